"""``fastamp.checkpoint.checkpoint`` / ``checkpoint_sequential``: torch.utils.checkpoint's
non-reentrant mode (nesting, kwargs, non-tensor outputs, ``autograd.grad(inputs=)``, retain_graph,
early stop, autocast replay are its machinery), plus:

* RNG replay for the CPU generator and *every initialised CUDA generator* in one C++ call
  (PyTorch stashes only the devices of the function's tensor arguments, so randomness drawn on
  another GPU inside the block replays wrong);
* ``determinism_check="bitwise"``: digests of every op output in the forward, compared with the
  recompute's as it runs; the first difference raises, naming the op and output;
* nothing else: a block whose inputs and parameters need no grad (frozen layers) runs as with
  PyTorch, and no check raises once the block has run (its BatchNorm statistics and the RNG have
  moved by then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointError, noop_context_fn

from fastamp.checkpoint import accounting
from fastamp.checkpoint._determinism import bitwise_context_fn, checked_context_fn
from fastamp.checkpoint._rng_fork import RngFork

__all__ = ["checkpoint", "checkpoint_sequential", "CheckpointError"]

_DETERMINISM_CHECKS = ("default", "none", "bitwise")
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized  # typed: torch's is not


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Activation checkpointing with the semantics of ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)`` (see the module docstring for what differs).

    Args:
        function, args, kwargs, context_fn, debug, early_stop: as in PyTorch.
        use_reentrant: must be False (the default here; PyTorch warns when it is not given). The
            reentrant mode cannot support nesting, ``autograd.grad`` with ``inputs=`` or DDP well,
            so fastamp does not offer it.
        preserve_rng_state: replay the RNG of the CPU and of every initialised CUDA device.
        determinism_check: ``"default"`` (shapes/dtypes/devices, as PyTorch), ``"none"``, or
            ``"bitwise"``: every op output of the recompute must equal the forward's bit for bit.

    A graph break under ``torch.compile``: the block runs eagerly, with the same numbers.
    """
    if not callable(function):
        raise TypeError(
            "fastamp.checkpoint.checkpoint: function must be callable (the block to run and "
            f"recompute), got {type(function).__name__}; expected checkpoint(block, *inputs)"
        )
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(
            f"fastamp.checkpoint.checkpoint: use_reentrant must be False (or None), got "
            f"{use_reentrant!r} (a {type(use_reentrant).__name__}); expected use_reentrant=False"
        )
    if not callable(context_fn):
        raise TypeError(
            "fastamp.checkpoint.checkpoint: context_fn must be a callable returning two context "
            f"managers (forward, recompute), got {type(context_fn).__name__}; expected e.g. "
            "context_fn=fastamp.checkpoint.selective()"
        )
    if use_reentrant:
        raise ValueError(
            "fastamp.checkpoint.checkpoint: use_reentrant=True is not supported; fastamp implements "
            "the non-reentrant mode (nesting, autograd.grad(inputs=...), DDP). Pass "
            "use_reentrant=False, or use torch.utils.checkpoint for the reentrant variant."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"fastamp.checkpoint.checkpoint: determinism_check must be one of {list(_DETERMINISM_CHECKS)}, "
            f"got {determinism_check!r}"
        )
    if torch.compiler.is_compiling():
        # A graph break: the block runs eagerly, with the same numbers. (Decorating checkpoint
        # itself with torch.compiler.disable would cost every eager call a frame-hook round trip.)
        return _checkpoint_eager(
            function,
            args,
            kwargs,
            preserve_rng_state,
            context_fn,
            determinism_check,
            debug,
            early_stop,
        )
    return _checkpoint(
        function, args, kwargs, preserve_rng_state, context_fn, determinism_check, debug, early_stop
    )


def _checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    debug: bool,
    early_stop: bool,
) -> Any:
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and accounting.counting():
        accounting.note_checkpoint_inputs(
            (args, kwargs)
        )  # the region keeps its inputs until backward
    run = function
    torch_rng = False  # whether torch's own RNG stash does the replay
    if preserve_rng_state and grad_enabled:
        if _cuda_initialized():
            run = RngFork(function)  # every initialised CUDA generator, and the CPU one
        else:
            # Only the CPU generator exists: PyTorch's stash of it is exactly that replay, and
            # reusing it costs nothing on top of torch's checkpoint.
            torch_rng = True
    torch_check = determinism_check
    if determinism_check == "bitwise":
        if debug:
            raise ValueError(
                "fastamp.checkpoint.checkpoint: determinism_check='bitwise' already names the op "
                "that differs; it cannot be combined with debug=True (PyTorch's debug mode takes "
                "over context_fn)"
            )
        context_fn = bitwise_context_fn(context_fn)
        torch_check = "default"
    if context_fn is not noop_context_fn:
        context_fn = checked_context_fn(context_fn)
    # Like PyTorch, a block none of whose inputs or parameters requires grad just runs (frozen
    # layers when fine-tuning): nothing is recomputed, nothing raises.
    if _GENERATOR is None:
        out = torch.utils.checkpoint.checkpoint(
            run,
            *args,
            use_reentrant=False,
            preserve_rng_state=torch_rng,
            context_fn=context_fn,
            determinism_check=torch_check,
            debug=debug,
            early_stop=early_stop,
            **kwargs,
        )
    else:
        out = _run_generator(
            _GENERATOR, run, args, kwargs, torch_rng, context_fn, torch_check, debug, early_stop
        )
    if torch_rng and _cuda_initialized():
        RngFork.warn_newly_used("all initialised")
    return out


def _find_generator() -> Callable[..., Any] | None:
    """torch.utils.checkpoint's non-reentrant machinery, when its signature is the one this module
    drives (else None: the public function is used, at the cost of its dynamo frame hook)."""
    import inspect

    # private-ok: the generator behind torch.utils.checkpoint's non-reentrant mode (the public
    # function adds a dynamo frame hook per call); its signature is checked below, else unused.
    gen = getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None)
    if gen is None:
        return None
    try:
        params = list(inspect.signature(gen).parameters)
    except (TypeError, ValueError):
        return None
    expected = [
        "fn",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "args",
        "kwargs",
    ]
    return gen if params == expected else None


_GENERATOR = _find_generator()


def _run_generator(
    generator: Callable[..., Any],
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    debug: bool,
    early_stop: bool,
) -> Any:
    """What torch.utils.checkpoint.checkpoint(use_reentrant=False) does around its generator,
    minus its per-call dynamo frame hook (torch.compile gets the disabled path above) and the
    argument parsing this module has already done."""
    gen = generator(
        run, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs
    )
    next(gen)  # pre-forward: saved-tensor hooks, the forward context
    try:
        out = run(*args, **kwargs)
    except BaseException as e:
        try:
            gen.throw(e)
        except StopIteration as stop:
            raise RuntimeError(
                "fastamp.checkpoint: the forward context returned by context_fn suppressed an "
                "exception raised by the checkpointed function; checkpoint cannot return a value "
                "for a failed forward"
            ) from stop
        raise
    try:
        next(gen)  # post-forward
    except StopIteration:
        return out
    raise AssertionError("fastamp.checkpoint: torch's checkpoint generator yielded more than twice")


_checkpoint_eager = torch.compiler.disable(_checkpoint)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = False,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint_sequential`` on :func:`checkpoint`: the functions are cut
    into ``segments`` runs of ``len // segments``; every run but the last is checkpointed."""
    fns: list[Callable[[Any], Any]]
    if isinstance(functions, torch.nn.Sequential):
        fns = list(functions.children())
    elif isinstance(functions, (torch.nn.Module, Tensor)) or not isinstance(functions, Iterable):
        raise TypeError(
            "checkpoint_sequential: functions must be an nn.Sequential or a list of callables, got "
            f"{type(functions).__name__}; expected e.g. nn.Sequential(*blocks) (a single block: "
            "use fastamp.checkpoint.checkpoint(block, input))"
        )
    else:
        fns = list(functions)
        bad = next((i for i, f in enumerate(fns) if not callable(f)), None)
        if bad is not None:
            raise TypeError(
                f"checkpoint_sequential: functions[{bad}] is a {type(fns[bad]).__name__}, not "
                "callable; expected modules or functions applied in order"
            )
    # torch's checkpoint_sequential takes preserve_rng_state and nothing else by keyword.
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError(
            "Unexpected keyword arguments: " + ",".join(kwargs) + " (checkpoint_sequential "
            "takes functions, segments, input, use_reentrant and preserve_rng_state, as torch's)"
        )
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"checkpoint_sequential: segments must be an int >= 1, got {segments!r}")
    if segments > len(fns):
        raise ValueError(
            f"checkpoint_sequential: segments={segments} is more than the {len(fns)} functions"
        )

    def run(start: int, stop: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for f in fns[start:stop]:
                x = f(x)
            return x

        return forward

    size = len(fns) // segments
    start = 0
    for _ in range(segments - 1):
        input = checkpoint(
            run(start, start + size), input, use_reentrant=use_reentrant,
            preserve_rng_state=preserve,
        )  # fmt: skip
        start += size
    return run(start, len(fns))(input)
