"""Property test over the public API (issue 14): whatever raises, nothing changed.

Hypothesis draws a sequence of calls -- valid ones and misuse -- on a small model trained with a
fastamp optimizer and fastamp.GradScaler, through fastamp.checkpoint, save_training_state and
load_training_state. Before each call everything observable is snapshotted: params, grads,
optimizer state, the scaler's state and per-optimizer stage, model buffers, every random
generator (torch, python, numpy) and the files in the run's directory. A call that raises must
leave all of it bit for bit as it was; a call that succeeds may change it (the sequence goes on
from there).
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import pathlib
import random
import shutil
import tempfile

import numpy as np
import torch
from hypothesis import strategies as st
from torch import nn

import fastamp
from fastamp.resume._checksums import seal
from fastamp.testing import assert_bitwise_equal
from tests._fuzz import tiered

OPTIMIZERS = ("Adam", "AdamW", "SGD")
BAD_NUMBERS = (-1.0, 0.0, math.nan, math.inf, "2", None, True, 3, 2.0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(6, 3)
        self.big = nn.Parameter(torch.randn(64, 64) * 0.1)  # 4096 elements: low-bit state applies

    def forward(self, x):
        return self.b(self.drop(self.bn(self.a(x)))) + (self.big @ self.big.t()).mean()


def _files(d: str) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _grad_copy(p):
    g = p.grad
    if g is None:
        return None
    return g.to_dense().clone() if g.is_sparse else g.clone()


def _snapshot(w):
    scaler = w["scaler"]
    stages = {
        k: (v.get("stage"), sorted(v.keys())) for k, v in scaler._per_optimizer_states.items()
    }
    return {
        "params": [p.detach().clone() for p in w["net"].parameters()],
        "grads": [_grad_copy(p) for p in w["net"].parameters()],
        "buffers": [b.clone() for b in w["net"].buffers()],
        "opt": copy.deepcopy(w["opt"].state_dict()),
        "scaler": scaler.state_dict(),
        "scale": None if scaler._scale is None else scaler._scale.clone(),
        "stages": repr(stages),
        "rng": [
            torch.get_rng_state(),
            repr(random.getstate()),
            torch.from_numpy(np.random.get_state()[1].astype("int64")),
        ],
        "files": _files(w["dir"]),
    }


def _backward(w, scale_inf=False):
    net, scaler, opt = w["net"], w["scaler"], w["opt"]
    opt.zero_grad()
    loss = net(torch.randn(5, 4)).square().mean()
    if scale_inf:
        loss = loss * math.inf
    scaler.scale(loss).backward()


def _op(data, w):
    """One drawn call; returns a label (for hypothesis' statistics) and the thunk."""
    net, scaler, opt = w["net"], w["scaler"], w["opt"]
    params = list(net.parameters())
    kind = data.draw(
        st.sampled_from(
            [
                "backward",
                "backward_inf",
                "step",
                "unscale",
                "update",
                "update_new_scale",
                "clip",
                "opt_step",
                "bad_grad",
                "load_opt",
                "load_scaler",
                "setters",
                "checkpoint",
                "save",
                "load",
                "add_group",
            ]
        )
    )
    if kind == "backward":
        return kind, lambda: _backward(w)
    if kind == "backward_inf":
        return kind, lambda: _backward(w, scale_inf=True)
    if kind == "step":
        closure = data.draw(st.sampled_from([None, "kw", "pos"]))
        if closure == "kw":
            return kind, lambda: scaler.step(opt, closure=lambda: None)
        if closure == "pos":
            return kind, lambda: scaler.step(opt, lambda: None)
        return kind, lambda: scaler.step(opt)
    if kind == "unscale":
        return kind, lambda: scaler.unscale_(opt)
    if kind == "update":
        return kind, lambda: scaler.update()
    if kind == "update_new_scale":
        v = data.draw(
            st.sampled_from(
                BAD_NUMBERS
                + (torch.tensor(2.0), torch.tensor([1.0, 2.0]), torch.tensor(2, dtype=torch.int32))
            )
        )
        return kind, lambda: scaler.update(v)
    if kind == "clip":
        max_norm = data.draw(st.sampled_from(BAD_NUMBERS + (1.0, 0.5)))
        norm_type = data.draw(st.sampled_from((2.0, 1.0, math.inf, 0.0, -2.0, "fro", math.nan)))
        target = data.draw(st.sampled_from(["opt", "params"]))
        obj = opt if target == "opt" else params
        return kind, lambda: scaler.clip_grad_norm_(obj, max_norm, norm_type)
    if kind == "opt_step":
        return kind, lambda: opt.step()
    if kind == "bad_grad":
        i = data.draw(st.integers(0, len(params) - 1))
        how = data.draw(
            st.sampled_from(
                [
                    "float64",
                    "complex",
                    "sparse",
                    "wrong_shape",
                    "int",
                    "meta",
                    "non_contiguous",
                    "none",
                ]
            )
        )
        p = params[i]

        def set_bad():
            def force(t):  # a grad autograd would not produce, set the way a user could
                p.grad = torch.zeros_like(p)
                p.grad.data = t

            if how == "float64":
                force(torch.randn(p.shape, dtype=torch.float64))
            elif how == "complex":
                force(torch.randn(p.shape, dtype=torch.complex64))
            elif how == "sparse":
                p.grad = torch.randn(p.shape).to_sparse()
            elif how == "wrong_shape":
                force(torch.randn(p.numel() + 1))
            elif how == "int":
                force(torch.ones(p.shape, dtype=torch.int64))
            elif how == "meta":
                force(torch.empty(p.shape, device="meta"))
            elif how == "non_contiguous":
                p.grad = (
                    torch.randn(tuple(reversed(p.shape))).t()
                    if p.dim() == 2
                    else torch.randn(p.numel() * 2)[::2]
                )
            else:
                p.grad = None

        # Setting the grad is the user's doing (it changes the grad on purpose); what follows is
        # the call under test.
        w["pending_setup"] = set_bad
        follow = data.draw(st.sampled_from(["step", "unscale", "clip", "opt_step"]))
        if follow == "step":
            return f"bad_grad:{how}:step", lambda: scaler.step(opt)
        if follow == "unscale":
            return f"bad_grad:{how}:unscale", lambda: scaler.unscale_(opt)
        if follow == "clip":
            return f"bad_grad:{how}:clip", lambda: scaler.clip_grad_norm_(opt, 1.0)
        return f"bad_grad:{how}:opt_step", lambda: opt.step()
    if kind == "add_group":
        options = data.draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "state_dtype": st.sampled_from(
                        [torch.float32, torch.bfloat16, "int8", "int4", torch.float16]
                    ),
                    "state_seed": st.sampled_from([0, 5, -1, 2**32, True]),
                    "amsgrad": st.booleans(),
                    "lr": st.sampled_from([1e-3, -1.0]),
                },
            )
        )
        again = data.draw(st.booleans())  # a param already in the optimizer: torch refuses it
        p = params[0] if again else nn.Parameter(torch.randn(4096) * 0.1)
        return f"add_group:{sorted(options)}", lambda: opt.add_param_group(
            {"params": [p], **options}
        )
    if kind == "load_opt":
        sd = copy.deepcopy(opt.state_dict())
        defect = data.draw(
            st.sampled_from(
                [
                    "none",
                    "no_state",
                    "groups",
                    "lr",
                    "shape",
                    "type",
                    "step",
                    "no_scales",
                    "short_scales",
                    "int_codes",
                    "float_codes",
                    "int_moments",
                    "transposed",
                ]
            )
        )
        lowbit_state = next((v for v in sd["state"].values() if "exp_avg_codes" in v), None)
        float_state = next(
            (
                v
                for v in sd["state"].values()
                if isinstance(v.get("exp_avg", v.get("momentum_buffer")), torch.Tensor)
            ),
            None,
        )
        if defect == "no_scales" and lowbit_state:
            del lowbit_state["exp_avg_sq_absmax"]
        elif defect == "short_scales" and lowbit_state:
            lowbit_state["exp_avg_absmax"] = lowbit_state["exp_avg_absmax"][:-1].clone()
        elif defect in ("int_codes", "float_codes") and lowbit_state:
            lowbit_state["exp_avg_codes"] = lowbit_state["exp_avg_codes"].to(
                torch.int16 if defect == "int_codes" else torch.float32
            )
        elif defect == "int_moments" and float_state:
            key = "exp_avg" if "exp_avg" in float_state else "momentum_buffer"
            float_state[key] = float_state[key].to(torch.int8)
        elif defect == "transposed":
            for v in sd["state"].values():
                for k, t in list(v.items()):
                    if isinstance(t, torch.Tensor) and t.dim() == 2:
                        v[k] = t.t().contiguous().t()
        if defect == "no_state":
            sd.pop("state")
        elif defect == "groups":
            sd["param_groups"] = sd["param_groups"] * 2
        elif defect == "lr":
            sd["param_groups"][0]["lr"] = -1.0
        elif sd["state"] and defect in ("shape", "type", "step"):
            first = next(iter(sd["state"].values()))
            key = next((k for k in first if k != "step"), None)
            if defect == "shape" and key:
                first[key] = torch.zeros(7)
            elif defect == "type" and key:
                first[key] = [1, 2]
            elif defect == "step":
                first["step"] = "one"
        return f"load_opt:{defect}", lambda: opt.load_state_dict(sd)
    if kind == "load_scaler":
        sd = scaler.state_dict()
        defect = data.draw(
            st.sampled_from(["none", "empty", "scale0", "scale_nan", "missing", "tracker", "type"])
        )
        if defect == "empty":
            sd = {}
        elif defect == "scale0":
            sd["scale"] = 0.0
        elif defect == "scale_nan":
            sd["scale"] = math.nan
        elif defect == "missing":
            sd.pop("growth_factor", None)
        elif defect == "tracker":
            sd["_growth_tracker"] = -3
        elif defect == "type":
            sd = [1, 2]
        return f"load_scaler:{defect}", lambda: scaler.load_state_dict(sd)
    if kind == "setters":
        which = data.draw(
            st.sampled_from(["set_growth_factor", "set_backoff_factor", "set_growth_interval"])
        )
        v = data.draw(st.sampled_from(BAD_NUMBERS + (0.9, 1.5, 7)))
        return f"{which}", lambda: getattr(scaler, which)(v)
    if kind == "checkpoint":
        block = w["block"]
        kwargs = data.draw(
            st.sampled_from(
                [
                    {},
                    {"use_reentrant": True},
                    {"use_reentrant": "no"},
                    {"determinism_check": "exact"},
                    {"determinism_check": "bitwise", "debug": True},
                    {"context_fn": 3},
                    {"preserve_rng_state": False},
                ]
            )
        )
        requires_grad = data.draw(st.booleans())
        freeze = data.draw(st.booleans())

        x = torch.randn(5, 4, requires_grad=requires_grad)  # drawn before the call under test

        def run():
            block.requires_grad_(not freeze)
            try:
                out = fastamp.checkpoint.checkpoint(block, x, **kwargs)
                if out.requires_grad:
                    out.sum().backward()
            finally:
                block.requires_grad_(True)

        return f"checkpoint:{sorted(kwargs)}", run
    if kind == "save":
        target = data.draw(st.sampled_from(["file", "dir", "missing_dir"]))
        extra = data.draw(
            st.sampled_from(
                [
                    None,
                    {"epoch": 1},
                    {"p": pathlib.Path("x")},
                    {"bad": object()},
                    {"s": {1, 2}},
                    "notadict",
                    {"arr": np.ones(2)},
                ]
            )
        )
        path = {
            "file": os.path.join(w["dir"], "c.pt"),
            "dir": w["dir"],
            "missing_dir": os.path.join(w["dir"], "nope", "c.pt"),
        }[target]
        return f"save:{target}", lambda: fastamp.save_training_state(
            path, model=net, optimizer=opt, scaler=scaler, step=1, extra=extra
        )
    # load
    defect = data.draw(
        st.sampled_from(["none", "rng", "scaler_empty", "exp_avg", "groups", "missing_file"])
    )
    path = os.path.join(w["dir"], "c.pt")

    def load():
        if defect == "missing_file" or not os.path.exists(path):
            return fastamp.load_training_state(os.path.join(w["dir"], "absent.pt"), model=net)
        obj = torch.load(path, weights_only=True)
        if defect == "rng":
            obj["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)
        elif defect == "scaler_empty":
            obj["scaler"] = {}
        elif defect == "exp_avg" and obj["optimizer"]["state"]:
            first = next(iter(obj["optimizer"]["state"].values()))
            for k in list(first):
                if k != "step":
                    first[k] = torch.zeros(2)
        elif defect == "groups":
            obj["optimizer"]["param_groups"].append(dict(obj["optimizer"]["param_groups"][0]))
        tampered = os.path.join(w["scratch"], "t.pt")
        torch.save(seal(obj), tampered)  # edited, checksums recomputed: the later checks refuse it
        return fastamp.load_training_state(tampered, model=net, optimizer=opt, scaler=scaler)

    return f"load:{defect}", load


def _check_public_api_misuse_changes_nothing(data):
    """Whatever raises, nothing changed (params, grads, optimizer state, scaler state and stage,
    buffers, RNG, files)."""
    name = data.draw(st.sampled_from(OPTIMIZERS))
    torch.manual_seed(data.draw(st.integers(0, 3)))
    net = _Net()
    cls = getattr(fastamp.optim, name)
    kw = {"lr": 0.05, "momentum": 0.9} if name == "SGD" else {"lr": 1e-2}
    formats = [torch.float32, torch.bfloat16] + ([] if name == "SGD" else ["int8"])
    kw["state_dtype"] = data.draw(st.sampled_from(formats))
    big = {"params": [net.big]}
    if data.draw(st.booleans()):  # a group of its own format
        big["state_dtype"] = data.draw(st.sampled_from(formats))
    opt = cls(
        [
            {"params": [net.a.weight, net.a.bias]},
            {"params": list(net.bn.parameters()) + list(net.b.parameters())},
            big,
        ],
        **kw,
    )
    d = tempfile.mkdtemp(prefix="fastamp-fuzz-")
    scratch = tempfile.mkdtemp(prefix="fastamp-fuzz-scratch-")
    w = {
        "net": net,
        "opt": opt,
        "scaler": fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
        "dir": d,
        "scratch": scratch,
        "block": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)),
    }
    try:
        for _ in range(data.draw(st.integers(1, 8))):
            label, thunk = _op(data, w)
            setup = w.pop("pending_setup", None)
            if setup is not None:
                try:
                    setup()
                except (RuntimeError, TypeError, ValueError):
                    continue  # torch itself refused that grad: nothing to call

            before = _snapshot(w)
            try:
                thunk()
            except Exception as e:  # noqa: BLE001 -- the property: any error leaves no trace
                try:
                    assert_bitwise_equal(_snapshot(w), before)
                except AssertionError as diff:
                    raise AssertionError(
                        f"{label} raised {type(e).__name__}: {e}\nand changed {diff}"
                    ) from e
                if label.startswith("bad_grad"):  # put sane grads back, as a user would
                    _backward(w)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


test_public_api_misuse_changes_nothing, test_public_api_misuse_changes_nothing_slow = tiered(
    default=60, slow=1500, data=st.data()
)(_check_public_api_misuse_changes_nothing)
