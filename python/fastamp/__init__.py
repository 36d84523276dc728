"""fastamp: fused mixed-precision training glue for PyTorch.

Replace ``torch.amp.GradScaler`` with :class:`fastamp.GradScaler`; nothing else in the script changes.
"""

from fastamp import checkpoint, cuda, optim, parallel  # noqa: E402  (fastamp.cuda.amp.GradScaler for old scripts)
from fastamp._library import build_info
from fastamp.scaler import GradScaler, OptState
from fastamp.scaler import ops as scaler_ops
from fastamp.scaler.grad_scaler import OverflowReport

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "OptState",
    "OverflowReport",
    "build_info",
    "checkpoint",
    "cuda",
    "optim",
    "parallel",
    "scaler_ops",
    "__version__",
]
