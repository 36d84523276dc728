"""Shared by the client-integration tests: a learnable task, op counting, loss checks, a spy on
fastamp.clip_grad_norm_ (spy_on_fastamps_clip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

IN, CLASSES = 16, 4
ROOT = Path(__file__).resolve().parent.parent.parent


def dataset(n: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A task with structure: the label is the argmax of a fixed linear map of the input
    (chance loss ln 4 = 1.386; an MLP gets well below it in a few dozen steps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, CLASSES, generator=g)
    return x, (x @ w).argmax(1)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, CLASSES)
    )


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy in fp32 for half logits, in the logits' dtype for float64 (an exact run)."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op as "namespace.name" (e.g. "fastamp.grad_stats", "aten.mul_")."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


# Ops any unscale-then-clip recipe runs over the grads (torch's or fastamp's unfused one).
EXTRA_PASS_OPS = (
    "fastamp.clip_unscale_",
    "fastamp.non_finite_check_and_unscale_",
    "aten._amp_foreach_non_finite_check_and_unscale_",
    "aten._foreach_norm",
    "aten.linalg_vector_norm",
    "aten._foreach_mul_",
)


def adam_launches(counts: Mapping[str, int]) -> int:
    """The fused Adam updates counted: through the list-taking op (a full step) or its held
    variant (a planned step, fastamp.optim._replay)."""
    return counts.get("fastamp.adam_step_", 0) + counts.get("fastamp.adam_step_held_", 0)


def assert_fused_clip(counts: Counter, steps: int, groups: int = 1) -> None:
    """Clipping folded into the fused step: one read-only stats pass + one fused update per step,
    and none of the ops of an unscale / norm / multiply recipe."""
    assert counts["fastamp.grad_stats"] == steps, counts
    assert adam_launches(counts) == steps * groups, counts
    extra = {op: counts[op] for op in EXTRA_PASS_OPS if counts[op]}
    assert not extra, f"extra passes over the grads: {extra}"


def assert_learns(losses: list[float], chance: float = 1.386) -> None:
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert all(map(lambda v: v == v, losses)), losses
    assert last < 0.7 * first and last < 0.8 * chance, (first, last, losses)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


def assert_params_close(a: nn.Module, b: nn.Module, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def distance(
    losses_a: list[float], a: nn.Module, losses_b: list[float], b: nn.Module
) -> tuple[float, float]:
    """The largest |difference| of two runs' losses, and of their final params."""
    assert len(losses_a) == len(losses_b), (len(losses_a), len(losses_b))
    loss = max(abs(x - y) for x, y in zip(losses_a, losses_b))
    params = max(
        (p.detach().double() - q.detach().double()).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters())
    )
    return loss, params


def assert_within_torchs_error(ours, ref, exact, factor: float = 2.0) -> None:
    """fastamp's run is as close to the exact (float64) run as the client's own run in the same
    precision, within ``factor``: each run is ``(losses, model)``. The tolerance is torch's own
    error in that precision (bf16 autocast, fp32), measured here, not a fixed number: the runs
    differ only in the rounding of the clip's norm and of the optimizer's update, which is well
    inside it (a clip left out or applied twice is not)."""
    torch_err = distance(*ref, *exact)
    ours_err = distance(*ours, *exact)
    assert all(e > 0 for e in torch_err), torch_err  # (a float64 run in disguise)
    for what, o, t in zip(("losses", "params"), ours_err, torch_err):
        assert o <= factor * t, f"{what}: fastamp's run {o:.3g} from float64, the client's {t:.3g}"


def run_script(tmp_path: Path, text: str, name: str, *args: str) -> dict:
    """Runs ``text`` as the script ``tmp_path / name`` (a framework launches its own worker
    processes from it) with ``args`` and the JSON path it writes its results to; returns them."""
    script = tmp_path / name
    script.write_text(text)
    out = tmp_path / f"{'-'.join(args) or 'out'}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(script), *args, str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def spy_on_fastamps_clip(monkeypatch) -> list[type]:
    """Wraps ``fastamp.clip_grad_norm_`` for the test: the returned list collects the type of the
    optimizer of each call."""
    import fastamp

    calls: list[type] = []
    real = fastamp.clip_grad_norm_

    def spy(optimizer, *args, **kwargs):
        calls.append(type(optimizer))
        return real(optimizer, *args, **kwargs)

    monkeypatch.setattr(fastamp, "clip_grad_norm_", spy)
    return calls
