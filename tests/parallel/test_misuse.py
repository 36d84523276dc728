"""The misuse catalogue of distributed (harness: tests/_misuse.py): each misuse raises a clear error
naming the argument and changes nothing."""

from __future__ import annotations

import pytest

from tests._dist import init_gloo
from tests._misuse import *  # noqa: F403 (the catalogue's harness and world builders)
from tests._misuse import Case, check_misuse, make_case

CASES: list[Case] = []
case = make_case(CASES)


@case(
    "ddp_without_process_group",
    RuntimeError,
    r"torch\.distributed is not initialised",
    r"call torch\.distributed\.init_process_group\(\) first",
)
def _(lib):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: FDDP(model)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    check_misuse(c)


# ================================================================== DDP across 2 gloo ranks


def _ddp_model_differs(rank):
    model = nn.Sequential(nn.Linear(4, 8 if rank == 0 else 9), nn.Linear(8 if rank == 0 else 9, 2))
    model(torch.randn(3, 4)).sum().backward()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return _world(model, opt), lambda: FDDP(model)


def _ddp_bucket_cap_zero(rank):
    model = _net(seed=rank)
    return _world(model), lambda: FDDP(model, bucket_cap_mb=0)


def _ddp_two_device_ids(rank):
    model = _net(seed=rank)
    return _world(model), lambda: FDDP(model, device_ids=[0, 1])


# (id, build(rank), exception, argument regex, fix regex)
DDP_CASES = [
    (
        "ddp_model_differs_across_ranks",
        _ddp_model_differs,
        RuntimeError,
        r"differs across ranks \(rank 0 has '0\.weight:\(8, 4\):torch\.float32', rank 1 has '0\.weight:\(9, 4\)",
        r"Every rank must construct the same model",
    ),
    (
        "ddp_bucket_cap_mb_zero",
        _ddp_bucket_cap_zero,
        ValueError,
        r"bucket_cap_mb",
        r"positive, finite number .*e\.g\. 25",
    ),
    (
        "ddp_two_device_ids",
        _ddp_two_device_ids,
        ValueError,
        r"device_ids=\[0, 1\]",
        r"one device per process",
    ),
]


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    results = {}
    for cid, build, exc, _, _ in DDP_CASES:
        objects, misuse = build(rank)
        before = _snapshot(objects)
        try:
            misuse()
        except Exception as e:  # noqa: BLE001 -- recorded, judged by the test
            raised = [type(e).__name__, str(e), isinstance(e, exc)]
        else:
            raised = None
        results[cid] = {"raised": raised, "changed": _diff(before, _snapshot(objects))}
        dist.barrier()  # the next case starts together on every rank
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_misuse")
    world = 2
    mp.spawn(_ddp_worker, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("ddp_case", DDP_CASES, ids=[c[0] for c in DDP_CASES])
def test_ddp_misuse_on_every_rank(ddp_case, ddp_results):
    cid, _, exc, arg, fix = ddp_case
    for rank, results in enumerate(ddp_results):
        r = results[cid]
        assert r["raised"] is not None, f"{cid}: rank {rank} raised nothing"
        name, msg, is_exc = r["raised"]
        assert is_exc, f"{cid}: rank {rank} raised {name}, expected {exc.__name__}: {msg}"
        assert re.search(arg, msg), f"{cid}: rank {rank}: the message does not name {arg!r}: {msg}"
        assert re.search(fix, msg), f"{cid}: rank {rank}: the message does not say {fix!r}: {msg}"
        assert not r["changed"], (
            f"{cid}: rank {rank} changed state before raising: {r['changed'][:12]}"
        )
