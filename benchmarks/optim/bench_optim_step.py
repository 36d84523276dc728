"""Benchmark: the whole post-backward step (inf check + grad norm + clip + AdamW update + scale update).

Three recipes on the same model-shaped parameters and the same loss-scaled grads, in one process,
repetitions interleaved, grads restored (untimed) before each repetition:

  torch fused:    scaler.unscale_(opt); clip_grad_norm_(params, foreach=True); scaler.step(opt);
                  scaler.update()        with torch.optim.AdamW(fused=True)   (PyTorch's best)
  torch foreach:  the same with torch.optim.AdamW(foreach=True)
  fastamp:        scaler.clip_grad_norm_(opt); scaler.step(opt); scaler.update()
                  with fastamp.GradScaler + fastamp.optim.AdamW

Bytes moved per parameter (fp32 params, grads, exp_avg, exp_avg_sq):
  fastamp      4 (stats: read g) + 28 (update: read g, read+write p, m, v)                  = 32
  torch fused  8 (unscale: r+w g) + 4 (norm) + 8 (clip: r+w g) + 28 (fused update)          = 48
The floor is those bytes over the copy bandwidth measured in the same run.

    python benchmarks/optim/bench_optim_step.py                       # CPU: 10M, 50M, 100M
    python benchmarks/optim/bench_optim_step.py --device cuda --sizes 100e6 1e9
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

import fastamp
from fastamp.testing import transformer_like_shapes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import copy_bandwidth, device_name, print_header, sync, timed, write_results  # noqa: E402

FASTAMP_BYTES, TORCH_FUSED_BYTES = 32, 48


def bench_size(n_params, device, reps, warmup, max_norm):
    shapes = transformer_like_shapes(int(n_params))
    numel = sum(math.prod(s) for s in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    masters = [torch.randn(s, generator=gen, device=device) * 2.0**16 * 1e-3 for s in shapes]
    init = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]

    def make(kind):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        for p, g in zip(params, masters):
            p.grad = g.clone()
        if kind == "fastamp":
            opt = fastamp.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
            scaler = fastamp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)
        else:
            extra = {"fused": True} if kind == "torch fused" else {"foreach": True}
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **extra)
            scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=10**9)
        scaler.scale(torch.ones((), device=device))  # lazy init of the scale tensor
        return params, opt, scaler

    setups = {k: make(k) for k in ("torch fused", "torch foreach", "fastamp")}

    def step_fn(kind):
        params, opt, scaler = setups[kind]
        if kind == "fastamp":

            def fn():
                scaler.clip_grad_norm_(opt, max_norm)
                scaler.step(opt)
                scaler.update()
        else:

            def fn():
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
                scaler.step(opt)
                scaler.update()

        return fn

    fns = {k: step_fn(k) for k in setups}
    times = {k: [] for k in setups}
    for i in range(warmup + reps):
        for kind, fn in fns.items():
            params = setups[kind][0]
            torch._foreach_copy_([p.grad for p in params], masters)
            sync(device)
            t = timed(fn, device)
            if i >= warmup:
                times[kind].append(t)
    # Same trajectory check: every recipe took warmup + reps identical steps from the same start.
    ref = setups["torch fused"][0]
    for kind in ("torch foreach", "fastamp"):
        for a, b in zip(setups[kind][0], ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    return numel, {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="+", type=float, default=[10e6, 50e6, 100e6])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    bw = copy_bandwidth(args.device)
    dev_name = device_name(args.device)
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | {args.device} ({dev_name}) | "
        f"threads {torch.get_num_threads()} | fp32 | copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    header = (
        f"{'params':>8} | {'torch fused':>11} {'torch foreach':>13} {'fastamp':>9} | "
        f"{'vs fused':>8} {'vs foreach':>10} | {'B/param torch fused / fastamp':>29} | "
        f"{'fastamp floor':>13} {'% of floor':>10}"
    )
    print_header(header)
    rows = []
    for n in args.sizes:
        numel, med = bench_size(n, args.device, args.reps, args.warmup, args.max_norm)
        floor = numel * FASTAMP_BYTES / bw
        row = {
            "params": numel,
            **{f"{k}_s": v for k, v in med.items()},
            "speedup_vs_fused": med["torch fused"] / med["fastamp"],
            "speedup_vs_foreach": med["torch foreach"] / med["fastamp"],
            "fastamp_bytes_per_param": FASTAMP_BYTES,
            "torch_fused_bytes_per_param": TORCH_FUSED_BYTES,
            "fastamp_floor_s": floor,
            "fastamp_fraction_of_floor": floor / med["fastamp"],
        }
        rows.append(row)
        print(
            f"{numel / 1e6:>7.1f}M | {med['torch fused'] * 1e3:>9.1f}ms {med['torch foreach'] * 1e3:>11.1f}ms "
            f"{med['fastamp'] * 1e3:>7.1f}ms | {row['speedup_vs_fused']:>7.2f}x {row['speedup_vs_foreach']:>9.2f}x | "
            f"{TORCH_FUSED_BYTES:>18} / {FASTAMP_BYTES:<8} | {floor * 1e3:>11.1f}ms "
            f"{100 * row['fastamp_fraction_of_floor']:>9.0f}%"
        )
    write_results(
        args.json, args.device, threads=torch.get_num_threads(), copy_bandwidth_Bps=bw, rows=rows
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
