"""The typed hand-offs between fastamp's capabilities: what one class gives another in a step.

A mixed-precision training step through fastamp reads as one line::

    scaler.scale(loss).backward()          # GradScaler: the loss times the device scale
      -> DistributedDataParallel           # buckets, all-reduces, unpacks the grads, measuring them
      -> GradStats                         #   (found_inf, sum of squares): DDP -> GradScaler
    scaler.clip_grad_norm_(opt, max_norm)  # GradScaler: the norm (reusing GradStats when current)
    scaler.step(opt)                       # -> AmpStep (inv_scale, found_inf, clip_coef)
      -> fused optimizer kernel            #   GradScaler -> optimizer: unscale, clip, skip, update
    scaler.update()                        # the scale, on the device

Every arrow is one of the objects below, passed through a public method; no class reads or writes
another's private attributes (``tests/test_architecture.py`` checks the sources).

* :class:`GradStats` -- DDP to the scaler, through :meth:`GradStatsConsumer.note_grad_stats`.
* :class:`FlatGrads` -- an optimizer with flat buffers to the scaler, through
  :meth:`AmpFusedOptimizer.amp_flat_grads`: its grads as a few flat tensors to measure.
* :class:`PendingClip` -- the scaler-free clip (:func:`fastamp.clip_grad_norm_`) to a
  :class:`AmpFusedOptimizer`, left as its ``pending_clip`` attribute for the next ``step()``.
* :class:`AmpStep` -- the scaler to a :class:`AmpFusedOptimizer`, for exactly one ``step()`` call:
  the scaler sets it as the optimizer's ``amp_step`` attribute while it calls ``optimizer.step()``
  (the public entry point, so LR schedulers and wrappers see the step) and removes it when that
  call returns or raises, as torch's scaler sets ``grad_scale`` / ``found_inf`` on its fused
  optimizers; the optimizer's ``step`` reads it and sets it to None (once per call).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from fastamp._step import to_device

__all__ = [
    "AmpFusedOptimizer",
    "AmpStep",
    "FlatGrads",
    "GradStats",
    "GradStatsConsumer",
    "PendingClip",
]


# ---------------------------------------------------------------------------- scaler -> optimizer
@dataclass(frozen=True)
class AmpStep:
    """What :class:`fastamp.GradScaler` hands a fused optimizer for one step (device tensors only:
    nothing here syncs with the host).

    * ``inv_scale``: float32 [], the factor that unscales the grads, or None when they are already
      unscaled (``scaler.unscale_`` ran);
    * ``found_inf``: float32 [], non-zero when any grad held inf/NaN: the kernel then writes nothing
      and the step counters hold; None for an unconditional step;
    * ``clip_coef``: float32 [], ``min(1, max_norm / (norm + 1e-6))`` from
      ``scaler.clip_grad_norm_``, applied in the update pass, or None (no clipping).
    """

    inv_scale: Tensor | None
    found_inf: Tensor | None
    clip_coef: Tensor | None = None

    def to(self, device: torch.device) -> AmpStep:
        """These scalars where a kernel on ``device`` reads them (no copy of one already there,
        no sync either way)."""
        inv, found, coef = self.inv_scale, self.found_inf, self.clip_coef
        moved = (to_device(inv, device), to_device(found, device), to_device(coef, device))
        if moved[0] is inv and moved[1] is found and moved[2] is coef:
            return self
        return AmpStep(*moved)


@dataclass(frozen=True, eq=False)
class PendingClip:
    """What :func:`fastamp.clip_grad_norm_` (the scaler-free clip) leaves on a fused optimizer for
    its next ``step()``: the grads were only read, and the step's kernel multiplies each by
    ``amp.clip_coef`` in registers (``amp.inv_scale`` is None: nothing to unscale); with
    ``skip_nonfinite=True``, ``amp.found_inf`` makes the kernel write nothing when the norm was
    inf/NaN. ``total_norm``/``max_norm`` let a second clip before the step make this write pass
    itself first. ``grads``/``versions`` are the grads it measured and their write counters: a
    step or clip that finds any of them replaced or written since refuses the stale
    coefficient (torch's clip had already scaled them; an accumulation since cannot be
    reproduced)."""

    amp: AmpStep
    total_norm: Tensor
    max_norm: float
    params: tuple[Tensor, ...]
    grads: tuple[Tensor | None, ...]
    versions: tuple[int, ...] | None

    @classmethod
    def of(
        cls,
        amp: AmpStep,
        total_norm: Tensor,
        max_norm: float,
        params: Sequence[Tensor],
        grads: Sequence[Tensor] | None = None,
    ) -> PendingClip:
        """The clip of ``params``' grads as they are now (``grads``: the ``p.grad`` of each, when
        the caller has just read them; not tracked while torch.compile traces: clip and step are
        then one graph, with nothing between them)."""
        if torch.compiler.is_compiling():
            return cls(amp, total_norm, max_norm, (), (), None)
        grads = tuple(map(_GRAD, params)) if grads is None else tuple(grads)
        return cls(amp, total_norm, max_norm, tuple(params), grads, _versions(grads))

    def current(self) -> bool:
        """Whether every param still has the grad that was measured, unwritten since."""
        if self.versions is None:
            return True
        if not all(map(is_, map(_GRAD, self.params), self.grads)):
            return False
        return _versions(self.grads) == self.versions


@dataclass(frozen=True, eq=False)
class FlatGrads:
    """An optimizer's grads as a few flat tensors (``flat_buffers=True``): ``grads[k]`` is one
    (dtype, device) grad buffer whose views are the grads of the params ``param_ids[k]`` (at
    ``places[k]``, (group, index)); ``counts[k]`` is ``len(param_ids[k])`` (the buffer's inf/NaN
    flag stands for each of those params). The gaps between the views are zeros."""

    grads: tuple[Tensor, ...]
    param_ids: tuple[list[int], ...]
    places: tuple[list[tuple[int, int]], ...]
    counts: tuple[int, ...]


class AmpFusedOptimizer:
    """Marker base of optimizers whose ``step()`` unscales, clips and skips inside its own kernel.

    Contract: ``step()`` reads :attr:`amp_step` once and sets it to None; with an :class:`AmpStep`
    it applies it, else it follows ``torch.amp.GradScaler``'s protocol for optimizers that unscale themselves
    (``grad_scale`` / ``found_inf`` attributes, set by torch's scaler on ``fused=True``
    optimizers). :class:`fastamp.GradScaler` then skips its unscale pass for them."""

    # torch.amp.GradScaler's flag for that protocol (public in PyTorch's optimizer contract).
    _step_supports_amp_scaling = True
    #: The AmpStep :class:`fastamp.GradScaler` hands this optimizer for the ``step()`` it is
    #: calling: set just before that call and removed when it returns or raises, read (and set
    #: to None) by the step; None at any other time.
    amp_step: AmpStep | None = None
    #: What :func:`fastamp.clip_grad_norm_` measured for the next ``step()``, which takes it (and
    #: sets it to None); ``zero_grad`` drops it with the grads it was for.
    pending_clip: PendingClip | None = None

    def amp_flat_grads(self) -> FlatGrads | None:
        """The grads as flat buffers, for :class:`fastamp.GradScaler` to measure (and, for
        ``unscale_``, write) in a few launches; None when they are not all views of the
        optimizer's flat grad buffers this step (the scaler then collects them per parameter)."""
        return None


# ---------------------------------------------------------------------------- DDP -> scaler
@dataclass(frozen=True)
class GradStats:
    """What the unpack of one DDP backward measured, handed to the scaler.

    ``found_inf`` (float32 [], 1.0 if any all-reduced grad held inf/NaN) and ``sum_sq`` (float32 [],
    the sum of squares of the grads times the inverse scale) were computed from exactly the tensors
    in ``grads`` (weak references) at the version counters in ``versions``, with the scale tensor
    ``scale`` at version ``scale_version``. :meth:`current_for` says whether they still describe an
    optimizer's grads: every grad the same tensor, not written since, and the scale unchanged.
    Anything else (``p.grad.mul_``, ``nan_to_num_``, a grad replaced or set to None) and the scaler
    measures the grads itself."""

    found_inf: Tensor
    sum_sq: Tensor
    params: tuple[Tensor, ...]
    grads: tuple[weakref.ref[Tensor], ...]
    versions: tuple[int, ...]
    scale: weakref.ref[Tensor] | None
    scale_version: int

    @classmethod
    def measured(
        cls,
        found_inf: Tensor,
        sum_sq: Tensor,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        scale: Tensor | None,
    ) -> GradStats:
        """The record of ``found_inf`` / ``sum_sq`` just computed from ``grads`` (of ``params``)
        with ``scale``."""
        return cls(
            found_inf=found_inf,
            sum_sq=sum_sq,
            params=tuple(params),
            grads=tuple(weakref.ref(g) for g in grads),
            versions=tuple(_version(g) for g in grads),
            scale=weakref.ref(scale) if scale is not None else None,
            scale_version=_version(scale) if scale is not None else -1,
        )

    def current_for(self, params: Sequence[Tensor], scale: Tensor | None) -> bool:
        """``scale``: the scaler's, or None for grads that are not scaled (the scaler-free
        clip), which matches only statistics measured with no scale."""
        if scale is None:
            if self.scale is not None:
                return False
        elif self.scale is None or self.scale() is not scale:
            return False
        elif _version(scale) != self.scale_version:
            return False
        with_grad = [p for p in params if p.grad is not None]
        if len(with_grad) != len(self.params) or {id(p) for p in with_grad} != {
            id(p) for p in self.params
        }:
            return False
        for p, ref, v in zip(self.params, self.grads, self.versions):
            g = p.grad
            if g is None or ref() is not g or _version(g) != v:
                return False
        return True


_GRAD = attrgetter("grad")
# private-ok: Tensor._version is PyTorch's in-place write counter (see _version below).
_VERSION = attrgetter("_version")


def _versions(grads: tuple[Tensor | None, ...]) -> tuple[int, ...]:
    """The write counters of the grads that are not None (at C speed when none is)."""
    if all(map(is_not, grads, repeat(None))):  # (`None in grads` would call Tensor.__eq__)
        return tuple(map(_VERSION, grads))
    return tuple(map(_VERSION, [g for g in grads if g is not None]))


def _version(t: Tensor) -> int:
    # private-ok: Tensor._version is PyTorch's in-place write counter (autograd's own check
    # reads it); there is no public spelling.
    return t._version


@runtime_checkable
class GradStatsConsumer(Protocol):
    """What DDP needs of a consumer to hand it :class:`GradStats`: :class:`fastamp.GradScaler`, or
    without a scaler the scaler-free clip's (:data:`fastamp.scaler.clip.UNSCALED_STATS`)."""

    def current_scale(self) -> Tensor | None:
        """The scale as a device tensor (no sync), or None before the first ``scale()``."""

    def note_grad_stats(self, stats: GradStats) -> None:
        """Keeps ``stats`` for this iteration's ``clip_grad_norm_`` (dropped by ``update()``)."""
