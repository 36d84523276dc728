"""Activation accounting: the bytes autograd keeps for the backward, counted through saved-tensor
hooks (:func:`count_saved_bytes`, into a :class:`SavedBytes` tally), plus what checkpointed regions keep (their inputs,
:func:`note_checkpoint_inputs`) and selective checkpointing's caches (:func:`note_cache`).

The bottom layer of ``fastamp.checkpoint``: ``core`` and ``policies`` report to it, the planner
reads it; it imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from fastamp._sharding import local

__all__ = ["SavedBytes", "count_saved_bytes", "counting", "note_cache", "note_checkpoint_inputs"]

_active_counters: list[SavedBytes] = []


class SavedBytes:
    """Bytes of distinct storages autograd saved (parameters excluded), optionally per block."""

    def __init__(self, exclude: Sequence[Tensor] = ()):
        # A sharded (DTensor) parameter's own storage is its shard; the unsharded copy FSDP2
        # gathers for the forward is an nn.Parameter when saved, excluded in add().
        self._excluded = {local(p).untyped_storage().data_ptr() for p in exclude}
        self._seen: set[int] = set()
        self._saved = 0
        self._caches: list[Any] = []
        self.by_block: dict[str, int] = {}
        self.block: str | None = None

    @property
    def total(self) -> int:
        """Bytes saved so far, including selective checkpointing's caches as they are now."""
        extra = 0
        seen = set(self._seen)
        for cache in self._caches:
            for leaf in tree_leaves(cache):
                t = getattr(leaf, "val", leaf)  # PyTorch wraps cached outputs in _VersionWrapper
                if isinstance(t, Tensor) and t.layout == torch.strided:
                    st = t.untyped_storage()
                    if st.data_ptr() not in seen and st.data_ptr() not in self._excluded:
                        seen.add(st.data_ptr())
                        extra += st.nbytes()
        return self._saved + extra

    def add_cache(self, cache: Any) -> None:
        """Counts the tensors of a selective-checkpointing cache (as they are when read)."""
        self._caches.append(cache)

    def add(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return
        if isinstance(
            t, nn.Parameter
        ):  # a weight (FSDP2's gathered copy included), not an activation
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._excluded or ptr in self._seen or ptr == 0:
            return
        self._seen.add(ptr)
        self._saved += storage.nbytes()
        if self.block is not None:
            self.by_block[self.block] = self.by_block.get(self.block, 0) + storage.nbytes()


def counting() -> bool:
    """Whether a :func:`count_saved_bytes` block is active (the hooks below then have work)."""
    return bool(_active_counters)


def note_cache(cache: Any) -> None:
    """Called by selective checkpointing: the tensors it caches stay alive until backward."""
    for counter in _active_counters:
        counter.add_cache(cache)


def note_checkpoint_inputs(args: Any) -> None:
    """Called by checkpoint wrappers: the region's inputs stay alive until its backward."""
    for counter in _active_counters:
        for t in tree_leaves(args):
            if isinstance(t, Tensor):
                counter.add(t)


@contextlib.contextmanager
def count_saved_bytes(model: nn.Module | None = None) -> Iterator[SavedBytes]:
    """Counts the activation bytes saved for backward by the code run inside."""
    counter = SavedBytes(list(model.parameters()) if model is not None else ())

    def pack(t: Tensor) -> Tensor:
        counter.add(t)
        return t

    _active_counters.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counter
    finally:
        _active_counters.remove(counter)
