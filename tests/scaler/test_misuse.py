"""The misuse catalogue of scaler (harness: tests/_misuse.py): each misuse raises a clear error
naming the argument and changes nothing."""

from __future__ import annotations

import pytest

from tests._misuse import *  # noqa: F403 (the catalogue's harness and world builders)
from tests._misuse import Case, check_misuse, make_case

CASES: list[Case] = []
case = make_case(CASES)


@case("scaler_init_scale_zero", ValueError, r"init_scale", r"finite number > 0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=0.0)


@case("scaler_init_scale_nan", ValueError, r"init_scale", r"finite number > 0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=math.nan)


@case("scaler_init_scale_inf", ValueError, r"init_scale", r"expected e\.g\. 2\.0\*\*16")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=math.inf)


@case("scaler_growth_factor_not_above_1", AssertionError, r"growth factor", like_torch="message")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_factor=1.0)


@case("scaler_growth_factor_inf", ValueError, r"growth_factor", r"finite number > 1\.0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_factor=math.inf)


@case("scaler_backoff_factor_not_below_1", AssertionError, r"backoff factor", like_torch="message")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", backoff_factor=1.0)


@case(
    "scaler_backoff_factor_zero",
    ValueError,
    r"backoff_factor",
    r"in \(0, 1\).*expected e\.g\. 0\.5",
)
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", backoff_factor=0.0)


@case("scaler_growth_interval_zero", ValueError, r"growth_interval", r"int >= 1")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_interval=0)


@case("scaler_hysteresis_zero", ValueError, r"hysteresis", r"int >= 1")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", hysteresis=0)


@case("scaler_min_scale_above_max_scale", ValueError, r"max_scale", r"must be >= min_scale")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", min_scale=8.0, max_scale=4.0)


@case("scaler_set_growth_interval_zero", ValueError, r"new_interval", r"int >= 1")
def _(lib):
    # PyTorch stores it, and update() fails after the optimizer has stepped.
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.set_growth_interval(0)


@case(
    "scaler_load_state_dict_scale_zero", ValueError, r"state_dict\['scale'\]", r"finite number > 0"
)
def _(lib):
    return _scaler_load(lib, scale=0.0)


@case(
    "scaler_load_state_dict_scale_nan", ValueError, r"state_dict\['scale'\]", r"finite number > 0"
)
def _(lib):
    return _scaler_load(lib, scale=math.nan)


@case(
    "scaler_load_state_dict_growth_interval_str",
    TypeError,
    r"state_dict\['growth_interval'\]",
    r"must be an int >= 1",
)
def _(lib):
    return _scaler_load(lib, growth_interval="2000")  # e.g. a checkpoint that went through YAML


@case(
    "scaler_load_state_dict_hysteresis_zero", ValueError, r"state_dict\['hysteresis'\]", r"int >= 1"
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False, hysteresis=2)
    sd = sc.state_dict()
    sd["hysteresis"] = 0
    return _world(model, opt, sc), lambda: sc.load_state_dict(sd)


@case(
    "scaler_load_optimizer_state_dict",
    KeyError,
    r"lacks \[.*'scale'",
    r"GradScaler\.state_dict\(\)",
    like_torch="type",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict(opt.state_dict())  # wrong entry


@case(
    "scaler_load_state_dict_empty",
    RuntimeError,
    r"source state dict is empty",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict({})


@case(
    "scaler_load_state_dict_none",
    TypeError,
    r"state_dict",
    r"GradScaler\.state_dict\(\)",
    like_torch="type",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict(None)


@case("scaler_update_new_scale_zero", ValueError, r"new_scale", r"finite number > 0")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale=0.0)


@case("scaler_update_new_scale_int", AttributeError, r"new_scale", r"512\.0", like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale=512)


@case("scaler_update_new_scale_str", AttributeError, r"new_scale", r"float", like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale="2.0")


@case(
    "scaler_update_new_scale_two_elements",
    AssertionError,
    r"new_scale",
    r"should be a float or a 1-element",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale=torch.tensor([8.0, 8.0]))


@case(
    "scaler_scale_non_tensor",
    ValueError,
    r"outputs",
    r"must be a Tensor or an iterable of Tensors",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    loss = _loss(model)
    return _world(model, opt, sc), lambda: sc.scale(loss.item())


@case(
    "scaler_scale_meta_loss",
    RuntimeError,
    r"outputs is on the meta device",
    r"model\.to_empty\(device=",
)
def _(lib):
    # Deferred initialisation forgotten: PyTorch creates the scale on meta, and step() fails later.
    with torch.device("meta"):
        model = _net()
    sc = lib.GradScaler("cpu")
    loss = model(torch.randn(5, 6, device="meta")).sum()
    return _world(model, None, sc), lambda: sc.scale(loss)


@case(
    "scaler_unscale_meta_grads",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\]",
    r"to_empty\(device=",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    with torch.device("meta"):
        meta = _net()
    for p in meta.parameters():
        p.grad = torch.ones_like(p)
    meta_opt = lib.SGD(meta.parameters(), lr=0.1)
    return _world(model, opt, sc, meta=meta), lambda: sc.unscale_(meta_opt)


@case(
    "scaler_unscale_twice",
    RuntimeError,
    r"unscale_\(\) has already been called",
    r"since the last update\(\)",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    sc.unscale_(opt)
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


@case(
    "scaler_unscale_after_step",
    RuntimeError,
    r"unscale_\(\) is being called after step\(\)",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


@case(
    "scaler_step_twice",
    RuntimeError,
    r"step\(\) has already been called",
    r"since the last update\(\)",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.step(opt)


@case(
    "scaler_update_without_step",
    AssertionError,
    r"No inf checks were recorded prior to update",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.update()


@case(
    "scaler_step_without_scale",
    AssertionError,
    r"Attempted step but _scale is None",
    r"did not use scaler\.scale\(loss or outputs\)",
    like_torch="message",
)
def _(lib):
    model = _net()
    opt = _opt(lib, "SGD", model)
    _loss(model).backward()
    sc = lib.GradScaler("cpu")
    return _world(model, opt, sc), lambda: sc.step(opt)


@case(
    "scaler_step_with_closure",
    RuntimeError,
    r"Closure use is not currently supported",
    like_torch="message",
)
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.step(opt, closure=lambda: _loss(model))


@case(
    "scaler_unscale_fp16_grads",
    ValueError,
    r"Attempting to unscale FP16 gradients",
    like_torch="message",
)
def _(lib):
    model = _net(torch.float16)
    opt = lib.SGD(model.parameters(), lr=0.1)
    sc = lib.GradScaler("cpu")
    sc.scale(_loss(model)).backward()
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


@case(
    "clip_max_norm_negative", ValueError, r"max_norm", r"non-negative number.*expected e\.g\. 1\.0"
)
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, -1.0)


@case("clip_max_norm_nan", ValueError, r"max_norm", r"non-negative number")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, math.nan)


@case("clip_norm_type_zero", ValueError, r"norm_type", r"positive number or inf")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0, norm_type=0)


@case("clip_norm_type_fro", ValueError, r"norm_type", r"expected e\.g\. 2\.0")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0, norm_type="fro")


@case(
    "clip_given_parameters_not_optimizer",
    TypeError,
    r"optimizer must be",
    r"scaler\.clip_grad_norm_\(optimizer, max_norm\)",
)
def _(lib):
    # The habit from torch.nn.utils.clip_grad_norm_(model.parameters(), ...).
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(model.parameters(), 1.0)


@case(
    "clip_after_step",
    RuntimeError,
    r"clip_grad_norm_\(\) is being called after step\(\)",
    r"between scaler\.scale\(loss\)\.backward\(\) and scaler\.step\(optimizer\)",
)
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0)


@case(
    "clip_fp16_grads_torch_optimizer",
    ValueError,
    r"param_groups\[0\]\['params'\]\[0\] has a float16 grad",
    r"keep the model in float32.*fastamp\.optim",
)
def _(lib):
    model = _net(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = lib.GradScaler("cpu")
    sc.scale(_loss(model)).backward()
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0)


@case(
    "scaler_fused_step_with_sparse_grads",
    RuntimeError,
    r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
    r"sparse=False",
)
def _(lib):
    # The scaler's read-only inf check passes; the fused optimizer refuses: the scaler's
    # per-optimizer state must not keep the inf check of a step that did not happen.
    emb = nn.Embedding(10, 4, sparse=True)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    sc = lib.GradScaler("cpu")
    sc.scale(model(torch.tensor([1, 2, 3])).square().sum()).backward()
    return _world(model, opt, sc), lambda: sc.step(opt)


@case("scale_lr_unknown_rule", ValueError, r"rule", r"'linear' or 'sqrt'")
def _(lib):
    return {}, lambda: fastamp.scale_lr(1e-3, 256, 1024, rule="cubic")


@case("scale_lr_base_batch_zero", ValueError, r"base_batch", r"int >= 1")
def _(lib):
    return {}, lambda: fastamp.scale_lr(1e-3, 0, 1024)


@case("scale_lr_base_lr_string", TypeError, r"base_lr", r"expected e\.g\. 1e-3")
def _(lib):
    return {}, lambda: fastamp.scale_lr("1e-3", 256, 1024)


@case(
    "op_unscale_tensor_found_inf_wrong_length", RuntimeError, r"tensor_found_inf", r"len\(grads\)=3"
)
def _(lib):
    grads, found = _grads(), _scalar(0.0)
    flags = torch.zeros(2, dtype=torch.bool)
    return (
        {"grads": grads, "found_inf": found, "flags": flags},
        lambda: _F.non_finite_check_and_unscale_(grads, found, _scalar(1 / 64), flags),
    )


@case(
    "op_unscale_overlapping_output_view",
    RuntimeError,
    r"grads\[1\] is a view whose elements overlap",
    r"\.clone\(\)",
)
def _(lib):
    base = torch.randn(1, 4)
    grads = [
        torch.randn(3),
        base.expand(3, 4),
    ]  # writing it in place would hit each element 3 times
    found = _scalar(0.0)
    return (
        {"grads": grads, "base": base, "found": found},
        lambda: _F.non_finite_check_and_unscale_(
            grads, found, _scalar(0.5), torch.zeros(2, dtype=torch.bool)
        ),
    )


@case(
    "op_grad_stats_inv_scale_two_elements",
    RuntimeError,
    r"inv_scale has 2 elements",
    r"expected a one-element tensor",
)
def _(lib):
    grads = _grads()
    return {"grads": grads}, lambda: _F.grad_stats(grads, torch.ones(2), 2.0)


@case("op_update_scale_float64_scale", RuntimeError, r"scale has dtype Double", r"expected Float")
def _(lib):
    scale, growth, hyst = (
        _scalar(1024.0, torch.float64),
        _scalar(3, torch.int32),
        _scalar(1, torch.int32),
    )
    found = _scalar(0.0)
    return (
        {"scale": scale, "growth": growth, "hysteresis": hyst, "found": found},
        lambda: _F.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 1, 1, 0.0, math.inf),
    )


@case(
    "op_clip_unscale_grads_on_two_devices",
    RuntimeError,
    r"grads\[1\] is on meta",
    r"group tensors by device",
)
def _(lib):
    grads = [torch.randn(4) * 64, torch.randn(4, device="meta")]
    return {"grads": grads}, lambda: _F.clip_unscale_(grads, _scalar(1 / 64), _scalar(2.0), 1.0)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    check_misuse(c)


# ------------------------------------------------------------------ the checks let valid input through


def test_scaler_accepts_what_pytorch_does():
    model, opt, sc = _trained(FASTAMP, backward=False)
    sc.update(new_scale=512.0)
    assert sc.get_scale() == 512.0
    sc.load_state_dict(torch.amp.GradScaler("cpu", init_scale=64.0).state_dict())
    assert sc.get_scale() == 64.0
    sc.set_growth_interval(3)
    outs = sc.scale([torch.ones(()), (torch.ones(2),)])
    assert float(outs[0]) == 64.0 and outs[1][0].tolist() == [64.0, 64.0]


@pytest.mark.parametrize("fused", [True, False], ids=["fastamp_optimizer", "torch_optimizer"])
def test_step_after_zero_grad_says_the_grads_are_none(fused):
    """torch raises AssertionError("No inf checks were recorded for this optimizer.") when
    zero_grad() ran between backward and step; fastamp raises the same class and words, then
    says why."""
    import torch

    import fastamp

    model = torch.nn.Linear(3, 2)
    opt = (fastamp.optim.AdamW if fused else torch.optim.AdamW)(model.parameters())
    tmodel = torch.nn.Linear(3, 2)
    topt = torch.optim.AdamW(tmodel.parameters())
    for m, o, s in (
        (model, opt, fastamp.GradScaler("cpu")),
        (tmodel, topt, torch.amp.GradScaler("cpu")),
    ):
        s.scale(m(torch.randn(4, 3)).sum()).backward()
        o.zero_grad()
        with pytest.raises(AssertionError) as err:
            s.step(o)
        assert str(err.value).startswith("No inf checks were recorded for this optimizer")
        if isinstance(s, fastamp.GradScaler):
            assert "grad None" in str(err.value) and "zero_grad()" in str(err.value)
