"""The scaler's 1/scale in one float32 op (grad_scaler._inverse) has the bits of torch's
``scale.double().reciprocal().float()`` (the quotient rounded twice, to double then to float, is
the quotient rounded once: innocuous double rounding), on fresh random bit patterns of every
magnitude, powers of two, subnormals and the extremes."""

from __future__ import annotations

import torch

from fastamp.scaler.grad_scaler import _inverse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_inverse_is_torchs_double_reciprocal_bit_for_bit():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    raw = torch.randint(1, 0x7F800000, (1 << 20,), generator=gen, dtype=torch.int32)
    x = raw.view(torch.float32)  # every positive finite float32, subnormals included
    specials = torch.tensor(
        [2.0**k for k in range(-149, 128)]
        + [torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny, 65536.0, 3.0, 0.0]
        + [float("inf"), float("nan")],
        dtype=torch.float32,
    )
    for values in (x, -x, specials):
        for scale in values[:4096]:  # as the scaler holds it: a one-element tensor
            assert torch.equal(_bits(_inverse(scale)), _bits(scale.double().reciprocal().float()))
        got, want = _inverse(values), values.double().reciprocal().float()
        assert torch.equal(_bits(got), _bits(want)) or (
            torch.isnan(got).equal(torch.isnan(want))
            and torch.equal(_bits(got[~torch.isnan(got)]), _bits(want[~torch.isnan(want)]))
        )
