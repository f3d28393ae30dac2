"""Multi-process CPU test bed: run one function on N gloo ranks, each in a fresh interpreter.

    from accel_fp8_fix.testing import run_distributed
    results = run_distributed(check_fn, world_size=4, args=(...), timeout=120)

``check_fn(rank, world_size, *args)`` must be importable by module name (a module-level function of a
test module or package). Each rank runs it in a new ``python`` process with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set and (unless ``init_process_group=False``) the
default process group initialised on gloo with ``collective_timeout``. The return values come back in
rank order. Any rank failing, or the whole run outliving ``timeout``, raises
:class:`DistributedTestError` carrying every rank's traceback / output tail; all ranks are killed, so a
stuck collective cannot eat a CI budget.

Every run is a collective-order audit too (``audit_collectives=True``, the default): each rank records the
collectives it issues (``accel_fp8_fix.diagnostics.collective_order``) and a run whose ranks disagree — a group's
members issuing different collectives, sizes or orders, which gloo completes and NCCL hangs on — raises
:class:`DistributedTestError` naming the first divergent collective and the ranks.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import settings

__all__ = ["run_distributed", "DistributedTestError", "free_port"]

HOOK_PROBLEM = "inside FSDP2's all-gather extension hooks"  # collective_order.inside_extension_hooks's words


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung, or their collectives diverged; the message holds every rank's report.
    ``divergences``: what the collective-order audit found; ``results``: the ranks' return values when every rank
    finished (a divergence alone)."""

    def __init__(self, message: str, divergences: list | None = None, results: list | None = None):
        super().__init__(message)
        self.divergences = divergences or []
        self.results = results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_divergences(tmp: Path, world_size: int) -> list[str]:
    from ..diagnostics.collective_order import check, load_dir

    runs = load_dir(tmp / "collectives")
    sequences = {rank: seq for run in runs.values() for rank, seq in run["sequences"].items()}
    if len(sequences) < world_size:
        return []  # a rank recorded nothing (failed before recording): its own error is the report
    return check(sequences)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_distributed(
    fn,
    world_size: int,
    *,
    args: tuple = (),
    env: dict | None = None,
    rank_env: dict | None = None,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    init_process_group: bool = True,
    sys_path: list | None = None,
    audit_collectives: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU processes; return the results by rank.

    ``env`` is added to every rank's environment, ``rank_env`` maps a rank to extra variables for it.
    ``sys_path`` entries are prepended to the workers' ``sys.path`` (the caller's module directory is
    added automatically so test modules are importable). ``audit_collectives=False`` skips the
    collective-order audit (for a function that diverges on purpose).
    """
    module, paths = _importable(fn, sys_path)
    with tempfile.TemporaryDirectory(prefix="accel_fp8_fix_dist_") as tmp:
        tmp = Path(tmp)
        payload = {
            "module": module,
            "qualname": fn.__qualname__,
            "args": args,
            "sys_path": paths,
            "init_process_group": init_process_group,
            "collective_timeout": collective_timeout,
            "timeout": timeout,
            "audit_collectives": audit_collectives,
            "deadline": time.time() + timeout,  # wall clock: the ranks' imports take part of the timeout
            "run_dir": str(tmp / "shared"),  # testing.shared: what one rank computes for all
        }
        (tmp / "shared").mkdir()
        (tmp / "payload.pkl").write_bytes(pickle.dumps(payload))
        started = time.time()
        procs = _start_ranks(tmp, world_size, env, rank_env)
        timed_out = _wait(procs, timeout)
        try:
            return _collect(procs, tmp, fn.__qualname__, world_size, timeout, timed_out, audit_collectives)
        finally:
            _profile(tmp, f"{module}.{fn.__qualname__}", world_size, started)


def _profile(tmp: Path, what: str, world_size: int, started: float) -> None:
    """With ACCEL_FP8_FIX_TEST_PROFILE=FILE: one JSON line per launch (scripts/suite_profile.py reads them)."""
    out = os.environ.get("ACCEL_FP8_FIX_TEST_PROFILE")
    if not out:
        return
    import json

    ranks = []
    for rank in range(world_size):
        timing = tmp / f"rank{rank}.timing"
        ranks.append(pickle.loads(timing.read_bytes()) if timing.exists() else None)
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what, "world_size": world_size,
            "started": started, "ended": time.time(), "ranks": ranks, "pooled": False}
    with open(out, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def _importable(fn, sys_path) -> tuple[str, list]:
    """(module name the workers import ``fn`` from, sys.path entries that make it importable)."""
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or module == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ValueError(f"run_distributed needs a module-level function, got {module}.{qualname}")
    paths = list(sys_path or [])
    mod_file = getattr(sys.modules.get(module), "__file__", None)
    if mod_file:
        # Directory from which `module` is importable by its dotted name.
        root = Path(mod_file).resolve().parent
        for _ in range(module.count(".")):
            root = root.parent
        paths.append(str(root))
        if module == "__main__":
            module = Path(mod_file).stem
    return module, paths


def _start_ranks(tmp: Path, world_size: int, env, rank_env) -> list:
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_environ = {**os.environ, **(env or {}), **(rank_env or {}).get(rank, {})}
        rank_environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=rank_environ.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        # the collective-order audit reads c10d's flight recorder (on from start-up) instead of seeing every op
        rank_environ.setdefault(settings.FLIGHT_RECORDER, str(settings.FLIGHT_RECORDER_ENTRIES))
        log = open(tmp / f"rank{rank}.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "accel_fp8_fix.testing._worker", str(tmp), str(rank)],
                                env=rank_environ, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    return procs


def _wait(procs: list, timeout: float) -> bool:
    """Wait for every rank; once one has failed, give the others 10 s to report their own error. Every rank
    still running at the end is killed. True when the deadline passed."""
    deadline = time.monotonic() + timeout
    timed_out = False
    first_failure_at = None
    while True:
        codes = [p.poll() for p, _ in procs]
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes) and first_failure_at is None:
            first_failure_at = time.monotonic()
        if first_failure_at is not None and time.monotonic() - first_failure_at > 10:
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return timed_out


def _collect(procs, tmp: Path, qualname: str, world_size: int, timeout: float, timed_out: bool,
             audit_collectives: bool) -> list:
    """The ranks' results in rank order, or DistributedTestError with every failed rank's output tail."""
    reports, results, failed = [], [], False
    for rank, (p, log) in enumerate(procs):
        log.seek(0)
        output = log.read()
        log.close()
        result_file = tmp / f"rank{rank}.result"
        if p.returncode == 0 and result_file.exists():
            results.append(pickle.loads(result_file.read_bytes()))
            continue
        failed = True
        status = "killed (still running at the deadline)" if p.returncode in (-9,) else f"exit {p.returncode}"
        reports.append(f"--- rank {rank}: {status} ---\n{_tail(output)}")
    divergences = _collective_divergences(tmp, world_size) if audit_collectives else []
    if failed or timed_out:
        head = f"{qualname} on {world_size} ranks " + (f"timed out after {timeout:.0f}s" if timed_out else "failed")
        if divergences:  # a hang is often the divergence itself: name it
            reports.append("collective order (as far as the ranks recorded it):\n  " + "\n  ".join(divergences))
        raise DistributedTestError(head + "\n" + "\n".join(reports), divergences)
    if divergences:
        raise _divergence_error(f"{qualname} on {world_size} ranks", divergences, results)
    return results


def _divergence_error(who: str, divergences: list, results) -> DistributedTestError:
    """A run that completed though its collectives diverged (or ran inside FSDP2's all-gather hooks)."""
    what = ("the ranks' collectives diverge" if any(HOOK_PROBLEM not in d for d in divergences)
            else "collectives were issued inside FSDP2's all-gather extension hooks")
    return DistributedTestError(f"{who}: {what} (gloo completed the run; NCCL would hang or corrupt it):\n  "
                                + "\n  ".join(divergences), divergences, results)
