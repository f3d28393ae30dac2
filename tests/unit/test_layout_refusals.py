"""Layouts accelerate refuses (issue 20 item 4): the package names the refusal and the layout to use instead — in the
doctor (``accel-fp8-fix doctor --launch``), at ``ParallelismConfig()`` and at ``Accelerator()`` (fix id ``layout``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from accel_fp8_fix.diagnostics.launch_check import check_launch_config
from accel_fp8_fix.fixes.start.layout import refused_layout
from accel_fp8_fix.internals.accelerate_internals import replicate_with_tp_accepted

ROOT = Path(__file__).resolve().parents[2]
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_", "PARALLELISM_CONFIG", "WORLD_SIZE", "RANK"))}


def test_dp_replicate_x_tp_without_dp_shard_names_fsdp2_x_tp_and_hsdp_x_tp():
    """accelerate 1.13-1.15 refuse dp_replicate x tp / cp without dp_shard at ParallelismConfig()."""
    reason, instead = refused_layout({"dp_replicate": 2, "tp": 2}, replicate_tp=False)
    assert reason.startswith("dp_replicate 2 x tp 2 without dp_shard")
    assert instead.startswith("dp_shard 2 x tp 2 (FSDP2 x tp 2 on the same 4 processes")
    _, instead = refused_layout({"dp_replicate": 4, "tp": 2}, replicate_tp=False)
    assert "or dp_replicate 2 x dp_shard 2 x tp 2 (HSDP x tp 2" in instead
    _, instead = refused_layout({"dp_replicate": 2, "cp": 2}, replicate_tp=False)
    assert instead.startswith("dp_shard 2 x cp 2")


def test_accelerate_1_16_takes_dp_replicate_x_tp_and_only_an_fp8_run_is_refused():
    """accelerate 1.16 (#4193) takes whole TP replicas without FSDP: stock for bf16 and unknown precision (the
    ParallelismConfig() patch), refused by name for FP8 (untested here); cp keeps accelerate's refusal."""
    assert refused_layout({"dp_replicate": 2, "tp": 2}, replicate_tp=True) is None
    assert refused_layout({"dp_replicate": 2, "tp": 2}, fp8=False, replicate_tp=True) is None
    reason, instead = refused_layout({"dp_replicate": 2, "tp": 2}, fp8=True, replicate_tp=True)
    assert reason.startswith("dp_replicate 2 x tp 2 without dp_shard with mixed_precision fp8: accelerate 1.16 takes")
    assert instead.startswith("dp_shard 2 x tp 2 (FSDP2 x tp 2") and "bf16" in instead
    reason, _ = refused_layout({"dp_replicate": 2, "cp": 2}, replicate_tp=True)
    assert reason.startswith("dp_replicate 2 x cp 2 without dp_shard: accelerate refuses")
    reason, _ = refused_layout({"dp_replicate": 2, "tp": 2}, fsdp=True, replicate_tp=True)
    assert reason.startswith("dp_replicate 2 x tp 2 without dp_shard: accelerate refuses")


def test_the_installed_accelerate_decides_whether_replicas_of_tp_are_taken():
    from importlib.metadata import version

    from packaging.version import Version

    assert replicate_with_tp_accepted() is (Version(version("accelerate")) >= Version("1.16"))


def test_fsdp_without_a_shard_dim_and_process_mismatch_name_the_layout_to_use():
    reason, instead = refused_layout({"tp": 4}, fsdp=True, processes=4)
    assert "FSDP with tp 4 and dp_shard 1" in reason
    assert instead.startswith("tp 4 without FSDP") and "or dp_shard 2 x tp 2" in instead
    reason, instead = refused_layout({"dp_shard": 2, "tp": 2}, fsdp=True, processes=8)
    assert "multiplies to 4 but 8 processes run" in reason and "dp_shard 4 x tp 2 on 8 processes" in instead


@pytest.mark.parametrize("sizes,fsdp,processes", [
    ({"dp_shard": 2, "tp": 2}, True, 4), ({"tp": 2}, False, 2), ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, True, 8),
    ({"dp_replicate": 4}, False, 4), ({"dp_replicate": 2, "dp_shard": 2}, True, 4), ({}, True, 4)])
def test_layouts_accelerate_takes_are_not_refused(sizes, fsdp, processes):
    assert refused_layout(sizes, fsdp=fsdp, processes=processes) is None


def test_doctor_names_the_layout_to_use_instead(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples/fsdp2_tp_fp8.yaml").read_text())
    pc = cfg["parallelism_config"]
    pc["parallelism_config_dp_replicate_size"], pc["parallelism_config_dp_shard_size"] = 2, 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verdict = check_launch_config(str(path), environ={"ACCEL_FP8_FIX_REHEARSAL": "1"})
    (check,) = [c for c in verdict.checks if c.name == "layout"]
    assert not check.ok and "layout" in verdict.failed
    assert check.detail.startswith("dp_replicate 2 x tp 2 without dp_shard") and check.fix.startswith("use dp_shard 2 x tp 2")
    assert "[FAIL] layout: dp_replicate 2 x tp 2 without dp_shard" in str(verdict)


SCRIPT = """
import accel_fp8_fix
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig
try:
    {call}
except ValueError as exc:
    print("refused:", exc)
else:
    print("ok")
"""


REPLICATE_TP = "ok" if replicate_with_tp_accepted() else "refused: accel_fp8_fix: dp_replicate 2 x tp 2 without dp_shard"


@pytest.mark.parametrize("call,env,expect", [
    ("ParallelismConfig(dp_replicate_size=2, tp_size=2)", {}, REPLICATE_TP),
    ("ParallelismConfig(dp_replicate_size=2, cp_size=2)", {},
     "refused: accel_fp8_fix: dp_replicate 2 x cp 2 without dp_shard"),
    ("Accelerator(mixed_precision='fp8')", {"ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                                            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"},
     "refused: accel_fp8_fix: dp_replicate 2 x tp 2 without dp_shard"),
    ("Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))", {"WORLD_SIZE": "8"},
     "refused: accel_fp8_fix: dp_shard 2 x tp 2 multiplies to 4 but 8 processes run"),
    ("ParallelismConfig(dp_shard_size=2, tp_size=2)", {}, "ok"),
])
def test_parallelism_config_and_accelerator_refuse_with_the_layout_to_use(call, env, expect):
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(call=call)], capture_output=True, text=True,
                          timeout=180, env={**CLEAN_ENV, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(expect), proc.stdout + proc.stderr[-2000:]
    if expect != "ok":
        assert "Use " in last


EP_SCRIPT = """
import json, os, sys
if sys.argv[1] == "fixed":
    import accel_fp8_fix
from dataclasses import dataclass
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig

@dataclass
class EPConfig(ParallelismConfig):  # a future accelerate's ep_size (an accelerate pull request adds it)
    ep_size: int = 1

def outcome(call):
    try:
        call()
    except ValueError as exc:
        return "refused: " + str(exc)
    return "ok"

out = {
    "built": outcome(lambda: EPConfig(dp_shard_size=2, ep_size=2)),
    "ep 2": outcome(lambda: Accelerator(parallelism_config=EPConfig(dp_shard_size=2, ep_size=2), mixed_precision="fp8")),
    "ep 1": outcome(lambda: Accelerator(parallelism_config=EPConfig(dp_shard_size=2, ep_size=1), mixed_precision="fp8")),
    "bf16 ep 2": outcome(lambda: Accelerator(parallelism_config=EPConfig(dp_shard_size=2, ep_size=2),
                                             mixed_precision="bf16")),
}
os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_DP_SHARD_SIZE="2",
                  PARALLELISM_CONFIG_EP_SIZE="2", ACCELERATE_MIXED_PRECISION="fp8")
out["env ep 2"] = outcome(lambda: Accelerator())
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["fixed", "stock"])
def test_an_unknown_parallelism_dimension_is_refused_by_name_never_misread(mode):
    """issue 32 item 4: a size the package does not know (a ParallelismConfig subclass's ep_size, or the launcher's
    PARALLELISM_CONFIG_EP_SIZE) is refused at Accelerator() with FP8 on, naming it; size 1 is no dimension; a bf16
    run and stock accelerate are left to accelerate (the refusal is the package's, and only for FP8)."""
    import json

    proc = subprocess.run([sys.executable, "-c", EP_SCRIPT, mode], capture_output=True, text=True, timeout=180,
                          env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["built"] == "ok"  # ParallelismConfig() itself: stock
    for case in ("ep 1", "bf16 ep 2") + (("ep 2", "env ep 2") if mode == "stock" else ()):
        # accelerate's own outcome on one process (not the package's refusal): bf16 / no FP8 stays stock
        assert "a parallelism dimension this package does not know" not in out[case], (case, out[case])
    if mode == "stock":
        return
    assert out["ep 2"].startswith("refused: accel_fp8_fix: EPConfig.ep_size = 2: a parallelism dimension this "
                                  "package does not know (it knows dp_replicate, dp_shard, tp, cp, sp)"), out
    assert out["env ep 2"].startswith("refused: accel_fp8_fix: PARALLELISM_CONFIG_EP_SIZE = 2: a parallelism"), out


def test_doctor_refuses_an_unknown_parallelism_dimension_by_name(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples/fsdp2_tp_fp8.yaml").read_text())
    cfg["parallelism_config"]["parallelism_config_ep_size"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verdict = check_launch_config(str(path), environ={"ACCEL_FP8_FIX_REHEARSAL": "1"})
    (check,) = [c for c in verdict.checks if c.name == "parallelism dimensions"]
    assert not check.ok and "parallelism dimensions" in verdict.failed
    assert check.detail.startswith("parallelism_config_ep_size = 2: a parallelism dimension this package does not know")
    assert check.fix == "parallelism_config_ep_size: 1"
    cfg["parallelism_config"]["parallelism_config_ep_size"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert not [c for c in check_launch_config(str(path), environ={"ACCEL_FP8_FIX_REHEARSAL": "1"}).checks
                if c.name == "parallelism dimensions"]
