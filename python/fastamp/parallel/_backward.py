"""The backward half of DistributedDataParallel: :class:`GradSync`, the object that owns one
iteration's synchronisation. A synchronised forward arms it; each grad's hook marks the grad
ready; a full bucket is packed and its all-reduce (or comm hook) started while backward goes on;
at the end every bucket is waited on and unpacked into the grads, measuring them for the scaler
(:class:`fastamp.handoff.GradStats`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.handoff import GradStats, GradStatsConsumer
from fastamp.parallel import _ops
from fastamp.parallel._args import _NAME, collective_error
from fastamp.parallel.buckets import Bucket, BucketLayout


def _no_grad() -> Any:
    """A no_grad guard where grad mode is on (create_graph); nothing otherwise (the usual case:
    the guard costs more than the small ops it would wrap)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


class GradSync:
    """Gradient synchronisation of one DistributedDataParallel over ``layout``'s buckets.

    The iteration's state machine: :meth:`arm` (a synchronised forward) arms the next backward;
    the first grad hook (or the output's grad) starts it (``started``; ``pending`` once a grad
    hook fired: collectives may be in flight); autograd's end-of-backward callback finishes it.
    Grads of an unarmed backward (under ``no_sync``) only accumulate locally."""

    def __init__(
        self,
        layout: BucketLayout,
        names: dict[int, str],
        *,
        world_size: int,
        rank: int,
        process_group: Any,
        device: torch.device,
        find_unused_parameters: bool,
        static_graph: bool,
        views: bool,
    ):
        self.layout = layout
        self.names = names
        self.world_size = world_size
        self.rank = rank
        self.process_group = process_group
        self.device = device
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.views = views  # gradient_as_bucket_view
        self.comm_hook: tuple[Callable, object] | None = None
        self.scaler: GradStatsConsumer | None = None
        self.divide_by_initial_world_size = True  # join()'s option
        self.join_work: Any = None  # join's count of active ranks, in flight (set per forward)
        self.armed = False
        self.started = False  # the end-of-backward callback is queued
        self.pending = False  # a grad hook fired: collectives may be in flight
        self._tokens: list[list[bool]] = []  # one per armed forward, set once its backward ran
        self._consuming: list[list[bool]] = []
        self._grad_ready: set[int] = set()
        self._used: set[int] = set()  # locally used since the last synchronised backward
        self._global_unused: set[int] | None = None  # static_graph: from the first iteration
        # ids used on some rank in the last used-map all-reduce this rank took part in: what a
        # joined rank contributes to the others' (torch's reducer all-reduces its used map in
        # place, and a joined rank sends that last result again).
        self._last_global_used: set[int] = set()
        # What grads are divided by before the all-reduce (torch's div_factor: the world size, 1
        # with a comm hook, join's count of active ranks; None until that count arrives).
        self._divisor: int | None = 1
        # Each parameter's grad accumulator (held: autograd keeps it only while a graph uses it)
        # and the handle of the post hook this object put on it.
        self._accumulators: list[Any] = []
        self._hook_handles: list[Any] = []
        self._next_launch = 0
        self._stats: list[tuple[Tensor, Tensor]] = []

    # ------------------------------------------------------------------ hooks
    def attach(self, params: list[nn.Parameter]) -> None:
        """Hooks every parameter's grad accumulator where torch's reducer hooks it: a post hook of
        the AccumulateGrad node, which runs after the grad is accumulated *and* after the
        tensor's own post-accumulate-grad hooks (so a user's hook sees the local, undivided grad
        and what it leaves in ``p.grad`` is what gets all-reduced, as with torch's DDP)."""
        from torch.autograd.graph import get_gradient_edge

        on_ready = self.on_grad_ready
        for p in params:
            acc = get_gradient_edge(p).node

            def hook(grad_inputs: Any, grad_outputs: Any, p: nn.Parameter = p) -> None:
                on_ready(p)

            self._accumulators.append(acc)
            self._hook_handles.append(acc.register_hook(hook))

    def detach(self) -> None:
        """Removes the hooks (the wrapper is gone: its parameters train on without it)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles, self._accumulators = [], []

    # ------------------------------------------------------------------ forward side
    def arm(self) -> None:
        """The next backward synchronises (torch's ``reducer.prepare_for_backward``)."""
        self.armed = True

    def arm_forward(self, output: Any) -> None:
        """Arms the next backward for the forward that produced ``output``. The end-of-backward
        callback goes on the graph task that reaches this output: the outermost backward, even
        when the first grad hook fires in a reentrant one. The token tells a second backward
        through this output (retain_graph) from the first."""
        from torch.nn.parallel.distributed import _find_tensors

        self.armed = True
        token = [False]
        self._tokens.append(token)
        del self._tokens[:-64]  # forwards with no backward (grad-enabled evaluation) add up
        on_grad = weakref.WeakMethod(self._on_output_grad)  # the graph must not keep this alive

        def prehook(grads: Any, on_grad: Any = on_grad, token: list = token) -> None:
            fn = on_grad()
            if fn is not None:
                fn(token)

        for t in _find_tensors(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(prehook)

    def check_previous_iteration(self) -> None:
        if self.pending:
            raise RuntimeError(
                f"{_NAME}: Expected to have finished reduction in the prior iteration before "
                "starting a new one. The previous backward started synchronising gradients but "
                "did not finish (an exception was raised inside it, or some parameters did not "
                "get a gradient); the ranks' gradients are no longer in step. Recreate the model "
                "wrapper (and the process group if a peer is stuck) instead of continuing."
            )
        # A backward that raised before any grad hook fired launched nothing: nothing to undo.
        self.started = False

    def has_run(self) -> bool:
        """A backward has started synchronising (comm hooks can no longer be registered)."""
        return self.pending or any(b.launched for b in self.layout.buckets)

    # ------------------------------------------------------------------ backward
    def _on_output_grad(self, token: list) -> None:
        if token[0]:
            raise RuntimeError(
                f"{_NAME}: a second backward through the output of a forward whose gradients "
                "were already synchronised. torch's DDP would skip the all-reduce here and leave "
                "the ranks with different gradients; run a new forward for each backward (or "
                "sum the losses and call backward once)."
            )
        if self.armed and not self.started:
            self._start_backward()

    def on_grad_ready(self, p: nn.Parameter) -> None:
        """The hook of every parameter's grad accumulator (the per-grad hot path: a few set and
        list operations and one pass over the grad)."""
        key = id(p)
        if not self.started:
            if not self.armed:  # under no_sync (or no DDP forward): local accumulation
                self._used.add(key)
                return
            self._start_backward()
        self.pending = True
        ready = self._grad_ready
        if key in ready:
            raise RuntimeError(
                f"{_NAME}: parameter {self.names[key]} got a gradient twice in one synchronised "
                "backward (torch: 'Expected to mark a variable ready only once'). It is used both "
                "inside and outside a reentrant checkpoint (use torch.utils.checkpoint with "
                "use_reentrant=False, or fastamp.checkpoint), or an earlier backward raised half "
                "way (its all-reduces are incomplete: recreate the wrapper)."
            )
        ready.add(key)
        layout = self.layout
        if not layout.rebuilt:
            layout.ready_order.append(p)
        bucket, i = layout.bucket_of[key]
        grad = p.grad
        if grad is not None:
            # Into the bucket, divided by the world size, now, while this grad is hot in cache
            # (one pass, as torch's reducer; a pack of the whole bucket at launch would read the
            # grads back cold). With bucket views the grad is (or becomes) its view. A comm hook
            # gets the grads undivided (it averages), as in torch.
            if torch.is_grad_enabled():  # create_graph: the move is not part of the graph
                with torch.no_grad():
                    self._into_bucket(p, grad, bucket.views[i])
            else:
                self._into_bucket(p, grad, bucket.views[i])
        else:  # another hook set it to None: contributes zeros, as in torch's reducer
            bucket.views[i].zero_()
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next_launch:
            self._launch_ready()

    def _into_bucket(self, p: nn.Parameter, grad: Tensor, view: Tensor) -> None:
        """One ready grad into its bucket slice, divided as torch's reducer does (with bucket
        views the grad then is the slice)."""
        if not self._divide_into(grad, view) and self.views:
            p.grad = view

    def _divide_into(self, grad: Tensor, view: Tensor) -> bool:
        """``view = grad / divisor`` as torch's reducer computes it: a grad that is the slice
        (bucket views) is divided in place with ``div_``; any other is copied in times
        ``1 / divisor`` (``mul_out``). On CPU the two round differently. True if ``grad`` is
        the slice."""
        divisor = self._divisor if self._divisor is not None else self._join_divisor()
        if grad is view or (self.views and grad.data_ptr() == view.data_ptr()):
            if divisor != 1:
                view.div_(divisor)
            return True
        if divisor != 1:
            torch.mul(grad, 1.0 / divisor, out=view)
        else:
            view.copy_(grad)
        return False

    def _join_divisor(self) -> int:
        """The number of ranks still active (join with divide_by_initial_world_size=False)."""
        self.join_work.wait()
        self._divisor = int(self.join_work.result()[0].item())
        return self._divisor

    def _launch_ready(self) -> None:
        """Launches complete buckets strictly in bucket order. Collectives must be issued in the same
        order on every rank; buckets may complete in different orders on different ranks."""
        buckets = self.layout.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1

    def _start_backward(self) -> None:
        self.started = True
        self.armed = False
        self._consuming, self._tokens = self._tokens, []  # done when this backward finishes
        self._grad_ready = set()
        self._stats = []
        if self.comm_hook is not None:
            self._divisor = 1
        elif self.join_work is not None and not self.divide_by_initial_world_size:
            self._divisor = None  # the count of active ranks arrives with join's all-reduce
        else:
            self._divisor = self.world_size
        for b in self.layout.buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self._next_launch = 0
        # private-ok: autograd's end-of-backward callback queue has no public spelling; torch's
        # DDP (static graph, join) and FSDP queue their own callbacks through it.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch(self, bucket: Bucket) -> None:
        divisor = self._divisor if self._divisor is not None else self._join_divisor()
        with _no_grad():
            if self.views:
                for p, view in zip(bucket.params, bucket.views):
                    if id(p) in self._grad_ready:
                        continue  # divided (or moved) in its hook
                    if p.grad is None:  # unused here: contributes zeros
                        view.zero_()
                    else:  # unused in this backward but holding a grad: torch reduces it
                        self._divide_into(p.grad, view)
            else:  # ready grads are in the bucket (their hook); unused ones: zeros or their grad
                late = []
                for p, view, off in zip(bucket.params, bucket.views, bucket.offsets):
                    if id(p) in self._grad_ready:
                        continue
                    if p.grad is None:
                        view.zero_()
                    else:
                        late.append((p.grad.contiguous(), off))
                if late:
                    _ops.bucket_pack_(
                        bucket.buffer, [g for g, _ in late], [o for _, o in late], 1.0 / divisor
                    )
            if self.comm_hook is not None:
                hook, state = self.comm_hook
                bucket.work = hook(
                    state,
                    bucket.comm_bucket(bucket.buffer, bucket.index == len(self.layout.buckets) - 1),
                )
            elif self.world_size > 1:
                bucket.work = dist.all_reduce(
                    bucket.buffer, group=self.process_group, async_op=True
                )
        bucket.launched = True

    def _wait(self, bucket: Bucket) -> Tensor:
        """Waits for the bucket's all-reduce (or comm hook future); returns the reduced tensor."""
        work, bucket.work = bucket.work, None  # a finished Work keeps the process group alive
        if work is None:
            return bucket.buffer
        try:
            if self.comm_hook is None:
                work.wait()
                return bucket.buffer
            out = work.wait()
        except Exception as e:
            raise collective_error(
                f"the all-reduce of gradient bucket {bucket.index}", self.rank, e
            ) from e
        if isinstance(out, (list, tuple)) and len(out) == 1:
            out = out[0]
        if (
            not isinstance(out, Tensor)
            or out.numel() != bucket.numel
            or out.device != bucket.buffer.device
        ):
            raise RuntimeError(
                f"{_NAME}: the comm hook's future for bucket {bucket.index} must hold one tensor of "
                f"{bucket.numel} elements on {bucket.buffer.device} (the reduced bucket.buffer()), got "
                f"{type(out).__name__}{tuple(out.shape) if isinstance(out, Tensor) else ''}"
            )
        return out.reshape(-1).to(bucket.buffer.dtype)

    def _finish_backward(self) -> None:
        layout = self.layout
        ready = self._grad_ready
        unready = (
            []
            if len(ready) == len(layout.params)
            else [p for p in layout.params if id(p) not in ready]
        )
        if unready and not self.find_unused_parameters and not self.static_graph:
            names = ", ".join(self.names[id(p)] for p in unready[:10])
            more = f" and {len(unready) - 10} more" if len(unready) > 10 else ""
            raise RuntimeError(
                f"{_NAME}: these parameters received no gradient in this backward: {names}{more}. "
                "They were not used to compute the loss. Pass find_unused_parameters=True, or "
                "make every parameter take part in the loss (or set requires_grad=False on the "
                "unused ones)."
            )
        # Unused parameters (allowed): their buckets still need their all-reduce, with zeros.
        for p in unready:
            bucket, _ = layout.bucket_of[id(p)]
            bucket.pending -= 1
        self._launch_ready()
        self._used |= self._grad_ready
        global_unused = self._reduce_used_map()
        scale = self.scaler.current_scale() if self.scaler is not None else None
        # 1 / scale, rounded once from float64 as the scaler's unscale does (a few tiny ops per
        # backward, and only for the unpack: not worth a cache that must track scale updates).
        inv = scale.double().reciprocal().float() if scale is not None and not self.views else None
        noted: list[tuple[Tensor, Tensor]] = []
        for b in layout.buckets:
            reduced = self._wait(b)
            with _no_grad():
                if self.views:
                    if reduced.data_ptr() != b.buffer.data_ptr():
                        b.buffer.copy_(reduced)
                    for p, view in zip(b.params, b.views):
                        if p.grad is None and id(p) not in global_unused:
                            p.grad = view
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
                # One fused op on every device (one read of the bucket); its statistics come from
                # the scaler's own stats kernel over the grads' chunks, so they are bit-identical
                # to fastamp::grad_stats over these grads.
                self._stats.append(_ops.bucket_unpack_(reduced, grads, offs, inv))
                noted.extend(zip((p for p in b.params if id(p) not in global_unused), grads))
        if noted and self.scaler is not None and scale is not None:
            found, sq = self.grad_stats()
            self.scaler.note_grad_stats(
                GradStats.measured(found, sq, [p for p, _ in noted], [g for _, g in noted], scale)
            )
        if not layout.rebuilt:
            layout.rebuild_from_rank0()
        self._used = set()
        self.join_work = None
        for token in self._consuming:
            token[0] = True
        self._consuming = []
        self.pending = False
        self.started = False

    def _reduce_used_map(self, joined: bool = False) -> set[int]:
        """ids of the parameters no rank used since the last synchronised backward (torch's
        globally unused parameters: their grads are not touched). A ``joined`` rank contributes
        the map of the last reduction it took part in, as torch's does (so a parameter the
        remaining ranks leave unused gets zeros, not None, when it was used in that one)."""
        if not (self.find_unused_parameters or self.static_graph):
            return set()
        if self.static_graph and self._global_unused is not None:
            return self._global_unused
        params = self.layout.params
        mine = self._last_global_used if joined else self._used
        used = torch.tensor(
            [1 if id(p) in mine else 0 for p in params], dtype=torch.int32, device=self.device
        )
        if self.world_size > 1:
            try:
                dist.all_reduce(used, group=self.process_group)
            except Exception as e:
                raise collective_error(
                    "the all-reduce of the used-parameter map", self.rank, e
                ) from e
        counts = used.tolist()
        unused = {id(p) for p, u in zip(params, counts) if u == 0}
        self._last_global_used = {id(p) for p, u in zip(params, counts) if u != 0}
        if self.static_graph:
            self._global_unused = unused
        return unused

    def shadow_backward(self) -> None:
        """A joined rank's share of one backward of the others: zeros for every bucket, in order
        (through the comm hook if one is registered), the used map, the one-time rebuild."""
        buckets = self.layout.buckets
        with torch.no_grad():
            for b in buckets:
                if self.comm_hook is not None:
                    hook, state = self.comm_hook
                    b.work = hook(
                        state,
                        b.comm_bucket(torch.zeros_like(b.buffer), b.index == len(buckets) - 1),
                    )
                else:
                    b.buffer.zero_()
                    b.work = dist.all_reduce(b.buffer, group=self.process_group, async_op=True)
            for b in buckets:
                self._wait(b)
        if self.find_unused_parameters or (self.static_graph and self._global_unused is None):
            self._used = set()
            self._reduce_used_map(joined=True)
        if not self.layout.rebuilt:
            self.layout.rebuild_from_rank0()

    # ------------------------------------------------------------------ what the unpack measured
    def grad_stats(self) -> tuple[Tensor, Tensor] | None:
        """``(found_inf, sum of squares)`` of the all-reduced grads, computed by the unpack of the
        last backward (None with bucket views, which have no unpack); the buckets' sums added
        in bucket order."""
        if not self._stats:
            return None
        found, sq = self._stats[0]
        for f, q in self._stats[1:]:
            found, sq = found + f, sq + q
        return found, sq
