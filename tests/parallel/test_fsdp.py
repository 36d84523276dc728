"""fastamp on FSDP2 (``fully_shard``, DTensor params and grads): real gloo processes on localhost,
differential against torch's recipe on the same sharded model (see _fsdp_workers.py)."""

from __future__ import annotations

import os

import pytest

from tests._dist import spawn
from tests.parallel import _fsdp_workers


# The quick tier (`make test`) runs the 2-rank recipe; 4 ranks, HSDP, checkpoints and master
# weights (10-40 s of spawned processes each on 2 cores) run in the full tier (`make test-all`).
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.full)])
def test_recipe_matches_torch_with_one_collective(world, tmp_path):
    spawn(_fsdp_workers.recipe_parity, world, tmp_path)


@pytest.mark.full
def test_hybrid_sharding_reduces_over_the_shard_dimension(tmp_path):
    spawn(_fsdp_workers.hybrid_parity, 4, tmp_path)


@pytest.mark.full
def test_checkpoint_round_trip_and_resharded_resume(tmp_path, monkeypatch):
    spawn(_fsdp_workers.checkpoint_round_trip, 2, tmp_path)
    os.remove(tmp_path / "init")
    spawn(_fsdp_workers.training_state, 2, tmp_path)
    os.remove(tmp_path / "init")
    monkeypatch.setenv("FASTAMP_FSDP_CKPT", str(tmp_path))
    spawn(_fsdp_workers.resharded_resume, 4, tmp_path)


@pytest.mark.full
def test_checkpointing_master_weights_and_accumulation(tmp_path):
    spawn(_fsdp_workers.features, 2, tmp_path)
