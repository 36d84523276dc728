"""Argument coverage: which value class of each op argument reached a kernel, and where.

While the test suite runs, every successful call of a ``fastamp::`` op on CPU tensors (the CPU
kernels) and of its ``fastamp_emu::`` mirror (the CUDA kernels on the emulator) is classified
argument by argument against the op's schema:

- ``Tensor?``: ``None`` or ``tensor`` (found_inf also by value: ``tensor=0`` / ``tensor!=0``);
- ``bool``: ``True`` and ``False``;
- the scalars a kernel branches on (:data:`SCALAR_CLASSES`: a zero weight decay, an infinite
  norm type, a hysteresis of 1, ...);
- ``Tensor[]`` that may be empty (:data:`OPTIONAL_LISTS`): ``empty`` / ``non-empty``;
- tensors and tensor lists: each element dtype (``dtype:float16``).

:func:`missing` then lists each (op, argument, class) required but not seen on one of the two
backends. ``tests/test_argument_coverage.py`` runs it at the end of the suite.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("cpu", "emu")


def _zero(v: float) -> bool:
    return v == 0.0


def _nonzero(v: float) -> bool:
    return v != 0.0


_ZERO_OR_NOT = {"0": _zero, "!=0": _nonzero}

#: The scalar arguments the kernels branch on, and the classes each must take.
SCALAR_CLASSES: dict[tuple[str, str], dict[str, Callable[[Any], bool]]] = {
    ("grad_stats", "norm_type"): {
        "2": lambda v: v == 2.0,
        "inf": lambda v: math.isinf(v),
        "1": lambda v: v == 1.0,
        "p": lambda v: math.isfinite(v) and v not in (1.0, 2.0),
    },
    ("adam_step_", "weight_decay"): _ZERO_OR_NOT,
    ("adam_lowbit_step_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_step_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_lowbit_step_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_step_", "momentum"): _ZERO_OR_NOT,
    ("sgd_step_", "dampening"): _ZERO_OR_NOT,
    ("sgd_lowbit_step_", "dampening"): _ZERO_OR_NOT,
    # The held variants (common/held_tensors.h) branch as their list-taking ops.
    ("adam_step_held_", "weight_decay"): _ZERO_OR_NOT,
    ("adam_lowbit_step_held_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_step_held_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_lowbit_step_held_", "weight_decay"): _ZERO_OR_NOT,
    ("sgd_step_held_", "momentum"): _ZERO_OR_NOT,
    ("sgd_step_held_", "dampening"): _ZERO_OR_NOT,
    ("sgd_lowbit_step_held_", "dampening"): _ZERO_OR_NOT,
    ("bucket_pack_", "scale"): {"1": lambda v: v == 1.0, "!=1": lambda v: v != 1.0},
    ("bucket_divide_stats_", "divisor"): {"1": lambda v: v == 1.0, "!=1": lambda v: v != 1.0},
    ("clip_coef", "norm_type"): {
        "2": lambda v: v == 2.0,
        "inf": lambda v: math.isinf(v),
        "1": lambda v: v == 1.0,
    },
    ("clip_coef", "max_norm"): {
        "0": _zero,
        "finite>0": lambda v: math.isfinite(v) and v > 0.0,
        "inf": math.isinf,
    },
    ("update_scale_", "hysteresis"): {"1": lambda v: v == 1, ">1": lambda v: v > 1},
    ("update_scale_", "min_scale"): _ZERO_OR_NOT,
    ("update_scale_", "max_scale"): {"inf": math.isinf, "finite": math.isfinite},
}

#: Tensor arguments whose value a kernel branches on.
TENSOR_VALUE_CLASSES = {"found_inf"}

#: Tensor lists an op takes empty in one mode and filled in another.
OPTIONAL_LISTS = {
    ("adam_step_", "max_exp_avg_sqs"),
    ("adam_step_", "master_params"),
    ("adam_lowbit_step_", "exp_avg_absmax"),
    ("adam_lowbit_step_", "exp_avg_sq_absmax"),
    ("adam_lowbit_step_", "master_params"),
    ("sgd_step_", "momentum_buffers"),
    ("sgd_step_", "master_params"),
    ("sgd_lowbit_step_", "master_params"),
}

HALF_AND_FLOAT = {"dtype:float32", "dtype:float16", "dtype:bfloat16"}
#: The dtypes each of these arguments accepts (every other tensor argument: the dtypes seen).
DECLARED_DTYPES = {
    ("grad_stats", "grads"): HALF_AND_FLOAT,
    ("non_finite_check_and_unscale_", "grads"): HALF_AND_FLOAT,
    ("clip_unscale_", "grads"): HALF_AND_FLOAT,
    ("adam_step_", "params"): HALF_AND_FLOAT,
    ("adam_lowbit_step_", "params"): HALF_AND_FLOAT,
    ("sgd_step_", "params"): HALF_AND_FLOAT,
    ("sgd_lowbit_step_", "params"): HALF_AND_FLOAT,
    ("bucket_pack_", "grads"): HALF_AND_FLOAT,
    ("bucket_unpack_", "grads"): HALF_AND_FLOAT,
    ("bucket_divide_stats_", "bucket"): HALF_AND_FLOAT,
}

# (backend, op) -> argument -> classes seen
SEEN: dict[tuple[str, str], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))


def cuda_ops() -> list[str]:
    """The ops with a CUDA kernel (registered in a FASTAMP_CUDA_KERNELS block of csrc/)."""
    names: set[str] = set()
    for p in list((ROOT / "csrc").rglob("*.cu")) + list((ROOT / "csrc").rglob("*.cuh")):
        text = re.sub(r"//[^\n]*", "", p.read_text())
        for block in re.findall(r"FASTAMP_CUDA_KERNELS\(m\)\s*\{(.*?)\n\}", text, flags=re.S):
            names |= set(re.findall(r'm\.impl\("([A-Za-z0-9_]+)"', block))
    return sorted(names)


def _schema(op: str):
    import fastamp  # noqa: F401  (defines the fastamp schemas)

    return getattr(torch.ops.fastamp, op).default._schema


def _classes(op: str, arg, value: Any) -> set[str]:
    t = str(arg.type)
    out: set[str] = set()
    if t.startswith("Optional[Tensor]") or t == "Tensor?":
        out.add("None" if value is None else "tensor")
    if isinstance(value, torch.Tensor):
        out.add(f"dtype:{str(value.dtype).removeprefix('torch.')}")
        if arg.name in TENSOR_VALUE_CLASSES and value.numel() == 1:
            out.add("tensor=0" if float(value) == 0.0 else "tensor!=0")
    elif isinstance(value, (list, tuple)) and (
        "Tensor" in t and "[]" in t or t.startswith("List[Tensor]")
    ):
        if (op, arg.name) in OPTIONAL_LISTS:
            out.add("non-empty" if len(value) else "empty")
        out |= {
            f"dtype:{str(v.dtype).removeprefix('torch.')}"
            for v in value
            if isinstance(v, torch.Tensor)
        }
    elif isinstance(value, bool):
        out.add(str(value))
    elif (op, arg.name) in SCALAR_CLASSES and isinstance(value, (int, float)):
        out |= {label for label, pred in SCALAR_CLASSES[(op, arg.name)].items() if pred(value)}
    return out


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for i in x:
            yield from _tensors(i)


def record(qualified: str, args: tuple, kwargs: dict) -> None:
    ns, _, op = qualified.partition("::")
    if ns == "fastamp_emu":
        backend = "emu"
    else:
        # Plain CPU tensors outside any tracing: what the CPU kernel itself receives (a fake,
        # functional or meta tensor, or a call under torch.compile or a dispatch mode, never
        # reaches it).
        tensors = list(_tensors(list(args) + list(kwargs.values())))
        if (
            not tensors
            or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() > 0
            or any(
                type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu"
                for t in tensors
            )
        ):
            return
        backend = "cpu"
    try:
        schema = _schema(op)
    except AttributeError:
        return  # an emulator-only op (its self-tests)
    seen = SEEN[(backend, op)]
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            continue
        seen[arg.name] |= _classes(op, arg, value)


def required(op: str) -> dict[str, set[str]]:
    """The classes each argument of `op` must take on each backend."""
    out: dict[str, set[str]] = {}
    for arg in _schema(op).arguments:
        t = str(arg.type)
        need: set[str] = set()
        if t.startswith("Optional[Tensor]") or t == "Tensor?":
            need |= {"None", "tensor"}
        if t == "bool":
            need |= {"True", "False"}
        if (op, arg.name) in SCALAR_CLASSES:
            need |= set(SCALAR_CLASSES[(op, arg.name)])
        if (op, arg.name) in OPTIONAL_LISTS:
            need |= {"empty", "non-empty"}
        if arg.name in TENSOR_VALUE_CLASSES:
            need |= {"tensor=0", "tensor!=0"}
        if "Tensor" in t:
            seen_dtypes = {
                c
                for b in BACKENDS
                for c in SEEN[(b, op)].get(arg.name, ())
                if c.startswith("dtype:")
            }
            need |= seen_dtypes | DECLARED_DTYPES.get((op, arg.name), set())
        if need:
            out[arg.name] = need
    return out


def missing(ops: Iterable[str] | None = None) -> list[str]:
    """`op.arg: class` for each class an argument must take but did not, per backend."""
    out = []
    for op in ops if ops is not None else cuda_ops():
        for arg, need in required(op).items():
            for backend in BACKENDS:
                lacking = need - SEEN[(backend, op)].get(arg, set())
                for c in sorted(lacking):
                    out.append(
                        f"{op}.{arg}: {c} never reached the {'CPU' if backend == 'cpu' else 'emulated CUDA'} kernel"
                    )
    return out


def save(path: str, nodeids: list[str], extra: dict[str, Any] | None = None) -> None:
    """The session's records and the tests that made them, for a later session of the other
    tier to add to its own (``make test`` then ``make test-full``: each test runs once), or for
    the pytest-xdist controller to add up (``extra``: what the worker collected and left out)."""
    import json

    data = {
        "seen": [
            [b, op, {a: sorted(c) for a, c in args.items()}] for (b, op), args in SEEN.items()
        ],
        "nodeids": nodeids,
        **(extra or {}),
    }
    with open(path, "w") as f:
        json.dump(data, f)


def load_part(path: Path) -> dict[str, Any]:
    """Adds the records :func:`save` wrote to this session's; returns the whole file's data."""
    import json

    data: dict[str, Any] = json.loads(Path(path).read_text())
    for b, op, args in data["seen"]:
        for a, classes in args.items():
            SEEN[(b, op)][a].update(classes)
    return data


def load(path: str) -> list[str]:
    """Adds the records :func:`save` wrote to this session's; returns the tests that made them."""
    return list(load_part(Path(path))["nodeids"])


_installed = False


def install() -> None:
    """Wraps the dispatcher entry points of torch.ops calls (OpOverloadPacket and OpOverload) so
    that successful fastamp and fastamp_emu calls are recorded."""
    global _installed
    if _installed:
        return
    _installed = True
    for cls in (torch._ops.OpOverloadPacket, torch._ops.OpOverload):
        original = cls.__call__

        def call(self, /, *args, __original=original, **kwargs):
            out = __original(self, *args, **kwargs)
            name = getattr(self, "_qualified_op_name", None) or self._schema.name
            if name.startswith("fastamp"):
                record(name, args, kwargs)
            return out

        cls.__call__ = call
