"""The CUDA kernel of fastamp::adam_lowbit_step_ (csrc/optim/lowbit_cuda.cu) on the emulator against
the CPU kernel, bit for bit, in every launch order, canaries intact (harness.run_case): bfloat16
state with stochastic rounding and 8-bit codes with their block scales (side lists of the engine:
blocks of 256 that straddle a chunk boundary and a partial last block), half params with master
weights, and an overflowed step that writes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from harness import Mem, run_case, tensors_of

from fastamp.optim import lowbit
from fastamp.testing import op_args

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CHUNK = 65536

SPECS = {
    # (numel, dtype, offset in its buffer)
    "fp32-blocks": [
        (1, F32, 0),
        (255, F32, 1),
        (256, F32, 2),
        (257, F32, 3),
        (4097, F32, 0),
        (CHUNK + 300, F32, 1),
    ],
    "fp16": [(513, F16, 1), (CHUNK - 1, F16, 0)],
    "bf16": [(2 * CHUNK + 17, BF16, 3), (31, BF16, 0)],
    # Offset 9 (after the 7-element front canaries): every list 16-byte aligned, so the kernels'
    # 16-byte vector path (and its cut last vector) runs; the offsets above take the scalar one.
    "fp32-aligned": [(CHUNK + 4097, F32, 9), (300, F32, 9), (3 * 256 + 5, F32, 9)],
    "bf16-aligned": [(CHUNK + 700, BF16, 9), (45, BF16, 9)],
}

# Without master weights: the float32 param lists (the others have fp32 masters).
NO_MASTER = ("fp32-blocks", "fp32-aligned")


def _build(
    spec, fmt, master, found=0.0, inject=None, lr_tensor=False, decoupled=True, maximize=False,
    scaled=True, weight_decay=0.01,
):  # fmt: skip
    def build(mem: Mem):
        params = [mem.place(mem.randn(n, dt, 0.1), off) for n, dt, off in spec]
        gs = []
        for i, (n, dt, off) in enumerate(spec):
            g = mem.randn(n, dt, 64.0)
            for j, v in (inject or {}).get(i, []):
                g[j] = v
            gs.append(mem.place(g, off))
        ms, vs, ams, avs = [], [], [], []
        for n, _, off in spec:
            m = mem.randn(n, F32, 1e-2)
            v = mem.randn(n, F32, 1e-3).abs()
            # Some moments far below their block's maximum: 8-bit codes whose exponent field
            # is 0 (decoded as 0), which random moments of one scale never produce.
            m[::97] *= 1e-7
            v[::89] *= 1e-9
            st = lowbit.resolve(fmt, "test").encode({"exp_avg": m, "exp_avg_sq": v}, torch.empty(n))
            m8, v8, am, av = lowbit.resolve(fmt, "test").adam_lists([st])
            ms.append(mem.place(m8[0], off))
            vs.append(mem.place(v8[0], off))
            ams += [mem.place(t) for t in am]
            avs += [mem.place(t) for t in av]
        masters = (
            [mem.place(p.float(), off) for p, (_, _, off) in zip(params, spec)] if master else []
        )
        steps = [torch.tensor(float(3 + i)) for i in range(len(spec))]
        return op_args("adam_lowbit_step_", params=params, grads=gs, exp_avgs=ms, exp_avg_sqs=vs,
                       exp_avg_absmax=ams, exp_avg_sq_absmax=avs, state_steps=steps,
                       master_params=masters, seed=12345, lr=0.05,
                       lr_tensor=torch.tensor(0.02) if lr_tensor else None,
                       weight_decay=weight_decay, decoupled_weight_decay=decoupled,
                       maximize=maximize, inv_scale=torch.tensor(1 / 64) if scaled else None,
                       found_inf=torch.tensor(found) if scaled else None,
                       clip_coef=torch.tensor(0.7) if scaled else None)  # fmt: skip

    return build


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_adam_lowbit_step(name, fmt):
    run_case("adam_lowbit_step_", _build(SPECS[name], fmt, name not in NO_MASTER))


# Each argument value the kernel branches on, against the CPU kernel (tests/_argcov.py checks
# that every one reaches both): a tensor lr, Adam's L2 decay, maximize, no scaler, no decay.
ADAM_VARIANTS = {
    "lr-tensor": {"lr_tensor": True},
    "l2-decay": {"decoupled": False},
    "maximize": {"maximize": True},
    "unscaled": {"scaled": False},
    "no-decay": {"weight_decay": 0.0},
}


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(ADAM_VARIANTS))
def test_adam_lowbit_step_variants(variant, fmt):
    build = _build(SPECS["fp16"], fmt, True, **ADAM_VARIANTS[variant])
    run_case("adam_lowbit_step_", build, orders=("ascending", "random"))


def _assert_writes_nothing(op, build):
    """``op`` (its arguments from ``build``, found_inf set) leaves every argument as it was."""
    out = run_case(op, build, orders=("ascending", "random"))
    fresh = tensors_of(list(build(Mem(0))))
    for i, (a, b) in enumerate(zip(out["emu"], fresh)):
        assert torch.equal(
            a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        ), f"{op} with found_inf=1 wrote into argument tensor {i}"


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_adam_lowbit_step_found_inf_writes_nothing(fmt):
    build = _build(SPECS["fp32-blocks"], fmt, False, found=1.0, inject={5: [(70, math.inf)]})
    _assert_writes_nothing("adam_lowbit_step_", build)


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_adam_lowbit_step_non_finite_gradient_without_found_inf(fmt):
    """No scaler: a NaN and an inf gradient are stepped into the state. The NaN reaches a block's
    maximum (int8: the integer maximum of the bits on both backends) and bfloat16's NaN rule."""
    build = _build(
        SPECS["fp32-blocks"],
        fmt,
        False,
        found=0.0,
        inject={5: [(70, math.nan)], 4: [(300, math.inf), (301, -math.inf)]},
    )
    out = run_case("adam_lowbit_step_", build, orders=("ascending", "random"))
    assert any(torch.isnan(t.float()).any() for t in out["emu"] if t.is_floating_point())


def _build_sgd(
    spec, master, found=0.0, first=False, lr_tensor=False, weight_decay=0.01, dampening=0.1,
    nesterov=True, maximize=False, scaled=True,
):  # fmt: skip
    def build(mem: Mem):
        params = [mem.place(mem.randn(n, dt, 0.1), off) for n, dt, off in spec]
        gs = [mem.place(mem.randn(n, dt, 64.0), off) for n, dt, off in spec]
        bufs = [mem.place(mem.randn(n, F32, 1e-2).to(BF16), off) for n, _, off in spec]
        masters = (
            [mem.place(p.float(), off) for p, (_, _, off) in zip(params, spec)] if master else []
        )
        counts = [torch.tensor(0.0 if first else float(2 + i)) for i in range(len(spec))]
        return op_args("sgd_lowbit_step_", params=params, grads=gs, momentum_buffers=bufs,
                       state_steps=counts, master_params=masters, seed=777, lr=0.05,
                       lr_tensor=torch.tensor(0.02) if lr_tensor else None,
                       weight_decay=weight_decay, dampening=dampening, nesterov=nesterov,
                       maximize=maximize, inv_scale=torch.tensor(1 / 64) if scaled else None,
                       found_inf=torch.tensor(found) if scaled else None,
                       clip_coef=torch.tensor(0.7) if scaled else None)  # fmt: skip

    return build


@pytest.mark.parametrize("first", [False, True], ids=["later", "first-update"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_sgd_lowbit_step(name, first):
    run_case("sgd_lowbit_step_", _build_sgd(SPECS[name], name not in NO_MASTER, first=first))


SGD_VARIANTS = {
    "lr-tensor": {"lr_tensor": True},
    "no-decay": {"weight_decay": 0.0},
    "no-dampening": {"dampening": 0.0},
    "heavy-ball": {"nesterov": False},
    "maximize": {"maximize": True},
    "unscaled": {"scaled": False},
}


@pytest.mark.parametrize("variant", sorted(SGD_VARIANTS))
def test_sgd_lowbit_step_variants(variant):
    build = _build_sgd(SPECS["bf16"], True, **SGD_VARIANTS[variant])
    run_case("sgd_lowbit_step_", build, orders=("ascending", "random"))


def test_sgd_lowbit_step_found_inf_writes_nothing():
    build = _build_sgd(SPECS["fp32-blocks"], False, found=1.0)
    _assert_writes_nothing("sgd_lowbit_step_", build)
