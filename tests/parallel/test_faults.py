"""Distributed faults (gloo on CPU, 2 ranks): a killed or stalled rank makes its peer raise a clear
error within the process group's timeout, and a run resumed from fastamp.save_training_state
continues bit for bit like the run that was never interrupted."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from fastamp.testing import assert_bitwise_equal
from tests.parallel import _fault_workers as W

STEPS, SAVE_AT, FAULT_AT = 12, 6, 8


def _launch(fn, args, tmp_path, tag, world=2, join_timeout=120.0, patience=None):
    """Starts one process per rank; returns their exit codes (None if one had to be killed).
    `patience[r]` overrides how long rank r is waited for (after the ranks before it)."""
    ctx = mp.get_context("spawn")
    init = str(tmp_path / f"init-{tag}")
    procs = [ctx.Process(target=fn, args=(r, world, init, *args)) for r in range(world)]
    for p in procs:
        p.start()
    codes = []
    for r, p in enumerate(procs):
        p.join(patience[r] if patience else join_timeout)
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


def _load(path):
    return torch.load(path, weights_only=False)


def test_bitwise_helper_catches_one_flipped_bit():
    a = torch.randn(5)
    b = a.clone()
    b.view(torch.int32)[3] ^= 1
    with pytest.raises(AssertionError):
        assert_bitwise_equal({"x": [a]}, {"x": [b]})


# Killed and stalled ranks wait out timeouts (40 s together): the full tier (`make test-all`).
@pytest.mark.full
def test_killed_rank_then_resume_is_bit_identical(tmp_path):
    timeout = 20.0
    full = tmp_path / "full"
    interrupted = tmp_path / "interrupted"
    full.mkdir()
    interrupted.mkdir()
    assert _launch(
        W.run, (str(full), "full", STEPS, SAVE_AT, FAULT_AT, timeout), tmp_path, "full"
    ) == [0, 0]
    codes = _launch(
        W.run, (str(interrupted), "killed", STEPS, SAVE_AT, FAULT_AT, timeout), tmp_path, "killed"
    )
    assert codes[1] == -9, f"rank 1 should have been SIGKILLed mid-backward, exit codes {codes}"
    assert codes[0] == 0, f"rank 0 must raise and exit cleanly, not hang or crash: {codes}"
    seen = _load(interrupted / "killed.rank0.pt")
    assert seen["error"] is not None, "rank 0 did not notice its peer died"
    assert "peer rank has probably died" in seen["error"], seen["error"]
    assert seen["elapsed"] < timeout, f"rank 0 took {seen['elapsed']:.1f}s (timeout {timeout}s)"
    # the checkpoint: rank 0's shared file and one file per rank
    assert sorted(os.listdir(interrupted)) == [
        "ckpt.pt",
        "ckpt.pt.rank0",
        "ckpt.pt.rank1",
        "killed.rank0.pt",
    ]

    assert _launch(
        W.run, (str(interrupted), "resume", STEPS, SAVE_AT, FAULT_AT, timeout), tmp_path, "resume"
    ) == [0, 0]
    for rank in range(2):
        ref = _load(full / f"full.rank{rank}.pt")
        got = _load(interrupted / f"resume.rank{rank}.pt")
        assert got["start"] == SAVE_AT
        # every step after the restart: same loss, norm, scale and skip decision, to the bit
        assert_bitwise_equal(got["log"], ref["log"][SAVE_AT:], f"rank{rank}.log")
        assert_bitwise_equal(got["state"], ref["state"], f"rank{rank}.state")
        assert got["buckets"] == ref["buckets"]
        # the resumed run starts with the saved (rebuilt) layout, not a fresh one it would rebuild
        assert got["initial_buckets"] == ref["buckets"], "bucket layout not restored"
        # the run really exercised what it claims: skips, a scale change, several buckets
        assert any(r["skipped"] for r in ref["log"][SAVE_AT:]), "no overflow after the restart"
        assert len({r["scale"] for r in ref["log"]}) > 1
        assert len(ref["buckets"]["bucket_sizes"]) > 1
        assert ref["initial_buckets"]["order"] != ref["buckets"]["order"], (
            "the rebuild changed nothing"
        )


@pytest.mark.full
def test_stalled_rank_raises_within_timeout(tmp_path):
    timeout = 5.0
    out = tmp_path / "out"
    out.mkdir()
    codes = _launch(
        W.run,
        (str(out), "stalled", STEPS, SAVE_AT, 2, timeout),
        tmp_path,
        "stalled",
        patience=[60.0, 1.0],
    )
    assert codes[0] == 0 and codes[1] is None, codes  # rank 1 never returned: the parent killed it
    seen = _load(out / "stalled.rank0.pt")
    assert (
        seen["error"] is not None and "peer rank has probably died or stalled" in seen["error"]
    ), seen
    # gloo's timeout, not a hang: at least most of the timeout passed, and not much more
    assert timeout * 0.8 <= seen["elapsed"] < timeout + 10.0, seen["elapsed"]
