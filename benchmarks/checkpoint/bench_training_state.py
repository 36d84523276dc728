"""Benchmark: what the content checksums cost fastamp.save_training_state / load_training_state.

A ~100M-parameter model (6 x Linear(4096, 4096)) with fastamp.optim.AdamW (params + 2 moments:
~1.2 GB of float32 state by default), one process, one file. Two variants of the same code, runs
interleaved (a balanced order per repetition):

  checksums      what fastamp does: every tensor hashed (fastamp::tensor_digest) at save and
                 again after torch.load, before anything is restored; the file written without
                 torch.save's CRC-32 of its records (which no reader checks: the digests replace it)
  no checksums   the same save and load with the hashing patched out (seal/verify are no-ops),
                 the file written as torch.save writes by default (with its CRC-32): the save as
                 it would be without fastamp's checksums

save = save_training_state (torch.save to a temporary file, fsync, rename); load =
load_training_state (torch.load of the file just written, so from the page cache: the case where
hashing is the largest share; the checks; the restore into the live model and optimizer).

    python benchmarks/checkpoint/bench_training_state.py
    python benchmarks/checkpoint/bench_training_state.py --reps 5 --state-dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import fastamp
import fastamp.resume.training_state as resume
from fastamp.checkpoint import ops as checkpoint_ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import balanced_order, device_name  # noqa: E402

VARIANTS = ("checksums", "no checksums")


def build(layers: int, dim: int, state_dtype: object) -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype)
    scaler = fastamp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    scaler.step(opt)
    scaler.update()
    return model, opt, scaler


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state_dict()["state"].values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def run_once(variant: str, path: str, model, opt, scaler) -> tuple[float, float]:
    real_seal, real_verify, real_save = resume.seal, resume.verify, resume.atomic_save
    if variant == "no checksums":
        resume.seal = lambda obj: obj
        resume.verify = lambda obj, path: None
        resume.atomic_save = lambda obj, path, torch_crc32=True: real_save(obj, path)
    try:
        t0 = time.perf_counter()
        fastamp.save_training_state(path, model=model, optimizer=opt, scaler=scaler, step=1)
        t1 = time.perf_counter()
        fastamp.load_training_state(path, model=model, optimizer=opt, scaler=scaler)
        t2 = time.perf_counter()
    finally:
        resume.seal, resume.verify, resume.atomic_save = real_seal, real_verify, real_save
    return t1 - t0, t2 - t1


def digest_rate(model: nn.Module) -> float:
    """Bytes per second of fastamp::tensor_digest over the model's parameters (median of 3)."""
    ts = [p.detach() for p in model.parameters()]
    n = sum(t.numel() * t.element_size() for t in ts)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        checkpoint_ops.tensor_digest(ts)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument(
        "--dir", default=None, help="where the checkpoint is written (default: a temp dir)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    state_dtype = (
        args.state_dtype if args.state_dtype == "int8" else getattr(torch, args.state_dtype)
    )
    model, opt, scaler = build(args.layers, args.dim, state_dtype)
    nparams = sum(p.numel() for p in model.parameters())
    nbytes = state_bytes(model, opt)
    folder = tempfile.mkdtemp(dir=args.dir, prefix="fastamp-bench-state-")
    path = os.path.join(folder, "state.pt")
    run_once("checksums", path, model, opt, scaler)  # warm-up: page cache, allocator
    times: dict[str, dict[str, list[float]]] = {v: {"save": [], "load": []} for v in VARIANTS}
    for rep in range(args.reps):
        for v in balanced_order(VARIANTS, rep):
            save_s, load_s = run_once(v, path, model, opt, scaler)
            times[v]["save"].append(save_s)
            times[v]["load"].append(load_s)
    os.remove(path)
    os.rmdir(folder)

    print(
        f"{nparams / 1e6:.1f}M params, AdamW state_dtype={args.state_dtype}, "
        f"{nbytes / 2**30:.2f} GiB of tensors; {device_name('cpu')}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}; tensor_digest {digest_rate(model) / 1e9:.2f} GB/s"
    )
    print(f"{'':14} {'save median':>12} {'spread':>16} {'load median':>12} {'spread':>16}")
    result: dict[str, object] = {
        "params": nparams,
        "tensor_bytes": nbytes,
        "state_dtype": args.state_dtype,
        "reps": args.reps,
        "machine": platform.machine(),
        "torch": str(torch.__version__),
        "times_s": times,
    }
    med = {v: {k: statistics.median(x) for k, x in times[v].items()} for v in VARIANTS}
    for v in VARIANTS:
        row = [f"{v:14}"]
        for k in ("save", "load"):
            xs = times[v][k]
            row.append(f"{med[v][k]:11.3f}s {min(xs):7.3f}-{max(xs):.3f}s")
        print(" ".join(row))
    for k in ("save", "load"):
        ratio = med["checksums"][k] / med["no checksums"][k]
        result[f"{k}_ratio"] = ratio
        print(f"{k}: checksums / no checksums = {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
