"""What the tests' gloo worker processes share: joining the process group through a file, and
leaving it together."""

from __future__ import annotations

import datetime
import gc

import torch.distributed as dist
import torch.multiprocessing as mp


def init_gloo(rank: int, world: int, init_file: str, timeout_s: float = 60.0) -> None:
    """Joins the gloo group of ``world`` ranks that meet at the file ``init_file``, with collectives
    timing out after ``timeout_s`` seconds."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def finish() -> None:
    """Every rank leaves together: a rank that tears its process group down while a peer is still
    finishing the last collective can make gloo abort that peer (SIGABRT at exit)."""
    gc.collect()  # drop DDP objects (and any Work they hold) before the group goes
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world: int, tmp_path) -> None:
    """Runs ``fn(rank, world, init_file)`` in ``world`` spawned processes that meet at a file in
    ``tmp_path``; a failing rank makes this raise with its traceback."""
    mp.spawn(fn, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
