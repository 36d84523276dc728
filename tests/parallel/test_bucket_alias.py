"""Issue 14: fastamp::bucket_pack_ / bucket_unpack_ refuse a grad that is a view of the bucket
(other than exactly its own slot): the result would depend on the order of the copies."""

from __future__ import annotations

import pytest
import torch

import fastamp  # noqa: F401  (registers the ops)


def test_pack_refuses_a_grad_viewing_another_part_of_the_bucket():
    bucket = torch.arange(10, dtype=torch.float32)
    other = torch.randn(3)
    alias = bucket[4:7]  # lies over the slot of grads[0] (offsets 3..5) and its own
    before = bucket.clone()
    with pytest.raises(RuntimeError, match=r"grads\[1\] is a view of the bucket"):
        torch.ops.fastamp.bucket_pack_(bucket, [other, alias], [3, 6], 0.5)
    assert torch.equal(bucket, before)  # refused before writing


def test_pack_accepts_a_grad_that_is_exactly_its_own_slot():
    bucket = torch.arange(8, dtype=torch.float32)
    own = bucket[2:5]
    torch.ops.fastamp.bucket_pack_(bucket, [own], [2], 0.5)
    want = torch.arange(8, dtype=torch.float32)
    want[2:5] *= 0.5
    assert torch.equal(bucket, want)


def test_unpack_refuses_a_grad_viewing_the_bucket():
    bucket = torch.arange(8, dtype=torch.float32)
    grads = [torch.zeros(3), bucket[0:3]]
    before = [bucket.clone(), grads[0].clone()]
    with pytest.raises(RuntimeError, match=r"grads\[1\] is a view of the bucket"):
        torch.ops.fastamp.bucket_unpack_(bucket, grads, [0, 3], torch.ones(()))
    assert torch.equal(bucket, before[0]) and torch.equal(grads[0], before[1])


def test_bucket_unpack_refuses_overlapping_grads():
    bucket, g = torch.randn(10), torch.randn(10)
    before = g.clone()
    with pytest.raises(
        RuntimeError, match=r"bucket_unpack_: grads\[1\] and grads\[0\] share memory"
    ):
        torch.ops.fastamp.bucket_unpack_(bucket, [g[:5], g[3:8]], [0, 5], torch.ones(()))
    assert torch.equal(g, before)
