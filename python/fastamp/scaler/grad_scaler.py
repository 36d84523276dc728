"""``fastamp.GradScaler``: a drop-in ``torch.amp.GradScaler`` backed by fused C++/CUDA ops.

It *is* a ``torch.amp.GradScaler`` (a subclass), with the same constructor, methods, per-optimizer
state machine, exceptions and ``state_dict``; scripts and libraries that type-check the scaler
accept it unchanged. What changes underneath:

* unscaling takes every grad of a device in one multi-tensor launch, whatever the dtypes (PyTorch
  launches once per dtype, and its CUDA kernel has no bfloat16);
* the inf/NaN check for optimizers that unscale themselves (``fused=True``) is a read-only pass
  (PyTorch multiplies every grad by 1.0 and writes it back);
* ``step`` reads the inf flags back with one host sync in total (PyTorch: one per device);
* :meth:`clip_grad_norm_` replaces ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``: one read-only
  stats pass (inf check + norm) and one write pass (unscale and clip together);
* the scale update runs on the device with optional hysteresis and bounds;
* diagnostics: :meth:`last_step_skipped` (a device tensor, no sync) and :meth:`overflow_report`.

One concern in one file, the scaler's state machine: :class:`GradScaler`. What it keeps of each
optimizer's iteration and its all-or-nothing rule are in :mod:`fastamp.scaler._iteration`; the
clip's arithmetic (:mod:`fastamp.scaler._clip`) and the state_dict checks are functions it calls
with explicit inputs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from fastamp._library import backend_keyset, direct_call_allowed
from fastamp._step import to_device
from fastamp.handoff import AmpFusedOptimizer, AmpStep, GradStats
from fastamp.scaler import _ops, _state, diagnostics
from fastamp.scaler._clip import (
    check_clip_arguments,
    inf_flags,
    norm_reader,
    ones,
    unscale,
    unscale_and_clip,
)
from fastamp.scaler._grads import DeviceGrads, GradReader
from fastamp.scaler._iteration import ClipStep, OptimizerIteration, RestoreOnError, Transaction
from fastamp.scaler._validation import (
    check_backoff_factor,
    check_bounds,
    check_growth_factor,
    check_growth_interval,
    check_hysteresis,
    check_initialised,
    check_new_scale,
    check_not_meta,
    check_scale,
    no_inf_checks,
)
from fastamp.scaler.clip import clip_grad_norm_
from fastamp.scaler.diagnostics import OverflowReport

__all__ = ["GradScaler", "OptState", "OverflowReport"]


def _inverse(scale: Tensor) -> Tensor:
    """``1 / scale`` in float32: the bits of torch's ``scale.double().reciprocal().float()`` in
    one op instead of three (a quotient rounded to double and then to float is the quotient
    rounded to float: 53 >= 2 * 24 + 2 bits, so the double rounding is innocuous)."""
    return torch.reciprocal(scale)


class GradScaler(torch.amp.GradScaler):
    """Drop-in replacement for :class:`torch.amp.GradScaler`.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in PyTorch.
        hysteresis: number of overflows tolerated before the scale backs off (Megatron-LM's
            hysteresis); reset by each growth. ``1`` (default) is PyTorch's behaviour.
        min_scale: the scale never backs off below this (default: no bound, as PyTorch).
        max_scale: the scale never grows above this (default: no bound, as PyTorch; the scale
            never grows to inf either way).
    """

    # torch.amp.GradScaler's (set by its __init__ and its lazy init)
    _scale: Tensor | None
    _growth_tracker: Tensor | None
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _enabled: bool

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
    ) -> None:
        super().__init__(
            device, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled,
        )  # fmt: skip
        if self._enabled:
            # After PyTorch's own checks, so its AssertionErrors come first, as with torch.amp.
            check_scale(init_scale, "GradScaler", "init_scale")
            check_growth_factor(growth_factor, "GradScaler", "growth_factor")
            check_backoff_factor(backoff_factor, "GradScaler", "backoff_factor")
            check_growth_interval(growth_interval, "GradScaler", "growth_interval")
        check_hysteresis(hysteresis, "GradScaler", "hysteresis")
        lo, hi = check_bounds(min_scale, max_scale, init_scale if self._enabled else None)
        self._hysteresis = hysteresis
        self._min_scale = lo
        self._max_scale = hi
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: Tensor | None = None
        # The last step's inf flags summed (its skip), and `> 0` of it once read.
        self._last_found: Tensor | None = None
        self._last_skipped: Tensor | None = None
        self._update_count: Tensor | None = None
        self._diag: dict[int, diagnostics.OverflowRecord] = {}
        self._warned_small_scale = False
        self._ddp_stats: GradStats | None = None
        # fastamp's per-iteration record of each optimizer (beside PyTorch's
        # _per_optimizer_states, which keeps PyTorch's keys only), and the call in progress.
        self._iterations: dict[int, OptimizerIteration] = {}
        self._transaction: Transaction | None = None
        # How the passes get each optimizer's grads (with the caches that skip their checks).
        self._reader = GradReader()

    # ------------------------------------------------------------------ lazy state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=dev
        )
        self._update_count = torch.zeros((), dtype=torch.int64, device=dev)

    def _ensure_aux(self) -> tuple[Tensor, Tensor]:
        # States loaded through __setstate__/load_state_dict before scale() have scale but may lack
        # the auxiliary tensors; create them next to the scale.
        assert self._scale is not None
        if self._hysteresis_tracker is None:
            self._hysteresis_tracker = torch.full(
                (), self._init_hysteresis_tracker, dtype=torch.int32, device=self._scale.device
            )
        if self._update_count is None:
            self._update_count = torch.zeros((), dtype=torch.int64, device=self._scale.device)
        return self._hysteresis_tracker, self._update_count

    def scale(self, outputs: Any) -> Any:
        if self._enabled:
            check_not_meta(outputs)
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # PyTorch's unscale_, except that an error leaves the scaler as it was.
        if not self._enabled:
            return
        with self._restore_on_error(optimizer):
            super().unscale_(optimizer)

    # ------------------------------------------------------------------ grads
    def _record_flags(
        self,
        optimizer: torch.optim.Optimizer,
        per_device: dict[torch.device, DeviceGrads],
        flags: dict[torch.device, Tensor],
    ) -> None:
        self._iteration(optimizer).flags = [(per_device[d], flags[d]) for d in flags]

    def _iteration(self, optimizer: torch.optim.Optimizer) -> OptimizerIteration:
        return self._iterations.setdefault(id(optimizer), OptimizerIteration())

    def _restore_on_error(self, optimizer: torch.optim.Optimizer) -> RestoreOnError:
        """The call inside, all or nothing for the optimizer's per-iteration state (see
        :class:`Transaction`)."""
        tx = self._transaction = Transaction(
            self._per_optimizer_states, self._iterations, id(optimizer), self._transaction
        )
        return RestoreOnError(tx, self._close_transaction)

    def _close_transaction(self, tx: Transaction, failed: bool) -> None:
        if failed:
            tx.undo(self._per_optimizer_states)
        self._transaction = tx.outer

    def _grads_written(self) -> None:
        if self._transaction is not None:
            self._transaction.grads_written()

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's per-optimizer record (stage, inf flags), made on first use as torch's
        ``defaultdict`` makes it, but stored explicitly: torch.compile's trace of a missing
        ``defaultdict`` key does not keep the entry it makes."""
        states = self._per_optimizer_states
        key = id(optimizer)
        state = states.get(key)
        if state is None:  # torch's _refresh_per_optimizer_state(), as a literal dynamo traces
            state = states[key] = {"stage": OptState.READY, "found_inf_per_device": {}}
        return state

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        """torch's check, with torch's messages (``scale()`` must have made the scale and the
        growth tracker), written here because torch.compile does not trace into
        ``torch.amp.GradScaler``'s own methods."""
        return check_initialised(self._scale, self._growth_tracker, funcname)

    def _collect(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, caller: str = "unscale_"
    ) -> dict[torch.device, DeviceGrads]:
        return self._reader.collect(optimizer, allow_fp16, caller)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, Tensor]:
        per_device = self._collect(optimizer, allow_fp16)
        with torch.no_grad():
            found, flags = unscale(per_device, inv_scale, found_inf, self._grads_written)
        self._record_flags(optimizer, per_device, flags)
        return found

    # (type: ignore[override]: torch annotates dict[str, Any], but its own implementation returns
    # what _unscale_grads_ returns, the flags by device, as this one does)
    def _check_inf_per_device(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, Tensor]:
        # For optimizers that unscale inside their own kernel (fused=True): a read-only inf/NaN
        # check. PyTorch unscales by 1.0 here, rewriting every grad to itself.
        self._check_scale_growth_tracker("_check_inf_per_device")
        with torch.no_grad():
            per_device, (found, flags) = self._reader.read(optimizer, "unscale_", inf_flags)
        self._optimizer_state(optimizer)["found_inf_per_device"] = found
        self._record_flags(optimizer, per_device, flags)
        return found

    # ------------------------------------------------------------------ clipping
    def current_scale(self) -> Tensor | None:
        """The scale as a device tensor (no host sync), or None before the first ``scale()`` /
        when disabled. fastamp extra: :class:`fastamp.parallel.DistributedDataParallel` unscales
        the sum of squares it measures with it."""
        return self._scale if self._enabled else None

    def note_grad_stats(self, stats: GradStats) -> None:
        """fastamp extra: takes a :class:`fastamp.handoff.GradStats` (from
        :class:`fastamp.parallel.DistributedDataParallel`, which measured the all-reduced grads
        while unpacking them). ``clip_grad_norm_`` reuses it instead of reading the grads again
        only while ``stats.current_for(params, scale)`` (same grads, unwritten since, same scale);
        ``update()`` drops it."""
        if not isinstance(stats, GradStats):
            raise TypeError(
                f"GradScaler.note_grad_stats: stats must be a fastamp.handoff.GradStats, got "
                f"{type(stats).__name__}"
            )
        self._ddp_stats = stats

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> Tensor:
        """Unscale and clip the optimizer's grads; return the total norm of the *unscaled* grads.

        Equivalent to ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``, but in two passes over the
        grads instead of four or more: a read-only pass finds inf/NaN and accumulates the norm (fp32,
        even for half grads), then one write pass multiplies by ``inv_scale * clip_coef`` (for a
        fastamp.optim optimizer, its own update pass does). The norm is returned as a device
        tensor: nothing syncs with the host. On a step with inf/NaN grads the norm is inf/NaN and
        the following :meth:`step` is skipped, as with PyTorch's recipe.

        Counts as this iteration's ``unscale_`` for ``optimizer`` (calling ``unscale_`` afterwards
        raises, as a second ``unscale_`` would). If ``unscale_`` was already called, only clips.
        """
        norm = check_clip_arguments(optimizer, max_norm, norm_type)
        if not self._enabled:  # no scaling: the scaler-free fused clip (torch's result)
            return clip_grad_norm_(optimizer, max_norm, norm_type)
        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        with self._restore_on_error(optimizer) as tx:
            return self._clip_grad_norm(optimizer, scale, float(max_norm), norm, tx)

    def _clip_grad_norm(
        self,
        optimizer: torch.optim.Optimizer,
        scale: Tensor,
        max_norm: float,
        norm_type: float,
        tx: Transaction,
    ) -> Tensor:
        state = self._optimizer_state(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "clip_grad_norm_() is being called after step(). Expected once per iteration, "
                "between scaler.scale(loss).backward() and scaler.step(optimizer) (after "
                "scaler.update() it may be called again)"
            )
        already_unscaled = state["stage"] is OptState.UNSCALED
        pending = self._iteration(optimizer).clip if already_unscaled else None
        if pending is not None:
            # A second clip in this iteration, after one whose write pass was left to the fused
            # step: that pass is made now (unscale and clip, as the first call would have made
            # it for a torch optimizer), so this call clips the grads torch's recipe would see
            # and the step takes them as they are.
            with torch.no_grad():
                per_device = self._collect(optimizer, True, "clip_grad_norm_")
                invs = {dev: to_device(pending.inv_scale, dev) for dev in per_device}
                unscale_and_clip(
                    per_device, invs, pending.total_norm, pending.max_norm, tx.grads_written
                )
            self._iteration(optimizer).clip = None
        # A fastamp fused optimizer takes the clip coefficient into its own kernel: the grads are
        # only read here (so fp16 grads are fine), and unscaled + clipped in the update pass.
        fused = isinstance(optimizer, AmpFusedOptimizer) and not already_unscaled
        inv_scale = ones(scale.device) if already_unscaled else _inverse(scale)
        reuse = None
        stats = self._ddp_stats
        if norm_type == 2.0 and not already_unscaled and stats is not None:
            # DDP's unpack already read these grads for the inf check and the sum of squares.
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if stats.current_for(params, self._scale):
                reuse = (stats.found_inf, stats.sum_sq)
        read = norm_reader(inv_scale, norm_type, max_norm, scale.device, reuse)

        with torch.no_grad():
            if fused:  # the grads are only read here: their replay leaves the checks to the op
                per_device, (found, flags, total_norm, coef) = self._reader.read(
                    optimizer, "clip_grad_norm_", read
                )
            else:
                per_device = self._collect(optimizer, already_unscaled, "clip_grad_norm_")
                found, flags, total_norm, coef = read(per_device)
            if fused:  # the step's scalars but found_inf (summed over devices at step())
                self._iteration(optimizer).clip = ClipStep(inv_scale, coef, total_norm, max_norm)
            else:
                invs = {dev: to_device(inv_scale, dev) for dev in per_device}
                unscale_and_clip(per_device, invs, total_norm, max_norm, tx.grads_written)
        if already_unscaled:
            # Keep the inf checks of the earlier unscale_: they saw the grads before clipping.
            prev = state["found_inf_per_device"]
            for dev, f in found.items():
                prev[dev] = torch.maximum(prev[dev], f) if dev in prev else f
        else:
            state["found_inf_per_device"] = found
            self._record_flags(optimizer, per_device, flags)
            state["stage"] = OptState.UNSCALED
        return total_norm

    # ------------------------------------------------------------------ step / update
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> float | None:
        found = self._found_total(id(optimizer), optimizer_state)
        # One host sync for every device (PyTorch: one .item() per device); the scale rides along
        # so the "scale below 1" warning costs nothing extra.
        assert self._scale is not None  # step() checked it (_check_scale_growth_tracker)
        found_val, scale_val = torch.stack([found, self._scale.to(found.device)]).tolist()
        self._maybe_warn_scale(scale_val)
        if not found_val:
            retval: float | None = optimizer.step(*args, **kwargs)  # a closure's loss, or None
            return retval
        return None

    def _found_total(self, key: int, optimizer_state: dict[str, Any]) -> Tensor:
        """The inf flags of optimizer ``id(optimizer) == key`` summed over devices, on the scale's
        device: computed once per iteration (step, last_step_skipped and update all need it, and
        its inputs no longer change once step() has begun)."""
        record = self._iterations.setdefault(key, OptimizerIteration())
        if record.found_total is None:
            assert self._scale is not None
            values = [
                to_device(v, self._scale.device)
                for v in optimizer_state["found_inf_per_device"].values()
            ]
            total = values[0]
            for v in values[1:]:
                total = total + v
            record.found_total = total
        return record.found_total

    def _skipped_if(self, found: Tensor) -> None:
        """The last step skipped iff ``found > 0``: kept as ``found`` (the inf flags summed, not
        written again), the compare made when :meth:`last_step_skipped` is first read."""
        self._last_found = found
        self._last_skipped = None

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        if not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        if isinstance(optimizer, AmpFusedOptimizer):
            with self._restore_on_error(optimizer):
                return self._fused_step(optimizer, *args, **kwargs)
        with self._restore_on_error(optimizer):
            try:
                retval = super().step(optimizer, *args, **kwargs)
            except AssertionError as e:
                if str(e) == "No inf checks were recorded for this optimizer.":
                    raise no_inf_checks(optimizer) from None  # torch's, saying why
                raise
        if self._enabled:
            state = self._optimizer_state(optimizer)
            if state["found_inf_per_device"]:
                self._skipped_if(self._found_total(id(optimizer), state))
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
    ) -> float | None:
        """step() for fastamp.optim optimizers: hand inv_scale, found_inf and the clip coefficient
        to the fused kernel, which skips on overflow by itself. No host sync, and the grads are
        read twice in all (stats pass + update) and never written."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._optimizer_state(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        record = self._iteration(optimizer)
        clip, record.clip = record.clip, None
        if clip is not None:  # clip_grad_norm_ ran the stats pass; grads are still scaled
            inv_scale, coef = clip.inv_scale, clip.clip_coef
        elif state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            inv_scale, coef = _inverse(scale), None
        else:  # unscale_ already rewrote the grads
            inv_scale, coef = None, None
        if not state["found_inf_per_device"]:
            raise no_inf_checks(optimizer)
        found = self._found_total(id(optimizer), state)
        assert isinstance(optimizer, AmpFusedOptimizer)  # step() calls this only for them
        # Handed over as torch's scaler hands grad_scale / found_inf to its fused optimizers: a
        # visible attribute of the optimizer, read by its step() (AmpFusedOptimizer.amp_step),
        # here for this one call only (nothing stays behind, whether step() ran or raised).
        # Through optimizer.step() (not a private entry point), so wrappers such as the LR
        # schedulers' step counting see every step. PyTorch returns what optimizer.step returns
        # (a closure's loss) for optimizers that handle the scaling themselves.
        optimizer.amp_step = AmpStep(inv_scale, found, coef)
        try:
            retval: float | None = optimizer.step(*args, **kwargs)
        finally:
            vars(optimizer).pop("amp_step", None)
        state["stage"] = OptState.STEPPED
        self._skipped_if(found)
        return retval

    def update(self, new_scale: float | Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            self._check_scale_growth_tracker("update")  # PyTorch's error first
            new_scale = check_new_scale(new_scale)
            super().update(new_scale)
            self._iterations = {}
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        hysteresis_tracker, update_count = self._ensure_aux()
        found_infs = [
            self._found_total(key, state)
            for key, state in self._per_optimizer_states.items()
            if state["found_inf_per_device"]
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = found_infs[0]
        for f in found_infs[1:]:
            found = found + f
        _ops.update_scale_(
            scale, growth_tracker, hysteresis_tracker, found, self._growth_factor,
            self._backoff_factor, self._growth_interval, self._hysteresis, self._min_scale,
            self._max_scale, backend_keyset(scale.device) if direct_call_allowed() else None,
        )  # fmt: skip
        self._record_overflow(update_count)
        update_count.add_(1)
        self._ddp_stats = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._iterations = {}

    def _record_overflow(self, update_count: Tensor) -> None:
        """Keeps, per optimizer, the flags of its last overflowing step; device ops only."""
        for opt_id, state in self._per_optimizer_states.items():
            record = self._iterations.get(opt_id)
            if record is not None and record.flags and state["found_inf_per_device"]:
                found = self._found_total(opt_id, state)
                diagnostics.record_flags(self._diag, opt_id, record.flags, found, update_count)

    # ------------------------------------------------------------------ state
    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's five entries; plus the hysteresis/bounds entries only when they are in use,
        so the dict of a default-configured scaler is exactly PyTorch's."""
        out = super().state_dict()
        if self._enabled:
            out.update(
                _state.extra_entries(
                    self._hysteresis, self._min_scale, self._max_scale,
                    self._get_hysteresis_tracker(),
                )
            )  # fmt: skip
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts dicts from ``torch.amp.GradScaler`` and from ``fastamp.GradScaler``; every
        entry is checked before anything changes."""
        if not self._enabled:
            return
        _state.check_loadable(state_dict)
        super().load_state_dict(state_dict)
        if "hysteresis" in state_dict:
            self._hysteresis = int(state_dict["hysteresis"])
            self._min_scale = float(state_dict.get("min_scale", 0.0))
            self._max_scale = float(state_dict.get("max_scale", math.inf))
        tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        self._init_hysteresis_tracker = tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(tracker)

    def __getstate__(self) -> dict[str, Any]:
        tracker = self._get_hysteresis_tracker() if self._enabled else None
        return _state.pickled(super().__getstate__(), self._enabled, tracker)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(_state.unpickled(state))

    # ------------------------------------------------------------------ diagnostics
    def in_iteration(self) -> bool:
        """fastamp extra: True between an iteration's first ``unscale_`` / ``clip_grad_norm_`` /
        ``step`` and its ``update()`` (when a checkpoint of the scaler would be half a step)."""
        if not self._enabled:  # a disabled scaler has no per-optimizer state (as torch's)
            return False
        return any(
            state["stage"] is not OptState.READY for state in self._per_optimizer_states.values()
        )

    def last_step_skipped(self) -> Tensor:
        """A device bool tensor: did the most recent :meth:`step` skip ``optimizer.step()``?

        Reading it does not sync until you turn it into a Python bool. False before any step and
        when the scaler is disabled.
        """
        if self._last_skipped is None and self._last_found is not None:
            self._last_skipped = self._last_found > 0
        if self._last_skipped is not None:
            return self._last_skipped
        scale = getattr(self, "_scale", None)
        dev = scale.device if scale is not None else torch.device("cpu")
        return torch.zeros((), dtype=torch.bool, device=dev)

    def overflow_report(self, model: torch.nn.Module | None = None) -> OverflowReport:
        """Names the parameters whose grads were inf/NaN at the most recent overflow.

        Pass the model to get parameter names (``"encoder.layer.0.weight"``); otherwise parameters
        are labelled by their place in the optimizer (``"param_groups[0][3]"``). This syncs with the
        device (it is a diagnostic, meant for after a NaN loss, not for every step).
        """
        return diagnostics.report(self._diag, model)

    def _maybe_warn_scale(self, scale_val: float) -> None:
        if scale_val < 1.0 and not self._warned_small_scale:
            self._warned_small_scale = True
            diagnostics.warn_small_scale(scale_val)

    def set_growth_factor(self, new_factor: float) -> None:
        super().set_growth_factor(
            check_growth_factor(new_factor, "GradScaler.set_growth_factor", "new_factor")
        )

    def set_backoff_factor(self, new_factor: float) -> None:
        super().set_backoff_factor(
            check_backoff_factor(new_factor, "GradScaler.set_backoff_factor", "new_factor")
        )

    def set_growth_interval(self, new_interval: int) -> None:
        super().set_growth_interval(
            check_growth_interval(new_interval, "GradScaler.set_growth_interval", "new_interval")
        )

    def get_scale(self) -> float:
        value = super().get_scale()
        if self._enabled:
            self._maybe_warn_scale(value)
        return value
