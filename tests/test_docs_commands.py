"""Docs drift: every command that README.md, docs/*.md and benchmarks/results/*.md tell a reader to
run is checked as written.

A command is a line of a fenced or indented code block, or an inline code span, that starts with
``make``, ``python``, ``.venv/bin/python``, ``torchrun`` or a ``.ci/`` script (environment
assignments such as ``FASTAMP_CPU_CAPABILITY=avx2`` in front allowed). What each is checked for:

* ``make <target> ...``: every target is a rule of the Makefile (and ``make -n`` accepts it).
* a script (``python path.py ...``, ``torchrun ... path.py ...``): the file exists and every
  ``--option`` written after it is one its ``--help`` lists (full tier: imports torch per script).
* ``python -m fastamp doctor ...`` and ``python -c "..."``: run as written; they must succeed (and
  the doctor print the lines the README shows it printing).
* ``.venv/bin/python -m pytest ... -k EXPR / -m EXPR``: the expressions select tests (full tier).
* a ``.ci/`` path: the file exists.

The long commands themselves (``make test-all``, the benchmarks, the torchrun examples) are run
elsewhere: CI runs the test tiers, tests/test_examples.py runs the documented torchrun commands
and the demo, the benchmark results name the commands that produced them. What is checked here is
that a reader who copies a command gets a command that exists, with options that exist.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from functools import cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (
    ["README.md"]
    + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    + sorted(
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.md"))
    )
)
_ENV = r"(?:[A-Z][A-Z0-9_]*=\S+\s+)*"
_START = re.compile(rf"^{_ENV}(?:make\b|python3?\s|\.venv/bin/python\s|torchrun\s|\.ci/[\w./-]+)")
_SPAN = re.compile(r"`([^`\n]+)`")


def _commands() -> list[tuple[str, int, str]]:
    """(file, line, command) for every documented command (see the module docstring)."""
    out: list[tuple[str, int, str]] = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            lines = f.read().splitlines()
        fence: str | None = None
        for n, line in enumerate(lines, 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                fence = None if fence is not None else stripped[3:].strip().lower()
                continue
            if fence is not None:
                if fence not in ("", "bash", "sh", "shell", "console", "text"):
                    continue  # a Python snippet: tests/integrations/test_readme.py runs those
                candidates = [stripped.removeprefix("$ ")]
            elif line.startswith("    ") and not line.lstrip().startswith(("-", "*")):
                candidates = [stripped.removeprefix("$ ")]
            else:
                candidates = [m.group(1).strip() for m in _SPAN.finditer(line)]
            for cand in candidates:
                cand = re.split(r"\s+#\s", cand, maxsplit=1)[0].strip()  # a trailing comment
                if _START.match(cand) and cand not in ("make", "python", "torchrun"):
                    out.append((doc, n, cand))
    return out


COMMANDS = _commands()


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.match(r"^[A-Z][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return words


@cache
def _make_targets() -> frozenset[str]:
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    names = set(re.findall(r"^([A-Za-z0-9_.%/$()-]+)\s*:(?!=)", text, re.M))
    for phony in re.findall(r"^\.PHONY:\s*(.+)$", text, re.M):
        names.update(phony.split())
    return frozenset(names)


def _script_of(words: list[str]) -> tuple[str, list[str]] | None:
    """(script path, the words after it) of a python/torchrun command, or None (python -m/-c)."""
    for k, w in enumerate(words):
        if w.endswith(".py") and not w.startswith("-"):
            return w, words[k + 1 :]
    return None


def _ids() -> list[str]:
    return [f"{doc}:{n}" for doc, n, _ in COMMANDS]


def test_the_docs_have_commands_to_check():
    """The extraction finds the README's commands (a broken parser would check nothing)."""
    found = {c for doc, _, c in COMMANDS if doc == "README.md"}
    assert any(c.startswith("make test") for c in found), sorted(found)
    assert any(c.startswith("torchrun") for c in found), sorted(found)
    assert len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize("doc, line, command", COMMANDS, ids=_ids())
def test_documented_command_names_what_exists(doc, line, command):
    words = _words(command)
    head = words[0]
    where = f"{doc}:{line}: {command!r}"
    if head == "make":
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        missing = [t for t in targets if t not in _make_targets()]
        assert not missing, f"{where}: no Makefile target {missing}"
        return
    if head.startswith(".ci/"):
        assert os.path.exists(os.path.join(ROOT, head)), f"{where}: no file {head}"
        return
    script = _script_of(words)
    if script is not None:
        path = script[0]
        assert os.path.isfile(os.path.join(ROOT, path)), f"{where}: no file {path}"


@cache
def _help(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


SCRIPT_COMMANDS = [
    (doc, n, c)
    for doc, n, c in COMMANDS
    if _script_of(_words(c)) is not None
    and any(w.startswith("--") for w in _script_of(_words(c))[1])  # type: ignore[index]
]


@pytest.mark.full  # runs each script's --help (imports torch each time)
@pytest.mark.parametrize(
    "doc, line, command", SCRIPT_COMMANDS, ids=[f"{d}:{n}" for d, n, _ in SCRIPT_COMMANDS]
)
def test_documented_script_options_exist(doc, line, command):
    path, rest = _script_of(_words(command))  # type: ignore[misc]
    if not os.path.isfile(os.path.join(ROOT, path)):
        pytest.fail(f"{doc}:{line}: no file {path}")
    listed = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", _help(path)))
    options = [w.split("=", 1)[0] for w in rest if w.startswith("--")]
    unknown = [o for o in options if o not in listed]
    assert not unknown, f"{doc}:{line}: {command!r}: {path} --help lists no {unknown}"


RUN_AS_WRITTEN = [
    (doc, n, c) for doc, n, c in COMMANDS if re.match(r"^python3? (-m fastamp doctor|-c )", c)
]


@pytest.mark.full  # each imports torch and fastamp (about 4 s)
@pytest.mark.parametrize(
    "doc, line, command", RUN_AS_WRITTEN, ids=[f"{d}:{n}" for d, n, _ in RUN_AS_WRITTEN]
)
def test_cheap_documented_commands_run_as_written(doc, line, command):
    words = _words(command)
    proc = subprocess.run(
        [sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{doc}:{line}: {command!r} failed:\n{proc.stderr[-2000:]}"
    if words[1:3] == ["-m", "fastamp"] and "--quiet" not in words:
        # What the README says it prints: versions, devices, how fastamp was built, a self-test.
        for section in ("environment", "devices", "fastamp build", "self-test on cpu"):
            assert re.search(rf"^{section}", proc.stdout, re.M), (section, proc.stdout[-1500:])


PYTEST_COMMANDS = [
    (doc, n, c) for doc, n, c in COMMANDS if re.search(r"-m pytest\b", c) and " -" in c
]


@pytest.mark.full  # collects the suite (about 15 s each)
@pytest.mark.parametrize(
    "doc, line, command", PYTEST_COMMANDS, ids=[f"{d}:{n}" for d, n, _ in PYTEST_COMMANDS]
)
def test_documented_pytest_selections_select_tests(doc, line, command):
    words = _words(command)
    args = words[words.index("pytest") + 1 :]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{doc}:{line}: {command!r}:\n{proc.stdout[-2000:]}"
    assert re.search(r"\b[1-9]\d* tests? collected|^\S+::", proc.stdout, re.M), proc.stdout[-500:]


# --- The Python snippets of README.md and docs/*.md run as written --------------------------------
#
# Every ```python block runs in a fresh interpreter on the CPU, as a reader would paste it. A block
# directly under ``<!-- readme-test: NAME -->`` is run by tests/integrations/test_readme.py (the
# client integrations, with their packages); one under ``<!-- snippet: skip REASON -->`` is not run,
# and must say why (a GPU, several processes); ``<!-- snippet: NAME -->`` names a block whose
# output a test below checks too.

SNIPPET_DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
_MARK = re.compile(r"^\s*<!--\s*(readme-test|snippet):\s*(.*?)\s*-->\s*$")


def _snippets() -> list[tuple[str, int, str, str, str]]:
    """(file, line of the fence, code, mark, mark text) of every ```python block; mark is
    "readme-test", "skip", "named" or "" (the line directly above the fence, if it is a mark)."""
    out = []
    for doc in SNIPPET_DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            lines = f.read().splitlines()
        n = 0
        while n < len(lines):
            stripped = lines[n].strip()
            if stripped.startswith("```") and stripped[3:].strip().lower() in ("python", "py"):
                indent = len(lines[n]) - len(lines[n].lstrip())
                end = n + 1
                while end < len(lines) and lines[end].strip() != "```":
                    end += 1
                code = "\n".join(line[indent:] for line in lines[n + 1 : end]) + "\n"
                mark, text = "", ""
                m = _MARK.match(lines[n - 1]) if n else None
                if m:
                    mark, text = m.group(1), m.group(2)
                    if mark == "snippet":
                        if text == "skip" or text.startswith("skip "):
                            mark, text = "skip", text[4:].strip()
                        else:
                            mark = "named"
                out.append((doc, n + 1, code, mark, text))
                n = end
            n += 1
    return out


SNIPPETS = _snippets()
RUNNABLE = [(doc, n, code, text) for doc, n, code, mark, text in SNIPPETS if mark in ("", "named")]
# How many snippets are not run here: adding one to the list is a decision this count records.
SKIPPED_SNIPPETS = 7


def test_the_docs_python_snippets_are_found_and_skips_say_why():
    """The extraction finds the README's quick start; each skipped snippet gives a reason of a
    few words, and the number skipped is the one recorded above."""
    assert any(doc == "README.md" and text == "quickstart" for doc, _, _, text in RUNNABLE)
    assert len(RUNNABLE) >= 5, [(d, n) for d, n, _, _ in RUNNABLE]
    skipped = [(doc, n, text) for doc, n, _, mark, text in SNIPPETS if mark == "skip"]
    vague = [(doc, n, text) for doc, n, text in skipped if len(text.split()) < 3]
    assert not vague, f"a skipped snippet must say why it cannot run here: {vague}"
    assert len(skipped) == SKIPPED_SNIPPETS, skipped


def test_readme_starts_with_the_code():
    """A reader meets the quick start in the first screen: the first ``import fastamp`` of
    README.md within its first 40 lines, inside the quick start snippet."""
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    first = next(n for n, line in enumerate(lines, 1) if line.strip() == "import fastamp")
    assert first <= 40, f"README.md's first `import fastamp` is at line {first}"
    start = next(n for d, n, _, text in RUNNABLE if d == "README.md" and text == "quickstart")
    assert start < first, (start, first)


def _run_snippet(code: str, cwd) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.parametrize(
    "doc, line, code, name",
    [
        pytest.param(
            *s, id=f"{s[0]}:{s[1]}", marks=[] if s[3] == "quickstart" else [pytest.mark.full]
        )
        for s in RUNNABLE
    ],
)
def test_python_snippet_runs_as_written(doc, line, code, name, tmp_path):
    proc = _run_snippet(code, tmp_path)
    assert proc.returncode == 0, (
        f"{doc}:{line}: the snippet failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    # Dynamo's warnings (a cache it traces through, a graph break) are for fastamp to fix, not for
    # a reader of the docs to wonder about.
    assert "torch._dynamo" not in proc.stderr and "Silent incorrectness" not in proc.stderr, (
        f"{doc}:{line}: the snippet printed Dynamo warnings:\n{proc.stderr[-4000:]}"
    )
    if name == "quickstart":
        # It trains with the loss really scaled (fp16 autocast on the CPU too), and learns.
        m = re.search(r"accuracy ([\d.]+)%, loss scale (\S+)", proc.stdout)
        assert m, proc.stdout
        assert float(m.group(1)) > 90 and float(m.group(2)) > 1, proc.stdout
