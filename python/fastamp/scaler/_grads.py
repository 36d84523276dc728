"""An optimizer's grads as the scaler's ops take them (:class:`DeviceGrads`): grouped by device
(all dtypes in one list; a DTensor grad as this rank's shard, with the :class:`ShardGroup` its
statistics are reduced over), validated before the first one is touched; the :class:`GradReplay`
that collects them again, unchecked, while nothing the checks read changed; and the
:class:`GradReader` that keeps those per optimizer and takes an optimizer's flat buffers
(:class:`fastamp.handoff.FlatGrads`) when it keeps them. One reader serves every producer of a
step's control values: :class:`fastamp.GradScaler` keeps one, the scaler-free clip
(:mod:`fastamp.scaler.clip`) one for all optimizers; it holds only caches."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from fastamp._sharding import ShardGroup, local, shard_group
from fastamp._step import same_params
from fastamp.handoff import AmpFusedOptimizer, FlatGrads

_T = TypeVar("_T")


class DeviceGrads(NamedTuple):
    """An optimizer's grads on one device, with each one's parameter id and (group, index), and
    ``shard``: the ranks their inf flags and norm are reduced over (None: not sharded)."""

    grads: list[Tensor]
    param_ids: list[int]
    places: list[tuple[int, int]]
    shard: ShardGroup | None = None
    #: With flat buffers (one grad per buffer, several params each): how many params each grad
    #: holds (its inf/NaN flag stands for each of them). None: one each.
    counts: list[int] | None = None
    #: Every grad a plain dense tensor of the same backend, as a :class:`GradReplay` checked: the
    #: scaler's ops may call the backend kernel directly (fastamp._library.call_direct).
    plain: bool = False
    #: False: a :class:`GradReplay` compared only the grads' types, for a caller whose first op
    #: over them only reads them; the kernel checks devices, dtypes and layouts, and on its
    #: refusal the caller collects in full (:func:`collect_grads`) and runs the op again.
    checked: bool = True


_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
_device = attrgetter("device")
_layout = attrgetter("layout")


class GradReplay:
    """What :func:`collect_grads` found for an optimizer whose grads were all plain dense
    tensors, kept so the next steps collect them with a few C-speed comparisons per grad
    instead of the checks: :meth:`collect` gives this step's grads, or None when anything it
    was built from changed (the param groups, the params, which have grads, a grad's type,
    dtype, device or layout), and :func:`collect_grads` then runs in full."""

    def __init__(self, optimizer: Any, per_device: dict[torch.device, DeviceGrads]) -> None:
        groups = optimizer.param_groups
        self.groups: list[dict[str, Any]] = groups
        self.group_dicts = list(groups)
        params = list(chain.from_iterable(grp["params"] for grp in groups))
        self.params = params  # compared by identity (same_params)
        grads = [p.grad for p in params]
        self.mask = [g is None for g in grads]
        self.some_none = any(self.mask)
        live = [g for g in grads if g is not None]
        self.types = list(map(type, live))
        self.dtypes = list(map(_dtype, live))
        self.devices = list(map(_device, live))
        self.layouts = list(map(_layout, live))
        self.has_fp16 = torch.float16 in self.dtypes
        # Where each device's grads are in the list of present grads.
        self.entries = [
            (
                dev,
                [k for k, d in enumerate(self.devices) if d == dev],
                entry.param_ids,
                entry.places,
            )
            for dev, entry in per_device.items()
        ]

    @staticmethod
    def replayable(optimizer: Any) -> bool:
        """Whether the optimizer's grads can be collected by a replay: every one a plain dense
        tensor (collected as it is: no sparse values, no DTensor shard)."""
        for grp in optimizer.param_groups:
            for p in grp["params"]:
                g = p.grad
                if g is not None and (type(g) is not torch.Tensor or g.layout is not torch.strided):
                    return False
        return True

    def collect(
        self, optimizer: Any, allow_fp16: bool, read_only: bool = False
    ) -> dict[torch.device, DeviceGrads] | None:
        """This step's grads, or None (see the class docstring). ``read_only``: the caller's
        first op over them only reads them and takes any dtype (``allow_fp16``), and it collects
        in full if that op refuses them; then, for one device, only the grads' types are
        compared here (about 0.25 us per grad less) and the op's checks do the rest."""
        groups = optimizer.param_groups
        if groups is not self.groups:
            return None
        params = same_params(groups, self.group_dicts, self.params)
        if params is None:
            return None
        grads = list(map(_grad, params))
        if list(map(is_, grads, repeat(None))) != self.mask:
            return None
        live = [g for g in grads if g is not None] if self.some_none else grads
        if read_only and allow_fp16 and len(self.entries) == 1:
            if list(map(type, live)) != self.types:
                return None
            dev, _, ids, places = self.entries[0]
            return {dev: DeviceGrads(live, ids, places, plain=True, checked=False)}
        if (
            list(map(type, live)) != self.types
            or list(map(_dtype, live)) != self.dtypes
            or list(map(_device, live)) != self.devices
            or list(map(_layout, live)) != self.layouts
            or (self.has_fp16 and not allow_fp16)  # the full collection raises for it
        ):
            return None
        if len(self.entries) == 1:
            dev, _, ids, places = self.entries[0]
            return {dev: DeviceGrads(live, ids, places, plain=True)}
        return {
            dev: DeviceGrads([live[k] for k in where], ids, places, plain=True)
            for dev, where, ids, places in self.entries
        }


def flat_device_grads(flat: FlatGrads, allow_fp16: bool) -> dict[torch.device, DeviceGrads] | None:
    """:class:`FlatGrads` grouped by device as the scaler's ops take them; None where the
    per-parameter collection must run (it raises for fp16 grads that may not be unscaled)."""
    per_device: dict[torch.device, DeviceGrads] = {}
    for g, ids, places, counts in zip(flat.grads, flat.param_ids, flat.places, flat.counts):
        if g.dtype is torch.float16 and not allow_fp16:
            return None
        entry = per_device.get(g.device)
        # The buffers are the optimizer's own plain dense tensors: the scaler's ops may call
        # their backend kernel directly (DeviceGrads.plain), as for a GradReplay's grads.
        plain = type(g) is Tensor and g.layout is torch.strided
        if entry is None:
            per_device[g.device] = DeviceGrads(
                [g], list(ids), list(places), None, [counts], plain=plain
            )
        else:
            entry.grads.append(g)
            entry.param_ids.extend(ids)
            entry.places.extend(places)
            entry.counts.append(counts)  # type: ignore[union-attr]
            if entry.plain and not plain:
                per_device[g.device] = DeviceGrads(
                    entry.grads, entry.param_ids, entry.places, entry.shard, entry.counts
                )  # (plain=False)
    return per_device


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
                    f"{_who(caller)}: the grad of optimizer.param_groups[{g}]['params'][{i}] "
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


class GradReader:
    """Collects optimizers' grads for the scaler's ops, caching what lets the next step skip
    the per-grad checks (see the module docstring)."""

    def __init__(self) -> None:
        # Each optimizer's grads as the last collection found them, to collect them again with
        # no per-grad checks while nothing they depend on changed.
        self.replays: weakref.WeakKeyDictionary[Any, GradReplay] = weakref.WeakKeyDictionary()
        # The last flat-buffer grads handed over, grouped by device (FlatGrads, allow_fp16, ...).
        self.flat: tuple[FlatGrads, bool, dict[torch.device, DeviceGrads]] | None = None
        # One reader may serve threads that step different optimizers (the scaler-free clip's).
        self.lock = threading.Lock()

    def collect(
        self,
        optimizer: torch.optim.Optimizer,
        allow_fp16: bool,
        caller: str = "unscale_",
        read_only: bool = False,
    ) -> dict[torch.device, DeviceGrads]:
        """:func:`collect_grads`, through the optimizer's :class:`GradReplay` while it holds (not
        while torch.compile traces: the replay is host-side bookkeeping a graph need not repeat).
        ``read_only``: see :meth:`read`, the one caller that passes it."""
        if torch.compiler.is_compiling():
            return collect_grads(optimizer, allow_fp16, caller)
        if isinstance(optimizer, AmpFusedOptimizer):
            flat = optimizer.amp_flat_grads()
            if flat is not None:
                cached = self.flat
                if cached is not None and cached[0] is flat and cached[1] == allow_fp16:
                    return cached[2]
                per_device = flat_device_grads(flat, allow_fp16)
                if per_device is not None:
                    self.flat = (flat, allow_fp16, per_device)
                    return per_device
        try:
            replay = self.replays.get(optimizer)
        except TypeError:  # an optimizer that takes no weak reference: no replay
            return collect_grads(optimizer, allow_fp16, caller)
        if replay is not None:
            per_device = replay.collect(optimizer, allow_fp16, read_only)
            if per_device is not None:
                return per_device
        return self.collect_in_full(optimizer, allow_fp16, caller)

    def collect_in_full(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, caller: str
    ) -> dict[torch.device, DeviceGrads]:
        """:func:`collect_grads`, keeping a new :class:`GradReplay` when the grads allow one."""
        per_device = collect_grads(optimizer, allow_fp16, caller)
        try:
            if GradReplay.replayable(optimizer):
                with self.lock:
                    self.replays[optimizer] = GradReplay(optimizer, per_device)
            else:
                with self.lock:
                    self.replays.pop(optimizer, None)
        except TypeError:  # no weak reference to it: nothing kept
            pass
        return per_device

    def read(
        self,
        optimizer: torch.optim.Optimizer,
        caller: str,
        read: Callable[[dict[torch.device, DeviceGrads]], _T],
    ) -> tuple[dict[torch.device, DeviceGrads], _T]:
        """The optimizer's grads (any dtype) and ``read(grads)``, an op pass that only reads
        them. The grads' replay then compares their types only (:meth:`GradReplay.collect`'s
        ``read_only``) and leaves devices, dtypes and layouts to the op's own checks: if the op
        refuses them, nothing was written, and the grads are collected in full (which raises
        what it finds, or groups them anew) and read again."""
        per_device = self.collect(optimizer, True, caller, read_only=True)
        try:
            return per_device, read(per_device)
        except (RuntimeError, TypeError, ValueError):
            if all(entry.checked for entry in per_device.values()):
                raise
        per_device = self.collect_in_full(optimizer, True, caller)
        return per_device, read(per_device)


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
            sg = shard_group(param.grad, f"{_who(caller)}: the grad of {where}")
            dev = local(param.grad).device
            first = seen.setdefault(dev, (sg, (g, i)))
            if first[0] != sg:
                raise NotImplementedError(
                    f"{_who(caller)}: the grads on {dev} are sharded differently: "
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


def _who(caller: str) -> str:
    """The name errors give the caller: a GradScaler method, or a function's full name."""
    return caller if "." in caller else f"GradScaler.{caller}"
