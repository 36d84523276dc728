"""Benchmark: the training step of ``examples/train.py --checkpoint --compare-torch``, interleaved.

examples/train.py trains the fastamp run to the end, then the torch run: on a machine whose load
drifts (shared CPUs) its "step time torch/fastamp" moves by +-10% from one invocation to the next.
This script builds the same two setups (examples/train.py's TinyLM with every block checkpointed,
bf16 autocast on CPU, fastamp.optim.AdamW + fastamp.GradScaler + fastamp.checkpoint vs
torch.optim.AdamW + torch.amp.GradScaler + torch.utils.checkpoint, same seed, same batches) and
alternates them step by step, so both see the same machine. It prints the median step time of
each and the median of the per-step ratios torch / fastamp (> 1: fastamp is faster), as
examples/train.py does.

    python benchmarks/checkpoint/bench_train_checkpoint.py
    python benchmarks/checkpoint/bench_train_checkpoint.py --steps 40 --runs 3
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time

import torch
from torch import nn

import fastamp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import int_options  # noqa: E402


def _train_module():
    if os.path.join(ROOT, "examples") not in sys.path:  # train.py imports its sibling plotting.py
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    spec = importlib.util.spec_from_file_location(
        "fastamp_example_train", os.path.join(ROOT, "examples", "train.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def setup(ex, impl, args):
    torch.manual_seed(args.seed)
    model = ex.TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq, True, impl)
    if impl == "fastamp":
        opt = fastamp.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scaler = fastamp.GradScaler("cpu", enabled=False)  # bf16: no loss scaling, as train.py
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
    return model, opt, scaler


def step(model, opt, scaler, tokens, target):
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    t = time.perf_counter() - t0
    gc.enable()
    return t, loss.item()


def run_once(ex, args):
    runs = {impl: setup(ex, impl, args) for impl in ("fastamp", "torch")}
    data = list(
        ex.synthetic(args.steps + args.warmup, args.batch_size, args.seq, args.vocab, args.seed)
    )
    times = {"fastamp": [], "torch": []}
    ratios, max_diff = [], 0.0
    for i, (tokens, target) in enumerate(data):
        order = ["fastamp", "torch"] if i % 2 == 0 else ["torch", "fastamp"]
        out = {impl: step(*runs[impl], tokens, target) for impl in order}
        max_diff = max(max_diff, abs(out["fastamp"][1] - out["torch"][1]))
        if i >= args.warmup:
            for impl in order:
                times[impl].append(out[impl][0])
            ratios.append(out["torch"][0] / out["fastamp"][0])
    return (
        {impl: statistics.median(v) for impl, v in times.items()},
        statistics.median(ratios),
        max_diff,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    int_options(
        ap, steps=30, warmup=3, runs=1, batch_size=32, dim=128, heads=4, layers=4, seq=64,
        vocab=256, seed=0,
    )  # fmt: skip
    args = ap.parse_args(argv)
    ex = _train_module()
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | cpu | threads {torch.get_num_threads()} | "
        f"examples/train.py TinyLM(dim={args.dim}, layers={args.layers}, seq={args.seq}) batch "
        f"{args.batch_size}, every block checkpointed, bf16 autocast | {args.steps} interleaved steps"
    )
    ratios = []
    for r in range(args.runs):
        med, ratio, diff = run_once(ex, args)
        ratios.append(ratio)
        print(
            f"run {r + 1}: median step ms fastamp {med['fastamp'] * 1e3:.1f}, torch {med['torch'] * 1e3:.1f}; "
            f"step time torch/fastamp (median of per-step ratios) {ratio:.3f}x; max |loss difference| {diff:.2e}"
        )
    if args.runs > 1:
        print(
            f"median over {args.runs} runs: {statistics.median(ratios):.3f}x (min {min(ratios):.3f}, "
            f"max {max(ratios):.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
