"""fastamp vs torch: the same mixed-precision training run, side by side.

Trains a small transformer on synthetic data twice from the same seed, once with
``torch.amp.GradScaler`` (+ unscale_ + clip_grad_norm_) and once with ``fastamp.GradScaler``
(+ its fused clip_grad_norm_), injecting inf/NaN gradients at a few steps, and prints loss, scale and
skipped steps of both runs next to each other.

    python examples/demo.py            # CUDA with fp16 autocast if available, else CPU with bf16
    python examples/demo.py --steps 200 --device cpu
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import fastamp


class TinyTransformer(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, seq=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens) + self.pos[: tokens.shape[1]]))


def train(scaler_kind: str, args, device: str, amp_dtype: torch.dtype):
    torch.manual_seed(args.seed)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if scaler_kind == "torch":
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=20)
    else:
        scaler = fastamp.GradScaler(device, init_scale=2.0**12, growth_interval=20)
    gen = torch.Generator().manual_seed(args.seed + 1)
    bad_steps = {args.steps // 3: math.inf, args.steps // 3 + 1: math.nan, 2 * args.steps // 3: math.inf}
    rows, times = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, 32), generator=gen).to(device)
        target = torch.roll(tokens, 1, dims=1)  # a learnable task: predict the previous token
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=amp_dtype):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        scaler.scale(loss).backward()
        if step in bad_steps:  # a gradient storm, as an overflowing fp16 activation would cause
            model.head.weight.grad[0, 0] = bad_steps[step]
        t0 = time.perf_counter()
        if scaler_kind == "torch":
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        rows.append((float(loss.detach()), scaler.get_scale(), float(norm)))
    return rows, times, scaler, model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--every", type=int, default=5, help="print every N-th step")
    args = ap.parse_args(argv)
    amp_dtype = torch.float16 if args.device == "cuda" else torch.bfloat16
    print(f"fastamp {fastamp.__version__} | torch {torch.__version__} | device {args.device} | autocast {amp_dtype}")
    t_rows, t_times, _, _ = train("torch", args, args.device, amp_dtype)
    f_rows, f_times, f_scaler, f_model = train("fastamp", args, args.device, amp_dtype)

    print(f"{'step':>5} | {'loss torch':>10} {'loss fastamp':>12} | {'scale torch':>11} {'scale fastamp':>13} | {'grad norm torch':>15} {'grad norm fastamp':>17}")
    for i, (t, f) in enumerate(zip(t_rows, f_rows)):
        skipped = not math.isfinite(f[2])
        if i % args.every == 0 or skipped or i == len(t_rows) - 1:
            mark = "  <- skipped (inf/NaN grads)" if skipped else ""
            print(f"{i:>5} | {t[0]:>10.4f} {f[0]:>12.4f} | {t[1]:>11g} {f[1]:>13g} | {t[2]:>15.4g} {f[2]:>17.4g}{mark}")
    same_scale = [r[1] for r in t_rows] == [r[1] for r in f_rows]
    max_loss_diff = max(abs(a[0] - b[0]) for a, b in zip(t_rows, f_rows))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print()
    print(f"scale trajectories identical: {same_scale}")
    print(f"max |loss torch - loss fastamp|: {max_loss_diff:.3g}")
    print(f"last overflow: {f_scaler.overflow_report(f_model)}")
    print(
        f"median unscale+clip+step+update time: torch {med(t_times) * 1e3:.3f} ms, "
        f"fastamp {med(f_times) * 1e3:.3f} ms (x{med(t_times) / med(f_times):.2f}; tiny model, "
        "see benchmarks/ for real sizes)"
    )
    return 0 if same_scale else 1


if __name__ == "__main__":
    raise SystemExit(main())
