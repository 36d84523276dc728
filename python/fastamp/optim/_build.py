"""How each optimizer family makes the launches of a step (:class:`AdamLaunches`,
:class:`SgdLaunches`): for one param group's params of one state format, the kernel's views of
the params, their grads and their state -- new state (zero moments, step counts, fp32 masters)
and state converted to the group's format made into the launch's ``news``, never into the
optimizer's state, which its optimizer commits only once the kernel has run
(:meth:`commit`). Each builder is handed the optimizer's ``state`` mapping explicitly; SGD's
keeps its params' update counts (:class:`UpdateCounts`, which decide a momentum buffer's first
value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import is_
from typing import Any

import torch
from torch import Tensor

from fastamp._sharding import local, local_param, wrap_like
from fastamp.optim import _family as family
from fastamp.optim import lowbit
from fastamp.optim._launch import AdamRule, Launch, SgdRule, StepOp, written
from fastamp.optim._layout import grad_like, kernel_view, same_strides
from fastamp.optim.lowbit import StateFormat

__all__ = ["AdamLaunches", "SgdLaunches", "UpdateCounts"]

StateMap = Mapping[Tensor, Any]


def master(
    master_weights: bool, p: Tensor, kp: Tensor, state: Mapping[str, Any], new: dict[str, Any]
) -> Tensor | None:
    """The fp32 master of ``p`` (with ``master_weights``), laid out as ``kp`` (the param as the
    kernel walks it); a new or re-strided one goes into ``new``."""
    if not master_weights or p.dtype == torch.float32:
        return None
    m = state.get("master_param")
    if m is None or not same_strides(m, kp):
        src = p if m is None else m
        m = new["master_param"] = torch.empty_like(kp, dtype=torch.float32).copy_(src)
    return m


def moments_for(
    fmt: StateFormat,
    moments: tuple[str, ...],
    like: Tensor,
    state: Mapping[str, Any],
    new: dict[str, Any],
) -> Mapping[str, Any]:
    """The state as the kernel takes it for ``fmt``: new zero moments, or the present ones
    converted / re-strided when they are not already in ``fmt`` (into ``new``)."""
    if fmt.holds(state, like, moments):  # the fast path: every step but the first
        return {**state, **new} if new else state
    made: dict[str, Any] = {}
    if lowbit.format_of(state, moments) is None:
        made.update(fmt.new(like, moments))
    else:
        converted = lowbit.convert(state, fmt, like, moments)
        if converted is not None:
            made.update(converted)
    new.update(made)
    return {**state, **new}


def step_tensor(
    p: Tensor, state: Mapping[str, Any], new: dict[str, Any], key: str = "step"
) -> Tensor:
    """``state[key]`` as the kernel takes it (float32 [] on ``p``'s device), made into ``new``
    when it is missing, a number, or elsewhere (a state_dict saved by torch.optim keeps steps on
    the CPU)."""
    step = state.get(key)
    if step is None:
        step = new[key] = torch.zeros((), dtype=torch.float32, device=p.device)
    elif not isinstance(step, Tensor):  # a number (accepted by the checks, as by PyTorch)
        step = new[key] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
    elif step.device != p.device or step.dtype != torch.float32 or step.dim() != 0:
        step = new[key] = step.to(device=p.device, dtype=torch.float32).reshape(())
    return step


def commit(launch: Launch, state: Any) -> None:
    """After the kernel: copy staged params back, and put the state the launch made in place
    (moments converted to another format drop that format's keys; a DTensor param's new state
    tensors of its local shape become DTensors laid out as it is, as torch keeps it)."""
    for p, kp in launch.staged:
        p.copy_(kp)
    for p, new in zip(launch.params, launch.news):
        if not new:
            continue
        st = state[p]
        if any(k in new for k in launch.moments) or any(k.endswith("_codes") for k in new):
            for k in lowbit.moment_keys(launch.moments):
                if k not in new:
                    st.pop(k, None)
        st.update({k: wrap_like(p, v) for k, v in new.items()})


class AdamLaunches:
    """Adam's (AdamW's with ``decoupled``) launches."""

    moments = family.ADAM.moments

    def __init__(self, master_weights: bool, decoupled: bool) -> None:
        self.master_weights = master_weights
        self.decoupled = decoupled

    def launch(
        self,
        state: StateMap,
        fmt: StateFormat,
        g: int,
        group: dict[str, Any],
        params: list[Tensor],
        places: list[int],
        states: Sequence[Mapping[str, Any] | None] | None = None,
        grads: Sequence[Tensor] | None = None,
    ) -> Launch:
        """``states`` / ``grads`` (flat buffers) stand for ``state[p]`` / ``p.grad``."""
        moments = self.moments
        amsgrad = bool(group["amsgrad"]) and not fmt.lowbit
        kparams, gs, steps, masters = [], [], [], []
        currents: list[Mapping[str, Any]] = []
        max_sqs: list[Tensor] = []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        for k, p in enumerate(params):
            # .get: no entry is created before the kernel ran. A DTensor param (FSDP2) steps as
            # its local shard, with its state's local shards.
            st = state.get(p) if states is None else states[k]
            lp, pstate = local_param(p, st or {})
            new: dict[str, Any] = {}
            # The step count first: a new state's keys in torch's order (step, exp_avg, ...).
            steps.append(step_tensor(lp, pstate, new))
            kp = kernel_view(lp)
            if kp is not lp:
                staged.append((lp, kp))
            m = master(self.master_weights, lp, kp, pstate, new)
            like = m if m is not None else kp
            currents.append(moments_for(fmt, moments, like, pstate, new))
            if amsgrad:
                mx = pstate.get("max_exp_avg_sq")
                if mx is None:
                    mx = new["max_exp_avg_sq"] = torch.zeros_like(like)
                elif not same_strides(mx, like):  # re-strided, as the moments
                    mx = new["max_exp_avg_sq"] = torch.empty_like(like).copy_(mx)
                max_sqs.append(mx)
            kparams.append(kp)
            grad = p.grad if grads is None else grads[k]
            assert grad is not None  # StepChecks.params keeps the params that have a grad
            gs.append(grad_like(grad if lp is p else local(grad), kp))
            if m is not None:
                masters.append(m)
            news.append(new)
        ms, vs, ams, avs = fmt.adam_lists(currents)
        rule = AdamRule(params[0].device, self.decoupled, amsgrad)
        lists: tuple[list[Tensor], ...]
        if fmt.lowbit:
            op, lists = StepOp.ADAM_LOWBIT, (kparams, ms, vs, ams, avs, steps, masters)
        else:
            op, lists = StepOp.ADAM, (kparams, ms, vs, max_sqs, steps, masters)
        return Launch(
            op, lists, gs, rule, int(group.get("state_seed", 0)),
            written(kparams, ms, vs, ams, avs, max_sqs, steps, masters), g, group, params,
            places, news, moments, staged,
        )  # fmt: skip

    def commit(self, launch: Launch, state: Any) -> None:
        commit(launch, state)


def _counted_for(state: Mapping[str, Any]) -> tuple[Any, Any]:
    """The state tensors an SGD update count stands for (compared by identity)."""
    return state.get("momentum_buffer"), state.get("step")


class UpdateCounts:
    """SGD's count of each param's updates, on the device, with the state tensors it counts for
    (the momentum buffer and a saved count): a state cleared, deleted or replaced since
    (``opt.state.clear()``, ``del opt.state[p]["momentum_buffer"]``) makes the count start again,
    as torch's None buffer does. (``state["step"]`` is not part of PyTorch's SGD state; it is
    kept in the state only with bfloat16 buffers, whose rounding it keys.)"""

    def __init__(self) -> None:
        self.known: dict[Tensor, tuple[Tensor, Tensor | None, Tensor | None]] = {}

    def of(self, p: Tensor, state: Mapping[str, Any]) -> Tensor | None:
        """The count kept for ``p`` while its state holds the tensors it was kept for."""
        known = self.known.get(p)
        if known is not None and all(map(is_, _counted_for(state), known[1:])):
            return known[0]
        return None

    def update_count(self, p: Tensor, state: Mapping[str, Any]) -> Any:
        """The count of ``p``'s updates (in the state with bfloat16 buffers; None: unknown)."""
        if "step" in state:
            return state["step"]
        return self.of(p, state)

    def for_launch(
        self, p: Tensor, state: Mapping[str, Any], new_counts: dict[Tensor, Tensor]
    ) -> Tensor:
        known = self.of(p, state)
        if known is not None:
            return known
        saved = state.get("step")  # kept in the state with state_dtype=torch.bfloat16
        if isinstance(saved, Tensor) and saved.numel() == 1:
            n = new_counts[p] = saved.detach().to(device=p.device, dtype=torch.float32).reshape(())
            return n
        # A buffer loaded from a checkpoint (or put in the state by hand) has had its first
        # value already; no buffer: the next update gives it its first.
        first = 0.0 if state.get("momentum_buffer") is None else 1.0
        n = new_counts[p] = torch.full((), first, dtype=torch.float32, device=p.device)
        return n

    def note(self, counts: Mapping[Tensor, Tensor], state: Any) -> None:
        for p, n in counts.items():
            self.known[p] = (n, *_counted_for(state.get(p) or {}))


class SgdLaunches:
    """SGD's launches, with its update counts (:class:`UpdateCounts`)."""

    def __init__(self, master_weights: bool, counts: UpdateCounts) -> None:
        self.master_weights = master_weights
        self.counts = counts

    def launch(
        self,
        state: StateMap,
        fmt: StateFormat,
        g: int,
        group: dict[str, Any],
        params: list[Tensor],
        places: list[int],
        states: Sequence[Mapping[str, Any] | None] | None = None,
        grads: Sequence[Tensor] | None = None,
    ) -> Launch:
        assert states is None and grads is None  # (no flat buffers for SGD)
        moments = family.SGD.moments_of(group)
        kparams, gs, bufs, counts, masters = [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        new_counts: dict[Tensor, Tensor] = {}
        for p in params:
            # Like torch.optim.SGD, momentum-free SGD keeps no per-param state at all (an entry,
            # even empty, would show up in state_dict()); .get creates none.
            lp, pstate = local_param(p, state.get(p) or {})
            new: dict[str, Any] = {}
            kp = kernel_view(lp)
            if kp is not lp:
                staged.append((lp, kp))
            m = master(self.master_weights, lp, kp, pstate, new)
            count = self.counts.for_launch(p, pstate, new_counts)
            if fmt.lowbit and pstate.get("step") is not count:
                new["step"] = count  # keys the rounding: saved with the state
            if moments:
                like = m if m is not None else kp
                bufs.append(moments_for(fmt, moments, like, pstate, new)["momentum_buffer"])
            counts.append(count)
            kparams.append(kp)
            grad = p.grad
            assert grad is not None  # StepChecks.params keeps the params that have a grad
            gs.append(grad_like(grad if lp is p else local(grad), kp))
            if m is not None:
                masters.append(m)
            news.append(new)
        return Launch(
            StepOp.SGD_LOWBIT if fmt.lowbit else StepOp.SGD, (kparams, bufs, counts, masters),
            gs, SgdRule(params[0].device), int(group.get("state_seed", 0)),
            written(kparams, bufs, counts, masters), g, group, params, places, news, moments,
            staged, new_counts,
        )  # fmt: skip

    def commit(self, launch: Launch, state: Any) -> None:
        commit(launch, state)
        self.counts.note(launch.counts, state)
