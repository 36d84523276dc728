"""The fused optimizer ops against float64 references, every accepted dtype combination."""

import math

import pytest
import torch

from fastamp.testing import adam_ref, make_grads, op_args, sgd_ref

SHAPES = [(300,), (65536 + 5,), (17, 13), (1,)]
TOL = {torch.float32: (2e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (2e-3, 1e-4)}


def _tensors(device, dtype, seed, scale=1.0):
    return make_grads(SHAPES, dtype, device, seed=seed, scale=scale)


def _close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected.to(dtype).double(), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("amsgrad,decoupled,maximize", [(False, True, False), (True, False, True)])
def test_adam_step_matches_float64(device, dtype, master, amsgrad, decoupled, maximize):
    if master and dtype == torch.float32:
        pytest.skip("master weights are for half params")
    params = _tensors(device, dtype, 1)
    grads = _tensors(device, dtype, 2, scale=256.0)  # loss-scaled by 256
    sdt = torch.float32 if master else dtype
    m = [t.to(sdt) * 0.1 for t in _tensors(device, dtype, 3)]
    v = [t.to(sdt).square() * 0.01 for t in _tensors(device, dtype, 4)]
    vmax = [x * 1.5 for x in v] if amsgrad else []
    masters = [p.float() + 1e-3 for p in params] if master else []
    steps = [torch.tensor(float(i + 2), device=device) for i in range(len(SHAPES))]
    hp = dict(
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.05,
        amsgrad=amsgrad,
        decoupled=decoupled,
        maximize=maximize,
    )
    inv, coef = 1.0 / 256.0, 0.75
    expected = [
        adam_ref(
            masters[i] if master else params[i],
            grads[i],
            m[i],
            v[i],
            vmax[i] if amsgrad else None,
            float(steps[i]) + 1,
            inv_scale=inv,
            clip_coef=coef,
            **hp,
        )
        for i in range(len(SHAPES))
    ]
    torch.ops.fastamp.adam_step_(*op_args(
        "adam_step_", params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=vmax,
        state_steps=steps, master_params=masters, lr=hp["lr"], weight_decay=0.05, amsgrad=amsgrad,
        decoupled_weight_decay=decoupled, maximize=maximize,
        inv_scale=torch.tensor(inv, device=device), found_inf=torch.zeros((), device=device),
        clip_coef=torch.tensor(coef, device=device)))  # fmt: skip
    for i, (ep, em, ev, evm) in enumerate(expected):
        _close(masters[i] if master else params[i], ep, torch.float32 if master else dtype)
        if master:
            _close(params[i], ep, dtype)
        _close(m[i], em, sdt)
        _close(v[i], ev, sdt)
        if amsgrad:
            _close(vmax[i], evm, sdt)
        assert float(steps[i]) == i + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize(
    "momentum,dampening,nesterov,first",
    [
        (0.0, 0.0, False, True),
        (0.9, 0.1, False, False),
        (0.9, 0.0, True, True),
        (0.9, 0.3, False, True),
    ],
)
def test_sgd_step_matches_float64(device, dtype, master, momentum, dampening, nesterov, first):
    if master and dtype == torch.float32:
        pytest.skip("master weights are for half params")
    params = _tensors(device, dtype, 5)
    grads = _tensors(device, dtype, 6, scale=64.0)
    sdt = torch.float32 if master else dtype
    bufs = [t.to(sdt) for t in _tensors(device, dtype, 7)] if momentum else []
    masters = [p.float() for p in params] if master else []
    counts = [torch.tensor(0.0 if first else 4.0, device=device) for _ in SHAPES]
    hp = dict(
        lr=0.05,
        momentum=momentum,
        dampening=dampening,
        weight_decay=0.01,
        nesterov=nesterov,
        maximize=False,
    )
    expected = [
        sgd_ref(
            params[i],
            grads[i],
            bufs[i] if momentum else None,
            first,
            inv_scale=1 / 64,
            clip_coef=0.5,
            **hp,
        )
        for i in range(len(SHAPES))
    ]
    torch.ops.fastamp.sgd_step_(*op_args(
        "sgd_step_", params=params, grads=grads, momentum_buffers=bufs, state_steps=counts,
        master_params=masters, lr=0.05, weight_decay=0.01, momentum=momentum, dampening=dampening,
        nesterov=nesterov, inv_scale=torch.tensor(1 / 64, device=device),
        clip_coef=torch.tensor(0.5, device=device)))  # fmt: skip
    for i, (ep, eb) in enumerate(expected):
        _close(params[i], ep, dtype)
        if momentum:
            _close(bufs[i], eb, sdt)
        assert float(counts[i]) == (1.0 if first else 5.0)


@pytest.mark.parametrize("which", ["adam", "sgd"])
def test_found_inf_writes_nothing(device, which):
    params = _tensors(device, torch.float32, 8)
    grads = _tensors(device, torch.float32, 9)
    grads[1][3] = math.nan
    state = [t.clone() for t in _tensors(device, torch.float32, 10)]
    state2 = [t.abs() for t in _tensors(device, torch.float32, 11)]
    steps = [torch.tensor(3.0, device=device) for _ in SHAPES]
    before = [t.clone() for t in params + state + state2 + steps]
    found = torch.ones((), device=device)
    lr_t = torch.tensor(0.1, device=device)
    if which == "adam":
        torch.ops.fastamp.adam_step_(*op_args(
            "adam_step_", params=params, grads=grads, exp_avgs=state, exp_avg_sqs=state2,
            state_steps=steps, lr_tensor=lr_t, beta2=0.99, found_inf=found))  # fmt: skip
    else:
        torch.ops.fastamp.sgd_step_(*op_args(
            "sgd_step_", params=params, grads=grads, momentum_buffers=state, state_steps=steps,
            lr_tensor=lr_t, found_inf=found))  # fmt: skip
    for a, b in zip(params + state + state2 + steps, before):
        assert torch.equal(a, b)


def test_lr_tensor_overrides_float_lr(device):
    p1, p2 = _tensors(device, torch.float32, 12), _tensors(device, torch.float32, 12)
    g = _tensors(device, torch.float32, 13)
    for p, lr, lr_t in ((p1, 0.3, None), (p2, 99.0, torch.tensor(0.3, device=device))):
        torch.ops.fastamp.sgd_step_(*op_args(
            "sgd_step_", params=p, grads=g, momentum_buffers=[],
            state_steps=[torch.tensor(0.0, device=device) for _ in SHAPES], lr=lr, lr_tensor=lr_t,
            momentum=0.0))  # fmt: skip
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)


def test_bad_input_raises_before_writing(device):
    params = _tensors(device, torch.float32, 14)
    grads = _tensors(device, torch.float32, 15)
    snap = [p.clone() for p in params]
    steps = [torch.tensor(0.0, device=device) for _ in SHAPES]
    bufs = [torch.zeros_like(p) for p in params]
    with pytest.raises(RuntimeError, match=r"grads\[2\] has shape"):
        torch.ops.fastamp.sgd_step_(*op_args(
            "sgd_step_", params=params, grads=grads[:2] + [grads[0]] + grads[3:],
            momentum_buffers=bufs, state_steps=steps))  # fmt: skip
    with pytest.raises(RuntimeError, match="momentum_buffers has 3 tensors"):
        torch.ops.fastamp.sgd_step_(*op_args(
            "sgd_step_", params=params, grads=grads, momentum_buffers=bufs[:3],
            state_steps=steps))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"exp_avgs\[1\] has dtype Half"):
        torch.ops.fastamp.adam_step_(*op_args(
            "adam_step_", params=params, grads=grads,
            exp_avgs=[b.half() if i == 1 else b for i, b in enumerate(bufs)], exp_avg_sqs=bufs,
            state_steps=steps, beta2=0.99))  # fmt: skip
    with pytest.raises(RuntimeError, match="found_inf has dtype Double"):
        torch.ops.fastamp.sgd_step_(*op_args(
            "sgd_step_", params=params, grads=grads, momentum_buffers=bufs, state_steps=steps,
            found_inf=torch.zeros((), dtype=torch.float64, device=device)))  # fmt: skip
    for p, s in zip(params, snap):
        assert torch.equal(p, s)
    assert all(float(s) == 0.0 for s in steps)


def test_opcheck(device):
    params = _tensors(device, torch.bfloat16, 16)
    grads = _tensors(device, torch.bfloat16, 17)
    masters = [p.float() for p in params]
    m = [torch.zeros_like(x) for x in masters]
    v = [torch.zeros_like(x) for x in masters]
    steps = [torch.tensor(0.0, device=device) for _ in SHAPES]
    torch.library.opcheck(torch.ops.fastamp.adam_step_.default, op_args(
        "adam_step_", params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, state_steps=steps,
        master_params=masters, lr=1e-3, weight_decay=0.01,
        inv_scale=torch.tensor(0.5, device=device), found_inf=torch.zeros((), device=device),
        clip_coef=torch.tensor(0.9, device=device)))  # fmt: skip
    p32 = _tensors(device, torch.float32, 18)
    g32 = _tensors(device, torch.float32, 19)
    torch.library.opcheck(torch.ops.fastamp.sgd_step_.default, op_args(
        "sgd_step_", params=p32, grads=g32, momentum_buffers=[torch.zeros_like(x) for x in p32],
        state_steps=[torch.tensor(0.0, device=device) for _ in SHAPES],
        lr_tensor=torch.tensor(0.2, device=device), weight_decay=0.01, nesterov=True))  # fmt: skip
