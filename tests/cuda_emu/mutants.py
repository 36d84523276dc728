"""Planted faults: the emulated tests must catch each of them, or the harness proves nothing.

Each mutant replaces one exact snippet of one .cu file (the snippet must occur exactly once, so a
mutant cannot silently stop applying when the source changes), is built into its own emulator
library (only that file is recompiled), and a chosen subset of tests/cuda_emu is run against it
in a fresh process, which must FAIL with the expected report.

    python tests/cuda_emu/mutants.py            # every mutant; exit 1 if one survives
    python tests/cuda_emu/mutants.py NAME ...   # some
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to csrc/
    old: str
    new: str
    tests: str  # pytest -k expression over tests/cuda_emu/<test_file>
    expect: str  # regex the failing run's output must contain
    what: str
    test_file: str = "test_emulated_ops.py"


MUTANTS = {
    # The Adam kernel's barrier between thread 0 writing the step coefficients to shared memory
    # and every thread reading them.
    "removed_barrier": Mutant(
        "optim/optim_cuda.cu",
        "        coefs_shared = adam_coefs(h, lr_v, static_cast<double>(steps[blk.index]) + 1.0);\n"
        "      }\n      __syncthreads();\n",
        "        coefs_shared = adam_coefs(h, lr_v, static_cast<double>(steps[blk.index]) + 1.0);\n"
        "      }\n",
        "test_adam_step and fp32-0",
        r"differ from the CPU kernel|differs between launch orders",
        "removed __syncthreads() in the Adam kernel",
    ),
    # Each block writes its norm partial to its tensor's slot instead of its chunk's.
    "wrong_chunk_index": Mutant(
        "scaler/scaler_cuda.cu",
        "if (threadIdx.x == 0) partials[blk.chunk_id] = total;",
        "if (threadIdx.x == 0) partials[blk.index] = total;",
        "test_grad_stats and fp32-edges and 2.0",
        r"reduction 1: emulated .* vs float64",
        "norm partial written at the tensor index instead of the chunk index",
    ),
    # Half of each warp skips the stats reduction's shuffles.
    "divergent_shuffle": Mutant(
        "scaler/scaler_cuda.cu",
        "    const float total = mta_block_reduce<kMtaThreads>(st.acc, CombineFn<K>{}, 0.0f);",
        "    const float total = (threadIdx.x % 32) < 16 ?"
        " mta_block_reduce<kMtaThreads>(st.acc, CombineFn<K>{}, 0.0f) : 0.0f;",
        "test_grad_stats and fp32-edges and 2.0",
        r"CUDA emulator: kernel multi_tensor_apply_kernel: .*(__shfl_down_sync|__syncthreads|exited)",
        "warp shuffle executed by half of the lanes of its mask",
    ),
    # The optimizer's vector path taken without checking alignment.
    "misaligned_vector_load": Mutant(
        "optim/optim_cuda.cu",
        "  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kPack) == 0;",
        "  return reinterpret_cast<uintptr_t>(p) % 4 == 0;",
        "test_adam_step and fp32-0",
        r"misaligned 16-byte vector (load|store)",
        "16-byte vector load from an address that is not 16-byte aligned",
    ),
    # The pack writes one element past each chunk of the bucket.
    "out_of_bounds_write": Mutant(
        "parallel/bucket_cuda.cu",
        "    mta_transform(blk.ptr<T>(1), blk.ptr<T>(0), blk.len,\n"
        "                  [&](T x) { return static_cast<T>(static_cast<float>(x) * s); });",
        "    mta_transform(blk.ptr<T>(1), blk.ptr<T>(0), blk.len,\n"
        "                  [&](T x) { return static_cast<T>(static_cast<float>(x) * s); });\n"
        "    if (threadIdx.x == 0) blk.ptr<T>(0)[blk.len] = T(0);",
        "test_bucket_pack",
        r"wrote outside tensor|differ from the CPU kernel",
        "bucket pack writes one element past its slot",
    ),
    # The 8-bit state's block maximum reduced over half of each warp: the two halves of a warp
    # disagree on their quantization block's scale.
    "lowbit_half_warp_absmax": Mutant(
        "optim/lowbit_cuda.cu",
        "    for (int off = 16; off > 0; off /= 2) {\n"
        "      wm = max_bits(__shfl_xor_sync(0xffffffffu, wm, off), wm);",
        "    for (int off = 8; off > 0; off /= 2) {\n"
        "      wm = max_bits(__shfl_xor_sync(0xffffffffu, wm, off), wm);",
        "test_adam_lowbit_step and fp32 and int8",
        r"differ from the CPU kernel|differs between launch orders",
        "8-bit block maximum reduced over 16 of the 32 lanes",
        "test_emulated_lowbit.py",
    ),
    # Both quantization blocks of a tile decode with the first block's scale.
    "lowbit_wrong_block_scale": Mutant(
        "optim/lowbit_cuda.cu",
        "    const float scale_m = sm[half];",
        "    const float scale_m = sm[0];",
        "test_adam_lowbit_step and fp32 and int8",
        r"differ from the CPU kernel|differs between launch orders",
        "8-bit codes decoded with another quantization block's scale",
        "test_emulated_lowbit.py",
    ),
    # The stochastic rounding's counter restarts at every chunk (the element index within the
    # chunk instead of the tensor): later chunks repeat the first chunk's random bits.
    "lowbit_chunk_local_counter": Mutant(
        "optim/lowbit_cuda.cu",
        "update_bf16_group<T>(k, blk.start + base, pl, gl, ml, ms, vs, lane, b);",
        "update_bf16_group<T>(k, base, pl, gl, ml, ms, vs, lane, b);",
        "test_adam_lowbit_step and bf16 and bfloat16",
        r"differ from the CPU kernel|differs between launch orders",
        "bfloat16 rounding bits drawn from the chunk-local index",
        "test_emulated_lowbit.py",
    ),
    # The SGD kernel keys its bfloat16 rounding by the update count after this step (old + 1), as
    # the CPU kernel does; keyed by the old count, every rounding bit changes.
    "sgd_lowbit_stale_rounding_key": Mutant(
        "optim/lowbit_cuda.cu",
        "shared.first = old == 0.0f;\n"
        "          shared.key =\n"
        "              sr_key(seed, static_cast<uint32_t>(old + 1.0f),",
        "shared.first = old == 0.0f;\n"
        "          shared.key =\n"
        "              sr_key(seed, static_cast<uint32_t>(old),",
        "test_sgd_lowbit_step and fp32 and later",
        r"differ from the CPU kernel|differs between launch orders",
        "SGD bfloat16 rounding keyed by the update count before the step",
        "test_emulated_lowbit.py",
    ),
    # The low-precision kernels' warp transpose hands each lane the 1- and 2-byte elements of the
    # wrong group: only the 16-byte vector path (aligned lists) has it.
    "lowbit_transpose_wrong_group": Mutant(
        "optim/lowbit_cuda.cu",
        "        const uint32_t w = stage[(k * 32 + lane) * kWords + i];",
        "        const uint32_t w = stage[((G / 4 - 1 - k) * 32 + lane) * kWords + i];",
        "test_adam_lowbit_step and aligned",
        r"differ from the CPU kernel|differs between launch orders",
        "warp transpose of the low-bit state reads another group's words",
        "test_emulated_lowbit.py",
    ),
    # The low-precision kernels never take their 16-byte vector path: one element per lane per
    # access, the bits unchanged, the requests 2-4 sectors (the traffic budget must catch it).
    "lowbit_scalar_per_lane": Mutant(
        "optim/lowbit_cuda.cu",
        "  return reinterpret_cast<uintptr_t>(p) % 16 == 0;",
        "  return p == nullptr;",
        "lowbit",
        r"sectors per request",
        "low-precision state kernels moving one element per lane",
        "test_traffic.py",
    ),
    # The optimizers' half stores round ties away from zero (the value nudged up by one float32
    # ulp before the round-to-nearest-even cast): only inputs exactly on a tie see it.
    "half_store_ties_away": Mutant(
        "optim/optim_cuda.cu",
        "for (int j = 0; j < kPack; ++j) r.v[j] = static_cast<T>(x[j]);",
        "for (int j = 0; j < kPack; ++j) "
        "r.v[j] = static_cast<T>(std::is_same_v<T, float> ? x[j] : x[j] * 1.00000012f);",
        "test_half_param_store_ties",
        r"differ from the CPU kernel",
        "float16/bfloat16 param stores rounding ties away from zero",
        "test_emulated_ties.py",
    ),
}


def apply(name: str) -> dict[str, str]:
    """{file: mutated source} for mutant `name`."""
    m = MUTANTS[name]
    text = (CSRC / m.file).read_text()
    count = text.count(m.old)
    if count != 1:
        raise RuntimeError(
            f"mutant {name}: the snippet occurs {count} times in csrc/{m.file} "
            f"(expected once); update mutants.py to the current source"
        )
    return {m.file: text.replace(m.old, m.new)}


def pytest_cmd(test_file: str, k: str = "") -> list[str]:
    """pytest over tests/cuda_emu/<test_file> (filtered by -k `k`), stopping at the first failure."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / test_file),
    ]
    return cmd + ["-k", k] if k else cmd


def run(name: str, sanitize: bool = False) -> tuple[bool, str]:
    """Builds and runs one mutant; returns (caught, summary)."""
    m = MUTANTS[name]
    sys.path.insert(0, str(HERE))
    import build

    out = build.DEFAULT_OUT / ("asan" if sanitize else "default")
    lib = build.build(out, sanitize=sanitize, overrides=apply(name), name=f"_cuda_emu_{name}.so")
    env = dict(os.environ, FASTAMP_EMU_LIB=str(lib))
    cmd = pytest_cmd(m.test_file, m.tests)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    output = r.stdout + r.stderr
    ran = re.search(r"(\d+) (passed|failed)", output)
    if r.returncode == 0:
        return (
            False,
            f"SURVIVED: {m.what}: the tests passed ({ran.group(0) if ran else 'no tests?'})",
        )
    if not ran or "failed" not in output:
        return (
            False,
            f"NOT RUN: {m.what}: pytest exited {r.returncode} without a failing test:\n{output[-2000:]}",
        )
    hit = re.search(m.expect, output)
    if not hit:
        return False, (
            f"WRONG REPORT: {m.what}: tests failed but without /{m.expect}/:\n{output[-3000:]}"
        )
    lines = [ln for ln in output.splitlines() if re.search(m.expect, ln)]
    line = next((ln for ln in lines if ln.startswith("E ")), lines[0] if lines else hit.group(0))
    return True, f"caught: {m.what}: {line.strip()[:220]}"


def main(argv: list[str]) -> int:
    """Runs the planted faults side by side, one per core (EMU_FAULT_JOBS): each is a one-file
    rebuild and a pytest process, single-threaded for most of its time."""
    import concurrent.futures

    names = argv or list(MUTANTS)
    jobs = int(os.environ.get("EMU_FAULT_JOBS", os.cpu_count() or 1))

    def one(name: str) -> tuple[str, bool, str, float]:
        t0 = time.time()
        caught, summary = run(name)
        return name, caught, summary, time.time() - t0

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for name, caught, summary, secs in pool.map(one, names):
            failed += not caught
            print(f"[{name}] {summary} ({secs:.0f}s)", flush=True)
    print(f"planted faults: {len(names) - failed} of {len(names)} caught")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
