"""The low-precision-state half of fastamp.optim.Adam / AdamW (``state_dtype=``, see
:mod:`fastamp.optim.lowbit`): the constructor options, the step of the params whose moments are
bfloat16 or 8-bit (fastamp::adam_lowbit_step_), and the conversions a load_state_dict makes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastamp.optim import _ops, lowbit


class LowbitAdamMixin:
    """Mixin of the fused Adam/AdamW (methods over their own state)."""

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]
    defaults: dict[str, Any]
    _decoupled: bool

    def _lowbit_format(self, group: dict[str, Any], p: Tensor) -> str:
        fmt = group.get("state_dtype", "float32")
        return fmt if lowbit.uses_lowbit(p, fmt) else "float32"

    def _check_lowbit_group(self, group: dict[str, Any]) -> None:
        if group["amsgrad"]:
            raise ValueError(
                f"fastamp.optim.{type(self).__name__}: amsgrad=True needs float32 state (it keeps "
                f"the running maximum of exp_avg_sq exactly); this param group has state_dtype="
                f"{group['state_dtype']!r}: use state_dtype=torch.float32 with amsgrad"
            )

    def _lowbit_step(self, group, params, inv_scale, found_inf, clip_coef) -> None:
        fmt = group["state_dtype"]
        kparams, grads, ms, vs, ams, avs, steps, masters = [], [], [], [], [], [], [], []
        news: list[dict[str, Any]] = []
        for p in params:
            state = self.state.get(p) or {}
            new: dict[str, Any] = {}
            master = self._master(p, state, new)
            if "exp_avg" not in state:
                new.update(lowbit.new_state(p, fmt))
            elif not lowbit.matches(state, fmt, lowbit.moments_dtype(fmt, p, master is not None)):
                new.update(lowbit.convert(state, fmt, p))  # state of another precision
            cur = {**state, **new}
            steps.append(self._step_tensor(p, state, new))
            kparams.append(p)
            grads.append(p.grad if p.grad.is_contiguous() else p.grad.contiguous())
            ms.append(cur["exp_avg"])
            vs.append(cur["exp_avg_sq"])
            if fmt == "int8":
                ams.append(cur["exp_avg_absmax"])
                avs.append(cur["exp_avg_sq_absmax"])
            if master is not None:
                masters.append(master)
            news.append(new)
        beta1, beta2 = group["betas"]
        lr, lr_t = self._lr(group, params[0].device)
        _ops.adam_lowbit_step_(
            kparams, grads, ms, vs, ams, avs, steps, masters, int(group.get("state_seed", 0)),
            lr, lr_t, float(beta1), float(beta2), float(group["weight_decay"]), float(group["eps"]),
            bool(group.get("decoupled_weight_decay", self._decoupled)), bool(group["maximize"]),
            inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._commit(params, news, [])
        for p, new in zip(params, news):  # a converted state drops the other format's keys
            if "exp_avg" in new and fmt != "int8":
                self.state[p].pop("exp_avg_absmax", None)
                self.state[p].pop("exp_avg_sq_absmax", None)

    def _lowbit_init(self, state_dtype: Any, state_seed: Any) -> None:
        name = type(self).__name__
        fmt = lowbit.state_format(state_dtype, f"fastamp.optim.{name}")
        if isinstance(state_seed, bool) or not isinstance(state_seed, int) or not 0 <= state_seed < 2**32:
            raise ValueError(
                f"fastamp.optim.{name}: state_seed must be an int in [0, 2**32), got {state_seed!r}"
            )
        if fmt == "float32":
            return  # PyTorch's param groups and state_dict, unchanged
        for group in self.param_groups:
            group.setdefault("state_dtype", fmt)
            group.setdefault("state_seed", state_seed)
            self._check_lowbit_group(group)
        self.defaults["state_dtype"] = fmt
        self.defaults["state_seed"] = state_seed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As the fused optimizers' load_state_dict, then the moments are converted to this
        optimizer's ``state_dtype`` (per param group, as constructed): a float32 state_dict loads
        into an 8-bit/bfloat16 optimizer and back, so a run can switch precision."""
        formats = [(g.get("state_dtype"), g.get("state_seed")) for g in self.param_groups]
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        saved_ids = [pid for sg in state_dict["param_groups"] for pid in sg["params"]]
        for group, (fmt, seed) in zip(self.param_groups, formats):
            for key, value in (("state_dtype", fmt), ("state_seed", seed)):
                if value is None:
                    group.pop(key, None)
                else:
                    group[key] = value
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            state = self.state.get(p)
            src = saved.get(pid)
            if not state or "exp_avg" not in state or not isinstance(src, dict):
                continue
            # PyTorch cast every floating tensor to the param's dtype: take the saved ones as saved.
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
                if isinstance(src.get(key), Tensor):
                    state[key] = src[key].detach().to(device=p.device, copy=True)
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            fmt = self._lowbit_format(group, p)
            master = state.get("master_param")
            like = master if isinstance(master, Tensor) else p
            dtype = lowbit.moments_dtype(fmt, p, isinstance(master, Tensor))
            if not lowbit.matches(state, fmt, dtype):
                converted = lowbit.convert(state, fmt, like)
                state.pop("exp_avg_absmax", None)
                state.pop("exp_avg_sq_absmax", None)
                state.update(converted)


class LowbitSgdMixin:
    """The ``state_dtype=torch.bfloat16`` half of the fused SGD: bfloat16 momentum buffers written
    with stochastic rounding (fastamp::sgd_lowbit_step_), as Adam's bfloat16 ``exp_avg``. 8-bit
    buffers are not offered: a momentum buffer is one moment, not two, and its stochastic bfloat16
    already halves it; the block scales would buy 2 more bytes per parameter for a second pass."""

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]
    defaults: dict[str, Any]

    def _lowbit_format(self, group: dict[str, Any], p: Tensor) -> str:
        fmt = group.get("state_dtype", "float32")
        if group["momentum"] == 0 or not lowbit.uses_lowbit(p, fmt):
            return "float32"
        return fmt

    def _sgd_lowbit_init(self, state_dtype: Any, state_seed: Any) -> None:
        fmt = lowbit.state_format(state_dtype, "fastamp.optim.SGD")
        if fmt == "int8":
            raise ValueError(
                "fastamp.optim.SGD: state_dtype='int8' is for Adam/AdamW's two moments; SGD's "
                "one momentum buffer can be torch.bfloat16 (stochastic rounding) or torch.float32"
            )
        if isinstance(state_seed, bool) or not isinstance(state_seed, int) or not 0 <= state_seed < 2**32:
            raise ValueError(f"fastamp.optim.SGD: state_seed must be an int in [0, 2**32), got {state_seed!r}")
        if fmt == "float32":
            return  # PyTorch's param groups and state_dict, unchanged
        for group in self.param_groups:
            group.setdefault("state_dtype", fmt)
            group.setdefault("state_seed", state_seed)
        self.defaults["state_dtype"] = fmt
        self.defaults["state_seed"] = state_seed

    @staticmethod
    def _check_lowbit_state(name: str, g: int, i: int, p: Tensor, state: dict[str, Any]) -> None:
        """A momentum buffer of any float dtype (the step converts it), of ``p``'s shape on its
        device."""
        v = state.get("momentum_buffer")
        if v is not None and not (isinstance(v, Tensor) and v.is_floating_point()
                                  and v.shape == p.shape and v.device == p.device):
            got = (f"a {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}"
                   if isinstance(v, Tensor) else type(v).__name__)
            raise TypeError(
                f"{name}: state['momentum_buffer'] of param {i} in param group {g} is {got}; "
                f"expected a float tensor of the parameter's shape {tuple(p.shape)} on {p.device}"
            )

    def _sgd_lowbit_step(self, group, params, counts, inv_scale, found_inf, clip_coef) -> None:
        kparams, grads, bufs, masters = [], [], [], []
        news: list[dict[str, Any]] = []
        for p, count in zip(params, counts):
            state = self.state.get(p) or {}
            new: dict[str, Any] = {}
            if state.get("step") is not count:
                # The update count keys the rounding: saved with the state (not PyTorch's SGD
                # state, which has none, but this format is fastamp's), so a resumed run draws
                # the same bits.
                new["step"] = count
            master = self._master(p, state, new)
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = new["momentum_buffer"] = p.new_zeros(p.shape, dtype=torch.bfloat16)
            elif buf.dtype != torch.bfloat16:  # a float32 buffer (a state_dict of that format)
                buf = new["momentum_buffer"] = buf.to(torch.bfloat16).contiguous()
            kparams.append(p)
            grads.append(p.grad if p.grad.is_contiguous() else p.grad.contiguous())
            bufs.append(buf)
            if master is not None:
                masters.append(master)
            news.append(new)
        lr, lr_t = self._lr(group, params[0].device)
        _ops.sgd_lowbit_step_(
            kparams, grads, bufs, counts, masters, int(group.get("state_seed", 0)), lr, lr_t,
            float(group["weight_decay"]), float(group["momentum"]), float(group["dampening"]),
            bool(group["nesterov"]), bool(group["maximize"]), inv_scale, found_inf, clip_coef,
        )  # fmt: skip
        self._commit(params, news, [])

    def _sgd_lowbit_load(self, formats: list[tuple[Any, Any]]) -> None:
        """After load_state_dict: the constructed state_dtype / state_seed win over the saved
        ones, and each buffer takes its param's format (bfloat16 here; PyTorch's load already cast
        a bfloat16 one to a float32 param's dtype, exactly)."""
        for group, (fmt, seed) in zip(self.param_groups, formats):
            for key, value in (("state_dtype", fmt), ("state_seed", seed)):
                if value is None:
                    group.pop(key, None)
                else:
                    group[key] = value
            for p in group["params"]:
                buf = (self.state.get(p) or {}).get("momentum_buffer")
                if isinstance(buf, Tensor) and self._lowbit_format(group, p) != "float32":
                    self.state[p]["momentum_buffer"] = buf.to(torch.bfloat16).contiguous()
