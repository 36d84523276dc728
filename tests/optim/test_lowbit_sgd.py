"""bfloat16 momentum for fastamp.optim.SGD (``state_dtype=torch.bfloat16``,
fastamp::sgd_lowbit_step_): the kernel against the float32 SGD kernel plus the stochastic rounding
(bit for bit), training against torch.optim.SGD, state_dict round trips and conversions, the fused
skip, opcheck, and bad input refused with nothing changed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import assert_bitwise_equal, lowbit_ref, op_args

ops = torch.ops.fastamp  # the ops themselves: their schemas are the interface under test

LR, WD, MOMENTUM, DAMPENING = 0.05, 0.01, 0.9, 0.1


def _inputs(n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    g = (torch.randn(n, generator=gen) * 1e-2).to(dtype)
    buf = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    return p, g, buf


@pytest.mark.parametrize("lr_t", [None, 0.02], ids=["lr", "lr_tensor"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
@pytest.mark.parametrize("first", [True, False], ids=["first-update", "later"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_is_the_float32_step_plus_stochastic_rounding_bit_for_bit(
    dtype, first, nesterov, lr_t
):
    n = 65_536 + 4_097  # two chunks, the second partial
    lr_t = None if lr_t is None else torch.tensor(lr_t)  # a tensor lr overrides the float one
    p, g, buf = _inputs(n, dtype, seed=n + int(first))
    g[11], g[12] = math.nan, math.inf  # stepped in (no found_inf): the buffer's NaN rule
    master = p.float() if dtype != torch.float32 else None
    inv, coef = torch.tensor(0.5), torch.tensor(0.75)
    count = torch.tensor(0.0 if first else 4.0)
    # Reference: the float32 SGD kernel on a float32 copy of the buffer, then the rounding.
    p32, buf32, mp32, count32 = (
        p.clone(),
        buf.float(),
        None if master is None else master.clone(),
        count.clone(),
    )
    ops.sgd_step_(*op_args("sgd_step_", params=[p32], grads=[g], momentum_buffers=[buf32],
                           state_steps=[count32], master_params=[mp32] if mp32 is not None else [],
                           lr=LR, lr_tensor=lr_t, weight_decay=WD, momentum=MOMENTUM,
                           dampening=DAMPENING, nesterov=nesterov, inv_scale=inv,
                           clip_coef=coef))  # fmt: skip
    ops.sgd_lowbit_step_(*op_args("sgd_lowbit_step_", params=[p], grads=[g], momentum_buffers=[buf],
                                  state_steps=[count],
                                  master_params=[master] if master is not None else [], seed=7,
                                  lr=LR, lr_tensor=lr_t, weight_decay=WD, momentum=MOMENTUM,
                                  dampening=DAMPENING, nesterov=nesterov, inv_scale=inv,
                                  clip_coef=coef))  # fmt: skip
    assert_bitwise_equal(p, p32, "params")
    if master is not None:
        assert_bitwise_equal(master, mp32, "master")
    r = lowbit_ref.sr_bits(lowbit_ref.sr_key(7, 1 if first else 5, 0), torch.arange(n))
    assert_bitwise_equal(buf, lowbit_ref.bf16_stochastic(buf32, r), "momentum_buffer")
    assert float(count) == float(count32) == (1.0 if first else 5.0)


def test_found_inf_step_writes_nothing():
    p, g, buf = _inputs(5000, torch.float32, seed=1)
    g[3] = math.inf
    count = torch.tensor(2.0)
    before = (p.clone(), buf.clone(), count.clone())
    ops.sgd_lowbit_step_(*op_args("sgd_lowbit_step_", params=[p], grads=[g], momentum_buffers=[buf],
                                  state_steps=[count], lr=LR, weight_decay=WD, momentum=MOMENTUM,
                                  inv_scale=torch.tensor(1.0),
                                  found_inf=torch.tensor(1.0)))  # fmt: skip
    assert_bitwise_equal((p, buf, count), before)


def test_opcheck():
    p, g, buf = _inputs(4096, torch.float32, seed=2)
    args = op_args("sgd_lowbit_step_", params=[p], grads=[g], momentum_buffers=[buf],
                   state_steps=[torch.tensor(1.0)], seed=5, lr=LR, weight_decay=WD,
                   momentum=MOMENTUM, inv_scale=torch.tensor(0.5),
                   found_inf=torch.tensor(0.0))  # fmt: skip
    torch.library.opcheck(torch.ops.fastamp.sgd_lowbit_step_.default, args)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # 8192 and 1280 weights


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def test_training_tracks_torch_sgd_and_halves_the_buffer():
    m_ref, m_low = _model(), _model()
    kw = dict(lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True)
    ref = torch.optim.SGD(m_ref.parameters(), **kw)
    low = fastamp.optim.SGD(m_low.parameters(), **kw, state_dtype=torch.bfloat16, state_seed=3)
    a, b = _train(m_ref, ref, 150), _train(m_low, low, 150)
    assert abs(b - a) <= 0.02 * a, (a, b)
    w_big = m_low[0].weight
    assert low.state[w_big]["momentum_buffer"].dtype == torch.bfloat16
    assert low.state[m_low[2].weight]["momentum_buffer"].dtype == torch.float32  # 1280 < 4096
    per = fastamp.memory.optimizer_state_bytes(low)
    # 8192 bfloat16 with its update count (float32, it keys the rounding) + (1280 + 128 + 10)
    # float32 buffers, whose counts stay outside the state as in PyTorch's SGD.
    assert per["state_bytes"] == 8192 * 2 + 4 + (1280 + 128 + 10) * 4
    assert "step" in low.state[w_big] and "step" not in low.state[m_low[2].weight]


def test_state_dict_resumes_bit_for_bit_and_converts_both_ways():
    model = _model()
    opt = fastamp.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, state_dtype=torch.bfloat16
    )
    _train(model, opt, 4)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["param_groups"][0]["state_dtype"] == "bfloat16"
    m2 = copy.deepcopy(model)
    opt2 = fastamp.optim.SGD(m2.parameters(), lr=LR, momentum=MOMENTUM, state_dtype=torch.bfloat16)
    opt2.load_state_dict(sd)
    _train(model, opt, 3, seed=9)
    _train(m2, opt2, 3, seed=9)
    assert_bitwise_equal(list(model.parameters()), list(m2.parameters()), "resumed params")
    # Into torch.optim.SGD (its load casts the bfloat16 buffer to the param's float32, exactly)
    # and back out of a float32 state_dict into a bfloat16 optimizer.
    m3 = copy.deepcopy(model)
    plain = torch.optim.SGD(m3.parameters(), lr=LR, momentum=MOMENTUM)
    plain.load_state_dict(opt.state_dict())
    big = list(m3.parameters())[0]
    assert plain.state[big]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(
        plain.state[big]["momentum_buffer"],
        opt.state[list(model.parameters())[0]]["momentum_buffer"].float(),
    )
    m4 = copy.deepcopy(model)
    back = fastamp.optim.SGD(m4.parameters(), lr=LR, momentum=MOMENTUM, state_dtype=torch.bfloat16)
    back.load_state_dict(plain.state_dict())
    buf = back.state[list(m4.parameters())[0]]["momentum_buffer"]
    assert buf.dtype == torch.bfloat16 and back.param_groups[0]["state_dtype"] == "bfloat16"
    _train(m4, back, 1)  # steps on the converted state


def test_bad_arguments_are_refused_before_anything_changes():
    p = nn.Parameter(torch.randn(8192))
    with pytest.raises(ValueError, match=r"state_dtype='int8' is for Adam/AdamW"):
        fastamp.optim.SGD([p], lr=0.1, momentum=0.9, state_dtype="int8")
    with pytest.raises(ValueError, match=r"state_seed must be an int in \[0, 2\*\*32\)"):
        fastamp.optim.SGD([p], lr=0.1, momentum=0.9, state_dtype=torch.bfloat16, state_seed=2**32)
    q, g, buf = _inputs(5000, torch.float32, seed=4)
    before = (q.clone(), buf.clone())
    with pytest.raises(
        RuntimeError, match=r"momentum_buffers\[0\] must be a contiguous BFloat16 tensor"
    ):
        ops.sgd_lowbit_step_(*op_args(
            "sgd_lowbit_step_", params=[q], grads=[g], momentum_buffers=[buf.float()],
            state_steps=[torch.tensor(0.0)], lr=LR, momentum=MOMENTUM))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"momentum is 0"):
        ops.sgd_lowbit_step_(*op_args(
            "sgd_lowbit_step_", params=[q], grads=[g], momentum_buffers=[buf],
            state_steps=[torch.tensor(0.0)], lr=LR, momentum=0.0))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"params\[0\] and grads\[0\] must be contiguous"):
        wide = torch.randn(100, 50).t()
        ops.sgd_lowbit_step_(*op_args(
            "sgd_lowbit_step_", params=[wide], grads=[wide.clone()],
            momentum_buffers=[torch.zeros(50, 100, dtype=torch.bfloat16).t()],
            state_steps=[torch.tensor(0.0)], lr=LR, momentum=MOMENTUM))  # fmt: skip
    assert_bitwise_equal((q, buf), before)
    # Momentum-free SGD keeps no state in any format, as torch.optim.SGD.
    plain = fastamp.optim.SGD([p], lr=0.1, state_dtype=torch.bfloat16)
    p.grad = torch.ones_like(p)
    plain.step()
    assert not plain.state.get(p)
