"""Where a GPU step's time goes: torch.profiler over the whole post-backward step (the recipes of
benchmarks/optim/bench_optim_step.py), fastamp's and torch's fused, on model-shaped parameters;
with ``--flat``, also fastamp's with ``flat_buffers=True`` (its grads kept as views of the flat grad
buffer between steps, as ``zero_grad(set_to_none=False)`` training keeps them).

Prints, per recipe, the wall time of a step, the summed time of its GPU kernels, the number of
kernel launches and host-device synchronisations, and the top kernels and host ops. A wall time
far above the kernel time is host overhead (Python, launches, syncs), not memory traffic.

    python benchmarks/gpu/profile_step.py --numel 100e6
    python benchmarks/gpu/profile_step.py --numel 10e6 100e6 --flat
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fastamp
from fastamp.testing import transformer_like_shapes


def make(kind: str, numel: int, device: str):
    shapes = transformer_like_shapes(numel)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, device=device) * 0.02) for s in shapes
    ]
    grads = [torch.randn(s, generator=gen, device=device) * 2.0**16 * 1e-3 for s in shapes]
    if kind in ("fastamp", "flat"):
        opt = fastamp.optim.AdamW(params, lr=1e-4, weight_decay=0.01, flat_buffers=kind == "flat")
        scaler = fastamp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)

        def step():
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)

        def step():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            scaler.step(opt)
            scaler.update()

    scaler.scale(torch.ones((), device=device))

    def restore():
        for p, g in zip(params, grads):
            if kind == "flat" and p.grad is not None:
                p.grad.copy_(g)  # into the flat buffer's view: the layout holds
            else:
                p.grad = g.clone()

    return step, restore, len(shapes)


def measure(kind: str, numel: int, device: str, reps: int) -> tuple[float, float]:
    """Prints the step's profile; returns (median wall seconds, GPU kernel microseconds)."""
    step, restore, n_tensors = make(kind, numel, device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    walls = []
    for i in range(reps + 2):
        restore()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= 2:
            walls.append(time.perf_counter() - t0)
    restore()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    events = prof.key_averages()
    # The kernels themselves: device-side records that are not user annotations (torch records
    # "Optimizer.step#AdamW.step" on the device too; counting it counted every kernel twice).
    kernel_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type.name == "CUDA"
        and not getattr(e, "is_user_annotation", False)
        and not e.key.startswith("Optimizer.")
    )
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    syncs = sum(
        e.count
        for e in events
        if e.key
        in (
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaMemcpyAsync",
            "cudaEventSynchronize",
        )
    )
    print(
        f"\n=== {kind}: {numel / 1e6:.0f}M parameters in {n_tensors} tensors | "
        f"wall {statistics.median(walls) * 1e3:.2f} ms "
        f"(median of {reps}) | GPU kernels {kernel_us / 1e3:.2f} ms | launches {launches} | "
        f"memcpy/sync calls {syncs}"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return statistics.median(walls), kernel_us


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--numel", type=float, nargs="+", default=[10e6, 100e6])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--flat", action="store_true", help="add fastamp with flat_buffers=True")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"fastamp {fastamp.__version__} | torch {torch.__version__} | {name}")
    summary = []
    for n in a.numel:
        kinds = ("torch", "fastamp", "flat") if a.flat else ("torch", "fastamp")
        got = {kind: measure(kind, int(n), a.device, a.reps) for kind in kinds}
        tw, tk = got["torch"]
        for kind in kinds[1:]:
            fw, fk = got[kind]
            summary.append(
                f"{n / 1e6:5.0f}M {kind:>7}: wall {kind}/torch {fw / tw:.3f}x "
                f"({fw * 1e3:.2f} / {tw * 1e3:.2f} ms)"
                + (
                    f", GPU kernels {fk / tk:.3f}x ({fk / 1e3:.2f} / {tk / 1e3:.2f} ms)"
                    if tk
                    else ""
                )
            )
    print("\n=== the whole step, fastamp / torch's fused recipe (host-cost issue: wall <= 0.80x)")
    print("\n".join(summary))


if __name__ == "__main__":
    sys.exit(main())
