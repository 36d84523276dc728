"""Selective activation checkpointing policies (``context_fn`` factories for :func:`checkpoint`).

Built on PyTorch's selective-checkpoint machinery (``create_selective_checkpoint_contexts``): a
policy decides per op whether its output is saved or recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fastamp.checkpoint.accounting import note_cache

__all__ = ["save_compute_intensive", "selective", "CheckpointPolicy"]

# Matmuls, convolutions and attention: expensive to recompute, cheap to keep relative to their
# cost. Everything else (pointwise, norms, activations, dropout) is recomputed.
_COMPUTE_INTENSIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in (
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
):
    if hasattr(torch.ops.aten, _name):
        _COMPUTE_INTENSIVE.add(getattr(torch.ops.aten, _name).default)


def save_compute_intensive(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Ready policy: save matmul / convolution / attention outputs, recompute the rest."""
    if func in _COMPUTE_INTENSIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective(
    policy: Callable[..., CheckpointPolicy] | list[Any] = save_compute_intensive,
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for :func:`checkpoint`: ``checkpoint(block, x, context_fn=selective())``.

    ``policy`` is a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a list of ops to
    save, as PyTorch's ``create_selective_checkpoint_contexts`` takes. It is checked here, not at
    the first forward.
    """
    if isinstance(policy, (list, tuple)):
        for i, op in enumerate(policy):
            if isinstance(op, torch._ops.OpOverloadPacket):
                raise TypeError(
                    f"selective: policy[{i}] is {op} (an OpOverloadPacket), which never matches an "
                    f"op that runs; expected an overload such as {op}.default"
                )
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                raise TypeError(
                    f"selective: policy[{i}] is a {type(op).__name__}; expected an op overload such "
                    "as torch.ops.aten.mm.default"
                )
        policy = list(policy)
    elif isinstance(policy, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(
            f"selective: policy is the op {policy}, which would be called as a policy function; "
            "expected a list of ops to save, e.g. selective([torch.ops.aten.mm.default])"
        )
    elif not callable(policy):
        raise TypeError(
            "selective: policy must be a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or "
            f"a list of ops to save, got {type(policy).__name__}; expected e.g. "
            "selective([torch.ops.aten.mm.default]) or selective(save_compute_intensive)"
        )

    def context_fn() -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(policy)
        # The outputs the policy saves live in this cache, not in autograd's saved tensors; let
        # fastamp's activation accounting (count_saved_bytes, the planner) see them.
        note_cache(caching.storage)
        return caching, cached

    return context_fn
