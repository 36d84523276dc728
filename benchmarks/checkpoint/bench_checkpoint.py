"""Benchmark: activation memory and step time of checkpointing strategies on a 12-layer transformer.

Strategies, same model and inputs, one process, repetitions interleaved:
  none                  no checkpointing
  torch every block     torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
  fastamp every block   fastamp.checkpoint.checkpoint(block, x)
  fastamp selective     ... with context_fn=fastamp.checkpoint.selective() (save matmuls/attention)
  fastamp offload       saved activations in host memory (on CPU they already are: only the cost
                        of the copies is shown, and the memory column counts what stays on device)
  planner @ 50%         fastamp.checkpoint.apply(model, budget = 50% of "none")

Activation memory: on CPU the bytes autograd keeps for backward (saved tensors, checkpoint inputs,
selective caches; parameters excluded), counted by fastamp.checkpoint.planner.count_saved_bytes;
on CUDA also torch.cuda.max_memory_allocated over the step. Step = forward + backward.

    python benchmarks/checkpoint/bench_checkpoint.py
    python benchmarks/checkpoint/bench_checkpoint.py --device cuda --batch 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn

import fastamp
from fastamp.checkpoint import checkpoint, offload_activations, selective
from fastamp.checkpoint.planner import count_saved_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_name, int_options, print_header, sync, timed, write_results  # noqa: E402


def make_model(layers, dim, heads, device):
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        for _ in range(layers)
    )
    return blocks.to(device)


def strategies(model, device, x):
    offload_ctx = offload_activations(min_bytes=1 << 14, device_types=(device,))

    def none(y):
        for b in model:
            y = b(y)
        return y

    def torch_every(y):
        for b in model:
            y = torch.utils.checkpoint.checkpoint(b, y, use_reentrant=False)
        return y

    def fastamp_every(y):
        for b in model:
            y = checkpoint(b, y)
        return y

    def fastamp_selective(y):
        for b in model:
            y = checkpoint(b, y, context_fn=selective())
        return y

    def fastamp_offload(y):
        with offload_ctx:
            return none(y)

    strategies.offload_ctx = offload_ctx
    return {
        "none": none,
        "torch every block": torch_every,
        "fastamp every block": fastamp_every,
        "fastamp selective": fastamp_selective,
        "fastamp offload": fastamp_offload,
    }


def activation_bytes(fn, model, x, device):
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with count_saved_bytes(model) as counter:
        out = fn(x)
    saved = counter.total
    peak = None
    if device == "cuda":
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    out.float().square().mean().backward()
    return saved, peak


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    int_options(ap, layers=12, dim=256, heads=4, seq=128, batch=8, reps=7, warmup=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = args.device
    model = make_model(args.layers, args.dim, args.heads, dev)
    model.train()
    x = torch.randn(args.batch, args.seq, args.dim, device=dev, requires_grad=True)
    fns = strategies(model, dev, x)

    mem = {name: activation_bytes(fn, model, x, dev) for name, fn in fns.items()}
    budget = mem["none"][0] // 2
    # The planner measures one forward itself, then wraps the blocks it picks.
    wrapper = nn.Sequential(*model)  # same block objects: apply() finds them as "0".."11"
    plan = fastamp.checkpoint.apply(wrapper, budget, x.detach(), verbose=False)
    fns["planner @ 50%"] = lambda y: wrapper(y)
    mem["planner @ 50%"] = activation_bytes(fns["planner @ 50%"], model, x, dev)

    def step(fn):
        def run():
            model.zero_grad(set_to_none=True)
            fn(x).float().square().mean().backward()

        return run

    times = {name: [] for name in fns}
    for i in range(args.warmup + args.reps):
        for name, fn in fns.items():
            t = timed(step(fn), dev)
            if i >= args.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}

    mb = 2.0**20
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | {dev} ({device_name(dev)}) | "
        f"threads {torch.get_num_threads()} | {args.layers} x TransformerEncoderLayer(d={args.dim}, "
        f"heads={args.heads}), batch {args.batch} x seq {args.seq}, dropout 0.1"
    )
    cuda_col = f" {'CUDA peak MiB':>13}" if dev == "cuda" else ""
    header = f"{'strategy':<22} {'activations MiB':>15} {'vs none':>8}{cuda_col} {'step ms':>9} {'vs torch ckpt':>13}"
    print_header(header)
    rows = []
    for name in fns:
        saved, peak = mem[name]
        row = {
            "strategy": name,
            "activation_bytes": saved,
            "cuda_peak_bytes": peak,
            "step_s": med[name],
            "time_vs_torch_checkpoint": med[name] / med["torch every block"],
        }
        rows.append(row)
        cuda = f" {peak / mb:>13.1f}" if dev == "cuda" else ""
        print(
            f"{name:<22} {saved / mb:>15.1f} {saved / mem['none'][0]:>7.0%}{cuda} {med[name] * 1e3:>9.1f} "
            f"{row['time_vs_torch_checkpoint']:>12.2f}x"
        )
    planned = mem["planner @ 50%"][0]
    print(
        f"\nplanner: budget {budget / mb:.1f} MiB, measured {planned / mb:.1f} MiB "
        f"({planned / budget - 1:+.1%} of budget), {len(plan.chosen)}/{len(plan.blocks)} blocks checkpointed"
        f" + {len(plan.selective)} selectively"
    )
    pool = strategies.offload_ctx.pool
    print(
        f"offload: {pool.allocated_bytes / mb:.1f} MiB of host buffers allocated once, reused "
        f"{pool.reuses} times over the run (the 0 above is what stays on the device)"
    )
    ratio = med["fastamp every block"] / med["torch every block"]
    print(f"fastamp every block vs torch every block at equal memory: {ratio:.3f}x the time")
    write_results(args.json, dev, config=vars(args), budget_bytes=budget, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
