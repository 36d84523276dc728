"""What :class:`fastamp.GradScaler` keeps of one optimizer's iteration, from its first
``unscale_`` / ``clip_grad_norm_`` / ``step`` until ``update()`` (:class:`OptimizerIteration`,
beside PyTorch's own per-optimizer entry, which keeps PyTorch's keys only, with its
:class:`ClipStep`: what ``clip_grad_norm_`` hands the fused step), and the all-or-nothing rule of
its public calls (:class:`Transaction`, opened and closed by :class:`RestoreOnError`: a call that
raises before writing a grad leaves both as they were)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from fastamp.scaler._grads import DeviceGrads

__all__ = ["ClipStep", "OptimizerIteration", "RestoreOnError", "Transaction"]


@dataclass(frozen=True)
class ClipStep:
    """What ``clip_grad_norm_`` leaves for a fused optimizer's step: the grads are still scaled,
    and the kernel multiplies them by ``inv_scale * clip_coef``. ``total_norm`` and ``max_norm``
    are kept for a second ``clip_grad_norm_`` in the same iteration, which first makes this
    write pass itself (the grads as torch's ``unscale_`` + ``clip_grad_norm_`` leave them)."""

    inv_scale: Tensor
    clip_coef: Tensor
    total_norm: Tensor
    max_norm: float


@dataclass
class OptimizerIteration:
    """fastamp's record of one optimizer's iteration (see the module docstring)."""

    # Each device's grads with their per-grad inf flags (for overflow_report()).
    flags: list[tuple[DeviceGrads, Tensor]] = field(default_factory=list)
    # clip_grad_norm_'s result for a fused optimizer's step, until that step takes it.
    clip: ClipStep | None = None
    # The inf flags summed over devices, once the step began (step, last_step_skipped and
    # update all read it; its inputs no longer change).
    found_total: Tensor | None = None

    def copy(self) -> OptimizerIteration:
        return OptimizerIteration(list(self.flags), self.clip, self.found_total)


class Transaction:
    """One public call's changes to the per-iteration state of one optimizer, undone if the call
    raises before it wrote a grad (:meth:`grads_written`): PyTorch leaves a fresh entry behind
    (its ``_per_optimizer_states`` is a defaultdict), after which the scaler refuses to be pickled,
    and a failing fused step would leave inf checks that a retry then mixes with new ones. Once a
    grad has been written the new stage is the truth and is kept."""

    def __init__(
        self,
        states: Any,
        iterations: dict[int, OptimizerIteration],
        key: int,
        outer: Transaction | None,
    ) -> None:
        self.states = states
        self.iterations = iterations
        self.key = key
        self.outer = outer
        self.wrote = False
        self._saved = None
        if key in states:  # `in` does not create an entry
            saved = dict(states[key])
            if isinstance(saved.get("found_inf_per_device"), dict):
                saved["found_inf_per_device"] = dict(saved["found_inf_per_device"])
            self._saved = saved
        record = iterations.get(key)
        self._saved_record = None if record is None else record.copy()

    def grads_written(self) -> None:
        self.wrote = True
        if self.outer is not None:
            self.outer.grads_written()

    def undo(self, states: Any) -> None:
        """Puts the entries back (unless a grad was written, or update() replaced the dicts)."""
        if states is not self.states or self.wrote:
            return
        if self._saved is None:
            states.pop(self.key, None)
        else:
            states[self.key] = self._saved
        if self._saved_record is None:
            self.iterations.pop(self.key, None)
        else:
            self.iterations[self.key] = self._saved_record


class RestoreOnError:
    """``with scaler._restore_on_error(optimizer) as tx``: the block's :class:`Transaction`
    (already the scaler's current one), closed by ``close(tx, failed)`` when the block ends (the
    scaler undoes it if the block raised and puts the outer one back). A class rather than a
    ``contextlib.contextmanager`` generator: three of these open per training step, and the
    generator's machinery costs about 1 us each."""

    __slots__ = ("tx", "close")

    def __init__(self, tx: Transaction, close: Callable[[Transaction, bool], None]) -> None:
        self.tx = tx
        self.close = close

    def __enter__(self) -> Transaction:
        return self.tx

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> Literal[False]:
        self.close(self.tx, exc_type is not None)
        return False
