"""fastamp.integrations: nothing imported until asked; a missing client is a precise error."""

from __future__ import annotations

import subprocess
import sys

from fastamp.integrations import SUPPORTED
from fastamp.integrations._deps import _in_range


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_fastamp_imports_no_client():
    out = _py(
        "import sys, fastamp, fastamp.integrations\n"
        "bad = [m for m in ('lightning', 'accelerate', 'transformers', 'timm') if m in sys.modules]\n"
        "bad += [m for m in sys.modules if m.startswith('fastamp.integrations.')]\n"
        "print(bad)"
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_missing_client_names_the_package_and_the_versions():
    # sys.modules[name] = None makes `import name` fail as if it were not installed (one
    # interpreter for the three: each start imports torch)
    out = _py(
        "import importlib, sys\n"
        "for c in ('lightning', 'accelerate', 'transformers'):\n"
        "    sys.modules[c] = None\n"
        "    try:\n"
        "        importlib.import_module('fastamp.integrations.' + c)\n"
        "    except ImportError as e:\n"
        "        print(c, '|', e)\n"
        "    else:\n"
        "        print(c, '| imported')\n"
    )
    lines = dict(ln.split(" | ", 1) for ln in out.stdout.strip().splitlines())
    assert set(lines) == {"lightning", "accelerate", "transformers"}, out.stdout + out.stderr
    for client, msg in lines.items():
        spec = SUPPORTED[client][1]
        assert msg.startswith(
            f"fastamp.integrations.{client} needs the '{client}' package ({client}{spec}"
        ), msg
        assert f"pip install '{client}{spec}'" in msg, msg


def test_version_ranges():
    assert _in_range("2.6.6", ">=2.5,<2.7")
    assert not _in_range("2.7.0", ">=2.5,<2.7")
    assert _in_range("5.23.0.dev0", ">=5.0,<6")
    assert _in_range("2.13.0+cpu", ">=2.11")
    assert not _in_range("1.0.14", ">=1.0.15,<1.1")
