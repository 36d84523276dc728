"""Benchmark: the step without a loss scaler (bf16 autocast or fp32 training), fastamp vs torch.

  torch:    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True); opt.step()
            with torch.optim.AdamW(fused=True)                       (torch's bf16 recipe)
  fastamp:  fastamp.clip_grad_norm_(opt, max_norm); opt.step()  with fastamp.optim.AdamW
  flat:     (--flat) the same with fastamp.optim.AdamW(flat_buffers=True)
  guarded:  (--guard) fastamp's with skip_nonfinite=True (the device-side NaN guard)

Two tables, one run, the recipes interleaved in a balanced order, grads restored (untimed)
before each timed block:

* throughput (``--sizes``, default 29M params in transformer shapes, ``--threads`` 2): median ms
  per step [min-max] over ``--reps``, GB/s of the bytes each recipe must move, and the floor.
  Bytes per fp32 param: torch 40 (clip's norm pass 4, its scale pass r+w 8, fused AdamW 28);
  fastamp 32 (stats pass 4, the update 28 with the clip folded in);
* host cost (``--host-sizes``, default 121x64 and 4000x256, one thread): us per tensor per step,
  where the kernels are nearly free and what is left is the host's work per tensor.

On a GPU (``--device cuda``, what ``make gpu-check`` runs) the throughput table also gives the
kernel time (torch.profiler: the sum of the step's device kernels) beside the wall time (CUDA
events), for ``--layouts`` N params split over T equal tensors (e.g. 10e6/25 100e6/121).

    python benchmarks/optim/bench_bf16_step.py --runs 3 --json out.json
    python benchmarks/optim/bench_bf16_step.py --device cuda --layouts 10e6/25 100e6/121 --host-sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch

import fastamp
from fastamp.testing import transformer_like_shapes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import balanced_order, copy_bandwidth, device_name, per_step_us, sync, timed  # noqa: E402

BYTES = {"torch": 40, "fastamp": 32, "flat": 32, "guarded": 32}


def _setup(
    variant: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0,
    device: str = "cpu",
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(device) for s in shapes]
    params = [torch.nn.Parameter(w.to(device=device, dtype=dtype)) for w in init]
    if variant == "torch":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=1e-4, weight_decay=0.01, fused=True
        )
    else:
        opt = fastamp.optim.AdamW(
            params, lr=1e-4, weight_decay=0.01, flat_buffers=variant == "flat",
            master_weights=dtype is not torch.float32,
        )  # fmt: skip
    opt.zero_grad(set_to_none=False) if variant == "flat" else None
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.to(dtype)
        else:
            p.grad.copy_(g)
    saved = [g.to(dtype) for g in grads]
    return params, opt, saved


def _step(variant: str, params, opt, max_norm: float) -> Callable[[], None]:
    if variant == "torch":

        def fn() -> None:
            torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
            opt.step()

        return fn
    skip = variant == "guarded"

    def fa() -> None:
        fastamp.clip_grad_norm_(opt, max_norm, skip_nonfinite=skip)
        opt.step()

    return fa


def _restore(params, saved) -> None:
    torch._foreach_copy_([p.grad for p in params], saved)


def verify(variants, shapes, dtype, max_norm, device="cpu") -> None:
    """Same updates: three steps of every recipe from one start, grads restored before each."""
    setups = {v: _setup(v, shapes, dtype, device=device) for v in variants}
    for v in variants:
        params, opt, saved = setups[v]
        fn = _step(v, params, opt, max_norm)
        for _ in range(3):
            _restore(params, saved)
            fn()
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype is torch.float32 else {"rtol": 2e-2, "atol": 1e-4}
    for v in variants[1:]:
        for a, b in zip(setups[v][0], setups["torch"][0]):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def _kernel_seconds(fn: Callable[[], None], reps: int) -> float:
    """The step's device kernel time per call (torch.profiler's CUDA kernels), median-free: the
    total over ``reps`` calls divided by ``reps``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages())
    return total_us / reps / 1e6


def throughput(variants, shapes, dtype, reps, warmup, max_norm, device="cpu"):
    numel = sum(math.prod(s) for s in shapes)
    setups = {v: _setup(v, shapes, dtype, device=device) for v in variants}
    fns = {v: _step(v, setups[v][0], setups[v][1], max_norm) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + reps):
        for v in balanced_order(list(variants), i):
            params, _, saved = setups[v]
            _restore(params, saved)
            gc.collect()
            sync(device)
            t = timed(fns[v], device)
            if i >= warmup:
                times[v].append(t)
    kernels = {v: _kernel_seconds(fns[v], reps) for v in variants} if device == "cuda" else {}
    return numel, len(shapes), times, kernels


def host(variants, n, numel, runs, steps, warmup, max_norm, device="cpu"):
    shapes = [(numel,)] * n
    setups = {v: _setup(v, shapes, torch.float32, device=device) for v in variants}
    fns = {v: _step(v, setups[v][0], setups[v][1], max_norm) for v in variants}
    return per_step_us(fns, runs, steps, warmup, n, device)


def _fmt(values: list[float], scale: float = 1.0) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):8.2f} [{min(v):.2f}-{max(v):.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="*", type=float, default=[29e6],
                    help="params in transformer-shaped tensors")  # fmt: skip
    ap.add_argument("--layouts", nargs="*", default=[],
                    help="N/T: N params in T equal tensors (e.g. 10e6/25)")  # fmt: skip
    ap.add_argument("--host-sizes", nargs="*", default=["121x64", "4000x256"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="param dtype for the throughput table (bf16 autocast keeps float32)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants: tuple[str, ...] = ("torch", "fastamp")
    variants += ("flat",) * args.flat + ("guarded",) * args.guard
    dtype = getattr(torch, args.dtype)
    dev = args.device
    out: dict[str, object] = {"device": device_name(dev), "torch": torch.__version__,
                              "cpu_capability": fastamp.build_info()["cpu_capability"]}  # fmt: skip
    torch.set_num_threads(args.threads)
    bw = copy_bandwidth(dev)
    print(f"# bench_bf16_step: {out['device']}, torch {torch.__version__}, fastamp "
          f"{out['cpu_capability']} CPU kernels, {args.dtype} params, max_norm {args.max_norm}")  # fmt: skip
    print(f"## throughput on {dev}, {args.threads} CPU thread(s), median of {args.reps} [min-max]; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s")  # fmt: skip
    layouts = [transformer_like_shapes(int(n)) for n in args.sizes]
    for spec in args.layouts:
        n, t = spec.split("/")
        per = int(float(n)) // int(t)
        layouts.append([(per,)] * int(t))
    rows = []
    for shapes in layouts:
        small = [(min(math.prod(sh), 4096),) for sh in shapes]
        verify(variants, small, dtype, args.max_norm, dev)
        numel, ntensors, times, kernels = throughput(
            variants, shapes, dtype, args.reps, args.warmup, args.max_norm, dev
        )
        torch_s = statistics.median(times["torch"])
        for v in variants:
            med = statistics.median(times[v])
            gbs = BYTES[v] * numel / med / 1e9
            floor = BYTES[v] * numel / bw * 1e3
            ratios = [a / b for a, b in zip(times[v], times["torch"])]
            kern = ""
            if kernels:
                kern = (f"  kernels {kernels[v] * 1e3:7.3f} ms "
                        f"({kernels[v] / kernels['torch']:.3f}x torch's)")  # fmt: skip
            print(f"{numel / 1e6:6.1f}M/{ntensors:<4d} {v:>8} {_fmt(times[v], 1e3)} ms "
                  f"{gbs:6.1f} GB/s  floor {floor:7.2f} ms  {med / torch_s:6.3f}x torch "
                  f"(per rep {min(ratios):.3f}-{max(ratios):.3f}){kern}")  # fmt: skip
        rows.append({"numel": numel, "tensors": ntensors, "seconds": times, "kernel_s": kernels})
    out["throughput"] = rows
    torch.set_num_threads(1)
    print("## host cost, 1 thread, us per tensor per step, median of "
          f"{args.runs} [min-max]")  # fmt: skip
    hosts = []
    for size in args.host_sizes:
        n, numel = (int(x) for x in size.split("x"))
        steps = max(3, int(50_000 / n))
        r = host(variants, n, numel, args.runs, steps, args.warmup, args.max_norm, dev)
        base = statistics.median(r["torch"])
        line = f"{size:>9} torch {_fmt(r['torch'])}"
        for v in variants[1:]:
            spread = [a / b for a, b in zip(r[v], r["torch"])]
            line += (f" | {v} {_fmt(r[v])} {statistics.median(r[v]) / base:.3f}x "
                     f"({min(spread):.3f}-{max(spread):.3f})")  # fmt: skip
        print(line)
        hosts.append({"size": size, "steps": steps, "us_per_tensor": r})
    out["host"] = hosts
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
