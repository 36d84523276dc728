"""The fused optimizer ops: typed wrappers (what :mod:`fastamp.optim` calls) and their fake (meta)
kernels, so ``torch.compile`` can trace them. Schemas and argument checks: csrc/optim/ops.cpp.

The step ops mutate their inputs and return nothing; the fake kernels check what a trace can
check (devices) and return None.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastamp._library import check_fake_devices  # (importing it loads the operator library)

__all__ = ["adam_lowbit_step_", "adam_step_", "sgd_lowbit_step_", "sgd_step_", "shared_memory_pair"]

_ops = torch.ops.fastamp


def adam_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
               state_steps: Sequence[Tensor], master_params: Sequence[Tensor], lr: float,
               lr_tensor: Tensor | None, beta1: float, beta2: float, weight_decay: float,
               eps: float, amsgrad: bool, decoupled_weight_decay: bool, maximize: bool,
               inv_scale: Tensor | None, found_inf: Tensor | None,
               clip_coef: Tensor | None) -> None:
    """One Adam (AdamW with ``decoupled_weight_decay``) step over a list of params, in one pass:
    each grad is read once and multiplied in registers by ``inv_scale * clip_coef``; when
    ``found_inf`` is non-zero nothing is written and ``state_steps`` hold. ``master_params``
    (fp32) are updated in place of half params when given; ``lr_tensor`` overrides ``lr``."""
    _ops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                    master_params, float(lr), lr_tensor, float(beta1), float(beta2),
                    float(weight_decay), float(eps), bool(amsgrad), bool(decoupled_weight_decay),
                    bool(maximize), inv_scale, found_inf, clip_coef)


def adam_lowbit_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], exp_avg_absmax: Sequence[Tensor],
                      exp_avg_sq_absmax: Sequence[Tensor], state_steps: Sequence[Tensor],
                      master_params: Sequence[Tensor], seed: int, lr: float,
                      lr_tensor: Tensor | None, beta1: float, beta2: float, weight_decay: float,
                      eps: float, decoupled_weight_decay: bool, maximize: bool,
                      inv_scale: Tensor | None, found_inf: Tensor | None,
                      clip_coef: Tensor | None) -> None:
    """:func:`adam_step_` with low-precision moments (fastamp.optim.lowbit): bfloat16 ones,
    written with stochastic rounding keyed by ``seed``, or uint8 codes of 256-element blocks with
    their float32 scales in ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (empty lists for
    bfloat16). One pass; with ``found_inf`` non-zero nothing is written. No amsgrad."""
    _ops.adam_lowbit_step_(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax,
                           exp_avg_sq_absmax, state_steps, master_params, int(seed), float(lr),
                           lr_tensor, float(beta1), float(beta2), float(weight_decay), float(eps),
                           bool(decoupled_weight_decay), bool(maximize), inv_scale, found_inf,
                           clip_coef)


def sgd_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
              momentum_buffers: Sequence[Tensor], state_steps: Sequence[Tensor],
              master_params: Sequence[Tensor], lr: float, lr_tensor: Tensor | None,
              weight_decay: float, momentum: float, dampening: float, nesterov: bool,
              maximize: bool, inv_scale: Tensor | None, found_inf: Tensor | None,
              clip_coef: Tensor | None) -> None:
    """One SGD step (torch.optim.SGD's rule), fused as :func:`adam_step_`; ``state_steps`` count
    each param's updates (a buffer's first update takes the grad as is)."""
    _ops.sgd_step_(params, grads, momentum_buffers, state_steps, master_params, float(lr),
                   lr_tensor, float(weight_decay), float(momentum), float(dampening),
                   bool(nesterov), bool(maximize), inv_scale, found_inf, clip_coef)


def sgd_lowbit_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                     momentum_buffers: Sequence[Tensor], state_steps: Sequence[Tensor],
                     master_params: Sequence[Tensor], seed: int, lr: float,
                     lr_tensor: Tensor | None, weight_decay: float, momentum: float,
                     dampening: float, nesterov: bool, maximize: bool, inv_scale: Tensor | None,
                     found_inf: Tensor | None, clip_coef: Tensor | None) -> None:
    """:func:`sgd_step_` (momentum != 0) with bfloat16 momentum buffers, written with stochastic
    rounding keyed by ``seed`` (fastamp.optim.lowbit). One pass; with ``found_inf`` non-zero
    nothing is written."""
    _ops.sgd_lowbit_step_(params, grads, momentum_buffers, state_steps, master_params, int(seed),
                          float(lr), lr_tensor, float(weight_decay), float(momentum),
                          float(dampening), bool(nesterov), bool(maximize), inv_scale, found_inf,
                          clip_coef)


def shared_memory_pair(tensors: Sequence[Tensor]) -> list[int]:
    """``[]`` when the tensors' elements are disjoint in memory, else ``[a, b]``: tensors ``a`` and
    ``b`` overlap (``a == b``: tensor ``a`` overlaps itself, as ``expand()`` views do)."""
    return list(_ops.shared_memory_pair(list(tensors)))


@torch.library.register_fake("fastamp::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                    master_params, lr, lr_tensor, beta1, beta2, weight_decay, eps, amsgrad,
                    decoupled_weight_decay, maximize, inv_scale, found_inf, clip_coef):
    if params:
        check_fake_devices(
            "adam_step_", params[0].device,
            [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
             ("exp_avg_sqs", exp_avg_sqs), ("max_exp_avg_sqs", max_exp_avg_sqs),
             ("state_steps", state_steps), ("master_params", master_params)],
            {"lr_tensor": lr_tensor, "inv_scale": inv_scale, "found_inf": found_inf,
             "clip_coef": clip_coef}, anchor="the device of params[0]")  # fmt: skip
    return None


@torch.library.register_fake("fastamp::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, state_steps, master_params, lr, lr_tensor,
                   weight_decay, momentum, dampening, nesterov, maximize, inv_scale, found_inf,
                   clip_coef):
    if params:
        check_fake_devices(
            "sgd_step_", params[0].device,
            [("params", params), ("grads", grads), ("momentum_buffers", momentum_buffers),
             ("state_steps", state_steps), ("master_params", master_params)],
            {"lr_tensor": lr_tensor, "inv_scale": inv_scale, "found_inf": found_inf,
             "clip_coef": clip_coef}, anchor="the device of params[0]")  # fmt: skip
    return None


@torch.library.register_fake("fastamp::adam_lowbit_step_")
def _adam_lowbit_step_fake(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax,
                           state_steps, master_params, seed, lr, lr_tensor, beta1, beta2,
                           weight_decay, eps, decoupled_weight_decay, maximize, inv_scale,
                           found_inf, clip_coef):
    if params:
        check_fake_devices(
            "adam_lowbit_step_", params[0].device,
            [("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
             ("exp_avg_sqs", exp_avg_sqs), ("exp_avg_absmax", exp_avg_absmax),
             ("exp_avg_sq_absmax", exp_avg_sq_absmax), ("state_steps", state_steps),
             ("master_params", master_params)],
            {"lr_tensor": lr_tensor, "inv_scale": inv_scale, "found_inf": found_inf,
             "clip_coef": clip_coef}, anchor="the device of params[0]")  # fmt: skip
    return None


@torch.library.register_fake("fastamp::sgd_lowbit_step_")
def _sgd_lowbit_step_fake(params, grads, momentum_buffers, state_steps, master_params, seed, lr,
                          lr_tensor, weight_decay, momentum, dampening, nesterov, maximize,
                          inv_scale, found_inf, clip_coef):
    if params:
        check_fake_devices(
            "sgd_lowbit_step_", params[0].device,
            [("params", params), ("grads", grads), ("momentum_buffers", momentum_buffers),
             ("state_steps", state_steps), ("master_params", master_params)],
            {"lr_tensor": lr_tensor, "inv_scale": inv_scale, "found_inf": found_inf,
             "clip_coef": clip_coef}, anchor="the device of params[0]")  # fmt: skip
    return None
