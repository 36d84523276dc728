"""Exact ties and rounding boundaries through the CUDA kernels on the emulator (issue 26): the inputs
of tests/optim/test_exact_ties.py (master -> half stores on a round-to-nearest tie, 8-bit codes on
a 3-bit-mantissa tie, bfloat16 stochastic rounding exactly at its carry), placed at misaligned
offsets so both the vector and the scalar paths store them; harness.run_case compares the emulated
kernels with the CPU kernels bit for bit, and the CPU side is checked here against torch's cast /
the float64 reference, so a CUDA store that rounds ties away from zero cannot pass."""

from __future__ import annotations

import pytest
import torch
from harness import Mem, run_case
from tests.optim.test_exact_ties import half_ties, m8_ties, sr_boundaries
from tests.optim.test_lowbit import _rne_reference

from fastamp.optim import lowbit
from fastamp.testing import op_args

N = 4096 + 256 * 3 + 5


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["adam_step_", "sgd_step_"])
def test_half_param_store_ties(op, dtype, offset):
    ties = half_ties(dtype, N, seed=7)

    def build(mem: Mem):
        p = mem.place(torch.zeros(N, dtype=dtype), offset)
        g = mem.place((mem.randn(N, torch.float32, 1e-2)).to(dtype), offset)
        master = mem.place(ties.clone(), offset)
        if op == "adam_step_":
            m, v = mem.place(torch.zeros(N), offset), mem.place(torch.zeros(N), offset)
            return op_args("adam_step_", params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v],
                           state_steps=[torch.tensor(3.0)], master_params=[master],
                           lr=0.0)  # fmt: skip
        buf = mem.place(torch.zeros(N), offset)
        return op_args("sgd_step_", params=[p], grads=[g], momentum_buffers=[buf],
                       state_steps=[torch.tensor(0.0)], master_params=[master], lr=0.0)  # fmt: skip

    out = run_case(op, build)
    params = out["cpu"][0]
    assert torch.equal(params.view(torch.int16), ties.to(dtype).view(torch.int16))


def test_8bit_code_ties():
    g = m8_ties(N, seed=8)

    def build(mem: Mem):
        blocks = lowbit.nblocks(g)
        return op_args("adam_lowbit_step_", params=[mem.place(mem.randn(N, torch.float32), 1)],
                       grads=[mem.place(g.clone(), 1)],
                       exp_avgs=[mem.place(torch.zeros(N, dtype=torch.uint8), 1)],
                       exp_avg_sqs=[mem.place(torch.zeros(N, dtype=torch.uint8), 1)],
                       exp_avg_absmax=[mem.place(torch.zeros(blocks))],
                       exp_avg_sq_absmax=[mem.place(torch.zeros(blocks))],
                       state_steps=[torch.tensor(0.0)], lr=0.0, beta1=0.0)  # fmt: skip

    out = run_case("adam_lowbit_step_", build)
    codes = out["cpu"][2]
    assert torch.equal(lowbit.decode_m8(codes).double(), _rne_reference(g, 3, -14))


def test_bf16_stochastic_rounding_carry():
    step, seed = 6, 21
    g, up = sr_boundaries(N, seed=9, step=step, sr_seed=seed, high=False)

    def build(mem: Mem):
        return op_args("adam_lowbit_step_", params=[mem.place(mem.randn(N, torch.float32))],
                       grads=[mem.place(g.clone())],
                       exp_avgs=[mem.place(torch.zeros(N, dtype=torch.bfloat16))],
                       exp_avg_sqs=[mem.place(torch.zeros(N, dtype=torch.bfloat16))],
                       state_steps=[torch.tensor(float(step))], seed=seed, lr=0.0,
                       beta1=0.0)  # fmt: skip

    out = run_case("adam_lowbit_step_", build)
    m = out["cpu"][2]
    hi16 = g.view(torch.int32) >> 16
    expected = torch.where(up, hi16 + 1, hi16).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(m.view(torch.int16), expected.view(torch.int16))
