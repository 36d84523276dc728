"""Fake (meta) kernels of the fused optimizer ops, so ``torch.compile`` can trace them.

The ops mutate their inputs and return nothing, so the fake kernels only check what a trace can
check (devices) and return None.
"""

from __future__ import annotations

import torch

import fastamp._library  # noqa: F401  (loads the operator library)


def _check_devices(op: str, params, *lists, **scalars) -> None:
    # The real kernels check every tensor's device. A list mixing devices (a meta tensor among
    # CPU ones) dispatches to these fake kernels, which must then raise too: returning quietly
    # would make the step a silent no-op.
    if not params:
        return
    dev = params[0].device
    for name, tensors in (("params", params), *lists):
        for i, t in enumerate(tensors):
            if t.device != dev:
                raise RuntimeError(f"fastamp::{op}: {name}[{i}] is on {t.device}; expected {dev}")
    for name, t in scalars.items():
        if t is not None and t.device != dev:
            raise RuntimeError(f"fastamp::{op}: {name} is on {t.device}; expected {dev}")


@torch.library.register_fake("fastamp::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                    master_params, lr, lr_tensor, beta1, beta2, weight_decay, eps, amsgrad,
                    decoupled_weight_decay, maximize, inv_scale, found_inf, clip_coef):
    _check_devices("adam_step_", params, ("grads", grads), ("exp_avgs", exp_avgs),
                   ("exp_avg_sqs", exp_avg_sqs), ("max_exp_avg_sqs", max_exp_avg_sqs),
                   ("state_steps", state_steps), ("master_params", master_params),
                   lr_tensor=lr_tensor, inv_scale=inv_scale, found_inf=found_inf,
                   clip_coef=clip_coef)
    return None


@torch.library.register_fake("fastamp::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, state_steps, master_params, lr, lr_tensor,
                   weight_decay, momentum, dampening, nesterov, maximize, inv_scale, found_inf,
                   clip_coef):
    _check_devices("sgd_step_", params, ("grads", grads), ("momentum_buffers", momentum_buffers),
                   ("state_steps", state_steps), ("master_params", master_params),
                   lr_tensor=lr_tensor, inv_scale=inv_scale, found_inf=found_inf,
                   clip_coef=clip_coef)
    return None
