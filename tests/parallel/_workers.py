"""Worker processes of the distributed tests (gloo on CPU). Each worker asserts by itself; a
failure anywhere makes torch.multiprocessing.spawn raise in the test with the traceback."""

from __future__ import annotations

import copy
import math
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastamp
from fastamp.parallel import DistributedDataParallel as FDDP
from tests._dist import finish, init_gloo

_finish = finish


def _refused(fn, words: list[str], otherwise: str) -> None:
    """``fn()`` raises a RuntimeError whose message has each of ``words``; it failing to raise
    fails with ``otherwise``."""
    try:
        fn()
    except RuntimeError as e:
        assert all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError(otherwise)


def _init(rank: int, world: int, init_file: str, timeout_s: float = 60.0) -> None:
    init_gloo(rank, world, init_file, timeout_s)
    torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self, dtype=torch.float32, unused=False, bn=True):
        super().__init__()
        self.a = nn.Linear(10, 20)
        self.b = nn.Linear(20, 20)
        # BatchNorm exercises the buffer broadcast; without it, DDP equals one process on the
        # concatenated batch (with it, each rank normalises its own half).
        self.norm = nn.BatchNorm1d(20) if bn else nn.LayerNorm(20)
        self.c = nn.Linear(20, 3)
        self.unused = nn.Linear(3, 3) if unused else None
        self.to(dtype)

    def forward(self, x):
        return self.c(torch.relu(self.norm(self.b(torch.tanh(self.a(x))))))


def _batches(rank: int, world: int, steps: int, dtype):
    g = torch.Generator().manual_seed(1234)
    full = [
        (
            torch.randn(4 * world, 10, generator=g).to(dtype),
            torch.randn(4 * world, 3, generator=g).to(dtype),
        )
        for _ in range(steps)
    ]
    return full, [(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]) for x, y in full]


def _train(model, batches, accumulate=1, scaler=None, inject=None, rank=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        parts = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (xx, yy) in enumerate(parts):
            ctx = model.no_sync() if (i < len(parts) - 1 and hasattr(model, "no_sync")) else _null()
            with ctx:
                loss = nn.functional.mse_loss(model(xx).float(), yy.float()) / len(parts)
                (scaler.scale(loss) if scaler else loss).backward()
        if inject is not None and step == inject[0] and rank == inject[1]:
            model.module.a.weight.grad[0, 0] = math.inf
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _close(a: nn.Module, b: nn.Module, rtol=1e-5, atol=1e-6):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def equivalence(rank, world, init_file):
    """fastamp DDP == torch DDP == one process on the concatenated batch, for several buckets."""
    _init(rank, world, init_file)
    full, mine = _batches(rank, world, 4, torch.float32)
    base = Net()
    ref = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base)), mine)
    base_ln = Net(bn=False)
    single = _train(copy.deepcopy(base_ln), full)
    for cap in (1e-6, 0.001, 25.0, 1000.0):  # every param alone ... all in one bucket
        for view in (False, True):
            m = FDDP(copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=view)
            assert len(m.bucket_sizes) == 1  # as torch: one bucket until the rebuild sizes them
            _train(m, mine)
            if cap == 1e-6:
                assert m.bucket_sizes == [1] * len(list(base.parameters())), m.bucket_sizes
            if cap == 1000.0:
                assert len(m.bucket_sizes) == 1
            _close(m.module, ref.module)
            for buf_a, buf_b in zip(m.module.buffers(), ref.module.buffers()):
                # grad * (1/3) here vs grad / 3 in torch: params differ in the last bits, and the
                # running statistics follow them.
                torch.testing.assert_close(buf_a, buf_b, rtol=1e-5, atol=1e-6)
            m_ln = _train(
                FDDP(copy.deepcopy(base_ln), bucket_cap_mb=cap, gradient_as_bucket_view=view), mine
            )
            _close(m_ln.module, single, rtol=1e-4, atol=1e-5)
    assert list(m.state_dict()) == list(ref.state_dict())  # "module." keys, interchangeable
    _finish()


def accumulation_and_half(rank, world, init_file):
    _init(rank, world, init_file)
    _, mine = _batches(rank, world, 3, torch.float32)
    base = Net()
    ref = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base)), mine, accumulate=2)
    m = _train(FDDP(copy.deepcopy(base), bucket_cap_mb=0.001), mine, accumulate=2)
    _close(m.module, ref.module)
    for dtype in (torch.bfloat16, torch.float16):
        _, mine_h = _batches(rank, world, 3, dtype)
        base_h = Net(dtype)
        ref_h = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base_h)), mine_h)
        m_h = _train(FDDP(copy.deepcopy(base_h), bucket_cap_mb=0.001), mine_h)
        _close(m_h.module, ref_h.module, rtol=2e-2, atol=2e-3)
    _finish()


def overflow_on_one_rank(rank, world, init_file):
    """inf in one rank's grads: after the all-reduce every rank sees it and all skip together."""
    _init(rank, world, init_file)
    _, mine = _batches(rank, world, 4, torch.float32)
    m = FDDP(Net())
    scaler = fastamp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for x, y in mine:  # clean steps: the unpack's stats agree with the grads
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        found, sq = m.grad_stats()
        assert float(found) == 0.0
        ref_sq = sum(float(p.grad.double().square().sum()) for p in m.parameters())
        assert math.isclose(float(sq), ref_sq, rel_tol=1e-5)
        scaler.step(opt)
        scaler.update()
    # With the scaler registered, clip_grad_norm_ reuses the unpack's stats: no grad_stats pass.
    m.register_grad_scaler(scaler)
    from fastamp.scaler import _ops as scaler_ops

    real_stats = scaler_ops.grad_stats
    scaler_ops.grad_stats = None  # any call would fail
    try:
        for x, y in mine[:2]:
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
            inv = 1.0 / scaler.get_scale()
            ref_norm = math.sqrt(
                sum(float((p.grad.double() * inv).square().sum()) for p in m.parameters())
            )
            norm = scaler.clip_grad_norm_(opt, 0.01)
            assert math.isclose(float(norm), ref_norm, rel_tol=1e-5), (float(norm), ref_norm)
            scaler.step(opt)
            scaler.update()
    finally:
        scaler_ops.grad_stats = real_stats
    # now a real overflow on one rank, injected into the loss so it flows through the all-reduce
    opt.zero_grad()
    x, y = mine[0]
    loss = nn.functional.mse_loss(m(x), y) * (math.inf if rank == 0 else 1.0)
    scaler.scale(loss).backward()
    found, _ = m.grad_stats()
    assert float(found) == 1.0, "every rank must see the overflow after the all-reduce"
    before = [p.detach().clone() for p in m.parameters()]
    scale_before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())), "step must be skipped"
    assert scaler.get_scale() == scale_before / 2
    gathered = [None] * world
    dist.all_gather_object(gathered, scaler.get_scale())
    assert len(set(gathered)) == 1
    _finish()


def unused_parameters(rank, world, init_file):
    _init(rank, world, init_file)
    _, mine = _batches(rank, world, 3, torch.float32)
    base = Net(unused=True)
    ref = _train(
        nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True), mine
    )
    m = _train(FDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.001), mine)
    _close(m.module, ref.module)
    strict = FDDP(copy.deepcopy(base))
    x, y = mine[0]
    _refused(
        lambda: nn.functional.mse_loss(strict(x), y).backward(),
        ["unused.weight", "find_unused_parameters=True"],
        "expected an error naming the unused parameters",
    )
    _finish()


def rank_dependent_unused(rank, world, init_file):
    """Each rank uses a different branch, and they swap: collectives must still pair up."""
    _init(rank, world, init_file)

    class TwoBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.out = nn.Linear(6, 2)

        def forward(self, x, use_a):
            return self.out(torch.tanh(self.a(x) if use_a else self.b(x)))

    base = TwoBranch()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    for cap in (1e-6, 1000.0):
        m = FDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=cap)
        opts = (
            [torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, ref)]
            if cap == 1e-6
            else [torch.optim.SGD(m.parameters(), lr=0.1)]
        )
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            use_a = (rank + step) % 2 == 0
            models = (m, ref) if cap == 1e-6 else (m,)
            for model, opt in zip(models, opts):
                opt.zero_grad()
                nn.functional.mse_loss(model(x, use_a), y).backward()
                opt.step()
        if cap == 1e-6:
            _close(m.module, ref.module)
            ref_params = [p.detach().clone() for p in ref.module.parameters()]
        else:
            for p, q in zip(m.module.parameters(), ref_params):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    _finish()


def mismatched_models(rank, world, init_file):
    _init(rank, world, init_file)
    model = nn.Sequential(nn.Linear(4, 8 if rank == 0 else 9), nn.Linear(8 if rank == 0 else 9, 2))
    _refused(lambda: FDDP(model), ["differs across ranks", "0.weight"], "expected a mismatch error")
    _finish()


def dead_rank(rank, world, init_file):
    """A peer dies mid-step: the survivors raise a clear error within the timeout, not hang."""
    _init(rank, world, init_file, timeout_s=15.0)
    m = FDDP(Net())
    x, y = torch.randn(4, 10), torch.randn(4, 3)
    nn.functional.mse_loss(m(x), y).backward()  # one good step together
    if rank == world - 1:
        os._exit(0)
    import time

    t0 = time.monotonic()
    # the forward's buffer broadcast or a bucket's all-reduce notices first
    _refused(
        lambda: nn.functional.mse_loss(m(x), y).backward(),
        ["peer rank has probably died"],
        "expected an error when a peer died",
    )
    assert time.monotonic() - t0 < 60
    os._exit(0)  # the process group is broken; skip its teardown


def accumulation_collectives(rank, world, init_file):
    """GradientAccumulator under DDP: one all-reduce per optimizer step, counted."""
    from fastamp import GradientAccumulator
    from fastamp.parallel import distributed as fddp_mod

    _init(rank, world, init_file)
    _, mine = _batches(rank, world, 7, torch.float32)  # 7 micro-batches, groups of 3: 3, 3, 1
    calls = []
    real = fddp_mod.dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    fddp_mod.dist.all_reduce = counting
    try:
        m = FDDP(Net(), bucket_cap_mb=1000.0)  # one bucket: one all-reduce per synced backward
        acc = GradientAccumulator(torch.optim.SGD(m.parameters(), lr=0.01), 3, model=m)
        for (x, y), micro in acc.iterate(mine):
            with micro:
                micro.backward(nn.functional.mse_loss(m(x), y))
    finally:
        fddp_mod.dist.all_reduce = real
    assert acc.optimizer_steps == 3 and len(calls) == 3, (acc.optimizer_steps, len(calls))

    torch_ddp = nn.parallel.DistributedDataParallel(Net())
    hooked = []

    def hook(state, bucket):
        hooked.append(1)
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0] / world)
        )

    torch_ddp.register_comm_hook(None, hook)
    acc = GradientAccumulator(torch.optim.SGD(torch_ddp.parameters(), lr=0.01), 3, model=torch_ddp)
    for (x, y), micro in acc.iterate(mine):
        with micro:
            micro.backward(nn.functional.mse_loss(torch_ddp(x), y))
    n_buckets = len(hooked) // 3
    assert len(hooked) == 3 * n_buckets and n_buckets >= 1, len(hooked)
    _finish()


def flat_buffers_under_ddp(rank, world, init_file):
    """fastamp.optim.AdamW(flat_buffers=True) under fastamp's DDP (torch's reducer copies each
    reduced bucket into the grads, which are views of the flat grad buffer): the same parameters
    as torch's DDP + GradScaler + AdamW(fused=True), the DDP's statistics reused by the scaler;
    with gradient_as_bucket_view=True the grads are the reducer's bucket views, and the flat
    optimizer refuses them naming the argument, before stepping anything."""

    _init(rank, world, init_file)
    _, mine = _batches(rank, world, 4, torch.float32)
    base = Net(bn=False)
    t = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    f = FDDP(copy.deepcopy(base))
    topt = torch.optim.AdamW(t.parameters(), lr=1e-2, fused=True)
    fopt = fastamp.optim.AdamW(f.parameters(), lr=1e-2, flat_buffers=True)
    ts = torch.amp.GradScaler("cpu", init_scale=256.0)
    fs = fastamp.GradScaler("cpu", init_scale=256.0)
    f.register_grad_scaler(fs)
    for x, y in mine:
        for m, s, opt in ((t, ts, topt), (f, fs, fopt)):
            opt.zero_grad()
            s.scale(nn.functional.mse_loss(m(x), y)).backward()
            if s is ts:
                s.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.5)
            else:
                s.clip_grad_norm_(opt, 0.5)
            s.step(opt)
            s.update()
    _close(f.module, t.module, rtol=1e-5, atol=1e-6)
    v = FDDP(copy.deepcopy(base), gradient_as_bucket_view=True)
    vopt = fastamp.optim.AdamW(v.parameters(), lr=1e-2, flat_buffers=True)
    x, y = mine[0]
    for _ in range(2):  # the reducer makes the grads its bucket views after the first backward
        vopt.zero_grad()
        nn.functional.mse_loss(v(x), y).backward()
    before = [p.detach().clone() for p in v.parameters()]
    _refused(
        vopt.step,
        ["gradient_as_bucket_view"],
        "flat buffers stepped grads that are DDP's bucket views",
    )
    assert all(torch.equal(a, b) for a, b in zip(before, v.parameters()))
    _finish()


class _Given(nn.Module):
    """loss = sum(w * g): each rank's grad of ``w`` is exactly its ``g``, whatever its size."""

    def __init__(self, n: int, dtype: torch.dtype):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n, dtype=dtype))
        self.v = nn.Parameter(torch.ones(n, dtype=dtype))  # a second grad in the same bucket

    def forward(self, g: Tensor, h: Tensor) -> Tensor:
        return (self.w * g).sum() + (self.v * h).sum()


def _extreme_grads(rank: int, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Grads at both ends of ``dtype``'s range: near its maximum (the same sign on every rank
    for most elements, so their sum passes the maximum while their mean does not) and among
    its subnormals and smallest normals (where a halving rounds)."""
    fi = torch.finfo(dtype)
    shared = torch.Generator().manual_seed(7)  # the same on every rank: signs
    own = torch.Generator().manual_seed(100 + rank)
    sign = torch.where(torch.rand(n, generator=shared) < 0.5, -1.0, 1.0).double()
    sign[: n // 8] *= 1.0 if rank == 0 else -1.0  # some elements of opposite signs
    big = (0.5 + 0.5 * torch.rand(n, generator=own, dtype=torch.float64)) * fi.max * sign
    tiny_steps = torch.randint(0, 64, (n,), generator=own).double()
    tiny = tiny_steps * fi.smallest_normal * fi.eps * sign  # k steps of the smallest subnormal
    tiny[n // 2 :] = torch.rand(n - n // 2, generator=own, dtype=torch.float64) * 4 * fi.tiny
    return big.to(dtype), tiny.to(dtype)


def division_extremes(rank, world, init_file):
    """fastamp's DDP divides by the world size where torch's reducer does, before the sum: grads
    near the top of float32's/bfloat16's range stay finite as torch's do (summed first, they
    overflow to inf), and subnormal grads round as torch's (summed first, they round once
    instead of per term). Compared with torch's DDP bit for bit: both run the same exactly
    rounded IEEE operations (a halving, a two-term sum) on this machine."""
    _init(rank, world, init_file)
    n = 256
    for dtype in (torch.float32, torch.bfloat16):
        big, tiny = _extreme_grads(rank, n, dtype)
        for views in (False, True):
            base = _Given(n, dtype)
            t = nn.parallel.DistributedDataParallel(
                copy.deepcopy(base), gradient_as_bucket_view=views
            )
            f = FDDP(copy.deepcopy(base), gradient_as_bucket_view=views)
            for g, h in ((big, tiny), (tiny, big), (big, big)):
                for m in (t, f):
                    m.zero_grad()
                    m(g, h).backward()
                for (name, pt), pf in zip(t.module.named_parameters(), f.module.parameters()):
                    assert pt.grad is not None and pf.grad is not None
                    if g is big and h is big:
                        assert bool(pt.grad.isfinite().all()), "the extremes overflow torch too"
                    assert torch.equal(pf.grad, pt.grad), (
                        f"{dtype} views={views} {name}: "
                        f"{(pf.grad != pt.grad).sum().item()} grads differ from torch's DDP, "
                        f"e.g. {pf.grad[pf.grad != pt.grad][:3].tolist()} vs "
                        f"{pt.grad[pf.grad != pt.grad][:3].tolist()}"
                    )
    _finish()
