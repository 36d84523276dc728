"""Benchmark: the post-backward glue + optimizer step of an FSDP2-sharded model, fastamp vs torch.

The same sharded model (``fully_shard`` on every layer and the root), the same data, in one run on
every rank, repetitions interleaved (in a carry-over balanced order, benchmarks/common.py
balanced_order) after warm-up:

  torch:    torch.amp.GradScaler + torch.optim.AdamW(foreach=True), and AdamW(fused=True)
            scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0);
            scaler.step(opt); scaler.update()
  fastamp:  fastamp.GradScaler + fastamp.optim.AdamW (float32, bfloat16 and 8-bit state)
            scaler.clip_grad_norm_(opt, 1.0); scaler.step(opt); scaler.update()

Timed per step: the glue above (zero_grad + forward + backward run untimed before it, then a
barrier); the table reports medians on rank 0, the ratio to torch, and the all-reduces each
issued (CommDebugMode). Optimizer-state bytes per parameter per rank are counted from the state
tensors' local shards (torch: float32 moments).

    python benchmarks/distributed/bench_fsdp.py                    # spawns 2 gloo ranks on CPU
    python benchmarks/distributed/bench_fsdp.py --width 2048 --layers 4 --reps 30
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fastamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import balanced_order, device_name, int_options  # noqa: E402

VARIANTS = ["torch", "torch fused", "fastamp float32", "fastamp bfloat16", "fastamp int8"]


def _model(mesh, width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    m = nn.Sequential(*mods, nn.Linear(width, 8))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _setup(variant: str, mesh, args):
    m = _model(mesh, args.width, args.layers)
    if variant.startswith("torch"):
        fused = variant == "torch fused"
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=not fused, fused=fused)
        return m, opt, torch.amp.GradScaler("cpu", init_scale=1.0)
    fmt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": "int8"}[variant.split()[1]]
    opt = fastamp.optim.AdamW(m.parameters(), lr=1e-4, state_dtype=fmt)
    return m, opt, fastamp.GradScaler("cpu", init_scale=1.0)


def _glue(variant: str, m, opt, scaler) -> None:
    if variant.startswith("torch"):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    else:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def _state_bytes_per_param(m, opt) -> float:
    params = list(m.parameters())
    numel = sum(p.to_local().numel() for p in params)
    total = 0
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # moments, codes, block scales
                t = v.to_local() if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    return total / numel


def worker(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    torch.set_num_threads(1)  # one core per rank
    mesh = init_device_mesh("cpu", (world,))
    runs = {v: _setup(v, mesh, args) for v in VARIANTS}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    comms: dict[str, int] = {}
    for rep in range(args.warmup + args.reps):
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randn(args.batch, 8, generator=g)
        for v in balanced_order(VARIANTS, rep):
            m, opt, scaler = runs[v]
            opt.zero_grad(set_to_none=True)
            scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
            dist.barrier()
            mode = CommDebugMode()
            t0 = time.perf_counter()
            with mode:
                _glue(v, m, opt, scaler)
            dt = time.perf_counter() - t0
            if rep >= args.warmup:
                times[v].append(dt)
            comms[v] = mode.get_total_counts()
    state = {v: _state_bytes_per_param(runs[v][0], runs[v][1]) for v in VARIANTS}
    meds = {v: statistics.median(t) for v, t in times.items()}
    every = [None] * world
    dist.all_gather_object(every, meds)
    if rank == 0:
        params = sum(p.numel() for p in runs["torch"][0].parameters())
        print(
            f"\nFSDP2 on {world} gloo ranks ({device_name('cpu')}, 1 thread each); "
            f"{args.layers} x Linear({args.width}, {args.width}) + head = {params / 1e6:.1f}M "
            f"params; median of {args.reps} reps after {args.warmup} warm-up, interleaved\n"
        )
        print(
            "| variant | glue + step (ms, rank 0) | ratio to torch | slowest rank (ms) "
            "| all-reduces per step | state bytes / param / rank |"
        )
        print("|---|---|---|---|---|---|")
        base = meds["torch"]
        for v in VARIANTS:
            slowest = max(e[v] for e in every)
            print(
                f"| {v} | {meds[v] * 1e3:.1f} | {meds[v] / base:.2f}x | {slowest * 1e3:.1f} "
                f"| {comms[v]} | {state[v]:.2f} |"
            )
    # Leave together with nothing holding the group (as tests/parallel/_workers._finish does).
    del runs
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    int_options(ap, world=2, width=1024, layers=4, batch=8, warmup=3, reps=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args.world, os.path.join(d, "init"), args), nprocs=args.world)


if __name__ == "__main__":
    main()
