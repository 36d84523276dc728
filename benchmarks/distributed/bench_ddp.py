"""Benchmark: a data-parallel training step, fastamp.parallel.DistributedDataParallel vs torch's DDP.

The same model (a small GPT-style transformer LM), the same data and the same math, in one run on
every rank, repetitions interleaved after warm-up (blocks of consecutive steps per variant, the
last one timed, in a carry-over balanced order: benchmarks/common.py balanced_order):

  torch:    nn.parallel.DistributedDataParallel + torch.amp.GradScaler + torch.optim.AdamW(foreach)
            scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(foreach=True);
            scaler.step(opt); scaler.update()
  fastamp:  fastamp.parallel.DistributedDataParallel (+ ddp.register_grad_scaler(scaler))
            + fastamp.GradScaler + fastamp.optim.AdamW
            scaler.scale(loss).backward(); scaler.clip_grad_norm_(opt); scaler.step(opt); scaler.update()

each with gradient_as_bucket_view=False and =True (4 variants); with --baseline REF also
  today:    fastamp's DDP as it was at git commit REF (the python/fastamp/parallel package of
            that commit, imported from a temporary file), the rest as fastamp above
so that "no slower than before" is measured in the same interleaved run. Timed per step: zero_grad + forward +
backward (which includes the bucket all-reduces and their wait) = "fwd+bwd", and clip + optimizer
step + scale update = "step"; the table reports medians on rank 0 and checks the ranks agree.

Memory (CPU has no allocator statistics to diff, so it is counted): the communication buffers
DDP keeps (a Python reducer baseline's bucket buffers by address; torch's reducer, which fastamp's
DDP now runs on too: the bucket sizes from _get_ddp_logging_data()["rebuilt_bucket_sizes"]), the
grads' own storage, and the buffer bytes that are
*not* the grads' storage ("extra beyond grads"). With bucket views that is 0 only when verified:
every p.grad lies inside a bucket buffer (fastamp: by address; torch: the grads' distinct storages
are exactly as many and as large as the reducer's buckets).

The script asserts that fastamp reached the same parameters as torch (rtol 1e-4, atol 1e-4: the
clip norm's summation order drifts the trajectories by ~1.5e-5 in 126 steps) in both modes (the
grads themselves are compared bit for bit in tests/parallel). The blocks use GELU: with ReLU,
last-bit differences (fastamp sums the clip norm in another order) flip a gate within a few steps
and the trajectories part for reasons unrelated to DDP.

    python benchmarks/distributed/bench_ddp.py                        # spawns 2 gloo ranks on CPU
    torchrun --standalone --nproc_per_node=2 benchmarks/distributed/bench_ddp.py
    python benchmarks/distributed/bench_ddp.py --set-to-none 1 --json /tmp/ddp.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import balanced_order, device_name, int_options, print_header, switch_option  # noqa: E402

VARIANTS = [("torch", False), ("fastamp", False), ("torch", True), ("fastamp", True)]
# torch's DDP with fastamp's scaler and optimizer: the same step around both DDPs, so that their
# fwd+bwd differ by the DDP alone (torch's foreach AdamW frees temporaries that the allocator
# returns to the kernel, and the next forward and backward pay the page faults of taking them
# back: that is torch's step's cost, not its DDP's)
CONTROLS = [("torchddp", False), ("torchddp", True)]
MiB = 2**20


class LM(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim,
                heads,
                4 * dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def name(kind, view):
    return f"{kind}{' +view' if view else ''}"


_BASELINE = None  # the DDP class of --baseline REF


def load_baseline(ref):
    """fastamp's DDP class as of git commit `ref`: that commit's python/fastamp/parallel package,
    imported under another name (the ops and the rest of fastamp are today's). `ref` must be a
    commit whose DDP hands the scaler a fastamp.handoff.GradStats (register_grad_scaler)."""
    import importlib
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = subprocess.run(
        ["git", "-C", root, "ls-tree", "--name-only", ref, "python/fastamp/parallel/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    top = tempfile.mkdtemp()
    pkg = os.path.join(top, "fastamp_baseline_parallel")
    os.makedirs(pkg)
    for f in files:
        if not f.endswith(".py"):
            continue
        src = subprocess.run(
            ["git", "-C", root, "show", f"{ref}:{f}"], check=True, capture_output=True, text=True
        ).stdout
        with open(os.path.join(pkg, os.path.basename(f)), "w") as fh:
            fh.write(src.replace("fastamp.parallel", "fastamp_baseline_parallel"))
    sys.path.insert(0, top)
    return importlib.import_module("fastamp_baseline_parallel.distributed").DistributedDataParallel


def make_variant(kind, view, base, args):
    model = copy.deepcopy(base)
    if kind == "today":
        ddp = _BASELINE(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view)
        opt = fastamp.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
        scaler = fastamp.GradScaler("cpu", init_scale=2.0**16)
        ddp.register_grad_scaler(scaler)
    elif kind == "torch":
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view
        )
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    elif kind == "torchddp":
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view
        )
        opt = fastamp.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
        scaler = fastamp.GradScaler("cpu", init_scale=2.0**16)
    else:
        ddp = fastamp.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view
        )
        opt = fastamp.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
        scaler = fastamp.GradScaler("cpu", init_scale=2.0**16)
        ddp.register_grad_scaler(scaler)
    params = list(ddp.parameters())
    loss_fn = nn.CrossEntropyLoss()

    def fwd_bwd(x, y):
        opt.zero_grad(set_to_none=args.set_to_none)
        logits = ddp(x)
        loss = loss_fn(logits.flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()

    if kind == "torch":

        def step():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, args.max_norm, foreach=True)
            scaler.step(opt)
            scaler.update()
    else:

        def step():
            scaler.clip_grad_norm_(opt, args.max_norm)
            scaler.step(opt)
            scaler.update()

    return ddp, fwd_bwd, step


def memory(kind, ddp):
    """(comm buffer bytes, grad bytes, extra-beyond-grads bytes or None, note, number of buckets)."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    storages = {}  # data_ptr -> nbytes of each distinct storage that holds a grad
    for p in params:
        s = p.grad.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    held = sum(storages.values())  # what the grads actually keep alive
    if hasattr(ddp, "_sync") or hasattr(ddp, "_buckets"):  # a baseline's Python reducer
        buckets = ddp._sync.layout.buckets if hasattr(ddp, "_sync") else ddp._buckets
        bufs = [(b.buffer.data_ptr(), b.buffer.numel() * b.buffer.element_size()) for b in buckets]
        comm = sum(n for _, n in bufs)

        def inside(p):
            a = p.grad.data_ptr()
            return any(
                s <= a and a + p.grad.numel() * p.grad.element_size() <= s + n for s, n in bufs
            )

        if all(inside(p) for p in params):
            extra = (
                comm - grad_bytes
            )  # the buffers are the grads' storage; only padding could be extra
            note = "every p.grad lies inside a bucket buffer (by address)"
        else:
            shared = sum(n for s, n in bufs if s in storages)
            extra = comm - shared
            note = "grads have their own storage; buckets are separate"
        return comm, grad_bytes, held, extra, note, len(bufs)
    # torch's C++ reducer (torch's DDP, and fastamp's since it runs on it) keeps the buckets; its
    # logging data lists their bytes (the rebuilt ones once the buckets were rebuilt).
    data = ddp._get_ddp_logging_data()
    sizes = (
        data.get("rebuilt_bucket_sizes")
        if data.get("has_rebuilt_buckets")
        else data.get("bucket_sizes")
    )
    if not sizes:
        return None, grad_bytes, held, None, "torch: reducer bucket sizes unavailable", None
    sizes = [int(s) for s in str(sizes).split(",") if s.strip()]
    comm = sum(sizes)
    if sorted(storages.values()) == sorted(sizes):
        extra = 0
        note = "grads' distinct storages == the reducer's buckets (count and bytes)"
    elif held == grad_bytes and len(storages) == len(params):
        extra = comm
        note = "grads have their own storage; buckets are separate"
    else:
        extra = None
        note = f"could not verify ({len(storages)} grad storages, {len(sizes)} buckets)"
    return comm, grad_bytes, held, extra, note, len(sizes)


def worker(rank, world, init_method, args):
    global _BASELINE, VARIANTS
    if args.baseline:
        _BASELINE = load_baseline(args.baseline)
        VARIANTS = VARIANTS + [("today", False), ("today", True)]
    if args.ddp_control:
        VARIANTS = VARIANTS + CONTROLS
    if init_method is None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    else:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)

    torch.manual_seed(0)
    base = LM(args.vocab, args.dim, args.heads, args.layers, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    steps = (args.warmup + args.reps) * args.block
    g = torch.Generator().manual_seed(1234)
    full = [
        torch.randint(0, args.vocab, (args.batch * world, args.seq + 1), generator=g)
        for _ in range(steps)
    ]
    mine = [
        (
            t[rank * args.batch : (rank + 1) * args.batch, :-1],
            t[rank * args.batch : (rank + 1) * args.batch, 1:],
        )
        for t in full
    ]

    setups = {name(k, v): (k, v, *make_variant(k, v, base, args)) for k, v in VARIANTS}
    times = {n: {"fwd+bwd": [], "step": [], "total": [], "faults": []} for n in setups}
    t_run = time.perf_counter()
    for i in range(args.warmup + args.reps):
        # Each variant runs a block of consecutive steps (the same batches for every variant);
        # only the block's last step is timed, so it starts from the variant's own leftovers
        # (heap, caches) as in a training loop, not from the previous variant's. The blocks'
        # order is carry-over balanced (benchmarks/common.py balanced_order).
        for n in balanced_order(list(setups), i):
            _, _, ddp, fwd_bwd, step = setups[n]
            for j in range(args.block):
                x, y = mine[i * args.block + j]
                dist.barrier()  # every rank starts the step together
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                fwd_bwd(x, y)
                t1 = time.perf_counter()
                step()
                t2 = time.perf_counter()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            if i >= args.warmup:
                times[n]["faults"].append(faults)
                times[n]["fwd+bwd"].append(t1 - t0)
                times[n]["step"].append(t2 - t1)
                times[n]["total"].append(t2 - t0)
    run_s = time.perf_counter() - t_run

    # The comparison is honest only if both reached the same parameters.
    for view, other in [
        (v, k)
        for v in (False, True)
        for k in ("fastamp", "today", "torchddp")
        if name(k, v) in setups
    ]:
        a = setups[name("torch", view)][2].module
        b = setups[name(other, view)][2].module
        for (pn, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(
                q,
                p,
                rtol=args.rtol,
                atol=args.atol,
                msg=lambda m, pn=pn, view=view: f"view={view} {pn}: {m}",
            )

    med = {n: {ph: statistics.median(v) for ph, v in d.items()} for n, d in times.items()}
    mem = {n: memory(s[0], s[2]) for n, s in setups.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, med)
    if rank == 0:
        report(args, world, threads, n_params, med, gathered, mem, run_s)
    dist.barrier()
    dist.destroy_process_group()


def report(args, world, threads, n_params, med, gathered, mem, run_s):
    spread = max(abs(g[n]["total"] / med[n]["total"] - 1) for g in gathered for n in med)
    print(
        f"fastamp {fastamp.__version__} | torch {torch.__version__} | cpu ({device_name('cpu')}) | "
        f"gloo, {world} ranks x {threads} thread(s) | fp32 + GradScaler, AdamW, clip {args.max_norm}"
    )
    print(
        f"model: transformer LM {n_params / 1e6:.1f}M params (dim {args.dim}, {args.layers} layers, vocab "
        f"{args.vocab}), {args.batch}x{args.seq} tokens per rank | bucket_cap_mb {args.bucket_cap_mb} | "
        f"zero_grad(set_to_none={args.set_to_none}) | {args.reps} reps after {args.warmup} warm-up, "
        f"interleaved in blocks of {args.block} (the last timed) | run {run_s:.0f}s"
    )
    hdr = (
        f"{'variant':<14} | {'fwd+bwd ms':>10} {'step ms':>8} {'total ms':>9} | {'fastamp/torch':>13} | "
        f"{'buckets':>7} {'comm buf MiB':>12} {'grads MiB':>9} {'extra beyond grads MiB':>22}"
    )
    print_header(hdr)
    rows = []
    for n, (kind, view) in zip(med, VARIANTS):
        m = med[n]
        ref = med[name("torch", view)]
        ratio = m["total"] / ref["total"]
        comm, grads, held, extra, note, nb = mem[n]
        fmt = lambda v: "n/a" if v is None else f"{v / MiB:.1f}"  # noqa: E731
        print(
            f"{n:<14} | {m['fwd+bwd'] * 1e3:>10.1f} {m['step'] * 1e3:>8.1f} {m['total'] * 1e3:>9.1f} | "
            f"{ratio:>12.2f}x | {nb if nb is not None else 'n/a':>7} {fmt(comm):>12} {fmt(grads):>9} "
            f"{fmt(extra):>22}"
        )
        rows.append(
            {
                "variant": n,
                "kind": kind,
                "gradient_as_bucket_view": view,
                **{f"{ph}_s": v for ph, v in m.items() if ph != "faults"},
                "page_faults_per_step": m["faults"],
                "ratio_total_vs_torch": ratio,
                "ratio_fwd_bwd_vs_torch": m["fwd+bwd"] / ref["fwd+bwd"],
                "ratio_fwd_bwd_vs_torch_ddp_same_step": (
                    m["fwd+bwd"] / med[name("torchddp", view)]["fwd+bwd"]
                    if name("torchddp", view) in med
                    else None
                ),
                "ratio_step_vs_torch": m["step"] / ref["step"],
                "per_rank_total_s": [g[n]["total"] for g in gathered],
                "buckets": nb,
                "comm_buffer_bytes": comm,
                "grad_bytes": grads,
                "grad_storage_bytes": held,
                "extra_beyond_grads_bytes": extra,
                "memory_note": note,
            }
        )
    fa = [r for r in rows if r["kind"] in ("fastamp", "today")]
    print(
        "ratio = total step time / torch's with the same gradient_as_bucket_view (< 1: fastamp faster)"
    )
    print(
        "  fwd+bwd (DDP) ratios: "
        + ", ".join(f"{r['variant']} {r['ratio_fwd_bwd_vs_torch']:.2f}x" for r in fa)
        + " | step (clip+optimizer) ratios: "
        + ", ".join(f"{r['variant']} {r['ratio_step_vs_torch']:.2f}x" for r in fa)
    )
    if args.ddp_control:
        print(
            "  fwd+bwd (DDP alone: vs torch's DDP with fastamp's scaler and AdamW around it): "
            + ", ".join(
                f"{r['variant']} {r['ratio_fwd_bwd_vs_torch_ddp_same_step']:.2f}x"
                for r in fa
                if r["ratio_fwd_bwd_vs_torch_ddp_same_step"] is not None
            )
        )
    by = {r["variant"]: r for r in rows}
    for view in (False, True):
        new, old = by.get(name("fastamp", view)), by.get(name("today", view))
        if new and old:
            print(
                f"  fastamp{' +view' if view else ''} now / at {args.baseline}: total "
                f"{new['total_s'] / old['total_s']:.2f}x, fwd+bwd {new['fwd+bwd_s'] / old['fwd+bwd_s']:.2f}x, "
                f"step {new['step_s'] / old['step_s']:.2f}x"
            )
    print(
        "  page faults per timed step (rank 0, median; the allocator's trimmed heap re-mapped): "
        + ", ".join(f"{n} {med[n]['faults']:.0f}" for n in med)
    )
    print(
        f"ranks agree: largest per-rank deviation of a median total from rank 0's: {100 * spread:.1f}%"
    )
    for r in rows:
        print(f"  memory {r['variant']}: {r['memory_note']}")
    print(
        f"final parameters: fastamp == torch (rtol {args.rtol}, atol {args.atol}) with and without bucket views"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device": "cpu",
                    "device_name": device_name("cpu"),
                    "torch": torch.__version__,
                    "fastamp": fastamp.__version__,
                    "world_size": world,
                    "threads_per_rank": threads,
                    "params": n_params,
                    "args": vars(args),
                    "rows": rows,
                },
                fh,
                indent=2,
            )


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)"
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)"
    )
    int_options(ap, vocab=8192, dim=384, heads=6, layers=6, seq=32)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-norm", type=float, default=1.0)
    switch_option(
        ap,
        "--set-to-none",
        0,
        "zero_grad(set_to_none=...); 0 keeps the grads as bucket views across steps",
    )
    int_options(ap, reps=30, warmup=3)
    switch_option(
        ap,
        "--ddp-control",
        1,
        "also time torch's DDP with fastamp's scaler and AdamW (the DDP part alone)",
    )
    ap.add_argument(
        "--block",
        type=int,
        default=2,
        help="consecutive steps per variant in each repetition, the last one timed (1: the "
        "previous variant's leftovers are timed too)",
    )
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="REF",
        help="also time fastamp's DDP as of this git commit (e.g. main), interleaved",
    )
    args = ap.parse_args(argv)
    args.set_to_none = bool(args.set_to_none)
    if (
        args.warmup < 2
    ):  # both rebuild their buckets after the first iteration (torch: in the second forward)
        ap.error("--warmup must be >= 2 so that no timed repetition includes a bucket rebuild")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker,
            args=(args.world_size, f"file://{os.path.join(tmp, 'init')}", args),
            nprocs=args.world_size,
            join=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
