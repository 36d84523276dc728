"""Exact ties and rounding boundaries through the optimizer kernels (issue 26): inputs that sit
exactly on a round-to-nearest tie or a stochastic-rounding carry boundary, so that a kernel that
rounds ties away from zero, truncates, or is off by one in its carry differs on many elements,
not by chance on one in 10^5.

- the float32 master -> float16/bfloat16 param store of Adam and SGD (master weights, lr 0 so the
  master stays the tie), against torch's own round-to-nearest-even cast;
- the 8-bit exp_avg codes (beta1 0 so the moment is the grad), against the float64 reference of
  "truncate to bfloat16, then round to 3 mantissa bits, to nearest even";
- the bfloat16 moments' stochastic rounding, with grads whose low 16 bits plus the kernel's
  random bits land exactly on the carry (rounds up) or one below it (rounds down).

tests/cuda_emu/test_emulated_ties.py runs the same inputs through the CUDA kernels on the emulator.
"""

from __future__ import annotations

import torch

from fastamp.optim import lowbit
from fastamp.testing import assert_bitwise_equal, lowbit_ref, op_args
from tests.optim.test_lowbit import _rne_reference

ops = torch.ops.fastamp  # the ops themselves: their schemas are the interface under test

N = 4096 + 256 * 3 + 5  # several 8-bit blocks and a partial one


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    b = bits & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def half_ties(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """float32 values exactly halfway between two neighbouring ``dtype`` values (lower neighbour
    even for half of them, odd for the other half; both signs; fp16 subnormals included)."""
    gen = torch.Generator().manual_seed(seed)
    lo = (torch.randn(n, generator=gen) * 4).to(dtype)
    if dtype is torch.float16:
        lo[: n // 8] = (torch.rand(n // 8, generator=gen) * 6e-5).to(dtype)  # subnormals
    lo = torch.where(lo == 0, torch.ones_like(lo), lo)
    ints = lo.view(torch.int16).to(torch.int32)
    ints = (ints & ~1) | (torch.arange(n) % 2)  # alternate even / odd lower neighbour
    lo = ints.to(torch.int16).view(dtype)
    hi = (ints + 1).to(torch.int16).view(dtype)  # sign and magnitude: one ulp away from zero
    ties = (lo.double() + hi.double()) / 2
    assert torch.equal(ties.float().double(), ties)  # exact in float32
    return ties.float()


def _adam_master_store(dtype, master):
    p = master.to(dtype)
    g = torch.randn(master.shape).to(dtype) * 1e-2
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    p.fill_(0)  # overwritten by the store
    ops.adam_step_(*op_args("adam_step_", params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v],
                            state_steps=[torch.tensor(3.0)], master_params=[master],
                            lr=0.0))  # fmt: skip
    return p


def _sgd_master_store(dtype, master):
    p = torch.zeros(master.shape, dtype=dtype)
    g = torch.randn(master.shape).to(dtype) * 1e-2
    buf = torch.zeros_like(master)
    ops.sgd_step_(*op_args("sgd_step_", params=[p], grads=[g], momentum_buffers=[buf],
                           state_steps=[torch.tensor(0.0)], master_params=[master],
                           lr=0.0))  # fmt: skip
    return p


def test_half_param_stores_round_ties_to_even_as_torch():
    for dtype in (torch.bfloat16, torch.float16):
        ties = half_ties(dtype, N, seed=1 if dtype is torch.bfloat16 else 2)
        down = int((ties.to(dtype).float().abs() < ties.abs()).sum())
        assert N // 4 < down < 3 * N // 4  # about half the ties round down: even lower neighbour
        for store in (_adam_master_store, _sgd_master_store):
            master = ties.clone()
            p = store(dtype, master)
            assert_bitwise_equal(master, ties, f"{store.__name__} {dtype}: master")  # lr 0
            assert_bitwise_equal(p, ties.to(dtype), f"{store.__name__} {dtype}: the half store")


def m8_ties(n: int, seed: int) -> torch.Tensor:
    """exp_avg values whose 8-bit code is a tie: after truncation to bfloat16, the mantissa is
    exactly half-way between two 3-bit mantissas (the kernel truncates, then rounds to even); a
    quarter carry low bits that truncation drops (a tie only after it). One element per block is
    1.0, the block's maximum, so m / absmax is the value itself."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 8, (n,), generator=gen)  # the 3-bit mantissa below the tie
    e = torch.randint(-13, 0, (n,), generator=gen).double()  # exponents the code keeps
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    y = sign * (1 + k.double() / 8 + 1 / 16) * torch.exp2(e)
    y = y.float()
    low = torch.randint(1, 2**16, (n,), generator=gen)
    dropped = torch.arange(n) % 4 == 3
    y = torch.where(dropped, _as_float(y.view(torch.int32).to(torch.int64) | low), y)
    y[:: lowbit.QUANT_BLOCK] = 1.0
    return y


def test_8bit_codes_round_ties_to_even_through_the_kernel():
    g = m8_ties(N, seed=3)
    p = torch.randn(N)
    m8 = torch.zeros(N, dtype=torch.uint8)
    v8 = torch.zeros(N, dtype=torch.uint8)
    am = torch.zeros(lowbit.nblocks(p))
    av = torch.zeros(lowbit.nblocks(p))
    # beta1 = 0: the new exp_avg is the grad exactly; lr 0 leaves the params.
    ops.adam_lowbit_step_(*op_args("adam_lowbit_step_", params=[p], grads=[g], exp_avgs=[m8],
                                   exp_avg_sqs=[v8], exp_avg_absmax=[am], exp_avg_sq_absmax=[av],
                                   state_steps=[torch.tensor(0.0)], lr=0.0, beta1=0.0))  # fmt: skip
    assert torch.equal(am, torch.ones_like(am))
    assert_bitwise_equal(m8, lowbit.encode_m8(g), "codes vs the codec")
    assert_bitwise_equal(
        lowbit.decode_m8(m8).double(), _rne_reference(g, 3, -14), "codes vs float64"
    )
    up = lowbit.decode_m8(m8).abs() > g.abs()
    assert N // 4 < int(up.sum()) < 3 * N // 4  # ties went both ways: to the even neighbour


def sr_boundaries(
    n: int, seed: int, step: int, sr_seed: int, high: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grads whose low 16 bits plus the kernel's random bits for that element (``exp_avg``: the
    low half of the element's 32 bits, ``exp_avg_sq``: the high half) make exactly 0x10000 (the
    carry: rounds up) or 0xFFFF (rounds down), alternately; and which way each must go."""
    gen = torch.Generator().manual_seed(seed)
    r = lowbit_ref.sr_bits(lowbit_ref.sr_key(sr_seed, step + 1, 0), torch.arange(n))
    r16 = (r >> 16 if high else r) & 0xFFFF
    up = torch.arange(n) % 2 == 0
    low = torch.where(up, (0x10000 - r16) & 0xFFFF, 0xFFFF - r16)
    up = up & (low != 0)  # r16 == 0: no carry is possible (the value is already a bfloat16)
    top = (torch.randn(n, generator=gen) * 1e-2).view(torch.int32).to(torch.int64) & ~0xFFFF
    return _as_float(top | low), up


def test_bf16_stochastic_rounding_carries_exactly_at_the_boundary():
    step, seed = 6, 21
    g, up = sr_boundaries(N, seed=4, step=step, sr_seed=seed, high=False)
    p = torch.randn(N)
    m = torch.zeros(N, dtype=torch.bfloat16)
    v = torch.zeros(N, dtype=torch.bfloat16)
    ops.adam_lowbit_step_(*op_args("adam_lowbit_step_", params=[p], grads=[g], exp_avgs=[m],
                                   exp_avg_sqs=[v], state_steps=[torch.tensor(float(step))],
                                   seed=seed, lr=0.0, beta1=0.0))  # fmt: skip
    truncated = (g.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    bumped = ((g.view(torch.int32) >> 16) + 1).to(torch.int16).view(torch.bfloat16)
    assert_bitwise_equal(m, torch.where(up, bumped, truncated), "exp_avg at the carry boundary")
    assert int(up.sum()) > N // 3
