"""Written tensor lists must not share memory between entries (or, for the optimizer ops, across
the lists they write): each shared element would be updated twice. Found by the bad-input
catalogue review: ``non_finite_check_and_unscale_([a, a], ...)`` used to unscale ``a`` twice."""

from __future__ import annotations

import pytest
import torch

import fastamp  # noqa: F401  (registers the ops)

ops = torch.ops.fastamp


def _scalars(n):
    return torch.zeros(()), torch.full((), 0.5), torch.zeros(n, dtype=torch.bool)


@pytest.mark.parametrize("views", ["same", "overlapping_slices", "strided_collision"])
def test_unscale_refuses_shared_elements_and_writes_nothing(views):
    x = torch.randn(40)
    lists = {
        "same": lambda: [x, x],
        "overlapping_slices": lambda: [x[:24], x[16:]],
        "strided_collision": lambda: [x[::2], x[2::4]],  # elements 2, 6, 10... are in both
    }[views]()
    before = x.clone()
    found, inv, flags = _scalars(2)
    with pytest.raises(
        RuntimeError, match=r"grads\[1\] and grads\[0\] (may )?share memory.*Pass each tensor once"
    ):
        ops.non_finite_check_and_unscale_(lists, found, inv, flags)
    assert torch.equal(x, before) and float(found) == 0.0 and not flags.any()
    with pytest.raises(RuntimeError, match=r"share memory"):
        ops.clip_unscale_(lists, inv, torch.full((), 1.0), 0.5)
    assert torch.equal(x, before)


def test_disjoint_views_of_one_storage_are_accepted():
    # DDP's bucket views and interleaved strided views share a storage but no element.
    x = torch.randn(40)
    ref = x.double() * 0.5
    found, inv, flags = _scalars(4)
    ops.non_finite_check_and_unscale_([x[:10], x[10:20], x[20:40:2], x[21:40:2]], found, inv, flags)
    assert torch.allclose(x.double(), ref, rtol=0, atol=1e-7)
