"""Low-precision state you can trust (issue 23), each case differential against torch.optim on the
same input: the outcome, the exception class, and the state afterwards.

- interchange: a torch optimizer loading fastamp's state gets the true float moments or fails
  loudly, never 8-bit codes taken for moments;
- all or nothing: per-group options checked when the group is made; a bad load_state_dict
  (missing keys, short scales, codes of another dtype) changes nothing; transposed state is
  re-strided as torch steps it;
- deepcopy and pickle give a working optimizer equal to the original;
- memory-format changes and capturable=True on the CPU behave as torch's.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fastamp
from fastamp.optim import lowbit
from fastamp.testing import assert_bitwise_equal

FORMATS = [torch.float32, torch.bfloat16, "int8"]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.LayerNorm(64))


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def _train(model, opt, steps, start=0):
    for k in range(start, start + steps):
        _grads(model, k)
        opt.step()


def _state_snapshot(opt):
    return copy.deepcopy(opt.state_dict()), [
        p.detach().clone() for g in opt.param_groups for p in g["params"]
    ]


# --- interchange with torch --------------------------------------------------------------------


def test_torch_never_takes_8bit_codes_for_moments():
    """The silent defect: torch's AdamW loaded fastamp's int8 state_dict and stepped on codes cast
    to 0..255. Now what torch can read under its keys is the true moments, or its step fails."""
    a = _model()
    fa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype="int8")
    _train(a, fa, 3)
    sd = copy.deepcopy(fa.state_dict())
    t = torch.optim.AdamW(a.parameters(), lr=1e-3)
    t.load_state_dict(copy.deepcopy(sd))
    w = a[0].weight
    truth = lowbit.INT8.decode(fa.state[w], lowbit.ADAM_MOMENTS)
    assert "exp_avg" not in t.state[w] and "exp_avg_sq" not in t.state[w]
    before = w.detach().clone()
    _grads(a, 9)
    with pytest.raises(KeyError, match="exp_avg"):
        t.step()
    assert_bitwise_equal(w, before)  # torch's step failed before writing the weight
    # The export for torch's keys: float moments, exactly the ones fastamp computes with.
    t2 = torch.optim.AdamW(a.parameters(), lr=1e-3)
    t2.load_state_dict(lowbit.float32_state_dict(sd))
    assert_bitwise_equal(
        (t2.state[w]["exp_avg"], t2.state[w]["exp_avg_sq"]), (truth["exp_avg"], truth["exp_avg_sq"])
    )
    assert "state_dtype" not in t2.param_groups[0]
    t2.step()  # and torch steps on them
    # A copy: keys beside state and param_groups (a user's state_dict hook may add some) stay.
    extra = lowbit.float32_state_dict({**sd, "saved_by": "hook"})
    assert extra["saved_by"] == "hook" and set(extra) == {"state", "param_groups", "saved_by"}
    assert extra["state"] is not sd["state"] and extra["param_groups"] is not sd["param_groups"]


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_torch_loads_bfloat16_state_as_its_exact_floats(cls):
    a = _model()
    kw = {"momentum": 0.9} if cls == "SGD" else {}
    fa = getattr(fastamp.optim, cls)(a.parameters(), lr=1e-3, state_dtype=torch.bfloat16, **kw)
    _train(a, fa, 2)
    t = getattr(torch.optim, cls)(a.parameters(), lr=1e-3, **kw)
    t.load_state_dict(copy.deepcopy(fa.state_dict()))
    w = a[0].weight
    for key in ("exp_avg", "exp_avg_sq") if cls == "AdamW" else ("momentum_buffer",):
        assert fa.state[w][key].dtype == torch.bfloat16
        assert_bitwise_equal(t.state[w][key], fa.state[w][key].float())
    t.step()


def test_codes_under_torch_keys_are_refused():
    """0.1.0's development builds saved the codes under torch's keys; that layout is not read:
    loading it (or converting it with float32_state_dict) raises, naming the keys to rename,
    and changes nothing."""
    a = _model()
    fa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype="int8")
    _train(a, fa, 2)
    sd = copy.deepcopy(fa.state_dict())
    for st in sd["state"].values():
        if "exp_avg_codes" in st:
            st["exp_avg"] = st.pop("exp_avg_codes")
            st["exp_avg_sq"] = st.pop("exp_avg_sq_codes")
    want = r"8-bit codes \(uint8\) under PyTorch's keys .*'exp_avg' -> 'exp_avg_codes'"
    for fmt in ("int8", torch.float32):
        b = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt)
        _train(a, b, 1)
        before = copy.deepcopy(b.state_dict())
        with pytest.raises(KeyError, match=want):
            b.load_state_dict(sd)
        assert_bitwise_equal(b.state_dict(), before)
    with pytest.raises(KeyError, match=want):
        lowbit.float32_state_dict(sd)


# --- per-group options: checked when the group is made -------------------------------------------


def _two_groups(model):
    return [list(model[0].parameters()), list(model[2].parameters()) + list(model[3].parameters())]


@pytest.mark.parametrize(
    "default, group0",
    [
        (torch.float32, torch.bfloat16),
        ("int8", torch.float32),
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
    ],
)
def test_per_group_state_dtype_steps_as_that_format(default, group0):
    """A group's own state_dtype steps exactly as an optimizer made with that format."""
    a, b, c = _model(), _model(), _model()
    ga = _two_groups(a)
    mixed = fastamp.optim.AdamW(
        [{"params": ga[0], "state_dtype": group0}, {"params": ga[1]}],
        lr=1e-3,
        state_dtype=default,
        state_seed=3,
    )
    gb, gc = _two_groups(b), _two_groups(c)
    only0 = fastamp.optim.AdamW(gb[0], lr=1e-3, state_dtype=group0, state_seed=3)
    only1 = fastamp.optim.AdamW(gc[1], lr=1e-3, state_dtype=default, state_seed=3)
    for k in range(3):
        for m in (a, b, c):
            _grads(m, k)
        mixed.step()
        only0.step()
        only1.step()
    assert_bitwise_equal(ga[0], gb[0])
    assert_bitwise_equal(ga[1], gc[1])
    assert mixed.param_groups[0]["state_dtype"] == lowbit.resolve(group0, "").name


@pytest.mark.parametrize("bad", ["int4", torch.float16, "8bit", torch.uint8])
def test_bad_group_state_dtype_is_refused_when_the_group_is_made(bad):
    a = _model()
    ga = _two_groups(a)
    with pytest.raises(ValueError, match=r"param group 0: state_dtype must be"):
        fastamp.optim.AdamW([{"params": ga[0], "state_dtype": bad}], state_dtype="int8")
    opt = fastamp.optim.AdamW(ga[0], state_dtype="int8")
    with pytest.raises(ValueError, match=r"param group 1: state_dtype must be"):
        opt.add_param_group({"params": ga[1], "state_dtype": bad})
    assert len(opt.param_groups) == 1


def test_add_param_group_amsgrad_on_int8_refused_before_anything_changes():
    """torch accepts the group (its state is float); fastamp cannot keep amsgrad's running max in
    8 bits, and says so when the group is added, not halfway through a step."""
    a = _model()
    ga = _two_groups(a)
    t = torch.optim.AdamW(ga[0])
    t.add_param_group({"params": ga[1], "amsgrad": True})
    opt = fastamp.optim.AdamW(ga[0], state_dtype="int8")
    with pytest.raises(ValueError, match=r"param group 1: amsgrad=True needs float32 state"):
        opt.add_param_group({"params": ga[1], "amsgrad": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": ga[1], "amsgrad": True, "state_dtype": torch.float32})
    _grads(a, 0)
    opt.step()
    assert "max_exp_avg_sq" in opt.state[ga[1][0]]
    # A group edited into amsgrad after it was made: refused by the step before any write.
    opt.param_groups[0]["amsgrad"] = True
    before = _state_snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 0: amsgrad=True needs float32 state"):
        opt.step()
    assert_bitwise_equal(_state_snapshot(opt), before)


def test_sgd_group_state_dtype():
    a = _model()
    ga = _two_groups(a)
    with pytest.raises(ValueError, match="SGD's one momentum buffer"):
        fastamp.optim.SGD([{"params": ga[0], "state_dtype": "int8"}], lr=0.1, momentum=0.9)
    opt = fastamp.optim.SGD(
        [{"params": ga[0], "state_dtype": torch.bfloat16}, {"params": ga[1]}], lr=0.1, momentum=0.9
    )
    _train(a, opt, 2)
    assert opt.state[a[0].weight]["momentum_buffer"].dtype == torch.bfloat16
    assert opt.state[a[2].weight]["momentum_buffer"].dtype == torch.float32


# --- load_state_dict: all checked before anything is replaced -------------------------------------


def _int8_run():
    a = _model()
    opt = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype="int8")
    _train(a, opt, 2)
    return a, opt


def _corrupt(sd, how):
    sd = copy.deepcopy(sd)
    st = sd["state"][0]  # a[0].weight: 6144 elements, 8-bit
    if how == "missing_scales":
        del st["exp_avg_sq_absmax"]
    elif how == "short_scales":
        st["exp_avg_absmax"] = st["exp_avg_absmax"][:-1].clone()
    elif how == "float_scales_2d":
        st["exp_avg_absmax"] = st["exp_avg_absmax"].reshape(2, -1).clone()
    elif how == "int8_codes":
        st["exp_avg_codes"] = st["exp_avg_codes"].to(torch.int8)
    elif how == "int16_codes":
        st["exp_avg_sq_codes"] = st["exp_avg_sq_codes"].to(torch.int16)
    elif how == "float_codes":  # what torch's load_state_dict leaves of them
        st["exp_avg_codes"] = st["exp_avg_codes"].float()
    elif how == "codes_and_moments":
        st["exp_avg"] = torch.zeros(st["exp_avg_codes"].shape)
    elif how == "wrong_shape_codes":
        st["exp_avg_codes"] = st["exp_avg_codes"].reshape(-1).clone()
    return sd


@pytest.mark.parametrize(
    "how, exc",
    [
        ("missing_scales", KeyError),
        ("short_scales", ValueError),
        ("float_scales_2d", ValueError),
        ("int8_codes", TypeError),
        ("int16_codes", TypeError),
        ("float_codes", TypeError),
        ("codes_and_moments", KeyError),
        ("wrong_shape_codes", ValueError),
    ],
)
def test_corrupted_lowbit_state_dict_changes_nothing(how, exc):
    a, opt = _int8_run()
    bad = _corrupt(opt.state_dict(), how)
    before = _state_snapshot(opt)
    with pytest.raises(exc, match=r"state_dict\['state'\]\[0\]"):
        opt.load_state_dict(bad)
    assert_bitwise_equal(_state_snapshot(opt), before)
    _grads(a, 5)
    opt.step()  # and the optimizer still works


@pytest.mark.parametrize("fmt", [torch.bfloat16, "int8"])
def test_integer_moments_are_refused(fmt):
    """Signed integer tensors under torch's keys are not moments (they used to be converted as
    if they were floats)."""
    a = _model()
    opt = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt)
    t = torch.optim.AdamW(a.parameters(), lr=1e-3)
    _grads(a, 0)
    t.step()
    sd = copy.deepcopy(t.state_dict())
    sd["state"][0]["exp_avg"] = (sd["state"][0]["exp_avg"] * 1e4).to(torch.int8)
    with pytest.raises(
        TypeError, match=r"\['exp_avg'\] is a torch.int8 tensor; expected float moments"
    ):
        opt.load_state_dict(sd)
    assert not opt.state


@pytest.mark.parametrize("fmt", FORMATS)
def test_transposed_state_is_restrided_as_torch_steps_it(fmt):
    """State tensors of the right shape but other strides (a hand-edited or converted checkpoint):
    torch steps them as they are; fastamp re-strides them, same numbers."""
    a, b = _model(), _model()
    oa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt)
    _train(a, oa, 2)
    sd = copy.deepcopy(oa.state_dict())
    sd_t = copy.deepcopy(sd)
    for st in sd_t["state"].values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                st[k] = v.t().contiguous().t()  # same values, transposed strides
    ob = fastamp.optim.AdamW(b.parameters(), lr=1e-3, state_dtype=fmt)
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(sd_t)
    oa.load_state_dict(sd)
    _train(a, oa, 2, start=2)
    _train(b, ob, 2, start=2)
    assert_bitwise_equal(list(a.parameters()), list(b.parameters()))
    if fmt == torch.float32:  # torch too steps them
        c = _model()
        c.load_state_dict(b.state_dict())
        t = torch.optim.AdamW(c.parameters(), lr=1e-3)
        t.load_state_dict(sd_t)


# --- deepcopy and pickle -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, fmt",
    [
        ("SGD", torch.float32),
        ("SGD", torch.bfloat16),
        ("Adam", "int8"),
        ("AdamW", torch.float32),
        ("AdamW", torch.bfloat16),
        ("AdamW", "int8"),
    ],
)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_an_optimizer_step_as_the_original(cls, fmt, how):
    kw = {"momentum": 0.9} if cls == "SGD" else {}
    a = _model()
    opt = getattr(fastamp.optim, cls)(
        a.parameters(), lr=1e-2, state_dtype=fmt, state_seed=7, master_weights=True, **kw
    )
    _train(a, opt, 2)
    if how == "deepcopy":
        b, ob = copy.deepcopy((a, opt))
    elif how == "pickle":
        b, ob = pickle.loads(pickle.dumps((a, opt)))
    else:
        buf = io.BytesIO()
        torch.save((a, opt), buf)
        buf.seek(0)
        b, ob = torch.load(buf, weights_only=False)
    # torch's optimizer survives the same.
    t = getattr(torch.optim, cls)(a.parameters(), lr=1e-2, **kw)
    copy.deepcopy(t)
    assert type(ob) is type(opt)
    assert ob._master_weights and ob._default_format is opt._default_format
    _train(a, opt, 2, start=2)
    _train(b, ob, 2, start=2)
    assert_bitwise_equal(list(a.parameters()), list(b.parameters()))
    assert_bitwise_equal(ob.state_dict(), opt.state_dict())


# --- memory formats and capturable -------------------------------------------------------------


def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 64, 3), nn.Conv2d(64, 16, 3))


def _conv_train(model, opt, steps, start=0):
    for k in range(start, start + steps):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(2, 8, 9, 9, generator=gen).to(
            memory_format=torch.channels_last
            if model[0].weight.is_contiguous(memory_format=torch.channels_last)
            else torch.contiguous_format
        )
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("fmt", FORMATS)
def test_channels_last_after_some_steps_continues_as_torch(fmt):
    a, b = _conv(), _conv()
    fa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt)
    tb = torch.optim.AdamW(b.parameters(), lr=1e-3)
    _conv_train(a, fa, 2)
    _conv_train(b, tb, 2)
    a.to(memory_format=torch.channels_last)
    b.to(memory_format=torch.channels_last)
    _conv_train(a, fa, 2, start=2)
    _conv_train(b, tb, 2, start=2)
    w = a[1].weight
    assert w.is_contiguous(memory_format=torch.channels_last)
    for key, v in fa.state[w].items():
        if v.dim() == 4:  # moments laid out as the param (the 8-bit ones float32 now)
            assert v.stride() == w.stride(), key
    if fmt == torch.float32:
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_contiguous_checkpoint_resumes_into_a_channels_last_model_as_torch():
    a = _conv()
    fa = fastamp.optim.AdamW(a.parameters(), lr=1e-3)
    _conv_train(a, fa, 2)
    sd, msd = copy.deepcopy(fa.state_dict()), copy.deepcopy(a.state_dict())
    b, c = _conv(), _conv()
    for m in (b, c):
        m.load_state_dict(msd)
        m.to(memory_format=torch.channels_last)
    fb = fastamp.optim.AdamW(b.parameters(), lr=1e-3)
    tc = torch.optim.AdamW(c.parameters(), lr=1e-3)
    fb.load_state_dict(sd)
    # fastamp's dict says fused=True (the state of a fused step), which would switch torch to its
    # fused kernel: that one walks a channels_last param and the contiguous moments loaded for it
    # element by element in memory order (torch keeps the saved layout), so the reference here
    # is torch's for-loop step, as the dict of a non-fused optimizer loads it.
    tsd = copy.deepcopy(sd)
    for group in tsd["param_groups"]:
        group["fused"] = None
    tc.load_state_dict(tsd)
    _conv_train(b, fb, 2, start=2)
    _conv_train(c, tc, 2, start=2)
    for pb, pc in zip(b.parameters(), c.parameters()):
        torch.testing.assert_close(pb, pc, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_capturable_on_cpu_raises_as_torch(cls):
    a, b = _model(), _model()
    t = getattr(torch.optim, cls)(a.parameters(), capturable=True)
    f = getattr(fastamp.optim, cls)(b.parameters(), capturable=True)
    _grads(a, 0)
    _grads(b, 0)
    with pytest.raises(AssertionError) as te:
        t.step()
    before = _state_snapshot(f)
    with pytest.raises(type(te.value), match="capturable=True"):
        f.step()
    assert_bitwise_equal(_state_snapshot(f), before)


# --- saving: torch.save with weights_only=True, torch.distributed.checkpoint --------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trips_weights_only_and_through_dcp(fmt, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    a = _model()
    oa = fastamp.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=fmt, state_seed=4)
    _train(a, oa, 2)
    torch.save(oa.state_dict(), tmp_path / "o.pt")
    b = _model(1)
    b.load_state_dict(a.state_dict())
    ob = fastamp.optim.AdamW(b.parameters(), lr=1e-3, state_dtype=fmt, state_seed=4)
    ob.load_state_dict(torch.load(tmp_path / "o.pt", weights_only=True))
    assert_bitwise_equal(ob.state_dict(), oa.state_dict())
    # torch.distributed.checkpoint with its state_dict helpers (FQN keys), as FSDP users save.
    msd, osd = get_state_dict(a, oa)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    c = _model(2)
    oc = fastamp.optim.AdamW(c.parameters(), lr=1e-3, state_dtype=fmt, state_seed=4)
    msd2, osd2 = get_state_dict(c, oc)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(c, oc, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_bitwise_equal(oc.state_dict(), oa.state_dict())
    _train(a, oa, 2, start=2)
    _train(c, oc, 2, start=2)
    assert_bitwise_equal(list(c.parameters()), list(a.parameters()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_byte_count_is_the_measured_storage(fmt):
    """StateFormat.nbytes against the storages of the state the step made."""
    ps = [nn.Parameter(torch.randn(96, 256)), nn.Parameter(torch.randn(5000))]
    opt = fastamp.optim.AdamW(ps, state_dtype=fmt)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    form = lowbit.resolve(fmt, "test")
    for p in ps:
        moments = {k: v for k, v in opt.state[p].items() if k != "step"}
        measured = sum(v.untyped_storage().nbytes() for v in moments.values())
        expected = form.nbytes(p, lowbit.ADAM_MOMENTS)
        assert measured == expected, (fmt, p.shape, measured, expected)
    assert lowbit.INT8.nbytes(ps[1], lowbit.ADAM_MOMENTS) == 2 * 5000 + 2 * 4 * 20  # 20 blocks


@pytest.mark.parametrize(
    "cls, fmt",
    [("AdamW", torch.bfloat16), ("AdamW", "int8"), ("Adam", "int8"), ("SGD", torch.bfloat16)],
)
def test_maximize_reaches_the_lowbit_kernels(cls, fmt):
    """maximize=True steps as torch's rule says: as the negated grads would."""
    kw = {"momentum": 0.9} if cls == "SGD" else {}
    runs = []
    for lr, maximize in ((1e-3, False), (1e-3, True)):
        a = _model()
        opt = getattr(fastamp.optim, cls)(
            a.parameters(), lr=lr, maximize=maximize, state_dtype=fmt, **kw
        )
        for k in range(3):
            _grads(a, k)
            if maximize:
                for p in a.parameters():
                    p.grad.neg_()
            opt.step()
        runs.append(list(a.parameters()))
    assert_bitwise_equal(runs[1], runs[0])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_state_is_updated_in_place_and_checked_for_its_device(fmt):
    """As torch's AdamW, the step updates the state tensors in place: a reference taken before a
    step sees the new moments (no re-encoding into new tensors when the state is already in its
    format). A moment moved to another device is refused by name before anything is written."""
    m = nn.Linear(8, 4)
    t_m = copy.deepcopy(m)
    o = fastamp.optim.AdamW(m.parameters(), lr=1e-3, state_dtype=fmt)
    t = torch.optim.AdamW(t_m.parameters(), lr=1e-3)
    for model, opt in ((m, o), (t_m, t)):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        held = dict(opt.state[model.weight])
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        assert all(opt.state[model.weight][k] is v for k, v in held.items()), type(opt)
    st = o.state[m.weight]
    st["exp_avg"] = st["exp_avg"].to("meta")
    before = m.weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=r"\['exp_avg'\] is on meta; expected the parameter's device"
    ):
        o.step()
    assert_bitwise_equal(m.weight, before)
    t.state[t_m.weight]["exp_avg"] = t.state[t_m.weight]["exp_avg"].to("meta")
    with pytest.raises(RuntimeError):  # torch's class for the same state
        t.step()


@pytest.mark.parametrize("seed", [-1, 2**32 + 3, 1.5, True, None])
def test_a_state_seed_edited_into_a_group_is_checked_before_the_step(seed):
    """The constructor refuses these seeds; one written into param_groups between steps was
    taken as int(seed) (or raised from inside the launch). The step checks it as the
    constructor does, before anything changes."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(100))
    b = nn.Parameter(torch.randn(64, 128))
    opt = fastamp.optim.AdamW([{"params": [a]}, {"params": [b], "state_dtype": "int8"}], lr=1e-2)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[1]["state_seed"] = seed
    before = [a.detach().clone(), b.detach().clone(), opt.state[a]["step"].clone()]
    with pytest.raises(
        ValueError, match=r"param group 1.*state_seed.*must be an int in \[0, 2\*\*32\)"
    ):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert torch.equal(opt.state[a]["step"], before[2])


@pytest.mark.parametrize("fmt", [torch.bfloat16, "int8"])
def test_the_state_lists_params_in_torchs_order_with_mixed_formats(fmt):
    """A group whose large params keep low-bit state and small ones float32 is launched format
    by format; the state is still made in the params' order, as torch's (state_dict()["state"]
    listed [1, 0, 2] for a small, a large and a small param)."""
    torch.manual_seed(0)
    ps = [
        nn.Parameter(torch.randn(10)),
        nn.Parameter(torch.randn(64, 128)),
        nn.Parameter(torch.randn(7)),
    ]
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = fastamp.optim.AdamW(ps, lr=1e-2, state_dtype=fmt)
    topt = torch.optim.AdamW(ref, lr=1e-2)
    for group in (ps, ref):
        for p in group:
            p.grad = torch.ones_like(p)
    opt.step()
    topt.step()
    assert list(opt.state_dict()["state"]) == list(topt.state_dict()["state"]) == [0, 1, 2]
    assert list(opt.state) == ps
    opt.step()  # the planned step after it
