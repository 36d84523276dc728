"""The steady-state AMP step is capture-safe (what a CUDA graph needs), checked on the CPU: after
warm-up steps, ``scaler.clip_grad_norm_`` + ``scaler.step`` + ``scaler.update`` with a fastamp
optimizer (each state format, master weights, SGD with momentum) makes no op that reads a device
value on the host (``aten::_local_scalar_dense``, what ``.item()`` / ``bool(t)`` / ``.tolist()``
dispatch to) and no copy to another device, seen by a ``TorchDispatchMode`` under every op; and
every tensor that lives across steps (scale, growth tracker, params, grads, every state tensor)
keeps its storage address. A planted ``.item()`` and a re-made state tensor each fail the check."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastamp

HOST_READS = {"aten::_local_scalar_dense", "aten::item"}


class _Ops(TorchDispatchMode):
    """Every op dispatched inside the block, and the devices each copy goes to."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.copies_to: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.names.append(name)
        if name in ("aten::_to_copy", "aten::to", "aten::copy_") and "device" in kwargs:
            self.copies_to.add(str(kwargs["device"]))
        return func(*args, **kwargs)


CASES = {
    "adamw": (fastamp.optim.AdamW, {"lr": 1e-3}),
    "adamw_amsgrad": (fastamp.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
    "adamw_bf16_state": (fastamp.optim.AdamW, {"lr": 1e-3, "state_dtype": torch.bfloat16}),
    "adamw_int8_state": (fastamp.optim.AdamW, {"lr": 1e-3, "state_dtype": "int8"}),
    "adamw_master_weights": (fastamp.optim.AdamW, {"lr": 1e-3, "master_weights": True}),
    "sgd_momentum": (fastamp.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


def _setup(case: str):
    cls, options = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 260), nn.LayerNorm(260), nn.Linear(260, 5))
    if options.get("master_weights"):
        model = model.to(torch.bfloat16)
    opt = cls(model.parameters(), **options)
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g  # the same grad tensors every step (a captured backward writes them in place)

    def step() -> None:
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    scaler.scale(torch.ones(()))  # the scale's lazy init
    return model, opt, scaler, step


def _lived(model, opt, scaler) -> list[torch.Tensor]:
    """Every tensor that lives across steps."""
    out = [scaler._scale, scaler._growth_tracker]  # private-ok: the scaler's own device scalars
    for p in model.parameters():
        out += [p, p.grad]
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _steady_state_violations(model, opt, scaler, step, steps: int = 4) -> list[str]:
    for _ in range(3):
        step()
    before = _lived(model, opt, scaler)  # kept: no id is reused while they are compared
    addresses = [t.untyped_storage().data_ptr() for t in before]
    ops = _Ops()
    with ops:
        for _ in range(steps):
            step()
    after = _lived(model, opt, scaler)
    problems = [f"host read: {n}" for n in ops.names if n in HOST_READS]
    problems += [f"copy to {d}" for d in ops.copies_to if d != "cpu"]
    moved = abs(len(after) - len(before)) + sum(
        a is not b or a.untyped_storage().data_ptr() != addr
        for a, b, addr in zip(after, before, addresses)
    )
    if moved:
        problems.append(f"{moved} tensor(s) living across steps moved or were re-made")
    return problems


@pytest.mark.parametrize("case", sorted(CASES))
def test_steady_state_step_reads_nothing_on_the_host_and_keeps_its_addresses(case):
    model, opt, scaler, step = _setup(case)
    assert _steady_state_violations(model, opt, scaler, step) == []


def test_a_planted_host_read_is_seen():
    model, opt, scaler, step = _setup("adamw")

    def syncing_step() -> None:
        step()
        scaler._scale.item()  # private-ok: the planted read-back

    assert "host read: aten::_local_scalar_dense" in _steady_state_violations(
        model, opt, scaler, syncing_step
    )


def test_a_remade_state_tensor_is_seen():
    model, opt, scaler, step = _setup("adamw")
    first = next(iter(model.parameters()))

    def remaking_step() -> None:
        step()
        st = opt.state[first]
        st["exp_avg"] = st["exp_avg"].clone()

    problems = _steady_state_violations(model, opt, scaler, remaking_step)
    assert any("moved or were re-made" in p for p in problems), problems


@pytest.mark.parametrize("as_view", [True, False], ids=["bucket_view", "grad_copy"])
def test_ddp_steady_state_step_is_capture_safe(as_view):
    """The same contract for the step after fastamp's DDP backward (one gloo rank, in process):
    with ``gradient_as_bucket_view=True`` the grads are views of the reducer's buckets, and the
    step keeps them, the params, the state and the scale where they are, reading nothing on the
    host. The backward runs outside the mode: it is torch's reducer's, not the step."""
    import torch.distributed as dist

    from fastamp.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(30, 26), nn.LayerNorm(26), nn.Linear(26, 5))
        model = DistributedDataParallel(net, gradient_as_bucket_view=as_view)
        opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        model.register_grad_scaler(scaler)  # the clip reuses the buckets' statistics
        x = torch.randn(8, 30, generator=torch.Generator().manual_seed(1))

        def backward() -> None:
            scaler.scale(model(x).square().mean()).backward()

        def step() -> None:
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

        for _ in range(3):
            backward()
            step()
        lived = _lived(net, opt, scaler)
        addresses = [t.untyped_storage().data_ptr() for t in lived]
        problems: list[str] = []
        for _ in range(3):
            backward()  # grads accumulate into the same tensors (no zero_grad): as captured
            ops = _Ops()
            with ops:
                step()
            problems += [f"host read: {n}" for n in ops.names if n in HOST_READS]
        after = _lived(net, opt, scaler)
        moved = sum(
            a is not b or a.untyped_storage().data_ptr() != addr
            for a, b, addr in zip(after, lived, addresses)
        )
        assert problems == [] and moved == 0, (problems, moved)
        if as_view:  # the grads are the buckets' views throughout
            assert all(p.grad._base is not None for p in net.parameters())
    finally:
        dist.destroy_process_group()
