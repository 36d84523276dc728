"""What the scaler remembers of overflows, on the device, and the report it builds from it.

Per optimizer, :func:`record` keeps (in an :class:`OverflowRecord`) the per-parameter inf/NaN
flags of the last step that overflowed, with device ops only (no host sync in the training
step); :func:`report` reads them back (one sync, meant for after a NaN loss) as an
:class:`OverflowReport`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import is_

import torch
from torch import Tensor

from fastamp._library import KeySet, backend_keyset, direct_call_allowed
from fastamp._step import to_device
from fastamp.scaler import _ops
from fastamp.scaler._grads import DeviceGrads

__all__ = [
    "OverflowRecord",
    "OverflowReport",
    "record",
    "record_flags",
    "report",
    "warn_small_scale",
]


@dataclass
class OverflowReport:
    """Which parameters had inf/NaN grads at the most recent overflow.

    ``update`` is the index of the :meth:`GradScaler.update` call (0-based) whose step overflowed, or
    None when no overflow has been seen; ``parameters`` holds parameter names when a model was
    given, else ``"param_groups[g][i]"`` labels of the optimizer.
    """

    update: int | None
    parameters: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.update is not None

    def __str__(self) -> str:
        if self.update is None:
            return "no overflow recorded"
        names = (
            ", ".join(self.parameters)
            if self.parameters
            else "(none: inf/NaN came from outside the grads)"
        )
        return f"overflow at update #{self.update}: non-finite grads in {names}"


class OverflowRecord:
    """Per-optimizer, device-resident record of the last overflow (updated without host syncs):
    ``keys`` the parameter ids, ``places`` their (group, index), ``flags`` one inf/NaN flag per
    parameter, ``update`` the update() index of that overflow (-1: none yet); ``sources`` the
    per-device id lists ``keys`` was made from (a step that hands the same list objects again,
    as a grad replay does, skips rebuilding and comparing ``keys``)."""

    __slots__ = ("keys", "places", "flags", "update", "sources", "repeats")

    def __init__(
        self, keys: tuple[int, ...], places: list[tuple[int, int]], flags: Tensor, update: Tensor
    ):
        self.keys = keys
        self.places = places
        self.flags = flags
        self.update = update
        self.sources: list[list[int]] = []
        # With flat buffers: how many params (of keys, in order) each flag stands for.
        self.repeats: list[int] | None = None


def record(
    records: dict[int, OverflowRecord],
    opt_id: int,
    ids: Sequence[list[int]],
    places: Sequence[list[tuple[int, int]]],
    flags: Tensor,
    found_inf: Tensor,
    update_count: Tensor,
    repeats: list[int] | None = None,
    keyset: KeySet | None = None,
) -> None:
    """Keeps ``flags`` (one per parameter, on ``update_count``'s device) as optimizer
    ``opt_id``'s record when ``found_inf > 0`` (the step overflowed): one device op
    (``fastamp::record_overflow_``, straight to the ``keyset``'s kernel when given), no sync.
    ``ids`` and ``places`` are the parameter ids and (group, index) of each device's grads, in
    the order of ``flags``; with flat buffers a flag stands for ``repeats[k]`` params (None: one
    each)."""
    rec = records.get(opt_id)
    if rec is None or len(rec.sources) != len(ids) or not all(map(is_, rec.sources, ids)):
        keys = tuple(chain.from_iterable(ids))
        # (The same params with another number of flags: a flat-buffer step, one flag per
        # buffer, after a per-parameter one, or the other way round.)
        if rec is None or rec.keys != keys or rec.flags.shape != flags.shape:
            rec = OverflowRecord(
                keys,
                list(chain.from_iterable(places)),
                torch.zeros_like(flags),
                torch.full_like(update_count, -1),
            )
            records[opt_id] = rec
        rec.sources = list(ids)
        rec.repeats = repeats
    _ops.record_overflow_(rec.flags, rec.update, flags, found_inf, update_count, keyset)


def report(
    records: dict[int, OverflowRecord], model: torch.nn.Module | None = None
) -> OverflowReport:
    """The parameters whose grads were inf/NaN at the most recent overflow (syncs)."""
    names: dict[int, str] = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    best: tuple[int, list[str]] | None = None
    for rec in records.values():
        upd = int(rec.update.item())
        if upd < 0:
            continue
        bad = rec.flags.tolist()
        if rec.repeats is not None:
            bad = [b for b, n in zip(bad, rec.repeats) for _ in range(n)]
        params = [
            names.get(k, f"param_groups[{g}][{i}]")
            for k, (g, i), b in zip(rec.keys, rec.places, bad)
            if b
        ]
        if best is None or upd > best[0]:
            best = (upd, params)
        elif upd == best[0]:
            best[1].extend(params)
    if best is None:
        return OverflowReport(None, [])
    return OverflowReport(best[0], best[1])


def record_flags(
    records: dict[int, OverflowRecord],
    opt_id: int,
    entries: Sequence[tuple[DeviceGrads, Tensor]],
    found_inf: Tensor,
    update_count: Tensor,
) -> None:
    """:func:`record` of one optimizer's per-device grads and flags (``entries``, from the inf
    check of its iteration), brought to ``update_count``'s device; device ops only."""
    dev = update_count.device
    keyset = backend_keyset(dev) if direct_call_allowed() else None
    flags = [to_device(f, dev) for _, f in entries]
    repeats = None
    if any(entry.counts is not None for entry, _ in entries):
        repeats = [n for entry, _ in entries for n in entry.counts or [1] * len(entry.grads)]
    record(
        records, opt_id,
        ids=[entry.param_ids for entry, _ in entries],
        places=[entry.places for entry, _ in entries],
        flags=flags[0] if len(flags) == 1 else torch.cat(flags),
        found_inf=to_device(found_inf, dev), update_count=update_count, repeats=repeats,
        keyset=keyset,
    )  # fmt: skip


def warn_small_scale(scale_val: float) -> None:
    """The scaler's one warning when the scale falls below 1 (the grads overflow unscaled)."""
    warnings.warn(
        f"fastamp.GradScaler: the loss scale fell to {scale_val:g} (< 1). Gradients overflow even "
        "unscaled: the loss or some activations are inf/NaN on their own. Check the data and the "
        "learning rate; overflow_report() names the parameters involved. bf16-pretrained models "
        "often overflow in fp16: prefer bf16 autocast for them.",
        RuntimeWarning,
        stacklevel=4,
    )
