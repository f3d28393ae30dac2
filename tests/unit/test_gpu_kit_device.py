"""The GPU kit's first stage reads the device and checks it against the rehearsed profile (gpu_kit/device.py,
docs/gpu.md): the rule on CPU, with device facts written by hand; the reader on this CPU-only torch (every
device field unknown, with its reason, nothing raised); the probe and summary.md carrying facts and verdict.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from gpu_kit import device, gpu_run, kit

MIB, GIB = 2**20, 2**30


@pytest.fixture
def h200():
    from accel_fp8_fix.rehearsal.te_on_cpu import target

    return dataclasses.asdict(target.PROFILES["h200-cu130"])


def _facts(**changed) -> dict:
    """An H200 with torch 2.11.0+cu130 as torch reports it (total_memory 143156 MiB), with ``changed`` fields."""
    facts = {"gpu": "NVIDIA H200", "capability": [9, 0], "cuda": "13.0", "cublaslt": 130100, "cudnn": 91900,
             "sm_count": 132, "l2_cache": 60 * MIB, "total_memory": 143156 * MIB,
             "te_distributions": {"transformer_engine": "2.20.2"}}
    facts.update(changed)
    return facts


def test_a_device_that_matches_the_profile_passes(h200):
    check = device.compare(_facts(), h200)
    assert check == {"profile": "h200-cu130", "verdict": "pass", "failed": {}, "warnings": {},
                     "agreed": list(device.DECIDING + device.WARNING)}
    assert device.describe(check) == "device against the rehearsal's profile h200-cu130: PASS"


def test_a_different_compute_capability_fails_by_name(h200):
    check = device.compare(_facts(capability=[10, 0]), h200)
    assert check["verdict"] == "fail" and check["failed"] == {"capability": "device 10.0, profile 9.0"}
    assert "capability FAILS (device 10.0, profile 9.0)" in device.describe(check)


@pytest.mark.parametrize("cuda", ["12.8", "14.0", "13.1", None])
def test_a_different_cuda_version_fails(h200, cuda):
    """Major or minor: TE's checks read both (FP8 block scaling needs CUDA >= 12.9); None is a CPU torch."""
    check = device.compare(_facts(cuda=cuda), h200)
    assert check["verdict"] == "fail" and list(check["failed"]) == ["cuda"]
    assert check["failed"]["cuda"] == f"device {cuda!r}, profile '13.0'"


def test_a_cuda_patch_level_agrees(h200):
    assert device.compare(_facts(cuda="13.0.2"), h200)["verdict"] == "pass"


def test_a_different_cublaslt_fails_and_a_patch_level_only_warns(h200):
    check = device.compare(_facts(cublaslt=120804), h200)
    assert check["verdict"] == "fail" and check["failed"] == {"cublaslt": "device 120804, profile 130100"}
    check = device.compare(_facts(cublaslt=130002), h200)
    assert check["verdict"] == "fail" and list(check["failed"]) == ["cublaslt"]
    check = device.compare(_facts(cublaslt=130103), h200)
    assert check["verdict"] == "warn" and not check["failed"]
    assert check["warnings"]["cublaslt"].startswith("device 130103, profile 130100 (the patch level only")


def test_sm_count_l2_memory_name_and_cudnn_differences_only_warn(h200):
    facts = _facts(gpu="NVIDIA H100 PCIe", sm_count=114, l2_cache=50 * MIB, total_memory=80 * GIB, cudnn=91002)
    check = device.compare(facts, h200)
    assert check["verdict"] == "warn" and check["failed"] == {}
    assert set(check["warnings"]) == {"gpu", "sm_count", "l2_cache", "total_memory", "cudnn"}
    assert check["warnings"]["sm_count"] == "device 114, profile 132"
    assert check["warnings"]["l2_cache"] == f"device 50.0 MiB ({50 * MIB} bytes), profile 60.0 MiB ({60 * MIB} bytes)"
    assert check["agreed"] == ["capability", "cuda", "cublaslt"]


def test_memory_within_two_percent_agrees(h200):
    assert device.compare(_facts(total_memory=int(h200["total_memory"] * 1.019)), h200)["verdict"] == "pass"
    assert "total_memory" in device.compare(_facts(total_memory=int(h200["total_memory"] * 0.97)), h200)["warnings"]


def test_unreadable_fields_warn_with_their_reason(h200):
    facts = _facts(capability=device.unknown("no CUDA"), l2_cache=device.unknown("no L2_cache_size"))
    del facts["cublaslt"]
    check = device.compare(facts, h200)
    assert check["verdict"] == "warn" and check["failed"] == {}
    assert check["warnings"]["capability"] == "unknown (no CUDA); profile 9.0"
    assert check["warnings"]["cublaslt"] == "unknown (not recorded); profile 130100"
    assert check["warnings"]["l2_cache"].startswith("unknown (no L2_cache_size)")


def test_a_disagreeing_deciding_field_fails_even_beside_unknown_ones(h200):
    check = device.compare(_facts(cuda="12.8", sm_count=device.unknown("?")), h200)
    assert check["verdict"] == "fail" and list(check["failed"]) == ["cuda"] and list(check["warnings"]) == ["sm_count"]


def test_the_reader_on_a_machine_without_cuda_records_unknowns_and_never_raises():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the reader reads real values there")
    facts = device.read_facts(kit.te_distributions())
    for field in ("gpu", "capability", "sm_count", "l2_cache", "total_memory"):
        assert device.is_unknown(facts[field]) and "is_available() is False" in facts[field]["unknown"], facts
    assert facts["cuda"] == torch.version.cuda
    assert isinstance(facts["cublaslt"], int) or facts["cublaslt"]["unknown"]
    assert set(facts["te_distributions"]) == set(kit.te_distributions())
    json.dumps(facts)  # what the probe writes


def test_a_reader_that_cannot_run_leaves_every_field_unknown(monkeypatch):
    monkeypatch.setattr(device.sys, "executable", "/nonexistent/python3")
    facts = device.read(["transformer_engine"])
    assert set(facts) == {"te_distributions", *device.DECIDING, *device.WARNING}
    assert all(device.is_unknown(v) and "device reader: FileNotFoundError" in v["unknown"] for v in facts.values())
    assert device.check(facts)["verdict"] == "warn"


def test_the_te_distributions_are_the_ones_the_pins_install():
    assert kit.te_distributions() == ["transformer_engine", "transformer_engine_cu13", "transformer_engine_torch"]


def test_the_rehearsed_profile_is_targets_with_its_settings(monkeypatch):
    from accel_fp8_fix.rehearsal.te_on_cpu import target

    assert device.rehearsed_profile() == dataclasses.asdict(target.PROFILES[target.DEFAULT])
    monkeypatch.setenv(target.ENV_TARGET, "b200-cu130")
    assert device.rehearsed_profile()["capability"] == (10, 0)
    monkeypatch.setenv(target.ENV_TARGET, "no-such-gpu")
    check = device.check(_facts())
    assert check["verdict"] == "warn" and "ValueError" in check["warnings"]["profile"]


def test_tes_own_cublaslt_reading_replaces_the_probes(h200):
    facts = _facts(cublaslt=device.unknown("no libcublasLt loaded"), cublaslt_read="unread")
    answered = device.with_te_answers(facts, {"te_cublaslt": 120900})
    assert answered["cublaslt"] == 120900 and answered["cublaslt_probe"] == facts["cublaslt"]
    assert device.compare(answered, h200)["failed"] == {"cublaslt": "device 120900, profile 130100"}
    assert device.with_te_answers(facts, {"te_cublaslt": "unread: AttributeError"}) is facts


@pytest.mark.parametrize("module", ["gpu_run.py", "device.py", "kit.py"])
def test_the_gpu_side_modules_import_only_the_standard_library(module):
    """Nothing is installed on the GPU machine when they start (torch is imported inside functions only)."""
    tree = ast.parse((ROOT / "gpu_kit" / module).read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name.split(".")[0] for node in top if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in top if isinstance(node, ast.ImportFrom) and node.module}
    assert names <= set(sys.stdlib_module_names) | {"gpu_kit", "__future__"}, names


# -- wired into the kit's first stage --------------------------------------------------------------------------
def test_the_probe_records_the_facts_and_fails_on_a_deciding_field(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_run, "STATE", tmp_path / "state")
    monkeypatch.setattr(gpu_run, "ranks_probe", lambda run, out: {})  # no torchrun here
    monkeypatch.setattr(gpu_run.device, "read", lambda names: _facts(capability=[10, 0], sm_count=148))
    monkeypatch.setattr(gpu_run, "machine_facts", lambda: gpu_run.read_device({"python": "3.12"}))
    assert gpu_run.probe(tmp_path / "out") == 1
    written = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert written["device"]["l2_cache"] == 60 * MIB and written["device"]["te_distributions"]
    assert written["device_check"]["failed"] == {"capability": "device 10.0, profile 9.0"}
    assert written["device_check"]["warnings"] == {"sm_count": "device 148, profile 132"}
    assert json.loads((tmp_path / "state" / "machine.json").read_text())["device_check"] == written["device_check"]

    monkeypatch.setattr(gpu_run.device, "read", lambda names: _facts(sm_count=148))
    assert gpu_run.probe(tmp_path / "out") == 0  # a warning only


def test_results_and_summary_carry_the_facts_and_the_verdict(monkeypatch, tmp_path):
    run = gpu_run.Run(tmp_path, budget=60)
    run.results["machine"] = {"python": "3.12", "device": _facts(l2_cache=50 * MIB, cublaslt_read="test")}
    run.results["machine"]["device_check"] = device.check(run.results["machine"]["device"])
    run.stage("device", **run.results["machine"]["device_check"])
    gpu_run.recheck_device(run, {"import": "ok", "te_cublaslt": 120804})  # TE's own answer decides
    gpu_run.summary(run)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["device"]["verdict"] == "fail"
    assert results["stages"]["device"]["failed"] == {"cublaslt": "device 120804, profile 130100"}
    assert results["stages"]["device"]["warnings"]["l2_cache"].startswith("device 50.0 MiB")
    text = (tmp_path / "summary.md").read_text()
    assert "Device: capability 9.0, CUDA 13.0, cuBLASLt 120804 (transformer_engine_torch.get_cublasLt_version()" in text
    assert "132 SMs, L2 50.0 MiB, memory 139.8 GiB" in text
    assert "**device against the rehearsal's profile h200-cu130: FAIL; cublaslt FAILS" in text
