"""Workers of tests/parallel/test_ddp_parity.py: fastamp's DDP and torch's DDP side by side in
the same gloo processes, on the same inputs (each rank its own shard). Each worker asserts by
itself; a failure makes torch.multiprocessing.spawn raise in the test with the traceback.

"Same" means: the same grads (values and which ones are None), the same parameters and buffers
after the same steps, and the same exception class where torch raises."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as TDDP

import fastamp
from fastamp.parallel import DistributedDataParallel as FDDP
from tests.parallel._workers import _finish, _init


def _data(rank, steps, n=4, d_in=6, d_out=3, seed=77):
    g = torch.Generator().manual_seed(seed + 1000 * rank)  # each rank its own shard
    return [
        (torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g))
        for _ in range(steps)
    ]


def _same_grads(a: nn.Module, b: nn.Module, what: str, rtol=1e-5, atol=1e-6):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), (
            f"{what}: {n}.grad is None: fastamp {p.grad is None}, torch {q.grad is None}"
        )
        if p.grad is not None:
            torch.testing.assert_close(
                p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{what}: {n}.grad: {m}"
            )


def _same_state(a: nn.Module, b: nn.Module, what: str, rtol=1e-5, atol=1e-6):
    for (n, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(
            x, y, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{what}: {n}: {m}"
        )


def _same_everywhere(model: nn.Module, what: str):
    flat = torch.cat([t.detach().double().flatten() for t in model.state_dict().values()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], f) for f in everyone), (
        f"{what}: replicas differ across ranks"
    )


@contextlib.contextmanager
def _counted_grad_stats():
    """Counts the calls of fastamp's ``grad_stats`` wrapper (the scaler's own measuring pass)
    inside the block: yields ``(calls, the real function)``; the wrapper is restored after."""
    from fastamp.scaler import _ops as scaler_ops

    calls: list[int] = []
    real = scaler_ops.grad_stats

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    scaler_ops.grad_stats = counting
    try:
        yield calls, real
    finally:
        scaler_ops.grad_stats = real


def _scaled_sgd(t, f):
    """Torch's and fastamp's scalers (init_scale 256; fastamp's registered with its DDP ``f``) and
    an SGD for each of ``t`` and ``f``: (ts, fs, topt, fopt)."""
    ts = torch.amp.GradScaler("cpu", init_scale=256.0)
    fs = fastamp.GradScaler("cpu", init_scale=256.0)
    f.register_grad_scaler(fs)
    return ts, fs, torch.optim.SGD(t.parameters(), lr=0.1), torch.optim.SGD(f.parameters(), lr=0.1)


def _raises(fn):
    """The exception class fn raises (None if it returns)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, ""


# ---------------------------------------------------------------------------------- 1. faults
class _Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Boom.armed:
            raise RuntimeError("boom in backward")
        return g


class _Linears(nn.Module):
    """Linear layers named a, b, c, ... of the (in, out) ``sizes``, made in that order; a subclass
    gives the forward."""

    sizes: tuple[tuple[int, int], ...] = ((6, 8), (8, 3))

    def __init__(self):
        super().__init__()
        for name, (n_in, n_out) in zip("abc", self.sizes):
            setattr(self, name, nn.Linear(n_in, n_out))


class FaultNet(_Linears):
    """`b`'s grads are ready (and their bucket launched) before backward reaches the bomb."""

    def forward(self, x, fail_forward=False):
        if fail_forward:
            raise ValueError("boom in forward")
        return self.b(_Boom.apply(torch.tanh(self.a(x))))


def exception_in_backward(rank, world, init_file):
    """Every rank: an exception inside backward after some grad hooks fired. torch raises at the
    next forward, and at every one after; so must fastamp (today it silently stops syncing)."""
    _init(rank, world, init_file)
    data = _data(rank, 4)
    base = FaultNet()
    seen = {}
    for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
        m = cls(copy.deepcopy(base), bucket_cap_mb=1e-6)  # one bucket per parameter
        x, y = data[0]
        nn.functional.mse_loss(m(x), y).backward()  # a good iteration
        _Boom.armed = True
        try:
            first = _raises(lambda: nn.functional.mse_loss(m(x), y).backward())
        finally:
            _Boom.armed = False
        assert first[0] is RuntimeError and "boom in backward" in first[1], (kind, first)
        nxt = [_raises(lambda: nn.functional.mse_loss(m(x), y).backward()) for _ in range(2)]
        seen[kind] = [first[0]] + [e for e, _ in nxt]
        if kind == "fastamp":
            assert "Expected to have finished reduction in the prior iteration" in nxt[0][1], nxt[
                0
            ][1]
    assert seen["fastamp"] == seen["torch"] == [RuntimeError] * 3, seen
    _finish()


def exception_in_forward(rank, world, init_file):
    """Every rank raises in one forward (a bad batch skipped by all): nothing was armed, training
    goes on and matches torch doing the same."""
    _init(rank, world, init_file)
    data = _data(rank, 4)
    base = FaultNet()
    out = {}
    for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
        m = cls(copy.deepcopy(base))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        errors = []
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            try:
                loss = nn.functional.mse_loss(m(x, fail_forward=step == 1), y)
            except ValueError as e:
                errors.append(str(e))
                continue
            loss.backward()
            opt.step()
        assert errors == ["boom in forward"], errors
        out[kind] = m
    _same_state(out["fastamp"].module, out["torch"].module, "after a skipped forward")
    _same_everywhere(out["fastamp"], "after a skipped forward")
    # Only the last rank raises in a forward, catches it and goes on while the others run their
    # backward: its next backward pairs with theirs (the n-th synchronised backward of every rank
    # pairs up, whatever batch it came from), so the replicas stay identical, as with torch; it
    # runs one batch more to end with as many backwards as the others.
    data = _data(rank, 5)
    failing = rank == world - 1
    out = {}
    for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
        m = cls(copy.deepcopy(base))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step, (x, y) in enumerate(data if failing else data[:4]):
            opt.zero_grad()
            try:
                loss = nn.functional.mse_loss(m(x, fail_forward=failing and step == 1), y)
            except ValueError:
                continue
            loss.backward()
            opt.step()
        out[kind] = m
    _same_state(out["fastamp"].module, out["torch"].module, "one rank skipped a forward")
    _same_everywhere(out["fastamp"], "one rank skipped a forward")
    _finish()


def reentrant_backward(rank, world, init_file):
    """Reentrant checkpointing (the last layer's grads fire inside a nested backward): the same
    grads as torch. A parameter used inside and outside the reentrant checkpoint: both raise.
    A second backward over an already synchronised graph: torch skips the all-reduce (the ranks'
    grads differ); fastamp raises."""
    from torch.utils.checkpoint import checkpoint

    _init(rank, world, init_file)
    data = _data(rank, 3)

    class Ckpt(_Linears):
        def forward(self, x, share=False):
            h = torch.tanh(self.a(x))
            out = checkpoint(self.b, h, use_reentrant=True)
            return out + self.b.bias if share else out

    base = Ckpt()
    models = {
        kind: cls(copy.deepcopy(base), bucket_cap_mb=1e-6)
        for kind, cls in (("torch", TDDP), ("fastamp", FDDP))
    }
    for x, y in data:
        for m in models.values():
            m.zero_grad()
            nn.functional.mse_loss(m(x.requires_grad_()), y).backward()
        _same_grads(models["fastamp"].module, models["torch"].module, "reentrant checkpoint")
    for kind in ("torch", "fastamp"):  # shared parameter: "marked ready twice"
        m = (TDDP if kind == "torch" else FDDP)(copy.deepcopy(base), bucket_cap_mb=1e-6)
        x, y = data[0]
        err = _raises(
            lambda: nn.functional.mse_loss(m(x.requires_grad_(), share=True), y).backward()
        )
        assert err[0] is RuntimeError, (kind, err)
        assert "once" in err[1], (kind, err[1])
        del m

    # several outputs of one forward in one loss (a model returning loss and logits): one backward
    class TwoOut(_Linears):
        def forward(self, x):
            h = torch.tanh(self.a(x))
            return {"out": self.b(h), "aux": h.square().mean()}

    base3 = TwoOut()
    pair = [cls(copy.deepcopy(base3)) for cls in (TDDP, FDDP)]
    for x, y in data:
        for m in pair:
            m.zero_grad()
            o = m(x)
            (nn.functional.mse_loss(o["out"], y) + o["aux"]).backward()
        _same_grads(pair[1].module, pair[0].module, "two outputs in one loss")
    # retain_graph: the second backward
    base2 = FaultNet()
    x, y = data[0]
    t = TDDP(copy.deepcopy(base2))
    loss = nn.functional.mse_loss(t(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in t.parameters()])
    everyone = [torch.zeros_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)
    assert not all(torch.equal(everyone[0], g) for g in everyone), (
        "torch: expected the silent divergence"
    )
    f = FDDP(copy.deepcopy(base2))
    loss = nn.functional.mse_loss(f(x), y)
    loss.backward(retain_graph=True)
    err = _raises(lambda: loss.backward())
    assert err[0] is RuntimeError and "second backward" in err[1], err
    # ... and a fresh forward afterwards works and matches torch's first backward
    f.zero_grad()
    t.zero_grad()
    nn.functional.mse_loss(f(x), y).backward()
    nn.functional.mse_loss(t(x), y).backward()
    _same_grads(f.module, t.module, "after the refused second backward")
    # a gradient penalty (WGAN-GP, R1): torch.autograd.grad of the output w.r.t. the input with
    # create_graph, then one backward of the loss and the penalty. The first pass reaches no
    # parameter and synchronises nothing: torch runs it, and so must fastamp (it used to take
    # the first pass for the synchronised backward and refuse the real one as a second).
    pair = [cls(copy.deepcopy(base2)) for cls in (TDDP, FDDP)]
    for x, y in data:
        for m in pair:
            m.zero_grad()
            xi = x.clone().requires_grad_()
            out = m(xi)
            (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
            (nn.functional.mse_loss(out, y) + g.square().sum()).backward()
        _same_grads(pair[1].module, pair[0].module, "gradient penalty")
    _finish()


def rank_raises_in_backward(rank, world, init_file):
    """Only the last rank raises inside backward while the others are in theirs: every rank fails
    loudly (the others within the process group's timeout), none goes on silently."""
    import time

    _init(rank, world, init_file, timeout_s=6.0)
    m = FDDP(FaultNet(), bucket_cap_mb=1e-6)
    x, y = _data(rank, 1)[0]
    nn.functional.mse_loss(m(x), y).backward()
    _Boom.armed = rank == world - 1
    t0 = time.monotonic()
    err = _raises(lambda: nn.functional.mse_loss(m(x), y).backward())
    _Boom.armed = False
    assert err[0] is RuntimeError, err
    if rank == world - 1:
        assert "boom in backward" in err[1]
        nxt = _raises(lambda: m(x))
        assert nxt[0] is RuntimeError and "prior iteration" in nxt[1], nxt
    else:
        assert "peer rank has probably died or stalled" in err[1], err[1]
        assert time.monotonic() - t0 < 60
    os._exit(0)  # the process group is broken; skip its teardown


# ---------------------------------------------------------------------------------- 2. unused
class UnusedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.never = nn.Linear(3, 3)  # unused on every rank
        self.sometimes = nn.Linear(8, 3)  # used on rank 0 only

    def forward(self, x, rank):
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return out + self.sometimes(h) if rank == 0 else out


def unused_parameters(rank, world, init_file):
    _init(rank, world, init_file)
    data = _data(rank, 4)
    base = UnusedNet()
    configs = [
        dict(find_unused_parameters=True),
        dict(static_graph=True),
        dict(find_unused_parameters=True, gradient_as_bucket_view=True),
        dict(static_graph=True, gradient_as_bucket_view=True),
    ]
    for kw in configs:
        for set_to_none in (True, False):
            for accumulate in (1, 2):
                if accumulate > 1 and kw.get("static_graph"):
                    continue  # torch: static_graph with no_sync trips an internal assert
                t = TDDP(copy.deepcopy(base), **kw)
                f = FDDP(copy.deepcopy(base), bucket_cap_mb=1e-6, **kw)
                opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (t, f)]
                what = f"{kw} set_to_none={set_to_none} accumulate={accumulate}"
                for x, y in data:
                    for m, opt in zip((t, f), opts):
                        opt.zero_grad(set_to_none=set_to_none)
                        for i, (xx, yy) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
                            ctx = m.no_sync() if i < accumulate - 1 else _Null()
                            with ctx:
                                nn.functional.mse_loss(m(xx, rank), yy).backward()
                    _same_grads(f.module, t.module, what)
                    for opt in opts:
                        opt.step()
                    assert f.module.never.weight.grad is None or not set_to_none, what
                _same_state(f.module, t.module, what)
                # momentum buffers exist exactly where torch's do (no state for None grads)
                assert [len(s) for s in opts[1].state.values()] == [
                    len(s) for s in opts[0].state.values()
                ], what
                assert len(opts[1].state) == len(opts[0].state), what
    _finish()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------------------------- 3. stats
def stale_statistics(rank, world, init_file):
    """ddp.register_grad_scaler(scaler): the unpack's norm and inf flag are reused only while the
    grads are exactly the ones measured. Reference: torch DDP + torch.amp.GradScaler with the
    same edits to the grads, unscale_ and torch.nn.utils.clip_grad_norm_."""

    _init(rank, world, init_file)
    data = _data(rank, 2)
    base = FaultNet()

    def edit_mul(m):
        for p in m.parameters():
            p.grad.mul_(0.25)

    def edit_replace(m):
        m.module.a.weight.grad = m.module.a.weight.grad * 0.5

    def edit_nan_to_num(m):
        for p in m.parameters():
            p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def edit_none(m):
        pass

    with _counted_grad_stats() as (calls, real):
        for edit, overflow in (
            (edit_none, False),
            (edit_mul, False),
            (edit_replace, False),
            (edit_nan_to_num, True),
            (edit_none, True),
        ):
            t = TDDP(copy.deepcopy(base))
            f = FDDP(copy.deepcopy(base))
            ts, fs, topt, fopt = _scaled_sgd(t, f)
            for step, (x, y) in enumerate(data):
                norms = []
                calls.clear()
                for m, s, opt in ((t, ts, topt), (f, fs, fopt)):
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(m(x), y)
                    if overflow and step == 1 and rank == 0:
                        loss = loss * math.inf
                    s.scale(loss).backward()
                    edit(m)
                    if s is ts:
                        s.unscale_(opt)
                        norms.append(torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0))
                    else:
                        norms.append(s.clip_grad_norm_(opt, 1.0))
                    s.step(opt)
                    s.update()
                what = f"{edit.__name__} overflow={overflow} step {step}"
                if math.isfinite(float(norms[0])):
                    torch.testing.assert_close(
                        norms[1], norms[0], rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: norm {m}"
                    )
                else:
                    assert not math.isfinite(float(norms[1])), (what, norms)
                assert ts.get_scale() == fs.get_scale(), (what, ts.get_scale(), fs.get_scale())
                _same_state(f.module, t.module, what)
                reused = not calls
                assert reused == (edit is edit_none), f"{what}: stats reused={reused}"
    _finish()


# ---------------------------------------------------------------------------------- 4. buffers
def mismatched_buffers(rank, world, init_file):
    """Ranks whose buffers differ: every rank raises an error naming the buffer (today: one rank
    dies of a C++ terminate in the broadcast)."""
    _init(rank, world, init_file)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    if rank == world - 1:
        m[1].register_buffer("running_mean", torch.zeros(5))
    err = _raises(lambda: FDDP(m))
    assert (
        err[0] is RuntimeError and "1.running_mean" in err[1] and "differs across ranks" in err[1]
    ), err
    m2 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    if rank == 0:
        m2.register_buffer("extra", torch.zeros(2))
    err = _raises(lambda: FDDP(m2))
    assert err[0] is RuntimeError and "extra" in err[1], err
    # init_sync=False skips the check at construction: it runs before the first buffer broadcast
    m3 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    if rank == world - 1:
        m3[1].register_buffer("running_var", torch.ones(3))
    f = FDDP(m3, init_sync=False)
    err = _raises(lambda: f(torch.randn(2, 4)))
    assert err[0] is RuntimeError and "1.running_var" in err[1], err
    _finish()


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def buffers_under_no_sync(rank, world, init_file):
    """Buffers are broadcast exactly when torch broadcasts them: not in the forward after a
    no_sync() one, not in no-grad forwards after a no-grad one; the running statistics (which
    differ per rank, each rank its own data) then equal torch's on every rank."""
    _init(rank, world, init_file)
    data = _data(rank, 6, n=8)
    base = BNNet()
    has_forward_sync = "forward_sync_buffers" in inspect.signature(TDDP.__init__).parameters
    kws = [dict(), dict(broadcast_buffers=False)]
    if has_forward_sync:  # torch >= 2.13
        kws.insert(1, dict(forward_sync_buffers=False))
    for kw in kws:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            t = TDDP(copy.deepcopy(base), **kw)
            f = FDDP(copy.deepcopy(base), **kw)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (t, f)]
        for step, (x, y) in enumerate(data):
            for m, opt in zip((t, f), opts):
                opt.zero_grad()
                if step % 3 == 2:  # an evaluation forward with no grad, in train mode
                    with torch.no_grad():
                        m(x)
                    continue
                for i, (xx, yy) in enumerate(zip(x.chunk(4), y.chunk(4))):
                    with m.no_sync() if i < 3 else _Null():
                        nn.functional.mse_loss(m(xx), yy).backward()
                opt.step()
            _same_state(f.module, t.module, f"{kw} step {step}")
    _finish()


# ---------------------------------------------------------------------------------- 5. arguments
def _signature_cases(world):
    """For every keyword of torch's constructor: how to check fastamp accepts it with torch's
    meaning ("same": both run with the value, grads and state compared) or refuses it ("refused":
    NotImplementedError naming it). Keywords of an installed torch missing here fail the test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel.distributed import _MixedPrecision

    return {
        "device_ids": ("same_error", dict(device_ids=[0])),  # CPU module: ValueError in both
        "output_device": ("same_error", dict(output_device=1)),  # 0 is falsy: both ignore it
        "dim": ("same", dict(dim=1)),
        "broadcast_buffers": ("same", dict(broadcast_buffers=False)),
        "init_sync": ("same", dict(init_sync=False)),
        "process_group": ("same", dict(process_group=dist.new_group(list(range(world))))),
        "bucket_cap_mb": ("same", dict(bucket_cap_mb=1e-4)),
        "find_unused_parameters": ("same", dict(find_unused_parameters=True)),
        "check_reduction": ("same", dict(check_reduction=True)),
        "gradient_as_bucket_view": ("same", dict(gradient_as_bucket_view=True)),
        "static_graph": ("same", dict(static_graph=True)),
        "delay_all_reduce_named_params": ("refused", None),  # needs a model: see below
        "param_to_hook_all_reduce": ("refused", None),
        "mixed_precision": (
            "refused",
            dict(mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)),
        ),
        "device_mesh": ("same", dict(device_mesh=init_device_mesh("cpu", (world,)))),
        "skip_all_reduce_unused_params": (
            "same",
            dict(skip_all_reduce_unused_params=True, find_unused_parameters=True),
        ),
        "bucket_cap_mb_list": ("same", dict(bucket_cap_mb_list=[1e-4, 1.0])),
        "batched_grad_copy": ("same", dict(batched_grad_copy=True)),
        "forward_sync_buffers": ("same", dict(forward_sync_buffers=False)),
        "lazy_bucket_allocation": ("refused", dict(lazy_bucket_allocation=True)),  # torch 2.15
    }


def constructor_keywords(rank, world, init_file):
    _init(rank, world, init_file)
    tsig = inspect.signature(TDDP.__init__)
    fsig = inspect.signature(FDDP.__init__)
    tnames = [n for n in tsig.parameters if n not in ("self", "module")]
    fnames = [n for n in fsig.parameters if n not in ("self", "module")]
    assert fnames[: len(tnames)] == tnames, (
        f"keyword order differs from torch's: {fnames} vs {tnames}"
    )
    for n in tnames:
        assert fsig.parameters[n].default == tsig.parameters[n].default, (
            n,
            fsig.parameters[n].default,
        )
    cases = _signature_cases(world)
    missing = set(tnames) - set(cases)
    assert not missing, f"torch's DDP has keywords this test does not decide on: {missing}"
    data = _data(rank, 2)
    base = BNNet()
    torch.manual_seed(rank)  # init_sync=False: each rank its own initial parameters
    local = BNNet()
    for name in tnames:
        kind, kw = cases[name]
        if name in ("delay_all_reduce_named_params", "param_to_hook_all_reduce"):
            m = copy.deepcopy(base)
            kw = dict(
                delay_all_reduce_named_params=list(m.a.named_parameters()),
                param_to_hook_all_reduce=m.b.weight,
            )
            err = _raises(lambda: FDDP(m, **kw))
            assert err[0] is NotImplementedError and name in err[1], (name, err)
            one = {name: kw[name]}
            te, fe = (
                _raises(lambda: TDDP(copy.deepcopy(base), **one)),
                _raises(lambda: FDDP(copy.deepcopy(base), **one)),
            )
            assert te[0] is fe[0] is ValueError, (name, te, fe)
            continue
        if kind == "refused":
            err = _raises(lambda: FDDP(copy.deepcopy(base), **kw))
            assert err[0] is NotImplementedError and name in err[1] and "not supported" in err[1], (
                name,
                err,
            )
            continue
        if kind == "same_error":
            te, fe = (
                _raises(lambda: TDDP(copy.deepcopy(base), **kw)),
                _raises(lambda: FDDP(copy.deepcopy(base), **kw)),
            )
            assert te[0] is not None and te[0] is fe[0], (name, te, fe)
            continue
        start = local if name == "init_sync" else base
        with warnings.catch_warnings(record=True) as tw:
            warnings.simplefilter("always")
            t = TDDP(copy.deepcopy(start), **kw)
        with warnings.catch_warnings(record=True) as fw:
            warnings.simplefilter("always")
            f = FDDP(copy.deepcopy(start), **kw)
        tcat = sorted({w.category.__name__ for w in tw if issubclass(w.category, FutureWarning)})
        fcat = sorted({w.category.__name__ for w in fw if issubclass(w.category, FutureWarning)})
        assert tcat == fcat, (name, tcat, fcat)
        _same_state(f.module, t.module, f"{name}: after construction")
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (t, f)]
        for x, y in data:
            for m, opt in zip((t, f), opts):
                opt.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
            _same_grads(f.module, t.module, name)
            for opt in opts:
                opt.step()
        _same_state(f.module, t.module, name)
    # a process_group that is not one: torch's binding raises TypeError; fastamp raised an
    # AttributeError from its own model check (now: TypeError naming the argument, first)
    te, fe = (
        _raises(lambda: TDDP(copy.deepcopy(base), process_group=3)),
        _raises(lambda: FDDP(copy.deepcopy(base), process_group=3)),
    )
    assert te[0] is fe[0] is TypeError and "process_group" in fe[1], (te, fe)
    _finish()


def comm_hooks(rank, world, init_file):
    """register_comm_hook with torch's hooks and a user hook: the same grads as torch's DDP with
    the same hook; the fused statistics still come out of the unpack."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as H

    _init(rank, world, init_file)
    data = _data(rank, 3)
    base = BNNet()

    def user_hook(state, bucket):  # (string annotations would fail torch's check under __future__)
        # uses the GradBucket interface: a per-parameter weight, then the mean
        state["calls"] += 1
        assert len(bucket.gradients()) == len(bucket.parameters())
        buf = bucket.buffer()
        for g, p in zip(bucket.gradients(), bucket.parameters()):
            assert g.shape == p.shape
        buf.mul_(0.5)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    for name, hook, state_of in (
        ("allreduce", H.allreduce_hook, lambda: None),
        ("fp16", H.fp16_compress_hook, lambda: None),
        ("bf16", H.bf16_compress_hook, lambda: None),
        ("user", user_hook, lambda: {"calls": 0}),
    ):
        for view in (False, True):
            t = TDDP(copy.deepcopy(base), gradient_as_bucket_view=view)
            f = FDDP(copy.deepcopy(base), gradient_as_bucket_view=view, bucket_cap_mb=1e-4)
            ts, fs = state_of(), state_of()
            te, fe = (
                _raises(lambda: t.register_comm_hook(ts, hook)),
                _raises(lambda: f.register_comm_hook(fs, hook)),
            )
            assert te[0] is fe[0], (name, te, fe)
            if te[0] is not None:  # bf16 on a build without NCCL: torch refuses, so do we
                assert name == "bf16", (name, te)
                continue
            again = (
                _raises(lambda: f.register_comm_hook(fs, hook)),
                _raises(lambda: t.register_comm_hook(ts, hook)),
            )
            assert again[0][0] is again[1][0] is RuntimeError, again
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (t, f)]
            for x, y in data:
                for m, opt in zip((t, f), opts):
                    opt.zero_grad()
                    nn.functional.mse_loss(m(x), y).backward()
                # Compressed hooks sum in half precision, and gloo orders a sum of 3 ranks by
                # the bucket's size (fastamp's buckets here are one param each): one fp16 / bf16
                # ulp apart (bf16 runs on CPU where torch has NCCL built in: torch >= 2.15's wheels).
                tol = {
                    "fp16": dict(rtol=1e-3, atol=1e-4),
                    "bf16": dict(rtol=8e-3, atol=1e-3),
                }.get(name, {})
                _same_grads(f.module, t.module, f"hook {name} view={view}", **tol)
                if not view:
                    found, sq = f.grad_stats()
                    ref = sum(float(p.grad.double().square().sum()) for p in f.parameters())
                    assert math.isclose(float(sq), ref, rel_tol=1e-5), (name, float(sq), ref)
                for opt in opts:
                    opt.step()
            if name == "user":
                assert fs["calls"] >= len(data) and ts["calls"] >= len(data), (fs, ts)
    _finish()


def uneven_inputs_join(rank, world, init_file):
    """join(): rank r has 2 + r batches; every rank finishes, and the model equals torch's."""
    _init(rank, world, init_file, timeout_s=30.0)
    data = _data(rank, 2 + rank)
    base = BNNet()
    for divide in (True, False):
        for view in (False, True):
            out = {}
            for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
                m = cls(copy.deepcopy(base), gradient_as_bucket_view=view)
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
                with m.join(divide_by_initial_world_size=divide):
                    for x, y in data:
                        opt.zero_grad()
                        nn.functional.mse_loss(m(x), y).backward()
                        opt.step()
                out[kind] = m
                if kind == "fastamp" and not view:  # the fused statistics survive join()
                    found, sq = m.grad_stats()
                    ref = sum(float(p.grad.double().square().sum()) for p in m.parameters())
                    assert float(found) == 0.0 and math.isclose(float(sq), ref, rel_tol=1e-5), (
                        float(sq),
                        ref,
                    )
            what = f"join divide_by_initial_world_size={divide} view={view}"
            _same_state(out["fastamp"].module, out["torch"].module, what)
            _same_everywhere(out["fastamp"], what)
    _finish()


class _BranchNet(_Linears):
    sizes = ((4, 4), (4, 4), (4, 4))

    def forward(self, x, use_b, use_c):
        y = self.a(x)
        if use_b:
            y = self.b(y)
        return self.c(y) if use_c else y


def join_with_unused_parameters(rank, world, init_file):
    """join() with find_unused_parameters: a joined rank sends the used map of the last
    reduction it took part in (torch's reducer all-reduces its map in place and sends it again),
    so a parameter the remaining ranks leave unused gets zeros where it was used in that
    reduction and stays None where it was not. Grads compared (None or values) at every step."""
    _init(rank, world, init_file, timeout_s=30.0)
    torch.manual_seed(0)
    base = _BranchNet()
    # The last rank joins after 2 steps; in its second step b is used by no rank, c by rank 0.
    plans = {
        r: [(True, True), (False, r == 0), (False, False), (False, False), (True, True)]
        for r in range(world)
    }
    plans[world - 1] = plans[world - 1][:2]
    grads = {}
    for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
        m = cls(copy.deepcopy(base), find_unused_parameters=True)
        seen = []
        with m.join():
            for i, (use_b, use_c) in enumerate(plans[rank]):
                m.zero_grad(set_to_none=True)
                m(torch.ones(2, 4) * (rank + 1 + i), use_b, use_c).sum().backward()
                seen.append(
                    [None if p.grad is None else p.grad.clone() for p in m.module.parameters()]
                )
        grads[kind] = seen
    for i, (t, f) in enumerate(zip(grads["torch"], grads["fastamp"])):
        for (n, _), gt, gf in zip(base.named_parameters(), t, f):
            assert (gt is None) == (gf is None), (
                f"step {i}: {n}.grad is {gf is None and 'None'} here, torch's {gt is None and 'None'}"
            )
            if gt is not None:
                assert torch.equal(gt, gf), f"step {i}: {n}.grad differs from torch's"
    if rank == 0:  # the case the test is about did happen
        assert grads["torch"][2][4] is not None and grads["torch"][2][2] is None
    _finish()


# ------------------------------------------------------------------ 6. bit for bit with 3+ ranks
class _WideNet(_Linears):
    sizes = ((6, 40), (40, 30), (30, 3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def grads_bitwise(rank, world, init_file):
    """The all-reduced grads equal torch's bit for bit, first iteration (torch's single-bucket
    layout) and after the rebuild (its ready-order layout), with one bucket, many buckets, a
    per-bucket cap list and an unused-parameter search (no rebuild, the 1 MiB first bucket). With
    3 ranks the collective's summation order depends on an element's position in its bucket, so
    this fails unless the bucket layouts are torch's. With bucket views and grads zeroed in place
    (``set_to_none=False``) the grads are their slices and torch divides them in place; with 3
    ranks that rounds differently from a multiplication by 1/3."""
    _init(rank, world, init_file)
    data = _data(rank, 4, n=8)
    base = _WideNet()
    cases = (
        (dict(), True),
        (dict(bucket_cap_mb=0.002), True),
        (dict(bucket_cap_mb_list=[0.001, 0.004]), True),
        (dict(find_unused_parameters=True), True),
        (dict(find_unused_parameters=True, bucket_cap_mb=0.002), True),
        (dict(gradient_as_bucket_view=True, bucket_cap_mb=0.003), True),
        (dict(gradient_as_bucket_view=True, bucket_cap_mb=0.003), False),
        (dict(bucket_cap_mb=0.003), False),
    )
    for kw, set_to_none in cases:
        t = TDDP(copy.deepcopy(base), **kw)
        f = FDDP(copy.deepcopy(base), **kw)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (t, f)]
        for step, (x, y) in enumerate(data):
            for m, opt in zip((t, f), opts):
                opt.zero_grad(set_to_none=set_to_none)
                nn.functional.mse_loss(m(x), y).backward()
            for (n, p), q in zip(f.module.named_parameters(), t.module.parameters()):
                assert torch.equal(p.grad, q.grad), (
                    f"{kw} set_to_none={set_to_none} step {step}: {n}.grad differs from torch's: "
                    f"max {(p.grad - q.grad).abs().max().item():.3g}; buckets {f.bucket_layout()}"
                )
            for opt in opts:
                opt.step()
        if kw.get("bucket_cap_mb") == 0.002 and not kw.get("find_unused_parameters"):
            assert len(f.bucket_sizes) > 1, f.bucket_sizes  # the rebuild made several buckets
    _finish()


def user_grad_hooks(rank, world, init_file):
    """A user's post-accumulate-grad hook registered after wrapping (a rank-dependent in-place
    change and a clamp) runs where it runs under torch's DDP: before the reducer, seeing the
    local undivided grad, and what it leaves in ``p.grad`` is what gets all-reduced. Same grads
    seen by the hook, same grads after backward, with and without bucket views."""
    _init(rank, world, init_file)
    data = _data(rank, 3)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for view in (False, True):
        seen: dict[str, list[Tensor]] = {"torch": [], "fastamp": []}
        models = {}
        for kind, cls in (("torch", TDDP), ("fastamp", FDDP)):
            m = models[kind] = cls(copy.deepcopy(base), gradient_as_bucket_view=view)
            for p in m.parameters():

                def hook(p, log=seen[kind]):
                    log.append(p.grad.clone())
                    p.grad.mul_(rank + 1).clamp_(-0.05, 0.05)

                p.register_post_accumulate_grad_hook(hook)
        for step, (x, y) in enumerate(data):
            for m in models.values():
                m.zero_grad(set_to_none=step % 2 == 0)
                nn.functional.mse_loss(m(x), y).backward()
            what = f"view={view} step {step}"
            for a, b in zip(seen["fastamp"], seen["torch"]):
                assert torch.equal(a, b), f"{what}: the user hook saw another grad than torch's"
            _same_grads(models["fastamp"].module, models["torch"].module, what, rtol=0, atol=0)
    _finish()


def wrapper_deleted(rank, world, init_file):
    """Deleting the wrapper removes its grad hooks, as torch's reducer does: its synchronisation
    object is freed and a later backward of the bare module does not reach it (no collective
    is started), so the module can be wrapped again."""
    import gc
    import weakref

    _init(rank, world, init_file)
    ((x, y),) = _data(rank, 1)
    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    f = FDDP(module)
    nn.functional.mse_loss(f(x), y).backward()
    sync = weakref.ref(f._bucket_stats)
    del f
    gc.collect()
    assert sync() is None, (
        "the deleted wrapper's comm-hook state is still referenced (its reducer and hooks remain)"
    )
    module.zero_grad()
    nn.functional.mse_loss(module(x), y).backward()  # local only: nothing hooked
    local = [p.grad.clone() for p in module.parameters()]
    assert all(torch.isfinite(t).all() for t in local)
    f2 = FDDP(module)
    module.zero_grad()
    nn.functional.mse_loss(f2(x), y).backward()
    mean = [t.clone() for t in local]
    for t in mean:
        dist.all_reduce(t)
        t /= world
    for p, m_ in zip(module.parameters(), mean):
        torch.testing.assert_close(p.grad, m_, rtol=1e-6, atol=1e-7)
    _finish()


# ------------------------------------------------------------------ 7. hook + statistics, bitwise
def _bits(t: Tensor) -> Tensor:
    return t.detach().reshape(-1).view(torch.int32)  # fp32: NaN compared by its bits


def hooks_and_statistics_bitwise(rank, world, init_file):
    """fastamp's statistics composed with a comm hook (none, torch's allreduce_hook and
    fp16_compress_hook, a user's own; PowerSGD is not here: torch's own DDP with powerSGD_hook
    hangs in its first compressed step on gloo, torch 2.13 CPU), against torch's DDP with the same hook followed by
    torch's unscale_ and clip_grad_norm_: the reduced grads are torch's bit for bit; the
    statistics the scaler reuses are ``grad_stats`` over each bucket's reduced grads (summed in
    bucket order) bit for bit, with an inf and then a NaN in one rank's grads of one bucket only;
    the scaler skips exactly where torch's does, reading no grad itself."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as H

    _init(rank, world, init_file)
    data = _data(rank, 4, n=8)
    base = _WideNet()

    def user_hook(state, bucket):  # a user's average: scale, all-reduce, divide on completion
        buf = bucket.buffer()
        buf.mul_(0.5)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] * (2.0 / world))

    poison = {1: math.inf, 2: math.nan}  # step -> value put in rank 0's b.weight grad

    def inject(step):
        def hook(p):
            if rank == 0 and step[0] in poison:
                p.grad[0, 0] = poison[step[0]]

        return hook

    with _counted_grad_stats() as (calls, real):
        for name, hook, state_of in (
            ("none", None, None),
            ("allreduce", H.allreduce_hook, lambda: None),
            ("fp16", H.fp16_compress_hook, lambda: None),
            ("user", user_hook, lambda: None),
        ):
            for view in (False, True):
                what = f"hook {name} view={view}"
                step = [0]
                t = TDDP(copy.deepcopy(base), gradient_as_bucket_view=view, bucket_cap_mb=0.003)
                f = FDDP(copy.deepcopy(base), gradient_as_bucket_view=view, bucket_cap_mb=0.003)
                if hook is not None:
                    t.register_comm_hook(state_of(), hook)
                    f.register_comm_hook(state_of(), hook)
                for m in (t, f):
                    m.module.b.weight.register_post_accumulate_grad_hook(inject(step))
                ts, fs, topt, fopt = _scaled_sgd(t, f)
                for i, (x, y) in enumerate(data):
                    step[0] = i
                    for m, s, opt in ((t, ts, topt), (f, fs, fopt)):
                        opt.zero_grad()
                        s.scale(nn.functional.mse_loss(m(x), y)).backward()
                    for (n, p), q in zip(f.module.named_parameters(), t.module.parameters()):
                        assert torch.equal(_bits(p.grad), _bits(q.grad)), f"{what} step {i}: {n}"
                    # the statistics: grad_stats over each bucket's reduced grads, bucket order
                    layout = f.bucket_layout()
                    params = [p for p in f.module.parameters() if p.requires_grad]
                    inv = fs.current_scale().reciprocal()
                    ref_found = ref_sq = None
                    start = 0
                    for size in layout["bucket_sizes"]:
                        grads = [params[j].grad for j in layout["order"][start : start + size]]
                        start += size
                        rf, rq, _ = real(grads, inv, 2.0)
                        ref_found = rf if ref_found is None else ref_found + rf
                        ref_sq = rq if ref_sq is None else ref_sq + rq
                    found, sq = f.grad_stats()
                    assert torch.equal(found, ref_found), (what, i, found, ref_found)
                    assert torch.equal(_bits(sq), _bits(ref_sq)), (what, i, sq, ref_sq)
                    assert (float(found) == 1.0) == (i in poison), (what, i, found)
                    # torch: unscale_ + clip; fastamp: clip_grad_norm_ reusing the statistics
                    calls.clear()
                    ts.unscale_(topt)
                    tnorm = torch.nn.utils.clip_grad_norm_(list(t.parameters()), 1.0)
                    fnorm = fs.clip_grad_norm_(fopt, 1.0)
                    assert not calls, f"{what} step {i}: the scaler read the grads again"
                    if math.isfinite(float(tnorm)):
                        assert math.isclose(float(fnorm), float(tnorm), rel_tol=1e-5), (
                            what, i, float(fnorm), float(tnorm),
                        )  # fmt: skip
                    else:
                        assert not math.isfinite(float(fnorm)), (what, i, fnorm)
                    for s, opt in ((ts, topt), (fs, fopt)):
                        s.step(opt)
                        s.update()
                    assert ts.get_scale() == fs.get_scale(), (what, i)
                    _same_state(f.module, t.module, f"{what} step {i}")
                assert ts.get_scale() == 256.0 / 4  # both poisoned steps were skipped
    _finish()
