"""The optimizers' CPU kernels exist three times (baseline x86-64, AVX2+FMA+F16C, AVX-512), picked
at run time; the SIMD loops of the low-precision state (common/cpu_simd.h) run 4, 8 or 16 lanes;
so does the tensor digest's word loop (2, 4 or 8 words).
Every build must give the same bits: the same element math, lane by lane, with no contraction.
FASTAMP_CPU_CAPABILITY=default / =avx2 caps the choice, so one machine runs each build it has."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastamp

SCRIPT = textwrap.dedent(
    """
    import sys, torch, fastamp
    from fastamp.optim import lowbit
    ops = torch.ops.fastamp
    out = {"capability": fastamp.build_info()["cpu_capability"]}
    # Sizes with SIMD tails, partial 256-blocks, and more than one 2^16-element chunk.
    sizes = (4096 + 7, 65536 * 2 + 256 * 3 + 45)
    for fmt in ("bfloat16", "int8", "float32"):  # Adam/AdamW
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(len(fmt) + dtype.itemsize)
            ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
            gs = [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for n in sizes]
            gs[0][5] = float("nan") if fmt != "float32" else gs[0][5]  # NaN reaching the state
            mp = [p.float() for p in ps] if dtype != torch.float32 else []
            ms = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
            vs = [torch.rand(n, generator=gen) * 1e-5 for n in sizes]
            steps = [torch.tensor(3.0) for _ in sizes]
            inv, coef = torch.tensor(0.5), torch.tensor(0.75)
            for step in range(3):
                if fmt == "float32":
                    if step == 0:
                        ms = [m.to(dtype) if not mp else m for m in ms]
                        vs = [v.to(dtype) if not mp else v for v in vs]
                    ops.adam_step_(ps, gs, ms, vs, [], steps, mp, 1e-2, None, 0.9, 0.999, 0.01,
                                   1e-8, False, step % 2 == 0, False, inv, None, coef)
                    state = ms + vs
                else:
                    if step == 0:
                        st = [lowbit.resolve(fmt, "test").encode({"exp_avg": m, "exp_avg_sq": v}, p.float())
                              for m, v, p in zip(ms, vs, ps)]
                    ops.adam_lowbit_step_(
                        ps, gs, *lowbit.resolve(fmt, "test").adam_lists(st), steps, mp, 5, 1e-2,
                        None, 0.9 if step < 2 else 0.3, 0.999, 0.01 * step, 1e-8, step != 1,
                        step == 2, inv, None, coef)
                    state = [t for s in st for t in s.values()]
            out[(fmt, str(dtype))] = [t.clone() for t in ps + mp + state]
    for dtype in (torch.float32, torch.bfloat16):  # SGD with a bfloat16 momentum buffer
        gen = torch.Generator().manual_seed(99)
        ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
        gs = [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for n in sizes]
        gs[0][5] = float("nan")
        mp = [p.float() for p in ps] if dtype != torch.float32 else []
        bufs = [(torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16) for n in sizes]
        counts = [torch.tensor(0.0), torch.tensor(3.0)]
        inv, coef = torch.tensor(0.5), torch.tensor(0.75)
        for step in range(2):
            ops.sgd_lowbit_step_(ps, gs, bufs, counts, mp, 9, 0.05, None, 0.01, 0.9, 0.1, step == 1,
                                 step == 0, inv, None, coef)
        out[("sgd-bf16", str(dtype))] = [t.clone() for t in ps + mp + bufs]
    # tensor_digest: its word loop is built per ISA too (2, 4 or 8 words an instruction): byte
    # counts with a partial last word and word counts off every lane width, more than one chunk.
    gen = torch.Generator().manual_seed(7)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
             for n in (0, 1, 7, 8, 9, 23, 64, 65, 8 * 65536 * 2 + 8 * 13 + 5)]
    out[("digest",)] = [ops.tensor_digest(blobs)]
    torch.save(out, sys.argv[1])
    """
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _run(cap: str | None, path) -> dict:
    env = dict(os.environ)
    env.pop("FASTAMP_CPU_CAPABILITY", None)
    if cap is not None:
        env["FASTAMP_CPU_CAPABILITY"] = cap
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, env=env, timeout=600)
    return torch.load(path)


@pytest.mark.full  # a subprocess per CPU build (10-17 s on 2 cores): the full tier (`make test-all`)
def test_every_cpu_build_of_the_optimizer_kernels_gives_the_same_bits(tmp_path):
    # (and of the tensor digest's word loop)
    runs = {cap: _run(cap, tmp_path / f"{cap}.pt") for cap in ("default", "avx2", None)}
    best = runs[None]["capability"]
    assert runs["default"]["capability"] == "default"
    assert runs["avx2"]["capability"] in ("avx2", "default")
    assert best == fastamp.build_info()["cpu_capability"]
    if best == "default":
        pytest.skip("this CPU has neither AVX2 nor AVX-512: only the baseline build can run")
    for cap in ("avx2", None):
        for key, ref in runs["default"].items():
            if key == "capability":
                continue
            got = runs[cap][key]
            assert len(got) == len(ref)
            for i, (a, b) in enumerate(zip(ref, got)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(_bits(a), _bits(b)), (cap or best, key, i)


DIGEST_SCRIPT = textwrap.dedent(
    """
    import sys, torch, fastamp
    gen = torch.Generator().manual_seed(7)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
             for n in (0, 1, 7, 8, 9, 23, 64, 65, 8 * 65536 * 2 + 8 * 13 + 5)]
    torch.save({"capability": fastamp.build_info()["cpu_capability"],
                "digest": torch.ops.fastamp.tensor_digest(blobs)}, sys.argv[1])
    """
)


def test_every_cpu_build_of_the_tensor_digest_gives_the_same_bits(tmp_path):
    """The digest's word loop per ISA (2, 4 or 8 words an instruction), in the quick tier: a
    subprocess per build, each only imports fastamp and hashes a few blobs (byte counts with a
    partial last word, word counts off every lane width, more than one chunk)."""
    runs = {}
    for cap in ("default", "avx2", None):
        env = dict(os.environ)
        env.pop("FASTAMP_CPU_CAPABILITY", None)
        if cap is not None:
            env["FASTAMP_CPU_CAPABILITY"] = cap
        out = tmp_path / f"{cap}.pt"
        cmd = [sys.executable, "-c", DIGEST_SCRIPT, str(out)]
        subprocess.run(cmd, check=True, env=env, timeout=300)
        runs[cap] = torch.load(out)
    assert runs["default"]["capability"] == "default"
    if runs[None]["capability"] == "default":
        pytest.skip("this CPU has neither AVX2 nor AVX-512: only the baseline build can run")
    for cap in ("avx2", None):
        assert torch.equal(runs[cap]["digest"], runs["default"]["digest"]), cap
