"""The GPU run's orchestration on CPU (issue 48 item 1): stages in order, each result written before the next
starts, a stage the budget does not reach left for ``run --resume``, which keeps what an earlier pass finished.
The subprocesses are stubbed (each takes its planned estimate on a fake clock); what they would run is the kit's."""

from __future__ import annotations

import json

import pytest

from gpu_kit import gpu_run, kit, rank_jobs


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    clock, calls = Clock(), []
    monkeypatch.setattr(gpu_run.time, "monotonic", clock)
    monkeypatch.setattr(gpu_run, "STATE", tmp_path / "state")
    (tmp_path / "state").mkdir()
    probe = {"gloo": {"exit": 0, "init": ["ok"], "ops": {}, "jobs": {
        job.name: {"ok": job.name != "fsdp2_cp", "failed": {} if job.name != "fsdp2_cp" else
                   {"all_to_all.float32.uneven": {"1": "RuntimeError: not on CUDA tensors"}}}
        for job in rank_jobs.JOBS}}}
    (tmp_path / "state" / "ranks_probe.json").write_text(json.dumps(probe))

    def sub(self, name, command, log_name, cap, env=None, reserve=15):
        stage = name.split(" ")[0]
        limit = max(0.0, min(cap, self.left() - reserve))
        if limit < 5:
            calls.append(("skipped", stage))
            return None, "", 0.0
        took = gpu_run.BY_STAGE[stage].estimate
        calls.append(("ran", stage))
        out = self.out / log_name  # the output is appended to the stage's log, as the real one does
        out.write_text(out.read_text() + name if out.is_file() else name)
        if took > limit:
            clock.now += limit
            return None, "", limit
        clock.now += took
        if stage == "kernel_fixtures":
            (self.out / "kernels.pt").write_bytes(b"fixtures")
            return 0, 'KERNEL_FIXTURES {"cases": 24, "errors": {}}\n', took
        if stage.startswith("ranks_"):
            return 0, 'RANKS_RESULT {"losses_finite": true}\n', took
        if stage in ("te_decides", "gpu_files", "compile"):
            return 0, "tests/gpu/test_x.py::test_a PASSED\ntests/gpu/test_x.py::test_b FAILED\n", took
        return 0, 'BENCH_ROW {"config": "bf16"}\n', took

    monkeypatch.setattr(gpu_run.Run, "sub", sub)
    monkeypatch.setattr(gpu_run, "machine_facts", lambda: {"device_check": {"verdict": "pass", "fields": {}}})
    monkeypatch.setattr(gpu_run, "recheck_device", lambda run, imported: None)
    monkeypatch.setattr(gpu_run.device, "describe", lambda check: "device: pass")
    monkeypatch.setattr(kit, "import_probe", lambda **kw: {"import": "ok", "accelerate": "1.16.0",
                                                           "transformers": "5.25.0"})
    return clock, calls, tmp_path


def _run(tmp_path, out: str, budget: float, resume: bool = False) -> dict:
    run = gpu_run.Run(tmp_path / out, budget)
    if resume:
        previous = json.loads((gpu_run.STATE / "results.json").read_text())
        run.results["stages"] = previous["stages"]
        run.done_before = {n for n, f in run.results["stages"].items() if f.get("done")}
    run.results["machine"] = gpu_run.machine_facts()
    gpu_run.checks(run, kit.import_probe())
    return json.loads((tmp_path / out / "results.json").read_text())


def test_a_first_pass_runs_the_decisive_stages_in_order_and_leaves_the_rest(stubbed):
    clock, calls, tmp_path = stubbed
    results = _run(tmp_path, "out1", budget=290 - 15 - 12)  # what is left after install and import
    ran = [stage for what, stage in calls if what == "ran"]
    assert ran[:3] == ["kernel_fixtures", "te_decides", "gpu_files"]
    assert ran.index("ranks_fsdp2_ag") < ran.index("ranks_fsdp2_ep")
    stages = results["stages"]
    assert stages["kernel_fixtures"]["done"] and stages["te_decides"]["counts"] == {"passed": 1, "failed": 1}
    assert "the probe failed collectives" in stages["ranks_fsdp2_cp"]["skipped"]  # never launched: it would hang
    assert "ranks_fsdp2_cp" not in ran
    assert not stages.get("benchmark_moe", {}).get("done")  # the budget ran out before throughput
    summary = (tmp_path / "out1" / "summary.md").read_text()
    assert "accelerate 1.16.0" in summary and "transformers 5.25.0" in summary
    assert len(list((tmp_path / "out1").iterdir())) <= 8


def test_a_resumed_pass_keeps_what_the_first_finished_and_runs_the_rest(stubbed):
    clock, calls, tmp_path = stubbed
    first = _run(tmp_path, "out1", budget=200)
    done_first = {n for n, f in first["stages"].items() if f.get("done")}
    calls.clear()
    second = _run(tmp_path, "out2", budget=600, resume=True)
    ran = {stage for what, stage in calls if what == "ran"}
    assert not ran & done_first  # nothing finished is run again
    assert all(second["stages"][s.name].get("done") for s in gpu_run.STAGES if s.name not in ("install", "import"))
    assert (gpu_run.STATE / "kernels.pt").read_bytes() == b"fixtures"  # kept on the warm machine for a later $OUT


def test_a_stage_stopped_at_its_cap_is_recorded_and_not_done(stubbed, monkeypatch):
    clock, calls, tmp_path = stubbed
    monkeypatch.setitem(gpu_run.BY_STAGE, "te_decides", gpu_run.Stage("te_decides", cap=20, estimate=40, what="x"))
    results = _run(tmp_path, "out1", budget=600)
    assert results["stages"]["te_decides"]["stopped_at_cap"] and not results["stages"]["te_decides"].get("done")
    assert results["stages"]["gpu_files"]["done"]  # the next stage still runs
