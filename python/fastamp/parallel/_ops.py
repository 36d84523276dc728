"""The gradient-bucket ops: typed wrappers (what :mod:`fastamp.parallel` calls) and their fake
(meta) kernels for torch.compile tracing. Schemas and argument checks: csrc/parallel/ops.cpp."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastamp._library import (  # (importing it loads the operator library)
    StableOps,
    check_fake_devices,
    register_fake,
)

__all__ = ["bucket_divide_stats_", "bucket_pack_", "bucket_unpack_"]

_raw = StableOps("fastamp")  # the raw ops; this module is their typed layer


def bucket_pack_(
    bucket: Tensor, grads: Sequence[Tensor], offsets: Sequence[int], scale: float
) -> None:
    """``bucket[offsets[i] : offsets[i] + grads[i].numel()] = grads[i] * scale`` for every grad, in
    one multi-tensor pass (the bucket flat and contiguous)."""
    _raw.bucket_pack_(bucket, grads, list(offsets), float(scale))


def bucket_unpack_(
    bucket: Tensor, grads: Sequence[Tensor], offsets: Sequence[int], inv_scale: Tensor
) -> tuple[Tensor, Tensor]:
    """Copies each grad's span of the reduced ``bucket`` into it; returns ``(found_inf, sum of
    (g * inv_scale)^2)``, computed with the scaler's stats kernel over the same chunks (so equal
    bit for bit to ``fastamp::grad_stats`` over the grads)."""
    stats: tuple[Tensor, Tensor] = _raw.bucket_unpack_(bucket, grads, list(offsets), inv_scale)
    return stats


def bucket_divide_stats_(
    bucket: Tensor, lengths: Sequence[int], divisor: float, inv_scale: Tensor
) -> tuple[Tensor, Tensor]:
    """What DistributedDataParallel's comm hook does to a reduced bucket, in one pass: divides it in
    place (``bucket * (1 / divisor)``, skipped for 1) and returns ``(found_inf, sum of (x *
    inv_scale)^2)`` over its consecutive spans of ``lengths`` elements, bit for bit
    ``fastamp::grad_stats`` over those spans after the division."""
    stats: tuple[Tensor, Tensor] = _raw.bucket_divide_stats_(
        bucket, list(lengths), float(divisor), inv_scale
    )
    return stats


@register_fake("fastamp::bucket_divide_stats_")
def _bucket_divide_stats_fake(
    bucket: Tensor, lengths: Sequence[int], divisor: float, inv_scale: Tensor
) -> tuple[Tensor, Tensor]:
    check_fake_devices(
        "bucket_divide_stats_", bucket.device, [], {"inv_scale": inv_scale},
        anchor="the bucket's device",
    )  # fmt: skip
    return (bucket.new_empty((), dtype=torch.float32), bucket.new_empty((), dtype=torch.float32))


@register_fake("fastamp::bucket_pack_")
def _bucket_pack_fake(
    bucket: Tensor, grads: Sequence[Tensor], offsets: Sequence[int], scale: float
) -> None:
    check_fake_devices(
        "bucket_pack_", bucket.device, [("grads", grads)], anchor="the bucket's device"
    )
    return None


@register_fake("fastamp::bucket_unpack_")
def _bucket_unpack_fake(
    bucket: Tensor, grads: Sequence[Tensor], offsets: Sequence[int], inv_scale: Tensor
) -> tuple[Tensor, Tensor]:
    check_fake_devices(
        "bucket_unpack_",
        bucket.device,
        [("grads", grads)],
        {"inv_scale": inv_scale},
        anchor="the bucket's device",
    )
    return (bucket.new_empty((), dtype=torch.float32), bucket.new_empty((), dtype=torch.float32))
