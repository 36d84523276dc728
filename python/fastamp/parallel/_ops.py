"""Fake kernels of the gradient-bucket ops (for torch.compile tracing)."""

from __future__ import annotations

import torch

import fastamp._library  # noqa: F401  (loads the operator library)


def _check_devices(op: str, bucket, grads, **scalars) -> None:
    # The real kernels check these. Grads on another device than the bucket (a meta tensor among
    # CPU ones) dispatch to these fake kernels, which must raise too rather than return quietly.
    for i, g in enumerate(grads):
        if g.device != bucket.device:
            raise RuntimeError(
                f"fastamp::{op}: grads[{i}] is on {g.device} but the bucket is on {bucket.device}"
            )
    for name, t in scalars.items():
        if t.device != bucket.device:
            raise RuntimeError(f"fastamp::{op}: {name} is on {t.device}; expected {bucket.device}")


@torch.library.register_fake("fastamp::bucket_pack_")
def _bucket_pack_fake(bucket, grads, offsets, scale):
    _check_devices("bucket_pack_", bucket, grads)
    return None


@torch.library.register_fake("fastamp::bucket_unpack_")
def _bucket_unpack_fake(bucket, grads, offsets, inv_scale):
    _check_devices("bucket_unpack_", bucket, grads, inv_scale=inv_scale)
    return (bucket.new_empty((), dtype=torch.float32), bucket.new_empty((), dtype=torch.float32))
