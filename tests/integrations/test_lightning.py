"""fastamp.integrations.lightning against Lightning's own plugins (MixedPrecision in fp16 and bf16,
Precision in fp32), on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.integrations import _common as common

pytestmark = pytest.mark.clients
L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import (  # noqa: E402
    DoublePrecision,
    MixedPrecision,
    Precision,
)

import fastamp  # noqa: E402
from fastamp.integrations.lightning import FastampPrecision  # noqa: E402

STEPS = 40


class Net(L.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        self.net = common.mlp()
        self.make_opt = make_opt
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = common.loss_of(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def fit(plugin, make_opt, clip=None, count=False, algorithm=None):
    x, y = common.dataset()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=False
    )
    model = Net(make_opt)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[plugin],
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    counter = common.OpCounter()
    if count:
        with counter:
            trainer.fit(model, loader)
    else:
        trainer.fit(model, loader)
    return model, counter.counts


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def fastamp_adamw(params):
    return fastamp.optim.AdamW(params, lr=1e-2)


def test_lightning_refuses_clipping_with_fused_optimizer_without_the_plugin():
    # What the plugin is for: Lightning's own MixedPrecision cannot clip with a fused optimizer.
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(
            MixedPrecision("16-mixed", "cpu", scaler=fastamp.GradScaler("cpu")),
            fastamp_adamw,
            clip=1.0,
        )


def test_gradient_clip_val_with_fastamp_adamw_is_folded_into_the_fused_step():
    ours, counts = fit(FastampPrecision("16-mixed", "cpu"), fastamp_adamw, clip=0.5, count=True)
    ref, _ = fit(MixedPrecision("16-mixed", "cpu"), torch_adamw, clip=0.5)
    common.assert_learns(ours.losses)
    common.assert_fused_clip(counts, STEPS)
    # The same training as Lightning's torch path (fp32 norm accumulation: equal up to rounding).
    torch.testing.assert_close(ours.losses, ref.losses, rtol=2e-3, atol=2e-3)
    common.assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


def test_fastamp_scaler_with_torch_optimizer_is_bitwise_lightnings_path():
    ours, counts = fit(FastampPrecision("16-mixed", "cpu"), torch_adamw, count=True)
    ref, _ = fit(MixedPrecision("16-mixed", "cpu"), torch_adamw)
    common.assert_learns(ours.losses)
    assert ours.losses == ref.losses
    common.assert_params_equal(ours, ref)
    assert counts["fastamp.non_finite_check_and_unscale_"] == STEPS  # fastamp's scaler did the work
    assert counts["aten._amp_foreach_non_finite_check_and_unscale_"] == 0


def test_value_clipping_with_fastamp_adamw_matches_lightnings_path():
    ours, _ = fit(FastampPrecision("16-mixed", "cpu"), fastamp_adamw, clip=0.01, algorithm="value")
    ref, _ = fit(MixedPrecision("16-mixed", "cpu"), torch_adamw, clip=0.01, algorithm="value")
    common.assert_learns(ours.losses)
    torch.testing.assert_close(ours.losses, ref.losses, rtol=2e-3, atol=2e-3)


def lightnings_plugin(precision):
    return MixedPrecision(precision, "cpu") if precision == "bf16-mixed" else Precision()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_gradient_clip_val_without_scaler_is_folded_into_the_fused_step(precision, monkeypatch):
    plugin = FastampPrecision(precision, "cpu")
    assert plugin.scaler is None
    calls = common.spy_on_fastamps_clip(monkeypatch)
    ours, counts = fit(plugin, fastamp_adamw, clip=0.5, count=True)
    assert calls == [fastamp.optim.AdamW] * STEPS
    common.assert_fused_clip(counts, STEPS)
    assert ours.trainer.optimizers[0].pending_clip is None  # each clip was taken by its step
    assert plugin.last_grad_norm is not None and plugin.last_grad_norm.dtype == torch.float32
    ref, _ = fit(lightnings_plugin(precision), torch_adamw, clip=0.5)
    exact, _ = fit(DoublePrecision(), torch_adamw, clip=0.5)
    common.assert_learns(ours.losses)
    common.assert_within_torchs_error((ours.losses, ours), (ref.losses, ref), (exact.losses, exact))


def test_bf16_torch_optimizer_gets_its_grads_clipped_in_place_as_lightnings(monkeypatch):
    calls = common.spy_on_fastamps_clip(monkeypatch)
    ours, _ = fit(FastampPrecision("bf16-mixed", "cpu"), torch_adamw, clip=0.5)
    assert calls == [torch.optim.AdamW] * STEPS
    ref, _ = fit(MixedPrecision("bf16-mixed", "cpu"), torch_adamw, clip=0.5)
    exact, _ = fit(DoublePrecision(), torch_adamw, clip=0.5)
    common.assert_within_torchs_error((ours.losses, ours), (ref.losses, ref), (exact.losses, exact))


def test_32_true_takes_no_scaler():
    with pytest.raises(ValueError, match="'32-true' uses no scaler"):
        FastampPrecision("32-true", "cpu", scaler=fastamp.GradScaler("cpu"))


def test_bad_device_is_a_clear_error():
    with pytest.raises(TypeError, match="device must be a device type string"):
        FastampPrecision("16-mixed", torch.device("cpu"))
