"""Checks that a built fastamp library uses torch only through the LibTorch stable ABI, and loads
on every Linux torch's own wheels load on (manylinux_2_28).

    python .ci/check_library.py PATH [PATH ...]    (a _C*.so, a wheel, or a directory of either)

For each compiled library:
  1. torch-abi-audit (PyPI) must classify it STABLE and abi3-ok, with a minimum torch no newer than
     the build's FASTAMP_TORCH_TARGET (2.11): `torch-abi-audit --check both`;
  2. its own reading of the ELF: no undefined symbol in the at::, c10:: or torch:: namespaces
     (those live in libtorch's C++ ABI, which changes every release), no such symbol defined and
     exported either, and no NEEDED library beyond libtorch_cpu / libtorch_cuda (the C shim),
     the CUDA runtime and the C/C++ runtimes;
  3. no glibc, libstdc++ or libgcc symbol version newer than the manylinux_2_28 policy allows
     (auditwheel's own policy table; csrc/common/manylinux_compat.cpp keeps builds with a newer
     toolchain within it). CI builds no wheel, so this is its guard on the tag `make wheel` gives.
For each wheel, besides its library: `auditwheel show --json` must find its symbols within
manylinux_2_28 (sym_tag), its platform tags must be manylinux_2_28 or older, and the only libraries
it needs from outside the wheel and the manylinux allow-list must be the ones torch's wheels ship
(libtorch_cpu, libtorch_cuda, libcudart): that is why `auditwheel show` calls every torch
extension wheel "consistent with linux_x86_64", and the one thing it holds against this one.
Exits 1 naming every violation.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TARGET = (2, 11)
ALLOWED_NEEDED = re.compile(
    r"^(libtorch_cpu\.so|libtorch_cuda\.so|libcudart\.so\.\d+|libstdc\+\+\.so\.6|libm\.so\.6|"
    r"libgcc_s\.so\.1|libc\.so\.6|libdl\.so\.2|ld-linux-x86-64\.so\.2)$"
)
CXX_TORCH = re.compile(r"^(at|c10|torch|caffe2)::")
# The oldest platform torch's own wheels support, and the libraries a fastamp wheel takes from
# torch's (auditwheel repair --exclude in the Makefile).
PLATFORM = "manylinux_2_28"
FROM_TORCH = re.compile(r"^(libtorch_cpu\.so|libtorch_cuda\.so|libcudart\.so\.\d+)$")
VERSIONED = re.compile(r"\b(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9][0-9.]*)\)?\s+(\S+)$")
MANYLINUX_TAG = re.compile(r"^manylinux_(\d+)_(\d+)_")


def _allowed_versions() -> dict[str, set[str]]:
    """manylinux_2_28's symbol versions for this machine's architecture, from auditwheel's policy
    table (requirements/wheel.txt installs auditwheel beside this interpreter)."""
    from importlib.resources import files

    table = json.loads(files("auditwheel.policy").joinpath("manylinux-policy.json").read_text())
    policy = next(p for p in table if p["name"] == PLATFORM)
    return {k: set(v) for k, v in policy["symbol_versions"][platform.machine()].items()}


def _tag_within(tag: str) -> bool:
    """A manylinux_X_Y platform tag no newer than PLATFORM."""
    m = MANYLINUX_TAG.match(tag)
    return bool(m) and (int(m.group(1)), int(m.group(2))) <= (2, 28)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def libraries(paths: list[str], tmp: Path) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(p.rglob("_C*.so")) + libraries([str(w) for w in p.rglob("*.whl")], tmp)
        elif p.suffix == ".whl":
            out = tmp / f"{len(found)}-{p.parent.name}-{p.stem}"  # the CPU and CUDA wheels share a name
            with zipfile.ZipFile(p) as z:
                z.extractall(out)
            found += sorted(out.rglob("_C*.so"))
        else:
            found.append(p)
    return found


def check(lib: Path) -> list[str]:
    problems: list[str] = []
    # The console script installed beside this interpreter (requirements/wheel.txt).
    exe = Path(sys.executable).parent / "torch-abi-audit"
    audit = subprocess.run(
        [str(exe), "--check", "both", "-v", str(lib)], capture_output=True, text=True
    )
    print(audit.stdout.rstrip())
    if audit.returncode != 0:
        problems.append(f"torch-abi-audit --check both failed ({audit.returncode}): {audit.stderr}")
    m = re.search(r"Min torch:\s+(\d+)\.(\d+)", audit.stdout)
    if m is None or (int(m.group(1)), int(m.group(2))) > TARGET:
        problems.append(f"minimum torch is not <= {TARGET[0]}.{TARGET[1]}: {m and m.group(0)}")
    for line in _run(["nm", "-DC", "--undefined-only", str(lib)]).splitlines():
        name = line.split(None, 1)[-1]
        if CXX_TORCH.match(name):
            problems.append(f"undefined libtorch C++ symbol: {name}")
    for line in _run(["nm", "-DC", "--defined-only", str(lib)]).splitlines():
        name = line.split(None, 2)[-1]
        if CXX_TORCH.match(name):
            problems.append(f"exported libtorch C++ symbol: {name}")
    for needed in re.findall(
        r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run(["readelf", "-d", str(lib)])
    ):
        if not ALLOWED_NEEDED.match(needed):
            problems.append(f"links a library outside the stable ABI and the runtimes: {needed}")
    allowed = _allowed_versions()
    for line in _run(["objdump", "-T", str(lib)]).splitlines():
        m = VERSIONED.search(line) if "*UND*" in line else None
        if m and m.group(2) not in allowed.get(m.group(1), set()):
            problems.append(
                f"{m.group(3)} needs {m.group(1)}_{m.group(2)}, newer than {PLATFORM} allows"
            )
    return problems


def check_wheel(wheel: Path) -> list[str]:
    """What `auditwheel show` holds against a wheel beyond the torch libraries it needs."""
    from packaging.utils import parse_wheel_filename

    exe = Path(sys.executable).parent / "auditwheel"
    show = json.loads(_run([str(exe), "show", "--json", str(wheel)]))
    outside = sorted(show["external_libs"])
    print(
        f"{wheel.name}: auditwheel: symbols within {show['sym_tag']}; needs from outside the "
        f"wheel and the allow-list: {', '.join(outside) or 'nothing'}"
    )
    problems = []
    if not _tag_within(show["sym_tag"]):
        problems.append(f"auditwheel: its symbols need {show['sym_tag']}, newer than {PLATFORM}")
    for tag in parse_wheel_filename(wheel.name)[3]:
        if not _tag_within(tag.platform):
            problems.append(f"platform tag {tag.platform} is not {PLATFORM} or older")
    for lib in outside:
        if not FROM_TORCH.match(lib):
            problems.append(f"auditwheel: needs {lib}, which neither the wheel nor torch ships")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        libs = libraries(argv, Path(tmp))
        if not libs:
            print(f"no fastamp library (_C*.so) under {argv}")
            return 1
        failed = False
        wheels = [p for a in map(Path, argv) for p in ([a] if a.suffix == ".whl" else a.rglob("*.whl"))]
        for wheel in wheels:
            problems = check_wheel(wheel)
            for p in problems:
                print(f"  - {p}")
            failed = failed or bool(problems)
        for lib in libs:
            problems = check(lib)
            print(f"{lib.name}: " + ("OK" if not problems else "FAILED"))
            for p in problems:
                print(f"  - {p}")
            failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
