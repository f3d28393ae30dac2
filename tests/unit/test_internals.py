"""accel_fp8_fix/internals/: each module's ``check(versions)`` names a missing internal and the installed version;
Transformer Engine's internals and forks live in one subpackage, a module per job, whose declarations are all
gathered by its check (or by the check of the opt-in path that needs them)."""

import pathlib
import subprocess
import sys

import pytest

from accel_fp8_fix import internals
from accel_fp8_fix.engine.versions import installed_versions
from accel_fp8_fix.internals import torch_internals
from accel_fp8_fix.internals import transformer_engine as te_internals

VERSIONS = installed_versions(internals.DISTRIBUTIONS)
TE = VERSIONS.get("transformer-engine")
needs_te = pytest.mark.skipif(TE is None, reason="transformer-engine not installed")


def test_every_module_takes_the_versions_and_imports_nothing_from_the_engine():
    assert "transformer_engine" in internals.MODULES and "torch_internals" in internals.MODULES
    for path in pathlib.Path(internals.__file__).parent.rglob("*.py"):
        source = path.read_text()
        assert "..engine" not in source and "accel_fp8_fix.engine" not in source, path.name
    assert internals.check(internals.MODULES, VERSIONS) == []


def test_an_unknown_module_is_named():
    assert internals.check(["nope"], VERSIONS) == [
        f"unknown internals module 'nope' (known: {', '.join(internals.MODULES)})"]


@needs_te
def test_a_missing_te_internal_is_named_with_the_te_version(monkeypatch):
    monkeypatch.setattr(te_internals.recipes, "_SOURCES",
                        te_internals.recipes._SOURCES + (("pytorch/utils.py", "def get_device_compute_capability_renamed("),))
    assert te_internals.check(VERSIONS) == [
        f"transformer-engine {TE}: internal 'def get_device_compute_capability_renamed(' is gone from "
        "transformer_engine/pytorch/utils.py"]


@needs_te
def test_a_te_file_that_is_gone_is_named(monkeypatch):
    monkeypatch.setattr(te_internals.recipes, "_SOURCES", (("pytorch/no_such_module.py", "def f("),))
    assert te_internals.check(VERSIONS) == [f"transformer-engine {TE}: transformer_engine/pytorch/no_such_module.py is gone"]


@needs_te
def test_a_fork_with_neither_side_present_is_named(monkeypatch):
    forks = (("FP8GlobalStateManager (in quantization.py or fp8.py)",
              (("pytorch/quantization.py", "class FP8GlobalStateManagerX"), ("pytorch/fp8.py", "class FP8GlobalStateManagerX"))),)
    monkeypatch.setattr(te_internals.recipes, "_FORKS", forks)
    (problem,) = te_internals.check(VERSIONS)
    assert problem.startswith(f"transformer-engine {TE}: internal FP8GlobalStateManager (in quantization.py or fp8.py) is gone")
    assert "'class FP8GlobalStateManagerX' in transformer_engine/pytorch/quantization.py" in problem


@needs_te
def test_the_pickle_guard_internals_are_checked_only_on_a_te_that_has_the_guard(monkeypatch):
    guard_file, sources = te_internals.checkpoint._GUARDED
    guard = sources + ((guard_file, "def _classify_extra_state_pickle_renamed("),)
    monkeypatch.setattr(te_internals.checkpoint, "_GUARDED", (guard_file, guard))
    (problem,) = te_internals.check(VERSIONS)
    assert f"transformer-engine {TE}: internal 'def _classify_extra_state_pickle_renamed('" in problem
    monkeypatch.setattr(te_internals.checkpoint, "_GUARDED", ("pytorch/_extra_state_absent.py", guard))  # a TE < 2.18
    assert te_internals.check(VERSIONS) == []


# The declarations of TE's subpackage checked when the paths that need them are asked for, not when a set applies.
TE_ON_DEMAND = {"modules.GROUPED_WEIGHT_SOURCES": "grouped_views_missing",
                "float8_tensors.FP8_ALL_GATHER_SOURCES": "fp8_all_gather_missing",
                "float8_tensors.FP8_ALL_GATHER_BLOCK_SOURCES": "fp8_all_gather_missing"}


def test_every_te_source_declaration_is_gathered_by_a_check():
    """Split by job, TE's internals are declared in several modules: each declaration is one check() gathers (a
    module of JOBS, as _SOURCES / _FORKS / _GUARDED) or one an opt-in path's check reads (TE_ON_DEMAND)."""
    import importlib
    import inspect

    folder = pathlib.Path(te_internals.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted(
        ["__init__", "checkpoint", "float8_tensors", "installed", "modules", "recipes", "scaling"])
    gathered = {"_SOURCES", "_FORKS", "_GUARDED"}
    for path in folder.glob("*.py"):
        module = importlib.import_module(f"{te_internals.__name__}.{path.stem}" if path.stem != "__init__"
                                         else te_internals.__name__)
        for name in (n for n in vars(module) if n.endswith(("SOURCES", "FORKS", "GUARDED"))):
            if path.stem == "__init__" or vars(module)[name] is getattr(te_internals.checkpoint, "_GUARD_SOURCES"):
                continue  # re-exports; the guard's sources are declared through _GUARDED
            key = f"{path.stem}.{name}"
            if key in TE_ON_DEMAND:
                checker = getattr(module, TE_ON_DEMAND[key])
                assert name in inspect.getsource(checker), key
            else:
                assert name in gathered and module in te_internals.installed.JOBS, key
    assert te_internals.checkpoint._GUARDED[1] is te_internals.checkpoint._GUARD_SOURCES


def test_no_te_installed_means_nothing_to_check(monkeypatch):
    monkeypatch.setattr(internals, "package_root", lambda name: None)
    assert te_internals.check({"torch": VERSIONS["torch"], "transformer-engine": None}) == []


def test_te_version_is_read_under_either_distribution_name():
    assert te_internals.te_version({"transformer_engine": "2.8.0"}) == "2.8.0"
    assert te_internals.te_version({"transformer-engine": "2.20.2"}) == "2.20.2"
    assert te_internals.te_version({}) is None


def test_a_missing_torch_internal_is_named_with_the_torch_version(monkeypatch):
    monkeypatch.setattr(torch_internals, "_SOURCES", (("distributed/_composable_state.py", "class _StateRenamed"),))
    assert torch_internals.check(VERSIONS) == [
        f"torch {VERSIONS['torch']}: internal 'class _StateRenamed' is gone from torch/distributed/_composable_state.py"]


def test_a_changed_context_parallel_internal_is_named_and_refuses_the_rehearsal_set(monkeypatch):
    from accel_fp8_fix.engine.declarations import load_patch_sets
    from accel_fp8_fix.internals import torch_context_parallel

    (rehearsal,) = [s for s in load_patch_sets() if s.kind == "rehearsal"]
    assert "torch_context_parallel" in rehearsal.internals  # checked whenever the rehearsal is applied
    assert torch_context_parallel.check(VERSIONS) == []
    monkeypatch.setattr(torch_context_parallel, "_SOURCES", (
        ("distributed/tensor/experimental/_context_parallel/_attention.py", "\ncustom_ops_renamed = {\n"),))
    assert internals.check(rehearsal.internals, VERSIONS) == [
        f"torch {VERSIONS['torch']}: internal '\\ncustom_ops_renamed = {{\\n' is gone from "
        "torch/distributed/tensor/experimental/_context_parallel/_attention.py"]


def test_torch_internals_recognise_what_they_name():
    from torch.distributed.tensor import Shard

    assert not torch_internals.is_strided_shard(Shard(0))
    assert not torch_internals.is_composable_state(object())
    assert torch_internals.checkpoint_wrapper_type().__name__ == "CheckpointWrapper"


@needs_te
def test_a_renamed_te_internal_refuses_the_whole_set_naming_it_and_the_te_version():
    """The real set, applied at ``import accelerate`` in a fresh interpreter, with one TE internal renamed."""
    probe = (
        "import json\n"
        "import accel_fp8_fix.internals.transformer_engine as t\n"
        "t.recipes._SOURCES += (('pytorch/distributed.py', 'def checkpoint_renamed('),)\n"
        "import accel_fp8_fix, accelerate\n"
        "print(json.dumps({'patch_set': accel_fp8_fix.active_patch_set(), 'error': accel_fp8_fix.report().error}))\n"
        "import sys; print(json.dumps('transformer_engine' in sys.modules))\n"
    )
    import json
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8"))}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    got, te_imported = json.loads(lines[-2]), json.loads(lines[-1])
    assert got["patch_set"] is None
    assert (f"transformer-engine {TE}: internal 'def checkpoint_renamed(' is gone from "
            "transformer_engine/pytorch/distributed.py") in got["error"]
    assert not te_imported  # the check reads TE's source, it never imports TE


# -- hashed torch functions (issue 32 item 3): "unchanged", not only "still mentioned" -----------------------------
def _fsdp2_copy(tmp_path):
    from accel_fp8_fix.internals import package_root
    from accel_fp8_fix.internals.torch_fsdp2 import FSDP2_FOLDER

    source = package_root("torch") / FSDP2_FOLDER
    copy = tmp_path / "_fully_shard"
    copy.mkdir()
    for name in ("_fsdp_param.py", "_fsdp_param_group.py", "_fsdp_state.py", "_fsdp_common.py"):
        (copy / name).write_text((source / name).read_text())
    return copy


def test_the_installed_torchs_watched_functions_hash_to_its_own_recorded_release(tmp_path):
    from importlib.metadata import version

    from accel_fp8_fix.internals import block_sha256
    from accel_fp8_fix.internals.torch_fsdp2 import FP8_ALL_GATHER_HASHED, HASHED

    installed = version("torch").split("+")[0]
    copy = _fsdp2_copy(tmp_path)
    for (name, qualname), known in {**HASHED, **FP8_ALL_GATHER_HASHED}.items():
        assert installed in known, f"{qualname}: no hash recorded for the suite's torch {installed}"
        assert block_sha256((copy / name).read_text(), qualname) == known[installed], qualname


_BODY_WITH_A_SHALLOW_STRING = """\
class Accelerator:
    def __init__(self, x):
        doc = \"\"\"a message
whose second line starts at column 0\"\"\"
        self.x = x{tail}
        # a trailing comment inside the block

    def other(self):
        return 1
"""


def test_a_def_block_runs_past_a_string_line_at_column_0():
    """A multi-line string with a shallow line ends no block early: code after it is hashed (accelerate 1.16's
    ``Accelerator.__init__`` / ``PartialState._prepare_backend`` hashed the same as 1.15's before)."""
    from accel_fp8_fix.internals import block_sha256

    before = block_sha256(_BODY_WITH_A_SHALLOW_STRING.format(tail=""), "Accelerator.__init__")
    after = block_sha256(_BODY_WITH_A_SHALLOW_STRING.format(tail=" + 1"), "Accelerator.__init__")
    assert before is not None and before != after
    # the block is its def line through its trailing comment, not the next method
    other = block_sha256(_BODY_WITH_A_SHALLOW_STRING.format(tail=""), "Accelerator.other")
    assert other == block_sha256("class Accelerator:\n    def other(self):\n        return 1\n", "Accelerator.other")


def test_a_def_block_runs_past_a_signature_that_closes_at_the_def_indent():
    """``def f(\n    a,\n) -> None:`` closes its signature at the def's own indent: the body after it is hashed
    too. Under the old rule 143 of the 1,370 blocks in torch 2.13's FSDP2 and accelerate 1.16 ended early this
    way or the string's; none of the watched ones (their hashes hold on 2.11-2.15)."""
    from accel_fp8_fix.internals import block_sha256

    source = "def f(\n    a,\n) -> None:\n    return a{tail}\n"
    assert block_sha256(source.format(tail=""), "f") != block_sha256(source.format(tail=" + 1"), "f")


def test_a_changed_watched_function_is_named_where_a_string_check_still_passes(tmp_path):
    from accel_fp8_fix.internals import changed_blocks, missing_from_sources
    from accel_fp8_fix.internals.torch_fsdp2 import FP8_ALL_GATHER_HASHED, FP8_ALL_GATHER_SOURCES

    copy = _fsdp2_copy(tmp_path)
    assert changed_blocks(copy, FP8_ALL_GATHER_HASHED, "torch 9.9") == []
    text = (copy / "_fsdp_param.py").read_text()
    marker = "    def _init_extensions(self) -> None:\n"
    assert marker in text
    (copy / "_fsdp_param.py").write_text(text.replace(marker, marker + "        self._new_release_flag = True\n"))
    assert missing_from_sources(copy, FP8_ALL_GATHER_SOURCES, "torch 9.9") == []  # every string still there
    (problem,) = changed_blocks(copy, FP8_ALL_GATHER_HASHED, "torch 9.9")
    assert problem.startswith("torch 9.9: _fully_shard/_fsdp_param.py: FSDPParam._init_extensions changed (source "
                              "sha256 ") and "2.15.0 7bf883bb18abd559" in problem
    (copy / "_fsdp_param.py").write_text(text.replace(marker, ""))
    assert any("FSDPParam._init_extensions is gone" in p for p in changed_blocks(copy, FP8_ALL_GATHER_HASHED, "torch 9.9"))
