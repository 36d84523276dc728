"""Worker processes of the fault-injection tests (gloo on CPU, 2 ranks).

Each worker writes what it observed to ``out_dir/<name>.rank<r>.pt`` and asserts by itself where it
can; the test process compares the runs. Processes are started by hand (not mp.spawn) because some
tests kill or stall a rank on purpose and must watch what the *other* rank does.
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import fastamp
from fastamp.parallel import DistributedDataParallel as FDDP
from tests._dist import finish, init_gloo

_init, _finish = init_gloo, finish


class SoakNet(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.l1 = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(48)
        self.l2 = nn.Linear(48, 48)
        self.drop = nn.Dropout(dropout)
        self.l3 = nn.Linear(48, 4)

    def forward(self, x):
        return self.l3(
            self.drop(torch.nn.functional.gelu(self.l2(torch.relu(self.norm(self.l1(x))))))
        )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Data depends only on (step, rank), never on the global RNG (which dropout consumes).
    g = torch.Generator().manual_seed(100_003 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


# ---------------------------------------------------------------------------------------------
# Fault-injection soak: fastamp vs PyTorch, step by step
# ---------------------------------------------------------------------------------------------
_KINDS = ("inf_one", "nan_one", "neginf_tensor", "nan_tensor", "inf_loss")


def storm_schedule(steps: int, seed: int) -> list[tuple[str, int] | None]:
    """Per step: None, or (kind, rank) -- rank -1 means every rank. Storms of 1..8 consecutive
    steps, about one step in eight affected, mostly on one rank only."""
    g = torch.Generator().manual_seed(seed)
    sched: list[tuple[str, int] | None] = [None] * steps
    s = 5  # a few clean steps first
    while s < steps:
        gap = int(torch.randint(5, 60, (), generator=g))
        s += gap
        length = int(torch.randint(1, 9, (), generator=g))
        kind = _KINDS[int(torch.randint(len(_KINDS), (), generator=g))]
        rank = int(torch.randint(-1, 2, (), generator=g))  # -1 (all), 0 or 1
        for t in range(s, min(s + length, steps)):
            sched[t] = (kind, rank)
        s += length
    return sched


def _grad_fault(kind: str, step: int):
    """A tensor hook (runs before the grad is accumulated, so before the all-reduce)."""

    def hook(g):
        g = g.clone()
        flat = g.view(-1)
        i = (step * 7919) % flat.numel()
        if kind == "inf_one":
            flat[i] = math.inf
        elif kind == "nan_one":
            flat[i] = math.nan
        elif kind == "neginf_tensor":
            flat.fill_(-math.inf)
        elif kind == "nan_tensor":
            flat.fill_(math.nan)
        return g

    return hook


class _Pipeline:
    """One model + DDP + scaler + optimizer; `kind` picks fastamp's or PyTorch's pieces."""

    def __init__(self, kind: str, init_state: dict, growth_interval: int):
        self.kind = kind
        net = SoakNet()
        net.load_state_dict(init_state)
        if kind == "torch":
            self.model = nn.parallel.DistributedDataParallel(net)
            self.scaler = torch.amp.GradScaler(
                "cpu", init_scale=2.0**14, growth_interval=growth_interval
            )
            self.opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
        else:
            self.model = FDDP(net)
            self.scaler = fastamp.GradScaler(
                "cpu", init_scale=2.0**14, growth_interval=growth_interval
            )
            if kind == "fastamp_fused":
                self.opt = fastamp.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
                self.model.register_grad_scaler(self.scaler)
            else:  # drop-in: fastamp.GradScaler + fastamp DDP, torch's optimizer and clip recipe
                self.opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
        self.net = net

    def step(self, step: int, rank: int, fault: tuple[str, int] | None, autocast: bool) -> dict:
        x, y = _batch(step, rank)
        self.opt.zero_grad(set_to_none=True)
        hit = fault is not None and fault[1] in (-1, rank)
        handle = None
        if hit and fault[0] != "inf_loss":
            handle = self.net.l2.weight.register_hook(_grad_fault(fault[0], step))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = self.model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        if hit and fault[0] == "inf_loss":
            loss = loss * math.inf
        self.scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        before = [p.detach().clone() for p in self.net.parameters()]
        if self.kind == "torch":
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
            skipped = (
                sum(float(v) for v in self.scaler._found_inf_per_device(self.opt).values()) > 0
            )
            self.scaler.step(self.opt)
        elif self.kind == "fastamp_dropin":  # the user's torch recipe, only the class swapped
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
            self.scaler.step(self.opt)
            skipped = bool(self.scaler.last_step_skipped())
        else:
            self.scaler.clip_grad_norm_(self.opt, 1.0)
            self.scaler.step(self.opt)
            skipped = bool(self.scaler.last_step_skipped())
        self.scaler.update()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, self.net.parameters()))
        return {
            "skipped": skipped,
            "unchanged": unchanged,
            "scale": self.scaler.get_scale(),
            "growth": int(self.scaler._growth_tracker),
            "loss": loss.item(),
        }


def soak(
    rank: int, world: int, init_file: str, out_dir: str, steps: int, seed: int, autocast: bool
) -> None:
    """Three set-ups on the same data and faults: PyTorch's (DDP + GradScaler + AdamW), fastamp's
    fused one and fastamp's drop-in one (fastamp DDP + GradScaler with torch's AdamW)."""
    _init(rank, world, init_file, timeout_s=120.0)
    torch.manual_seed(seed)
    init_state = SoakNet().state_dict()
    sched = storm_schedule(steps, seed)
    pipes = [
        _Pipeline(k, init_state, growth_interval=25)
        for k in ("torch", "fastamp_fused", "fastamp_dropin")
    ]
    log: list[dict] = []
    max_rel = {p.kind: 0.0 for p in pipes[1:]}
    for step in range(steps):
        rec = {p.kind: p.step(step, rank, sched[step], autocast) for p in pipes}
        expect_skip = sched[step] is not None
        ref = rec["torch"]
        for p in pipes:
            r = rec[p.kind]
            assert r["skipped"] == expect_skip, (step, p.kind, sched[step], r)
            assert r["unchanged"] == r["skipped"], (step, p.kind, r)
            assert r["scale"] == ref["scale"] and r["growth"] == ref["growth"], (
                step,
                p.kind,
                r,
                ref,
            )
        for p in pipes[1:]:
            for a, b in zip(p.net.parameters(), pipes[0].net.parameters()):
                rel = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                max_rel[p.kind] = max(max_rel[p.kind], rel)
        log.append({k: (v["skipped"], v["scale"]) for k, v in rec.items()})
    # every rank holds the same parameters at the end (the skips agreed across ranks)
    for p in pipes:
        flat = torch.cat([q.detach().reshape(-1) for q in p.net.parameters()])
        other = flat.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(flat, other), f"{p.kind}: ranks diverged"
    torch.save(
        {"log": log, "max_rel": max_rel, "skips": sum(s is not None for s in sched)},
        os.path.join(out_dir, f"soak.rank{rank}.pt"),
    )
    del pipes
    _finish()


# ---------------------------------------------------------------------------------------------
# Killed / stalled ranks and bit-identical restart
# ---------------------------------------------------------------------------------------------
class RunNet(nn.Module):
    def __init__(self):
        super().__init__()
        # Registered out of forward order, so the buckets rebuilt from the order grads become
        # ready differ from the initial (reverse registration order) ones: a resumed run must
        # restore the rebuilt layout to sum the clip norm the same way.
        self.l3 = nn.Linear(64, 4)
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.2)  # consumes the CPU generator: the RNG must be resumed

    def forward(self, x):
        return self.l3(self.drop(torch.tanh(self.l2(torch.relu(self.bn(self.l1(x)))))))


def _build(seed: int):
    torch.manual_seed(seed)
    model = FDDP(RunNet(), bucket_cap_mb=0.01)  # several buckets, rebuilt after the first step
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=2)
    opt = fastamp.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    model.register_grad_scaler(scaler)
    return model, opt, scaler, sched


INF_STEPS = (4, 5, 9)  # overflow on rank 1 only (flows to rank 0 through the all-reduce)


def _train_step(model, opt, scaler, sched, step: int, rank: int, die_at: int | None = None) -> dict:
    x, y = _batch(step, rank)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    if step in INF_STEPS and rank == 1:
        loss = loss * math.inf
    if die_at == step:
        # killed in the middle of the backward, after some buckets were launched
        model.module.l1.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    scaler.scale(loss).backward()
    norm = scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()
    return {
        "loss": float(loss),
        "norm": float(norm),
        "scale": scaler.get_scale(),
        "skipped": bool(scaler.last_step_skipped()),
    }


def _state(model, opt, scaler) -> dict:
    return {
        "params": {k: v.clone() for k, v in model.module.state_dict().items()},
        "opt": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": torch.get_rng_state(),
    }


def run(
    rank: int,
    world: int,
    init_file: str,
    out_dir: str,
    mode: str,
    steps: int,
    save_at: int,
    fault_at: int,
    timeout_s: float,
) -> None:
    """mode: "full" (uninterrupted), "killed" (save at `save_at`; rank 1 is SIGKILLed mid-backward
    at `fault_at`), "stalled" (rank 1 stops responding at `fault_at`), "resume" (load the
    checkpoint and continue to `steps`)."""
    _init(rank, world, init_file, timeout_s=timeout_s)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    if mode == "resume":
        model, opt, scaler, sched = _build(seed=999)  # different init: the load must overwrite it
        st = fastamp.load_training_state(
            ckpt, model=model, optimizer=opt, scaler=scaler, lr_scheduler=sched
        )
        start = st.step
        assert st.extra == {"note": "mid-run"}, st.extra
    else:
        model, opt, scaler, sched = _build(seed=0)
        start = 0
    initial_buckets = model.bucket_layout()  # for "resume": the layout just loaded
    log = []
    result: dict = {}
    for step in range(start, steps):
        if mode in ("killed", "stalled") and step == fault_at:
            if rank == 1 and mode == "stalled":
                time.sleep(3600)  # alive but silent; the parent kills it
            t0 = time.monotonic()
            try:
                _train_step(
                    model, opt, scaler, sched, step, rank, die_at=fault_at if rank == 1 else None
                )
            except RuntimeError as e:
                result = {"error": str(e), "elapsed": time.monotonic() - t0}
            else:
                result = {"error": None, "elapsed": time.monotonic() - t0}
            torch.save(result, os.path.join(out_dir, f"{mode}.rank{rank}.pt"))
            os._exit(0)  # the process group is broken: skip its teardown
        log.append(_train_step(model, opt, scaler, sched, step, rank))
        if step + 1 == save_at and mode != "resume":
            fastamp.save_training_state(
                ckpt,
                model=model,
                optimizer=opt,
                scaler=scaler,
                lr_scheduler=sched,
                step=save_at,
                extra={"note": "mid-run"},
            )
    torch.save(
        {
            "log": log,
            "state": _state(model, opt, scaler),
            "start": start,
            "buckets": model.bucket_layout(),
            "initial_buckets": initial_buckets,
        },
        os.path.join(out_dir, f"{mode}.rank{rank}.pt"),
    )
    del model, opt, scaler, sched
    _finish()
