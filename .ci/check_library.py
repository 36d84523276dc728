"""Checks that a built fastamp library uses torch only through the LibTorch stable ABI.

    python .ci/check_library.py PATH [PATH ...]    (a _C*.so, a wheel, or a directory of either)

For each compiled library:
  1. torch-abi-audit (PyPI) must classify it STABLE and abi3-ok, with a minimum torch no newer than
     the build's FASTAMP_TORCH_TARGET (2.11): `torch-abi-audit --check both`;
  2. its own reading of the ELF: no undefined symbol in the at::, c10:: or torch:: namespaces
     (those live in libtorch's C++ ABI, which changes every release), no such symbol defined and
     exported either, and no NEEDED library beyond libtorch_cpu / libtorch_cuda (the C shim),
     the CUDA runtime and the C/C++ runtimes.
Exits 1 naming every violation.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TARGET = (2, 11)
ALLOWED_NEEDED = re.compile(
    r"^(libtorch_cpu\.so|libtorch_cuda\.so|libcudart\.so\.\d+|libstdc\+\+\.so\.6|libm\.so\.6|"
    r"libgcc_s\.so\.1|libc\.so\.6|ld-linux-x86-64\.so\.2)$"
)
CXX_TORCH = re.compile(r"^(at|c10|torch|caffe2)::")


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
        for lib in libs:
            problems = check(lib)
            print(f"{lib.name}: " + ("OK" if not problems else "FAILED"))
            for p in problems:
                print(f"  - {p}")
            failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
