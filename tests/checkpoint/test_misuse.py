"""The misuse catalogue of checkpoint (harness: tests/_misuse.py): each misuse raises a clear error
naming the argument and changes nothing."""

from __future__ import annotations

import pytest

from tests._misuse import *  # noqa: F403 (the catalogue's harness and world builders)
from tests._misuse import Case, check_misuse, make_case

CASES: list[Case] = []
case = make_case(CASES)


@case(
    "checkpoint_use_reentrant_true", ValueError, r"use_reentrant=True", r"Pass use_reentrant=False"
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, use_reentrant=True)


@case(
    "checkpoint_use_reentrant_string",
    TypeError,
    r"use_reentrant must be False",
    r"expected use_reentrant=False",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, use_reentrant="False")  # truthy


@case(
    "checkpoint_determinism_check_unknown",
    ValueError,
    r"determinism_check",
    r"one of \['default', 'none', 'bitwise'\]",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, determinism_check="exact")


@case(
    "checkpoint_bitwise_with_debug",
    ValueError,
    r"determinism_check='bitwise'.*debug=True",
    r"cannot be combined with debug=True",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, determinism_check="bitwise", debug=True)


@case(
    "checkpoint_arguments_swapped",
    TypeError,
    r"function must be callable",
    r"checkpoint\(block, \*inputs\)",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(x, model)


@case(
    "checkpoint_context_fn_factory_uncalled",
    TypeError,
    r"context_fn must return two context managers",
    r"selective instead of context_fn=selective\(\)",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, context_fn=selective)


@case(
    "selective_policy_single_op",
    TypeError,
    r"policy is the op",
    r"selective\(\[torch\.ops\.aten\.mm\.default\]\)",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, context_fn=selective(torch.ops.aten.mm.default))


@case("checkpoint_sequential_segments_zero", ValueError, r"segments", r"int >= 1")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint_sequential(model, 0, x)


@case(
    "checkpoint_sequential_single_module",
    TypeError,
    r"functions must be an nn\.Sequential",
    r"fastamp\.checkpoint\.checkpoint\(block, input\)",
)
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint_sequential(model[0], 1, x)


@case("offload_device_types_string", TypeError, r"device_types", r"device_types=\('cuda',\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: offload_activations(device_types="cuda")  # would match no device at all


@case("apply_budget_zero", ValueError, r"budget_bytes", r"finite number > 0")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(
        model, 0, torch.randn(8, 16), verbose=False
    )


@case("apply_budget_nan", ValueError, r"budget_bytes", r"finite number > 0")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(
        model, math.nan, torch.randn(8, 16), verbose=False
    )


@case("apply_unknown_block", ValueError, r"blocks\[1\]='layers\.1'", r"model\.named_modules\(\)")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(
        model, 1 << 20, torch.randn(8, 16), blocks=["0", "layers.1"], verbose=False
    )


@case("apply_budget_unreachable", ValueError, r"budget", r"raise the budget")
def _(lib):
    # Raised after measuring: the measuring forwards must not move BatchNorm's running stats,
    # and no block may be left checkpointed.
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(
        model, 16, torch.randn(8, 16), verbose=False
    )


@case(
    "op_rng_set_state_empty",
    ValueError,
    r"states is empty",
    r"the list returned by fastamp::rng_get_state",
)
def _(lib):
    return {"cpu_rng": torch.get_rng_state()}, lambda: _F.rng_set_state([])


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    check_misuse(c)


# ------------------------------------------------------------------ the checks let valid input through


def test_apply_measures_without_moving_batchnorm_statistics():
    model = _bn_net()
    world = _world(model)
    before = _snapshot(world)
    plan = fastamp.checkpoint.apply(model, 1 << 30, torch.randn(8, 16), verbose=False)
    assert not plan.chosen and _diff(before, _snapshot(world)) == []
