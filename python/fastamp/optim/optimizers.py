"""Fused SGD / Adam / AdamW: one multi-tensor kernel per param group that unscales, clips and
skips on overflow inside the update, driven by device tensors only.

Each class subclasses its ``torch.optim`` namesake, so the constructor (and its ValueErrors), the
param groups, ``state_dict()`` layout, ``add_param_group`` and ``torch.optim.lr_scheduler`` work as
with PyTorch; only ``step()`` differs:

* one fused kernel per param group reads each grad once, multiplies it in registers by
  ``inv_scale * clip_coef`` (device tensors handed over by :class:`fastamp.GradScaler`), and updates
  params and state in the same pass;
* on a step whose grads held inf/NaN (``found_inf`` on the device) the kernel writes nothing and the
  step counters do not advance (so Adam's bias correction stays right) -- no host sync decides it;
* ``master_weights=True`` keeps an fp32 copy of fp16/bf16 params (``state["master_param"]``) with
  fp32 optimizer state; the kernel updates the master and writes the half param in the same pass.

``optimizer.stepped`` is a device bool tensor: whether the last ``step()`` updated the params.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from fastamp._checks import is_real
from fastamp.handoff import AmpFusedOptimizer, take
from fastamp.optim import _ops

__all__ = ["SGD", "Adam", "AdamW"]

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    if t is None:
        return None
    return t if t.device == device else t.to(device, non_blocking=True)


def _where(g: int, i: int) -> str:
    return f"param_groups[{g}]['params'][{i}]"


def _grad_like(p: Tensor, like: Tensor) -> Tensor:
    """The grad of ``p`` with the strides of ``like`` (the param as the kernel sees it): the kernel
    walks both as one flat span. PyTorch accepts a grad of any layout; a re-strided copy
    (read-only, so a temporary) keeps that working."""
    g = p.grad
    assert g is not None
    return g if g.stride() == like.stride() else torch.empty_like(like).copy_(g)


def _is_dense(p: Tensor) -> bool:
    """Whether the elements of ``p`` are one dense span without overlap (contiguous, a
    permutation of it such as channels_last or a transpose)."""
    if p.is_contiguous():
        return True
    expected = 1  # sorted by stride, each dim must step over exactly the dims below it
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _kernel_view(p: Tensor) -> Tensor:
    """``p`` as the kernel walks it: ``p`` itself when its elements are one dense span, else a
    dense copy laid out as ``torch.empty_like(p)`` lays it out -- the layout PyTorch gives the
    state of such a param (``zeros_like(p, memory_format=torch.preserve_format)``), so state
    and staged param line up. Staged params are copied back after the kernel, as PyTorch's
    in-place update of a strided view (``nn.Parameter(w[:, ::2])``) writes through it."""
    if _is_dense(p):
        return p
    return torch.empty_like(p).copy_(p)


def _state_strides(p: Tensor) -> tuple[int, ...]:
    """The strides the per-element state of ``p`` must have (see :func:`_kernel_view`)."""
    if _is_dense(p):
        return p.stride()
    return torch.empty_like(p, device="meta").stride()


class _FusedStepMixin(AmpFusedOptimizer):
    """What the three optimizers share: the amp-scaling protocol and the group loop.

    As :class:`fastamp.handoff.AmpFusedOptimizer`s they take from :class:`fastamp.GradScaler` an
    :class:`fastamp.handoff.AmpStep` (inv_scale, found_inf and a clip coefficient), and from
    torch.amp.GradScaler its ``grad_scale`` / ``found_inf`` (its protocol for fused=True)."""

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]

    def _fastamp_init(self, master_weights: bool) -> None:
        self._master_weights = bool(master_weights)
        self.stepped: Tensor | None = None
        for group in self.param_groups:
            if group.get("differentiable"):
                raise ValueError(
                    f"fastamp.optim.{type(self).__name__} does not support differentiable=True; "
                    f"use torch.optim.{type(self).__name__}"
                )

    # Per-element state the kernel reads and writes (set by each optimizer), and the group
    # hyperparameters a loaded state_dict must carry (those PyTorch does not default in
    # __setstate__; without them the step fails with a KeyError after the load has replaced
    # the state).
    _ELEMENTWISE: tuple[str, ...] = ()
    _GROUP_KEYS: tuple[str, ...] = ()

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE

    def _check_params(self, g: int, group: dict[str, Any]) -> tuple[list[Tensor], list[int]]:
        """Params of group ``g`` that have grads, with all that the kernel needs checked: nothing
        is created or written until every group has passed (so an error leaves the params, the
        grads and the state as they were)."""
        name = type(self).__name__
        params: list[Tensor] = []
        places: list[int] = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                if name == "SGD":
                    msg = "SGD does not support sparse gradients"
                    fix = "use torch.optim.SGD for these parameters (it takes sparse grads)"
                else:  # PyTorch's Adam and AdamW raise this text
                    msg = "Adam does not support sparse gradients, please consider SparseAdam instead"
                    fix = "put these parameters in a torch.optim.SparseAdam"
                raise RuntimeError(
                    f"{msg} (fastamp.optim.{name}: {_where(g, i)} has a sparse grad, e.g. from "
                    f"nn.Embedding(sparse=True); expected dense grads: build the module with "
                    f"sparse=False, or {fix})"
                )
            if p.dtype not in _FLOAT_TYPES:
                raise TypeError(
                    f"fastamp.optim.{name}: {_where(g, i)} has dtype {p.dtype}; the fused kernels "
                    "take float32, float16 and bfloat16 params (expected one of those: convert "
                    "the model, or use torch.optim for others)"
                )
            if p.grad.dtype != p.dtype:
                raise TypeError(
                    f"fastamp.optim.{name}: {_where(g, i)} of dtype {p.dtype} has a grad of dtype "
                    f"{p.grad.dtype}; expected the same dtype"
                )
            if p.grad.shape != p.shape or p.grad.device != p.device:
                # RuntimeError, as PyTorch's update raises for it ("The size of tensor a ...").
                raise RuntimeError(
                    f"fastamp.optim.{name}: {_where(g, i)} has shape {tuple(p.shape)} on "
                    f"{p.device} but its grad has shape {tuple(p.grad.shape)} on {p.grad.device}; "
                    "expected a grad of the parameter's shape on its device (was .grad assigned "
                    "by hand?)"
                )
            if params and p.device != params[0].device:
                raise RuntimeError(
                    f"fastamp.optim.{name}: {_where(g, i)} is on {p.device} but "
                    f"{_where(g, places[0])} is on {params[0].device}; expected every parameter "
                    "of a param group on one device (one fused launch per group): move the "
                    "model with model.to(device), or put each device's parameters in its own "
                    "param group"
                )
            params.append(p)
            places.append(i)
        if params:
            self._check_state(g, group, params, places)
        return params, places

    def _check_state(self, g: int, group: dict[str, Any], params: list[Tensor],
                     places: list[int]) -> None:
        name = type(self).__name__
        halves = [i for p, i in zip(params, places) if p.dtype != torch.float32]
        if self._master_weights and halves and len(halves) != len(params):
            fp32 = next(i for p, i in zip(params, places) if p.dtype == torch.float32)
            raise RuntimeError(
                f"fastamp.optim.{name}: with master_weights=True a param group must not mix "
                f"float32 params with float16/bfloat16 ones ({_where(g, fp32)} is float32, "
                f"{_where(g, halves[0])} is not); put them in separate param groups"
            )
        keys = self._elementwise_keys(group)
        for p, i in zip(params, places):
            state = self.state.get(p)  # .get: reading must not create an entry
            if not state:
                continue
            master = self._master_weights and p.dtype != torch.float32
            want = torch.float32 if master else p.dtype
            shape, device, stride = p.shape, p.device, _state_strides(p)
            for key in keys + (("master_param",) if master else ()):
                v = state.get(key)
                if v is None:
                    if key in self._required_state(state, group):
                        raise KeyError(
                            f"fastamp.optim.{name}: the state of {_where(g, i)} has no {key!r} "
                            f"(it has {sorted(state)}); expected the state this optimizer creates "
                            "-- was it saved with other settings (e.g. amsgrad)? Load the matching "
                            "state_dict, or clear optimizer.state[param] to start it afresh"
                        )
                    continue
                # Fast path first: this runs for every parameter at every step.
                if not (isinstance(v, Tensor) and v.shape == shape and v.device == device
                        and v.dtype == want and v.stride() == stride):
                    self._state_error(f"fastamp.optim.{name}: state[{key!r}] of {_where(g, i)}", v, p, want,
                                      stride)
            step = state.get("step")
            if step is not None and not (
                isinstance(step, Tensor) and step.numel() == 1 or is_real(step)
            ):
                raise TypeError(
                    f"fastamp.optim.{name}: state['step'] of {_where(g, i)} is {step!r}; expected "
                    "a number or a one-element tensor"
                )

    @staticmethod
    def _state_error(what: str, v: Any, p: Tensor, want: torch.dtype,
                     stride: tuple[int, ...]) -> None:
        if not isinstance(v, Tensor):
            raise TypeError(f"{what} is a {type(v).__name__}; expected a tensor like the parameter")
        if v.shape != p.shape:
            raise ValueError(
                f"{what} has shape {tuple(v.shape)} but the parameter has shape {tuple(p.shape)}: "
                "the state belongs to another model (or to parameters in another order). Expected "
                "state made for these parameters: load the state_dict saved with this model, or "
                "start from a fresh optimizer"
            )
        if v.device != p.device or v.dtype != want:
            raise TypeError(
                f"{what} is a {v.dtype} tensor on {v.device}; expected {want} on {p.device} (the "
                "parameter's device, and float32 with master_weights=True)"
            )
        raise ValueError(
            f"{what} has strides {v.stride()}; expected {stride}, the parameter's memory layout "
            "(convert the model to the memory format it had when the state was saved)"
        )

    def _required_state(self, state: dict[str, Any], group: dict[str, Any]) -> tuple[str, ...]:
        """Keys that must be present in a non-empty state (the rest is created when missing)."""
        return ()

    # ------------------------------------------------------------------ state_dict
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """PyTorch's ``load_state_dict``, with the dict checked before anything is replaced.

        PyTorch checks only the number and sizes of the param groups; a dict of another model or
        optimizer type loads, and the step after it fails (or the load itself fails halfway, in
        ``__setstate__``, with the state already replaced). Here such a dict raises first, naming
        the entry. With ``master_weights=True`` the fp32 state of fp16/bf16 params stays fp32
        (PyTorch casts all floating state to the param's dtype).
        """
        name = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"fastamp.optim.{name}.load_state_dict: state_dict must be the dict returned by "
                f"optimizer.state_dict(), got {type(state_dict).__name__}"
            )
        loaded: list[Mapping[str, Any]] = []

        def check(optimizer: Any, sd: Mapping[str, Any]) -> None:
            # Registered last, so it sees the dict as the user's pre-hooks left it.
            self.check_state_dict(sd)
            loaded.append(sd)

        handle = self.register_load_state_dict_pre_hook(check)
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            handle.remove()
        if self._master_weights and loaded:
            self._restore_fp32_state(loaded[-1])

    def check_state_dict(self, sd: Mapping[str, Any]) -> None:
        """fastamp extra: raises what :meth:`load_state_dict` would raise for ``sd`` (naming the
        entry), changing nothing."""
        name = type(self).__name__
        where = f"fastamp.optim.{name}.load_state_dict"
        for key in ("state", "param_groups"):
            if key not in sd:
                raise KeyError(
                    f"{where}: state_dict has no {key!r} entry (it has {sorted(map(str, sd))[:8]}); "
                    "expected the dict returned by optimizer.state_dict(), with 'state' and "
                    "'param_groups' -- was a model's state_dict or a whole checkpoint passed?"
                )
        saved_groups, saved_state = sd["param_groups"], sd["state"]
        if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(sg, Mapping) and isinstance(sg.get("params"), (list, tuple)) for sg in saved_groups
        ):
            raise TypeError(
                f"{where}: state_dict['param_groups'] must be a list of dicts, each with a "
                "'params' list, as optimizer.state_dict() returns"
            )
        if not isinstance(saved_state, Mapping):
            raise TypeError(
                f"{where}: state_dict['state'] is a {type(saved_state).__name__}; expected a dict "
                "from parameter index to that parameter's state"
            )
        if len(saved_groups) != len(self.param_groups) or any(
            len(sg["params"]) != len(g["params"]) for sg, g in zip(saved_groups, self.param_groups)
        ):
            return  # PyTorch raises its own ValueError for these, before changing anything
        family = "SGD" if name == "SGD" else "Adam/AdamW"
        for g, sg in enumerate(saved_groups):
            missing = [k for k in self._GROUP_KEYS if k not in sg]
            if missing:
                other = " (it looks like an Adam/AdamW state_dict)" if "betas" in sg else (
                    " (it looks like an SGD state_dict)" if "momentum" in sg else "")
                raise KeyError(
                    f"{where}: state_dict['param_groups'][{g}] has no {missing}{other}; expected "
                    f"the state_dict of an {family} optimizer: load the state saved by the same "
                    "optimizer type, or start this optimizer afresh"
                )
            self._check_hyperparameters(where, g, sg)
        id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved_groups),
                          ((g, i, p) for g, group in enumerate(self.param_groups)
                           for i, p in enumerate(group["params"]))))
        for pid, st in saved_state.items():
            if pid not in id_map:
                continue  # kept as is by PyTorch (state of no param)
            g, i, p = id_map[pid]
            entry = f"{where}: state_dict['state'][{pid!r}]"
            if not isinstance(st, Mapping):
                raise TypeError(f"{entry} is a {type(st).__name__}; expected a dict of state tensors")
            for key in self._ELEMENTWISE + ("master_param",):
                v = st.get(key)
                if v is None:
                    continue
                if not isinstance(v, Tensor):
                    raise TypeError(
                        f"{entry}[{key!r}] is a {type(v).__name__}; expected a tensor (was the "
                        "checkpoint converted, e.g. through JSON? save it with torch.save)"
                    )
                if v.shape != p.shape:
                    raise ValueError(
                        f"{entry}[{key!r}] has shape {tuple(v.shape)} but the parameter it loads "
                        f"into, {_where(g, i)}, has shape {tuple(p.shape)}: the state_dict belongs "
                        "to another model (or its parameters were in another order). Expected "
                        "the optimizer state saved with this model"
                    )
            required = self._required_state(st, saved_groups[g])
            for key in required + (("step",) if self._needs_step(st) else ()):
                if key not in st:
                    raise KeyError(
                        f"{entry} has no {key!r} (it has {sorted(map(str, st))}); expected the "
                        f"state an {family} optimizer saves for a parameter"
                    )
            step = st.get("step")
            if step is not None and not (is_real(step) or (isinstance(step, Tensor) and step.numel() == 1)):
                raise TypeError(f"{entry}['step'] is {step!r}; expected a number or a one-element tensor")

    def _needs_step(self, state: Mapping[str, Any]) -> bool:
        return False

    def _check_hyperparameters(self, where: str, g: int, sg: Mapping[str, Any]) -> None:
        # The constructor's ranges (PyTorch does not check a loaded dict); dampening has none.
        for key in self._GROUP_KEYS:
            v = sg[key]
            if key == "betas":
                ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(
                    (is_real(b) or (isinstance(b, Tensor) and b.numel() == 1)) and 0 <= b < 1 for b in v)
            elif key == "lr" and isinstance(v, Tensor):
                ok = v.numel() == 1
            else:
                ok = is_real(v) and (key == "dampening" or v >= 0)
            if not ok:
                expected = "two numbers in [0, 1)" if key == "betas" else (
                    "a number" if key == "dampening" else "a number >= 0")
                raise ValueError(
                    f"{where}: state_dict['param_groups'][{g}][{key!r}] is {v!r}; expected "
                    f"{expected}, as the constructor accepts"
                )

    def _restore_fp32_state(self, sd: Mapping[str, Any]) -> None:
        saved_ids = chain.from_iterable(sg["params"] for sg in sd["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            src = sd["state"].get(pid)
            if not src or p.dtype == torch.float32 or p not in self.state:
                continue
            state = self.state[p]
            for key in self._ELEMENTWISE + ("master_param",):
                v = src.get(key)
                if isinstance(v, Tensor) and v.is_floating_point():
                    state[key] = v.detach().to(device=p.device, dtype=torch.float32, copy=True)

    def _master(self, p: Tensor, state: dict[str, Any], new: dict[str, Any]) -> Tensor | None:
        """The fp32 master of ``p`` (with ``master_weights=True``); a new one goes into ``new``,
        which the caller commits to the state only once the kernel has run."""
        if not self._master_weights or p.dtype == torch.float32:
            return None
        master = state.get("master_param")
        if master is None:
            master = new["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)
        return master

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step. With ``torch.amp.GradScaler``, reads its ``grad_scale``/``found_inf``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        amp = take(self)
        if amp is not None:  # from fastamp.GradScaler
            self._fastamp_step(amp.inv_scale, amp.found_inf, amp.clip_coef)
        else:  # torch.amp.GradScaler's protocol for optimizers that unscale themselves
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
            self._fastamp_step(inv_scale, found_inf, None)
        return loss

    def _fastamp_step(self, inv_scale: Tensor | None, found_inf: Tensor | None,
                      clip_coef: Tensor | None) -> None:
        # Every group is checked before the first one is stepped, and a group's new state is
        # committed only after its kernel ran: an error leaves params, grads and state as they were
        # (a retry then steps every group once).
        checked = [(g, group, *self._check_params(g, group)) for g, group in enumerate(self.param_groups)]
        self._check_shared_memory(checked)
        stepped = None
        for g, group, params, places in checked:
            if not params:
                continue
            dev = params[0].device
            scalars = (_on(inv_scale, dev), _on(found_inf, dev), _on(clip_coef, dev))
            try:
                self._group_step(group, params, *scalars)
            except (RuntimeError, TypeError, ValueError) as e:
                raise self._kernel_error(e, g, places) from e
            if stepped is None:
                stepped = (
                    torch.ones((), dtype=torch.bool, device=dev)
                    if found_inf is None
                    else found_inf == 0
                )
        self.stepped = stepped

    def _check_shared_memory(self, checked: list[tuple[int, dict[str, Any], list[Tensor], list[int]]]) -> None:
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
                ts.append(p)
                where.append((g, i))
        for ts, where in by_device.values():
            pair = _ops.shared_memory_pair(ts)
            if not pair:
                continue
            a, b = pair
            name = type(self).__name__
            if a == b:
                raise RuntimeError(
                    f"fastamp.optim.{name}: {_where(*where[a])} is a view whose elements overlap "
                    "in memory (e.g. from expand() or as_strided()), so it cannot be updated in "
                    "place (PyTorch's optimizers raise for it too); expected a parameter with its "
                    "own storage: nn.Parameter(t.clone())"
                )
            raise RuntimeError(
                f"fastamp.optim.{name}: {_where(*where[b])} and {_where(*where[a])} share memory "
                "(overlapping views of one tensor, or one parameter listed twice), so the shared "
                "elements would be updated once per parameter; expected parameters over disjoint "
                "memory: give each its own storage (nn.Parameter(t.clone())) or list it once"
            )

    def _kernel_error(self, e: Exception, g: int, places: list[int]) -> Exception:
        """The kernel's error, with its list positions named as the param group's entries."""
        where = ", ".join(f"[{k}] = {_where(g, i)}" for k, i in enumerate(places[:8]))
        more = ", ..." if len(places) > 8 else ""
        try:
            return type(e)(f"{e} (fastamp.optim.{type(self).__name__}: list positions {where}{more}; "
                           "no param group was stepped)" if g == 0 else
                           f"{e} (fastamp.optim.{type(self).__name__}: list positions {where}{more})")
        except Exception:  # an exception type that takes other arguments
            return e

    @staticmethod
    def _lr(group: dict[str, Any], device: torch.device) -> tuple[float, Tensor | None]:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return 0.0, lr.to(device=device, dtype=torch.float32, non_blocking=True)
        return float(lr), None

    def _step_tensor(self, p: Tensor, state: dict[str, Any], new: dict[str, Any],
                     key: str = "step") -> Tensor:
        step = state.get(key)
        if step is None:
            step = new[key] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif not isinstance(step, Tensor):  # a number (accepted by the checks, as by PyTorch)
            step = new[key] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.device != p.device or step.dtype != torch.float32 or step.dim() != 0:
            # e.g. a state_dict saved by torch.optim (non-fused keeps steps on the CPU)
            step = new[key] = step.to(device=p.device, dtype=torch.float32).reshape(())
        return step

    def _commit(self, params: list[Tensor], news: list[dict[str, Any]],
                staged: list[tuple[Tensor, Tensor]]) -> None:
        """After the kernel: copy staged params back and add the state the step created."""
        for p, kp in staged:
            p.copy_(kp)
        for p, new in zip(params, news):
            if new:
                self.state[p].update(new)


class _AdamBase(_FusedStepMixin):
    _ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE if group.get("amsgrad") else self._ELEMENTWISE[:2]

    def _required_state(self, state, group) -> tuple[str, ...]:
        if "exp_avg" not in state:
            return ()
        return ("exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg_sq",)

    def _needs_step(self, state) -> bool:
        return len(state) > 0  # PyTorch's Adam.__setstate__ reads it (KeyError after the load)

    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        amsgrad = group["amsgrad"]
        kparams, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters = [], [], [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        for p in params:
            state = self.state.get(p) or {}  # .get: no entry is created before the kernel ran
            new: dict[str, Any] = {}
            kp = _kernel_view(p)
            if kp is not p:
                staged.append((p, kp))
            master = self._master(p, state, new)
            like = master if master is not None else kp
            if "exp_avg" not in state:
                new["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                new["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                if amsgrad:
                    new["max_exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            steps.append(self._step_tensor(p, state, new))
            kparams.append(kp)
            grads.append(_grad_like(p, kp))
            exp_avgs.append(new.get("exp_avg", state.get("exp_avg")))
            exp_avg_sqs.append(new.get("exp_avg_sq", state.get("exp_avg_sq")))
            if amsgrad:
                max_sqs.append(new.get("max_exp_avg_sq", state.get("max_exp_avg_sq")))
            if master is not None:
                masters.append(master)
            news.append(new)
        beta1, beta2 = group["betas"]
        lr, lr_t = self._lr(group, params[0].device)
        _ops.adam_step_(
            kparams, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, masters,
            lr, lr_t, float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(amsgrad), bool(group.get("decoupled_weight_decay", self._decoupled)),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._commit(params, news, staged)


class Adam(_AdamBase, torch.optim.Adam):
    """Fused :class:`torch.optim.Adam` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=False) -> None:  # fmt: skip
        torch.optim.Adam.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._fastamp_init(master_weights)


class AdamW(_AdamBase, torch.optim.AdamW):
    """Fused :class:`torch.optim.AdamW` (see the module docstring); ``master_weights`` is extra."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False) -> None:  # fmt: skip
        torch.optim.AdamW.__init__(
            self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)


class SGD(_FusedStepMixin, torch.optim.SGD):
    """Fused :class:`torch.optim.SGD` (see the module docstring); ``master_weights`` is extra.

    The number of updates each param has had lives on the device (``state["step"]`` is not part of
    PyTorch's SGD state, so it is kept beside it): it tells the kernel when a momentum buffer gets
    its first value, exactly as PyTorch's ``None`` buffer does, even when that step is skipped.
    """

    _ELEMENTWISE = ("momentum_buffer",)
    _GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay")

    def _elementwise_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._ELEMENTWISE if group["momentum"] != 0 else ()

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master_weights=False) -> None:  # fmt: skip
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._fastamp_init(master_weights)
        self._updates: dict[Tensor, Tensor] = {}

    def _updates_of(self, p: Tensor, state: dict[str, Any], new_counts: dict[Tensor, Tensor]) -> Tensor:
        n = self._updates.get(p)
        if n is None:
            # A buffer loaded from a checkpoint has had its first value already.
            first = 0.0 if state.get("momentum_buffer") is None else 1.0
            n = new_counts[p] = torch.full((), first, dtype=torch.float32, device=p.device)
        return n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._updates = {}

    def _group_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        momentum = group["momentum"]
        kparams, grads, bufs, counts, masters = [], [], [], [], []
        news: list[dict[str, Any]] = []
        staged: list[tuple[Tensor, Tensor]] = []
        new_counts: dict[Tensor, Tensor] = {}
        for p in params:
            # Like torch.optim.SGD, momentum-free SGD keeps no per-param state at all (an entry,
            # even empty, would show up in state_dict()); .get creates none.
            state = self.state.get(p) or {}
            new: dict[str, Any] = {}
            kp = _kernel_view(p)
            if kp is not p:
                staged.append((p, kp))
            master = self._master(p, state, new)
            counts.append(self._updates_of(p, state, new_counts))
            if momentum != 0:
                buf = state.get("momentum_buffer")
                if buf is None:
                    like = master if master is not None else kp
                    buf = new["momentum_buffer"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                bufs.append(buf)
            kparams.append(kp)
            grads.append(_grad_like(p, kp))
            if master is not None:
                masters.append(master)
            news.append(new)
        lr, lr_t = self._lr(group, params[0].device)
        _ops.sgd_step_(
            kparams, grads, bufs, counts, masters, lr, lr_t, float(group["weight_decay"]),
            float(momentum), float(group["dampening"]), bool(group["nesterov"]),
            bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._updates.update(new_counts)
        self._commit(params, news, staged)
