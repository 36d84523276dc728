"""Global-memory traffic of the CUDA kernels, measured by the emulator (csrc/emu/traffic.h): per
warp request, the 32-byte sectors touched; per launch, the distinct sectors (the DRAM bytes with
cold caches).

- The counter itself, on self-test kernels whose counts are known in closed form: a coalesced
  copy, a strided read, a double read, a broadcast, shared-memory staging, 16-byte vectors, and
  a store no instrumentation sees (inline assembly), which the footprint check must catch.
- Every CUDA kernel's op (traffic_cases.py) against its bytes model: DRAM bytes per element
  within 0.5% (+0.01 B) of the model, ideal coalescing on contiguous inputs, no sector re-read
  beyond the case's stated allowance, and a footprint that covers every byte the op changed and
  every byte of the streams it must read.
"""

from __future__ import annotations

import emu
import pytest
import torch
import traffic_cases as tc

pytestmark = pytest.mark.skipif(bool(emu.DEVICE), reason="the emulator's counters")


@pytest.fixture(autouse=True)
def _instrumented():
    if not emu.traffic_instrumented():
        pytest.skip("this emulator library's kernels are not instrumented (the --sanitize build)")


N = 8 * 512  # the self-test kernels' elements (float32)


def _trace(fn) -> list[emu.Launch]:
    launches: list[emu.Launch] = []
    with emu.traced(launches):
        fn()
    return launches


def _selftest(kind: str) -> emu.Launch:
    (launch,) = _trace(lambda: torch.ops.fastamp_emu.selftest(kind))
    return launch


def test_coalesced_copy_counts_one_request_per_warp_and_four_sectors_each():
    ln = _selftest("copy")
    for a in (ln.load, ln.store):
        assert a == emu.Access(requests=N // 32, bytes=4 * N, sectors=N // 8,
                               ideal_sectors=N // 8, unique_sectors=N // 8)  # fmt: skip
    assert tc.problems(ln, tc.Budget(load=4, store=4), N) == []


def test_strided_read_is_uncoalesced():
    ln = _selftest("strided")
    assert ln.load.sectors == 8 * ln.load.ideal_sectors == N  # one sector per lane
    assert ln.load.unique_sectors == N // 8  # the same bytes, in the end
    found = tc.problems(ln, tc.Budget(load=4, store=4), N)
    assert any("coalescing" in p for p in found), found


def test_double_read_is_caught():
    ln = _selftest("twice")
    assert ln.load.sectors == 2 * ln.load.unique_sectors
    assert ln.load.coalescing == 1.0  # each pass alone is perfect
    found = tc.problems(ln, tc.Budget(load=4, store=4), N)
    assert any("re-read" in p for p in found), found


def test_broadcast_reads_one_sector_per_request():
    ln = _selftest("broadcast")
    assert ln.load == emu.Access(requests=N // 32, bytes=4 * N // 32, sectors=N // 32,
                                 ideal_sectors=N // 32, unique_sectors=1)  # fmt: skip


def test_shared_memory_is_not_global_traffic():
    ln = _selftest("staged")
    assert ln.load.bytes == ln.store.bytes == 4 * N
    assert ln.load.requests == ln.store.requests == N // 32


def test_vector_accesses_are_one_request_of_16_byte_lanes():
    ln = _selftest("vector")
    for a in (ln.load, ln.store):
        assert a.requests == N // 4 // 32 and a.sectors == a.ideal_sectors == N // 8


def test_a_store_the_instrumentation_misses_fails_the_footprint_check():
    out: list[torch.Tensor] = []
    launches = _trace(lambda: out.append(torch.ops.fastamp_emu.selftest("bypass")))
    assert launches[0].store.requests == 0  # the inline-assembly stores were not seen
    written = tc.changed_sectors(torch.zeros(N), out[0])
    assert written and not written <= emu.footprint(store=True)


CASES = tc.cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_traffic_matches_the_bytes_model(case: tc.Case):
    args = case.args()
    before = [t.clone() for t in _written(case, args)]
    launches = _trace(lambda: emu.op(case.op)(*args))
    problems = tc.problems(launches, case.budget, tc.ELEMENTS)
    assert problems == [], "\n".join(problems)
    # The footprint covers every byte the op changed and every byte it had to read: no access
    # escaped the count.
    stored, loaded = emu.footprint(store=True), emu.footprint(store=False)
    for old, new in zip(before, _written(case, args)):
        assert tc.changed_sectors(old, new) <= stored
    for t in _read(case, args):
        assert tc.sectors_of(t) <= loaded


LOWBIT = [c for c in CASES if "lowbit" in c.op]


@pytest.mark.parametrize("case", LOWBIT, ids=[c.name for c in LOWBIT])
def test_lowbit_requests_carry_the_sectors_of_the_fp32_path(case: tc.Case):
    """The bf16 and 8-bit state kernels move 16-byte vectors per lane like the fp32 update of the
    same optimizer: at least its sectors per request, loads and stores of every launch."""
    fp32 = tc.by_name()["sgd_step_ float32" if case.op.startswith("sgd") else "adam_step_ float32"]
    ref = tc.sectors_per_request(_trace(lambda: emu.op(fp32.op)(*fp32.args())))
    got = tc.sectors_per_request(_trace(lambda: emu.op(case.op)(*case.args())))
    assert got >= ref, f"{case.name}: {got:.2f} sectors per request, {fp32.name}: {ref:.2f}"


def _written(case: tc.Case, args: tuple) -> list[torch.Tensor]:
    return [t for i in case.writes for t in _flat(args[i])]


def _read(case: tc.Case, args: tuple) -> list[torch.Tensor]:
    return [t for i in case.reads for t in _flat(args[i])]


def _flat(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def test_every_cuda_op_has_a_traffic_case():
    ops = {n.split(".")[0] for n in emu.fastamp_ops()}
    host_only = {"_cpu_capability", "rng_get_state", "rng_set_state", "shared_memory_pair"}
    host_only |= {"hold_tensors", "release_tensors", "held_moved"}
    # one thread: three scalars / two scalars; one block: n bools copied on an overflowed step
    scalar_only = {"update_scale_", "clip_coef", "record_overflow_"}
    # A held variant (adam_step_held_) calls its list-taking op's launcher with the same
    # arguments struct: its traffic is that op's case (the harness runs every differential case
    # through both, bit for bit).
    held = {op for op in ops if op.endswith("_held_") and op[: -len("held_")] in ops}
    assert ops - host_only - scalar_only - held == {c.op for c in CASES}
