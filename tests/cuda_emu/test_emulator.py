"""The emulator itself: its model of barriers, warp collectives, shared memory, atomics and launch
limits against CUDA's documented behaviour, in every launch order; and each kind of fault it must
report (csrc/emu/selftest.cpp holds the kernels)."""

from __future__ import annotations

import emu
import pytest
import torch


def selftest(kind: str) -> torch.Tensor:
    return emu.op("selftest")(kind)


@pytest.mark.parametrize("order", emu.ORDERS)
def test_block_reduce(order):
    with emu.order(order, seed=7):
        out = selftest("block_reduce")
    assert out.tolist() == [float(sum(range(512)))] * 3


def _shuffle_expected():
    lanes = range(32)
    v = [100 + lane for lane in lanes]

    def down(lane, d, w):
        seg = lane - lane % w
        return v[lane + d] if lane - seg + d < w else v[lane]

    def up(lane, d, w):
        seg = lane - lane % w
        return v[lane - d] if lane - seg >= d else v[lane]

    rows = [
        [down(lane, 3, 8) for lane in lanes],
        [up(lane, 2, 8) for lane in lanes],
        [v[lane ^ 5] for lane in lanes],
        [v[lane - lane % 8 + 9 % 8] for lane in lanes],
        [down(lane, 16, 32) for lane in lanes],
        [v[lane ^ 1] if lane < 16 else -1 for lane in lanes],
    ]
    return [x for row in rows for x in row]


@pytest.mark.parametrize("order", emu.ORDERS)
def test_shuffles_follow_cuda_width_rules(order):
    with emu.order(order, seed=3):
        out = selftest("shuffle")
    assert out.tolist() == _shuffle_expected()


@pytest.mark.parametrize("order", emu.ORDERS)
def test_shared_memory_and_barrier(order):
    with emu.order(order, seed=5):
        out = selftest("shared").view(2, 512)
    for b in range(2):
        assert out[b].tolist() == [((t + 1) % 512) * 3 + b for t in range(512)]


def test_atomics():
    out = selftest("atomics")
    assert out.tolist() == [4 * 512 * 0.5, 4 * sum(range(1, 513))]


FAULTS = {
    "divergent_barrier": r"(exited while .* wait at __syncthreads|__syncthreads\(\) reached after)",
    "exit_before_barrier": r"(exited while .* wait at __syncthreads|__syncthreads\(\) reached after)",
    "lane_outside_mask": r"does not name the calling lane",
    "read_outside_mask": r"reads lane 2, which is not in the mask",
    "shuffle_vs_barrier": r"divergent warp collective",
    "misaligned": r"misaligned 16-byte vector load",
    # Scalar accesses are checked by the instrumentation hooks (csrc/emu/traffic.cpp).
    "misaligned_scalar": r"misaligned 4-byte load",
    "big_params": r"4112 bytes of kernel parameters",
    "empty_grid": r"grid dimension x is 0",
    "too_many_threads": r"block dimension x is 1025|1025 threads per block",
    "block_z_too_large": r"block dimension z is 65",
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
@pytest.mark.parametrize("order", emu.ORDERS)
def test_faults_are_reported(kind, order):
    if kind == "misaligned_scalar" and not emu.traffic_instrumented():
        pytest.skip("scalar accesses are checked by the instrumentation (not in --sanitize)")
    with emu.order(order, seed=11), pytest.raises(RuntimeError, match=FAULTS[kind]):
        selftest(kind)
    # the emulator is usable after a fault
    assert selftest("block_reduce")[0].item() == float(sum(range(512)))


def test_launch_orders_start_blocks_and_threads_as_named():
    # arrival rank of each (block, thread) of a 3 x 64 launch
    with emu.order("ascending"):
        asc = selftest("arrival").tolist()
    assert asc == list(range(192))
    with emu.order("descending"):
        desc = selftest("arrival").tolist()
    assert desc == list(range(191, -1, -1))
    randoms = []
    for seed in (1, 2):
        with emu.order("random", seed=seed):
            r = selftest("arrival").tolist()
        assert sorted(r) == list(range(192)) and r not in (asc, desc)
        # threads of a block start before the next block's: blocks run one after another
        ranks = [sorted(r[b * 64 : (b + 1) * 64]) for b in range(3)]
        assert all(rk == list(range(rk[0], rk[0] + 64)) for rk in ranks)
        randoms.append(r)
    assert randoms[0] != randoms[1]
    with emu.order("random", seed=1):
        assert selftest("arrival").tolist() == randoms[0]  # reproducible from the seed
