"""fastamp.GradScaler against torch.amp.GradScaler: same trajectories, state, errors."""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import count_host_syncs


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    ).to(dtype)


def _overflowing_step(model, opt, scaler):
    """One scaled step whose grads hold an inf (the scaler skips it and backs off)."""
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 16)).sum()).backward()
    model[0].weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()


def _optimizer(kind, model):
    m = list(model.children())
    groups = [
        {"params": list(m[0].parameters()) + list(m[2].parameters())},
        {"params": list(m[3].parameters()) + list(m[5].parameters()), "lr": 3e-3},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-3, foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, fused=True)
    if kind == "sgd_fused":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, fused=True)
    raise ValueError(kind)


def _run(
    scaler_cls, opt_kind, steps, pattern, growth_interval, clip=None, dtype=torch.float32, seed=0
):
    """A training loop with inf/NaN injected at the steps in `pattern`; returns the trajectory."""
    model = _model(seed, dtype)
    opt = _optimizer(opt_kind, model)
    scaler = scaler_cls("cpu", init_scale=2.0**13, growth_interval=growth_interval)
    gen = torch.Generator().manual_seed(seed + 1)
    traj = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dtype)
        y = torch.randn(8, 4, generator=gen).to(dtype)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        kind = pattern.get(step)
        if kind is not None:
            params = [p for p in model.parameters()]
            p = params[(step * 7) % len(params)]
            p.grad.view(-1)[step % p.numel()] = {
                "inf": math.inf,
                "-inf": -math.inf,
                "nan": math.nan,
            }[kind]
        norm = None
        if clip is not None:
            if isinstance(scaler, fastamp.GradScaler):
                norm = scaler.clip_grad_norm_(opt, clip)
            else:
                scaler.unscale_(opt)
                norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        scaler.update()
        traj.append((scaler.get_scale(), skipped, None if norm is None else float(norm)))
    return traj, model, opt, scaler


def _pattern(seed, steps, rate=0.15):
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(steps, generator=gen).tolist()
    kinds = ["inf", "-inf", "nan"]
    # Never on the first step: torch's fused CPU SGD allocates its momentum buffer uninitialised
    # and leaves it so when the first step is skipped (a PyTorch bug that makes runs diverge
    # from garbage memory, whichever scaler drives it).
    return {i: kinds[i % 3] for i, v in enumerate(r) if v < rate and i > 0}


@pytest.mark.parametrize("opt_kind", ["sgd", "adam", "adamw", "adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("growth_interval", [1, 3, 2000])
def test_differential_training_matches_torch(opt_kind, growth_interval):
    steps = 60
    pattern = _pattern(growth_interval, steps)
    t_traj, t_model, t_opt, t_scaler = _run(
        torch.amp.GradScaler, opt_kind, steps, pattern, growth_interval
    )
    f_traj, f_model, f_opt, f_scaler = _run(
        fastamp.GradScaler, opt_kind, steps, pattern, growth_interval
    )
    assert [s for s, _, _ in f_traj] == [s for s, _, _ in t_traj], "scale trajectories differ"
    assert [k for _, k, _ in f_traj] == [k for _, k, _ in t_traj], "skipped steps differ"
    assert any(k for _, k, _ in t_traj) and not all(k for _, k, _ in t_traj)
    for a, b in zip(f_model.parameters(), t_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert f_scaler.state_dict() == t_scaler.state_dict()
    # Optimizer state identical too (the scaler must not disturb it).
    fs, ts = f_opt.state_dict(), t_opt.state_dict()
    for k in ts["state"]:
        for name, v in ts["state"][k].items():
            torch.testing.assert_close(fs["state"][k][name], v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw", "adamw_fused"])
@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e3])  # 0: torch zeroes the grads; so must we
def test_clip_grad_norm_matches_torch_recipe(opt_kind, max_norm):
    steps = 40
    pattern = _pattern(7, steps)
    t_traj, t_model, _, _ = _run(torch.amp.GradScaler, opt_kind, steps, pattern, 3, clip=max_norm)
    f_traj, f_model, _, _ = _run(fastamp.GradScaler, opt_kind, steps, pattern, 3, clip=max_norm)
    assert [(s, k) for s, k, _ in f_traj] == [(s, k) for s, k, _ in t_traj]
    # (With max_norm=0 plain SGD never moves the params, so "skipped" is every step; the norms
    # still must agree: non-finite on the overflowed steps, equal on the others.)
    for (_, _, fn), (_, _, tn) in zip(f_traj, t_traj):
        assert math.isfinite(fn) == math.isfinite(tn)
        assert not math.isfinite(fn) or math.isclose(fn, tn, rel_tol=1e-5)
    assert any(not math.isfinite(n) for _, _, n in t_traj)
    for a, b in zip(f_model.parameters(), t_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_model_matches_torch():
    steps = 30
    pattern = _pattern(3, steps)
    t_traj, t_model, _, _ = _run(
        torch.amp.GradScaler, "adamw", steps, pattern, 2, dtype=torch.bfloat16
    )
    f_traj, f_model, _, _ = _run(
        fastamp.GradScaler, "adamw", steps, pattern, 2, dtype=torch.bfloat16
    )
    assert [(s, k) for s, k, _ in f_traj] == [(s, k) for s, k, _ in t_traj]
    for a, b in zip(f_model.parameters(), t_model.parameters()):
        assert torch.equal(a, b)


def test_several_optimizers_and_step_return_value():
    model = _model()
    opt1 = torch.optim.SGD(list(model[0].parameters()), lr=0.1)
    opt2 = torch.optim.Adam(list(model[3].parameters()) + list(model[5].parameters()), lr=0.01)
    scaler = fastamp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    for step in range(3):
        opt1.zero_grad()
        opt2.zero_grad()
        scaler.scale(model(torch.randn(4, 16)).square().mean()).backward()
        if step == 1:
            model[3].weight.grad[0, 0] = math.nan  # only opt2's grads overflow
        scaler.step(opt1)
        scaler.step(opt2)
        scaler.update()
    # step 0 grows 4 -> 8, step 1 backs off (any optimizer overflowed) -> 4, step 2 grows -> 8.
    assert scaler.get_scale() == 8.0
    report = scaler.overflow_report(model)
    assert report.update == 1 and report.parameters == ["3.weight"]
    assert "3.weight" in str(report)


def test_state_dict_round_trips_both_ways():
    t = torch.amp.GradScaler(
        "cpu", init_scale=512.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7
    )
    f = fastamp.GradScaler("cpu")
    model = _model()
    opt = _optimizer("sgd", model)
    for s in (t, f):
        for _ in range(3):
            opt.zero_grad()
            s.scale(model(torch.randn(2, 16)).sum()).backward()
            s.step(opt)
            s.update()
    f.load_state_dict(t.state_dict())
    assert f.state_dict() == t.state_dict()
    assert set(f.state_dict()) == {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }
    t2 = torch.amp.GradScaler("cpu")
    t2.load_state_dict(f.state_dict())
    assert t2.state_dict() == f.state_dict()
    # Through torch.save / torch.load as a training checkpoint would.
    buf = io.BytesIO()
    torch.save({"scaler": f.state_dict()}, buf)
    buf.seek(0)
    t3 = torch.amp.GradScaler("cpu")
    t3.load_state_dict(torch.load(buf)["scaler"])
    assert t3.state_dict() == f.state_dict()


def test_state_dict_with_hysteresis_is_loadable_by_torch():
    f = fastamp.GradScaler("cpu", hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    sd = f.state_dict()
    assert sd["hysteresis"] == 2 and sd["_hysteresis_tracker"] == 2
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(sd)  # ignores fastamp's extra keys
    assert t.get_scale() == f.get_scale()
    f2 = fastamp.GradScaler("cpu")
    f2.load_state_dict(sd)
    assert f2.state_dict() == sd


def test_pickle_and_deepcopy():
    f = fastamp.GradScaler("cpu", init_scale=128.0, hysteresis=2)
    model = _model()
    opt = _optimizer("adam", model)
    opt.zero_grad()
    f.scale(model(torch.randn(2, 16)).sum()).backward()
    f.step(opt)
    f.update()
    g = pickle.loads(pickle.dumps(f))
    assert isinstance(g, fastamp.GradScaler)
    assert g.state_dict() == f.state_dict()
    h = copy.deepcopy(f)
    assert h.state_dict() == f.state_dict()
    # The copy keeps working.
    opt.zero_grad()
    g.scale(model(torch.randn(2, 16)).sum()).backward()
    g.step(opt)
    g.update()


def test_isinstance_and_legacy_alias():
    assert isinstance(fastamp.GradScaler("cpu"), torch.amp.GradScaler)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        legacy = fastamp.cuda.amp.GradScaler(init_scale=8.0)
    assert any(issubclass(x.category, FutureWarning) for x in w)
    assert isinstance(legacy, fastamp.GradScaler) and isinstance(legacy, torch.amp.GradScaler)
    if not torch.cuda.is_available():
        assert not legacy.is_enabled()  # like torch: CUDA scaler without CUDA disables itself


def test_getters_setters_and_disabled():
    f = fastamp.GradScaler("cpu", growth_interval=5)
    f.set_growth_factor(3.0)
    f.set_backoff_factor(0.3)
    f.set_growth_interval(9)
    assert (f.get_growth_factor(), f.get_backoff_factor(), f.get_growth_interval()) == (3.0, 0.3, 9)
    assert f.is_enabled() and f.get_scale() == 2.0**16
    d = fastamp.GradScaler("cpu", enabled=False)
    loss = torch.ones(())
    assert d.scale(loss) is loss and d.get_scale() == 1.0 and d.state_dict() == {}
    model = _model()
    opt = _optimizer("sgd", model)
    model(torch.randn(2, 16)).sum().backward()
    w0 = model[0].weight.detach().clone()
    d.step(opt)
    d.update()
    assert not torch.equal(w0, model[0].weight)
    assert not bool(d.last_step_skipped())


# --- misuse: same exception types and messages as PyTorch --------------------------------------


def _misuse_cases():
    def setup(s):
        model = _model()
        opt = _optimizer("sgd", model)
        s.scale(model(torch.randn(2, 16)).sum()).backward()
        return model, opt

    def unscale_twice(s):
        _, opt = setup(s)
        s.unscale_(opt)
        s.unscale_(opt)

    def unscale_after_step(s):
        _, opt = setup(s)
        s.step(opt)
        s.unscale_(opt)

    def step_twice(s):
        _, opt = setup(s)
        s.step(opt)
        s.step(opt)

    def step_without_scale(s):
        model = _model()
        opt = _optimizer("sgd", model)
        model(torch.randn(2, 16)).sum().backward()
        s.step(opt)

    def update_without_inf_checks(s):
        setup(s)
        s.update()

    def closure(s):
        _, opt = setup(s)
        s.step(opt, closure=lambda: 0.0)

    def empty_state_dict(s):
        s.load_state_dict({})

    def fp16_grads(s):
        model = _model(dtype=torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        s.scale(torch.ones(()))
        s.unscale_(opt)

    def no_grads(s):
        model = _model()
        opt = _optimizer("sgd", model)
        s.scale(torch.ones(()))
        s.step(opt)

    return [
        unscale_twice,
        unscale_after_step,
        step_twice,
        step_without_scale,
        update_without_inf_checks,
        closure,
        empty_state_dict,
        fp16_grads,
        no_grads,
    ]


@pytest.mark.parametrize("case", _misuse_cases(), ids=lambda f: f.__name__)
def test_misuse_raises_like_torch(case):
    errors = []
    for cls in (torch.amp.GradScaler, fastamp.GradScaler):
        with pytest.raises(Exception) as info:
            case(cls("cpu"))
        errors.append((type(info.value), str(info.value)))
    if case.__name__ == "no_grads":  # torch's class and words first; fastamp then says why
        assert errors[1][0] is errors[0][0]
        assert errors[1][1].startswith(errors[0][1].rstrip("."))
        assert "grad None" in errors[1][1]
        return
    assert errors[0] == errors[1]


def test_constructor_errors_like_torch():
    for kwargs in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}):
        with pytest.raises(AssertionError) as a:
            torch.amp.GradScaler("cpu", **kwargs)
        with pytest.raises(AssertionError) as b:
            fastamp.GradScaler("cpu", **kwargs)
        assert str(a.value) == str(b.value)
    with pytest.raises(ValueError, match="hysteresis must be an int >= 1"):
        fastamp.GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="init_scale=65536.0 is outside"):
        fastamp.GradScaler("cpu", max_scale=1024.0)
    with pytest.raises(ValueError, match="max_scale must be >= min_scale"):
        fastamp.GradScaler("cpu", min_scale=8.0, max_scale=4.0)


def test_fp16_error_leaves_grads_and_state_untouched():
    model = _model()
    model[3].half()  # one layer in fp16: its grads are the only fp16 ones, after fp32 ones
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = fastamp.GradScaler("cpu")
    s.scale(torch.ones(()))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        s.clip_grad_norm_(opt, 1.0)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert s._per_optimizer_states[id(opt)]["stage"] is fastamp.OptState.READY


def test_clip_grad_norm_errors():
    model = _model()
    opt = _optimizer("sgd", model)
    s = fastamp.GradScaler("cpu")
    s.scale(model(torch.randn(2, 16)).sum()).backward()
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        s.clip_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type must be a positive"):
        s.clip_grad_norm_(opt, 1.0, norm_type=0)
    s.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="clip_grad_norm_\\(\\) is being called after step"):
        s.clip_grad_norm_(opt, 1.0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_clip_after_unscale_and_norm_types(norm_type):
    m1, m2 = _model(1), _model(1)
    o1, o2 = _optimizer("sgd", m1), _optimizer("sgd", m2)
    s1, s2 = fastamp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    x = torch.randn(4, 16)
    s1.scale(m1(x).sum()).backward()
    s2.scale(m2(x).sum()).backward()
    s1.unscale_(o1)  # clip after an explicit unscale_ only clips
    n1 = s1.clip_grad_norm_(o1, 0.3, norm_type)
    s2.unscale_(o2)
    n2 = nn.utils.clip_grad_norm_(m2.parameters(), 0.3, norm_type)
    torch.testing.assert_close(n1, n2, rtol=1e-5, atol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("max_norm", [5.3, 0.7, 3.0])
def test_clip_coefficient_rounds_as_torch(max_norm):
    """torch computes ``max_norm / (norm + 1e-6)`` as ``(norm + 1e-6).reciprocal() * max_norm``
    (Tensor.__rtruediv__): two roundings. A single division differs in the last bit for about
    half the norms when max_norm is not a power of two, so the clipped grads of a torch
    optimizer (clip_unscale_'s write pass) and the fused path's update must use torch's two."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        grads = [torch.randn(37, generator=gen) * 10.0 ** (trial % 7) for _ in range(3)]
        runs = []
        for cls in (fastamp.GradScaler, torch.amp.GradScaler):
            params = [nn.Parameter(torch.zeros(37)) for _ in grads]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt = torch.optim.SGD(params, lr=1.0)
            s = cls("cpu", init_scale=4.0)
            s.scale(torch.ones(()))
            if cls is fastamp.GradScaler:
                norm = s.clip_grad_norm_(opt, max_norm)
            else:
                s.unscale_(opt)
                norm = nn.utils.clip_grad_norm_(params, max_norm)
            runs.append((norm, [p.grad for p in params]))
        (n1, g1), (n2, g2) = runs
        torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
        if torch.equal(n1, n2):  # the same norm: the same coefficient, bit for bit
            for a, b in zip(g1, g2):
                assert torch.equal(a, b), (trial, (a - b).abs().max())


@pytest.mark.parametrize("variant", ["SGD", "AdamW", "AdamW-flat", "torch-SGD"])
def test_a_second_clip_in_one_iteration_clips_what_torch_would(variant):
    """Two ``clip_grad_norm_`` calls in one iteration (a library clips, then the user): torch's
    recipe unscales once, clips, then clips the clipped grads. With a fastamp optimizer the first
    call leaves its write pass to the fused step; the second must make it first (it used to clip
    the still-scaled grads and step with both coefficients)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=gen)
    runs = []
    for recipe in ("torch", "fastamp"):
        m = _model(4)
        name = variant.split("-")[-1] if variant != "AdamW-flat" else "AdamW"
        extra = {"momentum": 0.9} if name == "SGD" else {}
        if recipe == "torch" or variant.startswith("torch"):
            opt = getattr(torch.optim, name)(m.parameters(), lr=0.1, **extra)
        else:
            flat = {"flat_buffers": True} if variant == "AdamW-flat" else {}
            opt = getattr(fastamp.optim, name)(m.parameters(), lr=0.1, **extra, **flat)
        s = (torch.amp.GradScaler if recipe == "torch" else fastamp.GradScaler)(
            "cpu", init_scale=2.0**10
        )
        norms = []
        for step in range(3):
            opt.zero_grad()
            s.scale(m(x * (step + 1)).square().sum()).backward()
            if recipe == "torch":
                s.unscale_(opt)
                norms.append(nn.utils.clip_grad_norm_(list(m.parameters()), 5.0))
                norms.append(nn.utils.clip_grad_norm_(list(m.parameters()), 1.0))
            else:
                norms.append(s.clip_grad_norm_(opt, 5.0))
                norms.append(s.clip_grad_norm_(opt, 1.0))
            s.step(opt)
            s.update()
        runs.append((norms, [p.detach().clone() for p in m.parameters()]))
    (n1, p1), (n2, p2) = runs
    for a, b in zip(n1, n2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    for a, b in zip(p1, p2):  # (Adam's update rounds in another order than torch's foreach)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clip_after_unscale_keeps_the_inf_check_of_unscale():
    """unscale_ saw an inf; the user then repairs the grads and clips. torch skips the step (its
    found_inf came from unscale_); so must fastamp, whose clip merges its own check into it."""
    runs = []
    for cls in (fastamp.GradScaler, torch.amp.GradScaler):
        m = _model(2)
        o = _optimizer("sgd", m)
        s = cls("cpu")
        s.scale(m(torch.randn(4, 16, generator=torch.Generator().manual_seed(5))).sum()).backward()
        next(m.parameters()).grad.view(-1)[3] = math.inf
        s.unscale_(o)
        for p in m.parameters():
            p.grad.nan_to_num_(posinf=0.0)
        if isinstance(s, fastamp.GradScaler):
            s.clip_grad_norm_(o, 1.0)
        else:
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        before = [p.detach().clone() for p in m.parameters()]
        s.step(o)
        s.update()
        runs.append((all(torch.equal(b, p) for b, p in zip(before, m.parameters())), s.get_scale()))
    assert runs[0] == runs[1] == (True, 2.0**15)


def test_fused_clip_reads_fp16_grads_without_unscaling_them():
    """With a fastamp optimizer, clip_grad_norm_ only reads the grads (its update pass unscales
    and clips), so fp16 grads are fine, where unscale_ (and torch) refuse them. The norm is the
    float64 reference's."""
    m = _model(3, torch.float16)
    o = fastamp.optim.AdamW(m.parameters(), lr=1e-3, master_weights=True)
    s = fastamp.GradScaler("cpu", init_scale=2.0**10)
    s.scale(m(torch.randn(4, 16).half()).float().sum()).backward()
    grads = [p.grad.double() / 2.0**10 for p in m.parameters()]
    norm = s.clip_grad_norm_(o, 0.5)
    ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert math.isclose(float(norm), float(ref), rel_tol=1e-5)
    s.step(o)
    assert not s.last_step_skipped()  # the step ran
    with pytest.raises(ValueError, match="FP16"):
        s2 = fastamp.GradScaler("cpu")
        m2 = _model(3, torch.float16)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
        s2.scale(m2(torch.randn(4, 16).half()).float().sum()).backward()
        s2.clip_grad_norm_(o2, 0.5)  # a torch optimizer: the grads are unscaled in place


def test_min_scale_takes_float32_max_and_no_more():
    f32_max = torch.finfo(torch.float32).max
    fastamp.GradScaler("cpu", init_scale=f32_max, min_scale=f32_max)  # a valid floor
    with pytest.raises(ValueError, match="min_scale"):
        fastamp.GradScaler("cpu", init_scale=f32_max, min_scale=f32_max * 2.0)


# --- diagnostics and host syncs -----------------------------------------------------------------


def test_last_step_skipped_and_overflow_report_indices():
    model = _model()
    opt = _optimizer("adamw", model)
    s = fastamp.GradScaler("cpu")
    assert s.overflow_report().update is None and not s.overflow_report()
    for step in range(4):
        opt.zero_grad()
        s.scale(model(torch.randn(2, 16)).sum()).backward()
        if step == 2:
            model[5].bias.grad[1] = math.inf
            model[0].weight.grad[0, 0] = math.nan
        s.step(opt)
        skipped = s.last_step_skipped()
        assert skipped.dtype == torch.bool and skipped.shape == ()
        assert bool(skipped) == (step == 2)
        s.update()
    rep = s.overflow_report()
    assert rep.update == 2
    assert rep.parameters == ["param_groups[0][0]", "param_groups[1][3]"]
    assert s.overflow_report(model).parameters == ["0.weight", "5.bias"]


def test_warns_once_when_scale_drops_below_one():
    model = _model()
    opt = _optimizer("sgd", model)
    s = fastamp.GradScaler("cpu", init_scale=2.0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(4):
            _overflowing_step(model, opt, s)
    msgs = [x for x in w if "fell to" in str(x.message)]
    assert len(msgs) == 1 and issubclass(msgs[0].category, RuntimeWarning)


def test_hysteresis_and_bounds_in_training():
    model = _model()
    opt = _optimizer("sgd", model)
    s = fastamp.GradScaler(
        "cpu", init_scale=64.0, hysteresis=2, min_scale=16.0, growth_interval=1000
    )
    scales = []
    for _ in range(6):
        _overflowing_step(model, opt, s)
        scales.append(s.get_scale())
    # First overflow is absorbed by hysteresis; then backs off each time down to min_scale.
    assert scales == [64.0, 32.0, 16.0, 16.0, 16.0, 16.0]


@pytest.mark.parametrize(
    "opt_kind,expected", [("adamw_fused", 0), ("sgd_fused", 0), ("adamw", 1), ("sgd", 1)]
)
def test_host_syncs_per_step_match_torch(opt_kind, expected):
    counts = {}
    for cls in (torch.amp.GradScaler, fastamp.GradScaler):
        model = _model()
        opt = _optimizer(opt_kind, model)
        s = cls("cpu")
        per_step = []
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.randn(2, 16)).sum()
            with count_host_syncs() as calls:
                scaled = s.scale(loss)
            scaled.backward()
            with count_host_syncs() as calls2:
                if cls is fastamp.GradScaler and step == 2:
                    s.clip_grad_norm_(opt, 1.0)
                s.step(opt)
                s.update()
                if cls is fastamp.GradScaler:
                    s.last_step_skipped()
            per_step.append(len(calls) + len(calls2))
        counts[cls] = per_step
    assert counts[fastamp.GradScaler] == [expected] * 3
    assert counts[torch.amp.GradScaler] == [expected] * 3


def test_grad_replay_holds_in_the_steady_state_and_sees_a_new_group_list():
    """The scaler's GradReplay serves a steady-state step (grads kept, nothing changed) with the
    optimizer's own grads in its order; a ``param_groups`` list replaced by another (the same
    dicts) is not the list it replays, and the grads are collected in full again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fastamp.GradScaler("cpu")
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    replay = scaler._reader.replays[opt]
    held = replay.collect(opt, allow_fp16=False)
    assert held is not None
    (on_cpu,) = held.values()
    assert all(g is p.grad for g, p in zip(on_cpu.grads, model.parameters(), strict=True))
    opt.param_groups = list(opt.param_groups)
    assert replay.collect(opt, allow_fp16=False) is None
