"""Argument checks that must run in Python, before the dispatcher sees the tensors."""

from __future__ import annotations

import numbers
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


def is_real(value: object) -> bool:
    """A Python int or float (bools excluded), or a NumPy-style real scalar."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real(value: object, where: str, arg: str, expected: str) -> float:
    """``float(value)`` when ``value`` is a real number, else a TypeError naming ``arg``.

    ``expected`` says what would be accepted (e.g. "a finite number > 0"); it ends the message.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # is_real, narrowed
        raise TypeError(
            f"{where}: {arg} must be {expected}, got {value!r} (a {type(value).__name__})"
        )
    return float(value)


def integer(value: object, where: str, arg: str, expected: str) -> int:
    """``int(value)`` when ``value`` is an integer (bools excluded), else a TypeError naming ``arg``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(
            f"{where}: {arg} must be {expected}, got {value!r} (a {type(value).__name__})"
        )
    return int(value)
