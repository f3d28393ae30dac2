"""The GPU kit carries the accelerate and transformers the CPU suite pins (issue 48 item 3): ``[carried]`` in
gpu_kit/pins.toml names them (and what they need that the GPU machine's image lacks) with PyPI's sha256, and
``kit.install`` puts them into the kit's site always, even where the machine has the module, ahead of the
machine's own site-packages. No network: the planning with a faked module lookup, the install with a recording
pip, and one real ``pip install --no-index --no-deps --target`` of two tiny wheels made here.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpu_kit import kit

ROOT = Path(__file__).resolve().parents[2]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def suite_pins() -> dict[str, str]:
    """``PINS`` of scripts/version_matrix.py (read, not imported): the versions the suite is written against."""
    tree = ast.parse((ROOT / "scripts" / "version_matrix.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PINS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("scripts/version_matrix.py has no PINS")


def setup_sh_pins() -> dict[str, str]:
    """The ``name==version`` requirements scripts/setup.sh installs into the suite's .venv."""
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', (ROOT / "scripts" / "setup.sh").read_text()))


# -- the pins ---------------------------------------------------------------------------------------------------
def test_carried_accelerate_and_transformers_are_the_suites_pins():
    pins, carried = suite_pins(), kit.carried_pins()
    for name in ("accelerate", "transformers"):
        assert setup_sh_pins()[name] == pins[name], f"scripts/setup.sh and version_matrix.py PINS disagree on {name}"
        assert carried[name]["version"] == pins[name], (name, carried[name], pins[name])


def test_the_dry_run_venv_has_the_suites_accelerate_and_transformers():
    packages = dict(p.split("==", 1) for p in kit.load_pins()["dry_run"]["packages"] if "==" in p)
    assert packages["accelerate"] == suite_pins()["accelerate"]
    assert packages["transformers"] == suite_pins()["transformers"]


def test_every_carried_pin_names_its_wheel_for_the_gpu_machine_with_pypis_sha256():
    pins = kit.load_pins()
    tag = pins["target"]["python_tag"]  # cp312
    minor = int(tag[3:])
    carried = kit.carried_pins(pins)
    assert carried and len({pin["wheel"] for pin in carried.values()}) == len(carried)
    for name, pin in carried.items():
        assert re.fullmatch(r"[0-9a-f]{64}", pin["sha256"]), (name, pin["sha256"])
        assert isinstance(pin.get("size"), int) and pin["size"] > 0, name
        assert pin["wheel"].endswith(".whl"), name
        dist, version, python, abi, platform = pin["wheel"][:-4].split("-")
        assert _canonical(dist) == _canonical(name) and version == pin["version"], (name, pin)
        if platform == "any":  # pure Python
            assert python.startswith("py3") and abi == "none", pin["wheel"]
        else:  # binary: CPython 3.12 (or a stable-ABI wheel of an older minor), manylinux x86_64
            assert all(p.startswith("manylinux") and p.endswith("_x86_64") for p in platform.split(".")), pin["wheel"]
            assert (python, abi) == (tag, tag) or (abi == "abi3" and python.startswith("cp3")
                                                   and int(python[3:]) <= minor), pin["wheel"]


def test_the_carried_set_holds_what_transformers_requires_beyond_the_image():
    """The image (device KINDS.md) has huggingface_hub 1.33.0 and no kernels: transformers 5.25.0 requires
    huggingface-hub>=2.4.0,<3.0 (checked when transformers is imported) and kernels>=0.19.1,<0.20; hub 2.x
    requires httpx2 (httpcore2, truststore), kernels tomlkit; the image's tokenizers 0.23.2 caps hub <2.0."""
    carried = {_canonical(n): p["version"] for n, p in kit.carried_pins().items()}
    assert carried.keys() >= {"accelerate", "transformers", "huggingface-hub", "kernels", "tomlkit", "httpx2",
                              "httpcore2", "truststore", "tokenizers"}
    hub = tuple(int(v) for v in carried["huggingface-hub"].split("."))
    assert (2, 4, 0) <= hub < (3,)
    assert carried["kernels"].startswith("0.19.")
    assert carried["httpcore2"] == carried["httpx2"]  # httpx2 requires httpcore2 == its own version


# -- the planning ------------------------------------------------------------------------------------------------
def _manifest(pins: dict | None = None) -> dict:
    files = [{"path": "wheels/te_core.whl", "role": "te-core", "sha256": "0" * 64},
             {"path": "wheels/te_python.whl", "role": "te-python", "sha256": "1" * 64},
             {"path": "wheels/te_ext.whl", "role": "te-torch-ext", "sha256": "2" * 64},
             {"path": "wheels/te_torch.tar.gz", "role": "te-torch-sdist", "sha256": "3" * 64},
             {"path": "wheelhouse/pydantic-2.12.5-py3-none-any.whl", "role": "wheelhouse", "sha256": "4" * 64,
              "import_name": "pydantic"}]
    for name, pin in kit.carried_pins(pins).items():
        files.append({"path": f"carried/{pin['wheel']}", "role": "carried", "sha256": pin["sha256"], "source": "pypi",
                      "distribution": name, "version": pin["version"]})
    return {"files": files}


def _machine_has_everything(name):
    return importlib.util.spec_from_loader(name, loader=None)


def test_plan_chooses_every_carried_wheel_even_where_the_machine_has_the_module():
    manifest = _manifest()
    carried = [f["path"] for f in manifest["files"] if f["role"] == "carried"]
    for find_spec in (_machine_has_everything, lambda name: None):
        plan = kit.plan_install(manifest, find_spec=find_spec)
        assert [e["path"] for e in plan["carried"]] == carried
        assert [e["role"] for e in plan["te"]] == ["te-core", "te-python", "te-torch-ext"]
    assert kit.plan_install(manifest, find_spec=_machine_has_everything)["wheelhouse_missing"] == []
    assert len(kit.plan_install(manifest, find_spec=lambda name: None)["wheelhouse_missing"]) == 1


def test_install_pips_the_carried_wheels_although_the_machine_has_accelerate_and_transformers(tmp_path, monkeypatch):
    manifest = _manifest()
    extracted = {f["path"]: tmp_path / "unpacked" / f["path"] for f in manifest["files"]}
    calls = []
    monkeypatch.setattr(kit, "_pip", lambda args, log: calls.append(args))
    monkeypatch.setattr(importlib.util, "find_spec", _machine_has_everything)  # the lookup kit.install makes
    result = kit.install(manifest, extracted, site=tmp_path / "site")
    assert len(calls) == 1, calls  # the wheelhouse: the machine has pydantic here
    args = calls[0]
    assert args[:6] == ["install", "--no-index", "--no-deps", "--no-compile", "--target", str(tmp_path / "site")]
    for pin in kit.carried_pins().values():
        assert str(tmp_path / "unpacked" / "carried" / pin["wheel"]) in args, pin["wheel"]
    assert result["carried"] == {name: pin["version"] for name, pin in kit.carried_pins().items()}
    assert result["wheelhouse_installed"] == [] and len(result["wheelhouse_present"]) == 1
    assert result["te_wheels"] == ["te_core.whl", "te_python.whl", "te_ext.whl"]


def test_a_kit_without_the_carried_wheels_is_refused(tmp_path, monkeypatch):
    manifest = _manifest()
    manifest["files"] = [f for f in manifest["files"] if f["role"] != "carried" or "accelerate" not in f["path"]]
    monkeypatch.setattr(kit, "_pip", lambda args, log: pytest.fail("pip ran for a kit that lacks a carried wheel"))
    with pytest.raises(kit.KitError, match=r"accelerate .*rebuild"):
        kit.install(manifest, {}, site=tmp_path / "site")
    stale = _manifest()
    next(f for f in stale["files"] if f["role"] == "carried")["sha256"] = "f" * 64
    with pytest.raises(kit.KitError, match="rebuild"):
        kit.plan_install(stale)


# -- one real install of tiny wheels: the kit's site shadows the interpreter's own ------------------------------
def _tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of ``name`` whose module says it is the kit's."""
    dist_info = f"{name}-{version}.dist-info"
    members = {f"{name}/__init__.py": f"__version__ = {version!r}\nFROM_THE_KIT = True\n",
               f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
               f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for member, text in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(text.encode())}")
    members[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in members.items():
            archive.writestr(member, text)
    return path


def test_installed_kit_site_gives_the_carried_accelerate_and_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    versions = {name: suite_pins()[name] for name in ("accelerate", "transformers")}
    (tmp_path / "unpacked" / "carried").mkdir(parents=True)
    pins = {"carried": {}}
    for name, version in versions.items():
        wheel = _tiny_wheel(tmp_path / "unpacked" / "carried", name, version)
        pins["carried"][name] = {"version": version, "wheel": wheel.name, "sha256": kit.sha256_file(wheel),
                                 "size": wheel.stat().st_size}
    manifest = _manifest(pins)
    manifest["files"] = [f for f in manifest["files"] if f["role"] == "carried"]
    extracted = {f["path"]: tmp_path / "unpacked" / f["path"] for f in manifest["files"]}
    site = tmp_path / "site"
    result = kit.install(manifest, extracted, site=site, pins=pins)
    assert result["carried"] == versions
    env = kit.site_env(site, base={k: v for k, v in os.environ.items()
                                   if k != "PYTHONPATH" and not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8"))})
    code = ("import json, importlib.metadata as m, accelerate, transformers; print(json.dumps({n: [mod.__file__, "
            "getattr(mod, 'FROM_THE_KIT', False), m.version(n)] for n, mod in (('accelerate', accelerate), "
            "('transformers', transformers))}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for name, version in versions.items():
        path, from_kit, dist_version = seen[name]
        assert Path(path).is_relative_to(site) and from_kit, (name, path)  # ahead of this venv's own
        assert dist_version == version


def test_site_env_puts_the_kit_site_ahead_of_the_interpreters_site_packages(tmp_path):
    env = kit.site_env(tmp_path / "site", base={"PYTHONPATH": "/elsewhere", "PATH": os.environ.get("PATH", "")})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(kit.ROOT), str(tmp_path / "site"), "/elsewhere"]
