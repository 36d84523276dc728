"""Timing helpers shared by the benchmarks: CUDA events on GPU, perf_counter on CPU, and the copy
bandwidth that the memory-traffic floors are computed against."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    """Seconds one call of fn takes on the device (fn's work is complete when this returns)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(device: str, nbytes: int = 512 * 2**20, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of reps."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = [timed(lambda: dst.copy_(src), device) for _ in range(reps)]
    return 2 * nbytes / statistics.median(times)


def balanced_order(names: Sequence[T], rep: int) -> list[T]:
    """The order to run ``names`` in at repetition ``rep``: rows of a Williams Latin square, so that
    over ``len(names)`` consecutive repetitions (``2 * len(names)`` when it is odd) every variant
    runs in every position once and directly after every other variant once.

    A plain rotation keeps the cyclic order, so each variant always runs right after the same
    other one and inherits its leftovers (the allocator's freed and trimmed heap, cold caches):
    in bench_ddp, fastamp's DDP always followed torch's foreach AdamW, whose temporaries glibc
    returns to the kernel, and paid the page faults of re-mapping them."""
    n = len(names)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = rep % (2 * n if n % 2 else n)
    order = [(k + row) % n for k in first]
    if row >= n:  # odd n needs the mirrored square as well
        order.reverse()
    return [names[k] for k in order]


def per_step_us(
    fns: Mapping[str, Callable[[], object]],
    runs: int,
    steps: int,
    warmup: int,
    per: int,
    device: str = "cpu",
) -> dict[str, list[float]]:
    """Host-side microseconds per step and per ``per`` (tensors) of each variant's step ``fns``:
    ``warmup`` calls each, then ``runs`` timed blocks of ``steps`` calls, in
    :func:`balanced_order` (the device synchronised around each block)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_tensor: dict[str, list[float]] = {v: [] for v in fns}
    for rep in range(runs):
        for v in balanced_order(list(fns), rep):
            gc.collect()
            fn = fns[v]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync(device)
            per_tensor[v].append((time.perf_counter() - t0) / steps / per * 1e6)
    return per_tensor


def int_options(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """Adds to ``ap`` an int option per keyword (``batch_size=32``: ``--batch-size``, default 32)."""
    for name, default in defaults.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def switch_option(ap: argparse.ArgumentParser, flag: str, default: int, help: str) -> None:
    """Adds to ``ap`` an on/off option ``flag`` taking 0 or 1."""
    ap.add_argument(flag, type=int, choices=[0, 1], default=default, help=help)


def print_header(header: str) -> None:
    """Prints a table's header line and a rule of its width under it."""
    print(header)
    print("-" * len(header))


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def write_results(path: str | None, device: str, **fields: object) -> None:
    """Writes a benchmark's results as JSON to ``path`` (nothing when it is None or empty): the
    device, its name and the torch version, then ``fields`` in the order given."""
    if not path:
        return
    record = {"device": device, "device_name": device_name(device), "torch": torch.__version__}
    with open(path, "w") as fh:
        json.dump({**record, **fields}, fh, indent=2)
