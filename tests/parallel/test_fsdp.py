"""fastamp on FSDP2 (``fully_shard``, DTensor params and grads): real gloo processes on localhost,
differential against torch's recipe on the same sharded model (see _fsdp_workers.py)."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from tests.parallel import _fsdp_workers


def _spawn(fn, world, tmp_path):
    mp.spawn(fn, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_recipe_matches_torch_with_one_collective(world, tmp_path):
    _spawn(_fsdp_workers.recipe_parity, world, tmp_path)


def test_hybrid_sharding_reduces_over_the_shard_dimension(tmp_path):
    _spawn(_fsdp_workers.hybrid_parity, 4, tmp_path)


def test_checkpoint_round_trip_and_resharded_resume(tmp_path, monkeypatch):
    _spawn(_fsdp_workers.checkpoint_round_trip, 2, tmp_path)
    os.remove(tmp_path / "init")
    _spawn(_fsdp_workers.training_state, 2, tmp_path)
    os.remove(tmp_path / "init")
    monkeypatch.setenv("FASTAMP_FSDP_CKPT", str(tmp_path))
    _spawn(_fsdp_workers.resharded_resume, 4, tmp_path)


def test_checkpointing_master_weights_and_accumulation(tmp_path):
    _spawn(_fsdp_workers.features, 2, tmp_path)
