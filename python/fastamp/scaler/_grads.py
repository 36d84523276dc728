"""An optimizer's grads as the scaler's ops take them (:class:`DeviceGrads`): grouped by device
(all dtypes in one list; a DTensor grad as this rank's shard, with the :class:`ShardGroup` its
statistics are reduced over), validated before the first one is touched."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fastamp._sharding import ShardGroup, local, shard_group


class DeviceGrads(NamedTuple):
    """An optimizer's grads on one device, with each one's parameter id and (group, index), and
    ``shard``: the ranks their inf flags and norm are reduced over (None: not sharded)."""

    grads: list[Tensor]
    param_ids: list[int]
    places: list[tuple[int, int]]
    shard: ShardGroup | None = None


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
    shards = _shard_groups(optimizer, caller)
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
                grad = local(param.grad)
            entry = per_device.setdefault(
                grad.device, DeviceGrads([], [], [], shards.get(grad.device))
            )
            entry.grads.append(grad)
            entry.param_ids.append(id(param))
            entry.places.append((g, i))
    return per_device


def _shard_groups(
    optimizer: torch.optim.Optimizer, caller: str
) -> dict[torch.device, ShardGroup | None]:
    """Each device's :class:`ShardGroup`, after checking that all its grads share one: one
    launch per device measures them together, so they must reduce over the same ranks."""
    seen: dict[torch.device, tuple[ShardGroup | None, tuple[int, int]]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            where = f"optimizer.param_groups[{g}]['params'][{i}]"
            sg = shard_group(param.grad, f"GradScaler.{caller}: the grad of {where}")
            dev = local(param.grad).device
            first = seen.setdefault(dev, (sg, (g, i)))
            if first[0] != sg:
                raise NotImplementedError(
                    f"GradScaler.{caller}: the grads on {dev} are sharded differently: "
                    f"{where} {_describe(sg)}, but optimizer.param_groups[{first[1][0]}]"
                    f"['params'][{first[1][1]}] {_describe(first[0])}. fastamp reduces the inf "
                    "check and the norm of a device's grads over one set of ranks. Expected "
                    "every parameter sharded alike (fully_shard every module, root included), "
                    "or one optimizer per sharding"
                )
    return {dev: sg for dev, (sg, _) in seen.items()}


def _describe(sg: ShardGroup | None) -> str:
    if sg is None:
        return "is not sharded (a plain tensor or a replicated DTensor)"
    return f"is sharded over dimensions {sg.dims} of {sg.mesh}"
