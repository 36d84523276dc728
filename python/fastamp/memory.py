"""Memory reports: ``summary()`` for every device (a :class:`DeviceMemory` each) and ``track()`` for
the peak of a block (a :class:`Peak`).

On CUDA the numbers come from PyTorch's caching allocator (allocated, reserved, peak,
fragmentation = the share of reserved memory not allocated). On CPU there is no allocator to ask:
the report uses the process's resident set size (RSS), and ``track()`` samples it every
millisecond on a background thread, so its CPU peak is an estimate at that resolution.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastamp._sharding import local

__all__ = ["DeviceMemory", "Peak", "optimizer_state_bytes", "summary", "track"]

_MB = 2.0**20


@dataclass
class DeviceMemory:
    device: str
    allocated: int
    reserved: int | None
    peak: int
    total: int | None

    @property
    def fragmentation(self) -> float | None:
        """Share of reserved memory that is not allocated (CUDA only)."""
        if not self.reserved:
            return None
        return 1.0 - self.allocated / self.reserved

    def __str__(self) -> str:
        parts = [f"{self.device}: allocated {self.allocated / _MB:.1f} MiB"]
        if self.reserved is not None:
            parts.append(f"reserved {self.reserved / _MB:.1f} MiB")
        parts.append(f"peak {self.peak / _MB:.1f} MiB")
        if self.fragmentation is not None:
            parts.append(f"fragmentation {self.fragmentation:.0%}")
        if self.total:
            parts.append(f"of {self.total / _MB / 1024:.1f} GiB")
        if self.device == "cpu":
            parts[0] = f"cpu: resident {self.allocated / _MB:.1f} MiB (process RSS)"
        return ", ".join(parts)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best available figure
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu() -> DeviceMemory:
    rss = _rss()
    # ru_maxrss (kilobytes on Linux) is updated lazily by the kernel and can trail the current RSS.
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss)
    total = (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    )
    return DeviceMemory("cpu", rss, None, peak, total)


def summary(print_: bool = True) -> list[DeviceMemory]:
    """Memory of the CPU process and of every initialised CUDA device; printed unless print_=False."""
    out = [_cpu()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out.append(
                DeviceMemory(
                    f"cuda:{i}",
                    torch.cuda.memory_allocated(i),
                    torch.cuda.memory_reserved(i),
                    torch.cuda.max_memory_allocated(i),
                    torch.cuda.get_device_properties(i).total_memory,
                )
            )
    if print_:
        for d in out:
            print(d)
    return out


@dataclass
class Peak:
    device: str
    start: int = 0
    peak: int = 0
    end: int = 0

    @property
    def peak_delta(self) -> int:
        """How far above its starting point memory went inside the block."""
        return self.peak - self.start

    def __str__(self) -> str:
        what = "RSS (sampled every 1 ms)" if self.device == "cpu" else "allocated"
        return (
            f"{self.device}: peak {self.peak / _MB:.1f} MiB {what}, +{self.peak_delta / _MB:.1f} MiB "
            f"over the block's start, {self.end / _MB:.1f} MiB at its end"
        )


@contextlib.contextmanager
def track(device: str | torch.device | None = None, print_: bool = False) -> Iterator[Peak]:
    """``with fastamp.memory.track() as m: ...`` then ``m.peak`` / ``m.peak_delta`` (bytes)."""
    dev = (
        torch.device(device)
        if device is not None
        else (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else torch.device("cpu")
        )
    )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"fastamp.memory.track: device={str(dev)!r} has no memory to track; expected 'cpu' or a "
            "CUDA device (or None for the current one)"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"fastamp.memory.track: device={str(dev)!r} but CUDA is not available in this process; "
            "expected device='cpu' (or None for the current device)"
        )
    result = Peak(str(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        result.start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            yield result
        finally:
            torch.cuda.synchronize(dev)
            result.peak = torch.cuda.max_memory_allocated(dev)
            result.end = torch.cuda.memory_allocated(dev)
    else:
        result.start = result.peak = _rss()
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                result.peak = max(result.peak, _rss())
                time.sleep(0.001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield result
        finally:
            stop.set()
            thread.join()
            result.end = _rss()
            result.peak = max(result.peak, result.end)
    if print_:
        print(result)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes the optimizer's state takes, measured from the storages of its tensors (each storage
    counted once): ``state_bytes`` (moments, their block scales, step counters), ``master_bytes``
    (fp32 master copies of half params, kept apart: they are weights), ``params`` (elements of the
    parameters that have state) and ``state_bytes_per_param``.

    float32 Adam moments: 8 bytes per parameter; ``state_dtype=torch.bfloat16``: 4;
    ``state_dtype="int8"``: 2 + 8/256 (plus the float32 state of tensors below 4096 elements).
    A sharded model's (FSDP2, DTensor) state is counted as this rank holds it: its shards, per
    element of its parameters' shards.
    """
    seen: set[tuple[int, int]] = set()
    state_bytes = master_bytes = params = 0
    for p, st in optimizer.state.items():
        if not isinstance(st, dict) or not st:
            continue
        params += local(p).numel() if isinstance(p, torch.Tensor) else 0
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            storage = local(v).untyped_storage()
            ident = (storage.data_ptr(), storage.nbytes())
            if ident in seen:
                continue
            seen.add(ident)
            if key == "master_param":
                master_bytes += storage.nbytes()
            else:
                state_bytes += storage.nbytes()
    return {
        "state_bytes": state_bytes,
        "master_bytes": master_bytes,
        "params": params,
        "state_bytes_per_param": state_bytes / params if params else 0.0,
    }
