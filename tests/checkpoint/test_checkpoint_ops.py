"""The checkpoint ops: RNG snapshot/restore and tensor digests."""

import pytest
import torch

from fastamp.checkpoint._ops import rng_get_state, rng_set_state, tensor_digest


def test_rng_snapshot_restores_every_initialised_generator(device):
    if device == "cuda":
        torch.cuda.init()
    states = rng_get_state()
    assert states[0].dtype == torch.uint8 and states[0].numel() > 0
    a = [torch.rand(5), torch.rand(5, device=device)]
    rng_set_state(states)
    b = [torch.rand(5), torch.rand(5, device=device)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    if device == "cuda":  # the CUDA generators are part of the same snapshot
        assert sum(s.numel() > 0 for s in states[1:]) >= 1


def test_rng_set_state_validates_before_restoring():
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="states is empty"):
        rng_set_state([])
    with pytest.raises(TypeError, match=r"states\[0\] must be a CPU uint8 tensor"):
        rng_set_state([torch.zeros(3)])
    too_many = [torch.get_rng_state()] * (torch.cuda.device_count() + 2)
    with pytest.raises(ValueError, match="CUDA device"):
        rng_set_state(too_many)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
)
def test_digest_equal_bytes_equal_digest_any_bit_flip_differs(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1003, generator=g) * 100).to(dtype).to(device)
    y = x.clone()
    d = tensor_digest([x, y])
    assert d.dtype == torch.int64 and d.shape == (2,) and d[0] == d[1]
    raw = y.view(torch.uint8)
    for pos in (0, 7, 8, raw.numel() - 1):
        z = y.clone()
        zr = z.view(torch.uint8)
        zr[pos] ^= 1
        assert tensor_digest([z])[0] != d[0], pos
    # Swapping two words changes it too (the digest is position-aware).
    w = torch.cat([x[8:16], x[:8], x[16:]])
    assert tensor_digest([w])[0] != d[0]


def test_digest_of_views_and_empties(device):
    x = torch.randn(10, 12, device=device)
    t = x.t()
    assert tensor_digest([t])[0] == tensor_digest([t.contiguous()])[0]  # logical order
    e = tensor_digest([torch.empty(0, device=device), torch.ones(1, device=device)])
    assert e.shape == (2,)
    assert tensor_digest([]).numel() == 0
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has layout"):
        tensor_digest([torch.ones(3, device=device).to_sparse()])


def test_opcheck_digest(device):
    torch.library.opcheck(
        torch.ops.fastamp.tensor_digest.default,
        ([torch.randn(7, 3, device=device), torch.arange(5, device=device)],),
    )


_GUARD_PROBE = r"""
import ctypes, mmap, sys
import torch
import fastamp
sys.path.insert(0, sys.argv[1])
page = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * page)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(addr + page), page, 0) == 0  # PROT_NONE
whole = torch.frombuffer(buf, dtype=torch.uint8, count=page)
whole.copy_(torch.arange(page, dtype=torch.int64).remainder(251).to(torch.uint8))
ops = [torch.ops.fastamp.tensor_digest]
if sys.argv[2] == "1":
    import emu
    ops.append(emu.op("tensor_digest"))
for n in (8, 64, page - 8, page - 3, page):  # full words, and a tail, up to the guard page
    t = whole[page - n:]
    got = [int(op([t])[0]) for op in ops]
    assert len(set(got)) == 1, (n, got)
print("ok")
"""


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emulated-cuda"])
def test_digest_reads_no_byte_past_the_tensor(emulated, tmp_path):
    """A tensor that ends where an inaccessible page begins: a kernel reading one byte past its
    storage (an 8-byte copy where 3 bytes were left, a 9-byte copy) crashes the probe."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    emu_dir = Path(__file__).resolve().parents[1] / "cuda_emu"
    if emulated and os.environ.get("FASTAMP_EMU_DEVICE"):
        pytest.skip("the emulator's own check")
    r = subprocess.run(
        [sys.executable, "-c", _GUARD_PROBE, str(emu_dir), "1" if emulated else "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
