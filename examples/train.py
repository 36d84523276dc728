"""Train a small transformer on synthetic data with fastamp: the script to copy from.

    python examples/train.py                                   # fp16 autocast (GPU or CPU)
    python examples/train.py --amp off --accum-steps 4 --checkpoint
    python examples/train.py --compare-torch --plot curves.png # the same run with torch, side by side

Everything fastamp offers around a training step is on: fastamp.GradScaler (fp16), the fused
fastamp.optim.AdamW, clipping through the scaler, gradient accumulation (fastamp.GradientAccumulator),
optional activation checkpointing (fastamp.checkpoint), and a memory report at the end.
``--compare-torch`` trains the same model from the same seed with torch.amp.GradScaler,
torch.optim.AdamW(fused=True where supported) and torch.utils.checkpoint, prints a side-by-side
table (losses, loss scale, skipped steps, step time), and writes a PNG of the loss curves and step
times (needs matplotlib). fp16 is the default on CPU too: it is the precision that needs loss
scaling, so the comparison exercises fastamp.GradScaler (with bf16 or off, both scalers are
disabled and only the optimizer and clipping are compared).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

import fastamp
from plotting import two_panels

try:
    from tqdm import tqdm
except ImportError:  # the bar is a nicety; training does not need it
    tqdm = None


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )

    def forward(self, x):
        return self.layer(x)


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seq, checkpoint, impl):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.checkpoint, self.impl = checkpoint, impl

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            if not self.checkpoint:
                x = b(x)
            elif self.impl == "fastamp":
                x = fastamp.checkpoint.checkpoint(b, x)
            else:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def synthetic(n_batches, batch, seq, vocab, seed):
    """A learnable task: each token is the previous one plus one (mod vocab), from random starts."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_batches):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        tokens = (start + torch.arange(seq)) % vocab
        yield tokens, torch.roll(tokens, -1, dims=1)


def train(impl, args, device, amp_dtype):
    torch.manual_seed(args.seed)
    model = TinyLM(
        args.vocab, args.dim, args.heads, args.layers, args.seq, args.checkpoint, impl
    ).to(device)
    scaling = amp_dtype == torch.float16
    if impl == "fastamp":
        opt = fastamp.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        scaler = fastamp.GradScaler(device.type, enabled=scaling)
    else:
        fused = device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)
        scaler = torch.amp.GradScaler(device.type, enabled=scaling)
    acc = fastamp.GradientAccumulator(opt, args.accum_steps, scaler=scaler, max_grad_norm=1.0)
    micro = args.batch_size // args.accum_steps
    losses, step_times = [], []
    total = args.epochs * args.batches_per_epoch
    bar = (
        tqdm(total=total, desc=f"{impl:>7}", leave=False)
        if tqdm is not None and not args.no_progress
        else None
    )
    group_loss = 0.0
    skipped, last_scale = 0, scaler.get_scale()  # a skipped (inf/NaN) step backs the scale off
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        data = synthetic(
            args.batches_per_epoch * args.accum_steps,
            micro,
            args.seq,
            args.vocab,
            args.seed + epoch,
        )
        for (tokens, target), m in acc.iterate(data):
            tokens, target = tokens.to(device), target.to(device)
            with m:
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
                m.backward(loss)
            group_loss += loss.item() / m.group_size
            if m.stepped:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                step_times.append(now - t0)
                t0 = now
                losses.append(group_loss)
                group_loss = 0.0
                scale = scaler.get_scale()
                skipped += scaling and scale < last_scale
                last_scale = scale
                if bar is not None:
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scaler.get_scale():g}")
                    bar.update(1)
    if bar is not None:
        bar.close()
    return {
        "losses": losses,
        "step_times": step_times,
        "scale": scaler.get_scale(),
        "model": model,
        "skipped": skipped,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--amp",
        choices=["fp16", "bf16", "off"],
        default="fp16",
        help="autocast dtype (default fp16, on CPU too: the one that needs loss scaling)",
    )
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint every transformer block")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batches-per-epoch", type=int, default=20, help="optimizer steps per epoch")
    ap.add_argument("--compare-torch", action="store_true")
    ap.add_argument(
        "--plot", default="fastamp_vs_torch.png", help="PNG written with --compare-torch"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.batch_size % args.accum_steps:
        ap.error("--batch-size must be a multiple of --accum-steps")
    device = torch.device(args.device)
    amp = args.amp
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | {device} | amp {amp} | "
        f"accum {args.accum_steps} | checkpoint {args.checkpoint}"
    )

    runs = {"fastamp": train("fastamp", args, device, amp_dtype)}
    if args.compare_torch:
        runs["torch"] = train("torch", args, device, amp_dtype)

    med = {k: statistics.median(r["step_times"][1:] or r["step_times"]) for k, r in runs.items()}
    print(f"\n{'':<22}" + "".join(f"{k:>14}" for k in runs))
    print(f"{'first loss':<22}" + "".join(f"{r['losses'][0]:>14.4f}" for r in runs.values()))
    print(f"{'final loss':<22}" + "".join(f"{r['losses'][-1]:>14.4f}" for r in runs.values()))
    print(f"{'final scale':<22}" + "".join(f"{r['scale']:>14g}" for r in runs.values()))
    print(f"{'skipped steps':<22}" + "".join(f"{r['skipped']:>14d}" for r in runs.values()))
    print(f"{'median step ms':<22}" + "".join(f"{med[k] * 1e3:>14.2f}" for k in runs))
    if args.compare_torch:
        print(f"{'step time torch/fastamp':<22} {med['torch'] / med['fastamp']:>13.2f}x")
        diff = max(abs(a - b) for a, b in zip(runs["fastamp"]["losses"], runs["torch"]["losses"]))
        print(f"{'max |loss difference|':<22} {diff:>13.2e}")
        if amp_dtype != torch.float16:
            print(
                f"(amp {amp}: both GradScalers are disabled; only the optimizer step and the "
                "clipping are compared. --amp fp16 compares the scalers too)"
            )
        _plot(runs, args.plot)
    print()
    fastamp.memory.summary()
    ok = all(math.isfinite(r["losses"][-1]) for r in runs.values())
    return 0 if ok and runs["fastamp"]["losses"][-1] < runs["fastamp"]["losses"][0] else 1


def _plot(runs, path):
    with two_panels(path) as panels:
        if panels is None:
            return
        ax1, ax2 = panels
        for name, r in runs.items():
            ax1.plot(r["losses"], label=name)
            ax2.plot([t * 1e3 for t in r["step_times"]], label=name)
        ax1.set(title="loss per optimizer step", xlabel="step", ylabel="loss")
        ax2.set(title="step time", xlabel="step", ylabel="ms")


if __name__ == "__main__":
    raise SystemExit(main())
