"""The fused optimizers' state dicts: what ``load_state_dict`` checks and puts in place
(:class:`StateDictChecks`, an object the optimizer owns): the dict is checked, and the state the
load leaves is made (moments in each group's format, laid out as the params; fp32 state of half
params kept fp32 with master weights), before PyTorch replaces anything; and what
``state_dict`` returns of torch's (:func:`saved_state_dict`)."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastamp._checks import is_real
from fastamp._sharding import is_dtensor, local, local_state, misplaced_state, wrap_like
from fastamp.optim import lowbit
from fastamp.optim._family import OptimizerFamily
from fastamp.optim._layout import kernel_like, where_in_groups

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class StateDictChecks:
    """What a fused optimizer's ``load_state_dict`` checks and puts in place (its name in
    messages, its family, whether it keeps master weights), over the param groups handed in."""

    def __init__(self, name: str, family: OptimizerFamily, master_weights: bool) -> None:
        self.name = name
        self.family = family
        self.master_weights = master_weights

    def check(self, param_groups: list[dict[str, Any]], sd: Mapping[str, Any]) -> None:
        """Raises what ``load_state_dict`` would raise for ``sd`` (naming the entry), changing
        nothing."""
        name = self.name
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
            isinstance(sg, Mapping) and isinstance(sg.get("params"), (list, tuple))
            for sg in saved_groups
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
        if len(saved_groups) != len(param_groups) or any(
            len(sg["params"]) != len(g["params"]) for sg, g in zip(saved_groups, param_groups)
        ):
            return  # PyTorch raises its own ValueError for these, before changing anything
        family = self.family.label
        for g, sg in enumerate(saved_groups):
            missing = [k for k in self.family.group_keys if k not in sg]
            if missing:
                other = (
                    " (it looks like an Adam/AdamW state_dict)"
                    if "betas" in sg
                    else (" (it looks like an SGD state_dict)" if "momentum" in sg else "")
                )
                raise KeyError(
                    f"{where}: state_dict['param_groups'][{g}] has no {missing}{other}; expected "
                    f"the state_dict of an {family} optimizer: load the state saved by the same "
                    "optimizer type, or start this optimizer afresh"
                )
            self._check_hyperparameters(where, g, sg)
        id_map = dict(
            zip(
                chain.from_iterable(sg["params"] for sg in saved_groups),
                (
                    (g, i, p)
                    for g, group in enumerate(param_groups)
                    for i, p in enumerate(group["params"])
                ),
            )
        )
        for pid, st in saved_state.items():
            if pid not in id_map:
                continue  # kept as is by PyTorch (state of no param)
            g, i, p = id_map[pid]
            entry = f"{where}: state_dict['state'][{pid!r}]"
            if not isinstance(st, Mapping):
                raise TypeError(
                    f"{entry} is a {type(st).__name__}; expected a dict of state tensors"
                )
            if is_dtensor(p):  # a sharded param's state: checked as its local shards
                _check_sharded(entry, p, st)
                p, st = local(p), local_state(st)
            moments = self.family.moments_of({**param_groups[g], **saved_groups[g]})
            lowbit.check_any(st, p, moments, entry, any_device=True)
            for key in tuple(k for k in self.family.elementwise if k not in moments) + (
                "master_param",
            ):
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
            required = self.family.required(st, saved_groups[g])
            for key in required + (("step",) if self.family.needs_step(st) else ()):
                if key not in st:
                    raise KeyError(
                        f"{entry} has no {key!r} (it has {sorted(map(str, st))}); expected the "
                        f"state an {family} optimizer saves for a parameter"
                    )
            step = st.get("step")
            if step is not None and not (
                is_real(step) or (isinstance(step, Tensor) and step.numel() == 1)
            ):
                raise TypeError(
                    f"{entry}['step'] is {step!r}; expected a number or a one-element tensor"
                )

    def _check_hyperparameters(self, where: str, g: int, sg: Mapping[str, Any]) -> None:
        # The constructor's ranges (PyTorch does not check a loaded dict); dampening has none.
        for key in self.family.group_keys:
            v = sg[key]
            if key == "betas":
                ok = (
                    isinstance(v, (list, tuple))
                    and len(v) == 2
                    and all(
                        (is_real(b) or (isinstance(b, Tensor) and b.numel() == 1)) and 0 <= b < 1
                        for b in v
                    )
                )
            elif key == "lr" and isinstance(v, Tensor):
                ok = v.numel() == 1
            else:
                ok = is_real(v) and (key == "dampening" or v >= 0)
            if not ok:
                expected = (
                    "two numbers in [0, 1)"
                    if key == "betas"
                    else ("a number" if key == "dampening" else "a number >= 0")
                )
                raise ValueError(
                    f"{where}: state_dict['param_groups'][{g}][{key!r}] is {v!r}; expected "
                    f"{expected}, as the constructor accepts"
                )

    def prepare(
        self, param_groups: list[dict[str, Any]], sd: Mapping[str, Any]
    ) -> list[tuple[Tensor, dict[str, Any]]]:
        """Per param with saved state: its moments in its group's format (and fp32 state kept
        fp32 with master weights), as the load will put them in place."""
        out = []
        saved_ids = chain.from_iterable(sg["params"] for sg in sd["param_groups"])
        places = ((g, p) for g, group in enumerate(param_groups) for p in group["params"])
        for pid, (g, p) in zip(saved_ids, places):
            src = sd["state"].get(pid)
            if not isinstance(src, Mapping) or not src:
                continue
            # A sharded param's state is made from the local shards, then laid out as it is.
            sharded, p = p, local(p)
            src = local_state(src)
            group = {
                **param_groups[g],
                **{
                    k: v
                    for k, v in sd["param_groups"][g].items()
                    if k not in ("params", "state_dtype", "state_seed")
                },
            }
            final: dict[str, Any] = {}
            master = None
            if self.master_weights and p.dtype != torch.float32:
                for key in self.family.elementwise + ("master_param",):
                    v = src.get(key)
                    if isinstance(v, Tensor) and v.is_floating_point():
                        final[key] = v.detach().to(device=p.device, dtype=torch.float32, copy=True)
                master = final.get("master_param")
            moments = self.family.moments_of(group)
            if moments and lowbit.format_of(src, moments) is not None:
                fmt = self.family.group_format(group, f"fastamp.optim.{self.name}")
                fmt = fmt if fmt.applies_to(sharded) else lowbit.FLOAT32  # as the step decides
                like = kernel_like(p)
                if self.master_weights and p.dtype != torch.float32:
                    like = (
                        master
                        if master is not None
                        else torch.empty_like(like, dtype=torch.float32)
                    )
                moved = {
                    k: v.detach().to(p.device) if isinstance(v, Tensor) else v
                    for k, v in src.items()
                }
                converted = lowbit.convert(moved, fmt, like, moments)
                if converted is None:
                    converted = {k: moved[k].clone() for k in fmt.keys(moments)}
                final.update(converted)
            out.append((sharded, {k: wrap_like(sharded, v) for k, v in final.items()}))
        return out


def _check_sharded(entry: str, p: DTensor, st: Mapping[str, Any]) -> None:
    """The state tensors of a DTensor param's shape must be DTensors laid out as the param."""
    bad = misplaced_state(p, st)
    if bad is not None:
        raise ValueError(
            f"{entry}[{bad[0]!r}] is {bad[1]}, but the parameter it loads into is a DTensor laid "
            f"out as {tuple(p.placements)}; expected the state sharded as the parameter: "
            "load a sharded model's optimizer state with torch.distributed.checkpoint "
            "(torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which "
            "shards a full state dict too)"
        )


def saved_state_dict(
    sd: dict[str, Any], params: list[Tensor], counts: list[Any], moments: tuple[str, ...]
) -> dict[str, Any]:
    """torch's ``state_dict()`` of a fused optimizer as fastamp returns it: the 8-bit state of a
    DTensor param given as its float32 moments (DTensors laid out as the param), the entries of
    params never updated left out (``counts[k]``: param ``k``'s update count, see
    :func:`_never_updated`), and every group saying ``fused=True``: a torch optimizer that
    loads it stays (or becomes) fused, as after loading torch's own fused state_dict (fused=None
    would switch torch's AdamW(fused=True) to its for-loop step, which its GradScaler refuses)."""
    state = dict(sd["state"])
    for pid, st in sd["state"].items():
        p = params[pid] if isinstance(pid, int) and pid < len(params) else None
        if p is None or not is_dtensor(p) or lowbit.format_of(st, moments) is not lowbit.INT8:
            continue
        floats = lowbit.INT8.decode(local_state(st), moments)
        out = {k: v for k, v in st.items() if k not in lowbit.moment_keys(moments)}
        out.update({k: wrap_like(p, v.reshape(local(p).shape)) for k, v in floats.items()})
        state[pid] = out
    for pid in _never_updated(sd["state"], counts):
        del state[pid]
    sd["state"] = state
    for group in sd["param_groups"]:
        if "fused" in group:
            group["fused"] = True
    return sd


def _never_updated(saved: Mapping[Any, Any], counts: list[Any]) -> list[Any]:
    """The entries of ``saved`` (state_dict()['state']) whose param was never updated: the state
    a fused kernel made for a first step it then skipped (inf/NaN grads). torch's optimizers
    leave no state for a step the scaler skipped, so the state_dict leaves it out too (a resumed
    torch SGD would take a zero momentum buffer for one that had its first value). One host
    read of the counts, per device."""
    by_device: dict[torch.device, list[tuple[Any, Tensor]]] = {}
    never: list[Any] = []
    for pid in saved:
        n = counts[pid] if isinstance(pid, int) and pid < len(counts) else None
        if isinstance(n, Tensor) and n.numel() == 1 and not is_dtensor(n):
            by_device.setdefault(n.device, []).append((pid, n))
        elif isinstance(n, (int, float)) and n == 0:
            never.append(pid)
    for items in by_device.values():
        values = torch.stack([n.detach().reshape(()).to(torch.float64) for _, n in items])
        never += [pid for (pid, _), c in zip(items, values.tolist()) if c == 0]
    return never
