"""``load_state_dict`` of the fused optimizers: the dict is checked before anything is replaced
(:class:`StateDictChecks`), and fp32 state of half params stays fp32 with master weights."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from fastamp._checks import is_real
from fastamp.optim import lowbit
from fastamp.optim._layout import kernel_like, where_in_groups


class StateDictChecks:
    """Mixin of the fused optimizers (see :class:`fastamp.optim.optimizers._FusedStepMixin`)."""

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]
    _master_weights: bool
    _ELEMENTWISE: tuple[str, ...] = ()
    _GROUP_KEYS: tuple[str, ...] = ()
    _FAMILY = "Adam/AdamW"  # what a state_dict of this optimizer is called in errors

    def _required_state(self, state: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[str, ...]:
        """Keys that must be present in a non-empty state (the rest is created when missing)."""
        return ()

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
        options = [{k: g[k] for k in ("state_dtype", "state_seed") if k in g} for g in self.param_groups]

        def check(optimizer: Any, sd: Mapping[str, Any]) -> None:
            # Registered last, so it sees the dict as the user's pre-hooks left it; everything the
            # load puts in place is made here, before PyTorch replaces anything.
            self.check_state_dict(sd)
            prepared[:] = self._prepare_load(sd)

        handle = self.register_load_state_dict_pre_hook(check)
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            handle.remove()
        for group, opts in zip(self.param_groups, options):
            group.pop("state_dtype", None)
            group.pop("state_seed", None)
            group.update(opts)
        for p, final in prepared:
            state = self.state[p]
            for key in lowbit.moment_keys(self._moments_of_family()):
                state.pop(key, None)
            state.update(final)
        self._after_load()

    def _after_load(self) -> None:
        return None

    def _prepare_load(self, sd: Mapping[str, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        """Per param with saved state: its moments in its group's format (and fp32 state kept
        fp32 with master weights), as the load will put them in place."""
        out = []
        saved_ids = chain.from_iterable(sg["params"] for sg in sd["param_groups"])
        places = ((g, p) for g, group in enumerate(self.param_groups) for p in group["params"])
        for pid, (g, p) in zip(saved_ids, places):
            src = sd["state"].get(pid)
            if not isinstance(src, Mapping) or not src:
                continue
            group = {**self.param_groups[g], **{k: v for k, v in sd["param_groups"][g].items()
                                                if k not in ("params", "state_dtype", "state_seed")}}
            final: dict[str, Any] = {}
            master = None
            if self._master_weights and p.dtype != torch.float32:
                for key in self._ELEMENTWISE + ("master_param",):
                    v = src.get(key)
                    if isinstance(v, Tensor) and v.is_floating_point():
                        final[key] = v.detach().to(device=p.device, dtype=torch.float32, copy=True)
                master = final.get("master_param")
            moments = self._moments(group)
            if moments and lowbit.format_of(src, moments) is not None:
                fmt = self._format(group, p)
                like = kernel_like(p)
                if self._master_weights and p.dtype != torch.float32:
                    like = master if master is not None else torch.empty_like(like, dtype=torch.float32)
                moved = {k: v.detach().to(p.device) if isinstance(v, Tensor) else v for k, v in src.items()}
                converted = lowbit.convert(moved, fmt, like, moments)
                if converted is None:
                    converted = {k: moved[k].clone() for k in fmt.keys(moments)}
                final.update(converted)
            out.append((p, final))
        return out

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
        family = self._FAMILY
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
            moments = self._moments({**self.param_groups[g], **saved_groups[g]})
            lowbit.check_any(st, p, moments, entry, any_device=True)
            for key in tuple(k for k in self._ELEMENTWISE if k not in moments) + ("master_param",):
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
                        f"into, {where_in_groups(g, i)}, has shape {tuple(p.shape)}: the state_dict belongs "
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
