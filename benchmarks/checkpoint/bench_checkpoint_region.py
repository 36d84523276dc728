"""Benchmark: the cost of one checkpointed region, fastamp.checkpoint.checkpoint vs
torch.utils.checkpoint.checkpoint(use_reentrant=False), from tiny blocks (where only the per-call
overhead shows) to a transformer layer under autocast.

For each block, one "rep" times R regions (forward + backward of R checkpointed calls of the block
on the same input) with torch's checkpoint, then with fastamp's (the order alternates between reps,
so drift and frequency changes hit both alike); the table prints the median time per region of each,
the difference per region and the ratio fastamp / torch (the median over reps of the ratio of the
two back-to-back timings of a rep). Both run with their defaults
(preserve_rng_state=True: torch stashes the CPU generator and the devices of the arguments, fastamp
the CPU generator and every initialised CUDA device).

Clock: on CPU the default is one intra-op thread and the CPU time of the calling thread
(time.thread_time, which runs the forward and, for CPU tensors, the backward too): on a shared
machine it counts the work of this process only, where wall time also counts the time other
processes hold the cores. --clock wall --threads N times wall clock instead (CUDA: always wall
clock with a synchronize).

    python benchmarks/checkpoint/bench_checkpoint_region.py
    python benchmarks/checkpoint/bench_checkpoint_region.py --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
from torch import nn

import fastamp
from fastamp.checkpoint import checkpoint as fa_checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_name, print_header, sync, write_results  # noqa: E402


def torch_checkpoint(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def blocks(device: str):
    torch.manual_seed(0)
    tiny = nn.Linear(8, 8).to(device)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64)).to(
        device
    )
    layer = nn.TransformerEncoderLayer(
        128, 4, 512, dropout=0.1, batch_first=True, norm_first=True
    ).to(device)
    bf16 = torch.autocast(device_type=device, dtype=torch.bfloat16)
    return [
        # (name, module, input, context, regions per rep)
        (
            "Linear(8, 8)",
            tiny,
            torch.randn(4, 8, device=device, requires_grad=True),
            contextlib.nullcontext,
            200,
        ),
        (
            "MLP 64-256-64 + dropout",
            mlp,
            torch.randn(32, 64, device=device, requires_grad=True),
            contextlib.nullcontext,
            100,
        ),
        (
            "TransformerEncoderLayer(128), bf16 autocast",
            layer,
            torch.randn(8, 32, 128, device=device, requires_grad=True),
            lambda: bf16,
            20,
        ),
    ]


CLOCK = time.thread_time


def time_regions(ckpt, module, x, ctx, regions: int, device: str) -> float:
    """Seconds per region: `regions` checkpointed forwards, then one backward through all."""
    gc.collect()  # as timeit does: no collection of the other's garbage inside the timing
    gc.disable()
    sync(device)
    t0 = CLOCK()
    with ctx():
        outs = [ckpt(module, x) for _ in range(regions)]
        loss = sum(o.float().sum() for o in outs)
    loss.backward()
    sync(device)
    t = (CLOCK() - t0) / regions
    gc.enable()
    return t


def run_once(device: str, reps: int, warmup: int) -> list[dict]:
    rows = []
    for name, module, x, ctx, regions in blocks(device):
        times = {"torch": [], "fastamp": []}
        pair_ratios = []
        for i in range(warmup + reps):
            order = [("torch", torch_checkpoint), ("fastamp", fa_checkpoint)]
            if i % 2:
                order.reverse()
            pair = {}
            for label, ck in order:
                module.zero_grad(set_to_none=True)
                x.grad = None
                pair[label] = time_regions(ck, module, x, ctx, regions, device)
            if i >= warmup:
                for label, t in pair.items():
                    times[label].append(t)
                pair_ratios.append(pair["fastamp"] / pair["torch"])
        t_med = statistics.median(times["torch"])
        f_med = statistics.median(times["fastamp"])
        rows.append(
            {
                "block": name,
                "regions_per_rep": regions,
                "reps": reps,
                "torch_us": t_med * 1e6,
                "fastamp_us": f_med * 1e6,
                "diff_us": (f_med - t_med) * 1e6,
                # the median of the per-rep ratios (each rep times both back to back, so
                # slow drifts of the machine cancel); the ratio of the medians is kept too
                "ratio": statistics.median(pair_ratios),
                "ratio_of_medians": f_med / t_med,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--runs", type=int, default=1, help="independent runs; the summary is their median"
    )
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global CLOCK
    if args.clock == "wall" or args.device != "cpu":
        args.clock = "wall"
        CLOCK = time.perf_counter
    torch.set_num_threads(args.threads)
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | {args.device} "
        f"({device_name(args.device)}) | threads {torch.get_num_threads()} | clock {args.clock} | "
        f"{args.reps} interleaved reps per run after {args.warmup} warm-ups"
    )
    all_runs = []
    for r in range(args.runs):
        rows = run_once(args.device, args.reps, args.warmup)
        all_runs.append(rows)
        print(f"\nrun {r + 1}/{args.runs}")
        header = (
            f"{'block':<46} {'torch us/region':>15} {'fastamp us/region':>17} {'diff us':>8} "
            f"{'fastamp/torch':>13}"
        )
        print_header(header)
        for row in rows:
            print(
                f"{row['block']:<46} {row['torch_us']:>15.1f} {row['fastamp_us']:>17.1f} "
                f"{row['diff_us']:>+8.1f} {row['ratio']:>12.3f}x"
            )
    if args.runs > 1:
        print(f"\nsummary over {args.runs} runs: median ratio (min - max)")
        for k, row in enumerate(all_runs[0]):
            ratios = [run[k]["ratio"] for run in all_runs]
            print(
                f"{row['block']:<46} {statistics.median(ratios):.3f}x ({min(ratios):.3f} - {max(ratios):.3f})"
            )
    write_results(args.json, args.device, config=vars(args), runs=all_runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
