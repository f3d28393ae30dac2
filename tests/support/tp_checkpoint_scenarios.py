"""Checkpoints on every layout (issue 20): pure TP ``save_state`` / ``load_state`` / ``save_model`` (A21), resume
across layouts (FSDP2 x TP <-> TP <-> FSDP2, TP 2 -> 4), 3-D HSDP x TP, and the refusals (CPU, gloo, Transformer
Engine's real Python on CPU) for tests/distributed/test_tp_checkpoint.py.

``sc_ckpt_save`` trains a tiny Llama (4 KV heads, so TP 4 divides them) a few AdamW steps on one layout, saves
with ``accelerator.save_state``, writes the full trained weights / optimizer state / FP8 state beside it (rank 0),
then keeps training: the run that did not stop. ``sc_ckpt_resume`` builds a differently initialised model on
another (or the same) layout, loads the checkpoint, compares everything bit for bit and trains the same steps:
its losses are compared with the uninterrupted run's.
"""

from __future__ import annotations

import os

from accel_fp8_fix.testing import training

from . import fp8_scenarios
from . import scenarios
from . import zoo_scenarios

LR = 1e-2
GLOBAL_BATCH = 8
SEQ = 16
# layout: (dp_replicate, dp_shard, tp); "tp" takes every process
LAYOUTS = {"tp": (None, None, "all"), "fsdp2_tp": (None, 2, 2), "fsdp2": (None, "all", None), "tp4": (None, None, 4),
           "hsdp_tp": (2, 2, 2), "fsdp2_tp4": (None, 2, 4)}


def _reset_te():
    """TE's global FP8 state (kept across scenarios of a launch); nothing when TE is not on CPU (stock bf16)."""
    import sys

    if "transformer_engine.pytorch" in sys.modules:
        fp8_scenarios.reset_te_global_state()


def _sizes(layout, world_size):
    return tuple(world_size if v == "all" else v for v in LAYOUTS[layout])


def _model(seed, intermediate=128, family="llama"):
    if family != "llama":
        return training.zoo_model(family, seed=seed)
    return training.tiny_llama(seed=seed, kv_heads=4, intermediate=intermediate)


def _batches(step):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _prepared(layout, world_size, seed, precision="fp8", intermediate=128, family="llama"):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dp_replicate, dp_shard, tp = _sizes(layout, world_size)
    fsdp = dp_shard is not None
    extra = {"mixed_precision_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)} if fsdp else {}
    wrap = zoo_scenarios.DECODER_LAYER[family]
    acc = scenarios.make_accelerator(fsdp=fsdp, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, mixed_precision=precision,
                             fp8_recipe=fp8_scenarios.RECIPE, wrap_cls=[wrap] if fsdp else None,
                             expect="FSDP" if fsdp else "MULTI_GPU", **extra)
    model = _model(seed, intermediate, family)
    if tp:  # packed experts TP-sharded (moe_tp_experts): the layout whose checkpoints these scenarios test (A16)
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"], experts="tp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _data_slice(acc):
    mesh = acc.torch_device_mesh
    names = [n for n in ("dp_replicate", "dp_shard") if mesh is not None and n in mesh.mesh_dim_names]
    if not names:
        return slice(None)
    index, size = 0, 1
    for n in names:
        index = index * mesh[n].size() + mesh[n].get_local_rank()
        size *= mesh[n].size()
    per = GLOBAL_BATCH // size
    return slice(index * per, (index + 1) * per)


def _train(acc, model, opt, first_step, steps, clip=None):
    """(losses, clipped grad norms): the mean over ranks of each rank's loss = the global batch's mean."""
    import torch.distributed as dist

    rows = _data_slice(acc)
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        batch = {k: v[rows] for k, v in _batches(step).items()}
        loss = model(**batch).loss
        acc.backward(loss)
        if clip is not None:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    return losses, norms


def _full(t):
    return scenarios.full_tensor(t)


def full_state(model, opt) -> dict:
    """Full weights, optimizer state (per parameter name) and FP8 state, gathered on every rank."""
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    inner = getattr(opt, "optimizer", opt)
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    optim = {}
    for n, p in model.named_parameters():
        for k, v in sorted(inner.state.get(p, {}).items()):
            if hasattr(v, "shape"):
                optim[f"{n}.{k}"] = _full(v).detach().clone()
    fp8 = {k: v.detach().clone() for k, v in fp8_state_tensors(model).items()}
    return {"params": params, "optim": optim, "fp8": fp8}


def _mismatch(want: dict, got: dict) -> list:
    import torch

    return sorted(k for k, t in want.items() if k not in got or got[k].shape != t.shape or not torch.equal(got[k], t))


def sc_ckpt_save(rank, world_size, out_dir, tag, layout="tp", precision="fp8", before=2, after=2, export=True,
                 family="llama"):
    """Train ``before`` steps, ``save_state`` (and ``save_model`` when ``export``), train ``after`` more."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc, model, opt = _prepared(layout, world_size, seed=0, precision=precision, family=family)
    facts = {"distributed_type": acc.distributed_type.name, "mesh": list(acc.torch_device_mesh.mesh_dim_names)}
    facts["losses_before"], _ = _train(acc, model, opt, 0, before)
    path = os.path.join(out_dir, tag)
    try:
        acc.save_state(path)
        facts["save_error"] = None
    except Exception as exc:  # noqa: BLE001  (stock: the DTensor storage error; A16: a refusal)
        facts["save_error"] = scenarios.err(exc)[:600]
    saved = full_state(model, opt)
    if rank == 0:
        torch.save(saved, f"{path}.reference.pt")
    facts["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if export:
        try:
            acc.save_model(model, f"{path}-export")
            if acc.is_main_process:
                acc.unwrap_model(model).config.save_pretrained(f"{path}-export")
            facts["export_error"] = None
        except Exception as exc:  # noqa: BLE001
            facts["export_error"] = scenarios.err(exc)[:600]
        acc.wait_for_everyone()
    facts["losses_after"], _ = _train(acc, model, opt, before, after)
    _reset_te()
    return facts


def sc_ckpt_resume(rank, world_size, out_dir, tag, layout="tp", precision="fp8", before=2, after=2, family="llama"):
    """A differently initialised model on ``layout`` loads ``tag``: everything bit for bit, then the same steps."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc, model, opt = _prepared(layout, world_size, seed=99, precision=precision, family=family)
    path = os.path.join(out_dir, tag)
    facts = {"mesh": list(acc.torch_device_mesh.mesh_dim_names)}
    try:
        acc.load_state(path)
        facts["load_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["load_error"] = scenarios.err(exc)[:800]
        _reset_te()
        return facts
    want = torch.load(f"{path}.reference.pt", weights_only=False)
    got = full_state(model, opt)
    facts.update({f"{k}_mismatch": _mismatch(want[k], got[k]) for k in ("params", "optim", "fp8")})
    facts.update({f"{k}_compared": len(want[k]) for k in ("params", "optim", "fp8")})
    facts["losses_after"], _ = _train(acc, model, opt, before, after)
    _reset_te()
    return facts


def sc_ckpt_refused(rank, world_size, out_dir, tag, layout="tp", intermediate=128, precision="fp8"):
    """Load ``tag`` into a model DCP cannot reshard it into (another MLP width: a shape mismatch; bf16 into FP8:
    FP8 state missing): refused by name, and nothing of the model changed (refused before anything was read)."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc, model, opt = _prepared(layout, world_size, seed=99, precision=precision, intermediate=intermediate)
    before = full_state(model, opt)
    try:
        acc.load_state(os.path.join(out_dir, tag))
        error = None
    except Exception as exc:  # noqa: BLE001
        error = scenarios.err(exc)[:1200]
    after = full_state(model, opt)
    _reset_te()
    return {"error": error, "changed": _mismatch(before["params"], after["params"])}


def sc_3d(rank, world_size, out_dir, steps=4):
    """dp_replicate 2 x dp_shard 2 x tp 2 on 8 processes: prepare, FP8 on, amax group = the whole mesh, losses and
    clipped grad norms vs the one-process reference (Llama, SGD), then a save_state / load_state round trip."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from . import tp_scenarios

    scenarios.ensure_rehearsal(True)
    ref, ref_norms = tp_scenarios._reference_losses(steps, fsdp2=True, max_norm=tp_scenarios.CLIP)
    acc = scenarios.make_accelerator(fsdp=True, dp_replicate=2, dp_shard=2, tp=2, mixed_precision="fp8", fp8_recipe=fp8_scenarios.RECIPE,
                             wrap_cls=["LlamaDecoderLayer"],
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
    model = scenarios.shard_llama_tp(training.tiny_llama(seed=0), acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=tp_scenarios.LR)
    model, opt = acc.prepare(model, opt)
    setup = acc.accel_fp8_fix
    mesh = acc.torch_device_mesh
    dp = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    per = tp_scenarios.GLOBAL_BATCH // 4
    batch = tp_scenarios._batch(slice(dp * per, (dp + 1) * per))
    scenarios.te_reset()
    losses, norms = [], []
    import torch.distributed as dist

    for _ in range(steps):
        loss = model(**batch).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), tp_scenarios.CLIP)))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
    stats = scenarios.te_stats()
    facts = {"mesh": list(mesh.mesh_dim_names), "fp8_enabled": setup.fp8_enabled,
             "amax_group_ranks": list(setup.amax_group_ranks), "fp8_gemms_fwd": stats["fp8_gemms_fwd"],
             "losses": losses, "reference": ref, "grad_norms": norms, "reference_grad_norms": ref_norms,
             "fp8_state_identical": fp8_scenarios._all_equal_across_ranks(fp8_scenarios.reduced_fp8_state(model))}
    path = os.path.join(out_dir, "3d")
    acc.save_state(path)
    saved = full_state(model, opt)
    acc2 = scenarios.make_accelerator(fsdp=True, dp_replicate=2, dp_shard=2, tp=2, mixed_precision="fp8", fp8_recipe=fp8_scenarios.RECIPE,
                              wrap_cls=["LlamaDecoderLayer"],
                              mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                          reduce_dtype=torch.float32))
    model2 = scenarios.shard_llama_tp(training.tiny_llama(seed=99), acc2.torch_device_mesh["tp"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=tp_scenarios.LR)
    model2, opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(path)
    got = full_state(model2, opt2)
    facts.update({f"{k}_mismatch": _mismatch(saved[k], got[k]) for k in ("params", "fp8")})
    facts["fp8_compared"] = len(saved["fp8"])
    _reset_te()
    return facts


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 600.0}
