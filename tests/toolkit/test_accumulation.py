"""GradientAccumulator: equal to one big batch, one optimizer step and scale update per group."""

import copy

import pytest
import torch
from torch import nn

import fastamp
from fastamp import GradientAccumulator, scale_lr


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("accum", [1, 2, 3, 7])
@pytest.mark.parametrize("unknown_length", [False, True])
def test_equals_one_big_batch_with_a_remainder(accum, unknown_length):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    data = _data(10)  # 10 micro-batches: groups of `accum` and a remainder
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for start in range(0, len(data), accum):
        group = data[start : start + accum]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = GradientAccumulator(opt, accum)
    source = iter(data) if unknown_length else data
    stepped = []
    for (x, y), micro in acc.iterate(source):
        with micro:
            micro.backward(nn.functional.mse_loss(model(x), y))
        stepped.append(micro.stepped)
    assert acc.optimizer_steps == -(-10 // accum)
    assert stepped[-1] and sum(stepped) == acc.optimizer_steps
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_scale_update_per_optimizer_step_and_clipping():
    model = nn.Linear(6, 2)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    acc = GradientAccumulator(opt, 3, scaler=scaler, max_grad_norm=0.5)
    for (x, y), micro in acc.iterate(_data(6)):
        with micro:
            micro.backward(nn.functional.mse_loss(model(x), y))
    assert acc.optimizer_steps == 2
    assert scaler.get_scale() == 32.0  # grew once per optimizer step, not per micro-batch
    assert float(acc.last_grad_norm) > 0


def test_errors():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="accum_steps must be an int >= 1"):
        GradientAccumulator(opt, 0)
    acc = GradientAccumulator(opt, 2)
    with pytest.raises(RuntimeError, match="call micro.backward"):
        for _, micro in acc.iterate([1, 2]):
            with micro:
                pass


def test_scale_lr():
    assert scale_lr(0.1, 256, 1024) == pytest.approx(0.4)
    assert scale_lr(1e-3, 64, 256, rule="sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="rule must be"):
        scale_lr(0.1, 1, 2, rule="cubic")
    with pytest.raises(ValueError, match="effective_batch must be an int >= 1"):
        scale_lr(0.1, 1, 0)
