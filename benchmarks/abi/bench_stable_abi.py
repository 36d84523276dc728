"""Benchmark: what the LibTorch stable ABI costs per call, A/B between two fastamp installs.

The stable ABI reaches every tensor property through torch's C shim (a function call where the
classic C++ API inlined a field read) and boxes a ``Tensor[]`` into a vector of new handles, so its
cost is per tensor per call, largest for many small tensors. This runs the same workloads under two
Python environments (e.g. a classic-API build of fastamp and the stable-ABI one), alternating them
round by round in fresh processes, and prints each one's median time and the ratio B/A:

- ``grad_stats``: the scaler's stats op over N float32 grads of K elements;
- ``step``: a whole fused step on N params of K elements: ``GradScaler.clip_grad_norm_`` (stats),
  ``GradScaler.step`` (fastamp AdamW's fused update with the unscale and clip) and ``update()``.

    python benchmarks/abi/bench_stable_abi.py --pythons /tmp/venv-old/bin/python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = [(1, 1_000_000), (100, 10_000), (1000, 1_000), (4000, 256)]


def worker(reps: int) -> dict[str, float]:
    import torch

    import fastamp
    from fastamp.scaler import _ops as scaler_ops

    torch.manual_seed(0)
    out: dict[str, float] = {}
    for n, k in CASES:
        grads = [torch.randn(k) for _ in range(n)]
        inv = torch.ones(())
        scaler_ops.grad_stats(grads, inv)  # warm-up
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            scaler_ops.grad_stats(grads, inv)
            t.append(time.perf_counter() - t0)
        out[f"grad_stats {n}x{k}"] = statistics.median(t)

        params = [torch.nn.Parameter(torch.randn(k)) for _ in range(n)]
        for p, g in zip(params, grads):
            p.grad = g * 65536.0
        opt = fastamp.optim.AdamW(params, lr=1e-3)
        scaler = fastamp.GradScaler("cpu", init_scale=65536.0, growth_interval=10**6)
        scaler.scale(torch.ones(()))  # creates the scale on the device, as the first loss does
        t = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            if i:  # the first step creates the optimizer state
                t.append(time.perf_counter() - t0)
        out[f"step {n}x{k}"] = statistics.median(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pythons", nargs=2, metavar=("A", "B"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return
    if not args.pythons:
        ap.error("--pythons A B is required")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in args.pythons}
    for _ in range(args.rounds):
        for py in args.pythons:  # alternate A, B, A, B, ...
            cmd = [py, __file__, "--worker", "--reps", str(args.reps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd="/tmp")
            runs[py].append(json.loads(res.stdout.strip().splitlines()[-1]))
    a, b = args.pythons
    print(f"A = {a}\nB = {b}\n(median over {args.rounds} rounds of the per-round medians)\n")
    print(f"{'workload':28s} {'A (us)':>10s} {'B (us)':>10s} {'B/A':>7s}")
    for key in runs[a][0]:
        ta = statistics.median(r[key] for r in runs[a]) * 1e6
        tb = statistics.median(r[key] for r in runs[b]) * 1e6
        print(f"{key:28s} {ta:10.1f} {tb:10.1f} {tb / ta:7.3f}")


if __name__ == "__main__":
    sys.exit(main())
