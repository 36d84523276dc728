"""Fused SGD / Adam / AdamW: one multi-tensor kernel per param group and state format that
unscales, clips and skips on overflow inside the update, driven by device tensors only.

Each class subclasses its ``torch.optim`` namesake, so the constructor (and its ValueErrors), the
param groups, ``state_dict()`` layout, ``add_param_group`` and ``torch.optim.lr_scheduler`` work as
with PyTorch; ``step()`` differs:

* one fused kernel per param group reads each grad once, multiplies it in registers by
  ``inv_scale * clip_coef`` (device tensors handed over by :class:`fastamp.GradScaler`), and updates
  params and state in the same pass;
* on a step whose grads held inf/NaN (``found_inf`` on the device) the kernel writes nothing and the
  step counters do not advance (so Adam's bias correction stays right) -- no host sync decides it;
* ``master_weights=True`` keeps an fp32 copy of fp16/bf16 params (``state["master_param"]``) with
  fp32 optimizer state; the kernel updates the master and writes the half param in the same pass;
* ``state_dtype`` (per param group too) picks the moments' format, :mod:`fastamp.optim.lowbit`.

All or nothing: a param group's options are checked when the group is made (constructor and
``add_param_group``), and every check of a step runs, and every launch's inputs are made, before
the first kernel writes anything.

``optimizer.stepped`` is a device bool tensor: whether the last ``step()`` updated the params.

One concern: the three optimizers and the step they share (each optimizer's launch beside the
loop that runs it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from fastamp.handoff import AmpFusedOptimizer, AmpStep, FlatGrads, PendingClip
from fastamp.optim import _family as family
from fastamp.optim import lowbit
from fastamp.optim._build import AdamLaunches, SgdLaunches, UpdateCounts
from fastamp.optim._family import OptimizerFamily
from fastamp.optim._flat import FlatBuffers
from fastamp.optim._state_dict import StateDictChecks, saved_state_dict
from fastamp.optim._step_checks import StepChecks
from fastamp.optim._stepper import FusedStep, LaunchBuilder, Stepped
from fastamp.optim.lowbit import FLOAT32, StateFormat

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["SGD", "Adam", "AdamW"]

# What a ``state_dtype`` argument may be (lowbit.resolve): torch.float32 / torch.bfloat16, a
# format's name ("int8", ...), a lowbit.StateFormat, or None (float32).
_StateDtype: TypeAlias = torch.dtype | str | StateFormat | None


@dataclass
class _LoadCall:
    """One ``load_state_dict`` call's work, from its check to its post-hook: each param's
    state as it goes in, and each group's own fastamp options (kept over the saved ones)."""

    prepared: list[tuple[Tensor, dict[str, Any]]]
    options: list[dict[str, Any]]


class _FusedOptimizer(AmpFusedOptimizer):
    """What the three optimizers share: their options, the amp-scaling protocol, the step and
    ``load_state_dict``. Composed with the objects that check (:class:`StepChecks`,
    :class:`StateDictChecks`) and its family's data (:class:`OptimizerFamily`), each handed its
    inputs explicitly.

    As :class:`fastamp.handoff.AmpFusedOptimizer`s they take from :class:`fastamp.GradScaler` an
    :class:`fastamp.handoff.AmpStep` (inv_scale, found_inf and a clip coefficient), and from
    torch.amp.GradScaler its ``grad_scale`` / ``found_inf`` (its protocol for fused=True)."""

    # PyTorch's (set by torch.optim.Optimizer.__init__, read here), typed as torch types them.
    # The methods this class overrides call PyTorch's through super(): to mypy this mixin's only
    # base is AmpFusedOptimizer, so those calls carry type: ignore[misc] ("undefined in
    # superclass"); at run time super() is the torch.optim class each optimizer also derives from.
    param_groups: list[dict[str, Any]]
    state: defaultdict[Tensor, Any]
    defaults: dict[str, Any]
    register_load_state_dict_post_hook: Callable[..., Any]
    register_state_dict_post_hook: Callable[..., Any]
    # torch's ordered registry of load_state_dict pre-hooks (fastamp's check is kept last).
    _optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]]

    _FAMILY: OptimizerFamily  # set by each optimizer class
    # fastamp's options (beside PyTorch's, which live in ``defaults`` and the param groups).
    _master_weights: bool
    _default_format: StateFormat
    _default_seed: int
    _flat_buffers: bool
    _step_checks: StepChecks
    _load_checks: StateDictChecks
    # The step (fastamp.optim._stepper): its replay of the last full step, and with
    # flat_buffers=True the params' flat layout.
    _stepper: FusedStep
    # What ``stepped`` is made from: the last step's found_inf (None: an unconditional step) and
    # its device, or None before any step; the compare is made when ``stepped`` is first read.
    _stepped_from: Stepped | None
    _stepped_value: Tensor | None
    # fastamp's state-dict hooks, registered once per optimizer (_register_hooks); the load
    # check's handle, kept last among the pre-hooks; each thread's load in progress (its
    # checked state and the groups' own options), from the check to the post-hook.
    _load_check_handle: RemovableHandle | None
    _loads: dict[int, _LoadCall]

    # Each optimizer class's method: its family's launch builder (fastamp.optim._build).
    _launches: Callable[[], LaunchBuilder]

    def _fastamp_setup(
        self, master_weights: bool, state_dtype: Any, state_seed: Any, flat_buffers: Any = False
    ) -> None:
        """Before PyTorch's constructor, which makes the param groups with add_param_group."""
        name = type(self).__name__
        if not isinstance(flat_buffers, bool):
            raise TypeError(
                f"fastamp.optim.{name}: flat_buffers must be True or False, got {flat_buffers!r}"
            )
        self._flat_buffers = flat_buffers
        self._master_weights = bool(master_weights)
        self._default_format = lowbit.resolve(
            state_dtype, f"fastamp.optim.{name}", self._FAMILY.moments
        )
        self._default_seed = lowbit.check_seed(state_seed, f"fastamp.optim.{name}")
        if flat_buffers and self._default_format.lowbit:
            raise ValueError(
                f"fastamp.optim.{name}: flat_buffers=True keeps float32 moments; got "
                f"state_dtype={self._default_format.name}. Expected state_dtype=torch.float32 "
                "with flat_buffers=True, or flat_buffers=False for low-precision state"
            )
        self._make_parts()
        self._stepped_from = None
        self._stepped_value = None

    def _make_parts(self) -> None:
        """The objects the optimizer composes (made again after unpickling)."""
        name = type(self).__name__
        self._step_checks = StepChecks(name, self._FAMILY, self._master_weights)
        self._load_checks = StateDictChecks(name, self._FAMILY, self._master_weights)
        self._stepper = FusedStep(
            name, self._FAMILY, self._step_checks, self._launches(), self._flat_buffers
        )

    def _fastamp_defaults(self) -> None:
        """After PyTorch's constructor: a low-precision default is in ``defaults`` as well; with
        ``flat_buffers=True`` the params become views of the flat buffers."""
        if self._default_format.lowbit:
            self.defaults["state_dtype"] = self._default_format.name
            self.defaults["state_seed"] = self._default_seed
        if self._flat_buffers:
            self._flat_layout()
        self._register_hooks()

    def _register_hooks(self) -> None:
        """fastamp's parts of ``state_dict`` and ``load_state_dict``, as hooks registered once
        (registering per call mutated torch's hook registry under other threads' calls): the
        load's check runs after the user's pre-hooks (it sees the dict as they leave it) and
        its result is put in place before the user's post-hooks run; ``state_dict``'s part runs
        before the user's post-hooks (they see the dict as returned, and may return another)."""
        self._loads = {}
        self._load_check_handle = None
        self._load_check_handle = self.register_load_state_dict_pre_hook(self._load_check)
        self.register_load_state_dict_post_hook(self._load_put, prepend=True)
        self.register_state_dict_post_hook(self._state_dict_post, prepend=True)

    def register_load_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """torch's; fastamp's own check stays the last pre-hook."""
        handle: RemovableHandle = super().register_load_state_dict_pre_hook(  # type: ignore[misc]
            hook, prepend=prepend
        )
        own = self.__dict__.get("_load_check_handle")
        if own is not None and own.id in self._optimizer_load_state_dict_pre_hooks:
            self._optimizer_load_state_dict_pre_hooks.move_to_end(own.id)
        return handle

    def __getstate__(self) -> dict[str, Any]:
        # PyTorch keeps defaults, state and param_groups; fastamp's options go along.
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        state.pop("_stepper", None)  # its replay and flat layout: remade by the first step
        state.pop("_step_checks", None)
        state.pop("_load_checks", None)
        state.pop("_load_check_handle", None)
        state.pop("_loads", None)
        state.pop("_stepped_from", None)  # kept as what it gives, `stepped`
        state.pop("_stepped_value", None)
        state.update(
            _master_weights=self._master_weights,
            _default_format=self._default_format,
            _default_seed=self._default_seed,
            _flat_buffers=self._flat_buffers,
            stepped=self.stepped,
            pending_clip=self.pending_clip,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict ends in __setstate__ on the live optimizer: the replay and
        # the flat layout are remade (load_state_dict makes the layout again), the rest stays.
        live = "_stepper" in self.__dict__
        super().__setstate__(state)  # type: ignore[misc]
        if live:
            self._stepper.replay = None
            self._stepper.flat = None
            self._stepper.flat_grads_cache = None
            self._stepped_from, self._stepped_value = None, None
            return
        self.__dict__.setdefault("_master_weights", False)
        self.__dict__.setdefault("_default_format", FLOAT32)
        self.__dict__.setdefault("_default_seed", 0)
        stepped = self.__dict__.pop("stepped", None)  # kept as the tensor it was
        self._stepped_from = None
        self._stepped_value = stepped
        self.__dict__.setdefault("_flat_buffers", False)
        for stale in ("_plan", "_flat", "_flat_handoff"):  # (pickles of earlier releases)
            self.__dict__.pop(stale, None)
        self._make_parts()
        self._register_hooks()  # (torch's __setstate__ made its hook registries anew)

    def _group_format(self, group: dict[str, Any]) -> StateFormat:
        """The format of ``group``'s moments (its params' when :meth:`StateFormat.applies_to`)."""
        return self._FAMILY.group_format(group, f"fastamp.optim.{type(self).__name__}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``set_to_none=False`` the grads are zeroed by one
        ``torch._foreach_zero_`` per device and dtype, as torch does for its fused and foreach
        optimizers (a fastamp optimizer is fused, but its ``defaults`` keep torch's
        ``fused=None``, which would make torch's method zero them one by one)."""
        self.pending_clip = None  # the clip was of these grads
        if self._flat_buffers and not torch.compiler.is_compiling():
            # The views stay: set_to_none would make autograd allocate new grads.
            self._flat_layout().zero_grad(set_to_none)
            return
        if set_to_none:
            super().zero_grad(set_to_none=True)  # type: ignore[misc]
            return
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        with torch.autograd.profiler.record_function(
            f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        ):
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    if g.is_sparse:
                        g.zero_()
                    else:
                        grads.setdefault((g.device, g.dtype), []).append(g)
            for same in grads.values():
                torch._foreach_zero_(same)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """PyTorch's ``add_param_group``, with fastamp's options (``state_dtype``, ``state_seed``)
        checked and normalised, and every option checked against them, before the group is added."""
        if isinstance(param_group, dict):
            where = f"fastamp.optim.{type(self).__name__}: param group {len(self.param_groups)}"
            given = "state_dtype" in param_group or "state_seed" in param_group
            fmt = lowbit.resolve(
                param_group.get("state_dtype", self._default_format), where, self._FAMILY.moments
            )
            seed = lowbit.check_seed(param_group.get("state_seed", self._default_seed), where)
            options = {**self.defaults, **param_group}
            if options.get("differentiable"):
                raise ValueError(
                    f"{where}: fastamp.optim.{type(self).__name__} does not support "
                    f"differentiable=True; use torch.optim.{type(self).__name__}"
                )
            self._FAMILY.check_group_options(where, options, fmt)
            if fmt.lowbit and self._flat_buffers:
                raise ValueError(
                    f"{where}: flat_buffers=True keeps float32 moments; got state_dtype="
                    f"{fmt.name}. Expected a float32 group, or flat_buffers=False"
                )
        super().add_param_group(param_group)  # type: ignore[misc]
        stepper = self.__dict__.get("_stepper")  # (None while torch's constructor adds groups)
        if stepper is not None:
            stepper.replay = None
            if stepper.flat is not None:  # the new params become views before their first backward
                try:
                    self._flat_layout()  # checks every param before it re-points any
                except BaseException:
                    self.param_groups.pop()  # refused: the group is not added (all or nothing)
                    raise
        if isinstance(param_group, dict) and (fmt.lowbit or given):
            param_group["state_dtype"] = fmt.name
            param_group["state_seed"] = seed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """PyTorch's ``load_state_dict``, with the dict checked before anything is replaced.

        PyTorch checks only the number and sizes of the param groups; a dict of another model or
        optimizer type loads, and the step after it fails (or the load itself fails halfway, in
        ``__setstate__``, with the state already replaced). Here such a dict raises first, naming
        the entry. The moments are then taken as saved (PyTorch casts every tensor to the param's
        dtype, 8-bit codes included) and converted to the format this optimizer's param groups
        were made with (``state_dtype``; they keep theirs over the saved ones), laid out as the
        params are: a float32 state_dict loads into an 8-bit/bfloat16 optimizer and back. With
        ``master_weights=True`` the fp32 state of fp16/bf16 params stays fp32.
        """
        name = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"fastamp.optim.{name}.load_state_dict: state_dict must be the dict returned by "
                f"optimizer.state_dict(), got {type(state_dict).__name__}"
            )
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            self._loads.pop(threading.get_ident(), None)
        if self._flat_buffers:
            self._flat_layout()

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's ``state_dict``; the 8-bit state of a DTensor (sharded) param is given as its
        float32 moments, DTensors laid out as the param, under PyTorch's keys.

        8-bit codes are scaled per block of this rank's shard: saved as they are, the block
        scales would be a different tensor on every rank under one name, which
        ``torch.distributed.checkpoint`` can neither tell apart nor reshard. Decoded moments
        reshard like any DTensor, and :meth:`load_state_dict` encodes them again (the codec
        maps its own decoded values back to the same codes and scales)."""
        # fastamp's part runs as a post-hook put before the user's (_register_hooks).
        sd: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        return sd

    def _load_check(self, optimizer: Any, sd: Mapping[str, Any]) -> None:
        """The load's pre-hook: everything the load puts in place is made here, before PyTorch
        replaces anything, from the dict as the user's pre-hooks left it."""
        self._load_checks.check(self.param_groups, sd)
        self._loads[threading.get_ident()] = _LoadCall(
            self._load_checks.prepare(self.param_groups, sd),
            [{k: g[k] for k in ("state_dtype", "state_seed") if k in g} for g in self.param_groups],
        )

    def _load_put(self, optimizer: Any) -> None:
        """The load's post-hook, before the user's: they see (and may change) the state as
        loaded."""
        call = self._loads.pop(threading.get_ident(), None)
        if call is None:  # (a load that did not pass through the check: nothing of fastamp's)
            return
        self._stepper.replay = None
        for group, opts in zip(self.param_groups, call.options):
            group.pop("state_dtype", None)
            group.pop("state_seed", None)
            group.update(opts)
        for p, final in call.prepared:
            state = self.state[p]
            for key in lowbit.moment_keys(self._FAMILY.moments):
                state.pop(key, None)
            state.update(final)
        self._after_load()

    def _state_dict_post(self, optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return self._own_state_dict(sd)

    def _own_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """torch's state_dict as fastamp returns it (see :meth:`state_dict`)."""
        params = [p for group in self.param_groups for p in group["params"]]
        counts = [self._update_count(p, self.state.get(p) or {}) for p in params]
        return saved_state_dict(sd, params, counts, self._FAMILY.moments)

    def _update_count(self, p: Tensor, state: Mapping[str, Any]) -> Any:
        """How many updates ``p``'s state has had (a number or a one-element tensor; None:
        unknown): Adam's ``step``."""
        return state.get("step")

    def _after_load(self) -> None:
        """What an optimizer resets after a load (SGD: its update counts)."""

    def check_state_dict(self, sd: Mapping[str, Any]) -> None:
        """fastamp extra: raises what :meth:`load_state_dict` would raise for ``sd`` (naming the
        entry), changing nothing."""
        self._load_checks.check(self.param_groups, sd)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step. With ``torch.amp.GradScaler``, reads its ``grad_scale``/``found_inf``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        amp = self.amp_step
        clip = self.pending_clip
        if clip is not None:  # from fastamp.clip_grad_norm_, the scaler-free clip
            current = clip.current()
            self._check_pending_clip(clip, amp, current)
            if current:
                self._fastamp_step(None, clip.amp.found_inf, clip.amp.clip_coef)
            # (else no param has a grad left: a pickled copy, say; torch's step does nothing)
            self.pending_clip = None
            self.amp_step = None
        elif amp is not None:  # from fastamp.GradScaler, for this step only
            self.amp_step = None  # (a closure that steps again gets none)
            self._fastamp_step(amp.inv_scale, amp.found_inf, amp.clip_coef)
        else:  # torch.amp.GradScaler's protocol for optimizers that unscale themselves
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            self._fastamp_step(inv_scale, found_inf, None)
        return loss

    def _check_pending_clip(self, clip: PendingClip, amp: AmpStep | None, current: bool) -> None:
        """Raises, changing nothing, when the clip coefficient ``fastamp.clip_grad_norm_`` left
        cannot be applied as torch's clip would have applied it."""
        name = f"fastamp.optim.{type(self).__name__}.step"
        if amp is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                f"{name}: fastamp.clip_grad_norm_ measured this optimizer's grads, and a "
                "GradScaler is stepping it: the grads were scaled, so that norm was of the scaled "
                "grads. Expected scaler.clip_grad_norm_(optimizer, max_norm) with a GradScaler, "
                "fastamp.clip_grad_norm_ without one"
            )
        if not current and any(p.grad is not None for p in clip.params):
            raise RuntimeError(
                f"{name}: a grad was written or replaced after fastamp.clip_grad_norm_ measured "
                "it. fastamp applies the clip coefficient inside the step (the grads are only "
                "read by the clip), so a change made between clip and step would be clipped "
                "with a stale coefficient. Expected clip_grad_norm_ after the last change to the "
                "grads (call it again now), or optimizer.zero_grad() to drop it"
            )

    def _fastamp_step(
        self, inv_scale: Tensor | None, found_inf: Tensor | None, clip_coef: Tensor | None
    ) -> None:
        stepped = self._stepper.run(
            self.param_groups, self.state, AmpStep(inv_scale, found_inf, clip_coef)
        )
        self._stepped_from, self._stepped_value = stepped, None

    def _flat_layout(self, grads_only: bool = False) -> FlatBuffers:
        return self._stepper.flat_layout(self.param_groups, self.state, grads_only)

    def amp_flat_grads(self) -> FlatGrads | None:
        """With ``flat_buffers=True``: the flat grad buffers, once every grad is its view (a grad
        that is another tensor is copied in first); None when this step is per parameter."""
        return self._stepper.flat_grads(self.param_groups, self.state)

    @property
    def stepped(self) -> Tensor | None:
        """A device bool tensor: whether the last ``step()`` updated the params (``found_inf
        == 0``, made when first read after that step; no sync); None before any step."""
        if self._stepped_value is None and self._stepped_from is not None:
            found_inf, dev = self._stepped_from
            self._stepped_value = (
                torch.ones((), dtype=torch.bool, device=dev)
                if found_inf is None
                else found_inf == 0
            )
        return self._stepped_value

    @stepped.setter
    def stepped(self, value: Tensor | None) -> None:
        self._stepped_from, self._stepped_value = None, value


class _AdamBase(_FusedOptimizer):
    _FAMILY = family.ADAM
    _decoupled: bool

    def _launches(self) -> LaunchBuilder:
        return AdamLaunches(self._master_weights, self._decoupled)


class Adam(_AdamBase, torch.optim.Adam):
    """Fused :class:`torch.optim.Adam` (see the module docstring); ``master_weights``,
    ``state_dtype``, ``state_seed`` and ``flat_buffers`` are extra."""

    _decoupled = False

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, master_weights: bool = False,
                 state_dtype: _StateDtype = torch.float32, state_seed: int = 0,
                 flat_buffers: bool = False) -> None:  # fmt: skip
        self._fastamp_setup(master_weights, state_dtype, state_seed, flat_buffers)
        torch.optim.Adam.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastamp_defaults()


class AdamW(_AdamBase, torch.optim.AdamW):
    """Fused :class:`torch.optim.AdamW` (see the module docstring); ``master_weights``,
    ``state_dtype``, ``state_seed`` and ``flat_buffers`` are extra."""

    _decoupled = True

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False, state_dtype: _StateDtype = torch.float32,
                 state_seed: int = 0, flat_buffers: bool = False) -> None:  # fmt: skip
        self._fastamp_setup(master_weights, state_dtype, state_seed, flat_buffers)
        torch.optim.AdamW.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_defaults()


class SGD(_FusedOptimizer, torch.optim.SGD):
    """Fused :class:`torch.optim.SGD` (see the module docstring); ``master_weights``,
    ``state_dtype`` (float32 or bfloat16 momentum buffers) and ``state_seed`` are extra.

    The number of updates each param has had lives on the device (``state["step"]`` is not part of
    PyTorch's SGD state, so it is kept beside it): it tells the kernel when a momentum buffer gets
    its first value, exactly as PyTorch's ``None`` buffer does, even when that step is skipped.
    With bfloat16 buffers it is saved in the state (it keys their rounding), so a resumed run
    draws the same bits.
    """

    _FAMILY = family.SGD
    # Each param's update count (fastamp.optim._build.UpdateCounts; its launches keep it).
    _counts: UpdateCounts

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False, state_dtype: _StateDtype = torch.float32,
                 state_seed: int = 0) -> None:  # fmt: skip
        self._counts = UpdateCounts()
        self._fastamp_setup(master_weights, state_dtype, state_seed)
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_defaults()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_counts"] = self._counts
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_stepper" not in self.__dict__:  # unpickling (not torch's load_state_dict)
            counts = state.get("_counts")
            if not isinstance(counts, UpdateCounts):  # a pickle of an earlier release
                counts = UpdateCounts()
                updates = state.pop("_updates", None) or {}
                counts.known = {p: n for p, n in updates.items() if isinstance(n, tuple)}
                state["_counts"] = counts
            self._counts = counts
        super().__setstate__(state)

    def _launches(self) -> LaunchBuilder:
        return SgdLaunches(self._master_weights, self._counts)

    def _after_load(self) -> None:
        self._counts.known = {}

    def _update_count(self, p: Tensor, state: Mapping[str, Any]) -> Any:
        """SGD's count: the one kept beside the state for these state tensors (or in it, with
        bfloat16 buffers)."""
        return self._counts.update_count(p, state)
