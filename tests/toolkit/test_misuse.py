"""The misuse catalogue of toolkit (harness: tests/_misuse.py): each misuse raises a clear error
naming the argument and changes nothing."""

from __future__ import annotations

import pytest

from tests._misuse import *  # noqa: F403 (the catalogue's harness and world builders)
from tests._misuse import Case, check_misuse, make_case

CASES: list[Case] = []
case = make_case(CASES)


@case("accumulator_steps_zero", ValueError, r"accum_steps", r"int >= 1")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(opt, 0, scaler=sc)


@case(
    "accumulator_given_parameters",
    TypeError,
    r"optimizer must be a torch\.optim\.Optimizer",
    r"expected GradientAccumulator\(torch\.optim",
)
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(model.parameters(), 4)


@case("accumulator_max_grad_norm_negative", ValueError, r"max_grad_norm", r"number > 0")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(opt, 2, max_grad_norm=-1.0)


@case(
    "accumulator_backward_outside_with",
    RuntimeError,
    r"micro\.backward\(loss\) was called outside",
    r"with micro: micro\.backward\(loss\)",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    acc = fastamp.GradientAccumulator(opt, 2, scaler=sc)
    _, micro = next(acc.iterate([0, 1]))
    loss = _loss(model)
    return _world(model, opt, sc, acc=acc), lambda: micro.backward(loss)


@case(
    "accumulator_block_without_backward",
    RuntimeError,
    r"call micro\.backward\(loss\)",
    r"inside `with micro:`",
)
def _(lib):
    # The last micro-batch of a group: leaving the block would step the optimizer.
    model, opt, sc = _trained(lib, backward=True)
    acc = fastamp.GradientAccumulator(opt, 1, scaler=sc)
    _, micro = next(acc.iterate([0]))

    def misuse():
        with micro:
            pass

    return _world(model, opt, sc, acc=acc), misuse


@case(
    "accumulator_backward_of_float",
    TypeError,
    r"micro\.backward\(loss\) takes the loss tensor",
    r"was \.item\(\) called",
)
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    acc = fastamp.GradientAccumulator(opt, 2, scaler=sc)
    _, micro = next(acc.iterate([0, 1]))
    loss = _loss(model)

    def misuse():
        with micro:
            micro.backward(loss.item())

    return _world(model, opt, sc, acc=acc), misuse


@case("memory_track_cuda_without_gpu", RuntimeError, r"device='cuda'", r"expected device='cpu'")
def _(lib):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the misuse needs a machine without it")
    return {}, lambda: _enter(fastamp.memory.track("cuda"))


@case("memory_track_meta", ValueError, r"device='meta'", r"expected 'cpu' or a CUDA device")
def _(lib):
    return {}, lambda: _enter(fastamp.memory.track("meta"))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    check_misuse(c)
