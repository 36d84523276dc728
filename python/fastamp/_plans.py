"""What the step plans of the optimizers (fastamp.optim._plan) and of the scaler
(fastamp.scaler._grads) both check first: the param groups and their params are the ones the
plan was built from."""

from __future__ import annotations

from itertools import chain
from typing import Any

from torch import Tensor


def same_params(
    groups: list[dict[str, Any]], group_dicts: list[dict[str, Any]], ids: list[int]
) -> list[Tensor] | None:
    """The params of ``groups`` in order, or None when a group dict or a param (by id) is not
    the one a plan recorded (``group_dicts``, ``ids``)."""
    if len(groups) != len(group_dicts) or any(g is not r for g, r in zip(groups, group_dicts)):
        return None
    params = list(chain.from_iterable(grp["params"] for grp in groups))
    return params if list(map(id, params)) == ids else None
