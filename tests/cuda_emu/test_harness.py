"""The differential harness's own rules: what counts as the same bits."""

from __future__ import annotations

import emu
import pytest
import torch
from harness import comparable_bits


def _nans(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    width = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    canonical = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}[dtype]
    x86_default = {torch.float32: -0x400000, torch.float16: -0x200, torch.bfloat16: -0x40}[dtype]
    gpu = torch.tensor([canonical, 0x3C00], dtype=width[dtype]).view(dtype)
    cpu = torch.tensor([x86_default, 0x3C00], dtype=width[dtype]).view(dtype)
    return gpu, cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_payloads_count_on_the_emulator_not_on_a_device(monkeypatch, dtype):
    gpu, cpu = _nans(dtype)
    assert torch.isnan(gpu[0]) and torch.isnan(cpu[0])
    monkeypatch.setattr(emu, "DEVICE", "")
    assert not torch.equal(comparable_bits(gpu), comparable_bits(cpu))
    monkeypatch.setattr(emu, "DEVICE", "cuda")
    assert torch.equal(comparable_bits(gpu), comparable_bits(cpu))
    # a NaN where the other has a number still differs, and so does any other bit
    number = cpu.clone()
    number[0] = 1.0
    assert not torch.equal(comparable_bits(gpu), comparable_bits(number))
    other = gpu.clone()
    other[1] = -other[1]
    assert not torch.equal(comparable_bits(gpu), comparable_bits(other))
