"""fastamp.integrations.timm: timm's NativeScaler interface over fastamp.GradScaler.

timm itself is not imported: timm 1.0 imports torchvision at `import timm`, and no torchvision on
PyPI imports beside the CPU torch (requirements/clients.txt). The reference below is timm's
NativeScaler recipe (torch.amp.GradScaler; unscale_, then clip, step, update), written out."""

from __future__ import annotations

import pytest
import torch

import fastamp
from fastamp.integrations.timm import NativeScaler, check_optimizer_name
from tests.integrations import _common as common

STEPS = 40


class TimmRecipe:
    """timm.utils.NativeScaler's __call__, as timm 1.0.29 runs it, on torch's scaler."""

    state_dict_key = "amp_scaler"

    def __init__(self, device="cpu"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(
        self,
        loss,
        optimizer,
        clip_grad=None,
        clip_mode="norm",
        parameters=None,
        create_graph=False,
        need_update=True,
    ):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()


class TimmNoScalerRecipe:
    """What timm 1.0.29's train.py runs with bf16 or no AMP (its loss_scaler is None):
    backward, ``timm.utils.dispatch_clip_grad`` (``"norm"``: torch's clip_grad_norm_), step."""

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None):
        loss.backward()
        if clip_grad is not None:
            assert clip_mode == "norm"
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        optimizer.step()


def run(loss_scaler, make_opt, clip=0.5, count=False, autocast=torch.float16, dtype=torch.float32):
    x, y = common.dataset()
    model = common.mlp().to(dtype)
    opt = make_opt(model.parameters())
    losses = []
    counter = common.OpCounter()
    for step in range(STEPS):
        xb, yb = x[32 * step : 32 * step + 32].to(dtype), y[32 * step : 32 * step + 32]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = common.loss_of(model(xb), yb)
        if count:
            with counter:
                loss_scaler(
                    loss, opt, clip_grad=clip, clip_mode="norm", parameters=model.parameters()
                )
        else:
            loss_scaler(loss, opt, clip_grad=clip, clip_mode="norm", parameters=model.parameters())
        losses.append(float(loss.detach()))
    return model, losses, counter.counts


def test_native_scaler_folds_norm_clip_into_fastamp_adamw():
    ours, losses, counts = run(
        NativeScaler("cpu"), lambda p: fastamp.optim.AdamW(p, lr=1e-2), count=True
    )
    ref, ref_losses, _ = run(
        TimmRecipe("cpu"), lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False)
    )
    common.assert_learns(losses)
    common.assert_fused_clip(counts, STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-3, atol=2e-3)
    common.assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


@pytest.mark.parametrize("autocast", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_disabled_native_scaler_folds_norm_clip_into_fastamp_adamw(autocast, monkeypatch):
    # timm's train.py builds no scaler for bf16 / fp32: a disabled NativeScaler stands in for it.
    calls = []
    real = fastamp.clip_grad_norm_
    monkeypatch.setattr(
        fastamp, "clip_grad_norm_", lambda opt, *a, **k: calls.append(opt) or real(opt, *a, **k)
    )
    scaler = NativeScaler("cpu", enabled=False)
    ours, losses, counts = run(
        scaler, lambda p: fastamp.optim.AdamW(p, lr=1e-2), count=True, autocast=autocast
    )
    assert len(calls) == STEPS and calls[0].pending_clip is None
    common.assert_fused_clip(counts, STEPS)
    assert counts["fastamp.non_finite_check_and_unscale_"] == 0  # nothing scaled
    ref, ref_losses, _ = run(
        TimmNoScalerRecipe(), lambda p: torch.optim.AdamW(p, lr=1e-2), autocast=autocast
    )
    exact, exact_losses, _ = run(
        TimmNoScalerRecipe(),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        autocast=None,
        dtype=torch.float64,
    )
    common.assert_learns(losses)
    common.assert_within_torchs_error((losses, ours), (ref_losses, ref), (exact_losses, exact))


def test_native_scaler_state_dict_is_timms():
    s = NativeScaler("cpu", init_scale=1024.0)
    assert s.state_dict_key == "amp_scaler"
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref.load_state_dict(s.state_dict())
    assert ref.get_scale() == 1024.0
    s.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    assert s.scaler.get_scale() == 8.0


def test_clip_without_parameters_is_a_clear_error():
    model = common.mlp()
    opt = fastamp.optim.AdamW(model.parameters())
    loss = model(torch.randn(2, 16)).sum()
    with pytest.raises(AssertionError):  # timm's own class
        TimmRecipe("cpu")(
            model(torch.randn(2, 16)).sum(), torch.optim.AdamW(model.parameters()), clip_grad=1.0
        )
    with pytest.raises(AssertionError, match="clip_grad needs parameters="):
        NativeScaler("cpu")(loss, opt, clip_grad=1.0)


def test_underscore_names_of_fastamp_optimizers_are_refused():
    # timm keeps only the part after the last underscore: "fastamp_adamw" would be torch's AdamW.
    with pytest.raises(
        ValueError, match="'adamw'.*silently create torch's optimizer.*'fastamp-adamw'"
    ):
        check_optimizer_name("fastamp_adamw")
    assert check_optimizer_name("fastamp-adamw") == "fastamp-adamw"
    assert check_optimizer_name("lookahead_fastamp-adamw") == "lookahead_fastamp-adamw"
    assert check_optimizer_name("adamw") == "adamw"
