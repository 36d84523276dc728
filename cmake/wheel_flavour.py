"""The package version, as torch's wheels spell theirs: fastamp's release (``__version__`` in
python/fastamp/__init__.py) and a local label naming the build's flavour: ``0.1.0+cpu`` for a
CPU-only build, ``0.1.0+cu130`` for CUDA kernels built against a torch with CUDA 13.0.

Without the label the CPU and the CUDA wheel have the same file name, and no package index (nor
one ``dist/`` folder) can hold both. A local version is what torch's own indexes use; PyPI refuses
local versions, so these wheels go to an index of their own (one PEP 503 folder per flavour, as
download.pytorch.org/whl/cpu and /whl/cu130 are), where ``pip install fastamp`` picks the
flavour of the index it is pointed at.

The label is for the wheels built from a checkout (`make wheel`, `make wheel-cpu`). An sdist has
no flavour, and a wheel must keep its sdist's version (core metadata: the version is never
dynamic between the two), so the sdist is made with ``FASTAMP_VERSION_LABEL=`` (empty: no label)
and a build from an sdist (its PKG-INFO present) keeps the plain release. ``FASTAMP_VERSION_LABEL``
set to a label uses that label.

scikit-build-core calls :func:`dynamic_metadata` (pyproject.toml:
``[tool.scikit-build.metadata.version]``) before CMake runs, so the flavour is decided here the
way CMakeLists.txt decides it: ``FASTAMP_CUDA=OFF`` or a CPU torch gives ``cpu``; ``ON``, or
``AUTO`` with nvcc found, gives ``cu<major><minor>`` of torch's CUDA. CMakeLists.txt checks that
its own decision agrees with the label and stops the build if not, so a wheel's name cannot
claim another flavour than it holds.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KEYS = {"input"}


def flavour(fastamp_cuda: str, torch_cuda: str | None, nvcc_found: bool) -> str:
    """The local version label: ``cpu`` or ``cu<major><minor>`` (``13.0`` -> ``cu130``)."""
    mode = (fastamp_cuda or "AUTO").upper()
    if mode not in ("AUTO", "ON", "OFF"):
        raise ValueError(f"FASTAMP_CUDA must be AUTO, ON or OFF, got {fastamp_cuda!r}")
    if mode == "OFF" or not torch_cuda or (mode == "AUTO" and not nvcc_found):
        return "cpu"  # (ON with a CPU torch or without nvcc: CMake stops with the reason)
    major, minor = torch_cuda.split(".")[:2]
    return f"cu{major}{minor}"


def version(release: str, label: str) -> str:
    return f"{release}+{label}" if label else release


def _nvcc_found(env: Mapping[str, str]) -> bool:
    # CMakeLists.txt: CUDACXX, else nvcc on the PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin.
    if env.get("CUDACXX"):
        return True
    hints = [os.path.join(env.get("CUDA_HOME", ""), "bin"), "/usr/local/cuda/bin"]
    path = os.pathsep.join([env.get("PATH", ""), *hints])
    return shutil.which("nvcc", path=path) is not None


def _torch_cuda() -> str | None:
    try:
        import torch  # the torch this build compiles against (--no-build-isolation)
    except ImportError:
        return None  # cmake/torch_info.py stops the build with the reason
    return torch.version.cuda


def dynamic_metadata(field: str, settings: Mapping[str, Any]) -> str:
    if field != "version" or settings.keys() - KEYS or "input" not in settings:
        raise RuntimeError(f"wheel_flavour gives the version from {KEYS}, got {field}, {settings}")
    text = Path(settings["input"]).read_text(encoding="utf-8")
    release = re.search(r'^__version__ = "([^"+]+)"$', text, re.M)
    if not release:
        raise RuntimeError(f'no `__version__ = "X.Y.Z"` line in {settings["input"]}')
    return version(release.group(1), label(os.environ, from_sdist=Path("PKG-INFO").is_file()))


def label(env: Mapping[str, str], from_sdist: bool) -> str:
    """The local label of this build: none from an sdist, FASTAMP_VERSION_LABEL when set, else the
    flavour."""
    if from_sdist:
        return ""
    if "FASTAMP_VERSION_LABEL" in env:
        return env["FASTAMP_VERSION_LABEL"]
    return flavour(env.get("FASTAMP_CUDA", "AUTO"), _torch_cuda(), _nvcc_found(env))
