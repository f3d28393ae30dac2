"""Contract check: ``accel_fp8_fix.emulation`` against Transformer Engine's *published* Python source.

What is checked
    TE's pure-Python wheel (``transformer_engine-X-py3-none-any.whl``) is read straight from the zip
    (no install, no import of TE) and parsed with ``ast`` by ``tests/te_contract/extract.py``. Against
    the newest TE 2.x (``TE_2X``) the emulation must have: every constructor parameter of ``Linear``,
    ``LayerNorm``, ``RMSNorm``, ``LayerNormLinear`` (leading positional ones in TE's order, TE's defaults
    for the parameters in ``compare.CHECKED_DEFAULTS``); identical ``fp8_autocast`` / ``autocast``
    signatures; identical dataclass fields of ``DelayedScaling``, ``Float8CurrentScaling``,
    ``MXFP8BlockScaling`` and ``Format`` members; the ``fp8_meta`` keys of
    ``compare.FP8_META_REQUIRED`` (read from a real emulated module after one FP8 forward on CPU); and
    the module attributes of ``compare.MODULE_ATTRIBUTES_REQUIRED`` that TE's constructor sets. Against
    TE 1.x (``TE_1X``) only what the emulation keeps from 1.x: see the table in
    ``tests/te_contract/compare.py`` (``fp8_autocast`` signature, ``DelayedScaling`` fields, ``Format``).
    Other differences are printed as notes (``pytest -s``) and do not fail.
    The extractor itself is unit-tested on in-memory snippets, so that part runs offline too.

Wheels
    ``pip download --no-deps --only-binary=:all: transformer-engine==X`` into
    ``$ACCEL_FP8_FIX_TE_WHEELS`` (default ``~/.cache/accel_fp8_fix/te-wheels``); a cached wheel is
    reused without touching the registry. If pip cannot get it (offline; 120 s timeout) the
    comparison tests are skipped, with the reason.

How to refresh (when TE releases)
    ``pip index versions transformer-engine``; set ``ACCEL_FP8_FIX_TE_2X=<new version>`` (or ``latest``:
    resolved with ``pip index versions`` at test time) and run this file; to see what changed,
    ``python tests/te_contract/extract.py <old> <new>`` prints both contracts as JSON and
    ``python tests/te_contract/compare.py <2.x> <1.x>`` prints every difference with the emulation.
    Then bump ``TE_2X`` below (and the emulation's ``EMULATED_TE_VERSION``) together.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from te_contract import compare, emulated, extract, wheels  # noqa: E402

TE_2X = os.environ.get("ACCEL_FP8_FIX_TE_2X", "2.20.2")  # newest 2.x on PyPI when written
TE_1X = os.environ.get("ACCEL_FP8_FIX_TE_1X", "1.13.0")  # last 1.x


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def _contract_for(version: str):
    try:
        if version == "latest":
            version = wheels.newest_version(2)
        path = wheels.obtain_wheel(version)
    except wheels.RegistryUnavailable as exc:
        pytest.skip(f"cannot obtain the transformer-engine {version} wheel (registry unreachable?): {exc}")
    contract = extract.extract_contract(extract.SourceTree.from_archive(path))
    assert contract["version"], f"{path} has no version in its METADATA"
    return contract


@pytest.fixture(scope="session")
def te2():
    return _contract_for(TE_2X)


@pytest.fixture(scope="session")
def te1():
    return _contract_for(TE_1X)


@pytest.fixture(scope="session")
def emu():
    try:
        handle = emulated.load()
    except emulated.EmulationMissing as exc:
        pytest.skip(str(exc))
    try:
        yield emulated.emulated_contract(handle)
    finally:
        handle.close()


def _check(report: compare.Report) -> None:
    for note in report.notes:
        print("note:", note)
    assert not report.failures, "contract drift:\n  " + "\n  ".join(report.failures)


# ---------------------------------------------------------------------------------------------
# Extractor unit tests (offline)
# ---------------------------------------------------------------------------------------------

_SNIPPET = {
    "transformer_engine/__init__.py": "",
    "transformer_engine/common/__init__.py": "",
    "transformer_engine/common/recipe/__init__.py": textwrap.dedent('''
        import os
        from dataclasses import dataclass
        from enum import Enum
        from typing import ClassVar, NamedTuple

        class _FormatHelper(NamedTuple):
            max_fwd: float
            max_bwd: float

        class Format(Enum):
            E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
            E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
            HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)

        class Recipe:
            _cached: str = None          # not a dataclass: not a field

        @dataclass()
        class DelayedScaling(Recipe):
            margin: int = 0
            fp8_format: Format = Format.HYBRID
            kind: ClassVar[str] = "x"    # ClassVar: not a field
            override = os.getenv("X")     # unannotated: class attribute
            reduce_amax: bool = True
    '''),
    "transformer_engine/pytorch/__init__.py": textwrap.dedent('''
        from transformer_engine.pytorch.module import Linear
        from transformer_engine.pytorch.module import LayerNorm as LayerNorm
        from transformer_engine.pytorch.quantization import fp8_autocast, autocast
        RMSNorm = LayerNorm
    '''),
    "transformer_engine/pytorch/module/__init__.py": "from .linear import *\nfrom .norm import LayerNorm\n",
    "transformer_engine/pytorch/module/base.py": textwrap.dedent('''
        class Base(torch.nn.Module):
            def __init__(self, name=None):
                super().__init__()
                self.fp8_meta = {"fp8_checkpoint": False}
                self.fp8_meta["fp8_group"] = None
                self.fp8 = False
                self.set_group(None)

            def set_group(self, g):
                self.fast_setattr("tp_group", g)
                setattr(self, "tp_group_initialized", True)

            def init_fp8_metadata(self, num_gemms=1):
                meta = self.fp8_meta
                meta["recipe"] = object()
                meta["num_gemms"] = num_gemms
                self.fp8_meta.update({"fp8_max_fwd": 1})
                for key in ("scaling_fwd", "scaling_bwd"):
                    self.fp8_meta[key] = None
                k = "a" if num_gemms else "b"
                self.fp8_meta[k] = 1
                self.fp8_meta[self._key()] = 2
                self.fp8_meta[compute()] = 3

            def _key(self):
                return "from_method"
    '''),
    "transformer_engine/pytorch/module/linear.py": textwrap.dedent('''
        from typing import Optional
        from .base import Base as _Base
        __all__ = ["Linear"]

        class Linear(_Base):
            def __init__(self, in_features: int, out_features: int, /, bias: bool = True,
                         params_dtype: Optional[torch.dtype] = None, device="cuda",
                         init_method=torch.nn.init.zeros_, *, name: Optional[str] = None) -> None:
                super().__init__(name)
                self.in_features, self.out_features = in_features, out_features
    '''),
    "transformer_engine/pytorch/module/norm.py": textwrap.dedent('''
        from transformer_engine.pytorch.ops import Op

        class LayerNorm(Op):
            def __init__(self, normalized_shape=None, eps: float = 1e-5, **kwargs):
                self.sequence_parallel = None
                super().__init__(normalized_shape, eps=eps, **kwargs)
    '''),
    "transformer_engine/pytorch/ops/__init__.py": "from .basic import *\n",
    "transformer_engine/pytorch/ops/basic.py": textwrap.dedent('''
        class Op:
            def __init__(self, normalized_shape, *, eps=1e-5, device=None, dtype=None):
                self.eps = eps
    '''),
    "transformer_engine/pytorch/quantization.py": textwrap.dedent('''
        def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None,
                         fp8_group=None, _graph: bool = False):
            pass

        class autocast:
            def __init__(self, enabled=True, calibrating=False, recipe=None,
                         amax_reduction_group=None, _graph=False):
                pass

        class Manager:
            @classmethod
            def add(cls, fp8_meta):
                index = cls.get_buffer_info()
                fp8_meta[index] = []

            @classmethod
            def get_buffer_info(cls):
                return "buffer_index_and_autocast_key"
    '''),
}


@pytest.fixture(scope="module")
def snippet_contract():
    return extract.extract_contract(extract.SourceTree(_SNIPPET, version="0.0.test"))


def test_extract_constructor_params(snippet_contract):
    lin = snippet_contract["modules"]["Linear"]
    assert [p["name"] for p in lin["params"]] == [
        "in_features", "out_features", "bias", "params_dtype", "device", "init_method", "name"]
    kinds = {p["name"]: p["kind"] for p in lin["params"]}
    assert kinds["in_features"] == "POSITIONAL_ONLY" and kinds["name"] == "KEYWORD_ONLY"
    byname = {p["name"]: p for p in lin["params"]}
    assert byname["bias"]["default"] is True and byname["params_dtype"]["default"] is None
    assert byname["params_dtype"]["literal"] and byname["device"]["default"] == "cuda"
    assert not byname["init_method"]["literal"]
    assert byname["init_method"]["default_src"] == "torch.nn.init.zeros_"
    assert not byname["in_features"]["has_default"]
    assert lin["bases"] == ["Base"] and lin["kwargs_forwarded"] == []


def test_extract_follows_imports_star_and_rebinding(snippet_contract):
    ln, rms = snippet_contract["modules"]["LayerNorm"], snippet_contract["modules"]["RMSNorm"]
    assert ln["defined_at"] == rms["defined_at"] == "transformer_engine/pytorch/module/norm.py:4"
    # **kwargs forwarded to the base resolved through ops/__init__.py's star import
    assert ln["kwargs_forwarded"] == ["device", "dtype"]
    assert set(ln["init_attributes"]) == {"sequence_parallel", "eps"}


def test_extract_init_attributes(snippet_contract):
    attrs = snippet_contract["modules"]["Linear"]["init_attributes"]
    assert set(attrs) == {"fp8_meta", "fp8", "tp_group", "tp_group_initialized", "in_features", "out_features"}
    assert attrs["tp_group"].startswith("Base.set_group")


def test_extract_fp8_meta_keys(snippet_contract):
    meta = snippet_contract["fp8_meta"]
    assert meta["init"]["Linear"] == {"keys": ["fp8_checkpoint", "fp8_group"], "created_in": "Base.__init__"}
    assert set(meta["written_keys"]) == {
        "fp8_checkpoint", "fp8_group", "recipe", "num_gemms", "fp8_max_fwd", "scaling_fwd", "scaling_bwd",
        "a", "b", "from_method", "buffer_index_and_autocast_key"}
    assert len(meta["dynamic"]) == 1 and "compute()" in meta["dynamic"][0]


def test_extract_functions_recipes_format(snippet_contract):
    fns = snippet_contract["functions"]
    assert extract.param_names(fns["fp8_autocast"]) == ["enabled", "calibrating", "fp8_recipe", "fp8_group", "_graph"]
    assert extract.param_names(fns["autocast"]) == ["enabled", "calibrating", "recipe", "amax_reduction_group", "_graph"]
    ds = snippet_contract["recipes"]["DelayedScaling"]
    assert [f["name"] for f in ds["fields"]] == ["margin", "fp8_format", "reduce_amax"]
    assert ds["fields"][1]["default_src"] == "Format.HYBRID" and ds["class_attributes"] == ["override"]
    assert snippet_contract["recipes"]["MXFP8BlockScaling"] is None
    assert snippet_contract["format"]["HYBRID"]["max_fwd"] == 448
    assert snippet_contract["format"]["HYBRID"]["max_bwd"] == 57344


def test_compare_words_drift_per_version(snippet_contract):
    te_sig = snippet_contract["modules"]["Linear"]
    emu_sig = {"params": [
        {"name": "in_features", "kind": "POSITIONAL_OR_KEYWORD", "has_default": False},
        {"name": "out_features", "kind": "POSITIONAL_OR_KEYWORD", "has_default": False},
        {"name": "bias", "kind": "POSITIONAL_OR_KEYWORD", "has_default": True, "literal": True,
         "default": False, "default_src": "False"},
    ]}
    rep = compare.check_constructor("9.9", "Linear", te_sig, emu_sig)
    assert "TE 9.9 Linear.__init__ has parameter 'params_dtype' (default None) that the emulation lacks" in rep.failures
    assert "TE 9.9 Linear.__init__ parameter 'bias' has default True; the emulation's has default False" in rep.failures


# ---------------------------------------------------------------------------------------------
# TE wheels vs the emulation
# ---------------------------------------------------------------------------------------------


def test_wheels_are_pure_python_and_parse(te2, te1):
    for c in (te2, te1):
        assert c["origin"].endswith("-py3-none-any.whl"), c["origin"]
        missing = [n for n in extract.MODULE_CLASSES if c["modules"][n] is None]
        assert not missing, f"extractor found no {missing} in TE {c['version']}: update extract.py"
        assert c["functions"]["fp8_autocast"] is not None
    assert te2["functions"]["autocast"] is not None, f"TE {te2['version']} has no autocast: is it really 2.x?"
    assert {"recipe", "scaling_fwd", "num_gemms"} <= set(te2["fp8_meta"]["written_keys"]), te2["fp8_meta"]


@pytest.mark.parametrize("name", extract.MODULE_CLASSES)
def test_constructor_params(te2, emu, name):
    _check(compare.check_constructor(te2["version"], name, te2["modules"][name], emu["modules"][name]))


@pytest.mark.parametrize("name", extract.AUTOCAST_FUNCTIONS)
def test_autocast_signature(te2, emu, name):
    _check(compare.check_signature(te2["version"], name, te2["functions"][name], emu["functions"][name]))


@pytest.mark.parametrize("name", extract.RECIPE_CLASSES)
def test_recipe_fields(te2, emu, name):
    _check(compare.check_recipe(te2["version"], name, te2["recipes"][name], emu["recipes"][name]))


def test_format_members(te2, emu):
    _check(compare.check_format(te2["version"], te2["format"], emu["format"]))


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear"])
def test_fp8_meta_keys(te2, emu, name):
    _check(compare.check_fp8_meta(te2["version"], name, te2, emu["runtime"].get(name)))


@pytest.mark.parametrize("name", extract.MODULE_CLASSES)
def test_module_attributes(te2, emu, name):
    _check(compare.check_attributes(te2["version"], name, te2["modules"][name], emu["runtime"].get(name)))


def test_v1_kept_contract(te1, emu):
    """TE 1.x: only the rows of compare.py's 1.x table (fp8_autocast, DelayedScaling, Format)."""
    assert te1["version"].startswith("1."), te1["version"]
    dropped_but_present = [f for f in compare.V1_FIELDS_DROPPED["DelayedScaling"]
                           if f not in extract.param_names({"params": te1["recipes"]["DelayedScaling"]["fields"]})]
    assert not dropped_but_present, f"V1_FIELDS_DROPPED lists fields TE {te1['version']} does not have: {dropped_but_present}"
    _check(compare.v1_report(te1, emu))


def test_emulated_version_matches_checked(te2, emu):
    """The emulation says which TE it imitates; it should be the release it is checked against."""
    handle_version = getattr(sys.modules.get("accel_fp8_fix.emulation"), "EMULATED_TE_VERSION", None)
    if handle_version is None:
        pytest.skip("accel_fp8_fix.emulation declares no EMULATED_TE_VERSION")
    assert handle_version == te2["version"], (
        f"the emulation claims to imitate TE {handle_version} but is checked against TE {te2['version']}")
