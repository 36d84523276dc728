"""``fastamp.parallel.DistributedDataParallel``: torch's DDP, on torch's own C++ reducer, with
fastamp's communication hook (NCCL on GPU, gloo on CPU; launched with torchrun).

It *is* :class:`torch.nn.parallel.DistributedDataParallel` (a subclass whose constructor runs
torch's): torch's reducer buckets the grads, overlaps each bucket's all-reduce with the rest of
the backward, searches unused parameters, handles ``join()``, ``no_sync()`` and
``static_graph``, and copies the reduced buckets out. What fastamp adds is the hook torch's
reducer calls for every bucket (:mod:`fastamp.parallel._comm`): the all-reduce (or the user's
hook, see :meth:`register_comm_hook`) followed by one statistics pass over the reduced bucket,
``found_inf`` and the sum of squares, which :class:`fastamp.GradScaler` reuses instead of reading
the grads again (:meth:`register_grad_scaler`).

Where it is stricter than torch (it raises where torch would go on with replicas that differ):
the model (parameters *and* buffers) must be the same on every rank, and the error names the
first difference; a second backward over the graph of an already synchronised forward raises
(torch's reducer silently skips the all-reduce, so the ranks' grads differ).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.handoff import GradStatsConsumer
from fastamp.parallel._args import (
    _NAME,
    BROADCAST_BUFFERS_DEFAULT,
    TORCH_DDP_KEYWORDS,
    check_arguments,
    collective_error,
    refuse,
)
from fastamp.parallel._comm import BucketStats, fastamp_comm_hook, queue_callback, weak_used_map

__all__ = ["DistributedDataParallel", "GradBucket"]

#: The interface a comm hook's bucket argument has (torch's class: the hooks run on its reducer).
if TYPE_CHECKING:  # torch.distributed imports it from its C module without re-exporting it
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket
_TorchDDP = torch.nn.parallel.DistributedDataParallel


# private-ok: whether this backward runs a given autograd node; torch.autograd.graph's
# register_multi_grad_hook uses it, and it has no public spelling.
_will_execute = torch._C._will_engine_execute_node


def _call(method: weakref.WeakMethod[Callable[[], None]]) -> None:
    fn = method()
    if fn is not None:
        fn()


def _transport_error(e: BaseException) -> bool:
    """A collective failed underneath (a peer died or stalled), not one of torch's own checks:
    c10d's DistError, or gloo's transport error, which reaches Python as a RuntimeError."""
    return isinstance(e, dist.DistError) or "/gloo/transport/" in str(e)


def _describe(module: nn.Module, ignore: set[str]) -> list[str]:
    desc = [
        f"{n}:{tuple(p.shape)}:{p.dtype}" + ("" if p.requires_grad else ":frozen")
        for n, p in module.named_parameters()
        if n not in ignore
    ]
    desc += [
        f"buffer {n}:{tuple(b.shape)}:{b.dtype}"
        for n, b in module.named_buffers()
        if n not in ignore
    ]
    return desc


def _check_same_model(module: nn.Module, ignore: set[str], group: Any) -> None:
    """All ranks must hold the same parameters and buffers: compare a digest, then name the first
    difference. (torch compares parameter shapes only; a broadcast of buffers of different sizes
    aborts the process.)"""
    world = dist.get_world_size(group)
    if world == 1:
        return
    desc = _describe(module, ignore)
    digest = hashlib.sha256("\n".join(desc).encode()).hexdigest()
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, (digest, desc), group=group)
    ref_digest, ref_desc = digests[0]
    for r, (d, other) in enumerate(digests):
        if d == ref_digest:
            continue
        diff = next(
            (f"rank 0 has {a!r}, rank {r} has {b!r}" for a, b in zip(ref_desc, other) if a != b),
            f"rank 0 has {len(ref_desc)} parameters and buffers ({ref_desc[len(other) :][:1]} "
            f"more), rank {r} has {len(other)} ({other[len(ref_desc) :][:1]} more)",
        )
        raise RuntimeError(
            f"{_NAME}: the model differs across ranks ({diff}). Every rank must construct the "
            "same model (parameters and buffers) before wrapping it."
        )


class DistributedDataParallel(_TorchDDP):
    """Mirrors :class:`torch.nn.parallel.DistributedDataParallel` (same arguments, same
    ``state_dict`` keys with the ``module.`` prefix; torch's constructor runs and builds torch's
    reducer); see the module docstring and docs/ddp.md.

    ``self._bucket_stats`` (a :class:`fastamp.parallel._comm.BucketStats`) is the state of the
    comm hook registered on ``self.reducer``: the user's hook, the measurements, the layout."""

    # set by torch's constructor (super().__init__), read here
    module: nn.Module
    reducer: Any  # torch's C++ reducer (torch._C._distributed_c10d.Reducer)
    logger: Any  # torch's C++ DDP logger
    process_group: Any
    device: torch.device
    parameters_to_ignore: set[str]
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    require_backward_grad_sync: bool
    bucket_bytes_cap: int
    # torch's record of register_comm_hook calls
    _comm_hooks: list[tuple[Callable[..., Any], object]]

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
        # fastamp's refusals and checks first: nothing is set and no collective is issued
        # before an argument is known to be good.
        ignore = check_arguments(
            module, device_ids, output_device, broadcast_buffers, process_group, bucket_cap_mb,
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
            device_mesh, bucket_cap_mb_list, lazy_bucket_allocation,
        )  # fmt: skip
        group = (
            device_mesh.get_group(mesh_dim=0)
            if device_mesh is not None
            else process_group
            if process_group is not None
            else dist.group.WORLD
        )
        if init_sync:  # before torch's broadcasts, which abort on buffers of different sizes
            _check_same_model(module, ignore, group)
        given = dict(
            device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, init_sync=init_sync,
            process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
            device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list, batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers,
            lazy_bucket_allocation=lazy_bucket_allocation,
        )  # fmt: skip
        for k, v in given.items():  # keywords of a later torch than the one installed
            if k not in TORCH_DDP_KEYWORDS and v != _DEFAULTS[k]:
                raise refuse(
                    f"{k}={v!r}",
                    f"torch {torch.__version__}'s DistributedDataParallel has no {k} keyword, "
                    "and fastamp's DDP runs on torch's reducer. Leave it at its default, or "
                    "install a torch that has it.",
                )
        super().__init__(module, **{k: v for k, v in given.items() if k in TORCH_DDP_KEYWORDS})
        self._checked_same_model = bool(init_sync)
        params, _ = self._build_params_for_reducer()  # the reducer's parameters, in its order
        self._bucket_stats = BucketStats(
            params=params,
            process_group=self.process_group,
            world_size=dist.get_world_size(self.process_group),
            views=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            used_map=weak_used_map(self),
        )
        # Tells a second backward through a synchronised forward's output from the first.
        self._forward_tokens: list[list[int | None]] = []
        # The reduced parameters' grad accumulators (made at the first armed forward).
        self._accumulators: list[Any] | None = None
        # (torch.distributed imports it from its C module without re-exporting it)
        dist._register_comm_hook(  # type: ignore[attr-defined]
            self.reducer, self._bucket_stats, fastamp_comm_hook
        )

    # ------------------------------------------------------------------ forward
    def _post_forward(self, output: Any) -> Any:
        # (torch's DDP method is unannotated; untyped_calls_exclude does not reach super() calls)
        output = super()._post_forward(output)  # type: ignore[no-untyped-call]
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._arm_output(output)
            world = self._bucket_stats.world_size
            if self.gradient_as_bucket_view and world & (world - 1):
                self._bucket_stats.note_forward()
        return output

    def _arm_output(self, output: Any) -> None:
        """A prehook on the output's autograd nodes: the first backward through them takes the
        forward's token; another backward through them raises (torch's reducer would skip the
        all-reduce and leave the ranks with different grads)."""
        from torch.nn.parallel.distributed import _find_tensors

        token: list[int | None] = [None]
        check = weakref.WeakMethod(self._check_reduced)  # the graph must not keep self alive
        accumulators = self._grad_accumulators()

        def prehook(grads: Any, token: list[int | None] = token) -> None:
            # private-ok: autograd's current graph task has no public spelling.
            task = torch._C._current_graph_task_id()
            if token[0] == task:
                return
            # A pass that reaches no parameter (torch.autograd.grad of the output w.r.t. the
            # inputs: a gradient penalty) runs no reducer hook and synchronises nothing: it
            # neither takes the token nor is refused, as torch's DDP lets it run. (torch's
            # register_multi_grad_hook asks the engine the same question.)
            if not any(map(_will_execute, accumulators)):
                return
            if token[0] is None:
                token[0] = task
                # After everything the backward queues (the reducer's finalisation included).
                queue_callback(lambda: queue_callback(lambda: _call(check)))
            elif token[0] != task:
                raise RuntimeError(
                    f"{_NAME}: a second backward through the output of a forward whose "
                    "gradients were already synchronised. torch's DDP would skip the all-reduce "
                    "here and leave the ranks with different gradients; run a new forward for "
                    "each backward (or sum the losses and call backward once)."
                )

        for t in _find_tensors(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(prehook)

    def _grad_accumulators(self) -> list[Any]:
        """The autograd nodes that accumulate the reduced parameters' grads (the reducer's hooks
        sit on them), made once, as torch's reducer holds them."""
        accs = self._accumulators
        if accs is None:
            accs = []
            for p in self._bucket_stats.params:
                fn = p.view_as(p).grad_fn  # (made in a forward with grad enabled)
                if p.requires_grad and fn is not None:
                    accs.append(fn.next_functions[0][0])
            self._accumulators = accs
        return accs

    def _check_reduced(self) -> None:
        """End of a synchronised backward: every bucket was reduced, or raise now, naming the
        parameters that got no grad (torch's reducer would raise at the next forward)."""
        try:
            # private-ok: torch's DDP exposes this check as its own _check_reducer_finalized.
            self.reducer._check_reducer_finalized()
        except RuntimeError as e:
            names = dict((id(p), n) for n, p in self.module.named_parameters())
            unready = [names[id(p)] for p in self._bucket_stats.params if p.grad is None]
            if not unready:
                raise
            more = f" and {len(unready) - 10} more" if len(unready) > 10 else ""
            raise RuntimeError(
                f"{_NAME}: these parameters received no gradient in this backward: "
                f"{', '.join(unready[:10])}{more}. They were not used to compute the loss. Pass "
                "find_unused_parameters=True, or make every parameter take part in the loss (or "
                "set requires_grad=False on the unused ones). The ranks' reduction is incomplete: "
                "the next forward raises."
            ) from e

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            # (torch's DDP method is unannotated; untyped_calls_exclude does not reach super() calls)
            return super()._pre_forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
        except RuntimeError as e:  # the bucket rebuild's or the join's collectives
            if not _transport_error(e):
                raise  # the reducer's own checks, with torch's message
            raise collective_error(
                "a collective of the forward", dist.get_rank(self.process_group), e
            ) from e

    def _sync_buffers(self) -> None:
        if not self._checked_same_model:  # init_sync=False: check before the first broadcast
            _check_same_model(self.module, set(self.parameters_to_ignore), self.process_group)
            self._checked_same_model = True
        try:
            # (torch's DDP method is unannotated; untyped_calls_exclude does not reach super() calls)
            super()._sync_buffers()  # type: ignore[no-untyped-call]
        except Exception as e:
            raise collective_error(
                "the broadcast of the module's buffers", dist.get_rank(self.process_group), e
            ) from e

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> Any:
        """torch's (join: whether the ranks still active synchronise this iteration), keeping the
        flags' all-reduce on an active rank: their sum is the number of active ranks, the divisor
        of ``join(divide_by_initial_world_size=False)``."""
        flags = torch.ones(1, device=self.device)
        if is_joined_rank or not self.require_backward_grad_sync:
            flags.zero_()
        work = dist.all_reduce(flags, group=self.process_group, async_op=True)
        if is_joined_rank:
            work.wait()
            return flags.item() != 0
        self._bucket_stats.join_count = (work, flags)
        return None

    def join_hook(self, **kwargs: Any) -> Any:
        # (torch's DDP method is unannotated; untyped_calls_exclude does not reach super() calls)
        hook = super().join_hook(**kwargs)  # type: ignore[no-untyped-call]
        self._bucket_stats.divide_by_initial_world_size = bool(
            kwargs.get("divide_by_initial_world_size", True)
        )
        return hook

    # ------------------------------------------------------------------ comm hooks
    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """As torch's: ``hook(state, bucket) -> torch.futures.Future[Tensor]`` replaces the
        all-reduce of each bucket (``bucket`` is a :class:`torch.distributed.GradBucket`; its
        buffer holds the local, undivided grads). Once, before the first backward.

        fastamp's statistics pass then runs on the tensor the hook's future returns (what the
        reducer copies into the grads), with every hook: allreduce_hook, fp16/bf16_compress_hook,
        PowerSGD, a user's own."""
        self._check_comm_hook(hook)  # torch's checks (callable, annotations, bf16 support)
        stats = self._bucket_stats
        if stats.user is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if stats.layout is not None:
            raise RuntimeError(
                "register_comm_hook: communication hook can only be registered before the first backward"
            )
        if self.logger is not None:
            # private-ok: torch's register_comm_hook records the hook's name this way.
            self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        stats.user = (hook, state)

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

    # ------------------------------------------------------------------ the scaler's statistics
    def register_grad_scaler(self, scaler: Any) -> None:
        """Hands each backward's statistics (a :class:`fastamp.handoff.GradStats`) to ``scaler``
        (a :class:`fastamp.GradScaler`), whose ``clip_grad_norm_`` then skips its own read pass
        over the grads -- only while the grads are exactly the ones measured (see
        :meth:`fastamp.handoff.GradStats.current_for`).

        The sum of squares is of the *unscaled* grads: the hook multiplies by the scaler's
        inverse scale in registers (read on the device, no sync)."""
        if not isinstance(scaler, GradStatsConsumer):
            raise TypeError(
                f"{_NAME}.register_grad_scaler: expected a fastamp.GradScaler, got {type(scaler).__name__}"
            )
        self._bucket_stats.scaler = scaler

    def grad_stats(self) -> tuple[Tensor, Tensor] | None:
        """``(found_inf, sum of squares)`` of the all-reduced grads of the last backward, the
        buckets' sums added in bucket order; None before the first backward, and after one
        where a parameter no rank used kept a grad the sums do not describe."""
        return self._bucket_stats.last

    # ------------------------------------------------------------------ the bucket layout
    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order (for tests and tuning)."""
        return list(self.bucket_layout()["bucket_sizes"])

    def _current_layout(self) -> list[list[int]]:
        """The buckets of the last backward (the reducer's one-time rebuild happens in the forward
        after the first backward: between that forward and its backward this is the layout
        before it); before any backward, the reducer's own."""
        stats = self._bucket_stats
        if stats.layout is not None:
            return stats.layout
        # No backward yet: ask the reducer (zero-filled copies of its buckets, freed on return).
        index = stats.index
        # private-ok: torch's DDP asks its reducer for the buckets the same way (join).
        buckets = self.reducer._get_zeros_like_grad_buckets()
        return [[index[id(p)] for p in b.parameters()] for b in buckets]

    def bucket_layout(self) -> dict[str, Any]:
        """The reducer's bucket layout as plain data: which parameter (by index in the order the
        reducer takes them: ``module.parameters()`` that require grad) goes in which bucket, and
        whether torch's one-time rebuild has happened.

        :func:`fastamp.save_training_state` stores it so that a resumed run sums the same grads
        in the same buckets as the run it continues (the clip norm is a sum of per-bucket partial
        sums, and with 3+ ranks the all-reduce's summation order depends on an element's place
        in its bucket: another layout rounds differently)."""
        layout = self._current_layout()
        return {
            "order": [i for b in layout for i in b],
            "bucket_sizes": [len(b) for b in layout],
            "rebuilt": bool(self._has_rebuilt_buckets),
            "num_params": len(self._bucket_stats.params),
        }

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Restores a layout from :meth:`bucket_layout` (validated before anything changes): torch's
        reducer is built again over those buckets, as torch's constructor builds it (its one-time
        rebuild after the next backward, if the layout was rebuilt, lays them out the same)."""
        params = self._bucket_stats.params
        n = len(params)
        where = f"{_NAME}.load_bucket_layout"
        if (
            not isinstance(layout, dict)
            or not {"order", "bucket_sizes", "rebuilt"} <= layout.keys()
        ):
            raise ValueError(
                f"{where}: layout must be the dict returned by bucket_layout() (keys order, "
                f"bucket_sizes, rebuilt); got {layout!r:.200}"
            )
        order, sizes = list(layout["order"]), list(layout["bucket_sizes"])
        if sorted(order) != list(range(n)) or sum(sizes) != n or any(s <= 0 for s in sizes):
            raise ValueError(
                f"{where}: the layout does not fit this model ({n} parameters that require grad; "
                f"the layout orders {len(order)} in buckets of {sizes}). Load a layout saved from "
                "the same model."
            )
        buckets, start = [], 0
        for s in sizes:
            group = order[start : start + s]
            first = params[group[0]]
            if any(
                params[i].dtype != first.dtype or params[i].device != first.device for i in group
            ):
                raise ValueError(
                    f"{where}: a bucket would mix dtypes or devices; the layout was saved from a "
                    "different model"
                )
            buckets.append(group)
            start += s
        if self._bucket_stats.task_in_flight():
            raise RuntimeError(f"{where}: cannot change buckets during backward")
        if buckets == self._current_layout():
            self._has_rebuilt_buckets = bool(layout["rebuilt"])
            return
        self._rebuild_reducer(buckets, bool(layout["rebuilt"]))

    def _rebuild_reducer(self, buckets: list[list[int]], layout_rebuilt: bool) -> None:
        """torch's reducer built again (as torch's ``__setstate__`` builds it) over ``buckets``,
        with fastamp's hook registered on it."""
        params, expect_sparse = self._build_params_for_reducer()
        names = self._build_debug_param_to_name_mapping(params)
        limits = [self.bucket_bytes_cap] * len(buckets)
        # torch's constructor takes its bucket assignment from this function and reverses it
        # (buckets in backward order); handing it the reversed layout gives the layout.
        # private-ok: torch's DDP builds its reducer this way; there is no public spelling.
        # (the three type: ignores: torch.distributed imports it from its C module without
        # re-exporting it)
        assign = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]
        # private-ok: torch's reducer methods, called as torch's DDP calls them.
        self.reducer._remove_autograd_hooks()
        dist._compute_bucket_assignment_by_size = lambda *a, **k: (  # type: ignore[attr-defined]
            [list(b) for b in reversed(buckets)],
            list(reversed(limits)),
        )
        try:
            self._ddp_init_helper(params, expect_sparse, names, self.static_graph)
        finally:
            dist._compute_bucket_assignment_by_size = assign  # type: ignore[attr-defined]
        if self.static_graph:
            # private-ok: torch's _set_static_graph does the same on a new reducer.
            self.reducer._set_static_graph()
            if self.logger is not None:
                # private-ok: torch's _set_static_graph does the same on a new reducer.
                self.logger._set_static_graph()
        # (torch.distributed imports it from its C module without re-exporting it)
        dist._register_comm_hook(  # type: ignore[attr-defined]
            self.reducer, self._bucket_stats, fastamp_comm_hook
        )
        self._has_rebuilt_buckets = bool(layout_rebuilt)
        self._bucket_stats.relaid(buckets)

    # ------------------------------------------------------------------ module protocol
    def __getstate__(self) -> NoReturn:
        raise RuntimeError(f"{_NAME} cannot be pickled; save .module")

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(f"{_NAME} cannot be unpickled; wrap the module again")


_DEFAULTS = {
    n: p.default
    for n, p in __import__("inspect").signature(DistributedDataParallel.__init__).parameters.items()
    if n not in ("self", "module")
}
