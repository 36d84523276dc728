"""The misuse catalogue of optim (harness: tests/_misuse.py): each misuse raises a clear error
naming the argument and changes nothing."""

from __future__ import annotations

import copy

import pytest

from fastamp.testing import op_args
from tests._misuse import *  # noqa: F403 (the catalogue's harness and world builders)
from tests._misuse import Case, check_misuse, make_case

CASES: list[Case] = []
case = make_case(CASES)


@case("adam_lr_negative", ValueError, r"learning rate", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.Adam(ps, lr=-1e-3)


@case("adamw_beta_out_of_range", ValueError, r"beta parameter at index 1", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.AdamW(ps, betas=(0.9, 1.0))


@case("adamw_weight_decay_negative", ValueError, r"weight_decay", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.AdamW(ps, weight_decay=-0.1)


@case(
    "sgd_nesterov_without_momentum",
    ValueError,
    r"Nesterov momentum",
    r"requires a momentum and zero dampening",
    like_torch="message",
)
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.SGD(ps, lr=0.1, nesterov=True)


@case(
    "optim_add_param_group_already_present",
    ValueError,
    r"more than one parameter group",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: opt.add_param_group({"params": [model[0].weight]})


@case(
    "adam_sparse_grads",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
    r"sparse=False|SparseAdam",
    like_torch="type",
)
def _(lib):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = lib.Adam(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    return _world(model, opt), lambda: opt.step()


@case(
    "sgd_sparse_grads",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
    r"use torch\.optim\.SGD",
)
def _(lib):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = lib.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.tensor([1, 2, 3])).sum().backward()
    return _world(model, opt), lambda: opt.step()


@case(
    "adam_float64_params",
    TypeError,
    r"param_groups\[0\]\['params'\]\[0\] has dtype torch\.float64",
    r"use torch\.optim",
)
def _(lib):
    model = _net(torch.float64)
    opt = lib.Adam(model.parameters(), lr=1e-3)
    _loss(model).backward()
    return _world(model, opt), lambda: opt.step()


@case(
    "adamw_bad_param_in_third_group",
    TypeError,
    r"param_groups\[2\]\['params'\]\[0\] has dtype torch\.complex64",
    r"use torch\.optim",
)
def _(lib):
    # The first two groups are fine: they must not be stepped before the third is refused.
    model, opt, sc = _trained(lib, backward=True)
    z = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    z.grad = torch.ones_like(z)
    opt.add_param_group({"params": [z]})
    return _world(model, opt, sc, z=z), lambda: opt.step()


@case(
    "adamw_master_weights_mixed_group",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\] is float32, param_groups\[0\]\['params'\]\[2\] is not",
    r"separate param groups",
)
def _(lib):
    model = _net()
    model[2].to(torch.bfloat16)
    opt = lib.AdamW(model.parameters(), lr=1e-3, master_weights=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return _world(model, opt), lambda: opt.step()


@case(
    "adam_group_on_two_devices",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[1\] is on meta",
    r"model\.to\(device\)",
)
def _(lib):
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(4, device="meta"))
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt = lib.Adam([a, b], lr=1e-3)
    return _world(None, opt, a=a, b=b), lambda: opt.step()


@case(
    "adamw_grad_of_another_shape",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\] has shape \(8, 6\) on cpu but its grad has shape \(48,\)",
    r"expected a grad of the parameter's shape",
    like_torch="type",
)
def _(lib):
    # Same device, other shape (PyTorch's update fails on the size mismatch).
    model, opt, sc = _trained(lib)
    model[0].weight.grad.resize_(48)  # (assigning .grad checks the shape; resizing it does not)
    return _world(model, opt, sc), lambda: opt.step()


@case(
    "adamw_amsgrad_state_replaced_by_one_of_another_shape",
    RuntimeError,
    r"state\['max_exp_avg_sq'\] of param_groups\[0\]\['params'\]\[0\] has shape \(48,\)",
    r"the state belongs to another model",
    like_torch="type",
)
def _(lib):
    # Between steps, amsgrad's maximum replaced by hand with one of the same size but another
    # shape (the moments have their own check, in lowbit.check_any).
    model, opt, sc = _trained(lib, opt_kw={"amsgrad": True})
    st = opt.state[model[0].weight]
    st["max_exp_avg_sq"] = st["max_exp_avg_sq"].reshape(-1).clone()
    return _world(model, opt, sc), lambda: opt.step()


@case(
    "adamw_param_data_of_another_shape",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\]\['exp_avg'\] has shape \(8, 6\)",
    r"the state belongs to another model",
    like_torch="type",
)
def _(lib):
    # p.data re-pointed at a tensor of another shape between steps: the state no longer fits.
    model, opt, sc = _trained(lib)
    model[0].weight.data = torch.zeros(6, 8)
    model[0].weight.grad = torch.ones(6, 8)
    return _world(model, opt, sc), lambda: opt.step()


@case(
    "adamw_model_half_after_the_state_was_made",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\]\['exp_avg'\] is a torch.float32 tensor",
    r"optimizer made after the conversion",
    like_torch="type",
)
def _(lib):
    # model.half() between steps: torch's AdamW fails at the step; fastamp used to convert the
    # moments to float16 and step on.
    model, opt, sc = _trained(lib, backward=False)
    model.half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return _world(model, opt, sc), lambda: opt.step()


@case(
    "optim_load_state_of_another_model",
    ValueError,
    r"state_dict\['state'\]\[0\]\['exp_avg'\] has shape \(6, 8\)",
    r"saved with this model",
)
def _(lib):
    # Same number of parameters per group, other shapes: PyTorch loads it, the step fails.
    other = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(8, 3))
    other_opt = _opt(lib, "AdamW", other)
    nn.functional.mse_loss(other[2](torch.randn(5, 8)), torch.randn(5, 3)).backward()
    other[0](torch.randn(5, 8)).sum().backward()
    other_opt.step()
    sd = other_opt.state_dict()
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


@case(
    "optim_load_sgd_state_into_adamw",
    KeyError,
    r"state_dict\['param_groups'\]\[0\] has no \['betas'",
    r"looks like an SGD state_dict.*same optimizer type",
    like_torch="type",
)
def _(lib):
    model, opt, sc = _trained(lib, "AdamW", backward=False)
    sgd = _opt(TORCH, "SGD", model)
    _loss(model).backward()
    sgd.step()
    sd = sgd.state_dict()
    opt.zero_grad(set_to_none=True)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


@case(
    "optim_load_model_state_dict",
    KeyError,
    r"state_dict has no 'state' entry",
    r"model's state_dict or a whole checkpoint",
    like_torch="type",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: opt.load_state_dict(model.state_dict())


@case(
    "optim_load_state_missing_step",
    KeyError,
    r"state_dict\['state'\]\[1\] has no 'step'",
    r"state an Adam/AdamW optimizer saves",
    like_torch="type",
)
def _(lib):
    # PyTorch raises this too -- from __setstate__, after the optimizer's state was replaced.
    return _optim_load(lib, lambda sd: sd["state"][1].pop("step"))


@case(
    "optim_load_state_tensors_as_lists",
    TypeError,
    r"state_dict\['state'\]\[0\]\['exp_avg'\] is a list",
    r"torch\.save",
)
def _(lib):
    def to_lists(sd):
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].tolist()

    return _optim_load(lib, to_lists)


@case(
    "optim_load_negative_lr",
    ValueError,
    r"state_dict\['param_groups'\]\[1\]\['lr'\]",
    r"a number >= 0",
)
def _(lib):
    def bad(sd):
        sd["param_groups"][1]["lr"] = -2e-3

    return _optim_load(lib, bad)


@case(
    "optim_load_group_count_mismatch",
    ValueError,
    r"different number of parameter groups",
    like_torch="message",
)
def _(lib):
    def one_group(sd):
        sd["param_groups"] = sd["param_groups"][:1]

    return _optim_load(lib, one_group)


@case(
    "optim_load_group_size_mismatch",
    ValueError,
    r"doesn't match the size of optimizer's group",
    like_torch="message",
)
def _(lib):
    def shorter(sd):
        sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:1]

    return _optim_load(lib, shorter)


@case(
    "op_adam_step_list_lengths_differ",
    RuntimeError,
    r"exp_avgs has 1 tensors",
    r"expected one per param \(2\)",
)
def _(lib):
    ps = [torch.randn(4), torch.randn(5)]
    gs = [torch.randn(4), torch.randn(5)]
    m, v = [torch.zeros(4)], [torch.zeros(4), torch.zeros(5)]
    steps = [_scalar(0.0), _scalar(0.0)]
    world = {"params": ps, "grads": gs, "exp_avgs": m, "exp_avg_sqs": v, "steps": steps}
    return world, lambda: _F.adam_step_(*op_args(
        "adam_step_", params=ps, grads=gs, exp_avgs=m, exp_avg_sqs=v, state_steps=steps,
        lr=1e-3))  # fmt: skip


@case(
    "op_sgd_step_buffers_without_momentum",
    RuntimeError,
    r"momentum_buffers",
    r"must be empty when momentum == 0",
)
def _(lib):
    ps, gs, bufs = [torch.randn(4)], [torch.randn(4)], [torch.zeros(4)]
    counts = [_scalar(0.0)]
    world = {"params": ps, "grads": gs, "bufs": bufs, "counts": counts}
    return world, lambda: _F.sgd_step_(*op_args(
        "sgd_step_", params=ps, grads=gs, momentum_buffers=bufs, state_steps=counts,
        momentum=0.0))  # fmt: skip


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    check_misuse(c)


# ------------------------------------------------------------------ the checks let valid input through


def test_master_weights_state_survives_a_state_dict_round_trip():
    # PyTorch's load casts all floating state to the param's dtype: the fp32 masters and moments
    # of fp16 params came back as fp16 and the next step failed.
    model = _net(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    for seed in range(3):
        opt.zero_grad()
        _loss(model, seed).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = fastamp.optim.AdamW(twin.parameters(), lr=1e-2, master_weights=True)
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], opt2.state[q][key]
            assert b.dtype == torch.float32 and _bytes(a) == _bytes(b), key
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        _loss(m, 7).backward()
        o.step()
    assert all(_bytes(p) == _bytes(q) for p, q in zip(model.parameters(), twin.parameters()))


def test_state_dicts_of_torch_and_after_user_pre_hooks_still_load():
    model, opt, _ = _trained(TORCH, "AdamW", backward=False)
    f_opt = _opt(FASTAMP, "AdamW", model)
    f_opt.load_state_dict(opt.state_dict())
    _loss(model).backward()
    f_opt.step()
    # fastamp's check runs after the user's pre-hooks: a hook may repair an old checkpoint.
    sd = copy.deepcopy(f_opt.state_dict())
    for st in sd["state"].values():
        del st["step"]

    def add_steps(optimizer, state_dict):
        for st in state_dict["state"].values():
            st.setdefault("step", torch.tensor(5.0))

    g_opt = _opt(FASTAMP, "AdamW", model)
    g_opt.register_load_state_dict_pre_hook(add_steps)
    g_opt.load_state_dict(sd)
    assert float(g_opt.state[model[0].weight]["step"]) == 5.0


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_one_element_step_count_loads_and_steps_like_torch(kind):
    """A state_dict whose step counts are 1-element 1-D tensors (as some tools save them): both
    libraries step from it alike, and fastamp keeps its own 0-dim float32 count."""
    models = [_net(), _net()]
    opts = [_opt(TORCH, kind, models[0], foreach=False), _opt(FASTAMP, kind, models[1])]
    for m, o in zip(models, opts):
        _loss(m).backward()
        o.step()
    sd = opts[0].state_dict()
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = st["step"].reshape(1).clone()
    for m, o in zip(models, opts):
        o.load_state_dict(copy.deepcopy(sd))
        o.zero_grad()
        _loss(m, seed=3).backward()
        o.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    if kind == "AdamW":
        steps = [opts[1].state[p]["step"] for p in models[1].parameters()]
        assert all(s.dim() == 0 and s.dtype == torch.float32 and float(s) == 2.0 for s in steps)


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_a_grad_with_other_strides_than_its_param_steps_like_torch(kind):
    # PyTorch takes any grad layout; the fused kernel needs the param's, so it gets a copy.
    models = [_net(), _net()]
    opts = [_opt(TORCH, kind, models[0], foreach=False), _opt(FASTAMP, kind, models[1])]
    for m, o in zip(models, opts):
        _loss(m).backward()
        w = m[0].weight
        w.grad = w.grad.t().contiguous().t()  # same values, column-major
        assert w.grad.stride() != w.stride()
        o.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
