"""Paths, pins, manifest, reassembly, verification and installation of the kit (standard library only: this
runs under the GPU machine's interpreter before anything is installed, and in the CPU dry run).

Bundle layout: one uncompressed tar (the wheels are already compressed; xz -6 saved 2.4 % on a 32 MiB slice of
TE's CUDA library) of ``wheels/`` (TE core, TE Python, TE torch extension built here, TE torch sdist for a
rebuild on the GPU machine), ``carried/`` (``[carried]``: the accelerate and transformers the CPU suite pins and
what they need that the machine lacks, always installed, ahead of the machine's own) and ``wheelhouse/`` (small
wheels installed only where the module is missing), cut into parts of at most ``[parts] max_mib`` MiB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

KIT_FORMAT = 1
ROOT = Path(__file__).resolve().parent.parent  # the repository root
PINS_FILE = Path(__file__).resolve().parent / "pins.toml"
KIT_DIR = Path(os.environ.get("GPU_KIT_DIR", ROOT / ".gpu_kit"))  # git-ignored
PARTS_DIR = KIT_DIR / "parts"
MANIFEST = PARTS_DIR / "manifest.json"
WORK_DIR = Path(os.environ.get("GPU_KIT_WORK", KIT_DIR))  # where the bundle is unpacked and installed
UNPACKED = WORK_DIR / "unpacked"
SITE = WORK_DIR / "site"
MIB = 1 << 20
TE_ROLES = ("te-core", "te-python", "te-torch-ext")


class KitError(RuntimeError):
    """A kit that is missing, incomplete or does not verify; the message names the file and the remedy."""


def sha256_file(path: Path, chunk: int = 8 * MIB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def load_pins(path: Path = PINS_FILE) -> dict:
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def pins_digest(*sections: str, path: Path = PINS_FILE) -> str:
    """sha256 of the named pins sections (all when none), with the kit format: a step is redone when it changes."""
    pins = load_pins(path)
    chosen = {name: pins[name] for name in (sections or sorted(pins))}
    return hashlib.sha256(json.dumps([KIT_FORMAT, chosen], sort_keys=True).encode()).hexdigest()


def te_distributions(pins: dict | None = None) -> list[str]:
    """The distributions the pins install, by each TE file's name up to its version (``transformer_engine_cu13``)."""
    te = (pins or load_pins())["transformer_engine"]
    return [te[key].split("-", 1)[0] for key in ("python_wheel", "core_wheel", "torch_sdist")]


def carried_pins(pins: dict | None = None) -> dict[str, dict]:
    """``[carried]``: {distribution: {version, wheel, size, sha256}}, the wheels always installed into the site."""
    return dict((load_pins() if pins is None else pins).get("carried", {}))


def load_manifest(path: Path = MANIFEST) -> dict:
    if not path.is_file():
        raise KitError(f"no kit manifest at {path}: build the kit with `python -m gpu_kit build` (on a machine "
                       "with network), and carry .gpu_kit/parts/manifest.json with the last device command")
    manifest = json.loads(path.read_text())
    if manifest.get("kit_format") != KIT_FORMAT:
        raise KitError(f"{path}: kit format {manifest.get('kit_format')}, this gpu_kit reads {KIT_FORMAT}: rebuild")
    return manifest


def verify_part(manifest: dict, index: int, parts_dir: Path = PARTS_DIR) -> dict:
    entry = manifest["parts"][index]
    path = parts_dir / entry["name"]
    if not path.is_file():
        raise KitError(f"kit part {entry['name']} ({index + 1} of {len(manifest['parts'])}) is missing from "
                       f"{parts_dir}: its device command (`python -m gpu_kit plan`) carries it; rerun that one")
    size = path.stat().st_size
    if size != entry["size"]:
        raise KitError(f"kit part {entry['name']}: {size} bytes, the manifest says {entry['size']} (a broken "
                       "transfer, or a part from another build): carry it again")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise KitError(f"kit part {entry['name']}: sha256 {digest}, the manifest says {entry['sha256']}: carry it again")
    return entry


class _ConcatenatedParts:
    """The parts, read back to back as one stream, hashed as they are read."""

    def __init__(self, paths: list[Path]):
        self._paths = list(paths)
        self._handle = None
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        chunks = []
        wanted = size
        while wanted != 0:
            if self._handle is None:
                if not self._paths:
                    break
                self._handle = open(self._paths.pop(0), "rb")
            block = self._handle.read(wanted if wanted > 0 else -1)
            if not block:
                self._handle.close()
                self._handle = None
                continue
            chunks.append(block)
            if wanted > 0:
                wanted -= len(block)
        data = b"".join(chunks)
        self.digest.update(data)
        self.size += len(data)
        return data


def assemble(manifest: dict | None = None, parts_dir: Path = PARTS_DIR, dest: Path = UNPACKED) -> dict[str, Path]:
    """Verify every part, stream them through tar into ``dest`` and verify every file and the whole bundle.
    Returns {manifest path: extracted path}."""
    manifest = manifest or load_manifest(parts_dir / "manifest.json")
    entries = [verify_part(manifest, i, parts_dir) for i in range(len(manifest["parts"]))]
    expected = {f["path"]: f for f in manifest["files"]}
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    stream = _ConcatenatedParts([parts_dir / e["name"] for e in entries])
    extracted: dict[str, Path] = {}
    with tarfile.open(fileobj=stream, mode="r|") as bundle:
        for member in bundle:
            if member.name not in expected or not member.isfile():
                raise KitError(f"kit bundle holds {member.name!r}, which its manifest does not list")
            target = dest / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            source = bundle.extractfile(member)
            with open(target, "wb") as out:
                while block := source.read(8 * MIB):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != expected[member.name]["sha256"]:
                raise KitError(f"{member.name}: sha256 {digest.hexdigest()}, manifest {expected[member.name]['sha256']}")
            extracted[member.name] = target
        while stream.read(MIB):  # tar's end padding: the whole bundle is hashed
            pass
    missing = sorted(set(expected) - set(extracted))
    if missing:
        raise KitError(f"kit bundle lacks {missing}")
    bundle_entry = manifest["bundle"]
    if (stream.size, stream.digest.hexdigest()) != (bundle_entry["size"], bundle_entry["sha256"]):
        raise KitError(f"kit bundle: {stream.size} bytes sha256 {stream.digest.hexdigest()}, manifest "
                       f"{bundle_entry['size']} bytes sha256 {bundle_entry['sha256']}")
    return extracted


SITECUSTOMIZE = '''"""Written by gpu_kit: makes this ``pip --target`` folder a site directory, so that its .pth files run
(accel_fp8_fix.pth: the accelerate config flag and ACCEL_FP8_FIX=1 reach every worker), then hands over
to the interpreter's own sitecustomize, if it has one."""
import importlib.util as _util
import os as _os
import site as _site
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_site.addsitedir(_here)
for _path in [p for p in _sys.path if p and _os.path.abspath(p) != _here]:
    _spec = _util.spec_from_file_location("_gpu_kit_chained_sitecustomize", _os.path.join(_path, "sitecustomize.py"))
    if _spec is not None and _os.path.isfile(_spec.origin):
        _spec.loader.exec_module(_util.module_from_spec(_spec))
        break
'''


def _pip(args: list[str], log: list[str]) -> None:
    command = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    log.append("$ " + " ".join(command) + "\n" + done.stdout + done.stderr)
    if done.returncode:
        raise KitError(f"pip failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def check_carried(manifest: dict, pins: dict | None = None) -> list[dict]:
    """The manifest's ``carried`` files, one per ``[carried]`` pin with the pinned wheel and sha256; a kit built
    before (or without) those pins is refused: it would answer with the machine's accelerate / transformers."""
    carried = {e["path"]: e for e in manifest["files"] if e["role"] == "carried"}
    chosen, problems = [], []
    for name, pin in carried_pins(pins).items():
        entry = carried.get(f"carried/{pin['wheel']}")
        if entry is None or entry["sha256"] != pin["sha256"]:
            problems.append(f"{name} {pin['version']} ({pin['wheel']})")
        else:
            chosen.append(entry)
    if problems:
        raise KitError(f"the kit does not carry {', '.join(problems)} as gpu_kit/pins.toml [carried] pins them: "
                       "rebuild it with `python -m gpu_kit build` and carry the new parts")
    return chosen


def plan_install(manifest: dict, skip_roles: tuple[str, ...] = (), all_wheelhouse: bool = False,
                 find_spec=None, pins: dict | None = None) -> dict[str, list[dict]]:
    """Which manifest files ``install`` puts into the site: TE's wheels (less ``skip_roles``); every ``[carried]``
    wheel, always, whether or not this interpreter has the module (the suite's accelerate / transformers replace
    the machine's); the wheelhouse wheels whose import name ``find_spec`` does not find (all of them with
    ``all_wheelhouse``; ``find_spec`` defaults to this interpreter's ``importlib.util.find_spec``)."""
    find_spec = find_spec or importlib.util.find_spec
    by_role: dict[str, list[dict]] = {}
    for entry in manifest["files"]:
        by_role.setdefault(entry["role"], []).append(entry)
    wheelhouse = by_role.get("wheelhouse", [])
    missing = [e for e in wheelhouse if all_wheelhouse or find_spec(e["import_name"]) is None]
    return {"te": [e for role in TE_ROLES if role not in skip_roles for e in by_role.get(role, [])],
            "carried": check_carried(manifest, pins),
            "wheelhouse_missing": missing, "wheelhouse_present": [e for e in wheelhouse if e not in missing]}


def install(manifest: dict, extracted: dict[str, Path], site: Path = SITE, log: list[str] | None = None,
            skip_roles: tuple[str, ...] = (), all_wheelhouse: bool = False, pins: dict | None = None) -> dict:
    """``pip install --no-index --no-deps --target site`` of TE's wheels and the ``[carried]`` wheels (always),
    then of the wheelhouse wheels whose module this interpreter lacks (all of them with ``all_wheelhouse``: the
    dry run, whose venv has them); the .pth trampoline of this package and a sitecustomize that reads it."""
    log = log if log is not None else []
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    plan = plan_install(manifest, skip_roles=skip_roles, all_wheelhouse=all_wheelhouse, pins=pins)
    first = [str(extracted[e["path"]]) for e in plan["te"] + plan["carried"]]
    if first:
        _pip(["install", "--no-index", "--no-deps", "--no-compile", "--target", str(site), *first], log)
    missing = plan["wheelhouse_missing"]
    if missing:
        _pip(["install", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
              *(str(extracted[e["path"]]) for e in missing)], log)
    shutil.copy2(ROOT / "accel_fp8_fix.pth", site / "accel_fp8_fix.pth")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"te_wheels": [Path(e["path"]).name for e in plan["te"]],
            "carried": {e["distribution"]: e["version"] for e in plan["carried"]},
            "wheelhouse_installed": [e["path"] for e in missing],
            "wheelhouse_present": [e["path"] for e in plan["wheelhouse_present"]]}


def site_env(site: Path = SITE, base: dict | None = None) -> dict:
    """Environment for a process that uses the installed kit: the repository and the kit's site first
    (``PYTHONPATH`` comes ahead of the interpreter's site-packages on ``sys.path``, so the ``[carried]``
    accelerate / transformers shadow the machine's own, for ``accelerate launch`` workers too)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(site), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


IMPORT_PROBE = r'''
import json, sys
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    from importlib.metadata import PackageNotFoundError, version
    out["te_distributions"] = {}
    for name in sys.argv[1:]:  # the pins' TE distributions, as this site holds them
        try:
            out["te_distributions"][name] = version(name)
        except PackageNotFoundError:
            out["te_distributions"][name] = None
    import transformer_engine
    out["transformer_engine_file"] = transformer_engine.__file__
    import transformer_engine.pytorch as te  # loads TE's core library, then the torch extension
    out["extension_file"] = getattr(sys.modules.get("transformer_engine_torch"), "__file__", None)
    out["te_version"] = version("transformer_engine")
    import accelerate, transformers  # what the tests and rank jobs import: the kit's [carried] releases
    out["accelerate"], out["transformers"] = accelerate.__version__, transformers.__version__
    out["import"] = "ok"
    if out["cuda_available"]:
        for name in ("is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available"):
            fn = getattr(te, name, None)
            if fn is not None:
                ok, why = fn(return_reason=True)
                out[name] = [bool(ok), str(why)]
        out["device"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
        tex = sys.modules.get("transformer_engine_torch")
        for key, name in (("te_cublaslt", "get_cublasLt_version"), ("te_cudnn", "get_cudnn_version")):
            try:  # what TE itself reads; a failure here is recorded, the import stays "ok"
                out[key] = int(getattr(tex, name)())
            except Exception as exc:
                out[key] = f"unread: {type(exc).__name__}: {exc}"
except BaseException as exc:
    out["import"] = f"{type(exc).__name__}: {exc}"
print("GPU_KIT_IMPORT " + json.dumps(out))
'''


def import_probe(site: Path = SITE, python: str = sys.executable, extra_env: dict | None = None,
                 timeout: float = 300) -> dict:
    """Import transformer_engine.pytorch in a fresh process over the kit's site; the pins' TE distributions as
    that site holds them; FP8 support and TE's own cuBLASLt / cuDNN readings where CUDA is."""
    env = site_env(site)
    env.update(extra_env or {})
    done = subprocess.run([python, "-c", IMPORT_PROBE, *te_distributions()], capture_output=True, text=True, env=env,
                          timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("GPU_KIT_IMPORT "):
            result = json.loads(line[len("GPU_KIT_IMPORT "):])
            result["stderr_tail"] = done.stderr[-3000:]
            return result
    return {"import": f"probe process failed ({done.returncode})", "stderr_tail": done.stderr[-3000:]}


def nvidia_include_dirs() -> list[str]:
    """CUDA / cuDNN / NCCL / cuBLAS headers of this interpreter's nvidia-* wheels (torch's dependencies)."""
    dirs = []
    for entry in sys.path:
        nvidia = Path(entry or ".") / "nvidia"
        if nvidia.is_dir():
            dirs += sorted(str(p / "include") for p in nvidia.iterdir() if (p / "include").is_dir())
    return dirs


def build_extension(sdist: Path, out_dir: Path, jobs: int, nice: bool = False, log_path: Path | None = None,
                    cuda_home: str | None = None, python: str = sys.executable, work_dir: Path | None = None) -> Path:
    """Build TE's torch extension wheel from its sdist with ``python`` (its torch), no GPU needed: headers from
    the CUDA toolkit (``cuda_home``: nvcc, crt/) and, after it, the nvidia-* wheels (cuBLAS, cuDNN, NCCL).
    The source tree is kept in ``work_dir``: an interrupted build resumes (ninja) where it stopped."""
    cuda_home = cuda_home or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    work_dir = work_dir or out_dir.parent / "src"
    source = work_dir / sdist.name.removesuffix(".tar.gz")
    if not source.is_dir():
        work_dir.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(work_dir, filter="data")
    include = subprocess.run([python, "-c", "from gpu_kit.kit import nvidia_include_dirs as n; print(':'.join(n()))"],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    # NVTE_NO_LOCAL_VERSION: TE would append the git commit of whatever repository it is built in (this one)
    # to its version, and TE's loader refuses an extension whose version differs from the core wheel's.
    env = dict(os.environ, MAX_JOBS=str(jobs), NVTE_PYTORCH_FORCE_BUILD="TRUE", NVTE_FRAMEWORK="pytorch",
               NVTE_NO_LOCAL_VERSION="1", CUDA_HOME=cuda_home, CPATH=":".join(p for p in (include.stdout.strip(), os.environ.get("CPATH")) if p))
    env.pop("NVTE_BUILD_USE_NVIDIA_WHEELS", None)  # the toolkit's headers first: the wheels lack crt/host_defines.h
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("transformer_engine_torch-*.whl"):
        old.unlink()
    command = (["nice", "-n", "19"] if nice else []) + [python, "-m", "pip", "wheel", "-v", "--no-build-isolation",
                                                        "--no-deps", "--no-index", "-w", str(out_dir), str(source)]
    with open(log_path or os.devnull, "w") as log:
        done = subprocess.run(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:  # the source tree stays: the next run resumes
        raise KitError(f"building TE's torch extension failed ({done.returncode}); log: {log_path}")
    shutil.rmtree(source, ignore_errors=True)  # TE's setup.py removes its build_tools after a wheel: not reusable
    return next(out_dir.glob("transformer_engine_torch-*.whl"))
