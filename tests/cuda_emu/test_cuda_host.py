"""The CUDA host checks of tests/cuda_host/*.cu (the multi-tensor-apply driver's launch packing,
tensors over 2^33 elements included, and its per-thread chunk loop), built with the emulator's
g++ flags (tests/cuda_emu/build.py: FASTAMP_CUDA_EMULATOR, no floating-point contraction,
warnings as errors) and the emulator's runtime, and run. tests/cuda_host/run.sh builds the same
files with nvcc on a machine with the CUDA toolkit.

The binaries are cached by the hash of the compiler, the flags, the test source and every csrc
header it includes (transitively): the check runs in well under a second once built, and a
changed driver header (say, a chunk start computed in 32 bits) rebuilds and runs it again."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import build
import pytest

HOST = build.ROOT / "tests" / "cuda_host"
OUT = build.DEFAULT_OUT / "host"
# The emulator's runtime (its device-side checks and the vector-access hooks the driver calls).
RUNTIME = ("emu/runtime.cpp", "emu/traffic.cpp")


def _binary(src: Path) -> Path:
    cxx = os.environ.get("CXX", "g++")
    cflags, ldflags = build.torch_flags()
    flags = build.base_flags(False) + cflags
    text = src.read_text()
    rel = f"../tests/cuda_host/{src.name}"  # (includes() follows csrc-relative #includes)
    used: set[str] = set(build.includes(rel, {rel: text}))
    for r in RUNTIME:
        used |= {r} | build.includes(r)
    h = hashlib.sha256("\0".join([cxx, *flags, *ldflags, text]).encode())
    for u in sorted(used):
        h.update(u.encode())
        h.update((build.CSRC / u).read_bytes())
    exe = OUT / f"{src.stem}-{h.hexdigest()[:20]}"
    if exe.exists():
        return exe
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        tmp_exe = Path(tmp) / src.stem
        cmd = [cxx, *flags, "-Wno-unused", "-x", "c++", str(src)]
        cmd += ["-x", "none", *(str(build.CSRC / r) for r in RUNTIME), "-o", str(tmp_exe)]
        r = subprocess.run([*cmd, *ldflags], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail(
                f"compiling {src.name} with the emulator's flags failed:\n{r.stderr[-4000:]}"
            )
        os.replace(tmp_exe, exe)
    return exe


def test_cuda_host_checks_pass_under_the_emulator_flags():
    sources = sorted(HOST.glob("*.cu"))
    assert {s.name for s in sources} >= {"test_mta_pack.cu", "test_mta_chunk_loop.cu"}
    failed = []
    for src in sources:
        r = subprocess.run([str(_binary(src))], capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or "errors=0" not in r.stdout:
            failed.append(
                f"{src.name} (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
            )
    assert not failed, "\n".join(failed)
