"""The step replays (fastamp.optim._replay.StepReplay, fastamp.scaler._grads.GradReplay) see every change
they depend on: after a few steps (a plan in use), each change below is made to a torch optimizer
and to fastamp's on identical models, and the next steps must give the same params and state as
torch's. Each test first checks that a plan was in use, so the steady state is what is tested.

"The same" is judged against a third run, torch's optimizer on a float64 copy of the model: some
changes make the steps ill-conditioned (a moment set to 1.0 moves every weight of the Linear by
the whole lr, which the LayerNorm after it amplifies), and there torch's own float32 bits differ
between machines (AVX-512 vs AVX2) by more than any fixed rtol, so fastamp's error is bounded by
torch's error on the same input (tests/_reference64.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastamp
from tests._reference64 import assert_as_close_as_torch

TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
FASTAMP = {"Adam": fastamp.optim.Adam, "AdamW": fastamp.optim.AdamW, "SGD": fastamp.optim.SGD}
OPTIONS = {"Adam": {"lr": 1e-2}, "AdamW": {"lr": 1e-2}, "SGD": {"lr": 1e-2, "momentum": 0.9}}


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.LayerNorm(5))
    return m.to(dtype)


def _pair(name: str, groups=None):
    """[torch's, fastamp's, the float64 reference] models and optimizers: fastamp's are at
    index 1, the reference (torch's optimizer on a float64 copy) at index 2."""
    models = [_model(), _model(), _model(torch.float64)]
    opts = []
    for model, table in zip(models, (TORCH, FASTAMP, TORCH)):
        params = groups(model) if groups else model.parameters()
        extra = {"foreach": False} if table is TORCH else {}
        opts.append(table[name](params, **OPTIONS[name], **extra))
    return models, opts


def _grads(models, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 6, 6, generator=g)
    for m in models:
        for p in m.parameters():
            p.grad = None
        xm = x.to(next(m.parameters()).dtype)
        m(xm.to(memory_format=torch.channels_last) if _is_cl(m) else xm).square().sum().backward()


def _is_cl(m: nn.Module) -> bool:
    w = m[0].weight
    return w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()


def _steps(models, opts, n: int, seed: int = 0) -> None:
    for k in range(n):
        _grads(models, seed + k)
        for o in opts:
            o.step()


def _same(models, opts, keys=("exp_avg", "exp_avg_sq", "momentum_buffer")) -> None:
    """fastamp's params and state as close to the float64 run's as torch's are (within a factor
    of torch's own error there: see the module docstring)."""
    named = [dict(m.named_parameters()) for m in models]
    triples = []
    for n, pt in named[0].items():
        pf, p64 = named[1][n], named[2][n]
        triples.append((n, pf, pt, p64))
        st, sf, s64 = (o.state.get(p, {}) for o, p in zip(opts, (pt, pf, p64)))
        triples += [(f"{n} {k}", sf[k], st[k], s64[k]) for k in keys if k in st]
    assert_as_close_as_torch(triples)


def _planned(opt) -> bool:
    return opt._stepper.replay is not None


def _change_param_replaced(models, opts):
    for m, o in zip(models, opts):
        new = nn.Parameter(m[2].weight.detach() * 0.5)
        m[2].weight = new
        o.param_groups[0]["params"][2] = new


def _change_data_swapped(models, opts):
    for m in models:
        m[2].weight.data = m[2].weight.data * 0.5


def _change_add_param_group(models, opts):
    head = nn.Linear(5, 2)
    for m, o in zip(models, opts):
        m.extra = copy.deepcopy(head).to(next(m.parameters()).dtype)
        o.add_param_group({"params": list(m.extra.parameters()), "lr": 1e-3})

    def forward(self, x):  # the extra head joins the loss
        for layer in list(self)[:4]:
            x = layer(x)
        return self.extra(x)

    for m in models:
        m.forward = forward.__get__(m)


def _change_load_state_dict(models, opts):
    sd = copy.deepcopy(opts[0].state_dict())
    for group in sd["param_groups"]:
        group["lr"] = 3e-3
    for st in sd["state"].values():
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor):
                st[k] = v * 0.25
    for o in opts:
        o.load_state_dict(copy.deepcopy(sd))


def _change_option_edited(models, opts):
    for o in opts:
        o.param_groups[0]["lr"] = 5e-2
        o.param_groups[0]["weight_decay"] = 0.1


def _change_grad_disappears(models, opts):
    pass  # applied in _steps_with_gap


def _change_channels_last(models, opts):
    for m in models:
        m.to(memory_format=torch.channels_last)


def _change_state_replaced(models, opts):
    for m, o in zip(models, opts):
        st = o.state[m[2].weight]
        key = "momentum_buffer" if "momentum_buffer" in st else "exp_avg"
        st[key] = st[key] * 0.0 + 1.0


def _change_state_cleared(models, opts):
    for m, o in zip(models, opts):
        del o.state[m[2].weight]


CHANGES = {
    "param_replaced": _change_param_replaced,
    "data_swapped": _change_data_swapped,
    "add_param_group": _change_add_param_group,
    "load_state_dict": _change_load_state_dict,
    "option_edited": _change_option_edited,
    "channels_last": _change_channels_last,
    "state_replaced": _change_state_replaced,
    "state_cleared": _change_state_cleared,
}


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_plan_sees_each_change(name, change):
    models, opts = _pair(name)
    _steps(models, opts, 3)
    assert _planned(opts[1]), "no plan in use after three steps: the test would test nothing"
    _same(models, opts)
    CHANGES[change](models, opts)
    _steps(models, opts, 3, seed=10)
    _same(models, opts)
    assert _planned(opts[1]), "the plan was not rebuilt after the change"


def _two_groups(m: nn.Module) -> list[dict]:
    """Two launches: the Linear and the LayerNorm (another weight decay) after the Conv."""
    return [
        {"params": list(m[0].parameters())},
        {"params": list(m[2].parameters()) + list(m[3].parameters()), "weight_decay": 0.0},
    ]


TWO_GROUP_CHANGES = ["data_swapped", "channels_last", "state_replaced", "state_cleared",
                     "load_state_dict", "option_edited"]  # fmt: skip


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
@pytest.mark.parametrize("change", TWO_GROUP_CHANGES)
def test_two_launch_plan_sees_each_change(name, change):
    """A plan of two launches compares what the params are made of itself (a later launch must
    not be the first to refuse): each change differential against torch."""
    models, opts = _pair(name, _two_groups)
    _steps(models, opts, 3)
    assert _planned(opts[1]) and len(opts[1]._stepper.replay.launches) == 2
    # unchanged, the replay serves the next step's grads (one list per launch)
    _grads(models, 99)
    served = opts[1]._stepper.replay.grads(opts[1].param_groups, opts[1].state)
    assert served is not None and len(served) == 2
    CHANGES[change](models, opts)
    _steps(models, opts, 3, seed=10)
    _same(models, opts)
    assert _planned(opts[1])


def test_plan_sees_a_dtype_change():
    """A param's dtype decides its state format and master weights: a changed dtype makes the
    plan stand down (the next step is a full one, which decides anew)."""
    models, opts = _pair("AdamW")
    _steps(models, opts, 3)
    opt = opts[1]
    assert _planned(opt)
    w = models[1][2].weight
    w.data = w.data.double()
    assert opt._stepper.replay.grads(opt.param_groups, opt.state) is None


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_plan_sees_a_grad_that_disappears_and_comes_back(name):
    models, opts = _pair(name)
    _steps(models, opts, 3)
    assert _planned(opts[1])
    for k in range(4):
        _grads(models, 20 + k)
        if k % 2 == 0:  # the Linear's weight has no grad on these steps
            for m in models:
                m[2].weight.grad = None
        for o in opts:
            o.step()
        _same(models, opts)


def test_plan_with_two_groups_refuses_a_bad_grad_before_any_write():
    """Two launches: a later group's bad grad is found before the first launch writes."""
    models, opts = _pair("AdamW", lambda m: [
        {"params": list(m[0].parameters())},
        {"params": list(m[2].parameters()) + list(m[3].parameters()), "weight_decay": 0.0},
    ])  # fmt: skip
    _steps(models, opts, 3)
    opt = opts[1]
    assert _planned(opt) and len(opt._stepper.replay.launches) == 2
    _grads(models, 30)
    before = [p.detach().clone() for p in models[1].parameters()]
    models[1][2].weight.grad = models[1][2].weight.grad.t().contiguous().t()  # other strides
    models[1][3].bias.grad.resize_(1)  # the second launch's kernel would refuse it
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[3\] has shape"):
        opt.step()
    for a, b in zip(before, models[1].parameters()):
        assert torch.equal(a, b)


def test_plan_refused_grad_reported_as_the_full_step_reports_it():
    """One launch: the kernel refuses a grad resized in place (same tensor, same presence), and
    the full step's error names the entry, nothing written."""
    models, opts = _pair("AdamW")
    _steps(models, opts, 3)
    _grads(models, 40)
    p = models[1][2].weight
    p.grad.resize_(p.numel())
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] has shape"):
        opts[1].step()
    assert torch.equal(before, p)


def test_grad_plan_sees_an_fp16_grad_for_unscale():
    """The scaler's GradReplay: a float16 grad appearing later is refused by unscale_ as by torch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fastamp.GradScaler("cpu")
    for k in range(3):
        _grads([model], k)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert len(scaler._reader.replays) == 1
    _grads([model], 9)
    model[2].half()  # params and grads: a float16 grad where a float32 one was
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_grad_plan_sees_a_sparse_grad():
    """A grad that becomes sparse is unscaled through its values, as torch's scaler does."""
    emb = [nn.Embedding(10, 3), nn.Embedding(10, 3)]
    emb[1].load_state_dict(emb[0].state_dict())
    opts = [torch.optim.SGD(e.parameters(), lr=0.1) for e in emb]
    scalers = [torch.amp.GradScaler("cpu"), fastamp.GradScaler("cpu")]
    idx = torch.tensor([1, 2, 2, 7])
    for k in range(4):
        for e, o, s in zip(emb, opts, scalers):
            e.sparse = k == 3
            o.zero_grad()
            s.scale(e(idx).square().sum()).backward()
            s.step(o)
            s.update()
    torch.testing.assert_close(emb[1].weight, emb[0].weight)


@pytest.mark.parametrize("option", ["momentum", "amsgrad"])
def test_plan_sees_a_structural_option_edited(option):
    """An option that changes what a step keeps (SGD's momentum turned off; Adam's amsgrad
    turned on, which torch starts from a zero running maximum) rebuilds the plan."""
    name = "SGD" if option == "momentum" else "Adam"
    models, opts = _pair(name)
    _steps(models, opts, 3)
    assert _planned(opts[1])
    for o, m in zip(opts, models):
        if option == "momentum":
            o.param_groups[0]["momentum"] = 0.0
        else:
            o.param_groups[0]["amsgrad"] = True
            for p in m.parameters():  # torch's Adam reads it once amsgrad is on
                o.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
    _steps(models, opts, 3, seed=50)
    _same(models, opts, keys=("exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq"))


def test_the_traced_step_walk_is_the_one_docs_architecture_lists():
    """docs/architecture.md lists the files a reader opens following one steady-state
    ``clip_grad_norm_`` + ``step`` + ``update``: its Python part must be the files a traced
    iteration runs in, in the order they first run."""
    import pathlib
    import re
    import sys

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    walk = doc[doc.index("### Following one `clip_grad_norm_` + `step` + `update`") :]
    walk = walk[: walk.index("\n\n", walk.index("| # | file |"))]
    listed = re.findall(r"^\| \d+ \| `([\w/]+\.py)` \|", walk, flags=re.M)
    params = [nn.Parameter(torch.randn(64)) for _ in range(8)]
    opt = fastamp.optim.AdamW(params, lr=1e-3)
    scaler = fastamp.GradScaler("cpu")

    def iteration():
        for p in params:
            p.grad = torch.randn(64)
        scaler.scale(torch.ones(()))

    def step():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        iteration()
        step()
    iteration()
    seen: list[str] = []

    package = str(pathlib.Path(fastamp.__file__).resolve().parent) + "/"

    def trace(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(package):
            rel = name[len(package) :]
            if rel not in seen:
                seen.append(rel)

    sys.settrace(trace)
    try:
        step()
    finally:
        sys.settrace(None)
    assert seen == listed
    assert len(listed) <= 15
