"""float64 params: torch's optimizers step them; fastamp's refuse them, before anything changes,
with a TypeError that names the param and says to use torch.optim for them (the decision and its
reason: README, "float64 params"). Differential: the same model and step, torch's and fastamp's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastamp


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_torch_steps_float64_params_and_fastamp_refuses_them_unchanged(name):
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = nn.Linear(4, 3).double()
        m(torch.randn(2, 4, dtype=torch.float64)).square().sum().backward()
        models.append(m)
    ref = getattr(torch.optim, name)(models[0].parameters(), lr=1e-2)
    ours = getattr(fastamp.optim, name)(models[1].parameters(), lr=1e-2)
    before = [p.detach().clone() for p in models[1].parameters()]
    ref.step()  # torch: stepped
    assert any(not torch.equal(a, b) for a, b in zip(models[0].parameters(), before))
    with pytest.raises(TypeError, match=r"has dtype torch\.float64.*use torch\.optim"):
        ours.step()
    for a, b in zip(models[1].parameters(), before):
        assert torch.equal(a, b)
    assert not ours.state
