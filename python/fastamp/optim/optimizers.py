"""Fused SGD / Adam / AdamW: one multi-tensor kernel per param group that unscales, clips and
skips on overflow inside the update, driven by device tensors only.

Each class subclasses its ``torch.optim`` namesake, so the constructor (and its ValueErrors), the
param groups, ``state_dict()`` layout, ``add_param_group`` and ``torch.optim.lr_scheduler`` work as
with PyTorch; only ``step()`` differs:

* one fused kernel per param group reads each grad once, multiplies it in registers by
  ``inv_scale * clip_coef`` (device tensors handed over by :class:`fastamp.GradScaler`), and updates
  params and state in the same pass;
* on a step whose grads held inf/NaN (``found_inf`` on the device) the kernel writes nothing and the
  step counters do not advance (so Adam's bias correction stays right) -- no host sync decides it;
* ``master_weights=True`` keeps an fp32 copy of fp16/bf16 params (``state["master_param"]``) with
  fp32 optimizer state; the kernel updates the master and writes the half param in the same pass.

``optimizer.stepped`` is a device bool tensor: whether the last ``step()`` updated the params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastamp.optim import _ops  # noqa: F401  (fake kernels for torch.compile)

__all__ = ["SGD", "Adam", "AdamW"]

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    if t is None:
        return None
    return t if t.device == device else t.to(device, non_blocking=True)


def _check_masters(masters: list[Tensor], params: list[Tensor]) -> None:
    # The kernel takes either no master list or one master per param.
    if masters and len(masters) != len(params):
        raise RuntimeError(
            "fastamp.optim: with master_weights=True a param group must not mix float32 "
            "params with float16/bfloat16 ones; put them in separate param groups"
        )


class _FusedStepMixin:
    """What the three optimizers share: the amp-scaling protocol and the group loop."""

    # torch.amp.GradScaler hands such optimizers `grad_scale` / `found_inf` instead of unscaling
    # the grads and syncing to decide whether to call step() (its protocol for fused=True).
    _step_supports_amp_scaling = True
    # fastamp.GradScaler additionally hands over a clip coefficient (see GradScaler.clip_grad_norm_).
    _fastamp_fused = True

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]

    def _fastamp_init(self, master_weights: bool) -> None:
        self._master_weights = bool(master_weights)
        self.stepped: Tensor | None = None
        for group in self.param_groups:
            if group.get("differentiable"):
                raise ValueError(
                    f"fastamp.optim.{type(self).__name__} does not support differentiable=True; "
                    f"use torch.optim.{type(self).__name__}"
                )

    def _check_params(self, group: dict[str, Any]) -> list[Tensor]:
        """Params of the group that have grads, validated before any state is created."""
        name = type(self).__name__
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{name} does not support sparse gradients"
                    + (", please consider SparseAdam instead" if name != "SGD" else "")
                )
            if p.dtype not in _FLOAT_TYPES:
                raise TypeError(
                    f"fastamp.optim.{name}: a parameter has dtype {p.dtype}; the fused kernels take "
                    "float32, float16 and bfloat16 params (use torch.optim for others)"
                )
            if p.grad.dtype != p.dtype:
                raise TypeError(
                    f"fastamp.optim.{name}: a parameter of dtype {p.dtype} has a grad of dtype "
                    f"{p.grad.dtype}; expected the same dtype"
                )
            params.append(p)
        return params

    def _master(self, p: Tensor, state: dict[str, Any]) -> Tensor | None:
        if not self._master_weights or p.dtype == torch.float32:
            return None
        master = state.get("master_param")
        if master is None:
            master = state["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)
        return master

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step. With ``torch.amp.GradScaler``, reads its ``grad_scale``/``found_inf``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = self.__dict__.pop("_fastamp_pending", None)
        if pending is not None:  # from fastamp.GradScaler: (inv_scale, found_inf, clip_coef)
            self._fastamp_step(*pending)
        else:  # torch.amp.GradScaler's protocol for optimizers that unscale themselves
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            self._fastamp_step(inv_scale, found_inf, None)
        return loss

    def _fastamp_step(self, inv_scale: Tensor | None, found_inf: Tensor | None,
                      clip_coef: Tensor | None) -> None:
        stepped = None
        for group in self.param_groups:
            params = self._check_params(group)
            if not params:
                continue
            dev = params[0].device
            scalars = (_on(inv_scale, dev), _on(found_inf, dev), _on(clip_coef, dev))
            self._group_step(group, params, *scalars)
            if stepped is None:
                stepped = (
                    torch.ones((), dtype=torch.bool, device=dev)
                    if found_inf is None
                    else found_inf == 0
                )
        self.stepped = stepped

    @staticmethod
    def _lr(group: dict[str, Any], device: torch.device) -> tuple[float, Tensor | None]:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return 0.0, lr.to(device=device, dtype=torch.float32, non_blocking=True)
        return float(lr), None

    def _step_tensor(self, p: Tensor, state: dict[str, Any], key: str = "step") -> Tensor:
        step = state.get(key)
        if step is None:
            step = state[key] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif step.device != p.device or step.dtype != torch.float32:
            # e.g. a state_dict saved by torch.optim (non-fused keeps steps on the CPU)
            step = state[key] = step.to(device=p.device, dtype=torch.float32)
        return step


class _AdamBase(_FusedStepMixin):
    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        amsgrad = group["amsgrad"]
        grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters = [], [], [], [], [], []
        for p in params:
            state = self.state[p]
            master = self._master(p, state)
            like = master if master is not None else p
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            steps.append(self._step_tensor(p, state))
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_sqs.append(state["max_exp_avg_sq"])
            if master is not None:
                masters.append(master)
        _check_masters(masters, params)
        beta1, beta2 = group["betas"]
        lr, lr_t = self._lr(group, params[0].device)
        torch.ops.fastamp.adam_step_(
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters,
            lr, lr_t, float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(amsgrad), bool(group.get("decoupled_weight_decay", self._decoupled)),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip


class Adam(_AdamBase, torch.optim.Adam):
    """Fused :class:`torch.optim.Adam` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=False) -> None:  # fmt: skip
        torch.optim.Adam.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastamp_init(master_weights)


class AdamW(_AdamBase, torch.optim.AdamW):
    """Fused :class:`torch.optim.AdamW` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False) -> None:  # fmt: skip
        torch.optim.AdamW.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)


class SGD(_FusedStepMixin, torch.optim.SGD):
    """Fused :class:`torch.optim.SGD` (see the module docstring); ``master_weights`` is extra.

    The number of updates each param has had lives on the device (``state["step"]`` is not part of
    PyTorch's SGD state, so it is kept beside it): it tells the kernel when a momentum buffer gets
    its first value, exactly as PyTorch's ``None`` buffer does, even when that step is skipped.
    """

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master_weights=False) -> None:  # fmt: skip
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)
        self._updates: dict[Tensor, Tensor] = {}

    def _updates_of(self, p: Tensor, state: dict[str, Any]) -> Tensor:
        n = self._updates.get(p)
        if n is None:
            # A buffer loaded from a checkpoint has had its first value already.
            first = 0.0 if state.get("momentum_buffer") is None else 1.0
            n = self._updates[p] = torch.full((), first, dtype=torch.float32, device=p.device)
        return n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._updates = {}

    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        momentum = group["momentum"]
        grads, bufs, counts, masters = [], [], [], []
        needs_state = momentum != 0 or self._master_weights
        for p in params:
            # Like torch.optim.SGD, momentum-free SGD keeps no per-param state at all (reading
            # self.state[p] would create an empty entry that shows up in state_dict()).
            state = self.state[p] if needs_state else {}
            master = self._master(p, state)
            counts.append(self._updates_of(p, state))
            if momentum != 0:
                if state.get("momentum_buffer") is None:
                    like = master if master is not None else p
                    state["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            grads.append(p.grad)
            if master is not None:
                masters.append(master)
        _check_masters(masters, params)
        lr, lr_t = self._lr(group, params[0].device)
        torch.ops.fastamp.sgd_step_(
            params, grads, bufs, counts, masters, lr, lr_t, float(group["weight_decay"]),
            float(momentum), float(group["dampening"]), bool(group["nesterov"]),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
