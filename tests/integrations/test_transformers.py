"""fastamp.integrations.transformers.FastampTrainer against the Trainer's own path, CPU fp16."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.integrations._common import (
    OpCounter,
    assert_fused_clip,
    assert_learns,
    assert_params_close,
    dataset,
    mlp,
)

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
        self.net = mlp()

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = dataset()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class TorchScalerTrainer(transformers.Trainer):
    """The Trainer's own path with torch's scaler (on CPU accelerate builds none for fp16)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        fa.install_grad_scaler(self.accelerator, torch.amp.GradScaler("cpu"))


def train(cls, tmp_path, count=False, max_grad_norm=0.5, **kw):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fp16=True,
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
    model = Classifier()
    trainer = cls(model=model, args=args, train_dataset=Rows())
    counter = OpCounter()
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
    assert_learns(losses)
    # decay and no-decay parameter groups: two fused launches per step
    assert_fused_clip(counts, STEPS, groups=2)
    torch.testing.assert_close(losses, ref_losses, rtol=5e-3, atol=5e-3)
    assert_params_close(ours, ref, rtol=5e-3, atol=5e-4)


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
    assert_learns(losses)
    assert losses == ref_losses
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
