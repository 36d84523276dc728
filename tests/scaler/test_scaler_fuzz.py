"""Property-based fuzzing of the scaler ops: grad_stats, non_finite_check_and_unscale_,
clip_unscale_ and update_scale_.

Every example either matches the float64 reference (exactly where the op promises exactness:
flags, found_inf, fp32/fp64 unscaling, the scale update) or raises an error naming the bad
argument with every input byte-identical afterwards. Grads live inside larger guard buffers, and
nothing outside a grad's elements may change.
"""

from __future__ import annotations

import math

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fastamp.scaler import ops
from fastamp.testing import update_scale_ref
from tests import _fuzz as fuzz

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
F32_MAX = float(torch.finfo(torch.float32).max)
EPS32 = 2.0**-24

inv_scales = st.one_of(
    st.sampled_from([1.0, 0.5, 2.0**-16, 1 / 3000, 1e-30, 3e38, 0.0, math.inf, math.nan]),
    st.floats(2.0**-24, 2.0**24),
)


# --- argument builders with optional defects ------------------------------------------------------


@st.composite
def grad_lists(draw, device: str, *, max_len: int = 5, defects: bool = True, layouts=fuzz.LAYOUTS):
    """(specs, expected_bad) where expected_bad maps a list index to what is wrong with it."""
    n = draw(st.integers(0, max_len))
    specs, bad = [], {}
    for i in range(n):
        spec = draw(fuzz.tensor_specs(device=device, layouts=layouts))
        roll = draw(st.integers(0, 24)) if defects else 99
        if roll == 0:
            spec = _replace(spec, dtype=draw(st.sampled_from(fuzz.NON_GRAD_DTYPES)))
            bad[i] = "dtype"
        elif roll == 1:
            spec = _replace(spec, device=draw(st.sampled_from(fuzz.foreign_devices(device))))
            bad[i] = "device"
        specs.append(spec)
    if n >= 2 and (n - 1) not in bad and defects and draw(st.integers(0, 9)) == 0:
        bad[n - 1] = "alias"  # the last entry is the first tensor again
    return specs, bad


def _build_grads(specs, bad, *, written: bool):
    """Builds a grad list; returns (guarded, names of entries an error must name). An "alias" last
    entry repeats the first tensor: fine to read twice, refused when written (it would be updated
    twice)."""
    grads = [fuzz.build(s) for s in specs]
    names = []
    if bad.get(len(specs) - 1) == "alias":
        event("first tensor repeated at the end")
        grads[-1] = grads[0]
        if written and grads[0].view.numel() > 0:
            names = ["grads[0]", f"grads[{len(specs) - 1}]"]
    return grads, names


def _replace(spec, **kw):
    from dataclasses import replace

    return replace(spec, **kw)


@st.composite
def scalar_arg(draw, values, *, device: str, dtype=torch.float32, defects: bool = True):
    """(tensor, defect or None): a one-element tensor (shape (), (1,) or (1, 1), maybe a view at a
    storage offset), or with a small probability one with a wrong dtype, size or device."""
    value = draw(values)
    shape = draw(st.sampled_from([(), (), (1,), (1, 1)]))
    roll = draw(st.integers(0, 29)) if defects else 99
    defect = None
    if roll == 0:
        dtype = draw(
            st.sampled_from(
                [
                    d
                    for d in (torch.float64, torch.float16, torch.int32, torch.float32, torch.bool)
                    if d != dtype
                ]
            )
        )
        defect = "dtype"
    elif roll == 1:
        shape = draw(st.sampled_from([(0,), (2,), (1, 3)]))
        defect = "numel"
    elif roll == 2:
        device = draw(st.sampled_from(fuzz.foreign_devices(device)))
        defect = "device"
    n = math.prod(shape)
    offset = draw(st.sampled_from([0, 3]))
    buf = torch.full((offset + max(n, 1),), value, dtype=torch.float64).to(dtype)
    t = buf[offset : offset + n].reshape(shape)
    return t.to(device), defect


def _device_defects(anchor_device, named):
    """Names of the tensors not on the anchor's device (the op runs on its anchor's device)."""
    return [name for name, t in named if t.device != anchor_device]


def _on_meta(anchor, device_names, other_names):
    """The names an error must carry. With a meta anchor the op is a meta (shape-only) call: its
    fake kernel checks devices, not values, dtypes or sizes, like the meta kernels of ATen ops."""
    return device_names if anchor.device.type == "meta" else device_names + other_names


def _all_untouched(groups):
    for g in groups:
        g.assert_untouched()


# --- grad_stats ---------------------------------------------------------------------------------


def _u32(values: torch.Tensor, inv: float) -> torch.Tensor:
    """The kernels' unscaled value: fp32(v * inv) (exact in float64 for every grad dtype), as float64."""
    return (values.double() * inv).float().double()


def grad_stats_reference(values: list[torch.Tensor], inv: float, p: float):
    """(found, flags, pow_sum, rtol, atol, overflow) with the sum in float64 of fp32 terms."""
    flags = [bool((~torch.isfinite(v)).any()) for v in values]
    us = [_u32(v, inv).reshape(-1) for v in values]
    if math.isinf(p):
        mags = [u.abs() for u in us if u.numel()]
        if not mags:
            return float(any(flags)), flags, 0.0, 0.0, 0.0, False
        allm = torch.cat(mags)
        total = math.nan if bool(allm.isnan().any()) else float(allm.max())
        return float(any(flags)), flags, total, 0.0, 0.0, False
    # The kernels raise to the power norm_type rounded to fp32 (like every other operand).
    p32 = float(torch.tensor(p, dtype=torch.float32))
    terms = [u.abs() ** p32 if p != 2.0 else u * u for u in us]
    allt = torch.cat(terms) if terms else torch.zeros(0, dtype=torch.float64)
    total = float(allt.sum())
    # fp32 accumulation: 16 lanes of at most 4096 terms per 64 Ki chunk, then the lanes, then the
    # chunks. Each term passes through at most `depth` roundings (first-order bound).
    nchunks = sum((u.numel() + 65535) // 65536 for u in us)
    longest = max((min(u.numel(), 65536) for u in us), default=0)
    depth = (longest + 15) // 16 + 16 + nchunks + 4
    rtol = 1.2 * depth * EPS32 + (4 * EPS32 if p not in (1.0, 2.0) else EPS32)
    atol = (allt.numel() + 1) * 2.0**-149
    overflow = bool((allt > F32_MAX).any()) or total > F32_MAX
    return float(any(flags)), flags, total, rtol, atol, overflow


def assert_pow_sum(got: float, expected: float, rtol: float, atol: float, overflow: bool) -> None:
    if math.isnan(expected):
        assert math.isnan(got), f"norm_pow_sum {got}, expected NaN"
    elif math.isinf(expected):
        assert got == expected, f"norm_pow_sum {got}, expected {expected}"
    elif overflow or expected > F32_MAX * (1 - rtol):
        # Past fp32's range the fp32 accumulator is inf (it may be finite right at the edge).
        assert got == math.inf or math.isclose(got, expected, rel_tol=rtol), (got, expected)
    else:
        assert math.isclose(got, expected, rel_tol=rtol, abs_tol=atol), (
            f"norm_pow_sum {got!r} vs float64 {expected!r} (rtol {rtol:.2g})"
        )


norm_types = st.one_of(st.sampled_from([2.0, 1.0, math.inf, 3.0]), st.floats(0.25, 8.0))


@st.composite
def grad_stats_cases(draw):
    device = draw(st.sampled_from(fuzz.compute_devices()))
    specs, bad = draw(grad_lists(device))
    inv = draw(scalar_arg(inv_scales, device=device))
    p = (
        draw(st.one_of(norm_types, st.sampled_from([0.0, -1.0, math.nan])))
        if draw(st.integers(0, 19)) == 0
        else draw(norm_types)
    )
    sparse = draw(st.integers(0, 39)) == 0 and len(specs) > 0
    return device, specs, bad, inv, p, sparse


def _check_grad_stats(case):
    """grad_stats: found_inf and the per-tensor flags exact, the fp32 sum within its rounding bound
    of float64, nothing written anywhere; bad arguments named."""
    device, specs, bad, (inv_t, inv_defect), p, sparse = case
    grads, _ = _build_grads(specs, bad, written=False)
    views = [g.view for g in grads]
    if sparse and specs[-1].dtype in fuzz.GRAD_DTYPES and bad.get(len(specs) - 1) != "alias":
        views[-1] = (
            views[-1].detach().cpu().to_sparse() if views[-1].device.type != "meta" else views[-1]
        )
    for g in grads:
        g.freeze()
    names = [f"grads[{i}]" for i, why in bad.items() if why == "dtype"]
    dev_names = _device_defects(inv_t.device, [(f"grads[{i}]", v) for i, v in enumerate(views)])
    if inv_defect in ("dtype", "numel"):
        names.append("inv_scale")
    if not (p > 0):
        names.append("norm_type")
    if sparse and views[-1].layout != torch.strided:
        names.append(f"grads[{len(views) - 1}]")
    names = _on_meta(inv_t, dev_names, names)
    if names:
        fuzz.expect_error(lambda: ops.grad_stats(views, inv_t, p), names, grads)
        return
    found, pow_sum, flags = ops.grad_stats(views, inv_t, p)
    assert found.shape == () and found.dtype == torch.float32 and found.device == inv_t.device
    assert pow_sum.shape == () and pow_sum.dtype == torch.float32
    assert flags.shape == (len(views),) and flags.dtype == torch.bool
    if inv_t.device.type == "meta":
        return
    _all_untouched(grads)  # read-only
    inv = float(inv_t.reshape(()))
    ref_found, ref_flags, total, rtol, atol, overflow = grad_stats_reference(
        [g.values() for g in grads], inv, p
    )
    assert float(found) == ref_found
    assert flags.tolist() == ref_flags
    assert_pow_sum(float(pow_sum), total, rtol, atol, overflow)
    again = ops.grad_stats(views, inv_t, p)[1]  # deterministic, bit for bit
    assert torch.equal(again.view(torch.int32), pow_sum.view(torch.int32))


test_grad_stats, test_grad_stats_slow = fuzz.tiered(
    default=150, slow=5000, case=grad_stats_cases()
)(_check_grad_stats)


# --- non_finite_check_and_unscale_ ----------------------------------------------------------------


def unscale_expected(values: torch.Tensor, inv: float, dtype: torch.dtype):
    """(exact, float64): the op's documented arithmetic (one multiply in the op-math type: fp32,
    or fp64 for float64 grads, then one rounding to the grad's dtype), and the float64 product
    rounded once to the dtype."""
    v64 = values.double()
    if dtype == torch.float64:
        exact = v64 * inv
    else:
        exact = (values.float() * torch.tensor(inv, dtype=torch.float32)).to(dtype)
    return exact, (v64 * inv).to(dtype)


@st.composite
def unscale_cases(draw):
    device = draw(st.sampled_from(fuzz.compute_devices()))
    specs, bad = draw(grad_lists(device))
    n = len(specs)
    inv = draw(scalar_arg(inv_scales, device=device))
    found = draw(scalar_arg(st.sampled_from([0.0, 0.0, 1.0, 0.5]), device=device))
    flags0 = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    tfi_defect = draw(st.sampled_from([None] * 20 + ["len", "dtype", "strided", "2d", "device"]))
    return device, specs, bad, inv, found, flags0, tfi_defect


def _tensor_found_inf(flags0, device, defect):
    n = len(flags0)
    t = torch.tensor(flags0, dtype=torch.bool)
    if defect == "len":
        t = torch.cat([t, torch.zeros(1, dtype=torch.bool)])
    elif defect == "dtype":
        t = t.to(torch.uint8)
    elif defect == "strided":
        if n < 2:
            defect = None  # a 1-element strided view is contiguous
        t = torch.stack([t, t], 1)[:, 0]
    elif defect == "2d":
        t = t.reshape(1, n)
    elif defect == "device":
        device = fuzz.foreign_devices(device)[0]
    return t.to(device), defect


def _values_then_call(call, inv_t, grads):
    """Runs ``call``; returns the grads' values from before it, or None where it is a shape-only
    call (``inv_t`` on meta)."""
    if inv_t.device.type == "meta":
        call()
        return None
    before = [g.values() for g in grads]
    call()
    return before


def _check_non_finite_check_and_unscale(case):
    """non_finite_check_and_unscale_: fp32/fp64 grads bitwise equal to the correctly rounded
    product, half grads equal to the fp32-op-math product and within 1 ulp of float64; flags
    OR-ed into found_inf/tensor_found_inf; overlapping grads, bad dtypes/devices/sizes rejected
    with nothing written."""
    device, specs, bad, (inv_t, inv_defect), (found_t, found_defect), flags0, tfi_defect = case
    grads, names = _build_grads(specs, bad, written=True)
    views = [g.view for g in grads]
    tfi, tfi_defect = _tensor_found_inf(flags0, device, tfi_defect)
    for g in grads:
        g.freeze()
    found_before, tfi_before, inv_before = found_t.clone(), tfi.clone(), inv_t.clone()
    names += [f"grads[{i}]" for i, why in bad.items() if why == "dtype"]
    dev_names = _device_defects(
        inv_t.device,
        [(f"grads[{i}]", v) for i, v in enumerate(views)]
        + [("found_inf", found_t), ("tensor_found_inf", tfi)],
    )
    names += [f"grads[{i}]" for i, g in enumerate(grads) if g.overlapping]
    names += ["inv_scale"] if inv_defect in ("dtype", "numel") else []
    names += ["found_inf"] if found_defect in ("dtype", "numel") else []
    names += ["tensor_found_inf"] if tfi_defect and tfi_defect != "device" else []
    names = _on_meta(inv_t, dev_names, names)
    call = lambda: ops.non_finite_check_and_unscale_(views, found_t, inv_t, tfi)
    if names:
        fuzz.expect_error(call, names, grads)
        if found_t.device.type != "meta":
            assert torch.equal(found_t.cpu(), found_before.cpu())
        if tfi.device.type != "meta":
            assert torch.equal(tfi.cpu(), tfi_before.cpu())
        return
    before = _values_then_call(call, inv_t, grads)
    if before is None:  # a shape-only call: nothing to compare
        return
    assert torch.equal(fuzz.bits(inv_t), fuzz.bits(inv_before))
    inv = float(inv_t.reshape(()))
    nonfinite = [bool((~torch.isfinite(b)).any()) for b in before]
    assert tfi.tolist() == [a or b for a, b in zip(flags0, nonfinite)]
    assert float(found_t.reshape(())) == (
        1.0 if any(nonfinite) else float(found_before.reshape(()))
    )
    for i, (g, b) in enumerate(zip(grads, before)):
        exact, ref64 = unscale_expected(b, inv, g.spec.dtype)
        got = g.values()
        same = (got == exact) | (got.isnan() & exact.isnan())
        assert bool(same.all()), (
            f"grads[{i}] ({g.spec.dtype}) differs from the documented arithmetic"
        )
        ulps = 0.0 if g.spec.dtype in (torch.float32, torch.float64) else 1.0
        fuzz.assert_within_ulps(got, ref64.double(), g.spec.dtype, ulps, f"grads[{i}]")
        g.assert_outside_untouched(f"grads[{i}]")


test_non_finite_check_and_unscale, test_non_finite_check_and_unscale_slow = fuzz.tiered(
    default=130, slow=5000, case=unscale_cases()
)(_check_non_finite_check_and_unscale)


# --- clip_unscale_ ------------------------------------------------------------------------------


def clip_coef32(total_norm: float, max_norm: float) -> torch.Tensor:
    """The coefficient as torch.nn.utils.clip_grad_norm_ computes it on an fp32 norm tensor:
    ``torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)``, with torch's own roundings (the
    Python float divided by a tensor is a reciprocal, then a product), NaN kept."""
    c = max_norm / (torch.tensor(total_norm, dtype=torch.float32) + 1e-6)
    return torch.clamp(c, max=1.0)


@st.composite
def clip_cases(draw):
    device = draw(st.sampled_from(fuzz.compute_devices()))
    specs, bad = draw(grad_lists(device))
    inv = draw(scalar_arg(inv_scales, device=device))
    total = draw(
        scalar_arg(
            st.one_of(st.floats(0.0, 1e6), st.sampled_from([0.0, 1e-7, math.inf, math.nan, 1e30])),
            device=device,
        )
    )
    max_norm = draw(st.one_of(st.floats(0.0, 1e3), st.sampled_from([0.0, 1.0, math.inf])))
    if draw(st.integers(0, 19)) == 0:
        max_norm = draw(st.sampled_from([-1.0, -1e-9, math.nan]))
    return device, specs, bad, inv, total, max_norm


def _check_clip_unscale(case):
    """clip_unscale_: grads equal to fp32 (v * inv) * coef rounded once to their dtype (fp64 op-math
    for float64 grads) and within 2 ulp of float64; bad arguments rejected, nothing written."""
    device, specs, bad, (inv_t, inv_defect), (tot_t, tot_defect), max_norm = case
    grads, names = _build_grads(specs, bad, written=True)
    views = [g.view for g in grads]
    for g in grads:
        g.freeze()
    names += [f"grads[{i}]" for i, why in bad.items() if why == "dtype"]
    dev_names = _device_defects(
        inv_t.device, [(f"grads[{i}]", v) for i, v in enumerate(views)] + [("total_norm", tot_t)]
    )
    names += [f"grads[{i}]" for i, g in enumerate(grads) if g.overlapping]
    names += ["inv_scale"] if inv_defect in ("dtype", "numel") else []
    names += ["total_norm"] if tot_defect in ("dtype", "numel") else []
    names += ["max_norm"] if not max_norm >= 0 else []
    names = _on_meta(inv_t, dev_names, names)
    call = lambda: ops.clip_unscale_(views, inv_t, tot_t, max_norm)
    if names:
        fuzz.expect_error(call, names, grads)
        return
    before = _values_then_call(call, inv_t, grads)
    if before is None:  # a shape-only call: nothing to compare
        return
    inv = float(inv_t.reshape(()))
    coef = clip_coef32(float(tot_t.reshape(())), max_norm)
    inv32 = torch.tensor(inv, dtype=torch.float32)
    for i, (g, b) in enumerate(zip(grads, before)):
        dt = g.spec.dtype
        if dt == torch.float64:
            exact = (b * inv) * float(coef)
        else:
            exact = ((b.float() * inv32) * coef).to(dt)
        # float64 after the unscale, which is rounded to fp32 first (fp64 for float64 grads): an
        # unscaled value past fp32's range is inf before it is clipped, as in PyTorch's recipe.
        u = b.double() * inv if dt == torch.float64 else (b.double() * inv).float().double()
        ref64 = (u * float(coef)).to(dt).double()
        got = g.values()
        same = (got == exact) | (got.isnan() & exact.isnan())
        assert bool(same.all()), f"grads[{i}] ({dt}) differs from the documented arithmetic"
        fuzz.assert_within_ulps(
            got, ref64, dt, 2.0 if dt in (torch.float32, torch.float64) else 1.0, f"grads[{i}]"
        )
        g.assert_outside_untouched(f"grads[{i}]")


test_clip_unscale, test_clip_unscale_slow = fuzz.tiered(default=120, slow=4000, case=clip_cases())(
    _check_clip_unscale
)


# --- update_scale_ ------------------------------------------------------------------------------


scales = st.one_of(
    st.floats(2.0**-30, 2.0**60),
    st.sampled_from([1.0, 65536.0, 0.0, 1e-40, F32_MAX, 3e38, math.inf, math.nan]),
)


@st.composite
def update_cases(draw):
    device = draw(st.sampled_from(fuzz.compute_devices()))
    interval = draw(st.one_of(st.integers(1, 5), st.sampled_from([2000, INT32_MAX])))
    hyst = draw(st.one_of(st.integers(1, 4), st.sampled_from([INT32_MAX])))
    gt = draw(
        st.one_of(
            st.integers(-2, min(interval, 8) + 1),
            st.sampled_from([interval - 1, INT32_MAX, INT32_MIN]),
        )
    )
    ht = draw(st.one_of(st.integers(-2, min(hyst, 8) + 1), st.sampled_from([INT32_MAX, INT32_MIN])))
    lo = draw(st.one_of(st.just(0.0), st.floats(0.0, 2.0**20)))
    hi = draw(st.one_of(st.just(math.inf), st.floats(lo, 2.0**40)))
    args = dict(
        growth_factor=draw(st.one_of(st.floats(1.0, 8.0), st.sampled_from([2.0, 1.0, 0.5]))),
        backoff_factor=draw(st.one_of(st.floats(0.01, 1.0), st.sampled_from([0.5, 1.0]))),
        growth_interval=interval,
        hysteresis=hyst,
        min_scale=lo,
        max_scale=hi,
    )
    bad_value = None
    if draw(st.integers(0, 4)) == 0:
        key, val = draw(
            st.sampled_from(
                [
                    ("growth_factor", 0.0),
                    ("growth_factor", -2.0),
                    ("growth_factor", math.inf),
                    ("growth_factor", math.nan),
                    ("backoff_factor", 0.0),
                    ("backoff_factor", math.nan),
                    ("backoff_factor", math.inf),
                    ("growth_interval", 0),
                    ("growth_interval", -5),
                    ("growth_interval", 2**31),
                    ("hysteresis", 0),
                    ("hysteresis", 2**33),
                    ("min_scale", -1.0),
                    ("min_scale", math.nan),
                    ("min_scale", math.inf),
                    ("min_scale", 1e39),
                    ("max_scale", math.nan),
                    ("max_scale", -1.0),
                ]
            )
        )
        args[key] = val
        if key == "min_scale" and not args["max_scale"] >= val:
            args["max_scale"] = math.inf
        bad_value = key
    if bad_value is None and args["max_scale"] < args["min_scale"]:
        bad_value = "max_scale"
    scale = draw(scalar_arg(scales, device=device))
    gt_t = draw(scalar_arg(st.just(gt), device=device, dtype=torch.int32))
    ht_t = draw(scalar_arg(st.just(ht), device=device, dtype=torch.int32))
    found = draw(scalar_arg(st.sampled_from([0.0, 1.0, 0.0, math.nan, 0.25, -0.0]), device=device))
    alias = draw(st.sampled_from([None] * 15 + ["gt=ht", "scale=found"]))
    return device, scale, gt_t, ht_t, found, args, bad_value, alias


# update_scale_'s scalar arguments after its four tensors, in its order.
_UPDATE_ARGS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
)


def _update_reference(scale, gt, ht, found, a):
    s, g, h = update_scale_ref(
        scale,
        gt,
        ht,
        found != 0,
        *(a[k] for k in _UPDATE_ARGS),
    )
    return s, min(g, INT32_MAX), h  # the int32 tracker saturates instead of overflowing


def _check_update_scale(case):
    """update_scale_: exactly the documented rule (PyTorch's with hysteresis=1 and no bounds), never
    a grown inf scale, int32 trackers that never overflow; bad arguments rejected, nothing written."""
    device, (scale, s_def), (gt, gt_def), (ht, ht_def), (found, f_def), a, bad_value, alias = case
    if alias == "gt=ht" and gt.dtype == ht.dtype == torch.int32:
        ht, ht_def = gt, gt_def
    elif alias == "scale=found":  # legal: found_inf is only read
        found, f_def = scale, s_def
    else:
        alias = None
    before = [t.clone() for t in (scale, gt, ht, found)]
    dev_names = _device_defects(
        scale.device, [("growth_tracker", gt), ("hysteresis_tracker", ht), ("found_inf", found)]
    )
    names = []
    for name, d in (
        ("scale", s_def),
        ("growth_tracker", gt_def),
        ("hysteresis_tracker", ht_def),
        ("found_inf", f_def),
    ):
        if d in ("dtype", "numel"):
            names.append(name)
    names += [bad_value] if bad_value else []
    if alias == "gt=ht":
        names += ["distinct"]
    names = _on_meta(scale, dev_names, names)
    call = lambda: ops.update_scale_(
        scale,
        gt,
        ht,
        found,
        *(a[k] for k in _UPDATE_ARGS),
    )
    if names:
        fuzz.expect_error(call, names)
        for t, b in zip((scale, gt, ht, found), before):
            if t.device.type != "meta":
                assert torch.equal(
                    t.cpu().view(-1).view(torch.uint8), b.cpu().view(-1).view(torch.uint8)
                )
        return
    call()
    if scale.device.type == "meta":
        return
    s0, g0, h0, f0 = (x.reshape(()).item() for x in before)
    es, eg, eh = _update_reference(s0, g0, h0, f0, a)
    got = (scale.reshape(()).item(), gt.reshape(()).item(), ht.reshape(()).item())
    same_scale = got[0] == es or (math.isnan(got[0]) and math.isnan(es))
    assert same_scale and got[1:] == (eg, eh), (
        f"got {got}, expected {(es, eg, eh)} from {(s0, g0, h0, f0)}, {a}"
    )
    if math.isfinite(s0):
        assert math.isfinite(got[0]) or math.isnan(got[0]), "the scale grew to inf"


test_update_scale, test_update_scale_slow = fuzz.tiered(
    default=300, slow=10000, case=update_cases()
)(_check_update_scale)


# --- regressions and fixed cases ----------------------------------------------------------------


def test_overlapping_as_strided_grads_are_rejected():
    """An as_strided view whose elements overlap without a zero stride (has_internal_overlap says
    "too hard") must be rejected like an expanded one, before anything is written."""
    base = torch.randn(64)
    v = base.as_strided((4, 4), (1, 2))  # element (0, 2) and (2, 1) share memory... and others
    g = fuzz.Guarded(
        fuzz.TensorSpec((4, 4), torch.float32), base, v, torch.arange(64).as_strided((4, 4), (1, 2))
    ).freeze()
    assert g.overlapping
    found = torch.zeros(())
    fuzz.expect_error(
        lambda: ops.non_finite_check_and_unscale_([v], found, torch.tensor(0.5)), ["grads[0]"], [g]
    )
    fuzz.expect_error(
        lambda: ops.clip_unscale_([v], torch.tensor(0.5), torch.tensor(1.0), 1.0), ["grads[0]"], [g]
    )
    assert float(found) == 0.0


def test_interleaved_non_overlapping_grads_are_accepted():
    """Strides (2, 3) over sizes (3, 2) interleave without overlapping: accepted and unscaled."""
    base = torch.randn(16)
    v = base.as_strided((3, 2), (2, 3))
    expected = v * 0.5
    rest = base.clone()
    ops.non_finite_check_and_unscale_([v], torch.zeros(()), torch.tensor(0.5))
    assert torch.equal(v, expected)
    mask = torch.ones(16, dtype=torch.bool)
    mask[torch.arange(16).as_strided((3, 2), (2, 3)).reshape(-1)] = False
    assert torch.equal(base[mask], rest[mask])


def test_mixed_device_scalars_are_rejected():
    """A meta found_inf/tensor_found_inf/total_norm beside CPU grads: a clear error, not a silent
    no-op of the meta kernel."""
    g = [torch.randn(8)]
    snap = g[0].clone()
    inv = torch.tensor(0.5)
    meta = torch.zeros((), device="meta")
    fuzz.expect_error(lambda: ops.non_finite_check_and_unscale_(g, meta, inv), ["found_inf"])
    fuzz.expect_error(
        lambda: ops.non_finite_check_and_unscale_(
            g, torch.zeros(()), inv, torch.zeros(1, dtype=torch.bool, device="meta")
        ),
        ["tensor_found_inf"],
    )
    fuzz.expect_error(lambda: ops.clip_unscale_(g, inv, meta, 1.0), ["total_norm"])
    i32 = torch.zeros((), dtype=torch.int32)
    fuzz.expect_error(
        lambda: ops.update_scale_(torch.ones(()), i32, i32.clone() + 1, meta, 2.0, 0.5, 1),
        ["found_inf"],
    )
    assert torch.equal(g[0], snap)


@example(gt=INT32_MAX, ht=INT32_MIN, found=0.0)
@example(gt=0, ht=INT32_MIN, found=1.0)
@given(
    gt=st.sampled_from([INT32_MAX, INT32_MAX - 1, INT32_MIN, 0]),
    ht=st.sampled_from([INT32_MAX, INT32_MIN, INT32_MIN + 1, 0]),
    found=st.sampled_from([0.0, 1.0]),
)
@settings(settings.get_profile("fastamp-fuzz"), max_examples=20)
def test_update_scale_extreme_trackers(gt, ht, found):
    """Trackers at the int32 limits: no signed overflow (undefined behaviour in the kernel); the
    growth tracker saturates, an overflow with a tracker <= 0 backs off and resets it to 0."""
    scale = torch.tensor(1024.0)
    g, h = torch.tensor(gt, dtype=torch.int32), torch.tensor(ht, dtype=torch.int32)
    a = dict(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        hysteresis=2,
        min_scale=0.0,
        max_scale=math.inf,
    )
    ops.update_scale_(scale, g, h, torch.tensor(found), **a)
    assert (float(scale), int(g), int(h)) == _update_reference(1024.0, gt, ht, found, a)
