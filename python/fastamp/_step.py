"""What the step paths of the scaler and the optimizers share, both on every step:

* :func:`same_params` -- what the step replays of the optimizers (fastamp.optim._replay,
  fastamp.optim._flat) and of the scaler (fastamp.scaler._grads) check first: the param groups
  and their params are the ones the replay was built from;
* :func:`to_device` -- the step's small device tensors (scales, flags, norms) moved where a
  kernel reads them.
"""

from __future__ import annotations

from itertools import chain
from operator import is_
from typing import Any, overload

import torch
from torch import Tensor


def same_params(
    groups: list[dict[str, Any]], group_dicts: list[dict[str, Any]], params: list[Tensor]
) -> list[Tensor] | None:
    """The params of ``groups`` in order (the group's own list when there is one group: read it,
    do not keep or change it), or None when a group dict or a param is not the one a replay
    recorded (``group_dicts``, ``params``, compared by identity at C speed)."""
    if len(groups) == 1:
        if len(group_dicts) != 1 or groups[0] is not group_dicts[0]:
            return None
        current: list[Tensor] = groups[0]["params"]
    else:
        if len(groups) != len(group_dicts) or not all(map(is_, groups, group_dicts)):
            return None
        current = list(chain.from_iterable(grp["params"] for grp in groups))
    if len(current) != len(params) or not all(map(is_, current, params)):
        return None
    return current


@overload
def to_device(t: Tensor, device: torch.device) -> Tensor: ...
@overload
def to_device(t: Tensor | None, device: torch.device) -> Tensor | None: ...


def to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device``, without a copy when it is already there (no sync either way); None
    stays None."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)
