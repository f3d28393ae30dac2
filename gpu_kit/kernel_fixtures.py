"""Kernel fixtures: TE's kernels on the GPU against the CPU shim's, bit for bit (issue 48 item 2).

On the GPU (the kit's ``fixtures`` stage): fixed-seed inputs, made on the CPU so that every machine makes the same
bits, go through Transformer Engine's own Python API to its CUDA kernels, and the inputs with TE's outputs are saved
to one file (``kernels.pt``, ~3 MiB: under the device tool's 16 MiB a file). On CPU, ``replay`` runs the same
calls through TE's Python over the rehearsal's kernel shim and reports every difference, tensor by tensor: how many
elements differ in their bits, the largest difference in units of the last place (FP8 codes, fp32 / bf16 bits), and
where NaN falls. Cases whose answer depends on something the shim models as a choice run once per choice:
the fp32 GEMMs under each TF32 rounding (``ACCEL_FP8_FIX_REHEARSAL_TF32``), the FP8 GEMMs without split
accumulation with Hopper's fast-accumulation model off and on — the replay says which one TE's bits match.

    python -m gpu_kit.kernel_fixtures record --out kernels.pt [--device cuda]   # GPU machine (cpu: the dry run)
    python -m gpu_kit.kernel_fixtures replay kernels.pt [--json report.json]   # here, the day the file comes back

The replay exits 0 when every case matches under the shim's defaults, 1 otherwise (the report names each
difference); a file recorded on CPU through the shim replays with no difference (tests/network/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager

import torch

FORMAT = 1
E4M3_MAX = 448.0


# -- inputs: CPU generator, fixed seeds ----------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _special_values(scale: float) -> torch.Tensor:
    """The values a cast must get right, before scaling by ``scale``: E4M3's largest finite (448) and the midpoint
    above it (464: saturate), E4M3 / E5M2 subnormals, fp32 subnormals, signed zeros, ties between FP8 codes."""
    base = [448.0, 449.0, 464.0, 465.0, -448.0, 57344.0, 61440.0, 2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
            2.0**-14, 2.0**-16, 2.0**-17, 1e-40, -1e-40, 0.0, -0.0, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4, 17.0, 19.0,
            -240.0, 232.0, 0.001953125, 1.0625]
    return torch.tensor(base, dtype=torch.float32) / scale


def _activation(shape, seed: int, scale: float = 1.0, specials: bool = True) -> torch.Tensor:
    """Log-uniform magnitudes over 2**-20 .. 2**10 with random signs, the special values in the first row."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g).sign() * torch.exp2(torch.rand(shape, generator=g) * 30 - 20)
    if specials:
        s = _special_values(scale)
        x.view(-1)[: s.numel()] = s
    return x


NONFINITE = torch.tensor([math.nan, math.inf, -math.inf, -math.nan])


# -- TE's API, the same on both sides ------------------------------------------------------------------------------
def _te():
    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension: the CUDA one, or the shim)
    import transformer_engine_torch as tex

    return tex


def _parts(t) -> dict:
    """Every tensor a quantized tensor holds (TE's attribute names), on the CPU; a plain tensor as "out"."""
    if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
        return {"out": t.detach().cpu()}
    names = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
             "_columnwise_scale_inv")
    return {n.lstrip("_"): getattr(t, n).detach().cpu() for n in names
            if isinstance(getattr(t, n, None), torch.Tensor)}


def _quantizer(kind: str, device, fp8: str = "e4m3", scale: float = 1.0):
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer

    tex = _te()
    dtype = tex.DType.kFloat8E4M3 if fp8 == "e4m3" else tex.DType.kFloat8E5M2
    if kind == "delayed":
        return Float8Quantizer(torch.tensor([scale], device=device), torch.zeros(1, device=device), dtype)
    if kind == "current":
        return Float8CurrentScalingQuantizer(dtype, torch.device(device))
    return Float8BlockQuantizer(dtype, rowwise=True, columnwise=True, block_scaling_dim=int(kind[-2]))


def _quantize(inputs, device, kind, fp8="e4m3", scale=1.0):
    q = _quantizer(kind, device, fp8, scale)
    out = _parts(q(inputs["x"].to(device)))
    if kind == "delayed":
        out["amax"] = q.amax.detach().cpu()
    return out


def _split_quantize(inputs, device, kind):
    tex = _te()
    splits = inputs["splits"].tolist()
    outs = tex.split_quantize(inputs["x"].to(device), splits, [_quantizer(kind, device) for _ in splits])
    # an empty split runs no kernel: its scale_inv is allocated, never written (uninitialised on both sides)
    return {f"{i}.{name}": v for i, (t, rows) in enumerate(zip(outs, splits)) for name, v in _parts(t).items()
            if rows or "scale_inv" not in name}


def _fp8_gemm(inputs, device, split: bool):
    from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm

    w = _quantizer("current", device)(inputs["w"].to(device))
    x = _quantizer("current", device)(inputs["x"].to(device))
    out = general_gemm(w, x, out_dtype=torch.float32, layout="TN", use_split_accumulator=split)[0]
    return {"out": out.detach().cpu()}


def _plain_gemm(inputs, device, dtype):
    from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm

    w, x = inputs["w"].to(device, dtype), inputs["x"].to(device, dtype)
    return {"out": general_gemm(w, x, out_dtype=dtype, layout="TN")[0].detach().cpu()}


def _grouped_gemm(inputs, device, fp8: bool):
    """TE's grouped GEMM on expert views: ``w[e]`` of one [E, out, in] parameter, rows split per expert (an
    empty expert among them), fprop into one output."""
    from transformer_engine.pytorch.cpp_extensions.gemm import general_grouped_gemm

    w, x, splits = inputs["w"].to(device), inputs["x"].to(device), inputs["splits"].tolist()
    experts = [w[e] for e in range(w.shape[0])]
    rows = list(torch.split(x, splits))
    if fp8:
        experts = [_quantizer("current", device)(t) for t in experts]
        rows = [_quantizer("current", device)(t) for t in rows]
    y = torch.zeros(x.shape[0], w.shape[1], device=device)
    general_grouped_gemm(experts, rows, [y], [None] * len(experts), torch.float32, layout="TN", m_splits=splits,
                         single_output=True)
    return {"out": y.detach().cpu()}


def _amax_and_scale_update(inputs, device, algo: str, margin: float):
    tex = _te()
    histories = [h.clone().to(device) for h in inputs["histories"]]
    scales = [s.clone().to(device) for s in inputs["scales"]]
    tex.fused_amax_and_scale_update_after_reduction(inputs["buffer"].to(device), histories, scales, algo,
                                                    tex.DType.kFloat8E4M3, margin)
    return {**{f"history{i}": h.cpu() for i, h in enumerate(histories)},
            **{f"scale{i}": s.cpu() for i, s in enumerate(scales)}}


def _update_inputs(seed: int) -> dict:
    g = _gen(seed)
    histories = [torch.rand(16, n, generator=g) * 100 for n in (3, 2, 3)]
    histories[0][3, 1] = 0.0  # a column whose newest amax is 0: the scale keeps its value
    histories[1][:, 0] = 0.0  # a history of zeros
    histories[2][5, 2] = 1e-30  # tiny amax: the scale overflows to fp32's largest
    buffer = torch.rand(8, generator=g) * 500
    buffer[1] = 0.0
    buffer[7] = 1e-35
    scales = [torch.rand(n, generator=g) + 0.5 for n in (3, 2, 3)]
    return {"histories": histories, "scales": scales, "buffer": buffer}


def _cases() -> dict:
    """name -> (inputs, call(inputs, device), shim variants to replay under: {env var: [values]})."""
    tf32 = {"ACCEL_FP8_FIX_REHEARSAL_TF32": ["auto", "rna", "truncate", "off"]}
    fast = {"ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM": ["0", "1"]}
    cases = {}
    for fp8 in ("e4m3", "e5m2"):
        cases[f"quantize_delayed_{fp8}"] = ({"x": _activation((128, 96), 1, scale=2.0)},
                                            lambda i, d, f=fp8: _quantize(i, d, "delayed", f, 2.0), {})
    cases["quantize_delayed_e4m3_bf16_input"] = ({"x": _activation((128, 96), 2, scale=2.0).bfloat16()},
                                                 lambda i, d: _quantize(i, d, "delayed", "e4m3", 2.0), {})
    x = _activation((64, 64), 3, scale=1.0)
    x.view(-1)[100:104] = NONFINITE
    cases["quantize_delayed_e4m3_nonfinite"] = ({"x": x}, lambda i, d: _quantize(i, d, "delayed", "e4m3", 1.0), {})
    cases["quantize_current_e4m3"] = ({"x": _activation((128, 96), 4)}, lambda i, d: _quantize(i, d, "current"), {})
    cases["quantize_current_e5m2"] = ({"x": _activation((128, 96), 5)},
                                      lambda i, d: _quantize(i, d, "current", "e5m2"), {})
    cases["quantize_current_e4m3_subnormal_only"] = (
        {"x": torch.exp2(-130 - torch.rand(32, 32, generator=_gen(6)) * 15)},
        lambda i, d: _quantize(i, d, "current"), {})
    for dim in (1, 2):  # 200 x 300: partial 128-tiles in both dimensions
        cases[f"quantize_block{dim}d_e4m3"] = ({"x": _activation((200, 300), 10 + dim)},
                                               lambda i, d, k=f"block{dim}d": _quantize(i, d, k), {})
    for kind in ("delayed", "current", "block1d"):
        cases[f"split_quantize_{kind}"] = (
            {"x": _activation((160, 128), 20).bfloat16(), "splits": torch.tensor([48, 0, 96, 16, 0])},
            lambda i, d, k=kind: _split_quantize(i, d, k), {})
    for k in (32, 256, 2048):
        inputs = {"w": torch.randn(64, k, generator=_gen(30 + k)), "x": torch.randn(32, k, generator=_gen(31 + k))}
        cases[f"fp8_gemm_k{k}_split"] = (inputs, lambda i, d: _fp8_gemm(i, d, True), {})
        cases[f"fp8_gemm_k{k}_fast"] = (inputs, lambda i, d: _fp8_gemm(i, d, False), fast)
    gemm = {"w": torch.randn(48, 512, generator=_gen(40)), "x": torch.randn(64, 512, generator=_gen(41))}
    cases["fp32_gemm"] = (gemm, lambda i, d: _plain_gemm(i, d, torch.float32), tf32)
    cases["bf16_gemm"] = (gemm, lambda i, d: _plain_gemm(i, d, torch.bfloat16), {})
    experts = {"w": torch.randn(4, 64, 128, generator=_gen(50)) * 0.05,
               "x": torch.randn(96, 128, generator=_gen(51)), "splits": torch.tensor([16, 0, 32, 48])}
    cases["grouped_gemm_experts_fp8"] = (experts, lambda i, d: _grouped_gemm(i, d, True), {})
    cases["grouped_gemm_experts_fp32"] = (experts, lambda i, d: _grouped_gemm(i, d, False), tf32)
    for algo, margin in (("max", 0.0), ("most_recent", 1.0)):
        cases[f"amax_and_scale_update_{algo}"] = (_update_inputs(60), lambda i, d, a=algo, m=margin:
                                                  _amax_and_scale_update(i, d, a, m), {})
    return cases


# -- record ---------------------------------------------------------------------------------------------------------
def _environment(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    facts = {"format": FORMAT, "device": device, "torch": torch.__version__}
    for dist in ("transformer_engine", "transformer_engine_cu13", "transformer_engine_torch"):
        try:
            facts[dist] = version(dist)
        except PackageNotFoundError:
            facts[dist] = None
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["capability"] = list(torch.cuda.get_device_capability(0))
        facts["cuda"] = torch.version.cuda
        facts["cublaslt"] = int(_te().get_cublasLt_version())
    return facts


def record(out: str, device: str) -> dict:
    if device == "cpu":
        from accel_fp8_fix.rehearsal import te_on_cpu

        te_on_cpu.install()
    _te()
    results, errors = {}, {}
    for name, (inputs, call, _) in _cases().items():
        try:
            results[name] = {"inputs": inputs, "outputs": call(inputs, device)}
        except Exception as exc:  # noqa: BLE001  (TE's refusal is an answer: recorded, then replayed)
            errors[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
            results[name] = {"inputs": inputs, "error": errors[name]}
    if device == "cuda":
        torch.cuda.synchronize()
    torch.save({"environment": _environment(device), "cases": results}, out)
    summary = {"file": out, "bytes": os.path.getsize(out), "cases": len(results), "errors": errors}
    print("KERNEL_FIXTURES " + json.dumps(summary), flush=True)
    return summary


# -- replay ---------------------------------------------------------------------------------------------------------
def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between same-dtype tensors (codes for FP8 bytes)."""
    if a.dtype == torch.uint8:
        def signed(t):  # FP8 sign-magnitude code -> an ordered integer
            t = t.to(torch.int32)
            return torch.where(t >= 128, -(t - 128), t)
        return int((signed(a) - signed(b)).abs().max()) if a.numel() else 0
    wide = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ia, ib = a.contiguous().view(wide).to(torch.int64), b.contiguous().view(wide).to(torch.int64)
    top = 1 << (32 if wide is torch.int32 else 16) - 1

    def ordered(i):
        return torch.where(i < 0, -(i + top), i)
    finite = torch.isfinite(a.float()) & torch.isfinite(b.float())
    return int((ordered(ia) - ordered(ib))[finite].abs().max()) if bool(finite.any()) else 0


def compare(want: torch.Tensor, got: torch.Tensor) -> dict:
    if want.shape != got.shape or want.dtype != got.dtype:
        return {"equal": False, "mismatch": f"{tuple(want.shape)} {want.dtype} vs {tuple(got.shape)} {got.dtype}"}
    if want.dtype in (torch.uint8, torch.int32, torch.int64):
        differ = int((want != got).sum())
    else:
        differ = int((want.contiguous().view(torch.uint8) != got.contiguous().view(torch.uint8))
                     .reshape(*want.shape, -1).any(-1).sum()) if want.numel() else 0
    out = {"equal": differ == 0, "elements": want.numel(), "differ": differ}
    if differ:
        out["max_ulps"] = _ulps(want, got)
        if want.is_floating_point():
            out["max_abs"] = float((want.float() - got.float()).nan_to_num().abs().max())
            out["nan_where_te"] = int(want.float().isnan().sum())
            out["nan_where_shim"] = int(got.float().isnan().sum())
    return out


@contextmanager
def _env(settings: dict):
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _replay_one(inputs, call, recorded) -> dict:
    try:
        got = call(inputs, "cpu")
    except Exception as exc:  # noqa: BLE001
        got = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    if "error" in recorded or "error" in got:  # a refusal must meet the same refusal (its exception type)
        te, shim = recorded.get("error", "ran"), got.get("error", "ran")
        return {"equal": te.split(":")[0] == shim.split(":")[0], "te": te, "shim": shim}
    outputs = recorded["outputs"]
    tensors = {k: compare(outputs[k], got[k]) if k in got else {"equal": False, "mismatch": "missing in the shim"}
               for k in outputs}
    tensors.update({k: {"equal": False, "mismatch": "missing in TE's"} for k in got if k not in outputs})
    return {"equal": all(t["equal"] for t in tensors.values()), "tensors": tensors}


def replay(path: str) -> dict:
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    _te()
    saved = torch.load(path, weights_only=False)
    cases = _cases()
    report = {"environment": saved["environment"], "cases": {}}
    for name, recorded in saved["cases"].items():
        if name not in cases:
            report["cases"][name] = {"equal": False, "te": "recorded", "shim": "no such case in this kit"}
            continue
        _, call, variants = cases[name]
        entry = {"default": _replay_one(recorded["inputs"], call, recorded)}
        for var, values in variants.items():
            for value in values:
                with _env({var: value}):
                    entry[f"{var}={value}"] = _replay_one(recorded["inputs"], call, recorded)
        entry["equal"] = entry["default"]["equal"]
        entry["matching"] = [k for k, v in entry.items() if isinstance(v, dict) and v.get("equal")]
        report["cases"][name] = entry
    report["equal"] = all(c["equal"] for c in report["cases"].values())
    return report


def describe(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Kernel replay: {env.get('gpu', env.get('device'))}, TE {env.get('transformer_engine')}, "
             f"torch {env.get('torch')}", "", "| case | shim (defaults) | matches under | differences |",
             "|---|---|---|---|"]
    for name, case in report["cases"].items():
        default = case.get("default", case)
        diffs = []
        for tensor, c in default.get("tensors", {}).items():
            if not c["equal"]:
                diffs.append(f"{tensor}: " + (c.get("mismatch") or f"{c['differ']}/{c['elements']} differ, "
                                                                  f"max {c['max_ulps']} ulp"))
        if "te" in default:
            diffs.append(f"TE: {default['te'][:80]}; shim: {default['shim'][:80]}")
        lines.append(f"| {name} | {'equal' if case['equal'] else 'DIFFERENT'} | "
                     f"{', '.join(case.get('matching', [])) or '-'} | {'; '.join(diffs)[:400] or '-'} |")
    lines.append("")
    lines.append("every case equal under the shim's defaults" if report["equal"] else
                 "DIFFERENCES: the shim does not compute what TE's kernels did (see the table)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_kit.kernel_fixtures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    rep = verbs.add_parser("replay")
    rep.add_argument("file")
    rep.add_argument("--json", help="write the whole report here")
    args = parser.parse_args(argv)
    if args.verb == "record":
        record(args.out, args.device)
        return 0  # TE's refusals are answers too: recorded for the replay
    report = replay(args.file)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    print(describe(report))
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
