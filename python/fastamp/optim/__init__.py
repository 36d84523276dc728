"""Fused optimizers: drop-in ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` whose step unscales, clips
and skips on overflow inside one kernel, with no host sync."""

from fastamp.optim import _ops as ops
from fastamp.optim.optimizers import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW", "ops"]
