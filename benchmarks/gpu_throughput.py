"""Training throughput on one GPU: bf16 against FP8 with each Transformer Engine recipe the GPU supports, on a
~1 B-parameter Llama-shaped model (transformers' ``LlamaForCausalLM`` built from a config: 18 layers, hidden
2048, MLP 5632, 16 heads, vocabulary 32000: 1.06 B parameters), through accelerate's FSDP2 ``prepare`` (world
size 1) with accel_fp8_fix active — the package's patched prepare: TE conversion after sharding, FP8 on.

Each configuration runs in its own process (fresh CUDA memory, fresh accelerate state):

* ``bf16``: ``Accelerator(mixed_precision="bf16")``, the same FSDP2 plugin; no TE.
* ``fp8-delayed``: ``mixed_precision="fp8"`` with accelerate's ``TERecipeKwargs`` (DelayedScaling, HYBRID,
  amax history 16, max).
* ``fp8-delayed-ag8`` / ``fp8-current-ag8`` / ``fp8-block-ag8``: the same recipe with the FP8 all-gather
  (``ACCELERATE_FP8_ALL_GATHER=fp8``: weights quantized on the FSDP2 shard, gathered as FP8, handed to TE as
  Float8Tensors — Float8BlockwiseQTensors under block scaling; one packed weight-amax all-reduce per step, none
  under block scaling; the row's ``fp8_all_gather`` = weights served so).
  On one GPU the all-gather is a local copy: the row measures the quantize-once weight path; the bytes on the
  wire are benchmarks/fp8_all_gather.py's (2 and 4 ranks).
* ``fp8-current`` / ``fp8-block`` / ``fp8-mxfp8``: the same, with the recipe accelerate would build replaced by
  TE's ``Float8CurrentScaling`` / ``Float8BlockScaling`` / ``MXFP8BlockScaling`` (accelerate's kwargs express
  only delayed scaling and MXFP8); run only where TE says the GPU supports it (the bf16 run asks TE).

Per configuration: tokens/s over the timed steps (after warm-up steps), an approximate TFLOP/s (6 x parameters
x tokens, attention not counted), peak CUDA memory (``max_memory_allocated``, whole run and training steps
only), the last loss, whether every TE module ran in FP8, and the share of TE's GEMM calls whose operands
were FP8 tensors (``transformer_engine_torch.generic_gemm`` calls counted in one step).

Prints the table (markdown) and one ``BENCH_ROW {json}`` line per configuration; ``--table PATH`` writes the
table there too. ``--tiny`` runs a small model on CPU over TE's real Python with the CPU rehearsal
(``ACCEL_FP8_FIX_REHEARSAL=1``): a check of this script, no speed figures.

``--model qwen3_moe``: the same configurations on a Qwen3-MoE-shaped model (transformers' ``Qwen3MoeForCausalLM``:
8 layers, hidden 2048, 16 heads / 4 KV heads, 64 experts of MLP 768 with top-8 routing: 2.6 B parameters, 0.45 B
active a token), the experts' GEMMs through TE's grouped GEMM (fixes/convert/moe_experts.py); TFLOP/s counts the active
parameters, and the GEMM column counts grouped GEMM calls as one each; its ``-ag8`` rows gather the experts in FP8
too (a scale per expert, fixes/all_gather/fp8_experts_gather.py; not under block scaling).

Run (one GPU, real TE): ``python benchmarks/gpu_throughput.py [--table out.md] [--budget 240] [--model qwen3_moe]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("bf16", "fp8-delayed", "fp8-delayed-ag8", "fp8-current", "fp8-current-ag8", "fp8-block", "fp8-block-ag8",
           "fp8-mxfp8")
AG8 = "-ag8"  # the same recipe with the FP8 all-gather (ACCELERATE_FP8_ALL_GATHER=fp8, fixes/all_gather/fp8_all_gather.py)
SUPPORT = {"fp8-delayed": "is_fp8_available", "fp8-current": "is_fp8_available",
           "fp8-delayed-ag8": "is_fp8_available", "fp8-current-ag8": "is_fp8_available",
           "fp8-block": "is_fp8_block_scaling_available", "fp8-block-ag8": "is_fp8_block_scaling_available",
           "fp8-mxfp8": "is_mxfp8_available"}
RECIPE_KWARGS = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute_recipe(config: str):
    """Make the package's prepare build TE's ``config`` recipe instead of what accelerate's kwargs express."""
    import transformer_engine.common.recipe as te_recipe

    import accel_fp8_fix.fixes.start.recipes as recipes

    make = {"fp8-current": lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID),
            "fp8-block": lambda: te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3),
            "fp8-mxfp8": lambda: te_recipe.MXFP8BlockScaling(fp8_format=te_recipe.Format.E4M3)}[config]
    recipes.build = lambda handler, checked=None: (make(), False)  # what the prepare's plan (fixes/convert/fp8_plan.py) builds


def _quantized(operand) -> bool:
    if isinstance(operand, (list, tuple)):
        return bool(operand) and all(_quantized(o) for o in operand)
    return type(operand).__module__.startswith("transformer_engine.")


class GemmCounter:
    """Counts TE's GEMM calls (a grouped GEMM — MoE experts — as one) and those whose two operands are TE quantized
    (FP8) tensors."""

    def __init__(self):
        import transformer_engine_torch as tex

        self.calls = self.fp8 = self._inside = 0
        self.enabled = False
        for name in ("generic_gemm", "te_general_grouped_gemm"):
            if hasattr(tex, name):
                setattr(tex, name, self._counting(getattr(tex, name)))

    def _counting(self, original):
        def counting(*args, **kwargs):
            if self.enabled and not self._inside:  # the CPU shim's grouped GEMM calls generic_gemm per group
                self.calls += 1
                operands = (args[0], args[2]) if len(args) > 2 else ()
                if operands and all(_quantized(o) for o in operands):
                    self.fp8 += 1
            self._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside -= 1

        return counting


def _model(args, device):
    """(model, decoder layer class name, parameters active per token) of ``args.model``."""
    import torch
    import transformers as tf

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if args.model == "qwen3_moe":
        config = tf.Qwen3MoeConfig(num_key_value_heads=max(1, args.heads // 4), head_dim=args.hidden // args.heads,
                                   num_experts=args.experts, num_experts_per_tok=args.top_k,
                                   moe_intermediate_size=args.intermediate, decoder_sparse_step=1, **common)
        cls, layer = tf.Qwen3MoeForCausalLM, "Qwen3MoeDecoderLayer"
    else:
        config = tf.LlamaConfig(num_key_value_heads=args.heads, intermediate_size=args.intermediate, **common)
        cls, layer = tf.LlamaForCausalLM, "LlamaDecoderLayer"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = params - experts + experts * args.top_k // max(1, args.experts) if experts else params
    return model, layer, params, active


def run_one(args) -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    if cuda:
        torch.cuda.set_device(device)
    import accel_fp8_fix

    accel_fp8_fix.activate()
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs

    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))
    row: dict = {"config": args.one, "device": torch.cuda.get_device_name(0) if cuda else "cpu (rehearsal)"}
    fp8 = args.one != "bf16"
    base = args.one.removesuffix(AG8)
    if args.one.endswith(AG8):
        os.environ["ACCELERATE_FP8_ALL_GATHER"] = "fp8"
    if fp8 and base != "fp8-delayed":
        _substitute_recipe(base)
    model, layer, params, active = _model(args, device)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer])
    accelerator = Accelerator(mixed_precision="fp8" if fp8 else "bf16", fsdp_plugin=plugin,
                              kwargs_handlers=[TERecipeKwargs(**RECIPE_KWARGS)] if fp8 else [])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    started = time.perf_counter()
    model, optimizer = accelerator.prepare(model, optimizer)
    row["prepare_s"] = round(time.perf_counter() - started, 2)
    setup = getattr(accelerator, "accel_fp8_fix", None)
    row["fp8_all_gather"] = len(setup.all_gather.weights) if setup is not None and setup.all_gather else 0
    te_modules = [m for m in model.modules() if type(m).__module__.startswith("transformer_engine.")
                  and hasattr(m, "fp8")]
    if not args.one.startswith("fp8"):
        import transformer_engine.pytorch as te

        row["recipes"] = {}
        for config_name, function in SUPPORT.items():
            fn = getattr(te, function, None)
            row["recipes"][config_name] = list(fn(return_reason=True)) if fn else [False, f"TE has no {function}"]
    counter = GemmCounter() if fp8 else None

    generator = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=generator)

    def step(count: bool = False):
        if counter is not None:
            counter.enabled = count
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if counter is not None:
            counter.enabled = False
        return loss

    for index in range(args.warmup):
        step(count=index == args.warmup - 1)
    peak_before = 0
    if cuda:
        torch.cuda.synchronize()
        peak_before = torch.cuda.max_memory_allocated()  # model, prepare, optimizer state, warm-up steps
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    last = float(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens = args.batch * args.seq * args.steps
    row.update(
        model=args.model, params_b=round(params / 1e9, 3), active_params_b=round(active / 1e9, 3),
        tokens_per_step=args.batch * args.seq, steps=args.steps, tokens_per_s=round(tokens / elapsed),
        step_s=round(elapsed / args.steps, 4), tflops_6n=round(6 * active * tokens / elapsed / 1e12, 1),
        peak_gib_steps=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        last_loss=round(last, 4), loss_finite=math.isfinite(last),
        fixes_active=setup is not None, te_modules=len(te_modules),
        fp8_active=bool(te_modules) and all(m.fp8 for m in te_modules) if fp8 else None,
        recipe=type(setup.recipe).__name__ if fp8 and setup is not None and getattr(setup, "recipe", None) else None,
        te_gemms_per_step=counter.calls if counter else None, fp8_gemms_per_step=counter.fp8 if counter else None,
    )
    if cuda:
        row["peak_gib_run"] = round(max(peak_before, torch.cuda.max_memory_allocated()) / 2**30, 2)
    accelerator.end_training()
    return row


def table(rows: list[dict], skipped: dict[str, str]) -> str:
    lines = ["| config | recipe | step s | tokens/s | vs bf16 | TFLOP/s (6N) | peak GiB (steps) | FP8 GEMMs / TE GEMMs "
             "per step | weights gathered in FP8 | last loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r["tokens_per_s"] for r in rows if r.get("config") == "bf16" and "tokens_per_s" in r), None)
    for row in rows:
        if "tokens_per_s" not in row:
            lines.append(f"| {row['config']} | failed: {row.get('error', '?')[:120]} | | | | | | | | |")
            continue
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else ""
        gemms = f"{row['fp8_gemms_per_step']} / {row['te_gemms_per_step']}" if row.get("te_gemms_per_step") is not None \
            else "-"
        lines.append(f"| {row['config']} | {row.get('recipe') or '-'} | {row.get('step_s', '-')} | "
                     f"{row['tokens_per_s']:,} | {ratio} | {row['tflops_6n']} | {row.get('peak_gib_steps') or '-'} | "
                     f"{gemms} | {row.get('fp8_all_gather', 0)} | {row['last_loss']} |")
    for config, why in skipped.items():
        lines.append(f"| {config} | not run: {why[:120]} | | | | | | | | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--model", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, help="MLP width (an expert's, for qwen3_moe)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=600, help="seconds for all configurations together")
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    parser.add_argument("--tiny", action="store_true", help="small model on CPU, TE's Python over the rehearsal")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    moe = args.model == "qwen3_moe"
    args.layers = args.layers or (8 if moe else 18)
    args.intermediate = args.intermediate or (768 if moe else 5632)
    if not moe:
        args.experts = args.top_k = 0
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.vocab = 2, 128, 64 if moe else 256, 4, 512
        args.seq, args.batch, args.warmup, args.steps = 64, 2, 2, 2
        args.experts, args.top_k = (4, 2) if moe else (0, 0)
        os.environ["ACCEL_FP8_FIX_REHEARSAL"] = "1"
    if args.one:
        try:
            row = run_one(args)
        except Exception as exc:  # noqa: BLE001  (the row says what failed)
            import traceback

            traceback.print_exc()
            row = {"config": args.one, "error": f"{type(exc).__name__}: {exc}"[:500]}
        print("BENCH_ROW " + json.dumps(row), flush=True)
        return 0

    started = time.monotonic()
    rows, skipped = [], {}
    forwarded = [a for a in sys.argv[1:] if not a.startswith("--table") and a not in (str(args.table),)]
    configs = [c for c in args.configs.split(",") if c]
    support = None
    for config in configs:
        if support is not None and config in SUPPORT and not support.get(config, [True])[0]:
            skipped[config] = f"TE: {support[config][1]}"
            continue
        left = args.budget - (time.monotonic() - started)
        if left < 20:
            skipped[config] = "out of time"
            continue
        command = [sys.executable, __file__, *forwarded, "--one", config]
        print(f"[gpu_throughput] {config} (limit {left:.0f} s)", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=left, cwd=ROOT)
            output = done.stdout
            sys.stderr.write(done.stderr[-4000:])
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            skipped[config] = "stopped at the time budget"
        found = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("BENCH_ROW ")]
        if found:
            rows.append(found[0])
            print("BENCH_ROW " + json.dumps(found[0]), flush=True)
            if config == "bf16":
                support = found[0].get("recipes")
        elif config not in skipped:
            rows.append({"config": config, "error": (output or "no output")[-300:]})
    text = table(rows, skipped)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    return 0 if rows and all("tokens_per_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
