"""What a new user reads matches what runs: the build tools pinned alike in the Makefile and the
Dockerfile, the README's compile-step count that of the last build, the LICENSE that of
pyproject.toml, and a bare `make` that explains instead of building."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_build_tools_pinned_alike_in_makefile_and_dockerfile():
    make = re.search(r"^BUILD_TOOLS := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    docker = re.search(
        r'^RUN pip install --no-cache-dir (".*")$', (ROOT / "Dockerfile").read_text(), re.M
    )
    assert make and docker
    pins = sorted(re.findall(r'"([^"]+)"', make.group(1)))
    assert pins == sorted(re.findall(r'"([^"]+)"', docker.group(1))), (pins, docker.group(1))
    assert all("==" in p for p in pins), pins


def test_readme_compile_step_count_is_the_builds():
    # The build's steps: one compile per source (compile_commands.json, which CMake writes for the
    # build .venv makes) and the link. Read from the build tree, not the last log: an incremental
    # build logs only what it recompiled.
    commands = ROOT / "build" / ".venv" / "compile_commands.json"
    if not commands.exists():
        pytest.skip("no build tree (build/.venv is written by make)")
    steps = len(json.loads(commands.read_text())) + 1
    readme = re.search(r"print\s+as `\[n/(\d+)\]` lines", (ROOT / "README.md").read_text())
    assert readme, "the README no longer states the compile-step count"
    assert int(readme.group(1)) == steps, (readme.group(1), steps)


def test_license_file_matches_pyproject():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "BSD-3-Clause"$', pyproject, re.M)
    assert re.search(r'^license-files = \["LICENSE"\]$', pyproject, re.M)


def test_bare_make_lists_the_targets_and_builds_nothing():
    # As a user types it: not as a sub-make of `make test` (which would print its directory).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "-n"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )  # -n: what a bare `make` would run
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines and all(line.startswith("echo ") for line in lines), lines
    shown = subprocess.run(["make"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    for target in ("demo", "test", "test-clients", "bench", "cuda-build", "sanitize", "lint"):
        assert f"make {target}" in shown.stdout, target


def test_library_check_passes_ours_and_catches_a_classic_api_library():
    # .ci/check_library.py (CI runs it on both builds): fastamp's library uses torch only through
    # the stable ABI; the CUDA emulator's test library, built against libtorch's C++ API on
    # purpose, is the planted violation it must catch.
    import sys

    import fastamp._C

    if not (Path(sys.executable).parent / "torch-abi-audit").exists():
        pytest.skip("torch-abi-audit is not installed (requirements/wheel.txt)")
    check = [sys.executable, str(ROOT / ".ci" / "check_library.py")]
    ours = subprocess.run([*check, fastamp._C.__file__], capture_output=True, text=True)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert "Torch ABI:   STABLE" in ours.stdout and "Min torch:   2.11" in ours.stdout
    emu = ROOT / "build" / "cuda_emu" / "default" / "_cuda_emu.so"
    if not emu.exists():
        pytest.skip("no emulator library (make emu builds it)")
    classic = subprocess.run([*check, str(emu)], capture_output=True, text=True)
    assert classic.returncode == 1, classic.stdout
    assert "undefined libtorch C++ symbol: c10::" in classic.stdout
    assert "links a library outside the stable ABI and the runtimes: libc10.so" in classic.stdout
    # ... and, built without csrc/common/manylinux_compat.cpp, symbols newer than manylinux_2_28
    assert "__libc_single_threaded needs GLIBC_2.32, newer than manylinux_2_28 allows" in (
        classic.stdout
    )


def test_package_metadata_names_authors_urls_and_classifiers(tmp_path):
    # What `pip show fastamp` and a package index display, from the build backend's own metadata
    # hook (no compile).
    import email

    from scikit_build_core.build import prepare_metadata_for_build_wheel

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        dist_info = prepare_metadata_for_build_wheel(str(tmp_path))
    finally:
        os.chdir(cwd)
    meta = email.message_from_string((tmp_path / dist_info / "METADATA").read_text())
    holder = re.search(r"^Copyright \(c\) \d{4}, (.+)$", (ROOT / "LICENSE").read_text(), re.M)
    assert holder and meta["Author"] == holder.group(1), (meta["Author"], holder)
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Source", "Issues"} <= set(urls), urls
    assert all(u.startswith("https://") for u in urls.values()), urls
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3 :: Only" in classifiers, classifiers
    # PEP 639: the SPDX expression is the license; a License :: classifier beside it is refused.
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers


def _make_dry_run(target: str) -> list[str]:
    # The commands `make TARGET` would run, as a user types it (not as a sub-make of `make test`).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _pytest_selection(target: str | None) -> tuple[str, set[str]]:
    # The -m expression of TARGET's pytest command (None: a bare pytest's, from pyproject.toml),
    # and the tests it selects (collected, not run).
    if target is None:
        expr = "not slow"
    else:
        (line,) = [ln for ln in _make_dry_run(target) if " -m pytest " in ln]
        args = shlex.split(line.split(" -m pytest ", 1)[1])
        expr = args[args.index("-m") + 1]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", expr],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return expr, {ln for ln in out.stdout.splitlines() if ln.startswith("tests/") and "::" in ln}


@pytest.mark.full  # collects the suite three times (about 20 s): checked where CI runs it
def test_quick_tier_and_full_tier_are_the_suite_ci_runs_each_test_once():
    # CI (.ci/run) runs the README's first test command, `make test` (the quick tier, every
    # capability in it), then `make test-full` (the tests marked full): together the whole suite a
    # bare pytest selects, and no test twice. `make test-all` is the two in a row.
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), "CI no longer runs `make test`"
    assert re.search(r"^make test-full$", ci, re.M), "CI no longer runs `make test-full`"
    assert ci.index("\nmake test\n") < ci.index(
        "\nmake test-full\n"
    )  # the quick tier's records first
    assert not re.search(r"^make test-all$", ci, re.M), "CI would run the quick tier twice"
    assert [ln for ln in _make_dry_run("test-all") if "test-full" in ln], (
        "test-all: test + test-full"
    )
    quick_expr, quick = _pytest_selection("test")
    full_expr, full = _pytest_selection("test-full")
    _, suite = _pytest_selection(None)
    assert "not full" in quick_expr and full_expr == "full", (quick_expr, full_expr)
    assert quick and full and not quick & full, sorted(quick & full)[:5]
    assert quick | full == suite, sorted(suite ^ (quick | full))[:5]
    capabilities = sorted(
        p.name for p in (ROOT / "tests").iterdir() if (p / "__init__.py").exists()
    )
    capabilities.append("cuda_emu")
    missing = [c for c in capabilities if not any(t.startswith(f"tests/{c}/") for t in quick)]
    assert not missing, f"capabilities without a test in the quick tier: {missing}"
    # The argument-coverage check judges the whole suite: it runs in the full tier only (with the
    # quick tier's saved records).
    argcov = (
        "tests/test_argument_coverage.py::test_every_argument_value_class_reaches_both_backends"
    )
    assert argcov in full and argcov not in quick


def test_readme_states_both_test_commands_with_their_durations():
    readme = (ROOT / "README.md").read_text()
    for command in ("make test", "make test-all"):
        line = re.search(rf"^{re.escape(command)} +#.*$", readme, re.M)
        assert line and re.search(r"\d+ min", line.group(0)), (command, line)
