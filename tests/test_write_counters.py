"""The raw in-place ops bump autograd's write counter of what they write, as torch's in-place ops
do (fastamp._library registers the kernel at the ADInplaceOrView key): differential against
torch's counterpart where there is one (the same arguments' counters move, the others stay), by
schema where there is none; a backward through a graph that saved a written tensor raises as it
does after torch's op; and a refused call bumps nothing."""

from __future__ import annotations

import pytest
import torch

import fastamp  # noqa: F401  (loads the ops)
from fastamp.testing import op_args

ops = torch.ops.fastamp


def _ops_that_write() -> set[str]:
    names = set()
    for qual in torch._C._dispatch_get_all_op_names():
        if qual.startswith("fastamp::"):
            name = qual.split("::", 1)[1].split(".")[0]
            schema = getattr(ops, name).default._schema
            if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
                names.add(name)
    return names


def _lists(n=3, numel=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _adam():
    p, g, m, v = _lists(seed=1), _lists(seed=2), _lists(seed=3), _lists(seed=4)
    v = [x.abs() for x in v]
    steps = [torch.tensor(1.0) for _ in p]
    return p, g, m, v, steps


# Each case: (fastamp call, torch call or None, {name: tensors} of fastamp's arguments, the same
# for torch's, which names are written).
def _torch_optimizer(cls, fa, **options):
    """torch's optimizer over copies of ``fa``'s params and grads, one step taken (its state
    exists): what its next step() writes is the counterpart of the fused op's call. torch's
    foreach implementation is the counterpart: its in-place foreach ops bump the counters, while
    torch's own fused kernels (_fused_adamw_, _fused_sgd_) bump none."""
    params = [p.clone() for p in fa[0]]
    for p, g in zip(params, fa[1]):
        p.grad = g.clone()
    opt = cls(params, foreach=True, **options)
    opt.step()
    return opt, params


def case_adam_step_():
    fa = _adam()
    opt, tp = _torch_optimizer(torch.optim.AdamW, fa, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    f = lambda: ops.adam_step_(*op_args(
        "adam_step_", params=fa[0], grads=fa[1], exp_avgs=fa[2], exp_avg_sqs=fa[3],
        state_steps=fa[4], lr=1e-2, beta2=0.99))  # fmt: skip
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "state_steps")
    targs = (tp, [p.grad for p in tp], [opt.state[p]["exp_avg"] for p in tp],
             [opt.state[p]["exp_avg_sq"] for p in tp], [opt.state[p]["step"] for p in tp])  # fmt: skip
    return f, opt.step, dict(zip(names, fa)), dict(zip(names, targs))


def case_sgd_step_():
    fa = _adam()
    opt, tp = _torch_optimizer(torch.optim.SGD, fa, lr=1e-2, momentum=0.9)
    f = lambda: ops.sgd_step_(*op_args(
        "sgd_step_", params=fa[0], grads=fa[1], momentum_buffers=fa[2], state_steps=fa[4],
        lr=1e-2))  # fmt: skip
    names = ("params", "grads", "momentum_buffers")
    targs = (tp, [p.grad for p in tp], [opt.state[p]["momentum_buffer"] for p in tp])
    # torch's SGD keeps no step counters: fastamp's state_steps are checked by schema below
    return f, opt.step, dict(zip(names, fa[:3])), dict(zip(names, targs))


def case_clip_unscale_():
    fg, tg = _lists(), _lists()
    f = lambda: ops.clip_unscale_(fg, torch.tensor(0.5), torch.tensor(2.0), 1.0)
    t = lambda: torch._foreach_mul_(tg, 0.25)
    return f, t, {"grads": fg}, {"grads": tg}


CASES = {
    "adam_step_": case_adam_step_,
    "sgd_step_": case_sgd_step_,
    "clip_unscale_": case_clip_unscale_,
}


def _versions(named):
    return {k: [t._version for t in ts] for k, ts in named.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_raw_op_moves_the_counters_torchs_counterpart_moves(name):
    f, t, fargs, targs = CASES[name]()
    fb, tb = _versions(fargs), _versions(targs)
    f()
    t()
    fa, ta = _versions(fargs), _versions(targs)
    for k in fargs:
        moved_f = [a > b for a, b in zip(fa[k], fb[k])]
        moved_t = [a > b for a, b in zip(ta[k], tb[k])]
        assert moved_f == moved_t, (name, k, moved_f, moved_t)


def _writing_calls():
    """A valid raw call of every op that writes, with the tensors its schema marks written."""
    p, g, m, v, steps = _adam()
    codes = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.ones(1) for _ in range(2)]
    lp = [torch.randn(256) for _ in range(2)]
    lg = [torch.randn(256) for _ in range(2)]
    lsteps = [torch.tensor(1.0) for _ in range(2)]
    bufs = [torch.zeros(256, dtype=torch.bfloat16) for _ in range(2)]
    bucket = torch.zeros(15)
    grads = _lists()
    fg, found, flags = _lists(), torch.zeros(()), torch.zeros(3, dtype=torch.bool)
    scale, gt, hy = (
        torch.tensor(8.0),
        torch.tensor(0, dtype=torch.int32),
        torch.tensor(1, dtype=torch.int32),
    )
    cg = _lists()
    sgd = _adam()
    rflags, rupdate = torch.zeros(3, dtype=torch.bool), torch.tensor(-1)
    return {
        "adam_step_": (lambda: ops.adam_step_(*op_args("adam_step_", params=p, grads=g,
                       exp_avgs=m, exp_avg_sqs=v, state_steps=steps, lr=1e-2, beta2=0.99)),
                       p + m + v + steps),
        "adam_lowbit_step_": (lambda: ops.adam_lowbit_step_(*op_args("adam_lowbit_step_",
                              params=lp[:1], grads=lg[:1], exp_avgs=[codes[0]],
                              exp_avg_sqs=[codes[1]], exp_avg_absmax=[scales[0]],
                              exp_avg_sq_absmax=[scales[1]], state_steps=lsteps[:1], seed=3,
                              lr=1e-2, beta2=0.99)),
                              lp[:1] + codes + scales + lsteps[:1]),
        "sgd_step_": (lambda: ops.sgd_step_(*op_args("sgd_step_", params=sgd[0], grads=sgd[1],
                      momentum_buffers=sgd[2], state_steps=sgd[4], lr=1e-2)),
                      sgd[0] + sgd[2] + sgd[4]),
        "sgd_lowbit_step_": (lambda: ops.sgd_lowbit_step_(*op_args("sgd_lowbit_step_",
                             params=lp[1:], grads=lg[1:], momentum_buffers=bufs[:1],
                             state_steps=lsteps[1:], seed=3, lr=1e-2)),
                             lp[1:] + bufs[:1] + lsteps[1:]),
        "bucket_pack_": (lambda: ops.bucket_pack_(bucket, grads, [0, 5, 10], 0.5), [bucket]),
        "bucket_unpack_": (lambda: ops.bucket_unpack_(bucket, grads, [0, 5, 10], torch.tensor(2.0)),
                           grads),
        "bucket_divide_stats_": (lambda: ops.bucket_divide_stats_(bucket, [bucket.numel()], 2.0,
                                 torch.tensor(2.0)), [bucket]),
        "non_finite_check_and_unscale_": (lambda: ops.non_finite_check_and_unscale_(
            fg, found, torch.tensor(0.5), flags), fg + [found, flags]),
        "update_scale_": (lambda: ops.update_scale_(scale, gt, hy, torch.zeros(()), 2.0, 0.5, 2000,
                          1, 0.0, float("inf")), [scale, gt, hy]),
        "clip_unscale_": (lambda: ops.clip_unscale_(cg, torch.tensor(0.5), torch.tensor(2.0), 1.0),
                          cg),
        "record_overflow_": (lambda: ops.record_overflow_(rflags, rupdate,
                             torch.ones(3, dtype=torch.bool), torch.ones(()), torch.tensor(4)),
                             [rflags, rupdate]),
    }  # fmt: skip


def test_every_op_that_writes_bumps_what_its_schema_marks_written():
    calls = _writing_calls()
    assert set(calls) == _ops_that_write(), "a new op that writes needs a case here"
    for name, (call, written) in calls.items():
        before = [t._version for t in written]
        call()
        after = [t._version for t in written]
        assert all(a > b for a, b in zip(after, before)), (name, before, after)


def test_torchs_amp_and_fused_kernels_bump_nothing_where_fastamps_ops_do():
    """The documented difference (docs/reliability.md): torch's AMP and fused-optimizer kernels
    move no write counter (a backward through a grad saved before ``scaler.unscale_`` uses the
    unscaled values silently); fastamp's ops bump like torch's in-place ATen ops. If torch starts
    bumping, this test says so and the docs' sentence goes."""
    grads, found = _lists(), torch.zeros(())
    before = [t._version for t in grads + [found]]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert [t._version for t in grads + [found]] == before
    p, g, m, v, steps = _adam()
    before = [t._version for t in p + m + v]
    torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0,
                        eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
    assert [t._version for t in p + m + v] == before
    ops.non_finite_check_and_unscale_(
        grads, found, torch.tensor(0.5), torch.zeros(3, dtype=torch.bool)
    )
    assert all(t._version > 0 for t in grads + [found])


def test_backward_through_a_tensor_the_raw_op_wrote_raises_as_after_torchs_op():
    for inplace in ("fastamp", "torch"):
        x = torch.ones(4, requires_grad=True)
        y = x * 2
        loss = (y * y).sum()  # saves y
        if inplace == "fastamp":
            ops.clip_unscale_([y], torch.tensor(1.0), torch.tensor(2.0), 1.0)
        else:
            torch._foreach_mul_([y], 0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_refused_call_bumps_nothing():
    g = _lists()
    before = [t._version for t in g]
    with pytest.raises(RuntimeError, match="inv_scale has dtype Double"):
        ops.clip_unscale_(g, torch.tensor(0.5, dtype=torch.float64), torch.tensor(2.0), 1.0)
    assert [t._version for t in g] == before


def test_compile_traces_the_wrappers_and_equals_eager():
    """The wrappers' write-counter bump no longer runs in Python (it asked is_inference() of a
    FakeTensor, which broke torch.compile's trace): the scaler's op wrappers compile whole."""
    from fastamp.scaler import _ops as scaler_ops

    def step(grads, scale, growth, hyst):
        inv = scale.reciprocal()
        found, pow_sum, _ = scaler_ops.grad_stats(grads, inv, 2.0)
        scaler_ops.clip_unscale_(grads, inv, pow_sum.sqrt(), 1.0)
        scaler_ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 3, 1, 0.0, float("inf"))
        return pow_sum

    def state():
        return (_lists(seed=7), torch.tensor(8.0), torch.tensor(0, dtype=torch.int32),
                torch.tensor(1, dtype=torch.int32))  # fmt: skip

    eager, compiled = state(), state()
    want = step(*eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    assert torch.equal(got, want)
    for a, b in zip(compiled[0] + list(compiled[1:]), eager[0] + list(eager[1:])):
        assert torch.equal(a, b)
