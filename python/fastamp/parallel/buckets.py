"""Gradient buckets: :class:`GradBucket` (what a comm hook receives, torch's interface), the bucket
itself, and :class:`BucketLayout`, the part of DistributedDataParallel that decides which grads go
in which bucket (torch's size caps and its one-time rebuild in the order grads became ready) and
saves/restores that layout for :func:`fastamp.save_training_state`."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp.parallel._args import _NAME

__all__ = ["BucketLayout", "GradBucket"]



class GradBucket:
    """The bucket a comm hook gets: the interface of :class:`torch.distributed.GradBucket`
    (``index``, ``buffer``, ``gradients``, ``parameters``, ``is_last``, ``set_buffer``).

    ``buffer()`` holds the local grads of the bucket's parameters, flattened, *not* divided by the
    world size (as in torch: the hook averages)."""

    def __init__(self, index: int, buffer: Tensor, params: list[Tensor], offsets: list[int], last: bool):
        self._index, self._buffer, self._params, self._offsets, self._last = index, buffer, params, offsets, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[Tensor]:
        return [self._buffer.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(self._params, self._offsets)]

    def parameters(self) -> list[Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


class Bucket:
    __slots__ = ("params", "offsets", "buffer", "pending", "work", "launched", "index", "numel")

    def __init__(self, params: list[nn.Parameter], index: int):
        self.params = params
        self.index = index
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.buffer = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.pending = len(params)
        self.work = None
        self.launched = False

    def view_of(self, i: int) -> Tensor:
        p = self.params[i]
        return self.buffer.narrow(0, self.offsets[i], p.numel()).view(p.shape)


class BucketLayout:
    """Mixin of :class:`fastamp.parallel.DistributedDataParallel`: the bucket layout."""

    process_group: Any
    world_size: int
    gradient_as_bucket_view: bool
    _params: list[nn.Parameter]
    _index: dict[int, int]
    _buckets: list[Bucket]
    _bucket_of: dict[int, tuple[Bucket, int]]
    _bucket_caps: list[int]
    _ready_order: list[nn.Parameter]
    _rebuilt: bool
    _pending: bool
    find_unused_parameters: bool
    static_graph: bool
    _default_bucket_cap: bool
    _custom_bucket_caps: bool
    device_mesh: Any

    def _global_src(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not dist.group.WORLD else 0

    def _limits(self, rebuild: bool) -> list[int]:
        """torch's bucket size limits in bytes (its DDP's BucketCapacityConfig and the C++
        reducer's rebuild default): bucket_cap_mb_list as given; else for the first iteration one
        bucket per dtype and device (the rebuild sizes them) unless unused parameters are searched
        for without a static graph; else a 1 MiB first bucket with the default cap, then the cap."""
        if self._custom_bucket_caps:
            return list(self._bucket_caps)
        if not rebuild and (self.static_graph or not self.find_unused_parameters):
            return [sys.maxsize]
        cap = self._bucket_caps[0]
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if self._default_bucket_cap else cap
        return [first, cap] if first < cap else [cap]

    def _assign(self, order: list[int] | None) -> None:
        """Builds the buckets with torch's own assignment (``_compute_bucket_assignment_by_size``:
        per dtype and device, a bucket closes once it reaches its limit): over the parameters in
        their order, buckets reversed, for the first iteration (``order`` None); over ``order``,
        buckets in that order, for the rebuild.

        The layout is not only speed: gloo and NCCL sum an element's contributions in an order
        that depends on its position in the bucket, so with 3 or more ranks another layout gives
        grads that differ from torch's in the last bits (and batch norm over a few samples can
        amplify them); with torch's layout they are torch's bit for bit."""
        n = len(self._params)
        if n == 0:
            self._build_buckets([], [])
            return
        limits = self._limits(rebuild=order is not None)
        if order is None:
            indices, _ = dist._compute_bucket_assignment_by_size(self._params, limits, [False] * n)
            indices = list(reversed(indices))
        else:
            indices, _ = dist._compute_bucket_assignment_by_size(
                [self._params[i] for i in order], limits, [False] * n, list(order))
        self._build_buckets([self._params[i] for b in indices for i in b], [len(b) for b in indices])

    def _build_buckets(self, order: list[nn.Parameter], sizes: list[int]) -> None:
        """Contiguous buckets of exactly ``sizes`` parameters each, in ``order``; grads that are
        bucket views move into the new buffers."""
        old = self._buckets
        self._buckets, self._bucket_of = [], {}
        start = 0
        for n in sizes:
            self._add_bucket(order[start:start + n])
            start += n
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for b in self._buckets:
                    for i, p in enumerate(b.params):
                        if p.grad is not None:
                            view = b.view_of(i)
                            view.copy_(p.grad)
                            p.grad = view
        del old

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        b = Bucket(params, len(self._buckets))
        self._buckets.append(b)
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = (b, i)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order (for tests and tuning)."""
        return [len(b.params) for b in self._buckets]

    def _rebuild_from_rank0(self) -> None:
        """Rebuilds the buckets in the order grads became ready in the first iteration -- rank 0's
        order, broadcast, so that every rank builds the same buckets."""
        seen = {id(p) for p in self._ready_order}
        order = [self._index[id(p)] for p in self._ready_order]
        order += [i for i in reversed(range(len(self._params))) if id(self._params[i]) not in seen]
        if self.world_size > 1:
            box = [order]
            dist.broadcast_object_list(box, src=self._global_src(), group=self.process_group)
            order = box[0]
        self._ready_order = []
        self._assign(order)

    def bucket_layout(self) -> dict[str, Any]:
        """The bucket layout as plain data: which parameter (by index in ``module.parameters()``
        that require grad) goes in which bucket, and whether the one-time rebuild has happened.

        :func:`fastamp.save_training_state` stores it so that a resumed run sums the same grads
        in the same buckets as the run it continues (the clip norm is a sum of per-bucket partial
        sums: another layout rounds differently)."""
        return {
            "order": [self._index[id(p)] for b in self._buckets for p in b.params],
            "bucket_sizes": self.bucket_sizes,
            "rebuilt": bool(self._rebuilt),
            "num_params": len(self._params),
        }

    def load_bucket_layout(self, layout: dict[str, Any]) -> None:
        """Restores a layout from :meth:`bucket_layout` (validated before anything changes)."""
        n = len(self._params)
        if not isinstance(layout, dict) or not {"order", "bucket_sizes", "rebuilt"} <= layout.keys():
            raise ValueError(
                "DistributedDataParallel.load_bucket_layout: layout must be the dict returned by "
                f"bucket_layout() (keys order, bucket_sizes, rebuilt); got {layout!r:.200}"
            )
        order, sizes = list(layout["order"]), list(layout["bucket_sizes"])
        if sorted(order) != list(range(n)) or sum(sizes) != n or any(s <= 0 for s in sizes):
            raise ValueError(
                "DistributedDataParallel.load_bucket_layout: the layout does not fit this model "
                f"({n} parameters that require grad; the layout orders {len(order)} in buckets of "
                f"{sizes}). Load a layout saved from the same model."
            )
        if self._pending:
            raise RuntimeError("DistributedDataParallel.load_bucket_layout: cannot change buckets during backward")
        params = [self._params[i] for i in order]
        start = 0
        for s in sizes:
            group = params[start:start + s]
            if any(p.dtype != group[0].dtype or p.device != group[0].device for p in group):
                raise ValueError(
                    "DistributedDataParallel.load_bucket_layout: a bucket would mix dtypes or "
                    "devices; the layout was saved from a different model"
                )
            start += s
        self._build_buckets(params, sizes)
        self._rebuilt = bool(layout["rebuilt"]) or self.find_unused_parameters
        self._ready_order = []
