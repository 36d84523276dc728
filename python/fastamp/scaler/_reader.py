"""How the scaler's passes get an optimizer's grads (:class:`GradReader`): as the optimizer's
flat buffers when it keeps them (:class:`fastamp.handoff.FlatGrads`), else per parameter through
the :class:`GradPlan` of its last collection while it holds, else collected and checked in full.

One reader serves every producer of a step's control values: :class:`fastamp.GradScaler` keeps
one, and the scaler-free clip (:mod:`fastamp.scaler.clip`) keeps one for all optimizers. It holds
only caches (a plan per optimizer, the last flat hand-off); dropping it changes no result.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fastamp.handoff import AmpFusedOptimizer, FlatGrads
from fastamp.scaler._grads import DeviceGrads, GradPlan, collect_grads, flat_device_grads

_T = TypeVar("_T")


class GradReader:
    """Collects optimizers' grads for the scaler's ops, caching what lets the next step skip
    the per-grad checks (see the module docstring)."""

    def __init__(self) -> None:
        # Each optimizer's grads as the last collection found them, to collect them again with
        # no per-grad checks while nothing they depend on changed.
        self.plans: weakref.WeakKeyDictionary[Any, GradPlan] = weakref.WeakKeyDictionary()
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
        """:func:`collect_grads`, through the optimizer's :class:`GradPlan` while it holds (not
        while torch.compile traces: the plan is host-side bookkeeping a graph need not repeat).
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
            plan = self.plans.get(optimizer)
        except TypeError:  # an optimizer that takes no weak reference: no plan
            return collect_grads(optimizer, allow_fp16, caller)
        if plan is not None:
            per_device = plan.collect(optimizer, allow_fp16, read_only)
            if per_device is not None:
                return per_device
        return self.collect_in_full(optimizer, allow_fp16, caller)

    def collect_in_full(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, caller: str
    ) -> dict[torch.device, DeviceGrads]:
        """:func:`collect_grads`, keeping a new :class:`GradPlan` when the grads allow one."""
        per_device = collect_grads(optimizer, allow_fp16, caller)
        try:
            if GradPlan.plannable(optimizer):
                with self.lock:
                    self.plans[optimizer] = GradPlan(optimizer, per_device)
            else:
                with self.lock:
                    self.plans.pop(optimizer, None)
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
        them. The grads' plan then compares their types only (:meth:`GradPlan.collect`'s
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
