"""The backward half of DistributedDataParallel (:class:`BackwardSync`): each grad's hook marks it
ready, a full bucket is packed and its all-reduce (or comm hook) started while backward goes on,
and at the end every bucket is waited on and unpacked into the grads, measuring them for the
scaler (:class:`fastamp.handoff.GradStats`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.handoff import GradStats, GradStatsConsumer
from fastamp.parallel import _ops
from fastamp.parallel._args import _NAME
from fastamp.parallel.buckets import Bucket, GradBucket



class BackwardSync:
    """Mixin of :class:`fastamp.parallel.DistributedDataParallel`: gradient synchronisation.

    Everything it reads of the DDP object is declared here (assigned in DDP's constructor, in
    distributed.py, or by torch's DDP, or a method of the BucketLayout mixin)."""

    # torch's DDP options, as DDP's constructor keeps them
    world_size: int
    device: torch.device
    process_group: Any
    static_graph: bool
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    # the parameters and their buckets (buckets.py lays them out)
    _params: list[nn.Parameter]
    _names: dict[int, str]
    _buckets: list[Bucket]
    _bucket_of: dict[int, tuple[Bucket, int]]
    _ready_order: list[nn.Parameter]
    _next_launch: int
    _rebuilt: bool
    _comm_hook: tuple[Any, object] | None
    # the iteration state machine (see DDP's constructor)
    _armed: bool
    _started: bool
    _pending: bool
    _tokens: list[list[bool]]
    _consuming: list[list[bool]]
    _grad_ready: set[int]
    _used: set[int]
    _global_unused: set[int] | None
    _last_global_used: set[int]
    _join_work: Any
    _divide: float | None
    _divide_by_initial_world_size: bool
    # what the unpack measured, and who takes it
    _stats: list[tuple[Tensor, Tensor]]
    _last_stats: GradStats | None
    _scaler: Any
    # methods of DistributedDataParallel (distributed.py) and BucketLayout (buckets.py)
    _collective_error: Callable[[str, Exception], RuntimeError]
    _rebuild_from_rank0: Callable[[], None]

    def _on_output_grad(self, token: list) -> None:
        if token[0]:
            raise RuntimeError(
                f"{_NAME}: a second backward through the output of a forward whose gradients "
                "were already synchronised. torch's DDP would skip the all-reduce here and leave "
                "the ranks with different gradients; run a new forward for each backward (or "
                "sum the losses and call backward once)."
            )
        if self._armed and not self._started:
            self._start_backward()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        key = id(p)
        if not self._started:
            if not self._armed:  # under no_sync (or no DDP forward): local accumulation
                self._used.add(key)
                return
            self._start_backward()
        self._pending = True
        if key in self._grad_ready:
            raise RuntimeError(
                f"{_NAME}: parameter {self._names[key]} got a gradient twice in one synchronised "
                "backward (torch: 'Expected to mark a variable ready only once'). It is used both "
                "inside and outside a reentrant checkpoint (use torch.utils.checkpoint with "
                "use_reentrant=False, or fastamp.checkpoint), or an earlier backward raised half "
                "way (its all-reduces are incomplete: recreate the wrapper)."
            )
        self._grad_ready.add(key)
        self._used.add(key)
        if not self._rebuilt:
            self._ready_order.append(p)
        bucket, i = self._bucket_of[key]
        if self.gradient_as_bucket_view and p.grad is not None:
            # Divide by the world size now, while this grad is hot in cache (one pass; a pass over
            # the whole bucket at launch would read it back cold). If grads were set to None,
            # autograd made a fresh one: the same pass moves it into the bucket. A comm hook gets
            # the grads undivided (it averages), as in torch.
            view = bucket.view_of(i)
            factor = self._pre_factor()
            with torch.no_grad():
                if p.grad.data_ptr() != view.data_ptr():
                    if factor != 1.0:
                        torch.mul(p.grad, factor, out=view)
                    else:
                        view.copy_(p.grad)
                    p.grad = view
                elif factor != 1.0:
                    view.mul_(factor)
        bucket.pending -= 1
        self._launch_ready()

    def _pre_factor(self) -> float:
        if self._comm_hook is not None:
            return 1.0
        if self._join_work is not None and not self._divide_by_initial_world_size:
            if self._divide is None:
                self._join_work.wait()
                self._divide = float(self._join_work.result()[0].item())
            return 1.0 / self._divide
        return 1.0 / self.world_size

    def _launch_ready(self) -> None:
        """Launches complete buckets strictly in bucket order. Collectives must be issued in the same
        order on every rank; buckets may complete in different orders on different ranks."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _start_backward(self) -> None:
        self._started = True
        self._armed = False
        self._consuming, self._tokens = self._tokens, []  # done when this backward finishes
        self._grad_ready = set()
        self._stats = []
        self._last_stats = None
        self._divide = None if (self._join_work is not None and not self._divide_by_initial_world_size) else float(self.world_size)
        for b in self._buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self._next_launch = 0
        # private-ok: autograd's end-of-backward callback queue has no public spelling; torch's
        # DDP (static graph, join) and FSDP queue their own callbacks through it.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch(self, bucket: Bucket) -> None:
        factor = self._pre_factor()
        with torch.no_grad():
            if self.gradient_as_bucket_view:
                for i, p in enumerate(bucket.params):
                    if id(p) in self._grad_ready:
                        continue  # divided (or moved) in its hook
                    view = bucket.view_of(i)
                    if p.grad is None:  # unused here: contributes zeros
                        view.zero_()
                    else:  # unused in this backward but holding a grad: torch reduces it
                        if p.grad.data_ptr() != view.data_ptr():
                            view.copy_(p.grad)
                        if factor != 1.0:
                            view.mul_(factor)
            else:
                present = [(p.grad, off) for p, off in zip(bucket.params, bucket.offsets) if p.grad is not None]
                if len(present) != len(bucket.params):
                    bucket.buffer.zero_()
                if present:
                    _ops.bucket_pack_(
                        bucket.buffer, [g.contiguous() for g, _ in present], [o for _, o in present], factor,
                    )
            if self._comm_hook is not None:
                hook, state = self._comm_hook
                gb = GradBucket(bucket.index, bucket.buffer, bucket.params, bucket.offsets,
                                bucket.index == len(self._buckets) - 1)
                bucket.work = hook(state, gb)
            elif self.world_size > 1:
                bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        bucket.launched = True

    def _wait(self, bucket: Bucket) -> Tensor:
        """Waits for the bucket's all-reduce (or comm hook future); returns the reduced tensor."""
        work, bucket.work = bucket.work, None  # a finished Work keeps the process group alive
        if work is None:
            return bucket.buffer
        try:
            if self._comm_hook is None:
                work.wait()
                return bucket.buffer
            out = work.wait()
        except Exception as e:
            raise self._collective_error(f"the all-reduce of gradient bucket {bucket.index}", e) from e
        if isinstance(out, (list, tuple)) and len(out) == 1:
            out = out[0]
        if not isinstance(out, Tensor) or out.numel() != bucket.numel or out.device != bucket.buffer.device:
            raise RuntimeError(
                f"{_NAME}: the comm hook's future for bucket {bucket.index} must hold one tensor of "
                f"{bucket.numel} elements on {bucket.buffer.device} (the reduced bucket.buffer()), got "
                f"{type(out).__name__}{tuple(out.shape) if isinstance(out, Tensor) else ''}"
            )
        return out.reshape(-1).to(bucket.buffer.dtype)

    def _finish_backward(self) -> None:
        unready = [p for p in self._params if id(p) not in self._grad_ready]
        if unready and not self.find_unused_parameters and not self.static_graph:
            names = ", ".join(self._names[id(p)] for p in unready[:10])
            more = f" and {len(unready) - 10} more" if len(unready) > 10 else ""
            raise RuntimeError(
                f"{_NAME}: these parameters received no gradient in this backward: {names}{more}. "
                "They were not used to compute the loss. Pass find_unused_parameters=True, or "
                "make every parameter take part in the loss (or set requires_grad=False on the "
                "unused ones)."
            )
        # Unused parameters (allowed): their buckets still need their all-reduce, with zeros.
        for p in unready:
            bucket, _ = self._bucket_of[id(p)]
            bucket.pending -= 1
        self._launch_ready()
        global_unused = self._reduce_used_map()
        scale = self._scaler.current_scale() if self._scaler is not None else None
        inv = scale.double().reciprocal().float() if scale is not None else None
        noted: list[tuple[Tensor, Tensor]] = []
        for b in self._buckets:
            reduced = self._wait(b)
            with torch.no_grad():
                if self.gradient_as_bucket_view:
                    if reduced.data_ptr() != b.buffer.data_ptr():
                        b.buffer.copy_(reduced)
                    for i, p in enumerate(b.params):
                        if id(p) not in global_unused and p.grad is None:
                            p.grad = b.view_of(i)
                    continue
                grads, offs = [], []
                for p, off in zip(b.params, b.offsets):
                    if id(p) in global_unused:
                        continue  # as torch: left as it was (None unless the user accumulated)
                    if p.grad is None:  # unused here but used elsewhere: takes the average
                        p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
                    grads.append(p.grad)
                    offs.append(off)
                if not grads:
                    continue
                if inv is None or inv.device != b.buffer.device:
                    inv = torch.ones((), dtype=torch.float32, device=b.buffer.device)
                self._stats.append(self._unpack(reduced, grads, offs, inv))
                noted.extend(zip((p for p in b.params if id(p) not in global_unused), grads))
        if noted and not self.gradient_as_bucket_view:
            found, sq = self.grad_stats()
            self._last_stats = GradStats.measured(
                found, sq, [p for p, _ in noted], [g for _, g in noted], scale
            )
            if self._scaler is not None and scale is not None:
                self._scaler.note_grad_stats(self._last_stats)
        if not self._rebuilt:
            self._rebuilt = True
            self._rebuild_from_rank0()
        self._used = set()
        self._join_work = None
        for token in self._consuming:
            token[0] = True
        self._consuming = []
        self._pending = False
        self._started = False

    @staticmethod
    def _unpack(reduced: Tensor, grads: list[Tensor], offs: list[int], inv: Tensor) -> tuple[Tensor, Tensor]:
        """Copies the reduced bucket into the grads; returns (found_inf, sum of (g * inv)^2).

        One fused op on every device (``fastamp::bucket_unpack_``: one read of the bucket). Its
        statistics are computed by the scaler's own stats kernel over the grads' chunks, so they
        are bit-identical to ``fastamp::grad_stats`` over these grads."""
        return _ops.bucket_unpack_(reduced, grads, offs, inv)

    def _reduce_used_map(self, joined: bool = False) -> set[int]:
        """ids of the parameters no rank used since the last synchronised backward (torch's
        globally unused parameters: their grads are not touched). A ``joined`` rank contributes
        the map of the last reduction it took part in, as torch's does (so a parameter the
        remaining ranks leave unused gets zeros, not None, when it was used in that one)."""
        if not (self.find_unused_parameters or self.static_graph):
            return set()
        if self.static_graph and self._global_unused is not None:
            return self._global_unused
        mine = self._last_global_used if joined else self._used
        used = torch.tensor([1 if id(p) in mine else 0 for p in self._params], dtype=torch.int32,
                            device=self.device)
        if self.world_size > 1:
            try:
                dist.all_reduce(used, group=self.process_group)
            except Exception as e:
                raise self._collective_error("the all-reduce of the used-parameter map", e) from e
        counts = used.tolist()
        unused = {id(p) for p, u in zip(self._params, counts) if u == 0}
        self._last_global_used = {id(p) for p, u in zip(self._params, counts) if u != 0}
        if self.static_graph:
            self._global_unused = unused
        return unused

    def _shadow_backward(self) -> None:
        """A joined rank's share of one backward of the others: zeros for every bucket, in order
        (through the comm hook if one is registered), the used map, the one-time rebuild."""
        with torch.no_grad():
            for b in self._buckets:
                if self._comm_hook is not None:
                    hook, state = self._comm_hook
                    zeros = torch.zeros_like(b.buffer)
                    gb = GradBucket(b.index, zeros, b.params, b.offsets, b.index == len(self._buckets) - 1)
                    b.work = hook(state, gb)
                else:
                    b.buffer.zero_()
                    b.work = dist.all_reduce(b.buffer, group=self.process_group, async_op=True)
            for b in self._buckets:
                self._wait(b)
        if self.find_unused_parameters or (self.static_graph and self._global_unused is None):
            self._used = set()
            self._reduce_used_map(joined=True)
        if not self._rebuilt:
            self._rebuilt = True
            self._rebuild_from_rank0()

    def register_grad_scaler(self, scaler: Any) -> None:
        """Hands the unpack's fused statistics (a :class:`fastamp.handoff.GradStats`) to ``scaler`` (a
        :class:`fastamp.GradScaler`), whose ``clip_grad_norm_`` then skips its own read pass over
        the grads -- only while the grads are exactly the ones measured (see
        :meth:`fastamp.handoff.GradStats.current_for`).

        The sum of squares is of the *unscaled* grads: the unpack multiplies by the scaler's
        inverse scale in registers (read on the device, no sync)."""
        if not isinstance(scaler, GradStatsConsumer):
            raise TypeError(
                f"{_NAME}.register_grad_scaler: expected a fastamp.GradScaler, got {type(scaler).__name__}"
            )
        self._scaler = scaler

    def grad_stats(self) -> tuple[Tensor, Tensor] | None:
        """``(found_inf, sum of squares)`` of the all-reduced grads, computed by the unpack of the
        last backward (None with gradient_as_bucket_view, which has no unpack)."""
        if not self._stats:
            return None
        found = sum(f for f, _ in self._stats)
        sq = sum(s for _, s in self._stats)
        return found, sq
