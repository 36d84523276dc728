"""DTensor-sharded tensors (FSDP2's ``fully_shard``, HSDP, ``distribute_tensor``) as fastamp's
kernels see them: each rank's local shard (:func:`local`), and :class:`ShardGroup`, the mesh
dimensions over which a statistic of the shards (inf flags, a norm's power sum) is reduced to
become the whole tensor's, in one collective.

A placement decides a mesh dimension's part: ``Shard`` -- each rank holds other elements, so the
statistics of the ranks combine; ``Replicate`` -- each rank holds the same elements (HSDP's
replica dimension), so combining them would count every element once per replica; ``Partial`` --
refused (a grad is reduce-scattered by FSDP2 before it is set, so a partial grad means a step
taken before the reduction ran).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

__all__ = [
    "ShardGroup",
    "is_dtensor",
    "is_sharded",
    "local",
    "local_state",
    "misplaced_state",
    "shard_group",
    "wrap_like",
]


def _dtensor_class() -> type[DTensor] | None:
    # No tensor is a DTensor until torch.distributed.tensor is imported (fully_shard and
    # distribute_tensor import it): looked up, never imported here, so `import fastamp` does not
    # pay for DTensor's import (about half a second).
    module = sys.modules.get("torch.distributed.tensor")
    return cast("type[DTensor] | None", getattr(module, "DTensor", None))


# The types almost every tensor a step sees has: answered without the module lookup (a step over
# thousands of parameters asks several times per parameter).
_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter})


def is_dtensor(t: object) -> TypeIs[DTensor]:
    if type(t) in _PLAIN_TYPES:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def is_sharded(module: Any) -> bool:
    """Whether any parameter of ``module`` is a DTensor (``fully_shard``, ``distribute_tensor``)."""
    return any(is_dtensor(p) for p in module.parameters())


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise): the storage a kernel reads
    and writes, so an in-place update of it is an update of the DTensor."""
    # private-ok: DTensor._local_tensor is the local shard to_local() returns a view of (without
    # the autograd Function to_local() runs, once per tensor and step).
    return t._local_tensor if is_dtensor(t) else t


def local_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with each DTensor replaced by this rank's shard of it."""
    return {k: local(v) for k, v in state.items()}


def local_param(p: Tensor, state: Mapping[str, Any]) -> tuple[Tensor, Mapping[str, Any]]:
    """``(local(p), local_state(state))`` for reading: a plain param (not a DTensor, so neither
    is its state) and its state mapping come back as they are, with no copy (a step asks this
    once per parameter)."""
    if type(p) in _PLAIN_TYPES:
        return p, state
    return local(p), local_state(state)


def misplaced_state(p: Tensor, state: Mapping[str, Any]) -> tuple[str, str] | None:
    """For a DTensor param: the first state entry of its shape that is not a DTensor laid out as
    it is, as ``(key, what it is instead)`` (a full tensor would be taken for this rank's shard);
    None when every such entry is sharded as the param."""
    for key, v in state.items():
        if not (isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape):
            continue
        if not is_dtensor(v):
            return key, "a plain tensor"
        if tuple(v.placements) != tuple(cast("DTensor", p).placements):
            return key, f"a DTensor laid out as {tuple(v.placements)}"
    return None


@dataclass(frozen=True)
class ShardGroup:
    """The mesh dimensions (``dims``, of ``mesh``) over which a sharded tensor's elements are
    spread: a sum (or max) over the elements is the sum (max) of the ranks' partial ones over
    these dimensions."""

    mesh: DeviceMesh
    dims: tuple[int, ...]

    def all_reduce_(self, t: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """``t`` reduced in place over the group's ranks: one all-reduce per sharded mesh
        dimension (one for FSDP2 and for HSDP)."""
        for d in self.dims:
            dist.all_reduce(t, op=op, group=self.mesh.get_group(d))

    def reduce_stats(
        self, found: Tensor, pow_sum: Tensor, norm_type: float
    ) -> tuple[Tensor, Tensor]:
        """The inf flag and the norm's power sum over every rank's shard, in one all-reduce of
        the pair: a sum of power sums (the max for ``norm_type=inf``); the flag summed, then
        clipped to 1.0 (any rank's inf makes every rank skip)."""
        both = torch.stack([found.float(), pow_sum.float()])
        inf = norm_type == float("inf")
        self.all_reduce_(both, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        return both[0].clamp(max=1.0), both[1]

    def reduce_found(self, found: Tensor) -> Tensor:
        """The inf flag over every rank's shard (its max), in one all-reduce."""
        out = found.float().clone()
        self.all_reduce_(out, dist.ReduceOp.MAX)
        return out


def shard_group(t: Tensor, what: str) -> ShardGroup | None:
    """Where the statistics of ``t`` are reduced: None for a plain tensor or a replicated
    DTensor (this rank's statistics are the whole tensor's)."""
    if not is_dtensor(t):
        return None
    dims = []
    for d, placement in enumerate(t.placements):
        if placement.is_shard():
            dims.append(d)
        elif placement.is_partial():
            raise RuntimeError(
                f"{what} is a DTensor with a Partial placement on mesh dimension {d} "
                f"(placements {tuple(t.placements)}): its ranks hold unreduced partial sums, "
                "so its inf/NaN check and norm would be wrong. Expected sharded or replicated "
                "grads, as FSDP2 sets them after its reduce-scatter (was the step taken inside "
                "set_requires_gradient_sync(False) accumulation, or a grad assigned by hand?)"
            )
    return ShardGroup(t.device_mesh, tuple(dims)) if dims else None


def wrap_like(p: Tensor, t: Tensor) -> Tensor:
    """A tensor ``t`` made for ``local(p)`` (a moment, a master copy: the local shard's shape)
    as a DTensor laid out as ``p`` when ``p`` is one, as torch's optimizers keep the state of
    DTensor params (``torch.distributed.checkpoint`` then saves and reshards it); ``t`` itself
    otherwise, and for tensors of another shape (step counters, block scales)."""
    if not is_dtensor(p) or t.shape != local(p).shape:
        return t
    return cast("type[DTensor]", _dtensor_class()).from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
