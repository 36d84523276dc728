"""The bad-input catalogue (issue 8): realistic misuses of the public API, one case each.

For every case the test

1. builds a small training "world" in the state just before the mistake (a model with grads, an
   optimizer with state, a scaler part-way through an iteration, raw op arguments...);
2. snapshots it: the bytes (and storage, strides, version counter) of every parameter, grad and
   buffer, every tensor and value in the optimizer's state and param groups, and the scaler's
   private tensors, per-optimizer states and ``state_dict()``;
3. makes the mistake inside ``pytest.raises(<type>, match=<the argument's name>)``;
4. checks the message says what to do -- or, where PyTorch owns the error (fastamp's classes are
   drop-in replacements), that it is PyTorch's text, verbatim;
5. checks the snapshot is unchanged, byte for byte.

Where PyTorch has the same API (``torch.amp.GradScaler``, ``torch.optim.*``), the PyTorch class
is put through the same misuse and must raise the same exception type.

DDP on a model that differs across ranks runs in two gloo processes (the pattern of
tests/distributed/test_ddp.py); each rank checks its own snapshot and the test reads the results.
"""

from __future__ import annotations

import copy
import datetime
import enum
import functools
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastamp
from fastamp.checkpoint import checkpoint, checkpoint_sequential, offload_activations, selective
from fastamp.parallel import DistributedDataParallel as FDDP

# ================================================================== snapshots


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy())


def _tensor_leaf(t: torch.Tensor) -> tuple:
    """Everything that identifies a tensor's contents: metadata, version counter, storage
    address and the bytes themselves (so NaN == NaN and -0.0 != 0.0)."""
    head = (type(t).__name__, str(t.layout), str(t.dtype), str(t.device), tuple(t.shape),
            t.requires_grad, t._version)
    if t.layout == torch.strided:
        head += (t.stride(), t.storage_offset())
        if t.device.type == "meta":
            return head + ("<meta: no data>",)
        return head + (t.data_ptr(), _bytes(t))
    if t.layout == torch.sparse_coo:
        return head + (_tensor_leaf(t._indices()), _tensor_leaf(t._values()))
    return head + (repr(t),)


class _Flattener:
    """Turns an object graph into {path: leaf}, tensors by content, other objects by value."""

    def __init__(self, names: dict[int, str]):
        self.names = names  # id(tensor) -> readable name, for dict keys such as optimizer.state
        self.out: dict[str, Any] = {}
        self.seen: dict[int, str] = {}

    def key(self, k: Any) -> str:
        if isinstance(k, torch.Tensor):
            return self.names.get(id(k), f"<tensor@{id(k):x}>")
        return repr(k)

    def add(self, obj: Any, path: str) -> None:
        out = self.out
        if isinstance(obj, torch.Tensor):
            out[path] = _tensor_leaf(obj)
            if obj.is_leaf and obj.grad is not None:
                self.add(obj.grad, path + ".grad")
            return
        if obj is None or isinstance(obj, (bool, int, str, bytes)):
            out[path] = (type(obj).__name__, obj)
            return
        if isinstance(obj, float):
            out[path] = ("float", obj.hex())  # NaN-safe, tells -0.0 from 0.0
            return
        if isinstance(obj, (torch.device, torch.dtype, enum.Enum, type)):
            out[path] = ("value", repr(obj))
            return
        if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                            functools.partial)):
            out[path] = ("callable", id(obj))
            return
        if id(obj) in self.seen:
            out[path] = ("same object as", self.seen[id(obj)])
            return
        self.seen[id(obj)] = path
        if isinstance(obj, nn.Module):
            self.module(obj, path)
        elif isinstance(obj, torch.amp.GradScaler):
            self.scaler(obj, path)
        elif isinstance(obj, Mapping):
            out[path] = (type(obj).__name__, len(obj))
            for k, v in obj.items():
                self.add(v, f"{path}[{self.key(k)}]")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            out[path] = (type(obj).__name__, len(obj))
            for i, v in enumerate(items):
                self.add(v, f"{path}[{i}]")
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            out[path] = ("object", type(obj).__name__)
            attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        attrs[slot] = getattr(obj, slot)
            for k, v in attrs.items():
                self.add(v, f"{path}.{k}")
        else:
            out[path] = ("opaque", type(obj).__name__, id(obj))

    def module(self, m: nn.Module, path: str) -> None:
        # Parameters, grads, buffers, and anything that patches a submodule (fastamp.checkpoint
        # .apply replaces forward on the instance; hooks).
        for n, p in m.named_parameters(remove_duplicate=False):
            self.add(p, f"{path}.{n}")
        for n, b in m.named_buffers(remove_duplicate=False):
            self.add(b, f"{path}.{n}")
        for n, sub in m.named_modules():
            where = f"{path}.{n}" if n else path
            self.out[where + ".<module>"] = (
                type(sub).__name__, sub.training, id(sub.__dict__.get("forward")),
                len(sub._forward_hooks), len(sub._forward_pre_hooks), len(sub._backward_hooks))

    def scaler(self, s: torch.amp.GradScaler, path: str) -> None:
        # Every attribute: _scale, _growth_tracker, _hysteresis_tracker, _per_optimizer_states
        # (with their inf checks), _diag, _ddp_stats, ... and the public state_dict().
        for k, v in vars(s).items():
            self.add(v, f"{path}.{k}")
        if s.is_enabled() and s._scale is not None and s._scale.device.type != "meta":
            warned = getattr(s, "_warned_small_scale", None)
            sd = s.state_dict()  # get_scale() may set the one-time warning flag: put it back
            if warned is not None:
                s._warned_small_scale = warned
            self.add(sd, f"{path}.state_dict()")


def _snapshot(world: Mapping[str, Any]) -> dict[str, Any]:
    names: dict[int, str] = {}
    for wname, obj in world.items():
        if isinstance(obj, nn.Module):
            for n, p in obj.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), f"{wname}.{n}")
    f = _Flattener(names)
    for wname, obj in world.items():
        f.add(obj, wname)
    return f.out


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Paths that differ (appeared, disappeared or changed); empty when byte-identical."""
    out = [f"+ {k}" for k in after if k not in before] + [f"- {k}" for k in before if k not in after]
    out += [f"~ {k}" for k in before if k in after and before[k] != after[k]]
    return out


# ================================================================== worlds

FASTAMP = types.SimpleNamespace(
    name="fastamp", GradScaler=fastamp.GradScaler, SGD=fastamp.optim.SGD, Adam=fastamp.optim.Adam,
    AdamW=fastamp.optim.AdamW)
TORCH = types.SimpleNamespace(
    name="torch", GradScaler=torch.amp.GradScaler, SGD=torch.optim.SGD, Adam=torch.optim.Adam,
    AdamW=torch.optim.AdamW)


def _net(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _opt(lib: Any, kind: str, model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    groups = [{"params": list(model[0].parameters())},
              {"params": list(model[2].parameters()), "lr": 2e-3}]
    if kind == "SGD":
        kw.setdefault("momentum", 0.9)
    return getattr(lib, kind)(groups, lr=1e-2, **kw)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    x, y = _batch(seed)
    return nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _trained(lib: Any = FASTAMP, kind: str = "AdamW", *, steps: int = 2, backward: bool = True,
             dtype: torch.dtype = torch.float32, opt_kw: dict | None = None, **scaler_kw: Any):
    """A model, its optimizer (with state) and a scaler after ``steps`` scaled steps (the scale has
    grown: growth_interval=1), then -- with ``backward`` -- one more scaled backward: the middle of
    an iteration, where a misuse happens."""
    model = _net(dtype)
    opt = _opt(lib, kind, model, **(opt_kw or {}))
    scaler = lib.GradScaler("cpu", init_scale=2.0**10, growth_interval=1, **scaler_kw)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, seed=i)).backward()
        scaler.step(opt)
        scaler.update()
    if backward:
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, seed=99)).backward()
    return model, opt, scaler


def _world(model=None, opt=None, scaler=None, **extra: Any) -> dict[str, Any]:
    w = {"model": model, "optimizer": opt, "scaler": scaler, **extra}
    return {k: v for k, v in w.items() if v is not None}


# ================================================================== the catalogue


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Any], tuple[dict[str, Any], Callable[[], Any]]]  # lib -> (world, misuse)
    exc: type[BaseException]
    arg: str  # regex: the message names the argument (or the call) that is wrong
    fix: str | None  # regex: the message says what to do / what was expected
    like_torch: str | None = None  # "type" / "message": PyTorch raises the same type / text

    def __post_init__(self):
        # A message without a fix is allowed only where it is PyTorch's own text, kept verbatim
        # because fastamp's classes must raise what PyTorch raises.
        assert self.fix is not None or self.like_torch == "message", self.id


CASES: list[Case] = []


def case(id: str, exc: type[BaseException], arg: str, fix: str | None = None,
         like_torch: str | None = None):
    def register(build):
        CASES.append(Case(id, build, exc, arg, fix, like_torch))
        return build

    return register


# ------------------------------------------------------------------ GradScaler: construction

@case("scaler_init_scale_zero", ValueError, r"init_scale", r"finite number > 0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=0.0)


@case("scaler_init_scale_nan", ValueError, r"init_scale", r"finite number > 0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=math.nan)


@case("scaler_init_scale_inf", ValueError, r"init_scale", r"expected e\.g\. 2\.0\*\*16")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", init_scale=math.inf)


@case("scaler_growth_factor_not_above_1", AssertionError, r"growth factor", like_torch="message")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_factor=1.0)


@case("scaler_growth_factor_inf", ValueError, r"growth_factor", r"finite number > 1\.0")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_factor=math.inf)


@case("scaler_backoff_factor_not_below_1", AssertionError, r"backoff factor", like_torch="message")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", backoff_factor=1.0)


@case("scaler_backoff_factor_zero", ValueError, r"backoff_factor", r"in \(0, 1\).*expected e\.g\. 0\.5")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", backoff_factor=0.0)


@case("scaler_growth_interval_zero", ValueError, r"growth_interval", r"int >= 1")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", growth_interval=0)


@case("scaler_hysteresis_zero", ValueError, r"hysteresis", r"int >= 1")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", hysteresis=0)


@case("scaler_min_scale_above_max_scale", ValueError, r"max_scale", r"must be >= min_scale")
def _(lib):
    return {}, lambda: lib.GradScaler("cpu", min_scale=8.0, max_scale=4.0)


@case("scaler_set_growth_interval_zero", ValueError, r"new_interval", r"int >= 1")
def _(lib):
    # PyTorch stores it, and update() fails after the optimizer has stepped.
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.set_growth_interval(0)


# ------------------------------------------------------------------ GradScaler: load_state_dict

def _scaler_load(lib, **changes):
    model, opt, sc = _trained(lib, backward=False)
    sd = sc.state_dict()
    sd.update(changes)
    return _world(model, opt, sc), lambda: sc.load_state_dict(sd)


@case("scaler_load_state_dict_scale_zero", ValueError, r"state_dict\['scale'\]", r"finite number > 0")
def _(lib):
    return _scaler_load(lib, scale=0.0)


@case("scaler_load_state_dict_scale_nan", ValueError, r"state_dict\['scale'\]", r"finite number > 0")
def _(lib):
    return _scaler_load(lib, scale=math.nan)


@case("scaler_load_state_dict_growth_interval_str", TypeError, r"state_dict\['growth_interval'\]",
      r"must be an int >= 1")
def _(lib):
    return _scaler_load(lib, growth_interval="2000")  # e.g. a checkpoint that went through YAML


@case("scaler_load_state_dict_hysteresis_zero", ValueError, r"state_dict\['hysteresis'\]", r"int >= 1")
def _(lib):
    model, opt, sc = _trained(lib, backward=False, hysteresis=2)
    sd = sc.state_dict()
    sd["hysteresis"] = 0
    return _world(model, opt, sc), lambda: sc.load_state_dict(sd)


@case("scaler_load_optimizer_state_dict", KeyError, r"lacks \[.*'scale'", r"GradScaler\.state_dict\(\)",
      like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict(opt.state_dict())  # wrong entry


@case("scaler_load_state_dict_empty", RuntimeError, r"source state dict is empty", like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict({})


@case("scaler_load_state_dict_none", TypeError, r"state_dict", r"GradScaler\.state_dict\(\)", like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.load_state_dict(None)


# ------------------------------------------------------------------ GradScaler: update / scale

@case("scaler_update_new_scale_zero", ValueError, r"new_scale", r"finite number > 0")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale=0.0)


@case("scaler_update_new_scale_two_elements", AssertionError, r"new_scale",
      r"should be a float or a 1-element", like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: sc.update(new_scale=torch.tensor([8.0, 8.0]))


@case("scaler_scale_non_tensor", ValueError, r"outputs", r"must be a Tensor or an iterable of Tensors",
      like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    loss = _loss(model)
    return _world(model, opt, sc), lambda: sc.scale(loss.item())


@case("scaler_scale_meta_loss", RuntimeError, r"outputs is on the meta device", r"model\.to_empty\(device=")
def _(lib):
    # Deferred initialisation forgotten: PyTorch creates the scale on meta, and step() fails later.
    with torch.device("meta"):
        model = _net()
    sc = lib.GradScaler("cpu")
    loss = model(torch.randn(5, 6, device="meta")).sum()
    return _world(model, None, sc), lambda: sc.scale(loss)


@case("scaler_unscale_meta_grads", RuntimeError, r"param_groups\[0\]\['params'\]\[0\]",
      r"to_empty\(device=")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    with torch.device("meta"):
        meta = _net()
    for p in meta.parameters():
        p.grad = torch.ones_like(p)
    meta_opt = lib.SGD(meta.parameters(), lr=0.1)
    return _world(model, opt, sc, meta=meta), lambda: sc.unscale_(meta_opt)


# ------------------------------------------------------------------ GradScaler: call order

@case("scaler_unscale_twice", RuntimeError, r"unscale_\(\) has already been called",
      r"since the last update\(\)", like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    sc.unscale_(opt)
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


@case("scaler_unscale_after_step", RuntimeError, r"unscale_\(\) is being called after step\(\)",
      like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


@case("scaler_step_twice", RuntimeError, r"step\(\) has already been called", r"since the last update\(\)",
      like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.step(opt)


@case("scaler_update_without_step", AssertionError, r"No inf checks were recorded prior to update",
      like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.update()


@case("scaler_step_without_scale", AssertionError, r"Attempted step but _scale is None",
      r"did not use scaler\.scale\(loss or outputs\)", like_torch="message")
def _(lib):
    model = _net()
    opt = _opt(lib, "SGD", model)
    _loss(model).backward()
    sc = lib.GradScaler("cpu")
    return _world(model, opt, sc), lambda: sc.step(opt)


@case("scaler_step_with_closure", RuntimeError, r"Closure use is not currently supported", like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.step(opt, closure=lambda: _loss(model))


@case("scaler_unscale_fp16_grads", ValueError, r"Attempting to unscale FP16 gradients", like_torch="message")
def _(lib):
    model = _net(torch.float16)
    opt = lib.SGD(model.parameters(), lr=0.1)
    sc = lib.GradScaler("cpu")
    sc.scale(_loss(model)).backward()
    return _world(model, opt, sc), lambda: sc.unscale_(opt)


# ------------------------------------------------------------------ GradScaler.clip_grad_norm_

@case("clip_max_norm_negative", ValueError, r"max_norm", r"non-negative number.*expected e\.g\. 1\.0")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, -1.0)


@case("clip_max_norm_nan", ValueError, r"max_norm", r"non-negative number")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, math.nan)


@case("clip_norm_type_zero", ValueError, r"norm_type", r"positive number or inf")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0, norm_type=0)


@case("clip_norm_type_fro", ValueError, r"norm_type", r"expected e\.g\. 2\.0")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0, norm_type="fro")


@case("clip_given_parameters_not_optimizer", TypeError, r"optimizer must be",
      r"scaler\.clip_grad_norm_\(optimizer, max_norm\)")
def _(lib):
    # The habit from torch.nn.utils.clip_grad_norm_(model.parameters(), ...).
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(model.parameters(), 1.0)


@case("clip_after_step", RuntimeError, r"clip_grad_norm_\(\) is being called after step\(\)",
      r"between scaler\.scale\(loss\)\.backward\(\) and scaler\.step\(optimizer\)")
def _(lib):
    model, opt, sc = _trained(lib)
    sc.step(opt)
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0)


@case("clip_fp16_grads_torch_optimizer", ValueError, r"param_groups\[0\]\['params'\]\[0\] has a float16 grad",
      r"keep the model in float32.*fastamp\.optim")
def _(lib):
    model = _net(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = lib.GradScaler("cpu")
    sc.scale(_loss(model)).backward()
    return _world(model, opt, sc), lambda: sc.clip_grad_norm_(opt, 1.0)


@case("scaler_fused_step_with_sparse_grads", RuntimeError, r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
      r"sparse=False")
def _(lib):
    # The scaler's read-only inf check passes; the fused optimizer refuses: the scaler's
    # per-optimizer state must not keep the inf check of a step that did not happen.
    emb = nn.Embedding(10, 4, sparse=True)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    sc = lib.GradScaler("cpu")
    sc.scale(model(torch.tensor([1, 2, 3])).square().sum()).backward()
    return _world(model, opt, sc), lambda: sc.step(opt)


# ------------------------------------------------------------------ optimizers: construction

def _params():
    model = _net()
    return model, list(model.parameters())


@case("adam_lr_negative", ValueError, r"learning rate", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.Adam(ps, lr=-1e-3)


@case("adamw_beta_out_of_range", ValueError, r"beta parameter at index 1", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.AdamW(ps, betas=(0.9, 1.0))


@case("adamw_weight_decay_negative", ValueError, r"weight_decay", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.AdamW(ps, weight_decay=-0.1)


@case("sgd_nesterov_without_momentum", ValueError, r"Nesterov momentum",
      r"requires a momentum and zero dampening", like_torch="message")
def _(lib):
    model, ps = _params()
    return _world(model), lambda: lib.SGD(ps, lr=0.1, nesterov=True)


@case("optim_add_param_group_already_present", ValueError, r"more than one parameter group", like_torch="message")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: opt.add_param_group({"params": [model[0].weight]})


# ------------------------------------------------------------------ optimizers: step

@case("adam_sparse_grads", RuntimeError, r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
      r"sparse=False|SparseAdam", like_torch="type")
def _(lib):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = lib.Adam(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    return _world(model, opt), lambda: opt.step()


@case("sgd_sparse_grads", RuntimeError, r"param_groups\[0\]\['params'\]\[0\] has a sparse grad",
      r"use torch\.optim\.SGD")
def _(lib):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = lib.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.tensor([1, 2, 3])).sum().backward()
    return _world(model, opt), lambda: opt.step()


@case("adam_float64_params", TypeError, r"param_groups\[0\]\['params'\]\[0\] has dtype torch\.float64",
      r"use torch\.optim")
def _(lib):
    model = _net(torch.float64)
    opt = lib.Adam(model.parameters(), lr=1e-3)
    _loss(model).backward()
    return _world(model, opt), lambda: opt.step()


@case("adamw_bad_param_in_third_group", TypeError, r"param_groups\[2\]\['params'\]\[0\] has dtype torch\.complex64",
      r"use torch\.optim")
def _(lib):
    # The first two groups are fine: they must not be stepped before the third is refused.
    model, opt, sc = _trained(lib, backward=True)
    z = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    z.grad = torch.ones_like(z)
    opt.add_param_group({"params": [z]})
    return _world(model, opt, sc, z=z), lambda: opt.step()


@case("adamw_master_weights_mixed_group", RuntimeError,
      r"param_groups\[0\]\['params'\]\[0\] is float32, param_groups\[0\]\['params'\]\[2\] is not",
      r"separate param groups")
def _(lib):
    model = _net()
    model[2].to(torch.bfloat16)
    opt = lib.AdamW(model.parameters(), lr=1e-3, master_weights=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return _world(model, opt), lambda: opt.step()


@case("adam_group_on_two_devices", RuntimeError, r"param_groups\[0\]\['params'\]\[1\] is on meta",
      r"model\.to\(device\)")
def _(lib):
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(4, device="meta"))
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt = lib.Adam([a, b], lr=1e-3)
    return _world(None, opt, a=a, b=b), lambda: opt.step()


# ------------------------------------------------------------------ optimizers: load_state_dict

def _optim_load(lib, mutate: Callable[[dict], Any], kind: str = "AdamW"):
    model, opt, sc = _trained(lib, kind, backward=False)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


@case("optim_load_state_of_another_model", ValueError, r"state_dict\['state'\]\[0\]\['exp_avg'\] has shape \(6, 8\)",
      r"saved with this model")
def _(lib):
    # Same number of parameters per group, other shapes: PyTorch loads it, the step fails.
    other = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(8, 3))
    other_opt = _opt(lib, "AdamW", other)
    nn.functional.mse_loss(other[2](torch.randn(5, 8)), torch.randn(5, 3)).backward()
    other[0](torch.randn(5, 8)).sum().backward()
    other_opt.step()
    sd = other_opt.state_dict()
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


@case("optim_load_sgd_state_into_adamw", KeyError, r"state_dict\['param_groups'\]\[0\] has no \['betas'",
      r"looks like an SGD state_dict.*same optimizer type", like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, "AdamW", backward=False)
    sgd = _opt(TORCH, "SGD", model)
    _loss(model).backward()
    sgd.step()
    sd = sgd.state_dict()
    opt.zero_grad(set_to_none=True)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


@case("optim_load_model_state_dict", KeyError, r"state_dict has no 'state' entry",
      r"model's state_dict or a whole checkpoint", like_torch="type")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    return _world(model, opt, sc), lambda: opt.load_state_dict(model.state_dict())


@case("optim_load_state_missing_step", KeyError, r"state_dict\['state'\]\[1\] has no 'step'",
      r"state an Adam/AdamW optimizer saves", like_torch="type")
def _(lib):
    # PyTorch raises this too -- from __setstate__, after the optimizer's state was replaced.
    return _optim_load(lib, lambda sd: sd["state"][1].pop("step"))


@case("optim_load_state_tensors_as_lists", TypeError, r"state_dict\['state'\]\[0\]\['exp_avg'\] is a list",
      r"torch\.save")
def _(lib):
    def to_lists(sd):
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].tolist()

    return _optim_load(lib, to_lists)


@case("optim_load_negative_lr", ValueError, r"state_dict\['param_groups'\]\[1\]\['lr'\]", r"a number >= 0")
def _(lib):
    def bad(sd):
        sd["param_groups"][1]["lr"] = -2e-3

    return _optim_load(lib, bad)


@case("optim_load_group_count_mismatch", ValueError, r"different number of parameter groups", like_torch="message")
def _(lib):
    def one_group(sd):
        sd["param_groups"] = sd["param_groups"][:1]

    return _optim_load(lib, one_group)


@case("optim_load_group_size_mismatch", ValueError, r"doesn't match the size of optimizer's group",
      like_torch="message")
def _(lib):
    def shorter(sd):
        sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:1]

    return _optim_load(lib, shorter)


# ------------------------------------------------------------------ checkpoint

def _ckpt_world():
    model, opt, sc = _trained(FASTAMP)
    x = torch.randn(5, 6, requires_grad=True)
    return _world(model, opt, sc), model, x


@case("checkpoint_use_reentrant_true", ValueError, r"use_reentrant=True", r"Pass use_reentrant=False")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, use_reentrant=True)


@case("checkpoint_use_reentrant_string", TypeError, r"use_reentrant must be False", r"expected use_reentrant=False")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, use_reentrant="False")  # truthy


@case("checkpoint_determinism_check_unknown", ValueError, r"determinism_check", r"one of \['default', 'none', 'bitwise'\]")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, determinism_check="exact")


@case("checkpoint_bitwise_with_debug", ValueError, r"determinism_check='bitwise'.*debug=True",
      r"cannot be combined with debug=True")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, determinism_check="bitwise", debug=True)


@case("checkpoint_arguments_swapped", TypeError, r"function must be callable", r"checkpoint\(block, \*inputs\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(x, model)


@case("checkpoint_context_fn_factory_uncalled", TypeError, r"context_fn must return two context managers",
      r"selective instead of context_fn=selective\(\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, context_fn=selective)


@case("selective_policy_single_op", TypeError, r"policy is the op", r"selective\(\[torch\.ops\.aten\.mm\.default\]\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint(model, x, context_fn=selective(torch.ops.aten.mm.default))


@case("checkpoint_sequential_segments_zero", ValueError, r"segments", r"int >= 1")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint_sequential(model, 0, x)


@case("checkpoint_sequential_single_module", TypeError, r"functions must be an nn\.Sequential",
      r"fastamp\.checkpoint\.checkpoint\(block, input\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: checkpoint_sequential(model[0], 1, x)


@case("offload_device_types_string", TypeError, r"device_types", r"device_types=\('cuda',\)")
def _(lib):
    w, model, x = _ckpt_world()
    return w, lambda: offload_activations(device_types="cuda")  # would match no device at all


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(3)])


@case("apply_budget_zero", ValueError, r"budget_bytes", r"finite number > 0")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(model, 0, torch.randn(8, 16), verbose=False)


@case("apply_budget_nan", ValueError, r"budget_bytes", r"finite number > 0")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(model, math.nan, torch.randn(8, 16), verbose=False)


@case("apply_unknown_block", ValueError, r"blocks\[1\]='layers\.1'", r"model\.named_modules\(\)")
def _(lib):
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(
        model, 1 << 20, torch.randn(8, 16), blocks=["0", "layers.1"], verbose=False)


@case("apply_budget_unreachable", ValueError, r"budget", r"raise the budget")
def _(lib):
    # Raised after measuring: the measuring forwards must not move BatchNorm's running stats,
    # and no block may be left checkpointed.
    model = _bn_net()
    return _world(model), lambda: fastamp.checkpoint.apply(model, 16, torch.randn(8, 16), verbose=False)


# ------------------------------------------------------------------ GradientAccumulator, scale_lr, memory

@case("accumulator_steps_zero", ValueError, r"accum_steps", r"int >= 1")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(opt, 0, scaler=sc)


@case("accumulator_given_parameters", TypeError, r"optimizer must be a torch\.optim\.Optimizer",
      r"expected GradientAccumulator\(torch\.optim")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(model.parameters(), 4)


@case("accumulator_max_grad_norm_negative", ValueError, r"max_grad_norm", r"number > 0")
def _(lib):
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: fastamp.GradientAccumulator(opt, 2, max_grad_norm=-1.0)


@case("accumulator_backward_outside_with", RuntimeError, r"micro\.backward\(loss\) was called outside",
      r"with micro: micro\.backward\(loss\)")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    acc = fastamp.GradientAccumulator(opt, 2, scaler=sc)
    _, micro = next(acc.iterate([0, 1]))
    loss = _loss(model)
    return _world(model, opt, sc, acc=acc), lambda: micro.backward(loss)


@case("accumulator_block_without_backward", RuntimeError, r"call micro\.backward\(loss\)", r"inside `with micro:`")
def _(lib):
    # The last micro-batch of a group: leaving the block would step the optimizer.
    model, opt, sc = _trained(lib, backward=True)
    acc = fastamp.GradientAccumulator(opt, 1, scaler=sc)
    _, micro = next(acc.iterate([0]))

    def misuse():
        with micro:
            pass

    return _world(model, opt, sc, acc=acc), misuse


@case("accumulator_backward_of_float", TypeError, r"micro\.backward\(loss\) takes the loss tensor",
      r"was \.item\(\) called")
def _(lib):
    model, opt, sc = _trained(lib, backward=False)
    acc = fastamp.GradientAccumulator(opt, 2, scaler=sc)
    _, micro = next(acc.iterate([0, 1]))
    loss = _loss(model)

    def misuse():
        with micro:
            micro.backward(loss.item())

    return _world(model, opt, sc, acc=acc), misuse


@case("scale_lr_unknown_rule", ValueError, r"rule", r"'linear' or 'sqrt'")
def _(lib):
    return {}, lambda: fastamp.scale_lr(1e-3, 256, 1024, rule="cubic")


@case("scale_lr_base_batch_zero", ValueError, r"base_batch", r"int >= 1")
def _(lib):
    return {}, lambda: fastamp.scale_lr(1e-3, 0, 1024)


@case("scale_lr_base_lr_string", TypeError, r"base_lr", r"expected e\.g\. 1e-3")
def _(lib):
    return {}, lambda: fastamp.scale_lr("1e-3", 256, 1024)


def _enter(cm):
    with cm:
        pass


@case("memory_track_cuda_without_gpu", RuntimeError, r"device='cuda'", r"expected device='cpu'")
def _(lib):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the misuse needs a machine without it")
    return {}, lambda: _enter(fastamp.memory.track("cuda"))


@case("memory_track_meta", ValueError, r"device='meta'", r"expected 'cpu' or a CUDA device")
def _(lib):
    return {}, lambda: _enter(fastamp.memory.track("meta"))


@case("ddp_without_process_group", RuntimeError, r"torch\.distributed is not initialised",
      r"call torch\.distributed\.init_process_group\(\) first")
def _(lib):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model, opt, sc = _trained(lib)
    return _world(model, opt, sc), lambda: FDDP(model)


# ------------------------------------------------------------------ raw ops

_F = torch.ops.fastamp


def _grads(n=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4 + i, generator=g) * 64 for i in range(n)]


def _scalar(v, dtype=torch.float32):
    return torch.full((), v, dtype=dtype)


@case("op_unscale_tensor_found_inf_wrong_length", RuntimeError, r"tensor_found_inf", r"len\(grads\)=3")
def _(lib):
    grads, found = _grads(), _scalar(0.0)
    flags = torch.zeros(2, dtype=torch.bool)
    return ({"grads": grads, "found_inf": found, "flags": flags},
            lambda: _F.non_finite_check_and_unscale_(grads, found, _scalar(1 / 64), flags))


@case("op_adam_step_list_lengths_differ", RuntimeError, r"exp_avgs has 1 tensors", r"expected one per param \(2\)")
def _(lib):
    ps = [torch.randn(4), torch.randn(5)]
    gs = [torch.randn(4), torch.randn(5)]
    m, v = [torch.zeros(4)], [torch.zeros(4), torch.zeros(5)]
    steps = [_scalar(0.0), _scalar(0.0)]
    world = {"params": ps, "grads": gs, "exp_avgs": m, "exp_avg_sqs": v, "steps": steps}
    return world, lambda: _F.adam_step_(ps, gs, m, v, [], steps, [], 1e-3, None, 0.9, 0.999, 0.0, 1e-8,
                                        False, True, False, None, None, None)


@case("op_unscale_overlapping_output_view", RuntimeError, r"grads\[1\] is a view whose elements overlap",
      r"\.clone\(\)")
def _(lib):
    base = torch.randn(1, 4)
    grads = [torch.randn(3), base.expand(3, 4)]  # writing it in place would hit each element 3 times
    found = _scalar(0.0)
    return ({"grads": grads, "base": base, "found": found},
            lambda: _F.non_finite_check_and_unscale_(grads, found, _scalar(0.5), torch.zeros(2, dtype=torch.bool)))


@case("op_grad_stats_inv_scale_two_elements", RuntimeError, r"inv_scale has 2 elements", r"expected a one-element tensor")
def _(lib):
    grads = _grads()
    return {"grads": grads}, lambda: _F.grad_stats(grads, torch.ones(2), 2.0)


@case("op_update_scale_float64_scale", RuntimeError, r"scale has dtype Double", r"expected Float")
def _(lib):
    scale, growth, hyst = _scalar(1024.0, torch.float64), _scalar(3, torch.int32), _scalar(1, torch.int32)
    found = _scalar(0.0)
    return ({"scale": scale, "growth": growth, "hysteresis": hyst, "found": found},
            lambda: _F.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 1, 1, 0.0, math.inf))


@case("op_clip_unscale_grads_on_two_devices", RuntimeError, r"grads\[1\] is on meta", r"group tensors by device")
def _(lib):
    grads = [torch.randn(4) * 64, torch.randn(4, device="meta")]
    return {"grads": grads}, lambda: _F.clip_unscale_(grads, _scalar(1 / 64), _scalar(2.0), 1.0)


@case("op_sgd_step_buffers_without_momentum", RuntimeError, r"momentum_buffers", r"must be empty when momentum == 0")
def _(lib):
    ps, gs, bufs = [torch.randn(4)], [torch.randn(4)], [torch.zeros(4)]
    counts = [_scalar(0.0)]
    world = {"params": ps, "grads": gs, "bufs": bufs, "counts": counts}
    return world, lambda: _F.sgd_step_(ps, gs, bufs, counts, [], 0.1, None, 0.0, 0.0, 0.0, False, False,
                                       None, None, None)


@case("op_rng_set_state_empty", ValueError, r"states is empty", r"the list returned by fastamp::rng_get_state")
def _(lib):
    return {"cpu_rng": torch.get_rng_state()}, lambda: _F.rng_set_state([])


# ================================================================== the tests


def _check_message(c: Case, err: BaseException) -> None:
    msg = str(err)
    assert re.search(c.arg, msg), f"{c.id}: the message does not name the argument ({c.arg!r}): {msg}"
    if c.fix is not None:
        assert re.search(c.fix, msg), f"{c.id}: the message does not say what to do ({c.fix!r}): {msg}"


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_misuse_raises_a_clear_error_and_changes_nothing(c: Case):
    world, misuse = c.build(FASTAMP)
    before = _snapshot(world)
    with pytest.raises(c.exc, match=c.arg) as info:
        misuse()
    _check_message(c, info.value)
    changed = _diff(before, _snapshot(world))
    assert not changed, f"{c.id} changed state before raising: {changed[:12]}"
    if c.like_torch is not None:
        _, t_misuse = c.build(TORCH)
        with pytest.raises(BaseException) as t_info:
            t_misuse()
        assert type(info.value) is c.exc and isinstance(t_info.value, c.exc), (
            f"{c.id}: PyTorch raises {type(t_info.value).__name__}: {t_info.value}")
        if c.like_torch == "message":
            assert str(info.value) == str(t_info.value)


def test_the_catalogue_is_large_and_distinct():
    ids = [c.id for c in CASES] + [c[0] for c in DDP_CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 30


# ------------------------------------------------------------------ the snapshot can fail


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    # Writes through NumPy do not bump the version counter: only the bytes change.
    return t.detach().numpy().reshape(-1).view(np.uint8)


def test_snapshot_sees_a_single_changed_byte_anywhere():
    model, opt, sc = _trained(FASTAMP, "AdamW", hysteresis=2)
    sc.unscale_(opt)
    world = _world(model, opt, sc)
    base = _snapshot(world)
    assert _diff(base, _snapshot(world)) == []
    targets = {
        "model.0.weight": model[0].weight,
        "model.2.bias.grad": model[2].bias.grad,
        "optimizer.state[model.0.weight]['exp_avg_sq']": opt.state[model[0].weight]["exp_avg_sq"],
        "optimizer.state[model.2.bias]['step']": opt.state[model[2].bias]["step"],
        "scaler._scale": sc._scale,
        "scaler._growth_tracker": sc._growth_tracker,
        "scaler._hysteresis_tracker": sc._hysteresis_tracker,
        "found_inf_per_device": sc._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")],
    }
    for name, t in targets.items():
        raw = _np_bytes(t)
        k = raw.size - 1  # the last byte: for a float, the sign/exponent
        raw[k] ^= 0x01
        changed = _diff(base, _snapshot(world))
        assert len(changed) >= 1 and all(x.startswith("~ ") for x in changed), (name, changed)
        raw[k] ^= 0x01
        assert _diff(base, _snapshot(world)) == [], name


def test_snapshot_is_nan_safe_and_sees_signed_zero_versions_and_python_state():
    t = torch.tensor([math.nan, 0.0, 1.0])
    base = _snapshot({"t": t})
    assert _diff(base, _snapshot({"t": t})) == []  # NaN == NaN, byte for byte
    _np_bytes(t)[7] ^= 0x80  # 0.0 -> -0.0: equal as numbers, not as bytes
    assert t[1].item() == 0.0 and _diff(base, _snapshot({"t": t})) == ["~ t"]
    _np_bytes(t)[7] ^= 0x80
    t.add_(0.0)  # same bytes, but written in place: the version counter moved
    assert _diff(base, _snapshot({"t": t})) == ["~ t"]

    model, opt, sc = _trained(FASTAMP, "SGD", backward=False)
    world = _world(model, opt, sc)
    base = _snapshot(world)
    sc._per_optimizer_states[id(object())]  # the defaultdict grows an entry: pickling now fails
    assert any(x.startswith("+ scaler._per_optimizer_states[") for x in _diff(base, _snapshot(world)))
    sc._per_optimizer_states.clear()
    opt.param_groups[1]["lr"] = math.nextafter(opt.param_groups[1]["lr"], 1.0)
    assert _diff(base, _snapshot(world)) == ["~ optimizer.param_groups[1]['lr']"]
    opt.param_groups[1]["lr"] = 2e-3
    model[2].forward = functools.partial(model[2].forward)
    assert _diff(base, _snapshot(world)) == ["~ model.2.<module>"]
    del model[2].forward
    model[0].weight.grad = None
    assert "- model.0.weight.grad" in _diff(base, _snapshot(world))


# ================================================================== DDP across 2 gloo ranks

def _ddp_model_differs(rank):
    model = nn.Sequential(nn.Linear(4, 8 if rank == 0 else 9), nn.Linear(8 if rank == 0 else 9, 2))
    model(torch.randn(3, 4)).sum().backward()
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return _world(model, opt), lambda: FDDP(model)


def _ddp_bucket_cap_zero(rank):
    model = _net(seed=rank)
    return _world(model), lambda: FDDP(model, bucket_cap_mb=0)


def _ddp_two_device_ids(rank):
    model = _net(seed=rank)
    return _world(model), lambda: FDDP(model, device_ids=[0, 1])


# (id, build(rank), exception, argument regex, fix regex)
DDP_CASES = [
    ("ddp_model_differs_across_ranks", _ddp_model_differs, RuntimeError,
     r"differs across ranks \(rank 0 has '0\.weight:\(8, 4\):torch\.float32', rank 1 has '0\.weight:\(9, 4\)",
     r"Every rank must construct the same model"),
    ("ddp_bucket_cap_mb_zero", _ddp_bucket_cap_zero, ValueError, r"bucket_cap_mb", r"positive, finite number .*e\.g\. 25"),
    ("ddp_two_device_ids", _ddp_two_device_ids, ValueError, r"device_ids=\[0, 1\]", r"one device per process"),
]


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for cid, build, exc, _, _ in DDP_CASES:
        objects, misuse = build(rank)
        before = _snapshot(objects)
        try:
            misuse()
        except Exception as e:  # noqa: BLE001 -- recorded, judged by the test
            raised = [type(e).__name__, str(e), isinstance(e, exc)]
        else:
            raised = None
        results[cid] = {"raised": raised, "changed": _diff(before, _snapshot(objects))}
        dist.barrier()  # the next case starts together on every rank
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_misuse")
    world = 2
    mp.spawn(_ddp_worker, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("ddp_case", DDP_CASES, ids=[c[0] for c in DDP_CASES])
def test_ddp_misuse_on_every_rank(ddp_case, ddp_results):
    cid, _, exc, arg, fix = ddp_case
    for rank, results in enumerate(ddp_results):
        r = results[cid]
        assert r["raised"] is not None, f"{cid}: rank {rank} raised nothing"
        name, msg, is_exc = r["raised"]
        assert is_exc, f"{cid}: rank {rank} raised {name}, expected {exc.__name__}: {msg}"
        assert re.search(arg, msg), f"{cid}: rank {rank}: the message does not name {arg!r}: {msg}"
        assert re.search(fix, msg), f"{cid}: rank {rank}: the message does not say {fix!r}: {msg}"
        assert not r["changed"], f"{cid}: rank {rank} changed state before raising: {r['changed'][:12]}"


# ================================================================== the checks let valid input through


def test_master_weights_state_survives_a_state_dict_round_trip():
    # PyTorch's load casts all floating state to the param's dtype: the fp32 masters and moments
    # of fp16 params came back as fp16 and the next step failed.
    model = _net(torch.float16)
    opt = fastamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    for seed in range(3):
        opt.zero_grad()
        _loss(model, seed).backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = fastamp.optim.AdamW(twin.parameters(), lr=1e-2, master_weights=True)
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], opt2.state[q][key]
            assert b.dtype == torch.float32 and _bytes(a) == _bytes(b), key
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        _loss(m, 7).backward()
        o.step()
    assert all(_bytes(p) == _bytes(q) for p, q in zip(model.parameters(), twin.parameters()))


def test_state_dicts_of_torch_and_after_user_pre_hooks_still_load():
    model, opt, _ = _trained(TORCH, "AdamW", backward=False)
    f_opt = _opt(FASTAMP, "AdamW", model)
    f_opt.load_state_dict(opt.state_dict())
    _loss(model).backward()
    f_opt.step()
    # fastamp's check runs after the user's pre-hooks: a hook may repair an old checkpoint.
    sd = copy.deepcopy(f_opt.state_dict())
    for st in sd["state"].values():
        del st["step"]

    def add_steps(optimizer, state_dict):
        for st in state_dict["state"].values():
            st.setdefault("step", torch.tensor(5.0))

    g_opt = _opt(FASTAMP, "AdamW", model)
    g_opt.register_load_state_dict_pre_hook(add_steps)
    g_opt.load_state_dict(sd)
    assert float(g_opt.state[model[0].weight]["step"]) == 5.0


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_a_grad_with_other_strides_than_its_param_steps_like_torch(kind):
    # PyTorch takes any grad layout; the fused kernel needs the param's, so it gets a copy.
    models = [_net(), _net()]
    opts = [_opt(TORCH, kind, models[0], foreach=False), _opt(FASTAMP, kind, models[1])]
    for m, o in zip(models, opts):
        _loss(m).backward()
        w = m[0].weight
        w.grad = w.grad.t().contiguous().t()  # same values, column-major
        assert w.grad.stride() != w.stride()
        o.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_scaler_accepts_what_pytorch_does_and_an_int_new_scale():
    model, opt, sc = _trained(FASTAMP, backward=False)
    sc.update(new_scale=512)  # PyTorch fails on an int (AttributeError); a number is a number
    assert sc.get_scale() == 512.0
    sc.load_state_dict(torch.amp.GradScaler("cpu", init_scale=64.0).state_dict())
    assert sc.get_scale() == 64.0
    sc.set_growth_interval(3)
    outs = sc.scale([torch.ones(()), (torch.ones(2),)])
    assert float(outs[0]) == 64.0 and outs[1][0].tolist() == [64.0, 64.0]


def test_apply_measures_without_moving_batchnorm_statistics():
    model = _bn_net()
    world = _world(model)
    before = _snapshot(world)
    plan = fastamp.checkpoint.apply(model, 1 << 30, torch.randn(8, 16), verbose=False)
    assert not plan.chosen and _diff(before, _snapshot(world)) == []
