"""Activation checkpointing that replays RNG and autocast exactly, checks determinism bit for bit,
saves selectively, offloads, and plans for a memory budget.

* :func:`checkpoint`, :func:`checkpoint_sequential`: ``torch.utils.checkpoint`` (non-reentrant)
  semantics, with RNG replay on every initialised device and ``determinism_check="bitwise"``.
* :func:`selective` / :func:`save_compute_intensive`: selective checkpointing policies.
* :class:`offload_activations` / :func:`offload`: keep saved activations in host memory instead.
* :func:`apply`: measure a model once and checkpoint the cheapest blocks to fit a memory budget.
"""

from fastamp.checkpoint import _ops as ops
from fastamp.checkpoint.core import CheckpointError, checkpoint, checkpoint_sequential
from fastamp.checkpoint.offload import PinnedPool, offload, offload_activations
from fastamp.checkpoint.planner import CheckpointPlan, apply, measure_blocks
from fastamp.checkpoint.policies import CheckpointPolicy, save_compute_intensive, selective

__all__ = [
    "CheckpointError",
    "CheckpointPlan",
    "CheckpointPolicy",
    "PinnedPool",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "measure_blocks",
    "offload",
    "offload_activations",
    "ops",
    "save_compute_intensive",
    "selective",
]
