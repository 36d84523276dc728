"""The GPU resource check (.ci/gpu_resources.py, `make gpu-resources`): how it reads ptxas, where
it takes each kernel's block size from, the occupancy arithmetic, and that a spill, a low
occupancy or a kernel without a launch site fails it (planted in ptxas logs; CI runs the real
compile in its CUDA step)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_resources", ROOT / ".ci" / "gpu_resources.py")
gr = importlib.util.module_from_spec(_spec)
sys.modules["gpu_resources"] = gr
_spec.loader.exec_module(gr)

# Mangled names of real fastamp kernels (as ptxas prints them).
MTA_ADAM = (
    "_ZN7fastamp6detail25multi_tensor_apply_kernelILi4ENS_5optim51_GLOBAL__N__a72cd6fe_13_optim"
    "_cuda_cu_50024fe0_64026AdamOpILb0ELb0EEEEEvNS_7MtaMetaIXT_EEET0_"
)
UPDATE_SCALE = (
    "_ZN7fastamp6scaler52_GLOBAL__N__86ab029a_14_scaler_cuda_cu_50024fe0_679619update_scale_kernel"
    "EPfPiS3_PKfddlldd"
)


def _log(
    name: str, arch: str, regs: int, spill_st: int = 0, spill_ld: int = 0, smem: int = 0
) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_{arch}'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    8 bytes stack frame, {spill_st} bytes spill stores, {spill_ld} bytes spill loads\n"
        f"ptxas info    : Used {regs} registers, used 1 barriers, {smem} bytes smem, 400 bytes cmem[0]\n"
    )


def _kernels(text: str):
    ks = gr.parse_ptxas(text)
    gr.annotate(ks, gr.launch_blocks())
    return ks


def test_reads_ptxas_and_names_the_kernel():
    (k,) = _kernels("### source: optim/optim_cuda.cu\n" + _log(MTA_ADAM, "90", 60, smem=36))
    assert (k.arch, k.registers, k.stack, k.spill_stores, k.smem) == ("90", 60, 8, 0, 36)
    assert k.name == "multi_tensor_apply_kernel<4, optim::AdamOp<false, false> >"
    assert k.source == "optim/optim_cuda.cu"
    assert k.block == 512 and not k.single_block


def test_block_sizes_come_from_every_launch_site():
    blocks = gr.launch_blocks()
    launched = set()
    for p in list((ROOT / "csrc").rglob("*.cu")) + list((ROOT / "csrc").rglob("*.cuh")):
        launched |= set(re.findall(r'gpu::launch\(\s*"(\w+)"', p.read_text()))
    assert launched and set(blocks) == launched
    mta = re.search(
        r"constexpr int kMtaThreads = (\d+);",
        (ROOT / "csrc/common/multi_tensor_apply_cuda.cuh").read_text(),
    )
    assert blocks["multi_tensor_apply_kernel"] == (int(mta.group(1)), False)
    assert blocks["update_scale_kernel"] == (1, True)
    assert blocks["combine_partials_kernel"][1] is True


@pytest.mark.parametrize(
    "arch, regs, threads, smem, expected",
    [
        ("90", 32, 512, 0, 1.0),  # 4 blocks of 16 warps: 64 warps, the SM's maximum
        ("90", 40, 512, 0, 0.75),  # 40 regs -> 1280 per warp: 65536 / (1280 * 16) = 3 blocks
        ("90", 64, 512, 0, 0.5),
        ("86", 58, 512, 0, 2 / 3),  # sm_86 holds 48 warps: 2 blocks of 16
        ("80", 128, 512, 0, 0.25),
        ("90", 32, 256, 100 * 1024, 16 / 64),  # shared memory limits it to 2 blocks of 8 warps
    ],
)
def test_occupancy_follows_the_calculator(arch, regs, threads, smem, expected):
    k = gr.Kernel(arch=arch, mangled="x", registers=regs, smem=smem, block=threads)
    assert k.occupancy() == pytest.approx(expected)


def test_real_kernels_pass():
    text = _log(MTA_ADAM, "80", 60, smem=36) + _log(UPDATE_SCALE, "90", 18)
    assert gr.problems(_kernels(text)) == []


def test_a_spill_fails():
    (p,) = gr.problems(_kernels(_log(MTA_ADAM, "86", 60, spill_st=16, spill_ld=16)))
    assert "spills: 16 bytes stored, 16 loaded" in p and "sm_86" in p


def test_an_occupancy_under_the_floor_fails():
    (p,) = gr.problems(_kernels(_log(MTA_ADAM, "90", 96)))
    assert "occupancy 25% < 50%" in p


def test_a_single_block_kernel_has_no_floor():
    (k,) = _kernels(_log(UPDATE_SCALE, "90", 255))
    assert k.single_block and gr.problems([k]) == []


def test_a_kernel_without_a_launch_site_fails():
    (p,) = gr.problems(_kernels(_log("_Z14planted_kernelPf", "90", 16)))
    assert "no launch site" in p


def test_check_exits_non_zero_on_a_planted_spill(tmp_path, capsys):
    log = tmp_path / "ptxas.log"
    log.write_text(_log(MTA_ADAM, "90", 60) + _log(MTA_ADAM, "80", 60, spill_st=4))
    assert gr.main(["--ptxas-log", str(log), "--check"]) == 1
    assert "FAILED" in capsys.readouterr().out
    log.write_text(_log(MTA_ADAM, "90", 60))
    assert gr.main(["--ptxas-log", str(log), "--check"]) == 0
