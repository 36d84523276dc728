"""Quality of low-precision optimizer state (issue 17): the same small transformer LM trained from the
same seed with fastamp.optim.AdamW and float32, bfloat16 (stochastic rounding) and 8-bit state.

The data has learnable structure and a known floor. `--task copy` (the default): each sequence is
32 tokens of a first-order Markov chain over 64 tokens (transition rows drawn from Dirichlet(0.2):
a few likely successors per token) followed by the same 32 tokens again. The first half can be
learnt as bigram statistics; the second half is predictable exactly, but only by attending back
to the earlier occurrence (an induction circuit, which small transformers learn late and which is
sensitive to the optimizer). The floor is 31 transitions' entropy rate spread over 63 targets.
`--task markov`: the chain alone (floor: its entropy rate; every run reaches it quickly, so it
separates the states less). Each run sees the same batches. The final loss is the mean
cross-entropy on 64 held-out batches; the curves (training loss, smoothed) go into one PNG.

    python benchmarks/optim/quality_lowbit.py --steps 3000 \
        --json benchmarks/results/lowbit_quality.json --png benchmarks/results/lowbit_quality.png
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

import fastamp

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 63, 64, 4, 2
HALF = 32  # the copy task: 32 Markov tokens, then the same 32 again (63 inputs, 63 targets)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False
        )

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x, src_mask=self.mask, is_causal=True)
        return self.head(x)


def _dirichlet(g: torch.Generator) -> torch.Tensor:
    # Gamma(0.2) draws by the Marsaglia-Tsang boost (seeded; torch's Dirichlet takes no generator).
    a = 0.2
    d, c = a + 1 - 1 / 3, 1 / math.sqrt(9 * (a + 1 - 1 / 3))
    out = torch.empty(VOCAB, VOCAB)
    for i in range(VOCAB):
        row = []
        while len(row) < VOCAB:
            x = torch.randn(1, generator=g).item()
            v = (1 + c * x) ** 3
            u = torch.rand(1, generator=g).item()
            if v > 0 and math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
                row.append(d * v * torch.rand(1, generator=g).item() ** (1 / a))
        out[i] = torch.tensor(row)
    return out / out.sum(dim=1, keepdim=True)


def batches(P: torch.Tensor, n: int, batch: int, seed: int, task: str = "copy"):
    g = torch.Generator().manual_seed(seed)
    chain = HALF if task == "copy" else SEQ + 1
    for _ in range(n):
        toks = torch.empty(batch, chain, dtype=torch.long)
        toks[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for t in range(chain - 1):
            toks[:, t + 1] = torch.multinomial(P[toks[:, t]], 1, generator=g).squeeze(1)
        if task == "copy":
            toks = torch.cat([toks, toks], dim=1)
        yield toks[:, :-1], toks[:, 1:]


def entropy_rate(P: torch.Tensor) -> float:
    # stationary distribution by power iteration
    pi = torch.full((VOCAB,), 1.0 / VOCAB)
    for _ in range(1000):
        pi = pi @ P
    h = -(P * P.clamp_min(1e-30).log()).sum(dim=1)
    return float((pi * h).sum())


def run(fmt, P, args):
    torch.manual_seed(0)
    model = LM()
    opt = fastamp.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, state_dtype=fmt)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / 100)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    losses = []
    t0 = time.perf_counter()
    for x, y in batches(P, args.steps, args.batch, seed=1, task=args.task):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        ev = [
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
            for x, y in batches(P, 64, args.batch, seed=2, task=args.task)
        ]
    state = fastamp.memory.optimizer_state_bytes(opt)
    return {
        "losses": losses,
        "final_eval_loss": sum(ev) / len(ev),
        "seconds": elapsed,
        "state_bytes_per_param": state["state_bytes_per_param"],
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--task", choices=("copy", "markov"), default="copy")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    P = _dirichlet(torch.Generator().manual_seed(0))
    floor = entropy_rate(P) * ((HALF - 1) / SEQ if args.task == "copy" else 1.0)
    results = {}
    for name, fmt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", "int8")):
        results[name] = run(fmt, P, args)
        r = results[name]
        print(
            f"{name:9} final eval loss {r['final_eval_loss']:.4f}  ({r['seconds']:.0f} s, "
            f"{r['state_bytes_per_param']:.2f} state bytes/param)",
            flush=True,
        )
    base = results["float32"]["final_eval_loss"]
    print(
        f"task {args.task}: loss floor {floor:.4f}; first-step loss {results['float32']['losses'][0]:.3f}"
    )
    for name in ("bfloat16", "int8"):
        d = results[name]["final_eval_loss"] / base - 1
        print(f"{name:9} vs float32: {100 * d:+.2f}% (target within 1%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "task": args.task,
                    "steps": args.steps,
                    "batch": args.batch,
                    "lr": args.lr,
                    "loss_floor": floor,
                    "final_eval_loss": {k: v["final_eval_loss"] for k, v in results.items()},
                    "state_bytes_per_param": {
                        k: v["state_bytes_per_param"] for k, v in results.items()
                    },
                    "seconds": {k: v["seconds"] for k, v in results.items()},
                },
                f,
                indent=1,
            )
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        k = 50
        for name, r in results.items():
            ls = torch.tensor(r["losses"])
            sm = ls.unfold(0, k, 1).mean(1) if len(ls) >= k else ls
            ax.plot(
                range(k - 1, k - 1 + len(sm)),
                sm.tolist(),
                label=f"{name} state (eval {r['final_eval_loss']:.3f})",
            )
        ax.axhline(floor, color="gray", ls=":", label=f"loss floor {floor:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss ({k}-step mean)")
        ax.set_title(f"fastamp.optim.AdamW, {args.task} task: float32 vs bfloat16 vs 8-bit state")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
