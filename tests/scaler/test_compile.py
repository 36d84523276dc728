"""torch.compile traces the scaler ops (fake kernels + functionalization) without graph breaks."""

import math

import pytest
import torch

import fastamp  # noqa: F401
from fastamp.testing import make_grads


def _scaler_step(grads, scale, growth_tracker, hysteresis_tracker, max_norm: float):
    inv = scale.double().reciprocal().float()
    found, pow_sum, _ = torch.ops.fastamp.grad_stats(grads, inv, 2.0)
    total, _ = torch.ops.fastamp.clip_coef(pow_sum, 2.0, max_norm)
    torch.ops.fastamp.clip_unscale_(grads, inv, total, max_norm)
    torch.ops.fastamp.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found, 2.0, 0.5, 2, 1, 0.0, math.inf
    )
    return total, found


def _state(device):
    return (
        torch.tensor(1024.0, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
        torch.ones((), dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_scaler_step_matches_eager_without_graph_breaks(device, backend):
    torch._dynamo.reset()
    shapes = [(64, 32), (32,), (1000,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    eager_grads = make_grads(shapes, dtypes, device, seed=1, scale=100.0)
    comp_grads = [g.clone() for g in eager_grads]
    eager_state, comp_state = _state(device), _state(device)
    compiled = torch.compile(_scaler_step, fullgraph=True, backend=backend)
    for step in range(3):
        fresh = make_grads(shapes, dtypes, device, seed=10 + step, scale=100.0)
        for g, h, f in zip(eager_grads, comp_grads, fresh):
            g.copy_(f)
            h.copy_(f)
        if step == 1:
            eager_grads[0][0, 0] = math.inf
            comp_grads[0][0, 0] = math.inf
        e = _scaler_step(eager_grads, *eager_state, 1.0)
        c = compiled(comp_grads, *comp_state, 1.0)
        torch.testing.assert_close(c[0], e[0], equal_nan=True)
        assert torch.equal(c[1], e[1])
        for a, b in zip(comp_grads, eager_grads):
            torch.testing.assert_close(a, b, equal_nan=True)
        for a, b in zip(comp_state, eager_state):
            assert torch.equal(a, b)
    # step 0: tracker 1; step 1: overflow, 1024 -> 512; step 2: tracker 1.
    assert float(eager_state[0]) == 512.0
