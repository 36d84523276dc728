"""fastamp.parallel.DistributedDataParallel in real processes (gloo on CPU)."""

import pytest

from tests._dist import spawn
from tests.parallel import _workers


# Three ranks (an odd world, uneven buckets) run in the full tier (`make test-all`); the quick tier
# (`make test`) runs each case with two.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_matches_torch_ddp_and_single_process(world, tmp_path):
    spawn(_workers.equivalence, world, tmp_path)


def test_no_sync_accumulation_and_half_precision_grads(tmp_path):
    spawn(_workers.accumulation_and_half, 2, tmp_path)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_overflow_on_one_rank_skips_on_all(world, tmp_path):
    spawn(_workers.overflow_on_one_rank, world, tmp_path)


def test_unused_parameters(tmp_path):
    spawn(_workers.unused_parameters, 2, tmp_path)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_rank_dependent_unused_parameters(world, tmp_path):
    spawn(_workers.rank_dependent_unused, world, tmp_path)


def test_mismatched_models_detected_at_construction(tmp_path):
    spawn(_workers.mismatched_models, 2, tmp_path)


def test_dead_rank_raises_instead_of_hanging(tmp_path):
    spawn(_workers.dead_rank, 2, tmp_path)


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    spawn(_workers.accumulation_collectives, 2, tmp_path)


def test_flat_buffers_under_ddp(tmp_path):
    spawn(_workers.flat_buffers_under_ddp, 2, tmp_path)


def test_division_by_the_world_overflows_and_underflows_where_torchs_does(tmp_path):
    spawn(_workers.division_extremes, 2, tmp_path)
