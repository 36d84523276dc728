"""The constructor arguments of DistributedDataParallel: torch's checks with torch's messages,
torch's deprecation warnings, and an error naming each argument fastamp refuses (see docs/ddp.md)."""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch import nn

_NAME = "fastamp.parallel.DistributedDataParallel"  # how the class is named in every message of the package

# The installed torch's constructor: its keywords and defaults move between versions, and
# fastamp's follow them (torch 2.11/2.12: broadcast_buffers=True, no forward_sync_buffers; 2.13:
# broadcast_buffers=None, deprecated for forward_sync_buffers).
TORCH_DDP_KEYWORDS = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
BROADCAST_BUFFERS_DEFAULT: Any = TORCH_DDP_KEYWORDS["broadcast_buffers"].default
BROADCAST_BUFFERS_DEPRECATED = "forward_sync_buffers" in TORCH_DDP_KEYWORDS


def refuse(arg: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{_NAME}: {arg} is not supported: {why}")


def collective_error(what: str, rank: int, e: Exception) -> RuntimeError:
    """The error for a collective that failed on ``rank`` (raised ``from e``)."""
    return RuntimeError(
        f"{_NAME}: {what} failed on rank {rank}: {e}. "
        "A peer rank has probably died or stalled past the process group's timeout "
        "(init_process_group(timeout=...)); check the other ranks' logs."
    )


def check_arguments(
    module: nn.Module,
    device_ids: Any,
    output_device: Any,
    broadcast_buffers: Any,
    process_group: Any,
    bucket_cap_mb: Any,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    device_mesh: Any,
    bucket_cap_mb_list: Any,
    lazy_bucket_allocation: Any = False,
) -> set[str]:
    """Raises (before anything is set up) for arguments torch refuses or fastamp cannot honour;
    returns the names of the parameters and buffers DDP ignores. torch's constructor, which runs
    next, checks again and warns about deprecated keywords itself."""
    # Everything is validated before any state is set or any collective is issued.
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{_NAME}: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first (torchrun sets the environment)"
        )
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
        )
    if delay_all_reduce_named_params is not None:
        raise refuse(
            "delay_all_reduce_named_params / param_to_hook_all_reduce",
            "the delayed group's grads are all-reduced by torch's own hooks, outside the comm "
            "hook that measures them for fastamp.GradScaler (torch uses it to compose DDP with "
            "tensor parallelism). Leave them unset, or use "
            "torch.nn.parallel.DistributedDataParallel for that model.",
        )
    if lazy_bucket_allocation:
        raise refuse(
            "lazy_bucket_allocation=True",
            "fastamp's comm hook measures each reduced bucket buffer and divides it in place, "
            "which is not tested with buffers torch allocates and frees per backward. Leave it "
            "False (torch's default)",
        )
    if mixed_precision is not None:
        raise refuse(
            "mixed_precision",
            "torch's experimental _MixedPrecision keeps low-precision parameter copies inside "
            "DDP, whose grads the scaler's statistics would not describe. With fastamp use "
            "torch.autocast + fastamp.GradScaler (and, to halve the "
            "all-reduce bytes, register_comm_hook(None, fp16_compress_hook)).",
        )
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        # TypeError, as torch's parameter check raises for it (later, from its C++ binding).
        raise TypeError(
            f"DistributedDataParallel: process_group must be a torch.distributed.ProcessGroup "
            f"(e.g. dist.new_group(ranks)) or None, got {type(process_group).__name__} "
            f"{process_group!r}"
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        # private-ok: DeviceMesh has no public "root mesh" accessor; torch's DDP asks the same.
        if device_mesh._get_root_mesh() != device_mesh:
            raise refuse(
                "device_mesh (a mesh sliced from a larger one)",
                "DDP composed with tensor parallelism (DTensor parameters) is not covered by "
                "fastamp's statistics hook; pass a 1-D mesh of the data-parallel ranks, or use "
                "torch's DDP.",
            )
    if bucket_cap_mb is not None and (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not 0 < bucket_cap_mb < float("inf")
    ):
        raise ValueError(
            f"{_NAME}: bucket_cap_mb must be a positive, finite number of megabytes (e.g. 25, "
            f"PyTorch's default), got {bucket_cap_mb!r}"
        )
    if bucket_cap_mb_list is not None:
        caps = list(bucket_cap_mb_list)
        if not caps or any(
            isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf")
            for c in caps
        ):
            raise ValueError(
                f"{_NAME}: bucket_cap_mb_list must be a non-empty list of positive, finite "
                f"megabytes (one cap per bucket, the last one repeating), got {bucket_cap_mb_list!r}"
            )
    # private-ok: torch's DDP reads the parameters to ignore from this module attribute (set by
    # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model), so it is read here too.
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    module_params = [p for n, p in module.named_parameters() if n not in ignore]
    if not any(p.requires_grad for p in module_params):
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter "
            "that requires a gradient."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            "device_ids can only be None or contain a single element (one device per process); "
            f"got device_ids={list(device_ids)}"
        )
    device_types = {p.device.type for p in module_params}
    if len(device_types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {device_types}."
        )
    multi_device = len({p.device for p in module_params}) > 1
    if not device_ids or next(iter(device_types)) == "cpu" or multi_device:
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters "
                f"{ {p.device for p in module_params} }."
            )
    for name, sub in module.named_modules():
        if (
            isinstance(sub, (nn.Embedding, nn.EmbeddingBag))
            and sub.sparse
            and sub.weight.requires_grad
        ):
            raise refuse(
                f"sparse gradients ({name or 'module'} is an {type(sub).__name__} with sparse=True)",
                "fastamp's statistics hook measures dense buckets; construct it with sparse=False, "
                "or use torch's DDP",
            )
    for p in module_params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )
    return ignore
