"""Worker processes of the FSDP2 tests (``fully_shard`` on a CPU mesh, gloo): fastamp's recipe
(``fastamp.GradScaler`` + ``clip_grad_norm_`` + ``fastamp.optim``) against torch's
(``torch.amp.GradScaler`` + ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim``) on
the same sharded model and batches. Each worker asserts by itself, on every rank."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fastamp
from fastamp.testing.syncs import count_host_syncs
from tests.parallel._workers import _finish, _init

GLOBAL_BATCH = 8


def _model(mesh, seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    # The last bias has 3 elements: on 4 ranks one rank's shard of it is empty.
    m = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 3))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _batch(step: int, rank: int, world: int, replicas: int = 1):
    """This rank's rows of the global batch of ``step`` (HSDP: ranks of a replica group share
    nothing; every rank holds its own rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _train(
    m, opt, scaler, rank, world, steps, *, start=0, clip=None, inject=None, counts=None,
    inject_ranks=None, autocast=True,
):  # fmt: skip
    """``steps`` steps of the recipe; returns the scale after each (the skip decisions). An inf
    goes into the first weight's grad shard at step ``inject``, on ``inject_ranks`` (default:
    the last rank only)."""
    inject_ranks = (world - 1,) if inject_ranks is None else inject_ranks
    fast = isinstance(scaler, fastamp.GradScaler)
    scales = []
    for s in range(start, start + steps):
        x, y = _batch(s, rank, world)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = nn.functional.mse_loss(m(x).float(), y)
        scaler.scale(loss).backward()
        if inject is not None and s == inject and rank in inject_ranks:
            shard = m[0].weight.grad.to_local()
            assert shard.numel() > 0
            shard.view(-1)[0] = math.inf
        mode = CommDebugMode()
        with mode, count_host_syncs(("fastamp",)) as reads:
            if fast:
                if clip is not None:
                    scaler.clip_grad_norm_(opt, clip)
            elif clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        if counts is not None:
            counts.append(mode.get_total_counts())
        if fast and isinstance(opt, fastamp.optim.AdamW | fastamp.optim.SGD):
            assert reads == [], reads  # the fused optimizer skips on the device: no host sync
        scales.append(scaler.get_scale())
    return scales


def _same_on_every_rank(value, what: str) -> None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"{what} differs between ranks: {values}"


def _close_shards(a: nn.Module, b: nn.Module, rtol=1e-5, atol=1e-7, exact=False) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert isinstance(p, DTensor) and isinstance(q, DTensor), n
        assert p.placements == q.placements, n
        if exact:
            assert torch.equal(p.to_local(), q.to_local()), n
        else:
            torch.testing.assert_close(
                p.to_local(), q.to_local(), rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}"
            )


def recipe_parity(rank: int, world: int, init_file: str) -> None:
    """fastamp's recipe == torch's on FSDP2: params (every rank's shard), the skip decision with an
    inf in one rank's shard only, one all-reduce per step (torch: two with clipping)."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    for clip in (None, 1.0):
        for kind in ("AdamW", "Adam", "SGD"):
            kw = {"lr": 0.05, "momentum": 0.9} if kind == "SGD" else {"lr": 1e-2}
            ref = _model(mesh)
            ours = _model(mesh)
            ref_counts: list[int] = []
            our_counts: list[int] = []
            ref_scales = _train(
                ref, getattr(torch.optim, kind)(ref.parameters(), **kw),
                torch.amp.GradScaler("cpu"), rank, world, 6, clip=clip, inject=2,
                counts=ref_counts,
            )  # fmt: skip
            our_opt = getattr(fastamp.optim, kind)(ours.parameters(), **kw)
            our_scales = _train(
                ours, our_opt, fastamp.GradScaler("cpu"), rank, world, 6, clip=clip, inject=2,
                counts=our_counts,
            )  # fmt: skip
            assert our_scales == ref_scales, (clip, kind, our_scales, ref_scales)
            assert our_scales[2] == our_scales[1] / 2  # the injected inf skipped on every rank
            _same_on_every_rank(our_scales, "the scale")
            _close_shards(ours, ref)
            assert our_counts == [1] * 6, our_counts  # found_inf and the norm: one all-reduce
            assert ref_counts == [2 if clip is not None else 1] * 6, ref_counts
            for p in ours.parameters():  # state sharded as torch keeps it
                st = our_opt.state[p]
                key = "momentum_buffer" if kind == "SGD" else "exp_avg"
                assert isinstance(st[key], DTensor) and st[key].placements == p.placements
    # The fastamp scaler with torch's optimizer: unscale_ then torch's clip, bit for bit.
    ref, ours = _model(mesh), _model(mesh)
    a = _train(ref, torch.optim.AdamW(ref.parameters()), torch.amp.GradScaler("cpu"), rank,
               world, 4, inject=1)  # fmt: skip
    b = _train(ours, torch.optim.AdamW(ours.parameters()), fastamp.GradScaler("cpu"), rank,
               world, 4, inject=1)  # fmt: skip
    assert a == b
    _close_shards(ours, ref, exact=True)
    _refusals(mesh, rank, world)
    _finish()


def _refusals(mesh, rank, world) -> None:
    """Grads fastamp cannot measure are refused by name before anything changes; the step then
    runs once they are fixed."""
    from torch.distributed.tensor import Partial, Replicate

    m = _model(mesh)
    opt, scaler = fastamp.optim.AdamW(m.parameters()), fastamp.GradScaler("cpu")
    x, y = _batch(0, rank, world)
    scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
    w = m[0].weight
    good = w.grad
    before = [p.to_local().clone() for p in m.parameters()]
    bad = {
        "Partial": DTensor.from_local(
            torch.zeros_like(good.full_tensor()), mesh, [Partial()], run_check=False
        ),
        "sharded differently": DTensor.from_local(
            good.full_tensor(), mesh, [Replicate()], run_check=False
        ),
    }
    for text, grad in bad.items():
        w.grad = grad
        for call in (lambda: scaler.clip_grad_norm_(opt, 1.0), lambda: scaler.step(opt)):
            try:
                call()
            except (RuntimeError, NotImplementedError) as e:
                assert text in str(e) and "param_groups[0]['params'][0]" in str(e), e
            else:
                raise AssertionError(f"a {text} grad was taken")
        assert not scaler.in_iteration()
        assert all(torch.equal(p.to_local(), q) for p, q in zip(m.parameters(), before))
    # Without a scaler, the optimizer's own check: a DTensor param with a plain grad (torch lets
    # .grad be assigned so; the fused kernel needs the grad's shard).
    w.grad = good.full_tensor()
    try:
        opt.step()
    except RuntimeError as e:
        assert "is a DTensor but its grad is a Tensor" in str(e), e
    else:
        raise AssertionError("a plain grad of a DTensor param was taken")
    assert all(torch.equal(p.to_local(), q) for p, q in zip(m.parameters(), before))
    w.grad = good
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(p.to_local(), q) for p, q in zip(m.parameters(), before))
    _same_errors_as_torch(mesh, rank, world)


def _same_errors_as_torch(mesh, rank, world) -> None:
    """Misuse raises what torch's recipe raises on the same sharded model (class and message)."""

    def outcome(fast: bool, calls) -> list[str]:
        m = _model(mesh)
        opt = (fastamp.optim if fast else torch.optim).AdamW(m.parameters())
        scaler = (fastamp.GradScaler if fast else torch.amp.GradScaler)("cpu")
        x, y = _batch(0, rank, world)
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        got = []
        for call in calls:
            try:
                call(scaler, opt)
                got.append("ok")
            except Exception as e:
                got.append(f"{type(e).__name__}: {e}")
        return got

    for calls in (
        [lambda s, o: s.unscale_(o), lambda s, o: s.unscale_(o)],  # unscale_ twice
        [lambda s, o: s.step(o), lambda s, o: s.step(o)],  # step twice
        [lambda s, o: s.step(o), lambda s, o: s.unscale_(o)],  # unscale_ after step
        [lambda s, o: s.step(o, closure=lambda: 0.0)],  # a closure
    ):
        assert outcome(True, calls) == outcome(False, calls), (
            outcome(True, calls),
            outcome(False, calls),
        )


def hybrid_parity(rank: int, world: int, init_file: str) -> None:
    """HSDP (a 2-D mesh, replicate x shard): the statistics reduce over the shard dimension only
    (over both, the norm would count every element twice); replicas stay identical."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))
        for part in (m[0], m[2], m):
            fully_shard(part, mesh=mesh)
        return m

    ref, ours = model(), model()
    counts: list[int] = []
    # FSDP2 all-reduces the grads over the replicas: an overflow is in every replica of the
    # shard (as torch, the inf check reduces over the shard dimension only).
    last = [r for r in range(world) if r % (world // 2) == world // 2 - 1]
    a = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.amp.GradScaler("cpu"),
               rank, world, 5, clip=0.5, inject=3, inject_ranks=last)  # fmt: skip
    b = _train(ours, fastamp.optim.AdamW(ours.parameters(), lr=1e-2), fastamp.GradScaler("cpu"),
               rank, world, 5, clip=0.5, inject=3, counts=counts, inject_ranks=last)  # fmt: skip
    assert b[3] == b[2] / 2  # skipped on every rank
    assert a == b, (a, b)
    assert counts == [1] * 5, counts
    _close_shards(ours, ref)
    for p in ours.parameters():  # the replicas of each shard hold the same values
        shard = mesh.get_local_rank("shard")
        gathered = [None] * world
        dist.all_gather_object(gathered, (shard, p.to_local().tolist()))
        for s, v in gathered:
            if s == shard:
                assert v == p.to_local().tolist()
    _finish()


def _save(m, opt, path: str) -> None:
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(m, opt, path: str) -> None:
    msd, osd = get_state_dict(m, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)


def _opt(m, fmt):
    return fastamp.optim.AdamW(m.parameters(), lr=1e-2, state_dtype=fmt)


FORMATS = (torch.float32, torch.bfloat16, "int8")


def checkpoint_round_trip(rank: int, world: int, init_file: str) -> None:
    """torch.distributed.checkpoint: a run saved and resumed on the same ranks continues bit for
    bit, in every state format (8-bit included); the 8-bit state of a shard whose blocks line up
    with the whole tensor's equals the unsharded optimizer's. Writes the 2 -> 4 ranks
    checkpoint and the reference the resharded run is compared with."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    root = os.path.dirname(init_file)
    for fmt in FORMATS:
        name = str(fmt).replace("torch.", "")
        # width 512: the first weight's shards are whole 256-element blocks, so it keeps 8-bit
        # state (>= 4096 elements) and its blocks are the unsharded tensor's.
        a = _model(mesh, width=512)
        oa, sa = _opt(a, fmt), fastamp.GradScaler("cpu", init_scale=2.0**10)
        _train(a, oa, sa, rank, world, 3, clip=1.0, inject=1)
        path = os.path.join(root, f"ckpt-{name}")
        _save(a, oa, path)
        scaler_state = sa.state_dict()
        if fmt == "int8":
            st = oa.state[a[0].weight]
            assert "exp_avg_codes" in st and isinstance(st["exp_avg_codes"], DTensor)
            saved = oa.state_dict()["state"][0]
            assert isinstance(saved["exp_avg"], DTensor) and "exp_avg_codes" not in saved
        after = _train(a, oa, sa, rank, world, 3, start=3, clip=1.0)
        b = _model(mesh, seed=7, width=512)
        ob, sb = _opt(b, fmt), fastamp.GradScaler("cpu")
        _load(b, ob, path)
        sb.load_state_dict(scaler_state)
        assert _train(b, ob, sb, rank, world, 3, start=3, clip=1.0) == after
        _close_shards(b, a, exact=True)
        for p, q in zip(a.parameters(), b.parameters()):
            for key, v in oa.state[p].items():
                w = ob.state[q][key]
                assert type(v) is type(w), key
                v, w = (v.to_local(), w.to_local()) if isinstance(v, DTensor) else (v, w)
                assert torch.equal(v, w), (fmt, key)
        if world == 2:  # the checkpoint the 4-rank test resumes, and what it must reach
            ref = os.path.join(root, f"ref-{name}.pt")
            _save_reference(mesh, fmt, rank, world, ref, path, scaler_state)
    # Refused before anything changes: a full (plain) tensor as a sharded param's state.
    m = _model(mesh)
    opt = fastamp.optim.AdamW(m.parameters())
    _train(m, opt, fastamp.GradScaler("cpu"), rank, world, 1)
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], "exp_avg": sd["state"][0]["exp_avg"].full_tensor()}
    before = {k: v.to_local().clone() for k, v in opt.state[m[0].weight].items() if k != "step"}
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        assert "expected the state sharded as the parameter" in str(e), e
    else:
        raise AssertionError("a plain tensor loaded as a sharded param's state")
    for k, v in before.items():
        assert torch.equal(opt.state[m[0].weight][k].to_local(), v)
    _finish()


def _save_reference(mesh, fmt, rank, world, ref, path, scaler_state) -> None:
    """The 2-rank run from the checkpoint on, 3 more steps: the full params it reaches."""
    b = _model(mesh, seed=3, width=512)
    ob, sb = _opt(b, fmt), fastamp.GradScaler("cpu")
    _load(b, ob, path)
    sb.load_state_dict(scaler_state)
    _train(b, ob, sb, rank, world, 3, start=3, clip=1.0, autocast=False)
    full = {n: p.full_tensor() for n, p in b.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "scaler": scaler_state}, ref)
    dist.barrier()


def resharded_resume(rank: int, world: int, init_file: str) -> None:
    """The 2-rank checkpoints resumed on 4 ranks (resharded by torch.distributed.checkpoint, 8-bit
    state included) reach the uninterrupted 2-rank run's params within float32 rounding."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    root = os.environ["FASTAMP_FSDP_CKPT"]
    for fmt in FORMATS:
        name = str(fmt).replace("torch.", "")
        ref = torch.load(os.path.join(root, f"ref-{name}.pt"))
        m = _model(mesh, seed=5, width=512)
        opt, scaler = _opt(m, fmt), fastamp.GradScaler("cpu")
        _load(m, opt, os.path.join(root, f"ckpt-{name}"))
        scaler.load_state_dict(ref["scaler"])
        _train(m, opt, scaler, rank, world, 3, start=3, clip=1.0, autocast=False)
        # float32 and 8-bit state: float32 rounding (the grads are reduced in another order;
        # the 256-element blocks of every shard are the 2-rank run's blocks). bfloat16 state:
        # its stochastic rounding is keyed by the element's index in this rank's shard, so the
        # resharded run draws other bits: each stored moment is within one bfloat16 ulp
        # (2^-8 relative), 3 steps of lr=1e-2 then differ by up to a few 1e-4.
        # 8-bit state: a moment that differs in its last float32 bit can round to the
        # neighbouring code, one code step (at most 2^-7 of its block's absmax); seen for 1 of
        # 8192 elements on an AVX-512 machine. Such elements are allowed, few and within 5e-4.
        tol = dict(rtol=0.0, atol=5e-4) if fmt is torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
        for n, p in m.named_parameters():
            got, want = p.full_tensor(), ref["params"][n]
            if fmt == "int8":
                off = ~torch.isclose(got, want, **tol)
                assert off.sum() <= max(1, got.numel() // 1000), f"{fmt} {n}: {int(off.sum())} off"
                torch.testing.assert_close(got, want, rtol=0.0, atol=5e-4)
                continue
            torch.testing.assert_close(
                got, want, **tol, msg=lambda msg, n=n: f"{fmt} {n}: {msg}"
            )  # fmt: skip
    # fastamp.load_training_state of the 2-rank save (8-bit state): resharded, fresh random
    # streams (restore_rng=False: the saved ones are per rank).
    m = _model(mesh, seed=5, width=512)
    opt, scaler = _opt(m, "int8"), fastamp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    path = os.path.join(root, "state.pt")
    try:
        fastamp.load_training_state(path, model=m, optimizer=opt, scaler=scaler)
    except RuntimeError as e:
        assert "restore_rng=False" in str(e), e
    else:
        raise AssertionError("per-rank random streams of 2 ranks restored on 4")
    got = fastamp.load_training_state(
        path, model=m, optimizer=opt, scaler=scaler, lr_scheduler=sched, restore_rng=False
    )
    assert got.step == 3 and got.world_size == 2
    for s in range(3, 6):
        _train(m, opt, scaler, rank, world, 1, start=s, clip=1.0)
        sched.step()
    ref = torch.load(path + ".ref")
    # Under fp16 autocast each rank's weight grad is an fp16 sum over its own rows: 4 ranks
    # round other partial sums than 2, and with 8-bit moments a last-bit difference can move a
    # moment across a code boundary (3-bit mantissa). Measured: 1.9e-4 after 3 steps of lr=1e-2.
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[n], rtol=0.0, atol=5e-4)
    _finish()


def _snapshot(m, opt):
    params = [p.to_local().clone() for p in m.parameters()]
    state = {
        (i, k): (v.to_local() if isinstance(v, DTensor) else v).clone()
        for i, p in enumerate(m.parameters())
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor)
    }
    return params, state


def _unchanged(m, opt, snap) -> None:
    params, state = _snapshot(m, opt)
    assert all(torch.equal(a, b) for a, b in zip(params, snap[0])), "params changed"
    assert state.keys() == snap[1].keys() and all(torch.equal(state[k], snap[1][k]) for k in state)


def training_state(rank: int, world: int, init_file: str) -> None:
    """fastamp.save_training_state / load_training_state on a sharded model: the run continues
    bit for bit (8-bit state, scaler, LR scheduler, random streams); one tensor directory per
    save, earlier ones removed; a corrupt, mismatched or incomplete checkpoint raises on every
    rank and changes nothing. Writes the checkpoint the 4-rank test resumes."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    root = os.path.dirname(init_file)
    path = os.path.join(root, "state.pt")

    def make(seed):
        m = _model(mesh, seed=seed, width=512)
        opt = _opt(m, "int8")
        return m, opt, fastamp.GradScaler("cpu"), torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)

    a, oa, sa, la = make(0)
    for s in range(3):
        _train(a, oa, sa, rank, world, 1, start=s, clip=1.0, inject=1)
        la.step()
    fastamp.save_training_state(path, model=a, optimizer=oa, scaler=sa, lr_scheduler=la, step=3)
    dirs = [n for n in os.listdir(root) if n.startswith("state.pt.dcp-")]
    assert len(dirs) == 1, dirs
    noise = torch.rand(3)  # the random streams continue too
    after = []
    for s in range(3, 6):
        after.append(_train(a, oa, sa, rank, world, 1, start=s, clip=1.0))
        la.step()
    b, ob, sb, lb = make(9)
    got = fastamp.load_training_state(path, model=b, optimizer=ob, scaler=sb, lr_scheduler=lb)
    assert got.step == 3 and torch.equal(torch.rand(3), noise)
    for s in range(3, 6):
        assert _train(b, ob, sb, rank, world, 1, start=s, clip=1.0) == after[s - 3]
        lb.step()
    _close_shards(b, a, exact=True)
    if rank == 0:
        torch.save({n: p.full_tensor() for n, p in a.named_parameters()}, path + ".ref")
    else:
        [p.full_tensor() for p in a.parameters()]  # the same collectives on every rank
    # A second save replaces the first one's tensors.
    fastamp.save_training_state(path + "2", model=b, optimizer=ob, scaler=sb, step=6)
    fastamp.save_training_state(path + "2", model=b, optimizer=ob, scaler=sb, step=6)
    dirs = [n for n in os.listdir(root) if n.startswith("state.pt2.dcp-")]
    assert len(dirs) == 1, dirs

    def refused(text, **kw):
        snap = _snapshot(b, ob)
        try:
            fastamp.load_training_state(path + "2", model=b, optimizer=ob, scaler=sb, **kw)
        except Exception as e:  # every rank raises: its own error, or the one naming the rank
            assert any(t in str(e) for t in text), (rank, e)
        else:
            raise AssertionError(f"rank {rank}: loaded {text}")
        _unchanged(b, ob, snap)

    # one rank's file missing: that rank's error, the other ranks' naming it
    if rank == world - 1:
        os.rename(f"{path}2.rank{rank}", f"{path}2.rank{rank}.away")
    dist.barrier()
    refused(("does not exist", f"rank {world - 1} refused the checkpoint"))
    if rank == world - 1:
        os.rename(f"{path}2.rank{rank}.away", f"{path}2.rank{rank}")
    dist.barrier()
    # a model of other shapes
    c, oc = _model(mesh, width=256), None
    oc = _opt(c, "int8")
    try:
        fastamp.load_training_state(path + "2", model=c, optimizer=oc)
    except RuntimeError as e:
        assert "does not match" in str(e) or "refused" in str(e), e
    else:
        raise AssertionError("a model of other shapes loaded")
    # a corrupt tensor file
    (tensor_dir,) = dirs
    files = sorted(f for f in os.listdir(os.path.join(root, tensor_dir)) if f.endswith(".distcp"))
    if rank == 0:
        with open(os.path.join(root, tensor_dir, files[-1]), "r+b") as f:
            f.truncate(16)
    dist.barrier()
    refused(("is damaged: it has 16 bytes",))  # its size differs from what the save recorded
    _damaged_files_refused(mesh, rank, world, root)
    _finish()


def _overwrite(path: str, frac: float, n: int = 64) -> None:
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(int(size * frac))
        f.write(b"\xff" * min(n, size - int(size * frac)))


def _full_state(m, opt, scaler, sched):
    def own(t):  # this rank's bytes of a sharded or plain tensor
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    params = [own(p) for p in m.parameters()]
    state = [{k: own(v) for k, v in opt.state[p].items()} for p in m.parameters()]
    return (params, state, scaler.state_dict(), sched.state_dict(), torch.get_rng_state())


def _damaged_files_refused(mesh, rank: int, world: int, root: str) -> None:
    """Issue 40: 64 bytes of 0xff at 30%, 50% and 70% of each file of a training state (the
    checkpoint, each rank's file, each torch.distributed.checkpoint shard and its .metadata), in
    each state format, sharded and unsharded: every rank raises (its own error naming the file,
    or one naming the rank that refused) and nothing changes; the clean files resume bit for
    bit."""
    from fastamp.testing import assert_bitwise_equal

    for sharded in (True, False):
        for fmt in FORMATS:
            tag = f"dmg-{'fsdp' if sharded else 'plain'}-{str(fmt).replace('torch.', '')}"
            path = os.path.join(root, f"{tag}.pt")

            def make(seed, sharded=sharded, fmt=fmt):
                if sharded:
                    m = _model(mesh, seed=seed, width=512)
                else:  # replicated (as under DDP): rank 0's file and one file per rank
                    torch.manual_seed(seed)
                    m = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 3))
                opt = _opt(m, fmt)
                sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
                return m, opt, fastamp.GradScaler("cpu"), sched

            a, oa, sa, la = make(0)
            for s in range(2):
                # the unsharded model is replicated: every rank steps on the whole batch
                x, y = _batch(s, rank, world) if sharded else _batch(s, 0, 1)
                oa.zero_grad(set_to_none=True)
                sa.scale(nn.functional.mse_loss(a(x), y)).backward()
                sa.step(oa)
                sa.update()
                la.step()
            torch.manual_seed(100 + rank)  # each rank's random stream is its own
            fastamp.save_training_state(path, model=a, optimizer=oa, scaler=sa, lr_scheduler=la)
            want = _full_state(a, oa, sa, la)
            b, ob, sb, lb = make(4)
            torch.manual_seed(200 + rank)
            before = _full_state(b, ob, sb, lb)
            files = [path] + [f"{path}.rank{r}" for r in range(world)]
            if sharded:
                (tensors,) = [d for d in os.listdir(root) if d.startswith(f"{tag}.pt.dcp-")]
                names = sorted(os.listdir(os.path.join(root, tensors)))
                assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == world
                files += [os.path.join(root, tensors, n) for n in names]
            for target in files:
                for frac in (0.3, 0.5, 0.7):
                    if rank == 0:
                        with open(target, "rb") as f:
                            clean = f.read()
                        _overwrite(target, frac)
                    dist.barrier()
                    try:
                        fastamp.load_training_state(
                            path, model=b, optimizer=ob, scaler=sb, lr_scheduler=lb
                        )
                    except Exception as e:  # every rank raises
                        msg = str(e)
                        assert os.path.basename(target) in msg, (rank, target, frac, msg)
                        assert "is damaged" in msg or "could not be read" in msg, (rank, msg)
                    else:
                        raise AssertionError(f"rank {rank}: {target} at {frac} loaded")
                    assert_bitwise_equal(_full_state(b, ob, sb, lb), before)
                    dist.barrier()
                    if rank == 0:
                        with open(target, "wb") as f:
                            f.write(clean)
                    dist.barrier()
            fastamp.load_training_state(path, model=b, optimizer=ob, scaler=sb, lr_scheduler=lb)
            assert_bitwise_equal(_full_state(b, ob, sb, lb), want)


class _Blocks(nn.Module):
    """Sharded blocks with dropout (its mask must be replayed exactly by a recompute)."""

    def __init__(self, mode: str = "none", width: int = 32, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.2)) for _ in range(n)
        )
        self.out = nn.Linear(width, 3)
        self.mode = mode

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            if self.mode == "full":
                x = fastamp.checkpoint.checkpoint(b, x, use_reentrant=False)
            elif self.mode == "selective":
                ctx = fastamp.checkpoint.selective()
                x = fastamp.checkpoint.checkpoint(b, x, use_reentrant=False, context_fn=ctx)
            else:
                x = b(x)
        return self.out(x)


def _sharded_blocks(mesh, mode):
    m = _Blocks(mode)
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def features(rank: int, world: int, init_file: str) -> None:
    """fastamp.checkpoint in sharded blocks (full, selective, the planner: grads bit for bit
    those of no checkpointing, dropout replayed), master weights of bfloat16 params, gradient
    accumulation without sync, and the state-bytes report, on FSDP2."""
    _init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    x, y = _batch(0, rank, world)
    grads = {}
    for mode in ("none", "full", "selective", "planner"):
        m = _sharded_blocks(mesh, "none" if mode == "planner" else mode)
        if mode == "planner":  # a budget that needs some blocks checkpointed
            _, total = fastamp.checkpoint.measure_blocks(m, x)
            plan = fastamp.checkpoint.apply(
                m, budget_bytes=total // 2, sample_input=x, verbose=False
            )
            assert plan.chosen or plan.selective, plan
            _same_on_every_rank((plan.chosen, plan.selective), "the checkpoint plan")
        torch.manual_seed(100 + rank)
        nn.functional.mse_loss(m(x), y).backward()
        grads[mode] = [p.grad.to_local().clone() for p in m.parameters()]
    for mode in ("full", "selective", "planner"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])), mode

    # bfloat16 params with fp32 master weights: the master is sharded as its param.
    m = _model(mesh)
    m.to(torch.bfloat16)
    opt = fastamp.optim.AdamW(m.parameters(), lr=1e-2, master_weights=True)
    scaler = fastamp.GradScaler("cpu", enabled=False)
    first = None
    for s in range(8):
        xb, yb = _batch(s % 2, rank, world)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(xb.bfloat16()).float(), yb)
        first = float(loss) if first is None else first
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert float(loss) < first
    for p in m.parameters():
        master = opt.state[p]["master_param"]
        assert isinstance(master, DTensor) and master.dtype == torch.float32
        assert master.placements == p.placements
        assert torch.equal(master.to_local().bfloat16(), p.to_local())
    report = fastamp.memory.optimizer_state_bytes(opt)
    assert report["master_bytes"] > 0 and report["state_bytes_per_param"] > 0, report

    # SGD with bfloat16 momentum on sharded params: buffers sharded as their params, it learns.
    m = _model(mesh, width=512)  # the first weight has 8192 elements: bfloat16 buffers
    opt = fastamp.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, state_dtype=torch.bfloat16)
    losses = []
    for s in range(8):
        xb, yb = _batch(s % 2, rank, world)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(xb), yb)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    for p in m.parameters():  # tensors under 4096 elements keep float32 buffers (lowbit.py)
        buf = opt.state[p]["momentum_buffer"]
        want = torch.bfloat16 if p.numel() >= 4096 else torch.float32
        assert isinstance(buf, DTensor) and buf.dtype == want, (buf.dtype, p.shape)
        assert buf.placements == p.placements
    assert opt.state[m[0].weight]["momentum_buffer"].dtype == torch.bfloat16

    # Accumulation: two micro-batches, the first without the reduce-scatter; as torch's recipe.
    def accumulate(model, opt, scaler):
        for s in range(3):
            opt.zero_grad(set_to_none=True)
            for k in range(2):
                model.set_requires_gradient_sync(k == 1)
                xb, yb = _batch(2 * s + k, rank, world)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(xb).float(), yb) / 2
                scaler.scale(loss).backward()
            if isinstance(scaler, fastamp.GradScaler):
                scaler.clip_grad_norm_(opt, 1.0)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale()

    ref, ours = _model(mesh), _model(mesh)
    a = accumulate(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.amp.GradScaler("cpu"))
    b = accumulate(ours, fastamp.optim.AdamW(ours.parameters(), lr=1e-2), fastamp.GradScaler("cpu"))
    assert a == b
    _close_shards(ours, ref)
    _finish()
