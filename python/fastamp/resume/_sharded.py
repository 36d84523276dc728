"""The model and optimizer of a sharded run (FSDP2: DTensor parameters) in a training state:
their tensors go through ``torch.distributed.checkpoint`` (each rank writes its shards; a
different number of ranks reshards them on load), everything else beside them in the checkpoint
file (:class:`ShardedState`, typed, written by rank 0).

Loading is all or nothing across ranks: every rank checks what it can, then the ranks agree
(:func:`agree`) before the first collective read and again before the first object changes, so a
bad checkpoint raises on every rank instead of leaving one rank restored and another waiting in a
collective. The tensors are read into fresh tensors, never into the live model or optimizer.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastamp._sharding import is_dtensor, local
from fastamp.resume._checksums import file_digests, verify_files

__all__ = [
    "ShardedState",
    "agree",
    "check_files",
    "load_tensors",
    "remove_stale",
    "save_tensors",
]


@dataclass
class ShardedState:
    """What the checkpoint file holds of a sharded model and optimizer: where their tensors are
    (``directory``, beside the file), the model's keys with their global shapes, and the
    optimizer's ``state_dict()`` without its tensors (``param_groups``, the other per-parameter
    entries, and for each tensor entry whether it is a DTensor, its global shape and dtype), and
    the checksums of the directory's files (:func:`fastamp.resume._checksums.file_digests`)."""

    directory: str
    model_shapes: dict[str, list[int]]
    optimizer_groups: list[dict[str, Any]] | None = None
    optimizer_other: dict[int, dict[str, Any]] = field(default_factory=dict)
    optimizer_tensors: dict[int, dict[str, tuple[bool, list[int], str]]] = field(
        default_factory=dict
    )
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "model_shapes": self.model_shapes,
            "optimizer_groups": self.optimizer_groups,
            "optimizer_other": self.optimizer_other,
            "optimizer_tensors": self.optimizer_tensors,
            "files": self.files,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> ShardedState:
        keys: tuple[str, ...] = ("directory", "model_shapes", "optimizer_groups", "optimizer_other")
        keys += ("optimizer_tensors", "files")
        missing = [k for k in keys if k not in d]
        if missing:
            raise KeyError(
                f"load_training_state: the sharded state in {where} has no {missing}; it was "
                "edited or written by hand. Resume from an unmodified checkpoint"
            )
        return cls(**{k: d[k] for k in keys})


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def save_tensors(
    path: str, save_id: str, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> ShardedState:
    """Writes the model's and optimizer's tensors (every rank its shards) to a directory of this
    save beside ``path``; returns what the checkpoint file records of them."""
    directory = f"{os.path.basename(path)}.dcp-{save_id}"
    model_sd = module.state_dict()
    tensors: dict[str, Any] = {"model": model_sd}
    state = ShardedState(directory, {k: list(v.shape) for k, v in model_sd.items()})
    if optimizer is not None:
        osd = optimizer.state_dict()
        state.optimizer_groups = osd["param_groups"]
        optim: dict[str, dict[str, Tensor]] = {}
        for pid, st in osd["state"].items():
            ts = {k: v for k, v in st.items() if isinstance(v, Tensor)}
            state.optimizer_other[pid] = {k: v for k, v in st.items() if k not in ts}
            state.optimizer_tensors[pid] = {
                k: (is_dtensor(v), list(v.shape), str(v.dtype).replace("torch.", ""))
                for k, v in ts.items()
            }
            optim[str(pid)] = ts
        tensors["optim"] = optim
    target = os.path.join(os.path.dirname(os.path.abspath(path)), directory)
    _dcp().save(tensors, checkpoint_id=target)
    # Checksums of the files just written (each rank a share, read back from the page cache):
    # torch.distributed.checkpoint records none, and the checkpoint file keeps them.
    rank, world = _rank_world()
    mine = file_digests(target, rank, world)
    if world > 1:
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, mine)
        mine = {name: rec for share in shares for name, rec in share.items()}
    state.files = mine
    return state


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_files(state: ShardedState, path: str) -> None:
    """Verifies this rank's share of the tensor directory's files against the checksums the save
    recorded (every rank calls it; the ranks then agree, so a damaged file raises everywhere)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), state.directory)
    rank, world = _rank_world()
    verify_files(state.files, folder, repr(path), rank, world)


def remove_stale(path: str, keep: str) -> None:
    """Removes the tensor directories of earlier saves to ``path`` (rank 0, once the checkpoint
    file names the new one)."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = f"{os.path.basename(path)}.dcp-"
    for name in os.listdir(folder):
        if name.startswith(prefix) and name != keep:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def check(
    state: ShardedState,
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """What can be checked before reading the tensors: the directory, the model's keys and
    global shapes, and that each sharded optimizer tensor matches its parameter's shape."""
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), state.directory)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"load_training_state: {path!r} names its sharded tensors {state.directory!r}, which "
            f"does not exist beside it; copy the checkpoint file together with that directory"
        )
    own = module.state_dict()
    missing = [k for k in own if k not in state.model_shapes]
    unexpected = [k for k in state.model_shapes if k not in own]
    bad = [
        k
        for k in own
        if k in state.model_shapes and list(own[k].shape) != list(state.model_shapes[k])
    ]
    if missing or unexpected or bad:
        raise RuntimeError(
            f"load_training_state: the model does not match {path!r}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, different shapes {bad[:5]}. Build the same model "
            "as the run that saved it"
        )
    if optimizer is None:
        return
    groups = state.optimizer_groups or []
    if len(groups) != len(optimizer.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, optimizer.param_groups)
    ):
        raise ValueError(
            "load_training_state: optimizer has "
            f"{[len(g['params']) for g in optimizer.param_groups]} parameters per group, the "
            f"checkpoint {[len(g['params']) for g in groups]}; build the optimizer as the saved "
            "run did"
        )
    params = _params_by_id(groups, optimizer)
    for pid, entries in state.optimizer_tensors.items():
        p = params.get(pid)
        for key, (sharded, shape, _) in entries.items():
            if sharded and (p is None or not is_dtensor(p) or list(p.shape) != list(shape)):
                got = "no parameter" if p is None else f"a parameter of shape {tuple(p.shape)}"
                raise ValueError(
                    f"load_training_state: the optimizer state {pid}[{key!r}] in {path!r} is "
                    f"sharded with shape {tuple(shape)}, but it loads into {got}; build the "
                    "model and optimizer as the saved run did"
                )


def _params_by_id(
    groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer
) -> dict[Any, Tensor]:
    ids = [pid for g in groups for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return dict(zip(ids, params))


def _empty_like_shard(p: Tensor, dtype: torch.dtype) -> Tensor:
    from torch.distributed.tensor import DTensor

    shard = torch.empty(local(p).shape, dtype=dtype, device=local(p).device)
    d = cast(DTensor, p)  # a DTensor param: its state entry was saved sharded
    return DTensor.from_local(
        shard, d.device_mesh, d.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def load_tensors(
    state: ShardedState,
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Reads the tensors into fresh tensors laid out as this run's model and optimizer shard
    them (resharding when the number of ranks changed): the model's ``state_dict`` and the
    optimizer's, ready for their ``load_state_dict``. Collective: every rank calls it."""
    model_sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
    tensors: dict[str, Any] = {"model": model_sd}
    optim: dict[str, dict[str, Tensor]] = {}
    if optimizer is not None:
        params = _params_by_id(state.optimizer_groups or [], optimizer)
        for pid, entries in state.optimizer_tensors.items():
            out: dict[str, Tensor] = {}
            for key, (sharded, shape, dtype_name) in entries.items():
                dtype = getattr(torch, dtype_name)
                if sharded:
                    out[key] = _empty_like_shard(params[pid], dtype)
                else:
                    out[key] = torch.empty(shape, dtype=dtype)
            optim[str(pid)] = out
        tensors["optim"] = optim
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), state.directory)
    dcp = _dcp()
    try:
        dcp.load(tensors, checkpoint_id=folder)
    except dcp.api.CheckpointException as e:
        # A BaseException in torch (it escapes `except Exception`); raised on every rank alike.
        detail = str(e)[:300]
        for r, failure in e.failures.items():  # rank -> (exception, traceback)
            exc = failure[0] if isinstance(failure, tuple) else failure
            detail = f"rank {r}: {type(exc).__name__}: {str(exc)[:200]}"
            break
        raise RuntimeError(
            f"load_training_state: the sharded tensors of {path!r} in {state.directory!r} could "
            f"not be read ({detail}): the directory is damaged or incomplete. Resume from "
            "another checkpoint; nothing was restored on any rank"
        ) from None
    if optimizer is None:
        return model_sd, None
    osd_state = {
        pid: {**state.optimizer_other.get(pid, {}), **optim[str(pid)]}
        for pid in state.optimizer_tensors
    }
    return model_sd, {"state": osd_state, "param_groups": state.optimizer_groups}


def agree(error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what``; all raise if one did (the failing
    rank its own error, the others one that names it). Collective."""
    flags: list[Any] = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(flags, mine)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(flags) if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(
            f"load_training_state: rank {r} refused the checkpoint while {what} ({m}); nothing "
            "was restored on any rank"
        )
