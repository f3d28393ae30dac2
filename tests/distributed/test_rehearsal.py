"""The CPU rehearsal gates (accel_fp8_fix.rehearsal.gates): accelerate's real FSDP2 / TP code on gloo ranks.

Multi-rank facts come from two shared launches (tests/support/scenarios.py: PLAN_2RANK on 2 ranks, PLAN_4RANK on 4),
run with the fixes OFF (ACCEL_FP8_FIX=0) so that only the gates differ from stock accelerate.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import scenarios

HERE = Path(__file__).resolve().parent.parent  # tests/: the helper modules
REPO = HERE.parent


ENV = scenarios.ENV_REHEARSAL  # the environment of the launches ``two`` and ``four`` (tests/distributed/conftest.py)


def _assert_rehearsed(f, world, mesh=None):
    assert f["distributed_type"] == "FSDP" and f["is_fsdp2"], f
    assert f["device"] == "cpu" and f["backend"] == "gloo" and f["num_processes"] == world
    assert f["mesh"] == mesh


# -- in-process: the patch set and the wrappers ------------------------------------------------------------
@pytest.fixture
def rehearsal_restored():
    from accel_fp8_fix.rehearsal import gates as rehearsal

    was = rehearsal.is_active()
    yield rehearsal
    if was:
        rehearsal.activate()
    else:
        rehearsal.deactivate()


def test_patch_set_is_declared_and_selected():
    from accel_fp8_fix._api import choose_patch_set

    sel = choose_patch_set("rehearsal")
    assert sel.supported, sel.reason
    ps = sel.patch_set
    assert ps.kind == "rehearsal" and ps.name == "rehearsal-accelerate-1.13-1.16"
    assert {p.target for p in ps.patches} == {
        "accelerate.state:AcceleratorState.__init__",
        "accelerate.state:PartialState._prepare_backend",
    }
    assert all(p.signature for p in ps.patches)
    # never chosen as a fix set
    assert choose_patch_set("fix").patch_set is None or choose_patch_set("fix").patch_set.kind == "fix"


def test_activate_deactivate_restores_originals(rehearsal_restored):
    rehearsal = rehearsal_restored
    from accelerate.state import AcceleratorState, PartialState

    from accel_fp8_fix.engine.engine import FixWrapper

    rehearsal.deactivate()
    originals = (vars(AcceleratorState)["__init__"], vars(PartialState)["_prepare_backend"])
    assert not any(isinstance(o, FixWrapper) for o in originals)
    rehearsal.activate()
    assert rehearsal.is_active() and rehearsal.is_applied()
    assert isinstance(vars(AcceleratorState)["__init__"], FixWrapper)
    assert isinstance(vars(PartialState)["_prepare_backend"], FixWrapper)
    rehearsal.activate()  # idempotent
    rehearsal.deactivate()
    assert not rehearsal.is_applied()
    assert (vars(AcceleratorState)["__init__"], vars(PartialState)["_prepare_backend"]) == originals


def test_changed_signature_refuses_cleanly(rehearsal_restored):
    from accelerate.state import PartialState

    rehearsal_restored.deactivate()
    from accel_fp8_fix._api import choose_patch_set
    from accel_fp8_fix.engine import Engine, PatchError
    from accel_fp8_fix.engine.declarations import PatchSet

    ps = choose_patch_set("rehearsal").patch_set
    broken = [ps.patches[0], type(ps.patches[1])(**{**ps.patches[1].__dict__, "signature": "(self, cpu=False)"})]
    engine = Engine(PatchSet(name="rehearsal-test-broken", kind="rehearsal", requires=ps.requires, patches=tuple(broken)))
    before = vars(PartialState)["_prepare_backend"]
    with pytest.raises(PatchError, match="signature changed"):
        engine.apply()
    assert vars(PartialState)["_prepare_backend"] is before
    assert not engine.applied


def test_wrappers_pass_through_when_cuda_is_available(monkeypatch):
    for var in ("LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    import torch
    from accelerate.utils import DistributedType

    from accel_fp8_fix.rehearsal import gates as rehearsal

    state = SimpleNamespace(device=None)
    stock = lambda *a, **k: (None, DistributedType.NO)  # noqa: E731
    rehearsal._local.wanted = "FSDP2 plugin"
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert rehearsal.prepare_backend(stock, state, (False, False, None), {}) == (None, DistributedType.NO)
        assert state.device is None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert rehearsal.prepare_backend(stock, state, (False, False, None), {}) == ("gloo", DistributedType.MULTI_GPU)
        assert state.device == torch.device("cpu")
        # another backend asked for explicitly: stock decides
        state.device = None
        assert rehearsal.prepare_backend(stock, state, (False, False, "mpi"), {}) == (None, DistributedType.NO)
    finally:
        rehearsal._local.wanted = None
    # Outside an AcceleratorState decision, and with no intent in the environment, it never acts.
    assert rehearsal.prepare_backend(stock, state, (False, False, None), {}) == (None, DistributedType.NO)
    # Intent in the launcher's environment (a PartialState created before the Accelerator) ...
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    state.device = None
    assert rehearsal.prepare_backend(stock, state, (False, False, None), {}) == ("gloo", DistributedType.MULTI_GPU)
    # ... but not for cpu=True (PartialState would then skip initialising the process group) nor FSDP1.
    state.device = None
    assert rehearsal.prepare_backend(stock, state, (True, False, None), {}) == (None, DistributedType.NO)
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert rehearsal.prepare_backend(stock, state, (False, False, None), {}) == (None, DistributedType.NO)


def test_state_init_passes_through_with_cuda(monkeypatch):
    from accelerate.state import PartialState

    from accel_fp8_fix.rehearsal import gates as rehearsal

    if PartialState._shared_state:
        pytest.skip("accelerate state already initialised in this process")
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(rehearsal, "_cuda_available", lambda: True)
    plugin = SimpleNamespace(fsdp_version=2)
    rehearsal.accelerator_state_init(lambda *a, **k: calls.append((a, k)), None, (), {"fsdp_plugin": plugin})
    assert calls and not PartialState._shared_state  # no PartialState was created by the gate
    assert rehearsal._wanted({"fsdp_plugin": plugin, "parallelism_config": None}) == "FSDP2 plugin"
    assert rehearsal._wanted({"fsdp_plugin": SimpleNamespace(fsdp_version=1), "parallelism_config": None}) is None


# -- 2 ranks ------------------------------------------------------------------------------------------------
def test_ranks_ran_without_fixes_and_with_rehearsal(two):
    for res in two:
        assert res["_meta"] == {"fixes_active": False, "rehearsal_applied": True, "te_on_cpu": True}


def test_fsdp2_prepare_shards_and_trains_like_the_oracle(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_fsdp2_train", {}):
        _assert_rehearsed(f, 2, mesh=None)
        assert f["model_type"] == "FSDPBlockStack" and f["fsdp_modules"] == 3  # 2 Blocks + root
        assert f["all_dtensor"] and f["param_meshes"] == [["cpu", [], [2]]]
        assert set(p for pl in f["placements"].values() for p in pl) == {"S(0)"}
        assert f["optimizer_params_dtensor"]
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-5)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-5)  # clipped norm = one-process norm
        assert f["losses"][1] < f["losses"][0]


def test_fsdp2_on_parallelism_config_mesh(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_fsdp2_train", {"dp_shard": 2}):
        _assert_rehearsed(f, 2, mesh={"device_type": "cpu", "dim_names": ["dp_shard"], "shape": [2]})
        assert f["all_dtensor"] and f["param_meshes"] == [["cpu", ["dp_shard_cp"], [2]]]
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-5)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-5)  # clipped norm = one-process norm


def test_cpu_true_is_rehearsed_too(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_fsdp2_cpu_true"):
        _assert_rehearsed(f, 2, mesh={"device_type": "cpu", "dim_names": ["dp_shard"], "shape": [2]})
        assert f["model_type"] == "FSDPBlockStack" and f["all_dtensor"]


def test_tp_prepare_and_train(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_tp_train"):
        assert f["distributed_type"] == "MULTI_GPU" and not f["is_fsdp2"]
        assert f["device"] == "cpu" and f["backend"] == "gloo"
        assert f["mesh"] == {"device_type": "cpu", "dim_names": ["tp"], "shape": [2]}
        assert f["model_type"] == "LlamaForCausalLM"  # no DDP around a TP model
        assert f["param_meshes"] == [["cpu", ["tp"], [2]]]
        pl = f["placements"]
        assert pl["model.layers.0.self_attn.q_proj.weight"] == ["S(0)"]
        assert pl["model.layers.0.self_attn.o_proj.weight"] == ["S(1)"]
        assert pl["model.layers.1.mlp.down_proj.weight"] == ["S(1)"]
        assert f["param_kinds"]["model.norm.weight"] == "Parameter"
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-5)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-5)  # clipped norm = one-process norm


def test_partial_state_created_first_from_launcher_env(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_partial_state_first"):
        assert f["partial_state"] == {"distributed_type": "MULTI_GPU", "backend": "gloo", "device": "cpu"}
        _assert_rehearsed(f, 2, mesh=None)
        assert f["model_type"] == "FSDPBlockStack" and f["fsdp_modules"] == 3 and f["all_dtensor"]


def test_tp_still_needs_a_tp_sharded_model(two):
    for f in scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_tp_without_tp_size"):
        assert f["prepare_error"].startswith("NotImplementedError: Model should undergo tensor parallel")


def test_stock_accelerate_without_the_gates(two):
    """Rehearsal off in the same ranks: exactly the stock behaviour the gates lift."""
    for rank, f in enumerate(scenarios.plan_facts(two, scenarios.PLAN_2RANK, "sc_stock_gates")):
        # torchrun rank, no cpu=True: silently undistributed, FSDP plugin unused, params untouched
        a = f["fsdp2_plugin"]
        assert (a["distributed_type"], a["num_processes"], a["backend"], a["is_fsdp2"]) == ("NO", 1, None, False)
        assert a["model_type"] == "BlockStack" and not a["any_dtensor"]
        # cpu=True: MULTI_CPU, FSDP plugin ignored, model wrapped in DDP
        b = f["fsdp2_plugin_cpu"]
        assert (b["distributed_type"], b["num_processes"], b["is_fsdp2"]) == ("MULTI_CPU", 2, False)
        assert b["model_type"] == "DistributedDataParallel" and not b["any_dtensor"]
        # ParallelismConfig: refused
        assert f["parallelism_config"]["error"].startswith(
            "ValueError: ParallelismConfig total_size (2) does not match num_processes (1)"
        )
        for key in ("parallelism_config_cpu", "tp_cpu"):
            assert f[key]["error"].startswith(
                "ValueError: ParallelismConfig is only compatible DistributedType.FSDP (version 2) or"
            ) and f[key]["error"].endswith("but got DistributedType.MULTI_CPU."), f[key]


# -- 4 ranks ------------------------------------------------------------------------------------------------
def test_fsdp2_on_four_ranks(four):
    for f in scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_fsdp2_train", {"dp_shard": 4}):
        _assert_rehearsed(f, 4, mesh={"device_type": "cpu", "dim_names": ["dp_shard"], "shape": [4]})
        assert f["all_dtensor"] and f["param_meshes"] == [["cpu", ["dp_shard_cp"], [4]]]
        assert f["losses"] == pytest.approx(f["reference_losses"], rel=1e-5)
        assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=1e-5)  # clipped norm = one-process norm


def test_fsdp2_x_tp_builds_the_2d_mesh_on_cpu(four):
    facts = scenarios.plan_facts(four, scenarios.PLAN_4RANK, "sc_mesh_2d")
    for f in facts:
        _assert_rehearsed(f, 4, mesh={"device_type": "cpu", "dim_names": ["dp_shard", "tp"], "shape": [2, 2]})
        assert f["flattened"] == ["dp", "dp_cp", "dp_shard_cp"]
    assert sorted(map(tuple, (f["coordinate"] for f in facts))) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# -- single process and accelerate launch -----------------------------------------------------------------
def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(scenarios.ENV_REHEARSAL, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def test_single_process_run_is_untouched():
    code = textwrap.dedent(
        """
        import json
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accel_fp8_fix.rehearsal import gates as rehearsal
        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        print(json.dumps({"applied": rehearsal.is_applied(), "decision": rehearsal.last_decision(),
                          "type": acc.distributed_type.name, "n": acc.num_processes}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == {"applied": True, "decision": {}, "type": "NO", "n": 1}
    assert "accel_fp8_fix rehearsal:" not in out.stderr


LAUNCH_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: {distributed_type}
use_cpu: true
num_processes: 2
num_machines: 1
machine_rank: 0
main_process_port: 0
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: HYBRID
  amax_history_len: 16
  amax_compute_algo: max
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
{extra}"""


def _accelerate_launch(tmp_path, distributed_type, extra=""):
    config = tmp_path / "config.yaml"
    config.write_text(LAUNCH_CONFIG.format(distributed_type=distributed_type, extra=extra))
    out = tmp_path / "seen"
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config), str(HERE / "support" / "scenarios.py"), "--out", str(out)]
    audit = tmp_path / "collectives"
    proc = subprocess.run(cmd, env=_clean_env(ACCEL_FP8_FIX_COLLECTIVE_AUDIT=str(audit)), capture_output=True,
                          text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # every launched rank's collectives agree (the order NCCL needs)
    from accel_fp8_fix.diagnostics.collective_order import check_dir, load_dir

    assert check_dir(audit) == []
    proc.collective_runs = load_dir(audit)
    files = sorted(glob.glob(f"{out}.rank*.json"))
    return proc, [json.loads(Path(f).read_text()) for f in files]


def test_accelerate_launch_fsdp_config_on_cpu(tmp_path):
    """`accelerate launch` with `distributed_type: FSDP` + `use_cpu: true` (+ a parallelism_config section)
    starts 2 CPU workers via torchrun; with ACCEL_FP8_FIX_REHEARSAL=1 (.pth bootstrap in launcher and
    workers) both run FSDP2 on the dp_shard mesh with TE's real Python on CPU."""
    extra = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
    proc, seen = _accelerate_launch(tmp_path, "FSDP", extra)
    assert len(seen) == 2, seen
    (run,) = proc.collective_runs.values()  # both ranks recorded (and agreed) from init_process_group on
    assert sorted(run["sequences"]) == [0, 1] and all(run["sequences"].values())
    # the start-up hook turned c10d's flight recorder on before the rehearsal imported torch: read from it
    assert run["recorders"] == {0: "FlightRecorderTrail", 1: "FlightRecorderTrail"}
    line = "accel_fp8_fix rehearsal: no CUDA device; FSDP2 plugin + ParallelismConfig(dp_shard_size=2) requested"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]  # one voice: rank 0 says it once for the job
    for rank, f in enumerate(seen):
        assert f["env"]["LOCAL_RANK"] == str(rank) and f["env"]["WORLD_SIZE"] == "2"
        assert f["env"]["ACCELERATE_USE_FSDP"] == "true" and f["env"]["FSDP_VERSION"] == "2"
        assert f["rehearsal_applied"] and f["rehearsal_decision"]["acted"]
        assert f["distributed_type"] == "FSDP" and f["is_fsdp2"] and f["fsdp_version"] == 2
        assert f["device"] == "cpu" and f["backend"] == "gloo" and f["num_processes"] == 2
        assert f["mixed_precision"] == "fp8" and f["te_modules"] == 7
        assert f["prepare_error"] is None and f["all_dtensor"] and f["model_type"] == "FSDPBlockStack"
        assert f["mesh"] == {"device_type": "cpu", "dim_names": ["dp_shard"], "shape": [2]}
        assert f["param_meshes"] == [["cpu", ["dp_shard_cp"], [2]]]
        # A2 seen through the launcher too: TE modules, FSDP2, but no FP8 GEMM (fixes are off here)
        assert f["stats"]["fp8_gemms"] == 0 and f["stats"]["non_fp8_gemms"] > 0


def test_accelerate_launch_multi_gpu_config_ignores_fsdp_config(tmp_path):
    """`distributed_type: MULTI_GPU` + `use_cpu: true` also starts 2 torchrun CPU workers, but the launcher
    exports ACCELERATE_USE_FSDP only for `distributed_type: FSDP`, so `fsdp_config` is ignored, the script's
    Accelerator() gets no FSDP plugin, nothing asks for FSDP2 and each worker runs undistributed (stock)."""
    proc, seen = _accelerate_launch(tmp_path, "MULTI_GPU")
    assert len(seen) == 1  # both workers are process_index 0 and write the same file
    f = seen[0]
    assert f["env"]["ACCELERATE_USE_FSDP"] is None and f["env"]["WORLD_SIZE"] == "2"
    assert f["distributed_type"] == "NO" and f["num_processes"] == 1 and not f["rehearsal_decision"]
    assert "accel_fp8_fix rehearsal: no CUDA device" not in proc.stderr
