"""Float64 reference implementations of the scaler ops, and random gradient makers.

The references are deliberately naive (per-tensor torch ops in float64) so that they share no code
and no summation order with the kernels they check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def make_grads(
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype] | torch.dtype,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    scale: float = 1.0,
    non_contiguous: Sequence[bool] | bool = False,
) -> list[Tensor]:
    """Random normal grads (never zeros), optionally as non-contiguous strided views."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(shapes)
    if isinstance(non_contiguous, bool):
        non_contiguous = [non_contiguous] * len(shapes)
    out = []
    for shape, dtype, nc in zip(shapes, dtypes, non_contiguous):
        if nc:
            # Every other column of a wider tensor: a view with gaps between rows' elements.
            big = (
                torch.randn(*shape[:-1], shape[-1] * 2, generator=gen, dtype=torch.float64)
                if shape
                else torch.randn((), generator=gen, dtype=torch.float64)
            )
            base = (big * scale).to(dtype).to(device)
            t = base[..., ::2] if shape else base
        else:
            t = (
                (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale)
                .to(dtype)
                .to(device)
            )
        out.append(t)
    return out


def transformer_like_shapes(
    n_params: int, hidden: int | None = None, vocab: int = 32000
) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-style stack whose total size is about ``n_params``.

    Per layer: QKV and output projections, a 4x MLP, two LayerNorms (weights and biases); plus an
    embedding table: many large matrices and many tiny vectors, as in real models. The hidden size
    grows with the model (the embedding stays about a quarter of it or less).
    """
    if hidden is None:
        hidden = 256
        for h in (512, 768, 1024, 1536, 2048, 4096):
            if vocab * h * 4 <= n_params:
                hidden = h
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    per_layer = [
        (3 * hidden, hidden),
        (3 * hidden,),
        (hidden, hidden),
        (hidden,),
        (4 * hidden, hidden),
        (4 * hidden,),
        (hidden, 4 * hidden),
        (hidden,),
        (hidden,),
        (hidden,),
        (hidden,),
        (hidden,),
    ]
    layer_size = sum(math.prod(s) for s in per_layer)
    total = vocab * hidden
    while total + layer_size <= n_params or len(shapes) == 1:
        shapes.extend(per_layer)
        total += layer_size
    return shapes


def _pow_sum(u: Tensor, norm_type: float) -> Tensor:
    a = u.abs()
    if math.isinf(norm_type):
        return a.max() if a.numel() else torch.zeros((), dtype=torch.float64)
    if norm_type == 2.0:
        return (a * a).sum()
    return a.pow(norm_type).sum()


def grad_stats_ref(
    grads: Sequence[Tensor], inv_scale: float, norm_type: float = 2.0
) -> tuple[float, float, list[bool]]:
    """(found_inf, sum |g*inv_scale|^p or max, per-tensor non-finite flags), in float64."""
    flags = [bool((~torch.isfinite(g)).any()) for g in grads]
    parts = [_pow_sum(g.detach().cpu().double() * inv_scale, norm_type) for g in grads]
    if not parts:
        total = 0.0
    elif math.isinf(norm_type):
        total = (
            float(torch.stack(parts).max()) if not any(torch.isnan(p) for p in parts) else math.nan
        )
    else:
        total = float(torch.stack(parts).sum())
    return (1.0 if any(flags) else 0.0), total, flags


def unscale_ref(grads: Sequence[Tensor], inv_scale: float) -> list[Tensor]:
    """grads * inv_scale computed in float64 and rounded once to each grad's dtype."""
    return [(g.detach().cpu().double() * inv_scale).to(g.dtype) for g in grads]


def clip_unscale_ref(
    grads: Sequence[Tensor], inv_scale: float, total_norm: float, max_norm: float
) -> list[Tensor]:
    coef = max_norm / (total_norm + 1e-6)
    coef = coef if (coef != coef or coef <= 1.0) else 1.0
    return [(g.detach().cpu().double() * inv_scale * coef).to(g.dtype) for g in grads]


def update_scale_ref(
    scale: float,
    growth_tracker: int,
    hysteresis_tracker: int,
    found_inf: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
) -> tuple[float, int, int]:
    """Python transcription of the documented update rule (PyTorch's when hysteresis=1, no bounds)."""

    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32))

    if found_inf:
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            scale = (
                max(f32(scale * backoff_factor), f32(min_scale))
                if min_scale > 0
                else f32(scale * backoff_factor)
            )
            hysteresis_tracker = 0
    else:
        if growth_tracker + 1 == growth_interval:
            grown = f32(scale * growth_factor)
            if not math.isinf(grown):
                scale = min(grown, f32(max_scale)) if not math.isinf(max_scale) else grown
            growth_tracker = 0
            hysteresis_tracker = hysteresis
        else:
            growth_tracker += 1
    return scale, growth_tracker, hysteresis_tracker


def adam_ref(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    vmax: Tensor | None,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    decoupled: bool,
    maximize: bool,
    inv_scale: float = 1.0,
    clip_coef: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One Adam/AdamW step in float64 (the textbook rule); returns new (p, m, v, vmax)."""
    p, g, m, v = (t.detach().double().cpu() for t in (p, g, m, v))
    vmax = vmax.detach().double().cpu() if vmax is not None else None
    g = g * inv_scale * clip_coef
    if maximize:
        g = -g
    if weight_decay:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    vhat = v
    if amsgrad:
        assert vmax is not None, "amsgrad needs vmax"
        vmax = torch.maximum(vmax, v)
        vhat = vmax
    p = p - lr / bc1 * m / (vhat.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v, vmax


def sgd_ref(
    p: Tensor,
    g: Tensor,
    buf: Tensor | None,
    first: bool,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    inv_scale: float = 1.0,
    clip_coef: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """One SGD step in float64; returns new (p, buf)."""
    p, g = p.detach().double().cpu(), g.detach().double().cpu() * inv_scale * clip_coef
    if maximize:
        g = -g
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        assert first or buf is not None, "a later momentum step needs buf"
        buf = (
            g.clone()
            if first or buf is None
            else momentum * buf.detach().double().cpu() + (1 - dampening) * g
        )
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Asserts two nested structures (dicts, lists, tuples of tensors and Python values) are equal
    bit for bit: tensors byte by byte (NaN payloads and signed zeros included), floats with NaN
    equal to NaN. ``where`` names the path of the first difference in the AssertionError."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, (where, a, b)
