"""Fake kernels of the gradient-bucket ops (for torch.compile tracing)."""

from __future__ import annotations

import torch

import fastamp._library  # noqa: F401  (loads the operator library)


@torch.library.register_fake("fastamp::bucket_pack_")
def _bucket_pack_fake(bucket, grads, offsets, scale):
    return None


@torch.library.register_fake("fastamp::bucket_unpack_")
def _bucket_unpack_fake(bucket, grads, offsets, inv_scale):
    return (bucket.new_empty((), dtype=torch.float32), bucket.new_empty((), dtype=torch.float32))
