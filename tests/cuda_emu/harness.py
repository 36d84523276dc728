"""Differential harness: one op, its CPU kernel and its emulated CUDA kernel, same inputs.

A case is a function ``build(mem) -> args`` that makes the op's arguments from ``mem`` (a seeded
source of random values that places every tensor inside a larger buffer, at a chosen element
offset, with random canary values around it). It is built afresh for the CPU run and for each
emulated run, so every run starts from the same bits. Then:

- every tensor the op returns or writes must be bit-identical between the CPU kernel and the
  emulator, except the outputs a case names as reductions (their summation order differs by
  design): those must be within tolerance of a float64 reference;
- the emulated outputs must be bit-identical across the three launch orders (ascending,
  descending, seeded random blocks and threads): an order-dependent result is a missing barrier or
  an order-dependent sum;
- no byte outside the tensors may change (the canaries): an out-of-bounds write fails here;
- a step op with a held variant (``adam_step_held_``: every list but the grads held, see
  csrc/common/held_tensors.h) runs the same case through it on both backends, with the same
  outputs as the list-taking op's CPU kernel, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import emu
import torch
from torch import Tensor

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: Tensor) -> Tensor:
    """The tensor's elements as integers of the same width (NaN payloads and -0.0 included)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_OF[t.element_size()]) if t.is_floating_point() else t


def comparable_bits(t: Tensor) -> Tensor:
    """`bits(t)`, except on a real device (emu.DEVICE) every NaN compares as one pattern.

    Which NaN an arithmetic operation returns is the hardware's choice (IEEE 754 leaves the
    payload and sign open): x86 returns an operand's NaN, quieted, or the negative default NaN
    0xffc00000 for inf - inf; an NVIDIA GPU returns the canonical 0x7fffffff. The emulator runs on
    the CPU and matches the CPU kernels payload for payload, so it is held to every bit; against
    a GPU, a NaN must still sit where the CPU kernel put one, whatever its payload."""
    b = bits(t)
    if emu.DEVICE and t.is_floating_point():
        nan = torch.isnan(t.detach().contiguous())
        b = torch.where(nan, torch.full_like(b, -1), b)
    return b


class Mem:
    """Seeded values, each tensor placed in a larger buffer surrounded by canaries."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.arenas: list[tuple[Tensor, int, int, int]] = []  # (buffer, offset, numel, stride)

    def randn(self, n: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
        x = torch.randn(n, generator=self.gen, dtype=torch.float64) * scale
        # never zeros: a zero would hide a missed or doubled element in a product
        x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
        return x.to(dtype)

    def place(self, values: Tensor, offset: int = 0, stride: int = 1) -> Tensor:
        """A tensor equal to `values` that starts `offset` elements into its buffer (after the
        front canaries), with element stride `stride` (> 1: a strided 1-D view, which ops stage
        through a dense temporary)."""
        n = values.numel()
        pad = 7
        buf = self.randn(pad + offset + max(n * stride, 1) + pad, values.dtype, scale=1e3)
        view = buf.as_strided((n,), (stride,), pad + offset)
        if stride == 1:
            view = view.view(values.shape)
        elif values.dim() != 1:
            raise ValueError("strided placements are 1-D")
        view.copy_(values)
        self.arenas.append((buf, pad + offset, n, stride))
        return view

    def tensor(
        self, n: int, dtype: torch.dtype, scale: float = 1.0, offset: int = 0, stride: int = 1
    ) -> Tensor:
        return self.place(self.randn(n, dtype, scale), offset, stride)

    def canaries(self) -> list[Tensor]:
        """Each buffer with the op's tensor masked out: what the op must leave alone."""
        out = []
        for buf, off, n, stride in self.arenas:
            keep = torch.ones(buf.numel(), dtype=torch.bool)
            keep[off + torch.arange(n) * stride] = False
            out.append(bits(buf)[keep].clone())
        return out


def tensors_of(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors_of(item)]
    return []


def _outputs(result: Any, args: Sequence[Any]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors_of(result) + tensors_of(list(args))]


def run_case(
    op_name: str,
    build: Callable[[Mem], Sequence[Any]],
    *,
    seed: int = 0,
    reductions: Iterable[int] = (),
    reduction_ref: Callable[[Sequence[Any]], Sequence[float]] | None = None,
    rtol: float = 1e-5,
    orders: Sequence[str] = emu.ORDERS,
) -> dict[str, Any]:
    """Runs the case on the CPU kernel and on the emulator in each order; asserts as described
    at the top. `reductions` are indices into the op's returned tensors; `reduction_ref(args)`
    gives their float64 reference values from the inputs (called on a fresh build)."""
    reductions = set(reductions)
    cpu_mem = Mem(seed)
    cpu_args = build(cpu_mem)
    ref_args = build(Mem(seed)) if reduction_ref is not None else None
    refs = list(reduction_ref(ref_args)) if reduction_ref is not None else []
    cpu_result = getattr(torch.ops.fastamp, op_name)(*cpu_args)
    cpu_out = _outputs(cpu_result, cpu_args)
    cpu_canaries = cpu_mem.canaries()
    n_results = len(tensors_of(cpu_result))

    first: list[Tensor] | None = None
    for order in orders:
        mem = Mem(seed)
        args = build(mem)
        with emu.order(order, seed=1234 + seed):
            result = emu.op(op_name)(*args)
        out = _outputs(result, args)
        assert len(out) == len(cpu_out), (
            f"{op_name}: the emulated op returned a different structure"
        )
        for i, (e, c) in enumerate(zip(out, cpu_out)):
            assert e.dtype == c.dtype and e.shape == c.shape, (
                f"{op_name} [{order}] output {i}: {e.dtype}{tuple(e.shape)} vs CPU {c.dtype}{tuple(c.shape)}"
            )
            if i < n_results and i in reductions:
                continue
            if not torch.equal(comparable_bits(e), comparable_bits(c)):
                diff = (comparable_bits(e) != comparable_bits(c)).sum().item()
                raise AssertionError(
                    f"{op_name} [{order}] output {i} ({c.dtype}, {c.numel()} elements): {diff} "
                    f"element(s) differ from the CPU kernel bit for bit; first emulated/CPU values "
                    f"{e.flatten()[(comparable_bits(e) != comparable_bits(c)).flatten()][:4].tolist()} / "
                    f"{c.flatten()[(comparable_bits(e) != comparable_bits(c)).flatten()][:4].tolist()}"
                )
        for j, (a, b) in enumerate(zip(mem.canaries(), cpu_canaries)):
            if not torch.equal(a, b):
                raise AssertionError(
                    f"{op_name} [{order}]: wrote outside tensor {j} "
                    f"({(a != b).sum().item()} canary element(s) changed)"
                )
        for i in reductions:
            e, c = out[i], cpu_out[i]
            if refs:
                r = refs[reductions_order(reductions).index(i)]
                ev = float(e)
                if math.isfinite(r):
                    assert math.isclose(ev, r, rel_tol=rtol, abs_tol=1e-30), (
                        f"{op_name} [{order}] reduction {i}: emulated {ev} vs float64 {r}"
                    )
                else:
                    assert not math.isfinite(ev), f"{op_name} [{order}] reduction {i}: {ev} vs {r}"
            assert math.isfinite(float(e)) == math.isfinite(float(c)), (
                f"{op_name} [{order}] reduction {i}: emulated {float(e)} vs CPU {float(c)}"
            )
        if first is None:
            first = out
        else:
            for i, (a, b) in enumerate(zip(out, first)):
                if not torch.equal(bits(a), bits(b)):
                    raise AssertionError(
                        f"{op_name}: output {i} differs between launch orders ({orders[0]} vs "
                        f"{order}): a missing barrier or an order-dependent reduction"
                    )
    if held_variant(op_name) is not None:
        _run_held(op_name, build, seed, cpu_out, cpu_canaries)
    return {"cpu": cpu_out, "emu": first}


def held_variant(op_name: str) -> str | None:
    """The op that takes ``op_name``'s lists but the grads held (``adam_step_`` ->
    ``adam_step_held_``, csrc/common/held_tensors.h), or None."""
    name = op_name + "held_"
    return name if name in emu.fastamp_ops() else None


def _held_call(op_name: str, args: Sequence[Any], call: Callable[..., Any], ns: Any) -> Any:
    """``op_name``'s call ``args`` made through its held variant (``call``): every tensor list
    but the grads held by ``ns.hold_tensors`` for the call, the other arguments by name."""
    schema = getattr(torch.ops.fastamp, op_name).default._schema
    held_schema = getattr(torch.ops.fastamp, held_variant(op_name)).default._schema
    by_name = {a.name: v for a, v in zip(schema.arguments, args)}
    lists = [
        a.name
        for a in schema.arguments
        if a.name != "grads" and a.type.isSubtypeOf(torch._C.ListType.ofTensors())
    ]
    handle = ns.hold_tensors(
        [t for n in lists for t in by_name[n]], [len(by_name[n]) for n in lists]
    )
    try:
        return call(handle, *[by_name[a.name] for a in held_schema.arguments[1:]])
    finally:
        ns.release_tensors(handle)


def _run_held(
    op_name: str,
    build: Callable[[Mem], Sequence[Any]],
    seed: int,
    cpu_out: list[Tensor],
    cpu_canaries: list[Tensor],
) -> None:
    """The held variant of ``op_name`` on the same case, on the CPU kernel and on the emulator:
    the same outputs as the list-taking op's CPU kernel, bit for bit, and no write outside."""
    held = held_variant(op_name)
    for where in ("cpu", "emu"):
        mem = Mem(seed)
        args = build(mem)
        if where == "cpu":
            result = _held_call(op_name, args, getattr(torch.ops.fastamp, held), torch.ops.fastamp)
        else:
            result = _held_call(op_name, args, emu.op(held), torch.ops.fastamp_emu)
        out = _outputs(result, args)
        for i, (e, c) in enumerate(zip(out, cpu_out)):
            if not torch.equal(comparable_bits(e), comparable_bits(c)):
                raise AssertionError(
                    f"{held} [{where}] output {i}: differs from {op_name}'s CPU kernel bit for bit"
                )
        for j, (a, b) in enumerate(zip(mem.canaries(), cpu_canaries)):
            assert torch.equal(a, b), f"{held} [{where}]: wrote outside tensor {j}"


def reductions_order(reductions: Iterable[int]) -> list[int]:
    return sorted(reductions)
