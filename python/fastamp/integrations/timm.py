"""fastamp in timm's training scripts: a loss scaler with timm's ``NativeScaler`` interface, and
fastamp's optimizers in timm's optimizer registry.

Change one line in a timm-style loop (``train.py``: ``loss_scaler = NativeScaler(device=...)``)::

    from fastamp.integrations.timm import NativeScaler   # was: from timm.utils import NativeScaler

    loss_scaler = NativeScaler(device="cuda")
    loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())

It is called, saved and loaded exactly as timm's (``state_dict_key = "amp_scaler"``; the state
dict is the GradScaler's, interchangeable with timm's), and needs no timm import. With
``clip_mode="norm"`` the clip goes through ``fastamp.GradScaler.clip_grad_norm_`` (with a
``fastamp.optim`` optimizer: folded into the fused step); ``"value"`` and ``"agc"`` keep timm's
recipe (unscale, then ``timm.utils.dispatch_clip_grad``).

bf16 and fp32: timm's ``train.py`` builds a loss scaler only for fp16 on CUDA; with bf16 or no AMP
its ``loss_scaler`` is None and it clips with ``timm.utils.dispatch_clip_grad(parameters, ...)``
then ``optimizer.step()``, a path that gets parameters (not the optimizer) and that no fastamp
class is part of, so fastamp cannot fuse it. To have it fused, build the scaler in every
precision, disabled where timm would have none::

    loss_scaler = NativeScaler(device=device.type, enabled=amp_dtype == torch.float16 and args.amp)

A disabled ``NativeScaler`` scales nothing and steps as ``optimizer.step()``; its ``"norm"``
clip of the optimizer's params goes through :func:`fastamp.clip_grad_norm_` (with a
``fastamp.optim`` optimizer: folded into the fused step, the grads keeping their unclipped
values; with another optimizer: clipped in place, as timm's), other clips are timm's.

Optimizers by name: :func:`register_optimizers` adds ``fastamp-adamw``, ``fastamp-adam`` and
``fastamp-sgd`` to timm's registry, so ``create_optimizer_v2(model, opt="fastamp-adamw")`` and
``--opt fastamp-adamw`` work. timm keeps only the part of a name after its last underscore
(``"fastamp_adamw"`` is read as ``"adamw"``: torch's AdamW, silently), so the names use a hyphen,
and :func:`create_optimizer_v2` here refuses underscore spellings of them with a clear error.
:class:`ClipParametersError` is what ``NativeScaler`` raises for ``clip_grad`` without ``parameters``
(timm asserts).

Note: timm 1.0 imports torchvision at ``import timm``; the registry functions need both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import fastamp

__all__ = [
    "ClipParametersError",
    "NativeScaler",
    "OPTIMIZERS",
    "register_optimizers",
    "create_optimizer_v2",
]

#: name in timm's registry -> (fastamp class, has_betas, has_momentum)
OPTIMIZERS: dict[str, tuple[type, bool, bool]] = {
    "fastamp-adamw": (fastamp.optim.AdamW, True, False),
    "fastamp-adam": (fastamp.optim.Adam, True, False),
    "fastamp-sgd": (fastamp.optim.SGD, False, True),
}


def _param_ids(params: Iterable[Any]) -> set[int]:
    ids: set[int] = set()
    for p in params:
        if isinstance(p, dict):  # a param group
            ids.update(id(q) for q in p["params"])
        else:
            ids.add(id(p))
    return ids


class ClipParametersError(AssertionError, ValueError):
    """``clip_grad`` without ``parameters``: timm's NativeScaler asserts it (AssertionError);
    this is one, with a message, and a ValueError as well."""


class NativeScaler:
    """timm's ``NativeScaler`` interface over :class:`fastamp.GradScaler`.

    Args:
        device: the autocast device type (``"cuda"``, ``"cpu"``), as timm's.
        **scaler_kwargs: passed to :class:`fastamp.GradScaler` (``init_scale``, ``hysteresis``, ...).
    """

    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda", **scaler_kwargs: Any) -> None:
        self._scaler = fastamp.GradScaler(device, **scaler_kwargs)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[Any] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            if parameters is None:
                raise ClipParametersError(
                    "NativeScaler: clip_grad needs parameters= (the tensors to clip), as timm's does; "
                    f"got clip_grad={clip_grad!r} and parameters=None"
                )
            params = list(parameters)
            opt_params = [p for g in optimizer.param_groups for p in g["params"]]
            if clip_mode == "norm" and _param_ids(params) == _param_ids(opt_params):
                if self._scaler.is_enabled():
                    self._scaler.clip_grad_norm_(optimizer, float(clip_grad))
                else:  # bf16 / fp32: nothing to unscale
                    fastamp.clip_grad_norm_(optimizer, float(clip_grad))
            else:
                self._scaler.unscale_(optimizer)
                _dispatch_clip_grad(params, clip_grad, clip_mode)
        self._scaler.step(optimizer)
        self._scaler.update()

    @property
    def scaler(self) -> fastamp.GradScaler:
        return self._scaler

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scaler.load_state_dict(state_dict)


def _dispatch_clip_grad(params: list[Any], value: float, mode: str) -> None:
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(params, value)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    else:  # "agc" and anything timm adds later: timm's own dispatcher
        from fastamp.integrations._deps import require

        require("timm")
        from timm.utils import dispatch_clip_grad

        dispatch_clip_grad(params, value, mode=mode)


def check_optimizer_name(opt: str) -> str:
    """Raise if ``opt`` is an underscore spelling of a fastamp optimizer (timm would read only
    the part after the last underscore and silently build torch's optimizer)."""
    if not isinstance(opt, str):
        raise TypeError(f"opt must be an optimizer name (str), got {type(opt).__name__}")
    low = opt.lower()
    if "_" in low and "fastamp" in low:
        parts = low.split("_")
        if parts[0] == "lookahead":
            return opt  # lookahead_fastamp-adamw is fine: timm strips the prefix, keeps the rest
        suggestion = low.replace("_", "-")
        raise ValueError(
            f"opt={opt!r}: timm reads only the part of an optimizer name after its last underscore "
            f"({parts[-1]!r} here), so this would silently create torch's optimizer, not fastamp's. "
            f"Use {suggestion!r} (registered by fastamp.integrations.timm.register_optimizers())"
        )
    return opt


def register_optimizers() -> list[str]:
    """Add fastamp's optimizers to timm's registry; returns the names. Idempotent."""
    from fastamp.integrations._deps import require

    require("timm")
    from timm.optim import OptimInfo, list_optimizers
    from timm.optim._optim_factory import default_registry

    have = set(list_optimizers())
    for name, (cls, has_betas, has_momentum) in OPTIMIZERS.items():
        if name in have:
            continue
        default_registry.register(
            OptimInfo(
                name=name,
                opt_class=cls,
                description=f"fastamp.optim.{cls.__name__} (fused, clip folded in)",
                has_betas=has_betas,
                has_momentum=has_momentum,
            )
        )
    return list(OPTIMIZERS)


def create_optimizer_v2(
    model_or_params: Any, opt: str = "fastamp-adamw", **kwargs: Any
) -> torch.optim.Optimizer:
    """timm's ``create_optimizer_v2`` with fastamp's optimizers registered and underscore
    spellings of them refused (see :func:`check_optimizer_name`)."""
    check_optimizer_name(opt)
    register_optimizers()
    from timm.optim import create_optimizer_v2 as _create

    optimizer: torch.optim.Optimizer = _create(model_or_params, opt=opt, **kwargs)  # (timm: Any)
    return optimizer
