"""The arithmetic of ``GradScaler.clip_grad_norm_`` over an optimizer's grads, as functions of
explicit inputs (the scaler keeps the per-iteration state): the argument checks, the read-only
stats pass (inf flags and the norm, a :class:`GradNorm`, or DDP's measured statistics reused;
over a sharded model's shards, both in one all-reduce), the write pass (unscale and clip
together) for optimizers that do not take the clip into their own kernel, and ``unscale_``'s
pass and the read-only inf check of grads that a fused optimizer unscales itself."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from fastamp._library import backend_keyset, direct_call_allowed
from fastamp._step import to_device
from fastamp.scaler import _ops
from fastamp.scaler._grads import DeviceGrads


class GradNorm(NamedTuple):
    """The stats pass's result: each device's found_inf and per-grad flags (no flags where DDP's
    statistics were reused), the total norm of the unscaled grads on the scale's device, and the
    clip coefficient ``min(max_norm / (total_norm + 1e-6), 1)`` beside it."""

    found: dict[torch.device, Tensor]
    flags: dict[torch.device, Tensor]
    total_norm: Tensor
    clip_coef: Tensor


def check_clip_arguments(optimizer: object, max_norm: object, norm_type: object) -> float:
    """Raises for arguments ``clip_grad_norm_`` cannot take; returns ``norm_type`` as a float."""
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(
            "clip_grad_norm_: optimizer must be the torch.optim.Optimizer whose grads to clip, "
            f"got {type(optimizer).__name__}. fastamp clips an optimizer's params, not an "
            "iterable of tensors: expected scaler.clip_grad_norm_(optimizer, max_norm)"
        )
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (max_norm >= 0):
        raise ValueError(
            f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm!r} "
            "(expected e.g. 1.0; inf disables clipping)"
        )
    try:
        value = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(norm_type, bool) or not (value > 0):
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r} "
            "(expected e.g. 2.0, 1.0 or float('inf'))"
        )
    return value


def grad_norm(
    per_device: dict[torch.device, DeviceGrads],
    invs: dict[torch.device, Tensor],
    norm_type: float,
    max_norm: float,
    scale_device: torch.device,
    reuse: tuple[Tensor, Tensor] | None,
) -> GradNorm:
    """The read-only stats pass over the grads (each multiplied by its device's ``invs``), or
    ``reuse``'s (found_inf, sum of squares) measured by DDP over the same grads; then the norm's
    root and the clip coefficient, in one launch (``fastamp::clip_coef``) for norms 1, 2 and inf."""
    found: dict[torch.device, Tensor] = {}
    flags: dict[torch.device, Tensor] = {}
    pow_sums: list[Tensor] = []
    direct = not torch.is_grad_enabled() and direct_call_allowed()
    if reuse is not None:
        (dev,) = per_device
        found[dev] = to_device(reuse[0], dev)
        pow_sums.append(to_device(reuse[1], scale_device))
    else:
        for dev, entry in per_device.items():
            keyset = backend_keyset(dev) if direct and entry.plain else None
            f, pow_sum, flags[dev] = _ops.grad_stats(entry.grads, invs[dev], norm_type, keyset)
            if entry.shard is not None:  # sharded grads (FSDP2): both over every shard, at once
                f, pow_sum = entry.shard.reduce_stats(f, pow_sum, norm_type)
            found[dev] = f
            pow_sums.append(to_device(pow_sum, scale_device))
    if not pow_sums:
        total = torch.zeros((), dtype=torch.float32, device=scale_device)
    else:
        total = pow_sums[0]
        for p in pow_sums[1:]:
            total = torch.maximum(total, p) if math.isinf(norm_type) else total + p
    if math.isinf(norm_type) or norm_type in (1.0, 2.0):
        keyset = backend_keyset(scale_device) if direct and type(total) is Tensor else None
        total_norm, coef = _ops.clip_coef(total, norm_type, max_norm, keyset)
        return GradNorm(found, flags, total_norm, coef)
    total_norm = total.pow(1.0 / norm_type)  # torch's root, as clip_grad_norm_ takes it
    return GradNorm(found, flags, total_norm, clip_coefficient(total_norm, max_norm))


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """PyTorch's clip coefficient, ``min(max_norm / (norm + 1e-6), 1)``, on the device: torch's
    own ops (``max_norm / t`` is ``t.reciprocal() * max_norm``, then ``clamp(max=1)``), in place
    on the one new tensor, which skips Tensor.__rdiv__'s Python and two allocations."""
    return (total_norm + 1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0)


def unscale_and_clip(
    per_device: dict[torch.device, DeviceGrads],
    invs: dict[torch.device, Tensor],
    total_norm: Tensor,
    max_norm: float,
    written: Callable[[], None],
) -> None:
    """The write pass: each grad multiplied by ``inv_scale * clip_coef`` in one launch per
    device; ``written()`` after each (a launch checks all its input before writing any)."""
    for dev, entry in per_device.items():
        _ops.clip_unscale_(entry.grads, invs[dev], to_device(total_norm, dev), float(max_norm))
        written()


_ONES: dict[torch.device, Tensor] = {}


def ones(device: torch.device) -> Tensor:
    """The inverse scale of grads that are not scaled (read by the kernels, never written)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def inf_flags(
    per_device: dict[torch.device, DeviceGrads],
) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
    """The read-only inf/NaN check of grads a fused optimizer unscales itself (torch's scaler
    unscales them by 1.0 here, rewriting each): each device's found_inf (reduced over the
    shards' ranks) and per-grad flags."""
    found: dict[torch.device, Tensor] = {}
    flags: dict[torch.device, Tensor] = {}
    direct = direct_call_allowed()
    for dev, entry in per_device.items():
        keyset = backend_keyset(dev) if direct and entry.plain else None
        f, _, flags[dev] = _ops.grad_stats(entry.grads, ones(dev), 2.0, keyset)
        found[dev] = f if entry.shard is None else entry.shard.reduce_found(f)
    return found, flags


def unscale(
    per_device: dict[torch.device, DeviceGrads],
    inv_scale: Tensor,
    found_inf: Tensor,
    written: Callable[[], None],
) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
    """``unscale_``'s pass: each device's grads times ``inv_scale`` in place, flagged; returns
    each device's found_inf (a copy of ``found_inf`` updated; over the shards' ranks for sharded
    grads: every rank skips if any rank's shard overflowed) and per-grad flags. ``written()``
    after each launch (the op checks all its input before writing any)."""
    found: dict[torch.device, Tensor] = {}
    flags: dict[torch.device, Tensor] = {}
    for dev, entry in per_device.items():
        f = found_inf.to(device=dev, non_blocking=True, copy=True)
        flags[dev] = _ops.non_finite_check_and_unscale_(entry.grads, f, to_device(inv_scale, dev))
        written()
        found[dev] = f if entry.shard is None else entry.shard.reduce_found(f)
    return found, flags


def norm_reader(
    inv_scale: Tensor,
    norm_type: float,
    max_norm: float,
    device: torch.device,
    reuse: tuple[Tensor, Tensor] | None,
) -> Callable[[dict[torch.device, DeviceGrads]], GradNorm]:
    """The clip's read of the grads, for :class:`fastamp.scaler._grads.GradReader.read`: the
    stats pass over grads times ``inv_scale`` (each device's copy of it), or ``reuse`` (DDP's
    measurement of these very grads) when they are on one device."""

    def read(per_device: dict[torch.device, DeviceGrads]) -> GradNorm:
        invs = {dev: to_device(inv_scale, dev) for dev in per_device}
        measured = reuse if len(per_device) == 1 else None
        return grad_norm(per_device, invs, norm_type, max_norm, device, measured)

    return read
