"""Typed wrappers and fake kernels of the checkpoint ops (RNG snapshot/restore, tensor digests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fastamp._checks import dense_list
from fastamp._library import StableOps, register_fake  # (importing it loads the operator library)

__all__ = ["rng_get_state", "rng_set_state", "tensor_digest"]

_raw = StableOps("fastamp")  # the raw ops; this module is their typed layer

# The RNG ops are defined here, in Python: generators are not part of the LibTorch stable ABI the
# compiled library is limited to. They stay operators (with fake kernels below) so that a
# checkpointed region traced by torch.compile keeps them as calls.
_lib = torch.library.Library("fastamp", "FRAGMENT")
_lib.define("rng_get_state() -> Tensor[]")
_lib.define("rng_set_state(Tensor[] states) -> ()")


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rng_get_state_impl() -> list[Tensor]:
    out = [torch.default_generator.get_state()]
    n = _cuda_device_count()
    if not torch.cuda.is_initialized():
        # No CUDA generator exists before CUDA is initialised (and asking for one would
        # initialise it): an empty tensor per device says "nothing to restore".
        return out + [torch.empty(0, dtype=torch.uint8) for _ in range(n)]
    # Every device's generator, whether or not the device has a context yet: reading a CUDA
    # generator's state (a seed and an offset) creates none, and a device first used after the
    # snapshot must be put back to it too. (Keying this on a primary context instead left a
    # device that had none at the snapshot un-restored: seen on an H200, where
    # torch.cuda.init() creates no context.)
    return out + [torch.cuda.default_generators[i].get_state() for i in range(n)]


def _generator(i: int) -> torch.Generator:
    return torch.default_generator if i == 0 else torch.cuda.default_generators[i - 1]


def _rng_set_state_impl(states: list[Tensor]) -> None:
    op = "fastamp::rng_set_state"
    if not states:
        raise ValueError(
            f"{op}: states is empty; expected the list returned by fastamp::rng_get_state (CPU "
            "state first, then one entry per CUDA device)"
        )
    n = _cuda_device_count()
    if len(states) > n + 1:
        raise ValueError(
            f"{op}: states has {len(states)} entries but this process sees {n} CUDA device(s); "
            f"expected at most {n + 1}"
        )
    for i, s in enumerate(states):
        if s.dtype != torch.uint8 or s.device.type != "cpu" or s.layout != torch.strided:
            raise TypeError(f"{op}: states[{i}] must be a CPU uint8 tensor (a generator state)")
    previous = _rng_get_state_impl() if len(states) > 1 else []
    for i, s in enumerate(states):
        if i > 0 and s.numel() == 0:
            continue
        # torch's set_state reads a view's storage from its start: hand it a tensor of its own.
        if not s.is_contiguous() or s.storage_offset() != 0:
            s = s.clone(memory_format=torch.contiguous_format)
        try:
            _generator(i).set_state(s)
        except RuntimeError as exc:
            for j in range(i):  # all or nothing: put back the generators already restored
                if j == 0 or previous[j].numel() > 0:
                    _generator(j).set_state(previous[j])
            raise ValueError(
                f"{op}: states[{i}] is not a valid {'CPU' if i == 0 else 'CUDA'} generator state "
                f"({exc}); no generator was changed"
            ) from None


_lib.impl("rng_get_state", _rng_get_state_impl, "CompositeExplicitAutograd")
_lib.impl("rng_set_state", _rng_set_state_impl, "CompositeExplicitAutograd")

# The OpOverloads themselves, for the checkpoint's per-region RNG snapshot (a call through the
# packet resolves the overload every time).
# (typed: an OpOverload's call returns Any; these schemas return Tensor[] and ())
rng_get_state_overload: Callable[[], list[Tensor]] = torch.ops.fastamp.rng_get_state.default
rng_set_state_overload: Callable[[list[Tensor]], None] = torch.ops.fastamp.rng_set_state.default


def rng_get_state() -> list[Tensor]:
    """``[cpu_state, cuda:0_state, ...]``: the default CPU generator and, once CUDA is initialised,
    every CUDA device's generator in one call (before that, an empty tensor per device).

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
    digests: Tensor = _raw.tensor_digest(tensors)
    return digests


@register_fake("fastamp::rng_get_state")
def _rng_get_state_fake() -> list[Tensor]:
    sizes = [torch.get_rng_state().numel()]
    if torch.cuda.is_available():
        sizes += [16 if torch.cuda.is_initialized() else 0] * torch.cuda.device_count()
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


@register_fake("fastamp::rng_set_state")
def _rng_set_state_fake(states: Sequence[Tensor]) -> None:
    # Generator states are CPU tensors; a meta one reaches this fake kernel, which must not make
    # the restore a silent no-op.
    for i, s in enumerate(states):
        if s.device.type != "cpu":
            raise TypeError(
                f"fastamp::rng_set_state: states[{i}] must be a CPU uint8 tensor (a generator "
                f"state), got one on {s.device}"
            )
    return None


@register_fake("fastamp::tensor_digest")
def _tensor_digest_fake(tensors: Sequence[Tensor]) -> Tensor:
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
