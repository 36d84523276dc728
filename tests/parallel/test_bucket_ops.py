"""The gradient-bucket ops against float64 references, with inf/NaN, and opcheck."""

import math

import pytest
import torch

from fastamp._library import StableOps
from fastamp.testing import make_grads

# The ops as fastamp's Python layer calls them (a bare torch.ops.fastamp call raises RuntimeError
# with the class name as the message prefix; test_library.py).
_ops = StableOps("fastamp")

SHAPES = [(10,), (70000,), (3, 5)]


def _offsets(grads, gap=0):
    offs, n = [], 0
    for g in grads:
        offs.append(n)
        n += g.numel() + gap
    return offs, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_then_unpack_matches_float64(device, dtype):
    grads = make_grads(SHAPES, dtype, device, seed=1, scale=30.0)
    offs, n = _offsets(grads, gap=3)  # gaps between slots stay untouched
    bucket = torch.full((n,), 7.0, dtype=dtype, device=device)
    torch.ops.fastamp.bucket_pack_(bucket, grads, offs, 1.0 / 3.0)
    for g, o in zip(grads, offs):
        expected = (g.double() / 3.0).to(dtype)
        torch.testing.assert_close(
            bucket[o : o + g.numel()].cpu(),
            expected.flatten().cpu(),
            rtol={torch.float32: 2e-7}.get(dtype, 1e-2),
            atol=0,
        )
        assert torch.all(bucket[o + g.numel() : o + g.numel() + 3] == 7.0)
    out = [torch.empty_like(g) for g in grads]
    inv = 1.0 / 16.0
    found, sq = torch.ops.fastamp.bucket_unpack_(
        bucket, out, offs, torch.tensor(inv, device=device)
    )
    ref_sq = sum(float((o.double() * inv).square().sum()) for o in out)
    for o, g, off in zip(out, grads, offs):
        assert torch.equal(o.flatten(), bucket[off : off + g.numel()])
    assert float(found) == 0.0 and math.isclose(float(sq), ref_sq, rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_unpack_statistics_are_grad_stats_bit_for_bit(device, dtype, poison):
    """The unpack measures the grads while copying them (one pass); what it returns is what
    fastamp::grad_stats computes over the unpacked grads, bit for bit: the DDP hands these to the
    scaler in its place. Sizes around the 16-lane vector body and the 65536-element chunks."""
    shapes = [(1,), (15,), (17,), (33, 3), (65536 + 5,), (2 * 65536 - 1,), (7, 1000)]
    src = make_grads(shapes, dtype, device, seed=11, scale=300.0)
    offs, n = _offsets(src, gap=5)
    bucket = torch.full((n,), 3.0, dtype=dtype, device=device)
    for g, o in zip(src, offs):
        bucket[o : o + g.numel()] = g.flatten()
    if poison is not None:
        bucket[offs[4] + 65536 + 2] = poison  # in the second chunk's scalar tail
    out = [torch.full_like(g, -1.0) for g in src]
    inv = torch.tensor(1.0 / 1024.0, device=device)
    found, sq = torch.ops.fastamp.bucket_unpack_(bucket, out, offs, inv)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for o, g, off in zip(out, src, offs):  # copied bit for bit (NaN payloads too)
        assert torch.equal(o.flatten().view(bits), bucket[off : off + g.numel()].view(bits))
    ref_found, ref_sq, _ = torch.ops.fastamp.grad_stats(out, inv)
    assert float(found) == float(ref_found) == (0.0 if poison is None else 1.0)
    assert torch.equal(sq, ref_sq) or (math.isnan(float(sq)) and math.isnan(float(ref_sq)))


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_unpack_flags_nonfinite(device, value):
    grads = make_grads(SHAPES, torch.float32, device, seed=2)
    offs, n = _offsets(grads)
    bucket = torch.randn(n, device=device)
    bucket[offs[1] + 123] = value
    found, sq = torch.ops.fastamp.bucket_unpack_(
        bucket, grads, offs, torch.tensor(1.0, device=device)
    )
    assert float(found) == 1.0 and not math.isfinite(float(sq))


def test_bad_input_writes_nothing(device):
    grads = make_grads(SHAPES, torch.float32, device, seed=3)
    offs, n = _offsets(grads)
    bucket = torch.zeros(n, device=device)
    with pytest.raises(ValueError, match="overlaps the previous slot or runs past"):
        _ops.bucket_pack_(bucket, grads, [0, 5, offs[2]], 1.0)
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype Half"):
        _ops.bucket_pack_(bucket, [grads[0], grads[1].half(), grads[2]], offs, 1.0)
    with pytest.raises(TypeError, match="inv_scale has dtype Double"):
        _ops.bucket_unpack_(
            bucket, grads, offs, torch.tensor(1.0, dtype=torch.float64, device=device)
        )
    assert torch.all(bucket == 0)


def test_opcheck(device):
    grads = make_grads(SHAPES, torch.float32, device, seed=4)
    offs, n = _offsets(grads)
    torch.library.opcheck(
        torch.ops.fastamp.bucket_pack_.default, (torch.zeros(n, device=device), grads, offs, 0.5)
    )
    torch.library.opcheck(
        torch.ops.fastamp.bucket_unpack_.default,
        (
            torch.randn(n, device=device),
            [torch.empty_like(g) for g in grads],
            offs,
            torch.tensor(0.5, device=device),
        ),
    )


# ------------------------------------------------------------------ bucket_divide_stats_
DIVIDE_SHAPES = [(1,), (15,), (17,), (33, 3), (65536 + 5,), (0,), (2 * 65536 - 1,), (7, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0, 4.0])
@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_divide_stats_is_torchs_division_then_grad_stats_bit_for_bit(
    device, dtype, divisor, poison
):
    """The comm hook's pass over a reduced bucket: the bucket divided in place as torch's
    ``mul_(1 / divisor)`` rounds it, bit for bit (a NaN stays a NaN; its payload is the
    conversion's: torch's vectorised bfloat16 path keeps another one), and the statistics equal
    fastamp::grad_stats over the spans after the division, bit for bit; both against a float64
    reference. Spans around the 16-lane vector body and the 65536-element chunks, an empty one."""
    src = make_grads(DIVIDE_SHAPES, dtype, device, seed=21, scale=300.0)
    lengths = [g.numel() for g in src]
    bucket = torch.cat([g.flatten() for g in src])
    if poison is not None:
        bucket[sum(lengths[:4]) + 65536 + 2] = poison  # the second chunk's scalar tail
    expected = bucket.clone() if divisor == 1.0 else bucket.clone().mul_(1.0 / divisor)
    inv = torch.tensor(1.0 / 1024.0, device=device)
    version = bucket._version
    found, sq = _ops.bucket_divide_stats_(bucket, lengths, divisor, inv)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(bucket), nan)
    assert torch.equal(bucket[~nan].view(bits), expected[~nan].view(bits))
    assert bucket._version > version  # written (a!): autograd's counter bumped
    ref_found, ref_sq, _ = torch.ops.fastamp.grad_stats(list(expected.split(lengths)), inv)
    assert float(found) == float(ref_found) == (0.0 if poison is None else 1.0)
    assert torch.equal(sq, ref_sq) or (math.isnan(float(sq)) and math.isnan(float(ref_sq)))
    if poison is None:
        ref = float((expected.double() * (1.0 / 1024.0)).square().sum())
        assert math.isclose(float(sq), ref, rel_tol=1e-5)
        ref_div = torch.cat([g.flatten() for g in src]).double() / divisor
        # x * fl(1/divisor), rounded once: within two units in the last place of the quotient
        rel = {torch.float32: 2.0**-22, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}[dtype]
        assert torch.all((bucket.double() - ref_div).abs() <= rel * ref_div.abs() + 1e-30)


def test_divide_stats_refuses_bad_input_before_writing(device):
    bucket = torch.ones(10, device=device)
    inv = torch.tensor(1.0, device=device)
    cases = [
        (ValueError, r"lengths sum to 9 elements but the bucket has 10", ([4, 5], 2.0, inv)),
        (ValueError, r"lengths\[1\] is 7 but only 6 elements", ([4, 7], 2.0, inv)),
        (ValueError, r"lengths\[0\] is -1", ([-1, 11], 2.0, inv)),
        (ValueError, "divisor must be a finite, positive number", ([10], 0.0, inv)),
        (ValueError, "divisor must be a finite, positive number", ([10], math.inf, inv)),
        (ValueError, "divisor must be a finite, positive number", ([10], math.nan, inv)),
        (TypeError, "inv_scale has dtype Double", ([10], 2.0, inv.double())),
    ]
    for cls, msg, (lengths, divisor, inv_) in cases:
        with pytest.raises(cls, match=msg):
            _ops.bucket_divide_stats_(bucket, lengths, divisor, inv_)
    with pytest.raises(RuntimeError, match="contiguous 1-D tensor"):
        _ops.bucket_divide_stats_(torch.ones(2, 5, device=device), [10], 2.0, inv)
    with pytest.raises(TypeError, match="bucket has dtype Double"):
        _ops.bucket_divide_stats_(
            torch.ones(10, dtype=torch.float64, device=device), [10], 2.0, inv
        )
    assert torch.all(bucket == 1.0)


def test_divide_stats_opcheck(device):
    for divisor in (1.0, 2.0):
        torch.library.opcheck(
            torch.ops.fastamp.bucket_divide_stats_.default,
            (
                torch.randn(300, device=device),
                [100, 0, 200],
                divisor,
                torch.tensor(0.5, device=device),
            ),
        )
