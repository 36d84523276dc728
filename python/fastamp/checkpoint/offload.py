"""Offloading saved activations to host memory instead of recomputing them.

``offload_activations()`` is a ``saved_tensors_hooks`` context: each activation autograd saves
(above ``min_bytes``) is copied to host memory on a side stream -- overlapped with the forward's
compute -- into pinned buffers that are reused across steps (a :class:`PinnedPool`), and copied back on the backward's
stream when autograd needs it. On CPU tensors there is nothing to offload and they are kept.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["offload_activations", "offload", "PinnedPool"]


class PinnedPool:
    """Host buffers reused across steps, by size in bytes (pinned when CUDA is available).

    A buffer comes back with the event of the last copy that reads it and is handed out again only
    once that event has completed, so reuse never waits on the host.
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[int, list[tuple[Tensor, Any]]] = defaultdict(list)
        self.allocated_bytes = 0
        self.reuses = 0

    def take(self, nbytes: int) -> Tensor:
        free = self._free[nbytes]
        for i, (buf, event) in enumerate(free):
            if event is None or event.query():
                del free[i]
                self.reuses += 1
                return buf
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: Tensor, event: Any = None) -> None:
        self._free[buf.numel()].append((buf, event))


class _Offloaded:
    """A saved activation living in a pool buffer. The buffer goes back to the pool when autograd
    drops this object (its graph is freed), not at unpack: with retain_graph=True a saved tensor is
    unpacked once per backward."""

    __slots__ = ("buf", "dtype", "shape", "device", "event", "pool", "last_read")

    def __init__(
        self,
        buf: Tensor,
        dtype: torch.dtype,
        shape: torch.Size,
        device: torch.device,
        event: Any,
        pool: Any,
    ) -> None:
        self.buf, self.dtype, self.shape, self.device = buf, dtype, shape, device
        self.event, self.pool, self.last_read = event, pool, None

    def __del__(self) -> None:
        self.pool.give(self.buf, self.last_read)


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved CUDA activations of at least ``min_bytes`` live in host memory
    between the forward and the backward.

    Args:
        min_bytes: smaller tensors stay on the device (the copy would cost more than it saves).
        pool: a :class:`PinnedPool` to share buffers between several regions (default: one per
            context object, reused by every forward run under it).
        device_types: which devices' activations to offload. ``("cpu",)`` copies CPU activations
            into the pool too (pointless for memory, useful to test the path without a GPU).
    """

    def __init__(
        self,
        min_bytes: int = 1 << 16,
        pool: PinnedPool | None = None,
        device_types: tuple[str, ...] = ("cuda",),
    ):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(
                f"offload_activations: min_bytes must be an int >= 0, got {min_bytes!r}"
            )
        if pool is not None and not isinstance(pool, PinnedPool):
            raise TypeError(
                f"offload_activations: pool must be a fastamp.checkpoint.PinnedPool, got "
                f"{type(pool).__name__}"
            )
        if not isinstance(device_types, (tuple, list)) or not all(
            isinstance(d, str) for d in device_types
        ):
            # A bare string would be iterated letter by letter and match no device: nothing offloaded.
            raise TypeError(
                f"offload_activations: device_types must be a tuple of device type names, got "
                f"{device_types!r}; expected e.g. device_types=('cuda',)"
            )
        self.min_bytes = min_bytes
        self.pool = pool or PinnedPool()
        self.device_types = tuple(device_types)
        self._stream: torch.cuda.Stream | None = None
        super().__init__(self._pack, self._unpack)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _pack(self, t: Tensor) -> Any:
        if (
            t.device.type not in self.device_types
            or t.nbytes < self.min_bytes
            or t.layout != torch.strided
        ):
            return t
        src = t.detach()
        if src.is_conj() or src.is_neg():  # lazy conjugate/negative views: their values, as
            src = src.resolve_conj().resolve_neg()  # torch's save_on_cpu copies them
        if not src.is_contiguous():
            src = src.contiguous()
        buf = self.pool.take(src.nbytes)
        if t.device.type != "cuda":
            buf.copy_(src.view(-1).view(torch.uint8))
            return _Offloaded(buf, t.dtype, t.shape, t.device, None, self.pool)
        stream = self._side_stream(t.device)
        # The copy waits for the producer on the compute stream, then runs beside later compute.
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            buf.copy_(src.view(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # keep the device memory alive until the copy is done
        return _Offloaded(buf, t.dtype, t.shape, t.device, event, self.pool)

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        if packed.event is None:  # host tensor
            out.view(-1).view(torch.uint8).copy_(packed.buf)
            return out
        torch.cuda.current_stream(packed.device).wait_event(packed.event)
        out.view(-1).view(torch.uint8).copy_(packed.buf, non_blocking=True)
        # The buffer may be refilled only after this copy has read it: the pool checks the event.
        packed.last_read = torch.cuda.Event()
        packed.last_read.record(torch.cuda.current_stream(packed.device))
        return out


def offload(
    function: Callable[..., Any],
    *args: Any,
    offload_ctx: offload_activations | None = None,
    **kwargs: Any,
) -> Any:
    """Runs ``function(*args, **kwargs)`` with its saved activations offloaded to host memory:
    the alternative to :func:`fastamp.checkpoint.checkpoint` that trades PCIe traffic, not compute,
    for memory."""
    with offload_ctx or offload_activations():
        return function(*args, **kwargs)
