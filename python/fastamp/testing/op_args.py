"""Keyword calls of fastamp's raw ops for tests: ``op_args`` builds the positional argument tuple
of ``fastamp::<op>`` in its schema's order from keywords, filling in ``OP_DEFAULTS`` for the
scalar and optional arguments a test does not vary, so each call states only what it varies::

    ops.adam_step_(*op_args("adam_step_", params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v],
                            state_steps=[step], lr=0.01))

The emulator's ``fastamp_emu::<op>`` mirrors each schema exactly, so the same tuple serves it.
``op_names`` lists an op's argument names in that order, read from the registered schema (this
module calls no op).
"""

from __future__ import annotations

from typing import Any

import torch

#: The value an argument takes when a call leaves it out, by schema name (the same in every op
#: that has it). Lists a mode may leave empty (AMSGrad's maxima, master params, the 8-bit block
#: scales) default to ``[]``; every other list and tensor argument must be given.
OP_DEFAULTS: dict[str, Any] = {
    "max_exp_avg_sqs": [],
    "master_params": [],
    "exp_avg_absmax": [],
    "exp_avg_sq_absmax": [],
    "seed": 0,
    "lr": 0.1,
    "lr_tensor": None,
    "beta1": 0.9,
    "beta2": 0.999,
    "weight_decay": 0.0,
    "eps": 1e-8,
    "amsgrad": False,
    "decoupled_weight_decay": True,
    "maximize": False,
    "momentum": 0.9,
    "dampening": 0.0,
    "nesterov": False,
    "inv_scale": None,
    "found_inf": None,
    "clip_coef": None,
}


def op_names(op: str) -> list[str]:
    """The argument names of ``fastamp::<op>``, in its schema's order."""
    # private-ok: the registered schema is PyTorch's one description of an op's arguments, and
    # torch has no public accessor for it
    schema = torch._C._get_schema(f"fastamp::{op}", "")
    return [a.name for a in schema.arguments]


def op_args(op: str, /, **given: Any) -> tuple[Any, ...]:
    """The positional arguments of ``fastamp::<op>`` (or the emulator's mirror of it): each
    schema argument from ``given``, else from ``OP_DEFAULTS``, else (or for a keyword the schema
    lacks) a TypeError that names it. Lists in the defaults are fresh on each call."""
    names = op_names(op)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"fastamp::{op} has no argument {', '.join(unknown)} (it takes {names})")
    args = []
    for name in names:
        if name in given:
            args.append(given[name])
        elif name in OP_DEFAULTS:
            value = OP_DEFAULTS[name]
            args.append(list(value) if isinstance(value, list) else value)
        else:
            raise TypeError(f"fastamp::{op} needs its argument {name}")
    return tuple(args)
