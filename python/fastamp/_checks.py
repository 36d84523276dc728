"""Argument checks that must run in Python, before the dispatcher sees the tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def dense_list(tensors: Sequence[Tensor], op: str, arg: str) -> list[Tensor]:
    """``list(tensors)``, refusing sparse tensors with an actionable message: the dispatcher would
    route them to a Sparse* backend with no kernel and say only "could not run ... SparseCPU"."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, Tensor) and t.layout != torch.strided:
            raise RuntimeError(
                f"fastamp::{op}: {arg}[{i}] has layout {t.layout}; expected a dense (strided) "
                "tensor. For sparse grads pass grad.coalesce()._values()"
            )
    return tensors
