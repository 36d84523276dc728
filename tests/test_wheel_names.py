"""The wheels' names: the version carries the build's flavour as torch's wheels do (0.1.0+cpu,
0.1.0+cu130; cmake/wheel_flavour.py), so the CPU and the CUDA wheel have different file names and
one index holds both, and the sdist keeps the plain release. No wheel is built here: the flavour
logic runs on its inputs, and the build backend's metadata hook (no compile) on this checkout."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _flavour_module():
    spec = importlib.util.spec_from_file_location(
        "wheel_flavour", ROOT / "cmake" / "wheel_flavour.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wf = _flavour_module()


@pytest.mark.parametrize(
    "fastamp_cuda,torch_cuda,nvcc,label",
    [
        ("OFF", "13.0", True, "cpu"),  # forced CPU build beside a CUDA torch
        ("AUTO", None, True, "cpu"),  # a CPU torch
        ("AUTO", "13.0", False, "cpu"),  # no nvcc: CMake builds CPU-only (with a warning)
        ("AUTO", "13.0", True, "cu130"),
        ("ON", "12.8", True, "cu128"),
        ("auto", "12.6", True, "cu126"),
    ],
)
def test_flavour_follows_the_builds_cuda_decision(fastamp_cuda, torch_cuda, nvcc, label):
    assert wf.flavour(fastamp_cuda, torch_cuda, nvcc) == label


def test_flavour_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="FASTAMP_CUDA must be AUTO, ON or OFF, got 'yes'"):
        wf.flavour("yes", "13.0", True)


def test_label_is_empty_for_the_sdist_and_a_build_from_it(monkeypatch):
    monkeypatch.setattr(wf, "_torch_cuda", lambda: "13.0")
    monkeypatch.setattr(wf, "_nvcc_found", lambda env: True)
    assert wf.label({}, from_sdist=False) == "cu130"
    assert wf.label({"FASTAMP_CUDA": "OFF"}, from_sdist=False) == "cpu"
    assert wf.label({"FASTAMP_VERSION_LABEL": ""}, from_sdist=False) == ""  # make wheel's sdist
    assert wf.label({"FASTAMP_CUDA": "OFF"}, from_sdist=True) == ""  # a wheel keeps its sdist's


# The file names `make wheel` gives each flavour, pinned: the release with the flavour as a local
# version, abi3 for CPython >= 3.10, and the platform tags `auditwheel repair --plat
# manylinux_2_28_x86_64` gives (the library's symbols fit glibc 2.27 as well, so repair adds that
# tag; benchmarks/results/wheels.md). cu128 is the CUDA 12 flavour's name (built against a torch
# with CUDA 12.8); no CUDA 12 toolchain could be had on the project's machines, so no such wheel
# has been built yet.
WHEEL_NAMES = {
    "cpu": "fastamp-0.1.0+cpu-cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "cu130": "fastamp-0.1.0+cu130-cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "cu128": "fastamp-0.1.0+cu128-cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
}
# FASTAMP_CUDA and the CUDA version of the torch each flavour is built against.
BUILT_WITH = {"cpu": ("OFF", None), "cu130": ("ON", "13.0"), "cu128": ("ON", "12.8")}


def _release() -> str:
    return re.search(
        r'^__version__ = "(.+)"$', (ROOT / "python" / "fastamp" / "__init__.py").read_text(), re.M
    ).group(1)


def test_wheel_names_per_flavour_are_pinned():
    release = _release()
    tags = "cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64"
    for label, pinned in WHEEL_NAMES.items():
        mode, cuda = BUILT_WITH[label]
        name = f"fastamp-{wf.version(release, wf.flavour(mode, cuda, True))}-{tags}.whl"
        assert name == pinned.replace("0.1.0", release, 1), (label, name)


def test_the_flavours_have_different_names_that_pip_resolves_alike():
    release = _release()
    names = [n.replace("0.1.0", release, 1) for n in WHEEL_NAMES.values()]
    assert len(set(names)) == len(names), names
    for name in names:
        dist, version, _, tags = parse_wheel_filename(name)
        assert dist == "fastamp" and version.local in WHEEL_NAMES, (name, version)
        assert version in SpecifierSet(f"=={release}")  # `pip install fastamp==0.1.0` takes any
        assert version.public == release
        # pip on glibc 2.28 (torch's own floor) or newer installs it
        assert {t.platform for t in tags} == {"manylinux_2_27_x86_64", "manylinux_2_28_x86_64"}
        assert {(t.interpreter, t.abi) for t in tags} == {("cp310", "abi3")}
    assert Version(wf.version(release, "")) == Version(release)


def test_make_wheel_repairs_both_flavours_to_manylinux_2_28():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^WHEEL_PLAT := manylinux_2_28_x86_64$", make, re.M)
    repairs = re.findall(r"auditwheel repair (.*) -w (dist/\w+)", make)
    assert {d for _, d in repairs} == {"dist/cpu", "dist/cuda"}, repairs
    assert all(a.startswith("--plat $(WHEEL_PLAT) ") for a, _ in repairs), repairs


def _metadata_version(tmp_path, monkeypatch, **env) -> str:
    from scikit_build_core.build import prepare_metadata_for_build_wheel

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    tmp_path.mkdir()
    dist_info = prepare_metadata_for_build_wheel(str(tmp_path))
    meta = (tmp_path / dist_info / "METADATA").read_text()
    return re.search(r"^Version: (.+)$", meta, re.M).group(1)


def test_the_build_backend_labels_this_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTAMP_VERSION_LABEL", raising=False)
    release = re.search(
        r'^__version__ = "(.+)"$', (ROOT / "python" / "fastamp" / "__init__.py").read_text(), re.M
    ).group(1)
    assert _metadata_version(tmp_path / "cpu", monkeypatch, FASTAMP_CUDA="OFF") == f"{release}+cpu"
    assert _metadata_version(tmp_path / "sdist", monkeypatch, FASTAMP_VERSION_LABEL="") == release


def test_make_wheel_cpu_builds_the_cpu_wheel_and_the_sdist_has_no_label():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^wheel-cpu: dist/cpu/\.built$", make, re.M)
    assert re.search(r"FASTAMP_CUDA=OFF .* wheel .* -w dist/raw-cpu", make)
    assert re.search(r"FASTAMP_VERSION_LABEL= \$\(PY\) -m build --sdist", make)
