"""One rank of :func:`accel_fp8_fix.testing.run_distributed` (``python -m accel_fp8_fix.testing._worker DIR RANK``)."""

import faulthandler
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from accel_fp8_fix.testing import shared


def main(tmp: str, rank: str) -> None:
    t_main = time.time()
    imports = _import_timer() if os.environ.get("ACCEL_FP8_FIX_TEST_PROFILE") else None
    tmp_dir = Path(tmp)
    payload = pickle.loads((tmp_dir / "payload.pkl").read_bytes())
    for path in reversed(payload["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    fn = importlib.import_module(payload["module"])
    for part in payload["qualname"].split("."):
        fn = getattr(fn, part)
    world_size = int(os.environ["WORLD_SIZE"])
    # Shortly before the launcher kills a hung run, print where this rank waits.
    faulthandler.dump_traceback_later(max(payload["timeout"] - 5, 1), exit=False)

    import torch.distributed as dist

    audit = None
    if payload.get("audit_collectives"):
        from accel_fp8_fix.diagnostics import collective_order as audit

        audit.install(tmp_dir / "collectives")  # records from init_process_group on
        # A hang is often a divergence: write what was recorded shortly before the launcher kills this rank.
        left = payload.get("deadline", time.time() + payload["timeout"]) - time.time()
        watchdog = threading.Timer(max(left - 3, 0.5), audit.write_now, kwargs={"failed": True})
        watchdog.daemon = True
        watchdog.start()
    if payload["init_process_group"]:
        dist.init_process_group(
            "gloo",
            rank=int(rank),
            world_size=world_size,
            timeout=timedelta(seconds=payload["collective_timeout"]),
        )
    t_fn = time.time()
    imported_before_fn = imports[0] if imports else None
    try:
        with shared.during_run(payload.get("run_dir")):
            result = fn(int(rank), world_size, *payload["args"])
    except BaseException:
        # Report first and leave at once, without destroy_process_group() or interpreter teardown: with peers
        # gone (or stuck in a collective with this rank) either can block until the collective timeout.
        traceback.print_exc()
        if audit is not None:
            audit.write_now(failed=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if audit is not None:
        watchdog.cancel()
        audit.write_now()
    t_done = time.time()
    (tmp_dir / f"rank{rank}.result").write_bytes(pickle.dumps(result))
    if imports is not None:
        import resource
        (tmp_dir / f"rank{rank}.timing").write_bytes(pickle.dumps({
            "main": t_main, "fn": t_fn, "done": t_done, "import_s": imports[0],
            "import_before_fn_s": imported_before_fn,
            "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime}))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank leaves while a peer may still be inside a collective with it
        # Destroy the group before interpreter teardown, as a plain torch script does: a gloo group left alive
        # races Py_FinalizeEx (its worker threads take the GIL while the interpreter finalizes: "terminate
        # called without an active exception", SIGABRT, a finished rank fails; A20, fixes/start/clean_exit.py).
        dist.destroy_process_group()


def _import_timer() -> list:
    """Seconds spent in outermost imports of modules not yet loaded (profiling only): [total]."""
    import builtins

    total, depth, original = [0.0], [0], builtins.__import__

    def timed(name, globals=None, locals=None, fromlist=(), level=0):
        if depth[0] or level or name in sys.modules:
            return original(name, globals, locals, fromlist, level)
        depth[0] += 1
        start = time.perf_counter()
        try:
            return original(name, globals, locals, fromlist, level)
        finally:
            depth[0] -= 1
            total[0] += time.perf_counter() - start

    builtins.__import__ = timed
    return total


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
