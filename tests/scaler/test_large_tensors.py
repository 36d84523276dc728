"""More than 2^31 elements: 64-bit indexing in the scaler ops (the bucket ops':
tests/parallel/test_bucket_large.py; shared helpers: tests/_large.py).

The default tier only checks views of more than 2^31 elements that the ops must refuse without
allocating anything (expanded / overlapping written arguments). The ``slow`` tests run the ops
on real bfloat16 tensors of 2^31 + 4099 elements (4 GiB each) and check them against float64
references computed chunk by chunk: the data of every chunk is regenerated from its seed, so no
copy and no float64 version of the whole tensor is ever held. They skip, with the numbers, when
the machine has too little memory available.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from fastamp.scaler import ops
from tests._fuzz import bits, expect_error
from tests._large import DT, EPS32, GiB, N, chunk_values, chunks, fill, need

# --- default tier: refused without allocating ---------------------------------------------------


def test_huge_overlapping_views_are_refused_cheaply():
    """A 2^31+ element expanded view (zero stride) and a 2^32-element as_strided view that overlaps
    without a zero stride: refused by every op that would write them, in well under a second and
    with no 4-16 GiB temporary."""
    one = torch.randn(1).to(DT)
    expanded = one.expand(N)
    base = torch.randn(2**17).to(DT)
    folded = base.as_strided((2**16, 2**16), (1, 1))  # 2^32 elements over 2^17 of memory
    snap = base.clone()
    inv, found = torch.tensor(0.5), torch.zeros(())
    t0 = time.perf_counter()
    for v in (expanded, folded):
        expect_error(lambda v=v: ops.non_finite_check_and_unscale_([v], found, inv), ["grads[0]"])
        expect_error(lambda v=v: ops.clip_unscale_([v], inv, torch.tensor(1.0), 1.0), ["grads[0]"])
    assert time.perf_counter() - t0 < 5.0
    assert float(found) == 0.0 and torch.equal(bits(base), bits(snap))


# --- slow tier: real 2^31+ element tensors --------------------------------------------------------


@pytest.mark.slow
def test_grad_stats_and_unscale_past_2_pow_31():
    """grad_stats (L2 and inf norms, flags) and non_finite_check_and_unscale_ on a bfloat16 tensor
    of 2^31 + 4099 elements plus a small one after it, against chunked float64 references."""
    need(N * 2 + 2 * GiB)  # the tensor, plus the reference's chunk temporaries and headroom
    seed = 11
    big = torch.empty(N, dtype=DT)
    fill(big, seed)
    small = chunk_values(seed, 10**6, 1000)
    grads = [big, small]
    inv_t = torch.tensor(1.0 / 3.0)  # not a power of two: every product rounds
    inv = float(inv_t)

    # Reference, chunk by chunk: sum of fp32(v * inv)^2 and max |fp32(v * inv)|.
    ref_sum, ref_max = 0.0, 0.0
    for c, _, n in chunks(N):
        u = (chunk_values(seed, c, n).double() * inv).float().double()
        ref_sum += float((u * u).sum())
        ref_max = max(ref_max, float(u.abs().max()))
    u = (small.double() * inv).float().double()
    ref_sum += float((u * u).sum())
    ref_max = max(ref_max, float(u.abs().max()))

    found, pow_sum, flags = ops.grad_stats(grads, inv_t, 2.0)
    assert float(found) == 0.0 and flags.tolist() == [False, False]
    depth = 65536 // 16 + 16 + N // 65536 + 2 + 4
    assert math.isclose(float(pow_sum), ref_sum, rel_tol=1.2 * depth * EPS32)
    # The realistic error is far below that first-order bound; a dropped chunk is not.
    assert math.isclose(float(pow_sum), ref_sum, rel_tol=1e-4)
    _, max_abs, _ = ops.grad_stats(grads, inv_t, math.inf)
    assert float(max_abs) == ref_max

    # inf/NaN past 2^31, and in the tensor after the big one.
    big[N - 3] = math.inf
    big[2**31 + 1] = -math.inf
    found, pow_sum, flags = ops.grad_stats(grads, inv_t)
    assert float(found) == 1.0 and flags.tolist() == [True, False] and float(pow_sum) == math.inf
    small[-1] = math.nan
    found, pow_sum, flags = ops.grad_stats(grads, inv_t)
    assert flags.tolist() == [True, True] and math.isnan(float(pow_sum))
    big[N - 3], big[2**31 + 1], small[-1] = 1.0, 1.0, 1.0
    found, _, flags = ops.grad_stats(grads, inv_t)
    assert float(found) == 0.0 and flags.tolist() == [False, False]

    # Unscale in place, then check every chunk against fp32(v * inv) rounded to bfloat16 once
    # (the documented arithmetic) regenerated from its seed.
    big[N - 1] = math.nan
    found_t = torch.zeros(())
    flags = ops.non_finite_check_and_unscale_(grads, found_t, inv_t)
    assert float(found_t) == 1.0 and flags.tolist() == [True, False]
    inv32 = inv_t.float()
    for c, s, n in chunks(N):
        v = chunk_values(seed, c, n)
        if s <= N - 3 < s + n:
            v[N - 3 - s] = 1.0
        if s <= 2**31 + 1 < s + n:
            v[2**31 + 1 - s] = 1.0
        expected = (v.float() * inv32).to(DT)
        got = big[s : s + n]
        if s + n == N:
            assert math.isnan(float(got[-1]))
            got, expected = got[:-1], expected[:-1]
        assert torch.equal(bits(got), bits(expected)), f"chunk {c} (elements {s}..{s + n})"


@pytest.mark.slow
def test_grad_stats_of_a_huge_expanded_view():
    """A read-only 2^31+ element expanded view is legal for grad_stats (it reads the logical
    elements, through a 4 GiB contiguous temporary): N copies of one value."""
    need(N * 2 + 2 * GiB)
    v = torch.tensor([1.5], dtype=DT).expand(N)
    found, pow_sum, flags = ops.grad_stats([v], torch.tensor(2.0))
    assert float(found) == 0.0 and flags.tolist() == [False]
    assert math.isclose(float(pow_sum), N * 9.0, rel_tol=1e-5)
    _, l1, _ = ops.grad_stats([v], torch.tensor(2.0), 1.0)
    assert math.isclose(float(l1), N * 3.0, rel_tol=1e-5)
