"""Fault-injection soak: 1,000 steps of a small model (2 gloo ranks, bf16 autocast, AdamW, clipping)
under random inf/NaN storms -- one element or a whole grad tensor, inf in the loss, several steps in
a row, on one rank only or on all -- run side by side with PyTorch's DDP + GradScaler + AdamW on the
same data. Every step, every rank: the same skip decision as PyTorch and as the injection schedule,
the same scale and growth tracker, parameters untouched on skipped steps; parameters within
tolerance of PyTorch's throughout; every rank ends with the same parameters.

Two fastamp set-ups run: the fused one (fastamp DDP + GradScaler.clip_grad_norm_ +
fastamp.optim.AdamW, stats reused from the DDP unpack) and the drop-in one (torch's recipe --
unscale_, clip_grad_norm_, step -- with fastamp's GradScaler and DDP and torch's AdamW).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel import _fault_workers as W


def _soak(tmp_path, steps, seed, autocast):
    mp.spawn(
        W.soak,
        args=(2, str(tmp_path / "init"), str(tmp_path), steps, seed, autocast),
        nprocs=2,
        join=True,
    )
    return [torch.load(tmp_path / f"soak.rank{r}.pt", weights_only=False) for r in range(2)]


def test_storm_schedule_covers_every_fault_kind():
    sched = W.storm_schedule(1000, seed=0)
    faults = [f for f in sched if f is not None]
    assert {k for k, _ in faults} == set(W._KINDS)
    assert {r for _, r in faults} == {-1, 0, 1}  # all ranks, and each rank alone
    runs, cur = [], 0
    for f in sched:
        cur = cur + 1 if f is not None else 0
        runs.append(cur)
    assert max(runs) >= 5, "no storm of several consecutive steps"
    assert 0.05 < len(faults) / len(sched) < 0.3


def _check(results, steps, fused_tol):
    for rank, res in enumerate(results):
        log = res["log"]
        assert len(log) == steps
        skips = sum(rec["torch"][0] for rec in log)
        assert skips == res["skips"] > 50, (rank, skips, res["skips"])
        scales = {rec["torch"][1] for rec in log}
        assert len(scales) > 5, "the scale never moved: the soak exercised nothing"
        # The drop-in set-up is torch's recipe (unscale_, clip_grad_norm_, step) with fastamp's
        # GradScaler and DDP: bit for bit.
        assert res["max_rel"]["fastamp_dropin"] == 0.0, (rank, res["max_rel"])
        # The fused AdamW rounds differently from torch's (one fused expression per element).
        assert res["max_rel"]["fastamp_fused"] < fused_tol, (rank, res["max_rel"])


@pytest.mark.full  # about 3 minutes on 2 cores: the full tier (`make test-all`)
def test_fault_injection_soak_1000_steps_matches_torch(tmp_path):
    # fp32 compute: last-bit differences between the fused and torch's AdamW stay last-bit
    # (measured: ~2e-6 relative after 200 steps, with or without faults and clipping).
    _check(_soak(tmp_path, 1000, seed=0, autocast=False), 1000, fused_tol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_fault_injection_soak_bf16_autocast(tmp_path, seed):
    # Under bf16 autocast a last-bit difference in a weight can flip the bf16 rounding of an
    # activation, so the fused optimizer's parameters drift chaotically from torch's (measured:
    # ~1e-2 relative after 100-200 steps, faults or not). Skips and scales must still be exact,
    # and the drop-in set-up still bit-identical.
    _check(_soak(tmp_path, 2000, seed=seed, autocast=True), 2000, fused_tol=0.5)
