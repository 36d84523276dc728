"""More than 2^31 elements: 64-bit indexing in the scaler and bucket ops.

The default tier only checks views of more than 2^31 elements that the ops must refuse without
allocating anything (expanded / overlapping written arguments, non-contiguous bucket grads). The
``slow`` tests run the ops on real bfloat16 tensors of 2^31 + 4099 elements (4 GiB each) and check
them against float64 references computed chunk by chunk: the data of every chunk is regenerated
from its seed, so no copy and no float64 version of the whole tensor is ever held. They skip, with
the numbers, when the machine has too little memory available.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from fastamp.scaler import ops
from tests.fuzz.strategies import bits, expect_error

N = 2**31 + 4099  # elements of a "large" tensor: past int32 indexing, and not a multiple of 64 Ki
CHUNK = 2**24  # reference chunk: 16 Mi elements (a 128 MiB float64 temporary)
DT = torch.bfloat16
GiB = 2**30
EPS32 = 2.0**-24


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def need(nbytes: int) -> None:
    have = available_bytes()
    if have < nbytes:
        pytest.skip(
            f"needs {nbytes / GiB:.1f} GiB of available memory, this machine has {have / GiB:.1f} GiB"
        )


def chunk_values(seed: int, c: int, n: int) -> torch.Tensor:
    """The bfloat16 values of chunk ``c`` (``n`` elements): fresh random normals times 3."""
    gen = torch.Generator().manual_seed(seed * 100_003 + c)
    return (torch.randn(n, generator=gen) * 3.0).to(DT)


def fill(t: torch.Tensor, seed: int) -> None:
    for c, s in enumerate(range(0, t.numel(), CHUNK)):
        n = min(CHUNK, t.numel() - s)
        t[s : s + n] = chunk_values(seed, c, n)


def chunks(numel: int):
    for c, s in enumerate(range(0, numel, CHUNK)):
        yield c, s, min(CHUNK, numel - s)


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
        expect_error(
            lambda v=v: torch.ops.fastamp.bucket_pack_(torch.zeros(8, dtype=DT), [v], [0], 1.0),
            ["grads[0]"],
        )
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
def test_bucket_ops_past_2_pow_31():
    """bucket_pack_/bucket_unpack_ with slots past element 2^31 of a bfloat16 bucket, and a grad of
    more than 2^31 elements: exact copies, nothing written outside the slots, found_inf and the sum
    of squares of the copied elements against chunked float64."""
    need(2 * N * 2 + 2 * GiB)  # bucket + one large grad + temporaries
    seed = 12
    nb = N + 300
    bucket = torch.full((nb,), 7.0, dtype=DT)
    big = torch.empty(N, dtype=DT)
    fill(big, seed)
    small = [chunk_values(seed, 10**6 + k, 37 + k) for k in range(3)]
    # big at offset 100 ends at N + 100; the small ones sit right after it, past 2^31.
    offsets = [100, N + 100 + 5, N + 100 + 5 + 37, N + 100 + 5 + 37 + 38 + 1]
    grads = [big, *small]
    scale = 0.5  # exact: pack must reproduce the grads times 1/2 bit for bit
    torch.ops.fastamp.bucket_pack_(bucket, grads, offsets, scale)
    # Outside the slots, still 7.0; inside, g * 0.5.
    seven = torch.tensor(7.0, dtype=DT)
    assert bool((bucket[:100] == seven).all()) and bool(
        (bucket[offsets[-1] + small[-1].numel() :] == seven).all()
    )
    assert bool((bucket[N + 100 : N + 105] == seven).all()) and bool(
        bucket[offsets[3] - 1] == seven
    )
    for c, s, n in chunks(N):
        assert torch.equal(
            bits(bucket[100 + s : 100 + s + n]),
            bits((chunk_values(seed, c, n).float() * 0.5).to(DT)),
        )
    for o, g in zip(offsets[1:], small):
        assert torch.equal(bits(bucket[o : o + g.numel()]), bits((g.float() * 0.5).to(DT)))

    # Unpack back into the grads (the big one is overwritten with the halved values).
    bucket[offsets[2] + 3] = math.inf  # in a slot past 2^31: must be found
    bucket[N + 100 + 2] = math.nan  # in a gap: must not
    inv_t = torch.tensor(2.0)
    for g in grads:
        g.fill_(-1.0)
    found, pow_sum = torch.ops.fastamp.bucket_unpack_(bucket, grads, offsets, inv_t)
    assert float(found) == 1.0 and float(pow_sum) == math.inf
    bucket[offsets[2] + 3] = 1.0
    found, pow_sum = torch.ops.fastamp.bucket_unpack_(bucket, grads, offsets, inv_t)
    assert float(found) == 0.0
    ref = 0.0
    for c, s, n in chunks(N):
        x = bucket[100 + s : 100 + s + n]
        assert torch.equal(bits(big[s : s + n]), bits(x)), f"chunk {c} of the large grad"
        u = (x.double() * 2.0).float().double()
        ref += float((u * u).sum())
    for o, g in zip(offsets[1:], small):
        assert torch.equal(bits(g), bits(bucket[o : o + g.numel()]))
        u = (g.double() * 2.0).float().double()
        ref += float((u * u).sum())
    assert math.isclose(float(pow_sum), ref, rel_tol=1e-4)


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
