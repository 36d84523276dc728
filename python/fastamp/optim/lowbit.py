"""Low-precision optimizer state for :class:`fastamp.optim.Adam` / :class:`~fastamp.optim.AdamW`
(``state_dtype=``): the formats, the conversions between them, and how much memory they take.

* ``torch.float32`` (default): PyTorch's state, 8 bytes per parameter for the two moments.
* ``torch.bfloat16``: both moments in bfloat16, written with stochastic rounding (16 random bits
  added below the kept mantissa, so the stored value is unbiased): 4 bytes per parameter. The bits
  are a hash of (``state_seed``, step, the param's position in its group's list, element index):
  a run is reproducible, on CPU and CUDA alike.
* ``"int8"``: both moments as 8-bit codes in blocks of 256 elements, each block scaled by its
  absolute maximum (one float32 per block and moment): 2 + 8/256 bytes per parameter. ``exp_avg``
  is sign + 4-bit exponent + 3-bit mantissa of m/absmax, ``exp_avg_sq`` 5-bit exponent + 3-bit
  mantissa of v/max, rounded to nearest even from the value truncated to bfloat16 (smaller
  magnitudes decode to 0), see csrc/optim/lowbit_math.h.

Parameters with fewer than :data:`MIN_LOWBIT_NUMEL` elements (biases, norms) and non-contiguous
ones keep float32 state, as bitsandbytes keeps small tensors in 32 bits.

The codecs here are the kernels' own arithmetic written with torch ops (bit for bit the same); the
optimizers use them to convert state when a state_dict of another format is loaded, and the tests
use them as the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["MIN_LOWBIT_NUMEL", "QUANT_BLOCK", "STATE_FORMATS", "dequantize", "quantize",
           "state_format"]

QUANT_BLOCK = 256
MIN_LOWBIT_NUMEL = 4096
STATE_FORMATS = ("float32", "bfloat16", "int8")


def state_format(value: Any, where: str) -> str:
    """The canonical name of a ``state_dtype`` argument, or a ValueError naming it."""
    if value is None or value is torch.float32 or value == "float32":
        return "float32"
    if value is torch.bfloat16 or value == "bfloat16":
        return "bfloat16"
    if value in ("int8", "8bit", torch.int8, torch.uint8):
        return "int8"
    raise ValueError(
        f"{where}: state_dtype must be torch.float32, torch.bfloat16 or 'int8' (8-bit block-"
        f"quantized moments), got {value!r}"
    )


def uses_lowbit(p: Tensor, fmt: str) -> bool:
    """Whether param ``p`` keeps its moments in ``fmt`` (else in float32/its own dtype)."""
    return fmt != "float32" and p.numel() >= MIN_LOWBIT_NUMEL and p.is_contiguous()


def moments_dtype(fmt: str, p: Tensor, master: bool) -> torch.dtype:
    """The dtype of a param's moments in ``fmt`` (float32 format: the param's, float32 with a
    master copy)."""
    if fmt == "int8":
        return torch.uint8
    if fmt == "bfloat16":
        return torch.bfloat16
    return torch.float32 if master else p.dtype


def matches(state: dict[str, Any], fmt: str, dtype: torch.dtype) -> bool:
    """Whether a param's existing moments are already in ``fmt`` with moments of ``dtype``."""
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if not (isinstance(m, Tensor) and isinstance(v, Tensor) and m.dtype == dtype == v.dtype):
        return False
    if fmt == "int8":
        return all(isinstance(state.get(k), Tensor) and state[k].dtype == torch.float32
                   for k in ("exp_avg_absmax", "exp_avg_sq_absmax"))
    return True


# --- 8-bit codes (csrc/optim/lowbit_math.h, in torch ops) --------------------------------------------

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
    return (mag | ((h >> 8) & 0x80)).to(torch.uint8)


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


def _blocks(x: Tensor) -> tuple[Tensor, int]:
    """x (flattened, float32) padded with zeros to whole blocks, as [blocks, 256]; and numel."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % QUANT_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, QUANT_BLOCK), n


def _reciprocal(absmax: Tensor) -> Tensor:
    return torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))


def quantize(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(exp_avg codes, exp_avg_sq codes, exp_avg_absmax, exp_avg_sq_absmax) of float moments, as
    the kernel writes them (codes shaped like the moments)."""
    mb, n = _blocks(m)
    vb, _ = _blocks(v)
    am = mb.abs().amax(dim=1)
    av = vb.amax(dim=1)
    mq = encode_m8(mb * _reciprocal(am)[:, None]).reshape(-1)[:n].reshape(m.shape)
    vq = encode_v8(vb * _reciprocal(av)[:, None]).reshape(-1)[:n].reshape(v.shape)
    return mq, vq, am.contiguous(), av.contiguous()


def dequantize(mq: Tensor, vq: Tensor, am: Tensor, av: Tensor) -> tuple[Tensor, Tensor]:
    """The float32 moments the codes stand for (what the kernel computes with)."""
    idx = torch.arange(mq.numel(), device=mq.device) // QUANT_BLOCK
    m = decode_m8(mq.reshape(-1)) * am.float()[idx]
    v = decode_v8(vq.reshape(-1)) * av.float()[idx]
    return m.reshape(mq.shape), v.reshape(vq.shape)


def nblocks(p: Tensor) -> int:
    return (p.numel() + QUANT_BLOCK - 1) // QUANT_BLOCK


def new_state(p: Tensor, fmt: str) -> dict[str, Tensor]:
    """Zero moments of param ``p`` in ``fmt`` ("bfloat16" or "int8")."""
    if fmt == "bfloat16":
        return {"exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16)}
    z = torch.zeros(nblocks(p), dtype=torch.float32, device=p.device)
    return {"exp_avg": torch.zeros_like(p, dtype=torch.uint8),
            "exp_avg_sq": torch.zeros_like(p, dtype=torch.uint8),
            "exp_avg_absmax": z, "exp_avg_sq_absmax": z.clone()}


def moments_float32(state: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """The float32 moments of a param's state in any format."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype == torch.uint8:
        return dequantize(m, v, state["exp_avg_absmax"], state["exp_avg_sq_absmax"])
    return m.float(), v.float()


def convert(state: dict[str, Any], fmt: str, like: Tensor) -> dict[str, Tensor]:
    """The moments of ``state`` (any format) as ``fmt`` for a param like ``like`` ("float32" gives
    tensors of ``like``'s dtype: the param's, or float32 for a master). bfloat16 targets are
    rounded to nearest (a conversion, not a step)."""
    m, v = moments_float32(state)
    m = m.to(like.device).reshape(like.shape)
    v = v.to(like.device).reshape(like.shape)
    if fmt == "float32":
        return {"exp_avg": m.to(like.dtype).clone(memory_format=torch.contiguous_format),
                "exp_avg_sq": v.to(like.dtype).clone(memory_format=torch.contiguous_format)}
    if fmt == "bfloat16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    mq, vq, am, av = quantize(m, v)
    return {"exp_avg": mq, "exp_avg_sq": vq, "exp_avg_absmax": am, "exp_avg_sq_absmax": av}


# --- stochastic rounding (the kernels' hash, in torch ops) -------------------------------------------

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


def sr_key(seed: int, step: int, position: int) -> int:
    """The kernels' per-tensor key (lowbit_math.h ``sr_key``) for the given step and list position."""
    t = lambda v: torch.tensor([v & _M32], dtype=torch.int64)  # noqa: E731
    inner = _mix32(t(seed) ^ _mix32(t(step)))
    return int(_mix32((inner + t(position) * 0x9E3779B9) & _M32))


def sr_bits(key: int, index: Tensor) -> Tensor:
    """32 random bits per element index (int64 tensor) of the tensor keyed ``key``."""
    i = index.to(torch.int64)
    lo, hi = i & _M32, (i >> 32) & _M32
    return _mix32(torch.full_like(i, key) ^ lo ^ ((hi * 0x85EBCA6B) & _M32), tail=True)


def bf16_stochastic(x: Tensor, r: Tensor) -> Tensor:
    """float32 ``x`` rounded to bfloat16 with the random bits ``r`` (low 16 used), as the kernels:
    the carry of the sum does the rounding; a NaN becomes the quiet NaN 0x7FC0."""
    x = x.float()
    b = torch.where(torch.isnan(x), 0x7FC00000, _bits(x))
    h = ((b + (r & 0xFFFF)) >> 16) & 0xFFFF
    return torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.bfloat16).reshape(x.shape)
