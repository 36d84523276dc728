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

from fastamp.handoff import AmpFusedOptimizer, take
from fastamp.optim import _ops, lowbit
from fastamp.optim._layout import grad_like, kernel_view, on_device
from fastamp.optim._lowbit_step import LowbitAdamMixin, LowbitSgdMixin
from fastamp.optim._state_dict import StateDictChecks
from fastamp.optim._step_checks import StepChecks

__all__ = ["SGD", "Adam", "AdamW"]


class _FusedStepMixin(StepChecks, StateDictChecks, AmpFusedOptimizer):
    """What the three optimizers share: the amp-scaling protocol and the group loop.

    As :class:`fastamp.handoff.AmpFusedOptimizer`s they take from :class:`fastamp.GradScaler` an
    :class:`fastamp.handoff.AmpStep` (inv_scale, found_inf and a clip coefficient), and from
    torch.amp.GradScaler its ``grad_scale`` / ``found_inf`` (its protocol for fused=True)."""

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

    # Per-element state the kernel reads and writes (set by each optimizer), and the group
    # hyperparameters a loaded state_dict must carry (those PyTorch does not default in
    # __setstate__; without them the step fails with a KeyError after the load has replaced
    # the state).
    _ELEMENTWISE: tuple[str, ...] = ()
    _GROUP_KEYS: tuple[str, ...] = ()

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE

    def _master(self, p: Tensor, state: dict[str, Any], new: dict[str, Any]) -> Tensor | None:
        """The fp32 master of ``p`` (with ``master_weights=True``); a new one goes into ``new``,
        which the caller commits to the state only once the kernel has run."""
        if not self._master_weights or p.dtype == torch.float32:
            return None
        master = state.get("master_param")
        if master is None:
            master = new["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)
        return master

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step. With ``torch.amp.GradScaler``, reads its ``grad_scale``/``found_inf``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        amp = take(self)
        if amp is not None:  # from fastamp.GradScaler
            self._fastamp_step(amp.inv_scale, amp.found_inf, amp.clip_coef)
        else:  # torch.amp.GradScaler's protocol for optimizers that unscale themselves
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            self._fastamp_step(inv_scale, found_inf, None)
        return loss

    def _fastamp_step(self, inv_scale: Tensor | None, found_inf: Tensor | None,
                      clip_coef: Tensor | None) -> None:
        # Every group is checked before the first one is stepped, and a group's new state is
        # committed only after its kernel ran: an error leaves params, grads and state as they were
        # (a retry then steps every group once).
        checked = [(g, group, *self._check_params(g, group)) for g, group in enumerate(self.param_groups)]
        self._check_shared_memory(checked)
        stepped = None
        for g, group, params, places in checked:
            if not params:
                continue
            dev = params[0].device
            scalars = (on_device(inv_scale, dev), on_device(found_inf, dev), on_device(clip_coef, dev))
            try:
                self._group_step(group, params, *scalars)
            except (RuntimeError, TypeError, ValueError) as e:
                raise self._kernel_error(e, g, places) from e
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

    def _step_tensor(self, p: Tensor, state: dict[str, Any], new: dict[str, Any],
                     key: str = "step") -> Tensor:
        step = state.get(key)
        if step is None:
            step = new[key] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif not isinstance(step, Tensor):  # a number (accepted by the checks, as by PyTorch)
            step = new[key] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.device != p.device or step.dtype != torch.float32 or step.dim() != 0:
            # e.g. a state_dict saved by torch.optim (non-fused keeps steps on the CPU)
            step = new[key] = step.to(device=p.device, dtype=torch.float32).reshape(())
        return step

    def _commit(self, params: list[Tensor], news: list[dict[str, Any]],
                staged: list[tuple[Tensor, Tensor]]) -> None:
        """After the kernel: copy staged params back and add the state the step created."""
        for p, kp in staged:
            p.copy_(kp)
        for p, new in zip(params, news):
            if new:
                self.state[p].update(new)


class _AdamBase(LowbitAdamMixin, _FusedStepMixin):
    _ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE if group.get("amsgrad") else self._ELEMENTWISE[:2]

    def _required_state(self, state, group) -> tuple[str, ...]:
        if "exp_avg" not in state:
            return ()
        return ("exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg_sq",)

    def _needs_step(self, state) -> bool:
        return len(state) > 0  # PyTorch's Adam.__setstate__ reads it (KeyError after the load)

    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        low = [p for p in params if self._lowbit_format(group, p) != "float32"]
        if low:
            self._check_lowbit_group(group)
            rest = [p for p in params if self._lowbit_format(group, p) == "float32"]
        else:
            rest = params
        if rest:
            self._full_step(group, rest, inv_scale, found_inf, clip_coef)
        if low:
            self._lowbit_step(group, low, inv_scale, found_inf, clip_coef)

    def _full_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        amsgrad = group["amsgrad"]
        kparams, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters = [], [], [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        for p in params:
            state = self.state.get(p) or {}  # .get: no entry is created before the kernel ran
            new: dict[str, Any] = {}
            kp = kernel_view(p)
            if kp is not p:
                staged.append((p, kp))
            master = self._master(p, state, new)
            like = master if master is not None else kp
            if isinstance(state.get("exp_avg"), Tensor) and state["exp_avg"].dtype != like.dtype:
                # Moments of another precision (the group's state_dtype changed): back to float.
                new.update(lowbit.convert(state, "float32", like))
            if "exp_avg" not in state and "exp_avg" not in new:
                new["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                new["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                if amsgrad:
                    new["max_exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            steps.append(self._step_tensor(p, state, new))
            kparams.append(kp)
            grads.append(grad_like(p, kp))
            exp_avgs.append(new.get("exp_avg", state.get("exp_avg")))
            exp_avg_sqs.append(new.get("exp_avg_sq", state.get("exp_avg_sq")))
            if amsgrad:
                max_sqs.append(new.get("max_exp_avg_sq", state.get("max_exp_avg_sq")))
            if master is not None:
                masters.append(master)
            news.append(new)
        beta1, beta2 = group["betas"]
        lr, lr_t = self._lr(group, params[0].device)
        _ops.adam_step_(
            kparams, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters,
            lr, lr_t, float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(amsgrad), bool(group.get("decoupled_weight_decay", self._decoupled)),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._commit(params, news, staged)
        for p, new in zip(params, news):  # converted back from 8-bit codes: drop their scales
            if "exp_avg" in new:
                self.state[p].pop("exp_avg_absmax", None)
                self.state[p].pop("exp_avg_sq_absmax", None)

class Adam(_AdamBase, torch.optim.Adam):
    """Fused :class:`torch.optim.Adam` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=False, state_dtype=torch.float32, state_seed=0) -> None:  # fmt: skip
        torch.optim.Adam.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastamp_init(master_weights)
        self._lowbit_init(state_dtype, state_seed)


class AdamW(_AdamBase, torch.optim.AdamW):
    """Fused :class:`torch.optim.AdamW` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False, state_dtype=torch.float32,
                 state_seed=0) -> None:  # fmt: skip
        torch.optim.AdamW.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)
        self._lowbit_init(state_dtype, state_seed)


class SGD(LowbitSgdMixin, _FusedStepMixin, torch.optim.SGD):
    """Fused :class:`torch.optim.SGD` (see the module docstring); ``master_weights`` is extra.

    The number of updates each param has had lives on the device (``state["step"]`` is not part of
    PyTorch's SGD state, so it is kept beside it): it tells the kernel when a momentum buffer gets
    its first value, exactly as PyTorch's ``None`` buffer does, even when that step is skipped.
    """

    _ELEMENTWISE = ("momentum_buffer",)
    _GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay")

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE if group["momentum"] != 0 else ()

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master_weights=False, state_dtype=torch.float32,
                 state_seed=0) -> None:  # fmt: skip
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)
        self._sgd_lowbit_init(state_dtype, state_seed)
        self._updates: dict[Tensor, Tensor] = {}

    def _updates_of(self, p: Tensor, state: dict[str, Any], new_counts: dict[Tensor, Tensor]) -> Tensor:
        n = self._updates.get(p)
        if n is None:
            saved = state.get("step")  # kept in the state with state_dtype=torch.bfloat16
            if isinstance(saved, Tensor) and saved.numel() == 1:
                n = new_counts[p] = saved.detach().to(device=p.device, dtype=torch.float32).reshape(())
                return n
            # A buffer loaded from a checkpoint has had its first value already.
            first = 0.0 if state.get("momentum_buffer") is None else 1.0
            n = new_counts[p] = torch.full((), first, dtype=torch.float32, device=p.device)
        return n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        formats = [(g.get("state_dtype"), g.get("state_seed")) for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._sgd_lowbit_load(formats)
        self._updates = {}

    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        low = [p for p in params if self._lowbit_format(group, p) != "float32"]
        rest = [p for p in params if self._lowbit_format(group, p) == "float32"] if low else params
        if rest:
            self._full_step(group, rest, inv_scale, found_inf, clip_coef)
        if low:
            new_counts: dict[Tensor, Tensor] = {}
            counts = [self._updates_of(p, self.state.get(p) or {}, new_counts) for p in low]
            self._sgd_lowbit_step(group, low, counts, inv_scale, found_inf, clip_coef)
            self._updates.update(new_counts)

    def _full_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        momentum = group["momentum"]
        kparams, grads, bufs, counts, masters = [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        new_counts: dict[Tensor, Tensor] = {}
        for p in params:
            # Like torch.optim.SGD, momentum-free SGD keeps no per-param state at all (an entry,
            # even empty, would show up in state_dict()); .get creates none.
            state = self.state.get(p) or {}
            new: dict[str, Any] = {}
            kp = kernel_view(p)
            if kp is not p:
                staged.append((p, kp))
            master = self._master(p, state, new)
            counts.append(self._updates_of(p, state, new_counts))
            if momentum != 0:
                buf = state.get("momentum_buffer")
                like = master if master is not None else kp
                if buf is None:
                    buf = new["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                elif buf.dtype == torch.bfloat16 and like.dtype != torch.bfloat16:
                    # A bfloat16 buffer of state_dtype=torch.bfloat16 (the group's format changed).
                    buf = new["momentum_buffer"] = buf.to(like.dtype)
                bufs.append(buf)
            kparams.append(kp)
            grads.append(grad_like(p, kp))
            if master is not None:
                masters.append(master)
            news.append(new)
        lr, lr_t = self._lr(group, params[0].device)
        _ops.sgd_step_(
            kparams, grads, bufs, counts, masters, lr, lr_t, float(group["weight_decay"]),
            float(momentum), float(group["dampening"]), bool(group["nesterov"]),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._updates.update(new_counts)
        self._commit(params, news, staged)
