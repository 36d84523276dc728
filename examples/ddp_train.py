"""Data-parallel training with fastamp, launched with torchrun:

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py                # CPU: gloo, fp16
    torchrun --standalone --nproc_per_node=8 examples/ddp_train.py                # GPUs: NCCL, fp16
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --accum-steps 4 --checkpoint

    # two "nodes" on one machine: two torchrun processes, one rendezvous on 127.0.0.1
    RDZV="--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29511 --rdzv-id=demo"
    torchrun --nnodes=2 --nproc_per_node=2 --node_rank=0 $RDZV examples/ddp_train.py &
    torchrun --nnodes=2 --nproc_per_node=2 --node_rank=1 $RDZV examples/ddp_train.py

A small causal transformer learns a synthetic language with structure: each sequence follows a
hidden rule (next token = 3 * the token two places back + 1, mod vocab), so the next-token loss
falls from chance, ln(vocab), far below it -- each rank draws its own shard of sequences. Wrapped in
fastamp.parallel.DistributedDataParallel, with fastamp.GradScaler + fastamp.optim.AdamW, gradient
accumulation with no_sync(), and activation checkpointing of every block, each behind a flag.
Rank 0 prints the loss against chance; every rank checks at the end that the parameters are
identical everywhere (the exit status says whether they are and whether the model learned).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import fastamp


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )

    def forward(self, x, mask):
        return self.layer(x, src_mask=mask, is_causal=True)


VOCAB = 64


def sequences(gen, n, length, vocab=VOCAB):
    """`n` sequences of the hidden rule x[t+1] = (3 x[t-1] + 1) mod vocab (two random starts):
    the model must attend to the token before the last one. Only the second token is
    unpredictable, so the loss can fall from ln(vocab) to about ln(vocab) / (length - 1)."""
    out = list(torch.randint(0, vocab, (2, n, 1), generator=gen))
    for _ in range(length - 2):
        out.append((3 * out[-2] + 1) % vocab)
    return torch.cat(out, dim=1)


def judge_learning(steps, final, chance):
    """(judged, learned, verdict): learning is judged only on runs long enough to learn (the
    default 30 steps are); a short smoke run (the tests' 3 steps) is judged on its other checks."""
    judge = steps >= 20
    learned = final < 0.5 * chance
    verdict = (
        ("learned the rule" if learned else "did NOT learn")
        if judge
        else f"too few steps ({steps} < 20) to judge learning"
    )
    return judge, learned, verdict


def summary(rank, run, steps, first, final, chance, what, same):
    """Prints (on rank 0) what the ``run`` learned and whether ``what`` was the ``same`` on every
    rank; the exit status: 0 when it was, and the run learned or was too short to judge."""
    judge, learned, verdict = judge_learning(steps, final, chance)
    if rank == 0:
        print(
            f"{run}; loss {first:.3f} -> {final:.3f} (chance {chance:.3f}): {verdict}; "
            f"{what} identical on every rank: {same}"
        )
    return 0 if same and (learned or not judge) else 1


def init_distributed():
    """Joins the process group torchrun describes (NCCL on GPUs, else gloo): (rank, world size,
    this rank's device)."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return rank, world, device


def log_step(rank, step, steps, loss, chance, norm, scaler):
    if rank == 0 and (step % 5 == 0 or step == steps - 1):
        print(
            f"step {step:>4}  loss {loss.item():.4f} (chance {chance:.2f})  "
            f"grad norm {float(norm):.3f}  scale {scaler.get_scale():g}",
            flush=True,
        )


def same_on_every_rank(t, world):
    """Whether every rank holds the same values in ``t``."""
    everyone = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], s) for s in everyone)


def leave_together():
    """Waits for every rank, then tears the group down (a rank that exits while a peer is still
    finishing its last collective can abort the peer); the caller drops what holds the group
    first."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


class Model(nn.Module):
    def __init__(self, vocab=VOCAB, dim=128, heads=4, layers=4, checkpoint=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.checkpoint = checkpoint

    def forward(self, tokens):
        x = self.emb(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for b in self.blocks:
            x = fastamp.checkpoint.checkpoint(b, x, mask) if self.checkpoint else b(x, mask)
        return self.head(x)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank, per optimizer step")
    ap.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument(
        "--amp",
        choices=["fp16", "bf16", "off"],
        default="fp16",
        help="autocast dtype (default fp16, the one that needs the loss scaler, on CPU too, where "
        "torch's fp16 kernels are several times slower than fp32: --amp off to train fast on a CPU; "
        "bf16 and off run with the scaler disabled, scale 1)",
    )
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint every block")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    args = ap.parse_args(argv)
    if args.batch_size % args.accum_steps:
        ap.error("--batch-size must be a multiple of --accum-steps")

    rank, world, device = init_distributed()
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[args.amp]

    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = fastamp.parallel.DistributedDataParallel(
        Model(checkpoint=args.checkpoint).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=args.bucket_view,
    )
    opt = fastamp.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = fastamp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    model.register_grad_scaler(scaler)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    micro = args.batch_size // args.accum_steps
    chance = math.log(VOCAB)  # the loss of a uniform guess
    t0 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(args.accum_steps):
            seq = sequences(gen, micro, 33).to(device)
            tokens, target = seq[:, :-1], seq[:, 1:]  # predict the next token
            last = k == args.accum_steps - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
                scaler.scale(loss / args.accum_steps).backward()
        if step == 0:
            first = loss.item()
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        log_step(rank, step, args.steps, loss, chance, norm, scaler)
    elapsed = time.perf_counter() - t0

    # Every rank must hold the same parameters: compare a checksum.
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    sums = torch.stack([flat.sum(), flat.square().sum()]).to(device)
    same = same_on_every_rank(sums, world)
    run = f"{world} ranks ({dist.get_backend()}), {args.steps} steps in {elapsed:.1f}s"
    status = summary(rank, run, args.steps, first, loss.item(), chance, "parameters", same)
    del model, opt, scaler  # what holds the process group
    leave_together()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
