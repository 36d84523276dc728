"""Mutation testing of the CPU kernels: generated mutants of their C++ sources, each compiled into
the CPU library (an incremental rebuild of the units it reaches) and run against the CPU op
tests and the emulated differential tests (whose reference is the CPU kernel).

The operators and the sampling are the CUDA tier's (tests/cuda_emu/mutate.py); the files are the
CPU kernels' own. Each mutant is written over its file in place and always put back, so run this
from a separate checkout (a git worktree) whose library is on the path:

    git worktree add /tmp/mutcpu HEAD
    cd /tmp/mutcpu && python tests/mutate_cpu.py --per-file 3 --out /tmp/mutation_cpu.md

The first run configures and builds the library in build/mutate-cpu (a few minutes); every
mutant then recompiles only what it touches, and the library is copied into python/fastamp.
Python imports fastamp from this checkout (sitecustomize drops the editable finder of the main
checkout, and python/ is put first on the path).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cuda_emu"))
sys.path.insert(0, str(ROOT / "tests"))

import mutate  # noqa: E402  (the generator of the CUDA tier)

from _mutation import checkout_env, mutation_parser, run_tests, write_report  # noqa: E402

BUILD = ROOT / "build" / "mutate-cpu"

# file: the tests its mutants run, most telling first (-x stops at the first failure).
FILES = {
    "scaler/scaler_cpu_kernels.inc": ["tests/scaler/test_ops.py", "tests/cuda_emu/test_emulated_ops.py"],
    "optim/optim_cpu_kernels.inc": ["tests/optim/test_optim_ops.py", "tests/optim/test_exact_ties.py",
                                    "tests/cuda_emu/test_emulated_ops.py"],
    "optim/lowbit_cpu_kernels.inc": ["tests/optim/test_lowbit.py", "tests/optim/test_lowbit_sgd.py",
                                     "tests/optim/test_exact_ties.py", "tests/cuda_emu/test_emulated_lowbit.py"],
    "parallel/bucket_cpu.cpp": ["tests/parallel/test_bucket_ops.py", "tests/cuda_emu/test_emulated_ops.py"],
    "checkpoint/checkpoint_cpu.cpp": ["tests/checkpoint", "tests/cuda_emu/test_emulated_ops.py"],
    "checkpoint/digest_cpu_kernels.inc": ["tests/checkpoint", "tests/cuda_emu/test_emulated_ops.py"],
}  # fmt: skip


# Survivors argued equivalent (mutant key -> why no test can tell), listed as such in the report.
_PREFETCH = "a software prefetch hint (another distance or locality, or one element further): "
_PREFETCH += "no load or store changes, so no bit of the result can"
EQUIVALENT: dict[str, str] = {
    "bf58e1e7da": _PREFETCH,
    "be40315227": _PREFETCH,
    "76c720c4a2": _PREFETCH,
    "52f4d734b0": _PREFETCH,
    "471e6b9f7d": _PREFETCH,
    "bfd9338a2e": "the tail's terms (fewer than 16 after the 16-wide loop) go into lanes 1..r "
    "instead of 0..r-1: no lane overflows, and the same terms are summed in another order; the "
    "norm's contract is the float64 norm within 2e-5 (not a bit pattern), which any order meets",
    "3e0bdb1a52": "one more partial sum when the word count is a multiple of the grain: its range "
    "is empty, so it adds 0",
}


def build() -> str:
    """Builds the CPU library (incrementally) and copies it into python/fastamp; returns the
    compiler's error output, or "" on success."""
    if not (BUILD / "build.ninja").exists():
        cmd = [
            "cmake", "-S", str(ROOT), "-B", str(BUILD), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DFASTAMP_CUDA=OFF", "-DFASTAMP_WERROR=ON",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env=checkout_env(ROOT))
        if r.returncode != 0:
            raise SystemExit(f"cmake configure failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    r = subprocess.run(
        ["cmake", "--build", str(BUILD)], capture_output=True, text=True, env=checkout_env(ROOT)
    )
    if r.returncode != 0:
        return (r.stdout + r.stderr)[-2000:]
    libs = sorted(BUILD.glob("_C*.so"))
    if not libs or not (BUILD / "_build_info.py").exists():
        raise SystemExit(f"no _C*.so and _build_info.py in {BUILD}")
    for f in (libs[0], BUILD / "_build_info.py"):
        shutil.copy2(f, ROOT / "python" / "fastamp" / f.name)
    return ""


def key(m: mutate.Mutant) -> str:
    """The mutant and its file's text. Tests only grow, so a killed (or stillborn) mutant is not
    run again; a survivor is, every time."""
    return hashlib.sha256(f"{m.key}\0{(mutate.CSRC / m.file).read_text()}".encode()).hexdigest()[
        :16
    ]


def run(m: mutate.Mutant, timeout: int) -> tuple[str, str]:
    path = mutate.CSRC / m.file
    original = path.read_text()
    try:
        path.write_text(m.source())
        err = build()
        if err:
            return "stillborn", err.strip().splitlines()[-1][:160]
        return run_tests(ROOT, FILES[m.file], timeout)
    finally:
        path.write_text(original)


def main(argv: list[str] | None = None) -> int:
    ap = mutation_parser(__doc__, per_file=3)
    a = ap.parse_args(argv)
    state = json.loads(a.state.read_text()) if a.state and a.state.exists() else {}
    chosen = []
    for rel in FILES:
        ms = mutate.mutants_of(rel)
        ms = random.Random(f"{a.seed}:{rel}").sample(ms, min(a.per_file, len(ms)))
        chosen += sorted(ms, key=lambda m: (m.line, m.col, m.op))
    if a.list:
        for m in chosen:
            print(f"{m.file}:{m.line} {m.op}: {m.new_line.strip()}")
        return 0
    t0 = time.time()
    # A mutant is restored by its `finally`; SIGTERM must reach it as an exception.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if build():
        raise SystemExit("the unmutated sources do not build")
    every = sorted({f for fs in FILES.values() for f in fs})
    status, detail = run_tests(ROOT, every, a.timeout)
    if status != "survived":  # the baseline must pass, or every mutant would look killed
        raise SystemExit(f"the unmutated tests fail: {detail}")
    results = []
    for m in chosen:
        k = key(m)
        final = state.get(k, [""])[0] in ("killed", "stillborn")
        status, detail = state[k] if final else run(m, a.timeout)
        if a.state:
            state[k] = [status, detail]
            a.state.write_text(json.dumps(state, indent=1))
        print(f"[{status:9}] {m.file}:{m.line} {m.op}: {m.new_line.strip()[:70]} {detail[:90]}",
              flush=True)  # fmt: skip
        results.append((m, status, detail))
    build()  # the unmutated library again
    results = [
        (m, "equivalent" if s == "survived" and m.key in EQUIVALENT else s, d)
        for m, s, d in results
    ]
    counted = [r for r in results if r[1] not in ("stillborn", "equivalent")]
    killed = sum(s == "killed" for _, s, _ in counted)
    equivalent = [r for r in results if r[1] == "equivalent"]
    lines = [
        "# Mutation testing of the CPU kernels (`tests/mutate_cpu.py`)",
        "",
        f"`python tests/mutate_cpu.py --per-file {a.per_file} --seed {a.seed}`: {len(results)} "
        f"mutants over {len(FILES)} files, {len(results) - len(counted) - len(equivalent)} "
        f"stillborn, {len(equivalent)} argued equivalent, {killed} of the {len(counted)} others "
        f"killed ({100 * killed / max(len(counted), 1):.1f}%), "
        f"{(time.time() - t0) / 60:.0f} minutes.",
        "",
        "| file | mutants | killed |",
        "|---|---|---|",
    ]
    for rel in FILES:
        rs = [r for r in counted if r[0].file == rel]
        lines.append(f"| csrc/{rel} | {len(rs)} | {sum(s == 'killed' for _, s, _ in rs)} |")
    lines += ["", "## Survivors", ""]
    lines += [f"- `csrc/{m.file}:{m.line}` {m.op}: `{m.new_line.strip()}`"
              for m, s, _ in results if s == "survived"] or ["None."]  # fmt: skip
    lines += ["", "## Equivalent mutants", ""]
    lines += [f"- `csrc/{m.file}:{m.line}` ({m.key}) {m.op}: `{m.new_line.strip()}`: "
              f"{EQUIVALENT[m.key]}" for m, _, _ in equivalent] or ["None."]  # fmt: skip
    lines += ["", "## Every mutant", ""]
    lines += [f"- {s}: `csrc/{m.file}:{m.line}` {m.op}: `{m.new_line.strip()}` {d[:120]}"
              for m, s, d in results]  # fmt: skip
    return write_report(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
