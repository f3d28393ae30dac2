"""TP and FSDP2 x TP + TE FP8 scenarios (CPU, gloo, Transformer Engine's real Python on CPU) for tests/distributed/test_tp_fp8.py.

A tiny transformers Llama is sharded with transformers 5.x TP (``_scenarios.shard_llama_tp``), prepared by
the patched accelerate with ``mixed_precision="fp8"``, and trained; facts come back to the test.
"""

from __future__ import annotations

import os
import warnings

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import tolerances

STEPS = 6
LR = 0.02
GLOBAL_BATCH = 4
RECIPE = fp8_scenarios.RECIPE
CLIP = 0.5  # max grad norm: below the model's norm, so clipping acts at every step (asserted in the tests)


def _batch(rank_slice=None):
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (GLOBAL_BATCH, 16), generator=g)
    if rank_slice is not None:
        ids = ids[rank_slice]
    return {"input_ids": ids, "labels": ids.clone()}


@fp8_scenarios.one_process_reference
def _reference_losses(steps=STEPS, fsdp2=False, max_norm=CLIP, intermediate=None, keep=("lm_head",)):
    """The same Llama, converted to TE in one process (``keep`` — lm_head, as under TP — kept), full batch, clipped
    to ``max_norm``: (losses, grad norms before clipping). ``fsdp2``: the TE modules take TE's FSDP2 weight path,
    as the ranks do."""
    import transformer_engine.common.recipe as te_recipe

    recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                      reduce_amax=False)
    data = _batch()
    return train_reference(lambda: training.tiny_llama(seed=0, **_sizes(intermediate)), lambda m: m(**data).loss,
                           steps=steps, lr=LR, max_norm=max_norm, recipe=recipe, convert={"exclude": tuple(keep)},
                           fsdp2_weight_path=fsdp2)


def _sizes(intermediate):
    return {} if intermediate is None else {"intermediate": intermediate}


def _mlp(layers=2):
    return tuple(f"model.layers.{i}.mlp.{p}" for i in range(layers) for p in ("gate_proj", "up_proj", "down_proj"))


def sc_tp_fp8_train(rank, world_size, dp_shard=None, tp=2, steps=STEPS, clip=True, spy=False, intermediate=None):
    """TP (or dp_shard x TP with FSDP2) + FP8 through the patched prepare; losses vs one process.
    ``intermediate``: the MLP width; 48 fits FP8's multiple of 16 globally but not per TP rank (24): the MLP must
    then be kept in high precision, decided on the local shard as TE decides on a GPU."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.testing.spy import CollectiveSpy

    scenarios.ensure_rehearsal(True)
    fsdp = dp_shard is not None
    extra = {"mixed_precision_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)} if fsdp else {}
    acc = scenarios.make_accelerator(fsdp=fsdp, dp_shard=dp_shard, tp=tp, mixed_precision="fp8", fp8_recipe=RECIPE,
                             wrap_cls=["LlamaDecoderLayer"] if fsdp else None, expect=None if not fsdp else "auto", **extra)
    misfit = intermediate is not None and (intermediate // tp) % 16 != 0
    reference, reference_norms = _reference_losses(steps, fsdp2=fsdp, max_norm=CLIP if clip else float("inf"),
                                                   intermediate=intermediate,
                                                   keep=("lm_head",) + (_mlp() if misfit else ()))
    mesh = acc.torch_device_mesh
    model = scenarios.shard_llama_tp(training.tiny_llama(seed=0, **_sizes(intermediate)), mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with CollectiveSpy() as prepare_spy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = acc.prepare(model, opt)
    setup = acc.accel_fp8_fix
    te_mods = {n: m for n, m in model.named_modules() if hasattr(m, "fp8_meta")}
    facts = {
        "distributed_type": acc.distributed_type.name,
        "mesh_dims": list(mesh.mesh_dim_names),
        "converted": setup.conversion.converted,
        "skipped": [n for n, _ in setup.conversion.skipped],
        "skip_reasons": [r for _, r in setup.conversion.skipped],
        "parallel_modes": {n: getattr(m, "parallel_mode", None) for n, m in te_mods.items()},
        "tp_sizes": sorted({getattr(m, "tp_size", 1) for m in te_mods.values()}),
        "all_params_dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "same_param_objects_in_optimizer": {id(p) for g in opt.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
        "amax_group_ranks": list(setup.amax_group_ranks),
        "prepare_dtensor_collectives": len(prepare_spy.dtensor_calls),
        "coverage_warnings": [(str(w.message), os.path.basename(w.filename)) for w in caught
                              if "FP8 covers" in str(w.message)],
    }
    if fsdp:
        dp_rank = mesh["dp_shard"].get_local_rank()
        per = GLOBAL_BATCH // dp_shard
        batch = _batch(slice(dp_rank * per, (dp_rank + 1) * per))
    else:
        batch = _batch()
    losses, same, norms = [], [], []
    scenarios.te_reset()
    fwd_gemms = scenarios.count_forward_gemms(te_mods)
    with CollectiveSpy() as train_spy:
        for _ in range(steps):
            loss = model(**batch).loss
            acc.backward(loss)
            if clip:
                # float() as a script logs it: the returned norm is the whole mesh's (A17)
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            if fsdp:  # mean over the data-parallel ranks (TP ranks hold the same loss)
                dist.all_reduce(value, group=mesh["dp_shard"].get_group())
                value /= dp_shard
            losses.append(float(value))
            same.append(fp8_scenarios._all_equal_across_ranks(fp8_scenarios.reduced_fp8_state(model)))
    stats = scenarios.te_stats()
    facts.update(
        losses=losses,
        reference=reference,
        fp8_state_identical_every_step=same,
        grad_norms=norms,
        reference_grad_norms=reference_norms,
        fp8_gemms_fwd_per_module=dict(fwd_gemms),
        fp8_gemms_fwd=stats["fp8_gemms_fwd"], fp8_gemms_bwd=stats["fp8_gemms_bwd"],
        fast_accum_gemms=stats.get("fast_accum_gemms", 0), row_parallel_ks=tolerances.row_parallel_ks(model.config),
        amax_reductions=stats["amax_reductions"],
        train_dtensor_collectives=len(train_spy.dtensor_calls),
        train_groups=sorted({tuple(c.group_ranks) for c in train_spy.calls() if c.group_ranks is not None}),
    )
    return facts


def sc_tp_checkpoint_save(rank, world_size, out_dir, dp_shard=2, tp=2):
    import torch

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors
    from accel_fp8_fix.testing.spy import CollectiveSpy

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp, mixed_precision="fp8", fp8_recipe=RECIPE,
                             wrap_cls=["LlamaDecoderLayer"])
    model = scenarios.shard_llama_tp(training.tiny_llama(seed=0), acc.torch_device_mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for _ in range(2):
        loss = model(**_batch()).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    with CollectiveSpy() as spy:
        acc.save_state(os.path.join(out_dir, "ckpt"))
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": params, "fp8": {k: v.clone() for k, v in fp8_state_tensors(model).items()}},
                   os.path.join(out_dir, "reference.pt"))
    return {"save_dtensor_collectives": len(spy.dtensor_calls)}


def sc_tp_checkpoint_load(rank, world_size, out_dir, dp_shard=2, tp=2):
    import torch

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors
    from accel_fp8_fix.testing.spy import CollectiveSpy

    scenarios.ensure_rehearsal(True)
    tp_on = tp is not None and tp > 1
    acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp if tp_on else None, mixed_precision="fp8",
                             fp8_recipe=RECIPE, wrap_cls=["LlamaDecoderLayer"])
    model = training.tiny_llama(seed=99)  # different init: everything must come from the checkpoint
    if tp_on:
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    with CollectiveSpy() as spy:
        acc.load_state(os.path.join(out_dir, "ckpt"))
    reference = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    fp8 = fp8_state_tensors(model)
    return {
        "param_mismatch": sorted(n for n, t in reference["params"].items() if n not in got or not torch.equal(got[n], t)),
        "fp8_mismatch": sorted(k for k, t in reference["fp8"].items() if k not in fp8 or not torch.equal(fp8[k], t)),
        "fp8_compared": len(reference["fp8"]),
        "load_dtensor_collectives": len(spy.dtensor_calls),
    }


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 400.0}

def sc_tp_heads_misfit(rank, world_size, tp=2, heads=4, kv_heads=1):
    """KV heads (1) not divisible by tp_size (2): the error and where it surfaced ("prepare" with the fix; the
    first forward's bare ``shape '[...]' is invalid`` without it)."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=False, tp=tp, mixed_precision="fp8", fp8_recipe=RECIPE, expect=None)
    model = scenarios.shard_llama_tp(training.tiny_llama(seed=0, heads=heads, kv_heads=kv_heads), acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        model, opt = acc.prepare(model, opt)
    except Exception as exc:  # noqa: BLE001
        return {"where": "prepare", "error": scenarios.err(exc)}
    try:
        model(**_batch()).loss.backward()
    except Exception as exc:  # noqa: BLE001
        return {"where": "forward", "error": scenarios.err(exc)}
    return {"where": None, "error": None}
