"""References of the low-precision kernels' stochastic rounding (csrc/optim/lowbit_math.h), in
torch ops, for the tests: the per-tensor key, the per-element random bits, and the rounding."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bf16_stochastic", "sr_bits", "sr_key"]

_M32 = 0xFFFFFFFF


def _mix32(x: Tensor, tail: bool = False) -> Tensor:
    """lowbias32 (lowbit_math.h ``mix32``), or without its first xorshift (``mix32_tail``)."""
    x = x & _M32
    if not tail:
        x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _word(v: int) -> Tensor:
    return torch.tensor([v & _M32], dtype=torch.int64)


def sr_key(seed: int, step: int, position: int) -> int:
    """The kernels' per-tensor key (lowbit_math.h ``sr_key``) for the given step and list position."""
    inner = _mix32(_word(seed) ^ _mix32(_word(step)))
    return int(_mix32((inner + _word(position) * 0x9E3779B9) & _M32))


def sr_bits(key: int, index: Tensor) -> Tensor:
    """32 random bits per element index (int64 tensor) of the tensor keyed ``key``."""
    i = index.to(torch.int64)
    lo, hi = i & _M32, (i >> 32) & _M32
    return _mix32(torch.full_like(i, key) ^ lo ^ ((hi * 0x85EBCA6B) & _M32), tail=True)


def bf16_stochastic(x: Tensor, r: Tensor) -> Tensor:
    """float32 ``x`` rounded to bfloat16 with the random bits ``r`` (low 16 used), as the kernels:
    the carry of the sum does the rounding; a NaN becomes the quiet NaN 0x7FC0."""
    x = x.float()
    b = torch.where(
        torch.isnan(x), 0x7FC00000, x.contiguous().view(torch.int32).to(torch.int64) & _M32
    )
    h = ((b + (r & 0xFFFF)) >> 16) & 0xFFFF
    return (
        torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.bfloat16).reshape(x.shape)
    )
