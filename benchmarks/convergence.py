"""Convergence on real text: FP8 against bf16 over hundreds of steps (issue 47).

Corpus: the running Python's standard library (``*.py`` under ``sysconfig``'s ``stdlib``), text no one here wrote
that every machine has; split by file (crc32 of the path, one file in ten held out for validation); byte-level
tokens (vocabulary 256). Each run is a user's training script under ``accelerate launch`` (this file's ``worker``):
``import accel_fp8_fix``, an ``Accelerator`` with FSDP2 and a ``ParallelismConfig``, transformers' model loaded the
documented N-D way (``from_pretrained(..., distributed_config=DistributedConfig(...))``), a DataLoader prepared by
accelerate, gradient accumulation (``accelerator.accumulate``), AdamW with warm-up + cosine, ``clip_grad_norm_``.

Models (``--model``):
  llama — transformers' Llama, FSDP2 (dp_shard 2) x TP 2 on 4 ranks;
  moe   — transformers' Qwen3-MoE, FSDP2 (4) x EP 2 on 4 ranks (transformers' expert parallelism).
Runs (``--runs``): fp32, bf16 with seeds 0, 1, 2 (the spread FP8 is judged against), FP8 delayed / current / block
(seed 0), and FP8 delayed with the FP8 all-gather. On CPU, TE's real Python runs over the rehearsal's kernel shim
(``ACCEL_FP8_FIX_REHEARSAL=1``): FP8 numerics, not GPU speed.

Prints a table per model (final training and validation loss, FP8's gap to bf16 seed 0 against bf16's seed-to-seed
spread, the first step each run reaches bf16's final loss, the largest per-step departure from bf16), writes
``<out>/<model>.csv`` (every step of every run) and ``<out>/<model>.png``, and exits 1 when a goal fails (``--check``):
a non-finite loss, a final validation loss outside the bf16 spread (or 1 % of it, whichever is larger), or a step
whose smoothed training loss departs from bf16's by more than the spread allows.

    python benchmarks/convergence.py                          # both models, every run, 300 steps (~1 h on 2 cores)
    python benchmarks/convergence.py --model llama --runs bf16,fp8_delayed_ag --steps 150 --check   # CI's phase
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOCK = "/tmp/accel_fp8_fix.mp.lock"  # one multi-process job at a time on this machine (scripts/test.sh's lock)
SEQ = 128
MICRO_BATCH = 4  # sequences per data-parallel rank per micro-step
GRAD_ACCUM = 2
EVAL_EVERY = 25
EVAL_SEQS = 32
WARMUP_FRACTION = 0.1
LR, MIN_LR_RATIO, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 0.1, 1.0
SMOOTH = 20  # steps of the moving average the per-step departure is judged on

# run name -> (mixed_precision, recipe, FP8 all-gather, seed)
RUNS = {
    "fp32": ("no", None, False, 0),
    "fp32_seed1": ("no", None, False, 1),
    "fp32_seed2": ("no", None, False, 2),
    "bf16": ("bf16", None, False, 0),
    "bf16_seed1": ("bf16", None, False, 1),
    "bf16_seed2": ("bf16", None, False, 2),
    "fp8_delayed": ("fp8", "delayed", False, 0),
    "fp8_current": ("fp8", "current", False, 0),
    "fp8_block": ("fp8", "block", False, 0),
    "fp8_delayed_ag": ("fp8", "delayed", True, 0),
}
BF16 = ("bf16", "bf16_seed1", "bf16_seed2")
# model -> (layout, decoder layer FSDP2 wraps); layout: ParallelismConfig sizes and transformers' DistributedConfig
MODELS = {
    "llama": ({"dp_shard": 2, "tp": 2}, "LlamaDecoderLayer"),
    "moe": ({"dp_shard": 4, "ep": 2}, "Qwen3MoeDecoderLayer"),
}


# -- the corpus ---------------------------------------------------------------------------------------------------
def corpus() -> tuple[bytes, bytes, dict]:
    """(training bytes, validation bytes, facts): the standard library's ``*.py`` files in path order, one in ten
    (by crc32 of the relative path) held out."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    train, valid, files = [], [], [0, 0]
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests", "idlelib"))
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                text = f.read()
            held_out = zlib.crc32(os.path.relpath(path, root).encode()) % 10 == 0
            (valid if held_out else train).append(text)
            files[held_out] += 1
    facts = {"python": sys.version.split()[0], "stdlib": root, "train_files": files[0], "valid_files": files[1]}
    return b"\n".join(train), b"\n".join(valid), facts


class Chunks:
    """Non-overlapping ``SEQ``-byte windows of ``data`` as token tensors (a map-style dataset; transformers shifts
    the labels)."""

    def __init__(self, data: bytes):
        import torch

        usable = len(data) // SEQ * SEQ
        self.tokens = torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8).view(-1, SEQ)

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        return self.tokens[i].long()


# -- the worker: one user's training run ----------------------------------------------------------------------------
def build_model(model: str, seed: int):
    import torch
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                  max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    if model == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=384, num_hidden_layers=4, **common))
    config = tf.Qwen3MoeConfig(intermediate_size=256, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True, **common)
    return tf.Qwen3MoeForCausalLM(config)


def load_sharded(model: str, seed: int, layout: dict, accelerator):
    """Rank 0 saves the seeded model; every rank loads it sharded by transformers (its TP or EP, and its FSDP2)."""
    import shutil
    import tempfile

    from accelerate.utils import broadcast_object_list
    from transformers import DistributedConfig

    path = [tempfile.mkdtemp(prefix="accel_fp8_fix_conv_") if accelerator.is_main_process else None]
    broadcast_object_list(path)
    fresh = build_model(model, seed)
    if accelerator.is_main_process:
        fresh.save_pretrained(path[0])
    accelerator.wait_for_everyone()
    # accelerate's mixed precision reaches an FSDP2 model only through fully_shard's policy: here transformers'
    config = DistributedConfig(fsdp_size=layout["dp_shard"], tp_size=layout.get("tp", 1),
                               fsdp_mixed_precision=accelerator.mixed_precision != "no",
                               **({"ep_size": layout["ep"]} if "ep" in layout else {}))
    loaded = type(fresh).from_pretrained(path[0], distributed_config=config, dtype=fresh.dtype)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(path[0], ignore_errors=True)
    return loaded.train()


def make_accelerator(run: str, model: str, collective_timeout: float):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ParallelismConfig

    import accel_fp8_fix

    precision, recipe, all_gather, _ = RUNS[run]
    layout, layer = MODELS[model]
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout))]
    if precision == "fp8":
        handlers.append(accel_fp8_fix.te_recipe_kwargs(recipe=recipe, all_gather="fp8" if all_gather else None,
                                                       fp8_format="HYBRID",
                                                       **({"amax_history_len": 16, "amax_compute_algo": "max"}
                                                          if recipe == "delayed" else {})))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer])
    pc = ParallelismConfig(dp_shard_size=layout["dp_shard"], tp_size=layout.get("tp", 1))
    return Accelerator(mixed_precision=precision, fsdp_plugin=plugin, parallelism_config=pc,
                       gradient_accumulation_steps=GRAD_ACCUM, kwargs_handlers=handlers)


def lr_lambda(steps: int):
    warmup = max(int(steps * WARMUP_FRACTION), 1)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def evaluate(model, valid) -> float:
    """Mean loss over the first ``EVAL_SEQS`` held-out windows, every rank the same batch (eval mode: TE autocast
    off, as accelerate evaluates by default)."""
    import torch

    model.eval()
    with torch.no_grad():
        ids = torch.stack([valid[i] for i in range(EVAL_SEQS)])
        loss = float(model(input_ids=ids, labels=ids).loss)
    model.train()
    return loss


def worker(args) -> None:
    import warnings

    import torch
    from torch.utils.data import DataLoader

    warnings.filterwarnings("ignore")
    precision, recipe, all_gather, seed = RUNS[args.run]
    layout, _ = MODELS[args.model]
    accelerator = make_accelerator(args.run, args.model, args.collective_timeout)
    model = load_sharded(args.model, seed, layout, accelerator)
    train_bytes, valid_bytes, facts = corpus()
    train, valid = Chunks(train_bytes), Chunks(valid_bytes)
    loader = DataLoader(train, batch_size=MICRO_BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(1000 + seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    log = open(args.out, "w") if accelerator.is_main_process else None
    if precision == "fp8":
        import accel_fp8_fix

        facts["fp8_coverage"] = str(accel_fp8_fix.audit(model).coverage)  # what runs in FP8, named
    batches, step, started, losses = iter(loader), 0, time.monotonic(), []
    while step < args.steps:
        ids = next(batches)
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            losses.append(loss.detach())
            if accelerator.sync_gradients:
                norm = float(accelerator.clip_grad_norm_(model.parameters(), CLIP))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        train_loss = float(accelerator.reduce(torch.stack(losses).mean(), "mean"))
        losses.clear()
        row = {"step": step, "train_loss": train_loss, "grad_norm": norm, "lr": scheduler.get_last_lr()[0]}
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == args.steps:
            row["valid_loss"] = evaluate(model, valid)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
            if step % 10 == 0 or "valid_loss" in row:
                elapsed = time.monotonic() - started
                print(f"  [{args.model} {args.run}] step {step + 1}/{args.steps}: loss {train_loss:.4f}"
                      + (f", valid {row['valid_loss']:.4f}" if "valid_loss" in row else "")
                      + f"  ({elapsed / (step + 1):.2f} s/step)", flush=True)
        step += 1
    if log:
        log.write(json.dumps({"facts": facts, "s_per_step": (time.monotonic() - started) / args.steps}) + "\n")
        log.close()
    accelerator.end_training()


# -- the driver: every run under accelerate launch, then the table, the CSV and the picture --------------------------
def launch(model: str, run: str, steps: int, out: str, timeout: float) -> float:
    """One run on 4 CPU ranks through ``accelerate launch`` (under the machine's lock): its wall seconds."""
    env = dict(os.environ, ACCEL_FP8_FIX_REHEARSAL="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = ["flock", LOCK, sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "4", "--num_machines", "1", "--main_process_port", "0", "--dynamo_backend", "no",
               os.path.abspath(__file__), "worker", "--model", model, "--run", run, "--steps", str(steps),
               "--out", out, "--collective-timeout", "120"]
    started = time.monotonic()
    subprocess.run(command, env=env, cwd=ROOT, check=True, timeout=timeout)
    return time.monotonic() - started


def read_run(path: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if "step" in r], next((r for r in rows if "facts" in r), {})


def smooth(values: list[float], width: int = SMOOTH) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def committed_spread(csv_path: str, steps: int) -> tuple[float, float]:
    """(final band, step band) from a committed full run's CSV: bf16's seed-to-seed spread of the validation loss at
    the evaluation nearest ``steps``, and the median over the steps after warm-up of the spread of the smoothed
    training curves — for a bounded run with one bf16 seed (CI), which compares FP8 with its matched seed instead."""
    rows = list(csv.DictReader(open(csv_path)))
    curves, valid = {}, {}
    for r in rows:
        if r["run"] in BF16:
            curves.setdefault(r["run"], []).append(float(r["train_loss"]))
            if r["valid_loss"]:
                valid.setdefault(int(r["step"]), []).append(float(r["valid_loss"]))
    at = min(valid, key=lambda step: abs(step - steps))
    smoothed = [smooth(c) for c in curves.values()]
    length = min(len(c) for c in smoothed)
    spreads = sorted(max(c[i] for c in smoothed) - min(c[i] for c in smoothed)
                     for i in range(int(length * WARMUP_FRACTION), length))
    return max(valid[at]) - min(valid[at]), spreads[len(spreads) // 2]


def summarise(runs: dict, committed: tuple | None = None) -> tuple[list[dict], list[str]]:
    """Rows of the table and the goals that failed. FP8 (and fp32) against the bf16 seeds: the gap of the final
    validation loss to bf16's mean, against ``band = max(bf16 seed-to-seed spread, 1 % of bf16's loss)``; per step,
    the smoothed training loss's departure from bf16's smoothed mean against the same band at that step.
    ``committed`` (``committed_spread``; one bf16 seed run): the spreads come from the committed full run, and each run
    is compared with bf16 seed 0, its matched run (same initialisation and data order)."""
    seeds = [runs[r] for r in BF16 if r in runs]
    curves = [smooth([row["train_loss"] for row in rows]) for rows in seeds]
    final_valid = [rows[-1]["valid_loss"] for rows in seeds]
    mean_valid = sum(final_valid) / len(final_valid)
    spread_valid = committed[0] if committed else max(final_valid) - min(final_valid)
    band = max(spread_valid, 0.01 * mean_valid)
    steps = min(len(c) for c in curves)
    mean_curve = [sum(c[i] for c in curves) / len(curves) for i in range(steps)]
    step_band = [max(committed[1] if committed else max(c[i] for c in curves) - min(c[i] for c in curves),
                     0.01 * mean_curve[i]) for i in range(steps)]
    target = mean_curve[-1]
    table, failed = [], []
    for name, rows in runs.items():
        losses = [row["train_loss"] for row in rows]
        curve = smooth(losses)
        finite = all(math.isfinite(v) for v in losses + [row.get("valid_loss", 0.0) for row in rows])
        valid = rows[-1]["valid_loss"]
        departures = [abs(curve[i] - mean_curve[i]) / step_band[i] for i in range(min(steps, len(curve)))]
        worst = max(range(len(departures)), key=departures.__getitem__)
        reached = next((i + 1 for i, v in enumerate(curve) if v <= target), None)
        row = {"run": name, "steps": len(rows), "train": curve[-1], "valid": valid, "gap": valid - mean_valid,
               "band": band, "reached": reached, "worst_departure": departures[worst], "worst_step": worst + 1,
               "finite": finite}
        table.append(row)
        if name.startswith("fp8"):
            if not finite:
                failed.append(f"{name}: a non-finite loss")
            if abs(row["gap"]) > band:
                failed.append(f"{name}: final validation loss {valid:.4f} is {row['gap']:+.4f} from bf16's "
                              f"{mean_valid:.4f}, outside the band {band:.4f}")
            if departures[worst] > 1.0:
                failed.append(f"{name}: at step {worst + 1} the smoothed training loss departs from bf16's by "
                              f"{departures[worst]:.2f} x the band")
    return table, failed


def print_table(model: str, table: list[dict], seconds: dict) -> str:
    lines = [f"### {model}", "",
             "| run | steps | final train loss (mean of last 20) | final valid loss | gap to bf16 mean | band | "
             "first step at bf16's final loss | worst departure (x band, at step) | finite | s / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['run']} | {r['steps']} | {r['train']:.4f} | {r['valid']:.4f} | {r['gap']:+.4f} | "
                     f"{r['band']:.4f} | {r['reached'] or '—'} | {r['worst_departure']:.2f} (step {r['worst_step']}) | "
                     f"{'yes' if r['finite'] else 'NO'} | {seconds.get(r['run'], float('nan')):.2f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_csv(path: str, runs: dict) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["run", "step", "train_loss", "valid_loss", "grad_norm", "lr"])
        for name, rows in runs.items():
            for r in rows:
                out.writerow([name, r["step"] + 1, f"{r['train_loss']:.6f}",
                              f"{r['valid_loss']:.6f}" if "valid_loss" in r else "", f"{r['grad_norm']:.6f}",
                              f"{r['lr']:.6g}"])


def plot(path: str, model: str, runs: dict) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"convergence: matplotlib is not installed, no picture ({path}); pip install matplotlib", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs.items():
        style = {"linestyle": "--"} if name.startswith(("bf16", "fp32")) else {}
        ax_train.plot([r["step"] + 1 for r in rows], smooth([r["train_loss"] for r in rows]), label=name,
                      linewidth=1.2, **style)
        evals = [r for r in rows if "valid_loss" in r]
        ax_valid.plot([r["step"] + 1 for r in evals], [r["valid_loss"] for r in evals], marker="o", markersize=3,
                      label=name, linewidth=1.2, **style)
    after = [v for rows in runs.values() for v in smooth([r["train_loss"] for r in rows])[int(len(rows) * WARMUP_FRACTION):]]
    ax_train.set_ylim(min(after) - 0.02, max(after) + 0.02)  # past warm-up: the first drop would flatten the rest
    ax_train.set(title=f"{model}: training loss (moving average of {SMOOTH} steps)", xlabel="step", ylabel="loss")
    ax_valid.set(title=f"{model}: held-out validation loss", xlabel="step", ylabel="loss")
    for ax in (ax_train, ax_valid):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


DOCS = os.path.join(ROOT, "docs", "convergence.md")


def write_docs(model: str, table: str, path: str = DOCS) -> None:
    """The table between ``<!-- results:<model> -->`` markers of docs/convergence.md (tests/unit/test_docs_agree.py
    checks that they equal the committed ``benchmarks/results/convergence/<model>.md``)."""
    text = open(path).read()
    start, end = f"<!-- results:{model} -->", f"<!-- /results:{model} -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{table}\n{end}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="one run (under accelerate launch)")
    w.add_argument("--model", choices=MODELS, required=True)
    w.add_argument("--run", choices=RUNS, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--collective-timeout", type=float, default=120.0)
    parser.add_argument("--model", default="llama,moe", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "convergence"))
    parser.add_argument("--reuse", action="store_true", help="keep runs whose log is complete in --out")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal fails")
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--write-docs", action="store_true", help="put each table into docs/convergence.md")
    parser.add_argument("--spread-from", help="a committed full run's <model>.csv: bf16's seed-to-seed spread from it "
                        "(for a bounded run with bf16 seed 0 only, as CI runs it)")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    failed = []
    for model in args.model.split(","):
        runs, seconds = {}, {}
        for run in args.runs.split(","):
            log = os.path.join(args.out, f"{model}.{run}.jsonl")
            done = os.path.exists(log) and read_run(log)[1] and len(read_run(log)[0]) == args.steps
            if not (args.reuse and done):
                print(f"convergence: {model} {run}, {args.steps} steps", flush=True)
                wall = launch(model, run, args.steps, log, args.run_timeout)
                print(f"convergence: {model} {run} done in {wall:.0f} s", flush=True)
            runs[run], facts = read_run(log)
            seconds[run] = facts.get("s_per_step", float("nan"))
        committed = committed_spread(args.spread_from.replace("<model>", model), args.steps) if args.spread_from else None
        table, model_failed = summarise(runs, committed)
        text = print_table(model, table, seconds)
        with open(os.path.join(args.out, f"{model}.md"), "w") as f:
            f.write(text + "\n")
        if args.write_docs:
            write_docs(model, text)
        write_csv(os.path.join(args.out, f"{model}.csv"), runs)
        plot(os.path.join(args.out, f"{model}.png"), model, runs)
        print(f"convergence: corpus {facts.get('facts', facts)}", flush=True)
        failed += [f"{model} {line}" for line in model_failed]
    for line in failed:
        print(f"convergence: GOAL FAILED: {line}", flush=True)
    if not failed:
        print("convergence: every goal held", flush=True)
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
