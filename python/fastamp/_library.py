"""Loads the compiled operator library ``fastamp._C`` and checks it can run on this torch.

The library speaks only the LibTorch stable ABI (csrc/common/torch_api.h): it calls torch through
its versioned C shim, so one binary loads on every torch from the floor it was compiled for
(``TORCH_TARGET``, the stable ABI's ``TORCH_TARGET_VERSION``) up. An older torch is refused here
with both versions and the fix, instead of failing later with an undefined-symbol error.

The stable ABI carries every C++ exception across as a RuntimeError. The kernels mark a refusal
that Python users expect as another class by starting its message with that class's name
(``"TypeError: ..."``); :class:`StableOps` (what each capability's ``_ops.py`` calls the operators
through) raises that class with the rest of the message.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    _Fake = TypeVar("_Fake", bound=Callable[..., Any])

    # torch.library.register_fake itself, as the op layers call it (a decorator of a fake
    # kernel): torch leaves its return type unannotated, which would make each fake untyped.
    def register_fake(op: str, /) -> Callable[[_Fake], _Fake]: ...

else:
    register_fake = torch.library.register_fake

_REBUILD = (
    "Install a torch it supports, or rebuild fastamp for this one:\n"
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


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.13.0+cpu" or "2.15.0.dev20261101"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(target: str, running: str) -> None:
    """Raises ImportError when the running torch is older than the one the library targets."""
    if _release(running) < _release(target):
        raise ImportError(
            f"fastamp's compiled library needs torch {target} or newer (it was compiled for the "
            f"LibTorch stable ABI of torch {target}), but torch {running} is installed.\n"
            + _REBUILD
        )


_info = _load_build_info()
check_torch_version(_info.TORCH_TARGET, torch.__version__)

try:
    from fastamp import _C  # type: ignore[attr-defined]  # noqa: F401  (compiled, no stub; importing runs the registrations)
except ImportError as exc:  # pragma: no cover - exercised only with broken builds
    raise ImportError(
        f"fastamp's operator library failed to load: {exc}\n"
        f"It was built with torch {_info.TORCH_VERSION} for torch >= {_info.TORCH_TARGET} "
        f"(CUDA: {_info.TORCH_CUDA_VERSION or 'none'}); running torch {torch.__version__} "
        f"(CUDA: {torch.version.cuda or 'none'}). A CUDA build needs a CUDA torch.\n" + _REBUILD
    ) from exc


_ERROR_CLASSES: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "NotImplementedError": NotImplementedError,
}
_MARKED = re.compile(r"^(TypeError|ValueError|NotImplementedError): ", re.S)


def translate_error(exc: RuntimeError) -> Exception:
    """The exception a kernel meant: ``RuntimeError("TypeError: msg")`` becomes ``TypeError("msg")``;
    any other error is returned as it is."""
    m = _MARKED.match(str(exc))
    if m is None or type(exc) is not RuntimeError:
        return exc
    return _ERROR_CLASSES[m.group(1)](str(exc)[m.end() :])


def _written_arguments(op: Any) -> list[tuple[int, str]]:
    """(position, name) of every argument the op's schema marks as written (``Tensor(a!)``)."""
    overload = op.default if hasattr(op, "default") else op
    # private-ok: OpOverload._schema is the parsed schema torch's own op wrappers read; there is
    # no public spelling of an argument's alias info.
    schema = overload._schema
    return [
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _written_tensors(
    written: list[tuple[int, str]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Tensor]:
    out: list[Tensor] = []
    for i, name in written:
        v = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, Tensor))
    return out


# The ADInplaceOrView kernels below (kept alive with this library object).
_VIEW_KERNELS: torch.library.Library | None = None


def _register_dispatcher_kernels(namespace: str) -> None:
    """Registers, for every op of ``namespace`` that takes a tensor, a kernel at the
    ADInplaceOrView key (where ATen's in-place ops bump their write counters): it runs the op
    below that key, then bumps the write counter of every tensor the schema marks as written
    (``Tensor(a!)``), as every in-place ATen op does, so autograd refuses a backward through a
    graph that saved one of them before ("modified by an inplace operation") instead of using the
    new values silently; and it raises the exception class a kernel meant (:func:`translate_error`).
    The stable ABI registers no kernel at that key, so without this only fastamp's wrappers did
    it: now a raw ``torch.ops.fastamp.*`` call and ``torch.compile``'s trace of one do it too.

    The key is in every tensor's dispatch key set but inference tensors' (and is skipped inside
    ``torch.inference_mode``), where there is no write counter to bump; there the raw op raises
    RuntimeError("TypeError: ...") and fastamp's wrappers (:class:`StableOps`) translate it."""
    global _VIEW_KERNELS
    lib = torch.library.Library(namespace, "IMPL")
    below = torch._C._after_ADInplaceOrView_keyset
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith(namespace + "::"):
            continue
        op_name, _, overload = name.split("::", 1)[1].partition(".")
        packet = getattr(getattr(torch.ops, namespace), op_name)
        op = getattr(packet, overload or "default")
        # private-ok: an OpOverload's parsed schema has no public spelling (as above).
        schema = op._schema
        if not any(
            a.type.isSubtypeOf(torch._C.ListType.ofTensors())
            or a.type.isSubtypeOf(torch._C.OptionalType.ofTensor())
            for a in schema.arguments
        ):
            continue  # no tensor: the call never reaches the key
        written = _written_arguments(op)
        lib.impl(
            name.split("::", 1)[1],
            _view_kernel(op, below, written),
            "ADInplaceOrView",
            with_keyset=True,
        )
    _VIEW_KERNELS = lib


def _redispatch(op: Any, keyset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op`` at the kernel ``keyset`` selects, raising the exception class the kernel meant
    (:func:`translate_error`): what the ADInplaceOrView kernel and :func:`call_direct` share."""
    try:
        return op.redispatch(keyset, *args, **kwargs)
    except RuntimeError as exc:
        err = translate_error(exc)
        if err is exc:
            raise
        raise err from None


def _view_kernel(op: Any, below: Any, written: list[tuple[int, str]]) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        result = _redispatch(op, keyset & below, args, kwargs)
        if written:
            # Inference tensors keep no counter: increment_version skips them.
            torch.autograd.graph.increment_version(_written_tensors(written, args, kwargs))
        return result

    return kernel


def bump_versions(tensors: Sequence[Tensor]) -> None:
    """Bumps the write counter of ``tensors``: what a held op (whose schema cannot name the held
    tensors it writes) leaves to its caller, which has them listed."""
    if tensors:
        torch.autograd.graph.increment_version(tensors)


# The thread-local dispatch state of a plain eager call: no TorchDispatchMode, FakeTensorMode,
# functorch transform or inference mode adds or removes a key (torch's default include set).
_PLAIN_INCLUDE = torch._C.DispatchKeySet(
    torch._C.DispatchKey.BackendSelect
) | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
_BACKEND_KEYS: dict[str, Any] = {
    "cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
    "cuda": torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA),
}


# torch has no public spelling of "no mode or transform on this thread": these are the checks
# torch.utils._python_dispatch and torch.overrides make themselves.
# private-ok: the TorchDispatchMode stack's depth
_dispatch_mode_count = torch._C._len_torch_dispatch_stack
# private-ok: whether a TorchFunctionMode is active
_function_mode_on = torch._C._is_torch_function_mode_enabled
# private-ok: the thread's included dispatch keys (Python, functorch and inference mode change it)
_tls_include_set = torch._C._dispatch_tls_local_include_set


# The dispatch key set of a backend kernel, what a direct call is made at (private-ok: torch's
# type of it has no public spelling).
KeySet: TypeAlias = torch._C.DispatchKeySet


def backend_keyset(device: torch.device) -> KeySet | None:
    """The dispatch key set of ``device``'s backend kernel (None: no direct call there)."""
    return _BACKEND_KEYS.get(device.type)


def direct_call_allowed() -> bool:
    """Whether a call may go straight to the backend kernel (:func:`call_direct`): eager, and
    nothing on the thread that would see or change the call on its way down (a
    TorchDispatchMode or TorchFunctionMode, FakeTensorMode, functorch, torch.compile's trace,
    inference mode). About 0.4 us; the caller checks it once per step, not per op, and also
    that autograd has nothing to do (grad mode off, or no argument requiring grad)."""
    if torch.compiler.is_compiling():  # first: dynamo traces no further than this
        return False
    return (
        _dispatch_mode_count() == 0
        and not _function_mode_on()
        and _tls_include_set() == _PLAIN_INCLUDE
    )


def call_direct(op: Any, keyset: KeySet, written: Sequence[Tensor], *args: Any) -> Any:
    """``op(*args)`` at its backend kernel (``keyset``, from :func:`backend_keyset`), for the
    steady-state step paths whose every tensor argument is a plain dense tensor on that backend
    (their replays checked the types) and only when :func:`direct_call_allowed`: what the dispatcher
    would do above the kernel is done here. The autograd and autocast keys have no kernel for
    fastamp's ops and (the caller checked) autograd has nothing to record, so they would pass the
    call on as it is; the
    ADInplaceOrView kernel (:func:`_register_dispatcher_kernels`) bumps the write counters of
    ``written`` (the caller lists them: every tensor the schema marks written, or that a held op
    writes) and raises the exception class the kernel meant, as here. What it saves is the Python
    kernel's boxing of every tensor argument to a Python object and back: about 8 us per call and
    0.15 us per tensor."""
    result = _redispatch(op, keyset, args, {})
    if written:
        torch.autograd.graph.increment_version(written)
    return result


def _translating(op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except RuntimeError as exc:  # a call that did not pass the ADInplaceOrView kernel
            err = translate_error(exc)
            if err is exc:
                raise
            raise err from None

    return call


class StableOps:
    """``torch.ops.<namespace>`` whose calls raise the exception class each kernel meant (see the
    module docstring). ``StableOps("fastamp").grad_stats(...)`` calls
    ``torch.ops.fastamp.grad_stats``; ``.overload(name)`` gives the ``.default`` overload, wrapped
    the same way. The write counters of what an op writes are bumped by the dispatcher
    (:func:`_register_dispatcher_kernels`); the held ops, whose schemas cannot name what they
    write, leave it to their caller (:func:`bump_versions`)."""

    def __init__(self, namespace: str) -> None:
        self._packets = getattr(torch.ops, namespace)
        # Every op's wrapper made now, not on first use: a first use inside torch.compile's trace
        # would trace functools.wraps (a graph break), e.g. for an op that eager steps call only
        # directly (call_direct).
        self._calls: dict[str, Callable[..., Any]] = {
            name: _translating(getattr(self._packets, name))
            for name in sorted(
                {
                    op.split("::", 1)[1].partition(".")[0]
                    for op in torch._C._dispatch_get_all_op_names()
                    if op.startswith(namespace + "::")
                }
            )
        }

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = _translating(getattr(self._packets, name))
        return call

    def overload(self, name: str) -> Callable[..., Any]:
        return _translating(getattr(self._packets, name).default)


def build_info() -> dict[str, Any]:
    """How this fastamp was built: torch/CUDA versions, CUDA archs, compiler, and which kernels exist."""
    return {
        "fastamp_version": _version(),
        "torch_version": _info.TORCH_VERSION,
        "torch_target": _info.TORCH_TARGET,
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


_register_dispatcher_kernels("fastamp")
