"""An optimizer's grads as the scaler's ops take them (:class:`DeviceGrads`): grouped by device
(all dtypes in one list), validated before the first one is touched."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class DeviceGrads(NamedTuple):
    """An optimizer's grads on one device, with each one's parameter id and (group, index)."""

    grads: list[Tensor]
    param_ids: list[int]
    places: list[tuple[int, int]]


def collect_grads(
    optimizer: torch.optim.Optimizer, allow_fp16: bool, caller: str = "unscale_"
) -> dict[torch.device, DeviceGrads]:
    """Grads of the optimizer grouped by device (all dtypes together), validated first: every
    check runs before the first grad is touched (PyTorch's own errors keep their text)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise AssertionError(
                    f"expected param to be torch.Tensor, got {type(param).__name__}"
                )
            if param.grad is None:
                continue
            if (not allow_fp16) and param.grad.dtype == torch.float16:
                msg = "Attempting to unscale FP16 gradients."
                if caller != "unscale_":  # PyTorch's text stays exact where PyTorch raises it
                    msg += (
                        f" {caller}() unscales the grads of optimizer in place, and "
                        f"param_groups[{g}]['params'][{i}] has a float16 grad. Expected "
                        "float32 params under autocast (keep the model in float32), or a "
                        "fastamp.optim optimizer, which unscales inside its kernel"
                    )
                raise ValueError(msg)
            if param.grad.device.type == "meta":
                raise RuntimeError(
                    f"GradScaler.{caller}: the grad of optimizer.param_groups[{g}]['params'][{i}] "
                    "is on the meta device, which holds no data: it cannot be checked for "
                    "inf/NaN or unscaled. Expected grads on a real device: materialise the "
                    "model before training (model.to_empty(device=...), then initialise or "
                    "load its weights)"
                )
    per_device: dict[torch.device, DeviceGrads] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                # Duplicate indices of scaled fp16 values may overflow only once summed, so
                # check the coalesced values (as PyTorch does).
                if param.grad.dtype is torch.float16:
                    param.grad = param.grad.coalesce()
                # private-ok: Tensor._values() is the documented accessor of a sparse COO
                # tensor's values (torch.amp.GradScaler unscales them through it too).
                grad = param.grad._values()
            else:
                grad = param.grad
            entry = per_device.setdefault(grad.device, DeviceGrads([], [], []))
            entry.grads.append(grad)
            entry.param_ids.append(id(param))
            entry.places.append((g, i))
    return per_device
