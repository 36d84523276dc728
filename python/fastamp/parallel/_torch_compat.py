"""What DistributedDataParallel keeps of torch's DDP interface without torch's C++ reducer: the
``reducer`` attribute's one used call (:class:`ReducerShim`), the Join hook for uneven inputs
(:class:`CallbackJoinHook`), and torch's private methods that clients call (:class:`TorchCompat`:
each either does what torch's does or raises naming itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from fastamp.parallel._args import _NAME, refuse
from fastamp.parallel._backward import GradSync


class ReducerShim:
    """Stands where torch's C++ reducer was: ``prepare_for_backward`` (accelerate's
    ``trigger_sync_in_backward``) arms the next backward; anything else raises naming itself."""

    __slots__ = ("prepare_for_backward_fn",)

    def __init__(self, arm: Callable[[], None]):
        self.prepare_for_backward_fn = arm

    def prepare_for_backward(self, outputs: Any = None) -> None:
        self.prepare_for_backward_fn()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{_NAME} has no torch C++ reducer (it buckets gradients itself): reducer.{name} does "
            "not exist; use the wrapper's public methods (no_sync, join, register_comm_hook, ...)"
        )


class CallbackJoinHook(JoinHook):
    """A Join hook made of the DDP's own callbacks: on a rank that ran out of inputs, ``main``
    shadows every collective one iteration of the others issues; ``post`` syncs the final model."""

    def __init__(self, main: Callable[[], None], post: Callable[[bool], None]):
        self.main = main
        self.post = post
        super().__init__()

    def main_hook(self) -> None:
        self.main()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.post(is_last_joiner)


class TorchCompat:
    """Mixin of :class:`fastamp.parallel.DistributedDataParallel`: torch's private methods, over
    the wrapper's :class:`fastamp.parallel._backward.GradSync` (``_sync``)."""

    # torch's DDP options, as DDP's constructor keeps them
    world_size: int
    process_group: Any
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    _sync: GradSync

    def _check_reducer_finalized(self) -> None:
        if self._sync.pending or self._sync.started:
            raise RuntimeError(
                f"{_NAME}: the last backward has not finished synchronising gradients"
            )

    def _set_static_graph(self) -> None:
        if self._sync.has_run():
            raise RuntimeError(
                "_set_static_graph: static graph can only be set before the first iteration"
            )
        self.static_graph = True
        self._sync.static_graph = True

    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> None:
        raise refuse("_register_fused_optim", "use fastamp.optim's fused optimizers after backward")

    def _register_buffer_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        raise refuse(
            "_register_buffer_comm_hook",
            "buffers are broadcast from rank 0 as with torch's default",
        )

    def _set_sparse_metadata(self, *args: Any, **kwargs: Any) -> None:
        raise refuse("_set_sparse_metadata", "sparse gradients are not supported")

    def _update_process_group(self, *args: Any, **kwargs: Any) -> None:
        raise refuse("_update_process_group", "wrap the module again with the new process group")

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        layout = self._sync.layout
        return {
            "bucket_sizes": ", ".join(
                str(b.numel * b.buffer.element_size()) for b in layout.buckets
            ),
            "has_rebuilt_buckets": int(layout.rebuilt),
            "world_size": self.world_size,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "backend_name": dist.get_backend(self.process_group),
        }

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")

    def _set_ddp_sink_clone(self, val: bool) -> None:
        return None
