"""Comparing fastamp with torch where the bits of either depend on the machine.

Torch's CPU kernels are picked per machine (AVX-512 on most Intel servers, AVX2 on AMD Zen 3, the
baseline elsewhere), and so are fastamp's (``FASTAMP_CPU_CAPABILITY``): the two round differently
on different machines. On a well-conditioned input that difference stays within a fixed rtol; on
an ill-conditioned one (a moment set to 1.0, a trajectory of many steps through a LayerNorm) a
rounding in one step is amplified by the next ones, and a tolerance tuned on one machine fails on
another although neither result is wrong.

So an ill-conditioned case is judged against a float64 run of the same steps: fastamp must be at
most ``factor`` times as far from it as torch's own float32 run is on the same input, plus a few
units in the last place. Torch's error on one small tensor can be luckily small while the run as a
whole is ill-conditioned, so the error allowed on each tensor is the larger of torch's error on
it and torch's largest relative error over the whole run (every tensor compared), at the tensor's
scale. That holds on every machine and still catches a wrong update, whose error is the size of
the update, not of a rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Triple = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref).abs().max()) if ref.numel() else 0.0


def assert_as_close_as_torch(
    triples: Sequence[Triple], *, factor: float = 4.0, ulps: float = 8.0
) -> None:
    """Each ``(what, actual, torch_result, reference64)``: ``actual`` no farther from the float64
    ``reference64`` than ``factor`` times torch's error (the larger of its error on this tensor
    and its largest relative error over all ``triples`` at this tensor's scale), plus ``ulps``
    units in the last place of ``actual``'s dtype at the reference's largest magnitude. Errors are
    the largest elementwise absolute differences of a tensor."""
    rows = []
    run_rel = 0.0  # torch's largest error over the run, relative to each tensor's scale
    for what, actual, torch_result, reference64 in triples:
        ref = reference64.detach().double()
        assert actual.shape == ref.shape == torch_result.shape, (what, actual.shape, ref.shape)
        assert bool(torch.isfinite(ref).all()), f"{what}: the float64 reference is not finite"
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        err_torch = _err(torch_result, ref)
        if scale > 0:
            run_rel = max(run_rel, err_torch / scale)
        rows.append((what, _err(actual, ref), err_torch, scale, actual.dtype))
    assert rows, "nothing compared"
    for what, err, err_torch, scale, dtype in rows:
        fi = torch.finfo(dtype)
        floor = ulps * fi.eps * max(scale, fi.tiny)
        bound = factor * max(err_torch, run_rel * scale) + floor
        assert err <= bound, (
            f"{what}: fastamp is {err:.3g} from the float64 reference, torch {err_torch:.3g} "
            f"(torch's largest relative error over the run: {run_rel:.3g}); expected at most "
            f"{factor} x torch's error + {ulps} ulp ({bound:.3g})"
        )
