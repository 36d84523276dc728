"""The fused clip without a loss scaler (bf16 and fp32 training): :func:`clip_grad_norm_`, and
the record of the steps its device-side guard skipped (:class:`NonfiniteGuard`), and the inbox
of the statistics fastamp's DDP measured for it (:class:`UnscaledStats`).

It is the scaler's clip with nothing to unscale: the same read-only stats pass (inf/NaN flags and
the norm in one launch), the same clip coefficient made on the device, and, for a fastamp.optim
optimizer, the write folded into the step's update (a :class:`fastamp.handoff.PendingClip` left
on the optimizer). A torch optimizer gets its grads clipped in place in one write pass, as
``torch.nn.utils.clip_grad_norm_`` leaves them. The scaler is one producer of a fused step's
control values (:class:`fastamp.handoff.AmpStep`), this clip another: the optimizers take both
through the same ``step()``.
"""

from __future__ import annotations

import weakref
from functools import reduce
from typing import Any

import torch
from torch import Tensor

from fastamp._step import to_device
from fastamp.handoff import AmpFusedOptimizer, AmpStep, GradStats, PendingClip
from fastamp.scaler import diagnostics
from fastamp.scaler._clip import GradNorm, check_clip_arguments, grad_norm, ones, unscale_and_clip
from fastamp.scaler._grads import DeviceGrads, GradReader
from fastamp.scaler.diagnostics import OverflowReport

__all__ = [
    "UNSCALED_STATS",
    "NonfiniteGuard",
    "UnscaledStats",
    "clip_grad_norm_",
    "nonfinite_guard",
]

_CALLER = "fastamp.clip_grad_norm_"


class NonfiniteGuard:
    """What ``clip_grad_norm_(optimizer, ..., skip_nonfinite=True)`` keeps for one optimizer,
    on the device (no host sync in the step): ``skipped``, how many guarded steps had
    an inf/NaN norm (their ``step()`` wrote nothing; int64 []), and the per-parameter inf/NaN flags of the
    last of them, read by :meth:`report` (one sync, meant for after the fact)."""

    def __init__(self, device: torch.device) -> None:
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.records: dict[int, diagnostics.OverflowRecord] = {}

    def note(self, key: int, entries: list[tuple[DeviceGrads, Tensor]], found: Tensor) -> None:
        """This clip's flags kept when ``found > 0`` (indexed by the skips before it), then
        ``skipped`` counts it: three device ops, no sync."""
        if entries:
            diagnostics.record_flags(self.records, key, entries, found, self.skipped)
        self.skipped.add_(found > 0)

    def report(self, model: torch.nn.Module | None = None) -> OverflowReport:
        """The parameters whose grads were inf/NaN at the last skipped step (``update`` is that
        skip's 0-based index among the skips); names from ``model`` when given. Syncs."""
        return diagnostics.report(self.records, model)


class UnscaledStats:
    """The scaler-free clip's inbox for the statistics fastamp's DDP measures while it unpacks
    the all-reduced buckets (:class:`fastamp.handoff.GradStats`, the inf flag and the sum of
    squares of the grads as they are): DDP hands each backward's here unless a GradScaler is
    registered, and :func:`clip_grad_norm_` (norm 2, one device) reuses them instead of reading
    the grads again, only while ``stats.current_for(params, None)``: the same grads, unwritten
    since. One per process; the latest backward's statistics are kept."""

    def __init__(self) -> None:
        self.stats: GradStats | None = None

    def current_scale(self) -> Tensor | None:
        return None  # the grads are not scaled

    def note_grad_stats(self, stats: GradStats) -> None:
        if not isinstance(stats, GradStats):
            raise TypeError(
                f"UnscaledStats.note_grad_stats: stats must be a fastamp.handoff.GradStats, got "
                f"{type(stats).__name__}"
            )
        self.stats = stats

    def reusable(self, optimizer: Any) -> tuple[Tensor, Tensor] | None:
        """(found_inf, sum of squares) of ``optimizer``'s grads, when DDP measured exactly them."""
        stats = self.stats
        if stats is None:
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not stats.current_for(params, None):
            return None
        return stats.found_inf, stats.sum_sq


#: DDP's statistics for the scaler-free clip (see :class:`UnscaledStats`).
UNSCALED_STATS = UnscaledStats()

# The caches of the grads' collection (one per optimizer, weakly keyed) and each guarded
# optimizer's record, shared by every caller of clip_grad_norm_.
_READER = GradReader()
_GUARDS: weakref.WeakKeyDictionary[Any, NonfiniteGuard] = weakref.WeakKeyDictionary()


def nonfinite_guard(optimizer: torch.optim.Optimizer) -> NonfiniteGuard | None:
    """The :class:`NonfiniteGuard` of ``optimizer``: made by its first ``clip_grad_norm_(...,
    skip_nonfinite=True)``; None before."""
    try:
        return _GUARDS.get(optimizer)
    except TypeError:
        return None


def _torch_norm_dtype(per_device: dict[torch.device, DeviceGrads]) -> torch.dtype:
    """The dtype of the norm torch's clip returns: its grads' dtypes promoted (it takes the norm
    of each dtype's grads in that dtype); float32 with no grads."""
    dtypes = {g.dtype for entry in per_device.values() for g in entry.grads}
    return reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def _check_flags(error_if_nonfinite: object, foreach: object, skip_nonfinite: object) -> None:
    for name, value, allowed in (
        ("error_if_nonfinite", error_if_nonfinite, (bool,)),
        ("skip_nonfinite", skip_nonfinite, (bool,)),
        ("foreach", foreach, (bool, type(None))),
    ):
        if not isinstance(value, allowed):
            expected = "True or False" + (" or None" if name == "foreach" else "")
            raise TypeError(f"{_CALLER}: {name} must be {expected}, got {value!r}")


def clip_grad_norm_(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    skip_nonfinite: bool = False,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``optimizer``'s params, fused, for training
    without a loss scaler (bf16 autocast or params, fp32). Returns the total norm as torch's
    does (a device tensor of the grads' promoted dtype; nothing syncs with the host).

    For a ``fastamp.optim`` optimizer the grads are only read (one pass: inf/NaN flags and the
    norm); the clip coefficient ``min(max_norm / (norm + 1e-6), 1)`` is applied inside its next
    ``step()``, in registers, so the grads keep their unclipped values until then. Any other
    optimizer gets its grads clipped in place in one more pass, as with torch's.

    ``skip_nonfinite=True`` (fastamp.optim optimizers): when the norm is inf/NaN the next step
    writes nothing (params, state, step counts), decided on the device; :func:`nonfinite_guard`
    counts the skips and reports which param held the inf/NaN. The default keeps torch's
    behaviour: a NaN norm makes NaN grads, and the step propagates them.

    As torch's: ``error_if_nonfinite=True`` raises RuntimeError (one host sync) when the norm is
    inf/NaN, before anything is clipped. ``foreach`` is accepted and has no effect: the kernel
    is fused on every device. Unlike torch's, the first argument is the optimizer (its param
    groups' params are clipped), and a negative ``max_norm`` or ``norm_type <= 0`` raises.
    """
    norm_type_f = check_clip_arguments(optimizer, max_norm, norm_type)
    _check_flags(error_if_nonfinite, foreach, skip_nonfinite)
    fused = isinstance(optimizer, AmpFusedOptimizer)
    if skip_nonfinite and not fused:
        raise ValueError(
            f"{_CALLER}: skip_nonfinite=True needs a fastamp.optim optimizer (its kernel makes "
            f"the skip on the device), got {type(optimizer).__name__}. Expected e.g. "
            "fastamp.optim.AdamW, or, with a torch optimizer, `if torch.isfinite(norm): "
            "optimizer.step()` (a host sync)"
        )
    with torch.no_grad():
        pending = optimizer.pending_clip if isinstance(optimizer, AmpFusedOptimizer) else None
        if pending is not None:
            _apply_pending(optimizer, pending)
        return _clip(optimizer, float(max_norm), norm_type_f, error_if_nonfinite,
                     skip_nonfinite, fused)  # fmt: skip


def _apply_pending(optimizer: Any, pending: PendingClip) -> None:
    """A second clip before the step: the first one's write pass is made now, so this clip
    measures the grads torch's first clip left."""
    if not pending.current() and any(p.grad is not None for p in pending.params):
        raise RuntimeError(
            f"{_CALLER}: a grad was written or replaced after the previous clip_grad_norm_ "
            "measured it, and no step() took that clip. fastamp applies the coefficient in the "
            "step, so it cannot be applied to grads changed since. Expected step() after each "
            "clip, or optimizer.zero_grad() to drop it"
        )
    per_device = _READER.collect(optimizer, True, _CALLER)
    invs = {dev: ones(dev) for dev in per_device}
    unscale_and_clip(per_device, invs, pending.total_norm, pending.max_norm, lambda: None)
    optimizer.pending_clip = None


def _clip(
    optimizer: Any,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    skip_nonfinite: bool,
    fused: bool,
) -> Tensor:
    def read(per_device: dict[torch.device, DeviceGrads]) -> GradNorm:
        invs = {dev: ones(dev) for dev in per_device}
        first = next(iter(per_device), torch.device("cpu"))
        reuse = None
        if norm_type == 2.0 and len(per_device) == 1 and not torch.compiler.is_compiling():
            # fastamp's DDP already read these grads for the inf check and the sum of squares.
            reuse = UNSCALED_STATS.reusable(optimizer)
        return grad_norm(per_device, invs, norm_type, max_norm, first, reuse)

    if fused:  # only read: the reader leaves the checks to the op (see GradReader.read)
        per_device, (found, flags, total_norm, coef) = _READER.read(optimizer, _CALLER, read)
    else:
        per_device = _READER.collect(optimizer, True, _CALLER)
        found, flags, total_norm, coef = read(per_device)
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    if fused:
        found_total = None
        if skip_nonfinite:
            values = [to_device(f, total_norm.device) for f in found.values()]
            found_total = reduce(torch.add, values) if values else torch.zeros_like(total_norm)
            _guard(optimizer, total_norm.device).note(
                id(optimizer), [(per_device[d], flags[d]) for d in flags], found_total
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen = None
        if len(per_device) == 1:
            (entry,) = per_device.values()
            # A replay's read of plain grads, one per param in order: these are the p.grad.
            if entry.plain and entry.counts is None and len(entry.grads) == len(params):
                seen = entry.grads
        optimizer.pending_clip = PendingClip.of(
            AmpStep(None, found_total, coef), total_norm, max_norm, params, seen
        )
    else:
        invs = {dev: ones(dev) for dev in per_device}
        unscale_and_clip(per_device, invs, total_norm, max_norm, lambda: None)
    dtype = _torch_norm_dtype(per_device)
    return total_norm if dtype is torch.float32 else total_norm.to(dtype)


def _guard(optimizer: Any, device: torch.device) -> NonfiniteGuard:
    guard = _GUARDS.get(optimizer)
    if guard is None:  # (setdefault: of two threads' first calls, one guard is kept)
        guard = _GUARDS.setdefault(optimizer, NonfiniteGuard(device))
    return guard
