"""Reference implementations, input makers and raw-op call helpers shared by fastamp's tests and
benchmarks."""

from fastamp.testing.op_args import OP_DEFAULTS, op_args, op_names
from fastamp.testing.reference import (
    adam_ref,
    assert_bitwise_equal,
    clip_unscale_ref,
    grad_stats_ref,
    make_grads,
    sgd_ref,
    transformer_like_shapes,
    unscale_ref,
    update_scale_ref,
)
from fastamp.testing.syncs import count_host_syncs

__all__ = [
    "OP_DEFAULTS",
    "op_args",
    "op_names",
    "adam_ref",
    "assert_bitwise_equal",
    "sgd_ref",
    "clip_unscale_ref",
    "count_host_syncs",
    "grad_stats_ref",
    "make_grads",
    "transformer_like_shapes",
    "unscale_ref",
    "update_scale_ref",
]
