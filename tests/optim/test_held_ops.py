"""The held step ops (``fastamp::hold_tensors`` + ``*_held_``, csrc/common/held_tensors.h): a step
through held lists is the list-taking op's step bit for bit, for every op and state format; a
held param is the caller's own tensor; bad handles and lengths are refused by name, and a
refused held call writes nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastamp
from fastamp.optim import _ops
from fastamp.testing import assert_bitwise_equal

ops = torch.ops.fastamp

CASES = {
    "adamw": (fastamp.optim.AdamW, {"lr": 1e-2}),
    "adam_amsgrad": (fastamp.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}),
    "adamw_bf16_state": (fastamp.optim.AdamW, {"lr": 1e-2, "state_dtype": torch.bfloat16}),
    "adamw_int8_state": (fastamp.optim.AdamW, {"lr": 1e-2, "state_dtype": "int8"}),
    "sgd_momentum": (fastamp.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "sgd_bf16_state": (
        fastamp.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "state_dtype": torch.bfloat16},
    ),
    "sgd_plain": (fastamp.optim.SGD, {"lr": 1e-2, "weight_decay": 0.01}),
}


def _model(half: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 260), nn.LayerNorm(260), nn.Linear(260, 7))
    return m.to(torch.bfloat16) if half else m


def _run(case: str, planned: bool, master: bool, steps: int = 5):
    cls, options = CASES[case]
    model = _model(half=master)
    opt = cls(model.parameters(), **options, **({"master_weights": True} if master else {}))
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.scale(torch.ones(()))  # the scale's lazy init
    gen = torch.Generator().manual_seed(1)
    used = 0
    for k in range(steps):
        if not planned:
            opt._plan = None  # every step a full one, through the list-taking op
        used += opt._plan is not None
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen) * 2.0**10
            if k == 2:
                g.view(-1)[0] = float("inf")  # one skipped step
            p.grad = g.to(p.dtype)
        scaler.clip_grad_norm_(opt, 5.0)
        scaler.step(opt)
        scaler.update()
    return model, opt, used


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("case", list(CASES))
def test_held_step_is_the_list_step_bit_for_bit(case, master):
    if master and case == "sgd_plain":
        pytest.skip("covered by sgd_momentum")
    m_list, o_list, used_list = _run(case, planned=False, master=master)
    m_held, o_held, used_held = _run(case, planned=True, master=master)
    assert used_list == 0 and used_held >= 3, (used_list, used_held)
    for a, b in zip(m_list.parameters(), m_held.parameters()):
        assert_bitwise_equal(b, a)
    for a, b in zip(m_list.parameters(), m_held.parameters()):
        sa, sb = o_list.state.get(a, {}), o_held.state.get(b, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert_bitwise_equal(sb[key], sa[key])


def _adam_hold(n: int = 3):
    torch.manual_seed(2)
    p = [torch.randn(5) for _ in range(n)]
    m = [torch.zeros(5) for _ in range(n)]
    v = [torch.zeros(5) for _ in range(n)]
    s = [torch.zeros(()) for _ in range(n)]
    return p, m, v, s, _ops.HeldTensors((p, m, v, [], s, []))


def _adam_args():
    return (1e-2, None, 0.9, 0.999, 0.0, 1e-8, False, True, False, None, None, None)


def test_held_param_is_the_callers_tensor():
    p, _, _, _, held = _adam_hold()
    before = p[1].clone()
    p[1].data = torch.full((5,), 3.0)  # p[1] now has new storage: the held op steps it
    ops.adam_step_held_(held.handle, [torch.ones(5)] * 3, *_adam_args())
    assert torch.all(p[1] < 3.0) and not torch.equal(p[1], before)


def test_held_call_refuses_a_mismatched_state_and_writes_nothing():
    p, m, _, s, held = _adam_hold()
    p[2].data = torch.zeros(6)  # no longer the shape of its moments
    saved = [t.clone() for t in p + m + s]
    with pytest.raises(RuntimeError, match=r"exp_avgs\[2\] must have the shape \[6\]"):
        ops.adam_step_held_(held.handle, [torch.ones(5), torch.ones(5), torch.ones(6)],
                            *_adam_args())  # fmt: skip
    for a, b in zip(p + m + s, saved):
        assert_bitwise_equal(a, b)


def test_bad_handles_and_lengths_are_refused_by_name():
    p, _, _, _, held = _adam_hold()
    with pytest.raises(ValueError, match=r"adam_step_held_: held is \d+, which holds no"):
        ops.adam_step_held_(held.handle + 10**6, [torch.ones(5)] * 3, *_adam_args())
    with pytest.raises(ValueError, match=r"sgd_step_held_: held \d+ holds 6 tensor lists; exp"):
        ops.sgd_step_held_(held.handle, [torch.ones(5)] * 3, 0.1, None, 0.0, 0.0, 0.0, False,
                           False, None, None, None)  # fmt: skip
    with pytest.raises(ValueError, match="lengths add up to 4 but 3 tensors were given"):
        ops.hold_tensors(p, [2, 2])
    with pytest.raises(ValueError, match=r"lengths\[0\] is -1"):
        ops.hold_tensors(p, [-1, 4])
    handle = held.handle
    held.release()
    with pytest.raises(RuntimeError, match="no tensors are held under handle"):
        ops.release_tensors(
            handle
        )  # no tensor argument: the marked RuntimeError (see reliability.md)
    with pytest.raises(ValueError, match="which holds no tensors"):
        ops.adam_step_held_(handle, [torch.ones(5)] * 3, *_adam_args())


def test_held_tensors_are_released_with_their_holder():
    _, _, _, _, held = _adam_hold()
    handle = held.handle
    del held
    with pytest.raises(RuntimeError, match="no tensors are held under handle"):
        ops.release_tensors(handle)
