"""Hypothesis strategies and oracles shared by the fastamp op fuzzers.

A drawn :class:`TensorSpec` describes one tensor argument: logical shape, dtype, device and memory
layout (contiguous, permuted, strided with gaps, expanded or overlapping as_strided views), where it
sits in a larger buffer (storage offset, guard elements on both sides), a data seed and magnitude,
an inf/NaN pattern, and whether the guard elements are poisoned with inf/NaN. :func:`build` turns a
spec into a :class:`Guarded` tensor: the view handed to the op, its buffer, and the storage offset
of every logical element, so a test can check that the op wrote nothing outside the view
(:meth:`Guarded.assert_outside_untouched`) or nothing at all (:meth:`Guarded.assert_untouched`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fastamp

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
HALF_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Dtypes that float ops must reject; float8 and complex are the easy ones to let slip through.
NON_GRAD_DTYPES = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
ALL_DTYPES = GRAD_DTYPES + NON_GRAD_DTYPES + (torch.complex128,)

# Sizes around the kernels' internal boundaries: 16-element vector lanes, 64 Ki-element chunks.
EDGE_SIZES = (15, 16, 17, 31, 33, 65535, 65536, 65537, 65536 + 19)
MAX_NUMEL = 140_000  # keeps one example in the milliseconds while still crossing a chunk boundary

LAYOUTS = ("contiguous", "permuted", "gapped", "expanded", "overlapping")
DENSE_LAYOUTS = ("contiguous", "permuted")
NONFINITE_VALUES = (math.inf, -math.inf, math.nan)
_ERRORS = (RuntimeError, ValueError, TypeError)


def compute_devices() -> list[str]:
    """Devices whose kernels this build can run here."""
    devs = ["cpu"]
    if torch.cuda.is_available() and fastamp.build_info()["with_cuda"]:
        devs.append("cuda")
    return devs


def foreign_devices(device: str) -> list[str]:
    """Devices a tensor may wrongly be on when the op runs on ``device``: always ``meta`` (works on a
    CPU-only machine and is what a half-traced model leaves behind), plus the other real device."""
    devs = ["meta"]
    if device == "cuda":
        devs.append("cpu")
    elif "cuda" in compute_devices():
        devs.append("cuda")
    return devs


# --- tiers ---------------------------------------------------------------------------------------


def tiered(*, default: int, slow: int, examples: tuple[dict, ...] = (), **strategies):
    """``@given(**strategies)`` twice: a fixed-seed test with ``default`` examples for the default
    ``pytest`` run and a randomised, ``slow``-marked one with ``slow`` examples (``pytest -m slow``).
    ``examples`` are explicit ``@example(**kwargs)`` cases (regressions) that both tiers run first.

    Usage: ``test_x, test_x_slow = tiered(default=50, slow=2000, case=cases())(_check_x)``.
    The profiles are registered in tests/conftest.py.
    """

    def deco(prop):
        name = prop.__name__.lstrip("_").removeprefix("check_")

        def one(suffix: str, profile: str, n: int):
            def test(**kwargs):
                prop(**kwargs)

            test.__name__ = test.__qualname__ = f"test_{name}{suffix}"
            test.__doc__ = prop.__doc__
            test.__module__ = prop.__module__
            for ex in reversed(examples):
                test = example(**ex)(test)
            t = given(**strategies)(test)
            return settings(settings.get_profile(profile), max_examples=n)(t)

        fast = one("", "fastamp-fuzz", default)
        long = pytest.mark.slow(one("_slow", "fastamp-fuzz-slow", slow))
        return fast, long

    return deco


# --- tensor specs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NonFinite:
    kind: str = "none"  # none | one | all | mix
    where: str = "random"  # first | middle | last | random (for "one")
    values: tuple[float, ...] = (math.inf,)
    count: int = 1  # positions for "mix"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"
    layout: str = "contiguous"
    perm: tuple[int, ...] = ()  # memory order of dims, outermost first
    steps: tuple[int, ...] = ()  # per-dim stride multipliers (gaps) for "gapped"
    squeeze: tuple[
        int, ...
    ] = ()  # dims given stride 0 ("expanded") or a shrunk stride ("overlapping")
    pre: int = 0  # guard elements before the view (also its storage offset)
    post: int = 0  # guard elements after it
    seed: int = 0
    magnitude: float = 1.0
    nonfinite: NonFinite = field(default_factory=NonFinite)
    poison_guards: bool = False  # put inf/NaN in the guard elements and gaps

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def strides(self) -> tuple[int, ...]:
        nd = len(self.shape)
        perm = self.perm if len(self.perm) == nd else tuple(range(nd))
        steps = self.steps if len(self.steps) == nd else (1,) * nd
        strides = [0] * nd
        running = 1
        for d in reversed(perm):
            strides[d] = running * steps[d]
            running = strides[d] * max(self.shape[d], 1)
        if self.layout == "expanded":
            for d in self.squeeze:
                strides[d] = 0
        elif self.layout == "overlapping":
            for d in self.squeeze:
                strides[d] = max(1, strides[d] // 3)
        return tuple(strides)


@st.composite
def shapes(draw, *, max_dims: int = 4, allow_empty: bool = True, edge: bool = True):
    nd = draw(st.integers(0, max_dims))
    lo = 0 if allow_empty else 1
    dims = [draw(st.integers(lo, 6)) for _ in range(nd)]
    if edge and nd and draw(st.integers(0, 4)) == 0:
        dims[draw(st.integers(0, nd - 1))] = draw(st.sampled_from(EDGE_SIZES))
    if math.prod(dims) > MAX_NUMEL:
        dims = [min(d, 3) for d in dims]
        dims[0] = draw(st.sampled_from(EDGE_SIZES))
    return tuple(dims)


@st.composite
def nonfinites(draw):
    kind = draw(st.sampled_from(("none", "none", "one", "all", "mix")))
    if kind == "none":
        return NonFinite()
    values = tuple(draw(st.lists(st.sampled_from(NONFINITE_VALUES), min_size=1, max_size=3)))
    return NonFinite(
        kind,
        draw(st.sampled_from(("first", "middle", "last", "random"))),
        values,
        draw(st.integers(1, 5)),
    )


@st.composite
def tensor_specs(
    draw,
    *,
    dtypes=GRAD_DTYPES,
    layouts=LAYOUTS,
    device: str = "cpu",
    shape=None,
    nonfinite: bool = True,
    magnitudes=(1e-3, 1.0, 1.0, 30.0, 1e3),
):
    shp = draw(shapes()) if shape is None else tuple(shape)
    nd = len(shp)
    layout = draw(st.sampled_from(layouts))
    perm, steps, squeeze = tuple(range(nd)), (1,) * nd, ()
    if layout != "contiguous" and nd:
        perm = tuple(draw(st.permutations(range(nd))))
    if layout == "gapped":
        steps = tuple(draw(st.integers(1, 3)) for _ in range(nd))
        if nd and all(s == 1 for s in steps):
            steps = steps[:-1] + (2,)
    if layout in ("expanded", "overlapping") and nd:
        squeeze = tuple(sorted(draw(st.sets(st.integers(0, nd - 1), min_size=1, max_size=nd))))
    return TensorSpec(
        shape=shp,
        dtype=draw(st.sampled_from(dtypes)),
        device=device,
        layout=layout,
        perm=perm,
        steps=steps,
        squeeze=squeeze,
        pre=draw(st.sampled_from((0, 0, 1, 3, 8, 17))),
        post=draw(st.sampled_from((0, 1, 5))),
        seed=draw(st.integers(0, 2**31 - 1)),
        magnitude=draw(st.sampled_from(magnitudes)),
        nonfinite=draw(nonfinites()) if nonfinite else NonFinite(),
        poison_guards=draw(st.booleans()),
    )


# --- building guarded tensors --------------------------------------------------------------------


def random_values(n: int, dtype: torch.dtype, gen: torch.Generator, magnitude: float = 1.0):
    """Fresh random, (almost surely) non-zero values of ``dtype`` on the CPU."""
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.float64 if not dtype.is_complex else torch.complex128
        x = torch.randn(n, generator=gen, dtype=real) * magnitude
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x.clamp(-400, 400)
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < 0.5
    lo, hi = (0, 256) if dtype == torch.uint8 else (-120, 120)
    x = torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64)
    x[x == 0] = 7
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's elements in logical order, for comparisons that treat NaN == NaN."""
    # clone, not contiguous(): a tensor with a size-1 dim can be "contiguous" with a stride != 1.
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


@dataclass
class Guarded:
    """A tensor argument living in the middle of a larger, random buffer."""

    spec: TensorSpec
    base: torch.Tensor  # 1-D buffer
    view: torch.Tensor  # what the op gets
    offsets: torch.Tensor  # int64, view's shape: storage offset of every logical element
    snapshot: torch.Tensor | None = None  # CPU copy of base, taken by freeze()

    @property
    def overlapping(self) -> bool:
        """Exactly: do two logical elements share memory?"""
        n = self.offsets.numel()
        return n > 1 and torch.unique(self.offsets).numel() < n

    def values(self) -> torch.Tensor:
        """The logical values, as a contiguous CPU tensor."""
        return self.view.detach().cpu().clone(memory_format=torch.contiguous_format)

    def freeze(self) -> Guarded:
        if self.base.device.type != "meta":
            self.snapshot = self.base.detach().cpu().clone()
        return self

    def _outside_mask(self) -> torch.Tensor:
        mask = torch.ones(self.base.numel(), dtype=torch.bool)
        mask[self.offsets.reshape(-1)] = False
        return mask.repeat_interleave(self.base.element_size())

    def assert_untouched(self, what: str = "") -> None:
        if self.snapshot is None:
            return
        now, before = bits(self.base.cpu()), bits(self.snapshot)
        if not torch.equal(now, before):
            changed = (now != before).nonzero().reshape(-1)[:8].tolist()
            raise AssertionError(f"{what} buffer changed (bytes {changed}...) for {self.spec}")

    def assert_outside_untouched(self, what: str = "") -> None:
        if self.snapshot is None:
            return
        mask = self._outside_mask()
        now, before = bits(self.base.cpu())[mask], bits(self.snapshot)[mask]
        if not torch.equal(now, before):
            raise AssertionError(f"{what}: bytes outside the view were written, for {self.spec}")


def _apply_nonfinite(
    flat_offsets: torch.Tensor, base_cpu: torch.Tensor, nf: NonFinite, gen: torch.Generator
) -> None:
    n = flat_offsets.numel()
    if nf.kind == "none" or n == 0 or not base_cpu.dtype.is_floating_point:
        return
    vals = nf.values
    if nf.kind == "all":
        # Cycle through the chosen values over the whole tensor.
        pattern = torch.tensor(vals, dtype=torch.float64).repeat(n // len(vals) + 1)[:n]
        base_cpu[flat_offsets] = pattern.to(base_cpu.dtype)
        return
    count = 1 if nf.kind == "one" else min(nf.count, n)
    if nf.where == "first":
        idx = torch.arange(count)
    elif nf.where == "last":
        idx = torch.arange(n - count, n)
    elif nf.where == "middle":
        idx = torch.arange(count) + (n - count) // 2
    else:
        idx = torch.randperm(n, generator=gen)[:count]
    for j, i in enumerate(idx.tolist()):
        base_cpu[flat_offsets[i]] = vals[j % len(vals)]


def build(spec: TensorSpec) -> Guarded:
    """Makes the tensor a spec describes, filled with fresh random data."""
    gen = torch.Generator().manual_seed(spec.seed)
    strides = spec.strides()
    numel = spec.numel
    span = 0 if numel == 0 else 1 + sum((s - 1) * st_ for s, st_ in zip(spec.shape, strides))
    total = spec.pre + span + spec.post
    index = torch.arange(total, dtype=torch.int64)
    offsets = index.as_strided(spec.shape, strides, spec.pre).clone()
    if spec.device == "meta":
        base = torch.empty(total, dtype=spec.dtype, device="meta")
        return Guarded(spec, base, base.as_strided(spec.shape, strides, spec.pre), offsets)
    base = random_values(total, spec.dtype, gen, spec.magnitude)
    flat = offsets.reshape(-1)
    if spec.poison_guards and spec.dtype.is_floating_point and total > 0:
        outside = torch.ones(total, dtype=torch.bool)
        outside[flat] = False
        where = outside.nonzero().reshape(-1)
        if where.numel():
            poison = torch.tensor(NONFINITE_VALUES, dtype=torch.float64).repeat(where.numel())
            base[where] = poison[: where.numel()].to(spec.dtype)
    _apply_nonfinite(flat, base, spec.nonfinite, gen)
    base = base.to(spec.device)
    return Guarded(spec, base, base.as_strided(spec.shape, strides, spec.pre), offsets)


def build_all(specs) -> list[Guarded]:
    return [build(s) for s in specs]


def freeze_all(*groups) -> None:
    for group in groups:
        for g in group if isinstance(group, list | tuple) else [group]:
            g.freeze()


# --- oracles -------------------------------------------------------------------------------------


def expect_error(fn, names: list[str], *guarded_groups, types=_ERRORS) -> BaseException:
    """``fn()`` must raise one of ``types`` whose message names one of ``names`` (e.g. "grads[2]"),
    and every guarded buffer must be byte-identical afterwards (nothing half-written)."""
    try:
        fn()
    except types as e:  # noqa: PERF203
        msg = str(e)
        if not any(n in msg for n in names):
            raise AssertionError(
                f"error does not name any of {names}: {type(e).__name__}: {msg}"
            ) from e
        err = e
    else:
        raise AssertionError(f"expected an error naming one of {names}; the op succeeded")
    for group in guarded_groups:
        for g in group if isinstance(group, list | tuple) else [group]:
            g.assert_untouched("after a rejected call:")
    return err


def names_in(msg: str) -> set[str]:
    return set(re.findall(r"[a-z_]+\[\d+\]", msg))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64), with the subnormal spacing as the floor."""
    fi = torch.finfo(dtype)
    ax = x.abs().clamp(min=fi.tiny)
    e = torch.floor(torch.log2(ax))
    return torch.exp2(e - _NMANT[dtype])


_NMANT = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def assert_within_ulps(
    actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, ulps: float, what: str = ""
) -> None:
    """``actual`` (of ``dtype``) within ``ulps`` units in the last place of the float64 reference
    (pass it already rounded to ``dtype``, so overflow to inf is part of it); non-finite values
    must match exactly (NaN == NaN, inf sign included)."""
    a = actual.detach().cpu().double().reshape(-1)
    e = expected64.detach().cpu().double().reshape(-1)
    nonfinite = ~torch.isfinite(e) | ~torch.isfinite(a)
    same_nonfinite = (a[nonfinite] == e[nonfinite]) | (a[nonfinite].isnan() & e[nonfinite].isnan())
    if not bool(same_nonfinite.all()):
        i = nonfinite.nonzero().reshape(-1)[~same_nonfinite][0]
        raise AssertionError(f"{what}: element {int(i)} is {float(a[i])}, expected {float(e[i])}")
    fin = ~nonfinite
    err = (a[fin] - e[fin]).abs()
    tol = ulp(e[fin], dtype) * ulps
    bad = err > tol
    if bool(bad.any()):
        i = bad.nonzero().reshape(-1)[0]
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off by more than {ulps} ulp, e.g. "
            f"{float(a[fin][i])!r} vs {float(e[fin][i])!r}"
        )
