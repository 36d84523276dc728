"""The steady-state replay of a fused optimizer's step (:class:`StepReplay`: a full step's
launches, held (:meth:`fastamp.optim._launch.Launch.held`), a :class:`Structure` per param
group): what depends only on the set of params, their layouts, groups and state formats,
computed once by a full (checked) step and repeated while it holds.

A replayed step does per tensor only what must be read anew every step (each param's
grad) plus a few comparisons of machine words made at C speed (``map(id, ...)``,
``map(type, ...)``); the per-param checks, format decisions, state lookups and list building
of a full step run only when something they depend on changed. Each launch's params and state
lists are held by the op library (:class:`fastamp.optim._ops.HeldTensors`), so its op call boxes
only the grads. :meth:`StepReplay.grads` compares against what the replay was built from:

* the ``param_groups`` list, each group dict, each group's structural options (everything but
  the per-step hyper-parameters, which are read every step) and the params in each group (ids);
* which params have a grad, and each grad's type (a grad that appears, disappears or becomes a
  subclass);
* the ``state`` mapping: every param's state dict and every value in it, by identity (a moment
  replaced, removed or converted, ``load_state_dict``).

Each param's dtype is compared (it decides the state format and master weights). The rest of
what a param is made of (storage, shape, strides, device: ``model.to(...)``, ``p.data = ...``,
channels_last) is not compared here when the step is one launch: the held param is the caller's
own tensor, so the kernel sees the new storage, and it checks every held tensor at every call as
the list-taking op would (the state must have the param's dtype, shape, strides and device).
When it refuses, nothing is written and the optimizer runs a full step, which rebuilds the state
as it needs and makes a new replay, or raises the full step's error. With more than one launch,
the params' devices, shapes and strides are compared here as well (a later launch must not be
the first to refuse).

Grads themselves may be new tensors every step (``zero_grad(set_to_none=True)``); the kernels
check each one against its param before writing anything (dtype, shape, strides, device). With
more than one launch per step the grads are also checked here, before the first launch, so an
error in a later group's grad cannot leave an earlier group stepped.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from operator import attrgetter, is_
from typing import Any

import torch
from torch import Tensor

from fastamp._step import same_params
from fastamp.optim._launch import Launch

# Per-step hyper-parameters: read from the group at every step, so editing them (an LR
# scheduler, a user changing weight decay) does not rebuild the replay.
PER_STEP_OPTIONS = frozenset(
    ("params", "lr", "initial_lr", "betas", "eps", "weight_decay", "dampening", "nesterov",
     "maximize")
)  # fmt: skip


class Structure:
    """The options of a group a replay depends on (amsgrad, state_dtype, state_seed, whether SGD
    keeps momentum, capturable, ...: every option but the per-step hyper-parameters), kept as
    the option names and the value objects; :meth:`holds` compares them by identity at C speed
    (an option assigned anew, even to an equal value, counts as changed: the replay is rebuilt,
    never wrongly kept)."""

    def __init__(self, group: Mapping[str, Any]) -> None:
        self.keys = frozenset(group.keys())
        self.names = tuple(k for k in group if k not in PER_STEP_OPTIONS and k != "momentum")
        self.values = tuple(map(group.__getitem__, self.names))
        # SGD's momentum buffers exist or not: its value is read every step, its on/off here.
        self.momentum = group.get("momentum", 0) != 0

    def holds(self, group: Mapping[str, Any]) -> bool:
        return (
            group.keys() == self.keys
            and all(map(is_, map(group.__getitem__, self.names), self.values))
            and (group.get("momentum", 0) != 0) == self.momentum
        )


class StepReplay:
    """The launches of a steady-state step and what they were built from (see the module
    docstring). Built from a full step that made no new state (:meth:`of`); used by the
    optimizer while :meth:`grads` says it holds."""

    @classmethod
    def of(
        cls, groups: list[dict[str, Any]], state: Mapping[Tensor, Any], launches: list[Launch]
    ) -> StepReplay:
        """The replay of a full step's ``launches`` (each :meth:`Launch.replayable`)."""
        params = [p for group in groups for p in group["params"]]
        return cls(groups, state, [launch.held() for launch in launches], params)

    def __init__(
        self,
        groups: list[dict[str, Any]],
        state: Mapping[Tensor, Any],
        launches: list[Launch],
        params: list[Tensor],
    ) -> None:
        """``launches``: held launches over some of ``params`` each (their positions in
        :attr:`indexes`)."""
        self.groups = groups
        self.group_dicts = list(groups)
        self.structure = [Structure(grp) for grp in groups]
        self.state = state
        self.launches = launches
        self.params = params
        position = {id(p): k for k, p in enumerate(params)}
        self.indexes = [[position[id(p)] for p in launch.params] for launch in launches]
        self.grad_types = [type(p.grad) for p in params]
        # Every grad a plain tensor (no subclass): a held op's call may go straight to the
        # backend kernel (fastamp._library.call_direct), the grad types compared each step.
        self.plain = all(t is Tensor for t in self.grad_types)
        # Every state dict and every value in it, kept (so no id is reused while the replay
        # lives) and compared by identity.
        self.state_dicts = list(state.values())
        self.state_values = list(chain.from_iterable(map(dict.values, self.state_dicts)))
        self.state_lens = list(map(len, self.state_dicts))
        # One launch over every param in order: its grads are this step's list as it is.
        self.whole = len(launches) == 1 and self.indexes[0] == list(range(len(params)))
        # With more than one launch, what the params are made of is compared here too (see
        # _made_of), so a later launch's kernel cannot be the first to refuse a param.
        self.layout = None if len(launches) == 1 else _made_of(params)
        # A param's dtype decides its state format and master weights: compared in any case.
        self.dtypes = list(map(_DTYPE, params))

    def grads(
        self, groups: list[dict[str, Any]], state: Mapping[Tensor, Any]
    ) -> list[list[Tensor]] | None:
        """Each launch's grads for this step, or None when the replay no longer holds (then the
        optimizer runs a full step, which checks everything and builds a new replay)."""
        if groups is not self.groups or state is not self.state:
            return None
        params = same_params(groups, self.group_dicts, self.params)
        if params is None:
            return None
        if not all(st.holds(grp) for grp, st in zip(groups, self.structure)):
            return None
        grads = list(map(_GRAD, params))
        if list(map(type, grads)) != self.grad_types or list(map(_DTYPE, params)) != self.dtypes:
            return None
        dicts = list(state.values())
        if len(dicts) != len(self.state_dicts) or not all(map(is_, dicts, self.state_dicts)):
            return None
        # The same dicts (all dicts, then), holding as many values each, the same ones.
        if list(map(len, dicts)) != self.state_lens or not all(
            map(is_, chain.from_iterable(map(dict.values, dicts)), self.state_values)
        ):
            return None
        if self.whole:
            return [grads]
        out = [[grads[i] for i in index] for index in self.indexes]
        if self.layout is not None:
            # All or nothing across launches: a later launch's kernel must not be the first to
            # see a param or grad it refuses (then the full step raises its error, or rebuilds
            # the state it needs, with nothing written).
            if _made_of(params) != self.layout:
                return None
            for launch, gs in zip(self.launches, out):
                for g, kp in zip(gs, launch.kparams):
                    if not _matches(g, kp):
                        return None
        return out


_GRAD = attrgetter("grad")


def _made_of(params: list[Tensor]) -> list[list[Any]]:
    """The dtypes, devices, shapes and strides of ``params`` (compared at C speed)."""
    return [
        list(map(_DTYPE, params)),
        list(map(_DEVICE, params)),
        list(map(Tensor.size, params)),
        list(map(Tensor.stride, params)),
    ]


_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")


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
