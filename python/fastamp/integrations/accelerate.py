"""fastamp in Hugging Face accelerate: its GradScaler, clipping folded into the fused step.

Change one line::

    from fastamp.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer = accelerator.prepare(model, fastamp.optim.AdamW(model.parameters()))
    ...
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)   # fastamp: stats pass only, clip in the step
    optimizer.step()

What differs from accelerate's own class (nothing else does):

* with ``mixed_precision="fp16"`` the scaler is a :class:`fastamp.GradScaler` (accelerate builds
  torch's, from :class:`accelerate.utils.GradScalerKwargs`, which are honoured here too). On CPU,
  where accelerate silently trains fp16 in fp32 (no autocast, no scaler), this class autocasts to
  fp16 and scales, as on GPUs.
* :meth:`Accelerator.clip_grad_norm_` is fused when the parameters are those of one prepared
  optimizer: through ``scaler.clip_grad_norm_`` with fp16, through :func:`fastamp.clip_grad_norm_`
  with no enabled scaler (``mixed_precision="bf16"`` or ``"no"``; not distributed, or DDP). With a
  ``fastamp.optim`` optimizer the clip is folded into the fused step (the grads are read once for
  inf check + norm and never written); with any other optimizer the grads are clipped in place,
  as accelerate's. It returns the same total norm as accelerate's (a device tensor, torch's dtype),
  equal up to rounding (fp32 accumulation). One difference with a ``fastamp.optim`` optimizer:
  the grads keep their unclipped values between the clip and ``optimizer.step()`` and after it
  (the step applies the clip coefficient in registers); code that reads ``p.grad`` there sees
  unclipped grads, and a grad written between clip and step makes the step raise. In bf16/fp32 a
  clip on an accumulation micro-step (``accelerator.sync_gradients`` False) is accelerate's own.
* ``optimizer.step_was_skipped`` / ``accelerator.optimizer_step_was_skipped`` are right for fused
  fastamp optimizers too (they always enter ``step()`` and skip inside the kernel).

For an ``Accelerator`` you do not construct (e.g. the transformers Trainer's), call
:func:`install_grad_scaler` before ``prepare()``.

With FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) the same holds: accelerate's own
scaler there is a plain ``torch.amp.GradScaler``, and fastamp's reduces the sharded grads' inf
check and norm in one all-reduce (docs/fsdp.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fastamp.integrations._deps import require

require("accelerate")

from accelerate import Accelerator as _Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import fastamp  # noqa: E402
from fastamp.handoff import AmpFusedOptimizer  # noqa: E402

__all__ = ["Accelerator", "clip_grad_norm_", "install_grad_scaler", "supports_fastamp_scaler"]

# Where accelerate's scaler is a plain torch.amp.GradScaler; FSDP (ShardedGradScaler), DeepSpeed,
# Megatron and XLA bring their own. FSDP2 (fsdp_version=2) also takes a plain scaler: see
# supports_fastamp_scaler.
PLAIN_DDP_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def supports_fastamp_scaler(accelerator: _Accelerator) -> bool:
    """Whether ``accelerator`` scales with a plain ``torch.amp.GradScaler``, which fastamp's
    replaces: no distribution, DDP, or FSDP2 (DTensor params: fastamp's scaler reduces their inf
    check and norm over the shards itself). FSDP1's ShardedGradScaler, DeepSpeed, Megatron-LM and
    XLA keep their own."""
    if accelerator.distributed_type in PLAIN_DDP_TYPES:
        return True
    return accelerator.distributed_type == DistributedType.FSDP and bool(accelerator.is_fsdp2)


def install_grad_scaler(
    accelerator: _Accelerator, scaler: torch.amp.GradScaler | None = None
) -> torch.amp.GradScaler:
    """Make ``accelerator`` (``mixed_precision="fp16"``) scale with ``scaler`` (default: a
    :class:`fastamp.GradScaler` built from the accelerator's ``GradScalerKwargs``). Call it before
    ``accelerator.prepare()``: the prepared optimizers take the scaler at that point. Returns the
    scaler. Also turns on fp16 autocast on CPU, which accelerate leaves off."""
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            "install_grad_scaler: the accelerator must use mixed_precision='fp16' (loss scaling is "
            f"for fp16), got mixed_precision={accelerator.mixed_precision!r}"
        )
    if not supports_fastamp_scaler(accelerator):
        raise ValueError(
            "install_grad_scaler: supported with distributed_type NO, MULTI_CPU or MULTI_GPU, or "
            f"FSDP with fsdp_version=2, got {accelerator.distributed_type}: FSDP1, DeepSpeed, "
            "Megatron-LM and XLA manage their own scaler"
        )
    # private-ok: accelerate (1.15, and its main branch) keeps the optimizers prepare() returned only
    # in Accelerator._optimizers, with no public accessor; read, never written.
    if accelerator._optimizers:
        raise RuntimeError(
            "install_grad_scaler: call it before accelerator.prepare(): "
            # private-ok: as above
            f"{len(accelerator._optimizers)} optimizer(s) were already prepared with the old scaler"
        )
    if scaler is None:
        handler = accelerator.scaler_handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        scaler = fastamp.GradScaler(accelerator.device.type, **kwargs)
    elif not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"install_grad_scaler: scaler must be a torch.amp.GradScaler (e.g. fastamp.GradScaler), "
            f"got {type(scaler).__name__}"
        )
    accelerator.scaler = scaler
    accelerator.native_amp = True  # autocast to fp16 in prepare()d models (accelerate: not on CPU)
    return scaler


def _unwrap(opt: Any) -> torch.optim.Optimizer:
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    inner: torch.optim.Optimizer = opt  # (accelerate is untyped: its wrappers' .optimizer is Any)
    return inner


def _owner(accelerator: _Accelerator, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The prepared optimizer whose params with a grad are exactly those of ``params``."""
    wanted = {id(p) for p in params if p.grad is not None}
    for acc_opt in accelerator._optimizers:  # private-ok: see install_grad_scaler
        opt = _unwrap(acc_opt)
        owned = {id(p) for g in opt.param_groups for p in g["params"] if p.grad is not None}
        if owned == wanted:
            return opt
    return None


def clip_grad_norm_(
    accelerator: _Accelerator,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """``accelerator.clip_grad_norm_``, fused when ``parameters`` are exactly one prepared
    optimizer's: through ``fastamp.GradScaler.clip_grad_norm_`` when the scaler is fastamp's and
    enabled (fp16), through :func:`fastamp.clip_grad_norm_` when there is no enabled scaler (bf16,
    fp32) on a step that syncs gradients; otherwise accelerate's own (unscale +
    ``torch.nn.utils.clip_grad_norm_``)."""
    params = list(parameters)
    scaler = accelerator.scaler
    if isinstance(scaler, fastamp.GradScaler) and scaler.is_enabled():
        if supports_fastamp_scaler(accelerator):
            opt = _owner(accelerator, params)
            if opt is not None:
                return scaler.clip_grad_norm_(opt, max_norm, norm_type)
    elif (
        (scaler is None or not scaler.is_enabled())
        and accelerator.mixed_precision in ("no", "bf16", "fp16")  # (fp8 recipes: their own)
        and accelerator.distributed_type in PLAIN_DDP_TYPES
        # On an accumulation micro-step accelerate's optimizer.step() does nothing, and the next
        # backward would write the grads this clip measured (refused by a fastamp step).
        and accelerator.sync_gradients
        # DTensor grads (tensor parallelism) keep accelerate's mesh-aware clip.
        and all(p.grad is None or type(p.grad) is torch.Tensor for p in params)
    ):
        opt = _owner(accelerator, params)
        if opt is not None:
            return fastamp.clip_grad_norm_(opt, max_norm, norm_type)
    norm: torch.Tensor = _Accelerator.clip_grad_norm_(accelerator, params, max_norm, norm_type)
    return norm


# (type: ignore[misc]: accelerate ships no type information, so its class is Any to mypy)
class _FastampAcceleratedOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """AcceleratedOptimizer whose ``step_was_skipped`` also sees the skips of fused fastamp
    optimizers: those always enter ``optimizer.step()`` (the kernel skips on inf/NaN, no host sync),
    which accelerate's own check takes for "not skipped". The flag is this class's own; accelerate's
    (read through ``super().step_was_skipped``) is left to accelerate."""

    # set by accelerate's AcceleratedOptimizer.__init__
    gradient_state: Any
    scaler: Any

    # A class default: instances get this class by __class__ assignment, so no __init__ runs.
    _fused_step_skipped = False

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        super().step(closure)
        if self.gradient_state.sync_gradients:  # a real step: the flag describes it
            self._fused_step_skipped = (
                isinstance(self.scaler, fastamp.GradScaler)
                and self.scaler.is_enabled()
                and isinstance(_unwrap(self), AmpFusedOptimizer)
                and bool(self.scaler.last_step_skipped())
            )

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped: by accelerate's check (the optimizer's step
        was not entered) or by a fused fastamp optimizer's kernel (found inf/NaN)."""
        return self._fused_step_skipped or super().step_was_skipped


# (type: ignore[misc]: accelerate ships no type information, so its class is Any to mypy)
class Accelerator(_Accelerator):  # type: ignore[misc]
    """:class:`accelerate.Accelerator` with :class:`fastamp.GradScaler` for fp16 and fastamp's
    fused clipping; same constructor and methods (see the module docstring for what differs)."""

    # accelerate's Accelerator (properties)
    distributed_type: Any
    mixed_precision: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mixed_precision == "fp16" and supports_fastamp_scaler(self):
            install_grad_scaler(self)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:
            # A fresh wrapper built by accelerate; the subclass only adds step()'s overflow flag.
            prepared.__class__ = _FastampAcceleratedOptimizer
        return prepared

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        return clip_grad_norm_(self, parameters, max_norm, norm_type)
