"""Typed Python wrappers and fake (meta) kernels of the ``fastamp`` scaler ops.

The schemas are in csrc/scaler/ops.cpp; the fake kernels registered here (``register_fake``)
let ``torch.compile`` trace the ops on FakeTensors without running them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastamp._checks import dense_list
from fastamp._library import (
    KeySet,  # (importing it loads the operator library)
    StableOps,
    call_direct,
    check_fake_devices,
    register_fake,
)

__all__ = [
    "grad_stats",
    "non_finite_check_and_unscale_",
    "clip_unscale_",
    "clip_coef",
    "record_overflow_",
    "update_scale_",
]

_raw = StableOps("fastamp")  # the raw ops; this module is their typed layer


def _on_dense(op: str, grads: Sequence[Tensor], *args: Any) -> Any:
    """``fastamp::<op>(grads, *args)``. A sparse grad cannot reach a kernel (the dispatcher
    refuses the call before any kernel runs, naming only a Sparse* backend); that refusal is
    replaced by :func:`dense_list`'s message, naming the grad. Checked after a refusal, not
    before every call: no Python per grad on the way to the kernel."""
    grads = list(grads)
    try:
        return getattr(_raw, op)(grads, *args)
    except (NotImplementedError, RuntimeError):
        dense_list(grads, op, "grads")
        raise


def grad_stats(
    grads: Sequence[Tensor], inv_scale: Tensor, norm_type: float = 2.0, keyset: KeySet | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Read-only pass over ``grads``: ``(found_inf, norm_pow_sum, tensor_found_inf)``.

    ``found_inf`` is a float32 scalar tensor (1.0 when any element is inf/NaN), ``norm_pow_sum`` the
    fp32 sum of ``|g * inv_scale| ** norm_type`` over all elements (the max for ``norm_type=inf``),
    ``tensor_found_inf`` a bool tensor flagging which grads held inf/NaN. Nothing is written into
    ``grads``, and nothing syncs with the host. Grads may mix float32, float16, bfloat16 and float64.
    With a backend ``keyset``, the call goes straight to that kernel (the caller vouches that the
    grads are plain dense tensors there, and that fastamp._library.direct_call_allowed()).
    """
    if keyset is not None and type(inv_scale) is Tensor:
        # Plain dense grads collected by a replay (see fastamp._library.call_direct).
        direct: tuple[Tensor, Tensor, Tensor] = call_direct(
            torch.ops.fastamp.grad_stats.default, keyset, (), grads, inv_scale, float(norm_type)
        )
        return direct
    stats: tuple[Tensor, Tensor, Tensor] = _on_dense(
        "grad_stats", grads, inv_scale, float(norm_type)
    )
    return stats


def non_finite_check_and_unscale_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    tensor_found_inf: Tensor | None = None,
) -> Tensor:
    """``grads[i] *= inv_scale`` in place, flagging inf/NaN: ``torch._amp_foreach_non_finite_check_and_unscale_``.

    Differs from PyTorch's op in that one call takes mixed dtypes (bfloat16 included, on CUDA too)
    and it also reports *which* tensors were non-finite in ``tensor_found_inf`` (allocated when
    None and returned).
    """
    grads = list(grads)
    if tensor_found_inf is None:
        tensor_found_inf = torch.zeros(len(grads), dtype=torch.bool, device=inv_scale.device)
    _on_dense("non_finite_check_and_unscale_", grads, found_inf, inv_scale, tensor_found_inf)
    return tensor_found_inf


def clip_unscale_(
    grads: Sequence[Tensor], inv_scale: Tensor, total_norm: Tensor, max_norm: float
) -> None:
    """``grads[i] *= inv_scale * min(max_norm / (total_norm + 1e-6), 1)`` in one write pass."""
    _on_dense("clip_unscale_", grads, inv_scale, total_norm, float(max_norm))


def clip_coef(
    norm_pow_sum: Tensor, norm_type: float, max_norm: float, keyset: KeySet | None = None
) -> tuple[Tensor, Tensor]:
    """``(total_norm, clip_coef)`` from the norm's power sum in one launch: the root (norm_type
    2: the square root; 1 and inf: the sum or max itself) and ``min(max_norm / (total_norm +
    1e-6), 1)`` rounded as torch.nn.utils.clip_grad_norm_ rounds it. With a backend ``keyset``
    (see :func:`grad_stats`), straight to that kernel."""
    if keyset is not None and type(norm_pow_sum) is Tensor and not norm_pow_sum.requires_grad:
        direct: tuple[Tensor, Tensor] = call_direct(
            torch.ops.fastamp.clip_coef.default, keyset, (), norm_pow_sum, float(norm_type),
            float(max_norm),
        )  # fmt: skip
        return direct
    out: tuple[Tensor, Tensor] = _raw.clip_coef(norm_pow_sum, float(norm_type), float(max_norm))
    return out


def record_overflow_(
    flags_record: Tensor,
    update_record: Tensor,
    flags: Tensor,
    found_inf: Tensor,
    update_count: Tensor,
    keyset: KeySet | None = None,
) -> None:
    """When ``found_inf > 0``: ``flags_record[:] = flags`` and ``update_record = update_count``,
    on the device in one launch; else nothing is written. With a backend ``keyset`` (see
    :func:`grad_stats`), straight to that kernel when the five tensors are plain ones."""
    args = (flags_record, update_record, flags, found_inf, update_count)
    if keyset is not None and all(type(t) is Tensor and not t.requires_grad for t in args):
        call_direct(
            torch.ops.fastamp.record_overflow_.default, keyset, (flags_record, update_record), *args
        )
        return
    _raw.record_overflow_(*args)


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    keyset: KeySet | None = None,
) -> None:
    """Device-side loss-scale update (``torch._amp_update_scale_`` plus hysteresis and bounds).
    With a backend ``keyset`` (see :func:`grad_stats`), straight to that kernel when the four
    tensors are plain ones, their write counters bumped here as the dispatcher would."""
    written = (scale, growth_tracker, hysteresis_tracker)
    if keyset is not None and all(
        type(t) is Tensor and not t.requires_grad for t in (*written, found_inf)
    ):
        call_direct(torch.ops.fastamp.update_scale_.default, keyset, written,
            scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
            float(backoff_factor), int(growth_interval), int(hysteresis), float(min_scale),
            float(max_scale),
        )  # fmt: skip
        return
    _raw.update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        float(growth_factor),
        float(backoff_factor),
        int(growth_interval),
        int(hysteresis),
        float(min_scale),
        float(max_scale),
    )


# --- fake kernels (shapes/dtypes/devices only) ---------------------------------------------------


@register_fake("fastamp::grad_stats")
def _grad_stats_fake(
    grads: Sequence[Tensor], inv_scale: Tensor, norm_type: float = 2.0
) -> tuple[Tensor, Tensor, Tensor]:
    check_fake_devices(
        "grad_stats", inv_scale.device, [("grads", grads)], anchor="the device of inv_scale"
    )
    dev = inv_scale.device
    return (
        inv_scale.new_empty((), dtype=torch.float32, device=dev),
        inv_scale.new_empty((), dtype=torch.float32, device=dev),
        inv_scale.new_empty((len(grads),), dtype=torch.bool, device=dev),
    )


@register_fake("fastamp::non_finite_check_and_unscale_")
def _unscale_fake(
    grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor, tensor_found_inf: Tensor
) -> None:
    check_fake_devices(
        "non_finite_check_and_unscale_",
        inv_scale.device,
        [("grads", grads)],
        {"found_inf": found_inf, "tensor_found_inf": tensor_found_inf},
        anchor="the device of inv_scale",
    )
    return None


@register_fake("fastamp::clip_unscale_")
def _clip_unscale_fake(
    grads: Sequence[Tensor], inv_scale: Tensor, total_norm: Tensor, max_norm: float
) -> None:
    check_fake_devices(
        "clip_unscale_",
        inv_scale.device,
        [("grads", grads)],
        {"total_norm": total_norm},
        anchor="the device of inv_scale",
    )
    return None


@register_fake("fastamp::clip_coef")
def _clip_coef_fake(
    norm_pow_sum: Tensor, norm_type: float, max_norm: float
) -> tuple[Tensor, Tensor]:
    dev = norm_pow_sum.device
    return (
        norm_pow_sum.new_empty((), dtype=torch.float32, device=dev),
        norm_pow_sum.new_empty((), dtype=torch.float32, device=dev),
    )


@register_fake("fastamp::record_overflow_")
def _record_overflow_fake(
    flags_record: Tensor,
    update_record: Tensor,
    flags: Tensor,
    found_inf: Tensor,
    update_count: Tensor,
) -> None:
    check_fake_devices(
        "record_overflow_",
        flags_record.device,
        (),
        {
            "update_record": update_record,
            "flags": flags,
            "found_inf": found_inf,
            "update_count": update_count,
        },
        anchor="the device of flags_record",
    )
    return None


@register_fake("fastamp::update_scale_")
def _update_scale_fake(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    check_fake_devices(
        "update_scale_",
        scale.device,
        (),
        {
            "growth_tracker": growth_tracker,
            "hysteresis_tracker": hysteresis_tracker,
            "found_inf": found_inf,
        },
        anchor="the device of scale",
    )
    return None
