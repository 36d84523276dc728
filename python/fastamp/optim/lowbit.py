"""Optimizer state formats (``state_dtype=`` of :class:`fastamp.optim.Adam`, ``AdamW`` and ``SGD``).

One :class:`StateFormat` object per format alone knows its state keys, how it creates, checks,
converts and counts a param's moments; the optimizers ask it and hold no format knowledge.

* :data:`FLOAT32` (``torch.float32``, the default): PyTorch's state, unchanged: the moments in
  the param's dtype (float32 with ``master_weights=True``), under PyTorch's keys.
* :data:`BFLOAT16` (``torch.bfloat16``): the moments in bfloat16 under PyTorch's keys, written
  with stochastic rounding (16 random bits added below the kept mantissa, so the stored value is
  unbiased): 2 bytes per moment and element. The bits are a hash of (``state_seed``, step, the
  param's position in its launch list, element index): a run is reproducible, on CPU and CUDA.
  A PyTorch optimizer that loads such a state_dict casts the moments to float exactly.
* :data:`INT8` (``"int8"``, Adam/AdamW only): each moment as 8-bit codes in blocks of 256
  elements, each block scaled by its absolute maximum (one float32 per block): 1 + 4/256 bytes
  per moment and element. ``exp_avg`` is sign + 4-bit exponent + 3-bit mantissa of m/absmax,
  ``exp_avg_sq`` 5-bit exponent + 3-bit mantissa of v/max, rounded to nearest even from the
  value truncated to bfloat16 (smaller magnitudes decode to 0), see csrc/optim/lowbit_math.h.
  The codes live under their own keys (``exp_avg_codes`` + ``exp_avg_absmax``, ...), never under
  PyTorch's ``exp_avg``/``exp_avg_sq``: a tool that reads PyTorch's keys cannot take codes for
  moments. A PyTorch optimizer that loads it fails at its first step with ``KeyError:
  'exp_avg'``; :func:`float32_state_dict` gives the float moments it can load.

Parameters with fewer than :data:`MIN_LOWBIT_NUMEL` elements (biases, norms) and non-contiguous
ones keep float32 state, as bitsandbytes keeps small tensors in 32 bits.

The formats convert with the kernels' own arithmetic written in torch ops (bit for bit the same,
:mod:`fastamp.optim.codec8`) when a state_dict of another format is loaded.

One concern: the three formats, how a state is recognised and checked, and the conversions
between them.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor

from fastamp.optim.codec8 import (  # noqa: F401
    QUANT_BLOCK,
    _dequantize_one,
    _quantize_one,
    decode_m8,
    decode_v8,
    dequantize,
    encode_m8,
    encode_v8,
    nblocks,
    quantize,
)

__all__ = [
    "BFLOAT16",
    "FLOAT32",
    "INT8",
    "MIN_LOWBIT_NUMEL",
    "QUANT_BLOCK",
    "StateFormat",
    "dequantize",
    "float32_state_dict",
    "format_of",
    "quantize",
    "resolve",
]

MIN_LOWBIT_NUMEL = 4096

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
SGD_MOMENTS = ("momentum_buffer",)
# exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax: the moment lists of adam_lowbit_step_.
_AdamLists: TypeAlias = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


class StateFormat(abc.ABC):
    """How one param's moments are stored. Instances: :data:`FLOAT32`, :data:`BFLOAT16`,
    :data:`INT8`; ``moments`` below are the state keys PyTorch gives them (``("exp_avg",
    "exp_avg_sq")`` for Adam, ``("momentum_buffer",)`` for SGD)."""

    name: str = ""
    lowbit: bool = False  # whether the fastamp::*_lowbit_step_ kernels step it

    def __repr__(self) -> str:
        return f"fastamp.optim.lowbit.{self.name.upper()}"

    def __reduce__(self) -> str:  # one object per format, also through copy and pickle
        return self.name.upper()

    def applies_to(self, p: Tensor) -> bool:
        """Whether param ``p`` keeps its moments in this format (else in :data:`FLOAT32`)."""
        return not self.lowbit or (p.numel() >= MIN_LOWBIT_NUMEL and p.is_contiguous())

    def keys(self, moments: Sequence[str]) -> tuple[str, ...]:
        """The state keys the moments take in this format."""
        return tuple(moments)

    def supports(self, moments: Sequence[str]) -> bool:
        return True

    @abc.abstractmethod
    def new(self, like: Tensor, moments: Sequence[str]) -> dict[str, Tensor]:
        """Zero moments for a param laid out as ``like`` (the param as the kernel walks it, or
        its float32 master)."""

    @abc.abstractmethod
    def encode(self, floats: Mapping[str, Tensor], like: Tensor) -> dict[str, Tensor]:
        """State in this format of the float moments ``floats`` (a conversion, rounded to
        nearest), laid out as ``like``."""

    def decode(self, state: Mapping[str, Any], moments: Sequence[str]) -> dict[str, Tensor]:
        """The float32 moments this format's ``state`` stands for (what the kernel computes with)."""
        return {k: state[k].float() for k in moments}

    def holds(self, state: Mapping[str, Any], like: Tensor, moments: Sequence[str]) -> bool:
        """Whether ``state`` holds the moments in this format, as the kernel takes them for a
        param laid out as ``like`` (dtype and strides); otherwise the step converts them."""
        dtype = self.moment_dtype(like)
        stride = like.stride()
        for k in moments:
            v = state.get(k)
            if not (isinstance(v, Tensor) and v.dtype == dtype and v.stride() == stride):
                return False
        return True

    @abc.abstractmethod
    def moment_dtype(self, like: Tensor) -> torch.dtype:
        """The dtype the moments of a param laid out as ``like`` are kept in."""

    def check(
        self,
        state: Mapping[str, Any],
        p: Tensor,
        moments: Sequence[str],
        where: object,
        any_device: bool = False,
    ) -> None:
        """Raises (naming ``str(where)``) unless ``state`` holds all of the moments in this format for
        param ``p``: each key present, dtype, shape, device (any, with ``any_device``: a loaded
        state moves to the param's), block scales. Strides are not checked: a state laid out
        otherwise is re-strided (PyTorch steps it as it is)."""
        for k in moments:
            v = state.get(k)
            if (
                isinstance(v, Tensor)
                and v.is_floating_point()
                and v.shape == p.shape
                and (any_device or v.device == p.device)
            ):
                continue  # the fast path: this runs for every parameter at every step
            v = _present(state, k, where)
            if not v.is_floating_point():
                raise TypeError(
                    f"{where}[{k!r}] is a {v.dtype} tensor; expected float moments (an integer "
                    "tensor is not a moment: 8-bit codes live under their own '*_codes' keys)"
                )
            _check_like(v, p, f"{where}[{k!r}]", any_device)

    @abc.abstractmethod
    def nbytes(self, like: Tensor, moments: Sequence[str]) -> int:
        """Bytes the moments of a param laid out as ``like`` take in this format."""

    def adam_lists(self, states: Sequence[Mapping[str, Any]]) -> _AdamLists:
        """The four moment lists of ``fastamp::adam_lowbit_step_`` (exp_avgs, exp_avg_sqs,
        exp_avg_absmax, exp_avg_sq_absmax; the scales empty but for 8-bit) for these states."""
        return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], []


class _Float32(StateFormat):
    name = "float32"

    def moment_dtype(self, like: Tensor) -> torch.dtype:
        return like.dtype  # the param's dtype, or float32 for a master

    def new(self, like: Tensor, moments: Sequence[str]) -> dict[str, Tensor]:
        return {k: torch.zeros_like(like, memory_format=torch.preserve_format) for k in moments}

    def encode(self, floats: Mapping[str, Tensor], like: Tensor) -> dict[str, Tensor]:
        return {k: torch.empty_like(like).copy_(v.reshape(like.shape)) for k, v in floats.items()}

    def nbytes(self, like: Tensor, moments: Sequence[str]) -> int:
        return like.numel() * like.element_size() * len(moments)


class _BFloat16(StateFormat):
    name = "bfloat16"
    lowbit = True

    def moment_dtype(self, like: Tensor) -> torch.dtype:
        return torch.bfloat16

    def new(self, like: Tensor, moments: Sequence[str]) -> dict[str, Tensor]:
        return {
            k: torch.zeros(like.shape, dtype=torch.bfloat16, device=like.device) for k in moments
        }

    def encode(self, floats: Mapping[str, Tensor], like: Tensor) -> dict[str, Tensor]:
        return {
            k: v.reshape(like.shape).to(torch.bfloat16, memory_format=torch.contiguous_format)
            for k, v in floats.items()
        }

    def holds(self, state: Mapping[str, Any], like: Tensor, moments: Sequence[str]) -> bool:
        return all(
            isinstance(state.get(k), Tensor)
            and state[k].dtype == torch.bfloat16
            and state[k].is_contiguous()
            for k in moments
        )

    def nbytes(self, like: Tensor, moments: Sequence[str]) -> int:
        return 2 * like.numel() * len(moments)


class _Int8(StateFormat):
    name = "int8"
    lowbit = True

    def keys(self, moments: Sequence[str]) -> tuple[str, ...]:
        return _int8_keys(tuple(moments))

    def supports(self, moments: Sequence[str]) -> bool:
        return tuple(moments) == ADAM_MOMENTS  # a signed and an unsigned codec

    def moment_dtype(self, like: Tensor) -> torch.dtype:
        return torch.uint8

    def new(self, like: Tensor, moments: Sequence[str]) -> dict[str, Tensor]:
        out = {}
        for k in moments:
            out[f"{k}_codes"] = torch.zeros(like.shape, dtype=torch.uint8, device=like.device)
            out[f"{k}_absmax"] = torch.zeros(nblocks(like), dtype=torch.float32, device=like.device)
        return out

    def encode(self, floats: Mapping[str, Tensor], like: Tensor) -> dict[str, Tensor]:
        out = {}
        for k, v in floats.items():
            codes, scales = _quantize_one(v.reshape(like.shape), signed=k == "exp_avg")
            out[f"{k}_codes"], out[f"{k}_absmax"] = codes, scales
        return out

    def decode(self, state: Mapping[str, Any], moments: Sequence[str]) -> dict[str, Tensor]:
        return {
            k: _dequantize_one(state[f"{k}_codes"], state[f"{k}_absmax"], signed=k == "exp_avg")
            for k in moments
        }

    def holds(self, state: Mapping[str, Any], like: Tensor, moments: Sequence[str]) -> bool:
        return all(
            isinstance(state.get(f"{k}_codes"), Tensor)
            and state[f"{k}_codes"].dtype == torch.uint8
            and state[f"{k}_codes"].is_contiguous()
            and isinstance(state.get(f"{k}_absmax"), Tensor)
            and state[f"{k}_absmax"].dtype == torch.float32
            and state[f"{k}_absmax"].is_contiguous()
            for k in moments
        )

    def check(
        self,
        state: Mapping[str, Any],
        p: Tensor,
        moments: Sequence[str],
        where: object,
        any_device: bool = False,
    ) -> None:
        blocks = nblocks(p)
        for k in moments:
            codes = _present(state, f"{k}_codes", where)
            if codes.dtype != torch.uint8:
                raise TypeError(
                    f"{where}[{k + '_codes'!r}] is a {codes.dtype} tensor; expected the uint8 codes "
                    "fastamp's 8-bit state saves (codes cast to another dtype, e.g. by a PyTorch "
                    "optimizer's load_state_dict, no longer decode)"
                )
            _check_like(codes, p, f"{where}[{k + '_codes'!r}]", any_device)
            scales = _present(state, f"{k}_absmax", where)
            if not (
                scales.dtype == torch.float32
                and scales.dim() == 1
                and scales.numel() == blocks
                and (any_device or scales.device == p.device)
            ):
                raise ValueError(
                    f"{where}[{k + '_absmax'!r}] is a {scales.dtype} tensor of shape "
                    f"{tuple(scales.shape)} on {scales.device}; expected {blocks} float32 block "
                    f"scales (one per {QUANT_BLOCK} elements of the parameter's {p.numel()}) on "
                    f"{p.device}"
                )

    def nbytes(self, like: Tensor, moments: Sequence[str]) -> int:
        return (like.numel() + 4 * nblocks(like)) * len(moments)  # codes + a float32 per block

    def adam_lists(self, states: Sequence[Mapping[str, Any]]) -> _AdamLists:
        a, b, c, d = (
            [s[k] for s in states]
            for k in ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
        )
        return a, b, c, d


FLOAT32: StateFormat = _Float32()
BFLOAT16: StateFormat = _BFloat16()
INT8: StateFormat = _Int8()
_BY_NAME = {f.name: f for f in (FLOAT32, BFLOAT16, INT8)}


def resolve(value: Any, where: str, moments: Sequence[str] = ADAM_MOMENTS) -> StateFormat:
    """The format a ``state_dtype`` argument names, or a ValueError naming ``where``."""
    if isinstance(value, StateFormat):
        fmt = value
    elif value is None:  # the default, as PyTorch's optional arguments read None
        fmt = FLOAT32
    elif value is torch.float32 or value is torch.bfloat16:
        fmt = FLOAT32 if value is torch.float32 else BFLOAT16
    elif isinstance(value, str) and value in _BY_NAME:
        fmt = _BY_NAME[value]
    else:
        hint = (
            " (the 8-bit format is named 'int8')"
            if value in ("8bit", torch.int8, torch.uint8)
            else ""
        )
        raise ValueError(
            f"{where}: state_dtype must be torch.float32, torch.bfloat16 or 'int8' (8-bit block-"
            f"quantized moments), got {value!r}{hint}"
        )
    if not fmt.supports(moments):
        raise ValueError(
            f"{where}: state_dtype='int8' is for Adam/AdamW's two moments; SGD's one momentum "
            "buffer can be torch.bfloat16 (stochastic rounding) or torch.float32"
        )
    return fmt


def check_seed(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{where}: state_seed must be an int in [0, 2**32), got {value!r}")
    return value


# The key lists below are asked for per param on every full step (a few us each to build, under a
# microsecond to look up), so each is kept in a plain dict. Not functools.cache: the full step also
# runs under torch.compile, and Dynamo warns at every lru_cache-wrapped function it traces through
# ("Dynamo detected a call to a `functools.lru_cache`-wrapped function ... Silent incorrectness is
# only a potential risk if the wrapped function is not pure"), which it traces like any function
# instead; a dict lookup it traces without a word. The functions are pure, so either is correct.
_INT8_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}
_MOMENT_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}
_OTHER_KEYS: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}


def _int8_keys(moments: tuple[str, ...]) -> tuple[str, ...]:
    keys = _INT8_KEYS.get(moments)
    if keys is None:
        keys = tuple(k for m in moments for k in (f"{m}_codes", f"{m}_absmax"))
        _INT8_KEYS[moments] = keys
    return keys


def moment_keys(moments: tuple[str, ...]) -> tuple[str, ...]:
    """Every state key any format keeps the moments under."""
    keys = _MOMENT_KEYS.get(moments)
    if keys is None:
        keys = tuple(
            dict.fromkeys(
                k for f in _BY_NAME.values() if f.supports(moments) for k in f.keys(moments)
            )
        )
        _MOMENT_KEYS[moments] = keys
    return keys


def _other_keys(fmt: StateFormat, moments: tuple[str, ...]) -> tuple[str, ...]:
    """The moment keys of the other formats (a state holding them beside ``fmt``'s is corrupt)."""
    keys = _OTHER_KEYS.get((fmt.name, moments))
    if keys is None:
        keys = tuple(k for k in moment_keys(moments) if k not in fmt.keys(moments))
        _OTHER_KEYS[(fmt.name, moments)] = keys
    return keys


def format_of(state: Mapping[str, Any], moments: Sequence[str]) -> StateFormat | None:
    """The format whose keys ``state`` holds its moments under (None: no moments yet).
    bfloat16 moments read as :data:`BFLOAT16` (a bfloat16 param's float32-format state is the
    same tensors). No moments kept (SGD without momentum): None."""
    if not moments:
        return None
    first = state.get(moments[0])
    if isinstance(first, Tensor):  # under PyTorch's key (checked per step: the fast path first)
        if first.dtype == torch.bfloat16:
            return BFLOAT16
        return FLOAT32
    if INT8.supports(moments) and any(k in state for k in INT8.keys(moments)):
        return INT8
    return None if all(state.get(k) is None for k in moments) else FLOAT32


def _refuse_codes_under_torch_keys(
    state: Mapping[str, Any], moments: Sequence[str], where: object
) -> None:
    """Raises if ``state`` holds 8-bit codes under PyTorch's keys (uint8 beside the block scales):
    the layout of fastamp 0.1.0's development builds, which is not read."""
    first = state.get(moments[0])
    if (
        isinstance(first, Tensor)
        and first.dtype == torch.uint8
        and f"{moments[0]}_absmax" in state
        and f"{moments[0]}_codes" not in state
    ):
        renames = ", ".join(f"{m!r} -> '{m}_codes'" for m in moments)
        raise KeyError(
            f"{where} holds 8-bit codes (uint8) under PyTorch's keys {list(moments)}: the layout "
            "of fastamp 0.1.0's development builds, which this version does not read. Expected "
            f"the codes under their own keys {list(INT8.keys(moments))}: rename them ({renames}) "
            "in each parameter's state to load it"
        )


def check_any(
    state: Mapping[str, Any],
    p: Tensor,
    moments: Sequence[str],
    where: object,
    any_device: bool = False,
) -> None:
    """Raises unless ``state`` holds complete moments of ``p`` in one of the formats (which the
    step or load converts to the optimizer's), checked as :meth:`StateFormat.check`."""
    fmt = format_of(state, moments)
    if fmt is None:
        return
    stray = [k for k in _other_keys(fmt, tuple(moments)) if k in state]
    if stray:
        _refuse_codes_under_torch_keys(state, moments, where)
        raise KeyError(
            f"{where} holds {fmt.name} moments under {list(fmt.keys(moments))} and also "
            f"{stray}; expected the keys of one format (a state_dict edited by hand, or "
            "converted by a tool that does not know fastamp's formats?)"
        )
    fmt.check(state, p, moments, where, any_device)


def decode_any(state: Mapping[str, Any], moments: Sequence[str]) -> dict[str, Tensor]:
    """The float32 moments of a state in any format (checked with :func:`check_any`)."""
    fmt = format_of(state, moments)
    assert fmt is not None
    return fmt.decode(state, moments)


def convert(
    state: Mapping[str, Any], fmt: StateFormat, like: Tensor, moments: Sequence[str]
) -> dict[str, Tensor] | None:
    """The moments of ``state`` as ``fmt`` holds them for a param laid out as ``like``, or None
    when ``state`` holds them so already."""
    if fmt.holds(state, like, moments):
        return None
    floats = decode_any(state, moments)
    return fmt.encode({k: v.to(like.device) for k, v in floats.items()}, like)


def float32_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a fastamp optimizer's ``state_dict()`` whose moments are float32 tensors under
    PyTorch's keys, and whose param groups have no fastamp format options: what a
    ``torch.optim`` optimizer (or a tool that reads PyTorch's keys) loads as its own."""
    out = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")}
    groups = []
    for sg in state_dict["param_groups"]:
        g = {k: copy.deepcopy(v) for k, v in sg.items() if k not in ("state_dtype", "state_seed")}
        groups.append(g)
    out["param_groups"] = groups
    state: dict[Any, Any] = {}
    for pid, st in state_dict["state"].items():
        st = dict(st)
        for moments in (ADAM_MOMENTS, SGD_MOMENTS):
            if format_of(st, moments) is None:
                continue
            _refuse_codes_under_torch_keys(
                st, moments, f"float32_state_dict: state_dict['state'][{pid!r}]"
            )
            floats = decode_any(st, moments)
            for k in moment_keys(moments):
                st.pop(k, None)
            st.update(floats)
        if "momentum_buffer" in st:
            st.pop("step", None)  # fastamp's SGD update count: not in PyTorch's SGD state
        state[pid] = st
    out["state"] = state
    return out


def _present(state: Mapping[str, Any], key: str, where: object) -> Tensor:
    v = state.get(key)
    if v is None:
        raise KeyError(f"{where} has no {key!r} (it has {sorted(map(str, state))})")
    if not isinstance(v, Tensor):
        raise TypeError(
            f"{where}[{key!r}] is a {type(v).__name__}; expected a tensor (was the checkpoint "
            "converted, e.g. through JSON? save it with torch.save)"
        )
    return v


def _check_like(v: Tensor, p: Tensor, what: str, any_device: bool) -> None:
    # At a step (any_device False), RuntimeError: what torch's update raises there (its
    # elementwise ops refuse the mismatch); at load_state_dict, where torch loads such a state
    # and fails only at the step, ValueError.
    if v.shape != p.shape:
        raise (ValueError if any_device else RuntimeError)(
            f"{what} has shape {tuple(v.shape)} but the parameter has shape {tuple(p.shape)}: "
            "the state belongs to another model (or to parameters in another order). Expected "
            "the state saved with this model"
        )
    if v.device != p.device and not any_device:
        raise RuntimeError(f"{what} is on {v.device}; expected the parameter's device {p.device}")
