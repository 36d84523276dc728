"""Loads the CUDA emulator library into this process: ``torch.ops.fastamp_emu.<op>`` then runs the
CUDA host launcher and kernels of ``torch.ops.fastamp.<op>`` on CPU tensors (the emulated device's
memory), so the two can be compared on the same inputs.

The library is the one FASTAMP_EMU_LIB names, else build/cuda_emu/default/_cuda_emu.so, built (or
brought up to date from cached objects) on first use.
"""

from __future__ import annotations

import contextlib
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
    if _loaded is None:
        path = str(library_path())
        _define_mirror()
        torch.ops.load_library(path)
        _loaded = path
    return _loaded


def op(name: str):
    load()
    return getattr(torch.ops.fastamp_emu, name)


@contextlib.contextmanager
def order(kind: str, seed: int = 0) -> Iterator[None]:
    """Runs the launches inside the block with blocks and threads started in `kind` order."""
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


def reset_stats() -> None:
    load()
    torch.ops.fastamp_emu.reset_stats()


def launched_kernels() -> list[str]:
    load()
    return list(torch.ops.fastamp_emu.launched_kernels())
