"""Coverage of the CUDA sources by the emulated tests: every host launcher registered in a .cu
file has a differential test, and every __global__ kernel in csrc/ is launched under the
emulator (here, by tiny calls of every op, so the check does not depend on test order)."""

from __future__ import annotations

import re
from pathlib import Path

import emu
import torch

from fastamp.testing import op_args

ROOT = Path(__file__).resolve().parents[2]
CUDA_FILES = sorted((ROOT / "csrc").rglob("*.cu")) + sorted((ROOT / "csrc").rglob("*.cuh"))


def _source(p: Path) -> str:
    # without comments, so a kernel named in a comment does not count
    text = re.sub(r"//[^\n]*", "", p.read_text())
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def registered_launchers() -> set[str]:
    names = set()
    for p in CUDA_FILES:
        for block in re.findall(r"FASTAMP_CUDA_KERNELS\(m\)\s*\{(.*?)\n\}", _source(p), flags=re.S):
            names |= set(re.findall(r'm\.impl\("([A-Za-z0-9_]+)"', block))
    return names


def global_kernels() -> set[str]:
    names = set()
    for p in CUDA_FILES:
        for m in re.finditer(
            r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?([A-Za-z0-9_]+)\s*\(",
            _source(p),
        ):
            names.add(m.group(1))
    return names


def test_every_cuda_launcher_has_a_differential_test():
    launchers = registered_launchers()
    assert len(launchers) >= 9, launchers  # the scan itself must find the known ones
    tests = "".join(p.read_text() for p in sorted(Path(__file__).parent.glob("test_emulated_*.py")))
    untested = sorted(n for n in launchers if f'"{n}"' not in tests)
    assert not untested, f"CUDA launchers with no emulated differential test: {untested}"
    # and each is registered in the emulator library
    emu.load()
    for n in launchers:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastamp_emu::{n}", "CPU"), n


def test_every_global_kernel_runs_under_the_emulator():
    kernels = global_kernels()
    assert {
        "multi_tensor_apply_kernel",
        "combine_partials_kernel",
        "update_scale_kernel",
        "clip_coef_kernel",
        "record_overflow_kernel",
    } <= kernels
    f = torch.randn(5)
    emu.op("grad_stats")([f.clone()], torch.tensor(1.0), 2.0)
    emu.op("non_finite_check_and_unscale_")(
        [f.clone()], torch.zeros(()), torch.tensor(1.0), torch.zeros(1, dtype=torch.bool)
    )
    emu.op("clip_unscale_")([f.clone()], torch.tensor(1.0), torch.tensor(2.0), 1.0)
    emu.op("clip_coef")(torch.tensor(4.0), 2.0, 1.0)
    emu.op("record_overflow_")(
        torch.zeros(2, dtype=torch.bool),
        torch.tensor(-1),
        torch.ones(2, dtype=torch.bool),
        torch.ones(()),
        torch.tensor(0),
    )
    emu.op("update_scale_")(
        torch.tensor(2.0),
        torch.tensor(0, dtype=torch.int32),
        torch.tensor(1, dtype=torch.int32),
        torch.zeros(()),
        2.0,
        0.5,
        10,
        1,
        0.0,
        float("inf"),
    )
    emu.op("adam_step_")(*op_args("adam_step_", params=[f.clone()], grads=[f.clone()],
                                  exp_avgs=[f.clone()], exp_avg_sqs=[f.abs()],
                                  state_steps=[torch.tensor(0.0)], lr=1e-3))  # fmt: skip
    emu.op("sgd_step_")(*op_args("sgd_step_", params=[f.clone()], grads=[f.clone()],
                                 momentum_buffers=[f.clone()],
                                 state_steps=[torch.tensor(0.0)]))  # fmt: skip
    emu.op("tensor_digest")([f.clone()])
    bucket = torch.zeros(5)
    emu.op("bucket_pack_")(bucket, [f.clone()], [0], 1.0)
    emu.op("bucket_unpack_")(bucket, [f.clone()], [0], torch.tensor(1.0))
    launched = set(emu.launched_kernels())
    missing = sorted(kernels - launched)
    assert not missing, f"__global__ kernels never launched under the emulator: {missing}"


def test_every_planted_fault_still_applies():
    # make emu-faults builds each mutant; a snippet that no longer occurs exactly once (the source
    # moved on, or a second kernel now holds the same line) would fail there after a long build.
    # This catches it in the ordinary test run, and checks each mutant's test file exists and its
    # -k expression names something in it.
    import mutants

    assert len(mutants.MUTANTS) >= 8
    for name, m in mutants.MUTANTS.items():
        changed = mutants.apply(name)  # raises unless the snippet occurs exactly once
        assert changed[m.file] != (ROOT / "csrc" / m.file).read_text(), name
        test_file = Path(__file__).parent / m.test_file
        assert test_file.exists(), (name, m.test_file)
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", m.tests)) - {"and", "or", "not"}
        text = test_file.read_text()
        missing = sorted(w for w in words if w not in text and not w.startswith("fp"))
        assert not missing, f"mutant {name}: -k words {missing} not in {m.test_file}"
