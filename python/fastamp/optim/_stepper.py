"""The step of a fused optimizer (:class:`FusedStep`, given its family's launches through a
:class:`LaunchBuilder`): the full step (every group checked, every
launch made, before the first kernel writes), its steady-state replay, and the step over flat
buffers; each takes the optimizer's param groups and state as arguments and a step's device
scalars as one :class:`fastamp.handoff.AmpStep`, and returns where the step's skip flag lives
(what ``optimizer.stepped`` is made from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fastamp._library import backend_keyset, direct_call_allowed
from fastamp.handoff import AmpStep, FlatGrads
from fastamp.optim._family import OptimizerFamily
from fastamp.optim._flat import FlatBuffers, FlatSegment
from fastamp.optim._launch import Launch
from fastamp.optim._replay import StepReplay
from fastamp.optim._step_checks import StepChecks
from fastamp.optim.lowbit import FLOAT32, StateFormat

__all__ = ["FusedStep", "LaunchBuilder", "Stepped"]

# What ``optimizer.stepped`` is made from: the step's found_inf (None: unconditional) and the
# device of its first launch.
Stepped = tuple[Tensor | None, torch.device]


class LaunchBuilder(Protocol):
    """A family's launches (fastamp.optim._build.AdamLaunches / SgdLaunches)."""

    def launch(
        self,
        state: Mapping[Tensor, Any],
        fmt: StateFormat,
        g: int,
        group: dict[str, Any],
        params: list[Tensor],
        places: list[int],
        states: Sequence[Mapping[str, Any] | None] | None = None,
        grads: Sequence[Tensor] | None = None,
    ) -> Launch: ...

    def commit(self, launch: Launch, state: Any) -> None: ...


class FusedStep:
    """One optimizer's step (see the module docstring). Holds what the step keeps between
    steps: the replay of the last full step (a cache: None makes the next step a full one),
    and with ``flat_buffers`` the params' flat layout and its hand-off to the scaler."""

    def __init__(
        self,
        name: str,
        family: OptimizerFamily,
        checks: StepChecks,
        builder: LaunchBuilder,
        flat_buffers: bool,
    ) -> None:
        self.name = name
        self.family = family
        self.checks = checks
        self.builder = builder
        self.flat_buffers = flat_buffers
        self.replay: StepReplay | None = None
        self.flat: FlatBuffers | None = None
        self.flat_grads_cache: FlatGrads | None = None

    def run(self, groups: list[dict[str, Any]], state: Any, amp: AmpStep) -> Stepped | None:
        """One step; None when it stepped no param."""
        if self.flat_buffers and not torch.compiler.is_compiling():
            return self._flat_step(groups, state, amp)
        return self._per_param_step(groups, state, amp)

    def _per_param_step(
        self, groups: list[dict[str, Any]], state: Any, amp: AmpStep
    ) -> Stepped | None:
        replay = self.replay
        if replay is not None and not torch.compiler.is_compiling():
            grads = replay.grads(groups, state)
            if grads is not None:
                done = self._replayed(replay, grads, amp)
                if done is not None:
                    return done
        # The replay is replaced only once a full step ran: one that raised changed nothing.
        return self._full_step(groups, state, amp)

    def _replayed(
        self, replay: StepReplay, grads: list[list[Tensor]], amp: AmpStep
    ) -> Stepped | None:
        """The step through ``replay``; None (nothing written) when its first kernel refuses an
        input: the full step then checks everything and raises what it finds, or steps."""
        amps: dict[torch.device, AmpStep] = {}
        # Straight to the backend kernel when the grads are plain tensors (fastamp._library).
        direct = replay.plain and not torch.is_grad_enabled() and direct_call_allowed()
        for k, (launch, gs) in enumerate(zip(replay.launches, grads)):
            dev = launch.device
            on_dev = amps.get(dev)
            if on_dev is None:
                on_dev = amps[dev] = amp.to(dev)
            try:
                launch.run(on_dev, gs, backend_keyset(dev) if direct else None)
            except (RuntimeError, TypeError, ValueError) as e:
                if k == 0:
                    return None
                # The replay checked every grad before the first launch: not expected.
                raise self.checks.kernel_error(e, launch.g, launch.places, first=False) from e
        return amp.found_inf, replay.launches[0].device

    def _full_step(self, groups: list[dict[str, Any]], state: Any, amp: AmpStep) -> Stepped | None:
        # Every group is checked, and every launch's inputs made (new and converted state
        # included), before the first kernel runs; a launch's state is committed right after it.
        checks = self.checks
        checked = [(g, group, *checks.params(g, group, state)) for g, group in enumerate(groups)]
        checks.shared_memory(checked)
        launches: list[Launch] = []
        amps: list[AmpStep] = []
        stepped: Stepped | None = None
        for g, group, params, places in checked:
            if not params:
                continue
            dev = params[0].device
            on_dev = amp.to(dev)
            by_format: dict[StateFormat, tuple[list[Tensor], list[int]]] = {}
            group_format = self.family.group_format(group, f"fastamp.optim.{self.name}")
            for p, i in zip(params, places):
                fmt = group_format if group_format.applies_to(p) else FLOAT32
                ps, ix = by_format.setdefault(fmt, ([], []))
                ps.append(p)
                ix.append(i)
            for fmt, (ps, ix) in sorted(by_format.items(), key=lambda kv: kv[0].lowbit):
                launches.append(self.builder.launch(state, fmt, g, group, ps, ix))
                amps.append(on_dev)
            if stepped is None:
                stepped = (amp.found_inf, dev)
        # Params whose state this step makes: launched by format (float32 first), they are put
        # in the state afterwards in the params' order, as torch's step makes them.
        fresh = [p for launch in launches for p in launch.params if p not in state]
        for k, (launch, on_dev) in enumerate(zip(launches, amps)):
            try:
                launch.run(on_dev)
            except (RuntimeError, TypeError, ValueError) as e:
                raise checks.kernel_error(e, launch.g, launch.places, first=k == 0) from e
            self.builder.commit(launch, state)
        if len(launches) > 1 and len(fresh) > 1:
            order = {id(p): k for k, p in enumerate(p for g in groups for p in g["params"])}
            for p in sorted((p for p in fresh if p in state), key=lambda p: order[id(p)]):
                state[p] = state.pop(p)  # (the new entries are last: moved in order)
        # No replay of a traced step: its held lists would hold FakeTensors, and a compiled step
        # is a graph already.
        replayable = (
            launches
            and all(launch.replayable() for launch in launches)
            and not torch.compiler.is_compiling()
        )
        self.replay = StepReplay.of(groups, state, launches) if replayable else None
        return stepped

    # ------------------------------------------------------------------ flat buffers
    def flat_layout(
        self, groups: list[dict[str, Any]], state: Any, grads_only: bool = False
    ) -> FlatBuffers:
        """The flat layout, made anew (values and state copied in) when it no longer holds
        (``grads_only``: for a read of the grads, see :meth:`FlatBuffers.holds`)."""
        flat = self.flat
        if flat is None or not flat.holds(groups, state, grads_only):
            flat = self.flat = FlatBuffers(self.name, groups, state)
            self.replay = None  # its held tensors may be the old buffers' views
            pos = {id(p): (g, i) for g, grp in enumerate(groups)
                   for i, p in enumerate(grp["params"])}  # fmt: skip
            members = [[id(flat.inside[m]) for s in flat.segments if s.buffer == b
                        for m in s.members] for b in range(len(flat.grad_buffers))]  # fmt: skip
            self.flat_grads_cache = FlatGrads(
                tuple(flat.grad_buffers),
                tuple(members),
                tuple([pos[i] for i in ids] for ids in members),
                tuple(len(ids) for ids in members),
            )
        return flat

    def flat_grads(self, groups: list[dict[str, Any]], state: Any) -> FlatGrads | None:
        """The flat grad buffers, once every grad is its view; None when the step is per
        parameter (see :meth:`fastamp.handoff.AmpFusedOptimizer.amp_flat_grads`)."""
        if not self.flat_buffers or torch.compiler.is_compiling():
            return None
        flat = self.flat_layout(groups, state, grads_only=True)
        if not flat.usable or not flat.sync_grads(f"fastamp.optim.{self.name}"):
            return None
        return self.flat_grads_cache

    def _flat_step(self, groups: list[dict[str, Any]], state: Any, amp: AmpStep) -> Stepped | None:
        """The step over the flat buffers: one launch per segment; a per-parameter step when
        a grad is None or a segment's step counts diverged."""
        flat = self.flat_layout(groups, state)
        if not flat.usable or not flat.sync_grads(f"fastamp.optim.{self.name}"):
            had_grad = [p.grad is not None for p in flat.inside]
            stepped = self._per_param_step(groups, state, amp)
            flat.after_per_tensor(had_grad)
            return stepped
        if any(seg.launch is None for seg in flat.segments):
            # A new layout's first launch takes the state as it is: checked first, as the
            # per-parameter step checks it (e.g. amsgrad switched on with no max_exp_avg_sq:
            # KeyError, as torch's), before any segment is stepped.
            for g, group in enumerate(groups):
                self.checks.params(g, group, state)
        amps: dict[torch.device, AmpStep] = {}
        adopted = False
        direct = not torch.is_grad_enabled() and direct_call_allowed()
        for seg in flat.segments:
            dev = seg.param.device
            on_dev = amps.get(dev)
            if on_dev is None:
                on_dev = amps[dev] = amp.to(dev)
            if seg.launch is None and self._flat_first_launch(flat, seg, state, on_dev):
                adopted = True  # it ran: its state is new
                continue
            assert seg.launch is not None
            seg.launch.run(on_dev, seg.grads, backend_keyset(dev) if direct else None)
            seg.copy_steps()
        if adopted:
            flat.snapshot(state)
        # The params are views made with .data: their own write counters are bumped here (what
        # autograd checks when a graph saved one of them).
        torch.autograd.graph.increment_version(flat.inside)
        dev = flat.segments[0].param.device if flat.segments else torch.device("cpu")
        return amp.found_inf, dev

    def _flat_first_launch(
        self, flat: FlatBuffers, seg: FlatSegment, state: Any, amp: AmpStep
    ) -> bool:
        """A segment's launch as the full step makes it: with no state yet, it runs once and its
        new state becomes the segment's (True); with state, only the held launch is made."""
        fresh = seg.state is None
        launch = self.builder.launch(
            state, FLOAT32, seg.g, seg.group, [seg.param], seg.places,
            states=[seg.state or {}], grads=[seg.grad],
        )  # fmt: skip
        if fresh:
            try:
                launch.run(amp)
            except (RuntimeError, TypeError, ValueError) as e:
                raise self.checks.kernel_error(e, seg.g, seg.places, first=True) from e
            flat.adopt(seg, launch.news[0], state)
            launch = self.builder.launch(
                state, FLOAT32, seg.g, seg.group, [seg.param], seg.places,
                states=[seg.state], grads=[seg.grad],
            )  # fmt: skip
        seg.launch = launch.held()
        seg.grads = [seg.grad]
        return fresh
