"""Long-lived gloo rank pools: many runs, one interpreter start-up per rank.

    from accel_fp8_fix.testing.pool import RankPool

    with RankPool(4, env={...}) as pool:
        results = pool.run(check_fn, args=(...), timeout=120)     # as run_distributed(check_fn, 4, ...)
        more = pool.run(other_fn)                                 # the same four interpreters

The contract of :func:`accel_fp8_fix.testing.run_distributed` — results in rank order, a
:class:`DistributedTestError` carrying every rank's report when a rank fails or the run outlives ``timeout``, a
collective-order audit of every run — with ranks that stay alive between runs: torch, accelerate, transformers and
Transformer Engine are imported once per rank instead of once per run. ``run_distributed`` stays what it promises
(fresh interpreters); a pool is for a test suite that launches the same kind of job many times.

Each run gets a fresh rendezvous port and, unless ``init_process_group=False``, a fresh default group; whatever
groups the run made are destroyed after it. Between runs every rank puts itself back where it started
(:mod:`accel_fp8_fix.testing.isolation`: environment, accelerate's singletons, the patch set undone and
re-applied, Transformer Engine's global FP8 state, the rehearsal's counters and target, dynamo's caches, the
package's once-per-process caches, RNG, warnings, logging) and checks what it cannot restore (functions
monkeypatched and left so, threads left running). A run that raises, hangs or leaves state behind fails with
every rank's report, and the pool is rebuilt (new interpreters) before its next run.

The ranks are forked from one start-up interpreter that imports ``preload`` once (``fork=True``, default
``ACCEL_FP8_FIX_TEST_POOL_FORK``; docs/testing.md says what differs from started ranks: the string-hash seed is
shared); ``fork=False`` starts every rank anew.

What a pool cannot give — an interpreter's start-up and exit (the ``.pth`` activation, exit status and teardown,
version refusal, ``accelerate launch`` itself) — needs fresh interpreters: ``run_distributed``.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from .. import settings
from . import DistributedTestError, _collective_divergences, _divergence_error, _importable, _tail, free_port

__all__ = ["RankPool"]

# A rank that failed gets this long to report before its peers (stuck in a collective with it) are killed.
_FAILURE_GRACE_S = 10.0

PRELOAD = ("torch", "torch.distributed", "accelerate", "transformers")  # the suite's pools (tests/support/launcher.py)
PRELOAD_TE = ("transformer_engine.pytorch",)  # with the rehearsal: TE's Python over the CPU shim


def preload_for(env: dict) -> tuple:
    """What a pool of ranks started with ``env`` imports before its baseline (and so what its first run finds
    imported): torch, accelerate, transformers, and TE's Python where ``env`` turns the rehearsal on."""
    rehearsal = env.get("ACCEL_FP8_FIX_REHEARSAL", "0") not in ("", "0")
    return PRELOAD + (PRELOAD_TE if rehearsal else ())


class RankPool:
    """``world_size`` interpreters started with ``env`` added to the environment (start-up variables such as the
    ``.pth`` activation flags belong here: they act once, when the interpreter starts). ``preload``: modules each
    rank imports before its first run (their import time is paid at start, and the isolation baseline includes
    them). ``start_timeout``: seconds for the ranks to start and import ``preload``. ``max_threads``: a run after
    which a rank holds more OS threads than this closes the pool (its results still count) and the next run starts
    new ranks: gloo groups that something still references (a DeviceMesh, FSDP2's state) keep their three
    threads each after ``destroy_process_group``, and a 4-rank pool that served a few hundred groups spent its
    cores waking ~800 idle threads a rank (default ``ACCEL_FP8_FIX_TEST_POOL_MAX_THREADS`` or 200)."""

    def __init__(self, world_size: int, env: dict | None = None, preload: tuple = (), start_timeout: float = 300.0,
                 max_threads: int | None = None, fork: bool | None = None):
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be >= 1, got {world_size}")
        self.world_size, self.env, self.preload = world_size, dict(env or {}), tuple(preload)
        # one start-up interpreter imports ``preload`` and forks the ranks (default ACCEL_FP8_FIX_TEST_POOL_FORK)
        self.fork = settings.get("ACCEL_FP8_FIX_TEST_POOL_FORK") is not False if fork is None else fork
        self.start_timeout = start_timeout
        self.max_threads = max_threads or settings.get("ACCEL_FP8_FIX_TEST_POOL_MAX_THREADS") or 200
        self.recycles = 0  # closes after a run that left a rank with more than max_threads OS threads
        self.starts = 0  # how many times the ranks were (re)started: 1 for a pool that never failed
        self.runs = 0
        self.start_seconds = 0.0  # wall seconds spent starting ranks, all starts together
        self._procs: list = []
        self._zygote: subprocess.Popen | None = None  # the start-up interpreter that forked the ranks
        self._conns: list[Connection] = []
        self._logs: list = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._last_start_s, self._import_s = 0.0, []

    # -- life cycle ---------------------------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def close(self) -> None:
        """Stop the ranks (asked to leave, killed after 10 s)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._zygote is not None:  # it leaves once it has reaped every rank
            try:
                self._zygote.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None
        for conn in self._conns:
            conn.close()
        for log in self._logs:
            log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._procs, self._conns, self._logs, self._tmp = [], [], [], None

    def _start(self) -> None:
        started = time.monotonic()
        self._tmp = tempfile.TemporaryDirectory(prefix="accel_fp8_fix_pool_")
        token = secrets.token_hex(16)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(self.world_size)
            server.settimeout(1.0)
            address = f"127.0.0.1:{server.getsockname()[1]}"
            if self.fork:
                self._zygote = self._spawn_forking(address, token)
            else:
                for rank in range(self.world_size):
                    self._procs.append(self._spawn(rank, address, token))
            self._conns = self._accept(server, token, started)
        self._await_ready(started)
        self.starts += 1
        self._last_start_s = time.monotonic() - started
        self.start_seconds += self._last_start_s

    def _environ(self, rank: int | None) -> dict:
        environ = {**os.environ, **self.env}
        environ.update(WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.world_size),
                       MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=environ.get("OMP_NUM_THREADS", "1"),
                       PYTHONUNBUFFERED="1")
        if rank is not None:
            environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
        # the collective-order audit reads c10d's flight recorder (on from start-up) instead of seeing every op
        environ.setdefault(settings.FLIGHT_RECORDER, str(settings.FLIGHT_RECORDER_ENTRIES))
        return environ

    def _spawn(self, rank: int, address: str, token: str):
        log = open(Path(self._tmp.name) / f"rank{rank}.log", "w+")
        self._logs.append(log)
        # The token (a rank proves it was started by this pool) and the modules to import, as arguments.
        command = [sys.executable, "-m", "accel_fp8_fix.testing._pool_worker", address, str(rank), token,
                   ",".join(self.preload)]
        return subprocess.Popen(command, env=self._environ(rank), stdout=log, stderr=subprocess.STDOUT)

    def _spawn_forking(self, address: str, token: str):
        """The start-up interpreter: imports ``preload`` once and forks the ranks (_pool_worker.fork_ranks); each
        rank writes to its own log, as a started one does, and its hello carries its pid."""
        self._logs = [open(Path(self._tmp.name) / f"rank{rank}.log", "w+") for rank in range(self.world_size)]
        log = open(Path(self._tmp.name) / "start-up.log", "w+")
        self._logs.append(log)  # read by _fail_start after the ranks' logs
        command = [sys.executable, "-m", "accel_fp8_fix.testing._pool_worker", "--fork", address,
                   str(self.world_size), token, ",".join(self.preload), self._tmp.name]
        return subprocess.Popen(command, env=self._environ(None), stdout=log, stderr=subprocess.STDOUT)

    def _accept(self, server: socket.socket, token: str, started: float) -> list[Connection]:
        conns: dict[int, Connection] = {}
        forked: dict[int, _ForkedRank] = {}
        while len(conns) < self.world_size:
            self._check_start(started, "connect")
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            if not conn.poll(30):
                conn.close()
                continue
            hello = conn.recv()
            if not isinstance(hello, dict) or hello.get("token") != token:
                conn.close()  # not one of ours
                continue
            conns[hello["rank"]] = conn
            if self._zygote is not None:
                forked[hello["rank"]] = _ForkedRank(hello["pid"], Path(self._tmp.name) / f"rank{hello['rank']}.exit")
                self._procs = [forked[rank] for rank in sorted(forked)]  # all of them once every rank said hello
        return [conns[rank] for rank in range(self.world_size)]

    def _await_ready(self, started: float) -> None:
        pending = set(range(self.world_size))
        self._import_s = [0.0] * self.world_size
        while pending:
            self._check_start(started, "import " + (", ".join(self.preload) or "the test bed"))
            for conn in wait([self._conns[r] for r in pending], timeout=1.0):
                rank = self._conns.index(conn)
                message = conn.recv()
                if message.get("ready"):
                    pending.discard(rank)
                    self._import_s[rank] = message["import_s"]
                else:
                    self._fail_start(f"rank {rank} could not start: {message.get('error')}")

    def _check_start(self, started: float, stage: str) -> None:
        dead = [r for r, p in enumerate(self._procs) if p.poll() is not None]
        if dead:
            self._fail_start(f"rank(s) {dead} exited while the pool was starting ({stage})")
        if self._zygote is not None and self._zygote.poll() is not None:
            self._fail_start(f"the start-up interpreter exited ({self._zygote.returncode}) while the pool was "
                             f"starting ({stage})")
        if time.monotonic() - started > self.start_timeout:
            self._fail_start(f"the ranks did not {stage} within {self.start_timeout:.0f}s")

    def _fail_start(self, why: str) -> None:
        names = [f"rank {r}" for r in range(self.world_size)] + ["start-up interpreter"]
        reports = [f"--- {names[r]} ---\n{_tail(self._read_log(r, 0))}" for r in range(len(self._logs))]
        self._kill()
        raise DistributedTestError(f"RankPool({self.world_size}) failed to start: {why}\n" + "\n".join(reports))

    def _read_log(self, rank: int, offset: int) -> str:
        log = self._logs[rank]
        log.flush()
        log.seek(offset)
        text = log.read()
        log.seek(0, os.SEEK_END)
        return text

    # -- runs -----------------------------------------------------------------------------------------------
    def run(self, fn, *, args: tuple = (), env: dict | None = None, timeout: float = 120.0,
            collective_timeout: float = 60.0, init_process_group: bool = True, sys_path: list | None = None,
            audit_collectives: bool = True) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank of the pool; the results by rank. Arguments as for
        :func:`run_distributed`; ``env`` is added for this run only. The pool's start-up (its first run, or the one
        after a failure) does not count against ``timeout``."""
        start_s = 0.0
        if not self.alive:
            if self._procs:
                self._kill()
            self._start()
            start_s = self._last_start_s
        module, paths = _importable(fn, sys_path)
        what = f"{fn.__qualname__} on {self.world_size} pooled ranks"
        with tempfile.TemporaryDirectory(prefix="accel_fp8_fix_run_") as tmp:
            task = {"module": module, "qualname": fn.__qualname__, "args": args, "sys_path": paths,
                    "env": dict(env or {}), "port": free_port(), "init_process_group": init_process_group,
                    "collective_timeout": collective_timeout, "timeout": timeout,
                    "audit_dir": str(Path(tmp) / "collectives") if audit_collectives else None,
                    "run_dir": str(Path(tmp) / "shared")}  # testing.shared: what one rank computes for all
            (Path(tmp) / "shared").mkdir()
            offsets = [log.seek(0, os.SEEK_END) for log in self._logs]
            started = time.time()
            for conn in self._conns:
                conn.send(task)
            replies, timed_out = self._replies(timeout)
            self.runs += 1
            try:
                return self._results(replies, offsets, what, timeout, timed_out, Path(tmp), audit_collectives)
            finally:
                _profile_pooled(f"{module}.{fn.__qualname__}", self.world_size, started, replies, start_s,
                                self._import_s, self.env)

    def _replies(self, timeout: float) -> tuple[dict, bool]:
        """{rank: reply} of the ranks that answered; True when the deadline passed first."""
        deadline = time.monotonic() + timeout
        replies: dict[int, dict] = {}
        failed_at = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                return replies, True
            if failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
                return replies, False
            waiting = [c for r, c in enumerate(self._conns) if r not in replies]
            for conn in wait(waiting, timeout=0.2):
                rank = self._conns.index(conn)
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    replies[rank] = {"ok": False, "error": f"the rank died (exit {_exit_status(self._procs[rank])})"}
                if not replies[rank].get("ok") and failed_at is None:
                    failed_at = time.monotonic()
        return replies, False

    def _results(self, replies, offsets, what, timeout, timed_out, tmp: Path, audit_collectives) -> list:
        reports, results = [], []
        for rank in range(self.world_size):
            reply = replies.get(rank)
            if reply is not None and reply.get("ok") and not reply.get("left_behind"):
                results.append(pickle.loads(reply["result"]))
                continue
            if reply is None:
                status = "killed (still running at the deadline)" if timed_out else "killed (a peer failed)"
            elif reply.get("left_behind"):
                status = "left state behind: " + "; ".join(reply["left_behind"])
            else:
                status = reply.get("error", "failed")
            reports.append(f"--- rank {rank}: {status} ---\n{_tail(self._read_log(rank, offsets[rank]))}")
        divergences = _collective_divergences(tmp, self.world_size) if audit_collectives else []
        if reports:
            self._kill()  # rebuilt before the next run: nothing a failed run left can reach it
            head = f"{what} " + (f"timed out after {timeout:.0f}s" if timed_out else "failed")
            if divergences:
                reports.append("collective order (as far as the ranks recorded it):\n  " + "\n  ".join(divergences))
            raise DistributedTestError(head + "\n" + "\n".join(reports), divergences)
        if divergences:
            raise _divergence_error(what, divergences, results)
        threads = max((reply.get("timing") or {}).get("os_threads", 0) for reply in replies.values())
        if threads > self.max_threads:
            self.close()  # the next run starts new ranks
            self.recycles += 1
        return results


def _exit_status(proc) -> int | None:
    """The exit status of a rank whose connection just closed (it may take a moment to be reaped)."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


class _ForkedRank:
    """A rank forked by the pool's start-up interpreter, as the pool sees it: not this process's child, so it is
    watched by pid and its exit status read from the file the start-up interpreter writes when it reaps it
    (``subprocess.Popen``'s poll / wait / kill, for what the pool uses)."""

    def __init__(self, pid: int, exit_file: Path):
        self.pid, self._exit_file, self.returncode = pid, exit_file, None

    def _reaped(self) -> int | None:
        try:
            return int(self._exit_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._reaped()
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:  # gone: its status is on the way (or the start-up interpreter died)
                time.sleep(0.2)
                self.returncode = self._reaped()
                if self.returncode is None:
                    self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pooled rank (pid {self.pid})", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def _profile_pooled(what: str, world_size: int, started: float, replies: dict, start_s: float,
                    import_s: list, pool_env: dict) -> None:
    """With ACCEL_FP8_FIX_TEST_PROFILE=FILE: one JSON line per pooled run (scripts/suite_profile.py); a run that
    (re)started the pool carries the start's wall seconds and each rank's import seconds."""
    out = os.environ.get("ACCEL_FP8_FIX_TEST_PROFILE")
    if not out:
        return
    import json

    ranks = [replies.get(rank, {}).get("timing") for rank in range(world_size)]
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what, "world_size": world_size,
            "started": started, "ended": time.time(), "ranks": ranks, "pooled": True,
            "pool_start_s": start_s, "pool_import_s": import_s if start_s else None, "pool_env": pool_env}
    with open(out, "a") as fh:
        fh.write(json.dumps(line) + "\n")
