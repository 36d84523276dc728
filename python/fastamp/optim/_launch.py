"""One kernel launch of a fused optimizer step, as one typed object (:class:`Launch`): which op
pair runs (:class:`StepOp`: the list-taking op and its held variant), the op's tensor lists, the
rule that reads the group's hyper-parameters when it runs (:class:`AdamRule`, :class:`SgdRule`),
and the bookkeeping its optimizer commits after it. A full step's launches, a replayed step's
(the same launches, their lists held by the op library) and a flat-buffer segment's are all
:class:`Launch` objects; the type says which op runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from fastamp._library import KeySet
from fastamp._sharding import is_dtensor
from fastamp.handoff import AmpStep
from fastamp.optim import _ops

__all__ = ["AdamRule", "Launch", "SgdRule", "StepOp", "written"]


class StepOp(enum.Enum):
    """The fused step ops (list-taking op and ``_held_`` variant), each with the lists it takes
    besides the grads, in schema order (what :attr:`Launch.lists` holds)."""

    ADAM = ("adam_step_", ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                           "state_steps", "master_params"))  # fmt: skip
    ADAM_LOWBIT = ("adam_lowbit_step_", ("params", "exp_avgs", "exp_avg_sqs", "exp_avg_absmax",
                                         "exp_avg_sq_absmax", "state_steps", "master_params"))  # fmt: skip
    SGD = ("sgd_step_", ("params", "momentum_buffers", "state_steps", "master_params"))
    SGD_LOWBIT = ("sgd_lowbit_step_", ("params", "momentum_buffers", "state_steps",
                                       "master_params"))  # fmt: skip

    @property
    def op_name(self) -> str:
        """The list-taking op (``fastamp::<op_name>``; the held one is ``<op_name>held_``)."""
        name: str = self.value[0]
        return name

    @property
    def list_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = self.value[1]
        return names


@dataclass(frozen=True)
class AdamRule:
    """How an Adam launch reads its group's hyper-parameters at each run (an LR scheduler or a
    user may change them between steps): ``lr`` as a tensor on ``device`` when it is one."""

    device: torch.device
    decoupled: bool
    amsgrad: bool

    def hyper(self, group: dict[str, Any]) -> _ops.AdamHyper:
        beta1, beta2 = group["betas"]
        lr, lr_t = _lr(group, self.device)
        return _ops.AdamHyper(
            lr, lr_t, float(beta1), float(beta2), float(group["weight_decay"]),
            float(group["eps"]), bool(group.get("decoupled_weight_decay", self.decoupled)),
            bool(group["maximize"]), self.amsgrad,
        )  # fmt: skip


@dataclass(frozen=True)
class SgdRule:
    """How an SGD launch reads its group's hyper-parameters at each run."""

    device: torch.device

    def hyper(self, group: dict[str, Any]) -> _ops.SgdHyper:
        lr, lr_t = _lr(group, self.device)
        return _ops.SgdHyper(
            lr, lr_t, float(group["weight_decay"]), float(group["momentum"]),
            float(group["dampening"]), bool(group["nesterov"]), bool(group["maximize"]),
        )  # fmt: skip


def _lr(group: dict[str, Any], device: torch.device) -> tuple[float, Tensor | None]:
    lr = group["lr"]
    if isinstance(lr, Tensor):
        return 0.0, lr.to(device=device, dtype=torch.float32, non_blocking=True)
    return float(lr), None


def written(*lists: list[Tensor]) -> list[Tensor]:
    """What a launch writes, for the write counters (increment_version skips inference tensors,
    which keep none)."""
    return [t for ts in lists for t in ts]


@dataclass
class Launch:
    """One launch of ``op`` over ``lists`` (its lists but the grads, in schema order) and
    ``grads``, with ``rule`` reading ``group``'s hyper-parameters when it runs and ``seed``
    keying a low-bit format's rounding. It writes ``written``; ``news`` is the state each param
    gets once it ran (committed by the optimizer), ``staged`` params stepped through a copy,
    ``counts`` SGD's new update counts. :meth:`held` gives the launch a replay repeats: the
    same, with ``lists`` held by the op library so a call boxes only the grads."""

    op: StepOp
    lists: tuple[list[Tensor], ...]
    grads: list[Tensor]
    rule: AdamRule | SgdRule
    seed: int
    written: list[Tensor]
    g: int
    group: dict[str, Any]
    params: list[Tensor]
    places: list[int]
    news: list[dict[str, Any]]
    moments: tuple[str, ...]
    staged: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    counts: dict[Tensor, Tensor] = field(default_factory=dict)
    holding: _ops.HeldTensors | None = None

    @property
    def kparams(self) -> list[Tensor]:
        """The params as the kernel takes them (first of ``lists``)."""
        return self.lists[0]

    @property
    def device(self) -> torch.device:
        return self.lists[0][0].device

    def run(
        self, amp: AmpStep, grads: list[Tensor] | None = None, keyset: KeySet | None = None
    ) -> None:
        """The op over this launch's lists, ``grads`` (default: the ones it was made with) and
        the scalars ``amp`` (on this launch's device); ``keyset``: a held launch's call straight
        to that backend's kernel (fastamp._library.call_direct), or None."""
        gs = self.grads if grads is None else grads
        hyper = self.rule.hyper(self.group)
        op, held = self.op, self.holding
        if held is not None:
            if op is StepOp.ADAM:
                assert isinstance(hyper, _ops.AdamHyper)
                _ops.adam_step_held_(held, gs, hyper, amp, self.written, keyset)
            elif op is StepOp.ADAM_LOWBIT:
                assert isinstance(hyper, _ops.AdamHyper)
                _ops.adam_lowbit_step_held_(held, gs, self.seed, hyper, amp, self.written, keyset)
            elif op is StepOp.SGD:
                assert isinstance(hyper, _ops.SgdHyper)
                _ops.sgd_step_held_(held, gs, hyper, amp, self.written, keyset)
            else:
                assert isinstance(hyper, _ops.SgdHyper)
                _ops.sgd_lowbit_step_held_(held, gs, self.seed, hyper, amp, self.written, keyset)
            return
        ls = self.lists
        if op is StepOp.ADAM:
            assert isinstance(hyper, _ops.AdamHyper)
            _ops.adam_step_(ls[0], gs, ls[1], ls[2], ls[3], ls[4], ls[5], hyper, amp)
        elif op is StepOp.ADAM_LOWBIT:
            assert isinstance(hyper, _ops.AdamHyper)
            _ops.adam_lowbit_step_(
                ls[0], gs, ls[1], ls[2], ls[3], ls[4], ls[5], ls[6], self.seed, hyper, amp
            )
        elif op is StepOp.SGD:
            assert isinstance(hyper, _ops.SgdHyper)
            _ops.sgd_step_(ls[0], gs, ls[1], ls[2], ls[3], hyper, amp)
        else:
            assert isinstance(hyper, _ops.SgdHyper)
            _ops.sgd_lowbit_step_(ls[0], gs, ls[1], ls[2], ls[3], self.seed, hyper, amp)

    def held(self) -> Launch:
        """This launch with its lists held by the op library (what a replay repeats)."""
        return replace(self, holding=_ops.HeldTensors(self.lists), news=[], staged=[], counts={})

    def replayable(self) -> bool:
        """Whether a later step can repeat this launch as it is: it made no state, staged no
        param, took every grad as it is, and its params are plain tensors."""
        return (
            not self.staged
            and all(g is p.grad for g, p in zip(self.grads, self.params))
            and not self.counts
            and not any(self.news)
            and not any(is_dtensor(p) for p in self.params)
        )
