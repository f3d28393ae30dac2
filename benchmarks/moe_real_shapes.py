"""FP8 share of MoE models' GEMM parameters and GEMM FLOPs, from the package's own conversion, on real shapes.

Each model is built by transformers' own class on the meta device (every module and parameter shape real, no memory)
and converted by the package's conversion as ``accelerator.prepare`` runs it on one rank
(``fixes/convert/te_convert.convert_after_sharding``, the output layer excluded; its Linears become TE Linears on meta, its
packed experts get the grouped-GEMM forward or are kept with a named reason). A GEMM weight counts as FP8 when its
module is then a TE module or converted experts; routers and the output layer stay in high precision by design.
Under transformers' expert parallelism each rank converts its local experts the same way (its all-to-all or
all-reduce dispatch calls them; tests/distributed/test_expert_parallel.py), so the shares hold there too.

FLOPs are a token's forward GEMM FLOPs through the weights: 2 x the weight's elements for a Linear and a router,
2 x one expert's elements x top-k for packed experts (the active experts); attention's score and value products are
not weight GEMMs and are left out. Shares are over the GEMM weights outside the output layer (the audit's coverage
figure); "(+ lm_head)" counts the output layer's FLOPs too.

* default: the four published configs of ``CONFIGS`` (values and source below; transformers' defaults differ for
  two of them: ``Qwen3MoeConfig`` has 24 layers, ``GptOssConfig`` is the 120b);
* ``--sweep``: every transformers family with a ``@use_experts_implementation`` class, on its config class's
  defaults (a family that cannot be built that way is listed with why).

Run: ``python benchmarks/moe_real_shapes.py [--sweep]`` (~1 min; the sweep a few). Figures: docs/benchmarks.md,
"MoE: FP8 share on real shapes"; the sweep's table: docs/fixes.md.
"""

from __future__ import annotations

import argparse
import os

# (transformers config class, the published config.json values that set GEMM shapes, source)
CONFIGS = {
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False),
        "huggingface.co/Qwen/Qwen3-30B-A3B config.json"),
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        tie_word_embeddings=False, attention_bias=True),
        "huggingface.co/openai/gpt-oss-20b config.json"),
    "DeepSeek-V3": ("DeepseekV3Config", dict(
        hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, tie_word_embeddings=False),
        "huggingface.co/deepseek-ai/DeepSeek-V3 config.json (its multi-token-prediction layer is not built by "
        "transformers and not counted)"),
    "Mixtral-8x7B": ("MixtralConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        tie_word_embeddings=False),
        "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json"),
}
OUTPUT_LAYER = "lm_head"
# the conversion's word for a module with 3-D parameters that is no experts class (a Mamba mixer's conv, ...): no GEMM
NOT_EXPERTS = "not a transformers @use_experts_implementation experts class"


def build(model_cls, config):
    import torch

    with torch.device("meta"):
        return model_cls._from_config(config)


def gemm_weights(model, top_k: int):
    """(module name, module, kind, elements, forward FLOPs a token) for each GEMM weight of ``model``; kind: linear,
    experts or router."""
    from torch import nn

    from accel_fp8_fix.diagnostics.audit import _is_router
    from accel_fp8_fix.fixes.convert.moe_experts import is_packed_experts
    from accel_fp8_fix.internals.transformer_engine import has_fp8_state

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or (has_fp8_state(module) and getattr(module, "weight", None) is not None
                                             and module.weight.dim() == 2):
            yield name, module, "linear", module.weight.numel(), 2 * module.weight.numel()
        elif is_packed_experts(module) and hasattr(module, "has_gate"):  # transformers' experts classes set it
            for p in module.parameters(recurse=False):
                if p.dim() == 3:
                    yield name, module, "experts", p.numel(), 2 * (p.numel() // p.shape[0]) * top_k
        elif _is_router(module, name):
            own = [p for p in module.parameters(recurse=False) if p.dim() == 2]
            if own:
                yield name, module, "router", own[0].numel(), 2 * own[0].numel()


def shares(model_cls, config) -> dict:
    """Build ``model_cls(config)`` on meta, convert it as the package does; the FP8 shares and the kept modules."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.convert.moe_experts import is_converted
    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding
    from accel_fp8_fix.internals.transformer_engine import has_fp8_state

    model = build(model_cls, config)
    report = convert_after_sharding(model, te, exclude=(OUTPUT_LAYER,))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None) or 1
    fp8_p = all_p = fp8_f = all_f = head_f = experts_p = 0
    for name, module, kind, elements, flops in gemm_weights(model, top_k):
        if name == OUTPUT_LAYER:
            head_f += flops
            continue
        all_p, all_f = all_p + elements, all_f + flops
        experts_p += elements if kind == "experts" else 0
        if (kind == "linear" and has_fp8_state(module)) or (kind == "experts" and is_converted(module)):
            fp8_p, fp8_f = fp8_p + elements, fp8_f + flops
    kept = sorted({why for name, why in report.skipped if not why.startswith(NOT_EXPERTS)})
    return {"params": all_p, "experts_share": experts_p / all_p if all_p else 0.0,
            "fp8_params": fp8_p / all_p if all_p else 0.0, "fp8_flops": fp8_f / all_f if all_f else 0.0,
            "fp8_flops_head": fp8_f / (all_f + head_f) if all_f else 0.0, "experts": len(report.experts),
            "kept": kept}


def published() -> None:
    import transformers

    print("| model | GEMM params outside lm_head (B) | experts' share of them | FP8 share of params | FP8 share of "
          "FLOPs / token (+ lm_head) | kept in high precision |")
    print("|---|---|---|---|---|---|")
    for label, (cls, values, _source) in CONFIGS.items():
        config = getattr(transformers, cls)(**values)
        one = shares(transformers.AutoModelForCausalLM._model_mapping[type(config)], config)
        kept = "; ".join(one["kept"]) or "routers, lm_head (by design)"
        print(f"| {label} | {one['params'] / 1e9:.2f} | {one['experts_share']:.1%} | {one['fp8_params']:.2%} | "
              f"{one['fp8_flops']:.2%} ({one['fp8_flops_head']:.2%}) | {kept} |")
    print("\nSources:")
    for label, (_, _, source) in CONFIGS.items():
        print(f"- {label}: {source}")


def families():
    """(modeling module name, its @use_experts_implementation classes) for every transformers family that has one,
    read from the sources (importing all of transformers' models would take minutes)."""
    import pathlib
    import re

    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        found = re.findall(r"@use_experts_implementation[^\n]*\nclass (\w+)", path.read_text())
        if found:
            yield f"transformers.models.{path.parent.name}.{path.stem}", found


def sweep() -> None:
    import importlib

    print("| family | experts classes | built as | GEMM params outside lm_head (M) | experts' share | "
          "FP8 share of params | experts modules converted | also kept in high precision (routers and lm_head always are) |")
    print("|---|---|---|---|---|---|---|---|")
    for module_name, classes in families():
        family = module_name.rsplit(".", 2)[-2]
        try:
            module = importlib.import_module(module_name)
            heads = [c for c in dir(module) if c.endswith("ForCausalLM")] or [
                c for c in dir(module) if c.endswith("ForConditionalGeneration")]
            if not heads:
                raise LookupError("no *ForCausalLM / *ForConditionalGeneration class")
            model_cls = getattr(module, sorted(heads, key=len)[0])
            got = shares(model_cls, model_cls.config_class())
        except Exception as exc:  # noqa: BLE001 - a family that cannot be built on its defaults: listed with why
            print(f"| {family} | {', '.join(classes)} | — | — | — | — | — | could not build on its defaults: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]} |")
            continue
        kept = "; ".join(why.replace("|", "/") for why in got["kept"]) or "—"
        print(f"| {family} | {', '.join(classes)} | {model_cls.__name__} | {got['params'] / 1e6:.0f} | "
              f"{got['experts_share']:.1%} | {got['fp8_params']:.1%} | {got['experts']} | {kept} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="every packed-experts family on its default config")
    args = parser.parse_args()
    os.environ.setdefault("ACCEL_FP8_FIX_REHEARSAL", "1")  # TE's Python over the CPU kernel shim
    import logging

    from accel_fp8_fix.testing.training import ensure_te_on_cpu

    ensure_te_on_cpu()
    logging.getLogger("accel_fp8_fix").setLevel(logging.ERROR)  # the conversion's "kept ..." warning: in the table
    sweep() if args.sweep else published()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
