"""Benchmark: one AdamW step with float32, bfloat16 and 8-bit optimizer state (issue 17).

Side by side in one process, repetitions interleaved, on GPT-shaped fp32 parameters with fp32
grads (the optimizer step alone: no scaler, clip_coef or found_inf, as torch's baseline has none):

  torch fused fp32    torch.optim.AdamW(fused=True)
  fastamp fp32        fastamp.optim.AdamW()
  fastamp bf16        fastamp.optim.AdamW(state_dtype=torch.bfloat16)   (stochastic rounding)
  fastamp int8        fastamp.optim.AdamW(state_dtype="int8")           (blocks of 256)
  torchao 8-bit       torchao.optim.AdamW8bit (tensor subclass + torch.compile; skipped with the
                      reason when it cannot run; its compile time is reported, not timed)
  deepspeed fp32      deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), the optional CPU peer
                      (`pip install deepspeed psutil tqdm`; DS_ACCELERATOR=cpu is set here; its
                      first use JIT-compiles cpu_adam for this CPU, minutes; skipped with the
                      reason when it cannot run)

An AVX2 machine (AMD Zen 3, no AVX-512) is what FASTAMP_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx2
give on an AVX-512 one: fastamp's and torch's kernels at AVX2 (DeepSpeed's cpu_adam keeps the
instruction set it was compiled for, printed in the header).

Bytes moved per parameter (the model behind the GPU expectation):
  fp32 state: read g 4 + read/write p 8 + read/write m 8 + read/write v 8           = 28
  bf16 state: 4 + 8 + 4 + 4                                                         = 20
  int8 state: 4 + 8 + 2 + 2 (+ 16 bytes of scales per 256)                          = 16.1
A step that only streams memory takes bytes / bandwidth; on a GPU (bandwidth-bound) the expected
ratio to fp32 is therefore 20/28 = 0.71 (bf16) and 16.1/28 = 0.58 (int8). The printout puts each
step's effective bandwidth beside the copy bandwidth measured in the same run.

    python benchmarks/optim/bench_lowbit.py --params 50e6 --json benchmarks/results/lowbit_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import fastamp
from fastamp.testing import transformer_like_shapes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import copy_bandwidth, device_name, timed  # noqa: E402

BYTES = {
    "torch fused fp32": 28.0,
    "fastamp fp32": 28.0,
    "fastamp bf16": 20.0,
    "fastamp int8": 16.0 + 16.0 / 256,
    "torchao 8-bit": 16.0 + 16.0 / 256,
    "deepspeed fp32": 28.0,
}


def make_params(n: float, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for shape in transformer_like_shapes(int(n)):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        ps.append(p)
    return ps


def build(name: str, params):
    if name == "torch fused fp32":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "fastamp fp32":
        return fastamp.optim.AdamW(params, lr=1e-4)
    if name == "fastamp bf16":
        return fastamp.optim.AdamW(params, lr=1e-4, state_dtype=torch.bfloat16)
    if name == "fastamp int8":
        return fastamp.optim.AdamW(params, lr=1e-4, state_dtype="int8")
    if name == "deepspeed fp32":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

        # torch's AdamW defaults (weight_decay 0.01, decoupled), as the other rows.
        return DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    from torchao.optim import AdamW8bit  # noqa: PLC0415

    return AdamW8bit(params, lr=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torchao-reps", type=int, default=2, help="its steps are slow: fewer of them")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave the DeepSpeed peer out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [
        "torch fused fp32",
        "deepspeed fp32",
        "fastamp fp32",
        "fastamp bf16",
        "fastamp int8",
        "torchao 8-bit",
    ]
    opts, params, skipped, compile_s = {}, {}, {}, None
    for name in names:
        if name == "torchao 8-bit" and args.torchao_reps <= 0:
            skipped[name] = "not run (--torchao-reps 0)"
            continue
        if name == "deepspeed fp32" and args.no_deepspeed:
            skipped[name] = "not run (--no-deepspeed)"
            continue
        params[name] = make_params(args.params)  # the same values for every optimizer
        try:
            opts[name] = build(name, params[name])
            t0 = time.perf_counter()
            for _ in range(args.warmup if name != "torchao 8-bit" else 1):
                opts[name].step()
            if name == "torchao 8-bit":
                compile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 -- reported as a skipped column
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            opts.pop(name, None)
    n = sum(p.numel() for p in params[names[0]])
    bw = copy_bandwidth("cpu")
    times: dict[str, list[float]] = {k: [] for k in opts}
    for r in range(args.reps):
        for name, opt in opts.items():
            if name == "torchao 8-bit" and r >= args.torchao_reps:
                continue
            times[name].append(timed(opt.step, "cpu"))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    base = med["torch fused fp32"]
    state_bpp = {}
    for name, opt in opts.items():
        if name.startswith("fastamp"):
            state_bpp[name] = fastamp.memory.optimizer_state_bytes(opt)["state_bytes_per_param"]
    ds_simd = ""
    if "deepspeed fp32" in opts:
        from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: PLC0415

        builder = CPUAdamBuilder()
        ds_simd = f" | deepspeed cpu_adam {builder.simd_width()} {builder.cpu_arch()}"
    print(
        f"fastamp {fastamp.__version__} | CPU kernels {fastamp.build_info()['cpu_capability']} | "
        f"torch {torch.__version__} kernels {torch.backends.cpu.get_cpu_capability()}{ds_simd} | "
        f"{device_name('cpu')} | "
        f"threads {torch.get_num_threads()} | {n / 1e6:.1f}M fp32 params | {args.reps} interleaved reps, "
        f"median (best/best: fastest rep over torch's fastest) | copy bandwidth "
        f"{bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'optimizer':<18} {'ms/step':>9} {'vs torch':>9} {'best/best':>9} {'B/param':>8} {'GB/s':>6} "
        f"{'% of copy bw':>12} {'state B/param':>13}"
    )
    rows = []
    for name in names:
        if name in skipped:
            print(f"{name:<18} skipped: {skipped[name]}")
            rows.append({"name": name, "skipped": skipped[name]})
            continue
        t = med[name]
        eff = BYTES[name] * n / t
        row = {
            "name": name,
            "ms": t * 1e3,
            "ratio_vs_torch_fused": t / base,
            "best_ratio_vs_torch_fused": best[name] / best["torch fused fp32"],
            "bytes_per_param": BYTES[name],
            "effective_GBps": eff / 1e9,
            "reps": len(times[name]),
            "state_bytes_per_param": state_bpp.get(name),
        }
        rows.append(row)
        sbpp = f"{state_bpp[name]:.3f}" if name in state_bpp else "-"
        print(
            f"{name:<18} {t * 1e3:9.1f} {t / base:8.2f}x {best[name] / best['torch fused fp32']:8.2f}x "
            f"{BYTES[name]:8.1f} {eff / 1e9:6.1f} "
            f"{100 * eff / bw:11.0f}% {sbpp:>13}"
        )
    peers = [k for k in ("torch fused fp32", "deepspeed fp32") if k in med]
    best_peer = min(peers, key=lambda k: med[k])
    print(
        f"fastamp fp32 vs the faster of {' and '.join(peers)} ({best_peer}): "
        f"{med['fastamp fp32'] / med[best_peer]:.2f}x (median), "
        f"{best['fastamp fp32'] / best[best_peer]:.2f}x (best/best)"
    )
    if "torchao 8-bit" in med:
        print(
            f"torchao 8-bit: first step (torch.compile) {compile_s:.1f} s, not timed; "
            f"fastamp int8 is {med['torchao 8-bit'] / med['fastamp int8']:.0f}x faster per step"
        )
    print(
        "GPU expectation (bandwidth-bound, from the bytes above): bf16 state "
        f"{BYTES['fastamp bf16'] / 28:.2f}x, int8 {BYTES['fastamp int8'] / 28:.2f}x of the fp32 step"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "params": n,
                    "copy_GBps": bw / 1e9,
                    "threads": torch.get_num_threads(),
                    "cpu_capability": fastamp.build_info()["cpu_capability"],
                    "reps": args.reps,
                    "torch": torch.__version__,
                    "torchao_compile_s": compile_s,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
