"""Structure probe: construct TE modules and print their structure as JSON (no forward, no GPU).

Run under an interpreter with a *real* Transformer Engine (built on a CPU machine, see
docs/emulation.md "Comparing with real TE (opt-in)"):

    /tmp/realte/venv/bin/python tests/real_te/probe.py

or under the project's interpreter against the CPU emulation:

    python tests/real_te/probe.py --emulation

Real TE refuses to construct a module without CUDA (``RuntimeError("TransformerEngine needs
CUDA.")``), so for real TE ``torch.cuda.is_available`` is forced to return True *only while a
module is being constructed*; everything else (``state_dict``, ``get_extra_state``) runs with the
real answer (False on a CPU machine). Modules are built on ``device="meta"`` (TE's default device is
"cuda", which cannot allocate here) plus ``device="cpu"`` variants to see what
``reset_parameters`` attaches to parameters.

The output (stdout, one JSON object) is deliberately free of module paths of the implementation:
class names are normalised (``accel_fp8_fix.emulation.te.`` -> ``transformer_engine.``) so the two
runs can be compared key by key by tests/test_real_te_structure.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback

EMU_PREFIX = "accel_fp8_fix.emulation.te."

# Attribute values recorded verbatim (when the module has them).
CHOSEN_VALUES = (
    "in_features",
    "out_features",
    "tp_size",
    "tp_group",
    "parallel_mode",
    "sequence_parallel",
    "fp8",
    "fp8_initialized",
    "fp8_calibration",
    "fp8_meta_tensors_initialized",
    "fsdp_wrapped",
    "fsdp_group",
    "primary_weights_in_fp8",
    "preserve_high_precision_init_val",
    "fp8_meta",
    "quantizers",
    "activation_dtype",
    "name",
    "use_bias",
    "return_bias",
    "apply_bias",
    "gemm_bias_unfused_add",
    "weight_names",
    "bias_names",
    "parameter_split_sizes",
    "fuse_wgrad_accumulation",
    "normalization",
    "return_layernorm_output",
    "return_layernorm_output_gathered",
    "zero_centered_gamma",
    "eps",
    "normalized_shape",
    "param_init_meta",
)


def _norm_name(qualified: str) -> str:
    if qualified.startswith(EMU_PREFIX):
        return "transformer_engine." + qualified[len(EMU_PREFIX):]
    return qualified


def _cls_name(cls) -> str:
    return _norm_name(f"{cls.__module__}.{cls.__qualname__}")


def _jsonable(value, depth: int = 0):
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return str(value)
    if depth < 3 and isinstance(value, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in value]
    if depth < 3 and isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    return f"<{_cls_name(type(value))}>"


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()


@contextlib.contextmanager
def _cuda_claimed(enabled: bool):
    """Force ``torch.cuda.is_available() -> True`` for the duration (real TE only)."""
    import torch

    if not enabled:
        yield
        return
    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = saved


def _tensor_info(t):
    info = {
        "type": _cls_name(type(t)),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "device": t.device.type,
    }
    if hasattr(t, "requires_grad"):
        info["requires_grad"] = bool(t.requires_grad)
    # attributes TE attaches to parameters (sequence_parallel, tensor_model_parallel, ...)
    info["attrs"] = {
        k: _jsonable(v) for k, v in sorted(getattr(t, "__dict__", {}).items()) if not k.startswith("__")
    }
    return info


def describe(module, te) -> dict:
    import torch

    out: dict = {}
    out["class"] = _cls_name(type(module))
    out["mro"] = [_cls_name(c) for c in type(module).__mro__]
    out["isinstance"] = {
        "torch.nn.Module": isinstance(module, torch.nn.Module),
        "torch.nn.Linear": isinstance(module, torch.nn.Linear),
        "torch.nn.LayerNorm": isinstance(module, torch.nn.LayerNorm),
        "TransformerEngineBaseModule": isinstance(
            module, te.module.base.TransformerEngineBaseModule
        ),
    }
    out["parameters"] = {n: _tensor_info(p) for n, p in module.named_parameters()}
    out["buffers"] = {n: _tensor_info(b) for n, b in module.named_buffers()}
    try:
        out["state_dict_keys"] = sorted(module.state_dict(keep_vars=True).keys())
    except Exception as exc:  # noqa: BLE001 - recorded, compared
        out["state_dict_keys"] = f"error: {_err(exc)}"
    out["overrides_get_extra_state"] = (
        type(module).get_extra_state is not torch.nn.Module.get_extra_state
    )
    if out["overrides_get_extra_state"]:
        try:
            es = module.get_extra_state()
            if isinstance(es, torch.Tensor):
                out["extra_state"] = {
                    "type": _cls_name(type(es)),
                    "dtype": str(es.dtype),
                    "shape": list(es.shape),
                    "device": es.device.type,
                }
            else:
                out["extra_state"] = {"type": _cls_name(type(es))}
        except Exception as exc:  # noqa: BLE001
            out["extra_state"] = f"error: {_err(exc)}"
    fp8_meta = getattr(module, "fp8_meta", None)
    out["fp8_meta"] = (
        {k: _cls_name(type(v)) for k, v in fp8_meta.items()} if isinstance(fp8_meta, dict) else None
    )
    attrs = vars(module)
    # torch.nn.Module's own bookkeeping (differs between torch releases) is left out.
    base = set(vars(torch.nn.Module()))
    out["attributes"] = {k: _cls_name(type(v)) for k, v in attrs.items() if k not in base}
    out["values"] = {k: _jsonable(attrs[k]) for k in CHOSEN_VALUES if k in attrs}
    out["submodules"] = [n for n, _ in module.named_modules() if n]
    return out


def _cases(torch):
    f32 = torch.float32
    meta = dict(params_dtype=f32, device="meta")
    return [
        ("linear", "Linear", (64, 128), dict(bias=True, **meta)),
        ("linear_nobias", "Linear", (64, 128), dict(bias=False, **meta)),
        ("linear_cpu", "Linear", (64, 128), dict(bias=True, params_dtype=f32, device="cpu")),
        (
            "linear_column_tp2",
            "Linear",
            (64, 128),
            dict(bias=True, tp_group=None, tp_size=2, parallel_mode="column", **meta),
        ),
        (
            "linear_column_tp2_cpu",
            "Linear",
            (64, 128),
            dict(bias=True, tp_group=None, tp_size=2, parallel_mode="column", params_dtype=f32, device="cpu"),
        ),
        (
            "linear_row_tp2",
            "Linear",
            (64, 128),
            dict(bias=True, tp_group=None, tp_size=2, parallel_mode="row", **meta),
        ),
        (
            "linear_row_tp2_cpu",
            "Linear",
            (64, 128),
            dict(bias=True, tp_group=None, tp_size=2, parallel_mode="row", params_dtype=f32, device="cpu"),
        ),
        ("layernorm", "LayerNorm", (64,), dict(**meta)),
        ("layernorm_cpu", "LayerNorm", (64,), dict(params_dtype=f32, device="cpu")),
        ("rmsnorm", "RMSNorm", (64,), dict(**meta)),
        ("rmsnorm_cpu", "RMSNorm", (64,), dict(params_dtype=f32, device="cpu")),
        ("layernorm_linear", "LayerNormLinear", (64, 128), dict(**meta)),
        ("layernorm_linear_cpu", "LayerNormLinear", (64, 128), dict(params_dtype=f32, device="cpu")),
        (
            "layernorm_linear_column_tp2_cpu",
            "LayerNormLinear",
            (64, 128),
            dict(tp_group=None, tp_size=2, parallel_mode="column", params_dtype=f32, device="cpu"),
        ),
        ("layernorm_linear_rms", "LayerNormLinear", (64, 128), dict(normalization="RMSNorm", **meta)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulation", action="store_true", help="install accel_fp8_fix.emulation first")
    ap.add_argument("--indent", type=int, default=None)
    args = ap.parse_args(argv)

    if args.emulation:
        import accel_fp8_fix.emulation as emu

        emu.install(force=True)
    import torch  # noqa: F401  (real TE needs torch imported before transformer_engine.pytorch)
    import transformer_engine
    import transformer_engine.pytorch as te

    emulated = bool(getattr(transformer_engine, "__emulated__", False))
    try:
        from importlib.metadata import version

        dist_version = version("transformer-engine")
    except Exception as exc:  # noqa: BLE001
        dist_version = f"error: {_err(exc)}"

    report = {
        "meta": {
            "emulated": emulated,
            "te_version": dist_version,
            "torch_version": torch.__version__,
            "cuda_available": torch.cuda.is_available(),
            "python": sys.version.split()[0],
            "torch_module_attributes": sorted(vars(torch.nn.Module())),
        },
        "modules": {},
    }

    for key, cls_name, pos, kwargs in _cases(torch):
        cls = getattr(te, cls_name)
        try:
            with _cuda_claimed(not emulated):
                module = cls(*pos, **kwargs)
        except Exception as exc:  # noqa: BLE001
            report["modules"][key] = {"construct_error": _err(exc)}
            if "-v" in sys.argv:
                traceback.print_exc()
            continue
        try:
            report["modules"][key] = describe(module, te)
        except Exception as exc:  # noqa: BLE001
            report["modules"][key] = {"describe_error": _err(exc), "trace": traceback.format_exc()}

    # What happens without CUDA (not forced): real TE refuses, the emulation builds on CPU.
    # (Last, so that it cannot shift TE's automatic layer names "Layer_<n>" of the cases above.)
    try:
        te.Linear(64, 128, params_dtype=torch.float32, device="meta")
        report["construct_without_cuda"] = "ok"
    except Exception as exc:  # noqa: BLE001
        report["construct_without_cuda"] = f"error: {_err(exc)}"

    json.dump(report, sys.stdout, indent=args.indent, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
