"""Memory-budget planner: measure a model once (a :class:`BlockStats` per block), then checkpoint the
blocks that free the most activation memory per second of recompute until the saved activations
fit the budget (the :class:`CheckpointPlan`).

Activation memory is measured, on any device, as the bytes autograd keeps for the backward: every
tensor saved through saved-tensor hooks (parameters excluded, shared storages counted once), plus
the inputs that checkpointed regions keep. On CUDA this is the part of the peak that checkpointing
can change; ``torch.cuda.max_memory_allocated`` also counts weights, grads and temporaries.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from fastamp._sharding import is_sharded
from fastamp.checkpoint.accounting import SavedBytes, count_saved_bytes
from fastamp.checkpoint.core import checkpoint
from fastamp.checkpoint.policies import selective

__all__ = [
    "BlockStats",
    "CheckpointPlan",
    "SavedBytes",
    "apply",
    "count_saved_bytes",
    "measure_blocks",
]


@dataclass
class BlockStats:
    name: str
    saved_bytes: int  # activations the block saves when it is not checkpointed
    input_bytes: int  # what it keeps when it is checkpointed (its inputs)
    forward_s: float  # cost of one recompute
    selective_bytes: int = -1  # what it keeps under selective checkpointing (-1: not measured)

    @property
    def freed_bytes(self) -> int:
        return max(self.saved_bytes - self.input_bytes, 0)

    @property
    def selective_freed_bytes(self) -> int:
        return max(self.saved_bytes - self.selective_bytes, 0) if self.selective_bytes >= 0 else 0


@dataclass
class CheckpointPlan:
    budget_bytes: int
    baseline_bytes: int  # saved activations of the whole model without checkpointing
    blocks: list[BlockStats]
    chosen: list[str] = field(default_factory=list)  # fully checkpointed
    selective: list[str] = field(default_factory=list)  # selectively checkpointed
    _undo: list[Any] = field(default_factory=list, repr=False)

    def estimate(self, full: Sequence[str], sel: Sequence[str]) -> int:
        """Saved activation bytes with the blocks ``full`` checkpointed and ``sel`` selectively."""
        freed = sum(b.freed_bytes for b in self.blocks if b.name in full)
        freed += sum(b.selective_freed_bytes for b in self.blocks if b.name in sel)
        return self.baseline_bytes - freed

    @property
    def estimated_bytes(self) -> int:
        return self.estimate(self.chosen, self.selective)

    @property
    def recompute_s(self) -> float:
        return sum(
            b.forward_s for b in self.blocks if b.name in self.chosen or b.name in self.selective
        )

    def install(self, model: nn.Module) -> None:
        """Wraps the forward of each chosen block of ``model`` in a checkpoint (selective for the
        blocks in ``selective``); :meth:`remove` undoes it."""
        for name in self.chosen + self.selective:
            module = model.get_submodule(name)
            module.forward = functools.partial(
                _checkpointed_forward, module.forward, name in self.selective
            )
            self._undo.append(module)

    def remove(self) -> None:
        """Undoes apply(): the blocks run without checkpointing again."""
        for module in self._undo:
            del module.forward  # drops the instance attribute; the class forward shows again
        self._undo.clear()
        self.chosen.clear()
        self.selective.clear()

    def __str__(self) -> str:
        mb = 2.0**20
        lines = [
            f"fastamp checkpoint plan: budget {self.budget_bytes / mb:.1f} MiB, activations "
            f"{self.baseline_bytes / mb:.1f} MiB unchecked -> {self.estimated_bytes / mb:.1f} MiB "
            f"estimated, {len(self.chosen)}/{len(self.blocks)} blocks checkpointed"
            f"{f' (+{len(self.selective)} selectively)' if self.selective else ''}, "
            f"+{self.recompute_s * 1e3:.1f} ms recompute per step",
            f"  {'block':<24} {'saved MiB':>10} {'kept MiB':>9} {'fwd ms':>8}  checkpoint",
        ]
        for b in self.blocks:
            lines.append(
                f"  {b.name:<24} {b.saved_bytes / mb:>10.2f} {b.input_bytes / mb:>9.2f} "
                f"{b.forward_s * 1e3:>8.2f}  "
                f"{'yes' if b.name in self.chosen else 'selective' if b.name in self.selective else '-'}"
            )
        return "\n".join(lines)


def _default_blocks(model: nn.Module) -> list[str]:
    """The children of the largest nn.Sequential / nn.ModuleList: the repeated blocks."""
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) > best_n:
            best, best_n = name, len(m)
    if best is None:
        raise ValueError(
            "fastamp.checkpoint.apply: found no nn.Sequential/nn.ModuleList of blocks in the "
            "model; pass blocks=[...] with the names of the submodules to consider"
        )
    return [f"{best}.{i}" if best else str(i) for i in range(best_n)]


def _sync(x: Any) -> None:
    for t in tree_leaves(x):
        if isinstance(t, Tensor) and t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


def measure_blocks(
    model: nn.Module,
    sample_input: Any,
    blocks: Sequence[str] | None = None,
    measure_selective: bool = True,
) -> tuple[list[BlockStats], int]:
    """Runs one forward of ``model(sample_input)`` and returns per-block stats and the total; with
    ``measure_selective``, also each block once under selective checkpointing. The model's
    buffers and the global RNG are as they were afterwards."""
    names = _check_blocks(model, blocks) if blocks is not None else _default_blocks(model)
    modules = {n: model.get_submodule(n) for n in names}
    # The measuring forwards draw from the RNG (dropout): on forks of the CPU generator and of
    # the model's CUDA devices', so the run's random stream is as if they never ran.
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    with _scratch_buffers(model), torch.random.fork_rng(devices=cuda):
        return _measure(model, sample_input, names, modules, measure_selective)


@contextlib.contextmanager
def _scratch_buffers(model: nn.Module) -> Iterator[None]:
    """The measuring forwards run on copies of the buffers, so a BatchNorm's running statistics
    (and any other buffer a forward updates) are as they were afterwards."""
    # nn.Module.__setattr__ assigns an existing buffer's name into the buffer slot.
    saved = [(m, k, b) for m in model.modules() for k, b in m.named_buffers(recurse=False)]
    for m, k, b in saved:
        setattr(m, k, b.detach().clone())
    try:
        yield
    finally:
        for m, k, b in saved:
            setattr(m, k, b)


def _check_blocks(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    if isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks):
        raise TypeError(
            f"fastamp.checkpoint.apply: blocks must be a list of submodule names, got {blocks!r}; "
            "expected e.g. blocks=['layers.0', 'layers.1']"
        )
    names = dict(model.named_modules())
    for i, b in enumerate(blocks):
        if b not in names or b == "":
            some = [n for n in names if n][:6]
            raise ValueError(
                f"fastamp.checkpoint.apply: blocks[{i}]={b!r} is not a submodule of the model; "
                f"expected names from model.named_modules(), such as {some}"
            )
    return list(blocks)


def _measure(
    model: nn.Module,
    sample_input: Any,
    names: list[str],
    modules: dict[str, nn.Module],
    measure_selective: bool,
) -> tuple[list[BlockStats], int]:
    stats: dict[str, dict[str, float]] = {n: {"in": 0, "t": 0.0} for n in names}
    inputs: dict[str, Any] = {}
    handles = []
    counter_ref: list[SavedBytes] = []

    def pre(
        name: str,
    ) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            counter_ref[0].block = name
            stats[name]["in"] = sum(
                t.nbytes for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
            )
            inputs[name] = (args, kwargs)
            _sync((args, kwargs))
            stats[name]["t0"] = time.perf_counter()

        return hook

    def post(
        name: str,
    ) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            _sync(out)
            stats[name]["t"] = time.perf_counter() - stats[name]["t0"]
            counter_ref[0].block = None

        return hook

    for n, m in modules.items():
        handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(m.register_forward_hook(post(n), with_kwargs=True))
    try:
        with torch.enable_grad(), count_saved_bytes(model) as counter:
            counter_ref.append(counter)
            args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
            model(*args)
    finally:
        for h in handles:
            h.remove()
    result = [
        BlockStats(n, counter.by_block.get(n, 0), int(stats[n]["in"]), float(stats[n]["t"]))
        for n in names
    ]
    if measure_selective:
        for b in result:
            if b.name not in inputs:
                continue
            args, kwargs = inputs[b.name]
            with torch.enable_grad(), count_saved_bytes(model) as c:
                checkpoint(modules[b.name], *args, context_fn=selective(), **kwargs)
            b.selective_bytes = c.total
    return result, counter.total


def _checkpointed_forward(
    forward: Callable[..., Any], selectively: bool, *args: Any, **kwargs: Any
) -> Any:
    if selectively:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective(), **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply(
    model: nn.Module,
    budget_bytes: int,
    sample_input: Any,
    blocks: Sequence[str] | None = None,
    verbose: bool = True,
) -> CheckpointPlan:
    """Checkpoints the fewest, cheapest blocks of ``model`` so its saved activations fit
    ``budget_bytes``, measured on one forward of ``sample_input`` (prints the plan when verbose).

    Blocks are ranked by freed bytes per second of recompute; the k best are checkpointed fully
    and at most one more selectively (save matmuls, recompute the rest), choosing the fit closest
    to the budget from below. Returns the plan;
    ``plan.remove()`` undoes it. Raises ValueError when even checkpointing every block cannot fit.

    A sharded model (FSDP2): call it on every rank; rank 0's measurements and budget decide the
    plan for all (a recomputed block all-gathers its params again, so the ranks must checkpoint
    alike).
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
        raise TypeError(
            f"fastamp.checkpoint.apply: budget_bytes must be a number of bytes, got {budget_bytes!r}; "
            "expected e.g. budget_bytes=2 * 2**30 for 2 GiB"
        )
    if not (math.isfinite(budget_bytes) and budget_bytes > 0):
        raise ValueError(
            f"fastamp.checkpoint.apply: budget_bytes must be a finite number > 0, got {budget_bytes}; "
            "expected the activation memory to fit, in bytes (e.g. 2 * 2**30 for 2 GiB)"
        )
    stats, total = measure_blocks(model, sample_input, blocks)
    if is_sharded(model) and dist.is_available() and dist.is_initialized():
        # Every rank installs rank 0's plan: the recompute of a checkpointed FSDP2 block
        # all-gathers its params again, so plans that differed between ranks (timings do) would
        # issue different collectives and hang.
        box = [(stats, total, budget_bytes)]
        dist.broadcast_object_list(box, src=0)
        stats, total, budget_bytes = box[0]
    plan = CheckpointPlan(int(budget_bytes), total, stats)
    # Whole blocks are coarse (a 12-block model moves in ~8% steps), so one block may instead be
    # checkpointed selectively: among "the k most efficient blocks in full, plus at most one other
    # block selectively", take the fit closest to the budget from below (then the least recompute).
    order = [
        b
        for b in sorted(stats, key=lambda b: b.freed_bytes / max(b.forward_s, 1e-9), reverse=True)
        if b.freed_bytes > 0
    ]
    best: tuple[int, float, list[str], list[str]] | None = None
    for k in range(len(order) + 1):
        full = [b.name for b in order[:k]]
        for extra in [None, *order[k:]]:
            sel = [extra.name] if extra is not None and extra.selective_freed_bytes > 0 else []
            if extra is not None and not sel:
                continue
            est = plan.estimate(full, sel)
            if est > budget_bytes:
                continue
            cost = sum(b.forward_s for b in stats if b.name in full or b.name in sel)
            key = (est, -cost)
            if best is None or key > (best[0], -best[1]):
                best = (est, cost, full, sel)
    if best is not None:
        plan.chosen, plan.selective = list(best[2]), list(best[3])
    else:
        plan.chosen = [b.name for b in order]
        raise ValueError(
            f"fastamp.checkpoint.apply: even with every block checkpointed the activations need "
            f"about {plan.estimated_bytes / 2**20:.1f} MiB > budget {budget_bytes / 2**20:.1f} MiB; "
            "raise the budget, shrink the batch, or add offload_activations()"
        )
    plan.chosen.sort(key=[b.name for b in stats].index)
    plan.install(model)
    if verbose:
        print(plan)
    return plan
