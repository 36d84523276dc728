"""Loss scaling for mixed-precision training: :class:`GradScaler` and its fused ops."""

from fastamp.scaler import _ops as ops
from fastamp.scaler._validation import check_state_dict
from fastamp.scaler.grad_scaler import GradScaler, OptState

__all__ = ["GradScaler", "OptState", "check_state_dict", "ops"]
