"""Data parallelism on torch.distributed: :class:`DistributedDataParallel` with bucketed,
overlapped gradient all-reduce."""

from fastamp.parallel.distributed import DDPGradStats, DistributedDataParallel, GradBucket

__all__ = ["DDPGradStats", "DistributedDataParallel", "GradBucket"]
