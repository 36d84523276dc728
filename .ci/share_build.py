"""Install fastamp into another venv by copying this venv's install of it (the compiled ``_C``
included) instead of compiling again: ``make test-clients`` runs it with .venv's Python for
.venv-clients, ``make test-matrix-ci`` for the floor and the newest torch. The library speaks the
LibTorch stable ABI, so the other venv may have any torch from the library's target (2.11) up; the
Python must be the same (an editable install's finder names this Python's paths).

    .venv/bin/python .ci/share_build.py .venv-clients/bin/python
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

PROBE = (
    "import json, sys, sysconfig, torch; "
    "print(json.dumps([sysconfig.get_paths()['purelib'], sys.version_info[:2], torch.__version__]))"
)


def main(target_python: str) -> int:
    src = Path(sysconfig.get_paths()["purelib"])
    out = subprocess.run([target_python, "-c", PROBE], capture_output=True, text=True, check=True)
    dst_dir, version, torch_version = json.loads(out.stdout)
    dst = Path(dst_dir)
    from fastamp._library import _release, build_info

    target = build_info()["torch_target"]
    if tuple(version) != sys.version_info[:2] or _release(torch_version) < _release(target):
        print(
            f"share_build: {target_python} has Python {tuple(version)} and torch {torch_version}, "
            f"this venv Python {sys.version_info[:2]} and a library for torch >= {target}: the "
            "built library cannot be shared; build fastamp there instead",
            file=sys.stderr,
        )
        return 1
    names = [p.name for p in src.glob("_editable_skbc_fastamp*")] + ["fastamp"]
    names += [p.name for p in src.glob("fastamp-*.dist-info")]
    if not (src / "fastamp").is_dir() or not list(src.glob("fastamp-*.dist-info")):
        print(f"share_build: fastamp is not installed in {src}; run make first", file=sys.stderr)
        return 1
    for old in list(dst.glob("_editable_skbc_fastamp*")) + list(dst.glob("fastamp*")):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    for name in names:
        s = src / name
        shutil.copytree(s, dst / name) if s.is_dir() else shutil.copy2(s, dst / name)
    print(f"share_build: fastamp from {src} installed into {dst} (no compile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
