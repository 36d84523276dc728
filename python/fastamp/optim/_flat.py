"""Flat buffers (``flat_buffers=True`` on :class:`fastamp.optim.AdamW` / :class:`~fastamp.optim.Adam`):
one param buffer and one grad buffer per (dtype, device), the params re-pointed as views into the
first and their grads as views into the second, so a step is one kernel launch per (param group,
dtype, device) segment whatever the param count (Megatron-Core's ``param_and_grad_buffer``,
apex's ``contiguous_param_buffer`` / ``contiguous_grad_buffer``, DeepSpeed ZeRO's flat groups).

:class:`FlatBuffers` is the layout and what it was built from; the optimizer asks it every step:

* :meth:`FlatBuffers.holds`: the param groups, their params (by identity), their structural options,
  each param's storage (``data_ptr``: ``p.data = ...``, ``model.to(...)``) and the state mapping
  and its per-param dicts (by identity: ``load_state_dict``, ``opt.state[p] = {...}``) are what
  the layout was built from. A value replaced inside a state dict is not looked for (that would
  cost a comparison per state tensor per step): ``state[p]`` holds views of the flat state, so
  write into them (``copy_``) or load a state_dict. When the layout does not hold, the optimizer
  builds a new one from the params and state as they are now (values kept, state copied in).
* :meth:`FlatBuffers.sync_grads`: every grad is its view (same object, same storage). A grad that
  is not (``p.grad = t``, a grad autograd made after ``model.zero_grad()``) is copied into its view
  and the view put back as ``p.grad``; a grad that is a view of another tensor's memory (DDP's
  ``gradient_as_bucket_view=True``) is refused before anything is copied; a None grad makes this
  step a per-parameter one (torch skips that param: the flat kernel cannot).

Per-parameter state stays per parameter: ``state[p]`` holds views of the segment's flat moments
and ``state[p]["step"]`` a 0-dim view of the segment's step buffer (one element per param, so a
torch optimizer loading the state_dict has one step tensor per param, as its own). The flat
kernel advances the segment's own step tensor, copied into the step buffer after each launch.
Each (param group, dtype, device) is a :class:`FlatSegment` of its buffer: one launch.
A per-parameter step that skipped some of a segment's params (a None grad) leaves their counts
apart: that segment's layout is then ``diverged`` and the optimizer steps per parameter until a
new layout finds the counts equal again (never: Adam's bias correction is per param).

Params with ``requires_grad=False`` stay outside the buffers (torch's optimizers skip them while
their grad is None; if one gets a grad, that step is per parameter).

Sparse grads (``nn.Embedding(sparse=True)``): autograd adds a sparse grad into a dense ``p.grad``
in place, so a grad view would take it silently and the step would be a dense one where torch's
Adam/AdamW raise. Each param put in a flat buffer gets one grad hook, registered once for its
lifetime (:class:`_SparseWatch`), that notes a sparse incoming grad for the layout holding it; the
next clip or step raises torch's ``RuntimeError`` before anything is copied or stepped (the note
lasts until ``zero_grad``). A param whose grad is sparse when a layout is built stays outside it
(its grad untouched): the step is then per parameter, which refuses it as torch does.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, is_
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fastamp._sharding import is_dtensor
from fastamp._step import same_params
from fastamp.optim import _ops
from fastamp.optim._launch import Launch
from fastamp.optim._replay import Structure

__all__ = ["ALIGN", "FlatBuffers", "FlatSegment"]

#: Each param's view starts at a multiple of this many elements (64 bytes of float32): the
#: per-parameter path's vector loads stay aligned. The gaps are zeros and stay zeros.
ALIGN = 16

_GRAD = attrgetter("grad")
_data_ptr = Tensor.data_ptr


def _version(t: Tensor) -> int:
    """``t``'s write counter (autograd's; shared by its views)."""
    # private-ok: Tensor._version, autograd's write counter, has no public spelling.
    version: int = t._version
    return version


def _zero_as_torch(grad: Tensor) -> None:
    """What torch's ``zero_grad(set_to_none=False)`` does to a grad it keeps."""
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


class _SparseWatch:
    """The grad hook of one param that a flat layout holds: notes a sparse incoming grad in the
    layout holding the param now (a weak reference: a layout that was replaced is not kept)."""

    __slots__ = ("layout", "index")
    # Nothing to save: torch.save / pickle of the param leave the hook out without a warning (a
    # loaded param gets its own when a layout takes it).
    __torch_unserializable__ = True

    def __init__(self) -> None:
        self.layout: weakref.ref[FlatBuffers] | None = None
        self.index = -1

    def __call__(self, grad: Tensor) -> None:
        if grad.layout is not torch.strided and self.layout is not None:
            flat = self.layout()
            if flat is not None:
                flat.sparse.add(self.index)


# One watch per param, its hook registered once (a layout built again re-points the watch).
# (both torch APIs are untyped)
_WATCHES: Any = WeakIdKeyDictionary()


def _watch(p: Tensor, flat: FlatBuffers, index: int) -> None:
    w = _WATCHES.get(p)
    if w is None:
        w = _WATCHES[p] = _SparseWatch()
        cast(Any, p).register_hook(w)
    w.layout = weakref.ref(flat)
    w.index = index


def _dense_strides(p: Tensor) -> tuple[int, ...]:
    """The strides of a dense tensor laid out as ``p`` (channels_last kept; a tensor with gaps or
    overlaps gets contiguous strides)."""
    return torch.empty_like(p, device="meta").stride()


@dataclass
class FlatSegment:
    """The params of one param group in one buffer: ``param`` / ``grad`` are the flat views the
    kernel takes (``[start, stop)`` of the buffer), ``members`` the params' places in
    :attr:`FlatBuffers.inside`. ``state`` is the flat state the kernel updates (None before the
    first step), ``steps`` the per-param step buffer; ``launch`` the held launch (made once the
    state exists)."""

    g: int
    group: dict[str, Any]
    buffer: int
    param: Tensor
    grad: Tensor
    members: list[int]
    places: list[int]
    state: dict[str, Any] | None = None
    steps: Tensor | None = None
    diverged: bool = False
    # steps' write counter after fastamp's own last write: another value means a write into a
    # param's state["step"] (a view of steps), which the layout then no longer holds.
    steps_version: int = -1
    launch: Launch | None = None
    grads: list[Tensor] = field(default_factory=list)
    written: list[Tensor] = field(default_factory=list)

    def copy_steps(self) -> None:
        """After a launch: the segment's step count into each param's ``state["step"]`` view."""
        assert self.steps is not None and self.state is not None
        self.steps.copy_(self.state["step"])
        self.steps_version = _version(self.steps)


class FlatBuffers:
    """The flat layout of an optimizer's params (see the module docstring). Construction checks
    every param first and raises (naming ``flat_buffers``) before anything is re-pointed."""

    def __init__(
        self,
        owner: str,
        groups: list[dict[str, Any]],
        state: Mapping[Tensor, dict[str, Any]],
    ) -> None:
        where = f"fastamp.optim.{owner}(flat_buffers=True)"
        inside: list[Tensor] = []
        keys: list[tuple[torch.dtype, torch.device]] = []
        by_group: list[list[tuple[Tensor, int]]] = []
        for g, group in enumerate(groups):
            mine: list[tuple[Tensor, int]] = []
            for i, p in enumerate(group["params"]):
                name = f"param_groups[{g}]['params'][{i}]"
                if is_dtensor(p) or is_dtensor(p.grad):
                    raise ValueError(
                        f"{where}: {name} is a DTensor (sharded by FSDP2's fully_shard or "
                        "distribute_tensor): flat buffers hold plain tensors, and a shard's "
                        "storage belongs to FSDP2. Expected flat_buffers=False with FSDP2 "
                        "(its own flat all-gather buffers already batch the step per module)"
                    )
                if not p.requires_grad:
                    # Frozen (an integer tensor too, which torch's optimizers take): outside the
                    # buffers; it never gets a grad while frozen.
                    continue
                if p.layout is not torch.strided or not p.is_floating_point():
                    raise ValueError(
                        f"{where}: {name} is a {p.layout} {p.dtype} tensor; flat buffers hold "
                        "dense floating-point params"
                    )
                if p.device.type == "meta":
                    raise ValueError(
                        f"{where}: {name} is on the meta device, which holds no data; expected "
                        "the optimizer made after the model is materialised"
                    )
                if p.grad is not None and p.grad.layout is not torch.strided:
                    continue  # (a sparse grad: stepped per parameter, which refuses it)
                key = (p.dtype, p.device)
                if key not in keys:
                    keys.append(key)
                mine.append((p, i))
                inside.append(p)
            by_group.append(mine)
        pair = _ops.shared_memory_pair(inside) if inside else []
        if pair:
            raise ValueError(
                f"{where}: two params share memory (params {pair[0]} and {pair[1]} of the "
                "trainable params, in param_groups order); flat buffers would give each its own "
                "copy and break the tie. Expected each shared weight passed once (tied modules "
                "share one Parameter object)"
            )
        # Offsets: per buffer, group after group, each param aligned to ALIGN elements.
        sizes = [0] * len(keys)
        where_of: list[tuple[int, int]] = [(0, 0)] * len(inside)  # (buffer, offset)
        spans: list[tuple[int, int, int, int, list[int], list[int]]] = []
        k = 0
        for g, mine in enumerate(by_group):
            index = list(range(k, k + len(mine)))
            k += len(mine)
            for b, key in enumerate(keys):
                start = sizes[b]
                members, places = [], []
                for (p, i), m in zip(mine, index):
                    if (p.dtype, p.device) != key:
                        continue
                    where_of[m] = (b, sizes[b])
                    sizes[b] += (p.numel() + ALIGN - 1) // ALIGN * ALIGN
                    members.append(m)
                    places.append(i)
                if members:
                    spans.append((g, b, start, sizes[b], members, places))
        self.param_buffers = [torch.zeros(n, dtype=d, device=v) for n, (d, v) in zip(sizes, keys)]
        self.grad_buffers = [torch.zeros(n, dtype=d, device=v) for n, (d, v) in zip(sizes, keys)]
        pviews: list[Tensor] = []
        gviews: list[Tensor] = []
        with torch.no_grad():
            for p, (b, off) in zip(inside, where_of):
                stride = _dense_strides(p)
                pv = self.param_buffers[b].as_strided(p.shape, stride, off)
                gv = self.grad_buffers[b].as_strided(p.shape, stride, off)
                pv.copy_(p)
                if p.grad is not None:
                    gv.copy_(p.grad)
                pviews.append(pv)
                gviews.append(gv)
        # Nothing above changed a param; from here on they are views.
        for p, pv, gv in zip(inside, pviews, gviews):
            p.data = pv
            p.grad = gv
        self.groups = groups
        self.group_dicts = list(groups)
        self.structure = [Structure(grp) for grp in groups]
        params = list(chain.from_iterable(grp["params"] for grp in groups))
        self.params = params  # compared by identity (operator.is_) at each step
        self.inside = inside
        inside_ids = {id(p) for p in inside}
        self.outside = [p for p in params if id(p) not in inside_ids]
        self.views = gviews
        self.view_ptrs = list(map(_data_ptr, gviews))
        # The params' and the grad views' addresses, compared at every step by the op library
        # (``fastamp::held_moved``: one C call per list, where a Python data_ptr() per tensor
        # costs about 0.1 us). Apart, so that a read of the grads (the scaler's stats pass)
        # checks only the views: :meth:`holds` keeps that result for :meth:`sync_grads`.
        self.held_params = _ops.HeldTensors((inside,))
        self.held_views = _ops.HeldTensors((gviews,))
        self.views_moved = False
        # A param frozen or unfrozen since this layout was built (seen by zero_grad): the layout
        # no longer holds.
        self.stale = False
        # Places in ``inside`` of the params that received a sparse grad since the last zero_grad.
        self.sparse: set[int] = set()
        for k, p in enumerate(inside):
            _watch(p, self, k)
        self.segments = [
            FlatSegment(
                g, groups[g], b, self.param_buffers[b][start:stop],
                self.grad_buffers[b][start:stop], members, places,
            )
            for g, b, start, stop, members, places in spans
        ]  # fmt: skip
        self._flatten_state(state)
        self.snapshot(state)

    # ---------------------------------------------------------------- state
    def _flatten_state(self, state: Mapping[Tensor, dict[str, Any]]) -> None:
        """Each segment's per-param state copied into flat tensors and replaced by views of
        them; a segment whose params' state differs in keys or step counts is ``diverged``."""
        for seg in self.segments:
            params = [self.inside[k] for k in seg.members]
            # {} for a param with no state yet: as falsy as the None .get gives.
            sts = [state.get(p) or {} for p in params]
            if not any(sts):
                continue
            names = list(sts[0]) if sts[0] else []
            ok = all(st and list(st) == names for st in sts) and "step" in names
            for k in names:
                if k == "step" or not ok:
                    continue
                ok = all(
                    isinstance(st[k], Tensor)
                    and st[k].layout is torch.strided
                    and st[k].shape == p.shape
                    and st[k].device == p.device
                    and st[k].dtype == sts[0][k].dtype
                    and not is_dtensor(st[k])
                    for st, p in zip(sts, params)
                )
            if not ok:
                seg.diverged = True  # stepped per parameter, its state left as it is
                continue
            dev = seg.param.device
            with torch.no_grad():
                flat: dict[str, Any] = {}
                views: dict[str, list[Tensor]] = {}
                for k in names:
                    if k == "step":
                        continue
                    buf = torch.zeros(seg.param.numel(), dtype=sts[0][k].dtype, device=dev)
                    vs = []
                    for m, p, st in zip(seg.members, params, sts):
                        off = self.views[m].storage_offset() - seg.grad.storage_offset()
                        v = buf.as_strided(p.shape, self.views[m].stride(), off)
                        v.copy_(st[k])
                        vs.append(v)
                    flat[k] = buf
                    views[k] = vs
                steps = torch.stack(
                    [
                        torch.as_tensor(st["step"], dtype=torch.float32).to(dev).reshape(())
                        for st in sts
                    ]
                )
                seg.diverged = not bool((steps == steps[0]).all())
                flat["step"] = steps[0].clone()
            seg.state = flat
            seg.steps = steps
            seg.steps_version = _version(steps)
            for j, p in enumerate(params):
                state[p].update({k: (steps[j] if k == "step" else views[k][j]) for k in names})
            seg.launch = None

    def adopt(self, seg: FlatSegment, new: dict[str, Any], state: Any) -> None:
        """After a segment's first launch made its flat state (``new``): the per-param state
        becomes views of it."""
        seg.state = dict(new)
        n = len(seg.members)
        seg.steps = seg.state["step"].reshape(1).repeat(n)
        seg.steps_version = _version(seg.steps)
        for j, m in enumerate(seg.members):
            p = self.inside[m]
            gv = self.views[m]
            off = gv.storage_offset() - seg.grad.storage_offset()
            state[p].update(
                {
                    k: seg.steps[j]
                    if k == "step"
                    else v.as_strided(p.shape, gv.stride(), v.storage_offset() + off)
                    for k, v in seg.state.items()
                }
            )

    def snapshot(self, state: Mapping[Tensor, dict[str, Any]]) -> None:
        """Records the state mapping as it is now (what :meth:`holds` compares against)."""
        self.state = state
        self.state_dicts = list(state.values())  # compared by identity at each step

    # ---------------------------------------------------------------- per step
    def holds(
        self, groups: list[dict[str, Any]], state: Mapping[Tensor, Any], grads_only: bool = False
    ) -> bool:
        """Whether the layout still describes the optimizer (see the module docstring). With
        ``grads_only`` (a pass that only reads the grads: the scaler's inf check and norm), only
        what that read depends on: the same params in the same groups, whose grads
        :meth:`sync_grads` then checks. The step itself asks for everything (the params'
        storage, the group options, the state), touching each param once more."""
        if groups is not self.groups or self.stale:
            return False
        if same_params(groups, self.group_dicts, self.params) is None:
            return False
        # A grad view re-pointed (p.grad.data = ..., set_): sync_grads looks at each grad.
        self.views_moved = self.held_views.moved() >= 0
        if grads_only:
            return True
        if state is not self.state:
            return False
        if not all(st.holds(grp) for grp, st in zip(groups, self.structure)):
            return False
        if any(
            seg.steps is not None and _version(seg.steps) != seg.steps_version
            for seg in self.segments
        ):  # a param's step count written in place (state[p]["step"].fill_(...))
            return False
        if self.held_params.moved() >= 0:  # a param re-pointed (p.data = ..., model.to(...))
            return False
        return len(state) == len(self.state_dicts) and all(
            map(is_, state.values(), self.state_dicts)
        )

    @property
    def usable(self) -> bool:
        return not any(seg.diverged for seg in self.segments)

    def sync_grads(self, where: str) -> bool:
        """True when every grad is (now) its view: a grad that is another tensor is copied into
        its view first. False (nothing copied) when a trainable param has no grad or a frozen
        one has one: the step is then per parameter. Raises (nothing copied) for a grad that is
        a view of another tensor's memory. Called right after :meth:`holds` returned True (its
        address check of the views is the one used here)."""
        if self.sparse:
            k = min(self.sparse)
            name = next(
                f"param_groups[{seg.g}]['params'][{i}]"
                for seg in self.segments
                for m, i in zip(seg.members, seg.places)
                if m == k
            )
            raise RuntimeError(
                "Adam does not support sparse gradients, please consider SparseAdam instead "
                f"({where}(flat_buffers=True): {name} received a "
                "sparse grad, e.g. from nn.Embedding(sparse=True), which its dense flat grad "
                "took in; expected dense grads: build the module with sparse=False, or put "
                "these parameters in a torch.optim.SparseAdam)"
            )
        grads = list(map(_GRAD, self.inside))
        if (
            all(map(is_, grads, self.views))
            and not self.views_moved
            and not any(p.grad is not None for p in self.outside)
        ):
            return True
        if any(g is None for g in grads) or any(p.grad is not None for p in self.outside):
            return False
        moved = [
            (k, g)
            for k, (g, v) in enumerate(zip(grads, self.views))
            if g is not v or g.data_ptr() != self.view_ptrs[k]
        ]
        for k, g in moved:
            if g is self.views[k]:  # p.grad.data = ... / set_ on the view itself
                raise RuntimeError(
                    f"{where}: the grad of a flat param (param {k}) no longer points into the "
                    "flat grad buffer (p.grad.data or p.grad.set_ was assigned). Expected "
                    "p.grad = tensor to replace a grad (it is copied into the buffer), or "
                    "flat_buffers=False"
                )
            # private-ok: Tensor._base (the tensor a view was made from) has no public spelling.
            if g._base is not None or g.layout is not torch.strided or is_dtensor(g):
                raise RuntimeError(
                    f"{where}: the grad of a flat param (param {k} of the trainable params) is "
                    "a view into another tensor's memory, as DistributedDataParallel("
                    "gradient_as_bucket_view=True) makes it (or a sparse/sharded grad): flat "
                    "buffers accumulate the grads into their own buffer. Expected "
                    "DistributedDataParallel(..., gradient_as_bucket_view=False) (it then "
                    "copies each all-reduced bucket into the flat grads), or flat_buffers=False"
                )
        with torch.no_grad():
            for k, g in moved:
                self.views[k].copy_(g)
        for k, _ in moved:
            self.inside[k].grad = self.views[k]
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the grad buffers (one op each) and puts every view back as its param's grad,
        whatever ``set_to_none`` says, for the params that still require grad. A param frozen
        since the layout was built (``requires_grad_(False)``) is left as torch's ``zero_grad``
        leaves it (None with ``set_to_none``, else its grad zeroed or None as it was), so the
        next step skips it as torch's does; the layout is then ``stale`` and built again, with
        that param outside, at the next step (so is one with a param unfrozen since)."""
        torch._foreach_zero_(self.grad_buffers)
        self.sparse.clear()
        trainable = [p.requires_grad for p in self.inside]
        if not all(trainable) or any(p.requires_grad for p in self.outside):
            self.stale = True
        if not all(map(is_, map(_GRAD, self.inside), self.views)) or self.stale:
            for p, v, t in zip(self.inside, self.views, trainable):
                if t:
                    if p.grad is not v:
                        p.grad = v
                elif set_to_none:
                    p.grad = None
                elif p.grad is not None and p.grad is not v:  # (the view: zeroed above)
                    _zero_as_torch(p.grad)
        for p in self.outside:  # (frozen when the layout was built: as torch's zero_grad)
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                _zero_as_torch(p.grad)

    def after_per_tensor(self, had_grad: list[bool]) -> None:
        """After a per-parameter step: a segment whose params all had a grad advanced (or held)
        their counts together, so its own step follows them; one with a None grad diverged."""
        for seg in self.segments:
            if seg.state is None or seg.diverged or seg.steps is None:
                continue
            if all(had_grad[m] for m in seg.members):
                seg.state["step"].copy_(seg.steps[0])
                seg.steps_version = _version(seg.steps)  # (advanced by the per-param kernels)
            elif any(had_grad[m] for m in seg.members):
                seg.diverged = True
