"""GradScaler's state: ``state_dict`` (PyTorch's five entries, plus fastamp's only when in use),
``load_state_dict`` (every entry checked before anything changes) and pickling (:class:`ScalerState`)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from fastamp.scaler._validation import check_state_dict


class ScalerState:
    """Mixin of :class:`fastamp.GradScaler` (methods over its own state)."""

    _enabled: bool
    _hysteresis: int
    _min_scale: float
    _max_scale: float
    _init_hysteresis_tracker: int
    _hysteresis_tracker: Tensor | None

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def _has_extras(self) -> bool:
        return self._hysteresis != 1 or self._min_scale != 0.0 or not math.isinf(self._max_scale)

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's five entries; plus the hysteresis/bounds entries only when they are in use,
        so the dict of a default-configured scaler is exactly PyTorch's."""
        out = super().state_dict()
        if self._enabled and self._has_extras():
            out["hysteresis"] = self._hysteresis
            out["_hysteresis_tracker"] = self._get_hysteresis_tracker()
            out["min_scale"] = self._min_scale
            out["max_scale"] = self._max_scale
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts dicts from ``torch.amp.GradScaler`` and from ``fastamp.GradScaler``."""
        if not self._enabled:
            return
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
        missing = [
            k
            for k in (
                "scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "_growth_tracker",
            )
            if k not in state_dict
        ]
        if missing:
            raise KeyError(
                f"GradScaler.load_state_dict: the state dict lacks {missing}; expected the dict "
                "returned by GradScaler.state_dict() (torch.amp or fastamp)"
            )
        check_state_dict(state_dict)  # everything, before anything is changed
        super().load_state_dict(state_dict)
        if "hysteresis" in state_dict:
            self._hysteresis = int(state_dict["hysteresis"])
            self._min_scale = float(state_dict.get("min_scale", 0.0))
            self._max_scale = float(state_dict.get("max_scale", math.inf))
        tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
        state["_hysteresis_tracker"] = None
        state["_last_skipped"] = None
        state["_update_count"] = None
        state["_diag"] = {}
        state["_ddp_stats"] = None
        state["_iterations"] = {}
        state["_transaction"] = None
        state.pop("_grad_plans", None)  # weak references; rebuilt by the next step
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        defaults = {
            "_hysteresis": 1,
            "_min_scale": 0.0,
            "_max_scale": math.inf,
            "_init_hysteresis_tracker": state.get("_hysteresis", 1),
            "_hysteresis_tracker": None,
            "_last_skipped": None,
            "_update_count": None,
            "_diag": {},
            "_warned_small_scale": False,
            "_ddp_stats": None,
            "_iterations": {},
            "_transaction": None,
            "_grad_plans": weakref.WeakKeyDictionary(),
        }
        for k, v in defaults.items():
            state.setdefault(k, v)
        super().__setstate__(state)
