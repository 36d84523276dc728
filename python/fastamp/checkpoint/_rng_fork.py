"""The RNG fork of checkpoint recomputes (:class:`RngFork`): the first call snapshots the CPU
generator and every initialised CUDA generator; a recompute runs with that snapshot and puts the
generators back afterwards (fork semantics), outside any active dispatch mode."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from fastamp.checkpoint._ops import rng_get_state_overload, rng_set_state_overload

_dispatch_modes = torch._C._len_torch_dispatch_stack


_cpu_generator = torch.default_generator
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized  # typed: torch's is not


def _rng_get_state() -> list[Tensor]:
    # Until CUDA is initialised the snapshot is the CPU generator's alone: read it directly (the
    # op costs a dispatcher round trip, several microseconds inside a checkpointed region).
    if not _cuda_initialized():
        return [_cpu_generator.get_state()]
    return rng_get_state_overload()


def _rng_set_state(states: list[Tensor]) -> None:
    if len(states) == 1:
        _cpu_generator.set_state(states[0])  # a fresh get_state() tensor: plain bytes
    else:
        rng_set_state_overload(states)


class RngFork:
    """Runs ``fn``; on every later call (a recompute) replays the RNG state of the first call for
    all generators, then puts the generators back where they were (fork semantics)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.state: list[Tensor] | None = None

    @staticmethod
    def _get() -> list[Tensor]:
        # Outside any dispatch mode: the block's context_fn modes (selective checkpointing's cache,
        # the bitwise check) must see the block's ops only, not this bookkeeping. (Entering the
        # context costs more than the snapshot: skipped when no mode is active.)
        if _dispatch_modes() == 0:
            return _rng_get_state()
        with _disable_current_modes():
            return _rng_get_state()

    @staticmethod
    def _set(states: list[Tensor]) -> None:
        if _dispatch_modes() == 0:
            _rng_set_state(states)
            return
        with _disable_current_modes():
            _rng_set_state(states)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.state is None:
            self.state = before = self._get()
            out = self.fn(*args, **kwargs)
            if len(before) == 1 and not _cuda_initialized():
                return out  # no CUDA generator before or after: nothing can have appeared
            after = self._get()
            newly = [
                i - 1
                for i in range(1, len(after))
                if after[i].numel() and not (i < len(before) and before[i].numel())
            ]
            if newly:
                self.warn_newly_used(newly)
            return out
        current = self._get()
        self._set(self.state)
        try:
            return self.fn(*args, **kwargs)
        finally:
            self._set(current)

    @staticmethod
    def warn_newly_used(newly: Any) -> None:
        # A warning, not an error: the block has run (BatchNorm statistics, RNG moved), and
        # PyTorch does not replay such devices either.
        warnings.warn(
            f"fastamp.checkpoint: CUDA device(s) {newly} were first used inside the "
            "checkpointed function, so their RNG state before it is unknown: the "
            "recompute does not replay their random numbers (as with PyTorch, which "
            "replays only the devices of the arguments). Initialise them before the "
            "checkpoint (e.g. torch.cuda.init() or a first tensor on each device) for an "
            "exact replay.",
            RuntimeWarning,
            stacklevel=3,
        )
