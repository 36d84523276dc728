"""``determinism_check`` of :func:`fastamp.checkpoint.checkpoint`: the context_fn wrappers that
check a user's context_fn (:func:`checked_context_fn`) and compare, op by op, the digests of the
first forward's outputs with the recompute's (``"bitwise"``, :func:`bitwise_context_fn`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointError

from fastamp.checkpoint._ops import tensor_digest

# Factories whose output is uninitialised memory: their bytes legitimately differ.
_NONDETERMINISTIC_BY_DESIGN = (
    "empty",
    "new_empty",
    "empty_like",
    "empty_strided",
    "new_empty_strided",
)


def _digests(out: Any) -> list[tuple[int, Tensor]]:
    tensors = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
    result: list[tuple[int, Tensor]] = []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout == torch.strided and t.device.type != "meta":
            by_device.setdefault(t.device, []).append(i)
    for idxs in by_device.values():
        d = tensor_digest([tensors[i] for i in idxs])
        result.extend((i, d[k]) for k, i in enumerate(idxs))
    return sorted(result, key=lambda x: x[0])


class _DigestMode(TorchDispatchMode):
    """Forward: records (op, output digests) per op. Recompute: compares them as ops run."""

    def __init__(self, log: list[tuple[str, list[tuple[int, Tensor]]]], compare: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.log = log
        self.compare = compare
        self.k = 0

    def __enter__(self) -> _DigestMode:
        self.k = 0  # every recompute (retain_graph, several backwards) starts from the first op
        mode: _DigestMode = super().__enter__()  # type: ignore[no-untyped-call]  # as __init__
        return mode

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # Aliases (detach, views) compute nothing, and the recompute detaches its inputs where the
        # forward did not; uninitialised factories legitimately differ.
        if func.is_view or func.__name__.split(".")[0] in _NONDETERMINISTIC_BY_DESIGN:
            return out
        digests = _digests(out)
        name = str(func)
        if not self.compare:
            self.log.append((name, digests))
        else:
            if self.k >= len(self.log):
                raise CheckpointError(
                    f"fastamp.checkpoint (determinism_check='bitwise'): the recompute ran more ops "
                    f"than the forward (op #{self.k}: {name})"
                )
            fwd_name, fwd = self.log[self.k]
            if fwd_name != name:
                raise CheckpointError(
                    f"fastamp.checkpoint (determinism_check='bitwise'): op #{self.k} was {fwd_name} "
                    f"in the forward but {name} in the recompute: the function took another path"
                )
            for (i, a), (_, b) in zip(fwd, digests):
                if not torch.equal(a, b):
                    raise CheckpointError(
                        f"fastamp.checkpoint (determinism_check='bitwise'): output {i} of op "
                        f"#{self.k} ({name}) differs bitwise between the forward and the recompute. "
                        "The block is not deterministic: it draws randomness that is not replayed "
                        "(a torch.Generator of its own, numpy/python random), reads mutable state, "
                        "or uses a nondeterministic kernel."
                    )
        self.k += 1
        return out


class _Both:
    """Enters two context managers as one (the user's context_fn and the bitwise check)."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _Both:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.outer)
        self.stack.enter_context(self.inner)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        assert self.stack is not None
        return self.stack.__exit__(*exc)


def checked_context_fn(context_fn: Callable[[], Any]) -> Callable[[], tuple[Any, Any]]:
    """context_fn, with its result checked before the forward runs (PyTorch unpacks it and says
    only "cannot unpack non-iterable ...")."""

    def checked() -> tuple[Any, Any]:
        out: tuple[Any, Any] = context_fn()
        ok = (
            isinstance(out, tuple)
            and len(out) == 2
            and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in out)
        )
        if not ok:
            hint = (
                " -- a function: was the policy factory passed uncalled (context_fn=selective "
                "instead of context_fn=selective())?"
                if callable(out)
                else ""
            )
            raise TypeError(
                "fastamp.checkpoint.checkpoint: context_fn must return two context managers "
                f"(forward, recompute), but it returned a {type(out).__name__}{hint}; expected "
                "e.g. context_fn=fastamp.checkpoint.selective()"
            )
        return out

    return checked


def bitwise_context_fn(
    user_context_fn: Callable[[], tuple[Any, Any]],
) -> Callable[[], tuple[_Both, _Both]]:
    def context_fn() -> tuple[_Both, _Both]:
        fwd, rec = user_context_fn()
        log: list[tuple[str, list[tuple[int, Tensor]]]] = []
        return _Both(fwd, _DigestMode(log, compare=False)), _Both(
            rec, _DigestMode(log, compare=True)
        )

    return context_fn
