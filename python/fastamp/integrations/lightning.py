"""fastamp in Lightning: a precision plugin with fastamp's scaler and clipping folded into the
fused optimizer step.

Change one line (the precision flag becomes the plugin)::

    from fastamp.integrations.lightning import FastampPrecision

    trainer = L.Trainer(plugins=[FastampPrecision("16-mixed")],  # was: precision="16-mixed"
                        gradient_clip_val=1.0)

(``"bf16-mixed"`` and ``"32-true"`` too: ``plugins=[FastampPrecision("bf16-mixed")]`` for
``precision="bf16-mixed"``.)

and ``configure_optimizers`` may return ``fastamp.optim.AdamW`` (or ``Adam``, ``SGD``) with
``gradient_clip_val``: Lightning's own ``MixedPrecision`` refuses clipping with any optimizer that
unscales inside its step (torch's ``fused=True`` ones and fastamp's), because it cannot unscale
before clipping. Here the clip goes through ``scaler.clip_grad_norm_``: with a fastamp optimizer
the grads are read once (inf check + norm) and unscaled and clipped inside the fused update, with
no host sync; with any other optimizer it is Lightning's recipe (unscale, then clip). With
``"bf16-mixed"`` or ``"32-true"`` there is no scaler and the clip goes through
:func:`fastamp.clip_grad_norm_` over the optimizer's params (Lightning's ``main_params``): with a
fastamp optimizer the grads are only read and the clip coefficient is applied inside the step;
with any other optimizer the grads are clipped in place, as Lightning's
``torch.nn.utils.clip_grad_norm_``.

Under DDP, :class:`FastampDDPStrategy` is Lightning's DDP strategy with
:class:`fastamp.parallel.DistributedDataParallel` as the wrapper. Under FSDP2 (Lightning's
``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``) the plugin works as it is: the
scaler reduces the sharded grads' inf check and norm in one all-reduce (docs/fsdp.md).

What differs from ``MixedPrecision`` (nothing else does): the default scaler is
:class:`fastamp.GradScaler`; ``gradient_clip_algorithm="norm"`` uses ``scaler.clip_grad_norm_``
(fp32 accumulation of the norm: equal to torch's up to rounding); with a fastamp fused optimizer,
grads are still scaled in ``on_before_optimizer_step`` (as with torch's fused optimizers), and
``"value"`` clipping unscales them first (a separate pass, as torch does). In bf16 and fp32,
``gradient_clip_algorithm="norm"`` uses :func:`fastamp.clip_grad_norm_` (equal to torch's up to
rounding). ``on_before_optimizer_step`` runs before the clip in every precision, so it sees
the same grads as with Lightning's plugins; but with a fastamp optimizer the grads are never
written by the clip, so what reads ``p.grad`` after the step (``on_before_zero_grad``,
``on_train_batch_end``, a manual-optimization ``training_step`` between ``self.clip_gradients``
and ``opt.step()``) sees the unclipped grads where Lightning's path leaves clipped ones, and a
grad written between the clip and the step makes the step raise. ``"32-true"`` (no autocast, no
scaler) is this plugin's only addition to ``MixedPrecision``'s choices: Lightning's own fp32
plugin (``Precision``) has no fused clip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastamp.integrations._deps import require

require("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

import fastamp  # noqa: E402

__all__ = ["FastampDDPStrategy", "FastampPrecision"]


def _handles_unscaling(optimizer: Any) -> bool:
    # private-ok: _step_supports_amp_scaling is torch.amp.GradScaler's documented flag for
    # optimizers that unscale themselves (fused=True); Lightning and torch read it the same way.
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# (type: ignore[misc]: lightning ships no type information, so its class is Any to mypy)
class FastampPrecision(MixedPrecision):  # type: ignore[misc]
    """:class:`lightning.pytorch.plugins.precision.MixedPrecision` with :class:`fastamp.GradScaler`
    and fused clipping.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + loss scaling), ``"bf16-mixed"`` (bf16
            autocast, no scaler) or ``"32-true"`` (no autocast, no scaler); without a scaler the
            norm clip is :func:`fastamp.clip_grad_norm_`.
        device: the autocast device (default: ``"cuda"`` if available, else ``"cpu"``).
        scaler: a scaler to use instead of a default ``fastamp.GradScaler(device)`` (e.g. one with
            ``init_scale=`` or ``hysteresis=``); must be a ``fastamp.GradScaler`` for fused clipping.
    """

    # lightning's MixedPrecision (set by its __init__, and its closure helper)
    scaler: Any
    _after_closure: Callable[..., Any]

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, str):
            raise TypeError(
                f"FastampPrecision: device must be a device type string such as 'cuda' or 'cpu', got "
                f"{device!r}"
            )
        if precision == "32-true":
            if scaler is not None:
                raise ValueError(
                    f"FastampPrecision: precision='32-true' uses no scaler, got scaler={scaler!r}"
                )
            # MixedPrecision's state without its check of the precision (autocast: forward_context)
            self.precision, self.device, self.scaler = precision, device, None
        else:
            if scaler is None and precision == "16-mixed":
                scaler = fastamp.GradScaler(device)
            super().__init__(precision, device, scaler)
        #: the total grad norm of the last clip (a device tensor; nothing syncs to produce it)
        self.last_grad_norm: torch.Tensor | None = None

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.precision == "32-true":
            yield  # (Precision's: no autocast)
            return
        with super().forward_context():
            yield

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("FastampPrecision: AMP and the LBFGS optimizer are not compatible")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not _handles_unscaling(optimizer) and not skip_unscaling:
            # Lightning's contract for ordinary optimizers: on_before_optimizer_step sees unscaled
            # grads. clip_grad_norm_ after unscale_ only clips.
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step, then clip_gradients
        if not skip_unscaling:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        return closure_result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Skips MixedPrecision's refusal for optimizers that unscale in step(): the scaler folds
        # the clip into their step (fastamp's) or unscales first (torch's fused ones).
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self.scaler is None or not self.scaler.is_enabled():
            # bf16 / fp32: Lightning's main_params(optimizer) are exactly this optimizer's params
            self.last_grad_norm = fastamp.clip_grad_norm_(optimizer, float(clip_val))
            return
        if not isinstance(self.scaler, fastamp.GradScaler):
            if self.scaler is not None and _handles_unscaling(optimizer):
                self.scaler.unscale_(optimizer)
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        if self.scaler is not None and _handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)  # clamping needs the true values
        super().clip_grad_by_value(optimizer, clip_val)


from lightning.pytorch.strategies import DDPStrategy  # noqa: E402


# (type: ignore[misc]: lightning ships no type information, so its class is Any to mypy)
class FastampDDPStrategy(DDPStrategy):  # type: ignore[misc]
    """:class:`lightning.pytorch.strategies.DDPStrategy` that wraps the model in
    :class:`fastamp.parallel.DistributedDataParallel` (same constructor arguments as Lightning's,
    e.g. ``process_group_backend="gloo"``, ``find_unused_parameters``, ``bucket_cap_mb``) and hands
    its fused inf check + norm to the precision plugin's :class:`fastamp.GradScaler`::

        trainer = L.Trainer(strategy=FastampDDPStrategy(), plugins=[FastampPrecision("16-mixed")])

    Not supported (clear error): manual optimization, and DDP communication hooks."""

    # lightning's DDPStrategy (set by its __init__ and its Strategy bases; its methods)
    _ddp_comm_hook: Any
    _ddp_kwargs: dict[str, Any]
    _model_averaging_period: Any
    lightning_module: Any
    model: Any  # Strategy's property (the wrapped model once set up)
    precision_plugin: Any
    determine_ddp_device_ids: Callable[[], Any]

    def _setup_model(self, model: torch.nn.Module) -> fastamp.parallel.DistributedDataParallel:
        if self._ddp_comm_hook is not None or self._model_averaging_period is not None:
            raise ValueError(
                "FastampDDPStrategy: ddp_comm_hook / model_averaging_period are torch DDP features "
                "that fastamp's DDP does not have; use DDPStrategy for them"
            )
        lm = self.lightning_module
        if lm is not None and not lm.automatic_optimization:
            raise ValueError(
                "FastampDDPStrategy supports automatic optimization only (got "
                "automatic_optimization=False); use DDPStrategy for manual optimization"
            )
        ddp = fastamp.parallel.DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs
        )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, fastamp.GradScaler):
            ddp.register_grad_scaler(scaler)
        return ddp

    def _register_ddp_hooks(self) -> None:
        pass  # comm hooks are refused in _setup_model

    def block_backward_sync(self) -> contextlib.AbstractContextManager[Any]:
        if isinstance(self.model, fastamp.parallel.DistributedDataParallel):
            return self.model.no_sync()
        blocked: contextlib.AbstractContextManager[Any] = super().block_backward_sync()
        return blocked

    def teardown(self) -> None:
        if isinstance(self.model, fastamp.parallel.DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as DDPStrategy does for torch's DDP
        super().teardown()
