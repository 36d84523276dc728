"""Benchmark: unscale + inf/NaN check + clip + scale update, fastamp vs PyTorch, side by side.

PyTorch's recipe:  scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True);
                   scaler.step(opt); scaler.update()
fastamp:           scaler.clip_grad_norm_(opt, max_norm); scaler.step(opt); scaler.update()

The optimizer's own update is left out (a no-op optimizer) so the table measures the scaler's work.
Every repetition starts from the same scaled grads (restored untimed), with a realistic scale of
2**16 and a max_norm that clips. Grads are split like a GPT-style transformer's parameters.
Repetitions alternate torch / fastamp. Bytes moved per element: PyTorch reads+writes (unscale),
reads (norm), reads+writes (clip) = 5 passes; fastamp reads (stats) and reads+writes (unscale+clip)
= 3 passes. The floor is those bytes over the copy bandwidth measured in the same run.

    python benchmarks/scaler/bench_grad_scaler.py                      # CPU: 10M, 50M, 100M
    python benchmarks/scaler/bench_grad_scaler.py --device cuda --sizes 100e6 1e9
    python benchmarks/scaler/bench_grad_scaler.py --json out.json
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


class _NoOpOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def bench_size(n_params, dtype, device, reps, warmup, max_norm):
    shapes = transformer_like_shapes(int(n_params))
    numel = sum(math.prod(s) for s in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    params, masters = [], []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device))
        g = (torch.randn(s, generator=gen, device=device) * 2.0**16 * 1e-3).to(dtype)
        masters.append(g)
        p.grad = g.clone()
        params.append(p)

    opt = _NoOpOptimizer(params)
    growth = 10**9  # keep the scale fixed so every repetition does identical work
    scalers = {
        "torch": torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=growth),
        "fastamp": fastamp.GradScaler(device, init_scale=2.0**16, growth_interval=growth),
    }

    def torch_step():
        s = scalers["torch"]
        s.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        s.step(opt)
        s.update()

    def fastamp_step():
        s = scalers["fastamp"]
        s.clip_grad_norm_(opt, max_norm)
        s.step(opt)
        s.update()

    def restore():
        torch._foreach_copy_([p.grad for p in params], masters)
        for s in scalers.values():
            s.scale(torch.ones((), device=device))  # lazy init of the scale tensor
        sync(device)

    fns = {"torch": torch_step, "fastamp": fastamp_step}
    times = {k: [] for k in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            restore()
            t = timed(fn, device)
            if i >= warmup:
                times[name].append(t)
    # Check both results against a float64 reference norm (PyTorch's fp32 CPU norm drifts at
    # these sizes; ours accumulates per chunk and is checked to 1e-5).
    ref_norm = math.sqrt(sum(float((m.double() / 2.0**16).square().sum()) for m in masters))
    norms = {}
    restore()
    s = scalers["torch"]
    s.unscale_(opt)
    norms["torch"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    s.step(opt)
    s.update()
    restore()
    norms["fastamp"] = float(scalers["fastamp"].clip_grad_norm_(opt, max_norm))
    scalers["fastamp"].step(opt)
    scalers["fastamp"].update()
    errors = {k: abs(v - ref_norm) / ref_norm for k, v in norms.items()}
    assert errors["fastamp"] < 1e-5, f"fastamp norm off by {errors['fastamp']:.2e} relative"
    return numel, {k: statistics.median(v) for k, v in times.items()}, errors


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="+", type=float, default=[10e6, 50e6, 100e6])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float16 and args.device == "cpu":
        ap.error("torch.amp.GradScaler refuses fp16 grads on CPU; use float32 or bfloat16")

    bw = copy_bandwidth(args.device)
    esize = torch.tensor([], dtype=dtype).element_size()
    dev_name = device_name(args.device)
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | {args.device} ({dev_name}) | "
        f"threads {torch.get_num_threads()} | grads {args.dtype} | copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    header = (
        f"{'params':>8} | {'torch ms':>9} {'fastamp ms':>10} {'speedup':>8} | "
        f"{'torch B/el':>10} {'fastamp B/el':>12} | {'torch floor':>11} {'fastamp floor':>13} "
        f"{'fastamp % of floor':>18} | {'norm rel err torch / fastamp':>28}"
    )
    print_header(header)
    rows = []
    for n in args.sizes:
        numel, med, errors = bench_size(
            n, dtype, args.device, args.reps, args.warmup, args.max_norm
        )
        t_bytes, f_bytes = 5 * esize, 3 * esize
        t_floor, f_floor = numel * t_bytes / bw, numel * f_bytes / bw
        row = {
            "params": numel,
            "torch_s": med["torch"],
            "fastamp_s": med["fastamp"],
            "speedup": med["torch"] / med["fastamp"],
            "torch_bytes_per_elem": t_bytes,
            "fastamp_bytes_per_elem": f_bytes,
            "torch_floor_s": t_floor,
            "fastamp_floor_s": f_floor,
            "fastamp_fraction_of_floor": f_floor / med["fastamp"],
            "torch_norm_rel_error": errors["torch"],
            "fastamp_norm_rel_error": errors["fastamp"],
        }
        rows.append(row)
        print(
            f"{numel / 1e6:>7.1f}M | {med['torch'] * 1e3:>9.2f} {med['fastamp'] * 1e3:>10.2f} "
            f"{row['speedup']:>7.2f}x | {t_bytes:>10} {f_bytes:>12} | {t_floor * 1e3:>9.2f}ms "
            f"{f_floor * 1e3:>11.2f}ms {100 * row['fastamp_fraction_of_floor']:>17.0f}% | "
            f"{errors['torch']:>13.1e} / {errors['fastamp']:.1e}"
        )
    write_results(
        args.json,
        args.device,
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        copy_bandwidth_Bps=bw,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
