"""Data parallelism on torch.distributed: :class:`DistributedDataParallel` with bucketed,
overlapped gradient all-reduce."""

from fastamp.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
