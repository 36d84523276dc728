"""Loads the compiled operator library ``fastamp._C`` and checks it matches the running torch.

A C++ extension is tied to the exact libtorch it was compiled against (the C++ ABI of libtorch is
not stable across releases), so a mismatch is refused here with both versions and the rebuild
command, instead of failing later with an undefined-symbol error or, worse, a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_REBUILD = (
    "Rebuild fastamp against the torch you are running:\n"
    "    pip install --no-build-isolation --force-reinstall --no-deps <path to fastamp source>\n"
    "(or `pip install --no-build-isolation -e .` in a source checkout)."
)


def _load_build_info() -> Any:
    try:
        return importlib.import_module("fastamp._build_info")
    except ImportError as exc:  # pragma: no cover - only in broken installs
        raise ImportError(
            "fastamp's compiled parts are missing (no fastamp._build_info). fastamp must be built, "
            "not imported from its source tree.\n" + _REBUILD
        ) from exc


def check_torch_version(built: str, running: str) -> None:
    """Raises ImportError when the torch fastamp was built for is not the running one."""
    if built != running:
        raise ImportError(
            f"fastamp was built against torch {built}, but torch {running} is installed. "
            "C++ extensions must be compiled against the exact torch they run with.\n" + _REBUILD
        )


_info = _load_build_info()
check_torch_version(_info.TORCH_VERSION, torch.__version__)

try:
    from fastamp import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - exercised only with broken builds
    raise ImportError(
        f"fastamp's operator library failed to load: {exc}\n"
        f"It was built for torch {_info.TORCH_VERSION} (CUDA: {_info.TORCH_CUDA_VERSION or 'none'}); "
        f"running torch {torch.__version__} (CUDA: {torch.version.cuda or 'none'}).\n" + _REBUILD
    ) from exc


def build_info() -> dict[str, Any]:
    """How this fastamp was built: torch/CUDA versions, CUDA archs, compiler, and which kernels exist."""
    return {
        "fastamp_version": _version(),
        "torch_version": _info.TORCH_VERSION,
        "torch_cuda_version": _info.TORCH_CUDA_VERSION or None,
        "with_cuda": bool(_info.WITH_CUDA),
        "cuda_compiler_version": _info.CUDA_COMPILER_VERSION or None,
        "cuda_archs": _info.CUDA_ARCHS.split() if _info.CUDA_ARCHS else [],
        "cxx_compiler": _info.CXX_COMPILER,
        "build_type": _info.BUILD_TYPE,
        "python_version": _info.PYTHON_VERSION,
        "sanitizers": _info.SANITIZERS or None,
        "ops": {name: registered_backends(name) for name in op_names()},
        "cpu_capability": cpu_capability(),
    }


def cpu_capability() -> str:
    """The instruction set of the CPU kernels this process runs: ``"avx512"`` (the optimizers'
    kernels; the others then run their AVX2 build), ``"avx2"`` or ``"default"``. Chosen once per
    process from the CPU; ``FASTAMP_CPU_CAPABILITY=default`` or ``=avx2`` caps it."""
    return str(torch.ops.fastamp._cpu_capability())


def op_names() -> list[str]:
    """Every public ``fastamp::`` operator the loaded library defines (read from the dispatcher, so
    the list is the schemas themselves)."""
    prefix = "fastamp::"
    names = (
        n[len(prefix) :] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)
    )
    # Leading underscore: build-internal ops (the sanitizer build's self-test), not the library's.
    return sorted(n for n in names if not n.startswith("_"))


def check_fake_devices(
    op: str,
    device: torch.device,
    lists: Sequence[tuple[str, Sequence[Any]]] = (),
    scalars: Mapping[str, Any] | None = None,
    anchor: str = "",
) -> None:
    """The device check of every fake (meta) kernel: each tensor of ``lists`` (``(name, tensors)``)
    and each non-None tensor of ``scalars`` must be on ``device``.

    The real kernels check this too. A list mixing devices (a meta tensor among CPU ones)
    dispatches to the fake kernel, which must then raise the same error: the fake kernel of an
    in-place op returning quietly would make the call a silent no-op. ``anchor`` says where
    ``device`` comes from, for the message."""
    where = f" ({anchor})" if anchor else ""
    for name, tensors in lists:
        for i, t in enumerate(tensors):
            if t.device != device:
                raise RuntimeError(
                    f"fastamp::{op}: {name}[{i}] is on {t.device}; expected {device}{where}: group "
                    "tensors by device"
                )
    for name, t in (scalars or {}).items():
        if t is not None and t.device != device:
            raise RuntimeError(f"fastamp::{op}: {name} is on {t.device}; expected {device}{where}")


def registered_backends(op: str) -> list[str]:
    """Dispatch keys with a kernel for ``fastamp::<op>`` (e.g. ['CPU', 'CUDA'])."""
    qualname = f"fastamp::{op}"
    keys = [
        key
        for key in ("CPU", "CUDA", "Meta")
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
    ]
    # Ops without tensor inputs (the RNG ones) have one kernel for every backend.
    if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd"):
        keys = sorted(set(keys) | {"CPU", "CUDA"} if _info.WITH_CUDA else set(keys) | {"CPU"})
    return keys


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fastamp")
    except Exception:  # pragma: no cover
        return "unknown"
