"""Holds the floating-point contraction decision (docs/reliability.md): no multiply-add is fused
on any backend, so the CPU kernels, the emulated CUDA kernels and the GPU kernels compute the same
bits from the shared element math.

    python .ci/check_fp_contract.py BUILD_DIR [BUILD_DIR...]

For each CMake build folder (its compile_commands.json and the _C library in it):
- CPU: the library contains no fused multiply-add instruction (x86-64: vfmadd/vfmsub/vfnmadd/
  vfnmsub), and a probe `a * b + c` compiled with the build's C++ flags plus -mfma has none either,
  while the same probe without -ffp-contract=off has one (so this check can fail);
- CUDA (when the build has .cu files): a probe kernel compiled with the exact nvcc flags of each
  .cu file has no `fma.rn.f32` in its PTX, and one with --fmad=true appended.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

FMA_X86 = re.compile(r"\bv?f(n)?m(add|sub)\d{3}[sp][sd]\b")
PROBE = "float fastamp_probe(float a, float b, float c) { return a * b + c; }\n"
CUDA_PROBE = "__global__ void fastamp_probe(float* x) { x[0] = x[1] * x[2] + x[3]; }\n"


def commands(build: Path) -> list[dict]:
    return json.loads((build / "compile_commands.json").read_text())


def strip_output(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD") or a.startswith("--generate-code") or a.startswith("-gencode") \
                or a.startswith("--generate-dependencies-with-compile") or a.startswith("--dependency-output"):
            continue
        out.append(a)
    return out


def run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {shlex.join(cmd)}\n{r.stderr[-3000:]}")
    return r.stdout


def check_cpu(build: Path, cmds: list[dict]) -> list[str]:
    problems = []
    libs = sorted(build.glob("_C*.so"))
    if not libs:
        return [f"{build}: no _C library"]
    dis = run(["objdump", "-d", "--no-show-raw-insn", str(libs[0])])
    n = len(FMA_X86.findall(dis))
    print(f"{libs[0].name}: {n} fused multiply-add instructions")
    if n:
        problems.append(f"{libs[0]} contains {n} fused multiply-add instructions")
    cxx = next(c for c in cmds if c["file"].endswith(".cpp"))
    args = strip_output(shlex.split(cxx["command"]))
    args = [a for a in args if not a.endswith(".cpp")]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(PROBE)

        def fmas(extra: list[str]) -> int:
            obj = Path(tmp) / "probe.o"
            run([*args, "-mfma", *extra, "-c", str(src), "-o", str(obj)])
            return len(FMA_X86.findall(run(["objdump", "-d", str(obj)])))

        with_flags = fmas([])
        without = fmas(["-ffp-contract=fast"])
    print(f"CPU probe a*b+c with -mfma: {with_flags} FMA with the build's flags, {without} with -ffp-contract=fast")
    if "-ffp-contract=off" not in args or with_flags:
        problems.append("the build's C++ flags let the compiler fuse multiply-adds")
    if without < 1:
        problems.append("the CPU probe shows no FMA even with contraction on: the check is blind")
    return problems


def check_cuda(cmds: list[dict]) -> list[str]:
    """A probe `a * b + c` kernel compiled to PTX with the exact nvcc flags of every .cu file of the
    build: no fma.rn.f32 (contraction off), and one with --fmad=true appended (the probe and the
    count can see a contraction). The PTX of the kernels themselves still holds fma.rn.f32 inside
    device libm functions (powf of the Lp norm): those are explicit fmas of CUDA's libm, not
    contractions of our arithmetic, and libm rounding is a documented difference anyway."""
    cus = [c for c in cmds if c["file"].endswith(".cu")]
    if not cus:
        print("no .cu files in this build: CUDA part skipped")
        return []
    problems = []
    flag_sets: dict[tuple[str, ...], list[str]] = {}
    for c in cus:
        args = tuple(a for a in strip_output(shlex.split(c["command"])) if not a.endswith(".cu"))
        flag_sets.setdefault(args, []).append(Path(c["file"]).name)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cu"
        src.write_text(CUDA_PROBE)
        for args, files in flag_sets.items():
            def fmas(extra: list[str], args=args) -> int:
                ptx = Path(tmp) / "probe.ptx"
                run([*args, *extra, "-arch=compute_90", "-ptx", str(src), "-o", str(ptx)])
                return ptx.read_text().count("fma.rn.f32")

            with_flags, fmad = fmas([]), fmas(["--fmad=true"])
            print(f"CUDA probe x1*x2+x3 with the nvcc flags of {', '.join(files)}: {with_flags} "
                  f"fma.rn.f32 ({fmad} with --fmad=true)")
            if with_flags:
                problems.append(f"the nvcc flags of {files} let nvcc fuse multiply-adds")
            if fmad < 1:
                problems.append("the CUDA probe shows no fma.rn.f32 even with --fmad=true: the "
                                "check is blind")
    return problems


def main(argv: list[str]) -> int:
    problems = []
    for b in map(Path, argv):
        cmds = commands(b)
        problems += check_cpu(b, cmds) + check_cuda(cmds)
    if problems:
        print("fp-contract check FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("fp-contract check OK: no fused multiply-add on any backend")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
