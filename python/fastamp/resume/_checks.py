"""What :func:`fastamp.load_training_state` checks before it restores anything (the optimizer's and
the scaler's saved state, the RNG states), and the RNG states it saves and restores."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any, cast

import torch

from fastamp.handoff import AmpFusedOptimizer
from fastamp.scaler import GradScaler
from fastamp.scaler import check_state_dict as check_scaler_state_dict


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        # The global generator's legacy tuple (numpy's stub types a call without legacy= as
        # the dict of legacy=False; its default is legacy=True).
        kind, keys, pos, has_gauss, cached = cast(
            "tuple[str, np.ndarray[Any, np.dtype[np.uint32]], int, int, float]",
            np.random.get_state(),
        )
        state["numpy"] = (
            kind,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        saved = state["cuda"]
        if torch.cuda.device_count() < len(saved):
            raise RuntimeError(
                f"load_training_state: the checkpoint holds the RNG state of {len(saved)} CUDA "
                f"devices but this process sees {torch.cuda.device_count()}; resume on the same "
                "devices (or pass restore_rng=False to continue with fresh random streams)"
            )
        torch.cuda.set_rng_state_all(saved)
    if "numpy_exact" in state:
        import numpy as np

        np.random.set_state(state["numpy_exact"])
    elif "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


# Hyperparameters PyTorch's optimizers default when a loaded group lacks them (__setstate__ or a
# newer version's keys); every other key of a group must be in the saved one.
_DEFAULTED_GROUP_KEYS = frozenset(
    {
        "foreach",
        "maximize",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
        "amsgrad",
        "nesterov",
        "initial_lr",
        "params",
    }
)
# Per-element state: one value per parameter element, so of the parameter's shape.
_ELEMENTWISE_STATE = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "master_param",
        "square_avg",
        "acc_delta",
        "sum",
        "grad_avg",
    }
)


def check_optimizer_state(optimizer: torch.optim.Optimizer, sd: Any, path: str) -> None:
    where = f"load_training_state: the optimizer state in {path!r}"
    if (
        not isinstance(sd, Mapping)
        or not isinstance(sd.get("param_groups"), list)
        or not isinstance(sd.get("state"), Mapping)
    ):
        raise ValueError(
            f"{where} is not an optimizer.state_dict() (dict with 'state' and 'param_groups')"
        )
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
        not isinstance(a, Mapping) or len(a.get("params", ())) != len(b["params"])
        for a, b in zip(saved_groups, optimizer.param_groups)
    ):
        raise ValueError(
            "load_training_state: optimizer has "
            f"{[len(g['params']) for g in optimizer.param_groups]} parameters per group, the "
            f"checkpoint {[len(g.get('params', ())) if isinstance(g, Mapping) else '?' for g in saved_groups]}; "
            "build the optimizer as the saved run did"
        )
    name = type(optimizer).__name__
    for g, (sg, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        missing = sorted(k for k in group if k not in sg and k not in _DEFAULTED_GROUP_KEYS)
        if missing:
            raise ValueError(
                f"{where} was saved by another kind of optimizer: its param_groups[{g}] lacks "
                f"{missing}, which {name} needs (it has {sorted(k for k in sg if k != 'params')}). "
                f"Build the optimizer the saved run used, or pass optimizer=None to start {name} afresh"
            )
    ids = [pid for sg in saved_groups for pid in sg["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    places = [
        (g, i)
        for g, group in enumerate(optimizer.param_groups)
        for i in range(len(group["params"]))
    ]
    index = {pid: k for k, pid in enumerate(ids)}
    for pid, st in sd["state"].items():
        k = index.get(pid)
        if k is None:
            continue
        if not isinstance(st, Mapping):
            raise ValueError(f"{where}: state[{pid!r}] is a {type(st).__name__}; expected a dict")
        p = params[k]
        for key, v in st.items():
            if (
                key in _ELEMENTWISE_STATE
                and isinstance(v, torch.Tensor)
                and tuple(v.shape) != tuple(p.shape)
            ):
                g, i = places[k]
                raise ValueError(
                    f"{where}: state[{pid!r}][{key!r}] has shape {tuple(v.shape)} but "
                    f"param_groups[{g}]['params'][{i}] has shape {tuple(p.shape)}; the state "
                    "belongs to another model (or parameter order). Build the model and optimizer "
                    "as the saved run did"
                )
    if isinstance(optimizer, AmpFusedOptimizer) and hasattr(optimizer, "check_state_dict"):
        optimizer.check_state_dict(sd)  # fastamp's optimizers check everything their step needs


def check_scaler_state(scaler: Any, sd: Any, path: str) -> None:
    where = f"load_training_state: the scaler state in {path!r}"
    if not isinstance(sd, Mapping):
        raise ValueError(
            f"{where} is a {type(sd).__name__}; expected the dict of scaler.state_dict()"
        )
    if not scaler.is_enabled():
        return  # a disabled scaler ignores what it is given (as PyTorch's)
    if len(sd) == 0:
        raise RuntimeError(
            f"{where} is empty: it was saved from a disabled GradScaler, so there is no loss scale to "
            "resume. Pass a disabled scaler (enabled=False), or scaler=None and start the scale afresh"
        )
    missing = [
        k
        for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        if k not in sd
    ]
    if missing:
        raise ValueError(f"{where} lacks {missing}; expected the dict of GradScaler.state_dict()")
    if isinstance(scaler, GradScaler):
        check_scaler_state_dict(sd)  # fastamp.GradScaler: every entry, with its own messages
        return
    scale = sd["scale"]
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"{where}: scale is {scale!r}; expected a finite number > 0")


def check_rng_state(rng: Any, path: str) -> None:
    where = f"load_training_state: the random-generator state in {path!r}"
    if not isinstance(rng, Mapping):
        raise ValueError(
            f"{where} is missing ({type(rng).__name__}); the file is damaged. Pass restore_rng=False "
            "to resume with fresh random streams"
        )
    for key in ("torch", "python"):
        if key not in rng:
            raise ValueError(
                f"{where} lacks its {key!r} entry; pass restore_rng=False to resume without it"
            )
    try:
        torch.Generator().set_state(rng["torch"])  # a scratch generator validates the bytes
    except Exception as e:
        raise ValueError(f"{where}: the 'torch' entry is not a CPU generator state ({e})") from None
    try:
        random.Random().setstate(rng["python"])
    except Exception as e:
        raise ValueError(
            f"{where}: the 'python' entry is not a random.getstate() value ({e})"
        ) from None
    if "cuda" in rng:
        saved = rng["cuda"]
        if not isinstance(saved, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in saved
        ):
            raise ValueError(f"{where}: the 'cuda' entry is not a list of generator states")
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < len(saved):
            raise RuntimeError(
                f"load_training_state: the checkpoint holds the RNG state of {len(saved)} CUDA "
                f"devices but this process sees {n}; resume on the same devices (or pass "
                "restore_rng=False to continue with fresh random streams)"
            )
    if "numpy" in rng:
        try:
            import numpy as np
        except ImportError:
            return
        try:
            kind, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.RandomState().set_state(
                (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
            )
        except Exception as e:
            raise ValueError(
                f"{where}: the 'numpy' entry is not a numpy generator state ({e})"
            ) from None


def rng_state_exact() -> dict[str, Any]:
    """The current generators, to put back should a later restore fail."""
    state = rng_state()
    if "numpy" in state:
        import numpy as np

        state["numpy_exact"] = np.random.get_state()
    return state
