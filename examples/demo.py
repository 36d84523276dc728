"""fastamp vs torch: the same mixed-precision training run, side by side.

Trains a small transformer twice from the same seed on synthetic sequences with structure to learn
(each token is the previous one plus a per-sequence stride; the model predicts the next token),
once with ``torch.amp.GradScaler`` (+ unscale_ + clip_grad_norm_) and once with
``fastamp.GradScaler`` (+ its fused clip_grad_norm_), with fp16 autocast (CPU too) so that loss
scaling is really at work. Gradient storms (inf/NaN) are injected at a few steps: both scalers skip
them and back off the same way. Prints progress, then loss, scale and skipped steps side by side,
and writes a PNG of both runs.

It times nothing: one run after the other of a model this small measures the machine (its load,
torch's OpenMP threads competing for shared cores) more than the scalers. The benchmarks time
fastamp and torch interleaved, threads fixed, median of repetitions, with the machine stated
(README "Benchmarks", benchmarks/results/).

    python examples/demo.py                       # CUDA if available, else CPU; fp16 autocast
    python examples/demo.py --steps 200 --device cpu --plot /tmp/demo.png
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import fastamp
from plotting import two_panels

VOCAB = 64
STRIDES = (1, 2, 3, 5)


def batch_of_sequences(gen: torch.Generator, batch: int, seq: int = 32):
    """Tokens ``start + stride * i (mod VOCAB)``, stride from STRIDES; the target is the next token.
    Chance level is ln(VOCAB); a model that reads the stride off its context gets close to 0."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch, 1), generator=gen)]
    tokens = (start + stride * torch.arange(seq + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


class TinyTransformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=64, heads=4, layers=2, seq=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        # causal: position i sees tokens 0..i only, so predicting token i+1 needs the stride
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.emb(tokens) + self.pos[:n]
        return self.head(self.body(x, mask=self.mask[:n, :n], is_causal=True))


def train(scaler_kind: str, args, device: str, amp_dtype: torch.dtype):
    torch.manual_seed(args.seed)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if scaler_kind == "torch":
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=20)
    else:
        scaler = fastamp.GradScaler(device, init_scale=2.0**12, growth_interval=20)
    gen = torch.Generator().manual_seed(args.seed + 1)
    bad_steps = {
        args.steps // 3: math.inf,
        args.steps // 3 + 1: math.nan,
        2 * args.steps // 3: math.inf,
    }
    rows = []
    print(f"training with {type(scaler).__module__.split('.')[0]}.GradScaler ...", flush=True)
    for step in range(args.steps):
        tokens, target = batch_of_sequences(gen, args.batch)
        tokens, target = tokens.to(device), target.to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=amp_dtype):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        scaler.scale(loss).backward()
        if step in bad_steps:  # a gradient storm, as an overflowing fp16 activation would cause
            model.head.weight.grad[0, 0] = bad_steps[step]
        if scaler_kind == "torch":
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        rows.append((float(loss.detach()), scaler.get_scale(), float(norm)))
        if step % args.every == 0 or step == args.steps - 1:
            print(
                f"  step {step + 1:>4}/{args.steps}  loss {rows[-1][0]:.3f}  scale {rows[-1][1]:g}",
                flush=True,
            )
    return rows, scaler, model


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--every", type=int, default=5, help="print every N-th step")
    ap.add_argument(
        "--amp",
        choices=["fp16", "bf16"],
        default="fp16",
        help="autocast dtype (default fp16, on CPU too: the one that needs loss scaling)",
    )
    ap.add_argument(
        "--plot", default="fastamp_demo.png", help="PNG of both runs (needs matplotlib)"
    )
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(
            f"--steps must be at least 3 (the inf/NaN storms go at steps/3 and 2*steps/3), got {args.steps}"
        )
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | device {args.device} | autocast {amp_dtype}"
    )
    t_rows, _, _ = train("torch", args, args.device, amp_dtype)
    f_rows, f_scaler, f_model = train("fastamp", args, args.device, amp_dtype)

    print(
        f"{'step':>5} | {'loss torch':>10} {'loss fastamp':>12} | {'scale torch':>11} "
        f"{'scale fastamp':>13} | {'grad norm torch':>15} {'grad norm fastamp':>17}"
    )
    for i, (t, f) in enumerate(zip(t_rows, f_rows)):
        skipped = not math.isfinite(f[2])
        if i % args.every == 0 or skipped or i == len(t_rows) - 1:
            mark = "  <- skipped (inf/NaN grads)" if skipped else ""
            print(
                f"{i:>5} | {t[0]:>10.4f} {f[0]:>12.4f} | {t[1]:>11g} {f[1]:>13g} | {t[2]:>15.4g} {f[2]:>17.4g}{mark}"
            )
    same_scale = [r[1] for r in t_rows] == [r[1] for r in f_rows]
    max_loss_diff = max(abs(a[0] - b[0]) for a, b in zip(t_rows, f_rows))
    print()
    print(f"scale trajectories identical: {same_scale}")
    print(f"max |loss torch - loss fastamp|: {max_loss_diff:.3g}")
    chance = math.log(VOCAB)
    tail = min(5, len(f_rows))
    final = sum(r[0] for r in f_rows[-tail:]) / tail
    learned = final < chance - 0.5
    print(
        f"loss: chance level ln({VOCAB}) = {chance:.3f}, first {f_rows[0][0]:.3f}, "
        f"last {tail} steps {final:.3f} (learned: {learned})"
    )
    print(f"last overflow: {f_scaler.overflow_report(f_model)}")
    print(
        "speed: not timed here (a small model timed run after run measures the machine's load, "
        "not the scalers); measured interleaved with threads fixed: README.md#benchmarks, or "
        "python benchmarks/scaler/bench_grad_scaler.py"
    )
    _plot(t_rows, f_rows, chance, args.plot)
    # a short smoke run (the test's) is not long enough to judge learning
    return 0 if same_scale and (learned or args.steps < 40) else 1


def _plot(t_rows, f_rows, chance, path):
    with two_panels(path) as panels:
        if panels is None:
            return
        ax1, ax2 = panels
        for name, rows, style in (("torch", t_rows, "-"), ("fastamp", f_rows, "--")):
            ax1.plot([r[0] for r in rows], style, label=name)
            ax2.plot([r[1] for r in rows], style, label=name)
        ax1.axhline(chance, color="grey", lw=0.8, ls=":", label="chance")
        ax1.set(title="loss", xlabel="step")
        ax2.set(
            title="loss scale (x2 after 20 clean steps, /2 at inf/NaN)", xlabel="step", yscale="log"
        )


if __name__ == "__main__":
    raise SystemExit(main())
