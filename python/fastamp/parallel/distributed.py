"""``fastamp.parallel.DistributedDataParallel``: DDP with gradient buckets overlapped with backward,
on torch.distributed (NCCL on GPU, gloo on CPU; launched with torchrun).

It *is a* :class:`torch.nn.parallel.DistributedDataParallel` (a subclass, so ``isinstance`` checks in
accelerate, transformers, Lightning and torch itself hold) that never builds torch's C++ reducer:
the bucketing is done here, in Python over two fused ops. Every keyword of torch's constructor is
accepted with torch's meaning or refused with an error naming it (see docs/ddp.md for the table).

What it does, as torch's DDP:

* at construction: checks that every rank holds the same parameters *and buffers* (names,
  shapes, dtypes; the error names the first difference) and broadcasts them from rank 0;
* in forward: broadcasts buffers from rank 0 when torch would (``broadcast_buffers`` /
  ``forward_sync_buffers``, not in the forward after a ``no_sync()`` one), moves inputs to
  ``device_ids[0]``, and arms the next backward for synchronisation (a forward under ``no_sync()``
  or with grad disabled does not, exactly like torch);
* in backward: each parameter's hook marks its grad ready; when the last grad of a bucket is
  ready the bucket is packed (one multi-tensor copy with the 1/world_size scale fused in, the
  ``fastamp::bucket_pack_`` op) and its all-reduce -- or the registered comm hook -- is started
  asynchronously, so communication overlaps the rest of the backward; at the end of backward
  every bucket is waited on and unpacked into the grads (``fastamp::bucket_unpack_``, fused with
  the inf/NaN check and the sum of squares that :class:`fastamp.GradScaler` can reuse);
* parameters unused on every rank keep ``grad=None`` (``find_unused_parameters=True`` or
  ``static_graph=True``); parameters unused on some ranks get the average;
* ``join()`` for uneven inputs, ``register_comm_hook`` with torch's hooks or a user's.

Where it is stricter than torch (it raises where torch would go on with replicas that differ):
an exception that aborts a backward half way makes the next forward raise (as torch does), and a
second backward over the graph of an already synchronised forward raises (torch silently skips
the all-reduce, so the ranks' grads differ).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from fastamp.handoff import GradStats, GradStatsConsumer
from fastamp.parallel import _ops

__all__ = ["DistributedDataParallel", "DDPGradStats", "GradBucket"]

_DEFAULT_BUCKET_MB = 25.0
_NAME = "fastamp.parallel.DistributedDataParallel"
_TorchDDP = torch.nn.parallel.DistributedDataParallel


def _refuse(arg: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{_NAME}: {arg} is not supported: {why}")


# The record DDP hands the scaler (kept under its old name too).
DDPGradStats = GradStats


class GradBucket:
    """The bucket a comm hook gets: the interface of :class:`torch.distributed.GradBucket`
    (``index``, ``buffer``, ``gradients``, ``parameters``, ``is_last``, ``set_buffer``).

    ``buffer()`` holds the local grads of the bucket's parameters, flattened, *not* divided by the
    world size (as in torch: the hook averages)."""

    def __init__(self, index: int, buffer: Tensor, params: list[Tensor], offsets: list[int], last: bool):
        self._index, self._buffer, self._params, self._offsets, self._last = index, buffer, params, offsets, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[Tensor]:
        return [self._buffer.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(self._params, self._offsets)]

    def parameters(self) -> list[Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


class _Bucket:
    __slots__ = ("params", "offsets", "buffer", "pending", "work", "launched", "index", "numel")

    def __init__(self, params: list[nn.Parameter], index: int):
        self.params = params
        self.index = index
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)
        self.work = None
        self.launched = False

    def view_of(self, i: int) -> Tensor:
        p = self.params[i]
        return self.buffer.narrow(0, self.offsets[i], p.numel()).view(p.shape)


class _ReducerShim:
    __slots__ = ("_ddp",)

    def __init__(self, ddp: DistributedDataParallel):
        self._ddp = ddp

    def prepare_for_backward(self, outputs: Any = None) -> None:
        self._ddp._armed = True

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{_NAME} has no torch C++ reducer (it buckets gradients itself): reducer.{name} does "
            "not exist; use the wrapper's public methods (no_sync, join, register_comm_hook, ...)"
        )


class _JoinHook(JoinHook):
    """Shadows, on a rank that ran out of inputs, every collective one iteration of the others
    issues (the same ones in the same order as their forward and backward)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._check_and_sync_module_buffers()  # torch's: common rank, then the broadcast
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp._shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class DistributedDataParallel(_TorchDDP):
    """Mirrors :class:`torch.nn.parallel.DistributedDataParallel` (same arguments, same
    ``state_dict`` keys with the ``module.`` prefix); see the module docstring and docs/ddp.md.

    A subclass of torch's class without torch's reducer: ``isinstance(m, torch.nn.parallel.
    DistributedDataParallel)`` is true, ``m.reducer`` does not exist."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        # Everything is validated before any state is set or any collective is issued.
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{_NAME}: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (torchrun sets the environment)"
            )
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
            )
        if delay_all_reduce_named_params is not None:
            raise _refuse(
                "delay_all_reduce_named_params / param_to_hook_all_reduce",
                "fastamp launches each bucket's all-reduce as soon as its grads are ready and has "
                "no delayed group (torch uses it to compose DDP with tensor parallelism). Leave "
                "them unset, or use torch.nn.parallel.DistributedDataParallel for that model.",
            )
        if mixed_precision is not None:
            raise _refuse(
                "mixed_precision",
                "torch's experimental _MixedPrecision keeps low-precision parameter copies inside "
                "DDP. With fastamp use torch.autocast + fastamp.GradScaler (and, to halve the "
                "all-reduce bytes, register_comm_hook(None, fp16_compress_hook)).",
            )
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            if device_mesh._get_root_mesh() != device_mesh:
                raise _refuse(
                    "device_mesh (a mesh sliced from a larger one)",
                    "DDP composed with tensor parallelism (DTensor parameters) needs torch's "
                    "reducer; pass a 1-D mesh of the data-parallel ranks, or use torch's DDP.",
                )
        if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
            or not 0 < bucket_cap_mb < float("inf")
        ):
            raise ValueError(
                f"{_NAME}: bucket_cap_mb must be a positive, finite number of megabytes (e.g. 25, "
                f"PyTorch's default), got {bucket_cap_mb!r}"
            )
        if bucket_cap_mb_list is not None:
            caps = list(bucket_cap_mb_list)
            if not caps or any(
                isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf") for c in caps
            ):
                raise ValueError(
                    f"{_NAME}: bucket_cap_mb_list must be a non-empty list of positive, finite "
                    f"megabytes (one cap per bucket, the last one repeating), got {bucket_cap_mb_list!r}"
                )
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        module_params = [p for n, p in module.named_parameters() if n not in ignore]
        if not any(p.requires_grad for p in module_params):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter "
                "that requires a gradient."
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                "device_ids can only be None or contain a single element (one device per process); "
                f"got device_ids={list(device_ids)}"
            )
        device_types = {p.device.type for p in module_params}
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but "
                f"input module parameters locate in {device_types}."
            )
        device_type = next(iter(device_types))
        multi_device = len({p.device for p in module_params}) > 1
        if not device_ids or device_type == "cpu" or multi_device:
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters "
                    f"{ {p.device for p in module_params} }."
                )
            device_ids_, output_device_ = None, None
        else:
            from torch._utils import _get_device_index

            device_ids_ = [_get_device_index(x, True) for x in device_ids]
            output_device_ = _get_device_index(output_device if output_device is not None else device_ids[0], True)
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
                raise _refuse(
                    f"sparse gradients ({name or 'module'} is an {type(sub).__name__} with sparse=True)",
                    "the gradient buckets are dense; construct it with sparse=False, or use torch's DDP",
                )
        for p in module_params:
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                    "Run a dummy forward pass to correctly initialize the modules"
                )
        # torch's deprecations, with torch's warnings.
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                warnings.warn(
                    "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                    "`broadcast_buffers` is deprecated and its value is ignored when "
                    "`forward_sync_buffers` is provided.",
                    FutureWarning,
                    stacklevel=2,
                )
            else:
                warnings.warn(
                    "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                    "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
                    "syncs buffers at init.",
                    FutureWarning,
                    stacklevel=2,
                )
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                "Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )

        nn.Module.__init__(self)
        Joinable.__init__(self)
        self.logger = None  # torch's C++ logger belongs to its reducer
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = bool(forward_sync_buffers)
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = self.forward_sync_buffers
        self.process_group = (
            device_mesh.get_group(mesh_dim=0) if device_mesh is not None
            else process_group if process_group is not None else dist.group.WORLD
        )
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.module = module
        self.device_ids = device_ids_
        self.output_device = output_device_
        self.dim = dim
        self.device_type = device_type
        self.is_multi_device_module = multi_device
        self.device = module_params[0].device
        self.parameters_to_ignore = ignore
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.batched_grad_copy = bool(batched_grad_copy)
        self.mixed_precision = None
        self.broadcast_bucket_size = 250 * 1024 * 1024
        self.bucket_bytes_cap = int((bucket_cap_mb or _DEFAULT_BUCKET_MB) * 2**20)
        self._bucket_caps = (
            [int(c * 2**20) for c in bucket_cap_mb_list] if bucket_cap_mb_list else [self.bucket_bytes_cap]
        )
        self.use_side_stream_for_tensor_copies = True
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._comm_hooks: list[tuple[Callable, object]] = []
        self._comm_hook: tuple[Callable, object] | None = None
        self._assign_modules_buffers()  # torch's: self.modules_buffers, self.named_module_buffers

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
        self._params = [p for _, p in named]
        self._names = {id(p): n for n, p in named}
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._checked_same_model = False
        if init_sync:
            self._check_same_model()
            self._sync_initial_states(init_sync_buffers)

        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        self._buckets: list[_Bucket] = []
        self._build_buckets(list(reversed(self._params)))
        self._ready_order: list[nn.Parameter] = []
        # Like torch: no rebuild when the graph may differ between iterations or ranks.
        self._rebuilt = self.find_unused_parameters
        self._next_launch = 0
        # The iteration state machine: a synchronised forward arms the next backward; its first
        # hook starts it (_pending); the end-of-backward callback finishes it.
        self._armed = False
        self._started = False  # the end-of-backward callback is queued
        self._pending = False  # a grad hook fired: collectives may be in flight
        self._tokens: list[list[bool]] = []  # one per armed forward, set once its backward ran
        self._consuming: list[list[bool]] = []
        self._grad_ready: set[int] = set()
        self._used: set[int] = set()  # locally used since the last synchronised backward
        self._global_unused: set[int] | None = None  # static_graph: from the first iteration
        self._join_work = None
        self._divide = float(self.world_size)
        self._stats: list[tuple[Tensor, Tensor]] = []
        self._last_stats: DDPGradStats | None = None
        self._scaler = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    # ------------------------------------------------------------------ what torch's reducer was
    @property
    def reducer(self) -> _ReducerShim:
        """Not torch's C++ reducer: the one call clients make on it, ``prepare_for_backward``
        (accelerate's ``trigger_sync_in_backward``), arms the next backward for synchronisation
        as torch's does; anything else raises AttributeError naming it."""
        return _ReducerShim(self)

    # ------------------------------------------------------------------ construction
    def _describe(self) -> list[str]:
        desc = [f"{n}:{tuple(p.shape)}:{p.dtype}" + ("" if p.requires_grad else ":frozen")
                for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        desc += [f"buffer {n}:{tuple(b.shape)}:{b.dtype}" for n, b in self.named_module_buffers.items()]
        return desc

    def _check_same_model(self) -> None:
        """All ranks must hold the same parameters and buffers: compare a digest, then name the
        first difference. (A broadcast of tensors of different sizes aborts the process.)"""
        self._checked_same_model = True
        if self.world_size == 1:
            return
        desc = self._describe()
        digest = hashlib.sha256("\n".join(desc).encode()).hexdigest()
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (digest, desc), group=self.process_group)
        ref_digest, ref_desc = digests[0]
        for r, (d, other) in enumerate(digests):
            if d == ref_digest:
                continue
            diff = next(
                (f"rank 0 has {a!r}, rank {r} has {b!r}" for a, b in zip(ref_desc, other) if a != b),
                f"rank 0 has {len(ref_desc)} parameters and buffers ({ref_desc[len(other):][:1]} "
                f"more), rank {r} has {len(other)} ({other[len(ref_desc):][:1]} more)",
            )
            raise RuntimeError(
                f"{_NAME}: the model differs across ranks ({diff}). Every rank must construct the "
                "same model (parameters and buffers) before wrapping it."
            )

    def _sync_initial_states(self, buffers: bool) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.utils import _sync_module_states

        _sync_module_states(
            module=self.module,
            process_group=self.process_group,
            broadcast_bucket_size=self.broadcast_bucket_size,
            src=0,
            params_and_buffers_to_ignore=self.parameters_to_ignore,
            broadcast_buffers=buffers,
        )

    def _global_src(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not dist.group.WORLD else 0

    def _cap(self, i: int) -> int:
        return self._bucket_caps[min(i, len(self._bucket_caps) - 1)]

    def _build_buckets(self, order: list[nn.Parameter], sizes: list[int] | None = None) -> None:
        """Contiguous buckets of at most the cap in bytes (bucket_cap_mb, or bucket_cap_mb_list[i]
        for bucket i), one dtype and device each, in `order` (or exactly `sizes` parameters per
        bucket, when restoring a saved layout)."""
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
                if current and (size + nbytes > self._cap(len(self._buckets)) or p.dtype != current[0].dtype
                                or p.device != current[0].device):
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
                        if p.grad is not None:
                            view = b.view_of(i)
                            view.copy_(p.grad)
                            p.grad = view
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
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            return self._post_forward(self.module(*inputs, **kwargs))

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        self._check_previous_iteration()
        if self._join_config.enable:
            work = Join.notify_join_context(self)
            if work:
                self._join_work = work
        if self._check_sync_bufs_pre_fwd():
            if not self._checked_same_model:  # init_sync=False: check before the first broadcast
                self._check_same_model()
            try:
                self._sync_buffers()  # torch's: rank 0 (or, under join, the last active rank)
            except Exception as e:
                raise self._collective_error("the broadcast of the module's buffers", e) from e
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs

            moved, moved_kw = _to_kwargs(inputs, kwargs, torch.device(self.device_type, self.device_ids[0]),
                                         self.use_side_stream_for_tensor_copies)
            return moved[0], moved_kw[0]
        return inputs, kwargs

    def _post_forward(self, output: Any) -> Any:
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        # torch: the next forward broadcasts buffers only if this one synchronises.
        self.require_forward_param_sync = synced
        if synced:
            self._armed = True
            # The end-of-backward callback goes on the graph task that reaches this output: the
            # outermost backward, even when the first grad hook fires in a reentrant one. The
            # token tells a second backward through this output (retain_graph) from the first.
            from torch.nn.parallel.distributed import _find_tensors

            token = [False]
            self._tokens.append(token)
            del self._tokens[:-64]  # forwards with no backward (grad-enabled evaluation) add up
            ref = weakref.ref(self)

            def prehook(grads: Any, ref: Any = ref, token: list = token) -> None:
                ddp = ref()
                if ddp is not None:
                    ddp._on_output_grad(token)

            for t in _find_tensors(output):
                if t.grad_fn is not None:
                    t.grad_fn.register_prehook(prehook)
        return output

    def _check_previous_iteration(self) -> None:
        if self._pending:
            raise RuntimeError(
                f"{_NAME}: Expected to have finished reduction in the prior iteration before "
                "starting a new one. The previous backward started synchronising gradients but "
                "did not finish (an exception was raised inside it, or some parameters did not "
                "get a gradient); the ranks' gradients are no longer in step. Recreate the model "
                "wrapper (and the process group if a peer is stuck) instead of continuing."
            )
        # A backward that raised before any grad hook fired launched nothing: nothing to undo.
        self._started = False

    def _collective_error(self, what: str, e: Exception) -> RuntimeError:
        return RuntimeError(
            f"{_NAME}: {what} failed on rank {self.rank}: {e}. "
            "A peer rank has probably died or stalled past the process group's timeout "
            "(init_process_group(timeout=...)); check the other ranks' logs."
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Grads accumulate locally inside (include the forward); the next synchronised backward
        all-reduces the sum. As torch: no buffer broadcast in the forward after a no_sync one."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------ backward
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
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch(self, bucket: _Bucket) -> None:
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

    def _wait(self, bucket: _Bucket) -> Tensor:
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
                self._stats.append(self._unpack(b, reduced, grads, offs, inv))
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
    def _unpack(b: _Bucket, reduced: Tensor, grads: list[Tensor], offs: list[int], inv: Tensor) -> tuple[Tensor, Tensor]:
        """Copies the reduced bucket into the grads; returns (found_inf, sum of (g * inv)^2).

        One fused op on every device (``fastamp::bucket_unpack_``: one read of the bucket). Its
        statistics are computed by the scaler's own stats kernel over the grads' chunks, so they
        are bit-identical to ``fastamp::grad_stats`` over these grads. (On CPU the fused op now
        runs the AVX2 stats kernel: 0.92 ms against 1.43 ms for a copy + grad_stats of a 26 MB
        bucket on the 2-core CI machine.)"""
        del b
        return _ops.bucket_unpack_(reduced, grads, offs, inv)

    def _reduce_used_map(self) -> set[int]:
        """ids of the parameters no rank used since the last synchronised backward (torch's
        globally unused parameters: their grads are not touched)."""
        if not (self.find_unused_parameters or self.static_graph):
            return set()
        if self.static_graph and self._global_unused is not None:
            return self._global_unused
        used = torch.tensor([1 if id(p) in self._used else 0 for p in self._params], dtype=torch.int32,
                            device=self.device)
        if self.world_size > 1:
            try:
                dist.all_reduce(used, group=self.process_group)
            except Exception as e:
                raise self._collective_error("the all-reduce of the used-parameter map", e) from e
        unused = {id(p) for p, u in zip(self._params, used.tolist()) if u == 0}
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
            self._reduce_used_map()
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

    # ------------------------------------------------------------------ comm hooks
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """As torch's: ``hook(state, bucket) -> torch.futures.Future[Tensor]`` replaces the
        all-reduce of each bucket (``bucket`` has the :class:`torch.distributed.GradBucket`
        interface; its buffer holds the local, undivided grads). Once, before the first backward.

        Statistics: the unpack still reads whatever tensor the hook's future returns, so
        :meth:`grad_stats` and the scaler's reuse work with every hook (allreduce_hook,
        fp16_compress_hook, bf16_compress_hook, user hooks); with ``gradient_as_bucket_view=True``
        there is no unpack and no statistics, hook or not."""
        self._check_comm_hook(hook)  # torch's checks (callable, annotations, bf16 support)
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._pending or any(b.launched for b in self._buckets):
            raise RuntimeError(
                "register_comm_hook: communication hook can only be registered before the first backward"
            )
        self._comm_hooks.append((hook, state))
        self._comm_hook = (hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in hooks:
            raise ValueError(f"{_NAME}: unknown built-in comm hook {comm_hook_type!r}; expected ALLREDUCE or FP16_COMPRESS")
        self.register_comm_hook(self.process_group, hooks[name])

    # ------------------------------------------------------------------ join (uneven inputs)
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """As torch's: a context manager in which ranks with fewer batches shadow the others'
        collectives until every rank is done (then the last rank to finish broadcasts the model)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    # ------------------------------------------------------------------ torch methods without a meaning here
    def _check_reducer_finalized(self) -> None:
        if self._pending or self._started:
            raise RuntimeError(f"{_NAME}: the last backward has not finished synchronising gradients")

    def _set_static_graph(self) -> None:
        if any(b.launched for b in self._buckets):
            raise RuntimeError("_set_static_graph: static graph can only be set before the first iteration")
        self.static_graph = True

    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("_register_fused_optim", "use fastamp.optim's fused optimizers after backward")

    def _register_buffer_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("_register_buffer_comm_hook", "buffers are broadcast from rank 0 as with torch's default")

    def _set_sparse_metadata(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("_set_sparse_metadata", "sparse gradients are not supported")

    def _update_process_group(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("_update_process_group", "wrap the module again with the new process group")

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        return {"bucket_sizes": ", ".join(str(b.numel * b.buffer.element_size()) for b in self._buckets),
                "has_rebuilt_buckets": int(self._rebuilt), "world_size": self.world_size,
                "find_unused_parameters": int(self.find_unused_parameters),
                "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
                "static_graph": int(self.static_graph), "backend_name": dist.get_backend(self.process_group)}

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")

    def _set_ddp_sink_clone(self, val: bool) -> None:
        return None

    # ------------------------------------------------------------------ bucket layout (resume)
    def _rebuild_from_rank0(self) -> None:
        """Rebuilds the buckets in the order grads became ready in the first iteration -- rank 0's
        order, broadcast, so that every rank builds the same buckets."""
        seen = {id(p) for p in self._ready_order}
        order = [self._index[id(p)] for p in self._ready_order]
        order += [i for i in reversed(range(len(self._params))) if id(self._params[i]) not in seen]
        if self.world_size > 1:
            box = [order]
            dist.broadcast_object_list(box, src=self._global_src(), group=self.process_group)
            order = box[0]
        self._ready_order = []
        if order != [self._index[id(p)] for b in self._buckets for p in b.params]:
            self._build_buckets([self._params[i] for i in order])

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain data: which parameter (by index in ``module.parameters()``
        that require grad) goes in which bucket, and whether the one-time rebuild has happened.

        :func:`fastamp.save_training_state` stores it so that a resumed run sums the same grads
        in the same buckets as the run it continues (the clip norm is a sum of per-bucket partial
        sums: another layout rounds differently)."""
        return {
            "order": [self._index[id(p)] for b in self._buckets for p in b.params],
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
        if self._pending:
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
        raise RuntimeError(f"{_NAME} cannot be pickled; save .module")

    def __setstate__(self, state):
        raise RuntimeError(f"{_NAME} cannot be unpickled; wrap the module again")
