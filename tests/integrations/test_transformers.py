"""fastamp.integrations.transformers.FastampTrainer against the Trainer's own path, on CPU: fp16,
bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.integrations import _common as common

pytestmark = pytest.mark.clients
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import fastamp  # noqa: E402
from fastamp.integrations import accelerate as fa  # noqa: E402
from fastamp.integrations.transformers import FastampTrainer  # noqa: E402

STEPS = 30


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = common.mlp()
        self.losses: list[float] = []  # every step's, unrounded (the Trainer logs 4 digits)

    def forward(self, x, labels=None):
        logits = self.net(x.to(self.net[0].weight.dtype))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = common.loss_of(logits, labels)
            self.losses.append(float(out["loss"].detach()))
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = common.dataset()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class TorchScalerTrainer(transformers.Trainer):
    """The Trainer's own path with torch's scaler (on CPU accelerate builds none for fp16)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        fa.install_grad_scaler(self.accelerator, torch.amp.GradScaler("cpu"))


def train(
    cls, tmp_path, count=False, max_grad_norm=0.5, dtype=torch.float32, fp16=True, bf16=False, **kw
):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fp16=fp16,
        bf16=bf16,
        max_steps=STEPS,
        learning_rate=1e-2,
        per_device_train_batch_size=32,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        lr_scheduler_type="constant",
        optim="adamw_torch",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_grad_norm=max_grad_norm,
        **kw,
    )
    torch.manual_seed(0)
    model = Classifier().to(dtype)
    trainer = cls(model=model, args=args, train_dataset=Rows())
    counter = common.OpCounter()
    if count:
        with counter:
            trainer.train()
    else:
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, model, losses, counter.counts


def test_fastamp_trainer_uses_fastamp_scaler_adamw_and_fused_clip(tmp_path):
    trainer, ours, losses, counts = train(FastampTrainer, tmp_path / "a", count=True)
    assert isinstance(trainer.accelerator.scaler, fastamp.GradScaler)
    assert isinstance(trainer.optimizer.optimizer, fastamp.optim.AdamW)
    _, ref, ref_losses, _ = train(TorchScalerTrainer, tmp_path / "b")
    assert len(losses) == STEPS
    common.assert_learns(losses)
    # decay and no-decay parameter groups: two fused launches per step
    common.assert_fused_clip(counts, STEPS, groups=2)
    torch.testing.assert_close(losses, ref_losses, rtol=5e-3, atol=5e-3)
    common.assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


def test_fastamp_scaler_with_torch_adamw_is_bitwise_the_trainers_path(tmp_path):
    # No clipping (max_grad_norm=0: the Trainer still takes the norm, with max_norm=inf) and torch's
    # AdamW on both sides: the same arithmetic, so the same bits.
    class WithTorchAdamW(FastampTrainer):
        def create_optimizer(self, model=None):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, foreach=False)
            return self.optimizer

    class RefWithTorchAdamW(TorchScalerTrainer):
        create_optimizer = WithTorchAdamW.create_optimizer

    trainer, ours, losses, counts = train(
        WithTorchAdamW, tmp_path / "a", count=True, max_grad_norm=0.0
    )
    _, ref, ref_losses, _ = train(RefWithTorchAdamW, tmp_path / "b", max_grad_norm=0.0)
    assert isinstance(trainer.accelerator.scaler, fastamp.GradScaler)
    assert counts["fastamp.grad_stats"] == STEPS
    common.assert_learns(losses)
    assert losses == ref_losses
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_max_grad_norm_without_scaler_is_folded_into_the_fused_step(bf16, tmp_path, monkeypatch):
    calls = common.spy_on_fastamps_clip(monkeypatch)
    trainer, ours, _, counts = train(
        FastampTrainer, tmp_path / "a", count=True, bf16=bf16, fp16=False
    )
    assert trainer.accelerator.scaler is None
    assert isinstance(trainer.accelerator, fa.Accelerator)
    assert isinstance(trainer.optimizer.optimizer, fastamp.optim.AdamW)
    assert calls == [fastamp.optim.AdamW] * STEPS
    common.assert_fused_clip(counts, STEPS, groups=2)
    assert trainer.optimizer.optimizer.pending_clip is None  # each clip was taken by its step
    _, ref, _, _ = train(transformers.Trainer, tmp_path / "b", bf16=bf16, fp16=False)
    _, exact, _, _ = train(
        transformers.Trainer, tmp_path / "c", bf16=False, fp16=False, dtype=torch.float64
    )
    assert len(ours.losses) == len(ref.losses) == STEPS
    common.assert_learns(ours.losses)
    common.assert_within_torchs_error((ours.losses, ours), (ref.losses, ref), (exact.losses, exact))
