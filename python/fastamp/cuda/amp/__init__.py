"""``fastamp.cuda.amp.GradScaler``: the counterpart of the deprecated ``torch.cuda.amp.GradScaler``."""

from __future__ import annotations

import warnings
from typing import Any

from fastamp.scaler.grad_scaler import GradScaler as _GradScaler

__all__ = ["GradScaler"]


class GradScaler(_GradScaler):
    """``fastamp.GradScaler("cuda", ...)``, for scripts that use ``torch.cuda.amp.GradScaler``.

    Like PyTorch's, it is deprecated in favour of ``fastamp.GradScaler("cuda", ...)`` and says so
    with a FutureWarning.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        **kwargs: Any,
    ) -> None:
        warnings.warn(
            "`fastamp.cuda.amp.GradScaler(args...)` is deprecated. "
            "Please use `fastamp.GradScaler('cuda', args...)` instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(
            "cuda",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            **kwargs,
        )
