"""The fused optimizer ops: typed wrappers (what :mod:`fastamp.optim` calls) and their fake (meta)
kernels, so ``torch.compile`` can trace them. Schemas and argument checks: csrc/optim/ops.cpp.

Each wrapper takes the op's tensor lists, its hyper-parameters as one :class:`AdamHyper` /
:class:`SgdHyper` and the scaler's per-step device scalars as one :class:`fastamp.handoff.AmpStep`,
and spreads them into the op's schema in one place. The step ops mutate their inputs and return
nothing; the fake kernels check what a trace can check (devices) and return None.

The ``*_held_`` variants take a :class:`HeldTensors` (every list of the op but the grads, held by
the op library between calls) in place of those lists: a step replay (fastamp.optim._replay) holds
its lists once and boxes only the grads at each step. They have no fake kernels: a replay is not
used while tracing (the full step calls the list-taking ops).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastamp._library import (
    KeySet,  # (importing it loads the operator library)
    StableOps,
    bump_versions,
    call_direct,
    check_fake_devices,
    register_fake,
)
from fastamp.handoff import AmpStep

__all__ = [
    "AdamHyper",
    "HeldTensors",
    "SgdHyper",
    "adam_lowbit_step_",
    "adam_lowbit_step_held_",
    "adam_step_",
    "adam_step_held_",
    "sgd_lowbit_step_",
    "sgd_lowbit_step_held_",
    "sgd_step_",
    "sgd_step_held_",
    "shared_memory_pair",
]

_raw = StableOps("fastamp")  # the raw ops; this module is their typed layer

# No scaler: grads taken as they are, the step unconditional, no clipping.
_NO_AMP = AmpStep(None, None, None)


def _call(name: str, *args: Any) -> None:
    """Calls op ``name`` (the dispatcher bumps the write counters of what it writes)."""
    getattr(_raw, name)(*args)


def _amp_args(a: AmpStep) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The scaler's device scalars in the schemas' order (the last three arguments of each)."""
    return a.inv_scale, a.found_inf, a.clip_coef


@dataclass(frozen=True)
class AdamHyper:
    """The hyper-parameters of :func:`adam_step_` and :func:`adam_lowbit_step_` (which has no
    ``amsgrad``); ``lr_tensor`` (float32 [] on the params' device) overrides ``lr`` when given."""

    lr: float
    lr_tensor: Tensor | None
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    decoupled_weight_decay: bool
    maximize: bool
    amsgrad: bool = False

    def schema_args(self, with_amsgrad: bool) -> tuple[Any, ...]:
        """The hyper-parameters in the schema's order (``amsgrad`` only in adam_step_'s)."""
        head: tuple[Any, ...] = (
            float(self.lr),
            self.lr_tensor,
            float(self.beta1),
            float(self.beta2),
        )
        head += (float(self.weight_decay), float(self.eps))
        ams = (bool(self.amsgrad),) if with_amsgrad else ()
        return head + ams + (bool(self.decoupled_weight_decay), bool(self.maximize))


@dataclass(frozen=True)
class SgdHyper:
    """The hyper-parameters of :func:`sgd_step_` and :func:`sgd_lowbit_step_` (torch.optim.SGD's);
    ``lr_tensor`` overrides ``lr`` when given."""

    lr: float
    lr_tensor: Tensor | None
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool
    maximize: bool

    def schema_args(self) -> tuple[Any, ...]:
        """The hyper-parameters in the schema's order."""
        return (float(self.lr), self.lr_tensor, float(self.weight_decay), float(self.momentum),
                float(self.dampening), bool(self.nesterov), bool(self.maximize))  # fmt: skip


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    master_params: Sequence[Tensor],
    hyper: AdamHyper,
    amp: AmpStep | None = None,
) -> None:
    """One Adam (AdamW with ``decoupled_weight_decay``) step over a list of params, in one pass:
    each grad is read once and multiplied in registers by ``amp.inv_scale * amp.clip_coef``; when
    ``amp.found_inf`` is non-zero nothing is written and ``state_steps`` hold. ``master_params``
    (fp32) are updated in place of half params when given."""
    h, a = hyper, amp or _NO_AMP
    _call("adam_step_",
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
        *h.schema_args(with_amsgrad=True), *_amp_args(a),
    )  # fmt: skip


def adam_lowbit_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_absmax: Sequence[Tensor],
    exp_avg_sq_absmax: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    master_params: Sequence[Tensor],
    seed: int,
    hyper: AdamHyper,
    amp: AmpStep | None = None,
) -> None:
    """:func:`adam_step_` with low-precision moments (fastamp.optim.lowbit): bfloat16 ones,
    written with stochastic rounding keyed by ``seed``, or uint8 codes of 256-element blocks with
    their float32 scales in ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (empty lists for
    bfloat16). One pass; with ``amp.found_inf`` non-zero nothing is written. No amsgrad."""
    h, a = hyper, amp or _NO_AMP
    if h.amsgrad:
        raise ValueError(
            "fastamp::adam_lowbit_step_: amsgrad is not supported with low-precision "
            "state (hyper.amsgrad must be False)"
        )
    _call("adam_lowbit_step_",
        params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps,
        master_params, int(seed), *h.schema_args(with_amsgrad=False), *_amp_args(a),
    )  # fmt: skip


def sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    master_params: Sequence[Tensor],
    hyper: SgdHyper,
    amp: AmpStep | None = None,
) -> None:
    """One SGD step (torch.optim.SGD's rule), fused as :func:`adam_step_`; ``state_steps`` count
    each param's updates (a buffer's first update takes the grad as is)."""
    h, a = hyper, amp or _NO_AMP
    _call("sgd_step_",
        params, grads, momentum_buffers, state_steps, master_params, *h.schema_args(), *_amp_args(a),
    )  # fmt: skip


def sgd_lowbit_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    master_params: Sequence[Tensor],
    seed: int,
    hyper: SgdHyper,
    amp: AmpStep | None = None,
) -> None:
    """:func:`sgd_step_` (momentum != 0) with bfloat16 momentum buffers, written with stochastic
    rounding keyed by ``seed`` (fastamp.optim.lowbit). One pass; with ``amp.found_inf`` non-zero
    nothing is written."""
    h, a = hyper, amp or _NO_AMP
    _call("sgd_lowbit_step_",
        params, grads, momentum_buffers, state_steps, master_params, int(seed), *h.schema_args(),
        *_amp_args(a),
    )  # fmt: skip


class HeldTensors:
    """Tensor lists held by the op library (``fastamp::hold_tensors``) for the ``*_held_`` ops,
    which take ``handle`` in place of every list but the grads, so a step boxes only its grads.
    The lists are the caller's own tensors, in the list-taking op's schema order; the library's
    references are dropped when this object is collected (or by :meth:`release`)."""

    def __init__(self, lists: Sequence[Sequence[Tensor]]) -> None:
        flat = [t for ts in lists for t in ts]
        self.handle: int = _raw.hold_tensors(flat, [len(ts) for ts in lists])
        self.count = len(lists)
        self._release = weakref.finalize(self, _release_held, self.handle)
        self._release.atexit = False  # the process frees everything at exit anyway

    def release(self) -> None:
        self._release()

    def moved(self) -> int:
        """The position (over the lists, in order) of the first held tensor whose data pointer
        is not the one it had when held (``p.data = ...``, ``set_``), or -1."""
        moved: int = _raw.held_moved(self.handle)
        return moved


def _release_held(handle: int) -> None:
    _raw.release_tensors(handle)


def _call_held(name: str, written: Sequence[Tensor], keyset: KeySet | None, *args: Any) -> None:
    """Calls held op ``name``, then bumps ``written``; with a ``keyset`` (a replay's launch whose
    grads are plain tensors, on a thread where :func:`fastamp._library.direct_call_allowed`) and
    no tensor subclass among the other arguments (the scaler's scalars, a tensor lr), straight at
    that backend's kernel (:func:`fastamp._library.call_direct`)."""
    if keyset is not None and all(type(a) is Tensor for a in args if isinstance(a, Tensor)):
        call_direct(getattr(torch.ops.fastamp, name).default, keyset, written, *args)
        return
    getattr(_raw, name)(*args)
    bump_versions(written)


def adam_step_held_(
    held: HeldTensors,
    grads: Sequence[Tensor],
    hyper: AdamHyper,
    amp: AmpStep,
    written: Sequence[Tensor],
    keyset: KeySet | None = None,
) -> None:
    """:func:`adam_step_` with ``held`` holding (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    state_steps, master_params); bumps the write counters of ``written`` (every tensor it
    writes)."""
    _call_held("adam_step_held_", written, keyset,
        held.handle, grads, *hyper.schema_args(with_amsgrad=True), *_amp_args(amp),
    )  # fmt: skip


def adam_lowbit_step_held_(
    held: HeldTensors,
    grads: Sequence[Tensor],
    seed: int,
    hyper: AdamHyper,
    amp: AmpStep,
    written: Sequence[Tensor],
    keyset: KeySet | None = None,
) -> None:
    """:func:`adam_lowbit_step_` with ``held`` holding (params, exp_avgs, exp_avg_sqs,
    exp_avg_absmax, exp_avg_sq_absmax, state_steps, master_params)."""
    _call_held("adam_lowbit_step_held_", written, keyset,
        held.handle, grads, int(seed), *hyper.schema_args(with_amsgrad=False), *_amp_args(amp),
    )  # fmt: skip


def sgd_step_held_(
    held: HeldTensors,
    grads: Sequence[Tensor],
    hyper: SgdHyper,
    amp: AmpStep,
    written: Sequence[Tensor],
    keyset: KeySet | None = None,
) -> None:
    """:func:`sgd_step_` with ``held`` holding (params, momentum_buffers, state_steps,
    master_params)."""
    _call_held("sgd_step_held_", written, keyset,
        held.handle, grads, *hyper.schema_args(), *_amp_args(amp),
    )  # fmt: skip


def sgd_lowbit_step_held_(
    held: HeldTensors,
    grads: Sequence[Tensor],
    seed: int,
    hyper: SgdHyper,
    amp: AmpStep,
    written: Sequence[Tensor],
    keyset: KeySet | None = None,
) -> None:
    """:func:`sgd_lowbit_step_` with ``held`` holding (params, momentum_buffers, state_steps,
    master_params)."""
    _call_held("sgd_lowbit_step_held_", written, keyset,
        held.handle, grads, int(seed), *hyper.schema_args(), *_amp_args(amp),
    )  # fmt: skip


def shared_memory_pair(tensors: Sequence[Tensor]) -> list[int]:
    """``[]`` when the tensors' elements are disjoint in memory, else ``[a, b]``: tensors ``a`` and
    ``b`` overlap (``a == b``: tensor ``a`` overlaps itself, as ``expand()`` views do)."""
    return list(_raw.shared_memory_pair(list(tensors)))


def _register_step_fake(name: str) -> None:
    """The fake kernel of the step op ``fastamp::<name>``, from its schema: every ``Tensor[]`` and
    ``Tensor?`` argument must be on the device of ``params[0]``."""
    # private-ok: an OpOverload's schema (argument names and types) has no public spelling.
    args = getattr(torch.ops.fastamp, name).default._schema.arguments
    names = [a.name for a in args]
    lists = [a.name for a in args if a.type.isSubtypeOf(torch._C.ListType.ofTensors())]
    scalars = [
        a.name
        for a in args
        if a.type.isSubtypeOf(torch._C.OptionalType.ofTensor()) and a.name not in lists
    ]

    def fake(*values: Any, **kwargs: Any) -> None:
        bound = {**dict(zip(names, values)), **kwargs}
        params = bound["params"]
        if params:
            check_fake_devices(
                name,
                params[0].device,
                [(n, bound[n]) for n in lists],
                {n: bound[n] for n in scalars},
                anchor="the device of params[0]",
            )
        return None

    register_fake(f"fastamp::{name}")(fake)


for _name in ("adam_step_", "sgd_step_", "adam_lowbit_step_", "sgd_lowbit_step_"):
    _register_step_fake(_name)
