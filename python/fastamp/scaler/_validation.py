"""Validation of GradScaler's arguments and state_dicts (shared by the constructor, the setters,
``load_state_dict`` and :func:`fastamp.load_training_state`).

``where`` names the entry point and ``arg`` the argument or state_dict key. PyTorch checks only
growth_factor > 1 and backoff_factor < 1 (and lets NaN through both); anything else it accepts
fails later, in update() -- after the optimizer has stepped -- or silently pins the scale at
0/inf/NaN, where every following step is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fastamp._checks import integer, is_real, real

FLOAT32_MAX = torch.finfo(torch.float32).max
INT32_MAX = 2**31 - 1  # the growth and hysteresis trackers are int32 tensors


def check_scale(value: Any, where: str, arg: str) -> float:
    v = real(value, where, arg, "a finite number > 0")
    if not (0.0 < v <= FLOAT32_MAX):  # the scale is a float32 tensor
        raise ValueError(
            f"{where}: {arg} must be a finite number > 0, got {value!r}; a scale of 0, inf or NaN "
            "(or past float32's range) zeroes or overflows every gradient and every step would be "
            "skipped (expected e.g. 2.0**16, the default init_scale)"
        )
    return v


def check_growth_factor(value: Any, where: str, arg: str) -> float:
    v = real(value, where, arg, "a finite number > 1.0")
    if not (math.isfinite(v) and v > 1.0):
        raise ValueError(
            f"{where}: {arg} must be a finite number > 1.0, got {value!r} (expected e.g. 2.0)"
        )
    return v


def check_backoff_factor(value: Any, where: str, arg: str) -> float:
    v = real(value, where, arg, "a number in (0, 1)")
    if not (0.0 < v < 1.0):
        raise ValueError(
            f"{where}: {arg} must be a number in (0, 1), got {value!r} (expected e.g. 0.5)"
        )
    return v


def _int32_count(value: Any, where: str, arg: str, tracker: str, example: str) -> int:
    v = integer(value, where, arg, "an int >= 1")
    if not 1 <= v <= INT32_MAX:
        raise ValueError(
            f"{where}: {arg} must be an int >= 1 and <= 2**31 - 1 (the {tracker} tracker is "
            f"int32), got {value!r} (expected e.g. {example})"
        )
    return v


def check_growth_interval(value: Any, where: str, arg: str) -> int:
    return _int32_count(value, where, arg, "growth", "2000")


def check_hysteresis(value: Any, where: str, arg: str) -> int:
    return _int32_count(value, where, arg, "hysteresis", "2; 1 is PyTorch's behaviour")


def check_state_dict(sd: Mapping[str, Any], where: str = "GradScaler.load_state_dict") -> None:
    """Every entry of a GradScaler state_dict (torch.amp's or fastamp's) a load would use, with
    the key present checked by the caller; raises before anything is changed."""
    scale = sd["scale"]
    if isinstance(scale, Tensor) and scale.numel() == 1:
        scale = scale.item()
    check_scale(scale, where, "state_dict['scale']")
    check_growth_factor(sd["growth_factor"], where, "state_dict['growth_factor']")
    check_backoff_factor(sd["backoff_factor"], where, "state_dict['backoff_factor']")
    check_growth_interval(sd["growth_interval"], where, "state_dict['growth_interval']")
    for key in ("_growth_tracker", "_hysteresis_tracker"):
        if key not in sd:
            continue
        tracker = integer(sd[key], where, f"state_dict[{key!r}]", "an int >= 0")
        if not 0 <= tracker <= INT32_MAX:
            raise ValueError(
                f"{where}: state_dict[{key!r}] must be an int in [0, 2**31 - 1] (an int32 "
                f"counter), got {tracker}"
            )
    if "hysteresis" in sd:
        check_hysteresis(sd["hysteresis"], where, "state_dict['hysteresis']")
        lo = real(
            sd.get("min_scale", 0.0), where, "state_dict['min_scale']", "a finite number >= 0"
        )
        hi = real(
            sd.get("max_scale", math.inf), where, "state_dict['max_scale']", "a number >= min_scale"
        )
        if not (0.0 <= lo <= FLOAT32_MAX and hi >= lo):
            raise ValueError(
                f"{where}: state_dict['min_scale'], state_dict['max_scale'] = {lo!r}, {hi!r}; "
                "expected 0 <= min_scale <= max_scale with min_scale finite"
            )


def check_bounds(min_scale: Any, max_scale: Any, init_scale: float | None) -> tuple[float, float]:
    """The constructor's ``(min_scale, max_scale)`` as floats (0 and inf when None), checked, and
    ``init_scale`` (None: a disabled scaler, not checked) within them."""
    lo = (
        0.0
        if min_scale is None
        else real(min_scale, "GradScaler", "min_scale", "a finite number >= 0")
    )
    hi = (
        math.inf
        if max_scale is None
        else real(max_scale, "GradScaler", "max_scale", "a number >= min_scale")
    )
    if not (0.0 <= lo <= FLOAT32_MAX):
        raise ValueError(
            f"GradScaler: min_scale must be a finite number >= 0 (within float32's range), got "
            f"{min_scale!r}"
        )
    if not (hi >= lo):
        raise ValueError(f"GradScaler: max_scale must be >= min_scale ({lo}), got {max_scale!r}")
    if init_scale is not None and not (lo <= init_scale <= hi):
        raise ValueError(
            f"GradScaler: init_scale={init_scale} is outside [min_scale, max_scale] = [{lo}, {hi}]"
        )
    return lo, hi


def check_new_scale(new_scale: Any) -> float | Tensor:
    """``update(new_scale)``'s argument: a float (0, inf, NaN and past float32's range refused;
    PyTorch fills it as is) or a tensor (PyTorch's checks follow)."""
    if isinstance(new_scale, float):
        return check_scale(new_scale, "GradScaler.update", "new_scale")
    if not isinstance(new_scale, Tensor):
        # PyTorch takes anything else for a tensor and fails reading its .device: the same
        # class, with what was expected.
        hint = f" (pass {float(new_scale)!r})" if is_real(new_scale) else ""
        raise AttributeError(
            "GradScaler.update: new_scale must be a Python float or a one-element float32 "
            f"tensor, got {type(new_scale).__name__} {new_scale!r}{hint}; "
            "torch.amp.GradScaler raises AttributeError here too"
        )
    return new_scale


def check_not_meta(outputs: Any) -> None:
    """``scale(outputs)``: a loss on the meta device holds no data to scale."""
    items = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    for t in items:
        if isinstance(t, Tensor) and t.device.type == "meta":
            raise RuntimeError(
                "GradScaler.scale: outputs is on the meta device, which holds no data: its "
                "gradients could not be checked for inf/NaN or unscaled, and the scale would be "
                "created on meta. Expected a loss on a real device: materialise the model first "
                "(model.to_empty(device=...), then initialise or load its weights)"
            )


def check_initialised(
    scale: Tensor | None, growth_tracker: Tensor | None, funcname: str
) -> tuple[Tensor, Tensor]:
    """torch's check, with torch's messages (``scale()`` must have made the scale and the growth
    tracker), written out because torch.compile does not trace into torch.amp.GradScaler's own
    methods."""
    fix = (
        "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
        "iteration."
    )
    if scale is None:
        raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
    if growth_tracker is None:
        raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
    return scale, growth_tracker


def no_inf_checks(optimizer: torch.optim.Optimizer) -> AssertionError:
    """torch's "No inf checks were recorded for this optimizer." (its class and words first),
    saying why when the reason is plain: every param's grad is None (``zero_grad()`` between the
    backward and the step, or a loss that does not reach these params)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(p.grad is None for p in params):
        return AssertionError(
            "No inf checks were recorded for this optimizer: all of its "
            f"{len(params)} params have grad None, so there was nothing to check or step. Was "
            "optimizer.zero_grad() (set_to_none=True by default) called between "
            "scaler.scale(loss).backward() and scaler.step(optimizer)? Expected the grads "
            "zeroed before the backward or after scaler.update() (or the loss does not depend "
            "on these params)"
        )
    return AssertionError("No inf checks were recorded for this optimizer.")
