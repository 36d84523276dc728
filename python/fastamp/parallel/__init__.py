"""Data parallelism on torch.distributed: :class:`DistributedDataParallel` with bucketed,
overlapped gradient all-reduce."""

from fastamp.parallel import _ops as ops
from fastamp.parallel.distributed import DistributedDataParallel, GradBucket

__all__ = ["DistributedDataParallel", "GradBucket", "ops"]
