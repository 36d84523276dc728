"""The examples a user copies from run, in a reduced size (seconds)."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


# The examples' end-to-end runs (20-25 s each on 2 cores, subprocesses and torchrun) are in the
# full tier (`make test-full`, CI): the quick tier a newcomer runs stays within minutes, and its
# docs-snippet tests still run README's quick start as written.
@pytest.mark.full
def test_demo_prints_matching_runs_progress_and_writes_a_plot(tmp_path):
    png = tmp_path / "demo.png"
    out = _run(
        [sys.executable, "examples/demo.py", "--steps", "12", "--every", "4", "--plot", str(png)]
    )
    assert "scale trajectories identical: True" in out
    assert "training with torch.GradScaler" in out and "step   12/12" in out  # progress as it runs
    assert "autocast torch.float16" in out  # fp16 on CPU too: the scalers are really at work
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # No fastamp-vs-torch timing: run after run on a tiny model it measured the machine's load and
    # contradicted the benchmarks (the README's tables are measured interleaved, threads fixed).
    assert not re.search(r"\d\s*(ms|us|s)\b.*fastamp|fastamp.*\d\s*(ms|us)\b", out), out[-1500:]
    assert "README.md#benchmarks" in out


def test_demo_data_is_learnable():
    # The demo's task must have structure a model can learn (chance is ln(VOCAB)): the next token is
    # determined by the previous two, so a lookup on (t[i-1], t[i]) predicts t[i+1] exactly.
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import demo
    finally:
        sys.path.pop(0)
    tokens, target = demo.batch_of_sequences(torch.Generator().manual_seed(0), 64)
    assert torch.equal(tokens[:, 1:], target[:, :-1])
    stride = (tokens[:, 1:] - tokens[:, :-1]) % demo.VOCAB
    assert torch.equal(stride, stride[:, :1].expand_as(stride))  # one stride per sequence
    assert set(stride[:, 0].tolist()) <= set(demo.STRIDES)


def test_pip_build_isolation_is_named_as_the_cause(tmp_path):
    # torch_info.py run as pip's isolated build env runs it (no torch importable there).
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.path.insert(0, {str(tmp_path / 'pip-build-env-x' / 'overlay')!r}); "
        f"sys.argv = ['torch_info.py', {str(tmp_path / 'out.cmake')!r}]; "
        "runpy.run_path('cmake/torch_info.py', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr.startswith("fastamp: build isolation is on"), out.stderr
    assert "--no-build-isolation" in out.stderr.splitlines()[2], out.stderr
    # without the isolation markers: torch is simply missing
    code = code.replace("pip-build-env-x", "plain")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and out.stderr.startswith("fastamp: cannot import torch"), out.stderr


@pytest.mark.full
@pytest.mark.parametrize(
    "flags", [["--accum-steps", "2", "--checkpoint"], ["--amp", "bf16", "--bucket-view"]]
)
def test_ddp_example_with_torchrun_two_processes(flags):
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "examples/ddp_train.py",
            "--steps",
            "3",
            *flags,
        ]
    )
    assert "parameters identical on every rank: True" in out


def documented_torchrun(script: str) -> list[tuple[int, tuple[str, ...]]]:
    """The `torchrun --standalone` commands of README.md and docs/*.md that run examples/`script`,
    as (processes, flags)."""
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    pattern = rf"^torchrun --standalone --nproc_per_node=(\d+) examples/{re.escape(script)}(.*)$"
    found = set()
    for path in docs:
        for m in re.finditer(pattern, open(path, encoding="utf-8").read(), re.M):
            found.add((int(m.group(1)), tuple(m.group(2).split("#")[0].split())))
    return sorted(found)


def test_docs_show_the_fsdp_example_commands():
    assert (2, ("--state-dtype", "int8", "--checkpoint")) in documented_torchrun("fsdp_train.py")


# Each FSDP2 command the docs show, as written (with --steps 3): the default --amp is fp16.
@pytest.mark.full
@pytest.mark.parametrize(
    "procs,flags",
    [
        pytest.param(n, f, id=" ".join((str(n), *f)))
        for n, f in documented_torchrun("fsdp_train.py")
    ],
)
def test_fsdp_example_with_torchrun(procs, flags):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={procs}", "examples/fsdp_train.py", "--steps", "3", *flags]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "scale and grad norm identical on every rank: True" in out.stdout
    # The loss scaler is on by default: every printed scale is a real one (fp16's 65536 start).
    scales = [
        float(ln.split("scale ")[-1]) for ln in out.stdout.splitlines() if ln.startswith("step")
    ]
    assert scales and all(s > 1 for s in scales), out.stdout
    # torch's view warning about the root's output is silenced by the example, with its reason.
    assert "returned a view tensor" not in out.stderr, out.stderr[-3000:]


@pytest.mark.full
def test_train_example_compare_torch_writes_a_plot(tmp_path):
    png = tmp_path / "curves.png"
    out = _run(
        [
            sys.executable,
            "examples/train.py",
            "--compare-torch",
            "--epochs",
            "1",
            "--batches-per-epoch",
            "4",
            "--accum-steps",
            "2",
            "--checkpoint",
            "--dim",
            "64",
            "--layers",
            "2",
            "--seq",
            "32",
            "--plot",
            str(png),
        ]
    )
    assert "step time torch/fastamp" in out and "final loss" in out
    assert "amp fp16" in out  # the default, on CPU too: fastamp.GradScaler is exercised
    scales = next(ln for ln in out.splitlines() if ln.startswith("final scale")).split()[2:]
    assert scales == ["65536", "65536"], out  # both scalers enabled and agreeing
    assert "skipped steps" in out and f"wrote {png}" in out
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
