"""Per-kernel GPU resources from the compiler, and the checks CI holds them to (`make gpu-resources`).

Compiles each CUDA source of a CUDA build (its compile_commands.json: the same flags) to a cubin
for each architecture of the default release list with ``ptxas -v``, and reads, for every
``__global__`` kernel instantiation: registers per thread, stack frame, spill stores and loads,
static shared memory. The threads per block come from the kernel's launch site in csrc/ (the
``gpu::launch("name", &kernel, grid, dim3(BLOCK), ...)`` call, BLOCK resolved through its
``constexpr int`` when it is a name), and with them the theoretical occupancy on that
architecture: resident warps per SM over the SM's maximum, limited by registers, shared memory,
threads and blocks per SM (the CUDA occupancy calculator's rules).

Checks: no kernel spills (0 bytes of spill stores and loads) on any architecture, and every kernel
launched with more than one block reaches the occupancy floor (FLOOR; single-block kernels, the
scale update and the partial-sum combine, are latency work and have none).

    python .ci/gpu_resources.py [--build build/.venv-cuda] [--markdown docs/gpu_resources.md] [--check]
    python .ci/gpu_resources.py --ptxas-log LOG --check      # check a saved ptxas -v log
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("80", "86", "90")
FLOOR = 0.5  # theoretical occupancy every multi-block kernel must reach

# Per-SM limits (CUDA C++ Programming Guide, "Compute capabilities" table).
SM = {
    "80": {"threads": 2048, "blocks": 32, "regs": 65536, "smem": 164 * 1024},
    "86": {"threads": 1536, "blocks": 16, "regs": 65536, "smem": 100 * 1024},
    "90": {"threads": 2048, "blocks": 32, "regs": 65536, "smem": 228 * 1024},
}
REG_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_RESERVED = 1024  # shared memory the system reserves per block (sm_80 and later)


@dataclass
class Kernel:
    arch: str
    mangled: str
    source: str = ""
    name: str = ""
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0
    block: int | None = None
    single_block: bool = False

    @property
    def launch_name(self) -> str:
        return re.match(r"[\w:]*", self.name).group(0).split("::")[-1]

    def occupancy(self) -> float | None:
        if self.block is None:
            return None
        lim = SM[self.arch]
        warps = math.ceil(self.block / 32)
        regs_per_warp = math.ceil(max(self.registers, 1) * 32 / REG_UNIT) * REG_UNIT
        by_regs = lim["regs"] // (regs_per_warp * warps)
        by_threads = lim["threads"] // (warps * 32)
        by_smem = lim["smem"] // (self.smem + SMEM_RESERVED)
        blocks = min(by_regs, by_threads, by_smem, lim["blocks"])
        return blocks * warps / (lim["threads"] // 32)


def parse_ptxas(text: str) -> list[Kernel]:
    """The kernels of a ``ptxas -v`` log (entry functions only; device functions have no
    'Compiling entry function' line)."""
    kernels: list[Kernel] = []
    cur: Kernel | None = None
    source = ""
    for line in text.splitlines():
        if line.startswith("### source: "):
            source = line.split(": ", 1)[1].strip()
            continue
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_(\d+)a?'", line)
        if m:
            cur = Kernel(arch=m.group(2), mangled=m.group(1), source=source)
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            cur.stack, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur.smem = int(s.group(1)) if s else 0
    return kernels


def demangle(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()


def short(name: str) -> str:
    """A demangled kernel's name without its parameters, namespaces fastamp and detail, or
    anonymous namespaces."""
    name = re.sub(r"^void ", "", name)
    for junk in ("fastamp::", "(anonymous namespace)::", "detail::"):
        name = name.replace(junk, "")
    name = name.split(">(")[0] + ">" if ">(" in name else name.split("(")[0]
    return re.sub(r"\s+", " ", name)


def launch_blocks(csrc: Path = ROOT / "csrc") -> dict[str, tuple[int, bool]]:
    """{kernel launch name: (threads per block, launched as a single block)} from the launch
    sites in csrc/ (the gpu::launch calls)."""
    files = sorted(csrc.rglob("*.cu")) + sorted(csrc.rglob("*.cuh"))
    texts = {p: re.sub(r"//[^\n]*", "", p.read_text()) for p in files}
    consts: dict[str, int] = {}
    for text in texts.values():
        for n, v in re.findall(r"constexpr\s+int\s+(\w+)\s*=\s*(\d+)\s*;", text):
            consts.setdefault(n, int(v))
    out: dict[str, tuple[int, bool]] = {}
    pattern = r'gpu::launch\(\s*"(\w+)"\s*,\s*&.*?,\s*dim3\((.*?)\)\s*,\s*dim3\((\w+)\)'
    for p, text in texts.items():
        local = dict(consts)
        local.update(
            {n: int(v) for n, v in re.findall(r"constexpr\s+int\s+(\w+)\s*=\s*(\d+)\s*;", text)}
        )
        for name, grid, block in re.findall(pattern, text, flags=re.S):
            threads = int(block) if block.isdigit() else local.get(block)
            if threads is None:
                raise SystemExit(f"{p}: cannot resolve the block size {block!r} of {name}")
            out[name] = (threads, grid.strip() == "1")
    return out


def compile_commands(build: Path) -> list[dict]:
    path = build / "compile_commands.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: build the CUDA flavour first (make cuda-build)")
    return [e for e in json.loads(path.read_text()) if e["file"].endswith(".cu")]


def ptxas_log(entry: dict, arch: str, tmp: Path) -> str:
    args = shlex.split(entry["command"])
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if (
            a.startswith("--generate-code")
            or a.startswith("-gencode")
            or a == "-c"
            or a == entry["file"]
        ):
            continue
        keep.append(a)
    out = tmp / f"{Path(entry['file']).stem}_{arch}.cubin"
    cmd = keep + [
        "--cubin",
        "-gencode",
        f"arch=compute_{arch},code=sm_{arch}",
        "-Xptxas=-v",
        "-o",
        str(out),
        entry["file"],
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=entry["directory"])
    if r.returncode != 0:
        raise SystemExit(f"compiling {entry['file']} for sm_{arch} failed:\n{r.stderr[-4000:]}")
    return f"### source: {Path(entry['file']).relative_to(ROOT / 'csrc')}\n{r.stderr}"


def collect(build: Path, archs: tuple[str, ...], jobs: int) -> str:
    entries = compile_commands(build)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs) as pool:
        logs = pool.map(
            lambda ea: ptxas_log(ea[0], ea[1], Path(tmp)), [(e, a) for e in entries for a in archs]
        )
        return "\n".join(logs)


def annotate(kernels: list[Kernel], blocks: dict[str, tuple[int, bool]]) -> None:
    for k, name in zip(kernels, demangle([k.mangled for k in kernels])):
        k.name = short(name)
        if k.launch_name in blocks:
            k.block, k.single_block = blocks[k.launch_name]


def problems(kernels: list[Kernel]) -> list[str]:
    out = []
    for k in kernels:
        where = f"{k.name} (sm_{k.arch})"
        if k.spill_stores or k.spill_loads:
            out.append(f"{where} spills: {k.spill_stores} bytes stored, {k.spill_loads} loaded")
        if k.block is None:
            out.append(f"{where}: no launch site found in csrc/ (gpu::launch with its block size)")
            continue
        occ = k.occupancy()
        if not k.single_block and occ is not None and occ < FLOOR:
            out.append(
                f"{where}: theoretical occupancy {occ:.0%} < {FLOOR:.0%} "
                f"({k.registers} registers, {k.block} threads, {k.smem} B smem)"
            )
    return out


def markdown(kernels: list[Kernel]) -> str:
    rows = [
        "<!-- generated by `make gpu-resources` (.ci/gpu_resources.py): do not edit -->",
        "# GPU resources per kernel",
        "",
        "From `ptxas -v` on the CUDA sources, compiled with the build's own flags for each",
        "architecture of the release list.",
        "",
        "- **Occupancy** is theoretical: resident warps per SM over the maximum, at the launch",
        "  site's threads per block.",
        f"- **Floor.** CI fails on any spill and on an occupancy below {FLOOR:.0%} for a kernel",
        "  launched with more than one block.",
        "- **Single-block kernels** (the scale update, the clip coefficient, the overflow",
        "  record and the partial-sum combine) are latency work, marked `1 block`, and have no",
        "  floor.",
        "",
        "| kernel | source | sm | regs | stack B | spill st/ld B | smem B | threads | occupancy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in sorted(kernels, key=lambda k: (k.name, k.source, k.arch)):
        occ = k.occupancy()
        occ_s = "1 block: no floor" if k.single_block else ("-" if occ is None else f"{occ:.0%}")
        rows.append(
            f"| `{k.name}` | {k.source} | {k.arch} | {k.registers} | {k.stack} | {k.spill_stores}/{k.spill_loads} | "
            f"{k.smem} | {k.block if k.block is not None else '?'} | {occ_s} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--build", type=Path, default=ROOT / "build" / ".venv-cuda")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--ptxas-log", type=Path, default=None, help="read this log instead of compiling"
    )
    ap.add_argument("--save-log", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    text = a.ptxas_log.read_text() if a.ptxas_log else collect(a.build, tuple(a.archs), a.jobs)
    if a.save_log:
        a.save_log.write_text(text)
    kernels = parse_ptxas(text)
    if not kernels:
        print("no kernels in the ptxas output")
        return 1
    annotate(kernels, launch_blocks())
    if a.markdown:
        a.markdown.write_text(markdown(kernels))
    worst = min((k.occupancy() or 1.0) for k in kernels if not k.single_block)
    print(
        f"{len(kernels)} kernel instantiations over sm_{', sm_'.join(sorted({k.arch for k in kernels}))}: "
        f"max {max(k.registers for k in kernels)} registers, "
        f"{sum(k.spill_stores + k.spill_loads for k in kernels)} spill bytes, "
        f"lowest multi-block occupancy {worst:.0%}"
    )
    found = problems(kernels)
    for p in found:
        print("  " + p)
    if a.check and found:
        print(f"GPU resource check FAILED ({len(found)} problem(s))")
        return 1
    if a.check:
        print("GPU resource check OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
