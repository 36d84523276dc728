"""``fastamp.clip_grad_norm_``, the fused clip without a loss scaler (bf16 and fp32 training),
against torch's recipe on the same params and grads: ``torch.nn.utils.clip_grad_norm_`` then the
optimizer's step. Every optimizer x state format x flat buffers x norm type, bf16 and fp32
params (with and without master weights); the device-side guard (``skip_nonfinite``) with inf
and NaN injected; torch's failure modes (``error_if_nonfinite``) and fastamp's refusals with
nothing changed; the pending clip's hand-off rules; deepcopy/pickle; threads; the capture
contract and ``torch.compile(fullgraph=True)``.

Tolerances come from a float64 run of torch's own recipe: fastamp's error against it must be
within twice torch's own error (plus one rounding of the params' dtype where the clip's write,
rounded to the grads' dtype in torch's recipe and kept in registers in fastamp's, can move one
element across a rounding boundary)."""

from __future__ import annotations

import copy
import gc
import math
import pickle

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastamp
from tests._threads import run_together

OPTIMIZERS = {
    "adamw": (fastamp.optim.AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam_amsgrad": (fastamp.optim.Adam, torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "sgd_momentum": (fastamp.optim.SGD, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 9), nn.LayerNorm(9))
    return model.to(dtype)


def _grads(model: nn.Module, gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    return [(torch.randn(p.shape, generator=gen) * scale) for p in model.parameters()]


def _set(model: nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.to(p.dtype, copy=True)


def _twins(
    seed: int, scale: float, poison: tuple[int, float] | None = None
) -> tuple[nn.Module, nn.Module]:
    """Two float32 models, the same random grads set on both (``poison``: (i, v) sets the first
    element of the i-th to v)."""
    m0, m1 = _model(torch.float32), _model(torch.float32)
    grads = _grads(m0, torch.Generator().manual_seed(seed), scale)
    if poison is not None:
        grads[poison[0]].view(-1)[0] = poison[1]
    _set(m0, grads)
    _set(m1, grads)
    return m0, m1


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.abs().clamp_min(torch.finfo(dtype).tiny) * torch.finfo(dtype).eps


def _close_to_reference(ours, theirs, ref, dtype) -> None:
    """``ours`` within twice ``theirs``' error against the float64 ``ref``, plus one rounding
    of ``dtype`` at each element's magnitude."""
    for o, t, r in zip(ours, theirs, ref):
        o, t, r = o.double(), t.double(), r.double()
        torch_err = (t - r).abs().max()
        bound = 2 * torch_err + 2 * _ulp(r, dtype) + 1e-12
        assert ((o - r).abs() <= bound).all(), ((o - r).abs() - bound).max()


def _run(case, dtype, max_norm, norm_type, steps=4, fastamp_opts=None, grad_scale=3.0):
    """(fastamp's params and norms, torch's, float64 torch's) over ``steps`` steps."""
    fa_cls, torch_cls, options = OPTIMIZERS[case]
    gen = torch.Generator().manual_seed(5)
    models = [_model(dtype), _model(dtype), _model(torch.float64)]
    ours = fa_cls(models[0].parameters(), **options, **(fastamp_opts or {}))
    theirs = torch_cls(models[1].parameters(), **options)
    ref = torch_cls(models[2].parameters(), **options)
    norms: list[list[torch.Tensor]] = [[], [], []]
    for _ in range(steps):
        grads = _grads(models[0], gen, grad_scale)
        for m in models:
            _set(m, grads)
        norms[0].append(fastamp.clip_grad_norm_(ours, max_norm, norm_type))
        for k in (1, 2):
            norms[k].append(
                torch.nn.utils.clip_grad_norm_(models[k].parameters(), max_norm, norm_type)
            )
        for opt in (ours, theirs, ref):
            opt.step()
    return [list(m.parameters()) for m in models], norms


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_fp32_matches_torch_recipe(case, norm_type):
    params, norms = _run(case, torch.float32, max_norm=0.5, norm_type=norm_type)
    for a, b, r in zip(*norms):
        assert a.dtype == b.dtype == torch.float32
        _close_to_reference([a], [b], [r], torch.float32)
    _close_to_reference(params[0], params[1], params[2], torch.float32)


@pytest.mark.parametrize("max_norm", [0.05, 1e4], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_bf16_params_match_torch_recipe(case, max_norm):
    """bf16 params and grads: torch takes the norm in bf16 and returns it so; fastamp measures in
    fp32 and returns the norm rounded to bf16, and applies the coefficient in registers."""
    params, norms = _run(case, torch.bfloat16, max_norm=max_norm, norm_type=2.0)
    for a, b, r in zip(*norms):
        assert a.dtype == b.dtype == torch.bfloat16
        _close_to_reference([a], [b], [r], torch.bfloat16)
    _close_to_reference(params[0], params[1], params[2], torch.bfloat16)


@pytest.mark.parametrize(
    "opts",
    [
        {"master_weights": True},
        {"state_dtype": torch.bfloat16},
        {"state_dtype": "int8"},
        {"flat_buffers": True},
    ],
    ids=["master_weights", "bf16_state", "int8_state", "flat_buffers"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_state_format_clips_as_torch_clip_then_the_same_optimizer(opts, dtype):
    """The clip alone, isolated: fastamp's fused clip + step against torch's clip (grads written)
    + the same fastamp optimizer's step, for every format, flat buffers and master weights."""
    if opts.get("flat_buffers") and dtype is torch.bfloat16:
        opts = {**opts, "master_weights": True}
    gen = torch.Generator().manual_seed(3)
    models = [_model(dtype), _model(dtype), _model(torch.float64)]
    fused = fastamp.optim.AdamW(models[0].parameters(), lr=1e-2, **opts)
    plain = fastamp.optim.AdamW(models[1].parameters(), lr=1e-2, **opts)
    ref = torch.optim.AdamW(models[2].parameters(), lr=1e-2)
    for _ in range(4):
        grads = _grads(models[0], gen, 2.0)
        for m in models:
            _set(m, grads)
        n0 = fastamp.clip_grad_norm_(fused, 0.3)
        n1 = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.3)
        torch.nn.utils.clip_grad_norm_(models[2].parameters(), 0.3)
        assert n0.dtype == n1.dtype
        fused.step()
        plain.step()
        ref.step()
    if "state_dtype" in opts:  # low-bit moments: no float64 counterpart; the two fastamp runs
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=4 * _ulp(b, dtype).max().item())
        return
    _close_to_reference(
        list(models[0].parameters()), list(models[1].parameters()),
        list(models[2].parameters()), dtype,
    )  # fmt: skip


def _snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_skip_nonfinite_writes_nothing_and_the_run_equals_torchs_host_guard(case, bad):
    """With skip_nonfinite=True the step with an inf/NaN grad writes nothing (params, every
    state tensor, step counts), decided on the device; the run equals torch's usual guard
    ``if torch.isfinite(norm): opt.step()``, and the guard counts and names the skip."""
    fa_cls, torch_cls, options = OPTIMIZERS[case]
    gen = torch.Generator().manual_seed(9)
    m0, m1 = _model(torch.float32), _model(torch.float32)
    ours = fa_cls(m0.parameters(), **options)
    theirs = torch_cls(m1.parameters(), **options)
    for k in range(5):
        grads = _grads(m0, gen, 1.0)
        if k in (0, 3):  # a skip at the very first step (no state yet) and a later one
            grads[2].view(-1)[4] = bad
        _set(m0, grads)
        _set(m1, grads)
        before = _snapshot(m0, ours)
        norm = fastamp.clip_grad_norm_(ours, 1.0, skip_nonfinite=True)
        ours.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0)
        if torch.isfinite(ref_norm):
            theirs.step()
        assert bool(ours.stepped) == bool(torch.isfinite(ref_norm))
        if k in (0, 3):
            assert not torch.isfinite(norm)
            after = _snapshot(m0, ours)
            n = len(list(m0.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(after[:n], before[:n]))
            if k == 0:  # the state the kernel made for a skipped first step: all zeros
                assert all(not t.any() for t in after[n:])
            else:
                assert len(after) == len(before)
                assert all(torch.equal(a, b) for a, b in zip(after, before))
        for a, b in zip(m0.parameters(), m1.parameters()):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    guard = fastamp.nonfinite_guard(ours)
    assert guard is not None and guard.skipped.item() == 2
    report = guard.report(m0)
    assert report.update == 1 and report.parameters == ["2.weight"]
    # torch's optimizer state equals fastamp's (no state from the skipped first step)
    assert ours.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()


def test_default_propagates_nan_as_torch():
    """Without skip_nonfinite a NaN norm makes NaN params, as torch's recipe does."""
    m0, m1 = _twins(1, 1.0, poison=(0, math.nan))
    ours = fastamp.optim.AdamW(m0.parameters())
    theirs = torch.optim.AdamW(m1.parameters())
    a = fastamp.clip_grad_norm_(ours, 1.0)
    b = torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0)
    assert a.isnan() and b.isnan()
    ours.step()
    theirs.step()
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p.isnan(), q.isnan())


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_error_if_nonfinite_raises_torchs_error_before_anything(bad):
    m0, m1 = _twins(1, 1.0, poison=(1, bad))
    ours = fastamp.optim.AdamW(m0.parameters())
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0, error_if_nonfinite=True)
    before = [p.grad.clone() for p in m0.parameters()]
    with pytest.raises(RuntimeError) as err:
        fastamp.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    assert str(err.value) == str(theirs.value)
    assert ours.pending_clip is None
    assert all(torch.equal(p.grad, b, equal_nan=True) if False else
               torch.allclose(p.grad, b, equal_nan=True)
               for p, b in zip(m0.parameters(), before))  # fmt: skip
    # a torch optimizer's grads are not clipped either (torch raises before clipping)
    sgd = torch.optim.SGD(m1.parameters(), lr=0.1)
    saved = [p.grad.clone() for p in m1.parameters()]
    with pytest.raises(RuntimeError):
        fastamp.clip_grad_norm_(sgd, 1.0, error_if_nonfinite=True)
    assert all(torch.allclose(p.grad, b, equal_nan=True) for p, b in zip(m1.parameters(), saved))


def test_torch_optimizer_gets_grads_clipped_in_place_as_torchs_clip():
    m0, m1 = _model(torch.float32), _model(torch.float32)
    grads = _grads(m0, torch.Generator().manual_seed(2), 4.0)
    _set(m0, grads)
    _set(m1, grads)
    versions = [p.grad._version for p in m0.parameters()]  # private-ok: write counters
    a = fastamp.clip_grad_norm_(torch.optim.SGD(m0.parameters(), lr=0.1), 0.7)
    b = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.7)
    _close_to_reference([a], [b], [b], torch.float32)
    for p, q, v in zip(m0.parameters(), m1.parameters(), versions):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        assert p.grad._version > v  # private-ok: autograd sees the write, as torch's mul_
    # fastamp's optimizer: the grads are only read, their write counters unchanged
    m2 = _model(torch.float32)
    _set(m2, grads)
    opt = fastamp.optim.AdamW(m2.parameters())
    versions = [p.grad._version for p in m2.parameters()]  # private-ok: write counters
    fastamp.clip_grad_norm_(opt, 0.7)
    assert [p.grad._version for p in m2.parameters()] == versions  # private-ok


@pytest.mark.parametrize("grad_scale", [1e-8, 1e-7, 1e-6])
@pytest.mark.parametrize("scaled", [False, True], ids=["scaler_free", "grad_scaler"])
@pytest.mark.parametrize("norm_type", [2.0, 3.0])  # fastamp::clip_coef; torch's ops in Python
def test_norms_near_torchs_epsilon_clip_as_torch(grad_scale, scaled, norm_type):
    """Total norms near torch's 1e-6 in ``max_norm / (norm + 1e-6)``, where the epsilon's sign and
    size decide the coefficient: fastamp's clip handed to fastamp's SGD (the coefficient applied in
    its step), scaler-free and GradScaler's (grads scaled by 1024), against torch's unscale_, clip
    and SGD. Params start at zero, so each step's update is the clipped grad itself."""
    m0, m1 = _model(torch.float32), _model(torch.float32)
    grads = _grads(m0, torch.Generator().manual_seed(7), grad_scale)
    with torch.no_grad():
        for p in (*m0.parameters(), *m1.parameters()):
            p.zero_()
    max_norm = 1e-7
    ours = fastamp.optim.SGD(m0.parameters(), lr=1.0)
    theirs = torch.optim.SGD(m1.parameters(), lr=1.0)
    if scaled:
        _set(m0, [g * 1024 for g in grads])
        _set(m1, [g * 1024 for g in grads])
        scalers = fastamp.GradScaler("cpu", 1024.0), torch.amp.GradScaler("cpu", 1024.0)
        for s in scalers:
            s.scale(torch.ones(()))
        a = scalers[0].clip_grad_norm_(ours, max_norm, norm_type)
        scalers[0].step(ours)
        scalers[1].unscale_(theirs)
        b = torch.nn.utils.clip_grad_norm_(m1.parameters(), max_norm, norm_type)
        scalers[1].step(theirs)
    else:
        _set(m0, grads)
        _set(m1, grads)
        a = fastamp.clip_grad_norm_(ours, max_norm, norm_type)
        ours.step()
        b = torch.nn.utils.clip_grad_norm_(m1.parameters(), max_norm, norm_type)
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    coef = max_norm / (float(b) + 1e-6)
    assert 0 < coef < 1  # the clip is active, and its coefficient is positive
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert bool(q.ne(0).any())
        torch.testing.assert_close(p, q, rtol=1e-5, atol=0)


def test_second_clip_before_step_equals_torchs_double_clip():
    m0, m1 = _twins(4, 5.0)
    ours = fastamp.optim.SGD(m0.parameters(), lr=0.1)
    theirs = torch.optim.SGD(m1.parameters(), lr=0.1)
    norms = [fastamp.clip_grad_norm_(ours, 1.0), fastamp.clip_grad_norm_(ours, 0.25)]
    refs = [torch.nn.utils.clip_grad_norm_(m1.parameters(), n) for n in (1.0, 0.25)]
    for a, b in zip(norms, refs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    ours.step()
    theirs.step()
    for p, q in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_grad_written_after_the_clip_is_refused_by_the_step_with_nothing_changed():
    model = _model(torch.float32)
    opt = fastamp.optim.AdamW(model.parameters())
    _set(model, _grads(model, torch.Generator().manual_seed(1), 1.0))
    fastamp.clip_grad_norm_(opt, 1.0)
    next(model.parameters()).grad.mul_(2)  # written after it was measured
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="written or replaced after fastamp.clip_grad_norm_"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before))
    with pytest.raises(RuntimeError, match="written or replaced after the previous"):
        fastamp.clip_grad_norm_(opt, 1.0)
    opt.zero_grad()  # drops the clip with its grads
    assert opt.pending_clip is None
    _set(model, _grads(model, torch.Generator().manual_seed(2), 1.0))
    fastamp.clip_grad_norm_(opt, 1.0)
    opt.step()
    assert opt.pending_clip is None and bool(opt.stepped)


def test_a_scaler_stepping_a_clipped_optimizer_is_refused():
    model = _model(torch.float32)
    opt = fastamp.optim.AdamW(model.parameters())
    scaler = fastamp.GradScaler("cpu")
    loss = model(torch.randn(3, 24)).sum()
    scaler.scale(loss).backward()
    fastamp.clip_grad_norm_(opt, 1.0)  # the scaled grads: the wrong clip for a scaler
    before = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="GradScaler is stepping it"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda m, o: fastamp.clip_grad_norm_(m.parameters(), 1.0), TypeError, "optimizer must"),
        (lambda m, o: fastamp.clip_grad_norm_(o, -1.0), ValueError, "max_norm"),
        (lambda m, o: fastamp.clip_grad_norm_(o, 1.0, 0.0), ValueError, "norm_type"),
        (lambda m, o: fastamp.clip_grad_norm_(o, 1.0, skip_nonfinite=1), TypeError, "skip_"),
        (lambda m, o: fastamp.clip_grad_norm_(o, 1.0, 2.0, "yes"), TypeError, "error_if"),
        (lambda m, o: fastamp.clip_grad_norm_(o, 1.0, foreach=1), TypeError, "foreach"),
        (
            lambda m, o: fastamp.clip_grad_norm_(
                torch.optim.SGD(m.parameters(), lr=0.1), 1.0, skip_nonfinite=True
            ),
            ValueError,
            "needs a fastamp.optim optimizer",
        ),
    ],
    ids=[
        "params_not_optimizer",
        "negative_max_norm",
        "zero_norm_type",
        "skip_not_bool",
        "error_if_not_bool",
        "foreach_not_bool",
        "skip_with_torch_optimizer",
    ],  # fmt: skip
)
def test_bad_arguments_raise_naming_them_with_nothing_changed(call, exc, match):
    model = _model(torch.float32)
    opt = fastamp.optim.AdamW(model.parameters())
    _set(model, _grads(model, torch.Generator().manual_seed(1), 3.0))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(exc, match=match):
        call(model, opt)
    assert opt.pending_clip is None and fastamp.nonfinite_guard(opt) is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_foreach_is_accepted_as_torchs_keyword():
    m0, m1 = _twins(1, 3.0)
    a = fastamp.clip_grad_norm_(torch.optim.SGD(m0.parameters(), lr=0.1), 1.0, 2.0, False, False)
    b = torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0, 2.0, False, False)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_no_grads_returns_torchs_zero():
    model = _model(torch.float32)
    opt = fastamp.optim.AdamW(model.parameters())
    ours = fastamp.clip_grad_norm_(opt, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert ours.item() == theirs.item() == 0.0 and ours.dtype == theirs.dtype
    opt.step()  # nothing to step, as torch's
    assert opt.pending_clip is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_clipped_optimizer_step_as_torchs_copies(how):
    """A trainer's snapshot between clip and step: a deep copy (grads copied with the params)
    steps with the clip, as torch's copy steps with clipped grads; a pickle carries no grads,
    and its step does nothing, as torch's."""
    m0, m1 = _twins(1, 3.0)
    ours = fastamp.optim.AdamW(m0.parameters(), lr=0.1)
    theirs = torch.optim.AdamW(m1.parameters(), lr=0.1)
    fastamp.clip_grad_norm_(ours, 0.5)
    torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.5)
    dump = copy.deepcopy if how == "deepcopy" else lambda x: pickle.loads(pickle.dumps(x))
    (m0c, oc), (m1c, tc) = dump((m0, ours)), dump((m1, theirs))
    oc.step()
    tc.step()
    for p, q in zip(m0c.parameters(), m1c.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_threads_clip_and_step_their_own_optimizers():
    # The models are made before the threads start: torch.manual_seed is process-wide.
    starts = [_model(torch.float32, seed=k) for k in range(4)]

    def train(k: int) -> list[torch.Tensor]:
        model = copy.deepcopy(starts[k])
        opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(k)
        for _ in range(5):
            _set(model, _grads(model, gen, 3.0))
            fastamp.clip_grad_norm_(opt, 0.5, skip_nonfinite=True)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    results: dict[int, list[torch.Tensor]] = {}
    assert run_together(lambda k: results.__setitem__(k, train(k)), 4) == []
    for k in range(4):  # each equals the same run alone
        for a, b in zip(results[k], train(k)):
            assert torch.equal(a, b)


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)  # private-ok: the op's schema name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flat", [False, True], ids=["per_param", "flat_buffers"])
@pytest.mark.parametrize("skip", [False, True], ids=["plain", "guarded"])
def test_steady_state_is_capture_safe_and_issues_few_ops(skip, flat):
    """No host read, every tensor that lives across steps at its address, and the launches of a
    steady-state clip + step: stats, coefficient, update (+ the guard's record and count; + the
    flat buffers' step-count copy)."""
    model = _model(torch.float32)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3, flat_buffers=flat)
    gen = torch.Generator().manual_seed(1)
    grads = _grads(model, gen, 3.0)
    if flat:
        opt.zero_grad(set_to_none=False)
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)
    else:
        _set(model, grads)

    def step() -> None:
        fastamp.clip_grad_norm_(opt, 1.0, skip_nonfinite=skip)
        opt.step()

    for _ in range(3):
        step()
    lived = [t for p in model.parameters() for t in [p, p.grad, *opt.state[p].values()]]
    addresses = [t.untyped_storage().data_ptr() for t in lived]
    mode = _HostReads()
    gc.collect()  # (an earlier test's held lists, released by the collector, are not this step's)
    gc.disable()
    try:
        with mode:
            step()
    finally:
        gc.enable()
    assert not {"aten::_local_scalar_dense", "aten::item"} & set(mode.names), mode.names
    after = [t for p in model.parameters() for t in [p, p.grad, *opt.state[p].values()]]
    assert all(a is b for a, b in zip(after, lived))
    assert [t.untyped_storage().data_ptr() for t in after] == addresses
    # Launches: every op but torch's step profiling marks and the held lists' host-side check.
    launches = [
        n for n in mode.names if not n.startswith("profiler::") and n != "fastamp::held_moved"
    ]
    assert len(launches) <= (3 if not skip else 6) + flat, mode.names


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "guarded"])
def test_compiles_fullgraph_and_equals_eager(skip):
    from torch._dynamo.testing import CompileCounter

    def run(compiled: bool):
        torch._dynamo.reset()
        model = _model(torch.float32)
        opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2)

        def step() -> None:
            fastamp.clip_grad_norm_(opt, 0.5, skip_nonfinite=skip)
            opt.step()

        counter = CompileCounter()
        fn = torch.compile(step, backend=counter, fullgraph=True) if compiled else step
        gen = torch.Generator().manual_seed(1)
        for k in range(5):
            grads = _grads(model, gen, 3.0)
            if k == 3 and skip:
                grads[0].view(-1)[0] = math.inf
            _set(model, grads)
            fn()
        return [p.detach().clone() for p in model.parameters()], counter.frame_count

    eager, _ = run(False)
    compiled, frames = run(True)
    assert 1 <= frames <= 2
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False], ids=["fastamp_optimizer", "torch_optimizer"])
def test_a_disabled_scaler_clips_through_the_scaler_free_path(fused, monkeypatch):
    """``GradScaler(enabled=False)`` (a bf16 run written for fp16) clips as torch's recipe, through
    the fused scaler-free clip (no torch clip op runs)."""
    m0, m1 = _twins(6, 3.0)
    opt = (fastamp.optim.AdamW if fused else torch.optim.AdamW)(m0.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    scaler = fastamp.GradScaler("cpu", enabled=False)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", None)  # any call of torch's fails
    norm = scaler.clip_grad_norm_(opt, 0.5)
    monkeypatch.undo()
    ref_norm = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    ref.step()
    for p, q in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not fused or opt.pending_clip is None
