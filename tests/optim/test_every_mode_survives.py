"""Every optimizer option and mode (flat buffers first) meets the old guarantees, against torch's
counterpart: a ``copy.deepcopy`` / pickle (with the model and the scaler, as a trainer's
snapshot takes them) trains as the original does; ``state_dict`` goes both ways with torch's
``fused=True`` optimizer (torch stays fused and its GradScaler steps it); ``add_param_group``
refusals leave nothing changed; the state-dict hooks are registered once, so ``state_dict`` /
``load_state_dict`` / ``save_training_state`` from several threads at once succeed as torch's."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fastamp
from tests._threads import run_together

MODES = {
    "adamw": (fastamp.optim.AdamW, {}, torch.optim.AdamW),
    "adamw_flat": (fastamp.optim.AdamW, {"flat_buffers": True}, torch.optim.AdamW),
    "adam_flat_amsgrad": (
        fastamp.optim.Adam,
        {"flat_buffers": True, "amsgrad": True},
        torch.optim.Adam,
    ),  # fmt: skip
    "adamw_bf16_state": (fastamp.optim.AdamW, {"state_dtype": torch.bfloat16}, None),
    "adamw_int8_state": (fastamp.optim.AdamW, {"state_dtype": "int8"}, None),
    "adamw_master": (fastamp.optim.AdamW, {"master_weights": True}, None),
    "sgd_momentum": (fastamp.optim.SGD, {"momentum": 0.9, "dampening": 0.1}, torch.optim.SGD),
}


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 3)).to(dtype)


def _setup(mode: str):
    cls, opts, _ = MODES[mode]
    model = _model(torch.bfloat16 if opts.get("master_weights") else torch.float32)
    opt = cls(model.parameters(), lr=1e-2, **opts)
    scaler = fastamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, scaler


def _train(model, opt, scaler, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for k in range(steps):
        x = torch.randn(6, 12, generator=gen).to(dtype)
        opt.zero_grad()
        scaler.scale(model(x).float().square().mean()).backward()
        if k % 2 and isinstance(scaler, fastamp.GradScaler):
            scaler.clip_grad_norm_(opt, 0.5)
        elif k % 2:  # torch's recipe
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()


def _options(opt) -> dict:
    return {
        "flat_buffers": opt._flat_buffers,  # private-ok: the option as the optimizer keeps it
        "master_weights": opt._master_weights,  # private-ok: likewise
        "state_format": opt._default_format.name,  # private-ok: likewise
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_copy_trains_as_the_original(mode, how):
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 3, seed=1)
    dump = copy.deepcopy if how == "deepcopy" else lambda x: pickle.loads(pickle.dumps(x))
    model2, opt2, scaler2 = dump((model, opt, scaler))
    assert _options(opt2) == _options(opt)
    _train(model, opt, scaler, 4, seed=2)
    _train(model2, opt2, scaler2, 4, seed=2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    if opt._flat_buffers:  # private-ok: the copy keeps its params in flat buffers too
        assert opt2.amp_flat_grads() is not None


@pytest.mark.parametrize("mode", [m for m in sorted(MODES) if MODES[m][2] is not None])
def test_state_dict_both_ways_with_torchs_fused_optimizer(mode):
    """fastamp -> torch(fused=True): torch stays fused and its GradScaler steps it; torch ->
    fastamp: the same trajectory as torch's own optimizer continuing."""
    cls, opts, torch_cls = MODES[mode]
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 3, seed=1)
    tmodel = copy.deepcopy(model)
    tkw = {k: v for k, v in opts.items() if k not in ("flat_buffers",)}
    topt = torch_cls(tmodel.parameters(), lr=1e-2, fused=True, **tkw)
    topt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch keeps the tensors it is given)
    assert all(g["fused"] for g in topt.param_groups)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    _train(tmodel, topt, tscaler, 3, seed=2)  # (torch's scaler asserts on a non-fused step)
    _train(model, opt, scaler, 3, seed=2)
    for a, b in zip(model.parameters(), tmodel.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # back: torch's state into a fresh fastamp optimizer, both continue alike
    model3 = copy.deepcopy(tmodel)
    opt3 = cls(model3.parameters(), lr=1e-2, **opts)
    opt3.load_state_dict(copy.deepcopy(topt.state_dict()))
    _train(tmodel, topt, tscaler, 2, seed=3)
    _train(model3, opt3, fastamp.GradScaler("cpu", init_scale=tscaler.get_scale()), 2, seed=3)
    for a, b in zip(model3.parameters(), tmodel.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mode, case",
    [("adamw", "already_in_a_group"), ("sgd_momentum", "already_in_a_group"),
     ("adamw_flat", "already_in_a_group"), ("adamw_flat", "shares_memory")],
)  # fmt: skip
def test_add_param_group_refusal_changes_nothing(mode, case):
    """Refused as torch refuses (a param already in a group), or, with flat buffers, a param
    whose memory another param holds (its own copy in the buffer would break the tie)."""
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 2, seed=1)
    group = {
        "shares_memory": {"params": [nn.Parameter(model[0].weight.data[0])]},
        "already_in_a_group": {"params": [model[0].weight]},
    }[case]
    if case == "already_in_a_group":
        with pytest.raises(ValueError):
            torch.optim.AdamW(model.parameters()).add_param_group(dict(group))
    before = (len(opt.param_groups), _options(opt), copy.deepcopy(opt.state_dict()))
    with pytest.raises(ValueError):
        opt.add_param_group(group)
    after = opt.state_dict()
    assert len(opt.param_groups) == before[0] and _options(opt) == before[1]
    assert after["param_groups"] == before[2]["param_groups"]
    _train(model, opt, scaler, 2, seed=2)  # steps on as before: no stale group


@pytest.mark.parametrize("mode", ["adamw", "adamw_flat"])
def test_add_param_group_takes_what_torch_takes(mode):
    """A frozen float param and a frozen integer buffer-like param: torch's optimizers accept
    them (they never get a grad); so does fastamp, flat buffers included."""
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 2, seed=1)
    for extra in (
        nn.Parameter(torch.randn(3), requires_grad=False),
        torch.zeros(3, dtype=torch.int64),
    ):
        tref = torch.optim.AdamW([nn.Parameter(torch.randn(2))])
        tref.add_param_group({"params": [extra]})  # torch accepts it
        opt.add_param_group({"params": [extra]})
    _train(model, opt, scaler, 2, seed=2)


@pytest.mark.parametrize("mode", ["adamw", "adamw_flat", "sgd_momentum"])
def test_state_dict_hooks_are_registered_once(mode):
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 2, seed=1)
    hooks = [
        dict(opt._optimizer_state_dict_post_hooks),  # private-ok: torch's hook registries
        dict(opt._optimizer_load_state_dict_pre_hooks),  # private-ok
        dict(opt._optimizer_load_state_dict_post_hooks),  # private-ok
    ]
    for _ in range(3):
        opt.load_state_dict(opt.state_dict())
    assert hooks == [
        dict(opt._optimizer_state_dict_post_hooks),  # private-ok
        dict(opt._optimizer_load_state_dict_pre_hooks),  # private-ok
        dict(opt._optimizer_load_state_dict_post_hooks),  # private-ok
    ]
    # a user's pre-hook registered later still runs before fastamp's check
    seen: list[str] = []

    def user_hook(optimizer, sd):
        seen.append("user")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.123) for g in sd["param_groups"]]
        return sd

    opt.register_load_state_dict_pre_hook(user_hook)
    opt.load_state_dict(opt.state_dict())
    assert seen == ["user"] and all(g["lr"] == 0.123 for g in opt.param_groups)


@pytest.mark.parametrize("paths", ["one_path", "four_paths"])
@pytest.mark.parametrize("mode", ["adamw", "adamw_flat", "sgd_momentum"])
def test_concurrent_saves_succeed_and_load(mode, paths, tmp_path):
    """4 threads x 5 saves (state_dict, and torch.save of it), to one path and to four, as torch's
    optimizers allow; every file loads and equals the state saved."""
    model, opt, scaler = _setup(mode)
    _train(model, opt, scaler, 2, seed=1)
    tref = torch.optim.AdamW(_model().parameters())

    def save(k: int) -> None:
        for j in range(5):
            sd = opt.state_dict()
            tref.state_dict()
            path = tmp_path / (f"opt{k}.pt" if paths == "four_paths" else "opt.pt")
            tmp = tmp_path / f"tmp{k}_{j}.pt"
            torch.save(sd, tmp)
            tmp.replace(path)  # atomic per save, as a trainer writes

    assert run_together(save, 4) == []
    expected = opt.state_dict()
    for f in sorted(tmp_path.glob("opt*.pt")):
        loaded = torch.load(f, weights_only=False)
        fresh = _setup(mode)[1]
        fresh.load_state_dict(loaded)
        for pid, st in expected["state"].items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(loaded["state"][pid][key], v)


@pytest.mark.parametrize("paths", ["one_path", "four_paths"])
def test_concurrent_save_training_state(paths, tmp_path):
    model, opt, scaler = _setup("adamw_flat")
    _train(model, opt, scaler, 2, seed=1)

    def save(k: int) -> None:
        for _ in range(5):
            target = tmp_path / (f"state{k}" if paths == "four_paths" else "state")
            fastamp.save_training_state(target, model=model, optimizer=opt, scaler=scaler)

    assert run_together(save, 4) == []
    for target in sorted(tmp_path.glob("state*")):
        m2, o2, s2 = _setup("adamw_flat")
        fastamp.load_training_state(target, model=m2, optimizer=o2, scaler=s2)
        for a, b in zip(model.parameters(), m2.parameters()):
            assert torch.equal(a, b)
