"""fastamp.checkpoint: exact replay (dropout + autocast), bitwise checks, policies, offload, planner."""

import pytest
import torch
from torch import nn

import fastamp
from fastamp.checkpoint import (
    CheckpointError,
    apply,
    checkpoint,
    checkpoint_sequential,
    offload_activations,
    selective,
)
from fastamp.checkpoint.planner import count_saved_bytes


class Block(nn.Module):
    def __init__(self, dim=32, p=0.2):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.ln(x))))))


def _stack(n=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(n)])


def _grads(model, x, run, autocast=True):
    torch.manual_seed(123)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = run(model, x)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], out.detach()


def _plain(model, x):
    return model(x)


def _each_block(model, x):
    for b in model:
        x = checkpoint(b, x)
    return x


def _nested(model, x):
    def outer(x):
        x = checkpoint(model[0], x)
        x = model[1](x)
        return checkpoint(lambda y: model[3](checkpoint(model[2], y)), x)

    return checkpoint(outer, x)


def _sequential(model, x):
    return checkpoint_sequential(model, 2, x)


@pytest.mark.parametrize(
    "run", [_each_block, _nested, _sequential], ids=["blocks", "nested", "sequential"]
)
@pytest.mark.parametrize("autocast", [True, False])
def test_grads_bitwise_identical_to_no_checkpoint_with_dropout(run, autocast):
    model = _stack()
    x = torch.randn(8, 16, 32)
    ref, ref_out = _grads(model, x, _plain, autocast)
    got, out = _grads(model, x, run, autocast)
    assert torch.equal(out, ref_out)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_bitwise_check_passes_on_a_deterministic_block():
    model = _stack(2)
    x = torch.randn(4, 8, 32, requires_grad=True)
    out = checkpoint(model, x, determinism_check="bitwise")
    out.sum().backward()
    assert x.grad is not None


def test_bitwise_check_names_a_planted_nondeterminism():
    gen = torch.Generator().manual_seed(0)  # a generator of its own: not replayed

    def leaky(x):
        noise = torch.randn(x.shape, generator=gen)
        return (x * 2 + noise).sin()

    x = torch.randn(4, 8, requires_grad=True)
    out = checkpoint(leaky, x, determinism_check="bitwise")
    with pytest.raises(
        CheckpointError, match=r"output 0 of op #\d+ \(aten\.randn\.\w+\) differs bitwise"
    ):
        out.sum().backward()


def test_default_check_still_catches_metadata_mismatch():
    calls = []

    def shape_changes(x):
        calls.append(1)
        return (x[: len(calls) + 1] * 2).exp()

    x = torch.randn(4, 3, requires_grad=True)
    out = checkpoint(shape_changes, x)
    with pytest.raises(CheckpointError):
        out.sum().backward()


def test_misuse_errors():
    # Nothing requiring grad is no misuse: the block runs as with PyTorch (tests/checkpoint/
    # test_checkpoint_fidelity.py compares the two).
    assert checkpoint(lambda x: x * 2, torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        checkpoint(lambda x: x * 2, torch.randn(3, requires_grad=True), use_reentrant=True)
    with pytest.raises(ValueError, match="determinism_check must be one of"):
        checkpoint(lambda x: x * 2, torch.randn(3, requires_grad=True), determinism_check="exact")
    with pytest.raises(ValueError, match="segments must be an int >= 1"):
        checkpoint_sequential(_stack(2), 0, torch.randn(2, 32))
    with torch.no_grad():  # evaluation: nothing requires grad and that is fine
        assert checkpoint(lambda x: x * 2, torch.ones(2)).tolist() == [2.0, 2.0]


def test_kwargs_non_tensor_outputs_autograd_grad_and_retain_graph():
    w = torch.randn(5, 5, requires_grad=True)

    def f(x, *, scale, tag):
        return (x @ w * scale).tanh(), tag, 7

    x = torch.randn(3, 5, requires_grad=True)
    y, tag, seven = checkpoint(f, x, scale=0.5, tag="hello")
    assert (tag, seven) == ("hello", 7)
    (gx,) = torch.autograd.grad(y.sum(), inputs=[x], retain_graph=True)
    (gw,) = torch.autograd.grad(y.sum(), inputs=[w])  # second backward through the same graph
    ref_y = (x @ w * 0.5).tanh()
    rgx, rgw = torch.autograd.grad(ref_y.sum(), [x, w])
    assert torch.equal(gx, rgx) and torch.equal(gw, rgw)


def test_selective_policy_saves_matmuls_and_keeps_grads_exact():
    model = _stack(2)
    x = torch.randn(8, 16, 32)
    ref, _ = _grads(model, x, _plain)
    got, _ = _grads(model, x, lambda m, y: checkpoint(m, y, context_fn=selective()))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    with count_saved_bytes(model) as none_:
        model(x.requires_grad_())
    with count_saved_bytes(model) as full:
        checkpoint(model, x)
    with count_saved_bytes(model) as sel:
        checkpoint(model, x, context_fn=selective())
    assert full.total < sel.total < none_.total


def test_offload_keeps_grads_exact_and_reuses_buffers():
    model = _stack(2)
    x = torch.randn(8, 16, 32)
    ref, _ = _grads(model, x, _plain)
    ctx = offload_activations(min_bytes=1024, device_types=("cpu",))
    for _ in range(3):
        got, _ = _grads(model, x, lambda m, y: fastamp.checkpoint.offload(m, y, offload_ctx=ctx))
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    assert ctx.pool.reuses > 0  # steps 2 and 3 took the buffers step 1 gave back
    # retain_graph: a saved tensor unpacked twice must still read its own data
    y = x.clone().requires_grad_()
    with ctx:
        out = model(y)
    g1 = torch.autograd.grad(out.sum(), y, retain_graph=True)[0]
    g2 = torch.autograd.grad(out.sum(), y)[0]
    assert torch.equal(g1, g2)


def test_planner_fits_half_the_activation_memory():
    model = nn.Sequential(*[Block(64, p=0.0) for _ in range(12)])
    x = torch.randn(8, 32, 64)
    with count_saved_bytes(model) as base:
        model(x)
    budget = base.total // 2
    plan = apply(model, budget, x, verbose=False)
    assert 0 < len(plan.chosen) < 12
    with count_saved_bytes(model) as after:
        out = model(x.clone().requires_grad_())
    assert budget * 0.90 <= after.total <= budget, (after.total, budget)  # within 10%, never over
    out.sum().backward()  # runs, through the checkpointed blocks
    assert "checkpoint" in str(plan) and "budget" in str(plan)
    plan.remove()
    with count_saved_bytes(model) as restored:
        model(x)
    assert restored.total == base.total
    with pytest.raises(ValueError, match="even with every block checkpointed"):
        apply(model, 1, x, verbose=False)


def test_with_grad_scaler_and_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = _stack(3)
        ref_model = _stack(3)
        ddp = nn.parallel.DistributedDataParallel(model)

        class Ckpt(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                for b in self.inner.module:
                    x = checkpoint(b, x)
                return x

        wrapped = Ckpt(ddp)
        scaler = fastamp.GradScaler("cpu")
        opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
        for _ in range(2):
            x = torch.randn(4, 8, 32)
            torch.manual_seed(5)
            loss = ddp(x).square().mean() if False else wrapped(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            torch.manual_seed(5)
            ref_model(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_torch_compile_gives_the_same_grads():
    torch._dynamo.reset()
    model = _stack(2)
    x = torch.randn(4, 8, 32)

    def run(m, y):
        return _each_block(m, y)

    ref, _ = _grads(model, x, _plain, autocast=False)
    got, _ = _grads(model, x, torch.compile(run, backend="aot_eager"), autocast=False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("segments", [1, 2])
def test_checkpoint_sequential_takes_the_keywords_torchs_takes(segments):
    """torch's checkpoint_sequential takes preserve_rng_state by keyword and raises ValueError
    for any other before running anything; fastamp passed them on to the blocks (a TypeError from
    inside the first segment) or, with one segment, ignored them."""
    import torch.utils.checkpoint as tcp

    from fastamp.checkpoint import checkpoint_sequential

    calls = []
    seq = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    for block in seq:
        block.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 4, requires_grad=True)
    for fn in (tcp.checkpoint_sequential, checkpoint_sequential):
        with pytest.raises(ValueError, match="Unexpected keyword arguments: foo"):
            fn(seq, segments, x, use_reentrant=False, foo=1)
    assert calls == []  # (refused before any block ran)
    torch.manual_seed(0)
    a = tcp.checkpoint_sequential(seq, segments, x, use_reentrant=False, preserve_rng_state=False)
    torch.manual_seed(0)
    b = checkpoint_sequential(seq, segments, x, use_reentrant=False, preserve_rng_state=False)
    assert torch.equal(a, b)


def test_apply_leaves_the_global_rng_and_the_buffers_as_they_were():
    """apply() measures with a forward of the sample input (dropout draws from the RNG): the
    random stream after it is the one a run without it has (it used to be advanced)."""
    import contextlib
    import io

    from fastamp.checkpoint import apply

    m = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(3)])
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    with contextlib.redirect_stdout(io.StringIO()):
        plan = apply(m, budget_bytes=10**9, sample_input=torch.ones(4, 8))
    assert torch.equal(torch.rand(3), want)
    plan.remove()


def test_offload_takes_conjugate_and_negative_views_as_torchs_save_on_cpu():
    """A saved tensor that is a lazy conjugate (z.conj()) or negative view (z.conj().imag): the
    offload copied it with .view(), which such views refuse (a RuntimeError in the forward)."""
    from fastamp.checkpoint import offload_activations

    z = torch.randn(6, dtype=torch.cfloat, generator=torch.Generator().manual_seed(3))
    z.requires_grad_()

    def loss():
        c = z.conj()
        return (c * c).abs().sum() + (c.imag * c.imag.exp()).sum()

    want = torch.autograd.grad(loss(), z)[0]
    with offload_activations(min_bytes=0, device_types=("cpu",)):
        out = loss()
    assert torch.equal(torch.autograd.grad(out, z)[0], want)
