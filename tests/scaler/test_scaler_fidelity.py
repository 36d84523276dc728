"""Issue 14, GradScaler and its raw ops: the same misuse raises the same exception class as
PyTorch's (code that catches torch's class must catch fastamp's), and leaves the same state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastamp
from fastamp._library import StableOps
from fastamp.testing import assert_bitwise_equal

# The ops as fastamp's Python layer calls them: the exception class each kernel means (a bare
# torch.ops.fastamp call carries it as a RuntimeError's message prefix; test_library.py).
_ops = StableOps("fastamp")


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the class is what is compared
        return type(e)
    return None


def _complex_setup(scaler_cls):
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q = nn.Parameter(torch.randn(2))
    p.grad = torch.randn(3, dtype=torch.complex64)
    q.grad = torch.randn(2)
    opt = torch.optim.SGD([q, p], lr=0.1)
    scaler = scaler_cls("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # creates the scale, as the first scale(loss) does
    return p, q, opt, scaler


@pytest.mark.parametrize("method", ["unscale_", "step"])
def test_complex_grads_raise_torchs_class_and_change_nothing(method):
    classes = []
    for scaler_cls in (torch.amp.GradScaler, fastamp.GradScaler):
        p, q, opt, scaler = _complex_setup(scaler_cls)
        before = [q.grad.clone(), p.grad.clone(), q.detach().clone(), scaler.state_dict()]
        classes.append(_outcome(lambda: getattr(scaler, method)(opt)))
        if scaler_cls is fastamp.GradScaler:
            assert_bitwise_equal(
                [q.grad.clone(), p.grad.clone(), q.detach().clone(), scaler.state_dict()], before
            )
            assert id(opt) not in scaler._per_optimizer_states  # no half-recorded stage
    assert classes[0] is not None and classes[1] is classes[0], classes


def _unscale_cases():
    g = lambda: [torch.randn(3), torch.randn(2)]  # noqa: E731
    f32 = lambda *s: torch.zeros(s or (1,))  # noqa: E731
    return {
        "found_inf int32": (g, lambda: torch.zeros(1, dtype=torch.int32), lambda: torch.ones(1)),
        "found_inf 2 elements": (g, lambda: f32(2), lambda: torch.ones(1)),
        "inv_scale float64": (g, lambda: f32(), lambda: torch.ones(1, dtype=torch.float64)),
        "inv_scale 3 elements": (g, lambda: f32(), lambda: torch.ones(3)),
        "grads int64": (
            lambda: [torch.ones(3, dtype=torch.int64)],
            lambda: f32(),
            lambda: torch.ones(1),
        ),
        "grads complex": (
            lambda: [torch.ones(3, dtype=torch.complex64)],
            lambda: f32(),
            lambda: torch.ones(1),
        ),
    }


@pytest.mark.parametrize("case", list(_unscale_cases()))
def test_raw_unscale_op_raises_like_torchs(case):
    grads_fn, found_fn, inv_fn = _unscale_cases()[case]
    want = _outcome(
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads_fn(), found_fn(), inv_fn())
    )
    assert want is not None and issubclass(want, RuntimeError)
    grads, found, inv = grads_fn(), found_fn(), inv_fn()
    before = [t.clone() for t in grads] + [found.clone()]
    tfi = torch.zeros(len(grads), dtype=torch.bool)
    got = _outcome(lambda: _ops.non_finite_check_and_unscale_(grads, found, inv, tfi))
    assert got is want, (got, want)
    assert_bitwise_equal([t.clone() for t in grads] + [found.clone()], before)


def _update_cases():
    f32 = lambda: torch.full((1,), 4.0)  # noqa: E731
    i32 = lambda: torch.zeros(1, dtype=torch.int32)  # noqa: E731
    fi = lambda: torch.zeros(1)  # noqa: E731
    return {
        "scale float64": (lambda: torch.full((1,), 4.0, dtype=torch.float64), i32, fi),
        "scale 2 elements": (lambda: torch.full((2,), 4.0), i32, fi),
        "growth_tracker float32": (f32, lambda: torch.zeros(1), fi),
        "growth_tracker int64": (f32, lambda: torch.zeros(1, dtype=torch.int64), fi),
        "found_inf int32": (f32, i32, lambda: torch.zeros(1, dtype=torch.int32)),
        "found_inf 2 elements": (f32, i32, lambda: torch.zeros(2)),
    }


@pytest.mark.parametrize("case", list(_update_cases()))
def test_raw_update_scale_op_raises_like_torchs(case):
    scale_fn, tracker_fn, found_fn = _update_cases()[case]
    want = _outcome(
        lambda: torch._amp_update_scale_(scale_fn(), tracker_fn(), found_fn(), 2.0, 0.5, 3)
    )
    assert want is not None and issubclass(want, RuntimeError)
    scale, tracker, found = scale_fn(), tracker_fn(), found_fn()
    hyst = torch.ones(1, dtype=torch.int32)
    before = [scale.clone(), tracker.clone(), hyst.clone()]
    got = _outcome(
        lambda: _ops.update_scale_(scale, tracker, hyst, found, 2.0, 0.5, 3, 1, 0.0, float("inf"))
    )
    assert got is want, (got, want)
    assert_bitwise_equal([scale.clone(), tracker.clone(), hyst.clone()], before)


def test_in_iteration_follows_the_per_optimizer_stage():
    """fastamp extra used by save_training_state: True from the first unscale_/step of an
    iteration until update(), as torch's per-optimizer stage says."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fastamp.GradScaler("cpu")
    assert not scaler.in_iteration()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    assert not scaler.in_iteration()  # backward alone does not start the scaler's iteration
    scaler.unscale_(opt)
    assert scaler.in_iteration()
    scaler.step(opt)
    assert scaler.in_iteration()
    scaler.update()
    assert not scaler.in_iteration()
    assert not fastamp.GradScaler("cpu", enabled=False).in_iteration()
