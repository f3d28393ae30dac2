"""Sharded checkpoints of TP-packed parameters (A16): Qwen3-MoE's fused expert ``gate_up_proj`` ``[E, 2I, H]``,
which transformers' ``packed_colwise`` TP style shards with ``_StridedShard(1, sf=2)`` on ``tp`` (under FSDP2 x TP:
``(Shard(0), _StridedShard(1, sf=2))`` on ``(dp_shard_cp, tp)``) — for tests/distributed/test_tp_packed_checkpoint.py.

``sc_packed_stock_dcp`` saves the prepared model's state dict with torch DCP directly (what the DCP planner makes
of the packed layout: "overlapping chunks"). ``sc_packed_save`` trains the tiny Qwen3-MoE of
``training.zoo_model("qwen3_moe")`` (accel_fp8_fix.testing) a few AdamW steps, ``save_state``s it (sharded DCP), writes the full trained
weights / optimizer state / FP8 state beside it (rank 0), reads the checkpoint's metadata and converts it with
``dcp_to_torch_save`` (rank 0), then trains on. ``sc_packed_resume`` loads it into a differently initialised model
on another (or the same) layout and world size, compares everything bit for bit and trains the same steps.
"""

from __future__ import annotations

import os

from . import fp8_scenarios
from . import scenarios
from . import tp_checkpoint_scenarios

FAMILY = "qwen3_moe"
PACKED = "model.layers.0.mlp.experts.gate_up_proj"


def _stock_error(exc: BaseException) -> str:
    text = scenarios.err(exc) + "\n" + str(exc)
    at = max(text.find("overlapping chunks"), text.find("Failed to validate global plan"))
    return text[:300] + (" ... " + text[max(at - 200, 0):at + 300] if at > 300 else "")


def sc_packed_stock_dcp(rank, world_size, out_dir, layout):
    """torch DCP on the prepared model's own state dict (``get_model_state_dict``), no package code in between."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    scenarios.ensure_rehearsal(True)
    acc, model, _ = tp_checkpoint_scenarios._prepared(layout, world_size, seed=0, family=FAMILY)
    param = dict(model.named_parameters())[PACKED]
    facts = {"placements": [str(p) for p in param.placements], "mesh": list(param.device_mesh.mesh_dim_names)}
    try:
        dcp.save({"model": get_model_state_dict(model)},
                 storage_writer=dcp.FileSystemWriter(os.path.join(out_dir, f"stock-{layout}")))
        facts["error"] = None
    except BaseException as exc:  # noqa: BLE001 — DCP's CheckpointException is a BaseException
        facts["error"] = _stock_error(exc)
    tp_checkpoint_scenarios._reset_te()
    return facts


def _metadata(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    entry = dcp.FileSystemReader(os.path.join(path, "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    md = entry[f"model.{PACKED}"]
    return {"size": list(md.size), "dtype": str(md.properties.dtype),
            "chunks": sorted([list(c.offsets), list(c.sizes)] for c in md.chunks)}


def _converted_mismatch(path: str, saved: dict) -> dict:
    """``dcp_to_torch_save`` of the model and optimizer checkpoints (one process) vs the full trained tensors:
    the names, dtypes and values that differ or are missing, and how many were compared."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        target = f"{path}.{sub}.pt"
        dcp_to_torch_save(os.path.join(path, sub), target)
        out[sub] = torch.load(target, weights_only=False)
    model = out["pytorch_model_fsdp_0"]["model"]
    state = out["optimizer_0"]["optimizer"]["state"]
    optim = {f"{n}.{k}": v for n, entry in state.items() for k, v in entry.items() if hasattr(v, "shape")}

    def differ(want, got):
        return sorted(k for k, t in want.items()
                      if k not in got or got[k].dtype != t.dtype or got[k].shape != t.shape or not torch.equal(got[k], t))

    return {"params": differ(saved["params"], model), "optim": differ(saved["optim"], optim),
            "params_compared": len(saved["params"]), "optim_compared": len(saved["optim"]),
            "packed_in_both": PACKED in model and f"{PACKED}.exp_avg" in optim,
            "extra_state_keys": sum(1 for k in model if k.endswith("_extra_state"))}


def sc_packed_save(rank, world_size, out_dir, tag, layout, before=2, after=1):
    """Train ``before`` steps, ``save_state``, reference + metadata + ``dcp_to_torch_save`` (rank 0), train on."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc, model, opt = tp_checkpoint_scenarios._prepared(layout, world_size, seed=0, family=FAMILY)
    param = dict(model.named_parameters())[PACKED]
    facts = {"placements": [str(p) for p in param.placements], "mesh": list(param.device_mesh.mesh_dim_names)}
    facts["losses_before"], _ = tp_checkpoint_scenarios._train(acc, model, opt, 0, before)
    path = os.path.join(out_dir, tag)
    try:
        acc.save_state(path)
        facts["save_error"] = None
    except BaseException as exc:  # noqa: BLE001 — a refusal (ValueError) or DCP's CheckpointException
        facts["save_error"] = scenarios.err(exc)[:1500]
    saved = tp_checkpoint_scenarios.full_state(model, opt)
    acc.wait_for_everyone()
    if rank == 0 and facts["save_error"] is None:
        torch.save(saved, f"{path}.reference.pt")
        facts["metadata"] = _metadata(path)
        facts["converted"] = _converted_mismatch(path, saved)
    acc.wait_for_everyone()
    facts["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    facts["losses_after"], _ = tp_checkpoint_scenarios._train(acc, model, opt, before, after)
    tp_checkpoint_scenarios._reset_te()
    return facts


def sc_packed_resume(rank, world_size, out_dir, tag, layout, precision="fp8", before=2, after=1):
    """A differently initialised model on ``layout`` (``precision``) loads ``tag``: weights and optimizer state bit
    for bit, FP8 state too when the model has FP8; then the same steps as the run that did not stop."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc, model, opt = tp_checkpoint_scenarios._prepared(layout, world_size, seed=99, precision=precision, family=FAMILY)
    param = dict(model.named_parameters())[PACKED]
    facts = {"placements": [str(p) for p in getattr(param, "placements", ())]}
    path = os.path.join(out_dir, tag)
    try:
        acc.load_state(path)
        facts["load_error"] = None
    except BaseException as exc:  # noqa: BLE001
        facts["load_error"] = scenarios.err(exc)[:1500]
        tp_checkpoint_scenarios._reset_te()
        return facts
    want = torch.load(f"{path}.reference.pt", weights_only=False)
    got = tp_checkpoint_scenarios.full_state(model, opt)
    facts.update({f"{k}_mismatch": tp_checkpoint_scenarios._mismatch(want[k], got[k]) for k in ("params", "optim")})
    # FP8 state the loading model has (TP 4 leaves the experts' GEMMs out of FP8: 8 local rows, not a multiple of 16)
    facts["fp8_mismatch"] = tp_checkpoint_scenarios._mismatch({k: v for k, v in want["fp8"].items() if k in got["fp8"]}, got["fp8"])
    facts["fp8_not_in_model"] = sorted(k for k in want["fp8"] if k not in got["fp8"])
    facts["fp8_loaded"] = len(got["fp8"])
    facts.update({f"{k}_compared": len(want[k]) for k in ("params", "optim", "fp8")})
    facts["losses_after"], _ = tp_checkpoint_scenarios._train(acc, model, opt, before, after)
    tp_checkpoint_scenarios._reset_te()
    return facts


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 600.0}
