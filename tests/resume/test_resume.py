"""fastamp.save_training_state / load_training_state in one process: an exact resume, and the
errors for files that cannot be resumed (raised before anything is restored)."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch
from torch import nn

import fastamp
from fastamp.resume._checksums import seal
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
    fastamp.save_training_state(
        tmp_path / "c.pt",
        model=net,
        optimizer=opt,
        scaler=scaler,
        lr_scheduler=sched,
        step=5,
        extra={"epoch": 0},
    )
    for i in range(5, 7):  # the interrupted run goes on a little and is lost
        _step(net, scaler, opt, sched, i)
    random.seed(99)
    np.random.seed(99)
    net, scaler, opt, sched = _make(seed=7)
    st = fastamp.load_training_state(
        tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler, lr_scheduler=sched
    )
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
    opt2 = torch.optim.AdamW(
        [{"params": [net.a.weight]}, {"params": [net.a.bias, net.b.weight, net.b.bias]}]
    )
    torch.save(net.state_dict(), tmp_path / "plain.pt")

    def other_model():
        with pytest.raises(RuntimeError, match="the model does not match .*Build the same model"):
            fastamp.load_training_state(tmp_path / "c.pt", model=wide)

    _unchanged_after(other_model, objs)

    def no_sched_saved():
        with pytest.raises(
            ValueError, match="lr_scheduler was given but .* holds no lr_scheduler state"
        ):
            fastamp.load_training_state(
                tmp_path / "c.pt", model=net, optimizer=opt, lr_scheduler=sched
            )

    _unchanged_after(no_sched_saved, objs)

    def wrong_groups():
        with pytest.raises(
            ValueError, match="optimizer has .* build the optimizer as the saved run did"
        ):
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
    shared = {
        "format": 2,
        "save_id": "aaaa",
        "world_size": 2,
        "step": 1,
        "extra": {},
        "model": net.state_dict(),
        "sharded": None,
        "ddp_buckets": None,
        "optimizer": None,
        "scaler": None,
        "lr_scheduler": None,
        "torch_version": "x",
    }
    torch.save(seal(shared), base)
    torch.save(
        seal({"format": 2, "save_id": "bbbb", "rank": 0, "world_size": 2, "rng": {}}),
        f"{base}.rank0",
    )
    with pytest.raises(RuntimeError, match="saved by 2 process.*restore_rng=False"):
        fastamp.load_training_state(base, model=net)  # this process is not distributed: world 1
    st = fastamp.load_training_state(base, model=net, restore_rng=False)
    assert st.step == 1 and not st.rng_restored
    # as rank 0 of 2 (the process-group query stubbed): the mismatched save ids are refused
    import fastamp.resume.training_state as resume

    monkeypatch.setattr(resume, "_dist_info", lambda: (0, 2, False))
    rng = torch.get_rng_state()
    with pytest.raises(
        RuntimeError, match="belongs to another save .* previous complete checkpoint"
    ):
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


# ----------------------------------------------------------------------------- issue 14


def _full_snapshot(net, opt, scaler, sched):
    return (
        [t.clone() for t in net.state_dict().values()],
        opt.state_dict(),
        scaler.state_dict(),
        sched.state_dict(),
        torch.get_rng_state(),
        random.getstate(),
        torch.from_numpy(np.random.get_state()[1].astype("int64")),
    )


def _tamper(path, fn):
    """A file edited by hand, its checksums recomputed: what the checks after them must refuse."""
    obj = torch.load(path, weights_only=True)
    fn(obj)
    torch.save(seal(obj), path)


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def fn(obj):
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value

    return fn


def _pop(*keys):
    def fn(obj):
        for k in keys[:-1]:
            obj = obj[k]
        obj.pop(keys[-1])

    return fn


def _save_variant(tmp_path, optimizer_cls=None, scaler_enabled=True):
    net, scaler, opt, sched = _make()
    if optimizer_cls is not None:
        opt = optimizer_cls(net.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if not scaler_enabled:
        scaler = fastamp.GradScaler("cpu", enabled=False)
    for i in range(2):
        _step(net, scaler, opt, sched, i)
    fastamp.save_training_state(
        tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler, lr_scheduler=sched, step=2
    )
    return tmp_path / "c.pt"


BAD_FILES = {
    # name: (how the file is made, what the load raises)
    "SGD state into AdamW": (lambda p: _save_variant(p, fastamp.optim.SGD), ValueError),
    "torch SGD state into AdamW": (lambda p: _save_variant(p, torch.optim.SGD), ValueError),
    "disabled scaler's empty state": (
        lambda p: _save_variant(p, scaler_enabled=False),
        RuntimeError,
    ),
    "scale 0": (
        lambda p: _tamper(_save_variant(p), _set("scaler", "scale", 0.0)) or p / "c.pt",
        ValueError,
    ),
    "exp_avg of the wrong shape": (
        lambda p: (
            _tamper(_save_variant(p), _set("optimizer", "state", 0, "exp_avg", torch.zeros(3)))
            or p / "c.pt"
        ),
        ValueError,
    ),
    "RNG entry missing": (
        lambda p: _tamper(_save_variant(p), _pop("rng")) or p / "c.pt",
        ValueError,
    ),
    # a KeyError naming the entry and the file (was a bare KeyError: 'model')
    "model entry missing": (
        lambda p: _tamper(_save_variant(p), _pop("model")) or p / "c.pt",
        KeyError,
    ),
    "world_size entry missing": (
        lambda p: _tamper(_save_variant(p), _pop("world_size")) or p / "c.pt",
        KeyError,
    ),
    "python RNG entry missing": (
        lambda p: _tamper(_save_variant(p), _pop("rng", "python")) or p / "c.pt",
        ValueError,
    ),
    "torch RNG entry corrupt": (
        lambda p: (
            _tamper(_save_variant(p), _set("rng", "torch", torch.zeros(7, dtype=torch.uint8)))
            or p / "c.pt"
        ),
        ValueError,
    ),
    "numpy RNG entry corrupt": (
        lambda p: (
            _tamper(
                _save_variant(p),
                _set("rng", "numpy", ("MT19937", torch.zeros(3, dtype=torch.int64), 0, 0, 0.0)),
            )
            or p / "c.pt"
        ),
        ValueError,
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_refused_before_anything_is_restored(tmp_path, case):
    make_file, error = BAD_FILES[case]
    path = make_file(tmp_path)
    random.seed(5)
    np.random.seed(5)
    net, scaler, opt, sched = _make(seed=3)  # the AdamW run that tries to resume
    for i in range(3):
        _step(net, scaler, opt, sched, i)
    before = _full_snapshot(net, opt, scaler, sched)
    with pytest.raises(error) as info:
        fastamp.load_training_state(
            path, model=net, optimizer=opt, scaler=scaler, lr_scheduler=sched
        )
    if error is KeyError:
        assert "load_training_state" in str(info.value) and "has no" in str(info.value)
    assert_bitwise_equal(_full_snapshot(net, opt, scaler, sched), before)


def test_a_load_failing_late_undoes_what_it_restored(tmp_path, monkeypatch):
    path = _save_variant(tmp_path)
    net, scaler, opt, sched = _make(seed=3)
    for i in range(3):
        _step(net, scaler, opt, sched, i)
    before = _full_snapshot(net, opt, scaler, sched)

    def broken(state_dict):
        raise RuntimeError("injected failure after the optimizer and scaler were restored")

    monkeypatch.setattr(net, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="injected"):
        fastamp.load_training_state(
            path, model=net, optimizer=opt, scaler=scaler, lr_scheduler=sched
        )
    monkeypatch.undo()
    assert_bitwise_equal(_full_snapshot(net, opt, scaler, sched), before)
    # and the objects still work: a step after the failed load equals one without it
    _step(net, scaler, opt, sched, 3)


def test_extra_common_types_round_trip(tmp_path):
    import argparse
    import pathlib

    net, *_ = _make()
    extra = {
        "np_f32": np.float32(1.5),
        "np_i64": np.int64(-3),
        "np_bool": np.bool_(True),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "farr": np.linspace(0, 1, 4),
        "path": pathlib.Path("/data/run1"),
        "args": argparse.Namespace(lr=0.1, tag="x", dims=[1, 2]),
        "nested": [{"p": pathlib.Path("a")}, (np.float64(2.0),)],
    }
    fastamp.save_training_state(tmp_path / "c.pt", model=net, extra=extra)
    got = fastamp.load_training_state(tmp_path / "c.pt", model=net).extra
    assert got.keys() == extra.keys()
    for k in ("np_f32", "np_i64", "np_bool"):
        assert type(got[k]) is type(extra[k]) and got[k] == extra[k]
    for k in ("arr", "farr"):
        assert got[k].dtype == extra[k].dtype and np.array_equal(got[k], extra[k])
    assert got["path"] == extra["path"] and got["args"] == extra["args"]
    assert got["nested"][0]["p"] == pathlib.Path("a") and got["nested"][1][0] == np.float64(2.0)


class _Opaque:
    pass


@pytest.mark.parametrize("bad", [_Opaque(), {1, 2}, np.array([object()], dtype=object), lambda: 0])
def test_extra_that_weights_only_cannot_read_is_refused_at_save(tmp_path, bad):
    net, *_ = _make()
    with pytest.raises(TypeError, match=r"extra\['bad'\].*weights_only"):
        fastamp.save_training_state(tmp_path / "c.pt", model=net, extra={"ok": 1, "bad": bad})
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file


def test_concurrent_saves_from_threads_all_succeed(tmp_path):
    import threading

    net, scaler, opt, sched = _make()
    errors = []

    def save(i):
        try:
            fastamp.save_training_state(
                tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler, step=i
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left
    assert fastamp.load_training_state(tmp_path / "c.pt", model=net).step in range(40)


def test_files_carry_no_torch_crc32_and_the_option_is_left_as_it_was(tmp_path, monkeypatch):
    """The checkpoint is written without torch.save's CRC-32 (the checksums replace it; torch.load
    never checked it); torch's process-wide option is put back after the save, failed or not."""
    import zipfile

    net, scaler, opt, _ = _make()
    path = tmp_path / "c.pt"
    try:
        for before in (True, False):
            torch.serialization.set_crc32_options(before)
            fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=1)
            assert torch.serialization.get_crc32_options() is before
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(path) as z:
        assert {i.CRC for i in z.infolist() if i.file_size} == {0}
    assert fastamp.load_training_state(path, model=net, optimizer=opt, scaler=scaler).step == 1

    real_save = torch.save

    def fail_inside(obj, f, *args, **kwargs):
        if not torch.serialization.get_crc32_options():
            raise RuntimeError("the writer failed")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fail_inside)
    with pytest.raises(RuntimeError, match="the writer failed"):
        fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=2)
    assert torch.serialization.get_crc32_options() is True
    monkeypatch.undo()
    assert fastamp.load_training_state(path, model=net).step == 1  # the previous one, intact


def test_failed_saves_leave_no_temporary_file(tmp_path, monkeypatch):
    net, scaler, opt, _ = _make()
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory; expected a file name"):
        fastamp.save_training_state(tmp_path / "adir", model=net)
    (tmp_path / "c.pt").write_bytes(b"previous checkpoint")

    import fastamp.resume.training_state as resume

    real_fdopen = resume.os.fdopen

    def disk_full(fd, *args, **kwargs):  # the temporary file, on a device with no space left
        real_fdopen(fd, *args, **kwargs).close()
        return open("/dev/full", "wb", buffering=0)  # noqa: SIM115

    monkeypatch.setattr(resume.os, "fdopen", disk_full)
    with pytest.raises(OSError, match="disk is full") as info:
        fastamp.save_training_state(tmp_path / "c.pt", model=net, optimizer=opt, scaler=scaler)
    assert info.value.errno == 28 and "inline_container" not in str(info.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "c.pt"]
    assert (tmp_path / "c.pt").read_bytes() == b"previous checkpoint"  # not replaced


# ----------------------------------------------------------------------------- issue 40
# Bytes overwritten in place (a bad disk block, a network file system): the content checksums
# refuse the file before anything is restored, in every optimizer-state format.

STATE_FORMATS = (torch.float32, torch.bfloat16, "int8")
OFFSETS = (0.3, 0.5, 0.7)


def _make_wide(fmt, seed=0):
    """A model whose first weight (8192 elements) keeps 8-bit state under state_dtype='int8'."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.3), nn.Linear(128, 2))
    scaler = fastamp.GradScaler("cpu", init_scale=256.0, growth_interval=2, hysteresis=2)
    opt = fastamp.optim.AdamW(net.parameters(), lr=1e-2, state_dtype=fmt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return net, scaler, opt, sched


def _train_wide(net, scaler, opt, sched, steps):
    for _ in range(steps):
        x = torch.tensor(np.random.randn(4, 64), dtype=torch.float32) + random.random()
        opt.zero_grad()
        scaler.scale(net(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def _overwrite(src, dst, frac, n=64):
    data = bytearray(src.read_bytes())
    at = int(len(data) * frac)
    data[at : at + n] = b"\xff" * min(n, len(data) - at)
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", STATE_FORMATS, ids=str)
def test_overwritten_bytes_are_refused_before_anything_is_restored(tmp_path, fmt, monkeypatch):
    random.seed(2)
    np.random.seed(2)
    saved = _make_wide(fmt)
    _train_wide(*saved, 3)
    if fmt == "int8":
        assert saved[2].state[saved[0][0].weight]["exp_avg_codes"].dtype == torch.uint8
    clean = tmp_path / "c.pt"
    fastamp.save_training_state(
        clean, model=saved[0], optimizer=saved[2], scaler=saved[1], lr_scheduler=saved[3], step=3
    )
    want = _full_snapshot(saved[0], saved[2], saved[1], saved[3])

    random.seed(5)
    np.random.seed(5)
    objs = _make_wide(fmt, seed=3)  # the run that tries to resume
    _train_wide(*objs, 2)
    net, scaler, opt, sched = objs
    kw = dict(model=net, optimizer=opt, scaler=scaler, lr_scheduler=sched)
    before = _full_snapshot(net, opt, scaler, sched)
    bad = tmp_path / "bad.pt"
    for frac in OFFSETS:
        _overwrite(clean, bad, frac)
        with pytest.raises(RuntimeError) as info:
            fastamp.load_training_state(bad, **kw)
        msg = str(info.value)
        assert str(bad) in msg and "nothing was restored" in msg.lower(), msg
        if "could not be read" not in msg:  # (else the archive itself no longer parses)
            # the checksum error: the entry, found and recorded digests
            assert re.search(r"entry '[^']+' .* is 0x[0-9a-f]{16}, the save recorded 0x", msg), msg
        assert_bitwise_equal(_full_snapshot(net, opt, scaler, sched), before)

    # The overwritten bytes reach the state: without the checksums one of these files loads, and
    # what it restores is not what was saved.
    import fastamp.resume.training_state as resume

    monkeypatch.setattr(resume, "verify", lambda obj, path: None)
    differs = 0
    for frac in OFFSETS:
        _overwrite(clean, bad, frac)
        try:
            fastamp.load_training_state(bad, **kw)
        except Exception:  # noqa: BLE001 - a later check may still catch it
            continue
        got = _full_snapshot(net, opt, scaler, sched)
        try:
            assert_bitwise_equal(got, want)
        except AssertionError:
            differs += 1
    assert differs > 0
    monkeypatch.undo()

    # The clean checkpoint still resumes bit for bit, and trains on like the saved run.
    fastamp.load_training_state(clean, **kw)
    assert_bitwise_equal(_full_snapshot(net, opt, scaler, sched), want)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    _train_wide(*objs, 2)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])
    _train_wide(*saved, 2)
    assert_bitwise_equal(
        _full_snapshot(net, opt, scaler, sched),
        _full_snapshot(saved[0], saved[2], saved[1], saved[3]),
    )


def test_format_1_checkpoint_without_checksums_is_refused(tmp_path):
    net, scaler, opt, _ = _make()
    path = tmp_path / "c.pt"
    fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=1)
    obj = torch.load(path, weights_only=True)
    obj.pop("checksums")
    obj["format"] = 1
    torch.save(obj, path)
    before = _snapshot(net, opt, scaler)
    with pytest.raises(RuntimeError, match="format 1.*no checksums.*refuses it"):
        fastamp.load_training_state(path, model=net, optimizer=opt, scaler=scaler)
    assert_bitwise_equal(_snapshot(net, opt, scaler), before)
    # a current file whose checksums entry was removed: refused as damaged
    obj["format"] = 2
    # checksums of the earlier digest (before tensor_digest2): refused by name, nothing restored
    fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=1)
    earlier = torch.load(path, weights_only=True)
    assert earlier["checksums"]["algorithm"] == "fastamp.tensor_digest2+blake2b-64+names"
    earlier["checksums"]["algorithm"] = "fastamp.tensor_digest+blake2b-64"
    torch.save(earlier, path)
    with pytest.raises(
        RuntimeError, match=r"checksums \(fastamp.tensor_digest\+blake2b-64\).*refuses it"
    ):
        fastamp.load_training_state(path, model=net, optimizer=opt, scaler=scaler)
    assert_bitwise_equal(_snapshot(net, opt, scaler), before)
    torch.save(obj, path)
    with pytest.raises(RuntimeError, match="is damaged: its 'checksums' entry is missing"):
        fastamp.load_training_state(path, model=net, optimizer=opt, scaler=scaler)
    assert_bitwise_equal(_snapshot(net, opt, scaler), before)


@pytest.mark.parametrize("entry", [b"extra", b"step", b"ddp_buckets", b"lr_scheduler"])
def test_a_bit_flipped_in_an_entry_name_is_refused_before_anything_is_restored(tmp_path, entry):
    """pickle writes each string once: an entry's name and the key of its recorded digest are the
    same bytes in the file, so a bit flipped there renamed both and a digest of the value alone
    still matched; the load then restored everything and failed on the missing entry (or, for
    ddp_buckets, skipped it). The digests cover the names now."""
    net, scaler, opt, _ = _make()
    path = tmp_path / "c.pt"
    fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=1)
    data = bytearray(path.read_bytes())
    at = data.find(entry)
    assert at >= 0
    data[at + 1] ^= 0x01  # e.g. "extra" -> "eytra"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    net2, scaler2, opt2, _ = _make(seed=7)
    before = _snapshot(net2, opt2, scaler2)
    with pytest.raises(RuntimeError, match="is damaged"):
        fastamp.load_training_state(bad, model=net2, optimizer=opt2, scaler=scaler2)
    assert_bitwise_equal(_snapshot(net2, opt2, scaler2), before)


def test_a_file_whose_digests_left_out_the_names_loads_and_is_checked_for_every_entry(tmp_path):
    """Files saved before the digests covered the entry names still verify (their algorithm is
    recorded); a renamed entry in one is refused by name before anything is restored."""
    from fastamp.resume import _checksums

    net, scaler, opt, _ = _make()
    path = tmp_path / "c.pt"
    fastamp.save_training_state(path, model=net, optimizer=opt, scaler=scaler, step=4)
    obj = torch.load(path, weights_only=True)
    obj.pop("checksums")

    def old_seal(o):
        entries = _checksums._checksums(o, names=False)
        return {**o, "checksums": {"algorithm": "fastamp.tensor_digest2+blake2b-64",
                                   "entries": entries}}  # fmt: skip

    torch.save(old_seal(obj), path)
    net2, scaler2, opt2, _ = _make(seed=7)
    got = fastamp.load_training_state(path, model=net2, optimizer=opt2, scaler=scaler2)
    assert got.step == 4
    assert_bitwise_equal(_snapshot(net2, opt2, scaler2), _snapshot(net, opt, scaler))
    renamed = {("eytra" if k == "extra" else k): v for k, v in obj.items()}
    torch.save(old_seal(renamed), path)
    net3, scaler3, opt3, _ = _make(seed=8)
    before = _snapshot(net3, opt3, scaler3)
    with pytest.raises(KeyError, match=r"has no \['extra'\] entry"):
        fastamp.load_training_state(path, model=net3, optimizer=opt3, scaler=scaler3)
    assert_bitwise_equal(_snapshot(net3, opt3, scaler3), before)
