"""Loads the CUDA emulator library into this process: ``torch.ops.fastamp_emu.<op>`` then runs the
CUDA host launcher and kernels of ``torch.ops.fastamp.<op>`` on CPU tensors (the emulated device's
memory), so the two can be compared on the same inputs.

The library is the one FASTAMP_EMU_LIB names, else build/cuda_emu/default/_cuda_emu.so, built (or
brought up to date from cached objects) on first use.

With FASTAMP_EMU_DEVICE=cuda the same differential tests run each op on a real GPU instead
(``make gpu-check``): every tensor argument's whole storage is copied to the device (so the
canaries around it travel too), ``torch.ops.fastamp.<op>`` runs there, and the storages are copied
back, so the harness compares the GPU's bits with the CPU kernel's exactly as it compares the
emulator's. FASTAMP_EMU_DEVICE=cpu takes the same path on the CPU (a self-test of the copying).
Emulator-only checks (launch orders, the emulator's own self-tests and counters) skip there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import fastamp  # noqa: F401  (registers the fastamp schemas mirrored below)

_HERE = Path(__file__).resolve().parent
_loaded: str | None = None
_mirror: torch.library.Library | None = None

ORDERS = ("ascending", "descending", "random")

#: "" runs the ops on the emulator; "cuda" (or "cpu") runs them on that device (see the top).
DEVICE = os.environ.get("FASTAMP_EMU_DEVICE", "")


def fastamp_ops() -> list[str]:
    """Every op of the fastamp namespace (name without the namespace)."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastamp::")]
    return sorted(n.split("::", 1)[1] for n in names)


def _define_mirror() -> None:
    """Defines fastamp_emu::<op> with exactly the schema of fastamp::<op>, for every op."""
    global _mirror
    if _mirror is not None:
        return
    _mirror = torch.library.Library("fastamp_emu", "FRAGMENT")
    for name in fastamp_ops():
        schema = str(getattr(torch.ops.fastamp, name.split(".")[0]).default._schema)
        _mirror.define(schema.split("::", 1)[1])


def library_path() -> Path:
    env = os.environ.get("FASTAMP_EMU_LIB")
    if env:
        return Path(env)
    sys.path.insert(0, str(_HERE))
    try:
        import build
    finally:
        sys.path.remove(str(_HERE))
    return build.build(build.DEFAULT_OUT / "default")


def load() -> str:
    """Loads the emulator library once per process and returns its path."""
    global _loaded
    if DEVICE:
        import pytest

        pytest.skip(f"emulator-only check (FASTAMP_EMU_DEVICE={DEVICE} runs the ops on the device)")
    if _loaded is None:
        path = str(library_path())
        _define_mirror()
        torch.ops.load_library(path)
        _loaded = path
    return _loaded


def op(name: str):
    if DEVICE:
        return _DeviceOp(name, DEVICE)
    load()
    return getattr(torch.ops.fastamp_emu, name)


class _DeviceOp:
    """``torch.ops.fastamp.<name>`` run on `device` with CPU arguments and CPU results: each CPU
    tensor argument becomes the same view of a device copy of its whole storage (aliases stay
    aliases, the canaries around a placed tensor travel with it), and after the call every
    storage is copied back into the CPU tensors."""

    def __init__(self, name: str, device: str):
        if name.split(".")[0] not in {n.split(".")[0] for n in fastamp_ops()}:
            import pytest

            pytest.skip(f"{name} is the emulator's own op")
        self.name = name
        self.device = torch.device(device)

    def __call__(self, *args):
        storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def to_device(x):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                st = x.untyped_storage()
                if st.data_ptr() not in storages:
                    host = torch.empty(0, dtype=torch.uint8).set_(st)
                    storages[st.data_ptr()] = (host, host.to(self.device, copy=True))
                dev = storages[st.data_ptr()][1].view(x.dtype)
                return dev.as_strided(x.size(), x.stride(), x.storage_offset())
            if isinstance(x, (list, tuple)):
                return type(x)(to_device(i) for i in x)
            return x

        def to_host(x):
            if isinstance(x, torch.Tensor):
                return x.cpu()
            if isinstance(x, (list, tuple)):
                return type(x)(to_host(i) for i in x)
            return x

        dev_args = [to_device(a) for a in args]
        result = getattr(torch.ops.fastamp, self.name)(*dev_args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for host, dev in storages.values():
            host.copy_(dev)
        return to_host(result)


@contextlib.contextmanager
def order(kind: str, seed: int = 0) -> Iterator[None]:
    """Runs the launches inside the block with blocks and threads started in `kind` order (on a
    real device, which schedules its own blocks, the block just runs: each order is a repeat)."""
    if DEVICE:
        yield
        return
    load()
    torch.ops.fastamp_emu.set_order(kind, seed)
    try:
        yield
    finally:
        torch.ops.fastamp_emu.set_order("ascending", 0)


def stats() -> dict[str, int]:
    load()
    launches, blocks, threads, switches = torch.ops.fastamp_emu.stats()
    return {"launches": launches, "blocks": blocks, "threads": threads, "switches": switches}


def vector_traffic() -> dict[str, int]:
    """The kernels' 16-byte vector loads and stores since the last reset_stats()."""
    load()
    loads, stores, load_bytes, store_bytes = torch.ops.fastamp_emu.vector_traffic()
    return {"loads": loads, "stores": stores, "load_bytes": load_bytes, "store_bytes": store_bytes}


FIELDS = ("requests", "bytes", "sectors", "ideal_sectors", "unique_sectors")


@dataclasses.dataclass(frozen=True)
class Access:
    """One direction (loads or stores) of one traced launch (csrc/emu/traffic.h)."""

    requests: int  # warp-level instructions
    bytes: int  # distinct bytes the requests asked for
    sectors: int  # 32-byte sectors the requests touched, summed
    ideal_sectors: int  # ceil(bytes of each request / 32), summed
    unique_sectors: int  # distinct sectors of the launch: its DRAM bytes / 32, caches cold

    @property
    def coalescing(self) -> float:
        """Sectors per ideal sector: 1.0 is perfect coalescing."""
        return self.sectors / max(self.ideal_sectors, 1)

    @property
    def reuse(self) -> float:
        """Sectors moved per distinct sector: 1.0 when no request re-reads a sector."""
        return self.sectors / max(self.unique_sectors, 1)


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    load: Access
    store: Access

    @property
    def dram_bytes(self) -> int:
        return 32 * (self.load.unique_sectors + self.store.unique_sectors)


def traffic_instrumented() -> bool:
    """Whether the loaded library's kernels report their accesses (not the --sanitize build)."""
    load()
    return bool(torch.ops.fastamp_emu.traffic_instrumented())


@contextlib.contextmanager
def traced(into: list[Launch]) -> Iterator[None]:
    """Traces the global-memory traffic of the launches inside the block (per-warp requests and
    32-byte sectors, csrc/emu/traffic.h) and appends one Launch per launch to `into`."""
    load()
    torch.ops.fastamp_emu.reset_stats()
    torch.ops.fastamp_emu.set_traffic_trace(True)
    try:
        yield
    finally:
        torch.ops.fastamp_emu.set_traffic_trace(False)
        names, counts = torch.ops.fastamp_emu.traffic()
        for i, name in enumerate(names):
            c = counts[10 * i : 10 * i + 10]
            into.append(Launch(name, Access(*c[:5]), Access(*c[5:])))


def footprint(store: bool) -> set[int]:
    """The sectors (address // 32) the traced launches loaded (or stored) since the last trace
    began."""
    load()
    return set(torch.ops.fastamp_emu.traffic_footprint(store))


def reset_stats() -> None:
    load()
    torch.ops.fastamp_emu.reset_stats()


def launched_kernels() -> list[str]:
    load()
    return list(torch.ops.fastamp_emu.launched_kernels())
