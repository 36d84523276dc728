"""What one optimizer family (Adam/AdamW, SGD) is, as data the step, its checks and the state-dict
load read: its state keys, its group options, the state it requires, and what PyTorch's
counterpart says of a sparse grad. One :class:`OptimizerFamily` per family; the optimizer classes
hold one and hand it to the checks explicitly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastamp.optim import lowbit
from fastamp.optim.lowbit import FLOAT32, StateFormat


@dataclass(frozen=True)
class OptimizerFamily:
    label: str  # what its state_dicts are called in errors
    moments: tuple[str, ...]  # the state keys a StateFormat stores
    elementwise: tuple[str, ...]  # every per-element state key (moments included)
    group_keys: tuple[str, ...]  # hyperparameters a loaded param group must carry
    sparse: tuple[str, str]  # PyTorch's error for a sparse grad, and what to do instead
    amsgrad: bool  # whether groups have an amsgrad option (a float32 running maximum)
    momentum_gated: bool  # SGD: moments only with momentum != 0
    step_in_state: bool  # whether PyTorch's state of a param always has "step"

    def moments_of(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The moments ``group`` keeps (none for momentum-free SGD)."""
        if self.momentum_gated and group["momentum"] == 0:
            return ()
        return self.moments

    def elementwise_of(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """Every per-element state key ``group`` keeps."""
        if self.momentum_gated and group["momentum"] == 0:
            return ()
        if self.amsgrad and not group.get("amsgrad"):
            return tuple(k for k in self.elementwise if k != "max_exp_avg_sq")
        return self.elementwise

    def required(self, state: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[str, ...]:
        """Non-moment keys a state with moments must hold (the moments' own keys are the
        format's to check)."""
        if (
            self.amsgrad
            and group.get("amsgrad")
            and lowbit.format_of(state, self.moments) is not None
        ):
            return ("max_exp_avg_sq",)
        return ()

    def needs_step(self, state: Mapping[str, Any]) -> bool:
        """Whether a non-empty state must carry ``step`` (PyTorch's Adam.__setstate__ reads it)."""
        return self.step_in_state and len(state) > 0

    def group_format(self, group: Mapping[str, Any], where: str) -> StateFormat:
        """The format of ``group``'s moments (its params' where :meth:`StateFormat.applies_to`)."""
        if not self.moments_of(group):
            return FLOAT32
        return lowbit.resolve(group.get("state_dtype", FLOAT32), where, self.moments)

    def check_group_options(self, where: str, options: Mapping[str, Any], fmt: StateFormat) -> None:
        """Raises for options that cannot go with ``fmt`` (run when a group is made, and again
        before a step: param groups are dicts a user may edit)."""
        if "state_seed" in options:  # (an int the rounding is keyed by: as the constructor's)
            lowbit.check_seed(options["state_seed"], f"{where}: ['state_seed']")
        if self.amsgrad and fmt.lowbit and options.get("amsgrad"):
            raise ValueError(
                f"{where}: amsgrad=True needs float32 state (it keeps the running maximum of "
                f"exp_avg_sq exactly), but the group's state_dtype is {fmt.name!r}: use "
                "state_dtype=torch.float32 with amsgrad"
            )


ADAM = OptimizerFamily(
    label="Adam/AdamW", moments=lowbit.ADAM_MOMENTS,
    elementwise=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    group_keys=("lr", "betas", "eps", "weight_decay"),
    sparse=("Adam does not support sparse gradients, please consider SparseAdam instead",
            "put these parameters in a torch.optim.SparseAdam"),
    amsgrad=True, momentum_gated=False, step_in_state=True,
)  # fmt: skip

SGD = OptimizerFamily(
    label="SGD", moments=lowbit.SGD_MOMENTS, elementwise=("momentum_buffer",),
    group_keys=("lr", "momentum", "dampening", "weight_decay"),
    sparse=("SGD does not support sparse gradients",
            "use torch.optim.SGD for these parameters (it takes sparse grads)"),
    amsgrad=False, momentum_gated=True, step_in_state=False,
)  # fmt: skip
