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
import json
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
            "grad_stats or unscale or clip or update_scale or partials or two_launches or norm_is or vectors",
        )
    ],
    "optim/optim": [
        ("test_emulated_ops.py", "adam or sgd or vectors"),
        ("test_emulated_ties.py", ""),
    ],
    "optim/lowbit": [("test_emulated_lowbit.py", ""), ("test_emulated_ties.py", "")],
    "parallel": [("test_emulated_ops.py", "bucket")],
    "checkpoint": [("test_emulated_ops.py", "digest")],
    "common": [("test_emulated_ops.py", ""), ("test_emulated_lowbit.py", "")],
}


# Survivors that cannot be killed because they do not change what the code computes, each with
# the argument (keyed by Mutant.key; the results file lists them apart and leaves them out of the
# score).
# Survivors that are not equivalent: what the emulator cannot see that lets them live.
GAPS: dict[str, str] = {
    "6e33ace2e7": "warp 0 of the block reduction reads warp slots 16-31 of its shared scratch, "
    "which no thread wrote. The emulator's shared memory (thread-local statics) starts at zero, "
    "the identity of the sums, so the result is unchanged here; on a GPU it is whatever the last "
    "block left. The instrumentation cannot check it: GCC's ThreadSanitizer pass does not "
    "instrument thread-local variables, which is what __shared__ becomes under the emulator",
}

EQUIVALENT: dict[str, str] = {
    "a27c8ae684": "the type of `a <= b` is the type of `a < b` (bool, or the vector mask type): "
    "only the type is used (decltype)",
    "495c0a3014": "a word with exactly 8 bytes left takes the byte-by-byte path instead, which "
    "assembles the same 8 bytes into the same word",
    "7d35f341aa": "launch geometry only: one more digest block when the word count is a "
    "multiple of 256, in a grid-strided loop (the extra block finds no word and adds 0)",
    "07d6bc6cf7": "launch geometry only: finish blocks of 257 threads for a grid sized by 256; "
    "the extra threads fail the i < n guard",
    "9f5537532a": "launch geometry only: one more block than needed at most, and the digest "
    "loop is grid-strided (an extra block finds no word below nwords)",
    "1e25410fc5": "launch geometry only: a cap of 1025 blocks instead of 1024 in a grid-strided "
    "loop",
    "93a614e496": "launch geometry only: one more block when n is a multiple of 256, whose "
    "threads all fail the i < n guard",
    "68ccb44855": "thread 1 instead of thread 0 computes the block's shared coefficients before "
    "the barrier (every block has 512 threads)",
    "c399087391": "after the xor butterfly every lane holds the warp's maximum: lanes 1-31 "
    "instead of lane 0 store the same value to the same slot",
    "ee252facc0": "threads 1-511 instead of thread 0 store the same step count to the same slot",
    "efe93894dc": "thread 1 instead of thread 0 stores the step count",
    "5059ddb2df": "thread 1 instead of thread 0 adds the one step (each step tensor is one block)",
    "684fa77612": "a weakened internal assertion on the launcher's own list counts, which hold "
    "for every call the ops make",
    "a889b1d164": "the non-finite probe adds 0 (finite) or NaN (inf/NaN): subtracting them "
    "gives 0 and NaN alike",
    "ae85c94c5a": "as a889b1d164, in the stats kernel",
    "be41fb2f20": "one more vector iteration at most, whose `valid` is 0: nothing is loaded, "
    "applied or stored",
    "e570ab5136": "as be41fb2f20 (one more vector iteration when n is a multiple of V)",
    "e251561208": "a max over absolute values: for a == b both choices are the same number "
    "(no -0.0 among |x|)",
    "cc6f100449": "at successful == INT32_MAX both branches give INT32_MAX",
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


def _compile(build, rel: str, headers: dict[str, str], text: str | None, mode: str) -> str:
    """Translation unit `rel` as the emulator build compiles it, with `headers` replaced through
    a shadow folder and `text` standing in for the unit itself: after the preprocessor
    (mode "E") or as the disassembly of its object (mode "S")."""
    import tempfile

    cflags, _ = build.torch_flags()
    cmd = [os.environ.get("CXX", "g++"), *build.base_flags(False), *cflags]
    with tempfile.TemporaryDirectory() as tmp:
        for h, t in headers.items():
            (Path(tmp) / "shadow" / h).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / "shadow" / h).write_text(t)
        src = CSRC / rel
        extra = [f"-I{Path(tmp) / 'shadow'}"] if headers else []
        if text is not None:
            src = Path(tmp) / "src" / Path(rel).name
            src.parent.mkdir()
            src.write_text(text)
            extra.append(f"-I{(CSRC / rel).parent}")
        cmd = [cmd[0], *extra, *cmd[1:], "-x", "c++", str(src)]
        if mode == "E":
            return subprocess.run(
                [*cmd, "-E", "-P"], capture_output=True, text=True, check=True
            ).stdout
        obj = Path(tmp) / "unit.o"
        subprocess.run([*cmd, "-c", "-o", str(obj)], capture_output=True, text=True, check=True)
        dis = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(obj)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return "\n".join(dis.splitlines()[2:])  # without the file name line


def unreachable(m: Mutant) -> bool:
    """Whether the emulator build never runs the mutation: every translation unit it reaches
    preprocesses to the same text (a line of the real-GPU `<<<...>>>` branch of gpu.cuh) or
    compiles to the same machine code (code only the CPU kernels instantiate)."""
    sys.path.insert(0, str(HERE))
    import build

    if m.file.endswith(".cu"):
        cases = [(m.file, {}, m.source())]
    else:
        units = [
            u for u in build.HOST_SOURCES + build.cuda_sources() if m.file in build.includes(u)
        ]
        cases = [(u, {m.file: m.source()}, None) for u in units]
    for unit, headers, text in cases:
        if _compile(build, unit, headers, text, "E") == _compile(build, unit, {}, None, "E"):
            continue
        if _compile(build, unit, headers, text, "S") != _compile(build, unit, {}, None, "S"):
            return False
    return True


def run(m: Mutant, timeout: int) -> tuple[str, str]:
    """('killed' | 'survived' | 'stillborn' | 'unreachable', detail)."""
    sys.path.insert(0, str(HERE))
    import build
    from mutants import pytest_cmd

    out = build.DEFAULT_OUT / "default"  # the ordinary build's objects are reused
    try:
        lib = build.build(
            out, overrides={m.file: m.source()}, name=f"_cuda_emu_m{m.key}.so", jobs=1
        )
    except RuntimeError as e:
        return "stillborn", str(e).splitlines()[-1][:160] if str(e) else "compile error"
    env = dict(os.environ, FASTAMP_EMU_LIB=str(lib), OMP_NUM_THREADS="1")
    try:
        for test_file, k in tests_for(m.file):
            cmd = pytest_cmd(test_file, k)
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
        if unreachable(m):
            return "unreachable", "the emulator build compiles it to the same code"
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
    unreach = sum(r[1] == "unreachable" for r in results)
    lines = [
        "# Mutation testing of the CUDA kernels (`make mutate`)",
        "",
        f"`python tests/cuda_emu/mutate.py --per-file {per_file} --seed {seed}`.",
        "Each mutant is built into its own emulator library and run against the emulated",
        "differential tests of its file (tests/cuda_emu/mutate.py).",
        "",
        f"- mutants run: {len(results)}: {stillborn} stillborn (did not compile), {unreach} "
        "unreachable (the emulator build's code is unchanged: the real-GPU branch, CPU-only "
        "helpers), "
        f"{len(equivalent)} equivalent (argued below)",
        f"- killed: {killed} of the {len(counted)} non-equivalent mutants that compiled "
        f"({100 * killed / max(len(counted), 1):.1f}%)",
        f"- time: {seconds / 60:.0f} minutes on this machine's 2 cores (this run; with --state, "
        "only the mutants not yet killed, stillborn or unreachable ran)",
        "",
        "| file | mutants | killed | survived | equivalent | stillborn | unreachable |",
        "|---|---|---|---|---|---|---|",
    ]
    for rel in sorted({m.file for m, _, _ in results}):
        rs = [r for r in results if r[0].file == rel]
        n = {
            k: sum(r[1] == k for r in rs)
            for k in ("killed", "survived", "equivalent", "stillborn", "unreachable")
        }
        lines.append(
            f"| {rel} | {len(rs)} | {n['killed']} | {n['survived']} | {n['equivalent']} | "
            f"{n['stillborn']} | {n['unreachable']} |"
        )

    def survivor(m: Mutant) -> list[str]:
        gap = [f"  - not equivalent: {GAPS[m.key]}"] if m.key in GAPS else []
        return [
            f"- `{m.file}:{m.line}` ({m.op}, mutant {m.key})",
            f"  - was: `{m.old_line.strip()}`",
            f"  - now: `{m.new_line.strip()}`",
            *gap,
        ]

    def argued(m: Mutant) -> list[str]:
        return [
            f"- `{m.file}:{m.line}` ({m.op}, mutant {m.key}): `{m.new_line.strip()}`",
            f"  - {EQUIVALENT[m.key]}",
        ]

    for title, rows, entry in (
        ("Survivors", [r for r in results if r[1] == "survived"], survivor),
        ("Equivalent mutants", equivalent, argued),
    ):
        lines += ["", f"## {title}", ""]
        lines += [line for m, _, _ in rows for line in entry(m)] or ["None."]
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
        "--state",
        type=Path,
        default=None,
        help="JSON of each mutant's outcome: read, a mutant already killed, stillborn or "
        "unreachable is not run again (tests only grow); written back at the end",
    )
    ap.add_argument(
        "--min-score", type=float, default=None, help="exit 1 below this kill percentage"
    )
    ap.add_argument("--keys", nargs="+", default=None, help="run these mutants only (CI's sample)")
    a = ap.parse_args(argv)
    ms = sample(a.per_file, a.seed)
    if a.keys:
        by_key = {m.key: m for m in sample(None, a.seed)}
        missing = [k for k in a.keys if k not in by_key]
        if missing:
            print(f"mutants {missing} no longer exist (their line changed): update the sample")
            return 1
        ms = [by_key[k] for k in a.keys]
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

    done: dict[str, list[str]] = {}
    if a.state is not None and a.state.exists():
        done = json.loads(a.state.read_text())
    final = ("killed", "stillborn", "unreachable")
    todo = [m for m in ms if done.get(m.key, [""])[0] not in final]
    with ThreadPoolExecutor(a.jobs) as pool:
        fresh = {m.key: (m, st, d) for m, st, d in pool.map(one, todo)}
    results = [fresh.get(m.key) or (m, done[m.key][0], done[m.key][1]) for m in ms]
    if a.state is not None:
        a.state.write_text(json.dumps({m.key: [st, d] for m, st, d in results}, indent=0))
    text = report(results, time.time() - t0, a.per_file, a.seed)
    if a.out:
        a.out.write_text(text)
    print(text)
    counted = [r for r in results if _status(r[0], r[1]) in ("killed", "survived")]
    score = 100 * sum(r[1] == "killed" for r in counted) / max(len(counted), 1)
    return 1 if a.min_score is not None and score < a.min_score else 0


if __name__ == "__main__":
    sys.exit(main())
