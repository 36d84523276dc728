"""fastamp.integrations.accelerate against accelerate's own path, on CPU: fp16 with its scaler,
bf16 and fp32 without."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn import functional as F

from tests.integrations import _common as common

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


def run(accelerator, make_opt, clip=None, count=False, dtype=torch.float32, norms=None):
    x, y = common.dataset()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x.to(dtype), y), batch_size=32
    )
    model = common.mlp().to(dtype)
    opt = make_opt(model.parameters())
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses = []
    counter = common.OpCounter()
    with counter if count else contextlib.nullcontext():
        for step, (xb, yb) in enumerate(loader):
            if step == STEPS:
                break
            opt.zero_grad(set_to_none=True)
            loss = common.loss_of(model(xb), yb)
            accelerator.backward(loss)
            if clip is not None:
                norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                if norms is not None:
                    norms.append(norm)
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
    common.assert_learns(losses)
    common.assert_fused_clip(counts, STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-3, atol=2e-3)
    common.assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


def test_fastamp_scaler_with_torch_optimizer_is_bitwise_accelerates_path():
    ours, losses, counts, _ = run(
        fa.Accelerator(mixed_precision="fp16", cpu=True), torch_adamw, count=True
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ref, ref_losses, _, _ = run(reference_accelerator(), torch_adamw)
    common.assert_learns(losses)
    assert losses == ref_losses
    common.assert_params_equal(ours, ref)
    assert counts["fastamp.non_finite_check_and_unscale_"] == STEPS


def test_skipped_fused_step_is_reported_as_skipped():
    acc = fa.Accelerator(mixed_precision="fp16", cpu=True)
    model = common.mlp()
    opt = acc.prepare(fastamp_adamw(model.parameters()))
    x, y = common.dataset(32)
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
    acc.prepare(torch_adamw(common.mlp().parameters()))
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        fa.install_grad_scaler(acc)


def fresh_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("precision", ["bf16", "no"])
@pytest.mark.parametrize("optimizer", ["fastamp", "torch"])
def test_clip_without_scaler_goes_through_fastamps_clip(precision, optimizer, monkeypatch):
    make_opt = fastamp_adamw if optimizer == "fastamp" else torch_adamw
    calls = common.spy_on_fastamps_clip(monkeypatch)
    acc = fa.Accelerator(mixed_precision=precision, cpu=True)
    assert acc.scaler is None
    norms = []
    ours, losses, counts, opt = run(acc, make_opt, clip=0.5, count=True, norms=norms)
    assert calls == [type(make_opt([torch.zeros(1, requires_grad=True)]))] * STEPS
    if optimizer == "fastamp":
        common.assert_fused_clip(counts, STEPS)
        assert fa._unwrap(opt).pending_clip is None  # each clip was taken by its step
    fresh_state()
    ref_norms = []
    ref, ref_losses, _, _ = run(
        accelerate.Accelerator(mixed_precision=precision, cpu=True),
        torch_adamw,
        clip=0.5,
        norms=ref_norms,
    )
    fresh_state()
    exact, exact_losses, _, _ = run(
        accelerate.Accelerator(cpu=True), torch_adamw, clip=0.5, dtype=torch.float64
    )
    common.assert_learns(losses)
    # The returned norm is accelerate's: a tensor of the grads' dtype; at the first step (the
    # same grads on both sides) equal up to the rounding of an fp32 sum of squares.
    assert all(n.dtype == r.dtype == torch.float32 for n, r in zip(norms, ref_norms))
    torch.testing.assert_close(norms[0], ref_norms[0], rtol=1e-5, atol=0)
    common.assert_within_torchs_error((losses, ours), (ref_losses, ref), (exact_losses, exact))


def test_clip_on_an_accumulation_micro_step_is_accelerates_own(monkeypatch):
    calls = common.spy_on_fastamps_clip(monkeypatch)
    acc = fa.Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    model = common.mlp()
    opt = fastamp_adamw(model.parameters())
    model, opt = acc.prepare(model, opt)
    x, y = common.dataset(64)
    for xb, yb in ((x[:32], y[:32]), (x[32:], y[32:])):
        with acc.accumulate(model):
            acc.backward(common.loss_of(model(xb), yb))
            acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    assert calls == [fastamp.optim.AdamW]  # the sync step only
