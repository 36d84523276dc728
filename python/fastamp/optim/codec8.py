"""The 8-bit codes of :data:`fastamp.optim.lowbit.INT8`: csrc/optim/lowbit_math.h's arithmetic
in torch ops, bit for bit (the format converts with it; the tests take it as the reference)."""

from __future__ import annotations

import torch
from torch import Tensor

QUANT_BLOCK = 256


def _rounded_high_half(y: Tensor) -> tuple[Tensor, Tensor]:
    """The high 16 bits ``h`` of y's float32 bits (y truncated to bfloat16), and ``t``: its
    exponent << 3 | mantissa rounded to 3 bits, to nearest even (int64)."""
    h = _bits(y) >> 16
    a = h & 0x7FFF
    return h, (a + 7 + ((a >> 4) & 1)) >> 4


def _bits(x: Tensor) -> Tensor:
    return x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _float(b: Tensor) -> Tensor:
    """float32 values of the 32-bit patterns in int64 ``b``."""
    b = b & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def encode_m8(y: Tensor) -> Tensor:
    h, t = _rounded_high_half(y)
    mag = (t.clamp(min=896) - 896).clamp(max=127)  # exponent field 0 below 2^-14; saturates
    sign = torch.where((h & 0x7FFF) > 0x7F80, 0, (h >> 8) & 0x80)  # a NaN's sign is not kept
    return (mag | sign).to(torch.uint8)


def decode_m8(c: Tensor) -> Tensor:
    c = c.to(torch.int64)
    ex = (c >> 3) & 0xF
    b = ((c & 0x80) << 24) | ((ex + 112) << 23) | ((c & 7) << 20)
    f = _float(b)
    return torch.where(ex == 0, torch.zeros_like(f), f)


def encode_v8(y: Tensor) -> Tensor:
    _, t = _rounded_high_half(y)
    return (t.clamp(min=768) - 768).clamp(max=255).to(torch.uint8)


def decode_v8(c: Tensor) -> Tensor:
    c = c.to(torch.int64)
    ex = c >> 3
    b = ((ex + 96) << 23) | ((c & 7) << 20)
    f = _float(b)
    return torch.where(ex == 0, torch.zeros_like(f), f)


def nblocks(p: Tensor) -> int:
    return (p.numel() + QUANT_BLOCK - 1) // QUANT_BLOCK


def _quantize_one(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes shaped like ``x``, contiguous; float32 block maxima) of one moment."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % QUANT_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, QUANT_BLOCK)
    scale = (blocks.abs() if signed else blocks).amax(dim=1)
    recip = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = (encode_m8 if signed else encode_v8)(blocks * recip[:, None])
    return codes.reshape(-1)[:n].reshape(x.shape).contiguous(), scale.contiguous()


def _dequantize_one(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    idx = torch.arange(codes.numel(), device=codes.device) // QUANT_BLOCK
    vals = (decode_m8 if signed else decode_v8)(codes.reshape(-1)) * scales.float().to(
        codes.device
    )[idx]
    return vals.reshape(codes.shape)


def quantize(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(exp_avg codes, exp_avg_sq codes, exp_avg_absmax, exp_avg_sq_absmax) of float moments, as
    the kernel writes them (codes shaped like the moments)."""
    mq, am = _quantize_one(m, signed=True)
    vq, av = _quantize_one(v, signed=False)
    return mq, vq, am, av


def dequantize(mq: Tensor, vq: Tensor, am: Tensor, av: Tensor) -> tuple[Tensor, Tensor]:
    """The float32 moments the codes stand for (what the kernel computes with)."""
    return _dequantize_one(mq, am, signed=True), _dequantize_one(vq, av, signed=False)
