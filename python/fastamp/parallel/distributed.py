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
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from fastamp.handoff import GradStatsConsumer
from fastamp.parallel._args import (
    _NAME,
    BROADCAST_BUFFERS_DEFAULT,
    check_arguments,
    collective_error,
)
from fastamp.parallel._backward import GradSync
from fastamp.parallel._torch_compat import CallbackJoinHook, ReducerShim, TorchCompat
from fastamp.parallel.buckets import BucketLayout, GradBucket

__all__ = ["DistributedDataParallel", "GradBucket"]

_DEFAULT_BUCKET_MB = 25.0
_TorchDDP = torch.nn.parallel.DistributedDataParallel


class DistributedDataParallel(TorchCompat, _TorchDDP):
    """Mirrors :class:`torch.nn.parallel.DistributedDataParallel` (same arguments, same
    ``state_dict`` keys with the ``module.`` prefix); see the module docstring and docs/ddp.md.

    A subclass of torch's class without torch's reducer: ``isinstance(m, torch.nn.parallel.
    DistributedDataParallel)`` is true, ``m.reducer`` does not exist. The buckets are a
    :class:`fastamp.parallel.buckets.BucketLayout`; each iteration's synchronisation is a
    :class:`fastamp.parallel._backward.GradSync` (``self._sync``), whose hooks the parameters hold."""

    # set by torch's DDP methods this class calls: _assign_modules_buffers(), join()
    named_module_buffers: dict[str, Tensor]
    _join_config: Any

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = BROADCAST_BUFFERS_DEFAULT,
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
        lazy_bucket_allocation: bool = False,
    ) -> None:
        # Everything is validated before any state is set or any collective is issued.
        ignore, module_params, device_type, multi_device, device_ids_, output_device_ = check_arguments(
            module, device_ids, output_device, broadcast_buffers, process_group, bucket_cap_mb,
            check_reduction, delay_all_reduce_named_params, param_to_hook_all_reduce,
            mixed_precision, device_mesh, bucket_cap_mb_list, forward_sync_buffers,
            lazy_bucket_allocation,
        )  # fmt: skip
        nn.Module.__init__(self)
        Joinable.__init__(self)
        self.logger = None  # torch's C++ logger belongs to its reducer
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = bool(forward_sync_buffers)
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = (
                True if broadcast_buffers is None else bool(broadcast_buffers)
            )
            init_sync_buffers = self.forward_sync_buffers
        self.process_group = (
            device_mesh.get_group(mesh_dim=0)
            if device_mesh is not None
            else process_group
            if process_group is not None
            else dist.group.WORLD
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
        self.lazy_bucket_allocation = False  # torch 2.15's keyword: True is refused above
        self.mixed_precision = None
        self.broadcast_bucket_size = 250 * 1024 * 1024
        self.bucket_bytes_cap = int((bucket_cap_mb or _DEFAULT_BUCKET_MB) * 2**20)
        self._bucket_caps = (
            [int(c * 2**20) for c in bucket_cap_mb_list]
            if bucket_cap_mb_list
            else [self.bucket_bytes_cap]
        )
        self._custom_bucket_caps = bool(bucket_cap_mb_list)
        self._default_bucket_cap = bucket_cap_mb is None
        self.use_side_stream_for_tensor_copies = True
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._comm_hooks: list[
            tuple[Callable, object]
        ] = []  # torch's attribute: the registered hook
        self._assign_modules_buffers()  # torch's: self.modules_buffers, self.named_module_buffers

        named = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore
        ]
        params = [p for _, p in named]
        self._checked_same_model = False
        if init_sync:
            self._check_same_model()
            self._sync_initial_states(init_sync_buffers)

        layout = BucketLayout(
            params,
            caps=self._bucket_caps,
            custom_caps=self._custom_bucket_caps,
            default_cap=self._default_bucket_cap,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            views=self.gradient_as_bucket_view,
            process_group=self.process_group,
            world_size=self.world_size,
        )
        self._sync = GradSync(
            layout,
            {id(p): n for n, p in named},
            world_size=self.world_size,
            rank=self.rank,
            process_group=self.process_group,
            device=self.device,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            views=self.gradient_as_bucket_view,
        )
        self._sync.attach(params)
        # torch's reducer removes its hooks when it is destroyed; so does this wrapper.
        weakref.finalize(self, self._sync.detach)

    # ------------------------------------------------------------------ what torch's reducer was
    @property
    def reducer(self) -> ReducerShim:
        """Not torch's C++ reducer: the one call clients make on it, ``prepare_for_backward``
        (accelerate's ``trigger_sync_in_backward``), arms the next backward for synchronisation
        as torch's does; anything else raises AttributeError naming it."""
        return ReducerShim(self._sync.arm)

    # ------------------------------------------------------------------ construction
    def _describe(self) -> list[str]:
        desc = [
            f"{n}:{tuple(p.shape)}:{p.dtype}" + ("" if p.requires_grad else ":frozen")
            for n, p in self.module.named_parameters()
            if n not in self.parameters_to_ignore
        ]
        desc += [
            f"buffer {n}:{tuple(b.shape)}:{b.dtype}" for n, b in self.named_module_buffers.items()
        ]
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
                (
                    f"rank 0 has {a!r}, rank {r} has {b!r}"
                    for a, b in zip(ref_desc, other)
                    if a != b
                ),
                f"rank 0 has {len(ref_desc)} parameters and buffers ({ref_desc[len(other) :][:1]} "
                f"more), rank {r} has {len(other)} ({other[len(ref_desc) :][:1]} more)",
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

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            return self._post_forward(self.module(*inputs, **kwargs))

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        self._sync.check_previous_iteration()
        if self._join_config.enable:
            work = Join.notify_join_context(self)
            if work:
                self._sync.join_work = work
        if self._check_sync_bufs_pre_fwd():
            if not self._checked_same_model:  # init_sync=False: check before the first broadcast
                self._check_same_model()
            try:
                self._sync_buffers()  # torch's: rank 0 (or, under join, the last active rank)
            except Exception as e:
                raise collective_error("the broadcast of the module's buffers", self.rank, e) from e
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs

            moved, moved_kw = _to_kwargs(
                inputs,
                kwargs,
                torch.device(self.device_type, self.device_ids[0]),
                self.use_side_stream_for_tensor_copies,
            )
            return moved[0], moved_kw[0]
        return inputs, kwargs

    def _post_forward(self, output: Any) -> Any:
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        # torch: the next forward broadcasts buffers only if this one synchronises.
        self.require_forward_param_sync = synced
        if synced:
            self._sync.arm_forward(output)
        return output

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
        if self._sync.comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if self._sync.has_run():
            raise RuntimeError(
                "register_comm_hook: communication hook can only be registered before the first backward"
            )
        self._comm_hooks.append((hook, state))
        self._sync.comm_hook = (hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            "ALLREDUCE": default_hooks.allreduce_hook,
            "FP16_COMPRESS": default_hooks.fp16_compress_hook,
        }
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in hooks:
            raise ValueError(
                f"{_NAME}: unknown built-in comm hook {comm_hook_type!r}; expected ALLREDUCE or FP16_COMPRESS"
            )
        self.register_comm_hook(self.process_group, hooks[name])

    # ------------------------------------------------------------------ join (uneven inputs)
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """As torch's: a context manager in which ranks with fewer batches shadow the others'
        collectives until every rank is done (then the last rank to finish broadcasts the model)."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._sync.divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return CallbackJoinHook(self._join_main_hook, self._sync_final_model)

    def _join_main_hook(self) -> None:
        """A joined rank's share of one iteration of the others: the buffer sync, then (when they
        synchronise grads) every collective of their backward."""
        self._check_and_sync_module_buffers()  # torch's: common rank, then the broadcast
        should_sync = self._check_global_requires_backward_grad_sync(is_joined_rank=True)
        self.require_forward_param_sync = should_sync
        if should_sync:
            self._sync.shadow_backward()

    # ------------------------------------------------------------------ the scaler's statistics
    # torch >= 2.13 names the flag forward_sync_buffers and keeps broadcast_buffers as this
    # property; torch 2.11/2.12 read self.broadcast_buffers in their own methods (e.g.
    # will_sync_module_buffers): the property here serves both.
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

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
        self._sync.scaler = scaler

    def grad_stats(self) -> tuple[Tensor, Tensor] | None:
        """``(found_inf, sum of squares)`` of the all-reduced grads, computed by the unpack of the
        last backward (None with gradient_as_bucket_view, which has no unpack)."""
        return self._sync.grad_stats()

    # ------------------------------------------------------------------ the bucket layout
    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order (for tests and tuning)."""
        return self._sync.layout.sizes

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain data: which parameter (by index in ``module.parameters()``
        that require grad) goes in which bucket, and whether the one-time rebuild has happened.

        :func:`fastamp.save_training_state` stores it so that a resumed run sums the same grads
        in the same buckets as the run it continues (the clip norm is a sum of per-bucket partial
        sums: another layout rounds differently)."""
        return self._sync.layout.to_dict()

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Restores a layout from :meth:`bucket_layout` (validated before anything changes)."""
        if self._sync.pending:
            raise RuntimeError(
                "DistributedDataParallel.load_bucket_layout: cannot change buckets during backward"
            )
        self._sync.layout.load_dict(layout)

    # ------------------------------------------------------------------ module protocol
    def __getstate__(self):
        raise RuntimeError(f"{_NAME} cannot be pickled; save .module")

    def __setstate__(self, state):
        raise RuntimeError(f"{_NAME} cannot be unpickled; wrap the module again")
