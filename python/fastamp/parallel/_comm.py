"""fastamp's communication hook on torch's C++ reducer: each bucket's all-reduce (or the user's
hook) followed by one statistics pass over the reduced bucket, what :class:`fastamp.GradScaler`
reuses instead of reading the grads again.

torch's reducer packs each bucket and calls the registered hook with a
:class:`torch.distributed.GradBucket`; the hook returns a future of the reduced flat buffer, which
the reducer copies into the grads (or, with ``gradient_as_bucket_view``, which *is* the grads).
With any hook registered the reducer does not divide by the world size, so this hook does, before
the all-reduce, exactly as the reducer would without a hook (a copied grad times ``1 / world_size``,
a grad already in its bucket view divided in place: on the CPU the two round differently with 3
ranks): then the sum overflows and underflows exactly where torch's does (dividing after the sum
would overflow to inf for grads whose sum passes float32's maximum, and round differently below
its normal range). A user's hook (which averages itself) runs instead of the all-reduce. When the
future completes, ``bucket_divide_stats_`` (divisor 1: read only) measures the reduced bucket, one
span per grad (so the result is bit for bit ``grad_stats`` over that bucket's grads), times the
scaler's inverse scale.

At the end of the backward (after the reducer has copied the buckets out), :class:`BucketStats`
adds the buckets' measurements in bucket order and hands them to the registered scaler as a
:class:`fastamp.handoff.GradStats`, which records every grad's identity and write counter so
that the scaler reuses them only while the grads are exactly the ones measured.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.handoff import GradStats, GradStatsConsumer
from fastamp.parallel import _ops as parallel_ops
from fastamp.parallel._args import collective_error
from fastamp.scaler import ops as scaler_ops
from fastamp.scaler.clip import UNSCALED_STATS

if TYPE_CHECKING:
    # torch.distributed.GradBucket (torch.distributed imports it from here without re-exporting)
    from torch._C._distributed_c10d import GradBucket

    #: A comm hook: ``hook(state, bucket)`` returns the future of the reduced bucket buffer.
    CommHook = Callable[[Any, GradBucket], torch.futures.Future[Tensor]]

# Bound once: the statistics pass is the hook's own, not a pass of the scaler's.
_grad_stats = scaler_ops.grad_stats
_divide_stats = parallel_ops.bucket_divide_stats_
_BUCKET_OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _graph_task() -> int:
    """The id of the autograd graph task running on this thread (-1 outside a backward)."""
    # private-ok: autograd's current graph task has no public spelling; torch's own
    # checkpointing reads it the same way.
    return torch._C._current_graph_task_id()


def queue_callback(fn: Callable[[], None]) -> None:
    # private-ok: autograd's end-of-backward callback queue has no public spelling; torch's DDP
    # (static graph, join) and FSDP queue their own callbacks through it.
    torch.autograd.Variable._execution_engine.queue_callback(fn)


@dataclass(frozen=True)
class _Bucket:
    """One bucket of the reducer as the hook saw it: its buffer (address, size), each grad's
    length and flat view in it, and which parameters (indices into ``BucketStats.params``)."""

    addr: int
    numel: int
    lengths: list[int]
    views: tuple[Tensor, ...]
    members: list[int]


def _is_view(t: Tensor | None) -> bool:
    # private-ok: Tensor._is_view has no public spelling (autograd's view tracking).
    return t is not None and t._is_view()


class BucketStats:
    """The state of fastamp's comm hook (one per :class:`DistributedDataParallel`): the user's
    hook if one was registered, the divisor, the measurements of the backward in flight and the
    last complete one, and the bucket layout the reducer used."""

    def __init__(
        self,
        *,
        params: list[nn.Parameter],
        process_group: Any,
        world_size: int,
        views: bool,
        find_unused_parameters: bool,
        static_graph: bool,
        used_map: Callable[[], Tensor],
    ):
        self.params = params  # the parameters the reducer reduces, in its order
        self.index = {id(p): i for i, p in enumerate(params)}
        self.process_group = process_group
        self.world_size = world_size
        self.views = views  # gradient_as_bucket_view
        self.sparse_search = find_unused_parameters or static_graph
        self._used_map = used_map  # the reducer's map of (globally) used parameters
        self.user: tuple[CommHook, object] | None = None  # register_comm_hook's (hook, state)
        # Who the statistics go to: the scaler registered (register_grad_scaler), else the
        # scaler-free clip's inbox (fastamp.clip_grad_norm_ reuses them).
        self.scaler: GradStatsConsumer = UNSCALED_STATS
        self.divide_by_initial_world_size = True  # join()'s option
        # join: the all-reduce of "this rank synchronises" flags issued in the forward, whose sum
        # is the number of ranks still active (the divisor when divide_by_initial_world_size is
        # False, as torch's reducer takes it from its own join all-reduce).
        self.join_count: tuple[Any, Tensor] | None = None
        # views with a world size that is not a power of two: ids of the parameters whose grad
        # is its bucket view at the forward (the reducer would divide those in place, the others
        # on the copy; only there do the two round differently).
        self.aliased: set[int] | None = None  # (indices into params)
        # the measurement of the backward in flight
        self._task = -1
        self._inv: Tensor | None = None
        self._scale: Tensor | None = None
        self._measured: dict[int, tuple[Tensor, Tensor]] = {}
        self._spans: dict[int, _Bucket] = {}
        self._seen: dict[int, list[int]] = {}  # bucket index -> parameter indices (this backward)
        self.layout: list[list[int]] | None = None  # the last complete backward's buckets
        self.last: tuple[Tensor, Tensor] | None = None  # its (found_inf, sum of squares)

    # ------------------------------------------------------------------ the hook
    def __call__(self, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        task = _graph_task()
        measuring = task != -1  # a joined rank shadows the others' buckets outside any backward
        if measuring and task != self._task:
            self._begin(task)
        idx = bucket.index()
        buffer = bucket.buffer()
        if measuring:
            self._seen[idx] = self._made_of(idx, buffer, bucket).members
        if self.user is not None:
            hook, state = self.user
            fut = hook(state, bucket)
        else:
            if measuring:
                self._divide(bucket, buffer)
            fut = dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
        if not measuring:
            return fut.then(_first) if self.user is None else fut
        inv = self._inv
        return fut.then(lambda f: self._measure(idx, self._result(idx, f), inv))

    def _result(self, idx: int, fut: torch.futures.Future[Any]) -> Any:
        try:
            return fut.value()
        except Exception as e:
            raise collective_error(
                f"the all-reduce of gradient bucket {idx}", dist.get_rank(self.process_group), e
            ) from e

    def _begin(self, task: int) -> None:
        """The first bucket of a backward: the scale it is measured with, and the callback that
        hands the result over once the reducer has finished."""
        self._task = task
        self._measured = {}
        self._seen = {}
        self.last = None
        scale = self.scaler.current_scale()
        self._scale = scale
        self._inv = scale.reciprocal() if scale is not None else None  # 1/scale, one float32 op
        # The reducer queues its own finalisation (wait, copy out) after the last bucket's hook,
        # i.e. after this callback; queueing the hand-off from inside this callback puts it
        # after the reducer's.
        queue_callback(lambda: queue_callback(self._finish))

    def _divide(self, bucket: GradBucket, buffer: Tensor) -> None:
        """What torch's reducer does without a hook: the grads divided by the world size (join's
        count of active ranks with ``divide_by_initial_world_size=False``), before the all-reduce,
        so the sum overflows and underflows where torch's does. Costs one read and one write of
        the bucket that the reducer's copy-in would have folded in (it divides only with no hook
        registered)."""
        divisor = self.world_size
        if self.join_count is not None and not self.divide_by_initial_world_size:
            work, flags = self.join_count
            work.wait()
            divisor = int(flags.item())
        if divisor == 1:
            return
        if self.aliased is None:
            buffer.mul_(1.0 / divisor)  # = mul_out(view, grad, 1/divisor) of every grad
            return
        aliased = self.aliased
        laid = self._made_of(bucket.index(), buffer, bucket)
        for i, span in zip(laid.members, laid.views):
            if i in aliased:
                span.div_(divisor)
            else:
                span.mul_(1.0 / divisor)

    def _made_of(self, idx: int, buffer: Tensor, bucket: GradBucket) -> _Bucket:
        """Bucket ``idx`` as the reducer laid it out (cached while its buffer is the same: the
        reducer allocates new buffers when it rebuilds its buckets)."""
        cached = self._spans.get(idx)
        if cached is None or cached.addr != buffer.data_ptr() or cached.numel != buffer.numel():
            lengths = [g.numel() for g in bucket.gradients()]
            cached = _Bucket(
                addr=buffer.data_ptr(),
                numel=buffer.numel(),
                lengths=lengths,
                views=buffer.view(-1).split_with_sizes(lengths),
                members=[self.index[id(p)] for p in bucket.parameters()],
            )
            self._spans[idx] = cached
        return cached

    def _measure(self, idx: int, value: Any, inv: Tensor | None) -> Tensor:
        """The reduced bucket measured (runs when its future completes, before the reducer
        copies it out); returns the bucket."""
        out = _first_tensor(value)
        laid = self._spans.get(idx)
        flat = out.view(-1) if out.is_contiguous() else out.reshape(-1)
        lengths = laid.lengths if laid is not None else [flat.numel()]
        if sum(lengths) != flat.numel():
            raise RuntimeError(
                "fastamp.parallel.DistributedDataParallel: the comm hook's future for bucket "
                f"{idx} must hold {sum(lengths)} elements (the reduced bucket.buffer()), got "
                f"{tuple(out.shape)}"
            )
        if inv is None or inv.device != out.device:
            inv = torch.ones((), dtype=torch.float32, device=out.device)
        with torch.no_grad():
            if flat.dtype in _BUCKET_OP_DTYPES:
                found, sq = _divide_stats(flat, lengths, 1.0, inv)  # divisor 1: reads only
            else:  # float64 grads: the scaler's stats op takes them
                found, sq, _ = _grad_stats(list(flat.split_with_sizes(lengths)), inv, 2.0)
        self._measured[idx] = (found, sq)
        return out

    # ------------------------------------------------------------------ end of backward
    def _finish(self) -> None:
        """After the reducer's finalisation: the buckets' sums in bucket order, the layout, and
        the hand-off to the scaler (only where every reduced grad is one the sums describe)."""
        self._task = -1
        self.join_count = None
        measured, self._measured = self._measured, {}
        seen, self._seen = self._seen, {}
        if seen:
            self.layout = [seen[i] for i in sorted(seen)]
        if not measured or len(measured) != len(seen):
            return
        order = sorted(measured)
        found, sq = measured[order[0]]
        for i in order[1:]:
            f, q = measured[i]
            found, sq = found + f, sq + q
        if self.sparse_search:
            # A parameter no rank used keeps its grad untouched (torch), while its bucket slot
            # was reduced: the sums would describe another tensor. Only hand them over when every
            # parameter was used somewhere (the reducer's used map, all-reduced by now).
            if not bool(self._used_map().all()):
                return
        self.last = (found, sq)
        if self._scale is not None or self.scaler is UNSCALED_STATS:
            with_grad = [p for p in self.params if p.grad is not None]
            grads = [g for p in with_grad if (g := p.grad) is not None]
            self.scaler.note_grad_stats(
                GradStats.measured(found, sq, with_grad, grads, self._scale)
            )

    def note_forward(self) -> None:
        """A synchronised forward with bucket views and a world size that is not a power of two:
        which grads are their bucket views now (see :attr:`aliased`). The reducer makes every
        grad a view of its bucket (at construction, at its rebuild, after each backward); a grad
        that is not a view was assigned or accumulated out of place since."""
        self.aliased = {i for i, p in enumerate(self.params) if _is_view(p.grad)}

    def task_in_flight(self) -> bool:
        """A backward has started reducing buckets and not finished."""
        return self._task != -1

    def relaid(self, buckets: list[list[int]]) -> None:
        """The reducer was built again over ``buckets``: forget the old buffers."""
        self._spans = {}
        self.layout = [list(b) for b in buckets]


def _first(fut: torch.futures.Future[Any]) -> Tensor:
    return _first_tensor(fut.value())


def _first_tensor(value: Any) -> Tensor:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, Tensor):
        raise RuntimeError(
            "fastamp.parallel.DistributedDataParallel: the comm hook's future must hold one "
            f"tensor (the reduced bucket.buffer()), got {type(value).__name__}"
        )
    return value


def fastamp_comm_hook(state: BucketStats, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """The hook fastamp registers on torch's reducer (``state`` is the DDP's :class:`BucketStats`)."""
    return state(bucket)


def weak_used_map(ddp: Any) -> Callable[[], Tensor]:
    """The reducer's used-parameter map, read through a weak reference to the DDP."""
    ref = weakref.ref(ddp)

    def used() -> Tensor:
        m = ref()
        if m is None:
            return torch.ones(1, dtype=torch.int32)
        # private-ok: torch's DDP reads the reducer's map the same way (join).
        used_map: Tensor = m.reducer._get_local_used_map()
        return used_map

    return used
