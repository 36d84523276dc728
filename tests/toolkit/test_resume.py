"""fastamp.save_training_state / load_training_state in one process: an exact resume, and the
errors for files that cannot be resumed (raised before anything is restored)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import fastamp
from fastamp.testing import assert_bitwise_equal


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(32, 2)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _make(seed=0):
    torch.manual_seed(seed)
    net = _Net()
    scaler = fastamp.GradScaler("cpu", init_scale=256.0, growth_interval=2, hysteresis=2)
    opt = fastamp.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return net, scaler, opt, sched


def _step(net, scaler, opt, sched, i):
    # the batch comes from python's and numpy's global generators, dropout from torch's
    x = torch.tensor(np.random.randn(4, 8), dtype=torch.float32) + random.random()
    opt.zero_grad()
    loss = net(x).square().mean() * (math.inf if i in (3, 4) else 1.0)
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item(), scaler.get_scale()


def _snapshot(net, opt, scaler):
    return ([p.detach().clone() for p in net.parameters()], opt.state_dict(), scaler.state_dict())


def test_resume_is_bit_identical(tmp_path):
    random.seed(1)
    np.random.seed(1)
    net, scaler, opt, sched = _make()
    full = [_step(net, scaler, opt, sched, i) for i in range(10)]
    want = _snapshot(net, opt, scaler)

    random.seed(1)
    np.random.seed(1)
    net, scaler, opt, sched = _make()
    for i in range(5):
        _step(net, scaler, opt, sched, i)
    fastamp.save_training_state(tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler,
                                lr_scheduler=sched, step=5, extra={"epoch": 0})
    for i in range(5, 7):  # the interrupted run goes on a little and is lost
        _step(net, scaler, opt, sched, i)
    random.seed(99)
    np.random.seed(99)
    net, scaler, opt, sched = _make(seed=7)
    st = fastamp.load_training_state(tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler,
                                     lr_scheduler=sched)
    assert st.step == 5 and st.extra == {"epoch": 0} and st.world_size == 1
    rest = [_step(net, scaler, opt, sched, i) for i in range(5, 10)]
    assert rest == full[5:]
    assert_bitwise_equal(_snapshot(net, opt, scaler), want)
    assert scaler._get_hysteresis_tracker() == want[2]["_hysteresis_tracker"]


def _saved(tmp_path):
    net, scaler, opt, sched = _make()
    for i in range(3):
        _step(net, scaler, opt, sched, i)
    fastamp.save_training_state(tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler, step=3)
    return net, scaler, opt, sched


def _unchanged_after(fn, objs):
    net, scaler, opt = objs
    before = _snapshot(net, opt, scaler)
    rng = torch.get_rng_state()
    fn()
    assert_bitwise_equal(_snapshot(net, opt, scaler), before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_load_errors_leave_everything_untouched(tmp_path):
    _saved(tmp_path)
    net, scaler, opt, sched = _make(seed=3)
    objs = (net, scaler, opt)
    wide = nn.Sequential(nn.Linear(8, 16))
    opt2 = torch.optim.AdamW([{"params": [net.a.weight]}, {"params": [net.a.bias, net.b.weight, net.b.bias]}])
    torch.save(net.state_dict(), tmp_path / "plain.pt")

    def other_model():
        with pytest.raises(RuntimeError, match="the model does not match .*Build the same model"):
            fastamp.load_training_state(tmp_path / "c.pt", model=wide)
    _unchanged_after(other_model, objs)

    def no_sched_saved():
        with pytest.raises(ValueError, match="lr_scheduler was given but .* holds no lr_scheduler state"):
            fastamp.load_training_state(tmp_path / "c.pt", model=net, optimizer=opt, lr_scheduler=sched)
    _unchanged_after(no_sched_saved, objs)

    def wrong_groups():
        with pytest.raises(ValueError, match="optimizer has .* build the optimizer as the saved run did"):
            fastamp.load_training_state(tmp_path / "c.pt", model=net, optimizer=opt2)
    _unchanged_after(wrong_groups, objs)

    def foreign_file():
        with pytest.raises(RuntimeError, match="not a fastamp training state"):
            fastamp.load_training_state(tmp_path / "plain.pt", model=net)
    _unchanged_after(foreign_file, objs)

    def missing():
        with pytest.raises(FileNotFoundError, match="does not exist"):
            fastamp.load_training_state(tmp_path / "nope.pt", model=net)
    _unchanged_after(missing, objs)


def test_interrupted_distributed_save_and_world_size_change_are_refused(tmp_path, monkeypatch):
    # Files of a 2-rank save whose rank file belongs to another save (killed mid-save).
    net, scaler, opt, _ = _make()
    base = tmp_path / "c.pt"
    shared = {"format": 1, "save_id": "aaaa", "world_size": 2, "step": 1, "extra": {},
              "model": net.state_dict(), "ddp_buckets": None, "optimizer": None, "scaler": None,
              "lr_scheduler": None, "torch_version": "x"}
    torch.save(shared, base)
    torch.save({"format": 1, "save_id": "bbbb", "rank": 0, "world_size": 2, "rng": {}}, f"{base}.rank0")
    with pytest.raises(RuntimeError, match="saved by 2 process.*restore_rng=False"):
        fastamp.load_training_state(base, model=net)  # this process is not distributed: world 1
    st = fastamp.load_training_state(base, model=net, restore_rng=False)
    assert st.step == 1 and not st.rng_restored
    # as rank 0 of 2 (the process-group query stubbed): the mismatched save ids are refused
    import fastamp.resume as resume

    monkeypatch.setattr(resume, "_dist_info", lambda: (0, 2, False))
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="belongs to another save .* previous complete checkpoint"):
        fastamp.load_training_state(base, model=net)
    assert torch.equal(torch.get_rng_state(), rng)


def test_save_refuses_mid_step_scaler(tmp_path):
    net, scaler, opt, _ = _make()
    opt.zero_grad()
    scaler.scale(net(torch.randn(4, 8)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="middle of a step.*after scaler.update"):
        fastamp.save_training_state(tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler)
    assert not (tmp_path / "c.pt").exists()
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        fastamp.save_training_state(tmp_path / "c.pt", model=net, step=-1)
