import os

import pytest
import torch


def _devices():
    devs = ["cpu"]
    # No CUDA call at import time beyond is_available(), which does not initialise a context.
    devs.append(
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        )
    )
    return devs


@pytest.fixture(params=_devices())
def device(request):
    if request.param == "cuda":
        import fastamp

        if not fastamp.build_info()["with_cuda"]:
            pytest.skip("fastamp was built without CUDA kernels")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# The `clients` tier (`make test-clients`): tests marked `clients` need Lightning, accelerate,
# transformers or timm and skip (pytest.importorskip) where those are not installed. With
# FASTAMP_REQUIRE_CLIENTS=1 a skip of such a test is a failure, so the tier cannot pass by
# skipping everything (a missing pin, a broken import, a client that moved an API).
_REQUIRE_CLIENTS = os.environ.get("FASTAMP_REQUIRE_CLIENTS", "") not in ("", "0")


def _skip_text(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip skips the whole module at collection, before any test
    # (and its marker) exists: fail it when the module holds `clients` tests.
    outcome = yield
    report = outcome.get_result()
    if _REQUIRE_CLIENTS and report.skipped and isinstance(collector, pytest.Module):
        try:
            text = collector.path.read_text(encoding="utf-8")
        except OSError:
            text = ""
        if "mark.clients" in text:
            report.outcome = "failed"
            report.longrepr = (
                f"FASTAMP_REQUIRE_CLIENTS=1: {collector.path.name} holds `clients` tests but was "
                f"skipped at import ({_skip_text(report)}); install the pins in requirements/ "
                "(`make test-clients`)"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _REQUIRE_CLIENTS and report.skipped and item.get_closest_marker("clients") is not None:
        reason = _skip_text(report)
        report.outcome = "failed"
        report.longrepr = (
            f"FASTAMP_REQUIRE_CLIENTS=1: this `clients` test was skipped ({reason}); in the clients "
            "tier every client test must run"
        )


# ---------------------------------------------------------------------------------------------
# Skips summarised by reason: one line per reason with a count and the files, instead of one
# "SKIPPED [1] file:line: no CUDA device" line per test (about 40 on a machine without a GPU).
# `--skip-details` restores pytest's per-location lines.
def pytest_addoption(parser):
    parser.addoption(
        "--skip-details",
        action="store_true",
        help="list every skipped test's location (default: one summary line per skip reason)",
    )


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None and not config.getoption("--skip-details"):
        config._fastamp_skip_summary = "s" in reporter.reportchars
        reporter.reportchars = reporter.reportchars.replace("s", "")


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    else:
        reason = str(report.longrepr)
    return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _quick_tier_summary(terminalreporter)
    if not getattr(config, "_fastamp_skip_summary", False):
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if not skipped:
        return
    by_reason: dict[str, list[str]] = {}
    for r in skipped:
        by_reason.setdefault(_skip_reason(r), []).append(r.nodeid.split("::")[0])
    terminalreporter.section("skipped, by reason (--skip-details lists each)", sep="-")
    for reason, files in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        uniq = sorted(set(files))
        where = ", ".join(uniq[:3]) + (f" and {len(uniq) - 3} more files" if len(uniq) > 3 else "")
        terminalreporter.write_line(f"SKIPPED {len(files):>4}  {reason}  ({where})")


# Hypothesis profiles of the op fuzzers (see tests/_fuzz.py: ``tiered``).
#
# * ``fastamp-fuzz``: the default ``pytest`` tier. Fixed seed (``derandomize``), so CI runs the same
#   examples every time and a failure reproduces; few examples, so the fuzz tests stay near a minute.
# * ``fastamp-fuzz-slow``: the ``slow`` tier (``pytest -m slow -k fuzz``): random seeds, many more
#   examples. A failure prints the ``@reproduce_failure`` blob.
#
# Neither keeps an example database: the tree is shared and ``.hypothesis/`` is not ignored by git.
# ``deadline=None`` because an example's time depends on the drawn sizes (up to ~140k elements) and
# on the machine's load, not on a regression. No health check is suppressed.
from hypothesis import settings  # noqa: E402

settings.register_profile(
    "fastamp-fuzz",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
)
settings.register_profile(
    "fastamp-fuzz-slow",
    derandomize=False,
    deadline=None,
    database=None,
    print_blob=True,
)


# ---------------------------------------------------------------------------------------------
# Argument coverage (tests/_argcov.py): every fastamp op call of the session is classified
# argument by argument, and tests/test_argument_coverage.py, moved to the end of the run, checks
# that each value class of each argument reached both the CPU and the emulated CUDA kernels.
from pathlib import Path  # noqa: E402

# (A test that copies this conftest elsewhere, tests/integrations/test_tier.py, runs without it.)
if (Path(__file__).resolve().parent / "_argcov.py").exists():
    from tests import _argcov

    _argcov.install()

ARGCOV_TEST = "test_argument_coverage.py"


def pytest_collection_modifyitems(session, config, items):
    last = [i for i in items if i.nodeid.split("::")[0].endswith(ARGCOV_TEST)]
    if last:
        items[:] = [i for i in items if i not in last] + last


# ---------------------------------------------------------------------------------------------
# Tiers: `make test` (quick: `-m "not slow and not full"`), `make test-all` and a bare `pytest`
# (the full suite, what CI runs: `-m "not slow"` from pyproject.toml), `pytest -m slow`. The items
# -m or -k left out are kept on the config: the argument-coverage check only judges a run that left
# out nothing but `slow` tests, and the quick tier's summary says what it did not run.
def pytest_deselected(items):
    if items:
        config = items[0].config
        config._fastamp_deselected = getattr(config, "_fastamp_deselected", []) + list(items)


def _quick_tier_summary(terminalreporter) -> None:
    config = terminalreporter.config
    if "not full" not in config.getoption("markexpr", ""):
        return
    deselected = getattr(config, "_fastamp_deselected", [])
    left = sum(1 for i in deselected if i.get_closest_marker("full") is not None)
    if left:
        terminalreporter.write_line(
            f"quick tier: {left} tests marked `full` not run; `make test-all` runs the full suite "
            "(what CI runs)"
        )


# The two tiers in two sessions, each test once (`make test` then `make test-full`, what CI runs):
# the quick tier's session saves its argument-coverage records (FASTAMP_ARGCOV_SAVE, written only
# by a whole quick tier that passed: no -k, nothing but `slow` and `full` tests left out), and the
# `-m full` session adds them to its own (FASTAMP_ARGCOV_PRIOR) and to the tests it counts as run
# (tests/test_argument_coverage.py).
QUICK_MARKEXPR = "not slow and not full"


def _whole_quick_tier(config, exitstatus) -> bool:
    """A passed quick tier that left out nothing but `slow` and `full` tests, with no -k."""
    return (
        exitstatus == 0
        and config.getoption("markexpr", "") == QUICK_MARKEXPR
        and not config.getoption("keyword", "")
        and all(
            i.get_closest_marker("slow") or i.get_closest_marker("full")
            for i in getattr(config, "_fastamp_deselected", [])
        )
    )


# With pytest-xdist (`make test`/`make test-full` run two workers, TEST_WORKERS) each worker
# records the calls of the tests it ran: at its end it writes them, with what it collected and
# deselected, beside the records' path (`<path>.gw0`, ...), and the controller, once every worker
# has finished, adds them up: the quick tier saves the sum as one session does; the full tier
# judges the argument coverage there (tests/test_argument_coverage.py's check, which a worker,
# having seen only its share, cannot make).
def _worker_id(config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else workerinput["workerid"]


def _xdist_controller(config) -> bool:
    return _worker_id(config) is None and bool(getattr(config.option, "numprocesses", None))


def _parts_path(config) -> str:
    return os.environ.get("FASTAMP_ARGCOV_SAVE") or str(
        Path(config.rootpath) / "build" / "argcov-full-parts"
    )


def pytest_sessionstart(session):
    if "_argcov" in globals() and _xdist_controller(session.config):
        for part in Path(_parts_path(session.config)).parent.glob(
            Path(_parts_path(session.config)).name + ".gw*"
        ):
            part.unlink()  # a stale worker file from another run must not be added


def _save_worker_part(session, exitstatus) -> None:
    config = session.config
    deselected = getattr(config, "_fastamp_deselected", [])
    _argcov.save(
        f"{_parts_path(config)}.{_worker_id(config)}",
        [i.nodeid for i in session.items],
        extra={
            "passed": exitstatus == 0,
            "whole_quick": _whole_quick_tier(config, exitstatus),
            "deselected_not_slow": [
                i.nodeid for i in deselected if i.get_closest_marker("slow") is None
            ],
        },
    )


def _add_worker_parts(session) -> None:
    config = session.config
    base = Path(_parts_path(config))
    parts = sorted(base.parent.glob(base.name + ".gw*"))
    datas = [_argcov.load_part(p) for p in parts]
    for p in parts:
        p.unlink()
    workers = int(config.option.numprocesses)
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if len(datas) != workers:
        return  # a worker that stopped early (-x, a crash): no record of the whole tier
    save = os.environ.get("FASTAMP_ARGCOV_SAVE")
    if save:
        if os.path.exists(save):
            os.remove(save)
        if session.exitstatus == 0 and all(d["whole_quick"] for d in datas):
            _argcov.save(save, sorted({n for d in datas for n in d["nodeids"]}))
        return
    if config.getoption("markexpr", "") != "full" or config.getoption("keyword", ""):
        return
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        return  # paths named: the full tier of part of the suite
    from tests.test_argument_coverage import SUITES, _prior_quick_tier

    prior = set(_prior_quick_tier())
    unrun = sorted({n for d in datas for n in d["deselected_not_slow"]} - prior)
    items = {n for d in datas for n in d["nodeids"]} | prior
    verdict: list[str] = []
    if unrun:
        verdict = [
            f"the quick tier's saved records (FASTAMP_ARGCOV_PRIOR) lack {len(unrun)} quick-tier "
            f"tests of this suite, e.g. {unrun[0]}: run `make test` again before `make test-full`"
        ]
    elif all(any(n.startswith(s) for n in items) for s in SUITES):
        gaps = _argcov.missing()
        verdict = [f"{len(gaps)} argument value class(es) never reached a kernel:", *gaps]
        if not gaps:
            verdict = []
            if reporter is not None:
                reporter.write_line(
                    "argument coverage (the workers' records with the quick tier's): every "
                    "value class of every op argument reached both backends"
                )
    if verdict:
        if reporter is not None:
            reporter.section("argument coverage (tests/test_argument_coverage.py)", sep="-")
            for line in verdict:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if "_argcov" not in globals():
        return
    if _worker_id(config) is not None:
        if os.environ.get("FASTAMP_ARGCOV_SAVE") or config.getoption("markexpr", "") == "full":
            _save_worker_part(session, exitstatus)
        return
    if _xdist_controller(config):
        _add_worker_parts(session)
        return
    path = os.environ.get("FASTAMP_ARGCOV_SAVE")
    if not path:
        return
    if os.path.exists(path):
        os.remove(path)  # a stale file from another run must not stand in for this one
    if _whole_quick_tier(config, exitstatus):
        _argcov.save(path, [i.nodeid for i in session.items])
