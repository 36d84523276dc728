"""The step plan of a fused optimizer (:class:`StepPlan`, one :class:`PlannedLaunch` per kernel
launch): what depends only on the set of params, their layouts, groups and state formats,
computed once by a full (checked) step and reused while it holds.

A step through a plan does per tensor only what must be read anew every step (each param's
grad) plus a few comparisons of machine words made at C speed (``map(id, ...)``,
``map(data_ptr, ...)``); the per-param checks, format decisions, state lookups and list building
of a full step run only when something they depend on changed. :meth:`StepPlan.grads` compares
against what the plan was built from:

* the ``param_groups`` list, each group dict, each group's structural options (everything but
  the per-step hyper-parameters, which are read every step) and the params in each group (ids);
* each param's storage address, shape and strides (``model.to(...)``, ``p.data = ...``,
  channels_last);
* which params have a grad (a grad that appears or disappears);
* the ``state`` mapping, each param's state dict and every state tensor the kernels read (ids:
  a moment replaced, removed or converted, ``load_state_dict``).

Grads themselves may be new tensors every step (``zero_grad(set_to_none=True)``); the kernels
check each one against its param before writing anything (dtype, shape, strides, device). With
more than one launch per step the grads are also checked here, before the first launch, so an
error in a later group's grad cannot leave an earlier group stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastamp._plans import same_params

# Per-step hyper-parameters: read from the group at every step, so editing them (an LR
# scheduler, a user changing weight decay) does not rebuild the plan.
PER_STEP_OPTIONS = frozenset(
    ("params", "lr", "initial_lr", "betas", "eps", "weight_decay", "dampening", "nesterov",
     "maximize")
)  # fmt: skip


def structure_of(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """The options of ``group`` a plan depends on (amsgrad, state_dtype, state_seed, whether
    SGD keeps momentum, capturable, ...): every option but the per-step hyper-parameters, tensors
    by identity."""
    key: list[Any] = []
    for k, v in group.items():
        if k in PER_STEP_OPTIONS:
            continue
        if k == "momentum":
            v = v != 0  # SGD's buffers exist or not; the value itself is read every step
        key.append((k, id(v) if isinstance(v, Tensor) else v))
    return tuple(key)


@dataclass
class PlannedLaunch:
    """One kernel launch of a planned step: ``call(grads, group, amp)`` runs it with this step's
    grads (in ``index`` order of the plan's params), the group's hyper-parameters read now, and
    the scaler's device scalars. ``kparams`` are the params as the kernel takes them (for the
    grads' check); ``written`` every tensor the launch writes (their write counters are bumped
    after it runs)."""

    call: Callable[[list[Tensor], dict[str, Any], Any], None]
    g: int
    group: dict[str, Any]
    places: list[int]
    index: list[int]
    kparams: list[Tensor]
    written: list[Tensor]
    device: torch.device


class StepPlan:
    """The launches of a steady-state step and what they were built from (see the module
    docstring). Built by :meth:`build` from a full step that made no new state; used by the
    optimizer while :meth:`grads` says it holds."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        state: Mapping[Tensor, Any],
        launches: list[PlannedLaunch],
        params: list[Tensor],
        state_keys: Sequence[str],
    ) -> None:
        self.groups = groups
        self.group_dicts = list(groups)
        self.structure = [structure_of(grp) for grp in groups]
        self.state = state
        self.launches = launches
        self.ids = [id(p) for p in params]
        self.params = params
        self.ptrs = [p.data_ptr() for p in params]
        self.shapes = [p.shape for p in params]
        self.strides = [p.stride() for p in params]
        self.mask = [p.grad is None for p in params]
        self.stepped = [params[i] for launch in launches for i in launch.index]
        states = [state.get(p) for p in self.stepped]
        self.state_ids = [id(s) for s in states]
        self.state_keys = [(k, [id(s.get(k)) if s else 0 for s in states]) for k in state_keys]

    def grads(
        self, groups: list[dict[str, Any]], state: Mapping[Tensor, Any]
    ) -> list[list[Tensor]] | None:
        """Each launch's grads for this step, or None when the plan no longer holds (then the
        optimizer runs a full step, which checks everything and builds a new plan)."""
        if groups is not self.groups or state is not self.state:
            return None
        params = same_params(groups, self.group_dicts, self.ids)
        if params is None:
            return None
        if any(structure_of(grp) != key for grp, key in zip(groups, self.structure)):
            return None
        grads = [p.grad for p in params]
        if [g is None for g in grads] != self.mask:
            return None
        if (
            list(map(Tensor.data_ptr, params)) != self.ptrs
            or list(map(Tensor.size, params)) != self.shapes
            or list(map(Tensor.stride, params)) != self.strides
        ):
            return None
        states = list(map(state.get, self.stepped))
        if list(map(id, states)) != self.state_ids:
            return None
        for k, ids in self.state_keys:
            if [id(s.get(k)) if s else 0 for s in states] != ids:
                return None
        out = [[grads[i] for i in launch.index] for launch in self.launches]
        if len(self.launches) > 1:
            # All or nothing across launches: a later launch's kernel must not be the first to
            # see a grad it refuses (then the full step raises its error, with nothing written).
            for launch, gs in zip(self.launches, out):
                for g, kp in zip(gs, launch.kparams):
                    if not _matches(g, kp):
                        return None
        return out


def _matches(g: Tensor, kp: Tensor) -> bool:
    """Whether the kernel takes ``g`` as the grad of ``kp`` as it is."""
    return (
        type(g) is Tensor
        and g.layout is torch.strided
        and g.dtype is kp.dtype
        and g.shape == kp.shape
        and g.stride() == kp.stride()
        and g.device == kp.device
    )
