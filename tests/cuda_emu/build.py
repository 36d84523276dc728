"""Builds the CUDA emulator library: every csrc/**/*.cu file compiled by the host C++ compiler with
FASTAMP_CUDA_EMULATOR (common/gpu.cuh then routes launches, barriers, shuffles and atomics to
csrc/emu), plus the emulator runtime and the ops' argument checks, linked into one shared library
that registers the CUDA host launchers as CPU kernels of ``torch.ops.fastamp_emu``.

    python tests/cuda_emu/build.py [--out DIR] [--sanitize] [--mutant NAME]

Object files are cached by the hash of (flags, the translation unit, and every csrc header it
includes, transitively), so a planted-fault or mutant build recompiles only the units its change
reaches.
Prints the library's path on its last line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
DEFAULT_OUT = ROOT / "build" / "cuda_emu"

# Translation units besides the .cu files: the emulator, its control ops, and the checks the
# launchers share with the CPU kernels.
HOST_SOURCES = [
    "emu/runtime.cpp",
    "emu/traffic.cpp",
    "emu/ops.cpp",
    "emu/selftest.cpp",
    "scaler/scaler_checks.cpp",
    "optim/optim_checks.cpp",
    "common/tensor_list.cpp",
    "common/held_tensors.cpp",
    "common/torch_api.cpp",
]

# The kernel sources' loads and stores become calls to emu/traffic.cpp's hooks: GCC's ThreadSanitizer
# instrumentation, without its runtime (the hooks only count; atomics are performed by them). Not
# with --sanitize, whose ASan cannot be combined with it.
# Every unit but the hooks' own and the scheduler's: an inline function (adam_coefs, say) is
# compiled in several units and the linker keeps one copy, which must be an instrumented one.
UNTRACED = ("emu/runtime.cpp", "emu/traffic.cpp")
TRACE = [
    "-fsanitize=thread",
    "--param=tsan-instrument-func-entry-exit=0",
    "--param=tsan-distinguish-volatile=0",
]

SANITIZE = [
    "-fsanitize=address,undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-O1",
    "-g",
]


def cuda_sources() -> list[str]:
    return sorted(str(p.relative_to(CSRC)) for p in CSRC.rglob("*.cu"))


def torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    mm = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    std = "-std=c++20" if mm >= (2, 14) else "-std=c++17"
    cflags = [std, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for inc in cpp_extension.include_paths():
        cflags += ["-isystem", inc]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    ldflags = [f"-L{libdir}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{libdir}"]
    return cflags, ldflags


def base_flags(sanitize: bool) -> list[str]:
    flags = [
        "-O2",
        "-fPIC",
        "-fvisibility=hidden",
        "-DFASTAMP_CUDA_EMULATOR=1",
        # No floating-point contraction anywhere: the CPU kernels and nvcc (--fmad=false) agree,
        # so emulated, CPU and GPU element-wise results are the same bits (docs/reliability.md).
        "-ffp-contract=off",
        "-Wall",
        "-Wextra",
        "-Werror",
        # `#pragma unroll` is nvcc's; a host compiler ignores it.
        "-Wno-unknown-pragmas",
        f"-I{CSRC}",
    ]
    if sanitize:
        flags += SANITIZE
    return flags


def unit_flags(rel: str, sanitize: bool) -> list[str]:
    """Flags of one translation unit beyond base_flags: the kernels' traffic instrumentation."""
    return TRACE if rel not in UNTRACED and not sanitize else []


HEADER_SUFFIXES = (".h", ".cuh", ".inc")


def includes(rel: str, headers: dict[str, str] | None = None) -> set[str]:
    """The csrc headers translation unit or header `rel` includes, transitively (#include "x"
    names its path from csrc/; system and torch headers are not followed)."""
    headers = headers or {}
    seen: set[str] = set()
    todo = [rel]
    while todo:
        cur = todo.pop()
        text = headers[cur] if cur in headers else (CSRC / cur).read_text()
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.M):
            if inc not in seen and (CSRC / inc).is_file():
                seen.add(inc)
                todo.append(inc)
    return seen


def shared_hash(headers: dict[str, str] | None = None) -> str:
    """Hash of every header a translation unit may include (.h, .cuh, .inc under csrc), with
    `headers` (relative path -> text) standing in for the files they name."""
    headers = headers or {}
    h = hashlib.sha256()
    for p in sorted(CSRC.rglob("*")):
        if p.is_file() and p.suffix in HEADER_SUFFIXES:
            rel = str(p.relative_to(CSRC))
            h.update(rel.encode())
            h.update(headers[rel].encode() if rel in headers else p.read_bytes())
    return h.hexdigest()


def build(
    out: Path,
    sanitize: bool = False,
    overrides: dict[str, str] | None = None,
    name: str = "_cuda_emu.so",
    jobs: int = 2,
    verbose: bool = False,
) -> Path:
    """Compiles (or reuses) every object and links ``out/name``. ``overrides`` maps a .cu file
    or a header (relative to csrc/) to replacement source text. A replaced header is written to
    a shadow include folder searched before csrc/ (every #include in csrc/ names its path from
    csrc/), and enters every object's cache key."""
    overrides = overrides or {}
    headers = {rel: t for rel, t in overrides.items() if rel.endswith(HEADER_SUFFIXES)}
    for rel in overrides:
        if not rel.endswith(".cu") and rel not in headers:
            raise ValueError(f"overrides may replace .cu files and headers only; got {rel!r}")
    cxx = os.environ.get("CXX", "g++")
    cflags, ldflags = torch_flags()
    flags = base_flags(sanitize) + cflags
    objdir = out / "obj"
    objdir.mkdir(parents=True, exist_ok=True)
    if headers:
        shadow = out / f"shadow-{shared_hash(headers)[:16]}"
        for rel, text in headers.items():
            (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
            (shadow / rel).write_text(text)
        flags = [f"-I{shadow}", *flags]

    def compile_one(rel: str) -> Path:
        text = overrides[rel] if rel in overrides else (CSRC / rel).read_text()
        # Keyed by the headers this unit includes (with their replacements): a replaced header
        # recompiles only the units that include it.
        used = sorted(includes(rel, {**headers, rel: text}))
        used_text = [headers[h] if h in headers else (CSRC / h).read_text() for h in used]
        key = hashlib.sha256(
            "\0".join(
                [cxx, *flags, *unit_flags(rel, sanitize), rel, text, *used, *used_text]
            ).encode()
        ).hexdigest()[:24]
        obj = objdir / f"{Path(rel).stem}-{key}.o"
        if obj.exists():
            return obj
        with tempfile.TemporaryDirectory() as tmp:
            if rel in overrides:  # compile the replacement text as if it were the file itself
                src = Path(tmp) / Path(rel).name
                src.write_text(text)
                extra = [f"-I{(CSRC / rel).parent}"]
            else:
                src, extra = CSRC / rel, []
            lang = ["-x", "c++"] if rel.endswith(".cu") else []
            tmp_obj = Path(tmp) / "out.o"
            cmd = [cxx, *flags, *unit_flags(rel, sanitize), *extra, *lang, "-c", str(src)]
            cmd += ["-o", str(tmp_obj)]
            if verbose:
                print(" ".join(cmd), flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {rel} for the CUDA emulator failed:\n{r.stderr}")
            # Into the cache in one rename: several builds (make emu-faults runs mutants side by
            # side) may look for the same object while it is written.
            staged = objdir / f".{obj.name}.{os.getpid()}.{threading.get_ident()}"
            shutil.move(str(tmp_obj), staged)
            os.replace(staged, obj)
        return obj

    units = HOST_SOURCES + cuda_sources()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        objs = list(pool.map(compile_one, units))
    lib = out / name
    tmp_lib = out / f".{name}.{os.getpid()}.tmp"
    link = [
        cxx,
        "-shared",
        *(SANITIZE[:1] if sanitize else []),
        *map(str, objs),
        "-o",
        str(tmp_lib),
        *ldflags,
    ]
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        tmp_lib.unlink(missing_ok=True)
        raise RuntimeError(f"linking the CUDA emulator library failed:\n{r.stderr}")
    os.replace(tmp_lib, lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="build folder (default build/cuda_emu/<variant>)"
    )
    ap.add_argument("--sanitize", action="store_true", help="ASan + UBSan build")
    ap.add_argument("--mutant", default=None, help="a planted fault from mutants.py")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    overrides: dict[str, str] = {}
    variant = "asan" if args.sanitize else "default"
    name = "_cuda_emu.so"
    if args.mutant:
        sys.path.insert(0, str(Path(__file__).parent))
        import mutants

        overrides = mutants.apply(args.mutant)
        name = f"_cuda_emu_{args.mutant}.so"
    out = args.out or DEFAULT_OUT / variant
    print(build(out, sanitize=args.sanitize, overrides=overrides, name=name, verbose=args.verbose))


if __name__ == "__main__":
    main()
