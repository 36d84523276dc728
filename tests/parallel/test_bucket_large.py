"""More than 2^31 elements in the bucket ops (64-bit indexing): slow tier, real bfloat16 tensors of
2^31 + 4099 elements against chunked float64 references (tests/_large.py); the default tier checks
that a huge overlapping view is refused without allocating."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests._fuzz import bits, expect_error
from tests._large import DT, GiB, N, chunk_values, chunks, fill, need


def test_huge_overlapping_views_are_refused_cheaply_by_the_bucket_ops():
    """A 2^31+ element expanded view and a 2^32-element overlapping as_strided view: refused by
    bucket_pack_ quickly, with no 4-16 GiB temporary and nothing written."""
    one = torch.randn(1).to(DT)
    base = torch.randn(2**17).to(DT)
    bucket = torch.full((8,), 3.0, dtype=DT)
    snap = base.clone()
    t0 = time.perf_counter()
    for v in (one.expand(N), base.as_strided((2**16, 2**16), (1, 1))):
        expect_error(
            lambda v=v: torch.ops.fastamp.bucket_pack_(bucket, [v], [0], 1.0), ["grads[0]"]
        )
    assert time.perf_counter() - t0 < 5.0
    assert torch.equal(bits(base), bits(snap)) and bool((bucket == 3.0).all())


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
