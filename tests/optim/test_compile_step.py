"""The whole AMP step compiles (issue 38): ``torch.compile(fullgraph=True)`` of a function that runs
``scaler.clip_grad_norm_``, ``scaler.step(opt)`` and ``scaler.update()`` with a fastamp optimizer
traces with no graph break (fullgraph raises on one), compiles once for the first step (which makes
the state) and once for the steady state, not again per step, and gives the eager step's params,
state and scale bit for bit over steps that include an overflow (skipped, scale backed off)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import fastamp

CASES = {
    "adamw": (fastamp.optim.AdamW, {"lr": 1e-2}),
    "adamw_bf16_state": (fastamp.optim.AdamW, {"lr": 1e-2, "state_dtype": torch.bfloat16}),
    "adamw_int8_state": (fastamp.optim.AdamW, {"lr": 1e-2, "state_dtype": "int8"}),
    "adamw_master_weights": (fastamp.optim.AdamW, {"lr": 1e-2, "master_weights": True}),
    "sgd_momentum": (fastamp.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


def _run(case: str, compiled: bool, backend: str = "eager"):
    cls, options = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 260), nn.LayerNorm(260))
    if options.get("master_weights"):
        model = model.to(torch.bfloat16)
    opt = cls(model.parameters(), **options)
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.scale(torch.ones(()))  # the scale's lazy init

    def step() -> None:
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    counter = CompileCounter()
    fn = torch.compile(step, backend=counter if backend == "eager" else backend, fullgraph=True)
    fn = fn if compiled else step
    gen = torch.Generator().manual_seed(1)
    for k in range(7):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen) * 1024
            if k == 4:
                g.view(-1)[0] = float("inf")  # skipped; the scale backs off
            p.grad = g.to(p.dtype)
        fn()
    return model, opt, scaler, counter.frame_count


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_step_compiles_fullgraph_and_equals_eager(case):
    torch._dynamo.reset()
    m_eager, o_eager, s_eager, _ = _run(case, compiled=False)
    m_comp, o_comp, s_comp, compiles = _run(case, compiled=True)
    assert compiles <= 2, f"recompiled {compiles} times in 7 steps"
    # 1024 grows every 2 clean steps: x2 x2, /2 at the overflow (step 4), x2 again
    assert s_comp.get_scale() == s_eager.get_scale() == 2.0**12
    for a, b in zip(m_eager.parameters(), m_comp.parameters()):
        assert torch.equal(a, b)
        sa, sb = o_eager.state[a], o_comp.state[b]
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[key]), key


def test_whole_step_compiles_through_aot_autograd():
    """The same through AOTAutograd's functionalization (the ops' fake kernels and mutation
    annotations), which backend="inductor" uses too."""
    torch._dynamo.reset()
    m_eager, _, s_eager, _ = _run("adamw", compiled=False)
    m_comp, _, s_comp, _ = _run("adamw", compiled=True, backend="aot_eager")
    assert s_comp.get_scale() == s_eager.get_scale()
    for a, b in zip(m_eager.parameters(), m_comp.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("warm", [0, 3], ids=["cold", "after_eager_steps"])
def test_dynamo_explain_reports_one_graph_and_no_break(warm):
    """``torch._dynamo.explain`` of the whole step (the issue's check), from a fresh scaler and
    after eager steps (whose direct kernel calls leave no op wrapper for a trace to build)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fastamp.GradScaler("cpu")

    def backward() -> None:
        scaler.scale(model(torch.randn(2, 8)).square().sum()).backward()

    def step() -> None:
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    for _ in range(warm):
        backward()
        step()
    backward()
    explained = torch._dynamo.explain(step)()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def _recipe(flat_buffers: bool, compiled: bool, **options):
    """docs/graphs.md's recipe (backward in the loop, zero_grad after the step), so that with
    ``flat_buffers=True`` the grads the compiled step reads are views of the flat grad buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    data = [torch.randn(16, 32) for _ in range(6)]
    if options.get("master_weights"):
        model = model.to(torch.bfloat16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, flat_buffers=flat_buffers, **options)
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def amp_step() -> None:
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    counter = CompileCounter()
    fn = torch.compile(amp_step, backend=counter, fullgraph=True) if compiled else amp_step
    for k, batch in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch).float().square().mean()
        scaler.scale(loss).backward()
        if k == 3:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # skipped, backed off
        fn()
        opt.zero_grad()
    return model, opt, scaler, counter.frame_count


@pytest.mark.parametrize(
    "options", [{}, {"amsgrad": True}, {"master_weights": True}], ids=["plain", "amsgrad", "master"]
)
def test_flat_buffers_recipe_compiles_fullgraph_and_equals_eager(options):
    """Issue 53 (4): with flat buffers the grads are views of one flat buffer, which Dynamo gives
    symbolic strides; the layout check compared stride tuples and failed to trace."""
    torch._dynamo.reset()
    m_eager, o_eager, s_eager, _ = _recipe(flat_buffers=True, compiled=False, **options)
    m_comp, o_comp, s_comp, compiles = _recipe(flat_buffers=True, compiled=True, **options)
    assert 1 <= compiles <= 3, f"compiled {compiles} times in 6 steps"
    assert s_comp.get_scale() == s_eager.get_scale()
    for m in (m_eager, m_comp):  # the grads are views of one flat buffer
        bases = {
            p.grad._base.data_ptr() if p.grad._base is not None else None for p in m.parameters()
        }
        assert len(bases) == 1 and None not in bases, bases
    for a, b in zip(m_eager.parameters(), m_comp.parameters()):
        assert torch.equal(a, b)
        for key, value in o_eager.state[a].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, o_comp.state[b][key]), key
    # and the same training as the per-parameter layout (flat buffers change no value)
    m_plain, _, _, _ = _recipe(flat_buffers=False, compiled=False, **options)
    for a, b in zip(m_plain.parameters(), m_comp.parameters()):
        assert torch.equal(a, b)
