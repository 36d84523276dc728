"""Moving the step's small device tensors (scales, flags, norms) where a kernel reads them."""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor


@overload
def to_device(t: Tensor, device: torch.device) -> Tensor: ...
@overload
def to_device(t: Tensor | None, device: torch.device) -> Tensor | None: ...


def to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device``, without a copy when it is already there (no sync either way); None
    stays None."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)
