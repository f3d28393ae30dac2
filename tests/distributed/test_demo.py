"""The README's main job, for real: `accelerate launch` of examples/demo.py on 4 CPU processes with the
config file whose fp8_config flag switches accel_fp8_fix on (the script never imports it)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}


def _launch(extra_env, audit_dir=None):
    audit = {"ACCEL_FP8_FIX_COLLECTIVE_AUDIT": str(audit_dir)} if audit_dir else {}
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "examples/fsdp2_tp_fp8.yaml"),
         "--main_process_port", "0", str(ROOT / "examples/demo.py"), "2"],
        env={**ENV, "ACCEL_FP8_FIX_REHEARSAL": "1", "OMP_NUM_THREADS": "1", **audit, **extra_env},
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )


def _expected_coverage_line() -> str:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    linears = {n: m.weight.numel() for n, m in demo.build_model().named_modules() if isinstance(m, torch.nn.Linear)}
    total, fp8 = sum(linears.values()), sum(v for n, v in linears.items() if n != "lm_head")
    gemms = 3 * len(linears)  # forward, dgrad, wgrad
    return (f"FP8 coverage: {fp8 / total:.1%} of GEMM parameters ({fp8}/{total}), "
            f"{gemms - 3}/{gemms} GEMMs per step ({(gemms - 3) / gemms:.1%})")


def test_demo_trains_fsdp2_x_tp_in_fp8_with_the_config_flag_only(tmp_path):
    from accel_fp8_fix.diagnostics.collective_order import check_dir, load_dir

    proc = _launch({}, audit_dir=tmp_path / "collectives")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]  # a finished run exits 0 (A20)
    out = proc.stdout
    assert "mesh ('dp_shard', 'tp') (2, 2), distributed type DistributedType.FSDP" in out
    assert out.count("FP8 active: True") == 2
    assert "patch set: accelerate-1.13-1.16  (activated by: accelerate config" in out
    assert "TE modules: 14 converted after sharding (14 with TE-native TP), kept: ['lm_head']" in out
    assert "amax group ranks [0, 1, 2, 3]" in out
    # the FP8 coverage figure: every Linear weight but lm_head's (kept), from the demo's own model
    assert _expected_coverage_line() in out
    assert "  high precision: lm_head - " in out
    # one voice: every package message once for the job (4 ranks), not once per rank or twice per message
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("accel_fp8_fix")]
    assert any(line.startswith("accel_fp8_fix: kept 1 module(s)") for line in said)
    assert len(said) == len(set(said)), said
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in proc.stderr
    # the collective-order audit: the 4 ranks' collectives agree on every group (what NCCL needs)
    runs = load_dir(tmp_path / "collectives")
    assert len(runs) == 1 and len(next(iter(runs.values()))["sequences"]) == 4, runs.keys()
    assert check_dir(tmp_path / "collectives") == []


def test_demo_with_the_patches_off_shows_the_stock_failure():
    """Exactly the stock failure, on every rank, and nothing else: before, rank 0's exit removed the temporary
    checkpoint while other ranks still loaded it (FileNotFoundError tracebacks; torchrun's root cause was one)."""
    import re

    proc = _launch({"ACCEL_FP8_FIX": "0"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    failed = re.findall(r"\[rank (\d)\] prepare\(\) failed: (\w+): cannot import name 'ReplicateParallel'", out)
    assert sorted(failed) == [(str(r), "ImportError") for r in range(4)], out[-4000:]
    assert "FileNotFoundError" not in out, out[-4000:]
    # the only other error named is the launcher's own report of the failed children
    assert set(re.findall(r"\b(\w+(?:Error|Exception))\b", out)) <= {"ImportError", "ChildFailedError"}, out[-4000:]
