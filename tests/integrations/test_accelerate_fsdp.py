"""fastamp's Accelerator under accelerate's FSDP2 plugin (``fsdp_version=2``): two CPU processes
launched with torchrun, against accelerate's own Accelerator with torch's scaler and AdamW.

accelerate 1.15 turns FSDP on only for GPU-type setups (``AcceleratorState`` keeps ``MULTI_CPU``
as it is), so the script sets the state's ``distributed_type`` to FSDP after constructing the
accelerator on CPU; from there accelerate's own FSDP2 path runs (``prepare`` shards the model with
``fully_shard`` and swaps the optimizer's params for the DTensors), with fastamp's scaler
installed by ``install_grad_scaler`` and the clip through ``accelerator.clip_grad_norm_``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.clients
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn import functional as F
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import fastamp
    from fastamp.integrations.accelerate import Accelerator, install_grad_scaler
    from tests.integrations._common import dataset, mlp

    out = sys.argv[1]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin)
    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP  # see the test module's docstring
    state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    scaler = install_grad_scaler(acc)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = dataset()
    n = 32 // world

    model = mlp()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    assert type(next(model.parameters())).__name__ == "DTensor"
    assert type(next(iter(opt.optimizer.param_groups[0]["params"]))).__name__ == "DTensor"
    def train(acc, model, opt):
        losses, reduces, skipped = [], [], []
        for s in range(20):
            rows = slice(32 * s + rank * n, 32 * s + (rank + 1) * n)
            opt.zero_grad()
            loss = F.cross_entropy(model(x[rows]).float(), y[rows])
            acc.backward(loss)
            mode = CommDebugMode()
            with mode:
                acc.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            reduces.append(mode.get_total_counts())
            skipped.append(acc.optimizer_step_was_skipped)
            losses.append(float(loss.detach()))
        return losses, reduces, skipped

    losses, reduces, skipped = train(acc, model, opt)

    # The reference: accelerate's own Accelerator on the same FSDP2 path, with torch's scaler
    # (installed as accelerate installs its own on GPUs) and torch's AdamW; its clip is
    # accelerate's (unscale_, then its DTensor-aware clip_grad_norm_).
    from accelerate import Accelerator as TheirAccelerator

    theirs = TheirAccelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin)
    state.distributed_type = DistributedType.FSDP  # the constructor set MULTI_CPU again
    assert theirs.is_fsdp2
    rscaler = install_grad_scaler(theirs, torch.amp.GradScaler("cpu"))
    ref = mlp()
    ref, ropt = theirs.prepare(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))
    assert type(next(ref.parameters())).__name__ == "DTensor"
    ref_losses, ref_reduces, _ = train(theirs, ref, ropt)
    ours_full = [p.full_tensor().flatten().tolist() for p in model.parameters()]
    ref_full = [p.full_tensor().flatten().tolist() for p in ref.parameters()]
    if rank == 0:
        json.dump({"losses": losses, "ref_losses": ref_losses, "params": ours_full,
                   "ref_params": ref_full, "reduces": reduces, "skipped": skipped,
                   "ref_reduces": ref_reduces,
                   "scale": scaler.get_scale(), "ref_scale": rscaler.get_scale(),
                   "scaler": type(acc.scaler).__module__}, open(out, "w"))
    # Leave together, with nothing holding the group (a rank tearing it down while a peer still
    # finishes can abort that peer), then accelerate's own teardown.
    del model, opt, ref, ropt
    gc.collect()
    dist.barrier()
    acc.end_training()
    """
)


def test_fastamp_accelerator_on_fsdp2_matches_torchs_recipe(tmp_path):
    script = tmp_path / "acc_fsdp.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(script), str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())
    import torch

    assert r["scaler"].startswith("fastamp"), r["scaler"]
    losses = r["losses"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:3]) / 3, losses
    torch.testing.assert_close(losses, r["ref_losses"], rtol=1e-5, atol=1e-6)
    for p, q in zip(r["params"], r["ref_params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
    assert r["scale"] == r["ref_scale"]
    # clip + step: one all-reduce (found_inf and the norm together; accelerate's: two)
    assert r["reduces"] == [1] * 20, r["reduces"]
    assert r["ref_reduces"] == [2] * 20, r["ref_reduces"]
    assert r["skipped"] == [False] * 20
