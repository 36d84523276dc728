"""Each rank's training-state file is tied to its rank, its world size and its run: on 2 gloo
ranks, files swapped between the ranks, or a rank file of another run, are refused on every rank
before anything (RNG included) is restored; format 2 files (no run id) still load, with their
rank and world size checked. One-process cases with hand-written files check the world size."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastamp
import fastamp.resume.training_state as resume
from fastamp.resume._checksums import seal
from fastamp.testing import assert_bitwise_equal
from tests._dist import init_gloo


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    opt = fastamp.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(3, 6)).sum().backward()
    opt.step()
    return net, opt


def _state(net: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return (net.state_dict(), opt.state_dict(), torch.get_rng_state())


def _refused(path: str, net: nn.Module, opt: torch.optim.Optimizer, *patterns: str) -> None:
    """A load of ``path`` raises (on this rank: one of ``patterns``) and changes nothing."""
    before = _state(net, opt)
    try:
        fastamp.load_training_state(path, model=net, optimizer=opt)
    except RuntimeError as e:
        assert any(p in str(e) for p in patterns), str(e)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: {path} loaded")
    assert_bitwise_equal(_state(net, opt), before)


def _as_format_2(path: str) -> None:
    """Rewrites a saved file as format 2 wrote it (no run id; the checkpoint without its rank)."""
    obj = torch.load(path, weights_only=True)
    obj.pop("checksums")
    obj.pop("run_id")
    if "rng" not in obj or "model" in obj:  # the checkpoint
        obj.pop("rank")
    obj["format"] = 2
    torch.save(seal(obj), path)


def _worker(rank: int, world: int, folder: str) -> None:
    init_gloo(rank, world, f"{folder}/init")
    try:
        net, opt = _net(0)
        torch.manual_seed(10 + rank)  # each rank its own random stream
        path = f"{folder}/c.pt"
        fastamp.save_training_state(path, model=net, optimizer=opt, step=1)
        other, _ = _net(5)  # what a load must leave as it is
        torch.manual_seed(99)

        def swap(src: str) -> None:
            dist.barrier()
            if rank == 0:
                for r in range(world):
                    shutil.copy(f"{src}.rank{(r + 1) % world}", f"{folder}/x.pt.rank{r}")
                shutil.copy(src, f"{folder}/x.pt")
            dist.barrier()

        # the ranks' files swapped: every rank raises (its own error names both ranks), nothing
        # changes anywhere
        swap(path)
        mine = f"written by rank {(rank + 1) % world}, expected rank {rank}"
        _refused(f"{folder}/x.pt", other, opt, mine)

        # what each file records
        saved = torch.load(f"{path}.rank{rank}", weights_only=True)
        assert (saved["rank"], saved["world_size"]) == (rank, world)
        assert saved["run_id"] == resume.run_id() is not None
        shared = torch.load(path, weights_only=True)
        assert (shared["rank"], shared["world_size"], shared["run_id"]) == (
            0,
            world,
            saved["run_id"],
        )

        # a rank file of another run (same rank, same world): refused, naming both runs
        dist.barrier()
        run = resume.run_id()
        resume._RUN["id"] = None  # as a fresh run's first save
        fastamp.save_training_state(f"{folder}/d.pt", model=net, optimizer=opt, step=1)
        assert resume.run_id() != run
        if rank == 0:
            shutil.copy(path, f"{folder}/y.pt")
            shutil.copy(f"{path}.rank0", f"{folder}/y.pt.rank0")
            shutil.copy(f"{folder}/d.pt.rank1", f"{folder}/y.pt.rank1")
        dist.barrier()
        bad = f"belongs to run {resume.run_id()!r}, expected run {run!r}"
        _refused(f"{folder}/y.pt", other, opt, bad, "rank 1 refused the checkpoint")

        # the files of one save load, and the loaded run's id is the one later saves record
        fastamp.load_training_state(path, model=other, optimizer=opt)
        assert resume.run_id() == run
        assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])

        # format 2 files (no run id): the swap is still refused, the files of one save load
        dist.barrier()
        if rank == 0:
            for f in (path, *(f"{path}.rank{r}" for r in range(world))):
                _as_format_2(f)
        swap(path)
        torch.manual_seed(99)
        other2, _ = _net(6)
        _refused(f"{folder}/x.pt", other2, opt, mine)
        fastamp.load_training_state(path, model=other2, optimizer=opt)
        assert_bitwise_equal(other2.state_dict(), net.state_dict())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_swapped_or_foreign_rank_files_are_refused_on_every_rank(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)


def _files(tmp_path, rank_file: dict) -> str:
    net, _ = _net(0)
    base = str(tmp_path / "c.pt")
    shared = {
        "format": 3, "save_id": "aaaa", "rank": 0, "world_size": 2, "run_id": "r1", "step": 1,
        "extra": {}, "model": net.state_dict(), "sharded": None, "ddp_buckets": None,
        "optimizer": None, "scaler": None, "lr_scheduler": None, "torch_version": "x",
    }  # fmt: skip
    torch.save(seal(shared), base)
    own = {"format": 3, "save_id": "aaaa", "rank": 1, "world_size": 2, "run_id": "r1", "rng": {}}
    torch.save(seal({**own, **rank_file}), f"{base}.rank1")
    return base


@pytest.mark.parametrize(
    ("rank_file", "message"),
    [
        ({"rank": 0}, "written by rank 0, expected rank 1"),
        ({"world_size": 4}, "world size 4, expected 2"),
        ({"run_id": "r2"}, "belongs to run 'r2', expected run 'r1'"),
        ({"save_id": "bbbb"}, "belongs to another save"),
    ],
)
def test_rank_file_checked_for_rank_world_and_run(tmp_path, monkeypatch, rank_file, message):
    base = _files(tmp_path, rank_file)
    monkeypatch.setattr(resume, "_dist_info", lambda: (1, 2, False))  # as rank 1 of 2
    net, _ = _net(3)
    before = (net.state_dict(), torch.get_rng_state())
    with pytest.raises(RuntimeError, match=message):
        fastamp.load_training_state(base, model=net)
    assert_bitwise_equal((net.state_dict(), torch.get_rng_state()), before)
    assert os.path.exists(base)
