"""fastamp.integrations.accelerate against accelerate's own scaler path, on CPU with fp16."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn import functional as F

from tests.integrations._common import (
    OpCounter,
    assert_fused_clip,
    assert_learns,
    assert_params_close,
    assert_params_equal,
    dataset,
    mlp,
)

pytestmark = pytest.mark.clients
accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations import accelerate as fa  # noqa: E402

STEPS = 40


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # accelerate's state is a process-wide singleton; each run here builds its own Accelerator.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run(accelerator, make_opt, clip=None, count=False):
    x, y = dataset()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model = mlp()
    opt = make_opt(model.parameters())
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    counter = OpCounter()
    with counter if count else contextlib.nullcontext():
        for step, (xb, yb) in enumerate(loader):
            if step == STEPS:
                break
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb).float(), yb)
            accelerator.backward(loss)
            if clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(float(loss.detach()))
    return accelerator.unwrap_model(model), losses, counter.counts, opt


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def fastamp_adamw(params):
    return fastamp.optim.AdamW(params, lr=1e-2)


def reference_accelerator():
    """accelerate's own path with torch's scaler (on CPU accelerate builds none for fp16, so it
    is installed the same way fastamp's is, through install_grad_scaler)."""
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    fa.install_grad_scaler(acc, torch.amp.GradScaler("cpu"))
    return acc


def test_accelerator_installs_fastamp_scaler_and_folds_clip_into_fused_step():
    acc = fa.Accelerator(mixed_precision="fp16", cpu=True)
    assert isinstance(acc.scaler, fastamp.GradScaler)
    ours, losses, counts, _ = run(acc, fastamp_adamw, clip=0.5, count=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ref, ref_losses, _, _ = run(reference_accelerator(), torch_adamw, clip=0.5)
    assert_learns(losses)
    assert_fused_clip(counts, STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-3, atol=2e-3)
    assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


def test_fastamp_scaler_with_torch_optimizer_is_bitwise_accelerates_path():
    ours, losses, counts, _ = run(
        fa.Accelerator(mixed_precision="fp16", cpu=True), torch_adamw, count=True
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ref, ref_losses, _, _ = run(reference_accelerator(), torch_adamw)
    assert_learns(losses)
    assert losses == ref_losses
    assert_params_equal(ours, ref)
    assert counts["fastamp.non_finite_check_and_unscale_"] == STEPS


def test_skipped_fused_step_is_reported_as_skipped():
    acc = fa.Accelerator(mixed_precision="fp16", cpu=True)
    model = mlp()
    opt = acc.prepare(fastamp_adamw(model.parameters()))
    x, y = dataset(32)
    loss = F.cross_entropy(model(x), y)
    acc.backward(loss)
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    acc.backward(F.cross_entropy(model(x), y))
    opt.step()
    assert not acc.optimizer_step_was_skipped


def test_install_grad_scaler_errors_name_the_problem():
    acc = accelerate.Accelerator(mixed_precision="no", cpu=True)
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*got mixed_precision='no'"):
        fa.install_grad_scaler(acc)
    AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler.*got int"):
        fa.install_grad_scaler(acc, 3)
    acc.prepare(torch_adamw(mlp().parameters()))
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        fa.install_grad_scaler(acc)
