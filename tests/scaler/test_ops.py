"""The scaler ops against float64 references, on fresh random inputs with inf/NaN injected."""

import math

import pytest
import torch

import fastamp
from fastamp.scaler import ops
from fastamp.testing import (
    clip_unscale_ref,
    grad_stats_ref,
    make_grads,
    unscale_ref,
    update_scale_ref,
)

GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1000,), (33, 17), (65536 + 3,), (5,), (2, 3, 4), (200_001,)]
# Relative tolerance of an fp32-accumulated sum over ~300k terms.
NORM_RTOL = 1e-5


def _mixed(device, seed, dtypes=None, non_contiguous=False, scale=1.0):
    dtypes = dtypes or [GRAD_DTYPES[i % len(GRAD_DTYPES)] for i in range(len(SHAPES))]
    return make_grads(SHAPES, dtypes, device, seed=seed, scale=scale, non_contiguous=non_contiguous)


def _inject(grads, which, value, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for i in which:
        flat = grads[i].view(-1) if grads[i].is_contiguous() else None
        idx = int(torch.randint(grads[i].numel(), (1,), generator=gen))
        if flat is not None:
            flat[idx] = value
        else:
            pos = torch.unravel_index(torch.tensor(idx), grads[i].shape)
            grads[i][tuple(int(p) for p in pos)] = value


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_grad_stats_matches_float64(device, dtype, norm_type):
    grads = make_grads(SHAPES, dtype, device, seed=1, scale=3.0)
    before = [g.clone() for g in grads]
    inv = 1.0 / 1024.0
    found, pow_sum, flags = ops.grad_stats(grads, torch.tensor(inv, device=device), norm_type)
    ref_found, ref_sum, ref_flags = grad_stats_ref(grads, inv, norm_type)
    assert found.dtype == torch.float32 and found.shape == () and found.device.type == device
    assert float(found) == ref_found == 0.0
    assert flags.tolist() == ref_flags
    assert math.isclose(float(pow_sum), ref_sum, rel_tol=NORM_RTOL if norm_type != 3.0 else 1e-4)
    assert ref_sum > 0
    for g, b in zip(grads, before):  # read-only: nothing written
        assert torch.equal(g, b)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_grad_stats_mixed_dtypes_with_nonfinite(device, value):
    grads = _mixed(device, seed=2)
    _inject(grads, [1, 4], value, seed=3)
    found, pow_sum, flags = ops.grad_stats(grads, torch.tensor(0.25, device=device))
    ref_found, ref_sum, ref_flags = grad_stats_ref(grads, 0.25)
    assert float(found) == 1.0
    assert flags.tolist() == ref_flags == [i in (1, 4) for i in range(len(SHAPES))]
    if math.isnan(value):
        assert math.isnan(float(pow_sum)) and math.isnan(ref_sum)
    else:
        assert float(pow_sum) == math.inf == ref_sum


def test_grad_stats_mixed_finite_matches(device):
    grads = _mixed(device, seed=4)
    found, pow_sum, flags = ops.grad_stats(grads, torch.tensor(0.5, device=device))
    _, ref_sum, _ = grad_stats_ref(grads, 0.5)
    assert float(found) == 0.0 and not flags.any()
    assert math.isclose(float(pow_sum), ref_sum, rel_tol=NORM_RTOL)


def test_grad_stats_norm_is_of_unscaled_values_without_overflow(device):
    # Scaled fp16 grads near the top of the fp16 range: squares overflow fp16 but not fp32.
    grads = make_grads([(4096,)], torch.float16, device, seed=5, scale=8000.0)
    _, pow_sum, _ = ops.grad_stats(grads, torch.tensor(1.0 / 65536, device=device))
    _, ref_sum, _ = grad_stats_ref(grads, 1.0 / 65536)
    assert math.isfinite(float(pow_sum))
    assert math.isclose(float(pow_sum), ref_sum, rel_tol=NORM_RTOL)


def test_grad_stats_is_deterministic(device):
    grads = _mixed(device, seed=6)
    inv = torch.tensor(0.125, device=device)
    first = ops.grad_stats(grads, inv)[1]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(ops.grad_stats(grads, inv)[1], first)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_unscale_matches_float64_and_torch(device, dtype):
    grads = make_grads(SHAPES, dtype, device, seed=7, scale=1000.0)
    inv = 1.0 / 3000.0  # not a power of two: the rounding is exercised
    inv_t = torch.tensor(inv, dtype=torch.float32, device=device)
    inv32 = float(inv_t)
    expected = unscale_ref(grads, inv32)
    theirs = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    flags = ops.non_finite_check_and_unscale_(grads, found, inv_t)
    assert float(found) == 0.0 and not flags.any()
    for g, e in zip(grads, expected):
        # fp32/fp64: one correctly rounded multiply; half types: fp32 multiply then one rounding.
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 0.0)
        torch.testing.assert_close(g.cpu(), e, rtol=tol, atol=0)
    if device == "cpu" or dtype != torch.bfloat16:  # PyTorch's CUDA kernel lacks bf16
        f2 = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, f2, inv_t)
        for g, t in zip(grads, theirs):
            assert torch.equal(g, t), "must be bitwise identical to PyTorch's kernel"


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_unscale_flags_nonfinite_and_accumulates(device, value):
    grads = _mixed(device, seed=8)
    _inject(grads, [3], value, seed=9)
    found = torch.zeros((), device=device)
    flags = ops.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5, device=device))
    assert float(found) == 1.0
    assert flags.tolist() == [i == 3 for i in range(len(SHAPES))]
    # A second, clean call never clears what the first one found.
    clean = make_grads([(10,)], torch.float32, device, seed=10)
    ops.non_finite_check_and_unscale_(clean, found, torch.tensor(0.5, device=device))
    assert float(found) == 1.0


def test_unscale_non_contiguous_and_empty(device):
    shapes = [(7, 9), (0,), (3, 0, 2), (64, 130)]
    grads = make_grads(
        shapes, torch.float32, device, seed=11, non_contiguous=[True, False, False, True]
    )
    assert not grads[0].is_contiguous() and not grads[3].is_contiguous()
    base3 = grads[3]._base
    base_before = base3.clone()
    expected = unscale_ref(grads, 0.5)
    found = torch.zeros((), device=device)
    flags = ops.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5, device=device))
    for g, e in zip(grads, expected):
        assert torch.equal(g.cpu(), e)
    assert flags.tolist() == [False] * 4
    # Elements of the base tensor outside the view are untouched.
    assert torch.equal(base3[..., 1::2], base_before[..., 1::2])
    # Channels-last (dense, non-contiguous) is used in place.
    cl = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    exp = cl * 0.25
    ops.non_finite_check_and_unscale_([cl], found, torch.tensor(0.25, device=device))
    assert torch.equal(cl, exp) and cl.is_contiguous(memory_format=torch.channels_last)


def test_empty_list(device):
    inv = torch.tensor(0.5, device=device)
    found, pow_sum, flags = ops.grad_stats([], inv)
    assert float(found) == 0.0 and float(pow_sum) == 0.0 and flags.numel() == 0
    f = torch.zeros((), device=device)
    ops.non_finite_check_and_unscale_([], f, inv)
    ops.clip_unscale_([], inv, torch.tensor(1.0, device=device), 1.0)
    assert float(f) == 0.0


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_unscale_matches_float64(device, dtype, max_norm):
    grads = make_grads(SHAPES, dtype, device, seed=12, scale=512.0)
    inv = torch.tensor(1.0 / 512.0, device=device)
    found, pow_sum, _ = ops.grad_stats(grads, inv)
    total = pow_sum.sqrt()
    expected = clip_unscale_ref(grads, float(inv), float(total), max_norm)
    ops.clip_unscale_(grads, inv, total, max_norm)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-7}.get(dtype, 1e-7)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=tol, atol=1e-6)
    if max_norm == 0.5:
        new_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        assert math.isclose(new_norm, 0.5, rel_tol=1e-2)


@pytest.mark.parametrize("max_norm", [1.0, 5.3])
def test_clip_unscale_fp32_bitwise_equals_torch_recipe(device, max_norm):
    grads = make_grads(SHAPES, torch.float32, device, seed=13, scale=100.0)
    theirs = [g.clone() for g in grads]
    inv = torch.tensor(1.0 / 300.0, device=device)
    found = torch.zeros((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, inv)
    total = torch.nn.utils.clip_grad_norm_(_as_params(theirs), max_norm)
    ops.clip_unscale_(grads, inv, total, max_norm)
    for g, t in zip(grads, theirs):
        assert torch.equal(g, t)


def _reference_clip(pow_sum: torch.Tensor, norm_type: float, max_norm: float):
    """The root correctly rounded to fp32 (float64 sqrt of an fp32 value, rounded once: exact,
    as IEEE sqrt is; CUDA's torch.sqrt is, the CPU build's MKL sqrt may be one ulp off), then
    torch.nn.utils.clip_grad_norm_'s coefficient with torch's own ops on that root."""
    v = float(pow_sum)
    root = math.sqrt(v) if norm_type == 2.0 and v >= 0 else (math.nan if norm_type == 2.0 else v)
    total = torch.tensor(root, dtype=torch.float32, device=pow_sum.device)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


CLIP_POW_SUMS = [0.0, 1e-30, 1e-12, 0.25, 1.0, 2.0, 3.0, 1e6, 3.4e38, math.inf, math.nan]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.0, 1.0, 5.3, 0.7, 1e9, math.inf])
def test_clip_coef_equals_torch_bit_for_bit(device, norm_type, max_norm):
    """The fused root + coefficient against the correctly rounded root and torch's own ops for
    the coefficient, on fixed edges (0, tiny, inf, NaN, the largest float) and fresh random sums
    over many magnitudes."""
    gen = torch.Generator().manual_seed(int(1000 * norm_type if math.isfinite(norm_type) else 7))
    rand = torch.rand(300, generator=gen) * 10.0 ** torch.randint(-8, 9, (300,), generator=gen)
    for v in CLIP_POW_SUMS + rand.tolist():
        ps = torch.tensor(v, dtype=torch.float32, device=device)
        total, coef = ops.clip_coef(ps, norm_type, max_norm)
        t_total, t_coef = _reference_clip(ps, norm_type, max_norm)
        assert total.shape == coef.shape == () and total.dtype == coef.dtype == torch.float32
        assert total.device == coef.device == ps.device
        torch.testing.assert_close(total, t_total, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(coef, t_coef, rtol=0, atol=0, equal_nan=True, msg=str(v))


def test_clip_coef_matches_float64_within_one_rounding(device):
    """Against the float64 formula: the root and the coefficient within the fp32 roundings."""
    gen = torch.Generator().manual_seed(31)
    sums = torch.rand(200, generator=gen, dtype=torch.float64) * 1e4
    for v in sums.tolist():
        ps = torch.tensor(v, dtype=torch.float32, device=device)
        total, coef = ops.clip_coef(ps, 2.0, 3.7)
        t64 = math.sqrt(float(ps))
        c64 = min(3.7 / (t64 + 1e-6), 1.0)
        assert math.isclose(float(total), t64, rel_tol=2**-23)
        assert math.isclose(float(coef), c64, rel_tol=2**-21)


def test_clip_coef_refuses_by_name(device):
    ps = torch.tensor(4.0, device=device)
    with pytest.raises(RuntimeError, match="norm_type must be 1, 2 or inf, got 3"):
        ops.clip_coef(ps, 3.0, 1.0)
    with pytest.raises(RuntimeError, match="norm_type must be 1, 2 or inf"):
        ops.clip_coef(ps, -math.inf, 1.0)
    for bad in (-1.0, math.nan):
        with pytest.raises(RuntimeError, match="max_norm must be a non-negative number"):
            ops.clip_coef(ps, 2.0, bad)
    with pytest.raises(RuntimeError, match="norm_pow_sum has dtype"):
        ops.clip_coef(ps.double(), 2.0, 1.0)
    with pytest.raises(RuntimeError, match="norm_pow_sum has 2 elements"):
        ops.clip_coef(torch.ones(2, device=device), 2.0, 1.0)
    # a one-element [1] tensor is taken, as the other scalar arguments are
    total, coef = ops.clip_coef(torch.tensor([16.0], device=device), 2.0, 1.0)
    assert float(total) == 4.0 and float(coef) == torch.tensor(1.0 / (4.0 + 1e-6)).item()


def _as_params(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append(p)
    return params


@pytest.mark.parametrize("hysteresis", [1, 3])
@pytest.mark.parametrize("bounds", [(0.0, math.inf), (4.0, 2.0**18)])
def test_update_scale_trajectory_matches_reference(device, hysteresis, bounds):
    lo, hi = bounds
    gen = torch.Generator().manual_seed(14 + hysteresis)
    pattern = (torch.rand(300, generator=gen) < 0.3).tolist()
    scale = torch.tensor(2.0**16 if hi > 2.0**16 else hi, device=device)
    gt = torch.zeros((), dtype=torch.int32, device=device)
    ht = torch.full((), hysteresis, dtype=torch.int32, device=device)
    ref = (float(scale), 0, hysteresis)
    for step, inf in enumerate(pattern):
        found = torch.tensor(1.0 if inf else 0.0, device=device)
        ops.update_scale_(scale, gt, ht, found, 2.0, 0.5, 3, hysteresis, lo, hi)
        ref = update_scale_ref(*ref, inf, 2.0, 0.5, 3, hysteresis, lo, hi)
        assert (float(scale), int(gt), int(ht)) == ref, f"step {step}"
        assert lo <= float(scale) <= hi


def test_update_scale_matches_torch_exactly(device):
    gen = torch.Generator().manual_seed(15)
    pattern = (torch.rand(500, generator=gen) < 0.2).tolist()
    ours = (torch.tensor(1024.0, device=device), torch.zeros((), dtype=torch.int32, device=device))
    ht = torch.ones((), dtype=torch.int32, device=device)
    theirs = (ours[0].clone(), ours[1].clone())
    for inf in pattern:
        found = torch.tensor(float(inf), device=device)
        ops.update_scale_(ours[0], ours[1], ht, found, 1.7, 0.37, 2)
        torch._amp_update_scale_(theirs[0], theirs[1], found, 1.7, 0.37, 2)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_update_scale_never_grows_to_inf(device):
    scale = torch.tensor(3.0e38, device=device)
    gt = torch.zeros((), dtype=torch.int32, device=device)
    ht = torch.ones((), dtype=torch.int32, device=device)
    ops.update_scale_(scale, gt, ht, torch.zeros((), device=device), 2.0, 0.5, 1)
    assert float(scale) == pytest.approx(3.0e38) and int(gt) == 0


# --- bad input: clear errors, nothing written ----------------------------------------------------


def test_errors_name_the_argument_and_write_nothing(device):
    good = make_grads([(10,), (20,)], torch.float32, device, seed=16)
    snapshot = [g.clone() for g in good]
    inv = torch.tensor(0.5, device=device)
    found = torch.zeros((), device=device)
    with pytest.raises(NotImplementedError, match=r"grads\[2\] has dtype Long"):
        ops.non_finite_check_and_unscale_(
            good + [torch.ones(3, dtype=torch.long, device=device)], found, inv
        )
    with pytest.raises(RuntimeError, match="inv_scale has dtype Double"):
        ops.non_finite_check_and_unscale_(good, found, inv.double())
    with pytest.raises(RuntimeError, match="inv_scale has 2 elements"):
        ops.grad_stats(good, torch.ones(2, device=device))
    with pytest.raises(RuntimeError, match=r"grads\[1\] is a view whose elements overlap"):
        ops.non_finite_check_and_unscale_(
            [good[0], torch.ones(1, device=device).expand(5)], found, inv
        )
    with pytest.raises(RuntimeError, match=r"grads\[0\] has layout"):
        ops.grad_stats([torch.ones(3, device=device).to_sparse()], inv)
    with pytest.raises(RuntimeError, match="norm_type must be a positive"):
        ops.grad_stats(good, inv, -1.0)
    with pytest.raises(RuntimeError, match="max_norm must be a non-negative"):
        ops.clip_unscale_(good, inv, torch.tensor(1.0, device=device), -1.0)
    with pytest.raises(RuntimeError, match="growth_interval must be >= 1"):
        ops.update_scale_(
            torch.tensor(1.0, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
            torch.ones((), dtype=torch.int32, device=device),
            found,
            2.0,
            0.5,
            0,
        )
    with pytest.raises(RuntimeError, match="growth_tracker has dtype Float"):
        ops.update_scale_(
            torch.tensor(1.0, device=device),
            torch.zeros((), device=device),
            torch.ones((), dtype=torch.int32, device=device),
            found,
            2.0,
            0.5,
            1,
        )
    with pytest.raises(
        RuntimeError, match="tensor_found_inf must be a contiguous 1-D tensor of len"
    ):
        ops.non_finite_check_and_unscale_(
            good, found, inv, torch.zeros(5, dtype=torch.bool, device=device)
        )
    assert float(found) == 0.0
    for g, s in zip(good, snapshot):
        assert torch.equal(g, s)


def test_device_mismatch_is_rejected():
    if not torch.cuda.is_available():
        # Use the meta device to play "another device" without a GPU.
        g = [torch.ones(3), torch.ones(3, device="meta")]
    else:
        g = [torch.ones(3), torch.ones(3, device="cuda")]
    with pytest.raises(RuntimeError, match=r"grads\[1\] is on"):
        ops.grad_stats(g, torch.tensor(1.0))


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    n = 2**31 + 1000
    g = torch.full((n,), 2.0, dtype=torch.bfloat16)
    g[-1] = math.inf
    found, pow_sum, flags = ops.grad_stats([g], torch.tensor(0.5))
    assert float(found) == 1.0 and flags.tolist() == [True]
    g[-1] = 3.0
    found, pow_sum, _ = ops.grad_stats([g], torch.tensor(0.5))
    assert float(found) == 0.0
    assert math.isclose(float(pow_sum), (n - 1) * 1.0 + 2.25, rel_tol=1e-3)


# --- opcheck ------------------------------------------------------------------------------------


def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs or {})


def test_opcheck_grad_stats(device):
    grads = _mixed(device, seed=17)
    _opcheck(
        torch.ops.fastamp.grad_stats.default,
        (grads, torch.tensor(0.5, device=device)),
        {"norm_type": 2.0},
    )
    _inject(grads, [0], math.inf)
    _opcheck(
        torch.ops.fastamp.grad_stats.default, (grads, torch.tensor(0.5, device=device), math.inf)
    )


def test_opcheck_unscale(device):
    grads = _mixed(device, seed=18)
    _inject(grads, [2], math.nan)
    _opcheck(
        torch.ops.fastamp.non_finite_check_and_unscale_.default,
        (
            grads,
            torch.zeros((), device=device),
            torch.tensor(0.5, device=device),
            torch.zeros(len(grads), dtype=torch.bool, device=device),
        ),
    )


def test_opcheck_clip_unscale(device):
    grads = _mixed(device, seed=19)
    _opcheck(
        torch.ops.fastamp.clip_unscale_.default,
        (grads, torch.tensor(0.5, device=device), torch.tensor(3.0, device=device), 1.0),
    )


def test_opcheck_clip_coef(device):
    for norm_type in (2.0, 1.0, math.inf):
        _opcheck(
            torch.ops.fastamp.clip_coef.default,
            (torch.tensor(9.0, device=device), norm_type, 0.5),
        )


def _record(device, n=5):
    return (
        torch.zeros(n, dtype=torch.bool, device=device),
        torch.tensor(-1, device=device),
    )


@pytest.mark.parametrize("found", [0.0, 1.0, 3.0, math.nan, -1.0])
def test_record_overflow_writes_only_on_an_overflowed_step(device, found):
    """As ``torch.where(found > 0, flags, record)`` for both records (what it replaces)."""
    flags_record, update_record = _record(device)
    flags_record[1] = True
    flags = torch.tensor([True, False, False, True, True], device=device)
    found_t = torch.tensor(found, device=device)
    count = torch.tensor(7, device=device)
    want_flags = torch.where(found_t > 0, flags, flags_record)
    want_update = torch.where(found_t > 0, count, update_record)
    ops.record_overflow_(flags_record, update_record, flags, found_t, count)
    assert torch.equal(flags_record, want_flags) and torch.equal(update_record, want_update)
    assert float(found_t) == found or math.isnan(found)  # inputs untouched
    assert int(count) == 7 and torch.equal(
        flags, torch.tensor([1, 0, 0, 1, 1], device=device).bool()
    )


def test_record_overflow_refuses_by_name_and_writes_nothing(device):
    rec, upd = _record(device)
    flags = torch.ones(5, dtype=torch.bool, device=device)
    one, count = torch.ones((), device=device), torch.tensor(2, device=device)
    cases = [
        ((rec, upd, torch.ones(4, dtype=torch.bool, device=device), one, count),
         "flags has 4 elements and flags_record 5"),
        ((rec, upd, flags.float(), one, count), "flags has dtype"),
        ((rec, upd, flags, one.double(), count), "found_inf has dtype"),
        ((rec, upd.int(), flags, one, count), "update_record has dtype"),
        ((rec, upd, flags, one, count.float()), "update_count has dtype"),
        ((rec.view(5, 1), upd, flags.view(5, 1), one, count), "flags_record must be a contiguous 1-D"),
        ((rec, upd, rec, one, count), "flags and flags_record must be different tensors"),
        ((rec[:3], upd, rec[2:], one, count), "flags and flags_record must be different tensors"),
    ]  # fmt: skip
    for args, msg in cases:
        before = [rec.clone(), upd.clone()]
        with pytest.raises(RuntimeError, match=msg):
            ops.record_overflow_(*args)
        assert torch.equal(rec, before[0]) and torch.equal(upd, before[1])


def test_opcheck_record_overflow(device):
    for found in (0.0, 1.0):
        rec, upd = _record(device)
        _opcheck(
            torch.ops.fastamp.record_overflow_.default,
            (rec, upd, torch.ones(5, dtype=torch.bool, device=device),
             torch.tensor(found, device=device), torch.tensor(3, device=device)),
        )  # fmt: skip


def test_opcheck_update_scale(device):
    args = (
        torch.tensor(1024.0, device=device),
        torch.tensor(2, dtype=torch.int32, device=device),
        torch.tensor(1, dtype=torch.int32, device=device),
        torch.tensor(0.0, device=device),
        2.0,
        0.5,
        3,
        1,
        0.0,
        math.inf,
    )
    _opcheck(torch.ops.fastamp.update_scale_.default, args)


def test_every_op_has_kernels_for_the_built_backends():
    info = fastamp.build_info()
    for op, keys in info["ops"].items():
        assert "CPU" in keys, op
        if info["with_cuda"]:
            assert "CUDA" in keys, op
