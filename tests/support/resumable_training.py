"""A training script as a user writes one for a long run, run by tests/distributed/test_fault_resume.py under
``accelerate launch --max_restarts 2`` with torchrun's standalone rendezvous (docs/troubleshooting.md): FP8 (delayed scaling) through ``import accel_fp8_fix``, FSDP2 x TP (Llama,
the FP8 all-gather on) or FSDP2 x EP (Qwen3-MoE, per-expert scales), loaded the documented N-D way, a prepared
DataLoader, gradient accumulation, AdamW + schedule, ``save_state`` every ``--save-every`` steps with automatic
checkpoint naming, and on start the resume: the newest complete checkpoint (``accel_fp8_fix.newest_complete_checkpoint``),
its RNG, optimizer, FP8 state and the data position (``skip_first_batches``).

``save_state`` runs every ``--save-every`` steps and once at the end. ``--kill ATTEMPT:KIND:STEP`` (repeatable) makes
process 1 SIGKILL itself in attempt ATTEMPT (torchrun's ``TORCHELASTIC_RESTART_COUNT``): ``between`` after step STEP
(after the end state is reported, before the final save, when STEP is the last), ``saving`` inside the
``save_state`` of step STEP (after the models and optimizers are written, before the RNG files). Process 0 appends
JSON lines to ``--out`` as it goes: an attempt's start (where it resumed from, what a plain ``load_state()`` said),
each step's loss, and after the last step a digest per process of every weight shard, FP8 state tensor and optimizer
state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import warnings

import accel_fp8_fix  # the one line: the patch set for the installed versions

GRAD_ACCUM = 2
MICRO_BATCH = 2
SEQ = 32


def build(layout: str):
    import torch
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                  intermediate_size=128, num_hidden_layers=2, max_position_embeddings=SEQ,
                  tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    if layout == "tp":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    decoder_sparse_step=1, norm_topk_prob=True, **common))


def accelerator_for(layout: str, project_dir: str):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import (FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ParallelismConfig,
                                  ProjectConfiguration)

    world = int(os.environ["WORLD_SIZE"])
    layer = "LlamaDecoderLayer" if layout == "tp" else "Qwen3MoeDecoderLayer"
    pc = ParallelismConfig(dp_shard_size=world // 2, tp_size=2) if layout == "tp" else ParallelismConfig(dp_shard_size=world)
    recipe = accel_fp8_fix.te_recipe_kwargs(recipe="delayed", all_gather="fp8" if layout == "tp" else None,
                                            fp8_format="HYBRID", amax_history_len=4, amax_compute_algo="max")
    return Accelerator(
        mixed_precision="fp8", gradient_accumulation_steps=GRAD_ACCUM, parallelism_config=pc,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                   transformer_cls_names_to_wrap=[layer]),
        project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True),
        kwargs_handlers=[recipe, InitProcessGroupKwargs(timeout=timedelta(seconds=60))])


def load_model(layout: str, accelerator, project_dir: str):
    """Saved once by process 0 (the "pretrained" model), loaded sharded by transformers on every process."""
    from transformers import DistributedConfig

    path = os.path.join(project_dir, "pretrained")
    if accelerator.is_main_process and not os.path.exists(os.path.join(path, "config.json")):
        build(layout).save_pretrained(path)
    accelerator.wait_for_everyone()
    world = accelerator.num_processes
    config = (DistributedConfig(tp_size=2, fsdp_size=world // 2) if layout == "tp"
              else DistributedConfig(fsdp_size=world, ep_size=2))
    cls = type(build(layout))
    return cls.from_pretrained(path, distributed_config=config).train()


class Progress:
    """The step count, checkpointed with ``register_for_checkpointing``."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def digest(model, optimizer) -> dict:
    """sha256 of this process's weight shards, registered buffers (FP8 scales and amax histories) and optimizer
    state, each by name."""
    import torch

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous().cpu()

    def sha(t):
        t = local(t)
        return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

    out = {f"param:{n}": sha(p) for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": sha(b) for n, b in model.named_buffers() if b is not None})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.optimizer.state.items() if hasattr(optimizer, "optimizer") else optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optim:{names.get(id(p), '?')}:{key}"] = sha(value)
    return out


def resume(accelerator, project_dir: str, attempt: int, record: dict) -> None:
    """What a plain ``load_state()`` does with the checkpoints as the last attempt left them, then the resume from
    the newest complete one (torn ones moved out of the checkpoints folder first)."""
    checkpoints = os.path.join(project_dir, "checkpoints")
    if attempt == 0 or not os.path.isdir(checkpoints) or not os.listdir(checkpoints):
        return
    try:
        accelerator.load_state()  # automatic naming: the newest folder, complete or not
        record["plain_load_state"] = "loaded"
    except accel_fp8_fix.IncompleteCheckpointError as exc:
        record["plain_load_state"] = str(exc)
    newest = accel_fp8_fix.newest_complete_checkpoint(checkpoints)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name in os.listdir(checkpoints):
            folder = os.path.join(checkpoints, name)
            if newest is None or int(name.rsplit("_", 1)[1]) > int(os.path.basename(newest).rsplit("_", 1)[1]):
                os.makedirs(os.path.join(project_dir, "torn"), exist_ok=True)
                shutil.move(folder, os.path.join(project_dir, "torn", f"{name}.attempt{attempt}"))
    accelerator.wait_for_everyone()
    if newest is not None:
        accelerator.load_state(newest)
        accelerator.project_configuration.iteration = int(newest.rsplit("_", 1)[1]) + 1
    record["resumed_from"] = os.path.basename(newest) if newest else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("tp", "ep"), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from torch.utils.data import DataLoader

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = {(int(a), kind): int(step) for a, kind, step in (k.split(":") for k in args.kill)}
    accelerator = accelerator_for(args.layout, args.project_dir)
    model = load_model(args.layout, accelerator, args.project_dir)
    data = torch.randint(0, 256, (256, SEQ), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(data, batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(11))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    rank = accelerator.process_index

    def kill_while_saving(models, weights, output_dir):
        if rank == 1 and kills.get((attempt, "saving")) == progress.step:
            os.kill(os.getpid(), signal.SIGKILL)

    accelerator.register_save_state_pre_hook(kill_while_saving)
    def emit(**fields):
        if accelerator.is_main_process:
            with open(args.out, "a") as f:
                f.write(json.dumps({"attempt": attempt, **fields}) + "\n")

    record = {}
    resume(accelerator, args.project_dir, attempt, record)
    emit(start=progress.step, **record)
    batches = iter(accelerator.skip_first_batches(loader, progress.step * GRAD_ACCUM) if progress.step else loader)
    while progress.step < args.steps:
        losses = []
        for _ in range(GRAD_ACCUM):
            ids = next(batches)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                losses.append(loss.detach())
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        progress.step += 1
        emit(step=progress.step, loss=float(accelerator.reduce(torch.stack(losses).mean(), "mean")))
        last = progress.step == args.steps
        if progress.step % args.save_every == 0 and not last:
            accelerator.save_state()
        if last:  # the end state, before the final save: an attempt killed after it still reports it
            emit(digests=accelerator.gather_for_metrics([digest(model, optimizer)], use_gather_object=True))
        if rank == 1 and kills.get((attempt, "between")) == progress.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if last:
            accelerator.save_state()  # the final checkpoint
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
