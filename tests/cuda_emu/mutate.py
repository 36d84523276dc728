"""Mutation testing of the CUDA kernels (`make mutate`): generated mutants of csrc/, each built into
its own emulator library and run against the emulated differential tests.

The mutants are generated, not chosen: every code line of the CUDA sources (`*.cu`, `*.cuh`) and
of the element math they share with the CPU kernels (`*_math.h`) yields one mutant per operator
that applies to it:

- arithmetic: `+` <-> `-`, `*` <-> `/` (binary, as clang-format spaces them), compound `+=` <-> `-=`;
- relational: `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`; logical: `&&` <-> `||`;
- shifts: `<<` <-> `>>`; bit operations: `&` <-> `|`;
- integer literals: `0` -> `1`, `1` -> `0`, `n` -> `n + 1`;
- statement deletion: an assignment, an increment or a `__syncthreads()` removed.

Comments, preprocessor lines, string literals and the operators inside them are left alone.
The sample is stratified: `--per-file N` mutants from each file (seeded, so a run is repeatable),
or all of them. A mutant is

- **killed** when the tests fail, or hang past the time limit;
- **stillborn** when it does not compile (not counted);
- **survived** otherwise. A survivor is a test gap or an equivalent mutant; the results file lists
  each with its line, for one or the other to be written down.

The emulated tests compare each kernel with the CPU kernel built from the unmutated sources, so a
mutant of a shared math header is a CUDA-side mutant here. The CPU kernels' own mutants need a
rebuild of the CPU library per mutant and are not part of this tier.

    python tests/cuda_emu/mutate.py --per-file 15 --out benchmarks/results/mutation_cuda.md
    python tests/cuda_emu/mutate.py --list        # the mutants, without running them
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"

# (pattern, replacement, name): applied to one occurrence at a time.
OPERATORS: list[tuple[str, str, str]] = [
    (r"(?<=\s)\+(?=\s)", "-", "+ -> -"),
    (r"(?<=\s)-(?=\s)", "+", "- -> +"),
    (r"(?<=\s)\*(?=\s)", "/", "* -> /"),
    (r"(?<=\s)/(?=\s)", "*", "/ -> *"),
    (r"(?<=\s)\+=(?=\s)", "-=", "+= -> -="),
    (r"(?<=\s)-=(?=\s)", "+=", "-= -> +="),
    (r"(?<=\s)<(?=\s)", "<=", "< -> <="),
    (r"(?<=\s)<=(?=\s)", "<", "<= -> <"),
    (r"(?<=\s)>(?=\s)", ">=", "> -> >="),
    (r"(?<=\s)>=(?=\s)", ">", ">= -> >"),
    (r"(?<=\s)==(?=\s)", "!=", "== -> !="),
    (r"(?<=\s)!=(?=\s)", "==", "!= -> =="),
    (r"(?<=\s)&&(?=\s)", "||", "&& -> ||"),
    (r"(?<=\s)\|\|(?=\s)", "&&", "|| -> &&"),
    (r"(?<=\s)<<(?=\s)", ">>", "<< -> >>"),
    (r"(?<=\s)>>(?=\s)", "<<", ">> -> <<"),
    (r"(?<=\s)&(?=\s)", "|", "& -> |"),
    (r"(?<=\s)\|(?=\s)", "&", "| -> &"),
    (r"(?<![\w.])0(?![\w.])", "1", "0 -> 1"),
    (r"(?<![\w.])1(?![\w.])", "0", "1 -> 0"),
    (r"(?<![\w.])([2-9]|[1-9]\d+)(?![\w.])", None, "n -> n + 1"),
]
DELETABLE = re.compile(
    r"^\s*(__syncthreads\(\);|[\w\[\]\.\->*]+\s*(\+|-|\*|/|\||&)?=\s*[^=].*;|\+\+\w+;|\w+\+\+;)\s*$"
)

# Which emulated tests a file's mutants run (`file: [test file, -k expression]`), most telling
# first; -x stops at the first failure.
TESTS = {
    "scaler": [
        (
            "test_emulated_ops.py",
            "grad_stats or unscale or clip or update_scale or partials or two_launches or norm_is",
        )
    ],
    "optim/optim": [("test_emulated_ops.py", "adam or sgd"), ("test_emulated_ties.py", "")],
    "optim/lowbit": [("test_emulated_lowbit.py", ""), ("test_emulated_ties.py", "")],
    "parallel": [("test_emulated_ops.py", "bucket")],
    "checkpoint": [("test_emulated_ops.py", "digest")],
    "common": [("test_emulated_ops.py", ""), ("test_emulated_lowbit.py", "")],
}


# Survivors that cannot be killed because they do not change what the code computes, each with
# the argument (keyed by Mutant.key; the results file lists them apart and leaves them out of the
# score).
EQUIVALENT: dict[str, str] = {
    "a27c8ae684": "the type of `a <= b` is the type of `a < b` (bool, or the vector mask type): "
    "only the type is used (decltype)",
}


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to csrc/
    line: int  # 1-based
    col: int
    op: str
    old_line: str
    new_line: str

    @property
    def key(self) -> str:
        return hashlib.sha256(
            f"{self.file}:{self.line}:{self.col}:{self.op}:{self.new_line}".encode()
        ).hexdigest()[:10]

    def source(self) -> str:
        lines = (CSRC / self.file).read_text().splitlines(keepends=True)
        assert lines[self.line - 1].rstrip("\n") == self.old_line, (
            f"{self.file}:{self.line} changed"
        )
        lines[self.line - 1] = self.new_line + "\n"
        return "".join(lines)


def kernel_files() -> list[str]:
    files = (
        sorted(CSRC.rglob("*.cu")) + sorted(CSRC.rglob("*.cuh")) + sorted(CSRC.rglob("*_math.h"))
    )
    return [str(p.relative_to(CSRC)) for p in files if "emu" not in p.parts]


def _code_spans(line: str) -> list[tuple[int, int]]:
    """The parts of `line` outside string/char literals and a trailing // comment."""
    spans, start, i, quote = [], 0, 0, None
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote, start = None, i + 1
        elif c in "\"'":
            spans.append((start, i))
            quote = c
        elif line.startswith("//", i):
            spans.append((start, i))
            return spans
        i += 1
    if not quote:
        spans.append((start, len(line)))
    return spans


def mutants_of(rel: str) -> list[Mutant]:
    out: list[Mutant] = []
    in_block_comment = False
    for n, line in enumerate((CSRC / rel).read_text().splitlines(), 1):
        stripped = line.strip()
        if in_block_comment:
            in_block_comment = "*/" not in stripped
            continue
        if stripped.startswith("/*"):
            in_block_comment = "*/" not in stripped
            continue
        if not stripped or stripped.startswith(
            ("//", "#", "///", "static_assert", "template", "FASTAMP_CHECK", "FASTAMP_ASSERT")
        ):
            continue
        spans = _code_spans(line)
        for pattern, repl, name in OPERATORS:
            for m in re.finditer(pattern, line):
                if not any(a <= m.start() and m.end() <= b for a, b in spans):
                    continue
                new = str(int(m.group(0)) + 1) if repl is None else repl
                mutated = line[: m.start()] + new + line[m.end() :]
                out.append(Mutant(rel, n, m.start(), name, line, mutated))
        if DELETABLE.match(line) and not re.match(r"^\s*(const\s+)?[\w:<>]+\s+[\w\[\]]+\s*=", line):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(
                Mutant(rel, n, len(indent), "delete statement", line, f"{indent}/* deleted */")
            )
    return out


def sample(per_file: int | None, seed: int) -> list[Mutant]:
    chosen: list[Mutant] = []
    for rel in kernel_files():
        ms = mutants_of(rel)
        if per_file is not None and len(ms) > per_file:
            ms = random.Random(f"{seed}:{rel}").sample(ms, per_file)
        chosen += sorted(ms, key=lambda m: (m.line, m.col, m.op))
    return chosen


def tests_for(rel: str) -> list[tuple[str, str]]:
    for prefix, tests in TESTS.items():
        if rel.startswith(prefix):
            return tests
    return TESTS["common"]


def run(m: Mutant, timeout: int) -> tuple[str, str]:
    """('killed' | 'survived' | 'stillborn', detail)."""
    sys.path.insert(0, str(HERE))
    import build

    out = build.DEFAULT_OUT / "mutate"
    try:
        lib = build.build(
            out, overrides={m.file: m.source()}, name=f"_cuda_emu_m{m.key}.so", jobs=1
        )
    except RuntimeError as e:
        return "stillborn", str(e).splitlines()[-1][:160] if str(e) else "compile error"
    env = dict(os.environ, FASTAMP_EMU_LIB=str(lib), OMP_NUM_THREADS="1")
    try:
        for test_file, k in tests_for(m.file):
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
            if k:
                cmd += ["-k", k]
            try:
                r = subprocess.run(
                    cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
                )
            except subprocess.TimeoutExpired:
                return "killed", f"{test_file}: timed out after {timeout}s (a hang)"
            if r.returncode != 0:
                out_text = r.stdout + r.stderr
                first = next((ln for ln in out_text.splitlines() if ln.startswith("FAILED")), "")
                if "failed" in out_text or "error" in out_text.lower():
                    return "killed", (first or f"{test_file}: pytest exited {r.returncode}")[:200]
        return "survived", ""
    finally:
        lib.unlink(missing_ok=True)


def _status(m: Mutant, status: str) -> str:
    return "equivalent" if status == "survived" and m.key in EQUIVALENT else status


def report(
    results: list[tuple[Mutant, str, str]], seconds: float, per_file: int | None, seed: int
) -> str:
    results = [(m, _status(m, st), d) for m, st, d in results]
    counted = [r for r in results if r[1] in ("killed", "survived")]
    killed = sum(1 for r in counted if r[1] == "killed")
    equivalent = [r for r in results if r[1] == "equivalent"]
    stillborn = sum(r[1] == "stillborn" for r in results)
    lines = [
        "# Mutation testing of the CUDA kernels (`make mutate`)",
        "",
        f"`python tests/cuda_emu/mutate.py --per-file {per_file} --seed {seed}`.",
        "Each mutant is built into its own emulator library and run against the emulated",
        "differential tests of its file (tests/cuda_emu/mutate.py).",
        "",
        f"- mutants run: {len(results)}: {stillborn} stillborn (did not compile), "
        f"{len(equivalent)} equivalent (argued below)",
        f"- killed: {killed} of the {len(counted)} non-equivalent mutants that compiled "
        f"({100 * killed / max(len(counted), 1):.1f}%)",
        f"- time: {seconds / 60:.0f} minutes on this machine's 2 cores",
        "",
        "| file | mutants | killed | survived | equivalent | stillborn |",
        "|---|---|---|---|---|---|",
    ]
    for rel in sorted({m.file for m, _, _ in results}):
        rs = [r for r in results if r[0].file == rel]
        n = {
            k: sum(r[1] == k for r in rs) for k in ("killed", "survived", "equivalent", "stillborn")
        }
        lines.append(
            f"| {rel} | {len(rs)} | {n['killed']} | {n['survived']} | {n['equivalent']} | "
            f"{n['stillborn']} |"
        )
    lines += ["", "## Survivors", ""]
    surv = [r for r in results if r[1] == "survived"]
    if not surv:
        lines.append("None.")
    for m, _, _ in surv:
        lines += [
            f"- `{m.file}:{m.line}` ({m.op}, mutant {m.key})",
            f"  - was: `{m.old_line.strip()}`",
            f"  - now: `{m.new_line.strip()}`",
        ]
    lines += ["", "## Equivalent mutants", ""]
    if not equivalent:
        lines.append("None.")
    for m, _, _ in equivalent:
        lines += [
            f"- `{m.file}:{m.line}` ({m.op}, mutant {m.key}): `{m.new_line.strip()}`",
            f"  - {EQUIVALENT[m.key]}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-file", type=int, default=None, help="mutants per file (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="results file (markdown)")
    ap.add_argument(
        "--min-score", type=float, default=None, help="exit 1 below this kill percentage"
    )
    a = ap.parse_args(argv)
    ms = sample(a.per_file, a.seed)
    if a.list:
        for m in ms:
            print(f"{m.key} {m.file}:{m.line} {m.op}: {m.new_line.strip()}")
        print(f"{len(ms)} mutants over {len({m.file for m in ms})} files")
        return 0
    t0 = time.time()
    results: list[tuple[Mutant, str, str]] = []

    def one(m: Mutant) -> tuple[Mutant, str, str]:
        status, detail = run(m, a.timeout)
        print(
            f"[{status:9}] {m.file}:{m.line} {m.op}: {m.new_line.strip()[:80]} {detail[:100]}",
            flush=True,
        )
        return m, status, detail

    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(one, ms))
    text = report(results, time.time() - t0, a.per_file, a.seed)
    if a.out:
        a.out.write_text(text)
    print(text)
    counted = [r for r in results if _status(r[0], r[1]) in ("killed", "survived")]
    score = 100 * sum(r[1] == "killed" for r in counted) / max(len(counted), 1)
    return 1 if a.min_score is not None and score < a.min_score else 0


if __name__ == "__main__":
    sys.exit(main())
