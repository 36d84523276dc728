"""fastamp's in-place writes bump the tensors' write counters as torch's in-place ops do, so autograd
refuses a backward through a graph that saved a tensor fastamp has since overwritten (torch's
"modified by an inplace operation" RuntimeError) instead of silently using the new values. The op
layer bumps every argument its schema marks as written (fastamp._library)."""

import pytest
import torch

import fastamp

CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("Adam", dict(lr=0.1)),
    ("AdamW", dict(lr=0.1)),
    ("AdamW", dict(lr=0.1, state_dtype=torch.bfloat16)),
]


def _stale_backward(make_opt):
    """The exception class of a backward through a graph that saved the params before a step
    (None if it runs), and whether the step bumped the param's write counter."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40))
    opt = make_opt([p])
    (p * p).sum().backward()
    saved = (p * p).sum()  # mul saves p for its backward
    before = p._version
    opt.step()
    bumped = p._version > before
    try:
        saved.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
        return RuntimeError, bumped
    return None, bumped


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{sorted(k)}" for n, k in CASES])
def test_optimizer_step_invalidates_saved_params_like_torch(name, kw):
    torch_kw = {k: v for k, v in kw.items() if k != "state_dtype"}
    want, torch_bumped = _stale_backward(lambda ps: getattr(torch.optim, name)(ps, **torch_kw))
    got, bumped = _stale_backward(lambda ps: getattr(fastamp.optim, name)(ps, **kw))
    assert want is RuntimeError and torch_bumped
    assert got is want and bumped, f"fastamp.optim.{name}({kw}) left the param's counter as it was"


def test_scaler_writes_bump_the_scale_like_torch_and_the_grads_too():
    """update writes the scale and bumps it, as torch's does. unscale_ writes the grads: torch's
    CPU op leaves their counters as they were (its unscale kernel has no in-place-or-view step);
    fastamp bumps them, the stricter side: a backward through a graph that saved a grad before
    unscale_ fails loudly instead of reading the unscaled values."""
    counters = {}
    for kind, mod in (("torch", torch.amp), ("fastamp", fastamp)):
        p = torch.nn.Parameter(torch.randn(8))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = mod.GradScaler("cpu", init_scale=4.0)
        scaler.scale((p * p).sum()).backward()
        g0 = p.grad._version
        scaler.unscale_(opt)
        scaler.step(opt)
        s0 = scaler._scale._version
        scaler.update()
        counters[kind] = (p.grad._version > g0, scaler._scale._version > s0)
    assert counters["torch"] == (False, True), counters
    assert counters["fastamp"] == (True, True), counters


def test_inference_tensors_are_skipped():
    """Inference tensors keep no write counter; an op writing them (inside inference_mode, as
    torch allows) must not raise."""
    with torch.inference_mode():
        g = torch.full((16,), 4.0)
        found = torch.zeros(())
        fastamp.scaler._ops.non_finite_check_and_unscale_([g], found, torch.tensor(0.5))
    assert g.is_inference() and float(found) == 0.0 and bool((g == 2.0).all())
