"""Helpers of the >2^31-element tests (tests/scaler/test_large_tensors.py,
tests/parallel/test_bucket_large.py): the data of every chunk is regenerated from its seed, so no
copy and no float64 version of a whole tensor is ever held; tests skip when memory is short."""

from __future__ import annotations

import os

import pytest
import torch

N = 2**31 + 4099  # elements of a "large" tensor: past int32 indexing, and not a multiple of 64 Ki
CHUNK = 2**24  # reference chunk: 16 Mi elements (a 128 MiB float64 temporary)
DT = torch.bfloat16
GiB = 2**30
EPS32 = 2.0**-24


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def need(nbytes: int) -> None:
    have = available_bytes()
    if have < nbytes:
        pytest.skip(
            f"needs {nbytes / GiB:.1f} GiB of available memory, this machine has {have / GiB:.1f} GiB"
        )


def chunk_values(seed: int, c: int, n: int) -> torch.Tensor:
    """The bfloat16 values of chunk ``c`` (``n`` elements): fresh random normals times 3."""
    gen = torch.Generator().manual_seed(seed * 100_003 + c)
    return (torch.randn(n, generator=gen) * 3.0).to(DT)


def fill(t: torch.Tensor, seed: int) -> None:
    for c, s in enumerate(range(0, t.numel(), CHUNK)):
        n = min(CHUNK, t.numel() - s)
        t[s : s + n] = chunk_values(seed, c, n)


def chunks(numel: int):
    for c, s in enumerate(range(0, numel, CHUNK)):
        yield c, s, min(CHUNK, numel - s)
