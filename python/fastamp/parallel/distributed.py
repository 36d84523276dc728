"""``fastamp.parallel.DistributedDataParallel``: DDP with gradient buckets overlapped with backward,
on torch.distributed (NCCL on GPU, gloo on CPU; launched with torchrun).

What it does, as torch's DDP:

* at construction: checks that every rank holds the same parameters (names, shapes, dtypes) and
  says which one differs; broadcasts parameters and buffers from rank 0;
* in forward: broadcasts buffers from rank 0 (``broadcast_buffers=True``);
* in backward: each parameter's hook marks its grad ready; when the last grad of a bucket is
  ready the bucket is packed (one multi-tensor copy with the 1/world_size scale fused in, the
  ``fastamp::bucket_pack_`` op) and its all-reduce is started asynchronously, so communication
  overlaps the rest of the backward; at the end of backward every bucket is waited on and
  unpacked into the grads (``fastamp::bucket_unpack_``, fused with the inf/NaN check and the sum of
  squares that :class:`fastamp.GradScaler` can reuse: :meth:`grad_stats`);
* buckets follow the reverse parameter order at first and are rebuilt once, after the first
  iteration, from the order in which grads actually became ready;
* ``no_sync()`` accumulates locally; ``gradient_as_bucket_view=True`` makes the grads views into
  the buckets, so no pack/unpack copies and no memory beyond the grads themselves;
* ``find_unused_parameters=False`` and a parameter that got no grad: an error naming it.

The all-reduce itself is ``torch.distributed.all_reduce(async_op=True)``: the process group's C++
(c10d) implementation, reached through its existing binding.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.parallel import _ops  # noqa: F401  (fake kernels)

__all__ = ["DistributedDataParallel"]

_DEFAULT_BUCKET_MB = 25.0


class _Bucket:
    __slots__ = ("params", "offsets", "buffer", "pending", "work", "launched", "index")

    def __init__(self, params: list[nn.Parameter], index: int):
        self.params = params
        self.index = index
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)
        self.work = None
        self.launched = False

    def view_of(self, i: int) -> Tensor:
        p = self.params[i]
        return self.buffer.narrow(0, self.offsets[i], p.numel()).view(p.shape)


class DistributedDataParallel(nn.Module):
    """Mirrors :class:`torch.nn.parallel.DistributedDataParallel` (same arguments); see the module
    docstring for how it works. ``state_dict()`` keys carry the ``module.`` prefix, so checkpoints
    are interchangeable with torch's DDP."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fastamp.parallel.DistributedDataParallel: torch.distributed is not initialised; "
                "call torch.distributed.init_process_group() first (torchrun sets the environment)"
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                "fastamp.parallel.DistributedDataParallel: one device per process; got "
                f"device_ids={device_ids}"
            )
        if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
            or not 0 < bucket_cap_mb < float("inf")
        ):
            raise ValueError(
                "fastamp.parallel.DistributedDataParallel: bucket_cap_mb must be a positive, finite "
                f"number of megabytes (e.g. 25, PyTorch's default), got {bucket_cap_mb!r}"
            )
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int((bucket_cap_mb or _DEFAULT_BUCKET_MB) * 2**20)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.require_backward_grad_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._names = {id(p): n for n, p in named}
        self._check_same_model(named)
        self._sync_module_states()

        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        self._buckets: list[_Bucket] = []
        self._build_buckets(list(reversed(self._params)))
        self._ready_order: list[nn.Parameter] = []
        # Like torch: no rebuild when the graph may differ between iterations or ranks.
        self._rebuilt = find_unused_parameters
        self._next_launch = 0
        self._in_backward = False
        self._grad_ready: set[int] = set()
        self._stats: list[tuple[Tensor, Tensor]] = []
        self._scaler = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    # ------------------------------------------------------------------ construction
    def _check_same_model(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """All ranks must hold the same parameters: compare a digest, then name the difference."""
        desc = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named]
        digest = hashlib.sha256("\n".join(desc).encode()).hexdigest()
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (digest, desc), group=self.process_group)
        ref_digest, ref_desc = digests[0]
        for r, (d, other) in enumerate(digests):
            if d == ref_digest:
                continue
            diff = next(
                (f"rank 0 has {a!r}, rank {r} has {b!r}" for a, b in zip(ref_desc, other) if a != b),
                f"rank 0 has {len(ref_desc)} parameters, rank {r} has {len(other)}",
            )
            raise RuntimeError(
                "fastamp.parallel.DistributedDataParallel: the model differs across ranks "
                f"({diff}). Every rank must construct the same model before wrapping it."
            )

    def _sync_module_states(self) -> None:
        if self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data if isinstance(t, nn.Parameter) else t, src=self._global_src(), group=self.process_group)

    def _global_src(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not dist.group.WORLD else 0

    def _build_buckets(self, order: list[nn.Parameter], sizes: list[int] | None = None) -> None:
        """Contiguous buckets of at most bucket_cap bytes, one dtype and device each, in `order`
        (or exactly `sizes` parameters per bucket, when restoring a saved layout)."""
        old = self._buckets
        self._buckets, self._bucket_of = [], {}
        if sizes is not None:
            start = 0
            for n in sizes:
                self._add_bucket(order[start:start + n])
                start += n
        else:
            current: list[nn.Parameter] = []
            size = 0
            for p in order:
                nbytes = p.numel() * p.element_size()
                if current and (size + nbytes > self.bucket_bytes_cap or p.dtype != current[0].dtype or p.device != current[0].device):
                    self._add_bucket(current)
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                self._add_bucket(current)
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for b in self._buckets:
                    for i, p in enumerate(b.params):
                        view = b.view_of(i)
                        if p.grad is not None:
                            view.copy_(p.grad)
                        p.grad = view if p.grad is not None else None
        del old

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        b = _Bucket(params, len(self._buckets))
        self._buckets.append(b)
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = (b, i)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order (for tests and tuning)."""
        return [len(b.params) for b in self._buckets]

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.world_size > 1 and torch.is_grad_enabled():
            try:
                with torch.no_grad():
                    for buf in self.module.buffers():
                        dist.broadcast(buf, src=self._global_src(), group=self.process_group)
            except Exception as e:
                raise self._collective_error("the broadcast of the module's buffers", e) from e
        return self.module(*inputs, **kwargs)

    def _collective_error(self, what: str, e: Exception) -> RuntimeError:
        return RuntimeError(
            f"fastamp.parallel.DistributedDataParallel: {what} failed on rank {self.rank}: {e}. "
            "A peer rank has probably died or stalled past the process group's timeout "
            "(init_process_group(timeout=...)); check the other ranks' logs."
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Grads accumulate locally inside; the next backward outside all-reduces the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------ backward
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return
        if not self._in_backward:
            self._start_backward()
        key = id(p)
        if key in self._grad_ready:  # a param used twice in the graph fires once per use
            return
        self._grad_ready.add(key)
        if not self._rebuilt:
            self._ready_order.append(p)
        bucket, i = self._bucket_of[key]
        if self.gradient_as_bucket_view and p.grad is not None:
            # Divide by the world size now, while this grad is hot in cache (one pass; a pass over
            # the whole bucket at launch would read it back cold). If grads were set to None,
            # autograd made a fresh one: the same pass moves it into the bucket.
            view = bucket.view_of(i)
            with torch.no_grad():
                if p.grad.data_ptr() != view.data_ptr():
                    torch.mul(p.grad, 1.0 / self.world_size, out=view)
                    p.grad = view
                elif self.world_size > 1:
                    view.mul_(1.0 / self.world_size)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launches complete buckets strictly in bucket order. Collectives must be issued in the same
        order on every rank; buckets may complete in different orders on different ranks."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _start_backward(self) -> None:
        self._in_backward = True
        self._grad_ready = set()
        self._stats = []
        for b in self._buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self._next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else None for p in bucket.params]
            if self.gradient_as_bucket_view:
                # Each grad was divided by the world size in its hook.
                for i, g in enumerate(grads):
                    if g is None:  # unused parameter: contributes zeros
                        bucket.view_of(i).zero_()
            else:
                present = [(g, off) for g, off in zip(grads, bucket.offsets) if g is not None]
                if len(present) != len(grads):
                    bucket.buffer.zero_()
                if present:
                    torch.ops.fastamp.bucket_pack_(
                        bucket.buffer, [g.contiguous() for g, _ in present], [o for _, o in present],
                        1.0 / self.world_size,
                    )
            if self.world_size > 1:
                bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        bucket.launched = True

    def _finish_backward(self) -> None:
        try:
            unready = [p for p in self._params if id(p) not in self._grad_ready]
            if unready and not self.find_unused_parameters and not self.static_graph:
                names = ", ".join(self._names[id(p)] for p in unready[:10])
                more = f" and {len(unready) - 10} more" if len(unready) > 10 else ""
                raise RuntimeError(
                    "fastamp.parallel.DistributedDataParallel: these parameters received no "
                    f"gradient in this backward: {names}{more}. They were not used to compute "
                    "the loss. Pass find_unused_parameters=True, or make every parameter take "
                    "part in the loss (or set requires_grad=False on the unused ones)."
                )
            # Unused parameters (allowed): their buckets still need their all-reduce, with zeros.
            for p in unready:
                bucket, _ = self._bucket_of[id(p)]
                bucket.pending -= 1
            self._launch_ready()
            inv = None
            scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
            if scale is not None:
                inv = scale.double().reciprocal().float()
            for b in self._buckets:
                if b.work is not None:
                    try:
                        b.work.wait()
                    except Exception as e:
                        raise self._collective_error(f"the all-reduce of gradient bucket {b.index}", e) from e
                    finally:
                        b.work = None  # a finished Work keeps the process group alive
                if self.gradient_as_bucket_view:
                    continue
                with torch.no_grad():
                    grads, offs = [], []
                    for p, off in zip(b.params, b.offsets):
                        if p.grad is None:  # unused here but synced elsewhere: take the zeros
                            p.grad = torch.zeros_like(p)
                        grads.append(p.grad)
                        offs.append(off)
                    if inv is None or inv.device != b.buffer.device:
                        inv = torch.ones((), dtype=torch.float32, device=b.buffer.device)
                    self._stats.append(torch.ops.fastamp.bucket_unpack_(b.buffer, grads, offs, inv))
            if self._scaler is not None and self._stats:
                self._scaler._note_grad_stats(self._params, *self.grad_stats())
            if not self._rebuilt:
                self._rebuilt = True
                self._rebuild_from_rank0()
        finally:
            self._in_backward = False

    def register_grad_scaler(self, scaler: Any) -> None:
        """Hands the unpack's fused statistics to ``scaler`` (a :class:`fastamp.GradScaler`), whose
        ``clip_grad_norm_`` / inf check then skip their own read pass over the grads.

        The sum of squares is of the *unscaled* grads: the unpack multiplies by the scaler's
        inverse scale in registers (read on the device, no sync)."""
        self._scaler = scaler

    def _rebuild_from_rank0(self) -> None:
        """Rebuilds the buckets in the order grads became ready in the first iteration -- rank 0's
        order, broadcast, so that every rank builds the same buckets."""
        index = {id(p): i for i, p in enumerate(self._params)}
        seen = {id(p) for p in self._ready_order}
        order = [index[id(p)] for p in self._ready_order]
        order += [i for i in reversed(range(len(self._params))) if id(self._params[i]) not in seen]
        if self.world_size > 1:
            box = [order]
            dist.broadcast_object_list(box, src=self._global_src(), group=self.process_group)
            order = box[0]
        if order != [index[id(p)] for b in self._buckets for p in b.params]:
            self._build_buckets([self._params[i] for i in order])

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain data: which parameter (by index in ``module.parameters()``
        that require grad) goes in which bucket, and whether the one-time rebuild has happened.

        :func:`fastamp.save_training_state` stores it so that a resumed run sums the same grads
        in the same buckets as the run it continues (the clip norm is a sum of per-bucket partial
        sums: another layout rounds differently)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        return {
            "order": [index[id(p)] for b in self._buckets for p in b.params],
            "bucket_sizes": self.bucket_sizes,
            "rebuilt": bool(self._rebuilt),
            "num_params": len(self._params),
        }

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Restores a layout from :meth:`bucket_layout` (validated before anything changes)."""
        n = len(self._params)
        if not isinstance(layout, dict) or not {"order", "bucket_sizes", "rebuilt"} <= layout.keys():
            raise ValueError(
                "DistributedDataParallel.load_bucket_layout: layout must be the dict returned by "
                f"bucket_layout() (keys order, bucket_sizes, rebuilt); got {layout!r:.200}"
            )
        order, sizes = list(layout["order"]), list(layout["bucket_sizes"])
        if sorted(order) != list(range(n)) or sum(sizes) != n or any(s <= 0 for s in sizes):
            raise ValueError(
                "DistributedDataParallel.load_bucket_layout: the layout does not fit this model "
                f"({n} parameters that require grad; the layout orders {len(order)} in buckets of "
                f"{sizes}). Load a layout saved from the same model."
            )
        if self._in_backward:
            raise RuntimeError("DistributedDataParallel.load_bucket_layout: cannot change buckets during backward")
        params = [self._params[i] for i in order]
        start = 0
        for s in sizes:
            group = params[start:start + s]
            if any(p.dtype != group[0].dtype or p.device != group[0].device for p in group):
                raise ValueError(
                    "DistributedDataParallel.load_bucket_layout: a bucket would mix dtypes or "
                    "devices; the layout was saved from a different model"
                )
            start += s
        self._build_buckets(params, sizes)
        self._rebuilt = bool(layout["rebuilt"]) or self.find_unused_parameters
        self._ready_order = []

    def grad_stats(self) -> tuple[Tensor, Tensor] | None:
        """``(found_inf, sum of squares)`` of the all-reduced grads, computed by the unpack of the
        last backward (None with gradient_as_bucket_view, which has no unpack)."""
        if not self._stats:
            return None
        found = sum(f for f, _ in self._stats)
        sq = sum(s for _, s in self._stats)
        return found, sq

    # ------------------------------------------------------------------ module protocol
    def __getstate__(self):
        raise RuntimeError("fastamp.parallel.DistributedDataParallel cannot be pickled; save .module")
