"""Loss scaling for mixed-precision training: :class:`GradScaler` and its fused ops, and the
same fused clip without a scaler (:func:`clip_grad_norm_`, for bf16 and fp32 training)."""

from fastamp.scaler import _ops as ops
from fastamp.scaler._validation import check_state_dict
from fastamp.scaler.clip import NonfiniteGuard, clip_grad_norm_, nonfinite_guard
from fastamp.scaler.grad_scaler import GradScaler, OptState

__all__ = [
    "GradScaler",
    "NonfiniteGuard",
    "OptState",
    "check_state_dict",
    "clip_grad_norm_",
    "nonfinite_guard",
    "ops",
]
