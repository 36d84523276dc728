"""Workers of tests/parallel/test_ddp_clients.py: the client libraries (accelerate,
transformers, Lightning) with fastamp's DDP, each run next to the same library with torch's DDP
on the same data. The libraries initialise the process group themselves from the torchrun-style
environment variables set here. The recipes are the ones docs/ddp.md gives."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import fastamp


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        GROUP_RANK="0",
    )


def _same_params(a: nn.Module, b: nn.Module, what: str, rtol=1e-5, atol=1e-6) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(
            p, q, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{what}: {n}: {m}"
        )


def _same_everywhere(model: nn.Module, what: str) -> None:
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], f) for f in everyone), f"{what}: replicas differ"


def _leave() -> None:
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# -------------------------------------------------------------------------------- accelerate
def accelerate_prepare(rank: int, world: int, port: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import extract_model_from_parallel

    _env(rank, world, port)
    acc = Accelerator(cpu=True)
    assert dist.is_initialized() and dist.get_world_size() == world, acc.distributed_type
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]

    # torch's DDP, wrapped by accelerate itself
    ref_model = copy.deepcopy(base)
    ref, ref_opt = acc.prepare(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    assert type(ref) is torch.nn.parallel.DistributedDataParallel, type(ref)
    # fastamp's DDP: wrap it, then let accelerate do the rest without wrapping it again
    inner = copy.deepcopy(base)
    model = acc.prepare_model(fastamp.parallel.DistributedDataParallel(inner), evaluation_mode=True)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(model) is fastamp.parallel.DistributedDataParallel, type(model)
    assert extract_model_from_parallel(model) is inner
    assert acc.unwrap_model(model) is inner
    for step, (x, y) in enumerate(data):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            if step % 2 == 0:  # accelerate's no_sync path, then its sync
                with acc.no_sync(m):
                    acc.backward(nn.functional.mse_loss(m(x[:2]), y[:2]) / 2)
                with acc.trigger_sync_in_backward(m):
                    acc.backward(nn.functional.mse_loss(m(x[2:]), y[2:]) / 2)
            else:
                acc.backward(nn.functional.mse_loss(m(x), y))
            o.step()
    _same_params(model.module, ref.module, "accelerate")
    _same_everywhere(model, "accelerate")
    state = acc.get_state_dict(model)
    assert list(state) == list(inner.state_dict()), list(state)  # unwrapped keys, no "module."
    _leave()


# -------------------------------------------------------------------------------- transformers
def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (8,), generator=g)
        return {"input_ids": ids, "labels": ids}


def transformers_trainer(rank: int, world: int, port: int, out: str) -> None:
    import transformers
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from fastamp.parallel import DistributedDataParallel as FDDP

    class FastampTrainer(Trainer):
        """The recipe: the Trainer wraps its model in fastamp's DDP instead of torch's."""

        def _wrap_model(self, model, training=True, dataloader=None):
            if (
                training
                and dist.is_initialized()
                and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
            ):
                return FDDP(model)
            return super()._wrap_model(model, training, dataloader)

    _env(rank, world, port)
    transformers.set_seed(0)

    def args(tag, max_steps):
        return TrainingArguments(
            output_dir=os.path.join(out, tag),
            max_steps=max_steps,
            save_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            use_cpu=True,
            report_to=[],
            logging_steps=100,
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )

    runs = {}
    for tag, cls in (("torch", Trainer), ("fastamp", FastampTrainer)):
        trainer = cls(model=_tiny_gpt2(), args=args(tag, 4), train_dataset=_Data())
        trainer.train()
        wrapped = trainer.model_wrapped
        expected = FDDP if tag == "fastamp" else torch.nn.parallel.DistributedDataParallel
        assert type(wrapped) is expected, (tag, type(wrapped))
        runs[tag] = trainer
    f, t = runs["fastamp"], runs["torch"]
    assert isinstance(f.model, GPT2LMHeadModel)
    _same_params(f.model, t.model, "Trainer")
    _same_everywhere(f.model, "Trainer")
    dist.barrier()
    # the checkpoint holds the model, not the wrapper: it loads into a plain model
    ckpt = os.path.join(out, "fastamp", "checkpoint-4")
    loaded = GPT2LMHeadModel.from_pretrained(ckpt)
    _same_params(loaded, f.model, "from_pretrained(checkpoint)", rtol=0, atol=0)
    # and resuming from the middle lands on the same weights as the uninterrupted run
    resumed = FastampTrainer(model=_tiny_gpt2(), args=args("fastamp", 4), train_dataset=_Data())
    resumed.train(resume_from_checkpoint=os.path.join(out, "fastamp", "checkpoint-2"))
    _same_params(resumed.model, f.model, "resumed from checkpoint-2")
    _leave()


# -------------------------------------------------------------------------------- Lightning
def lightning_strategy(rank: int, world: int, port: int, out: str) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from fastamp.parallel import DistributedDataParallel as FDDP

    class FastampDDPStrategy(DDPStrategy):
        """The recipe: Lightning's DDP strategy, wrapping in fastamp's DDP."""

        def _setup_model(self, model):
            return FDDP(
                module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs
            )

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

        def training_step(self, batch, i):
            self.wrapper = type(self.trainer.strategy.model)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    _env(rank, world, port)
    g = torch.Generator().manual_seed(5)
    ds = torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)
    )
    models = {}
    for tag, strategy in (("torch", DDPStrategy()), ("fastamp", FastampDDPStrategy())):
        net = Net()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=4,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=os.path.join(out, tag),
        )
        trainer.fit(net, torch.utils.data.DataLoader(ds, batch_size=4))
        expected = FDDP if tag == "fastamp" else torch.nn.parallel.DistributedDataParallel
        assert net.wrapper is expected, net.wrapper
        models[tag] = net
    _same_params(models["fastamp"], models["torch"], "Lightning")
    _same_everywhere(models["fastamp"], "Lightning")
    _leave()
