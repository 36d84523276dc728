"""Saving and resuming a training run so that it continues bit for bit.

``torch.save(model.state_dict())`` is not enough to continue a mixed-precision run exactly: the
loss scale and its growth tracker (and fastamp's hysteresis tracker), the optimizer's moments and
step counts, the LR scheduler, every random generator (dropout masks, data shuffling) and, under
:class:`fastamp.parallel.DistributedDataParallel`, the gradient-bucket layout (the clip norm is a
sum of per-bucket partial sums) all decide the next step's bits. :func:`save_training_state`
stores all of them (what it returns and reads back is a :class:`TrainingState`);
:func:`load_training_state` validates the files and restores them.

Files. With one process, ``path`` is one file. Under torch.distributed (world size > 1) rank 0
writes ``path`` (model, optimizer, scaler, scheduler: identical on every rank under DDP) and every
rank writes ``f"{path}.rank{r}"`` (its random generators). Every file is written to a temporary
name and renamed into place, and all of them carry one save id: a run killed in the middle of a
save leaves either the previous complete checkpoint or files whose ids disagree, which
:func:`load_training_state` refuses with a clear error, never a silently mixed state. Every file
also records the rank that wrote it, the world size and the run's id (drawn by the run's first
save, or taken from the checkpoint a run resumed from, :func:`run_id`), and a load checks all of
them against the loading rank, its world and the checkpoint before anything is restored: two ranks'
files swapped, or a rank file of another run, are refused on every rank. Files of format 2 (no run
id) still load: their rank and world size are checked.

A sharded model (FSDP2's ``fully_shard``: DTensor parameters) keeps its tensors and its
optimizer's in a directory ``f"{path}.dcp-<save id>"`` beside ``path``, written by every rank
through ``torch.distributed.checkpoint`` (:mod:`fastamp.resume._sharded`); ``path`` names it, so
the file and the tensors it names always belong to one save, and rank 0 removes earlier saves'
directories once ``path`` is in place. Such a checkpoint resumes on another number of ranks with
``restore_rng=False`` (the tensors are resharded).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastamp._sharding import is_sharded
from fastamp.resume._checks import (
    check_optimizer_state,
    check_rng_state,
    check_scaler_state,
    rng_state,
    rng_state_exact,
    set_rng_state,
)
from fastamp.resume._checksums import seal, verify
from fastamp.resume._io import atomic_save, check_weights_only, decode_extra, encode_extra
from fastamp.resume._sharded import (
    ShardedState,
    agree,
    check_files,
    load_tensors,
    remove_stale,
    save_tensors,
)
from fastamp.resume._sharded import check as check_sharded
from fastamp.scaler import GradScaler

__all__ = ["TrainingState", "load_training_state", "save_training_state"]

# 3: every file records the run's id and the rank that wrote it (the checkpoint: 0). Format 2
# files have no run id (their rank files record rank and world size, the checkpoint the world
# size): loaded, with those checked. Format 1 files (fastamp before 0.1.0, which has not been
# released) have no checksums and are refused: their bytes cannot be verified.
_FORMAT = 3
_READABLE = (2, 3)
# The entries save_training_state writes: the checkpoint (and "rng" in a one-process save), and
# each rank's own file of a multi-process save; by format.
_CHECKPOINT_ENTRIES: dict[int, tuple[str, ...]] = {
    2: ("world_size", "step", "extra", "model", "sharded", "ddp_buckets", "optimizer", "scaler",
        "lr_scheduler", "torch_version"),
    3: ("rank", "world_size", "run_id", "step", "extra", "model", "sharded", "ddp_buckets",
        "optimizer", "scaler", "lr_scheduler", "torch_version"),
}  # fmt: skip
_RANK_ENTRIES: dict[int, tuple[str, ...]] = {
    2: ("rank", "world_size", "rng"),
    3: ("rank", "world_size", "run_id", "rng"),
}
# This process's run: drawn by rank 0 at the first save and sent to every rank with the save id,
# or the id of the checkpoint the run resumed from, so every save of one run carries one id.
_RUN: dict[str, str | None] = {"id": None}


@dataclass
class TrainingState:
    """What :func:`load_training_state` returns besides restoring the objects it was given."""

    step: int | None
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rng_restored: bool = True


def _dist_info() -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _unwrap(model: nn.Module) -> tuple[nn.Module, Any]:
    """(the wrapped module, the fastamp DDP wrapper or None); torch's DDP is unwrapped too."""
    from fastamp.parallel import DistributedDataParallel as FDDP

    if isinstance(model, FDDP):
        return model.module, model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module, None
    return model, None


def run_id() -> str | None:
    """The id every file of this run's saves records (None before its first save or load)."""
    return _RUN["id"]


def _save_ids(distributed: bool, world: int) -> tuple[str, str]:
    """(this save's id, the run's id): rank 0's, on every rank (one broadcast)."""
    box = [secrets.token_hex(8), _RUN["id"] or secrets.token_hex(8)]
    if distributed and world > 1:
        dist.broadcast_object_list(box, src=0)
    _RUN["id"] = box[1]
    return box[0], box[1]


def _scaler_mid_iteration(scaler: torch.amp.GradScaler) -> bool:
    """Whether ``scaler`` is between an iteration's unscale_/step and its update()."""
    if isinstance(scaler, GradScaler):
        return scaler.in_iteration()
    # private-ok: torch.amp.GradScaler keeps each optimizer's stage (READY / UNSCALED / STEPPED)
    # only in _per_optimizer_states, with no public accessor (fastamp's has in_iteration()).
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    return any(getattr(st.get("stage"), "name", "READY") != "READY" for st in states.values())


def save_training_state(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    lr_scheduler: Any = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Saves everything needed to continue a run bit for bit (see the module docstring).

    Call it between steps (after ``scaler.update()``), on every rank when running distributed:
    it synchronises the ranks (the save id is broadcast; a barrier ends the save). ``extra`` holds
    your own picklable-by-``torch.save`` items (data-loader position, epoch...). Syncs with the
    host (reading the scale): a checkpoint is the place for that, not the training step.
    """
    path = os.fspath(path)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"save_training_state: model must be an nn.Module, got {type(model).__name__}"
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(
            f"save_training_state: step must be a non-negative int or None, got {step!r}"
        )
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(
            f"save_training_state: extra must be a dict or None, got {type(extra).__name__}"
        )
    if scaler is not None and _scaler_mid_iteration(scaler):
        raise RuntimeError(
            "save_training_state: the scaler is in the middle of a step (unscale_() or step() "
            "was called without update()); save after scaler.update()"
        )
    # Everything that could be unreadable is refused before the first byte is written.
    extra_enc = encode_extra(extra if extra is not None else {}, "extra")
    check_weights_only(extra_enc, "extra")
    sched_state = lr_scheduler.state_dict() if lr_scheduler is not None else None
    if sched_state is not None:
        check_weights_only(sched_state, "lr_scheduler.state_dict()")
    rank, world, distributed = _dist_info()
    module, ddp = _unwrap(model)
    save_id, run = _save_ids(distributed, world)
    # A sharded model's (and its optimizer's) tensors: every rank writes its shards.
    shards = save_tensors(path, save_id, module, optimizer) if is_sharded(module) else None
    local = {
        "format": _FORMAT,
        "save_id": save_id,
        "rank": rank,
        "world_size": world,
        "run_id": run,
        "rng": rng_state(),
    }
    if world > 1:
        atomic_save(seal(local), f"{path}.rank{rank}", torch_crc32=False)
        dist.barrier()
    if rank == 0:
        shared = {
            "format": _FORMAT,
            "save_id": save_id,
            "rank": rank,
            "world_size": world,
            "run_id": run,
            "step": step,
            "extra": extra_enc,
            "model": module.state_dict() if shards is None else None,
            "sharded": shards.to_dict() if shards is not None else None,
            "ddp_buckets": ddp.bucket_layout() if ddp is not None else None,
            "optimizer": (
                optimizer.state_dict() if optimizer is not None and shards is None else None
            ),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "lr_scheduler": sched_state,
            "torch_version": str(torch.__version__),
        }
        if world == 1:
            shared["rng"] = local["rng"]
        atomic_save(seal(shared), path, torch_crc32=False)
        if shards is not None:  # the file names the new tensors: earlier saves' can go
            remove_stale(path, shards.directory)
    if world > 1:
        dist.barrier()


def _load(path: str, what: str, map_location: Any) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_training_state: {what} {path!r} does not exist")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a damaged archive or pickle: name the file, not torch's internals
        lines = str(e).strip().splitlines()
        raise RuntimeError(
            f"load_training_state: {what} {path!r} could not be read ({type(e).__name__}: "
            f"{(lines[0] if lines else '')[:200]}): the file is damaged or not a training state. "
            "Nothing was restored; resume from another checkpoint"
        ) from e
    if isinstance(obj, dict) and obj.get("format") == 1 and "save_id" in obj:
        raise RuntimeError(
            f"load_training_state: {path!r} was written by a development version of fastamp "
            f"(format 1) that recorded no checksums of its content, so its bytes cannot be "
            f"verified; this version (format {_FORMAT}) refuses it. Resume it with the fastamp "
            "that wrote it and save again, or read its parts with torch.load(path, "
            "weights_only=True)"
        )
    if not isinstance(obj, dict) or obj.get("format") not in _READABLE or "save_id" not in obj:
        raise RuntimeError(
            f"load_training_state: {path!r} is not a fastamp training state (format {_FORMAT}); "
            "it must be written by fastamp.save_training_state"
        )
    verify(obj, path)  # its content is what the save wrote, before anything reads it
    # Every entry a file of the format holds, named when missing: all of them are read only
    # after the checks (some only once the objects were restored), so none may be found missing
    # then (a renamed entry in a file saved before the digests covered the names).
    # (A one-process checkpoint's "rng" is checked where the RNG is restored, before any is.)
    entries = _CHECKPOINT_ENTRIES if what == "checkpoint" else _RANK_ENTRIES
    required = entries[obj["format"]]
    missing = [k for k in required if k not in obj]
    if missing:
        raise KeyError(
            f"load_training_state: {what} {path!r} has no {missing} entry (it has "
            f"{sorted(map(str, obj))}); a file written by fastamp.save_training_state has them: "
            "was it edited or written by hand? Resume from an unmodified checkpoint"
        )
    return obj


def _snapshot(obj: Any) -> Any:
    """An undo for ``obj.load_state_dict``: optimizers, schedulers and scalers replace their
    attributes on load (a shallow copy of ``__dict__`` keeps the old ones), except for the tensors
    they fill in place (the scaler's scale and trackers), whose values are copied."""
    saved = dict(obj.__dict__)
    tensors = {k: v.clone() for k, v in saved.items() if isinstance(v, torch.Tensor)}

    def restore() -> None:
        obj.__dict__.clear()
        obj.__dict__.update(saved)
        for k, v in tensors.items():
            saved[k].copy_(v)

    return restore


def load_training_state(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    lr_scheduler: Any = None,
    map_location: Any = "cpu",
    restore_rng: bool = True,
) -> TrainingState:
    """Restores what :func:`save_training_state` saved into the given objects; returns the step and
    ``extra``. Every file is read and checked (format, the checksums of its content, save id,
    world size, which objects were saved) before any object is changed; under torch.distributed
    the ranks agree first, so a damaged or mismatched file raises on every rank. Build the model,
    optimizer, scaler and scheduler as the saved run did (same parameter order and groups), then
    call this on every rank.

    A sharded model (FSDP2) may resume on another number of ranks with ``restore_rng=False``
    (``torch.distributed.checkpoint`` reshards its tensors); its ranks agree before anything is
    read or restored, so a bad checkpoint raises on every rank."""
    path = os.fspath(path)
    rank, world, distributed = _dist_info()
    module, ddp = _unwrap(model)
    objects = {"optimizer": optimizer, "scaler": scaler, "lr_scheduler": lr_scheduler}
    error: BaseException | None = None
    if world > 1 and distributed and not is_sharded(module):
        # Every rank reads its own file: the ranks agree before any restores (a damaged rank file
        # raises on every rank, not only on its own while the others go on).
        try:
            shared, local = _read_and_check(path, module, ddp, objects, map_location, restore_rng)
        except Exception as e:
            error = e
        agree(error, "reading and checking its files")
        model_sd, optim_sd = shared["model"], shared["optimizer"]
    elif not (is_sharded(module) and world > 1):
        shared, local = _read_and_check(path, module, ddp, objects, map_location, restore_rng)
        if shared.get("sharded") is None:
            model_sd, optim_sd = shared["model"], shared["optimizer"]
        else:  # a sharded model in one process
            shards = ShardedState.from_dict(shared["sharded"], repr(path))
            model_sd, optim_sd = load_tensors(shards, path, module, optimizer)
            if optimizer is not None:
                check_optimizer_state(optimizer, optim_sd, path)
    else:
        try:
            shared, local = _read_and_check(path, module, ddp, objects, map_location, restore_rng)
        except Exception as e:
            error = e
        agree(error, "reading and checking its files")
        shards = ShardedState.from_dict(shared["sharded"], repr(path))
        model_sd, optim_sd = load_tensors(shards, path, module, optimizer)  # raises everywhere
        error = None
        try:
            if optimizer is not None:
                check_optimizer_state(optimizer, optim_sd, path)
        except Exception as e:
            error = e
        agree(error, "checking the optimizer state")
    _restore(shared, local, model_sd, optim_sd, module, ddp, objects, restore_rng)
    if shared.get("run_id") is not None:  # the resumed run goes on under its id
        _RUN["id"] = shared["run_id"]
    return TrainingState(
        step=shared["step"],
        extra=decode_extra(shared["extra"]),
        world_size=shared["world_size"],
        rng_restored=restore_rng,
    )


def _read_and_check(
    path: str,
    module: nn.Module,
    ddp: Any,
    objects: dict[str, Any],
    map_location: Any,
    restore_rng: bool,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Reads this rank's files and checks everything that can be checked before the objects
    change; returns (the checkpoint, this rank's file or None)."""
    rank, world, _ = _dist_info()
    optimizer, scaler, lr_scheduler = (
        objects["optimizer"],
        objects["scaler"],
        objects["lr_scheduler"],
    )
    shared = _load(path, "checkpoint", map_location)
    saved_world = shared["world_size"]
    local = None
    if restore_rng:
        if saved_world != world:
            raise RuntimeError(
                f"load_training_state: {path!r} was saved by {saved_world} process(es) and is loaded "
                f"by {world}; the random streams cannot be resumed exactly. Resume with the same "
                "world size, or pass restore_rng=False to continue with fresh random streams"
            )
        local = (
            shared
            if world == 1
            else _load(f"{path}.rank{rank}", f"rank {rank}'s file", map_location)
        )
        if local is not shared:
            _check_rank_file(path, shared, local, rank, world)
        if local["save_id"] != shared["save_id"]:
            raise RuntimeError(
                f"load_training_state: {path}.rank{rank} belongs to another save than {path!r} "
                "(save ids differ): the save was interrupted. Resume from the previous complete "
                "checkpoint"
            )
    sharded = shared.get("sharded")
    if sharded is not None and not is_sharded(module):
        raise RuntimeError(
            f"load_training_state: {path!r} was saved from a sharded model (DTensor parameters, "
            "e.g. fully_shard) and the model given is not sharded; shard it as the saved run did "
            "before loading"
        )
    if sharded is None and is_sharded(module):
        raise RuntimeError(
            f"load_training_state: the model is sharded (DTensor parameters) but {path!r} was "
            "saved from an unsharded model; load it before sharding the model (fully_shard "
            "after load_training_state), or save from the sharded model"
        )
    shards = None if sharded is None else ShardedState.from_dict(sharded, repr(path))
    for name, obj in objects.items():
        saved = (
            shared.get(name) if shards is None or name != "optimizer" else shards.optimizer_groups
        )
        if obj is not None and saved is None:
            raise ValueError(
                f"load_training_state: {name} was given but {path!r} holds no {name} state; pass "
                f"{name}=None or load a checkpoint saved with one"
            )
    if shards is not None:
        check_sharded(shards, path, module, optimizer)
        check_files(shards, path)  # this rank's share of the tensor files, byte for byte
    else:
        _check_model_and_optimizer(path, shared, module, optimizer)
    layout = shared.get("ddp_buckets")
    if (
        ddp is not None
        and layout is not None
        and layout.get("num_params") != ddp.bucket_layout()["num_params"]
    ):
        raise RuntimeError(
            "load_training_state: the checkpoint's gradient-bucket layout is for "
            f"{layout.get('num_params')} parameters, the DistributedDataParallel model has "
            f"{ddp.bucket_layout()['num_params']}"
        )
    if scaler is not None:
        check_scaler_state(scaler, shared["scaler"], path)
    if lr_scheduler is not None and not isinstance(shared["lr_scheduler"], Mapping):
        raise ValueError(
            f"load_training_state: the lr_scheduler state in {path!r} is a "
            f"{type(shared['lr_scheduler']).__name__}; expected the dict of lr_scheduler.state_dict()"
        )
    if restore_rng and local is not None:
        check_rng_state(local.get("rng"), path if world == 1 else f"{path}.rank{rank}")
    return shared, local


def _check_rank_file(
    path: str, shared: dict[str, Any], local: dict[str, Any], rank: int, world: int
) -> None:
    """Rank ``rank``'s file belongs to this rank, this world and the checkpoint's run (a format 2
    file has no run id: its rank and world size are checked)."""
    where = f"{path}.rank{rank}"
    if local["rank"] != rank:
        raise RuntimeError(
            f"load_training_state: {where!r} was written by rank {local['rank']!r}, expected rank "
            f"{rank} (the rank loading it): the ranks' files were swapped or renamed. Give every "
            "rank the file it wrote; nothing was restored"
        )
    if local["world_size"] != world:
        raise RuntimeError(
            f"load_training_state: {where!r} was written by a run of world size "
            f"{local['world_size']!r}, expected {world} (the loading run's world size, and the "
            f"checkpoint {path!r}'s): it belongs to another run. Resume with the files of one save"
        )
    if shared.get("run_id") != local.get("run_id"):
        raise RuntimeError(
            f"load_training_state: {where!r} belongs to run {local.get('run_id')!r}, expected run "
            f"{shared.get('run_id')!r} (the run of the checkpoint {path!r}): the files come from "
            "different runs. Resume with the files of one save"
        )


def _check_model_and_optimizer(
    path: str,
    shared: dict[str, Any],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """An unsharded checkpoint's model keys and shapes, and its optimizer state."""
    own = module.state_dict()
    saved_model = shared["model"]
    missing = [k for k in own if k not in saved_model]
    unexpected = [k for k in saved_model if k not in own]
    bad_shape = [
        k for k in own if k in saved_model and tuple(own[k].shape) != tuple(saved_model[k].shape)
    ]
    if missing or unexpected or bad_shape:
        raise RuntimeError(
            f"load_training_state: the model does not match {path!r}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, different shapes {bad_shape[:5]}. Build the same model "
            "as the run that saved it"
        )
    if optimizer is not None:
        saved_groups = shared["optimizer"]["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups) or any(
            len(a["params"]) != len(b["params"])
            for a, b in zip(saved_groups, optimizer.param_groups)
        ):
            raise ValueError(
                "load_training_state: optimizer has "
                f"{[len(g['params']) for g in optimizer.param_groups]} parameters per group, the "
                f"checkpoint {[len(g['params']) for g in saved_groups]}; build the optimizer as the "
                "saved run did"
            )
        check_optimizer_state(optimizer, shared["optimizer"], path)


def _restore(
    shared: dict[str, Any],
    local: dict[str, Any] | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any] | None,
    module: nn.Module,
    ddp: Any,
    objects: dict[str, Any],
    restore_rng: bool,
) -> None:
    """Everything was validated; should a load still fail, what was already restored is put
    back (the model last: it is the one restore that cannot be undone without a copy)."""
    optimizer, scaler, lr_scheduler = (
        objects["optimizer"],
        objects["scaler"],
        objects["lr_scheduler"],
    )
    layout = shared.get("ddp_buckets")
    undo: list[Any] = []
    try:
        if optimizer is not None:
            undo.append(_snapshot(optimizer))
            optimizer.load_state_dict(optim_sd)
        if scaler is not None:
            undo.append(_snapshot(scaler))
            scaler.load_state_dict(shared["scaler"])
        if lr_scheduler is not None:
            undo.append(_snapshot(lr_scheduler))
            lr_scheduler.load_state_dict(shared["lr_scheduler"])
        if restore_rng and local is not None:
            rng_before = rng_state_exact()
            undo.append(lambda: set_rng_state(rng_before))
            set_rng_state(local["rng"])
        if ddp is not None and layout is not None:
            ddp.load_bucket_layout(layout)  # validates everything before changing the buckets
        module.load_state_dict(model_sd)
    except BaseException:
        for restore in reversed(undo):
            restore()
        raise
