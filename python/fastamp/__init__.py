"""fastamp: fused mixed-precision training glue for PyTorch.

Replace ``torch.amp.GradScaler`` with :class:`fastamp.GradScaler`; nothing else in the script changes.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _doctor_requested() -> bool:
    # `python -m fastamp doctor` (argv[0] is "-m" while the package imports) or the `fastamp`
    # console script: the doctor must run even when the compiled library cannot load, to say why.
    argv = _sys.argv
    return (
        len(argv) > 1
        and argv[1] == "doctor"
        and (argv[0] == "-m" or _os.path.basename(argv[0]) in ("fastamp", "__main__.py"))
    )


try:
    from fastamp._library import build_info
except ImportError as _exc:
    if not _doctor_requested():
        raise
    LOAD_ERROR: "ImportError | None" = _exc
else:
    LOAD_ERROR = None
    from fastamp import checkpoint, cuda, memory, optim, parallel  # noqa: E402
    from fastamp.accumulation import GradientAccumulator, scale_lr  # noqa: E402
    from fastamp.resume import TrainingState, load_training_state, save_training_state  # noqa: E402
    from fastamp.scaler import (  # noqa: E402
        GradScaler,
        NonfiniteGuard,
        OptState,
        clip_grad_norm_,
        nonfinite_guard,
    )
    from fastamp.scaler import ops as scaler_ops  # noqa: E402
    from fastamp.scaler.grad_scaler import OverflowReport  # noqa: E402

__all__ = [
    "GradScaler",
    "GradientAccumulator",
    "NonfiniteGuard",
    "OptState",
    "OverflowReport",
    "TrainingState",
    "build_info",
    "checkpoint",
    "clip_grad_norm_",
    "cuda",
    "memory",
    "load_training_state",
    "nonfinite_guard",
    "optim",
    "parallel",
    "scale_lr",
    "save_training_state",
    "scaler_ops",
    "__version__",
]
