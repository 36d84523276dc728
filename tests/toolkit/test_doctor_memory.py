"""python -m fastamp doctor, and fastamp.memory."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import torch

import fastamp


def test_doctor_passes_on_this_machine():
    out = subprocess.run(
        [sys.executable, "-m", "fastamp", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout and "self-test on cpu" in out.stdout
    assert f"torch                        {torch.__version__}" in out.stdout
    # The NCCL line and the backends line tell the same story (built vs usable here).
    import torch.distributed as dist

    nccl = re.search(r"^  NCCL +(.*)$", out.stdout, re.M)
    backends = re.search(
        r"^  distributed backends +built (.*); usable here (.*)$", out.stdout, re.M
    )
    assert nccl and backends, out.stdout
    nccl_built = dist.is_nccl_available()
    assert ("not in this torch build" in nccl.group(1)) == (not nccl_built), nccl.group(0)
    assert ("nccl" in backends.group(1)) == nccl_built, backends.group(0)
    usable = nccl_built and torch.cuda.is_available()
    assert ("nccl" in backends.group(2).split(" (")[0]) == usable, backends.group(0)


def test_doctor_says_which_backends_are_built_and_which_usable():
    from fastamp.doctor import backend_lines

    # A CUDA torch on a machine without a GPU: NCCL is built in but not usable, in both lines.
    nccl, backends = backend_lines(True, True, "2.27.5", cuda_available=False)
    assert nccl == "2.27.5, not usable here (no CUDA device)"
    assert backends == "built gloo, nccl; usable here gloo (nccl needs a CUDA device)"
    nccl, backends = backend_lines(True, True, "2.27.5", cuda_available=True)
    assert (nccl, backends) == ("2.27.5", "built gloo, nccl; usable here gloo, nccl")
    nccl, backends = backend_lines(True, False, None, cuda_available=False)  # a CPU torch
    assert (nccl, backends) == ("not in this torch build", "built gloo; usable here gloo")
    assert backend_lines(False, False, None, False)[1] == "none built into this torch"


def test_console_script_is_installed():
    exe = shutil.which("fastamp", path=os.path.dirname(sys.executable))
    assert exe, "the `fastamp` console script should be installed next to python"
    out = subprocess.run([exe, "doctor", "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_doctor_explains_a_library_that_needs_a_newer_torch():
    code = textwrap.dedent(
        """
        import runpy, sys, types
        fake = types.ModuleType("fastamp._build_info")
        fake.TORCH_VERSION = "1.99.0+fake"
        fake.TORCH_TARGET = "9.99"
        sys.modules["fastamp._build_info"] = fake
        sys.argv = ["-m", "doctor"]
        runpy.run_module("fastamp", run_name="__main__", alter_sys=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "PROBLEM: fastamp's compiled library did not load" in out.stdout
    assert "torch 9.99 or newer" in out.stdout and "pip install --no-build-isolation" in out.stdout
    assert "Traceback" not in out.stderr


def test_memory_summary_and_track_on_cpu(capsys):
    rows = fastamp.memory.summary()
    assert rows[0].device == "cpu" and rows[0].allocated > 0 and rows[0].peak >= rows[0].allocated
    assert "cpu: resident" in capsys.readouterr().out
    with fastamp.memory.track() as m:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        x.add_(1)
        del x
    assert m.peak_delta >= 48 * 2**20, str(m)  # sampled: most of the 64 MiB is seen
    assert "peak" in str(m)
