"""The kit builder (this machine, with network): ``python -m gpu_kit build``.

1. download the pinned wheels / sdist from PyPI into ``.gpu_kit/cache`` (sha256 checked against the pins);
2. download the wheelhouse (``[wheelhouse]``, for cp312 manylinux) and the carried wheels (``[carried]``: the
   suite's accelerate / transformers and what they need that the GPU machine lacks; sha256 checked as in 1.);
3. a venv of the target Python (3.12) with PyPI's torch 2.11.0 (CUDA 13.0 build) and the build tools;
4. build TE's torch extension there (``nice -n 19``, ``MAX_JOBS=1`` by default);
5. write the bundle tar, cut it into parts of at most ``[parts] max_mib`` MiB, and the manifest.

Each step keeps a stamp (the sha256 of the pins it depends on) and is skipped when its pins did not change.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

from gpu_kit.kit import KIT_DIR, KIT_FORMAT, MIB, PARTS_DIR, KitError, build_extension, carried_pins, \
    load_pins, pins_digest, sha256_file

CACHE = KIT_DIR / "cache"
BUILD = KIT_DIR / "build"
EXT_DIR = BUILD / "ext"
DEFAULT_VENV = KIT_DIR / "venv-cp312"
PYPI_SIMPLE = "https://pypi.org/simple/{project}/"


def say(message: str) -> None:
    print(f"[gpu_kit build] {message}", flush=True)


def _stamp_ok(path: Path, digest: str) -> bool:
    try:
        return json.loads(path.read_text()).get("digest") == digest
    except (OSError, ValueError):
        return False


def _pypi_url(filename: str) -> str:
    project = re.split(r"-\d", filename, maxsplit=1)[0].replace("_", "-").lower()
    request = urllib.request.Request(PYPI_SIMPLE.format(project=project),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    for entry in files:
        if entry["filename"] == filename:
            return entry["url"]
    raise KitError(f"{filename} is not on PyPI's index of {project}")


def fetch(filename: str, sha256: str, cache: Path = CACHE) -> Path:
    """The pinned file in the cache, downloaded from PyPI if absent; its sha256 must be the pinned one."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / filename
    if path.is_file() and sha256_file(path) == sha256:
        return path
    url = _pypi_url(filename)
    say(f"downloading {url}")
    partial = path.with_suffix(path.suffix + ".partial")
    with urllib.request.urlopen(url, timeout=120) as answer, open(partial, "wb") as out:
        shutil.copyfileobj(answer, out, 8 * MIB)
    digest = sha256_file(partial)
    if digest != sha256:
        partial.unlink()
        raise KitError(f"{filename}: PyPI served sha256 {digest}, gpu_kit/pins.toml pins {sha256}")
    partial.rename(path)
    return path


def fetch_wheelhouse(pins: dict) -> list[Path]:
    target = CACHE / "wheelhouse"
    stamp = target / "stamp.json"
    digest = pins_digest("target", "wheelhouse")
    if not _stamp_ok(stamp, digest):
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                 "manylinux2014_x86_64")]
        tag = pins["target"]["python_tag"]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                        pins["target"]["python"], "--implementation", "cp", f"--abi={tag}", "--abi=abi3", "--abi=none",
                        *platforms, "--platform=any", "-d", str(target), *pins["wheelhouse"]["requirements"]],
                       check=True)
        stamp.write_text(json.dumps({"digest": digest}))
    return sorted(target.glob("*.whl"))


def fetch_carried(pins: dict) -> list[tuple[str, dict, Path]]:
    """``[carried]``: each pinned wheel from PyPI into ``cache/carried`` (kept while its sha256 is the pinned one,
    checked on every build), as (distribution, pin, path)."""
    target = CACHE / "carried"
    fetched = []
    for name, pin in carried_pins(pins).items():
        path = fetch(pin["wheel"], pin["sha256"], cache=target)
        if "size" in pin and path.stat().st_size != pin["size"]:
            raise KitError(f"{pin['wheel']}: {path.stat().st_size} bytes, gpu_kit/pins.toml [carried] says "
                           f"{pin['size']}")
        fetched.append((name, pin, path))
    return fetched


def find_target_python(version: str) -> str:
    """An interpreter of the target version: $GPU_KIT_PYTHON, pyenv's, or pythonX.Y on PATH."""
    candidates = [os.environ.get("GPU_KIT_PYTHON", "")]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")), reverse=True)
    candidates += [shutil.which(f"python{version}") or "", f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                  capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if done.returncode == 0 and done.stdout.strip() == version:
            return candidate
    raise KitError(f"no Python {version} found (GPU_KIT_PYTHON, ~/.pyenv/versions/{version}*, python{version} on "
                   f"PATH): the extension must be built for the GPU machine's Python {version}")


def ensure_venv(pins: dict, venv: Path, torch_wheel: Path) -> Path:
    """The target Python's venv: torch (PyPI's CUDA 13.0 build, with its nvidia-* wheels: the headers the
    extension is compiled against), the build tools, and the GPU machine's Python packages for the dry run."""
    python = venv / "bin" / "python"
    stamp = venv / "gpu_kit_stamp.json"
    digest = pins_digest("target", "dry_run")
    if python.exists() and _stamp_ok(stamp, digest):
        return python
    if not python.exists():
        base = find_target_python(pins["target"]["python"])
        say(f"creating {venv} from {base}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    say(f"installing {torch_wheel.name} (and its nvidia-* CUDA 13 wheels) and {pins['dry_run']['packages']} in {venv}")
    subprocess.run(["nice", "-n", "19", str(python), "-m", "pip", "install", str(torch_wheel), "setuptools<82", "wheel",
                    "packaging", "ninja", *pins["dry_run"]["packages"]], check=True)
    stamp.write_text(json.dumps({"digest": digest}))
    return python


def glibc_needs(wheel: Path) -> dict:
    """The newest GLIBC_ / GLIBCXX_ symbol versions the wheel's shared objects name (what the GPU machine's C
    and C++ runtimes must provide)."""
    newest: dict[str, tuple] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if ".so" not in name:
                continue
            for found in re.findall(rb"(GLIBC(?:XX)?)_(\d+(?:\.\d+)+)", archive.read(name)):
                kind, version = found[0].decode(), tuple(int(v) for v in found[1].decode().split("."))
                newest[kind] = max(newest.get(kind, ()), version)
    return {kind: ".".join(map(str, version)) for kind, version in newest.items()}


def ensure_extension(pins: dict, python: Path, sdist: Path) -> dict:
    stamp = EXT_DIR / "stamp.json"
    digest = pins_digest("target", "transformer_engine", "build")
    wheels = list(EXT_DIR.glob("transformer_engine_torch-*.whl"))
    if wheels and _stamp_ok(stamp, digest):
        return json.loads(stamp.read_text())
    build = pins["build"]
    say(f"building TE's torch extension with {python} (jobs {build['jobs']}, nice {build['nice']}); "
        f"log {EXT_DIR / 'build.log'}")
    started = time.monotonic()
    wheel = build_extension(sdist, EXT_DIR, jobs=build["jobs"], nice=build["nice"], log_path=EXT_DIR / "build.log",
                            cuda_home=build["cuda_home"], python=str(python))
    info = {"digest": digest, "wheel": wheel.name, "build_seconds": round(time.monotonic() - started),
            "built_with": _toolchain(python), "needs": glibc_needs(wheel)}
    stamp.write_text(json.dumps(info, indent=1))
    return info


def _toolchain(python: Path) -> dict:
    versions = subprocess.run([str(python), "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__, "
                               "torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)"],
                              capture_output=True, text=True, check=True).stdout.split()
    gcc = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return {"python": versions[0], "torch": versions[1], "torch_cuda": versions[2], "cxx11_abi": versions[3],
            "compiler": gcc[0] if gcc else "?"}


def write_parts(pins: dict, files: list[dict], sources: dict[str, Path], extension: dict,
                parts_dir: Path = PARTS_DIR, build_dir: Path = BUILD) -> dict:
    """The bundle tar cut into parts, and the manifest; skipped when the same inputs made the current parts."""
    max_bytes = int(pins["parts"]["max_mib"] * MIB)
    inputs = json.dumps([KIT_FORMAT, pins_digest(), max_bytes, [(f["path"], f["sha256"]) for f in files]])
    inputs_digest = hashlib.sha256(inputs.encode()).hexdigest()
    manifest_path = parts_dir / "manifest.json"
    if manifest_path.is_file():
        current = json.loads(manifest_path.read_text())
        if current.get("inputs_sha256") == inputs_digest and all(
                (parts_dir / p["name"]).is_file() and (parts_dir / p["name"]).stat().st_size == p["size"]
                for p in current["parts"]):
            return current
    build_dir.mkdir(parents=True, exist_ok=True)
    bundle = build_dir / "bundle.tar"
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as archive:
        for entry in files:
            source = sources[entry["path"]]
            info = archive.gettarinfo(source, arcname=entry["path"])
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(source, "rb") as handle:
                archive.addfile(info, handle)
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    parts = []
    with open(bundle, "rb") as handle:
        while block := handle.read(max_bytes):
            name = f"part-{len(parts):02d}"
            (parts_dir / name).write_bytes(block)
            parts.append({"name": name, "size": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {
        "kit_format": KIT_FORMAT, "pins_sha256": pins_digest(), "inputs_sha256": inputs_digest,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "target": pins["target"],
        "transformer_engine": pins["transformer_engine"]["version"], "max_part_bytes": max_bytes,
        "carried": {f["distribution"]: f["version"] for f in files if f["role"] == "carried"},
        "bundle": {"size": bundle.stat().st_size, "sha256": sha256_file(bundle)}, "parts": parts, "files": files,
        "extension": {k: v for k, v in extension.items() if k != "digest"},
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    bundle.unlink()
    return manifest


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpu_kit build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPU_KIT_VENV", DEFAULT_VENV)),
                        help="venv of the target Python with the target torch (default %(default)s, or $GPU_KIT_VENV)")
    args = parser.parse_args(argv)
    pins = load_pins()
    te, target = pins["transformer_engine"], pins["target"]
    core = fetch(te["core_wheel"], te["core_sha256"])
    te_python = fetch(te["python_wheel"], te["python_sha256"])
    sdist = fetch(te["torch_sdist"], te["torch_sdist_sha256"])
    torch_wheel = fetch(target["torch_wheel"], target["torch_sha256"])
    wheelhouse = fetch_wheelhouse(pins)
    carried = fetch_carried(pins)
    python = ensure_venv(pins, args.venv.resolve(), torch_wheel)
    extension = ensure_extension(pins, python, sdist)
    extension["venv_python"] = str(python)
    ext_wheel = EXT_DIR / extension["wheel"]

    import_names = pins["wheelhouse"].get("import_names", {})
    files: list[dict] = []
    sources: dict[str, Path] = {}
    for role, path, origin in (("te-core", core, te["core_sha256"]), ("te-python", te_python, te["python_sha256"]),
                               ("te-torch-ext", ext_wheel, None), ("te-torch-sdist", sdist, te["torch_sdist_sha256"])):
        files.append({"path": f"wheels/{path.name}", "role": role, "size": path.stat().st_size,
                      "sha256": origin or sha256_file(path), "source": "pypi" if origin else "built here"})
        sources[files[-1]["path"]] = path
    for name, pin, wheel in carried:
        files.append({"path": f"carried/{wheel.name}", "role": "carried", "size": wheel.stat().st_size,
                      "sha256": pin["sha256"], "source": "pypi", "distribution": name, "version": pin["version"]})
        sources[files[-1]["path"]] = wheel
    for wheel in wheelhouse:
        project = wheel.name.split("-")[0].replace("_", "-").lower()
        files.append({"path": f"wheelhouse/{wheel.name}", "role": "wheelhouse", "size": wheel.stat().st_size,
                      "sha256": sha256_file(wheel), "source": "pypi",
                      "import_name": import_names.get(project, project.replace("-", "_"))})
        sources[files[-1]["path"]] = wheel
    manifest = write_parts(pins, files, sources, extension)
    for part in manifest["parts"]:
        say(f"{part['name']}: {part['size'] / MIB:.1f} MiB  sha256 {part['sha256']}")
    say(f"{len(manifest['parts'])} parts, bundle {manifest['bundle']['size'] / MIB:.1f} MiB, manifest "
        f"{PARTS_DIR / 'manifest.json'}; extension built in {extension['build_seconds']} s; "
        f"next: python -m gpu_kit plan")
    return 0
