"""fastamp.parallel.DistributedDataParallel against torch's DDP in the same gloo processes
(2 and 3 ranks): faults, unused parameters, reused statistics, buffers, constructor keywords,
comm hooks and join. Each worker compares the two on the same inputs; see _parity_workers."""

import os

import pytest

from tests._dist import spawn
from tests.parallel import _parity_workers as W

# The full tier (`make test-all`): 3.5 minutes of spawned process groups on 2 cores. The quick
# tier (`make test`) keeps fastamp's DDP against torch's through tests/parallel/test_ddp.py.
pytestmark = pytest.mark.full


# 2 and 3 ranks; the torch matrix in CI (make test-matrix-ci) runs 2 only
# (FASTAMP_DDP_PARITY_WORLDS=2): the version differences it looks for are not rank counts.
_WORLDS = [int(w) for w in os.environ.get("FASTAMP_DDP_PARITY_WORLDS", "2,3").split(",")]

# What each worker shows, the worker (tests/parallel/_parity_workers.py) and the rank counts it
# runs at.
CASES = [
    ("exception_in_backward_raises_at_next_forward_like_torch", W.exception_in_backward, _WORLDS),
    ("exception_in_forward_on_every_rank_matches_torch", W.exception_in_forward, _WORLDS),
    ("reentrant_and_repeated_backward", W.reentrant_backward, _WORLDS),
    (
        "rank_raising_while_others_are_in_backward_fails_loudly_everywhere",
        W.rank_raises_in_backward,
        [2],
    ),
    ("unused_parameters_keep_none_grads_like_torch", W.unused_parameters, _WORLDS),
    ("statistics_reused_only_while_grads_unchanged", W.stale_statistics, _WORLDS),
    ("mismatched_buffers_named_on_every_rank", W.mismatched_buffers, _WORLDS),
    ("buffer_broadcasts_follow_torch_under_no_sync", W.buffers_under_no_sync, _WORLDS),
    ("every_torch_constructor_keyword_same_or_refused", W.constructor_keywords, _WORLDS),
    ("comm_hooks_match_torch", W.comm_hooks, _WORLDS),
    ("join_uneven_inputs_matches_torch", W.uneven_inputs_join, _WORLDS),
    ("join_with_unused_parameters_matches_torch", W.join_with_unused_parameters, _WORLDS),
    ("grads_bit_for_bit_with_torch_bucket_layouts", W.grads_bitwise, _WORLDS),
    ("user_grad_hooks_run_before_the_reducer_like_torch", W.user_grad_hooks, _WORLDS),
    ("deleting_the_wrapper_removes_its_hooks", W.wrapper_deleted, [2]),
    ("comm_hooks_compose_with_the_statistics_bit_for_bit", W.hooks_and_statistics_bitwise, _WORLDS),
]


@pytest.mark.parametrize(
    ("worker", "world"),
    [pytest.param(worker, w, id=f"{what}-{w}") for what, worker, ws in CASES for w in ws],
)
def test_same_as_torchs_ddp(worker, world, tmp_path):
    spawn(worker, world, tmp_path)
