"""Sparse grads under flat buffers: torch's Adam/AdamW refuse them at the step with a
RuntimeError; fastamp's AdamW(flat_buffers=True) refuses them the same way, before any param,
grad or state changes, whether the optimizer was built before the first backward (the dense grad
views would otherwise take the sparse grads in), after it, or steps through the GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import assert_bitwise_equal


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))


def _backward(m: nn.Module, scaler=None) -> None:
    loss = m(torch.tensor([1, 3, 3, 7])).square().sum()
    (loss if scaler is None else scaler.scale(loss)).backward()


def _error(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def _snapshot(m: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    grads = [None if p.grad is None else p.grad.to_dense().clone() for p in m.parameters()]
    return [p.detach().clone() for p in m.parameters()], grads, opt.state_dict()


@pytest.mark.parametrize("built", ["before_backward", "after_backward", "after_a_step"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("through_scaler", [False, True])
def test_flat_buffers_refuse_sparse_grads_like_torch(built, set_to_none, through_scaler):
    base = _model()
    tm, fm = copy.deepcopy(base), copy.deepcopy(base)
    results = {}
    for name, m in (("torch", tm), ("fastamp", fm)):
        if name == "torch":
            make = lambda: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)  # noqa: E731
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        else:
            make = lambda: fastamp.optim.AdamW(m.parameters(), lr=1e-2, flat_buffers=True)  # noqa: E731
            scaler = fastamp.GradScaler("cpu", init_scale=4.0)
        if built == "after_a_step":  # a dense step first: only the Linear has grads
            m[0].weight.requires_grad_(False)
            opt = make()
            m(torch.tensor([2])).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            m[0].weight.requires_grad_(True)
        elif built == "before_backward":
            opt = make()
        else:
            _backward(m, scaler if through_scaler else None)
            opt = make()
        if built != "after_backward":
            _backward(m, scaler if through_scaler else None)
        before = _snapshot(m, opt)

        def step() -> None:
            if through_scaler:
                scaler.step(opt)
            else:
                opt.step()

        results[name] = _error(step)
        if name == "fastamp":
            assert_bitwise_equal(_snapshot(m, opt), before)
            # refused again at the next step, as torch's: the sparse grad is still there
            assert type(_error(step)) is type(results["torch"])
            assert_bitwise_equal(_snapshot(m, opt), before)
    t, f = results["torch"], results["fastamp"]
    assert type(f) is type(t), (f, t)
    assert str(t) in str(f), (str(f), str(t))
    assert "param_groups[0]['params'][0]" in str(f) and "sparse=False" in str(f)


def test_a_dense_run_after_zero_grad_steps_flat_again():
    """The refusal lasts until zero_grad; a module switched to dense grads then steps as torch."""
    base = _model()
    tm, fm = copy.deepcopy(base), copy.deepcopy(base)
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-2, fused=True)
    fopt = fastamp.optim.AdamW(fm.parameters(), lr=1e-2, flat_buffers=True)
    _backward(fm)
    with pytest.raises(RuntimeError, match="sparse"):
        fopt.step()
    for m, opt in ((tm, topt), (fm, fopt)):
        opt.zero_grad()
        m[0].sparse = False
        _backward(m)
        opt.step()
    for a, b in zip(tm.parameters(), fm.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
