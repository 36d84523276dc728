"""Issue 14, checkpoint: fastamp.checkpoint.checkpoint runs like torch.utils.checkpoint when nothing
requires grad (frozen layers, a model after fastamp.checkpoint.apply() with frozen parameters), and
nothing raises once the block has run; tensor_digest names a sparse layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastamp
from fastamp.checkpoint import apply, checkpoint
from fastamp.checkpoint.planner import count_saved_bytes
from fastamp.testing import assert_bitwise_equal


def _frozen_block(seed=0):
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 6))
    block.requires_grad_(False)
    return block


def _state(block):
    return [t.clone() for t in block.state_dict().values()] + [torch.get_rng_state()]


def _run(ckpt, x_requires_grad):
    block = _frozen_block()
    torch.manual_seed(5)
    x = torch.randn(8, 6, requires_grad=x_requires_grad)
    with torch.enable_grad():
        out = ckpt(block, x)
    return out, _state(block)


def _torch_ckpt(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def test_frozen_block_runs_like_torch():
    t_out, t_state = _run(_torch_ckpt, False)
    f_out, f_state = _run(checkpoint, False)
    assert not t_out.requires_grad and not f_out.requires_grad
    assert_bitwise_equal([f_out] + f_state, [t_out] + t_state)  # output, BN stats, RNG alike


def test_frozen_block_with_input_requiring_grad_like_torch():
    t_out, t_state = _run(_torch_ckpt, True)
    f_out, f_state = _run(checkpoint, True)
    assert_bitwise_equal([f_out.detach()] + f_state, [t_out.detach()] + t_state)
    assert f_out.requires_grad and t_out.requires_grad


def test_frozen_layers_in_fine_tuning_train_like_torch():
    # Early layers frozen and checkpointed, the head trains: the same grads as with torch.
    results = []
    for ckpt in (_torch_ckpt, checkpoint):
        backbone = _frozen_block(1)
        torch.manual_seed(2)
        head = nn.Linear(6, 2)
        x = torch.randn(8, 6)
        torch.manual_seed(3)
        y = ckpt(backbone, x)
        head(y).square().sum().backward()
        results.append([head.weight.grad.clone(), head.bias.grad.clone()] + _state(backbone))
    assert_bitwise_equal(results[1], results[0])


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)]
        )

    def forward(self, x):
        return self.blocks(x)


def test_applied_plan_with_frozen_params_runs_like_the_plain_model():
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(4, 8, 16)
    with count_saved_bytes(model) as base:
        model(x.clone().requires_grad_())
    plan = apply(model, base.total // 2, x, verbose=False)
    assert plan.chosen  # some blocks are checkpointed
    model.requires_grad_(False)  # e.g. evaluation with grad mode on, or a frozen backbone
    with torch.enable_grad():
        out = model(x)  # raised "nothing to recompute" before
    plan.remove()
    assert_bitwise_equal(out, model(x))


def test_no_error_after_the_block_ran():
    # Whatever checkpoint refuses, it refuses before running the block: a block that counts its
    # calls and draws random numbers has run once or not at all.
    calls = []

    def block(x):
        calls.append(1)
        return x * torch.rand(())

    rng = torch.get_rng_state()
    for kwargs in (
        {"use_reentrant": True},
        {"determinism_check": "exact"},
        {"determinism_check": "bitwise", "debug": True},
        {"context_fn": 3},
    ):
        with pytest.raises((ValueError, TypeError)):
            checkpoint(block, torch.ones(2, requires_grad=True), **kwargs)
    assert calls == [] and torch.equal(torch.get_rng_state(), rng)
    checkpoint(block, torch.ones(2))  # nothing requires grad: runs, like torch
    assert calls == [1]


def test_tensor_digest_of_a_sparse_tensor_says_so():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has layout Sparse; expected dense"):
        torch.ops.fastamp.tensor_digest([sparse])
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has layout Sparse") as info:
        torch.ops.fastamp.tensor_digest([torch.ones(2), sparse])
    assert "in this build" not in str(info.value)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has layout torch.sparse_coo"):
        fastamp.checkpoint.ops.tensor_digest([sparse])
