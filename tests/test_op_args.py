"""The keyword helper for raw op calls (fastamp.testing.op_args): the tuple it builds is the one a
test would write by hand, and a wrong or missing keyword is a TypeError that names it."""

import pytest
import torch

from fastamp.testing import op_args


def test_adam_tuple_is_the_hand_written_one():
    p, g, m, v, step = (
        [torch.zeros(3)],
        [torch.ones(3)],
        [torch.zeros(3)],
        [torch.zeros(3)],
        [torch.tensor(0.0)],
    )
    built = op_args("adam_step_", params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, state_steps=step)
    by_hand = (
        p,
        g,
        m,
        v,
        [],
        step,
        [],
        0.1,
        None,
        0.9,
        0.999,
        0.0,
        1e-8,
        False,
        True,
        False,
        None,
        None,
        None,
    )
    assert built == by_hand
    varied = op_args("adam_step_", params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, state_steps=step,
                     lr=0.01, amsgrad=True)  # fmt: skip
    assert varied[7:14] == (0.01, None, 0.9, 0.999, 0.0, 1e-8, True)


def test_sgd_tuple_is_the_hand_written_one():
    p, g, buf, step = [torch.zeros(3)], [torch.ones(3)], [torch.zeros(3)], [torch.tensor(0.0)]
    inv = torch.tensor(0.5)
    built = op_args("sgd_step_", params=p, grads=g, momentum_buffers=buf, state_steps=step,
                    nesterov=True, inv_scale=inv)  # fmt: skip
    by_hand = (p, g, buf, step, [], 0.1, None, 0.0, 0.9, 0.0, True, False, inv, None, None)
    assert built == by_hand


def test_default_lists_are_fresh():
    a = op_args("sgd_step_", params=[], grads=[], momentum_buffers=[], state_steps=[])
    b = op_args("sgd_step_", params=[], grads=[], momentum_buffers=[], state_steps=[])
    assert a[4] == [] and a[4] is not b[4]


def test_a_wrong_keyword_is_named():
    with pytest.raises(TypeError, match="no argument betas"):
        op_args("adam_step_", params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], state_steps=[],
                betas=(0.9, 0.99))  # fmt: skip


def test_a_missing_argument_is_named():
    with pytest.raises(TypeError, match="needs its argument exp_avg_sqs"):
        op_args("adam_step_", params=[], grads=[], exp_avgs=[], state_steps=[])


def test_the_tuple_runs_the_op():
    p, g = torch.ones(4), torch.full((4,), 0.5)
    buf, step = torch.zeros(4), torch.tensor(0.0)
    args = op_args("sgd_step_", params=[p], grads=[g], momentum_buffers=[buf], state_steps=[step])
    torch.ops.fastamp.sgd_step_(*args)
    assert torch.allclose(p, torch.full((4,), 1 - 0.1 * 0.5))
