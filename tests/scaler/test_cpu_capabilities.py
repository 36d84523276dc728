"""The CPU kernels exist twice (baseline x86-64 and AVX2+FMA+F16C, picked at run time); both
builds must give the same answers. FASTAMP_CPU_CAPABILITY=default forces the baseline copy."""

import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import math, sys, torch
    from fastamp.scaler import ops
    from fastamp.testing import make_grads
    shapes = [(1000,), (65536 + 17,), (33, 17), (5,)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        g = make_grads(shapes, dtype, seed=3, scale=300.0)
        g[1][7] = math.inf if dtype != torch.float64 else math.nan
        found, pow_sum, flags = ops.grad_stats(g[2:], torch.tensor(1 / 256))
        f2 = torch.zeros(())
        fl = ops.non_finite_check_and_unscale_(g, f2, torch.tensor(1 / 300))
        ops.clip_unscale_(g[2:], torch.tensor(0.5), pow_sum.sqrt(), 0.1)
        out[str(dtype)] = (float(pow_sum), float(found), fl.tolist(), float(f2), [x.double() for x in g])
    torch.save(out, sys.argv[1])
    """
)


def test_baseline_and_avx2_kernels_agree(tmp_path):
    results = {}
    for cap in ("default", "auto"):
        env = dict(os.environ)
        if cap == "default":
            env["FASTAMP_CPU_CAPABILITY"] = "default"
        else:
            env.pop("FASTAMP_CPU_CAPABILITY", None)
        path = tmp_path / f"{cap}.pt"
        subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, env=env, timeout=300)
        results[cap] = torch.load(path)
    for dtype, (norm_a, found_a, flags_a, f2_a, grads_a) in results["default"].items():
        norm_b, found_b, flags_b, f2_b, grads_b = results["auto"][dtype]
        assert (found_a, flags_a, f2_a) == (found_b, flags_b, f2_b), dtype
        assert abs(norm_a - norm_b) <= 1e-6 * abs(norm_a), dtype  # FMA contraction may differ
        for a, b in zip(grads_a, grads_b):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True, msg=dtype)
