"""float16 params stepped without master weights: one UserWarning per optimizer naming the fix.

torch's fused AdamW steps float16 params in place without a word, and an update smaller than half
a float16 step at the weight is rounded away; fastamp says so once, on the first step that meets
a float16 param, and not with master_weights=True, bfloat16 or float32 params."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fastamp

OPTIMIZERS = {
    "AdamW": lambda ps, **kw: fastamp.optim.AdamW(ps, lr=1e-5, **kw),
    "Adam": lambda ps, **kw: fastamp.optim.Adam(ps, lr=1e-5, **kw),
    "SGD": lambda ps, **kw: fastamp.optim.SGD(ps, lr=1e-5, momentum=0.9, **kw),
}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(n):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
            opt.zero_grad()
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            opt.step()
    return [w for w in caught if "master_weights=True" in str(w.message)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_float16_params_without_master_weights_warn_once_per_optimizer(name):
    model = _model(torch.float16)
    found = _steps(model, OPTIMIZERS[name](model.parameters()), 4)
    assert len(found) == 1, [str(w.message) for w in found]
    assert found[0].category is UserWarning
    assert found[0].filename == __file__  # points at the caller's opt.step(), not into fastamp
    msg = str(found[0].message)
    assert f"fastamp.optim.{name}: param_groups[0]['params'][0] is float16" in msg, msg
    # once per optimizer, not once per process: a second optimizer warns again
    assert len(_steps(model, OPTIMIZERS[name](model.parameters()), 2)) == 1


@pytest.mark.parametrize(
    "dtype, master",
    [
        (torch.float16, True),
        (torch.bfloat16, False),
        (torch.bfloat16, True),
        (torch.float32, False),
    ],
)
def test_no_warning_with_master_weights_or_other_dtypes(dtype, master):
    model = _model(dtype)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-5, master_weights=master)
    assert _steps(model, opt, 3) == []


def test_the_warning_says_what_happens():
    """What the warning claims: a float16 weight of 1.0 does not move under updates below half
    its float16 step (4.9e-4), while its master weight carries them until it does."""
    finals = {}
    for master in (False, True):
        p = nn.Parameter(torch.ones(64, dtype=torch.float16))
        opt = fastamp.optim.SGD([p], lr=1e-4, master_weights=master)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(10):
                p.grad = torch.ones_like(p)
                opt.step()
        finals[master] = p.detach().clone()
    assert bool((finals[False] == 1).all())  # ten updates of 1e-4, each rounded away
    torch.testing.assert_close(finals[True].float(), torch.full((64,), 1 - 1e-3), atol=5e-4, rtol=0)
