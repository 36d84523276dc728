"""Written tensor lists must not share memory between entries (or, for the optimizer ops, across
the lists they write): each shared element would be updated twice. Found by the bad-input
catalogue review: ``non_finite_check_and_unscale_([a, a], ...)`` used to unscale ``a`` twice."""

from __future__ import annotations

import pytest
import torch

import fastamp  # noqa: F401  (registers the ops)
from fastamp.testing import op_args

ops = torch.ops.fastamp


def _adam(params, grads, exp_avgs, exp_avg_sqs, steps):
    ops.adam_step_(*op_args("adam_step_", params=params, grads=grads, exp_avgs=exp_avgs,
                            exp_avg_sqs=exp_avg_sqs, state_steps=steps, lr=1e-3,
                            decoupled_weight_decay=False))  # fmt: skip


def test_adam_refuses_a_param_passed_as_its_own_state():
    p, g, v = torch.randn(6), torch.randn(6), torch.rand(6)
    st = torch.zeros(1)
    before = (p.clone(), v.clone(), st.clone())
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] and params\[0\] share memory"):
        _adam([p], [g], [p], [v], [st])
    with pytest.raises(RuntimeError, match=r"params\[1\] and params\[0\] share memory"):
        _adam([p, p], [g, g], [torch.zeros(6), torch.zeros(6)], [v, v.clone()], [st, st.clone()])
    with pytest.raises(RuntimeError, match=r"state_steps\[1\] and state_steps\[0\] share memory"):
        _adam(
            [p, torch.randn(6)],
            [g, g],
            [torch.zeros(6), torch.zeros(6)],
            [torch.zeros(6), torch.zeros(6)],
            [st, st],
        )
    assert all(torch.equal(a, b) for a, b in zip((p, v, st), before))
