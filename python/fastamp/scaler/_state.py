"""What :class:`fastamp.GradScaler`'s ``state_dict``, ``load_state_dict`` and pickling add to
PyTorch's, as functions of the values handed in (the scaler's methods call them with its own
fields): the entries fastamp adds to PyTorch's five only when in use (:func:`extra_entries`),
the checks of a dict to load, every entry before anything changes (:func:`check_loadable`),
what a pickled scaler keeps (:func:`pickled`) and the defaults an older pickle lacks
(:func:`unpickled`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fastamp.scaler._grads import GradReader
from fastamp.scaler._validation import check_state_dict

# PyTorch's five entries of GradScaler.state_dict().
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def extra_entries(
    hysteresis: int, min_scale: float, max_scale: float, hysteresis_tracker: int
) -> dict[str, Any]:
    """fastamp's entries beside PyTorch's five, or none when hysteresis and the scale bounds are
    PyTorch's (the dict of a default-configured scaler is exactly PyTorch's)."""
    if hysteresis == 1 and min_scale == 0.0 and math.isinf(max_scale):
        return {}
    return {
        "hysteresis": hysteresis,
        "_hysteresis_tracker": hysteresis_tracker,
        "min_scale": min_scale,
        "max_scale": max_scale,
    }


def check_loadable(state_dict: Any) -> None:
    """Everything ``GradScaler.load_state_dict`` checks before anything changes (dicts from
    ``torch.amp.GradScaler`` and from ``fastamp.GradScaler`` are accepted)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "GradScaler.load_state_dict: state_dict must be the dict returned by "
            f"GradScaler.state_dict() (torch.amp or fastamp), got {type(state_dict).__name__}"
        )
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    if missing:
        raise KeyError(
            f"GradScaler.load_state_dict: the state dict lacks {missing}; expected the dict "
            "returned by GradScaler.state_dict() (torch.amp or fastamp)"
        )
    check_state_dict(state_dict)


def pickled(state: dict[str, Any], enabled: bool, hysteresis_tracker: int | None) -> dict[str, Any]:
    """What a pickled scaler keeps of ``state`` (its ``__dict__`` as torch's ``__getstate__``
    gives it): the per-iteration records and device scalars of fastamp's own are dropped and
    remade, the hysteresis tracker kept as a number."""
    if enabled:
        state["_init_hysteresis_tracker"] = hysteresis_tracker
    state["_hysteresis_tracker"] = None
    state["_last_skipped"] = None
    state["_last_found"] = None
    state["_update_count"] = None
    state["_diag"] = {}
    state["_ddp_stats"] = None
    state["_iterations"] = {}
    state["_transaction"] = None
    state.pop("_reader", None)  # caches of weak references and a lock; remade empty
    return state


def unpickled(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the defaults of every fastamp field a pickle may lack."""
    defaults = {
        "_hysteresis": 1,
        "_min_scale": 0.0,
        "_max_scale": math.inf,
        "_init_hysteresis_tracker": state.get("_hysteresis", 1),
        "_hysteresis_tracker": None,
        "_last_skipped": None,
        "_last_found": None,
        "_update_count": None,
        "_diag": {},
        "_warned_small_scale": False,
        "_ddp_stats": None,
        "_iterations": {},
        "_transaction": None,
    }
    for k, v in defaults.items():
        state.setdefault(k, v)
    state.pop("_grad_plans", None)  # (a pickle from before the reader held the caches)
    state.pop("_flat_grads", None)
    state["_reader"] = GradReader()
    return state
