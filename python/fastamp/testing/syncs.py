"""Counting host syncs made from Python code, on any device.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the ground truth. On CPU nothing syncs, but
the same Python-level reads (``.item()``, ``.tolist()``, ``bool(t)``...) would sync on a GPU, so
counting the ones made by chosen modules is a portable proxy that CPU CI can check.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def count_host_syncs(
    modules: Sequence[str] = ("fastamp", "torch.amp"),
) -> Iterator[list[str]]:
    """Yields a list that collects ``"<file>:<line> <method>"`` for each tensor read-back made
    directly by code in ``modules`` (matched on the caller's module name)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            mod = frame.f_globals.get("__name__", "")
            if any(mod == m or mod.startswith(m + ".") for m in modules):
                if not (mod.startswith("fastamp.testing")):
                    calls.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {name}")
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
