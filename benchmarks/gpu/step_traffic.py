"""One post-backward training step on a GPU, fastamp's recipe or torch's, for Nsight Compute to
count the DRAM bytes of every kernel it launches (``make gpu-check`` runs it).

    ncu --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        --csv --page raw python benchmarks/gpu/step_traffic.py --recipe fastamp --state float32
    python benchmarks/gpu/step_traffic.py --summarize DIR      # reads DIR/<recipe>-<state>.csv

The recipes, on the same fp32 parameters and loss-scaled fp32 gradients (8 tensors):
  torch:   scaler.unscale_(opt); clip_grad_norm_(params, foreach=True); scaler.step(opt);
           scaler.update()   with torch.optim.AdamW(fused=True)
  fastamp: scaler.clip_grad_norm_(opt); scaler.step(opt); scaler.update()
           with fastamp.GradScaler + fastamp.optim.AdamW(state_dtype=STATE)
Two untimed steps first (the optimizer state is created lazily), then the profiled step between
torch.cuda.profiler.start() and stop(). The bytes are measured, not modelled: the summary divides
the DRAM bytes read and written by all the step's kernels by the parameter count, and predicts the
step's time on a GPU as those bytes over the memory bandwidth the run measured with a copy.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

TENSORS = 8


def run(recipe: str, state: str, numel: int, device: str) -> None:
    import fastamp

    gen = torch.Generator(device=device).manual_seed(0)
    n = numel // TENSORS
    params = [
        torch.nn.Parameter(torch.randn(n, generator=gen, device=device) * 0.02)
        for _ in range(TENSORS)
    ]
    grads = [torch.randn(n, generator=gen, device=device) * 2.0**16 * 1e-3 for _ in range(TENSORS)]
    if recipe == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)

        def step() -> None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            scaler.step(opt)
            scaler.update()
    else:
        opt = fastamp.optim.AdamW(params, lr=1e-4, weight_decay=0.01, state_dtype=state)
        scaler = fastamp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)

        def step() -> None:
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

    scaler.scale(torch.ones((), device=device))  # the scale tensor exists before the step
    for i in range(3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        if i == 2 and device == "cuda":
            torch.cuda.profiler.start()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i == 2 and device == "cuda":
            torch.cuda.profiler.stop()
    print(f"{recipe}/{state}: {TENSORS} x {n} parameters, step done")


def _num(row: dict, key: str) -> float:
    return float((row.get(key) or "0").replace(",", "") or 0)


def read_ncu_csv(path: Path) -> list[dict[str, float | str]]:
    """The kernels of one ncu --csv --page raw report: name, bytes read, bytes written."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = []
    for row in csv.DictReader(lines[start:]):
        if not (row.get("ID") or "").strip().isdigit():
            continue  # the units row

        rows.append(
            {
                "kernel": row.get("Kernel Name", "?"),
                "read": _num(row, "dram__bytes_read.sum"),
                "write": _num(row, "dram__bytes_write.sum"),
                "ns": _num(row, "gpu__time_duration.sum"),
            }
        )
    return rows


def summarize(folder: Path, numel: int, bandwidth: float | None) -> dict:
    out: dict = {"numel": numel, "bandwidth_bytes_per_s": bandwidth, "recipes": {}}
    for path in sorted(folder.glob("*.csv")):
        kernels = read_ncu_csv(path)
        total = sum(k["read"] + k["write"] for k in kernels)
        out["recipes"][path.stem] = {
            "kernels": len(kernels),
            "bytes_per_param": total / numel,
            "predicted_ms": (total / bandwidth * 1e3) if bandwidth else None,
            "kernel_ms": sum(k["ns"] for k in kernels) / 1e6,
            "per_kernel": [
                {
                    "kernel": str(k["kernel"])[:90],
                    "bytes_per_param": (k["read"] + k["write"]) / numel,
                    "us": k["ns"] / 1e3,
                }
                for k in kernels
            ],
        }
    torch_bpp = out["recipes"].get("torch-float32", {}).get("bytes_per_param")
    print(f"measured DRAM traffic of one step, {numel / 1e6:.0f}M fp32 parameters (Nsight Compute)")
    print(f"{'recipe':<22}{'kernels':>8}{'B/param':>10}{'vs torch':>10}{'predicted ms':>14}")
    for name, r in out["recipes"].items():
        ratio = f"{r['bytes_per_param'] / torch_bpp:.2f}x" if torch_bpp else "-"
        pred = f"{r['predicted_ms']:.3f}" if r["predicted_ms"] else "-"
        print(f"{name:<22}{r['kernels']:>8}{r['bytes_per_param']:>10.1f}{ratio:>10}{pred:>14}")
    print("(predicted = measured bytes / the copy bandwidth measured in the same run: a model)")
    for name, r in out["recipes"].items():
        print(f"\n{name}: {r['kernels']} kernels, {r['kernel_ms']:.3f} ms of kernel time under ncu")
        for k in r["per_kernel"]:
            print(f"  {k['bytes_per_param']:7.2f} B/param {k['us']:9.1f} us  {k['kernel']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", choices=("torch", "fastamp"), default="fastamp")
    ap.add_argument("--state", choices=("float32", "bfloat16", "int8"), default="float32")
    ap.add_argument("--numel", type=float, default=64e6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--summarize", type=Path, default=None, help="folder of <recipe>-<state>.csv")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s, for the prediction")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    numel = int(a.numel) // TENSORS * TENSORS
    if a.summarize is not None:
        result = summarize(a.summarize, numel, a.bandwidth)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))
        return
    run(a.recipe, a.state, numel, a.device)


if __name__ == "__main__":
    sys.exit(main())
