"""GPU-shaped answers of the CPU rehearsal (issue 17 item 4): the target-machine profile
(``accel_fp8_fix.rehearsal.te_on_cpu.target``), the version / hardware answers read from it, and the kernel shim
answering ``hasattr`` / swizzles as the real ``transformer_engine_torch`` does.

TE's own decisions run in fresh ranks (TE caches its answers per process): with the ``h100-cu128`` profile TE
itself refuses ``Float8BlockScaling`` (CUDA 12.8 < 12.9), with ``h200-cu130`` it runs.
"""

from __future__ import annotations

import re
import types

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu, target, tex
from support import launcher

TARGET, ARCH = target.ENV_TARGET, target.ENV_ARCH
BLOCK_REFUSED = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(TARGET, raising=False)
    monkeypatch.delenv(ARCH, raising=False)


# -- the profile table -------------------------------------------------------------------------------------
def test_default_is_the_projects_h200_with_torch_2_11_cu130():
    p = target.profile()
    assert p.name == "h200-cu130" == target.DEFAULT
    assert (p.capability, p.cuda, p.cuda_tuple) == ((9, 0), "13.0", (13, 0))
    # cuda-toolkit 13.0.2 pins nvidia-cublas 13.1.0.3; torch 2.11.0 pins nvidia-cudnn-cu13 9.19.0.56
    assert (p.cublaslt, p.cudnn) == (130100, 91900)
    assert p.sm_count == 132 and 139 * 2**30 < p.total_memory < 141 * 2**30
    assert "nvidia-cublas==13.1.0.3" in p.sources and "nvidia-cudnn-cu13==9.19.0.56" in p.sources


@pytest.mark.parametrize("name, capability, cuda, cublaslt, cudnn", [
    ("h200-cu130", (9, 0), "13.0", 130100, 91900),
    ("h100-cu128", (9, 0), "12.8", 120804, 91002),
    ("b200-cu130", (10, 0), "13.0", 130100, 91900),
    ("l40s-cu128", (8, 9), "12.8", 120804, 91002),
])
def test_each_profile_answers_through_cuda_as_cpu_and_the_shim(monkeypatch, name, capability, cuda, cublaslt, cudnn):
    monkeypatch.setenv(TARGET, name)
    assert cuda_as_cpu.capability() == capability
    assert cuda_as_cpu.CUDA_VERSION == cuda
    assert (tex.get_cublasLt_version(), tex.get_cudnn_version()) == (cublaslt, cudnn)
    assert target.profile().sources  # every profile says where its numbers come from


def test_cpu_te_arch_overrides_only_the_capability(monkeypatch):
    monkeypatch.setenv(ARCH, "sm100")
    assert cuda_as_cpu.capability() == (10, 0)
    assert cuda_as_cpu.CUDA_VERSION == "13.0" and tex.get_cublasLt_version() == 130100  # still the H200's stack
    monkeypatch.setenv(TARGET, "l40s-cu128")
    monkeypatch.setenv(ARCH, "sm90")
    assert cuda_as_cpu.capability() == (9, 0) and cuda_as_cpu.CUDA_VERSION == "12.8"
    monkeypatch.setenv(ARCH, "")  # empty: unset
    assert cuda_as_cpu.capability() == (8, 9)


@pytest.mark.parametrize("variable, accepted", [
    (TARGET, ["b200-cu130", "h100-cu128", "h200-cu130", "l40s-cu128"]),
    (ARCH, ["sm100", "sm89", "sm90"]),
])
def test_unknown_values_name_the_variable_the_value_and_the_accepted_ones(monkeypatch, variable, accepted):
    monkeypatch.setenv(variable, "a100-cu118")
    with pytest.raises(ValueError) as refused:
        cuda_as_cpu.capability()
    message = str(refused.value)
    assert variable in message and "'a100-cu118'" in message and str(accepted) in message


# -- TE decides from the profile (fresh ranks) -------------------------------------------------------------
def _te_answers(rank, world_size):
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import torch

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling
    from transformer_engine.pytorch.utils import get_cudnn_version, get_device_compute_capability

    # TE's own decode of the shim's cudnnGetVersion() answer (transformer_engine.common.decode_cudnn_version)
    out = {"capability": list(get_device_compute_capability()), "cudnn": list(get_cudnn_version()),
           "available": list(te.is_fp8_block_scaling_available(return_reason=True))}
    try:
        layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            y = layer(torch.randn(32, 128, dtype=torch.bfloat16))
        out["ran"] = list(y.shape)
    except RuntimeError as exc:
        out["refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def on_targets():
    return {name: launcher.run(_te_answers, 1, env={TARGET: name, ARCH: ""}, timeout=180)[0]
            for name in ("h100-cu128", "h200-cu130")}


def test_te_refuses_block_scaling_on_cuda_12_8_with_its_own_message(on_targets):
    h100 = on_targets["h100-cu128"]
    assert h100["capability"] == [9, 0]
    assert h100["available"] == [False, BLOCK_REFUSED]
    assert h100["refused"] == BLOCK_REFUSED
    assert h100["cudnn"] == [9, 10, 2]


def test_te_runs_block_scaling_on_the_h200_profile(on_targets):
    h200 = on_targets["h200-cu130"]
    assert h200["available"] == [True, ""]
    assert h200["ran"] == [32, 128] and "refused" not in h200
    assert h200["cudnn"] == [9, 19, 0]


# -- the shim's module answers as the real extension's ---------------------------------------------------------
def test_names_the_real_extension_lacks_are_attribute_errors():
    assert not hasattr(tex, "anything_at_all")
    with pytest.raises(AttributeError, match="transformer_engine_torch.*'flash_attention'"):
        tex.flash_attention  # noqa: B018
    sentinel = object()
    assert getattr(tex, "get_attention_backend", sentinel) is sentinel  # TE's NVTE_PLUGIN probe gets its default
    assert not hasattr(tex, "LayerNorm")  # read by TE's ONNX path only; the real extension has no such name


def test_real_names_the_shim_does_not_implement_raise_by_name():
    for name in ("dbias_drelu", "fused_attn_fwd", "multi_tensor_adam", "nvte_built_with_cublasmp"):
        assert hasattr(tex, name)
        with pytest.raises(NotImplementedError, match=f"transformer_engine_torch.{name}: not implemented"):
            getattr(tex, name)()
    with pytest.raises(NotImplementedError, match="FP8TensorMeta is not available"):
        tex.FP8TensorMeta()
    with pytest.raises(NotImplementedError, match="grouped_mlp_experimental.swizzle_scales_and_pack"):
        tex.grouped_mlp_experimental.swizzle_scales_and_pack_ptrs_for_discrete_weights()


def test_every_name_tes_python_reads_from_the_extension_resolves():
    read = tex._names_read_by_te_python() - {"LayerNorm"}
    assert len(read) > 150
    assert read <= tex.REAL_EXTENSION_NAMES
    assert all(hasattr(tex, name) for name in read)


def _float8(shape=(4, 32)):
    return types.SimpleNamespace(_data=torch.zeros(shape, dtype=torch.uint8), _transpose=None,
                                 _scale_inv=torch.ones(1), _fp8_dtype=tex.DType.kFloat8E4M3)


def _mxfp8(swizzled=False):
    return types.SimpleNamespace(_rowwise_data=torch.zeros(128, 32, dtype=torch.uint8),
                                 _columnwise_data=None, _rowwise_scale_inv=torch.zeros(128, 4, dtype=torch.uint8),
                                 _columnwise_scale_inv=None, _fp8_dtype=tex.DType.kFloat8E4M3,
                                 _with_gemm_swizzled_scales=swizzled)


def test_swizzle_is_an_exact_no_op_where_tes_is_and_refuses_compact_mxfp8():
    plain = _float8()
    assert tex.swizzle_scales_for_gemm_(plain) is None and plain._scale_inv.tolist() == [1.0]
    assert tex.swizzle_scales_for_gemm_(_mxfp8(swizzled=True)) is None  # already swizzled: TE returns early
    with pytest.raises(NotImplementedError, match=re.escape("swizzle_scales_for_gemm_ of a SimpleNamespace")):
        tex.swizzle_scales_for_gemm_(_mxfp8())
    tex.multi_tensor_swizzle_scales_for_gemm_([plain, plain], True, False)  # per-tensor scales: nothing to do
    tex.multi_tensor_swizzle_scales_for_gemm_([], True, False)
    tex.multi_tensor_swizzle_scales_for_gemm_([_mxfp8()], False, True)  # no column-wise scales: skipped, as TE
    with pytest.raises(NotImplementedError, match="multi_tensor_swizzle_scales_for_gemm_unchecked_"):
        tex.multi_tensor_swizzle_scales_for_gemm_unchecked_([_mxfp8()], True, False)
    with pytest.raises(RuntimeError, match="exactly one of rowwise_usage and columnwise_usage"):
        tex.multi_tensor_swizzle_scales_for_gemm_([plain], True, True)


def test_tes_device_properties_are_the_target_profiles(monkeypatch):
    """TE's frames read SM count, memory and L2 of the chosen machine (cuda_as_cpu reads target.py per query)."""
    from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu, target

    for name in ("h200-cu130", "b200-cu130"):
        monkeypatch.setenv(target.ENV_TARGET, name)
        p, props = target.profile(), cuda_as_cpu._props()
        assert (props.major, props.minor) == p.capability
        assert (props.multi_processor_count, props.total_memory, props.L2_cache_size) == (p.sm_count, p.total_memory,
                                                                                            p.l2_cache)
        assert p.gpu in props.name


def test_profiles_l2_is_what_the_boards_report():
    """L2 as torch's ``get_device_properties`` prints it on real boards (target.py names the printouts): an H200
    enables all of GH100's 60 MiB, the H100 SXM 50 MiB."""
    from accel_fp8_fix.rehearsal.te_on_cpu import target

    mib = {name: p.l2_cache / 2**20 for name, p in target.PROFILES.items()}
    assert (mib["h200-cu130"], mib["h100-cu128"], mib["b200-cu130"]) == (60, 50, 126)
