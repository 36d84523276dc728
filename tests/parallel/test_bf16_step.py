"""The scaler-free step (bf16 autocast, ``fastamp.clip_grad_norm_``) under fastamp's DDP and FSDP2,
against torch's recipe on the same model: real gloo processes (see _bf16_workers.py)."""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests.parallel import _bf16_workers


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_ddp_scaler_free_step_matches_torch_and_reuses_the_hooks_norm(world, tmp_path):
    spawn(_bf16_workers.ddp_recipe, world, tmp_path)


# The quick tier runs DDP at 2 ranks; FSDP2 (1, 2 and 4 ranks, 20-60 s of spawned processes on
# 2 cores) and DDP at 3 run in the full tier (make test-all).
@pytest.mark.full
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp2_scaler_free_step_matches_torch_with_one_collective(world, tmp_path):
    spawn(_bf16_workers.fsdp_recipe, world, tmp_path)
