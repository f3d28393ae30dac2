"""GPU truth kit (gpu_kit/, docs/gpu.md): everything of it that needs no GPU.

* Always (seconds, no network): a bundle cut into parts by the builder's own code is reassembled byte for
  byte; a flipped byte, a missing part and a file the manifest does not list are refused by name; a kit's
  device commands fit the device tool's limits (2,000 characters, 8 carried paths, 64 MiB with the tree).
* With the kit built (``python -m gpu_kit build``: PyPI downloads and a ~1 h build of TE's torch extension on
  2 cores; skipped until then, a failure under ``GPU_KIT_REQUIRED=1``): every part is at most 60 MiB and
  verifies; the real runner's commands fit the limits; and the **CPU dry run** — the build venv's Python 3.12
  with PyPI's CUDA torch 2.11.0 (the GPU machine's torch build) reassembles the parts, verifies them, installs
  with ``pip --no-index --no-deps --target`` and imports ``transformer_engine.pytorch`` with the extension
  built here loaded (Python loads an extension with every symbol bound, so a torch / TE-core ABI mismatch
  fails here); the kit's site runs this package's .pth trampoline (the accelerate config flag path).
  It cannot show anything a GPU decides: kernels, FP8 support, NCCL, the GPU machine's C/C++ runtime.
* The GPU-side scripts' logic on CPU: the rank probe's expectations (gloo, CPU tensors), the throughput
  benchmark (``--tiny``, over TE's real Python and the CPU rehearsal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from gpu_kit import build, kit, plan


def _kit_missing(reason: str):
    if os.environ.get("GPU_KIT_REQUIRED", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"GPU_KIT_REQUIRED is set and {reason}")
    pytest.skip(reason)


# -- synthetic bundle: the builder's and the GPU side's code, small files ------------------------------------
@pytest.fixture
def small_kit(tmp_path):
    pins = kit.load_pins()
    pins["parts"]["max_mib"] = 3000 / kit.MIB  # parts of 3000 bytes
    payloads = {"wheels/core.whl": os.urandom(7000), "wheels/python.whl": os.urandom(10),
                "wheelhouse/dep.whl": os.urandom(2500)}
    sources, files = {}, []
    for index, (path, data) in enumerate(payloads.items()):
        source = tmp_path / "src" / f"f{index}"
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(data)
        sources[path] = source
        files.append({"path": path, "role": "wheelhouse" if "wheelhouse" in path else "te-core",
                      "size": len(data), "sha256": kit.sha256_file(source), "import_name": "dep"})
    parts_dir = tmp_path / "parts"
    manifest = build.write_parts(pins, files, sources, {"wheel": "x"}, parts_dir=parts_dir, build_dir=tmp_path / "b")
    return manifest, parts_dir, payloads


def test_parts_reassemble_byte_for_byte(small_kit, tmp_path):
    manifest, parts_dir, payloads = small_kit
    assert len(manifest["parts"]) >= 4 and all(p["size"] <= 3000 for p in manifest["parts"])
    extracted = kit.assemble(json.loads((parts_dir / "manifest.json").read_text()), parts_dir, tmp_path / "out")
    assert {name: path.read_bytes() for name, path in extracted.items()} == payloads


def test_a_flipped_byte_a_missing_part_and_an_unlisted_file_are_refused_by_name(small_kit, tmp_path):
    manifest, parts_dir, _ = small_kit
    part = parts_dir / "part-01"
    original = part.read_bytes()
    part.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
    with pytest.raises(kit.KitError, match=r"kit part part-01: sha256 .* carry it again"):
        kit.assemble(manifest, parts_dir, tmp_path / "out")
    part.unlink()
    with pytest.raises(kit.KitError, match=r"part-01 \(2 of \d+\) is missing"):
        kit.assemble(manifest, parts_dir, tmp_path / "out")

    unlisted = dict(manifest, files=[f for f in manifest["files"] if f["path"] != "wheels/python.whl"])
    part.write_bytes(original)
    with pytest.raises(kit.KitError, match="'wheels/python.whl', which its manifest does not list"):
        kit.assemble(unlisted, parts_dir, tmp_path / "out")


def test_device_commands_of_a_full_size_kit_fit_the_device_tool(tmp_path):
    """Five parts (what a TE 2.20 kit with the carried accelerate / transformers needs: 289 MiB): each command fits
    and carries its part and the manifest; the calls' limits sum to at most 8 minutes, and with a slow start, the
    gaps between calls and the optional resumed pass, to at most the session's 15 minutes of device time."""
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    manifest = {"kit_format": kit.KIT_FORMAT, "parts": [{"name": f"part-{i:02d}", "size": 60 * kit.MIB,
                                                         "sha256": "0" * 64} for i in range(5)]}
    (parts_dir / "manifest.json").write_text(json.dumps(manifest))
    steps = plan.commands(manifest, parts_dir)
    required = [s for s in steps if not s.get("optional")]
    assert [len(s["carry"]) for s in required] == [2] * 5 and steps[-1]["optional"] and steps[-1]["carry"] == []
    assert all(len(s["command"]) <= plan.COMMAND_LIMIT and s["timeout_s"] <= 600 for s in steps)
    assert all(s["carry"][0].endswith(f"part-{i:02d}") for i, s in enumerate(required))
    assert "gpu_kit probe" in steps[0]["command"] and "gpu_kit run" in required[-1]["command"]
    assert "--resume" in steps[-1]["command"]
    figures = plan.budget(steps)
    assert figures["limits_s"] == sum(s["timeout_s"] for s in required) <= 480
    assert plan.SLOW_START_S + figures["limits_s"] + plan.GAP_S * len(steps) + steps[-1]["timeout_s"] <= 900
    assert figures["decisive_estimate_s"] <= plan.RUN_BUDGET_S < required[-1]["timeout_s"]
    tree = plan.tree_bytes()
    problems = plan.check(steps, tree)
    assert not [p for p in problems if "does not exist" not in p], problems  # the parts themselves are fake
    assert tree + 60 * kit.MIB + 4096 <= plan.TRANSFER_LIMIT, f"the working tree ({tree} bytes) leaves no room"
    # a sixth part would break the 8 minutes: the check says so
    six = {**manifest, "parts": manifest["parts"] + [{"name": "part-05", "size": kit.MIB, "sha256": "0" * 64}]}
    assert any("limits sum to" in p for p in plan.check(plan.commands(six, parts_dir), tree))


def test_the_run_takes_its_stages_in_order_of_what_only_a_gpu_can_tell():
    """install and TE's own answers, the kernel fixtures, test_gpu_te_decides, the MoE / FP8 all-gather / real-TE
    files, the rank jobs (FP8 all-gather on 2 ranks, EP, CP first), compile, throughput last; the decisive ones
    inside the first pass's budget, each under its cap; 8 result files at most."""
    from gpu_kit import gpu_run, rank_jobs

    names = [s.name for s in gpu_run.STAGES]
    assert names[:5] == ["install", "import", "kernel_fixtures", "te_decides", "gpu_files"]
    assert names[5:8] == ["ranks_fsdp2_ag", "ranks_fsdp2_ep", "ranks_fsdp2_cp"]
    assert names[-3:] == ["compile", "benchmark", "benchmark_moe"]
    assert [s.name for s in gpu_run.STAGES if s.decisive] == names[:8]
    assert all(s.estimate < s.cap for s in gpu_run.STAGES)
    assert rank_jobs.BY_NAME["fsdp2_ag"].world == 2 and rank_jobs.BY_NAME["fsdp2_ag"].env == {
        "ACCELERATE_FP8_ALL_GATHER": "fp8"}
    assert set(gpu_run.GPU_FILES) | {"tests/gpu/test_gpu_te_decides.py", "tests/gpu/test_compile_fp8_gpu.py"} == {
        f"tests/gpu/{p.name}" for p in (ROOT / "tests" / "gpu").glob("test_*.py")}  # every GPU test file has a stage
    outputs = {"run.log", "tests.log", "ranks.log", "benchmark.log", "benchmark.md", "kernels.pt", "results.json",
               "summary.md"}
    assert all(name in gpu_run.__doc__ for name in outputs) and len(outputs) == 8


# -- the built kit ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built():
    if not kit.MANIFEST.is_file():
        _kit_missing(f"the GPU kit is not built ({kit.MANIFEST} absent): python -m gpu_kit build")
    return kit.load_manifest()


def test_built_kit_parts_are_at_most_60_mib_and_verify(built):
    pins = kit.load_pins()
    assert built["pins_sha256"] == kit.pins_digest(), "gpu_kit/pins.toml changed since the kit was built: rebuild"
    sizes = [p["size"] for p in built["parts"]]
    assert max(sizes) <= 60 * kit.MIB and sum(sizes) == built["bundle"]["size"]
    for index in range(len(built["parts"])):
        kit.verify_part(built, index)
    by_role = {f["role"]: f for f in built["files"]}
    te = pins["transformer_engine"]
    assert by_role["te-core"]["sha256"] == te["core_sha256"]  # PyPI's bytes, carried unchanged
    assert by_role["te-python"]["sha256"] == te["python_sha256"]
    assert by_role["te-torch-sdist"]["sha256"] == te["torch_sdist_sha256"]
    ext = by_role["te-torch-ext"]
    assert ext["path"].endswith(f"-{pins['target']['python_tag']}-{pins['target']['python_tag']}-linux_x86_64.whl")
    assert built["extension"]["built_with"]["torch"] == pins["target"]["torch_version"]
    assert built["extension"]["built_with"]["torch_cuda"] == pins["target"]["torch_cuda"]


def test_runner_commands_fit_the_device_tool(built):
    steps = plan.commands(built)
    assert len([s for s in steps if not s.get("optional")]) == len(built["parts"])
    assert plan.check(steps) == []
    done = subprocess.run([sys.executable, "-m", "gpu_kit", "plan", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = json.loads(done.stdout)
    assert [s["command"] for s in printed["steps"]] == [s["command"] for s in steps] and printed["problems"] == []


@pytest.fixture(scope="module")
def dry_run(built, tmp_path_factory):
    python = Path(built["extension"].get("venv_python", ""))
    if not python.is_file():
        _kit_missing(f"the kit's build venv ({python}) is gone: python -m gpu_kit build")
    work = tmp_path_factory.mktemp("gpu_kit_work")
    env = dict(os.environ, GPU_KIT_WORK=str(work))
    for variable in ("ACCEL_FP8_FIX", "ACCELERATE_FP8_ACCEL_FP8_FIX", "ACCEL_FP8_FIX_REHEARSAL", "PYTHONPATH"):
        env.pop(variable, None)
    done = subprocess.run([str(python), "-m", "gpu_kit", "install", "--all-wheelhouse"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU_KIT_INSTALL ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1]), work, python


def test_dry_run_installs_every_wheel_with_pip_no_index_no_deps_target(built, dry_run):
    result, work, _ = dry_run
    site = work / "site"
    assert result["site"] == str(site)
    wheels = {f["path"].split("/")[-1] for f in built["files"] if f["role"] in kit.TE_ROLES}
    assert set(result["installed"]["te_wheels"]) == wheels
    assert sorted(result["installed"]["wheelhouse_installed"]) == sorted(
        f["path"] for f in built["files"] if f["role"] == "wheelhouse")
    libs = site / "transformer_engine" / "wheel_lib"
    assert list(libs.glob("transformer_engine_torch.cpython-312-*.so")), sorted(p.name for p in libs.iterdir())
    assert (libs / "libtransformer_engine.so").is_file()
    assert (site / "accel_fp8_fix.pth").read_text() == (ROOT / "accel_fp8_fix.pth").read_text()


def test_dry_run_imports_transformer_engine_pytorch_with_the_built_extension(built, dry_run):
    result, work, _ = dry_run
    probe = result["import"]
    assert probe["import"] == "ok", probe
    pins = kit.load_pins()
    assert probe["torch"] == pins["target"]["torch_version"] and probe["torch_cuda"] == pins["target"]["torch_cuda"]
    assert probe["cuda_available"] is False  # CPU: nothing GPU-side is decided here
    assert probe["te_version"] == pins["transformer_engine"]["version"]
    assert probe["extension_file"].startswith(str(work / "site")), probe["extension_file"]
    assert probe["transformer_engine_file"].startswith(str(work / "site"))


def test_dry_run_site_runs_the_trampoline_so_the_config_flag_reaches_workers(dry_run):
    _, work, python = dry_run
    env = kit.site_env(work / "site", base={k: v for k, v in os.environ.items()
                                            if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8"))})
    env["ACCELERATE_FP8_ACCEL_FP8_FIX"] = "True"  # what accelerate launch exports for `accel_fp8_fix: true`
    code = ("import json, sys; started = 'accel_fp8_fix' in sys.modules; import accelerate, accel_fp8_fix; "
            "r = accel_fp8_fix.report(); print(json.dumps([started, r.mode, r.patch_set]))")
    done = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    started, mode, patch_set = json.loads(done.stdout.strip().splitlines()[-1])
    assert started is True, done.stdout + done.stderr  # imported at start-up by the .pth, through sitecustomize
    assert patch_set.startswith("accelerate-"), done.stdout
    assert mode.startswith("accelerate config"), mode


# -- kernel fixtures: recorded on the GPU, replayed here through the shim -----------------------------------------
def _rehearsal_or_skip():
    import importlib.util

    for needed in ("transformer_engine", "accel_fp8_fix.rehearsal"):  # found, not imported here
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed (the CPU rehearsal: pip install ./packaging/rehearsal)")


def test_kernel_fixtures_record_replay_bit_for_bit_and_name_every_difference(tmp_path):
    """The file the GPU stage writes, recorded here through the shim: under the device tool's 16 MiB, every case
    recorded, and its replay equal bit for bit. A flipped FP8 code and a changed fp32 bit are each reported by
    case and tensor, and the replay fails."""
    _rehearsal_or_skip()
    import torch

    fixture = tmp_path / "kernels.pt"
    done = subprocess.run([sys.executable, "-m", "gpu_kit.kernel_fixtures", "record", "--out", str(fixture),
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.split("KERNEL_FIXTURES ", 1)[1].splitlines()[0])
    assert summary["errors"] == {} and summary["cases"] >= 20 and summary["bytes"] < 16 * 2**20
    report_file = tmp_path / "report.json"
    replay = [sys.executable, "-m", "gpu_kit.kernel_fixtures", "replay", str(fixture), "--json", str(report_file)]
    done = subprocess.run(replay, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads(report_file.read_text())
    assert done.returncode == 0 and report["equal"], done.stdout[-3000:]
    # the variants the replay tries: TF32 rounding of the fp32 GEMMs, fast accumulation of the FP8 ones
    assert report["cases"]["fp32_gemm"]["matching"] == ["default", "ACCEL_FP8_FIX_REHEARSAL_TF32=auto",
                                                        "ACCEL_FP8_FIX_REHEARSAL_TF32=rna"]
    assert "ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM=1" not in report["cases"]["fp8_gemm_k2048_fast"]["matching"]

    saved = torch.load(fixture, weights_only=False)
    saved["cases"]["quantize_delayed_e4m3"]["outputs"]["data"].view(-1)[7] ^= 1  # one FP8 code, one step away
    out = saved["cases"]["fp32_gemm"]["outputs"]["out"]
    out.view(torch.int32).view(-1)[3] += 2  # two ulps
    torch.save(saved, fixture)
    done = subprocess.run(replay, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads(report_file.read_text())
    assert done.returncode == 1 and not report["equal"]
    data = report["cases"]["quantize_delayed_e4m3"]["default"]["tensors"]["data"]
    assert (data["differ"], data["max_ulps"]) == (1, 1)
    gemm = report["cases"]["fp32_gemm"]["default"]["tensors"]["out"]
    assert (gemm["differ"], gemm["max_ulps"]) == (1, 2)
    assert "| quantize_delayed_e4m3 | DIFFERENT |" in done.stdout and "| fp32_gemm | DIFFERENT |" in done.stdout


# -- the benchmark's logic on CPU ---------------------------------------------------------------------------
def test_throughput_benchmark_runs_bf16_and_delayed_fp8_through_the_patched_prepare(tmp_path):
    import importlib.util

    for needed in ("transformer_engine", "transformers", "accel_fp8_fix.rehearsal"):  # found, not imported here
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed (the CPU rehearsal: pip install ./packaging/rehearsal)")
    table = tmp_path / "table.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--tiny", "--configs",
                           "bf16,fp8-delayed,fp8-current", "--table", str(table), "--budget", "400"],
                          cwd=ROOT, capture_output=True, text=True, timeout=450)
    rows = {r["config"]: r for r in (json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                                     if line.startswith("BENCH_ROW "))}
    assert done.returncode == 0 and set(rows) == {"bf16", "fp8-delayed", "fp8-current"}, \
        done.stdout[-3000:] + done.stderr[-3000:]
    assert rows["bf16"]["fp8_active"] is None and rows["bf16"]["te_modules"] == 0
    for config, recipe in (("fp8-delayed", "DelayedScaling"), ("fp8-current", "Float8CurrentScaling")):
        row = rows[config]
        assert row["fixes_active"] and row["fp8_active"] and row["recipe"] == recipe, row
        assert row["te_modules"] > 0 and row["fp8_gemms_per_step"] > 0, row
        assert row["loss_finite"] and row["tokens_per_s"] > 0
    assert table.read_text().count("\n") == 2 + len(rows)


def test_throughput_benchmark_runs_the_moe_model_with_experts_on_te_grouped_gemms(tmp_path):
    """``--model qwen3_moe`` (the kit's MoE rows): FP8 through the patched prepare, every TE GEMM — the experts'
    grouped GEMMs counted one a call — on FP8 operands, TFLOP/s on the active parameters."""
    import importlib.util

    for needed in ("transformer_engine", "transformers", "accel_fp8_fix.rehearsal"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed (the CPU rehearsal: pip install ./packaging/rehearsal)")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--tiny", "--model",
                           "qwen3_moe", "--configs", "bf16,fp8-delayed", "--budget", "300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=350)
    rows = {r["config"]: r for r in (json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                                     if line.startswith("BENCH_ROW "))}
    assert done.returncode == 0 and set(rows) == {"bf16", "fp8-delayed"}, done.stdout[-3000:] + done.stderr[-3000:]
    fp8 = rows["fp8-delayed"]
    assert fp8["model"] == "qwen3_moe" and fp8["active_params_b"] < fp8["params_b"] or fp8["params_b"] == 0.0
    # 2 layers x (4 attention Linears x 3 GEMMs + 2 expert projections x 3 grouped GEMMs) per step
    assert fp8["te_gemms_per_step"] == fp8["fp8_gemms_per_step"] == 2 * (4 * 3 + 2 * 3), fp8
    assert fp8["fp8_active"] and fp8["loss_finite"]
