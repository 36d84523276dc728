"""fastamp.parallel.DistributedDataParallel against torch's DDP in the same gloo processes
(2 and 3 ranks): faults, unused parameters, reused statistics, buffers, constructor keywords,
comm hooks and join. Each worker compares the two on the same inputs; see _parity_workers."""

import os

import pytest
import torch.multiprocessing as mp

from tests.parallel import _parity_workers as W

# The full tier (`make test-all`): 3.5 minutes of spawned process groups on 2 cores. The quick
# tier (`make test`) keeps fastamp's DDP against torch's through tests/parallel/test_ddp.py.
pytestmark = pytest.mark.full


def _spawn(fn, world, tmp_path):
    mp.spawn(fn, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


# 2 and 3 ranks; the torch matrix in CI (make test-matrix-ci) runs 2 only
# (FASTAMP_DDP_PARITY_WORLDS=2): the version differences it looks for are not rank counts.
WORLDS = pytest.mark.parametrize(
    "world", [int(w) for w in os.environ.get("FASTAMP_DDP_PARITY_WORLDS", "2,3").split(",")]
)


@WORLDS
def test_exception_in_backward_raises_at_next_forward_like_torch(world, tmp_path):
    _spawn(W.exception_in_backward, world, tmp_path)


@WORLDS
def test_exception_in_forward_on_every_rank_matches_torch(world, tmp_path):
    _spawn(W.exception_in_forward, world, tmp_path)


@WORLDS
def test_reentrant_and_repeated_backward(world, tmp_path):
    _spawn(W.reentrant_backward, world, tmp_path)


def test_rank_raising_while_others_are_in_backward_fails_loudly_everywhere(tmp_path):
    _spawn(W.rank_raises_in_backward, 2, tmp_path)


@WORLDS
def test_unused_parameters_keep_none_grads_like_torch(world, tmp_path):
    _spawn(W.unused_parameters, world, tmp_path)


@WORLDS
def test_statistics_reused_only_while_grads_unchanged(world, tmp_path):
    _spawn(W.stale_statistics, world, tmp_path)


@WORLDS
def test_mismatched_buffers_named_on_every_rank(world, tmp_path):
    _spawn(W.mismatched_buffers, world, tmp_path)


@WORLDS
def test_buffer_broadcasts_follow_torch_under_no_sync(world, tmp_path):
    _spawn(W.buffers_under_no_sync, world, tmp_path)


@WORLDS
def test_every_torch_constructor_keyword_same_or_refused(world, tmp_path):
    _spawn(W.constructor_keywords, world, tmp_path)


@WORLDS
def test_comm_hooks_match_torch(world, tmp_path):
    _spawn(W.comm_hooks, world, tmp_path)


@WORLDS
def test_join_uneven_inputs_matches_torch(world, tmp_path):
    _spawn(W.uneven_inputs_join, world, tmp_path)


@WORLDS
def test_join_with_unused_parameters_matches_torch(world, tmp_path):
    _spawn(W.join_with_unused_parameters, world, tmp_path)


@WORLDS
def test_grads_bit_for_bit_with_torch_bucket_layouts(world, tmp_path):
    _spawn(W.grads_bitwise, world, tmp_path)


@WORLDS
def test_user_grad_hooks_run_before_the_reducer_like_torch(world, tmp_path):
    _spawn(W.user_grad_hooks, world, tmp_path)


def test_deleting_the_wrapper_removes_its_hooks(tmp_path):
    _spawn(W.wrapper_deleted, 2, tmp_path)


@WORLDS
def test_comm_hooks_compose_with_the_statistics_bit_for_bit(world, tmp_path):
    _spawn(W.hooks_and_statistics_bitwise, world, tmp_path)
