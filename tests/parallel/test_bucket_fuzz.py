"""Property-based fuzzing of the gradient-bucket ops, bucket_pack_ and bucket_unpack_.

The bucket is a 1-D slice in the middle of a guard buffer, its slots separated by random gaps; gaps
and guards may hold inf/NaN. pack must write exactly ``fp32(g) * fp32(scale)`` rounded once into
each slot and not one byte elsewhere; unpack must copy each slot bit for bit into its grad (itself
inside a guard buffer), flag inf/NaN of the copied elements only, and return the fp32 sum of squares
within its rounding bound of float64. Bad buckets, grads, offsets (overlapping, past the end,
negative, near 2^63) and devices must be named in an error with nothing written.
"""

from __future__ import annotations

import math

import torch
from hypothesis import event
from hypothesis import strategies as st

from tests import _fuzz as fuzz

EPS32 = 2.0**-24
F32_MAX = float(torch.finfo(torch.float32).max)
BAD_OFFSETS = ("overlap", "past_end", "negative", "huge", "huge2", "count")


@st.composite
def bucket_cases(draw, op: str):
    device = draw(st.sampled_from(fuzz.compute_devices()))
    dtype = draw(st.sampled_from(fuzz.HALF_DTYPES))
    n = draw(st.integers(0, 5))
    grads, offsets, end = [], [], 0
    for _ in range(n):
        spec = draw(
            fuzz.tensor_specs(
                dtypes=(dtype,),
                layouts=("contiguous",),
                device=device,
                shape=draw(fuzz.shapes(max_dims=3)),
            )
        )
        gap = draw(st.sampled_from([0, 0, 1, 3, 16]))
        offsets.append(end + gap)
        end += gap + spec.numel
        grads.append(spec)
    slack = draw(st.sampled_from([0, 0, 2, 9]))
    bucket = fuzz.TensorSpec(
        shape=(end + slack,),
        dtype=dtype,
        device=device,
        pre=draw(st.sampled_from([0, 4, 11])),
        post=draw(st.sampled_from([0, 3])),
        seed=draw(st.integers(0, 2**31 - 1)),
        magnitude=draw(st.sampled_from([1.0, 1e3])),
        poison_guards=draw(st.booleans()),
    )
    # The gaps between slots are part of the bucket: poison them too, sometimes.
    poison_gaps = draw(st.booleans())
    views = op == "pack" and draw(st.integers(0, 4)) == 0  # gradient_as_bucket_view
    scale = draw(
        st.one_of(
            st.sampled_from([1.0, 0.5, 0.25, 1 / 3, 0.0, math.inf, math.nan]), st.floats(1e-3, 1e3)
        )
    )
    inv = draw(st.sampled_from([1.0, 2.0**-16, 1 / 3000, 0.0, math.inf, math.nan]))
    defect = draw(
        st.sampled_from(
            [None] * 12
            + [
                "grad_dtype",
                "grad_strided",
                "grad_expanded",
                "grad_device",
                "bucket_2d",
                "bucket_strided",
                "bucket_dtype",
                "inv_dtype",
                "inv_device",
                *BAD_OFFSETS,
            ]
        )
    )
    pick = draw(st.integers(0, 1000))
    return dict(
        op=op,
        device=device,
        dtype=dtype,
        grads=grads,
        offsets=offsets,
        bucket=bucket,
        poison_gaps=poison_gaps,
        views=views,
        scale=scale,
        inv=inv,
        defect=defect,
        pick=pick,
    )


def _build(case):
    B = fuzz.build(case["bucket"])
    offsets = list(case["offsets"])
    if case["poison_gaps"] and B.view.device.type != "meta":
        used = torch.zeros(B.view.numel(), dtype=torch.bool)
        for o, s in zip(offsets, case["grads"]):
            used[o : o + s.numel] = True
        gaps = (~used).nonzero().reshape(-1)
        if gaps.numel():
            B.view[gaps.to(B.view.device)] = (
                torch.tensor([math.inf, math.nan, -math.inf], dtype=case["dtype"])
                .repeat(gaps.numel())[: gaps.numel()]
                .to(B.view.device)
            )
    G = [fuzz.build(s) for s in case["grads"]]
    if case["views"] and B.view.device.type != "meta":
        # Grads that are views of their own slots (DDP's gradient_as_bucket_view).
        for i, (o, s) in enumerate(zip(offsets, case["grads"])):
            B.view[o : o + s.numel] = G[i].view.reshape(-1)
            slot = B.view[o : o + s.numel].view(s.shape)
            G[i] = fuzz.Guarded(s, B.base, slot, B.offsets[o : o + s.numel].reshape(s.shape))
    return B, G, offsets


def _apply_defect(case, B, G, offsets, inv_t):
    """Returns (bucket, grads, offsets, inv_scale, names)."""
    d, pick, n = case["defect"], case["pick"], len(G)
    bucket, grads = B.view, [g.view for g in G]
    names: list[str] = []
    if d is None:
        return bucket, grads, offsets, inv_t, names
    if d.startswith("grad") and n:
        i = pick % n
        g = grads[i]
        if d == "grad_dtype":
            grads[i] = g.double()
        elif d in ("grad_strided", "grad_expanded") and g.numel() >= 2:
            if d == "grad_strided":
                grads[i] = torch.stack([g, g], -1)[..., 0]
            else:
                grads[i] = g.reshape(-1)[:1].expand(g.numel())
            assert not grads[i].is_contiguous()
        elif d == "grad_device":
            grads[i] = g.to(fuzz.foreign_devices(case["device"])[0])
        else:
            return bucket, grads, offsets, inv_t, names
        names.append(f"grads[{i}]")
    elif d == "bucket_2d" and bucket.numel() >= 1:
        bucket = bucket.reshape(1, -1)
        names.append("bucket")
    elif d == "bucket_strided" and bucket.numel() >= 2:
        # Every other element of a buffer twice the size: same element count, not contiguous.
        big = torch.zeros(2 * bucket.numel(), dtype=bucket.dtype, device=bucket.device)
        bucket = big[::2]
        names.append("bucket")
    elif d == "bucket_dtype":
        bucket = bucket.double() if bucket.dtype != torch.float64 else bucket.int()
        names.append("bucket")
    elif d == "inv_dtype" and case["op"] == "unpack":
        inv_t = inv_t.double()
        names.append("inv_scale")
    elif d == "inv_device" and case["op"] == "unpack":
        inv_t = inv_t.to(fuzz.foreign_devices(case["device"])[0])
        names.append("inv_scale")
    elif d in BAD_OFFSETS and n:
        i = pick % n
        numel = grads[i].numel()
        if d == "overlap" and i > 0 and grads[i - 1].numel() > 0:
            offsets[i] = offsets[i - 1] + grads[i - 1].numel() - 1
        elif d == "past_end" and numel > 0:
            offsets[i] = bucket.numel() - numel + 1
        elif d == "negative":
            offsets[i] = -1 - pick % 3
        elif d == "huge":
            offsets[i] = 2**63 - 1 - pick % 4  # offset + numel used to overflow into a valid range
        elif d == "huge2":
            offsets[i] = 2**62 + pick
        elif d == "count":
            offsets = offsets[:-1] if pick % 2 else offsets + [bucket.numel()]
            names.append("offsets")
            return bucket, grads, offsets, inv_t, names
        else:
            return bucket, grads, offsets, inv_t, names
        names.append(f"grads[{i}]")
    return bucket, grads, offsets, inv_t, names


def _expected_slots(case, B, offsets):
    used = torch.zeros(B.view.numel(), dtype=torch.bool)
    for o, s in zip(offsets, case["grads"]):
        used[o : o + s.numel] = True
    return used


def _check_bucket_pack(case):
    """bucket_pack_: each slot = fp32(g) * fp32(scale) rounded once (within 1 ulp of float64 for
    half buckets, exact for fp32); not one other byte of the bucket or its guards changes."""
    B, G, offsets = _build(case)
    B.freeze()
    for g in G:
        g.freeze()
    before = [g.values() for g in G]
    bucket, grads, offsets, _, names = _apply_defect(case, B, G, offsets, None)
    scale = case["scale"]
    call = lambda: torch.ops.fastamp.bucket_pack_(bucket, grads, offsets, scale)
    if not names and any(g.device != bucket.device for g in grads):
        names = [f"grads[{i}]" for i, g in enumerate(grads) if g.device != bucket.device]
    if names:
        event("rejected")
        fuzz.expect_error(call, names, [B] + G)
        return
    call()
    if bucket.device.type == "meta":
        return
    event(f"{len(G)} grads" + (" (views)" if case["views"] else ""))
    s32 = torch.tensor(scale, dtype=torch.float32)
    now = B.view.detach().cpu()
    for i, (o, b) in enumerate(zip(offsets, before)):
        got = now[o : o + b.numel()]
        exact = (b.reshape(-1).float() * s32).to(case["dtype"])
        same = (got == exact) | (got.isnan() & exact.isnan())
        assert bool(same.all()), f"slot {i} differs from fp32(g) * fp32(scale)"
        ref64 = (b.reshape(-1).double() * float(s32)).to(case["dtype"]).double()
        fuzz.assert_within_ulps(
            got, ref64, case["dtype"], 0.0 if case["dtype"] == torch.float32 else 1.0, f"slot {i}"
        )
        if not case["views"]:
            G[i].assert_untouched("grads (read-only)")
    # Nothing outside the slots: guards, gaps, slack.
    used = _expected_slots(case, B, offsets)
    mask = torch.ones(B.base.numel(), dtype=torch.bool)
    mask[B.offsets.reshape(-1)[used]] = False
    mask = mask.repeat_interleave(B.base.element_size())
    assert torch.equal(fuzz.bits(B.base.cpu())[mask], fuzz.bits(B.snapshot)[mask]), (
        "pack wrote outside the slots"
    )


def _check_bucket_unpack(case):
    """bucket_unpack_: grads = their slots bit for bit, found_inf over the copied elements only
    (poisoned gaps and guards ignored), norm_pow_sum = fp32 sum of (x * inv)^2 within its rounding
    bound of float64; the bucket and the grads' guards untouched."""
    B, G, offsets = _build(case)
    inv_t = torch.tensor(case["inv"], dtype=torch.float32, device=case["device"])
    B.freeze()
    for g in G:
        g.freeze()
    bucket, grads, offsets, inv_t, names = _apply_defect(case, B, G, offsets, inv_t)
    call = lambda: torch.ops.fastamp.bucket_unpack_(bucket, grads, offsets, inv_t)
    if not names:
        names = [f"grads[{i}]" for i, g in enumerate(grads) if g.device != bucket.device]
        names += ["inv_scale"] if inv_t.device != bucket.device else []
    if names:
        event("rejected")
        fuzz.expect_error(call, names, [B] + G)
        return
    found, pow_sum = call()
    assert found.shape == pow_sum.shape == () and found.dtype == pow_sum.dtype == torch.float32
    if bucket.device.type == "meta":
        return
    event(f"{len(G)} grads")
    B.assert_untouched("bucket (read-only)")
    src = B.values()
    slots = [src[o : o + s.numel] for o, s in zip(offsets, case["grads"])]
    for i, (g, slot) in enumerate(zip(G, slots)):
        assert torch.equal(fuzz.bits(g.values()), fuzz.bits(slot.contiguous())), (
            f"grads[{i}] != its slot"
        )
        g.assert_outside_untouched(f"grads[{i}]")
    allv = torch.cat(slots) if slots else torch.zeros(0, dtype=case["dtype"])
    assert float(found) == float(bool((~torch.isfinite(allv)).any()))
    inv = float(inv_t)
    u = (allv.double() * inv).float().double()
    terms = u * u
    total = float(terms.sum())
    nchunks = sum((s.numel + 65535) // 65536 for s in case["grads"])
    longest = max((min(s.numel, 65536) for s in case["grads"]), default=0)
    rtol = 1.2 * ((longest + 15) // 16 + 16 + nchunks + 4) * EPS32
    got = float(pow_sum)
    if math.isnan(total):
        assert math.isnan(got)
    elif math.isinf(total) or bool((terms > F32_MAX).any()) or total > F32_MAX * (1 - rtol):
        assert got == math.inf or math.isclose(got, total, rel_tol=rtol), (got, total)
    else:
        assert math.isclose(got, total, rel_tol=rtol, abs_tol=(terms.numel() + 1) * 2.0**-149), (
            got,
            total,
        )


test_bucket_pack, test_bucket_pack_slow = fuzz.tiered(
    default=100, slow=4000, case=bucket_cases("pack")
)(_check_bucket_pack)
test_bucket_unpack, test_bucket_unpack_slow = fuzz.tiered(
    default=120, slow=4000, case=bucket_cases("unpack")
)(_check_bucket_unpack)


def test_offset_near_int64_max_is_rejected_without_writing():
    """Regression: offset 2^63 - 2 with 3 elements overflowed offset + numel, passed the bounds
    check and bucket_pack_ wrote far outside the bucket (heap corruption)."""
    gen = torch.Generator().manual_seed(5)
    base = fuzz.random_values(16, torch.float32, gen)
    snap = base.clone()
    bucket = base[3:13]
    g = fuzz.random_values(3, torch.float32, gen)
    for off in (2**63 - 2, 2**63 - 1, 2**63 - 3 - 10):
        fuzz.expect_error(
            lambda o=off: torch.ops.fastamp.bucket_pack_(bucket, [g], [o], 1.0), ["grads[0]"]
        )
        fuzz.expect_error(
            lambda o=off: torch.ops.fastamp.bucket_unpack_(bucket, [g], [o], torch.tensor(1.0)),
            ["grads[0]"],
        )
    assert torch.equal(base, snap)


def test_meta_grads_are_rejected():
    """Regression: a meta grad beside a CPU bucket ran the fake kernel: pack silently did nothing and
    unpack returned two uninitialised CPU tensors."""
    bucket = torch.randn(8)
    for op, extra in (
        (torch.ops.fastamp.bucket_pack_, (1.0,)),
        (torch.ops.fastamp.bucket_unpack_, (torch.tensor(1.0),)),
    ):
        fuzz.expect_error(
            lambda op=op, extra=extra: op(bucket, [torch.ones(3, device="meta")], [0], *extra),
            ["grads[0]"],
        )
    fuzz.expect_error(
        lambda: torch.ops.fastamp.bucket_unpack_(
            bucket, [torch.ones(3)], [0], torch.tensor(1.0, device="meta")
        ),
        ["inv_scale"],
    )
