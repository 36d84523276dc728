"""tests/conftest.py's tier rules, run on probe tests in a scratch directory: with
FASTAMP_REQUIRE_CLIENTS=1 a skipped `clients` test fails; skips are summarised by reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

# Each case runs pytest in a subprocess (about 15 s together on 2 cores): the full tier.
pytestmark = pytest.mark.full

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBES = textwrap.dedent(
    """
    import pytest

    @pytest.mark.clients
    def test_needs_a_missing_client():
        pytest.importorskip("fastamp_no_such_client_pkg")

    @pytest.mark.clients
    def test_client_test_that_skips():
        pytest.skip("client feature not available")

    @pytest.mark.parametrize("i", range(2))
    def test_cuda_only(i):
        pytest.skip("no CUDA device")

    def test_cuda_only_elsewhere():
        pytest.skip("no CUDA device")

    def test_runs():
        assert True

    @pytest.mark.full
    def test_in_the_full_tier_only():
        assert True
    """
)

MODULE_LEVEL = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.clients
    pytest.importorskip("fastamp_no_such_client_pkg")

    def test_never_collected():
        pass
    """
)


def _pytest(tmp_path, *args, require=None):
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBES)
    (tmp_path / "test_probe_module.py").write_text(MODULE_LEVEL)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    clients: needs client libraries\n    cuda: cuda\n    full: full tier\n"
        "addopts = -ra\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FASTAMP_REQUIRE_CLIENTS"}
    if require is not None:
        env["FASTAMP_REQUIRE_CLIENTS"] = require
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


def test_without_the_flag_client_tests_skip(tmp_path):
    rc, out = _pytest(tmp_path, "-m", "clients")
    assert rc == 0, out
    assert "3 skipped" in out and "failed" not in out and "error" not in out, out


def test_with_the_flag_a_skipped_client_test_fails(tmp_path):
    rc, out = _pytest(tmp_path, "-m", "clients", "test_probe.py", require="1")
    assert rc == 1, out
    assert "2 failed" in out and "FASTAMP_REQUIRE_CLIENTS=1" in out, out
    assert "fastamp_no_such_client_pkg" in out and "client feature not available" in out, out
    # a module skipped at import (module-level importorskip) is a collection error
    rc, out = _pytest(tmp_path, "-m", "clients", require="1")
    assert rc != 0, out
    assert "test_probe_module.py holds `clients` tests but was skipped at import" in out, out


def test_skips_are_summarised_by_reason(tmp_path):
    rc, out = _pytest(tmp_path, "-m", "not clients")
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("SKIPPED") and "no CUDA device" in ln]
    # one line for the reason (pytest's -ra would print one per source line: two here)
    assert len(lines) == 1 and lines[0].split()[1] == "3" and "no CUDA device" in lines[0], out
    rc, out = _pytest(tmp_path, "-m", "not clients", "--skip-details")
    assert (
        sum(ln.startswith("SKIPPED [") and "no CUDA device" in ln for ln in out.splitlines()) == 2
    ), out


def test_the_quick_tier_says_what_it_left_to_the_full_suite(tmp_path):
    rc, out = _pytest(tmp_path, "-m", "not clients and not full", "test_probe.py")
    assert rc == 0, out
    assert "quick tier: 1 tests marked `full` not run; `make test-all` runs the full suite" in out
    rc, out = _pytest(tmp_path, "-m", "not clients", "test_probe.py")
    assert rc == 0 and "quick tier" not in out, out
