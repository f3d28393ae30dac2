"""The ranks of :class:`accel_fp8_fix.testing.pool.RankPool`.

``python -m accel_fp8_fix.testing._pool_worker HOST:PORT RANK TOKEN MODULE,MODULE,...``: one rank — connect,
import, then run tasks until told to stop. A task that fails is reported and the rank leaves (the pool is rebuilt).

``python -m accel_fp8_fix.testing._pool_worker --fork HOST:PORT WORLD_SIZE TOKEN MODULE,... LOG_DIR``: the pool's
start-up interpreter — imports the modules once, then forks the ``WORLD_SIZE`` ranks (each writes to
``LOG_DIR/rank{R}.log``), reaps them and writes each one's exit status to ``LOG_DIR/rank{R}.exit``.
"""

import faulthandler
import gc
import importlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from accel_fp8_fix.testing import isolation, shared


def main(address: str, rank: str, token: str, preload: str, imported_s: float = 0.0) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack, to the log
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send({"token": token, "rank": int(rank), "pid": os.getpid()})
    try:
        started = time.perf_counter()
        for name in filter(None, preload.split(",")):
            importlib.import_module(name)
        from accel_fp8_fix.diagnostics import collective_order

        collective_order.install_hook()  # the audit's init_process_group wrapper belongs to the baseline
        baseline = isolation.Baseline.capture()
        # The start-up heap (torch, transformers, TE: millions of objects) is never garbage: out of the collector's
        # sight, every full collection (the reset's after each run, the automatic ones during it) scans only what
        # runs made — the reset's gc.collect() was ~2 % of a 4-rank file's rank time.
        gc.freeze()
        conn.send({"ready": True, "import_s": imported_s + time.perf_counter() - started})
    except BaseException:  # noqa: BLE001  (reported to the pool, which fails its start with this text)
        traceback.print_exc()
        conn.send({"ready": False, "error": traceback.format_exc(limit=8)})
        return
    while True:
        task = conn.recv()
        if task is None:
            break
        reply = _run(task, int(rank), baseline)
        conn.send(reply)
        if not reply["ok"] or reply.get("left_behind"):
            _leave()
    conn.close()


def _run(task: dict, rank: int, baseline: "isolation.Baseline") -> dict:
    started, cpu_started = time.time(), time.process_time()
    os.environ.update(task["env"])
    os.environ["MASTER_PORT"] = str(task["port"])
    for path in reversed(task["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    faulthandler.dump_traceback_later(max(task["timeout"] - 5, 1), exit=False)
    # A hang is often a divergence: write what was recorded shortly before the pool kills this rank.
    watchdog = threading.Timer(max(task["timeout"] - 3, 0.5), _write_audit, args=(task, True))
    watchdog.daemon = True
    watchdog.start()
    try:
        fn = importlib.import_module(task["module"])
        for part in task["qualname"].split("."):
            fn = getattr(fn, part)
        if task["audit_dir"]:
            from accel_fp8_fix.diagnostics import collective_order

            collective_order.install(task["audit_dir"])
        if task["init_process_group"]:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timedelta(seconds=task["collective_timeout"]))
        with shared.during_run(task["run_dir"]):
            result = pickle.dumps(fn(rank, int(os.environ["WORLD_SIZE"]), *task["args"]))
        ran = time.time()
        _end_run(task)
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        watchdog.cancel()
        _write_audit(task, failed=True)
        faulthandler.cancel_dump_traceback_later()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    watchdog.cancel()
    watchdog.join()
    faulthandler.cancel_dump_traceback_later()
    left = baseline.restore(task["module"])
    timing = {"run_s": ran - started, "reset_s": time.time() - ran, "cpu_s": time.process_time() - cpu_started,
              "os_threads": _os_threads()}
    return {"ok": True, "result": result, "left_behind": left, "timing": timing}


def _end_run(task: dict) -> None:
    """Write the audit and stop recording (the flight-recorder trail reads nothing more at the destroy), then leave
    the run's groups together: no rank destroys a group a peer still uses."""
    _write_audit(task)
    if task["audit_dir"]:
        from accel_fp8_fix.diagnostics import collective_order

        collective_order.stop()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _os_threads() -> int:
    """This process's OS threads (native ones too: gloo's), 0 where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _write_audit(task: dict, failed: bool = False) -> None:
    if task["audit_dir"]:
        from ..diagnostics import collective_order

        collective_order.write_now(failed=failed)  # nothing when it never recorded


def _leave() -> None:
    """After a failed run: go without interpreter teardown (peers may be gone or stuck with this rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def fork_ranks(address: str, world_size: str, token: str, preload: str, log_dir: str) -> None:
    """Import ``preload`` once, then fork the ranks: each starts from this interpreter's state (nothing has run
    yet: no thread besides this one, no process group, no device) and goes on as :func:`main`. Every rank of a
    pool otherwise paid the same ~4 s of imports on the same two cores."""
    started = time.perf_counter()
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    from accel_fp8_fix.diagnostics import collective_order  # noqa: F401  (imported by every rank's start)

    imported_s = time.perf_counter() - started
    threads = _os_threads()
    if threads > 1:  # a thread would not exist in the forked ranks, and whatever lock it held stays held there
        raise RuntimeError(f"the pool's start-up interpreter holds {threads} OS threads after importing {preload}: "
                           "its ranks cannot be forked (ACCEL_FP8_FIX_TEST_POOL_FORK=0 starts each rank anew)")
    gc.collect()
    gc.freeze()  # the imports' objects stay shared with the ranks: no collection writes to their pages
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(int(world_size)):
        pid = os.fork()
        if pid == 0:
            log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            _seed_as_a_new_process()
            main(address, str(rank), token, preload, imported_s)
            return  # the rank's interpreter ends as a started one's does
        ranks[pid] = rank
    while ranks:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # pragma: no cover - every rank already reaped
            break
        rank = ranks.pop(pid, None)
        if rank is not None:
            with open(os.path.join(log_dir, f"rank{rank}.exit.tmp"), "w") as fh:
                fh.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(os.path.join(log_dir, f"rank{rank}.exit.tmp"), os.path.join(log_dir, f"rank{rank}.exit"))


_TORCH_DEFAULT_SEED = 67280421310721  # a new process's default generator before torch 2.13 seeded it at random


def _seed_as_a_new_process() -> None:
    """A forked rank's generators as a started interpreter's would be: its own (Python's ``random`` reseeds itself
    at fork), not a copy of the start-up interpreter's shared by every rank."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.initial_seed() != _TORCH_DEFAULT_SEED:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    if sys.argv[1] == "--fork":
        fork_ranks(*sys.argv[2:7])
    else:
        main(*sys.argv[1:5])
