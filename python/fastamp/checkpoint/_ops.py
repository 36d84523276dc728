"""Typed wrappers and fake kernels of the checkpoint ops (RNG snapshot/restore, tensor digests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import fastamp._library  # noqa: F401  (loads the operator library)
from fastamp._checks import dense_list

__all__ = ["rng_get_state", "rng_set_state", "tensor_digest"]


# The OpOverloads themselves, for the checkpoint's per-region RNG snapshot (a call through the
# packet resolves the overload every time).
rng_get_state_overload = torch.ops.fastamp.rng_get_state.default
rng_set_state_overload = torch.ops.fastamp.rng_set_state.default


def rng_get_state() -> list[Tensor]:
    """``[cpu_state, cuda:0_state, ...]``: the default CPU generator and every *initialised* CUDA
    device's generator in one call (an uninitialised device gets an empty tensor).

    ``torch.utils.checkpoint`` stashes only the devices of the checkpointed function's tensor
    arguments, so a block that draws random numbers on another GPU replays them wrong; this covers
    every device the process has touched.
    """
    return list(torch.ops.fastamp.rng_get_state())


def rng_set_state(states: Sequence[Tensor]) -> None:
    """Restores a snapshot from :func:`rng_get_state` (all entries validated first)."""
    torch.ops.fastamp.rng_set_state(list(states))


def tensor_digest(tensors: Sequence[Tensor]) -> Tensor:
    """int64 digest of each tensor's bytes (in logical element order), computed on its device."""
    tensors = dense_list(tensors, "tensor_digest", "tensors")
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    return torch.ops.fastamp.tensor_digest(tensors)


@torch.library.register_fake("fastamp::rng_get_state")
def _rng_get_state_fake():
    sizes = [torch.get_rng_state().numel()]
    if torch.cuda.is_available():
        sizes += [16 if torch.cuda.is_initialized() else 0] * torch.cuda.device_count()
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


@torch.library.register_fake("fastamp::rng_set_state")
def _rng_set_state_fake(states):
    # Generator states are CPU tensors; a meta one reaches this fake kernel, which must not make
    # the restore a silent no-op.
    for i, s in enumerate(states):
        if s.device.type != "cpu":
            raise TypeError(
                f"fastamp::rng_set_state: states[{i}] must be a CPU uint8 tensor (a generator "
                f"state), got one on {s.device}"
            )
    return None


@torch.library.register_fake("fastamp::tensor_digest")
def _tensor_digest_fake(tensors):
    # A meta tensor among CPU ones dispatches here: raise as the real kernel does, rather than
    # return an uninitialised "digest" on the CPU.
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    for i, t in enumerate(tensors):
        if t.device != tensors[0].device:
            raise RuntimeError(
                f"fastamp::tensor_digest: tensors[{i}] is on {t.device} but tensors[0] is on "
                f"{tensors[0].device}; digest one device at a time"
            )
    return tensors[0].new_empty((len(tensors),), dtype=torch.int64)
