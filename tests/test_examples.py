"""The examples a user copies from run, in a reduced size (seconds)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_demo_prints_matching_runs():
    out = _run([sys.executable, "examples/demo.py", "--steps", "12", "--every", "4"])
    assert "scale trajectories identical: True" in out


@pytest.mark.parametrize("flags", [["--accum-steps", "2", "--checkpoint"], ["--amp", "bf16", "--bucket-view"]])
def test_ddp_example_with_torchrun_two_processes(flags):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "examples/ddp_train.py", "--steps", "3", *flags])
    assert "parameters identical on every rank: True" in out


def test_train_example_compare_torch_writes_a_plot(tmp_path):
    png = tmp_path / "curves.png"
    out = _run([sys.executable, "examples/train.py", "--compare-torch", "--epochs", "1",
                "--batches-per-epoch", "4", "--accum-steps", "2", "--checkpoint", "--dim", "64",
                "--layers", "2", "--seq", "32", "--plot", str(png)])
    assert "step time torch/fastamp" in out and "final loss" in out
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
