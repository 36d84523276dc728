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
from fastamp.testing import assert_bitwise_equal, op_args

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
            opt._stepper.replay = None  # every step a full one, through the list-taking op
        used += opt._stepper.replay is not None
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
        ops.sgd_step_held_(*op_args("sgd_step_held_", held=held.handle, grads=[torch.ones(5)] * 3,
                                    momentum=0.0))  # fmt: skip
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


def _shared_with_p0(p, m, v):
    p[1].data = p[0].data  # two written params on one storage


def _state_shares_a_param(p, m, v):
    m[2].set_(p[2].untyped_storage(), 0, (5,), (1,))  # exp_avgs[2] is params[2]'s memory


def _zero_stride_in_place(p, m, v):
    v[0].as_strided_((5,), (0,))  # same data pointer, every element one


def _shrunk_in_place(p, m, v):
    p[1].resize_(4)  # same data pointer, another shape


@pytest.mark.parametrize(
    "change, error",
    [
        (_shared_with_p0, "share memory"),
        (_state_shares_a_param, "share memory"),
        (_zero_stride_in_place, r"exp_avg_sqs\[0\] must have the shape \[5\] and strides \[1\]"),
        (_shrunk_in_place, r"exp_avgs\[1\] must have the shape \[4\]"),
    ],
)
def test_held_call_sees_a_change_made_after_it_checked_the_tensors(change, error):
    """The held op caches what it read of each held tensor and skips the memory-sharing check
    while nothing changed: a change made after checked calls (new storage, memory shared across
    written lists, strides or a shape changed in place with the same data pointer) is seen and
    refused with nothing written, as the list-taking op refuses it."""
    p, m, v, s, held = _adam_hold()
    grads = [torch.ones(5) for _ in range(3)]
    for _ in range(2):  # checked twice: the second call is the cached one
        ops.adam_step_held_(held.handle, grads, *_adam_args())
    change(p, m, v)
    saved = [t.clone() for t in p + m + v + s]
    gs = [torch.ones(t.shape) for t in p]
    with pytest.raises(RuntimeError, match=error):
        ops.adam_step_held_(held.handle, gs, *_adam_args())
    for a, b in zip(p + m + v + s, saved):
        assert_bitwise_equal(a.contiguous(), b)  # (a zero-stride view compared by its values)
    # The list-taking op refuses the same lists with the same words.
    with pytest.raises(RuntimeError, match=error):
        ops.adam_step_(p, gs, m, v, [], s, [], *_adam_args())


def test_held_call_after_a_refusal_and_a_repair_steps_as_the_list_op():
    p, m, v, s, held = _adam_hold()
    grads = [torch.ones(5) for _ in range(3)]
    ops.adam_step_held_(held.handle, grads, *_adam_args())
    saved = p[1].data
    p[1].data = p[0].data
    with pytest.raises(RuntimeError, match="share memory"):
        ops.adam_step_held_(held.handle, grads, *_adam_args())
    p[1].data = saved
    copies = [[t.clone() for t in ts] for ts in (p, m, v, s)]
    ops.adam_step_held_(held.handle, grads, *_adam_args())
    ops.adam_step_(copies[0], grads, copies[1], copies[2], [], copies[3], [], *_adam_args())
    for a, b in zip(p + m + v + s, [t for ts in copies for t in ts]):
        assert_bitwise_equal(a, b)


def test_held_call_sees_a_consistent_in_place_resize():
    """A param and its state shrunk in place together (same data pointers, the storage keeps its
    old bytes beyond the new end) are stepped over their new size only, as the list-taking op
    steps them: the cached element counts are not reused."""
    p, m, v, s, held = _adam_hold()
    grads = [torch.ones(5) for _ in range(3)]
    for _ in range(2):
        ops.adam_step_held_(held.handle, grads, *_adam_args())
    copies = [[t.clone() for t in ts] for ts in (p, m, v, s)]
    for ts in (p, m, v, copies[0], copies[1], copies[2]):
        ts[1].resize_(3)
    gs = [torch.ones(t.shape) for t in p]
    ops.adam_step_held_(held.handle, gs, *_adam_args())
    ops.adam_step_(copies[0], gs, copies[1], copies[2], [], copies[3], [], *_adam_args())
    for a, b in zip(p + m + v + s, [t for ts in copies for t in ts]):
        assert_bitwise_equal(a, b)
        # the bytes past the new end are untouched in both
        assert bytes(a.untyped_storage()) == bytes(b.untyped_storage())


def test_held_moved_names_the_first_tensor_whose_address_changed():
    """``fastamp::held_moved``: -1 while every held tensor has the data pointer it had when held;
    else the first one's position over the lists (what flat buffers check every step)."""
    a = [torch.zeros(4) for _ in range(3)]
    b = [torch.zeros(2) for _ in range(2)]
    held = _ops.HeldTensors((a, b))
    assert held.moved() == -1
    a[2].add_(1.0)  # in place: same address
    b[0].resize_(2)
    assert held.moved() == -1
    b[1].data = torch.ones(2)  # position 3 + 1
    assert held.moved() == 4
    a[1].set_(torch.empty(4))  # position 1, now the first
    assert held.moved() == 1
    handle = held.handle
    held.release()
    with pytest.raises(ValueError, match="holds no tensors"):
        _ops._raw.held_moved(handle)  # (the raw op, with no tensor argument, raises RuntimeError)
