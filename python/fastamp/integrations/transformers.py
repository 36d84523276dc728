"""fastamp in the Hugging Face ``Trainer``: its GradScaler, its fused AdamW, clipping folded in.

Change one line::

    from fastamp.integrations.transformers import FastampTrainer

    trainer = FastampTrainer(model=model, args=TrainingArguments(..., fp16=True, max_grad_norm=1.0),
                             train_dataset=ds)          # was: Trainer(...)

What differs from ``Trainer`` (nothing else does):

* the default optimizer (``optim="adamw_torch"`` / ``"adamw_torch_fused"``, the default) is
  :class:`fastamp.optim.AdamW` with the same parameter groups and hyper-parameters; other ``optim``
  choices, ``optimizers=(...)`` and ``optimizer_cls_and_kwargs`` are honoured as given.
* with ``fp16=True`` the accelerator scales with :class:`fastamp.GradScaler` (see
  :mod:`fastamp.integrations.accelerate`; on CPU this also turns on the fp16 autocast that
  accelerate leaves off), and ``max_grad_norm`` clipping goes through ``scaler.clip_grad_norm_``:
  with fastamp's AdamW, folded into the fused step. Skipped (inf/NaN) steps do not advance the LR
  schedule, as with torch's scaler.
* with ``bf16=True`` or neither flag (fp32), not distributed or DDP, ``max_grad_norm`` clipping
  goes through :func:`fastamp.clip_grad_norm_` (the accelerator's ``clip_grad_norm_``, see
  :mod:`fastamp.integrations.accelerate`): with fastamp's AdamW, folded into the fused step. The
  logged ``grad_norm`` is the same total norm, up to rounding. With fastamp's AdamW the grads keep
  their unclipped values until (and after) ``optimizer.step()``: a callback's
  ``on_pre_optimizer_step`` or ``on_optimizer_step`` that reads ``p.grad`` sees unclipped grads
  where the Trainer's own path shows clipped ones.
"""

from __future__ import annotations

from typing import Any

import torch

from fastamp.integrations._deps import require

require("transformers")
require("accelerate")

import transformers  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations import accelerate as _fa_accelerate  # noqa: E402

__all__ = ["FastampTrainer"]

_ADAMW_NAMES = {"adamw_torch", "adamw_torch_fused"}


# (type: ignore[misc]: transformers ships no type information, so its class is Any to mypy)
class FastampTrainer(transformers.Trainer):  # type: ignore[misc]
    """:class:`transformers.Trainer` with fastamp's scaler, AdamW and fused clipping."""

    # transformers' Trainer (set by its __init__)
    accelerator: Any
    args: Any
    optimizer: Any
    optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        scaled = acc.mixed_precision == "fp16" and _fa_accelerate.supports_fastamp_scaler(acc)
        unscaled = (
            acc.mixed_precision in ("bf16", "no")
            and acc.distributed_type in _fa_accelerate.PLAIN_DDP_TYPES
        )
        if scaled:
            _fa_accelerate.install_grad_scaler(acc)
        if scaled or unscaled:
            # The instance accelerate built, given fastamp's clip_grad_norm_ and prepare_optimizer
            # (methods only: the subclass adds no state; its __init__ step was install_grad_scaler,
            # which has nothing to do without fp16).
            acc.__class__ = _fa_accelerate.Accelerator

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optim_name = str(getattr(self.args.optim, "value", self.args.optim))
        if (
            self.optimizer is None
            and self.optimizer_cls_and_kwargs is None
            and optim_name in _ADAMW_NAMES
        ):
            # The Trainer's own hook for a class + kwargs, set for this call only.
            self.optimizer_cls_and_kwargs = (
                fastamp.optim.AdamW,
                {
                    "lr": self.args.learning_rate,
                    "betas": (self.args.adam_beta1, self.args.adam_beta2),
                    "eps": self.args.adam_epsilon,
                },
            )
            try:
                made: torch.optim.Optimizer = super().create_optimizer(model)  # (transformers: Any)
            finally:
                self.optimizer_cls_and_kwargs = None
            return made
        made = super().create_optimizer(model)
        return made
