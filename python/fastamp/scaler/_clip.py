"""GradScaler's clipping and what it reuses (:class:`GradClipping`): ``clip_grad_norm_`` in two passes
(a read-only stats pass, then one write pass or the fused optimizer's own), the read-only inf check
for fused optimizers, and the :class:`fastamp.handoff.GradStats` DDP hands over."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fastamp.handoff import AmpFusedOptimizer, AmpStep, GradStats
from fastamp.scaler import _ops
from fastamp._devices import to_device
from fastamp.scaler._grads import collect_grads


class GradClipping:
    """Mixin of :class:`fastamp.GradScaler` (methods over its own state)."""

    _scale: Tensor | None
    _enabled: bool
    _ddp_stats: GradStats | None
    _per_optimizer_states: Any

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

    def _reuse_ddp_stats(self, optimizer: torch.optim.Optimizer) -> tuple[Tensor, Tensor] | None:
        stats = self._ddp_stats
        if stats is None:
            return None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not stats.current_for(params, self._scale):
            return None
        return stats.found_inf, stats.sum_sq

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # For optimizers that unscale inside their own kernel (fused=True): a read-only inf/NaN
        # check. PyTorch unscales by 1.0 here, rewriting every grad to itself.
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        per_device = collect_grads(optimizer, allow_fp16=True)
        one = torch.ones((), dtype=torch.float32, device=scale.device)
        found: dict[torch.device, Tensor] = {}
        flags: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            for dev, entry in per_device.items():
                found[dev], _, flags[dev] = _ops.grad_stats(entry.grads, to_device(one, dev))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        self._record_flags(optimizer, per_device, flags)
        return found

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
        even for half grads), then one write pass multiplies by ``inv_scale * clip_coef``. The norm is
        returned as a device tensor: nothing syncs with the host. On a step with inf/NaN grads the
        norm is inf/NaN and the following :meth:`step` is skipped, as with PyTorch's recipe.

        Counts as this iteration's ``unscale_`` for ``optimizer`` (calling ``unscale_`` afterwards
        raises, as a second ``unscale_`` would). If ``unscale_`` was already called, only clips.
        """
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(
                "clip_grad_norm_: optimizer must be the torch.optim.Optimizer whose grads to clip, "
                f"got {type(optimizer).__name__}. fastamp clips an optimizer's params, not an "
                "iterable of tensors: expected scaler.clip_grad_norm_(optimizer, max_norm)"
            )
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (max_norm >= 0):
            raise ValueError(
                f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm!r} "
                "(expected e.g. 1.0; inf disables clipping)"
            )
        norm_arg = norm_type
        try:
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            norm_type = math.nan
        if isinstance(norm_arg, bool) or not (norm_type > 0):
            raise ValueError(
                f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_arg!r} "
                "(expected e.g. 2.0, 1.0 or float('inf'))"
            )
        if not self._enabled:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        with self._restore_on_error(optimizer):
            return self._clip_grad_norm(optimizer, scale, float(max_norm), norm_type)

    def _clip_grad_norm(
        self, optimizer: torch.optim.Optimizer, scale: Tensor, max_norm: float, norm_type: float
    ) -> Tensor:
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "clip_grad_norm_() is being called after step(). Expected once per iteration, "
                "between scaler.scale(loss).backward() and scaler.step(optimizer) (after "
                "scaler.update() it may be called again)"
            )
        already_unscaled = state["stage"] is OptState.UNSCALED
        # A fastamp fused optimizer takes the clip coefficient into its own kernel: the grads are
        # only read here (so fp16 grads are fine), and unscaled + clipped in the update pass.
        fused = isinstance(optimizer, AmpFusedOptimizer) and not already_unscaled
        per_device = collect_grads(optimizer, already_unscaled or fused, "clip_grad_norm_")

        if already_unscaled:
            inv_scale = torch.ones((), dtype=torch.float32, device=scale.device)
        else:
            inv_scale = scale.double().reciprocal().float()
        found: dict[torch.device, Tensor] = {}
        flags: dict[torch.device, Tensor] = {}
        pow_sums: list[Tensor] = []
        invs: dict[torch.device, Tensor] = {dev: to_device(inv_scale, dev) for dev in per_device}
        reuse = (
            self._reuse_ddp_stats(optimizer)
            if norm_type == 2.0 and not already_unscaled and len(per_device) == 1
            else None
        )
        with torch.no_grad():
            if reuse is not None:
                # DDP's unpack already read these grads for the inf check and the sum of squares.
                (dev,) = per_device
                found[dev] = to_device(reuse[0], dev)
                pow_sums.append(to_device(reuse[1], scale.device))
            for dev, entry in per_device.items() if reuse is None else ():
                found[dev], pow_sum, flags[dev] = _ops.grad_stats(entry.grads, invs[dev], norm_type)
                pow_sums.append(to_device(pow_sum, scale.device))
            if not pow_sums:
                total_norm = torch.zeros((), dtype=torch.float32, device=scale.device)
            else:
                total = pow_sums[0]
                for p in pow_sums[1:]:
                    total = torch.maximum(total, p) if math.isinf(norm_type) else total + p
                if math.isinf(norm_type) or norm_type == 1.0:
                    total_norm = total
                elif norm_type == 2.0:
                    total_norm = total.sqrt()
                else:
                    total_norm = total.pow(1.0 / norm_type)
            if fused:
                coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
                # The step's scalars but found_inf (summed over devices at step()).
                state["fastamp_clip"] = AmpStep(inv_scale, None, coef)
            else:
                for dev, entry in per_device.items():
                    _ops.clip_unscale_(entry.grads, invs[dev], to_device(total_norm, dev), float(max_norm))
                    self._grads_written()

        if already_unscaled:
            # Keep the inf checks of the earlier unscale_: they saw the grads before clipping.
            prev = state["found_inf_per_device"]
            for dev, f in found.items():
                if dev in prev:
                    prev[dev] = torch.maximum(prev[dev], f)
                else:
                    prev[dev] = f
        else:
            state["found_inf_per_device"] = found
            self._record_flags(optimizer, per_device, flags)
            state["stage"] = OptState.UNSCALED
        return total_norm
