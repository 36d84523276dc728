"""Checks of a fused optimizer step, all run before anything is written: every param group's
params, grads and state (:class:`StepChecks`, an object the optimizer owns), and memory shared
between params. An error names the
param group entry, says what was expected and what was found, and leaves params, grads and state
as they were (a retry then steps every group once)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from fastamp._checks import is_real
from fastamp._sharding import is_dtensor, local, local_param, misplaced_state
from fastamp.optim import _ops, lowbit
from fastamp.optim._family import OptimizerFamily
from fastamp.optim._layout import FLOAT_TYPES, where_in_groups

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
    for m in (sys.modules["fastamp"], torch)
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside fastamp and torch (the user's
    ``optimizer.step()`` or ``scaler.step(optimizer)``, however deep the step's path is)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class _Where:
    """``"fastamp.optim.<name>: the state of param_groups[g]['params'][i]"``, formatted when an
    error message is (``str(where)``)."""

    __slots__ = ("name", "g", "i")

    def __init__(self, name: str, g: int, i: int) -> None:
        self.name, self.g, self.i = name, g, i

    def __str__(self) -> str:
        return f"fastamp.optim.{self.name}: the state of {where_in_groups(self.g, self.i)}"


# Devices PyTorch's optimizers take capturable=True on.
_CAPTURABLE = ("cuda", "xpu", "hpu", "privateuseone", "xla")


class StepChecks:
    """The checks of one fused optimizer's step (its name in messages, its family, whether it
    keeps master weights), over param groups and state handed in explicitly."""

    def __init__(self, name: str, family: OptimizerFamily, master_weights: bool) -> None:
        self.name = name
        self.family = family
        self.master_weights = master_weights
        # Whether the float16-without-master-weights warning was given (once per optimizer).
        self.warned_fp16 = False

    def params(
        self, g: int, group: dict[str, Any], state: Mapping[Tensor, dict[str, Any]]
    ) -> tuple[list[Tensor], list[int]]:
        """Params of group ``g`` that have grads, with all that the kernel needs checked: nothing
        is created or written until every group has passed (so an error leaves the params, the
        grads and the state as they were)."""
        name = self.name
        params: list[Tensor] = []
        places: list[int] = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                msg, fix = self.family.sparse
                raise RuntimeError(
                    f"{msg} (fastamp.optim.{name}: {where_in_groups(g, i)} has a sparse grad, e.g. from "
                    f"nn.Embedding(sparse=True); expected dense grads: build the module with "
                    f"sparse=False, or {fix})"
                )
            if p.dtype not in FLOAT_TYPES:
                raise TypeError(
                    f"fastamp.optim.{name}: {where_in_groups(g, i)} has dtype {p.dtype}; the fused kernels "
                    "take float32, float16 and bfloat16 params (expected one of those: convert "
                    "the model, or use torch.optim for others)"
                )
            if p.grad.dtype != p.dtype:
                raise TypeError(
                    f"fastamp.optim.{name}: {where_in_groups(g, i)} of dtype {p.dtype} has a grad of dtype "
                    f"{p.grad.dtype}; expected the same dtype"
                )
            if p.grad.shape != p.shape or p.grad.device != p.device:
                # RuntimeError, as PyTorch's update raises for it ("The size of tensor a ...").
                raise RuntimeError(
                    f"fastamp.optim.{name}: {where_in_groups(g, i)} has shape {tuple(p.shape)} on "
                    f"{p.device} but its grad has shape {tuple(p.grad.shape)} on {p.grad.device}; "
                    "expected a grad of the parameter's shape on its device (was .grad assigned "
                    "by hand?)"
                )
            if is_dtensor(p) or is_dtensor(p.grad):
                self._sharded(g, i, p)
            if params and p.device != params[0].device:
                raise RuntimeError(
                    f"fastamp.optim.{name}: {where_in_groups(g, i)} is on {p.device} but "
                    f"{where_in_groups(g, places[0])} is on {params[0].device}; expected every parameter "
                    "of a param group on one device (one fused launch per group): move the "
                    "model with model.to(device), or put each device's parameters in its own "
                    "param group"
                )
            params.append(p)
            places.append(i)
        if params:
            self._state(g, group, state, params, places)
        return params, places

    def _warn_fp16(self, g: int, params: list[Tensor], places: list[int]) -> None:
        """float16 params updated in place lose every update smaller than half the spacing of
        float16 at the weight (2**-11 of it): at small learning rates most weights never move.
        torch's fused AdamW steps them the same way without a word; this says so, once."""
        i = next((i for p, i in zip(params, places) if p.dtype == torch.float16), None)
        if i is None or torch.compiler.is_compiling():
            return
        self.warned_fp16 = True
        warnings.warn(
            f"fastamp.optim.{self.name}: {where_in_groups(g, i)} is float16 and the optimizer "
            "keeps no master weights, so each update is rounded to float16 in the weight itself: "
            "an update smaller than half a float16 step at the weight (2**-11 of it: 4.9e-4 at "
            "1.0) is lost, not carried to the next step, so at small learning rates (an Adam "
            "update is about lr) the larger weights never change. Pass master_weights=True to "
            "keep a float32 copy that the updates accumulate in (or keep the params float32 "
            "under autocast). Warned once per optimizer.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )

    def _sharded(self, g: int, i: int, p: Tensor) -> None:
        """A DTensor param (FSDP2) steps as its local shard with its grad's local shard: both
        must be DTensors laid out alike."""
        grad = p.grad
        if not (is_dtensor(p) and is_dtensor(grad)):
            raise RuntimeError(
                f"fastamp.optim.{self.name}: {where_in_groups(g, i)} is a "
                f"{type(p).__name__} but its grad is a {type(grad).__name__}; expected both "
                "DTensors (a sharded model's params and grads, as fully_shard makes them) or "
                "both plain tensors"
            )
        if grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
            raise RuntimeError(
                f"fastamp.optim.{self.name}: {where_in_groups(g, i)} is laid out as "
                f"{tuple(p.placements)} on {p.device_mesh} but its grad as "
                f"{tuple(grad.placements)} on {grad.device_mesh}; expected the grad sharded as "
                "its parameter (the fused kernel updates each rank's shard with that shard's "
                "grad)"
            )

    def _state(
        self,
        g: int,
        group: dict[str, Any],
        states: Mapping[Tensor, dict[str, Any]],
        params: list[Tensor],
        places: list[int],
    ) -> None:
        name = self.name
        halves = [i for p, i in zip(params, places) if p.dtype != torch.float32]
        if self.master_weights and halves and len(halves) != len(params):
            fp32 = next(i for p, i in zip(params, places) if p.dtype == torch.float32)
            raise RuntimeError(
                f"fastamp.optim.{name}: with master_weights=True a param group must not mix "
                f"float32 params with float16/bfloat16 ones ({where_in_groups(g, fp32)} is float32, "
                f"{where_in_groups(g, halves[0])} is not); put them in separate param groups"
            )
        if group.get("capturable") and not torch.compiler.is_compiling():
            # PyTorch's single-tensor and foreach steps assert this (an AssertionError there too),
            # except while torch.compile traces, which sets capturable on the groups it traces.
            bad = next(
                ((p, i) for p, i in zip(params, places) if p.device.type not in _CAPTURABLE), None
            )
            if bad is not None:
                raise AssertionError(
                    f"If capturable=True, params and state_steps must be on supported devices: "
                    f"{list(_CAPTURABLE)} (fastamp.optim.{name}: {where_in_groups(g, bad[1])} is on "
                    f"{bad[0].device}; expected capturable=False for parameters on the CPU)"
                )
        fmt = self.family.group_format(
            group, f"fastamp.optim.{name}: param_groups[{g}]['state_dtype']"
        )
        self.family.check_group_options(f"fastamp.optim.{name}: param group {g}", group, fmt)
        moments = self.family.moments_of(group)
        others = tuple(k for k in self.family.elementwise_of(group) if k not in moments)
        for q, i in zip(params, places):
            state: Mapping[str, Any] | None = states.get(
                q
            )  # .get: reading must not create an entry
            if not state:
                continue
            # A DTensor param's state is checked as the kernel takes it: the local shards.
            if is_dtensor(q):
                self._sharded_state(g, i, q, state)
            p, state = local_param(q, state)
            master = self.master_weights and p.dtype != torch.float32
            want = torch.float32 if master else p.dtype
            # Formatted only if a check fails (this runs for every parameter at every step).
            where = _Where(name, g, i)
            # Moments in any format (the step converts and re-strides them), complete.
            lowbit.check_any(state, p, moments, where)
            own = fmt if fmt.applies_to(p) else lowbit.FLOAT32
            if own is lowbit.FLOAT32 and lowbit.format_of(state, moments) is lowbit.FLOAT32:
                for key in moments:
                    v = state.get(key)
                    if isinstance(v, Tensor) and v.dtype != want:
                        _moment_dtype_error(where, key, v, p, master)
            for key in others + (("master_param",) if master else ()):
                v = state.get(key)
                if v is None:
                    if key in self.family.required(state, group):
                        raise KeyError(
                            f"fastamp.optim.{name}: the state of {where_in_groups(g, i)} has no {key!r} "
                            f"(it has {sorted(state)}); expected the state this optimizer creates "
                            "-- was it saved with other settings (e.g. amsgrad)? Load the matching "
                            "state_dict, or clear optimizer.state[param] to start it afresh"
                        )
                    continue
                # Fast path first: this runs for every parameter at every step. Strides are
                # not checked: the step re-strides (PyTorch steps state of any layout).
                if not (
                    isinstance(v, Tensor)
                    and v.shape == p.shape
                    and v.device == p.device
                    and v.dtype == want
                ):
                    _state_error(
                        f"fastamp.optim.{name}: state[{key!r}] of {where_in_groups(g, i)}",
                        v,
                        p,
                        want,
                    )
            step = state.get("step")
            if step is not None and not (
                isinstance(step, Tensor) and step.numel() == 1 or is_real(step)
            ):
                raise TypeError(
                    f"fastamp.optim.{name}: state['step'] of {where_in_groups(g, i)} is {step!r}; expected "
                    "a number or a one-element tensor"
                )
        # Last: a group that fails a check above warns of nothing and records nothing.
        if halves and not self.master_weights and not self.warned_fp16:
            self._warn_fp16(g, params, places)

    def _sharded_state(self, g: int, i: int, p: Tensor, state: Mapping[str, Any]) -> None:
        """The state tensors of a DTensor param's shape must be DTensors laid out as it is."""
        bad = misplaced_state(p, state)
        if bad is not None:
            raise RuntimeError(
                f"fastamp.optim.{self.name}: state[{bad[0]!r}] of {where_in_groups(g, i)} "
                f"is {bad[1]}, but the parameter is a DTensor laid out as "
                f"{tuple(cast('DTensor', p).placements)}; expected its state sharded as it is (load a "
                "sharded model's optimizer state with "
                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict)"
            )

    def shared_memory(
        self, checked: list[tuple[int, dict[str, Any], list[Tensor], list[int]]]
    ) -> None:
        """Refuses params that share memory (see :func:`check_shared_memory`)."""
        check_shared_memory(self.name, checked)

    def kernel_error(
        self, e: Exception, g: int, places: list[int], first: bool = True
    ) -> Exception:
        """The kernel's error, with its list positions named as the param group's entries."""
        where = ", ".join(f"[{k}] = {where_in_groups(g, i)}" for k, i in enumerate(places[:8]))
        more = ", ..." if len(places) > 8 else ""
        try:
            return type(e)(
                f"{e} (fastamp.optim.{self.name}: list positions {where}{more}; "
                "no param group was stepped)"
                if first
                else f"{e} (fastamp.optim.{self.name}: list positions {where}{more})"
            )
        except Exception:  # an exception type that takes other arguments
            return e


def _moment_dtype_error(where: object, key: str, v: Tensor, p: Tensor, master: bool) -> None:
    """Moments of another float dtype than the step keeps them in: a model converted
    (``model.half()``, ``.to(dtype)``) after the optimizer made its state. torch's Adam fails
    at that step (RuntimeError) and its SGD steps on in the old dtype; fastamp refuses rather
    than convert the moments silently."""
    kept = "float32 (master_weights=True)" if master else f"the parameter's dtype {p.dtype}"
    raise RuntimeError(
        f"{where}[{key!r}] is a {v.dtype} tensor, but the step "
        f"keeps it in {kept}: was the model converted (model.half(), .to(dtype)) after the "
        "optimizer made its state? Expected the optimizer made after the conversion, or its "
        "state_dict() loaded again (load_state_dict casts the state to the params' dtype)"
    )


def _state_error(what: str, v: Any, p: Tensor, want: torch.dtype) -> None:
    if not isinstance(v, Tensor):
        raise TypeError(f"{what} is a {type(v).__name__}; expected a tensor like the parameter")
    # RuntimeError for a tensor of another shape, dtype or device: what torch's update raises
    # at that step (its elementwise ops refuse the mismatch).
    if v.shape != p.shape:
        raise RuntimeError(
            f"{what} has shape {tuple(v.shape)} but the parameter has shape {tuple(p.shape)}: "
            "the state belongs to another model (or to parameters in another order). Expected "
            "state made for these parameters: load the state_dict saved with this model, or "
            "start from a fresh optimizer"
        )
    raise RuntimeError(
        f"{what} is a {v.dtype} tensor on {v.device}; expected {want} on {p.device} (the "
        "parameter's device, and float32 with master_weights=True)"
    )


def check_shared_memory(
    name: str, checked: list[tuple[int, dict[str, Any], list[Tensor], list[int]]]
) -> None:
    """Refuses params that share memory -- a view whose own elements overlap (``expand()``),
    or two params over the same elements (overlapping slices of one tensor, a param listed
    twice) -- across all groups, before any is stepped. PyTorch updates such memory once per
    param, in list order; the fused kernels would update it in an unspecified order."""
    if torch.compiler.is_compiling():
        return  # no addresses to compare on FakeTensors; the kernels still check each group
    by_device: dict[torch.device, tuple[list[Tensor], list[tuple[int, int]]]] = {}
    for g, _, params, places in checked:
        for p, i in zip(params, places):
            ts, where = by_device.setdefault(p.device, ([], []))
            ts.append(local(p))
            where.append((g, i))
    for ts, where in by_device.values():
        pair = _ops.shared_memory_pair(ts)
        if not pair:
            continue
        a, b = pair
        if a == b:
            raise RuntimeError(
                f"fastamp.optim.{name}: {where_in_groups(*where[a])} is a view whose elements overlap "
                "in memory (e.g. from expand() or as_strided()), so it cannot be updated in "
                "place (PyTorch's optimizers raise for it too); expected a parameter with its "
                "own storage: nn.Parameter(t.clone())"
            )
        raise RuntimeError(
            f"fastamp.optim.{name}: {where_in_groups(*where[b])} and {where_in_groups(*where[a])} share memory "
            "(overlapping views of one tensor, or one parameter listed twice), so the shared "
            "elements would be updated once per parameter; expected parameters over disjoint "
            "memory: give each its own storage (nn.Parameter(t.clone())) or list it once"
        )
