"""What runs on the GPU machine (``receive``, ``probe``, ``run``) and the install both there and in the CPU
dry run (``install``). Standard library at import: nothing is installed yet when this starts.

The first stage (``probe``, or ``run`` without one) reads the device (``gpu_kit.device``: capability, CUDA,
cuBLASLt, cuDNN, SMs, L2, memory, the pins' TE distributions) and checks it against the profile the CPU
rehearsal answers as: a field TE decides from that disagrees fails (exit 1, after every result is written),
the rest warn. results.json (``machine.device``, stage ``device``) and summary.md carry both.

``run`` keeps to a time budget (``--budget`` seconds, under the device command's 600 s limit): each stage
gets what is left, at most its own cap, and results are written under ``--out`` as they come, so a stage
that runs out of time still leaves the others' results. At most 8 files go to ``--out`` (the device tool
returns no more): run.log, tests.log, ranks.log, benchmark.log, benchmark.md, benchmark_moe.md, results.json,
summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_kit import device, kit

STATE = kit.KIT_DIR / "state"  # stays on the warm machine between commands (ignored path)
RANKS_BACKEND = "cuda:gloo,cpu:gloo"


class Run:
    def __init__(self, out: Path, budget: float):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.budget = budget
        self.results: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "stages": {}}
        self.log_handle = open(out / "run.log", "a")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def log(self, message: str) -> None:
        line = f"[gpu_kit {time.monotonic() - self.started:6.1f}s] {message}"
        print(line, flush=True)
        self.log_handle.write(line + "\n")
        self.log_handle.flush()

    def stage(self, name: str, **fields) -> None:
        self.results["stages"].setdefault(name, {}).update(fields)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def sub(self, name: str, command: list[str], log_name: str, cap: float, env: dict | None = None,
            reserve: float = 15) -> tuple[int | None, str, float]:
        """Run a subprocess with min(cap, time left - reserve) seconds; its output appended to --out/log_name."""
        limit = max(0.0, min(cap, self.left() - reserve))
        if limit < 5:
            self.log(f"{name}: skipped, {self.left():.0f} s left")
            return None, "", 0.0
        self.log(f"{name}: {' '.join(command)} (limit {limit:.0f} s)")
        started = time.monotonic()
        with open(self.out / log_name, "a") as log:
            log.write(f"\n===== {name}: {' '.join(command)}\n")
            log.flush()
            try:
                done = subprocess.run(command, cwd=kit.ROOT, env=env or kit.site_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=limit)
                output, code = done.stdout, done.returncode
            except subprocess.TimeoutExpired as exc:
                output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                output += f"\n[gpu_kit] {name}: stopped at its limit of {limit:.0f} s\n"
                code = None
            log.write(output)
        seconds = time.monotonic() - started
        self.log(f"{name}: exit {code} after {seconds:.0f} s")
        return code, output, seconds


# -- receive / probe -----------------------------------------------------------------------------------------
def receive(index: int) -> int:
    manifest = kit.load_manifest()
    entry = kit.verify_part(manifest, index)
    present = [p["name"] for p in manifest["parts"] if (kit.PARTS_DIR / p["name"]).is_file()]
    print(f"gpu_kit: {entry['name']} verified ({entry['size']} bytes); present {len(present)} of "
          f"{len(manifest['parts'])}: {', '.join(present)}")
    return 0


def machine_facts() -> dict:
    facts = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
             "libc": " ".join(platform.libc_ver()), "cpus": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True)
        facts["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
    code = ("import json, torch, importlib.metadata as m\n"
            "v = {}\n"
            "for d in ('torch', 'accelerate', 'transformers', 'wrapt', 'pytest', 'einops', 'pydantic', 'onnx'):\n"
            "    try: v[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: v[d] = None\n"
            "v['torch_cuda'] = torch.version.cuda\n"
            "v['cuda_available'] = torch.cuda.is_available()\n"
            "v['gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
            "v['cudnn'] = torch.backends.cudnn.version()\n"
            "print(json.dumps(v))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    facts["versions"] = json.loads(done.stdout) if done.returncode == 0 else done.stderr[-1000:]
    libstdcxx = _libstdcxx_glibcxx()
    if libstdcxx:
        facts["libstdcxx_newest_GLIBCXX"] = libstdcxx
    return read_device(facts)


def read_device(facts: dict) -> dict:
    """The device as TE sees it (capability, CUDA, cuBLASLt, cuDNN, SMs, L2, memory; the pins' TE distributions
    as this interpreter has them) and its check against the rehearsed profile, added to ``facts``."""
    facts["device"] = device.read(kit.te_distributions())
    facts["device_check"] = device.check(facts["device"])
    return facts


def _libstdcxx_glibcxx() -> str | None:
    for candidate in ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6"):
        if os.path.exists(candidate):
            data = Path(candidate).read_bytes()
            found = [tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBCXX_(\d+\.\d+(?:\.\d+)?)", data)]
            return ".".join(map(str, max(found))) if found else None
    return None


# what only context parallelism and expert parallelism need beyond FSDP2 / TP (torch's ring rotates K / V and their
# gradients with all-gathers and all-to-alls; transformers' EP dispatch sends tokens with all-to-alls: the
# collective-order audit records them on CPU, tests/distributed/test_context_parallel.py, test_expert_parallel.py)
CP_OPS = ("all_to_all_single",)


def _ranks_ok(ranks: list[dict], world: int, exclude=()) -> bool:
    """Every rank answered, initialised, and every probed collective (but ``exclude``) returned the right values."""
    return bool(ranks) and len(ranks) == world and all(
        r.get("init") == "ok" and all(v == "ok" for op, v in r["ops"].items() if op not in exclude) for r in ranks)


def ranks_probe(run: Run | None, out: Path, world: int = 2) -> dict:
    """torchrun with ``world`` ranks on the one GPU, per backend: which collectives work on CUDA tensors."""
    answers = {}
    for backend in ("gloo", "nccl"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   str(kit.ROOT / "gpu_kit" / "ranks_probe.py"), backend]
        if run is not None:
            code, output, _ = run.sub(f"ranks probe ({backend})", command, "ranks.log", cap=60, env=dict(os.environ))
        else:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=kit.ROOT)
                code, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:
                code, output = None, f"timed out: {exc}"
            with open(out / "ranks.log", "a") as log:
                log.write(f"\n===== ranks probe ({backend})\n{output}")
        ranks = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("RANKS_PROBE ")]
        ops: dict = {}
        for result in ranks:
            for op, verdict in result.get("ops", {}).items():
                ops.setdefault(op, set()).add(verdict)
        answers[backend] = {"exit": code, "init": sorted({r.get("init") for r in ranks}) or ["no answer"],
                            "ops": {op: sorted(v)[0] if len(v) == 1 else sorted(v) for op, v in ops.items()},
                            "all_ok": _ranks_ok(ranks, world, exclude=CP_OPS),
                            "cp_ok": _ranks_ok(ranks, world)}
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "ranks_probe.json").write_text(json.dumps(answers))
    return answers


def probe(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    facts["ranks_probe"] = ranks_probe(None, out)
    (out / "probe.json").write_text(json.dumps(facts, indent=1))
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "machine.json").write_text(json.dumps(facts))
    print(json.dumps(facts, indent=1))
    print(f"gpu_kit: {device.describe(facts['device_check'])}")
    return 1 if facts["device_check"]["verdict"] == "fail" else 0  # the next commands still run: results first


# -- install (GPU machine and CPU dry run) -------------------------------------------------------------------
def install(site: Path = kit.SITE, log: list[str] | None = None, all_wheelhouse: bool = False) -> tuple[dict, dict]:
    manifest = kit.load_manifest()
    started = time.monotonic()
    extracted = kit.assemble(manifest)
    assembled = time.monotonic() - started
    installed = kit.install(manifest, extracted, site, log=log, all_wheelhouse=all_wheelhouse)
    installed.update(assemble_s=round(assembled, 1), install_s=round(time.monotonic() - started - assembled, 1))
    return manifest, installed


def _needs_rebuild(probe_result: dict) -> bool:
    """The prebuilt extension does not load here (C/C++ runtime or torch ABI), while the rest does."""
    text = f"{probe_result.get('import', '')} {probe_result.get('stderr_tail', '')}"
    return probe_result.get("import") != "ok" and bool(
        re.search(r"GLIBC|undefined symbol|transformer_engine_torch", text))


def rebuild_extension(run: Run, manifest: dict, site: Path) -> bool:
    """Fallback: build TE's torch extension here from the carried sdist (all cores) and put it in place."""
    sdist = next(kit.UNPACKED / f["path"] for f in manifest["files"] if f["role"] == "te-torch-sdist")
    script = ("import sys; from pathlib import Path; from gpu_kit.kit import build_extension; "
              f"w = build_extension(Path({str(sdist)!r}), Path({str(kit.KIT_DIR / 'gpu_build' / 'ext')!r}), "
              f"jobs={os.cpu_count() or 8}, log_path=Path({str(kit.KIT_DIR / 'gpu_build' / 'build.log')!r})); print(w)")
    code, output, _ = run.sub("rebuild TE torch extension here", [sys.executable, "-c", script], "run.log", cap=330,
                              env=dict(os.environ, PYTHONPATH=str(kit.ROOT)), reserve=120)
    if code != 0:
        return False
    wheel = output.strip().splitlines()[-1]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", str(site), wheel], capture_output=True, text=True)
    run.log(done.stdout[-1500:] + done.stderr[-1500:])
    return done.returncode == 0


def install_main(args) -> int:
    log: list[str] = []
    manifest, installed = install(log=log, all_wheelhouse=args.all_wheelhouse)
    result = {"installed": installed, "import": kit.import_probe(), "site": str(kit.SITE)}
    print("GPU_KIT_INSTALL " + json.dumps(result))
    return 0


# -- run ------------------------------------------------------------------------------------------------------
RANKS_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: false
num_machines: 1
num_processes: {world}
machine_rank: 0
gpu_ids: all
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: HYBRID
  amax_history_len: 16
  amax_compute_algo: max
  accel_fp8_fix: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: {layer}
  fsdp_cpu_ram_efficient_loading: false
{parallelism}"""


def ranks_runs(run: Run) -> None:
    probe_file = STATE / "ranks_probe.json"
    answers = json.loads(probe_file.read_text()) if probe_file.is_file() else ranks_probe(run, run.out)
    run.stage("ranks_probe", **answers)
    if not answers.get("gloo", {}).get("all_ok"):
        gloo = answers.get("gloo", {})
        failed = {op: verdict for op, verdict in gloo.get("ops", {}).items() if verdict != "ok"}
        run.stage("ranks", skipped=f"two ranks on this one GPU over gloo did not pass the probe (init {gloo.get('init')}, "
                                   f"failed collectives {failed or 'none reported'}); see ranks_probe and ranks.log")
        return
    fsdp2_tp = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    fsdp2_cp = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_cp_size: 2\n"
    jobs = [("fsdp2", 2, "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n", "build"),
            ("fsdp2_tp", 4, fsdp2_tp, "build"),
            ("fsdp2_tp_loaded", 4, fsdp2_tp, "distributed_config")]  # transformers' N-D loading (A18)
    if answers["gloo"].get("cp_ok"):
        jobs.append(("fsdp2_cp", 4, fsdp2_cp, "build"))  # FSDP2 x CP inside maybe_context_parallel (functional)
        # transformers' expert parallelism at load (fsdp 4 x ep 2: its all-to-all token dispatch), experts in FP8
        jobs.append(("fsdp2_ep", 4, "parallelism_config:\n  parallelism_config_dp_shard_size: 4\n", "expert_parallel"))
    else:
        for job, what in (("ranks_fsdp2_cp", "context parallelism"), ("ranks_fsdp2_ep", "expert parallelism")):
            run.stage(job, skipped=f"the collectives {what} needs beyond FSDP2 ({', '.join(CP_OPS)}) failed the "
                                   "probe on this GPU over gloo")
    for name, world, parallelism, load in jobs:
        config = STATE / f"ranks_{name}.yaml"
        layer = "Qwen3MoeDecoderLayer" if load == "expert_parallel" else "LlamaDecoderLayer"
        config.write_text(RANKS_CONFIG.format(world=world, parallelism=parallelism, layer=layer))
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--main_process_port", "0", str(kit.ROOT / "gpu_kit" / "ranks_job.py"), RANKS_BACKEND, "3", load]
        env = kit.site_env()
        env.pop("ACCEL_FP8_FIX", None)  # the config flag alone switches the package on
        code, output, seconds = run.sub(f"ranks {name} (world {world}, one GPU)", command, "ranks.log", cap=110, env=env)
        found = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("RANKS_RESULT ")]
        run.stage(f"ranks_{name}", exit=code, seconds=round(seconds), result=found[0] if found else None,
                  error_tail=None if found else output[-1500:])


def tests_gpu(run: Run) -> None:
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider"]
    code, output, seconds = run.sub("tests/gpu", command, "tests.log", cap=200)
    counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", output))
    outcomes = re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+)", output, flags=re.M)
    run.stage("tests_gpu", exit=code, seconds=round(seconds), counts=counts,
              outcomes=[f"{o} {t}" for o, t in outcomes])


MOE_SECONDS = 120  # kept for the MoE rows (benchmark_moe) out of what the Llama rows may use
MOE_ARGS = ("--model", "qwen3_moe", "--layers", "4", "--configs", "bf16,fp8-delayed,fp8-current", "--warmup", "2",
            "--steps", "6")


def benchmark(run: Run) -> None:
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--table", str(run.out / "benchmark.md"),
               "--budget", str(max(30, int(run.left() - 25 - MOE_SECONDS))),
               *os.environ.get("GPU_KIT_BENCH_ARGS", "").split()]
    code, output, seconds = run.sub("throughput benchmark", command, "benchmark.log", cap=260, reserve=10 + MOE_SECONDS)
    rows = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("BENCH_ROW ")]
    run.stage("benchmark", exit=code, seconds=round(seconds), rows=rows)


def benchmark_moe(run: Run) -> None:
    """bf16 vs FP8 on a Qwen3-MoE-shaped model: the experts on TE grouped GEMMs (fixes/moe_experts.py)."""
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--table", str(run.out / "benchmark_moe.md"),
               "--budget", str(max(30, int(min(MOE_SECONDS, run.left() - 15)))), *MOE_ARGS]
    code, output, seconds = run.sub("MoE throughput benchmark", command, "benchmark.log", cap=MOE_SECONDS, reserve=5)
    rows = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("BENCH_ROW ")]
    run.stage("benchmark_moe", exit=code, seconds=round(seconds), rows=rows)


def summary(run: Run) -> None:
    stages = run.results["stages"]
    lines = [f"# GPU truth kit run, {run.results['date_utc']}", ""]
    machine = run.results.get("machine", {})
    versions = machine.get("versions", {}) if isinstance(machine.get("versions"), dict) else {}
    lines.append(f"GPU {versions.get('gpu')} ({machine.get('nvidia_smi', '?')}); Python {machine.get('python')}; "
                 f"torch {versions.get('torch')} (CUDA {versions.get('torch_cuda')}); accelerate "
                 f"{versions.get('accelerate')}; transformers {versions.get('transformers')}; TE "
                 f"{stages.get('import', {}).get('te_version')}")
    lines += ["", _device_lines(machine.get("device", {}), stages), ""]
    for name, fields in stages.items():
        brief = {k: v for k, v in fields.items() if k not in ("rows", "stderr_tail", "error_tail", "log")}
        lines.append(f"- **{name}**: `{json.dumps(brief, default=str)[:1500]}`")
    for table in (run.out / "benchmark.md", run.out / "benchmark_moe.md"):
        if table.is_file():
            lines += ["", table.read_text()]
    (run.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _device_lines(facts: dict, stages: dict) -> str:
    """The device's facts and its check against the rehearsed profile, for summary.md."""
    def shown(field: str, unit: str = "") -> str:
        value = facts.get(field)
        if device.is_unknown(value):
            return f"unknown ({value['unknown']})"
        if field == "capability" and isinstance(value, list):
            return ".".join(map(str, value))
        if unit and isinstance(value, int):
            return f"{value / 2**(20 if unit == 'MiB' else 30):.1f} {unit}"
        return str(value)

    te = stages.get("import", {}).get("te_distributions") or facts.get("te_distributions")
    check = stages.get("device", {})
    verdict = device.describe(check) if check.get("verdict") else "device not checked"
    return (f"Device: capability {shown('capability')}, CUDA {shown('cuda')}, cuBLASLt {shown('cublaslt')} "
            f"({facts.get('cublaslt_read', '?')}), cuDNN {shown('cudnn')}, {shown('sm_count')} SMs, "
            f"L2 {shown('l2_cache', 'MiB')}, memory {shown('total_memory', 'GiB')}; TE distributions {te}"
            f"\n\n**{verdict}**")


def run_main(args) -> int:
    run = Run(Path(args.out), args.budget)
    machine_file = STATE / "machine.json"
    run.results["machine"] = json.loads(machine_file.read_text()) if machine_file.is_file() else machine_facts()
    if "device_check" not in run.results["machine"]:  # a machine.json of an older kit
        read_device(run.results["machine"])
    run.stage("device", **run.results["machine"]["device_check"])
    run.log(device.describe(run.results["machine"]["device_check"]))
    if args.installed:  # any CUDA machine with TE installed by pip: no kit, the same checks
        return checks(run, kit.import_probe(site=Path("/nonexistent")))
    pip_log: list[str] = []
    try:
        manifest, installed = install(log=pip_log)
    except kit.KitError as exc:
        run.log(f"install failed: {exc}")
        run.stage("install", error=str(exc))
        summary(run)
        return 1
    finally:
        run.log_handle.write("\n".join(pip_log) + "\n")
    run.stage("install", **installed, manifest_created=manifest["created"], parts=len(manifest["parts"]))
    run.log(f"installed {installed['te_wheels']} in {installed['assemble_s'] + installed['install_s']:.0f} s")
    imported = kit.import_probe()
    if _needs_rebuild(imported) and run.left() > 300:
        run.log(f"the prebuilt extension does not load ({imported.get('import')}): rebuilding it here")
        run.stage("import_prebuilt", **imported)
        if rebuild_extension(run, manifest, kit.SITE):
            imported = kit.import_probe()
            imported["extension"] = "rebuilt on this machine"
    return checks(run, imported)


def checks(run: Run, imported: dict) -> int:
    run.stage("import", **imported)
    run.log(f"import transformer_engine.pytorch: {imported.get('import')}; FP8: {imported.get('is_fp8_available')}")
    recheck_device(run, imported)
    if imported.get("import") != "ok":
        summary(run)
        return 1
    tests_gpu(run)
    ranks_runs(run)
    benchmark(run)
    benchmark_moe(run)
    run.log(f"done, {run.left():.0f} s of the budget left")
    summary(run)
    return 1 if run.results["stages"].get("device", {}).get("verdict") == "fail" else 0


def recheck_device(run: Run, imported: dict) -> None:
    """The device check again with TE's own cuBLASLt reading (the import probe's), where TE gave one."""
    machine = run.results.get("machine", {})
    facts = device.with_te_answers(machine.get("device", {}), imported)
    if facts is not machine.get("device"):
        machine["device"] = facts
        run.stage("device", **device.check(facts))
        run.log(f"with TE's cuBLASLt reading: {device.describe(run.results['stages']['device'])}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_kit")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("receive").add_argument("index", type=int)
    verbs.add_parser("probe").add_argument("--out", required=True)
    verbs.add_parser("install").add_argument("--all-wheelhouse", action="store_true",
                                             help="install every wheelhouse wheel, not only the missing ones")
    run = verbs.add_parser("run")
    run.add_argument("--out", required=True)
    run.add_argument("--budget", type=float, default=530)
    run.add_argument("--installed", action="store_true",
                     help="use the Transformer Engine this interpreter has (pip install), no kit parts")
    args = parser.parse_args(argv)
    try:
        if args.verb == "receive":
            return receive(args.index)
        if args.verb == "probe":
            return probe(Path(args.out))
        if args.verb == "install":
            return install_main(args)
        return run_main(args)
    except kit.KitError as exc:
        print(f"gpu_kit: {exc}", file=sys.stderr)
        return 3
