"""fastamp.optim against torch.optim (fused=False) driven by torch.amp.GradScaler + clip_grad_norm_."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import count_host_syncs

CONFIGS = [
    ("SGD", dict(lr=0.02, momentum=0.9, weight_decay=1e-3)),
    ("SGD", dict(lr=0.02, momentum=0.9, dampening=0.2, nesterov=False, maximize=True)),
    ("SGD", dict(lr=0.02, momentum=0.8, nesterov=True)),
    ("SGD", dict(lr=0.02)),
    ("Adam", dict(lr=3e-3, weight_decay=1e-2)),
    ("Adam", dict(lr=3e-3, amsgrad=True, betas=(0.8, 0.99))),
    ("AdamW", dict(lr=3e-3, weight_decay=0.1)),
    ("AdamW", dict(lr=3e-3, weight_decay=0.1, amsgrad=True, maximize=True)),
]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.LayerNorm(24), nn.Linear(24, 3))


def _groups(model, lr):
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()) + list(model[3].parameters()), "lr": lr * 0.5},
    ]


def _train(kind, kw, fast, steps=200, clip=0.5, seed=0):
    model = _model(seed)
    cls = getattr(fastamp.optim if fast else torch.optim, kind)
    opt = (
        cls(_groups(model, kw["lr"]), **kw)
        if fast
        else cls(_groups(model, kw["lr"]), foreach=False, **kw)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    scaler = (fastamp.GradScaler if fast else torch.amp.GradScaler)(
        "cpu", init_scale=2.0**14, growth_interval=7
    )
    gen = torch.Generator().manual_seed(seed + 1)
    bad = torch.Generator().manual_seed(seed + 2)
    skipped = []
    for step in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        r = float(torch.rand((), generator=bad))
        if step > 0 and r < 0.1:  # inf/NaN storms at random steps, one or several tensors
            for p in list(model.parameters())[: 1 + step % 3]:
                p.grad.view(-1)[step % p.numel()] = math.nan if r < 0.05 else math.inf
        if fast:
            scaler.clip_grad_norm_(opt, clip)
        else:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale_before)
        sched.step()
    return model, opt, scaler, skipped


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIGS)])
def test_matches_torch_over_200_steps_with_overflows(kind, kw):
    fm, fo, fs, fskip = _train(kind, kw, True)
    tm, to, ts, tskip = _train(kind, kw, False)
    assert fskip == tskip and 5 < sum(tskip) < 60
    assert fs.state_dict() == ts.state_dict()
    for a, b in zip(fm.parameters(), tm.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fsd, tsd = fo.state_dict(), to.state_dict()
    assert fsd["state"].keys() == tsd["state"].keys()
    for k in tsd["state"]:
        assert fsd["state"][k].keys() == tsd["state"][k].keys()
        for name, value in tsd["state"][k].items():
            if name == "step":  # same count of *taken* steps: skipped ones did not advance it
                assert float(fsd["state"][k][name]) == float(value)
            else:
                torch.testing.assert_close(fsd["state"][k][name], value, rtol=1e-5, atol=1e-6)
    for fg, tg in zip(fsd["param_groups"], tsd["param_groups"]):
        fg, tg = dict(fg), dict(tg)
        assert (
            tg.pop("foreach") is False and fg.pop("foreach") is None
        )  # how torch ran; and fastamp's state is a fused step's (a torch optimizer that loads
        # it stays fused, as after loading torch's own fused=True state_dict)
        assert fg.pop("fused") is True and tg.pop("fused") in (None, False)
        assert fg == tg


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_state_dict_interchangeable_both_ways(kind):
    kw = dict(lr=0.01, momentum=0.9) if kind == "SGD" else dict(lr=0.01)
    base, _, _, _ = _train(kind, kw, False, steps=5)
    # torch -> fastamp -> continue == torch continued
    for src_fast in (False, True):
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        src_cls = getattr(fastamp.optim if src_fast else torch.optim, kind)
        dst_cls = getattr(torch.optim if src_fast else fastamp.optim, kind)
        o1 = src_cls(m1.parameters(), **kw)
        for _ in range(3):
            o1.zero_grad()
            m1(torch.randn(4, 12)).sum().backward()
            o1.step()
        m2.load_state_dict(m1.state_dict())
        o2 = dst_cls(m2.parameters(), **kw)
        # deepcopy: load_state_dict keeps same-device tensors as they are (aliases of o1's state)
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))
        x = torch.randn(4, 12)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reset", ["clear", "del_param", "del_buffer", "replace_buffer"])
def test_sgd_momentum_restarts_when_its_state_is_reset_as_torch(reset):
    """torch's SGD gives a momentum buffer its first value (the grad, no dampening) when the
    param has none: after ``opt.state.clear()``, ``del opt.state[p]`` or ``del
    opt.state[p]["momentum_buffer"]``; a buffer put in the state by hand counts as one that had
    its first value. fastamp's update counts live beside the state and used to survive the reset
    (dampening applied to a new zero buffer)."""
    runs = []
    for lib in (torch.optim, fastamp.optim):
        model = _model()
        opt = lib.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
        gen = torch.Generator().manual_seed(4)
        for step in range(5):
            opt.zero_grad()
            x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 2:
                p = next(model.parameters())
                if reset == "clear":
                    opt.state.clear()
                elif reset == "del_param":
                    del opt.state[p]
                elif reset == "del_buffer":
                    del opt.state[p]["momentum_buffer"]
                else:
                    opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.01)
        runs.append([q.detach().clone() for q in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("resume_in", ["torch", "fastamp"])
def test_a_skipped_first_step_leaves_no_state_in_the_state_dict(kind, resume_in):
    """The scaler skips the first step (inf grads): torch's optimizer never ran and has no state;
    fastamp's fused kernel made (and skipped) it. The state_dict leaves such never-updated state
    out, so a resumed SGD with dampening gives the buffer its first value as torch's does (it
    used to take the saved zero buffer for a started one)."""
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5) if kind == "SGD" else dict(lr=0.1)
    finals, dicts = [], []
    for lib in (torch.optim, fastamp.optim):
        model = _model()
        opt = getattr(lib, kind)(model.parameters(), **kw)
        scaler = (torch.amp.GradScaler if lib is torch.optim else fastamp.GradScaler)("cpu")
        gen = torch.Generator().manual_seed(9)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        next(model.parameters()).grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        sd = copy.deepcopy(opt.state_dict())
        dicts.append(sd["state"])
        resumed = getattr(torch.optim if resume_in == "torch" else fastamp.optim, kind)(
            model.parameters(), **kw
        )
        resumed.load_state_dict(sd)
        for _ in range(3):
            resumed.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            resumed.step()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert dicts[0] == {} and dicts[1] == {}
    for a, b in zip(*finals):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_state_dict_after_a_real_step_keeps_every_entry():
    model = _model()
    opt = fastamp.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 3)).backward()
    opt.step()
    assert sorted(opt.state_dict()["state"]) == list(range(len(list(model.parameters()))))


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_a_model_converted_after_its_state_was_made_is_refused_before_stepping(kind):
    """model.half() between steps: torch's AdamW fails at the step (RuntimeError) and its SGD
    steps on with float32 momentum; fastamp used to convert the moments to float16 silently. It
    refuses (RuntimeError naming the entry) with params, grads and state unchanged (README)."""
    model = _model()
    kw = dict(lr=0.05, momentum=0.9) if kind == "SGD" else dict(lr=0.05)
    opt = getattr(fastamp.optim, kind)(model.parameters(), **kw)
    nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 3)).backward()
    opt.step()
    model.half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    with pytest.raises(RuntimeError, match=r"is a torch.float32 tensor.*model.half\(\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    after = opt.state[next(model.parameters())]
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in state.items())
    opt.load_state_dict(opt.state_dict())  # cast to the params' dtype, as torch's load does
    opt.step()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_new_state_has_torchs_keys_in_torchs_order(amsgrad):
    keys = []
    for lib in (torch.optim, fastamp.optim):
        w = nn.Parameter(torch.ones(3))
        opt = lib.AdamW([w], amsgrad=amsgrad)
        w.grad = torch.ones(3)
        opt.step()
        keys.append(list(opt.state_dict()["state"][0]))
    assert keys[0] == keys[1]


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_constructor_defaults_are_torchs_values_of_torchs_types(kind):
    """The defaults land in opt.defaults, the param groups and state_dict(): 0 and 0.0 compare
    equal but print and serialise differently (repr(opt), a JSON dump of the groups)."""
    import inspect

    t = inspect.signature(getattr(torch.optim, kind).__init__).parameters
    f = inspect.signature(getattr(fastamp.optim, kind).__init__).parameters
    for name, param in t.items():
        if name in ("self", "params"):
            continue
        assert type(f[name].default) is type(param.default), name
        assert f[name].default == param.default, name
    m = _model()
    a = getattr(torch.optim, kind)(m.parameters())
    b = getattr(fastamp.optim, kind)(m.parameters())
    for k, v in a.param_groups[0].items():
        if k != "params":
            assert repr(b.param_groups[0][k]) == repr(v), k


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_state_dict_hooks_see_and_change_what_torchs_do(kind):
    """A load_state_dict post-hook that edits the loaded state (zeroes a moment) takes effect, as
    with torch (fastamp put the loaded state in place after the hooks ran, undoing the edit);
    a state_dict post-hook sees the dict fastamp returns and may return another (fastamp
    post-processed the hook's result: KeyError 'state' for a wrapped dict)."""
    key = "momentum_buffer" if kind == "SGD" else "exp_avg"
    kw = dict(lr=0.1, momentum=0.9) if kind == "SGD" else dict(lr=0.1)
    out = []
    for lib in (torch.optim, fastamp.optim):
        model = _model()
        opt = getattr(lib, kind)(model.parameters(), **kw)
        nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 3)).backward()
        opt.step()
        sd = copy.deepcopy(opt.state_dict())
        other = getattr(lib, kind)(model.parameters(), **kw)
        seen = []

        def zero(o, key=key):
            for st in o.state.values():
                st[key].zero_()

        other.register_load_state_dict_post_hook(zero)
        other.load_state_dict(sd)
        wrap = other.register_state_dict_post_hook(
            lambda o, d: seen.append(sorted(d["state"])) or {"wrapped": d}
        )
        wrapped = other.state_dict()
        wrap.remove()
        assert list(wrapped) == ["wrapped"] and seen == [list(range(len(list(model.parameters()))))]
        other.step()
        out.append(([st[key].clone() for st in other.state.values()], seen))
    for a, b in zip(out[0][0], out[1][0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_no_host_sync_and_no_scheduler_warning_when_steps_skip():
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = fastamp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # lr_scheduler's "step() before optimizer.step()" would raise
        for step in range(4):
            opt.zero_grad()
            loss = model(torch.randn(4, 12)).sum()
            with count_host_syncs() as calls:
                scaled = scaler.scale(loss)
            scaled.backward()
            if step == 0:
                model[0].weight.grad[0, 0] = math.inf  # the very first step overflows
            with count_host_syncs() as calls2:
                norm = scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
                skipped = scaler.last_step_skipped()
                stepped = opt.stepped
            assert calls == [] and calls2 == [], calls + calls2
            assert bool(skipped) == (step == 0) and bool(stepped) == (step != 0)
            assert math.isfinite(float(norm)) == (step != 0)
            sched.step()
    assert float(opt.state_dict()["state"][0]["step"]) == 3.0  # the skipped step did not count


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_matches_torch(kind, set_to_none):
    """Same grads afterwards (the same tensor objects, zeros, detached and not requiring grad) as
    torch's zero_grad, with mixed dtypes, a grad left None, a grad with a grad_fn (create_graph)
    and a sparse grad."""

    def world():
        torch.manual_seed(3)
        ps = [
            torch.nn.Parameter(torch.randn(5, 3)),
            torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(6)),
            torch.nn.Parameter(torch.randn(2, 2)),
            torch.nn.Parameter(torch.randn(7)),
        ]
        ps[0].grad = torch.randn(5, 3)
        ps[1].grad = torch.randn(4, dtype=torch.float64)
        x = torch.randn(6, requires_grad=True)
        ps[2].grad = x * 2.0  # a grad with a grad_fn, as after backward(create_graph=True)
        ps[4].grad = torch.sparse_coo_tensor([[1, 5]], [3.0, -2.0], (7,))  # ps[3] keeps None
        return ps

    fps, tps = world(), world()
    f = getattr(fastamp.optim, kind)([{"params": fps[:3]}, {"params": fps[3:]}], lr=0.1)
    t = getattr(torch.optim, kind)([{"params": tps[:3]}, {"params": tps[3:]}], lr=0.1)
    held_f, held_t = [p.grad for p in fps], [p.grad for p in tps]
    f.zero_grad(set_to_none=set_to_none)
    t.zero_grad(set_to_none=set_to_none)
    for i, (fp, tp) in enumerate(zip(fps, tps)):
        if tp.grad is None:
            assert fp.grad is None, i
            continue
        assert fp.grad is held_f[i] and tp.grad is held_t[i], i  # zeroed in place, as torch
        assert fp.grad.grad_fn is None and not fp.grad.requires_grad, i
        assert fp.grad.dtype == tp.grad.dtype and fp.grad.is_sparse == tp.grad.is_sparse, i
        torch.testing.assert_close(fp.grad.to_dense(), tp.grad.to_dense(), rtol=0, atol=0)
        assert not bool(fp.grad.to_dense().any()), i


def test_grads_are_never_written_with_clip():
    model = _model()
    opt = fastamp.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = fastamp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 12)).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.clip_grad_norm_(opt, 1e-3)
    scaler.step(opt)
    scaler.update()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)  # still scaled: unscale and clip happened in registers


def test_the_scalers_hand_off_is_for_one_step_call_only():
    """fastamp.GradScaler hands AmpStep as the optimizer's visible ``amp_step`` attribute for
    the one ``optimizer.step()`` call it makes: nothing stays behind after it returns or raises,
    and a second step inside that call (a closure stepping again) gets no AmpStep."""
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = fastamp.GradScaler("cpu")
    seen = []
    inner = type(opt).step

    def step(self, closure=None):
        seen.append(self.amp_step)
        out = inner(self, closure)
        seen.append(self.amp_step)  # read and cleared by the step
        return out

    opt.step = step.__get__(opt)
    scaler.scale(model(torch.randn(4, 12)).sum()).backward()
    scaler.step(opt)
    assert isinstance(seen[0], fastamp.handoff.AmpStep) and seen[1] is None
    assert "amp_step" not in vars(opt) and opt.amp_step is None
    scaler.update()

    def failing(self, closure=None):
        raise RuntimeError("planted")

    opt.step = failing.__get__(opt)
    scaler.scale(model(torch.randn(4, 12)).sum()).backward()
    with pytest.raises(RuntimeError, match="planted"):
        scaler.step(opt)
    assert "amp_step" not in vars(opt) and opt.amp_step is None


def test_driven_by_torch_grad_scaler_too():
    fm, tm = _model(), _model()
    fo = fastamp.optim.Adam(fm.parameters(), lr=1e-2)
    to = torch.optim.Adam(tm.parameters(), lr=1e-2, foreach=False)
    fs, ts = (
        torch.amp.GradScaler("cpu", growth_interval=2),
        torch.amp.GradScaler("cpu", growth_interval=2),
    )
    for step in range(10):
        x = torch.randn(4, 12)
        for m, o, s in ((fm, fo, fs), (tm, to, ts)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            if step == 4:
                m[3].bias.grad[0] = math.inf
            s.step(o)
            s.update()
    assert fs.get_scale() == ts.get_scale()
    for a, b in zip(fm.parameters(), tm.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_track_an_fp32_run(dtype):
    ref = _model()
    half = copy.deepcopy(ref).to(dtype)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ho = fastamp.optim.AdamW(half.parameters(), lr=1e-2, master_weights=True)
    plain = copy.deepcopy(ref).to(dtype)
    po = fastamp.optim.AdamW(plain.parameters(), lr=1e-2)
    for _ in range(30):
        x = torch.randn(8, 12)
        for m, o, xx in ((ref, ro, x), (half, ho, x.to(dtype)), (plain, po, x.to(dtype))):
            o.zero_grad()
            m(xx).float().square().mean().backward()
            o.step()
    st = ho.state_dict()["state"][0]
    assert st["master_param"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    assert ho.state[half[0].weight]["master_param"].to(dtype).equal(half[0].weight)
    err_master = max(
        (a.float() - b).abs().max().item() for a, b in zip(half.parameters(), ref.parameters())
    )
    err_plain = max(
        (a.float() - b).abs().max().item() for a, b in zip(plain.parameters(), ref.parameters())
    )
    assert err_master < err_plain  # fp32 masters keep the small updates half params round away


def test_constructor_errors_like_torch():
    p = [nn.Parameter(torch.randn(3))]
    for kind, kw in [
        ("Adam", dict(lr=-1.0)),
        ("AdamW", dict(betas=(1.0, 0.9))),
        ("Adam", dict(eps=-1.0)),
        ("SGD", dict(momentum=-0.1)),
        ("SGD", dict(lr=0.1, nesterov=True)),
        ("AdamW", dict(weight_decay=-1)),
    ]:
        with pytest.raises(ValueError) as a:
            getattr(torch.optim, kind)(p, **kw)
        with pytest.raises(ValueError) as b:
            getattr(fastamp.optim, kind)(p, **kw)
        assert str(a.value) == str(b.value)


def test_bad_params_rejected_before_any_state_change():
    model = _model()
    opt = fastamp.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[3].bias.grad = model[3].bias.grad.to_sparse()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert len(opt.state) == 0
    d = nn.Parameter(torch.randn(3, dtype=torch.float64))
    d.grad = torch.ones_like(d)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        fastamp.optim.SGD([d], lr=0.1).step()


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_tensor_lr_matches_torch(kind):
    fm, tm = _model(), _model()
    kw = dict(momentum=0.9) if kind == "SGD" else dict(weight_decay=0.1)
    fo = getattr(fastamp.optim, kind)(fm.parameters(), lr=torch.tensor(0.01), **kw)
    to = getattr(torch.optim, kind)(tm.parameters(), lr=torch.tensor(0.01), foreach=False, **kw)
    sched = [torch.optim.lr_scheduler.ExponentialLR(o, 0.9) for o in (fo, to)]
    for _ in range(5):
        x = torch.randn(4, 12)
        for m, o in ((fm, fo), (tm, to)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for s in sched:
            s.step()
    assert isinstance(fo.param_groups[0]["lr"], torch.Tensor)
    for a, b in zip(fm.parameters(), tm.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_torch_state_dict_with_tensor_betas_loads_and_steps_as_torch():
    """torch's AdamW takes betas as 1-element tensors; its state_dict keeps them so, and fastamp's
    AdamW loads it and steps as torch's does from it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    ours_p = torch.nn.Parameter(p.detach().clone())
    theirs = torch.optim.AdamW([p], lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    p.grad = torch.randn(6)
    theirs.step()
    ours = fastamp.optim.AdamW([ours_p], lr=1e-2)
    with torch.no_grad():
        ours_p.copy_(p)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (torch's load shares tensors)
    assert all(isinstance(b, torch.Tensor) for b in ours.param_groups[0]["betas"])
    g = torch.randn(6)
    p.grad, ours_p.grad = g.clone(), g.clone()
    theirs.step()
    ours.step()
    torch.testing.assert_close(ours_p, p, rtol=1e-6, atol=1e-7)
