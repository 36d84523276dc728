"""flat_buffers=True (fastamp.optim._flat): params as views of one buffer per (dtype, device),
grads as views of one grad buffer, the step over the flat tensors; checked against torch's
AdamW(fused=True) and against fastamp's per-parameter path (bit for bit where no reduction order
differs), with every way a grad or a param can stop being its view."""

from __future__ import annotations

import copy

import pytest
import torch

import fastamp

STEPS = 6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5), torch.nn.Linear(5, 3)
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)


def _groups(model: torch.nn.Module, two_groups: bool):
    ps = list(model.parameters())
    if not two_groups:
        return ps
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]


def _optimizer(kind: str, model: torch.nn.Module, two_groups: bool = False, **kw):
    groups = _groups(model, two_groups)
    if kind == "torch":
        return torch.optim.AdamW(groups, lr=1e-2, fused=True, **kw)
    return fastamp.optim.AdamW(groups, lr=1e-2, flat_buffers=kind == "flat", **kw)


def _scaler(kind: str, init_scale: float = 2.0**10):
    cls = torch.amp.GradScaler if kind == "torch" else fastamp.GradScaler
    return cls("cpu", init_scale=init_scale, growth_interval=3)


def _train(kind, model, opt, scaler, steps, clip=None, start=0, hook=None, after_clip=None):
    params = list(model.parameters())
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=False)
        x, y = _data(s)
        loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        if hook is not None:
            hook(s, model, opt)
        if clip is not None:
            if kind == "torch":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            else:
                scaler.clip_grad_norm_(opt, clip)
            if after_clip is not None:
                after_clip(s, model, opt)
        scaler.step(opt)
        scaler.update()


def _run(kind, steps=STEPS, clip=None, two_groups=False, hook=None, after_clip=None, **kw):
    model = _model()
    opt = _optimizer(kind, model, two_groups, **kw)
    scaler = _scaler(kind)
    _train(kind, model, opt, scaler, steps, clip, hook=hook, after_clip=after_clip)
    return model, opt, scaler


def _assert_params(a, b, exact):
    for pa, pb in zip(a.parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb)
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_params_become_views_of_one_buffer_keeping_values_and_objects():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    objects = list(model.parameters())
    opt = fastamp.optim.AdamW(model.parameters(), flat_buffers=True)
    params = list(model.parameters())
    assert all(a is b for a, b in zip(params, objects))
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    storages = {p.untyped_storage().data_ptr() for p in params}
    grads = {p.grad.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1 and len(grads) == 1
    assert all(p.grad is not None and not p.grad.any() for p in params)
    assert opt.state_dict()["state"] == {}  # no state before the first step, as torch


@pytest.mark.parametrize("two_groups", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_torch_and_the_per_parameter_path(clip, two_groups):
    ref, _, _ = _run("torch", clip=clip, two_groups=two_groups)
    per, _, _ = _run("fastamp", clip=clip, two_groups=two_groups)
    flat, opt, _ = _run("flat", clip=clip, two_groups=two_groups)
    _assert_params(flat, ref, exact=False)
    # Unclipped, flat and per-parameter steps are the same element math; the clip's norm is
    # summed over other chunks (one flat tensor), so it may differ in the last bit.
    _assert_params(flat, per, exact=clip is None)
    assert opt._stepper.flat is not None and opt._stepper.flat.usable
    assert len(opt._stepper.flat.segments) == (2 if two_groups else 1)


def test_amsgrad_and_adam_match_torch():
    for cls, tcls in ((fastamp.optim.Adam, torch.optim.Adam), (fastamp.optim.AdamW, None)):
        ref_model, flat_model = _model(), _model()
        if tcls is None:
            ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, amsgrad=True, fused=True)
            opt = cls(flat_model.parameters(), lr=1e-2, amsgrad=True, flat_buffers=True)
        else:
            ref = tcls(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
            opt = cls(flat_model.parameters(), lr=1e-2, weight_decay=0.1, flat_buffers=True)
        _train("torch", ref_model, ref, _scaler("torch"), STEPS)
        _train("flat", flat_model, opt, _scaler("flat"), STEPS)
        _assert_params(flat_model, ref_model, exact=False)


def test_zero_grad_zeroes_the_buffer_and_keeps_the_views():
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), flat_buffers=True)
    views = [p.grad for p in model.parameters()]
    x, y = _data(0)
    ((model(x) - y) ** 2).mean().backward()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))  # accumulated in place
    assert any(v.any() for v in views)
    opt.zero_grad()  # set_to_none=True by default: the views stay, zeroed
    assert all(p.grad is v and not v.any() for p, v in zip(model.parameters(), views))


def test_state_dict_is_per_parameter_and_loads_into_torch_exactly():
    flat, opt, _ = _run("flat", clip=0.5)
    sd = opt.state_dict()
    params = list(flat.parameters())
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert st["exp_avg"].shape == p.shape and st["step"].shape == ()
        assert float(st["step"]) == STEPS
    # torch's AdamW loads it and continues as the flat optimizer does.
    twin = copy.deepcopy(flat)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    ref.load_state_dict(copy.deepcopy(sd))
    for group in ref.param_groups:  # fastamp's groups keep torch's fused=None
        group["fused"] = True
    for i in sd["state"]:
        for k, v in sd["state"][i].items():
            assert torch.equal(ref.state_dict()["state"][i][k], v)
    _train("torch", twin, ref, _scaler("torch", 2.0**10), 3, start=STEPS)
    _train("flat", flat, opt, _scaler("flat", 2.0**10), 3, start=STEPS)
    _assert_params(flat, twin, exact=False)


def test_torch_state_dict_loads_into_flat_and_continues():
    ref_model, ref, _ = _run("torch")
    flat_model = copy.deepcopy(ref_model)
    opt = fastamp.optim.AdamW(flat_model.parameters(), lr=1e-2, flat_buffers=True)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    flat = opt._stepper.flat
    assert flat.usable and flat.segments[0].state is not None
    p0 = next(flat_model.parameters())
    # the loaded moments are views of the flat state now
    assert opt.state[p0]["exp_avg"].untyped_storage().data_ptr() == (
        flat.segments[0].state["exp_avg"].untyped_storage().data_ptr()
    )
    _train("torch", ref_model, ref, _scaler("torch"), 3, start=STEPS)
    _train("flat", flat_model, opt, _scaler("flat"), 3, start=STEPS)
    _assert_params(flat_model, ref_model, exact=False)


def _replace_grads(s, model, opt):
    if s == 2:
        for p in model.parameters():
            p.grad = p.grad.clone()  # no longer the views


def _model_zero_grad(s, model, opt):
    if s == 3:  # autograd makes new grads after model.zero_grad() (set_to_none=True)
        x, y = _data(s)
        model.zero_grad()
        ((model(x) - y) ** 2).mean().mul(2.0**10).backward()


def _rebind_data(s, model, opt):
    if s == 2:
        for p in model.parameters():
            p.data = p.data.clone()  # the param leaves the flat buffer


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("hook", [_replace_grads, _model_zero_grad, _rebind_data])
def test_a_grad_or_param_that_stops_being_its_view_steps_right(hook, clip):
    """Before the scaler's clip_grad_norm_ (whose read of the grads checks only the grads and
    their views) or, without a clip, before the step (which checks everything)."""
    ref, _, _ = _run("fastamp", hook=hook, clip=clip)
    flat, opt, _ = _run("flat", hook=hook, clip=clip)
    # (Clipped, the norm sums in another order over one buffer: equal within rounding.)
    _assert_params(flat, ref, exact=clip is None)
    # and the layout is whole again: grads are views, params in one buffer
    assert opt._stepper.flat.usable
    assert all(p.grad is v for p, v in zip(opt._stepper.flat.inside, opt._stepper.flat.views))
    assert len({p.untyped_storage().data_ptr() for p in flat.parameters()}) == 1


def _reset_state(s, model, opt):
    if s == 2:  # a fresh state dict, as code that resets an optimizer's state assigns one
        import collections

        opt.state = collections.defaultdict(dict)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_state_dict_replaced_steps_from_a_fresh_state_as_torch(clip):
    """``opt.state = defaultdict(dict)`` between steps: the next step starts the moments and step
    counts afresh, as the per-parameter path and torch's fused AdamW do; the flat buffers must
    not keep stepping the state they held."""
    ref, _, _ = _run("torch", hook=_reset_state, clip=clip)
    per_param, _, _ = _run("fastamp", hook=_reset_state, clip=clip)
    flat, opt, _ = _run("flat", hook=_reset_state, clip=clip)
    _assert_params(flat, per_param, exact=clip is None)
    _assert_params(flat, ref, exact=False)
    assert all(float(opt.state[p]["step"]) == STEPS - 2 for p in flat.parameters())


def _halve_grads(s, model, opt):
    if s == 2:
        for p in model.parameters():
            p.grad = p.grad * 0.5  # other values, in new tensors


@pytest.mark.parametrize("hook", [_halve_grads, _rebind_data])
def test_a_change_between_clip_and_step_is_seen_by_the_step(hook):
    """The clip read the flat grads; a grad replaced or a param re-pointed after it is stepped
    as the per-parameter path steps it (torch's recipe reads the grads again at step())."""
    ref, _, _ = _run("fastamp", clip=0.5, after_clip=hook)
    flat, opt, _ = _run("flat", clip=0.5, after_clip=hook)
    _assert_params(flat, ref, exact=False)
    assert opt._stepper.flat.usable
    assert all(p.grad is v for p, v in zip(opt._stepper.flat.inside, opt._stepper.flat.views))
    assert len({p.untyped_storage().data_ptr() for p in flat.parameters()}) == 1


def test_a_none_grad_steps_per_parameter_as_torch_skips_it():
    def drop_last(s, model, opt):
        if s == 2:
            list(model.parameters())[-1].grad = None  # torch skips this param at this step

    ref, _, _ = _run("torch", hook=drop_last)
    flat, opt, _ = _run("flat", hook=drop_last)
    _assert_params(flat, ref, exact=False)
    steps = [float(opt.state[p]["step"]) for p in flat.parameters()]
    assert steps == [STEPS] * (len(steps) - 1) + [STEPS - 1]
    assert not opt._stepper.flat.usable  # counts diverged: stepped per parameter from then on


def test_overflow_skips_the_step():
    def poison(s, model, opt):
        if s == 3:
            next(model.parameters()).grad[0, 0] = float("inf")

    ref, _, _ = _run("torch", hook=poison)
    flat, opt, scaler = _run("flat", hook=poison, clip=1.0)
    _assert_params(flat, _run("fastamp", hook=poison, clip=1.0)[0], exact=False)
    ref_clip, _, _ = _run("torch", hook=poison, clip=1.0)
    _assert_params(flat, ref_clip, exact=False)
    assert all(float(opt.state[p]["step"]) == STEPS - 1 for p in flat.parameters())
    report = scaler.overflow_report(flat)
    # The stats are per buffer: the report names every param of the buffer that overflowed.
    assert report.update is not None
    assert report.parameters == [n for n, _ in flat.named_parameters()]


def test_frozen_params_stay_outside_and_are_skipped():
    model = _model()
    frozen = list(model.parameters())[0]
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, flat_buffers=True)
    assert frozen.grad is None
    _train("flat", model, opt, _scaler("flat"), 3)
    assert torch.equal(frozen, before) and frozen not in opt.state


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("clear_grad", [True, False])
def test_a_param_frozen_then_unfrozen_after_the_layout_steps_as_torch(set_to_none, clear_grad):
    """Fine-tuning's freeze after the optimizer was made: torch skips a param whose grad is None
    and steps one whose grad is a zeroed tensor. The flat zero_grad leaves a frozen param's grad
    as torch's zero_grad does (it used to put the zeroed view back, so a frozen param kept moving
    with momentum and weight decay), and the layout is built again without it, then with it once
    unfrozen."""
    runs = []
    for kind in ("torch", "flat"):
        model = _model()
        opt = _optimizer(kind, model)
        scaler = _scaler(kind)
        first = list(model[0].parameters())
        for s in range(7):
            if s == 2:
                for p in first:
                    p.requires_grad_(False)
                    if clear_grad:
                        p.grad = None
            if s == 5:
                for p in first:
                    p.requires_grad_(True)
            opt.zero_grad(set_to_none=set_to_none)
            x, y = _data(s)
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            runs.append((kind, s, [p.detach().clone() for p in model.parameters()]))
    half = len(runs) // 2
    for (_, s, a), (_, _, b) in zip(runs[:half], runs[half:]):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {s}: {m}")


@pytest.mark.parametrize("which", ["one", "all"])
def test_a_step_count_written_in_place_is_what_the_next_step_uses(which):
    """``opt.state[p]["step"].fill_(0)`` (restarting Adam's bias correction): with flat buffers
    the step views are refreshed from the segment's own count after each launch, which used to
    discard the write; the layout now sees it (the step buffer's write counter) and is built
    again from the counts as they are (per parameter when they differ)."""

    def restart(s, model, opt):
        if s == 3:
            params = list(model.parameters())
            for p in params[:1] if which == "one" else params:
                opt.state[p]["step"].fill_(0.0)

    ref, ref_opt, _ = _run("torch", hook=restart)
    flat, opt, _ = _run("flat", hook=restart)
    _assert_params(flat, ref, exact=False)
    for p, q in zip(flat.parameters(), ref.parameters()):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])


def test_amsgrad_switched_on_mid_training_raises_as_torch_before_stepping():
    """torch's AdamW raises KeyError at the step after ``amsgrad`` is switched on in a group
    whose state has no ``max_exp_avg_sq``; the flat layout built again for the new options
    used to make zeros for it and step. Now its first launch checks the state first."""
    errors = []
    for kind in ("torch", "flat"):
        model = _model()
        opt = _optimizer(kind, model)
        _train(kind, model, opt, _scaler(kind), 2)
        opt.param_groups[0]["amsgrad"] = True
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(KeyError) as info:
            opt.step()
        errors.append(info.value)
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)
    assert "max_exp_avg_sq" in str(errors[1])


def test_add_param_group_flattens_the_new_params():
    ref_model, flat_model = _model(), _model()
    ref = torch.optim.AdamW(list(ref_model.parameters())[:2], lr=1e-2, fused=True)
    opt = fastamp.optim.AdamW(list(flat_model.parameters())[:2], lr=1e-2, flat_buffers=True)
    _train("torch", ref_model, ref, _scaler("torch"), 2)
    _train("flat", flat_model, opt, _scaler("flat"), 2)
    ref.add_param_group({"params": list(ref_model.parameters())[2:], "lr": 1e-3})
    opt.add_param_group({"params": list(flat_model.parameters())[2:], "lr": 1e-3})
    assert all(p.grad is not None for p in flat_model.parameters())
    _train("torch", ref_model, ref, _scaler("torch"), 3, start=2)
    _train("flat", flat_model, opt, _scaler("flat"), 3, start=2)
    _assert_params(flat_model, ref_model, exact=False)
    assert opt._stepper.flat.usable and len(opt._stepper.flat.segments) == 2


def test_master_weights_bf16_matches_the_per_parameter_path():
    def run(flat):
        model = _model().to(torch.bfloat16)
        opt = fastamp.optim.AdamW(
            model.parameters(), lr=1e-2, master_weights=True, flat_buffers=flat
        )
        for s in range(4):
            opt.zero_grad(set_to_none=False)
            x, y = _data(s)
            ((model(x.bfloat16()) - y.bfloat16()) ** 2).float().mean().backward()
            opt.step()
        return model, opt

    per, _ = run(False)
    flat, opt = run(True)
    _assert_params(flat, per, exact=True)
    assert opt.state[next(flat.parameters())]["master_param"].dtype == torch.float32


def test_plain_step_without_scaler_matches():
    ref_model, flat_model = _model(), _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = fastamp.optim.AdamW(flat_model.parameters(), lr=1e-2, flat_buffers=True)
    for s in range(4):
        for m, o in ((ref_model, ref), (flat_model, opt)):
            o.zero_grad(set_to_none=False)
            x, y = _data(s)
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    _assert_params(flat_model, ref_model, exact=False)


# ---------------------------------------------------------------------------- refusals


def test_refuses_low_precision_state_and_non_bool():
    with pytest.raises(ValueError, match="flat_buffers=True keeps float32 moments"):
        fastamp.optim.AdamW(_model().parameters(), flat_buffers=True, state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="flat_buffers must be True or False"):
        fastamp.optim.AdamW(_model().parameters(), flat_buffers="yes")
    opt = fastamp.optim.AdamW(list(_model().parameters())[:1], flat_buffers=True)
    with pytest.raises(ValueError, match="flat_buffers=True keeps float32 moments"):
        opt.add_param_group({"params": list(_model().parameters())[1:], "state_dtype": "int8"})


def test_refuses_params_that_share_memory_before_changing_any():
    base = torch.zeros(10)
    a = torch.nn.Parameter(base[:6])
    b = torch.nn.Parameter(base[4:])
    ptr = a.data_ptr()
    with pytest.raises(ValueError, match="share memory"):
        fastamp.optim.AdamW([a, b], flat_buffers=True)
    assert a.data_ptr() == ptr and a.grad is None


def test_refuses_grad_views_of_another_buffer_naming_gradient_as_bucket_view():
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, flat_buffers=True)
    scaler = _scaler("flat")
    _train("flat", model, opt, scaler, 1)
    before = [p.detach().clone() for p in model.parameters()]
    bucket = torch.ones(sum(p.numel() for p in model.parameters()))
    off = 0
    for p in model.parameters():  # as DDP(gradient_as_bucket_view=True) leaves them
        p.grad = bucket[off : off + p.numel()].view_as(p)
        off += p.numel()
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="gradient_as_bucket_view=False"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="gradient_as_bucket_view=False"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("how", ["data", "set_"])
def test_refuses_a_grad_view_re_pointed_in_place_before_changing_anything(how):
    """p.grad stays the same view object but no longer points into the flat grad buffer: the
    layout's address check (fastamp::held_moved over the params and the views) sees it; the
    scaler and the optimizer both refuse, naming what was assigned, with nothing written."""
    model = _model()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, flat_buffers=True)
    scaler = _scaler("flat")
    _train("flat", model, opt, scaler, 2)
    before = [p.detach().clone() for p in model.parameters()]
    p0 = next(iter(model.parameters()))
    elsewhere = torch.randn_like(p0)
    if how == "data":
        p0.grad.data = elsewhere
    else:
        p0.grad.set_(elsewhere)
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match=r"p\.grad\.data or p\.grad\.set_ was assigned"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"p\.grad\.data or p\.grad\.set_ was assigned"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_refuses_dtensor_params_naming_the_argument(monkeypatch):
    import fastamp.optim._flat as flat_mod

    model = _model()
    first = next(model.parameters())
    monkeypatch.setattr(flat_mod, "is_dtensor", lambda t: t is first)
    with pytest.raises(ValueError, match=r"DTensor.*flat_buffers=False with FSDP2"):
        fastamp.optim.AdamW(model.parameters(), flat_buffers=True)
    assert first.grad is None  # nothing re-pointed


def test_default_path_is_unchanged():
    opt = fastamp.optim.AdamW(_model().parameters())
    assert opt._stepper.flat is None and opt.amp_flat_grads() is None
