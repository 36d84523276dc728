"""Saving and resuming a whole training run so that it continues bit for bit.

* :func:`save_training_state`, :func:`load_training_state` and the :class:`TrainingState` a load
  returns (``training_state.py``): which files a save writes, the save id, the order of a load's
  checks and restores (also ``fastamp.save_training_state``, ``fastamp.load_training_state``,
  ``fastamp.TrainingState``);
* ``_checks.py``: what a load checks before it restores anything (optimizer, scaler and RNG
  states), and the RNG states saved and restored;
* ``_sharded.py``: a sharded model's (FSDP2) tensors and its optimizer's through
  ``torch.distributed.checkpoint``, and the ranks' agreement before a load reads or restores;
* ``_checksums.py``: the checksums of every file's content, recorded at save and verified before
  a load restores anything;
* ``_io.py``: atomic writes that report the real ``OSError``, and the encoding of ``extra`` that
  ``torch.load(weights_only=True)`` reads back.
"""

from fastamp.resume.training_state import (
    TrainingState,
    load_training_state,
    save_training_state,
)

__all__ = ["TrainingState", "load_training_state", "save_training_state"]
