"""CUDA-specific aliases kept for scripts written against ``torch.cuda.amp``."""

from fastamp.cuda import amp

__all__ = ["amp"]
