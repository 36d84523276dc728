"""The README's integration snippets run as written (each in a fresh interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def snippets() -> dict[str, str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = dict(re.findall(r"<!-- readme-test: (\w+) -->\n```python\n(.*?)```", text, re.S))
    return found


# snippet name -> the client package it needs (None: runs in the default tier)
NEEDS = {
    "lightning": "lightning",
    "accelerate": "accelerate",
    "transformers": "transformers",
    "timm": None,
}


def test_every_client_has_a_snippet():
    assert set(snippets()) == set(NEEDS)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.clients) if pkg else n for n, pkg in NEEDS.items()],
)
def test_readme_snippet_runs(name, tmp_path):
    if NEEDS[name]:
        pytest.importorskip(NEEDS[name])
    code = snippets()[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, (
        f"README snippet {name!r} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    )
