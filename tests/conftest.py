"""Test layers: ``tests/unit`` (one process, no network, seconds; the rehearsal's own in ``tests/rehearsal``, the test
bed's in ``tests/testbed``), ``tests/distributed`` (several gloo ranks,
the launcher, the demo), ``tests/network`` (installs other releases / builds wheels from the package
registry: skipped without it, failed under ``CI=true``), ``tests/gpu`` (real TE, CUDA only).

The scenarios the layers share are the package ``tests/support`` (``from support import scenarios``), on
pytest's ``pythonpath`` (pyproject.toml). Processes the tests start import them too: ``run_distributed`` workers
find them from the scenario's module name; scripts under ``accelerate launch`` / torchrun through PYTHONPATH,
set here once for every child process.
"""

import os
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
# Bytecode caches for this package and the tests (git ignores __pycache__): with PYTHONDONTWRITEBYTECODE set
# (this machine image sets it) every rank, launcher and subprocess of the suite compiled their sources again at
# each start, and pytest rewrote the test modules' assertions in every session.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_configure(config):
    config.addinivalue_line("markers", "run_last: runs after every other test of the session (pool agreement)")


def pytest_collection_modifyitems(session, config, items):
    """``run_last`` tests go to the end: they compare what the session's other tests launched."""
    items[:] = [i for i in items if i.get_closest_marker("run_last") is None] + \
               [i for i in items if i.get_closest_marker("run_last") is not None]


@pytest.fixture(scope="module")
def ckpt_dir(request, tmp_path_factory):
    """A checkpoint folder shared by the tests of one module (a launch writes, later tests read)."""
    return str(tmp_path_factory.mktemp(f"ckpt-{request.module.__name__.rsplit('.', 1)[-1]}"))


def pytest_sessionfinish(session, exitstatus):
    """The rank pools the session started (tests/support/launcher.py) are closed with it."""
    from support import launcher

    session.config._accel_fp8_fix_pools = launcher.close_all()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    summary = getattr(config, "_accel_fp8_fix_pools", None)
    if summary and summary["runs"]:
        terminalreporter.write_line(
            f"rank pools: {summary['runs']} launches ({summary['fresh']} in fresh interpreters), {summary['pools']} "
            f"pools, {summary['starts']} starts, {summary['start_s']:.0f} s starting ranks")


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """``one_rank(module, scenario, **kwargs)``: facts of a scenario of the ONE one-rank launch the test files share
    (tests/support/one_rank.py; launched at the first call); ``one_rank.path(name)``: a folder of its plan."""
    from support.one_rank import OneRank

    return OneRank(str(tmp_path_factory.mktemp("one_rank")))
