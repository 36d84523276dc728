"""Import a client library or say precisely what is missing."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from fastamp.integrations import SUPPORTED


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def _in_range(version: str, spec: str) -> bool:
    v = _version_tuple(version)
    for clause in spec.split(","):
        op = clause[:2] if clause[:2] in (">=", "<=", "==") else clause[:1]
        bound = _version_tuple(clause[len(op) :])
        ok = {
            ">=": v >= bound,
            "<=": v <= bound,
            "==": v == bound,
            ">": v > bound,
            "<": v < bound,
        }[op]
        if not ok:
            return False
    return True


def require(package: str) -> ModuleType:
    """Import ``package`` (a key of :data:`SUPPORTED`) or raise an ImportError that names it and
    the supported versions. A version outside the range imports with a warning (it may work)."""
    import_name, spec, tested = SUPPORTED[package]
    try:
        mod = importlib.import_module(import_name)
    except ImportError as exc:
        raise ImportError(
            f"fastamp.integrations.{package} needs the '{package}' package ({package}{spec}; "
            f"tested with {tested}), which could not be imported: {exc}. "
            f"Install it with `pip install '{package}{spec}'`."
        ) from exc
    version = getattr(mod, "__version__", "0")
    if not _in_range(version, spec):
        warnings.warn(
            f"fastamp.integrations.{package} supports {package}{spec} (tested with {tested}); "
            f"{package} {version} is installed and may not work",
            stacklevel=3,
        )
    return mod
