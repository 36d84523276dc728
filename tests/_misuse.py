"""The misuse-catalogue harness shared by the ``tests/<capability>/test_misuse.py`` files: realistic
misuses of the public API, one case each (issue 8).

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
is put through the same misuse and must raise the same exception type. The harness's own tests
(the snapshot sees one changed byte, ...) are in tests/toolkit/test_misuse_harness.py.
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

__all__ = [
    "Any",
    "Callable",
    "Case",
    "FASTAMP",
    "FDDP",
    "Mapping",
    "TORCH",
    "_F",
    "_Flattener",
    "_batch",
    "_bn_net",
    "_bytes",
    "_check_message",
    "_ckpt_world",
    "_diff",
    "_enter",
    "_grads",
    "_loss",
    "_net",
    "_opt",
    "_optim_load",
    "_params",
    "_scalar",
    "_scaler_load",
    "_snapshot",
    "_tensor_leaf",
    "_trained",
    "_world",
    "check_misuse",
    "checkpoint",
    "checkpoint_sequential",
    "copy",
    "dataclass",
    "datetime",
    "dist",
    "enum",
    "fastamp",
    "functools",
    "json",
    "make_case",
    "math",
    "mp",
    "nn",
    "np",
    "offload_activations",
    "pytest",
    "re",
    "selective",
    "torch",
    "types",
]  # for the test files' star import

# ================================================================== snapshots


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy())


def _tensor_leaf(t: torch.Tensor) -> tuple:
    """Everything that identifies a tensor's contents: metadata, version counter, storage
    address and the bytes themselves (so NaN == NaN and -0.0 != 0.0)."""
    head = (
        type(t).__name__,
        str(t.layout),
        str(t.dtype),
        str(t.device),
        tuple(t.shape),
        t.requires_grad,
        t._version,
    )
    if t.layout == torch.strided:
        head += (t.stride(), t.storage_offset())
        if t.device.type == "meta":
            return head + ("<meta: no data>",)
        return head + (t.data_ptr(), _bytes(t))
    if t.layout == torch.sparse_coo:
        return head + (_tensor_leaf(t._indices()), _tensor_leaf(t._values()))
    return head + (repr(t),)


# Replays (fastamp.optim._replay.StepReplay, the scaler's GradReader with its GradPlans): caches of what a
# full step computed, replaced when what they were built from changes, never observable state
# (tests/optim/test_step_plan.py shows each change is seen). A refused call may keep or drop one.
_CACHE_ATTRS = frozenset({"replay", "_reader"})


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
        if isinstance(
            obj,
            (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial),
        ):
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
                if k not in _CACHE_ATTRS:
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
                type(sub).__name__,
                sub.training,
                id(sub.__dict__.get("forward")),
                len(sub._forward_hooks),
                len(sub._forward_pre_hooks),
                len(sub._backward_hooks),
            )

    def scaler(self, s: torch.amp.GradScaler, path: str) -> None:
        # Every attribute: _scale, _growth_tracker, _hysteresis_tracker, _per_optimizer_states
        # (with their inf checks), _diag, _ddp_stats, ... and the public state_dict().
        for k, v in vars(s).items():
            if k not in _CACHE_ATTRS:
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
    out = [f"+ {k}" for k in after if k not in before] + [
        f"- {k}" for k in before if k not in after
    ]
    out += [f"~ {k}" for k in before if k in after and before[k] != after[k]]
    return out


# ================================================================== worlds

FASTAMP = types.SimpleNamespace(
    name="fastamp",
    GradScaler=fastamp.GradScaler,
    SGD=fastamp.optim.SGD,
    Adam=fastamp.optim.Adam,
    AdamW=fastamp.optim.AdamW,
)
TORCH = types.SimpleNamespace(
    name="torch",
    GradScaler=torch.amp.GradScaler,
    SGD=torch.optim.SGD,
    Adam=torch.optim.Adam,
    AdamW=torch.optim.AdamW,
)


def _net(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _opt(lib: Any, kind: str, model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 2e-3},
    ]
    if kind == "SGD":
        kw.setdefault("momentum", 0.9)
    return getattr(lib, kind)(groups, lr=1e-2, **kw)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    x, y = _batch(seed)
    return nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _trained(
    lib: Any = FASTAMP,
    kind: str = "AdamW",
    *,
    steps: int = 2,
    backward: bool = True,
    dtype: torch.dtype = torch.float32,
    opt_kw: dict | None = None,
    **scaler_kw: Any,
):
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


def make_case(registry: list[Case]) -> Callable[..., Callable[[Any], Any]]:
    """``case = make_case(CASES)``: a decorator registering a misuse builder into ``registry``."""

    def case(
        id: str,
        exc: type[BaseException],
        arg: str,
        fix: str | None = None,
        like_torch: str | None = None,
    ):
        def register(build):
            registry.append(Case(id, build, exc, arg, fix, like_torch))
            return build

        return register

    return case


def _scaler_load(lib, **changes):
    model, opt, sc = _trained(lib, backward=False)
    sd = sc.state_dict()
    sd.update(changes)
    return _world(model, opt, sc), lambda: sc.load_state_dict(sd)


def _params():
    model = _net()
    return model, list(model.parameters())


def _optim_load(lib, mutate: Callable[[dict], Any], kind: str = "AdamW"):
    model, opt, sc = _trained(lib, kind, backward=False)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    return _world(model, opt, sc), lambda: opt.load_state_dict(sd)


def _ckpt_world():
    model, opt, sc = _trained(FASTAMP)
    x = torch.randn(5, 6, requires_grad=True)
    return _world(model, opt, sc), model, x


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(3)]
    )


def _enter(cm):
    with cm:
        pass


_F = torch.ops.fastamp


def _grads(n=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4 + i, generator=g) * 64 for i in range(n)]


def _scalar(v, dtype=torch.float32):
    return torch.full((), v, dtype=dtype)


def _check_message(c: Case, err: BaseException) -> None:
    msg = str(err)
    assert re.search(c.arg, msg), (
        f"{c.id}: the message does not name the argument ({c.arg!r}): {msg}"
    )
    if c.fix is not None:
        assert re.search(c.fix, msg), (
            f"{c.id}: the message does not say what to do ({c.fix!r}): {msg}"
        )


def check_misuse(c: Case) -> None:
    """Runs one case: the expected error naming the argument and the fix, nothing changed, and
    PyTorch's class raising the same where it has the API."""
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
            f"{c.id}: PyTorch raises {type(t_info.value).__name__}: {t_info.value}"
        )
        if c.like_torch == "message":
            assert str(info.value) == str(t_info.value)
