"""Mutation testing of the Python step logic (the scaler's and the optimizers' modules): generated
mutants, each written over its module in place (and always put back), run against the tests of
its capability.

Operators, on the module's syntax tree, one node at a time: a comparison flipped (`<` <-> `<=`,
`>` <-> `>=`, `==` <-> `!=`, `is` <-> `is not`, `in` <-> `not in`), `and` <-> `or`, `+` <-> `-`,
`*` <-> `/`, an integer constant `n` -> `n + 1`, `True` <-> `False`, `not x` -> `x`. Docstrings,
messages (f-strings and string constants) and type annotations are not mutated.

    make mutate-python    # in a worktree of HEAD: see the Makefile

A mutant is killed when its capability's tests fail (or hang past the limit); survivors are listed
in the results file.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mutation import mutation_parser, run_tests, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "fastamp"
# module: its tests, most telling first (-x stops at the first failure). The scaler's modules
# also run the fastamp optimizers' tests (the fused clip hands its coefficient to their update),
# DDP's statistics-reuse test (clip_grad_norm_ reuses what DDP's unpack measured) and FSDP2's
# recipe test.
_SCALER = [
    "tests/scaler/test_grad_scaler.py",
    "tests/scaler/test_scaler_fidelity.py",
    "tests/scaler/test_clip_no_scaler.py",
    # the steady state's direct kernel calls against the dispatcher's (bits, write counters)
    "tests/optim/test_direct_calls.py",
    "tests/scaler",
    "tests/optim/test_optimizers.py",
    "tests/parallel/test_ddp_parity.py::test_same_as_torchs_ddp[statistics_reused_only_while_grads_unchanged-2]",
    # its workers also check the refusals of grads sharded differently (scaler/_grads.py)
    "tests/parallel/test_fsdp.py::test_recipe_matches_torch_with_one_collective",
]
# The optimizers' modules: their tests, the scaler's (which drive them), and FSDP2's recipe and
# sharded-checkpoint tests (DTensor params, grads and state).
_OPTIM = [
    "tests/optim/test_optimizers.py",
    "tests/optim/test_optim_fidelity.py",
    "tests/optim",
    "tests/scaler/test_grad_scaler.py",
    "tests/parallel/test_fsdp.py",
]
# The flat buffers (issue 53's widening): their own tests, the every-mode survival test (deepcopy,
# pickle, state_dict both ways, refusals) and the compiled recipe over flat grads.
_FLAT = [
    "tests/optim/test_flat_buffers.py",
    "tests/optim/test_flat_sparse.py",
    "tests/optim/test_every_mode_survives.py",
    "tests/optim/test_compile_step.py::test_flat_buffers_recipe_compiles_fullgraph_and_equals_eager",
]
# DDP's comm hook: the hook's own tests, the parity suite against torch's reducer (its division
# order included) and the scaler-free step fed by the hook's statistics.
_COMM = [
    "tests/parallel/test_ddp.py",
    "tests/parallel/test_ddp_parity.py",
    "tests/parallel/test_bf16_step.py",
]
# The scaler-free clip: its tests, DDP/FSDP2's bf16 step and every optimizer mode under it.
_CLIP = [
    "tests/scaler/test_clip_no_scaler.py",
    "tests/parallel/test_bf16_step.py",
    "tests/optim/test_every_mode_survives.py",
]
# The Python op layer (argument checks, fake kernels, typed wrappers): each op family's op and
# misuse tests, write counters, and the differential tests that call the ops through the classes.
# (parallel/_ops.py has no mutable site: its wrappers only pass their arguments on.)
_OPS = {
    "scaler/_ops.py": [
        "tests/scaler/test_ops.py",
        "tests/scaler/test_misuse.py",
        "tests/scaler/test_inverse_scale.py",
        "tests/test_write_counters.py",
        "tests/scaler/test_grad_scaler.py",
    ],
    "optim/_ops.py": [
        "tests/optim/test_optim_ops.py",
        "tests/optim/test_held_ops.py",
        "tests/optim/test_misuse.py",
        "tests/optim/test_direct_calls.py",
        "tests/test_write_counters.py",
    ],
    "checkpoint/_ops.py": [
        "tests/checkpoint/test_checkpoint_ops.py",
        "tests/checkpoint/test_misuse.py",
        "tests/checkpoint/test_checkpoint.py",
        "tests/test_write_counters.py",
    ],
}
FILES = {
    "scaler/grad_scaler.py": _SCALER,
    "scaler/_grads.py": _SCALER,
    "scaler/_clip.py": _SCALER,
    "scaler/clip.py": _CLIP,
    "optim/optimizers.py": _OPTIM,
    "optim/_stepper.py": _OPTIM,
    "optim/_build.py": _OPTIM,
    "optim/_replay.py": _OPTIM,
    "optim/_state_dict.py": _OPTIM,
    "optim/_step_checks.py": _OPTIM,
    "optim/lowbit.py": _OPTIM,
    "optim/_flat.py": _FLAT,
    "parallel/_comm.py": _COMM,
    # the sharded (torch.distributed.checkpoint) files' entries: FSDP2's checkpoint test
    "resume/_checksums.py": [
        "tests/resume",
        "tests/parallel/test_fsdp.py::test_checkpoint_round_trip_and_resharded_resume",
    ],
    **_OPS,
}

# Survivors no test here can kill, by "file:line:mutated text" -> why: equivalent (no
# observable difference) or unreachable on a machine with one device.
_ONE_DEVICE = (
    "unreachable on a one-device machine: the sum runs over the grads' devices, and CPU-only "
    "tests have one (two GPUs in one process would reach it)"
)
EQUIVALENT: dict[str, str] = {
    "scaler/grad_scaler.py:390:total - v": _ONE_DEVICE,
    "scaler/_clip.py:81:2": _ONE_DEVICE,
    "scaler/_clip.py:82:total - p": _ONE_DEVICE,
    "optim/optimizers.py:245:pid <= len(params)": "equivalent: the state_dict torch builds numbers "
    "its state by parameter position, so every key is below len(params); the guard is for keys "
    "no state_dict of this optimizer has",
    "optim/_state_dict.py:268:pid <= len(counts)": "equivalent: as above, the keys of the "
    "state_dict torch builds number params by position, each below len(counts) (one per param)",
    "checkpoint/_ops.py:75:j == 0 and previous[j].numel() > 0": "unreachable without CUDA: "
    "states[j] for j > 0 are CUDA generators' states, and on a CPU-only machine only the CPU "
    "generator's (j == 0) is restored",
    "checkpoint/_ops.py:122:1": "unreachable without CUDA: the fake kernel's CUDA generators' "
    "sizes (torch.cuda.is_available() is False here)",
    "scaler/_ops.py:129:t.requires_grad": "equivalent: only the scaler passes a keyset to "
    "record_overflow_, with its own five tensors, none of which requires grad (the guard keeps "
    "a direct call from skipping autograd's checks for other callers)",
    "optim/lowbit.py:266:True": "equivalent: the default of Int8Format.check's any_device is "
    "never used; its one caller (check_any) always passes it",
    "optim/optimizers.py:515:1": "equivalent: the default seed of the stochastic-rounding stream "
    "(state_seed=1 instead of 0); any seed is a valid default, and results are compared with a "
    "reference given the same seed",
}

_FLIP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.And: ast.Or, ast.Or: ast.And,
}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    file: str
    index: int  # the n-th mutable site of the file, in tree order
    what: str
    line: int


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """Nodes not to mutate: docstrings, f-strings, annotations and everything under them."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.JoinedStr):
            roots.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots += [a.annotation for a in node.args.args + node.args.kwonlyargs if a.annotation]
            roots += [node.returns] if node.returns else []
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        if isinstance(node, (ast.Raise, ast.Assert)):
            roots.append(node)  # messages and the exception's text
        for r in roots:
            skip |= {id(n) for n in ast.walk(r)}
    return skip


def _sites(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    skip = _skipped_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            out += [(node, f"compare {i}") for i, op in enumerate(node.ops) if type(op) in _FLIP]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _FLIP:
            out.append((node, "operator"))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            out.append((node, "constant"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((node, "drop not"))
    return out


def mutants_of(rel: str) -> list[Mutant]:
    tree = ast.parse((PKG / rel).read_text())
    return [
        Mutant(rel, i, f"{what} ({type(n).__name__})", getattr(n, "lineno", 0))
        for i, (n, what) in enumerate(_sites(tree))
    ]


def mutated_source(m: Mutant) -> tuple[str, str]:
    """(the module's mutated text, the mutated line as unparsed)."""
    tree = ast.parse((PKG / m.file).read_text())
    node, what = _sites(tree)[m.index]
    if what.startswith("compare"):
        i = int(what.split()[1])
        node.ops[i] = _FLIP[type(node.ops[i])]()
    elif what == "operator":
        node.op = _FLIP[type(node.op)]()
    elif what == "constant":
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    elif what == "drop not":
        parent = next(p for p in ast.walk(tree) for c in ast.iter_child_nodes(p) if c is node)
        for field, value in ast.iter_fields(parent):
            if value is node:
                setattr(parent, field, node.operand)
            elif isinstance(value, list):
                setattr(parent, field, [node.operand if v is node else v for v in value])
    snippet = ast.unparse(copy.deepcopy(node if what != "drop not" else node.operand))
    return ast.unparse(tree), snippet[:120]


def key(m: Mutant) -> str:
    """The mutant and what decides its fate: its module's text and the tests it runs."""
    text = (PKG / m.file).read_text()
    return hashlib.sha256(
        "\0".join([m.file, str(m.index), text, *FILES[m.file]]).encode()
    ).hexdigest()[:16]


def run(m: Mutant, timeout: int) -> tuple[str, str]:
    path = PKG / m.file
    original = path.read_text()
    text, _ = mutated_source(m)
    try:
        path.write_text(text)
        return run_tests(ROOT, FILES[m.file], timeout)
    finally:
        path.write_text(original)


def _argued(m: Mutant) -> str | None:
    """Why ``m`` is equivalent or unreachable here (EQUIVALENT), or None."""
    return EQUIVALENT.get(f"{m.file}:{m.line}:{mutated_source(m)[1]}")


def main(argv: list[str] | None = None) -> int:
    ap = mutation_parser(__doc__, per_file=6)
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="write the results file from the cache alone (survivors are not run again)",
    )
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="start no mutant after this many minutes; the report then counts the mutants with "
        "an outcome and names how many of the sample have none (modules are taken in turns, "
        "so a cut-off pass still samples each)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these modules' mutants (as FILES names them); the others are reported "
        "from the cache of outcomes, or counted as having none",
    )
    a = ap.parse_args(argv)
    state = json.loads(a.state.read_text()) if a.state and a.state.exists() else {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # restore the module on a kill
    per_module: list[list[Mutant]] = []
    for rel in FILES:
        ms = mutants_of(rel)
        per_module.append(
            sorted(
                random.Random(f"{a.seed}:{rel}").sample(ms, min(a.per_file, len(ms))),
                key=lambda m: m.index,
            )
        )
    # In turns: each module's first mutant, then each one's second, ...
    chosen = [ms[i] for i in range(a.per_file) for ms in per_module if i < len(ms)]
    if a.list:
        for m in chosen:
            print(m.file, m.line, m.what, mutated_source(m)[1])
        return 0
    t0 = time.time()
    results = []
    not_run = 0
    for m in chosen:
        k = key(m)
        # Tests only grow: a killed mutant stays killed; a survivor runs again every time.
        if a.report_only and k not in state:
            raise SystemExit(f"--report-only: {m.file}:{m.line} {m.what} has no cached outcome")
        # A survivor argued equivalent below is not run again: no test is expected to kill it.
        argued = state.get(k, [""])[0] == "survived" and _argued(m)
        cached = state.get(k, [""])[0] == "killed" or a.report_only or argued
        if a.only is not None and m.file not in a.only and not cached:
            cached = k in state  # not run now: its last outcome, if any
        if not cached and (
            (a.only is not None and m.file not in a.only)
            or (a.minutes is not None and time.time() - t0 > 60 * a.minutes)
        ):
            not_run += 1
            continue
        status, detail = state[k] if cached else run(m, a.timeout)
        if a.state:
            state[k] = [status, detail]
            a.state.write_text(json.dumps(state, indent=1))
        print(
            f"[{status:8}] {m.file}:{m.line} {m.what}: {mutated_source(m)[1][:70]} {detail[:90]}",
            flush=True,
        )
        results.append((m, status, detail))

    why = _argued

    results = [(m, "equivalent" if s == "survived" and why(m) else s, d) for m, s, d in results]
    counted = [r for r in results if r[1] != "equivalent"]
    killed = sum(s == "killed" for _, s, _ in counted)
    lines = [
        "# Mutation testing of the Python step logic (`tests/mutate_python.py`)",
        "",
        f"`make mutate-python` (`--per-file {a.per_file} --seed {a.seed}`): {len(results)} "
        f"mutants over {len(FILES)} modules; {len(results) - len(counted)} argued equivalent or "
        f"unreachable here; {killed} of the {len(counted)} others killed "
        f"({100 * killed / max(len(counted), 1):.1f}%); "
        + (
            "regenerated from the cache of outcomes (--report-only)."
            if a.report_only
            else f"{(time.time() - t0) / 60:.0f} minutes (killed mutants cached)."
        )
        + (
            f" **{not_run} mutants of the sample have no outcome yet** (not run in the time "
            f"given): the score is over the {len(results)} that have one."
            if not_run
            else ""
        ),
        "",
        "| module | mutants | killed |",
        "|---|---|---|",
    ]
    for rel in FILES:
        rs = [r for r in results if r[0].file == rel]
        lines.append(
            f"| python/fastamp/{rel} | {len(rs)} | {sum(s == 'killed' for _, s, _ in rs)} |"
        )
    lines += ["", "## Survivors", ""]
    surv = [m for m, s, _ in results if s == "survived"]
    lines += [f"- `{m.file}:{m.line}` {m.what}: `{mutated_source(m)[1]}`" for m in surv] or [
        "None."
    ]
    lines += ["", "## Equivalent or unreachable here", ""]
    lines += [
        f"- `{m.file}:{m.line}` {m.what}: `{mutated_source(m)[1]}`: {why(m)}"
        for m, s, _ in results
        if s == "equivalent"
    ] or ["None."]
    return write_report(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
