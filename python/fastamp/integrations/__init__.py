"""fastamp inside the training frameworks, through each one's own extension points.

One small module per client, imported only when you import it (``import fastamp`` never imports a
client library):

========================================  ===================================================
``fastamp.integrations.lightning``        ``FastampPrecision`` (precision plugin: fastamp's
                                          scaler, ``gradient_clip_val`` folded into the fused
                                          step) and ``FastampDDPStrategy``
``fastamp.integrations.accelerate``       ``Accelerator`` (drop-in subclass) and
                                          ``install_grad_scaler(accelerator)``
``fastamp.integrations.timm``             ``NativeScaler`` (timm's loss-scaler interface),
                                          ``register_optimizers()`` / ``create_optimizer_v2``
``fastamp.integrations.transformers``     ``FastampTrainer`` (drop-in ``Trainer`` subclass)
========================================  ===================================================

Each module raises an ImportError naming the missing package and the versions it supports.
"""

from __future__ import annotations

__all__ = ["SUPPORTED"]

#: client package -> (import name, supported version range, tested version)
SUPPORTED: dict[str, tuple[str, str, str]] = {
    "lightning": ("lightning", ">=2.5,<2.7", "2.6.6"),
    "accelerate": ("accelerate", ">=1.0,<2", "1.15.0"),
    "transformers": ("transformers", ">=5.0,<6", "5.23.0"),
    "timm": ("timm", ">=1.0.15,<1.1", "1.0.29"),
}
