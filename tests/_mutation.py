"""What the CPU-kernel and Python mutation tiers (tests/mutate_cpu.py, tests/mutate_python.py)
share: each writes its mutants over a worktree's files, so the tests must import fastamp from that
checkout, and a mutant is killed when they fail."""

from __future__ import annotations

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
    if r.returncode != 0:
        first = next((ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
        return "killed", first[:200] or f"pytest exited {r.returncode}"
    return "survived", ""
