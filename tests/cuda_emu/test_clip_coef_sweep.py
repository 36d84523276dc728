"""The clip coefficient over a sweep of random norms: fastamp::clip_coef's CUDA kernel (run on the
emulator), its CPU kernel (through fastamp.scaler's Python wrapper) and torch's own expression in
torch.nn.utils.clip_grad_norm_ (``max_norm / (total_norm + 1e-6)`` clamped at 1).

* emulated CUDA and CPU: the same bits (one source, scaler_math.h, built without contraction);
* the coefficient: torch's expression on the same total norm gives the same bits. It is three
  correctly rounded IEEE float32 operations (an add, a reciprocal, a multiply: ``max_norm / t``
  is ``t.reciprocal() * max_norm``), so a difference is a different rounding, the bug this looks
  for (one division instead differs in the last bit for about half the norms), on any machine;
* the total norm: the correctly rounded square root (the float64 root rounded to float32), and
  within 1 float32 ulp of torch's ``Tensor.sqrt`` (which is not always correctly rounded on
  the CPU: 1 ulp off for some inputs with its vectorised kernels);
* each coefficient within 4 float32 ulps (its 4 roundings) of the formula in float64."""

from __future__ import annotations

import math

import emu
import torch

from fastamp.scaler import _ops as scaler_ops

N = 300


def _cases() -> list[tuple[float, float, float]]:
    """(power sum, norm type, max_norm): magnitudes from 1e-30 to 1e30, max_norms that are not
    powers of two, coefficients on both sides of 1, the edges (0, inf, NaN, a norm of about
    1e-6, the float32 maximum)."""
    g = torch.Generator().manual_seed(20260)
    exps = torch.empty(N, dtype=torch.float64).uniform_(-30.0, 30.0, generator=g)
    mant = torch.empty(N, dtype=torch.float64).uniform_(1.0, 10.0, generator=g)
    sums = (mant * 10.0**exps).float().tolist()
    norms = [2.0, 1.0, math.inf]
    maxes = torch.empty(N, dtype=torch.float64).uniform_(-3.0, 3.0, generator=g)
    cases = [
        (s, norms[i % 3], float(torch.tensor(10.0 ** m.item()).float()))
        for i, (s, m) in enumerate(zip(sums, maxes))
    ]
    for s, mx in [(0.0, 1.0), (0.0, 0.0), (math.inf, 1.0), (math.nan, 0.7), (1e-30, math.inf),
                  (3.4028234663852886e38, 1e9), (1e-12, 1e-6), (1.0118544101715088, 1.0),
                  (6822148.0, 5.3), (1.0, 1.0), (4.0, 2.0)]:  # fmt: skip
        cases += [(s, t, mx) for t in norms]
    return cases


def _torch_expression(pow_sum: float, norm_type: float, max_norm: float) -> tuple:
    ps = torch.tensor(pow_sum, dtype=torch.float32)
    total = ps.sqrt() if norm_type == 2.0 else ps
    coef = max_norm / (total + 1e-6)
    return total, torch.clamp(coef, max=1.0)


def _bits(t: torch.Tensor) -> int:
    return int(t.reshape(1).view(torch.int32).item())


def test_clip_coef_cuda_cpu_and_torch_agree_bit_for_bit_on_random_norms():
    cuda = emu.op("clip_coef")
    bad = []
    for pow_sum, norm_type, max_norm in _cases():
        ps = torch.tensor(pow_sum, dtype=torch.float32)
        got = {
            "emulated CUDA": cuda(ps.clone(), norm_type, max_norm),
            "CPU": scaler_ops.clip_coef(ps.clone(), norm_type, max_norm),
        }
        case = f"pow_sum={pow_sum!r} norm_type={norm_type} max_norm={max_norm!r}"
        total, coef = got["CPU"]
        cuda_total, cuda_coef = got["emulated CUDA"]
        if (_bits(cuda_total), _bits(cuda_coef)) != (_bits(total), _bits(coef)):
            bad.append(f"emulated CUDA vs CPU: {case}: {got}")
        _, torch_coef = _torch_expression(total.item(), 1.0, max_norm)  # on fastamp's total
        if _bits(coef) != _bits(torch_coef):
            bad.append(
                f"coefficient vs torch's expression: {case}: {coef.item()!r} vs {torch_coef.item()!r}"
            )
        total64 = math.sqrt(ps.double().item()) if norm_type == 2.0 else ps.double().item()
        if _bits(total) != _bits(torch.tensor(total64, dtype=torch.float32)):
            bad.append(
                f"total norm vs the rounded float64 root: {case}: {total.item()!r} vs {total64!r}"
            )
        torch_total, _ = _torch_expression(pow_sum, norm_type, max_norm)
        if math.isfinite(total64) and abs(_bits(total) - _bits(torch_total)) > 1:
            bad.append(f"total norm vs torch's: {case}: {total.item()!r} vs {torch_total.item()!r}")
        c = coef.double().item()
        if math.isfinite(total64) and 0.0 < c < 1.0:
            exact = max_norm / (total64 + 1e-6)
            ulp = 2.0 ** (math.frexp(exact)[1] - 24)  # float32's spacing at |exact|
            if abs(c - exact) > 4 * ulp:  # 4 roundings: sqrt, add, reciprocal, multiply
                bad.append(f"float64: {case}: {c!r} vs {exact!r}")
    assert not bad, f"{len(bad)} differences, e.g.\n" + "\n".join(bad[:10])
