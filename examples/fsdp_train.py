"""Sharded training (FSDP2, ``fully_shard``) with fastamp, launched with torchrun:

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py                     # CPU: gloo
    torchrun --standalone --nproc_per_node=8 examples/fsdp_train.py                     # GPUs: NCCL
    torchrun --standalone --nproc_per_node=4 examples/fsdp_train.py --replicas 2        # HSDP 2 x 2
    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --state-dtype int8 --checkpoint

The model and data of examples/ddp_train.py (a small causal transformer learning a hidden rule),
each block and the root sharded with ``fully_shard`` on a 1-D mesh (or a 2-D replicate x shard
mesh: hybrid sharding), stepped by fastamp.GradScaler + fastamp.optim.AdamW: the grads' inf check
and norm are reduced over the shards in one all-reduce per step, the fused optimizer updates each
rank's shard and skips on overflow with no host sync; ``--state-dtype`` keeps the moments in
bfloat16 or 8 bits; ``--checkpoint`` recomputes every block with fastamp.checkpoint.

``--amp fp16`` (the default; fp16 autocast runs on the CPU too) is what the loss scaler is for: the
loss is scaled (the printed ``scale``: 65536, halved on a step whose grads overflow, which is then
skipped). ``--amp bf16`` and ``--amp off`` need no scaler (it is built disabled: scale 1).

Rank 0 prints the loss against chance; every rank checks at the end that the scale and the grad
norm (decisions every rank must share) are the same everywhere. The exit status says whether they
are and whether the model learned.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastamp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_train import (  # noqa: E402
    VOCAB,
    Model,
    init_distributed,
    leave_together,
    log_step,
    same_on_every_rank,
    sequences,
    summary,
)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument(
        "--amp",
        choices=["fp16", "bf16", "off"],
        default="fp16",
        help="autocast dtype (default fp16: the loss scaler at work; bf16 and off need no scaler)",
    )
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint every block")
    ap.add_argument("--replicas", type=int, default=1, help="HSDP: replica groups of the mesh")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16", "int8"], default="float32")
    args = ap.parse_args(argv)
    # torch warns when a fully_shard-ed module returns a view, because an in-place op on that view
    # would drop the pre-backward hook (and the all-gather) it registers on the output. The root's
    # output is self.head(x): nn.Linear on a 3-D input returns a view of its 2-D matmul. This
    # script never modifies it in place (.float(), .flatten() and cross_entropy are out of place),
    # so the hook stays and the backward all-gathers as it should: the warning does not apply.
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDPModel\) returned a view tensor",
        category=UserWarning,
    )

    rank, world, device = init_distributed()
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} must divide the world size {world}")
    shape = (world,) if args.replicas == 1 else (args.replicas, world // args.replicas)
    names = ("shard",) if args.replicas == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[args.amp]

    torch.manual_seed(0)  # the same initial model everywhere; fully_shard keeps each rank's part
    model = Model(checkpoint=args.checkpoint).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": "int8"}
    opt = fastamp.optim.AdamW(
        model.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=state_dtype[args.state_dtype]
    )
    scaler = fastamp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    chance = math.log(VOCAB)
    t0 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        seq = sequences(gen, args.batch_size, 33).to(device)
        tokens, target = seq[:, :-1], seq[:, 1:]
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        scaler.scale(loss).backward()
        if step == 0:
            first = loss.item()
        norm = scaler.clip_grad_norm_(opt, 1.0)  # over every shard: one all-reduce
        scaler.step(opt)
        scaler.update()
        log_step(rank, step, args.steps, loss, chance, norm, scaler)
    elapsed = time.perf_counter() - t0

    # The decisions every rank shares: the scale and the (global) grad norm.
    mine = torch.tensor([scaler.get_scale(), float(norm)], dtype=torch.float64, device=device)
    same = same_on_every_rank(mine, world)
    run = (
        f"{world} ranks ({dist.get_backend()}, mesh {tuple(shape)}), {args.steps} steps in "
        f"{elapsed:.1f}s"
    )
    what = "scale and grad norm"
    status = summary(rank, run, args.steps, first, loss.item(), chance, what, same)
    del model, opt, scaler  # what holds the process group
    leave_together()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
