"""Two "nodes" on one machine: two torchrun processes (--nnodes=2 --nproc_per_node=2) meeting at
a c10d rendezvous on 127.0.0.1, running examples/ddp_train.py; all four ranks must end with the
same parameters and the model must have learned (the example's exit status says both)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_on_one_machine(tmp_path):
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=fastamp-{port}",
            "--max-restarts=0",
            str(ROOT / "examples" / "ddp_train.py"),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=540)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{out[-3000:]}"
    # global rank 0 (which prints) may land on either torchrun process
    summary = [line for out in outs for line in out.splitlines() if "ranks (" in line]
    assert len(summary) == 1, [o[-2000:] for o in outs]
    assert summary[-1].startswith("4 ranks"), summary
    assert "parameters identical on every rank: True" in summary[-1], summary
    assert "learned the rule" in summary[-1], summary
