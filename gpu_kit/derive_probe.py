"""Derive the rank probe's ops from what the rank jobs really issue: ``python -m gpu_kit.derive_probe [--jobs a,b]``.

Each job of ``rank_jobs.JOBS`` runs on CPU processes (``accelerate launch`` of ``ranks_job.py`` with
``GPU_KIT_RANKS_DEVICE=cpu``: plain gloo, ``use_cpu: true``, TE's Python over the CPU rehearsal) with the
collective-order audit on, recorded at the dispatcher (the flight recorder does not name reduce ops); the audit
files are reduced to the distinct collectives the job issues (kind, dtype, reduce op, uneven all-to-all splits, the
API form) and written to ``gpu_kit/probe_ops.json`` (``probe_ops.py`` reads it; ``ranks_probe.py`` tries exactly
its ops). ``--jobs`` rederives those jobs and keeps the others' entries. One job at a time, each under the test
lock (``$ACCEL_FP8_FIX_TEST_LOCK``, default ``/tmp/accel_fp8_fix.mp.lock``; ``0``: none) and a timeout.

What a CPU run cannot show: code paths that only run on CUDA (streams, CUDA-only kernels choosing another dtype).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_kit import probe_ops, rank_jobs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "gpu_kit" / "ranks_job.py"
LOCK = os.environ.get("ACCEL_FP8_FIX_TEST_LOCK", "/tmp/accel_fp8_fix.mp.lock")
STEPS = 2  # the second step runs what the first only set up (FP8 state, amax reductions)
TIMEOUT_S = 900

# dispatcher op base name -> (form, probe-able variant); the kind comes from the audit
FORMS = {
    "allreduce_": "tensor", "all_reduce": "tensor", "all_reduce_": "tensor",
    "allreduce_coalesced_": "coalesced", "all_reduce_coalesced": "coalesced", "all_reduce_coalesced_": "coalesced",
    "broadcast_": "tensor", "broadcast": "tensor", "reduce_": "tensor",
    "allgather_": "list", "allgather_coalesced_": "coalesced", "allgather_into_tensor_coalesced_": "coalesced",
    "_allgather_base_": "tensor", "all_gather_into_tensor": "tensor", "all_gather_into_tensor_out": "tensor",
    "all_gather_into_tensor_coalesced": "coalesced",
    "reduce_scatter_": "list", "_reduce_scatter_base_": "tensor", "reduce_scatter_tensor_coalesced_": "coalesced",
    "reduce_scatter_tensor": "tensor", "reduce_scatter_tensor_coalesced": "coalesced",
    "alltoall_": "list", "alltoall_base_": "tensor", "all_to_all_single": "tensor",
    "gather_": "list", "scatter_": "list", "barrier": "tensor", "monitored_barrier_": "tensor",
}
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def op_name(spec: dict) -> str:
    parts = [spec["kind"]]
    if spec.get("dtype"):
        parts.append(spec["dtype"])
    if spec["kind"] in REDUCING:
        parts.append(spec.get("reduce_op") or "unknown")
    if spec.get("uneven"):
        parts.append("uneven")
    if spec.get("form", "tensor") != "tensor":
        parts.append(spec["form"])
    if spec.get("api") == "functional":
        parts.append("functional")
    return ".".join(parts)


def reduce_run(sequences: dict) -> dict:
    """``{op_name: spec}`` of one launched run (``{rank: [Collective]}``): the distinct collectives, an all-to-all
    uneven where any rank's splits of that call (the n-th all-to-all on its group) are."""
    uneven_calls: set = set()
    for rank, records in sequences.items():
        count: dict = {}
        for r in records:
            if r.kind == "all_to_all":
                index = count[r.communicator] = count.get(r.communicator, -1) + 1
                if r.splits and len(set(r.splits)) > 1:
                    uneven_calls.add((r.communicator, index))
    ops: dict = {}
    for rank, records in sorted(sequences.items()):
        count = {}
        for r in records:
            namespace, _, base = r.op.partition(".")
            uneven = False
            if r.kind == "all_to_all":
                index = count[r.communicator] = count.get(r.communicator, -1) + 1
                uneven = (r.communicator, index) in uneven_calls
            spec = {"kind": r.kind, "dtype": r.dtype or r.sent_dtype or None, "reduce_op": r.reduce_op if r.kind in REDUCING else None,
                    "uneven": uneven, "form": FORMS.get(base, "tensor"),
                    "api": "functional" if "functional" in namespace else "c10d"}
            entry = ops.setdefault(op_name(spec), dict(spec, dispatcher_ops=[], group_sizes=[], calls=0))
            entry["calls"] += 1 if rank == min(sequences) else 0
            for key, value in (("dispatcher_ops", r.op), ("group_sizes", len(r.group))):
                if value not in entry[key]:
                    entry[key].append(value)
    for entry in ops.values():
        entry["dispatcher_ops"].sort()
        entry["group_sizes"].sort()
    return ops


def _environ(job: rank_jobs.RankJob, audit: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_", "PARALLELISM_CONFIG", "FSDP_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"GPU_KIT_RANKS_DEVICE": "cpu", "ACCEL_FP8_FIX_REHEARSAL": "1", "ACCEL_FP8_FIX_COLLECTIVE_AUDIT": str(audit),
                "TORCH_FR_BUFFER_SIZE": "0",  # the dispatcher recorder: it reads the reduce op and the splits
                "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(job.env)
    return env


@contextlib.contextmanager
def test_lock():
    if not LOCK or LOCK == "0":
        yield
        return
    with open(LOCK, "a") as fh:
        print(f"derive_probe: waiting for the test lock {LOCK}", file=sys.stderr, flush=True)
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_job(job: rank_jobs.RankJob, workdir: Path, timeout: float = TIMEOUT_S) -> dict:
    """Run ``job`` on CPU with the audit on; ``{"ok", "seconds", "ops", "result", "tail"}``."""
    config = workdir / f"{job.name}.yaml"
    config.write_text(rank_jobs.config_text(job, "cpu"))
    audit = workdir / f"{job.name}.audit"
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
           "--main_process_port", "0", str(SCRIPT), "gloo", str(STEPS), job.load]
    log = workdir / f"{job.name}.log"
    with test_lock(), open(log, "w") as out:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=_environ(job, audit), cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: its workers too
            proc.wait()
            rc = "timeout"
        seconds = round(time.monotonic() - start, 1)
    text = log.read_text(errors="replace")
    result = next((json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("RANKS_RESULT ")), None)
    from accel_fp8_fix.diagnostics.collective_order import check_dir, load_dir

    runs = load_dir(audit) if audit.exists() else {}
    ops: dict = {}
    for run in runs.values():
        for name, spec in reduce_run(run["sequences"]).items():
            if name in ops:
                ops[name]["calls"] += spec["calls"]
                for key in ("dispatcher_ops", "group_sizes"):
                    ops[name][key] = sorted(set(ops[name][key]) | set(spec[key]))
            else:
                ops[name] = spec
    complete = bool(runs) and all(len(r["sequences"]) == job.world and not r["failed"] for r in runs.values())
    problems = check_dir(audit) if audit.exists() else ["no audit written"]
    return {"ok": rc == 0 and result is not None and complete, "rc": rc, "seconds": seconds, "ops": ops,
            "result": result, "audit_problems": problems, "tail": text[-4000:]}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist_name in ("torch", "accelerate", "transformers", "transformer_engine"):
        try:
            out[dist_name] = version(dist_name)
        except PackageNotFoundError:
            out[dist_name] = None
    out["python"] = sys.version.split()[0]
    out["date"] = datetime.date.today().isoformat()
    out["device"] = "cpu (gloo, CPU rehearsal)"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="", help="comma-separated job names (default: every job)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per job")
    parser.add_argument("--out", default=str(probe_ops.HERE / probe_ops.FILE))
    args = parser.parse_args(argv)
    names = [n for n in args.jobs.split(",") if n] or [job.name for job in rank_jobs.JOBS]
    unknown = [n for n in names if n not in rank_jobs.BY_NAME]
    if unknown:
        parser.error(f"unknown jobs {unknown}; known: {list(rank_jobs.BY_NAME)}")
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {"ops": {}, "jobs": {}}
    jobs = {k: v for k, v in previous.get("jobs", {}).items() if k in rank_jobs.BY_NAME and k not in names}
    ops = {k: v for k, v in previous.get("ops", {}).items() if any(k in used for used in jobs.values())}
    failures = {}
    with tempfile.TemporaryDirectory(prefix="derive_probe_") as tmp:
        for name in names:
            job = rank_jobs.BY_NAME[name]
            outcome = run_job(job, Path(tmp), timeout=args.timeout)
            print(f"derive_probe: {name}: {'ok' if outcome['ok'] else 'FAILED'} rc={outcome['rc']} "
                  f"{outcome['seconds']} s, {len(outcome['ops'])} ops: {sorted(outcome['ops'])}", flush=True)
            result = outcome["result"] or {}
            print(f"derive_probe: {name}: job said " + json.dumps({k: result.get(k) for k in (
                "fixes_active", "fp8_active_each_step", "losses_finite", "losses_equal_across_ranks",
                "equal_fp8_state_across_ranks", "mesh", "experts_in_fp8", "context_parallel")}), flush=True)
            for problem in outcome["audit_problems"]:
                print(f"derive_probe: {name}: audit: {problem}", flush=True)
            if not outcome["ok"]:
                failures[name] = outcome
                print(outcome["tail"], file=sys.stderr, flush=True)
                continue
            jobs[name] = sorted(outcome["ops"])
            for op, spec in outcome["ops"].items():
                spec = {k: v for k, v in spec.items() if k != "calls"}
                if op in ops:
                    for key in ("dispatcher_ops", "group_sizes"):
                        spec[key] = sorted(set(ops[op][key]) | set(spec[key]))
                ops[op] = spec
    data = {"derived_with": versions(), "source_sha256": probe_ops.source_sha256(),
            "ops": dict(sorted(ops.items())), "jobs": {n: jobs[n] for n in rank_jobs.BY_NAME if n in jobs},
            "not_derived": {n: f"rc={f['rc']}: {f['tail'].strip().splitlines()[-1] if f['tail'].strip() else ''}"[:400]
                            for n, f in failures.items()}}
    if not data["not_derived"]:
        del data["not_derived"]
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"derive_probe: wrote {out}: {len(ops)} ops over {len(data['jobs'])} jobs"
          + (f"; NOT derived: {sorted(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
