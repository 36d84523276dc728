"""Gradient accumulation that is right by construction, and learning-rate scaling rules.

    acc = fastamp.GradientAccumulator(optimizer, accum_steps=4, scaler=scaler, model=ddp_model,
                                      max_grad_norm=1.0)
    for batch, micro in acc.iterate(loader):
        with micro:
            loss = loss_fn(ddp_model(batch.x), batch.y)
            micro.backward(loss)
    # stepped on micro-batches 4, 8, ... and on the last one even when len(loader) % 4 != 0

Per group of micro-batches the loss is divided by the group's size (the last group may be
smaller), so the update equals one step on the concatenated batch; under DDP (torch's or
fastamp's) every micro-batch but the last of a group runs in ``no_sync()``, so there is one
all-reduce per optimizer step; with a GradScaler there is one ``step``/``update`` per optimizer step.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from fastamp._checks import is_real

__all__ = ["GradientAccumulator", "scale_lr"]


def scale_lr(base_lr: float, base_batch: int, effective_batch: int, rule: str = "linear") -> float:
    """The learning rate for ``effective_batch`` given one tuned at ``base_batch``:
    ``"linear"`` (Goyal et al., 2017: lr grows with the batch) or ``"sqrt"`` (for Adam-type
    optimizers, Krizhevsky 2014 / Hoffer et al. 2017)."""
    if not is_real(base_lr):
        raise TypeError(
            f"scale_lr: base_lr must be a positive number, got {base_lr!r} (a {type(base_lr).__name__}); "
            "expected e.g. 1e-3"
        )
    if not base_lr > 0 or not math.isfinite(base_lr):
        raise ValueError(f"scale_lr: base_lr must be a positive number, got {base_lr!r}")
    for name, v in (("base_batch", base_batch), ("effective_batch", effective_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"scale_lr: {name} must be an int >= 1, got {v!r}")
    ratio = effective_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"scale_lr: rule must be 'linear' or 'sqrt', got {rule!r}")


class _Micro:
    """One micro-batch: a context manager (no_sync when needed) with ``backward(loss)``."""

    def __init__(
        self,
        acc: GradientAccumulator,
        group_size: int,
        last_in_group: bool,
        step: Callable[[], None],
    ):
        self.acc = acc
        # The accumulator's optimizer step, run on leaving the group's last micro-batch (handed in,
        # so that a micro-batch calls nothing private of the accumulator; not public here either:
        # the optimizer steps only through the `with micro:` protocol).
        self._step = step
        self.group_size = group_size
        self.last = last_in_group
        self._stack: contextlib.ExitStack | None = None
        self._inside = False
        self.stepped = False
        self._backward_done = False

    def __enter__(self) -> _Micro:
        self._stack = contextlib.ExitStack()
        model = self.acc.model
        if not self.last and model is not None and hasattr(model, "no_sync"):
            self._stack.enter_context(model.no_sync())
        self._inside = True
        return self

    def backward(self, loss: torch.Tensor) -> None:
        if not self._inside:
            raise RuntimeError(
                "GradientAccumulator: micro.backward(loss) was called outside `with micro:`; "
                "expected `with micro: micro.backward(loss)` (the block enters no_sync() and "
                "steps the optimizer after the last micro-batch of a group)"
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"GradientAccumulator: micro.backward(loss) takes the loss tensor, got "
                f"{type(loss).__name__} (was .item() called on it?); expected a tensor that "
                "requires grad"
            )
        loss = loss / self.group_size
        scaler = self.acc.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        self._backward_done = True

    def __exit__(self, exc_type: object, exc: object, tb: object) -> Literal[False]:
        assert self._stack is not None
        self._inside = False
        self._stack.close()
        if exc_type is None:
            if not self._backward_done:
                raise RuntimeError(
                    "GradientAccumulator: call micro.backward(loss) inside `with micro:`"
                )
            if self.last:
                self._step()
                self.stepped = True
        return False


class GradientAccumulator:
    """Drives ``optimizer`` (and ``scaler``, ``model``'s ``no_sync``) over micro-batches.

    Args:
        optimizer: the optimizer to step once per group.
        accum_steps: micro-batches per optimizer step (>= 1).
        scaler: a ``fastamp.GradScaler`` or ``torch.amp.GradScaler`` (optional).
        model: the (DDP-wrapped) model, for ``no_sync`` (optional).
        max_grad_norm: clip the unscaled grads to this norm before each step (optional).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int,
        scaler: Any = None,
        model: Any = None,
        max_grad_norm: float | None = None,
    ):
        if not (
            isinstance(getattr(optimizer, "param_groups", None), list)
            and callable(getattr(optimizer, "step", None))
        ):
            raise TypeError(
                "GradientAccumulator: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; expected GradientAccumulator(torch.optim.AdamW(model."
                "parameters()), accum_steps)"
            )
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(
                f"GradientAccumulator: accum_steps must be an int >= 1, got {accum_steps!r} "
                "(expected the number of micro-batches per optimizer step, e.g. 4)"
            )
        if scaler is not None and not all(
            callable(getattr(scaler, m, None)) for m in ("scale", "step", "update")
        ):
            raise TypeError(
                f"GradientAccumulator: scaler must be a GradScaler (or None), got {type(scaler).__name__}; "
                "expected e.g. scaler=fastamp.GradScaler('cuda')"
            )
        if max_grad_norm is not None and not (is_real(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(
                f"GradientAccumulator: max_grad_norm must be a number > 0 (or None), got {max_grad_norm!r}; "
                "expected e.g. 1.0"
            )
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        self.scaler = scaler
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.optimizer_steps = 0
        self.last_grad_norm: torch.Tensor | None = None

    def _optimizer_step(self) -> None:
        scaler, opt = self.scaler, self.optimizer
        if self.max_grad_norm is not None:
            if scaler is not None and hasattr(scaler, "clip_grad_norm_") and scaler.is_enabled():
                self.last_grad_norm = scaler.clip_grad_norm_(opt, self.max_grad_norm)
            else:
                if scaler is not None:
                    scaler.unscale_(opt)
                params = [p for g in opt.param_groups for p in g["params"]]
                self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self.optimizer_steps += 1

    def iterate(self, batches: Iterable[Any]) -> Iterator[tuple[Any, _Micro]]:
        """Yields ``(batch, micro)``. Reads one group of ``accum_steps`` batches ahead, so the size
        of a short last group is known before its first backward (loaders of unknown length too)."""
        try:
            it = iter(batches)
        except TypeError:
            raise TypeError(
                f"GradientAccumulator.iterate: batches must be an iterable of batches (e.g. a "
                f"DataLoader), got {type(batches).__name__}"
            ) from None
        return self._groups(it)

    def _groups(self, it: Iterator[Any]) -> Iterator[tuple[Any, _Micro]]:
        while True:
            group = list(itertools.islice(it, self.accum_steps))
            if not group:
                return
            for pos, batch in enumerate(group):
                yield batch, _Micro(self, len(group), pos == len(group) - 1, self._optimizer_step)
