"""The steady-state step's direct kernel calls (fastamp._library.call_direct) and the scaler's
read-only grad plan (GradReplay.collect(read_only=True)).

- A planned step calls the backend kernels of ``grad_stats``, the held step ops and
  ``update_scale_`` directly (with flat buffers too: the scaler reads the grad buffers
  directly); it must give the bits, the write counters and the exceptions of the same step
  through the dispatcher (forced by making ``direct_call_allowed`` say no).
- Anything on the thread that would see the call (a TorchDispatchMode, inference mode) or a
  tensor subclass among the arguments sends the call through the dispatcher.
- The fused path's grad plan compares only the grads' types; a grad whose dtype, layout or
  strides changed is read by the stats op as it is, or refused by it and then collected in full,
  so the step matches a scaler and optimizer that never had a plan (the same params, or the same
  error). (A grad on another device than its param cannot be assigned in torch.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastamp
import fastamp._library as library
import fastamp.optim._ops as optim_ops
import fastamp.scaler._ops as scaler_ops


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _setup(name: str = "AdamW", **options):
    model = _model()
    table = {"AdamW": fastamp.optim.AdamW, "SGD": fastamp.optim.SGD}
    extra = {"momentum": 0.9} if name == "SGD" else {}
    if name == "AdamW-flat":  # flat buffers: the scaler reads the optimizer's grad buffers
        name, extra = "AdamW", {"flat_buffers": True}
    opt = table[name](model.parameters(), lr=1e-2, **extra, **options)
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, scaler


def _step(model, opt, scaler, seed: int, clip: bool = True, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    opt.zero_grad()
    scaler.scale(model(x).square().sum()).backward()
    if poison:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


class _Counted:
    """Counts call_direct's calls in the optim and scaler op layers."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        real = library.call_direct

        def counted(op, keyset, written, *args):
            self.calls.append(str(op))
            return real(op, keyset, written, *args)

        monkeypatch.setattr(optim_ops, "call_direct", counted)
        monkeypatch.setattr(scaler_ops, "call_direct", counted)


def _versions(model, opt, scaler) -> list[int]:
    out = [p._version for p in model.parameters()]
    for state in opt.state.values():
        out += [t._version for t in state.values() if isinstance(t, torch.Tensor)]
    return out + [scaler._scale._version, scaler._growth_tracker._version]


@pytest.mark.parametrize("name", ["AdamW", "SGD", "AdamW-flat"])
@pytest.mark.parametrize("clip", [True, False])
def test_direct_steps_equal_dispatched_steps_bits_and_write_counters(monkeypatch, name, clip):
    runs = []
    for direct in (True, False):
        with monkeypatch.context() as m:
            counted = _Counted(m)
            if not direct:
                for mod in (library, fastamp.optim._stepper, fastamp.scaler._clip,
                            fastamp.scaler.grad_scaler, fastamp.scaler.diagnostics):  # fmt: skip
                    m.setattr(mod, "direct_call_allowed", lambda: False)
            model, opt, scaler = _setup(name)
            versions = []
            for k in range(6):
                _step(model, opt, scaler, k, clip=clip, poison=k == 4)
                versions.append(_versions(model, opt, scaler))
            runs.append((model, opt, scaler, versions, counted.calls))
    (m1, o1, s1, v1, c1), (m2, o2, s2, v2, c2) = runs
    # The steady state went direct: the held step op, the stats op and the scale update.
    assert any("held" in c for c in c1) and any("update_scale_" in c for c in c1)
    assert any("grad_stats" in c for c in c1)
    assert c2 == []
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for pa, pb in zip(m1.parameters(), m2.parameters()):
        for key in o1.state[pa]:
            assert torch.equal(o1.state[pa][key], o2.state[pb][key]), key
    assert torch.equal(s1._scale, s2._scale) and torch.equal(s1._growth_tracker, s2._growth_tracker)
    # Every write counter moved as the dispatcher's ADInplaceOrView kernel moves it.
    assert v1 == v2


def test_a_dispatch_mode_sees_every_op_of_the_steady_state(monkeypatch):
    counted = _Counted(monkeypatch)
    model, opt, scaler = _setup()
    for k in range(3):
        _step(model, opt, scaler, k)
    assert counted.calls  # the steady state goes direct when nothing watches

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    counted.calls.clear()
    with Seen() as seen:
        _step(model, opt, scaler, 7)
    assert counted.calls == []
    for op in ("fastamp.grad_stats", "fastamp.adam_step_held_", "fastamp.update_scale_"):
        assert any(s.startswith(op) for s in seen.ops), (op, seen.ops)


def test_a_backward_through_a_param_saved_before_a_direct_step_raises():
    """The direct held call bumps the params' write counters as the dispatcher does."""
    model, opt, scaler = _setup()
    for k in range(3):
        _step(model, opt, scaler, k)
    w = model[0].weight
    y = (w * w).sum()  # saves w
    _step(model, opt, scaler, 5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_direct_call_raises_the_class_the_kernel_meant():
    """call_direct translates a kernel's marked refusal as the dispatcher kernel does."""
    grads = [torch.ones(3, dtype=torch.complex64)]
    keyset = library.backend_keyset(torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="not implemented"):
        library.call_direct(
            torch.ops.fastamp.grad_stats.default, keyset, (), grads, torch.ones(()), 2.0
        )
    with pytest.raises(NotImplementedError, match="not implemented"):
        torch.ops.fastamp.grad_stats(grads, torch.ones(()), 2.0)


def test_no_direct_call_in_inference_mode_or_with_grad_mode_on_for_the_step():
    assert library.direct_call_allowed()
    with torch.inference_mode():
        assert not library.direct_call_allowed()
    with TorchDispatchMode():
        assert not library.direct_call_allowed()


def _change_dtype(model) -> None:
    p = model[0].weight
    p.grad_dtype = None  # torch refuses a grad of another dtype unless told
    p.grad = p.grad.double()


def _change_to_sparse(model) -> None:
    p = model[0].bias
    p.grad = p.grad.to_sparse()


def _change_to_a_strided_view(model) -> None:
    p = model[0].weight
    wide = torch.zeros(p.shape[0], 2 * p.shape[1])
    wide[:, ::2] = p.grad
    p.grad = wide[:, ::2]  # every other column: not dense


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("change", [_change_dtype, _change_to_sparse, _change_to_a_strided_view])
def test_read_only_grad_plan_then_a_changed_grad_is_handled_as_without_a_plan(change, clip):
    """After a few planned steps, a grad changes dtype, layout or device; the planned scaler and
    a copy that never planned (same model, optimizer state and scale) must agree: the same
    params afterwards, or the same exception class and message."""
    model, opt, scaler = _setup()
    for k in range(3):
        _step(model, opt, scaler, k, clip=clip)
    assert scaler._reader.replays.get(opt) is not None
    fresh_model = copy.deepcopy(model)
    fresh_opt = fastamp.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state tensors
    fresh_scaler = fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    fresh_scaler.load_state_dict(scaler.state_dict())
    outcomes = []
    for m, o, s in ((model, opt, scaler), (fresh_model, fresh_opt, fresh_scaler)):
        g = torch.Generator().manual_seed(11)
        x = torch.randn(4, 6, generator=g)
        o.zero_grad()
        s.scale(m(x).square().sum()).backward()
        change(m)
        try:
            if clip:
                s.clip_grad_norm_(o, 1.0)
            s.step(o)
            s.update()
            outcomes.append(("ok", [p.detach().clone() for p in m.parameters()]))
        except Exception as e:  # compared below: class and message
            outcomes.append((type(e), str(e)))
    (a, pa), (b, pb) = outcomes
    assert a == b, outcomes
    if a == "ok":
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
    else:
        assert pa == pb
