"""Benchmark: the host cost of the AMP step, per tensor, where the kernels are nearly free.

Many tiny fp32 tensors (121 x 64 and 4000 x 256 elements by default) make the arithmetic
negligible and leave what the host does per tensor per step: Python bookkeeping, argument boxing,
launches. One thread, one process, the recipes interleaved in a balanced order, each timed over
``--steps`` consecutive steps after a warm-up; ``--runs`` repetitions give the median and spread.

  clipped  torch:   scaler.unscale_(opt); clip_grad_norm_(params, foreach=True); scaler.step(opt);
                    scaler.update()       with torch.amp.GradScaler + torch.optim.AdamW(fused=True)
           fastamp: scaler.clip_grad_norm_(opt, 1.0); scaler.step(opt); scaler.update()
                    with fastamp.GradScaler + fastamp.optim.AdamW
  plain    torch:   scaler.step(opt); scaler.update()          (torch.optim.AdamW(fused=True))
           fastamp: the same with fastamp.GradScaler + fastamp.optim.AdamW
  flat     (a third column with --flat): fastamp's recipe with fastamp.optim.AdamW(...,
           flat_buffers=True), params and grads as views of one buffer each

The grads stay the same tensors from step to step (``zero_grad(set_to_none=False)``-style
training); ``--fresh-grads`` gives every step new grad tensors instead (``set_to_none=True``),
timed together with the assignment that replaces them in every recipe.

    python benchmarks/optim/bench_host.py                      # both sizes, clipped and plain
    python benchmarks/optim/bench_host.py --sizes 121x64 --runs 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import fastamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_name, per_step_us  # noqa: E402

VARIANTS: tuple[str, ...] = ("torch", "fastamp")


def _make(variant: str, n: int, numel: int, fresh: bool):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(numel, generator=gen) * 0.02 for _ in range(n)]
    grads = [torch.randn(numel, generator=gen) * 2.0**16 * 1e-3 for _ in range(n)]
    model = torch.nn.ParameterList([torch.nn.Parameter(w) for w in init])
    params = list(model.parameters())
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if variant == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10**9)
    else:
        opt = fastamp.optim.AdamW(
            params, lr=1e-4, weight_decay=0.01, flat_buffers=variant == "flat"
        )
        scaler = fastamp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # the scale's lazy init
    spare = [g.clone() for g in grads] if fresh else None
    return params, opt, scaler, spare


def _step(variant: str, mode: str, params, opt, scaler, spare):
    clip = mode == "clipped"
    fresh = spare is not None

    if variant == "torch":

        def fn() -> None:
            if fresh:
                for p, g in zip(params, spare):
                    p.grad = g
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            scaler.step(opt)
            scaler.update()
    else:

        def fn() -> None:
            if fresh:
                for p, g in zip(params, spare):
                    p.grad = g
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

    return fn


def verify(n: int, numel: int, mode: str) -> None:
    """The recipes make the same updates: three steps each from one start, the grads restored
    before each (torch's ``unscale_`` divides them in place; fastamp's fused step only reads
    them), params compared."""
    setups = {v: _make(v, n, numel, False) for v in VARIANTS}
    saved = [p.grad.clone() for p in setups["torch"][0]]
    for v in VARIANTS:
        fn = _step(v, mode, *setups[v])
        for _ in range(3):
            torch._foreach_copy_([p.grad for p in setups[v][0]], saved)
            fn()
    for v in VARIANTS[1:]:
        for a, b in zip(setups[v][0], setups["torch"][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        if v == "flat":  # flat buffers: the per-parameter path's bits (unclipped)
            for a, b in zip(setups[v][0], setups["fastamp"][0]):
                if mode == "plain":
                    assert torch.equal(a, b)


def bench(n: int, numel: int, mode: str, runs: int, steps: int, warmup: int, fresh: bool):
    setups = {v: _make(v, n, numel, fresh) for v in VARIANTS}
    fns = {v: _step(v, mode, *setups[v]) for v in VARIANTS}
    return per_step_us(fns, runs, steps, warmup, n)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", nargs="+", default=["121x64", "4000x256"])
    ap.add_argument("--modes", nargs="+", default=["clipped", "plain"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="steps per timed block (default: ~0.5 s)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fresh-grads", action="store_true")
    ap.add_argument("--flat", action="store_true", help="add fastamp with flat_buffers=True")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global VARIANTS
    if args.flat:
        VARIANTS = ("torch", "fastamp", "flat")
    torch.set_num_threads(args.threads)
    print(
        f"# bench_host: {device_name('cpu')}, torch {torch.__version__}, {args.threads} thread(s), "
        f"fastamp {fastamp.build_info()['cpu_capability']} kernels, "
        f"{'fresh' if args.fresh_grads else 'persistent'} grads; us per tensor per step, "
        f"median of {args.runs} [min-max]"
    )
    head = f"{'size':>9} {'mode':>8} {'torch':>20} {'fastamp':>20} {'fastamp/torch':>14}"
    if args.flat:
        head += f"  {'flat':>20} {'flat/torch':>11}"
    print(head)
    results = []
    for size in args.sizes:
        n, numel = (int(x) for x in size.split("x"))
        steps = args.steps or max(3, int(50_000 / n))
        for mode in args.modes:
            verify(n, numel, mode)
            r = bench(n, numel, mode, args.runs, steps, args.warmup, args.fresh_grads)
            ratio = statistics.median(r["fastamp"]) / statistics.median(r["torch"])
            spread = [a / b for a, b in zip(r["fastamp"], r["torch"])]
            line = (
                f"{size:>9} {mode:>8} {_fmt(r['torch']):>20} {_fmt(r['fastamp']):>20} "
                f"{ratio:13.3f}x  (per run {min(spread):.3f}-{max(spread):.3f})"
            )
            entry = {"size": size, "mode": mode, "steps": steps, "us_per_tensor": r, "ratio": ratio}
            if args.flat:
                fr = statistics.median(r["flat"]) / statistics.median(r["torch"])
                fs = [a / b for a, b in zip(r["flat"], r["torch"])]
                line += f"  {_fmt(r['flat']):>20} {fr:10.3f}x (per run {min(fs):.3f}-{max(fs):.3f})"
                entry["flat_ratio"] = fr
            print(line)
            results.append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name("cpu"), "torch": torch.__version__,
                       "threads": args.threads, "fresh_grads": args.fresh_grads,
                       "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
