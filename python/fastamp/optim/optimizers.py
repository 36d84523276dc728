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

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import is_
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import Tensor

from fastamp._library import backend_keyset, direct_call_allowed
from fastamp._sharding import is_dtensor, local, local_param, local_state, wrap_like
from fastamp._step import to_device
from fastamp.handoff import AmpFusedOptimizer, AmpStep, FlatGrads, PendingClip
from fastamp.optim import _family as family
from fastamp.optim import _ops, lowbit
from fastamp.optim._family import OptimizerFamily
from fastamp.optim._flat import FlatBuffers, FlatSegment
from fastamp.optim._layout import grad_like, kernel_view
from fastamp.optim._plan import PlannedLaunch, StepPlan
from fastamp.optim._state_dict import StateDictChecks
from fastamp.optim._step_checks import StepChecks
from fastamp.optim.lowbit import FLOAT32, INT8, StateFormat

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["SGD", "Adam", "AdamW"]

# What a ``state_dtype`` argument may be (lowbit.resolve): torch.float32 / torch.bfloat16, a
# format's name ("int8", ...), a lowbit.StateFormat, or None (float32).
_StateDtype: TypeAlias = torch.dtype | str | StateFormat | None


@dataclass
class _Launch:
    """One kernel launch of a step, made before any launch runs: ``call(grads, group, amp)``
    writes ``kparams`` and the state tensors (all listed in ``written``; new ones in ``news``),
    reading the group's hyper-parameters when it runs; after it the state in ``news`` is
    committed. ``held_call(held, grads, group, amp, keyset)`` is the same launch through the op's
    ``_held_`` variant, with ``held`` holding ``lists`` (every list of the op but the grads, in
    its schema order): what a step plan repeats (``keyset``: the backend kernel to call directly,
    or None for the dispatcher, see fastamp._library.call_direct)."""

    call: Callable[[list[Tensor], dict[str, Any], AmpStep], None]
    held_call: Callable[[_ops.HeldTensors, list[Tensor], dict[str, Any], AmpStep, Any], None]
    lists: tuple[list[Tensor], ...]
    g: int
    group: dict[str, Any]
    params: list[Tensor]
    places: list[int]
    kparams: list[Tensor]
    grads: list[Tensor]
    written: list[Tensor]
    news: list[dict[str, Any]]
    moments: tuple[str, ...]
    staged: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    counts: dict[Tensor, Tensor] = field(default_factory=dict)

    def run(self, amp: AmpStep) -> None:
        self.call(self.grads, self.group, amp)

    def plannable(self) -> bool:
        """Whether a later step can repeat this launch as it is: it made no state, staged no
        param, took every grad as it is, and its params are plain tensors."""
        return (
            not self.staged
            and all(g is p.grad for g, p in zip(self.grads, self.params))
            and not self.counts
            and not any(self.news)
            and not any(is_dtensor(p) for p in self.params)
        )


def _written(*lists: list[Tensor]) -> list[Tensor]:
    """What a launch writes, for the write counters (increment_version skips inference tensors,
    which keep none)."""
    return [t for ts in lists for t in ts]


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
    register_load_state_dict_pre_hook: Callable[..., Any]
    register_load_state_dict_post_hook: Callable[..., Any]
    register_state_dict_post_hook: Callable[..., Any]

    _FAMILY: OptimizerFamily  # set by each optimizer class
    # Each optimizer's: the launch of one group's params of one state format, made before any
    # launch runs: (fmt, g, group, params, places) -> _Launch.
    _launch: Callable[..., _Launch]
    # fastamp's options (beside PyTorch's, which live in ``defaults`` and the param groups).
    _master_weights: bool
    _default_format: StateFormat
    _default_seed: int
    _step_checks: StepChecks
    _load_checks: StateDictChecks
    # What ``stepped`` is made from: the last step's found_inf (None: an unconditional step) and
    # its device, or None before any step; the compare is made when ``stepped`` is first read.
    _stepped_from: tuple[Tensor | None, torch.device] | None
    _stepped_value: Tensor | None
    # The steady state's launches (fastamp.optim._plan), or None: the next step is a full one.
    _plan: StepPlan | None
    # flat_buffers=True (Adam/AdamW): the params' flat layout (fastamp.optim._flat), made by the
    # constructor and remade when it no longer holds; None when not asked for (or unpickled).
    _flat_buffers: bool
    _flat: FlatBuffers | None
    _flat_handoff: FlatGrads | None

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
        self._flat = None
        self._flat_handoff = None
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
        self._step_checks = StepChecks(name, self._FAMILY, self._master_weights)
        self._load_checks = StateDictChecks(name, self._FAMILY, self._master_weights)
        self._stepped_from = None
        self._stepped_value = None
        self._plan = None

    def _fastamp_defaults(self) -> None:
        """After PyTorch's constructor: a low-precision default is in ``defaults`` as well; with
        ``flat_buffers=True`` the params become views of the flat buffers."""
        if self._default_format.lowbit:
            self.defaults["state_dtype"] = self._default_format.name
            self.defaults["state_seed"] = self._default_seed
        if self._flat_buffers:
            self._flat_layout()

    def __getstate__(self) -> dict[str, Any]:
        # PyTorch keeps defaults, state and param_groups; fastamp's options go along.
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        state.pop("_plan", None)  # rebuilt by the first step
        state.pop("_flat", None)  # remade from the params by the first step
        state.pop("_flat_handoff", None)
        state.pop("_stepped_from", None)  # kept as what it gives, `stepped`
        state.pop("_stepped_value", None)
        state.update(
            _master_weights=self._master_weights,
            _default_format=self._default_format,
            _default_seed=self._default_seed,
            stepped=self.stepped,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.__dict__.setdefault("_master_weights", False)
        self.__dict__.setdefault("_default_format", FLOAT32)
        self.__dict__.setdefault("_default_seed", 0)
        stepped = self.__dict__.pop("stepped", None)  # kept as the tensor it was
        self._stepped_from = None
        self._stepped_value = stepped
        self.__dict__.setdefault("_flat_buffers", False)
        self._plan = None
        self._flat = None
        self._flat_handoff = None
        name = type(self).__name__
        self._step_checks = StepChecks(name, self._FAMILY, self._master_weights)
        self._load_checks = StateDictChecks(name, self._FAMILY, self._master_weights)

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
        self._plan = None
        if self._flat is not None:  # the new params become views before their first backward
            self._flat_layout()
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
        prepared: list[tuple[Tensor, dict[str, Any]]] = []
        options: list[dict[str, Any]] = [
            {k: g[k] for k in ("state_dtype", "state_seed") if k in g} for g in self.param_groups
        ]

        def check(optimizer: Any, sd: Mapping[str, Any]) -> None:
            # Registered last, so it sees the dict as the user's pre-hooks left it; everything the
            # load puts in place is made here, before PyTorch replaces anything.
            self._load_checks.check(self.param_groups, sd)
            prepared[:] = self._load_checks.prepare(self.param_groups, sd)

        def put_in_place(optimizer: Any) -> None:
            # A post-hook put before the user's: they see (and may change) the state as loaded.
            self._plan = None
            for group, opts in zip(self.param_groups, options):
                group.pop("state_dtype", None)
                group.pop("state_seed", None)
                group.update(opts)
            for p, final in prepared:
                state = self.state[p]
                for key in lowbit.moment_keys(self._FAMILY.moments):
                    state.pop(key, None)
                state.update(final)
            self._after_load()

        handle = self.register_load_state_dict_pre_hook(check)
        after = self.register_load_state_dict_post_hook(put_in_place, prepend=True)
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            handle.remove()
            after.remove()
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
        # fastamp's part runs as a post-hook put before the user's (they see the dict as it is
        # returned, and may return another).
        hook = self.register_state_dict_post_hook(
            lambda optimizer, sd: self._own_state_dict(sd), prepend=True
        )
        try:
            sd: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        finally:
            hook.remove()
        return sd

    def _own_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """torch's state_dict as fastamp returns it (see :meth:`state_dict`)."""
        params = [p for group in self.param_groups for p in group["params"]]
        moments = self._FAMILY.moments
        state = dict(sd["state"])
        for pid, st in sd["state"].items():
            p = params[pid] if isinstance(pid, int) and pid < len(params) else None
            if p is None or not is_dtensor(p) or lowbit.format_of(st, moments) is not INT8:
                continue
            floats = INT8.decode(local_state(st), moments)
            out = {k: v for k, v in st.items() if k not in lowbit.moment_keys(moments)}
            out.update({k: wrap_like(p, v.reshape(local(p).shape)) for k, v in floats.items()})
            state[pid] = out
        for pid in self._never_updated(params, sd["state"]):
            del state[pid]
        sd["state"] = state
        return sd

    def _update_count(self, p: Tensor, state: Mapping[str, Any]) -> Any:
        """How many updates ``p``'s state has had (a number or a one-element tensor; None:
        unknown): Adam's ``step``."""
        return state.get("step")

    def _never_updated(self, params: list[Tensor], saved: Mapping[Any, Any]) -> list[Any]:
        """The entries of ``saved`` (state_dict()['state']) whose param was never updated: the
        state a fused kernel made for a first step it then skipped (inf/NaN grads). torch's
        optimizers leave no state for a step the scaler skipped, so the state_dict leaves it
        out too (a resumed torch SGD would take a zero momentum buffer for one that had its
        first value). One host read of the counts, per device."""
        by_device: dict[torch.device, list[tuple[Any, Tensor]]] = defaultdict(list)
        never: list[Any] = []
        for pid in saved:
            p = params[pid] if isinstance(pid, int) and pid < len(params) else None
            if p is None:
                continue
            n = self._update_count(p, self.state.get(p) or {})
            if isinstance(n, Tensor) and n.numel() == 1 and not is_dtensor(n):
                by_device[n.device].append((pid, n))
            elif isinstance(n, (int, float)) and n == 0:
                never.append(pid)
        for items in by_device.values():
            counts = torch.stack([n.detach().reshape(()).to(torch.float64) for _, n in items])
            never += [pid for (pid, _), c in zip(items, counts.tolist()) if c == 0]
        return never

    def _after_load(self) -> None:
        """What an optimizer resets after a load (SGD: its update counts)."""

    def check_state_dict(self, sd: Mapping[str, Any]) -> None:
        """fastamp extra: raises what :meth:`load_state_dict` would raise for ``sd`` (naming the
        entry), changing nothing."""
        self._load_checks.check(self.param_groups, sd)

    def _master(
        self, p: Tensor, kp: Tensor, state: Mapping[str, Any], new: dict[str, Any]
    ) -> Tensor | None:
        """The fp32 master of ``p`` (with ``master_weights=True``), laid out as ``kp`` (the param
        as the kernel walks it); a new or re-strided one goes into ``new``, which the caller
        commits to the state only once the kernel has run."""
        if not self._master_weights or p.dtype == torch.float32:
            return None
        master = state.get("master_param")
        if master is None or master.stride() != kp.stride():
            src = p if master is None else master
            master = new["master_param"] = torch.empty_like(kp, dtype=torch.float32).copy_(src)
        return master

    def _moments_for(
        self,
        fmt: StateFormat,
        moments: tuple[str, ...],
        like: Tensor,
        state: Mapping[str, Any],
        new: dict[str, Any],
    ) -> Mapping[str, Any]:
        """The state as the kernel takes it for ``fmt``: new zero moments, or the present ones
        converted / re-strided when they are not already in ``fmt`` (into ``new``)."""
        if fmt.holds(state, like, moments):  # the fast path: every step but the first
            return {**state, **new} if new else state
        if lowbit.format_of(state, moments) is None:
            new.update(fmt.new(like, moments))
        else:
            converted = lowbit.convert(state, fmt, like, moments)
            if converted is not None:
                new.update(converted)
        return {**state, **new}

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
        if self._flat_buffers and not torch.compiler.is_compiling():
            self._flat_fastamp_step(inv_scale, found_inf, clip_coef)
            return
        self._per_param_step(inv_scale, found_inf, clip_coef)

    def _per_param_step(
        self, inv_scale: Tensor | None, found_inf: Tensor | None, clip_coef: Tensor | None
    ) -> None:
        plan = self._plan
        if plan is not None and not torch.compiler.is_compiling():
            grads = plan.grads(self.param_groups, self.state)
            if grads is not None and self._planned_step(
                plan, grads, inv_scale, found_inf, clip_coef
            ):
                return
        # The plan is replaced only once a full step ran: one that raised changed nothing.
        self._full_step(inv_scale, found_inf, clip_coef)

    def _planned_step(
        self,
        plan: StepPlan,
        grads: list[list[Tensor]],
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
        clip_coef: Tensor | None,
    ) -> bool:
        """The step through ``plan``; False (nothing written) when its first kernel refuses an
        input: the full step then checks everything and raises what it finds, or steps."""
        amps: dict[torch.device, AmpStep] = {}
        # Straight to the backend kernel when the grads are plain tensors (fastamp._library).
        direct = plan.plain and not torch.is_grad_enabled() and direct_call_allowed()
        for k, (launch, gs) in enumerate(zip(plan.launches, grads)):
            dev = launch.device
            amp = amps.get(dev)
            if amp is None:
                amp = amps[dev] = AmpStep(
                    to_device(inv_scale, dev), to_device(found_inf, dev), to_device(clip_coef, dev)
                )
            try:
                launch.call(gs, launch.group, amp, backend_keyset(dev) if direct else None)
            except (RuntimeError, TypeError, ValueError) as e:
                if k == 0:
                    return False
                # The plan checked every grad before the first launch: not expected.
                raise self._step_checks.kernel_error(e, launch.g, launch.places, first=False) from e
        self._stepped_from, self._stepped_value = (found_inf, plan.launches[0].device), None
        return True

    # ------------------------------------------------------------------ flat buffers
    def _flat_layout(self, grads_only: bool = False) -> FlatBuffers:
        """The flat layout, made anew (values and state copied in) when it no longer holds
        (``grads_only``: for a read of the grads, see :meth:`FlatBuffers.holds`)."""
        flat = self._flat
        if flat is None or not flat.holds(self.param_groups, self.state, grads_only):
            flat = self._flat = FlatBuffers(type(self).__name__, self.param_groups, self.state)
            self._plan = None  # its held tensors may be the old buffers' views
            pos = {id(p): (g, i) for g, grp in enumerate(self.param_groups)
                   for i, p in enumerate(grp["params"])}  # fmt: skip
            members = [[id(flat.inside[m]) for s in flat.segments if s.buffer == b
                        for m in s.members] for b in range(len(flat.grad_buffers))]  # fmt: skip
            self._flat_handoff = FlatGrads(
                tuple(flat.grad_buffers),
                tuple(members),
                tuple([pos[i] for i in ids] for ids in members),
                tuple(len(ids) for ids in members),
            )
        return flat

    def amp_flat_grads(self) -> FlatGrads | None:
        """With ``flat_buffers=True``: the flat grad buffers, once every grad is its view (a grad
        that is another tensor is copied in first); None when this step is per parameter."""
        if not self._flat_buffers or torch.compiler.is_compiling():
            return None
        flat = self._flat_layout(grads_only=True)
        if not flat.usable or not flat.sync_grads(f"fastamp.optim.{type(self).__name__}"):
            return None
        return self._flat_handoff

    def _flat_fastamp_step(
        self, inv_scale: Tensor | None, found_inf: Tensor | None, clip_coef: Tensor | None
    ) -> None:
        """The step over the flat buffers: one launch per segment; a per-parameter step when
        a grad is None or a segment's step counts diverged."""
        flat = self._flat_layout()
        if not flat.usable or not flat.sync_grads(f"fastamp.optim.{type(self).__name__}"):
            had_grad = [p.grad is not None for p in flat.inside]
            self._per_param_step(inv_scale, found_inf, clip_coef)
            flat.after_per_tensor(had_grad)
            return
        if any(seg.call is None for seg in flat.segments):
            # A new layout's first launch takes the state as it is: checked first, as the
            # per-parameter step checks it (e.g. amsgrad switched on with no max_exp_avg_sq:
            # KeyError, as torch's), before any segment is stepped.
            for g, group in enumerate(self.param_groups):
                self._step_checks.params(g, group, self.state)
        amps: dict[torch.device, AmpStep] = {}
        adopted = False
        direct = not torch.is_grad_enabled() and direct_call_allowed()
        for seg in flat.segments:
            dev = seg.param.device
            amp = amps.get(dev)
            if amp is None:
                amp = amps[dev] = AmpStep(
                    to_device(inv_scale, dev), to_device(found_inf, dev), to_device(clip_coef, dev)
                )
            if seg.call is None and self._flat_first_launch(flat, seg, amp):
                adopted = True  # it ran: its state is new
                continue
            seg.call(seg.grads, seg.group, amp, backend_keyset(dev) if direct else None)
            seg.copy_steps()
        if adopted:
            flat.snapshot(self.state)
        # The params are views made with .data: their own write counters are bumped here (what
        # autograd checks when a graph saved one of them).
        torch.autograd.graph.increment_version(flat.inside)
        dev = flat.segments[0].param.device if flat.segments else torch.device("cpu")
        self._stepped_from, self._stepped_value = (found_inf, dev), None

    def _flat_first_launch(self, flat: FlatBuffers, seg: FlatSegment, amp: AmpStep) -> bool:
        """A segment's launch as the full step makes it: with no state yet, it runs once and its
        new state becomes the segment's (True); with state, only the held call is made."""
        fresh = seg.state is None
        launch = self._launch(
            FLOAT32, seg.g, seg.group, [seg.param], seg.places,
            states=[seg.state or {}], grads=[seg.grad],
        )  # fmt: skip
        if fresh:
            try:
                launch.run(amp)
            except (RuntimeError, TypeError, ValueError) as e:
                raise self._step_checks.kernel_error(e, seg.g, seg.places, first=True) from e
            flat.adopt(seg, launch.news[0], self.state)
            launch = self._launch(
                FLOAT32, seg.g, seg.group, [seg.param], seg.places,
                states=[seg.state], grads=[seg.grad],
            )  # fmt: skip
        seg.call = partial(launch.held_call, _ops.HeldTensors(launch.lists))
        seg.grads = [seg.grad]
        return fresh

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

    def _full_step(
        self, inv_scale: Tensor | None, found_inf: Tensor | None, clip_coef: Tensor | None
    ) -> None:
        # Every group is checked, and every launch's inputs made (new and converted state
        # included), before the first kernel runs; a launch's state is committed right after it.
        checks = self._step_checks
        checked = [
            (g, group, *checks.params(g, group, self.state))
            for g, group in enumerate(self.param_groups)
        ]
        checks.shared_memory(checked)
        launches: list[_Launch] = []
        amps: list[AmpStep] = []
        stepped = None
        for g, group, params, places in checked:
            if not params:
                continue
            dev = params[0].device
            amp = AmpStep(
                to_device(inv_scale, dev), to_device(found_inf, dev), to_device(clip_coef, dev)
            )
            by_format: dict[StateFormat, tuple[list[Tensor], list[int]]] = {}
            group_format = self._group_format(group)
            for p, i in zip(params, places):
                fmt = group_format if group_format.applies_to(p) else FLOAT32
                ps, ix = by_format.setdefault(fmt, ([], []))
                ps.append(p)
                ix.append(i)
            for fmt, (ps, ix) in sorted(by_format.items(), key=lambda kv: kv[0].lowbit):
                launches.append(self._launch(fmt, g, group, ps, ix))
                amps.append(amp)
            if stepped is None:
                stepped = (found_inf, dev)
        # Params whose state this step makes: launched by format (float32 first), they are put
        # in self.state afterwards in the params' order, as torch's step makes them.
        fresh = [p for launch in launches for p in launch.params if p not in self.state]
        for k, (launch, amp) in enumerate(zip(launches, amps)):
            try:
                launch.run(amp)
            except (RuntimeError, TypeError, ValueError) as e:
                raise checks.kernel_error(e, launch.g, launch.places, first=k == 0) from e
            self._commit(launch)
        if len(launches) > 1 and len(fresh) > 1:
            order = {
                id(p): k for k, p in enumerate(p for g in self.param_groups for p in g["params"])
            }
            for p in sorted((p for p in fresh if p in self.state), key=lambda p: order[id(p)]):
                self.state[p] = self.state.pop(p)  # (the new entries are last: moved in order)
        self._stepped_from, self._stepped_value = stepped, None
        # No plan from a traced step: its held lists would hold FakeTensors, and a compiled step
        # is a graph already.
        plannable = (
            launches
            and all(launch.plannable() for launch in launches)
            and not torch.compiler.is_compiling()
        )
        self._plan = self._make_plan(launches) if plannable else None

    def _make_plan(self, launches: list[_Launch]) -> StepPlan:
        """The plan of a step that made no state: the next steps repeat these launches."""
        params = [p for group in self.param_groups for p in group["params"]]
        position = {id(p): k for k, p in enumerate(params)}
        planned = [
            PlannedLaunch(
                call=partial(launch.held_call, _ops.HeldTensors(launch.lists)),
                g=launch.g,
                group=launch.group,
                places=launch.places,
                index=[position[id(p)] for p in launch.params],
                kparams=launch.kparams,
                written=launch.written,
                device=launch.kparams[0].device,
            )
            for launch in launches
        ]
        return StepPlan(self.param_groups, self.state, planned, params)

    @staticmethod
    def _lr(group: dict[str, Any], device: torch.device) -> tuple[float, Tensor | None]:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return 0.0, lr.to(device=device, dtype=torch.float32, non_blocking=True)
        return float(lr), None

    def _step_tensor(
        self, p: Tensor, state: Mapping[str, Any], new: dict[str, Any], key: str = "step"
    ) -> Tensor:
        step = state.get(key)
        if step is None:
            step = new[key] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif not isinstance(step, Tensor):  # a number (accepted by the checks, as by PyTorch)
            step = new[key] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.device != p.device or step.dtype != torch.float32 or step.dim() != 0:
            # e.g. a state_dict saved by torch.optim (non-fused keeps steps on the CPU)
            step = new[key] = step.to(device=p.device, dtype=torch.float32).reshape(())
        return step

    def _commit(self, launch: _Launch) -> None:
        """After the kernel: copy staged params back, and put the state the launch made in place
        (moments converted to another format drop that format's keys; a DTensor param's new
        state tensors of its local shape become DTensors laid out as it is, as torch keeps it)."""
        for p, kp in launch.staged:
            p.copy_(kp)
        for p, new in zip(launch.params, launch.news):
            if not new:
                continue
            state = self.state[p]
            if any(k in new for k in launch.moments) or any(k.endswith("_codes") for k in new):
                for k in lowbit.moment_keys(launch.moments):
                    if k not in new:
                        state.pop(k, None)
            state.update({k: wrap_like(p, v) for k, v in new.items()})


class _AdamBase(_FusedOptimizer):
    _FAMILY = family.ADAM
    _decoupled: bool

    def _launch(
        self,
        fmt: StateFormat,
        g: int,
        group: dict[str, Any],
        params: list[Tensor],
        places: list[int],
        states: Sequence[Mapping[str, Any] | None] | None = None,
        grads: Sequence[Tensor] | None = None,
    ) -> _Launch:
        """``states`` / ``grads`` (flat buffers) stand for ``self.state[p]`` / ``p.grad``."""
        moments = self._FAMILY.moments
        given_states, given_grads = states, grads
        amsgrad = bool(group["amsgrad"]) and not fmt.lowbit
        kparams, grads, steps, masters = [], [], [], []
        currents: list[Mapping[str, Any]] = []
        max_sqs: list[Tensor] = []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        for k, p in enumerate(params):
            # .get: no entry is created before the kernel ran. A DTensor param (FSDP2) steps as
            # its local shard, with its state's local shards.
            st = self.state.get(p) if given_states is None else given_states[k]
            lp, state = local_param(p, st or {})
            new: dict[str, Any] = {}
            # The step count first: a new state's keys in torch's order (step, exp_avg, ...).
            steps.append(self._step_tensor(lp, state, new))
            kp = kernel_view(lp)
            if kp is not lp:
                staged.append((lp, kp))
            master = self._master(lp, kp, state, new)
            like = master if master is not None else kp
            currents.append(self._moments_for(fmt, moments, like, state, new))
            if amsgrad:
                mx = state.get("max_exp_avg_sq")
                if mx is None:
                    mx = new["max_exp_avg_sq"] = torch.zeros_like(like)
                elif mx.stride() != like.stride():  # re-strided, as the moments
                    mx = new["max_exp_avg_sq"] = torch.empty_like(like).copy_(mx)
                max_sqs.append(mx)
            kparams.append(kp)
            grad = p.grad if given_grads is None else given_grads[k]
            assert grad is not None  # StepChecks.params keeps the params that have a grad
            grads.append(grad_like(grad if lp is p else local(grad), kp))
            if master is not None:
                masters.append(master)
            news.append(new)
        dev = params[0].device
        decoupled = self._decoupled
        ms, vs, ams, avs = fmt.adam_lists(currents)
        written = _written(kparams, ms, vs, ams, avs, max_sqs, steps, masters)

        def hyper_of(group: dict[str, Any]) -> _ops.AdamHyper:
            beta1, beta2 = group["betas"]
            lr, lr_t = self._lr(group, dev)
            return _ops.AdamHyper(
                lr,
                lr_t,
                float(beta1),
                float(beta2),
                float(group["weight_decay"]),
                float(group["eps"]),
                bool(group.get("decoupled_weight_decay", decoupled)),
                bool(group["maximize"]),
                amsgrad,
            )

        if fmt.lowbit:
            seed = int(group.get("state_seed", 0))

            def call(gs: list[Tensor], group: dict[str, Any], amp: AmpStep) -> None:
                _ops.adam_lowbit_step_(
                    kparams, gs, ms, vs, ams, avs, steps, masters, seed, hyper_of(group), amp
                )

            def held_call(held: _ops.HeldTensors, gs: list[Tensor], group: dict[str, Any],
                          amp: AmpStep, keyset: Any = None) -> None:  # fmt: skip
                _ops.adam_lowbit_step_held_(held, gs, seed, hyper_of(group), amp, written, keyset)

            lists: tuple[list[Tensor], ...] = (kparams, ms, vs, ams, avs, steps, masters)
        else:

            def call(gs: list[Tensor], group: dict[str, Any], amp: AmpStep) -> None:
                _ops.adam_step_(kparams, gs, ms, vs, max_sqs, steps, masters, hyper_of(group), amp)

            def held_call(held: _ops.HeldTensors, gs: list[Tensor], group: dict[str, Any],
                          amp: AmpStep, keyset: Any = None) -> None:  # fmt: skip
                _ops.adam_step_held_(held, gs, hyper_of(group), amp, written, keyset)

            lists = (kparams, ms, vs, max_sqs, steps, masters)

        return _Launch(
            call, held_call, lists, g, group, params, places, kparams, grads, written, news,
            moments, staged,
        )  # fmt: skip


def _counted_for(state: Mapping[str, Any]) -> tuple[Any, Any]:
    """The state tensors an SGD update count stands for (compared by identity)."""
    return state.get("momentum_buffer"), state.get("step")


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
    # Each param's update count, with the state tensors it counts for (the momentum buffer and
    # a saved count): a state cleared, deleted or replaced since (opt.state.clear(), del
    # opt.state[p]["momentum_buffer"]) makes the count start again as torch's None buffer does.
    _updates: dict[Tensor, tuple[Tensor, Tensor | None, Tensor | None]]

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float | Tensor = 0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False, state_dtype: _StateDtype = torch.float32,
                 state_seed: int = 0) -> None:  # fmt: skip
        self._fastamp_setup(master_weights, state_dtype, state_seed)
        self._updates = {}
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_defaults()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_updates"] = self._updates
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # (A pickle from before the counts kept their state tensors: counted again from them.)
        updates = self.__dict__.get("_updates") or {}
        self._updates = {p: n for p, n in updates.items() if isinstance(n, tuple)}

    def _after_load(self) -> None:
        self._updates = {}

    def _update_count(self, p: Tensor, state: Mapping[str, Any]) -> Any:
        """SGD's count: the one kept beside the state for these state tensors (or in it, with
        bfloat16 buffers)."""
        if "step" in state:
            return state["step"]
        return self._known_count(p, state)

    def _known_count(self, p: Tensor, state: Mapping[str, Any]) -> Tensor | None:
        """The count kept for ``p`` while its state holds the tensors it was kept for."""
        known = self._updates.get(p)
        if known is not None and all(map(is_, _counted_for(state), known[1:])):
            return known[0]
        return None

    def _updates_of(
        self, p: Tensor, state: Mapping[str, Any], new_counts: dict[Tensor, Tensor]
    ) -> Tensor:
        known = self._known_count(p, state)
        if known is not None:
            return known
        saved = state.get("step")  # kept in the state with state_dtype=torch.bfloat16
        if isinstance(saved, Tensor) and saved.numel() == 1:
            n = new_counts[p] = saved.detach().to(device=p.device, dtype=torch.float32).reshape(())
            return n
        # A buffer loaded from a checkpoint (or put in the state by hand) has had its first
        # value already; no buffer: the next update gives it its first.
        first = 0.0 if state.get("momentum_buffer") is None else 1.0
        n = new_counts[p] = torch.full((), first, dtype=torch.float32, device=p.device)
        return n

    def _launch(
        self,
        fmt: StateFormat,
        g: int,
        group: dict[str, Any],
        params: list[Tensor],
        places: list[int],
    ) -> _Launch:
        moments = self._FAMILY.moments_of(group)
        kparams, grads, bufs, counts, masters = [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        new_counts: dict[Tensor, Tensor] = {}
        for p in params:
            # Like torch.optim.SGD, momentum-free SGD keeps no per-param state at all (an entry,
            # even empty, would show up in state_dict()); .get creates none.
            lp, state = local_param(p, self.state.get(p) or {})
            new: dict[str, Any] = {}
            kp = kernel_view(lp)
            if kp is not lp:
                staged.append((lp, kp))
            master = self._master(lp, kp, state, new)
            count = self._updates_of(p, state, new_counts)
            if fmt.lowbit and state.get("step") is not count:
                new["step"] = count  # keys the rounding: saved with the state
            if moments:
                like = master if master is not None else kp
                bufs.append(self._moments_for(fmt, moments, like, state, new)["momentum_buffer"])
            counts.append(count)
            kparams.append(kp)
            grad = p.grad
            assert grad is not None  # StepChecks.params keeps the params that have a grad
            grads.append(grad_like(grad if lp is p else local(grad), kp))
            if master is not None:
                masters.append(master)
            news.append(new)
        dev = params[0].device
        written = _written(kparams, bufs, counts, masters)

        def hyper_of(group: dict[str, Any]) -> _ops.SgdHyper:
            lr, lr_t = self._lr(group, dev)
            return _ops.SgdHyper(
                lr,
                lr_t,
                float(group["weight_decay"]),
                float(group["momentum"]),
                float(group["dampening"]),
                bool(group["nesterov"]),
                bool(group["maximize"]),
            )

        if fmt.lowbit:
            seed = int(group.get("state_seed", 0))

            def call(gs: list[Tensor], group: dict[str, Any], amp: AmpStep) -> None:
                _ops.sgd_lowbit_step_(
                    kparams, gs, bufs, counts, masters, seed, hyper_of(group), amp
                )

            def held_call(held: _ops.HeldTensors, gs: list[Tensor], group: dict[str, Any],
                          amp: AmpStep, keyset: Any = None) -> None:  # fmt: skip
                _ops.sgd_lowbit_step_held_(held, gs, seed, hyper_of(group), amp, written, keyset)
        else:

            def call(gs: list[Tensor], group: dict[str, Any], amp: AmpStep) -> None:
                _ops.sgd_step_(kparams, gs, bufs, counts, masters, hyper_of(group), amp)

            def held_call(held: _ops.HeldTensors, gs: list[Tensor], group: dict[str, Any],
                          amp: AmpStep, keyset: Any = None) -> None:  # fmt: skip
                _ops.sgd_step_held_(held, gs, hyper_of(group), amp, written, keyset)

        return _Launch(
            call, held_call, (kparams, bufs, counts, masters), g, group, params, places, kparams,
            grads, written, news, moments, staged, new_counts,
        )  # fmt: skip

    def _commit(self, launch: _Launch) -> None:
        super()._commit(launch)
        for p, n in launch.counts.items():
            self._updates[p] = (n, *_counted_for(self.state.get(p) or {}))
