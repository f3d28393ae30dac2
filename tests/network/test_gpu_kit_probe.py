"""The GPU kit's rank probe asks what the rank jobs use (gpu_kit/probe_ops.json, gpu_kit/probe_ops.py,
gpu_kit/ranks_probe.py, gpu_kit/derive_probe.py), everything of it that needs no GPU:

* the probe on CPU tensors over gloo passes every op of ``probe_ops.json`` at 2 and 4 ranks (on the GPU, a failure
  is gloo's answer for CUDA tensors, not a wrong expectation of the probe), and every form it can issue gives the
  right values or gloo's own refusal (an op a later derivation adds is checked already);
* every op of the file has a probe implementation (an op the probe cannot issue is reported failed, never skipped),
  every job of ``rank_jobs.JOBS`` has its list, and the file matches the job sources (``stale()``);
* ``job_verdict`` refuses a job whose op failed on one rank or whose rank did not answer, and passes a job that
  does not use the failed op;
* ``derive_probe``'s reduction of audit records: distinct ops, reduce ops, uneven all-to-all across ranks.

Deriving itself (``python -m gpu_kit.derive_probe``: the five jobs on CPU, ~70 s) is not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from gpu_kit import derive_probe, probe_ops, rank_jobs, ranks_probe


def _probe(tmp_path, world: int, ops_file: Path | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    if ops_file is not None:
        env["GPU_KIT_PROBE_OPS"] = str(ops_file)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           str(ROOT / "gpu_kit" / "ranks_probe.py"), "gloo", "cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RANKS_PROBE ")]
    assert done.returncode == 0 and len(ranks) == world, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    return ranks


# -- the probe on CPU tensors -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_probe_passes_every_op_the_jobs_use_on_cpu_tensors_over_gloo(tmp_path, world):
    ranks = _probe(tmp_path, world)
    wanted = set(ranks_probe.load_ops())
    for result in ranks:
        assert result["init"] == "ok" and result["device"] == "cpu" and result["world_size"] == world
        assert set(result["ops"]) == wanted, sorted(set(result["ops"]) ^ wanted)
        assert set(result["ops"].values()) == {"ok"}, {k: v for k, v in result["ops"].items() if v != "ok"}
    for job in rank_jobs.JOBS:
        assert probe_ops.job_verdict(job.name, ranks, world) == (True, {})


def _every_form() -> dict:
    """An op of every kind, form and API the probe can issue, with uneven splits and the reduce ops."""
    ops = {}
    for (kind, api), forms in ranks_probe.FORMS.items():
        for form in forms:
            for dtype in ([None] if kind == "barrier" else ["float32", "bfloat16", "uint8"]):
                reducing = kind in ("all_reduce", "reduce_scatter", "reduce")
                for reduce_op in (ranks_probe.REDUCE_OPS if reducing else [None]):
                    if dtype == "uint8" and reduce_op in ("avg", "product"):
                        continue  # no integer mean; a product of 4 ranks' values overflows a byte
                    for uneven in ([False, True] if kind == "all_to_all" else [False]):
                        spec = {"kind": kind, "dtype": dtype, "reduce_op": reduce_op, "uneven": uneven,
                                "form": form, "api": api}
                        ops[derive_probe.op_name(spec)] = spec
    return ops


def test_every_form_the_probe_can_issue_checks_its_values_or_gets_gloos_refusal(tmp_path):
    """Forms no job uses today are right too: gloo gives the values expected, or refuses what it cannot do at all
    (c10d's coalescing; a list all-to-all of unequal tensors) — a later derivation adding them gets a true answer."""
    ops = _every_form()
    ops_file = tmp_path / "every_form.json"
    ops_file.write_text(json.dumps({"ops": ops, "jobs": {"every": sorted(ops)}}))
    for result in _probe(tmp_path, 2, ops_file):
        assert set(result["ops"]) == set(ops)
        for name, answer in result["ops"].items():
            spec = ops[name]
            if spec["api"] == "c10d" and spec["form"] == "coalesced":
                assert "does not implement startCoalescing" in answer, (name, answer)
            elif spec["kind"] == "all_to_all" and spec["form"] == "list" and spec["uneven"]:
                assert "invalid tensor size" in answer, (name, answer)
            else:
                assert answer == "ok", (name, answer)


# -- the ops file ---------------------------------------------------------------------------------------------
def test_every_op_of_probe_ops_json_has_a_probe_implementation():
    data = probe_ops.load()
    assert set(data["jobs"]) == {job.name for job in rank_jobs.JOBS}, "rerun python -m gpu_kit.derive_probe"
    used = {op for ops in data["jobs"].values() for op in ops}
    assert used == set(data["ops"]) == set(ranks_probe.load_ops())
    for name, spec in data["ops"].items():
        assert ranks_probe.unsupported(spec) is None, (name, ranks_probe.unsupported(spec))
    # what the jobs need and the old hand-written list lacked: the FP8 all-gather's bytes, expert dispatch's uneven
    # all-to-all, the functional collectives of EP / CP / TP, the amax reduction's MAX
    assert "all_gather.uint8" in probe_ops.ops_for("fsdp2_ag")
    assert "all_to_all.float32.uneven.functional" in probe_ops.ops_for("fsdp2_ep")
    assert "all_to_all.float32.uneven.functional" in probe_ops.ops_for("fsdp2_cp")
    assert "all_reduce.float32.max" in probe_ops.ops_for("fsdp2_tp")
    # an op the probe cannot issue is answered as a failure of that op, never skipped
    strange = {"kind": "all_gather", "dtype": "float32", "form": "ragged", "api": "c10d"}
    assert "no probe for" in ranks_probe.unsupported(strange)
    with pytest.raises(NotImplementedError, match="no probe for"):
        ranks_probe.Probe(0, 2, __import__("torch").device("cpu")).run(strange)


def test_the_committed_ops_file_matches_the_job_sources_and_stale_says_when_not(tmp_path):
    assert probe_ops.stale() is None, probe_ops.stale()
    for name in (*probe_ops.SOURCES, probe_ops.FILE):
        shutil.copy(ROOT / "gpu_kit" / name, tmp_path / name)
    assert probe_ops.stale(tmp_path) is None
    with open(tmp_path / "rank_jobs.py", "a") as fh:
        fh.write("\n# a new job\n")
    why = probe_ops.stale(tmp_path)
    assert why and "derive_probe" in why, why
    (tmp_path / probe_ops.FILE).unlink()
    assert "derive_probe" in probe_ops.stale(tmp_path)


def test_job_verdict_refuses_a_job_whose_op_failed_on_one_rank_or_a_rank_that_did_not_answer():
    jobs = probe_ops.load()["jobs"]
    # an op one job uses and another does not
    op, user, other = next((op, a, b) for a in jobs for op in jobs[a] for b in jobs if op not in jobs[b])
    every = sorted({o for ops in jobs.values() for o in ops})
    ranks = [{"rank": r, "init": "ok", "ops": {o: "ok" for o in every}} for r in range(4)]
    assert probe_ops.job_verdict(user, ranks, 4) == (True, {})
    ranks[2]["ops"][op] = "RuntimeError: no such collective for CUDA tensors"
    ok, failed = probe_ops.job_verdict(user, ranks, 4)
    assert not ok and failed == {op: {2: "RuntimeError: no such collective for CUDA tensors"}}
    assert probe_ops.job_verdict(other, ranks, 4) == (True, {})
    ranks[1]["ops"][op] = "wrong values"
    assert probe_ops.job_verdict(user, ranks, 4)[1] == {op: {1: "wrong values", 2: ranks[2]["ops"][op]}}
    # a rank that did not answer refuses every job
    ok, failed = probe_ops.job_verdict(other, ranks[:3], 4)
    assert not ok and "3 of 4" in failed["ranks"] and "[3]" in failed["ranks"]
    # an op the rank never tried (an older probe) and a rank whose process group failed
    del ranks[0]["ops"][jobs[other][0]]
    assert probe_ops.job_verdict(other, ranks, 4)[1] == {jobs[other][0]: {0: "not tried"}}
    ranks[0] = {"rank": 0, "init": "RuntimeError: gloo: connection refused", "ops": {}}
    assert probe_ops.job_verdict(other, ranks, 4)[1] == {"init": {0: "RuntimeError: gloo: connection refused"}}
    with pytest.raises(KeyError, match="derive_probe"):
        probe_ops.job_verdict("no_such_job", ranks, 4)


# -- derive_probe's reduction of the audit ---------------------------------------------------------------------
def test_derive_probe_reduces_audit_records_to_distinct_ops_with_reduce_op_and_uneven_splits():
    from accel_fp8_fix.diagnostics.collective_order import Collective

    def c(kind, op, dtype, reduce_op="", splits=(), group=(0, 1)):
        if kind == "all_to_all":  # as the audit records one: its dtype None (compared), what it sent beside
            return Collective(kind=kind, op=op, group=group, dtype=None, numel=None, group_name="0", splits=splits,
                              sent_dtype=dtype)
        return Collective(kind=kind, op=op, group=group, dtype=dtype, numel=None, group_name="0", reduce_op=reduce_op)

    common = [c("all_reduce", "c10d.allreduce_", "float32", "max"), c("all_reduce", "c10d.allreduce_", "float32", "sum"),
              c("all_gather", "c10d._allgather_base_", "uint8"), c("all_gather", "c10d.allgather_", "int64"),
              c("reduce_scatter", "_c10d_functional.reduce_scatter_tensor", "bfloat16", "avg"),
              c("barrier", "c10d.barrier", None)]
    sequences = {  # the first all-to-all is uneven on rank 1 only: uneven for both; the second even on both
        0: common + [c("all_to_all", "_c10d_functional.all_to_all_single", "float32", splits=(4, 4)),
                     c("all_to_all", "c10d.alltoall_base_", "int64", splits=(2, 2))],
        1: common + [c("all_to_all", "_c10d_functional.all_to_all_single", "float32", splits=(0, 8)),
                     c("all_to_all", "c10d.alltoall_base_", "int64", splits=(2, 2))],
    }
    ops = derive_probe.reduce_run(sequences)
    assert sorted(ops) == ["all_gather.int64.list", "all_gather.uint8", "all_reduce.float32.max",
                           "all_reduce.float32.sum", "all_to_all.float32.uneven.functional", "all_to_all.int64",
                           "barrier", "reduce_scatter.bfloat16.avg.functional"]
    assert ops["all_to_all.float32.uneven.functional"]["uneven"] is True
    assert ops["all_gather.uint8"]["dispatcher_ops"] == ["c10d._allgather_base_"]
    for spec in ops.values():
        assert ranks_probe.unsupported(spec) is None
