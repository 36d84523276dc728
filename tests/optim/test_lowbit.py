"""Low-precision optimizer state (fastamp.optim.lowbit, fastamp::adam_lowbit_step_): the codecs
against a float64 rounding reference, the kernel against the float32 kernel plus the codecs (bit for
bit), against float64 Adam (tolerance), stochastic rounding reproducible and unbiased, the fused
skip, state_dict round trips and conversions, memory per parameter, and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fastamp
from fastamp.optim import lowbit
from fastamp.testing import adam_ref, assert_bitwise_equal, lowbit_ref, op_args

ops = torch.ops.fastamp  # the ops themselves: their schemas are the interface under test

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)


def _rne_reference(y: torch.Tensor, mbits: int, min_exp: int) -> torch.Tensor:
    """y truncated to bfloat16 (the codes are computed from the high half of the float32 bits),
    then rounded to `mbits` mantissa bits, to nearest even, in float64; 0 below 2^min_exp."""
    y = (y.float().view(torch.int32) & -65536).view(torch.float32)
    a = y.double().abs()
    out = torch.zeros_like(a)
    nz = a > 0
    e = torch.floor(torch.log2(a[nz]))
    scaled = a[nz] / torch.exp2(e) * 2**mbits  # in [2^mbits, 2^(mbits+1))
    q = torch.round(scaled)  # torch.round rounds half to even
    r = q / 2**mbits * torch.exp2(e)
    r = torch.where(torch.floor(torch.log2(r)) < min_exp, torch.zeros_like(r), r)
    out[nz] = r
    return out * torch.sign(y.double())


def test_codecs_round_to_nearest_even_against_float64():
    gen = torch.Generator().manual_seed(0)
    y = torch.rand(200_000, generator=gen) * 2 - 1
    y = y * torch.exp2(-torch.randint(0, 18, (y.numel(),), generator=gen).float())  # many decades
    got = lowbit.decode_m8(lowbit.encode_m8(y)).double()
    ref = _rne_reference(y, 3, -14)
    assert torch.equal(got, ref)
    v = y.abs() * torch.exp2(-torch.randint(0, 16, (y.numel(),), generator=gen).float())
    assert torch.equal(lowbit.decode_v8(lowbit.encode_v8(v)).double(), _rne_reference(v, 3, -30))
    # Every code decodes to a distinct value (but the zeros), and re-encodes to itself.
    codes = torch.arange(256, dtype=torch.uint8)
    for enc, dec in ((lowbit.encode_m8, lowbit.decode_m8), (lowbit.encode_v8, lowbit.decode_v8)):
        vals = dec(codes)
        live = vals != 0
        assert torch.equal(enc(vals[live]), codes[live])
    # The largest magnitudes are exact: the block's absmax itself round-trips.
    assert lowbit.decode_m8(lowbit.encode_m8(torch.tensor([1.0, -1.0]))).tolist() == [1.0, -1.0]
    # Out of range (a NaN/inf block scale, never |y| > 1 otherwise) saturates, NaN included.
    odd = torch.tensor([math.inf, -math.inf, math.nan, 3.0, 1e-30, -1e-30, 0.0])
    assert lowbit.encode_m8(odd).tolist() == [127, 255, 127, 127, 0, 128, 0]
    # A NaN's code is 127 whatever its sign (x86 makes negative NaNs, a GPU positive ones).
    nans = torch.tensor([math.nan, -math.nan])
    assert nans.view(torch.int32)[1] < 0, "the second NaN carries a sign bit"
    assert lowbit.encode_m8(nans).tolist() == [127, 127]
    assert lowbit.encode_v8(odd.abs()).tolist() == [255, 255, 255, 255, 0, 0, 0]
    assert lowbit.decode_m8(torch.tensor([128], dtype=torch.uint8)).tolist() == [0.0]
    # The relative error bound of the docs: half a step of the 3-bit mantissa plus the truncation.
    live = ref != 0
    rel = ((got - y.double()).abs()[live] / y.double().abs()[live]).max().item()
    assert rel <= 2**-4 + 2**-8, rel


def _state(numel: int, fmt: str, seed: int = 1, master: bool = False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(numel, generator=gen) * 0.1).to(dtype)
    g = (torch.randn(numel, generator=gen) * 1e-2).to(dtype)
    m = torch.randn(numel, generator=gen) * 1e-3
    v = torch.rand(numel, generator=gen) * 1e-5 + 1e-9
    # The kernel's four lists, named after the op's arguments (codes for int8).
    form = lowbit.resolve(fmt, "test")
    lists = form.adam_lists([form.encode({"exp_avg": m, "exp_avg_sq": v}, p.float())])
    st = {
        k: t[0]
        for k, t in zip(("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"), lists)
        if t
    }
    mp = p.float().clone() if master else None
    return p, g, st, mp


def _floats(st):
    """The float32 moments of a _state dict."""
    if st["exp_avg"].dtype == torch.uint8:
        return lowbit.dequantize(
            st["exp_avg"], st["exp_avg_sq"], st["exp_avg_absmax"], st["exp_avg_sq_absmax"]
        )
    return st["exp_avg"].float(), st["exp_avg_sq"].float()


def _lowbit_call(
    p, g, st, steps, mp=None, seed=7, inv=None, found=None, coef=None, maximize=False, lr_t=None
):
    int8 = st["exp_avg"].dtype == torch.uint8
    ops.adam_lowbit_step_(*op_args("adam_lowbit_step_", params=[p], grads=[g],
                                   exp_avgs=[st["exp_avg"]], exp_avg_sqs=[st["exp_avg_sq"]],
                                   exp_avg_absmax=[st["exp_avg_absmax"]] if int8 else [],
                                   exp_avg_sq_absmax=[st["exp_avg_sq_absmax"]] if int8 else [],
                                   state_steps=[steps],
                                   master_params=[mp] if mp is not None else [], seed=seed,
                                   lr=HYPER["lr"], lr_tensor=lr_t, beta1=HYPER["beta1"],
                                   beta2=HYPER["beta2"], weight_decay=HYPER["weight_decay"],
                                   eps=HYPER["eps"], maximize=maximize, inv_scale=inv,
                                   found_inf=found, clip_coef=coef))  # fmt: skip


def _float32_call(p, g, m, v, steps, mp=None, inv=None, coef=None, maximize=False, lr_t=None):
    ops.adam_step_(*op_args("adam_step_", params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v],
                            state_steps=[steps], master_params=[mp] if mp is not None else [],
                            lr=HYPER["lr"], lr_tensor=lr_t, beta1=HYPER["beta1"],
                            beta2=HYPER["beta2"], weight_decay=HYPER["weight_decay"],
                            eps=HYPER["eps"], maximize=maximize, inv_scale=inv,
                            clip_coef=coef))  # fmt: skip


@pytest.mark.parametrize("lr_t", [None, 2e-3], ids=["lr", "lr_tensor"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "maximize"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [4096, 70_000, 65_536 + 256 * 3 + 17])
def test_int8_step_is_the_float32_step_plus_the_codec_bit_for_bit(
    numel, dtype, scaled, maximize, lr_t
):
    master = dtype != torch.float32
    p, g, st, mp = _state(numel, "int8", seed=numel, master=master, dtype=dtype)
    # Unscaled (no GradScaler, no clip): the float32-param kernel skips the multiplies by 1.
    inv, coef = (torch.tensor(0.5), torch.tensor(0.8)) if scaled else (None, None)
    # The float32 kernel on the dequantized moments does the same float32 arithmetic.
    m32, v32 = lowbit.dequantize(
        st["exp_avg"], st["exp_avg_sq"], st["exp_avg_absmax"], st["exp_avg_sq_absmax"]
    )
    p32, m32, v32 = p.clone(), m32.clone(), v32.clone()
    mp32 = mp.clone() if master else None
    steps, steps32 = torch.tensor(4.0), torch.tensor(4.0)
    lr_t = None if lr_t is None else torch.tensor(lr_t)  # a tensor lr overrides the float one
    _float32_call(p32, g, m32, v32, steps32, mp32, inv, coef, maximize, lr_t)
    _lowbit_call(p, g, st, steps, mp, inv=inv, coef=coef, maximize=maximize, lr_t=lr_t)
    assert_bitwise_equal(p, p32, "params")
    if master:
        assert_bitwise_equal(mp, mp32, "master")
    mq, vq, am, av = lowbit.quantize(m32, v32)
    assert_bitwise_equal(
        (st["exp_avg"], st["exp_avg_sq"], st["exp_avg_absmax"], st["exp_avg_sq_absmax"]),
        (mq, vq, am, av),
        "codes and scales",
    )
    assert float(steps) == 5.0


def test_int8_nan_moment_codes_do_not_depend_on_the_nan_sign():
    """A NaN gradient stepped in (no scaler) makes NaN moments; their codes are 127 whichever sign
    the hardware gave the NaN, so a CPU and a GPU store the same state (an H200 stored 127 where
    x86 stored 255 before the codec dropped a NaN's sign)."""
    p, g, st, _ = _state(4096, "int8", seed=2)
    g[5], g[700], g[3000] = math.nan, -math.nan, math.nan
    g[3000] = -g[3000]  # a NaN with the sign bit set, made by arithmetic
    assert (g.view(torch.int32)[[700, 3000]] < 0).all()
    _lowbit_call(p, g, st, torch.tensor(3.0))
    assert st["exp_avg"][[5, 700, 3000]].tolist() == [127, 127, 127]
    m, _ = _floats(st)
    assert torch.isnan(m[[5, 700, 3000]]).all()


@pytest.mark.parametrize("lr_t", [None, 2e-3], ids=["lr", "lr_tensor"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "maximize"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_bf16_step_is_the_float32_step_plus_stochastic_rounding_bit_for_bit(scaled, maximize, lr_t):
    numel = 70_000
    p, g, st, _ = _state(numel, "bfloat16", seed=3)
    m32, v32 = st["exp_avg"].float(), st["exp_avg_sq"].float()
    p32 = p.clone()
    steps, steps32 = torch.tensor(9.0), torch.tensor(9.0)
    inv, coef = (torch.tensor(0.25), torch.tensor(0.9)) if scaled else (None, None)
    g[123], g[456], g[789] = math.nan, -math.nan, math.inf  # stepped in: no found_inf here
    lr_t = None if lr_t is None else torch.tensor(lr_t)
    _float32_call(p32, g, m32, v32, steps32, inv=inv, coef=coef, maximize=maximize, lr_t=lr_t)
    _lowbit_call(p, g, st, steps, seed=11, inv=inv, coef=coef, maximize=maximize, lr_t=lr_t)
    assert_bitwise_equal(p, p32, "params")
    r = lowbit_ref.sr_bits(lowbit_ref.sr_key(11, 10, 0), torch.arange(numel))
    assert_bitwise_equal(st["exp_avg"], lowbit_ref.bf16_stochastic(m32, r), "exp_avg")
    assert_bitwise_equal(st["exp_avg_sq"], lowbit_ref.bf16_stochastic(v32, r >> 16), "exp_avg_sq")


def test_lowbit_steps_track_float64_adam():
    """Five steps from the same start stay close to float64 Adam over the dequantized start: the
    moments within their rounding (8-bit codes: half a step of a 3-bit mantissa, 2^-4 relative,
    per requantization; bfloat16: 2^-8), the params within a fraction of one lr-sized step."""
    for fmt, m_tol, p_tol in (("int8", 0.1, 1.0), ("bfloat16", 0.01, 0.1)):
        p, g0, st, _ = _state(8192, fmt, seed=5)
        m, v = _floats(st)
        rp, rm, rv = p.double(), m.double(), v.double()
        steps = torch.tensor(0.0)
        gen = torch.Generator().manual_seed(9)
        for k in range(5):
            g = g0 + torch.randn(g0.shape, generator=gen) * 1e-3
            _lowbit_call(p, g, st, steps)
            rp, rm, rv, _ = adam_ref(
                rp,
                g,
                rm,
                rv,
                None,
                k + 1,
                amsgrad=False,
                decoupled=True,
                maximize=False,
                **{k2: v2 for k2, v2 in HYPER.items()},
            )
        lr_steps = (p.double() - rp).abs().max().item() / HYPER["lr"]
        assert lr_steps < p_tol, (fmt, lr_steps)
        m_now, _ = _floats(st)
        rel = ((m_now.double() - rm).abs().max() / rm.abs().max()).item()
        assert rel < m_tol, (fmt, rel)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = torch.full((400_000,), 1.0 + 2**-9 + 2**-11)  # between two bfloat16 values, not halfway
    lo, hi = 1.0, 1.0 + 2**-7
    r = lowbit_ref.sr_bits(lowbit_ref.sr_key(3, 1, 0), torch.arange(x.numel()))
    y = lowbit_ref.bf16_stochastic(x, r).double()
    assert set(y.unique().tolist()) == {lo, hi}
    p_hi = (x[0].item() - lo) / (hi - lo)
    mean = y.mean().item()
    stderr = (hi - lo) * math.sqrt(p_hi * (1 - p_hi) / x.numel())
    assert abs(mean - x[0].item()) < 4 * stderr  # round to nearest would be off by 2^-9+2^-11
    assert abs(x.to(torch.bfloat16).double()[0].item() - x[0].item()) > 50 * stderr
    again = lowbit_ref.bf16_stochastic(
        x, lowbit_ref.sr_bits(lowbit_ref.sr_key(3, 1, 0), torch.arange(x.numel()))
    )
    assert torch.equal(again.double(), y)
    other = lowbit_ref.bf16_stochastic(
        x, lowbit_ref.sr_bits(lowbit_ref.sr_key(4, 1, 0), torch.arange(x.numel()))
    )
    assert not torch.equal(other.double(), y)
    # Non-finite: a NaN becomes the canonical 0x7FC0, inf stays, the largest floats may round up
    # to inf.
    odd = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 3.4e38])
    got = lowbit_ref.bf16_stochastic(odd, torch.full((5,), 0xFFFF))
    assert got.view(torch.int16)[:2].tolist() == [0x7FC0, 0x7FC0]
    assert got.float()[2:].tolist() == [math.inf, -math.inf, math.inf]


def test_rounding_bits_look_uniform_and_independent():
    """The counter hash's two 16-bit halves (exp_avg's and exp_avg_sq's rounding bits): uniform
    over 256 bins, uncorrelated with each other, from one step to the next, and between
    neighbouring elements, within a chunk and past the 2^16 and 2^32 chunk/index boundaries."""
    n = 1 << 16
    for start in (0, 3 << 16, (1 << 32) + (5 << 16)):
        idx = torch.arange(start, start + n)
        r1 = lowbit_ref.sr_bits(lowbit_ref.sr_key(0, 7, 2), idx)
        r2 = lowbit_ref.sr_bits(lowbit_ref.sr_key(0, 8, 2), idx)
        halves = [(r1 & 0xFFFF).double(), (r1 >> 16).double(), (r2 & 0xFFFF).double()]
        for h in halves:
            counts = torch.bincount((h.long() >> 8), minlength=256).double()
            chi2 = (((counts - n / 256) ** 2) / (n / 256)).sum().item()
            assert chi2 < 255 + 6 * math.sqrt(2 * 255), chi2  # 6 sigma of chi-square(255)
        pairs = [(halves[0], halves[1]), (halves[0], halves[2]), (halves[0][1:], halves[0][:-1])]
        for a, b in pairs:
            corr = torch.corrcoef(torch.stack([a, b]))[0, 1].abs().item()
            assert corr < 6 / math.sqrt(n), corr


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_overflow_step_writes_nothing(fmt):
    p, g, st, _ = _state(5000, fmt, seed=2)
    g[17] = math.inf
    before = (p.clone(), {k: v.clone() for k, v in st.items()})
    steps = torch.tensor(3.0)
    _lowbit_call(p, g, st, steps, found=torch.tensor(1.0))
    assert_bitwise_equal((p, st), before)
    assert float(steps) == 3.0


def test_opcheck():
    for fmt in ("int8", "bfloat16"):
        p, g, st, _ = _state(4096, fmt, seed=4)
        int8 = fmt == "int8"
        args = op_args("adam_lowbit_step_", params=[p], grads=[g], exp_avgs=[st["exp_avg"]],
                       exp_avg_sqs=[st["exp_avg_sq"]],
                       exp_avg_absmax=[st["exp_avg_absmax"]] if int8 else [],
                       exp_avg_sq_absmax=[st["exp_avg_sq_absmax"]] if int8 else [],
                       state_steps=[torch.tensor(1.0)], seed=5, lr=1e-3,
                       inv_scale=torch.tensor(0.5), found_inf=torch.tensor(0.0))  # fmt: skip
        torch.library.opcheck(torch.ops.fastamp.adam_lowbit_step_.default, args)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(512, 64),
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
        nn.LayerNorm(64),
        nn.Linear(64, 512),
    )


def _train(model, opt, steps, seed=1, start=0):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for k in range(start + steps):
        x = torch.randint(0, 512, (16, 8), generator=gen)
        if k < start:
            continue
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", ["int8", torch.bfloat16])
def test_state_dict_resumes_bit_for_bit(fmt):
    a = _model()
    oa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt, state_seed=5)
    _train(a, oa, 6)
    b = _model()
    b.load_state_dict(a.state_dict())
    ob = fastamp.optim.AdamW(b.parameters(), lr=1e-3, state_dtype=fmt, state_seed=5)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # a copy, as torch.save/load gives: an
    # in-memory state_dict shares its step tensors with both optimizers (so does torch's)
    assert_bitwise_equal(ob.state_dict(), oa.state_dict())
    _train(a, oa, 4, start=6)
    _train(b, ob, 4, start=6)
    assert_bitwise_equal(list(a.parameters()), list(b.parameters()))
    assert_bitwise_equal(ob.state_dict(), oa.state_dict())


def test_switching_precision_through_state_dict_converts():
    a = _model()
    o32 = fastamp.optim.AdamW(a.parameters(), lr=1e-3)
    _train(a, o32, 3)
    sd32 = o32.state_dict()
    o8 = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype="int8")
    o8.load_state_dict(sd32)
    w = a[1].weight
    mq, vq, am, av = lowbit.quantize(sd32["state"][1]["exp_avg"], sd32["state"][1]["exp_avg_sq"])
    assert_bitwise_equal(
        (
            o8.state[w]["exp_avg_codes"],
            o8.state[w]["exp_avg_sq_codes"],
            o8.state[w]["exp_avg_absmax"],
            o8.state[w]["exp_avg_sq_absmax"],
        ),
        (mq, vq, am, av),
    )
    assert set(o8.state[w]) == {
        "exp_avg_codes",
        "exp_avg_sq_codes",
        "exp_avg_absmax",
        "exp_avg_sq_absmax",
        "step",
    }
    assert o8.state[a[4].weight]["exp_avg"].dtype == torch.float32  # 64 elements: stays float32
    assert o8.param_groups[0]["state_dtype"] == "int8"
    _train(a, o8, 2, start=3)  # steps on the converted state
    back = fastamp.optim.AdamW(a.parameters(), lr=1e-3)
    back.load_state_dict(o8.state_dict())
    m, v = lowbit.dequantize(
        o8.state[w]["exp_avg_codes"],
        o8.state[w]["exp_avg_sq_codes"],
        o8.state[w]["exp_avg_absmax"],
        o8.state[w]["exp_avg_sq_absmax"],
    )
    assert_bitwise_equal((back.state[w]["exp_avg"], back.state[w]["exp_avg_sq"]), (m, v))
    assert set(back.state[w]) == {"exp_avg", "exp_avg_sq", "step"}
    assert "state_dtype" not in back.param_groups[0]  # a float32 optimizer's groups are torch's
    torch_opt = torch.optim.AdamW(a.parameters(), lr=1e-3)
    torch_opt.load_state_dict(back.state_dict())  # and load into torch's own AdamW


def test_state_bytes_per_parameter():
    """Measured from the tensors' storage on a model whose tensors are mostly large."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(4096, 256),
        *[nn.Linear(256, 256) for _ in range(6)],
        nn.LayerNorm(256),
        nn.Linear(256, 4096),
    )
    got = {}
    for fmt in (torch.float32, torch.bfloat16, "int8"):
        opt = fastamp.optim.AdamW(model.parameters(), lr=1e-4, state_dtype=fmt)
        model(torch.randint(0, 4096, (2, 4))).sum().backward()
        opt.step()
        got[str(fmt)] = fastamp.memory.optimizer_state_bytes(opt)["state_bytes_per_param"]
        model.zero_grad()
    assert 8.0 <= got["torch.float32"] < 8.05, got
    assert got["torch.bfloat16"] <= 4.1, got
    assert got["int8"] <= 2.1, got


def test_small_and_non_contiguous_params_keep_float32_state():
    small = nn.Parameter(torch.randn(4095))
    wide = nn.Parameter(torch.randn(128, 64).t())  # 8192 elements, not contiguous
    opt = fastamp.optim.Adam([small, wide], state_dtype="int8")
    (small.sum() + wide.square().sum()).backward()
    opt.step()
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    assert opt.state[wide]["exp_avg"].dtype == torch.float32
    assert lowbit.format_of(opt.state[small], lowbit.ADAM_MOMENTS) is lowbit.FLOAT32


def test_bad_arguments_are_refused_before_anything_changes():
    p = nn.Parameter(torch.randn(8192))
    with pytest.raises(
        ValueError, match=r"state_dtype must be torch\.float32, torch\.bfloat16 or 'int8'.*float16"
    ):
        fastamp.optim.AdamW([p], state_dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"amsgrad=True needs float32 state.*state_dtype is 'int8'"
    ):
        fastamp.optim.AdamW([p], amsgrad=True, state_dtype="int8")
    with pytest.raises(ValueError, match=r"state_seed must be an int in \[0, 2\*\*32\)"):
        fastamp.optim.AdamW([p], state_dtype="int8", state_seed=-1)
    # The op refuses mixed formats and wrong block scales with nothing written.
    q, g, st, _ = _state(5000, "int8", seed=8)
    _, _, st16, _ = _state(5000, "bfloat16", seed=8)
    before = (q.clone(), {k: v.clone() for k, v in st.items()})
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] must be a contiguous Byte tensor"):
        ops.adam_lowbit_step_(*op_args(
            "adam_lowbit_step_", params=[q], grads=[g], exp_avgs=[st["exp_avg"]],
            exp_avg_sqs=[st16["exp_avg_sq"]], exp_avg_absmax=[st["exp_avg_absmax"]],
            exp_avg_sq_absmax=[st["exp_avg_sq_absmax"]], state_steps=[torch.tensor(0.0)],
            lr=1e-3))  # fmt: skip
    with pytest.raises(
        RuntimeError,
        match=r"exp_avg_absmax\[0\] must be a contiguous float32 tensor of 20 elements",
    ):
        ops.adam_lowbit_step_(*op_args(
            "adam_lowbit_step_", params=[q], grads=[g], exp_avgs=[st["exp_avg"]],
            exp_avg_sqs=[st["exp_avg_sq"]], exp_avg_absmax=[torch.zeros(19)],
            exp_avg_sq_absmax=[st["exp_avg_sq_absmax"]], state_steps=[torch.tensor(0.0)],
            lr=1e-3))  # fmt: skip
    assert_bitwise_equal((q, st), before)
