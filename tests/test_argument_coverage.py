"""Every value class of every argument of every op with a CUDA kernel reaches the CPU kernel and
the emulated CUDA kernel in some test (tests/_argcov.py records the session's calls; conftest
runs this module last). An argument value no test passes is a code path no test compares: a
tensor lr that never reaches a CUDA kernel, maximize=True that never reaches a CPU kernel."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests import _argcov

# The suites whose calls count: the coverage is only judged on a run that collected all of them
# and left out nothing but `slow` tests (`pytest`: not the quick tier, not -k), or on a `-m full`
# run that adds the records a whole quick tier saved (`make test` then `make test-full`, CI's
# order: tests/conftest.py).
SUITES = (
    "tests/cuda_emu/",
    "tests/scaler/",
    "tests/optim/",
    "tests/parallel/",
    "tests/checkpoint/",
)


_PRIOR: list[str] | None = None


def _prior_quick_tier() -> list[str]:
    """The tests of the quick tier whose records FASTAMP_ARGCOV_PRIOR holds, added once to this
    session's records; [] without one."""
    global _PRIOR
    if _PRIOR is None:
        path = os.environ.get("FASTAMP_ARGCOV_PRIOR", "")
        _PRIOR = _argcov.load(path) if path and os.path.exists(path) else []
    return _PRIOR


def _whole_suite(request) -> bool:
    config = request.config
    if config.getoption("keyword", "") or getattr(config, "workerinput", None) is not None:
        return False
    deselected = getattr(config, "_fastamp_deselected", [])  # tests/conftest.py
    paths = {i.nodeid for i in request.session.items}
    if config.getoption("markexpr", "") == "full":
        if config.args_source == pytest.Config.ArgsSource.ARGS:
            return False  # paths named: the full tier of part of the suite
        prior = set(_prior_quick_tier())
        unrun = [
            i.nodeid
            for i in deselected
            if i.nodeid not in prior and i.get_closest_marker("slow") is None
        ]
        if prior and unrun:
            # A saved quick tier was handed over (make test-full) but is not this suite's: a
            # test added or renamed since (a docs test's id names its line). Not a silent skip.
            pytest.fail(
                f"the quick tier's saved records ({os.environ['FASTAMP_ARGCOV_PRIOR']}) are "
                f"stale: {len(unrun)} quick-tier tests of this suite are not in them, e.g. "
                f"{unrun[0]}; run `make test` again before `make test-full` (`make test-all`)"
            )
        if unrun:
            return False  # no saved quick tier: this session alone is not the whole suite
        paths |= prior
    elif any(i.get_closest_marker("slow") is None for i in deselected):
        return False
    return all(any(p.startswith(s) for p in paths) for s in SUITES)


@pytest.mark.full
def test_every_argument_value_class_reaches_both_backends(request):
    if getattr(request.config, "workerinput", None) is not None:
        pytest.skip(
            "a pytest-xdist worker saw only its share of the calls: the controller judges the "
            "argument coverage once every worker has finished (tests/conftest.py)"
        )
    if not _whole_suite(request):
        pytest.skip(
            "argument coverage is judged on the whole suite (`make test-all`: no -k, nothing "
            "but `slow` tests deselected, every op suite collected)"
        )
    gaps = _argcov.missing()
    assert not gaps, (
        f"{len(gaps)} argument value class(es) never reached a kernel:\n  " + "\n  ".join(gaps)
    )


def test_a_removed_argument_class_is_reported():
    """Planted: the check over a copy of the session's records with one class taken out of each
    backend in turn."""
    saved = {k: {a: set(c) for a, c in v.items()} for k, v in _argcov.SEEN.items()}
    try:
        for backend in _argcov.BACKENDS:
            where = "CPU" if backend == "cpu" else "emulated CUDA"
            for b in _argcov.BACKENDS:
                _argcov.SEEN[(b, "adam_step_")]["maximize"] = {"True", "False"}
                _argcov.SEEN[(b, "adam_step_")]["lr_tensor"] = {"None", "tensor"}
            gaps = _argcov.missing(["adam_step_"])
            assert not [g for g in gaps if ".maximize:" in g or ".lr_tensor:" in g]
            seen = _argcov.SEEN[(backend, "adam_step_")]
            seen["maximize"] = {"False"}
            assert f"adam_step_.maximize: True never reached the {where} kernel" in _argcov.missing(
                ["adam_step_"]
            )
            seen["maximize"] = {"True", "False"}
            seen["lr_tensor"] = {"None"}
            assert (
                f"adam_step_.lr_tensor: tensor never reached the {where} kernel"
                in _argcov.missing(["adam_step_"])
            )
    finally:
        _argcov.SEEN.clear()
        for k, v in saved.items():
            _argcov.SEEN[k].update(v)


def test_classes_follow_the_schema():
    op = "grad_stats"
    args = {a.name: a for a in _argcov._schema(op).arguments}
    assert _argcov._classes(op, args["norm_type"], float("inf")) == {"inf"}
    assert _argcov._classes(op, args["norm_type"], 3.0) == {"p"}
    adam = {a.name: a for a in _argcov._schema("adam_step_").arguments}
    assert _argcov._classes("adam_step_", adam["found_inf"], None) == {"None"}
    assert _argcov._classes("adam_step_", adam["found_inf"], torch.tensor(1.0)) == {
        "tensor",
        "dtype:float32",
        "tensor!=0",
    }
    assert _argcov._classes("adam_step_", adam["master_params"], []) == {"empty"}
    assert _argcov._classes("adam_step_", adam["maximize"], True) == {"True"}
    assert set(_argcov.required("adam_step_")["maximize"]) == {"True", "False"}


class _FakeConfig:
    """What tests/conftest.py's xdist controller reads of a pytest config."""

    def __init__(self, root) -> None:
        import types

        self.option = types.SimpleNamespace(numprocesses=2)
        self.args_source = pytest.Config.ArgsSource.TESTPATHS
        self.rootpath = root
        self.pluginmanager = types.SimpleNamespace(getplugin=lambda name: None)

    def getoption(self, name, default=None):
        return {"markexpr": "full", "keyword": ""}.get(name, default)


@pytest.mark.parametrize("planted", ["class_missing", "stale_quick_tier", "none"])
def test_the_xdist_controller_judges_the_workers_records(tmp_path, monkeypatch, planted):
    """The full tier in pytest-xdist workers: the controller adds up the workers' records and the
    quick tier's, then fails the session on a value class no kernel saw or on a stale quick
    tier, and passes one that has them all (planted on copies of this session's records)."""
    import types

    from tests import conftest

    saved = {k: {a: set(c) for a, c in v.items()} for k, v in _argcov.SEEN.items()}
    monkeypatch.delenv("FASTAMP_ARGCOV_SAVE", raising=False)
    (tmp_path / "build").mkdir()
    parts = tmp_path / "build" / "argcov-full-parts"
    try:
        # every class every op argument must take, on both backends
        everything: dict = {}
        for op in _argcov.cuda_ops():
            for arg, need in _argcov.required(op).items():
                for b in _argcov.BACKENDS:
                    everything.setdefault((b, op), {})[arg] = set(need)
        if planted == "class_missing":
            everything[("emu", "adam_step_")]["maximize"] = {"False"}
        suites = [f"{s}test_x.py::t" for s in SUITES]
        quick = ["tests/scaler/test_q.py::q"]
        for w, half in enumerate((list(everything.items())[::2], list(everything.items())[1::2])):
            _argcov.SEEN.clear()
            for (b, op), args in half:
                for a, c in args.items():
                    _argcov.SEEN[(b, op)][a] |= set(c)
            _argcov.save(
                f"{parts}.gw{w}",
                suites,
                extra={
                    "passed": True,
                    "whole_quick": False,
                    "deselected_not_slow": quick
                    + (["tests/optim/test_new.py::n"] * (planted == "stale_quick_tier")),
                },
            )
        _argcov.SEEN.clear()
        monkeypatch.setattr(sys.modules[__name__], "_PRIOR", quick)
        session = types.SimpleNamespace(config=_FakeConfig(tmp_path), exitstatus=0)
        conftest._add_worker_parts(session)
        failed = session.exitstatus == pytest.ExitCode.TESTS_FAILED
        assert failed == (planted != "none")
        if planted == "class_missing":
            assert (
                "adam_step_.maximize: True never reached the emulated CUDA kernel"
                in _argcov.missing(["adam_step_"])
            )
        assert not list(tmp_path.glob("build/argcov-full-parts.gw*"))  # the parts are consumed
    finally:
        _argcov.SEEN.clear()
        for k, v in saved.items():
            for a, c in v.items():
                _argcov.SEEN[k][a] |= c
