"""How the fused kernels see a parameter: one dense span of memory, its grad and state laid out
alike (staging a copy of a param that is not dense)."""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def where_in_groups(g: int, i: int) -> str:
    return f"param_groups[{g}]['params'][{i}]"


def grad_like(g: Tensor, like: Tensor) -> Tensor:
    """The grad ``g`` with the strides of ``like`` (the param as the kernel sees it): the kernel
    walks both as one flat span. PyTorch accepts a grad of any layout; a re-strided copy
    (read-only, so a temporary) keeps that working."""
    if same_strides(g, like):
        return g
    return torch.empty_like(like).copy_(g)


def same_strides(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) lay their elements out alike. Two contiguous tensors
    do, whatever their strides say: under torch.compile a view of a flat buffer (a grad or state
    of ``flat_buffers=True``) has symbolic strides, which Dynamo cannot compare as a tuple, while
    ``is_contiguous()`` it guards on."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    return a.stride() == b.stride()


def is_dense(p: Tensor) -> bool:
    """Whether the elements of ``p`` are one dense span without overlap (contiguous, a
    permutation of it such as channels_last or a transpose)."""
    if p.is_contiguous():
        return True
    expected = 1  # sorted by stride, each dim must step over exactly the dims below it
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def kernel_view(p: Tensor) -> Tensor:
    """``p`` as the kernel walks it: ``p`` itself when its elements are one dense span, else a
    dense copy laid out as ``torch.empty_like(p)`` lays it out -- the layout PyTorch gives the
    state of such a param (``zeros_like(p, memory_format=torch.preserve_format)``), so state
    and staged param line up. Staged params are copied back after the kernel, as PyTorch's
    in-place update of a strided view (``nn.Parameter(w[:, ::2])``) writes through it."""
    if is_dense(p):
        return p
    return torch.empty_like(p).copy_(p)


def kernel_like(p: Tensor) -> Tensor:
    """A tensor laid out as :func:`kernel_view` lays ``p`` out (``p`` itself when dense; no copy
    of the data): what the per-element state of ``p`` is laid out like."""
    return p if is_dense(p) else torch.empty_like(p)
