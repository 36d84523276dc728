"""The misuse catalogue's harness (tests/_misuse.py) can fail: its snapshot sees one changed byte
anywhere, and the catalogue across tests/<capability>/test_misuse.py is large and distinct."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from tests._misuse import FASTAMP, _diff, _snapshot, _trained, _world
from tests.checkpoint import test_misuse as checkpoint_misuse
from tests.optim import test_misuse as optim_misuse
from tests.parallel import test_misuse as distributed_misuse
from tests.scaler import test_misuse as scaler_misuse
from tests.toolkit import test_misuse as toolkit_misuse


def test_the_catalogue_is_large_and_distinct():
    cases = [
        c
        for m in (
            scaler_misuse,
            optim_misuse,
            checkpoint_misuse,
            distributed_misuse,
            toolkit_misuse,
        )
        for c in m.CASES
    ]
    ids = [c.id for c in cases] + [c[0] for c in distributed_misuse.DDP_CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 90


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    # Writes through NumPy do not bump the version counter: only the bytes change.
    return t.detach().numpy().reshape(-1).view(np.uint8)


def test_snapshot_sees_a_single_changed_byte_anywhere():
    model, opt, sc = _trained(FASTAMP, "AdamW", hysteresis=2)
    sc.unscale_(opt)
    world = _world(model, opt, sc)
    base = _snapshot(world)
    assert _diff(base, _snapshot(world)) == []
    targets = {
        "model.0.weight": model[0].weight,
        "model.2.bias.grad": model[2].bias.grad,
        "optimizer.state[model.0.weight]['exp_avg_sq']": opt.state[model[0].weight]["exp_avg_sq"],
        "optimizer.state[model.2.bias]['step']": opt.state[model[2].bias]["step"],
        "scaler._scale": sc._scale,
        "scaler._growth_tracker": sc._growth_tracker,
        "scaler._hysteresis_tracker": sc._hysteresis_tracker,
        "found_inf_per_device": sc._per_optimizer_states[id(opt)]["found_inf_per_device"][
            torch.device("cpu")
        ],
    }
    for name, t in targets.items():
        raw = _np_bytes(t)
        k = raw.size - 1  # the last byte: for a float, the sign/exponent
        raw[k] ^= 0x01
        changed = _diff(base, _snapshot(world))
        assert len(changed) >= 1 and all(x.startswith("~ ") for x in changed), (name, changed)
        raw[k] ^= 0x01
        assert _diff(base, _snapshot(world)) == [], name


def test_snapshot_is_nan_safe_and_sees_signed_zero_versions_and_python_state():
    t = torch.tensor([math.nan, 0.0, 1.0])
    base = _snapshot({"t": t})
    assert _diff(base, _snapshot({"t": t})) == []  # NaN == NaN, byte for byte
    _np_bytes(t)[7] ^= 0x80  # 0.0 -> -0.0: equal as numbers, not as bytes
    assert t[1].item() == 0.0 and _diff(base, _snapshot({"t": t})) == ["~ t"]
    _np_bytes(t)[7] ^= 0x80
    t.add_(0.0)  # same bytes, but written in place: the version counter moved
    assert _diff(base, _snapshot({"t": t})) == ["~ t"]

    model, opt, sc = _trained(FASTAMP, "SGD", backward=False)
    world = _world(model, opt, sc)
    base = _snapshot(world)
    sc._per_optimizer_states[id(object())]  # the defaultdict grows an entry: pickling now fails
    assert any(
        x.startswith("+ scaler._per_optimizer_states[") for x in _diff(base, _snapshot(world))
    )
    sc._per_optimizer_states.clear()
    opt.param_groups[1]["lr"] = math.nextafter(opt.param_groups[1]["lr"], 1.0)
    assert _diff(base, _snapshot(world)) == ["~ optimizer.param_groups[1]['lr']"]
    opt.param_groups[1]["lr"] = 2e-3
    model[2].forward = functools.partial(model[2].forward)
    assert _diff(base, _snapshot(world)) == ["~ model.2.<module>"]
    del model[2].forward
    model[0].weight.grad = None
    assert "- model.0.weight.grad" in _diff(base, _snapshot(world))
