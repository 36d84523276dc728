"""All or nothing for GradScaler's per-iteration state (:class:`RestoreOnError`): a call that raises
before writing a grad leaves the scaler as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class RestoreOnError:
    """Mixin of :class:`fastamp.GradScaler` (methods over its own state)."""

    _per_optimizer_states: Any

    @contextlib.contextmanager
    def _restore_on_error(self, optimizer: Any) -> Iterator[None]:
        """Puts the optimizer's per-iteration state back as it was when the block raises.

        PyTorch leaves a fresh entry behind (``_per_optimizer_states`` is a defaultdict), after
        which the scaler refuses to be pickled, and a failing fused step would leave inf checks
        that a retry then mixes with new ones. Once a grad has been written (``_grads_written``)
        the new stage is the truth and is kept.
        """
        outer = self.__dict__.get("_write_mark")
        mark = self.__dict__["_write_mark"] = [False]
        states = self._per_optimizer_states
        key = id(optimizer)
        saved = None
        if key in states:  # `in` does not create an entry
            saved = dict(states[key])
            if isinstance(saved.get("found_inf_per_device"), dict):
                saved["found_inf_per_device"] = dict(saved["found_inf_per_device"])
        try:
            yield
        except BaseException:
            if self._per_optimizer_states is states and not mark[0]:
                if saved is None:
                    states.pop(key, None)
                else:
                    states[key] = saved
            raise
        finally:
            if outer is None:
                self.__dict__.pop("_write_mark", None)
            else:
                outer[0] = outer[0] or mark[0]
                self._write_mark = outer

    def _grads_written(self) -> None:
        mark = self.__dict__.get("_write_mark")
        if mark is not None:
            mark[0] = True
