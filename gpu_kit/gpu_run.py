"""What runs on the GPU machine (``receive``, ``probe``, ``run``) and the install both there and in the CPU
dry run (``install``). Standard library at import: nothing is installed yet when this starts.

The first stage (``probe``, or ``run`` without one) reads the device (``gpu_kit.device``: capability, CUDA,
cuBLASLt, cuDNN, SMs, L2, memory, the pins' TE distributions) and checks it against the profile the CPU
rehearsal answers as: a field TE decides from that disagrees fails (exit 1, after every result is written),
the rest warn. results.json (``machine.device``, stage ``device``) and summary.md carry both.

``run`` keeps to a time budget (``--budget`` seconds, under the device command's limit): the stages (``STAGES``)
run in order of what only a GPU can tell — install and TE's own answers, the kernel fixtures, what only real TE
decides, the MoE / FP8 all-gather / real-TE files, the rank jobs, compile, throughput last — each gets what is left,
at most its cap, and writes its result before the next starts. ``run --resume`` (a second pass on the warm
machine) keeps the stages an earlier pass finished and runs the rest. At most 8 files go to ``--out`` (the device
tool returns no more): run.log, tests.log, ranks.log, benchmark.log, benchmark.md, kernels.pt, results.json,
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
from dataclasses import dataclass
from pathlib import Path

from gpu_kit import device, kit, probe_ops, rank_jobs

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
        self.done_before: set[str] = set()  # stages an earlier pass finished (run --resume)

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


PROBE_WORLD = max(job.world for job in rank_jobs.JOBS)  # one probe at the largest world size the jobs use


def ranks_probe(run: Run | None, out: Path, world: int = PROBE_WORLD, cap: float = 45) -> dict:
    """torchrun with ``world`` ranks on the one GPU over gloo (NCCL refuses two ranks on one device: not asked):
    which of the collectives the rank jobs issue (``probe_ops.json``) gloo runs on CUDA tensors, and the verdict
    per job. ``{"gloo": {"exit", "init", "ops", "ranks", "jobs": {job: {"ok", "failed"}}, "stale"}}``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(kit.ROOT / "gpu_kit" / "ranks_probe.py"), "gloo"]
    if run is not None:
        code, output, _ = run.sub("ranks probe (gloo)", command, "ranks.log", cap=cap, env=dict(os.environ))
    else:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=cap, cwd=kit.ROOT)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            code, output = None, f"timed out: {exc}"
        with open(out / "ranks.log", "a") as log:
            log.write(f"\n===== ranks probe (gloo)\n{output}")
    ranks = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("RANKS_PROBE ")]
    ops: dict = {}
    for result in ranks:
        for op, verdict in result.get("ops", {}).items():
            ops.setdefault(op, set()).add(verdict)
    jobs = {}
    for job in rank_jobs.JOBS:
        ok, failed = probe_ops.job_verdict(job.name, ranks, world)
        jobs[job.name] = {"ok": ok, "failed": failed}
    answers = {"gloo": {"exit": code, "init": sorted({str(r.get("init")) for r in ranks}) or ["no answer"],
                        "ops": {op: sorted(v)[0] if len(v) == 1 else sorted(v) for op, v in ops.items()},
                        "ranks": ranks, "jobs": jobs, "stale": probe_ops.stale()}}
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
@dataclass(frozen=True)
class Stage:
    """One stage of ``run``: ``cap`` the most it may take (s), ``estimate`` what it is planned to take on the lent
    machine (16 cores; docs/gpu.md "The plan"); ``decisive``: planned inside the first pass's budget."""

    name: str
    cap: float
    estimate: float
    what: str
    decisive: bool = True


# In order of what only a GPU can tell; each stage writes its result before the next starts.
STAGES = (
    Stage("install", 60, 15, "reassemble, verify, pip install --no-index --no-deps --target (TE, accelerate, "
          "transformers)"),
    Stage("import", 60, 12, "import transformer_engine.pytorch in a fresh process; FP8 support as TE reports it"),
    Stage("kernel_fixtures", 45, 15, "TE's kernels on fixed inputs -> kernels.pt (replayed on CPU by the shim)"),
    Stage("te_decides", 75, 40, "tests/gpu/test_gpu_te_decides.py: what only real TE decides (FP8 leading "
          "dimensions, token counts, FP8 state through save/load, recompute in FP8)"),
    Stage("gpu_files", 100, 60, "tests/gpu: MoE experts, the FP8 all-gather, real-TE FSDP2 / TP (world size 1)"),
    *(Stage(f"ranks_{job.name}", 60 if job.world > 2 else 50, 35 if job.world > 2 else 25, job.purpose,
            decisive=job.name in ("fsdp2_ag", "fsdp2_ep", "fsdp2_cp")) for job in rank_jobs.JOBS),
    Stage("compile", 90, 60, "tests/gpu/test_compile_fp8_gpu.py: torch.compile over TE FP8", decisive=False),
    Stage("benchmark", 150, 120, "throughput: bf16 vs FP8 recipes, a 1.06 B Llama", decisive=False),
    Stage("benchmark_moe", 120, 90, "throughput: bf16 vs FP8, a Qwen3-MoE", decisive=False),
)
BY_STAGE = {stage.name: stage for stage in STAGES}
GPU_FILES = ("tests/gpu/test_gpu_moe_experts.py", "tests/gpu/test_gpu_fp8_all_gather.py", "tests/gpu/test_gpu_real_te.py")


def _stage_done(run: Run, name: str, reserve: float = 15) -> bool:
    """A stage that finished in an earlier pass on this warm machine (``run --resume``): not run again; or one the
    budget no longer reaches: recorded as not reached (a resumed pass runs it). True: do not run it now."""
    if name in run.done_before:
        run.log(f"{name}: done in an earlier pass, kept")
        return True
    if min(BY_STAGE[name].cap, run.left() - reserve) < 5:
        run.log(f"{name}: not reached, {run.left():.0f} s left")
        run.stage(name, not_reached=f"{run.left():.0f} s of the budget left")
        return True
    return False


def _finish(run: Run, name: str, **fields) -> None:
    run.stage(name, **fields, done=True)
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "results.json").write_text(json.dumps(run.results, default=str))


def pytest_stage(run: Run, name: str, files: tuple[str, ...]) -> None:
    """pytest on ``files`` in the order given (not alphabetically), one line a test (``-v``): what ran is parsed
    even from a run the cap stopped."""
    if _stage_done(run, name):
        return
    command = [sys.executable, "-m", "pytest", *files, "-v", "-rA", "-p", "no:cacheprovider"]
    code, output, seconds = run.sub(name, command, "tests.log", cap=BY_STAGE[name].cap)
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", output, flags=re.M)
    counts: dict = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    fields = dict(exit=code, seconds=round(seconds), counts=counts, outcomes=[f"{o} {t}" for t, o in outcomes])
    if code is None:  # stopped at its cap: what ran is recorded, the stage is not done (a resume runs it again)
        run.stage(name, **fields, stopped_at_cap=True)
        return
    _finish(run, name, **fields)


def kernel_fixtures(run: Run) -> None:
    if _stage_done(run, "kernel_fixtures"):
        return
    target = run.out / "kernels.pt"
    command = [sys.executable, "-m", "gpu_kit.kernel_fixtures", "record", "--out", str(target), "--device", "cuda"]
    code, output, seconds = run.sub("kernel_fixtures", command, "tests.log", cap=BY_STAGE["kernel_fixtures"].cap)
    found = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("KERNEL_FIXTURES ")]
    if found and target.is_file():
        shutil.copy2(target, STATE / "kernels.pt")  # a resumed pass's $OUT is a new folder
    _finish(run, "kernel_fixtures", exit=code, seconds=round(seconds), result=found[0] if found else None,
            error_tail=None if found else output[-1500:])


def rank_job_runs(run: Run) -> None:
    probe_file = STATE / "ranks_probe.json"
    answers = json.loads(probe_file.read_text()) if probe_file.is_file() else ranks_probe(run, run.out)
    run.stage("ranks_probe", **{k: v for k, v in answers.get("gloo", {}).items() if k != "ranks"})
    verdicts = answers.get("gloo", {}).get("jobs", {})
    for job in rank_jobs.JOBS:
        name = f"ranks_{job.name}"
        if _stage_done(run, name):
            continue
        verdict = verdicts.get(job.name, {"ok": False, "failed": {"probe": "no answer for this job"}})
        if not verdict["ok"]:  # a collective gloo cannot run on CUDA tensors would hang or fail the job
            _finish(run, name, skipped=f"the probe failed collectives this job issues: {verdict['failed']}")
            continue
        config = STATE / f"{name}.yaml"
        config.write_text(rank_jobs.config_text(job))
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--main_process_port", "0", str(kit.ROOT / "gpu_kit" / "ranks_job.py"), RANKS_BACKEND, "3",
                   job.load]
        env = kit.site_env()
        env.pop("ACCEL_FP8_FIX", None)  # the config flag alone switches the package on
        env.update(job.env)
        code, output, seconds = run.sub(f"{name} (world {job.world}, one GPU)", command, "ranks.log",
                                        cap=BY_STAGE[name].cap, env=env)
        found = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("RANKS_RESULT ")]
        fields = dict(exit=code, seconds=round(seconds), result=found[0] if found else None,
                      error_tail=None if found else output[-1500:])
        if code is None:
            run.stage(name, **fields, stopped_at_cap=True)
        else:
            _finish(run, name, **fields)


def benchmark(run: Run, name: str, args: tuple[str, ...]) -> None:
    """bf16 against FP8 (``benchmarks/gpu_throughput.py``): rows into results.json, the table into benchmark.md."""
    if _stage_done(run, name, reserve=10):
        return
    table = STATE / f"{name}.md"
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--table", str(table),
               "--budget", str(max(30, int(min(BY_STAGE[name].cap, run.left()) - 20))), *args]
    code, output, seconds = run.sub(name, command, "benchmark.log", cap=BY_STAGE[name].cap, reserve=10)
    rows = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("BENCH_ROW ")]
    if code is None:  # stopped at its cap: the rows it printed are kept, a resume runs it again
        run.stage(name, exit=code, seconds=round(seconds), rows=rows, stopped_at_cap=True)
    else:
        _finish(run, name, exit=code, seconds=round(seconds), rows=rows)
    tables = [STATE / f"{b}.md" for b in ("benchmark", "benchmark_moe")]
    (run.out / "benchmark.md").write_text("\n\n".join(t.read_text() for t in tables if t.is_file()))


MOE_ARGS = ("--model", "qwen3_moe", "--layers", "4", "--configs", "bf16,fp8-delayed,fp8-current", "--warmup", "2",
            "--steps", "6")


def summary(run: Run) -> None:
    stages = run.results["stages"]
    lines = [f"# GPU truth kit run, {run.results['date_utc']}", ""]
    machine = run.results.get("machine", {})
    versions = machine.get("versions", {}) if isinstance(machine.get("versions"), dict) else {}
    imported = stages.get("import", {})
    lines.append(f"GPU {versions.get('gpu')} ({machine.get('nvidia_smi', '?')}); Python {machine.get('python')}; "
                 f"torch {versions.get('torch')} (CUDA {versions.get('torch_cuda')}); accelerate "
                 f"{imported.get('accelerate')} (the machine's {versions.get('accelerate')}); transformers "
                 f"{imported.get('transformers')} (the machine's {versions.get('transformers')}); TE "
                 f"{imported.get('te_version')}")
    lines += ["", _device_lines(machine.get("device", {}), stages), ""]
    not_reached = [s.name for s in STAGES if not stages.get(s.name, {}).get("done")]
    for name, fields in stages.items():
        brief = {k: v for k, v in fields.items() if k not in ("rows", "stderr_tail", "error_tail", "log", "ranks")}
        lines.append(f"- **{name}**: `{json.dumps(brief, default=str)[:1500]}`")
    if not_reached:
        lines += ["", f"Not done in this pass (on the warm machine: `python3 -m gpu_kit run --resume`): "
                      f"{', '.join(not_reached)}"]
    table = run.out / "benchmark.md"
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
    previous = STATE / "results.json"
    if args.resume and previous.is_file():  # a second pass on the warm machine: the first's results kept
        run.results["stages"] = json.loads(previous.read_text()).get("stages", {})
        run.done_before = {name for name, fields in run.results["stages"].items() if fields.get("done")}
        run.log(f"resuming: {len(run.done_before)} stages done in an earlier pass")
    machine_file = STATE / "machine.json"
    run.results["machine"] = json.loads(machine_file.read_text()) if machine_file.is_file() else machine_facts()
    if "device_check" not in run.results["machine"]:  # a machine.json of an older kit
        read_device(run.results["machine"])
    run.stage("device", **run.results["machine"]["device_check"])
    run.log(device.describe(run.results["machine"]["device_check"]))
    if args.installed:  # any CUDA machine with TE installed by pip: no kit, the same checks
        return checks(run, kit.import_probe(site=Path("/nonexistent"), timeout=BY_STAGE["import"].cap))
    if "install" in run.done_before and kit.SITE.is_dir():
        return checks(run, kit.import_probe(timeout=BY_STAGE["import"].cap))
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
    _finish(run, "install", **installed, manifest_created=manifest["created"], parts=len(manifest["parts"]))
    run.log(f"installed {installed['te_wheels']} and {installed.get('carried')} in "
            f"{installed['assemble_s'] + installed['install_s']:.0f} s")
    imported = kit.import_probe(timeout=BY_STAGE["import"].cap)
    if _needs_rebuild(imported) and run.left() > 300:
        run.log(f"the prebuilt extension does not load ({imported.get('import')}): rebuilding it here")
        run.stage("import_prebuilt", **imported)
        if rebuild_extension(run, manifest, kit.SITE):
            imported = kit.import_probe(timeout=BY_STAGE["import"].cap)
            imported["extension"] = "rebuilt on this machine"
    return checks(run, imported)


def checks(run: Run, imported: dict) -> int:
    run.stage("import", **imported, done=imported.get("import") == "ok")
    run.log(f"import transformer_engine.pytorch: {imported.get('import')}; FP8: {imported.get('is_fp8_available')}; "
            f"accelerate {imported.get('accelerate')}, transformers {imported.get('transformers')}")
    recheck_device(run, imported)
    if imported.get("import") != "ok":
        summary(run)
        return 1
    kernel_fixtures(run)
    pytest_stage(run, "te_decides", ("tests/gpu/test_gpu_te_decides.py",))
    pytest_stage(run, "gpu_files", GPU_FILES)
    rank_job_runs(run)
    pytest_stage(run, "compile", ("tests/gpu/test_compile_fp8_gpu.py",))
    benchmark(run, "benchmark", tuple(os.environ.get("GPU_KIT_BENCH_ARGS", "").split()))
    benchmark(run, "benchmark_moe", MOE_ARGS)
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
    run.add_argument("--resume", action="store_true",
                     help="a second pass on the warm machine: stages an earlier pass finished are kept, not rerun")
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
