"""Draws benchmarks/results/speedups_cpu.png from the JSON results of the benchmarks (for the README).

python benchmarks/plot_results.py
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name):
    with open(os.path.join(HERE, name)) as fh:
        return json.load(fh)


def main():
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, label in (
        ("scaler_cpu_float32.json", "GradScaler step, fp32 grads"),
        ("scaler_cpu_bfloat16.json", "GradScaler step, bf16 grads"),
        ("optim_cpu_adamw.json", "whole step with AdamW vs AdamW(fused=True)"),
    ):
        rows = load(name)["rows"]
        key = "speedup" if "speedup" in rows[0] else "speedup_vs_fused"
        ax1.plot([r["params"] / 1e6 for r in rows], [r[key] for r in rows], "o-", label=label)
    ax1.axhline(1.3, color="grey", ls="--", lw=1, label="target 1.3x")
    ax1.set(
        title="fastamp speed-up over PyTorch (CPU, 2 cores)",
        xlabel="parameters (M)",
        ylabel="x faster",
    )
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ck = load("checkpoint_cpu.json")["rows"]
    names = [r["strategy"] for r in ck]
    mem = [r["activation_bytes"] / 2**20 for r in ck]
    ax2.barh(names, mem, color="tab:blue")
    for i, r in enumerate(ck):
        ax2.text(mem[i], i, f"  {r['step_s'] * 1e3:.0f} ms", va="center", fontsize=8)
    ax2.invert_yaxis()
    ax2.set(title="12-layer transformer: activations kept (MiB) and step time", xlabel="MiB")
    fig.tight_layout()
    out = os.path.join(HERE, "speedups_cpu.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
