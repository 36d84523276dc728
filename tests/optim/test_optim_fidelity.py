"""Issue 14, optimizers: torch.optim's class and fastamp's on the same input -- same result, same
exception class, and on an error the same state afterwards (nothing stepped, nothing created)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import assert_bitwise_equal

PAIRS = [
    pytest.param(torch.optim.Adam, fastamp.optim.Adam, {}, id="Adam"),
    pytest.param(
        torch.optim.AdamW,
        fastamp.optim.AdamW,
        {"amsgrad": True, "weight_decay": 0.1},
        id="AdamW-amsgrad",
    ),
    pytest.param(
        torch.optim.SGD,
        fastamp.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True},
        id="SGD-nesterov",
    ),
    pytest.param(torch.optim.SGD, fastamp.optim.SGD, {"lr": 0.1}, id="SGD-plain"),
]


def _view_model(seed: int):
    """Group 0: a dense param; group 1: a strided view (every other column) and a transposed
    slice of another tensor -- params whose elements are not one dense span."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 8, generator=g)
    u = torch.randn(6, 7, generator=g)
    dense = nn.Parameter(torch.randn(4, generator=g))
    strided = nn.Parameter(w[:, ::2])
    sliced_t = nn.Parameter(u[1:5, 2:6].t())
    return [dense, strided, sliced_t], (w, u)


def _train(cls, kw, steps=4):
    params, bases = _view_model(0)
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, bases, opt


@pytest.mark.parametrize("torch_cls,fa_cls,kw", PAIRS)
def test_non_dense_view_params_train_like_torch(torch_cls, fa_cls, kw):
    tp, tb, topt = _train(torch_cls, kw)
    fp, fb, fopt = _train(fa_cls, kw)
    for a, b in zip(tp + list(tb), fp + list(fb)):  # the params, and the tensors they view
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # The views still view their base (updated in place, as torch does).
    assert fp[1].data_ptr() == fb[0].data_ptr() and fp[1].stride() == (8, 2)
    # Interchangeable state: torch's state_dict loads into fastamp's optimizer and goes on alike.
    tsd, fsd = topt.state_dict(), fopt.state_dict()
    assert tsd["state"].keys() == fsd["state"].keys()
    for pid in tsd["state"]:
        for key, v in tsd["state"][pid].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                torch.testing.assert_close(fsd["state"][pid][key], v, rtol=1e-5, atol=1e-6)


def _overlapping():
    w = torch.randn(10)
    first = nn.Parameter(torch.randn(3))
    a = nn.Parameter(w[0:6])
    b = nn.Parameter(w[4:10])  # shares w[4:6] with a
    return first, a, b


@pytest.mark.parametrize(
    "fa_cls,kw", [(fastamp.optim.Adam, {}), (fastamp.optim.SGD, {"lr": 0.1, "momentum": 0.9})]
)
def test_overlapping_params_refused_before_any_group_steps(fa_cls, kw):
    first, a, b = _overlapping()
    opt = fa_cls([{"params": [first]}, {"params": [a, b]}], **kw)
    for p in (first, a, b):
        p.grad = torch.ones_like(p)
    before = ([p.detach().clone() for p in (first, a, b)], opt.state_dict())
    with pytest.raises(
        RuntimeError,
        match=r"param_groups\[1\]\['params'\]\[1\] and param_groups\[1\]\['params'\]\[0\] share memory",
    ):
        opt.step()
    # Group 0 was not stepped, no state was created for any group.
    assert_bitwise_equal(([p.detach().clone() for p in (first, a, b)], opt.state_dict()), before)
    assert len(opt.state) == 0
    # After a fix the retry steps every group exactly once (like a fresh optimizer would).
    opt.param_groups[1]["params"] = [a]
    opt.step()
    ref = fa_cls(
        [
            {"params": [nn.Parameter(before[0][0].clone())]},
            {"params": [nn.Parameter(before[0][1].clone())]},
        ],
        **kw,
    )
    for p in (q for g in ref.param_groups for q in g["params"]):
        p.grad = torch.ones_like(p)
    ref.step()
    assert torch.equal(first, ref.param_groups[0]["params"][0])
    assert torch.equal(a, ref.param_groups[1]["params"][0])


def test_overlap_across_groups_is_found_too():
    first, a, b = _overlapping()
    opt = fastamp.optim.AdamW([{"params": [first, a]}, {"params": [b]}])
    for p in (first, a, b):
        p.grad = torch.ones_like(p)
    with pytest.raises(
        RuntimeError,
        match=r"param_groups\[1\]\['params'\]\[0\] and param_groups\[0\]\['params'\]\[1\]",
    ):
        opt.step()
    assert len(opt.state) == 0 and opt.stepped is None


@pytest.mark.parametrize("torch_cls,fa_cls,kw", PAIRS)
def test_self_overlapping_param_raises_torchs_class_and_changes_nothing(torch_cls, fa_cls, kw):
    def make():
        first = nn.Parameter(torch.ones(3))
        expanded = nn.Parameter(torch.ones(1, 4).expand(3, 4))
        for p in (first, expanded):
            p.grad = torch.ones(p.shape)
        return first, expanded

    errors = []
    for cls in (torch_cls, fa_cls):
        first, expanded = make()
        opt = cls([{"params": [first]}, {"params": [expanded]}], **kw)
        with pytest.raises(Exception) as info:
            opt.step()
        errors.append(info.type)
        if cls is fa_cls:
            assert "param_groups[1]['params'][0]" in str(info.value)
            assert torch.equal(first, torch.ones(3)) and len(opt.state) == 0
    assert errors[1] is errors[0] or issubclass(errors[1], errors[0]), errors


@pytest.mark.parametrize("torch_cls,fa_cls,kw", PAIRS)
def test_scaler_step_returns_the_closure_result_like_torch(torch_cls, fa_cls, kw):
    results = []
    for scaler_cls, cls in ((torch.amp.GradScaler, torch_cls), (fastamp.GradScaler, fa_cls)):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5))
        opt = cls([p], **kw)
        scaler = scaler_cls("cpu", init_scale=4.0)
        marker = object()

        def closure():
            opt.zero_grad()
            scaler.scale((p * p).sum()).backward()
            return marker

        closure()
        results.append(scaler.step(opt, closure) is marker)
        scaler.update()
    assert results == [True, True]


def test_kernel_errors_name_param_group_entries():
    # Every refusal the kernel could make is checked in Python first (naming the group entry);
    # should one still come from the kernel, its list positions are translated.
    p0, p1 = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4))
    opt = fastamp.optim.Adam([{"params": [p0]}, {"params": [p1]}])
    err = opt._step_checks.kernel_error(
        RuntimeError("fastamp::adam_step_: exp_avgs[0] is bad"), 1, [0], first=False
    )
    assert isinstance(err, RuntimeError)
    assert "exp_avgs[0] is bad" in str(err) and "[0] = param_groups[1]['params'][0]" in str(err)
    assert "no param group was stepped" not in str(err)  # a later launch: earlier ones ran
