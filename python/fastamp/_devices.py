"""Moving the step's small device tensors (scales, flags, norms) where a kernel reads them."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T", Tensor, None)


def to_device(t: T, device: torch.device) -> T:
    """``t`` on ``device``, without a copy when it is already there (no sync either way); None
    stays None."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)
