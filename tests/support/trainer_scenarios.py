"""transformers' ``Trainer`` on 4 CPU ranks (gloo, Transformer Engine's real Python on CPU), configured the way
``accelerate launch --config_file CONFIG`` configures it: each scenario puts into ``os.environ`` exactly the
variables accelerate's own launcher derives from the config file (:func:`launch_env`), then builds
``TrainingArguments`` and ``Trainer`` as a user script does, unchanged.

``sc_trainer(layout)``: "fsdp2" (a tiny Llama built in the script, FSDP2 dp_shard 4 from the config's
``fsdp_config``) or "fsdp2_tp_loaded" (the same model saved and loaded N-D with ``DistributedConfig(tp_size=2,
fsdp_size=2)``, the config of examples/fsdp2_tp_fp8.yaml). Each step consumes the whole 4-sample data set, so
the losses and clipped grad norms the Trainer logs compare with one process training the TE-converted model on
the full batch (:func:`reference`). ``sc_trainer_use_cpu``: ``TrainingArguments(use_cpu=True)`` with an FSDP2
config under the rehearsal — what accelerate decides and what the package says.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import zoo_scenarios

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
CLIP = 1.0  # Trainer's max_grad_norm: below the model's grad norm (~1.3-1.9), so clipping acts at every step
ND_CONFIG = ROOT / "examples" / "fsdp2_tp_fp8.yaml"  # the demo's: FSDP2 dp_shard 2 x TP 2, fp8, the flag
# the same without parallelism_config: FSDP2 over the 4 ranks (docs/trainer.md's first example)
FSDP2_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_machines: 1
num_processes: 4
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: HYBRID
  amax_history_len: 16
  amax_compute_algo: max
  accel_fp8_fix: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
"""
# a Qwen3-MoE loaded with transformers' expert parallelism (DistributedConfig(fsdp_size=4, ep_size=2)), FSDP2 over
# the 4 ranks from the config (issue 30 item 1)
EP_CONFIG = FSDP2_CONFIG.replace("LlamaDecoderLayer", "Qwen3MoeDecoderLayer")
LAYOUTS = {"fsdp2": (FSDP2_CONFIG, 1), "fsdp2_tp_loaded": (ND_CONFIG, 2), "fsdp2_ep_loaded": (EP_CONFIG, 1)}
FAMILY = {"fsdp2_ep_loaded": "qwen3_moe"}  # else llama
_LAUNCH_KEYS = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def launch_env(config) -> dict:
    """The variables ``accelerate launch --config_file config`` gives every worker (accelerate's own parser and
    ``prepare_multi_gpu_env``), less the rendezvous ones the test bed already set."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    with tempfile.TemporaryDirectory(prefix="accel_fp8_fix_trainer_") as scratch:
        path = config
        if not isinstance(config, Path):
            path = Path(scratch) / "config.yaml"
            path.write_text(config)
        args = launch_command_parser().parse_args(["--config_file", str(path), "--main_process_port", "0", "train.py"])
        args, _, _ = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(_LAUNCH_KEYS)}


def dataset():
    """The 4 samples of the zoo's global batch, one dict per sample (what Trainer's default collator stacks)."""
    data = zoo_scenarios.batch()
    return [{"input_ids": data["input_ids"][i], "labels": data["labels"][i]} for i in range(zoo_scenarios.GLOBAL_BATCH)]


@fp8_scenarios.one_process_reference
def reference(steps: int = STEPS, family: str = "llama"):
    """One process, full batch, the model converted to TE (lm_head kept, as on the ranks), SGD with the clip the
    Trainer applies: (losses, grad norms before clipping)."""
    from accel_fp8_fix.fixes.convert.fp8_shapes import weight_multiple

    def build():
        model = training.zoo_model(family)
        model.config._experts_implementation = "eager"
        return model

    recipe = training.zoo_recipe()
    data = zoo_scenarios.batch()
    return train_reference(build, lambda m: m(**data).loss, steps=steps, lr=zoo_scenarios.LR, max_norm=CLIP,
                           recipe=recipe, convert={"exclude": ("lm_head",), "dim_multiple": weight_multiple(recipe)},
                           fsdp2_weight_path=True)


def _arguments(per_device: int, use_cpu: bool = False):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="accel_fp8_fix_trainer_out_"), per_device_train_batch_size=per_device,
        max_steps=STEPS, learning_rate=zoo_scenarios.LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=CLIP, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        use_cpu=use_cpu, dataloader_drop_last=True)


def sc_trainer(rank, world_size, layout):
    scenarios.ensure_rehearsal(True)
    ref_losses, ref_norms = reference(family=FAMILY.get(layout, "llama"))
    config, per_device = LAYOUTS[layout]
    os.environ.update(launch_env(config))
    args = _arguments(per_device)
    try:
        return _train(args, layout, per_device, ref_losses, ref_norms)
    finally:
        shutil.rmtree(args.output_dir, ignore_errors=True)


def _train(args, layout, per_device, ref_losses, ref_norms):
    from transformers import Trainer

    args.device  # noqa: B018  (TrainingArguments creates the PartialState, as in a script: before the model is loaded)
    model = training.zoo_model(FAMILY.get(layout, "llama"))
    if layout == "fsdp2_tp_loaded":
        model = scenarios.load_sharded_by_transformers(model, tp_size=2, fsdp_size=2).train()
    elif layout == "fsdp2_ep_loaded":
        model.config._experts_implementation = "eager"
        model = scenarios.load_sharded_by_transformers(model, tp_size=1, fsdp_size=4, ep_size=2).train()
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    scenarios.te_reset()
    trainer.train()
    stats = scenarios.te_stats()
    acc = trainer.accelerator
    setup = getattr(acc, "accel_fp8_fix", None)
    mesh = acc.torch_device_mesh
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    facts = {
        "distributed_type": acc.distributed_type.name, "mixed_precision": acc.mixed_precision,
        "mesh": (tuple(mesh.mesh_dim_names), tuple(mesh.shape)) if mesh is not None else None,
        "converted": sorted(setup.conversion.converted) if setup else [],
        "experts": sorted(setup.conversion.experts) if setup else [],
        "skipped": sorted(dict(setup.conversion.skipped)) if setup else [],
        "fp8_enabled": bool(setup and setup.fp8_enabled),
        "prepared_is_trained": bool(setup) and setup.model is trainer.model_wrapped,
        "te_modules_fp8": sorted({bool(m.fp8) for m in trainer.model_wrapped.modules() if hasattr(m, "fp8_meta")}),
        "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "amax_reductions": stats["amax_reductions"],
        "amax_group_ranks": list(setup.amax_group_ranks) if setup else [],
        "losses": [float(e["loss"]) for e in logs], "grad_norms": [float(e["grad_norm"]) for e in logs],
        "reference": ref_losses, "reference_grad_norms": ref_norms,
        "epochs": [float(e["epoch"]) for e in logs],
    }
    fp8_scenarios.reset_te_global_state()
    return facts


def sc_trainer_use_cpu(rank, world_size):
    """``TrainingArguments(use_cpu=True)`` with an FSDP2 accelerate config: accelerate's MULTI_CPU (DDP)."""
    import warnings

    from transformers import Trainer

    scenarios.ensure_rehearsal(True)
    os.environ.update(launch_env(FSDP2_CONFIG))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = _arguments(1, use_cpu=True)
        try:
            trainer = Trainer(model=training.zoo_model("llama"), args=args, train_dataset=dataset())
        finally:
            shutil.rmtree(args.output_dir, ignore_errors=True)
    acc = trainer.accelerator
    return {"distributed_type": acc.distributed_type.name, "is_fsdp2": bool(acc.is_fsdp2),
            "fixes_prepare": hasattr(acc, "accel_fp8_fix"),
            "warnings": [str(w.message) for w in caught if "accel_fp8_fix" in str(w.message)]}


PLAN = [("sc_trainer", {"layout": "fsdp2"}), ("sc_trainer", {"layout": "fsdp2_tp_loaded"}), ("sc_trainer_use_cpu", {}),
        ("sc_trainer", {"layout": "fsdp2_ep_loaded"})]


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = fp8_scenarios.LAUNCH
