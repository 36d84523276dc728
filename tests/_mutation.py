"""What the CPU-kernel and Python mutation tiers (tests/mutate_cpu.py, tests/mutate_python.py)
share: each writes its mutants over a worktree's files, so the tests must import fastamp from that
checkout, and a mutant is killed when they fail."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def checkout_env(root: Path) -> dict[str, str]:
    """The environment in which `root`'s tests import fastamp from `root`: its python/ first on
    the path, the main checkout's editable finder dropped (a sitecustomize), and this venv's tools
    (cmake, ninja) on PATH. Its compiled parts must be in root/python/fastamp (the make targets
    copy them)."""
    site = root / "build" / "mutate-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path"
        " if 'editable' not in type(f).__module__.lower()]\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(root / "python")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_tests(root: Path, files: list[str], timeout: int) -> tuple[str, str]:
    """("killed", the first failure) or ("survived", "") for `files` (stopping at the first
    failure); a run past `timeout` seconds counts as killed."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, cwd=root, timeout=timeout, env=checkout_env(root)
        )
    except subprocess.TimeoutExpired:
        return "killed", f"timed out after {timeout}s"
    if r.returncode in (3, 4, 5):
        # pytest's internal error, usage error (a test id that no longer exists) and "no tests
        # collected" say nothing about the mutant: a kill counted from them would be false.
        raise RuntimeError(
            f"the mutant's test run could not run ({' '.join(files)}): pytest exited "
            f"{r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}"
        )
    if r.returncode != 0:
        first = next((ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
        return "killed", first[:200] or f"pytest exited {r.returncode}"
    return "survived", ""


def mutation_parser(doc: str | None, per_file: int) -> argparse.ArgumentParser:
    """The options both tiers take (--per-file, --seed, --timeout, --out, --list, --state)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-file", type=int, default=per_file)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--state", type=Path, default=None, help="cache of results (JSON) to reuse")
    return ap


def write_report(lines: list[str], out: Path | None) -> int:
    """Prints the report (and writes it to ``out`` when given); the tier's exit status (0)."""
    text = "\n".join(lines) + "\n"
    if out:
        out.write_text(text)
    print(text)
    return 0
