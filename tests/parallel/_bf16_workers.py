"""Worker processes of the scaler-free step's distributed tests (gloo on CPU): bf16 autocast, no
loss scaler, ``fastamp.clip_grad_norm_`` + a fastamp optimizer against torch's recipe
(``torch.nn.utils.clip_grad_norm_`` + the torch optimizer, stepping only when the norm is finite:
the usual host-side NaN guard) on the same model and batches, under fastamp's DDP / torch's DDP
and under FSDP2. An inf goes into one rank's grads only: every rank skips together. Each worker
asserts by itself, on every rank."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastamp
from fastamp.parallel import DistributedDataParallel as FDDP
from fastamp.testing.syncs import count_host_syncs
from tests.parallel._fsdp_workers import _batch, _close_shards, _model
from tests.parallel._workers import _finish, _init

KINDS = {"AdamW": {"lr": 1e-2}, "Adam": {"lr": 1e-2, "amsgrad": True},
         "SGD": {"lr": 0.05, "momentum": 0.9}}  # fmt: skip


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))


def _loss(m, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return nn.functional.mse_loss(m(x).float(), y)


def _torch_step(m, opt, params, clip) -> bool:
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if torch.isfinite(norm):  # the host-side guard (a sync)
        opt.step()
        return True
    return False


def ddp_recipe(rank: int, world: int, init_file: str) -> None:
    """fastamp's DDP + scaler-free clip == torch's DDP + torch's clip; the clip reuses the comm
    hook's sum of squares (no stats pass of its own) and reads nothing on the host."""
    _init(rank, world, init_file)
    from fastamp.scaler import _ops as scaler_ops

    for kind, kw in KINDS.items():
        ref = TorchDDP(_net())
        ours = FDDP(_net())
        ref_opt = getattr(torch.optim, kind)(ref.parameters(), **kw)
        our_opt = getattr(fastamp.optim, kind)(ours.parameters(), **kw)
        for s in range(5):
            x, y = _batch(s, rank, world)
            for m, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad()
                loss = _loss(m, x, y)
                if s == 3:  # an inf in one rank's loss reaches every rank's grads (all-reduce)
                    loss = loss * (math.inf if rank == 0 else 1.0)
                loss.backward()
            stepped = _torch_step(ref, ref_opt, ref.parameters(), 0.5)
            real_stats = scaler_ops.grad_stats
            scaler_ops.grad_stats = None  # the clip must take DDP's measurement: any call fails
            try:
                with count_host_syncs(("fastamp",)) as reads:
                    norm = fastamp.clip_grad_norm_(our_opt, 0.5, skip_nonfinite=True)
                    our_opt.step()
            finally:
                scaler_ops.grad_stats = real_stats
            assert reads == [], reads
            assert bool(our_opt.stepped) == stepped, (kind, s)
            assert stepped == (s != 3)
            if stepped:
                ref_norm = math.sqrt(sum(float(p.grad.double().square().sum())
                                         for p in ours.parameters()))  # fmt: skip
                assert math.isclose(float(norm), ref_norm, rel_tol=1e-5), (float(norm), ref_norm)
            for p, q in zip(ours.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        guard = fastamp.nonfinite_guard(our_opt)
        assert guard is not None and int(guard.skipped) == 1
    _finish()


def fsdp_recipe(rank: int, world: int, init_file: str) -> None:
    """The scaler-free step on FSDP2: the norm over every shard in one all-reduce (inf flag and
    sum of squares together), the skip on every rank when one rank's shard holds an inf, the
    shards as torch's recipe leaves them, no host read."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    for kind, kw in KINDS.items():
        ref, ours = _model(mesh), _model(mesh)
        ref_opt = getattr(torch.optim, kind)(ref.parameters(), **kw)
        our_opt = getattr(fastamp.optim, kind)(ours.parameters(), **kw)
        for s in range(5):
            x, y = _batch(s, rank, world)
            for m, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad(set_to_none=True)
                _loss(m, x, y).backward()
                if s == 2 and rank == world - 1:
                    shard = m[0].weight.grad.to_local()
                    shard.view(-1)[0] = math.inf
            stepped = _torch_step(ref, ref_opt, ref.parameters(), 0.5)
            mode = CommDebugMode()
            with mode, count_host_syncs(("fastamp",)) as reads:
                fastamp.clip_grad_norm_(our_opt, 0.5, skip_nonfinite=True)
                our_opt.step()
            assert reads == [], reads
            assert mode.get_total_counts() == 1, mode.get_comm_counts()
            assert bool(our_opt.stepped) == stepped == (s != 2), (kind, s)
            _close_shards(ours, ref, rtol=1e-5, atol=1e-6)
        for p in ours.parameters():
            st = our_opt.state[p]
            key = "momentum_buffer" if kind == "SGD" else "exp_avg"
            assert isinstance(st[key], DTensor) and st[key].placements == p.placements
    _finish()
