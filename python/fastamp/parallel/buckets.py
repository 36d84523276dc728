"""Gradient buckets: :class:`GradBucket` (what a comm hook receives, torch's interface), the
:class:`Bucket` itself, and :class:`BucketLayout`, the object that decides which grads go in which
bucket (torch's size caps and its one-time rebuild in the order grads became ready) and saves and
restores that layout for :func:`fastamp.save_training_state`."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Bucket", "BucketLayout", "GradBucket"]

_WHERE = "DistributedDataParallel.load_bucket_layout"


class GradBucket:
    """The bucket a comm hook gets: the interface of :class:`torch.distributed.GradBucket`
    (``index``, ``buffer``, ``gradients``, ``parameters``, ``is_last``, ``set_buffer``).

    ``buffer()`` holds the local grads of the bucket's parameters, flattened, *not* divided by the
    world size (as in torch: the hook averages)."""

    def __init__(
        self, index: int, buffer: Tensor, params: list[Tensor], offsets: list[int], last: bool
    ):
        self._index, self._buffer, self._params, self._offsets, self._last = (
            index,
            buffer,
            params,
            offsets,
            last,
        )

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[Tensor]:
        return [
            self._buffer.narrow(0, o, p.numel()).view(p.shape)
            for p, o in zip(self._params, self._offsets)
        ]

    def parameters(self) -> list[Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


class Bucket:
    """One flat buffer holding the grads of ``params`` (one dtype, one device) at ``offsets``;
    ``views[i]`` is parameter i's slice shaped like it (made once: the hooks of a backward use
    them). ``pending`` (grads not yet ready), ``work`` (the collective in flight) and ``launched``
    are the current backward's; :class:`fastamp.parallel._backward.GradSync` sets them."""

    __slots__ = (
        "params",
        "offsets",
        "buffer",
        "views",
        "pending",
        "work",
        "launched",
        "index",
        "numel",
    )

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
        self.views = [
            self.buffer.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(params, self.offsets)
        ]
        self.pending = len(params)
        self.work: Any = None
        self.launched = False

    def comm_bucket(self, buffer: Tensor, last: bool) -> GradBucket:
        """What a comm hook receives for this bucket, holding ``buffer``."""
        return GradBucket(self.index, buffer, self.params, self.offsets, last)


class BucketLayout:
    """The buckets of one DistributedDataParallel: built at construction with torch's assignment,
    rebuilt once after the first backward in the order its grads became ready (rank 0's order),
    saved and restored as plain data.

    ``caps`` are the bucket limits in bytes (``bucket_cap_mb``, or ``bucket_cap_mb_list`` when
    ``custom_caps``); ``default_cap`` says ``bucket_cap_mb`` was not given (torch then makes the
    rebuilt first bucket 1 MiB). ``views``: grads that are bucket views move with the buckets."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        caps: list[int],
        custom_caps: bool,
        default_cap: bool,
        find_unused_parameters: bool,
        static_graph: bool,
        views: bool,
        process_group: Any,
        world_size: int,
    ):
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        self.caps = caps
        self.custom_caps = custom_caps
        self.default_cap = default_cap
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.views = views
        self.process_group = process_group
        self.world_size = world_size
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[Bucket, int]] = {}
        # The order grads became ready in the first synchronised backward (the hooks append).
        self.ready_order: list[nn.Parameter] = []
        # Like torch: no rebuild when the graph may differ between iterations or ranks.
        self.rebuilt = find_unused_parameters
        self._assign(None)

    def _limits(self, rebuild: bool) -> list[int]:
        """torch's bucket size limits in bytes (its DDP's BucketCapacityConfig and the C++
        reducer's rebuild default): bucket_cap_mb_list as given; else for the first iteration one
        bucket per dtype and device (the rebuild sizes them) unless unused parameters are searched
        for without a static graph; else a 1 MiB first bucket with the default cap, then the cap."""
        if self.custom_caps:
            return list(self.caps)
        if not rebuild and (self.static_graph or not self.find_unused_parameters):
            return [sys.maxsize]
        cap = self.caps[0]
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if self.default_cap else cap
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
        n = len(self.params)
        if n == 0:
            self._build([], [])
            return
        limits = self._limits(rebuild=order is not None)
        if order is None:
            indices, _ = dist._compute_bucket_assignment_by_size(self.params, limits, [False] * n)
            indices = list(reversed(indices))
        else:
            indices, _ = dist._compute_bucket_assignment_by_size(
                [self.params[i] for i in order], limits, [False] * n, list(order)
            )
        self._build([self.params[i] for b in indices for i in b], [len(b) for b in indices])

    def _build(self, order: list[nn.Parameter], sizes: list[int]) -> None:
        """Contiguous buckets of exactly ``sizes`` parameters each, in ``order``; grads that are
        bucket views move into the new buffers."""
        self.buckets, self.bucket_of = [], {}
        start = 0
        for n in sizes:
            b = Bucket(order[start : start + n], len(self.buckets))
            self.buckets.append(b)
            for i, p in enumerate(b.params):
                self.bucket_of[id(p)] = (b, i)
            start += n
        if self.views:
            with torch.no_grad():
                for b in self.buckets:
                    for p, view in zip(b.params, b.views):
                        if p.grad is not None:
                            view.copy_(p.grad)
                            p.grad = view

    @property
    def sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self.buckets]

    def rebuild_from_rank0(self) -> None:
        """Rebuilds the buckets in the order grads became ready in the first iteration -- rank 0's
        order, broadcast, so that every rank builds the same buckets."""
        self.rebuilt = True
        seen = {id(p) for p in self.ready_order}
        order = [self.index[id(p)] for p in self.ready_order]
        order += [i for i in reversed(range(len(self.params))) if id(self.params[i]) not in seen]
        if self.world_size > 1:
            box = [order]
            src = (
                dist.get_global_rank(self.process_group, 0)
                if self.process_group is not dist.group.WORLD
                else 0
            )
            dist.broadcast_object_list(box, src=src, group=self.process_group)
            order = box[0]
        self.ready_order = []
        self._assign(order)

    def to_dict(self) -> dict[str, Any]:
        """The layout as plain data: which parameter (by index among the parameters that require
        grad) goes in which bucket, and whether the one-time rebuild has happened."""
        return {
            "order": [self.index[id(p)] for b in self.buckets for p in b.params],
            "bucket_sizes": self.sizes,
            "rebuilt": bool(self.rebuilt),
            "num_params": len(self.params),
        }

    def load_dict(self, layout: Any) -> None:
        """Restores a layout from :meth:`to_dict` (validated before anything changes)."""
        n = len(self.params)
        if (
            not isinstance(layout, dict)
            or not {"order", "bucket_sizes", "rebuilt"} <= layout.keys()
        ):
            raise ValueError(
                f"{_WHERE}: layout must be the dict returned by bucket_layout() (keys order, "
                f"bucket_sizes, rebuilt); got {layout!r:.200}"
            )
        order, sizes = list(layout["order"]), list(layout["bucket_sizes"])
        if sorted(order) != list(range(n)) or sum(sizes) != n or any(s <= 0 for s in sizes):
            raise ValueError(
                f"{_WHERE}: the layout does not fit this model ({n} parameters that require grad; "
                f"the layout orders {len(order)} in buckets of {sizes}). Load a layout saved from "
                "the same model."
            )
        params = [self.params[i] for i in order]
        start = 0
        for s in sizes:
            group = params[start : start + s]
            if any(p.dtype != group[0].dtype or p.device != group[0].device for p in group):
                raise ValueError(
                    f"{_WHERE}: a bucket would mix dtypes or devices; the layout was saved from a "
                    "different model"
                )
            start += s
        self._build(params, sizes)
        self.rebuilt = bool(layout["rebuilt"]) or self.find_unused_parameters
        self.ready_order = []
