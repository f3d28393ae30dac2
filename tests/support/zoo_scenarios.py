"""Model zoo: tiny configs of the model families users train (transformers' own classes, no download),
on every layout this package prepares (4 CPU ranks, gloo, Transformer Engine's real Python on CPU).

``sc_zoo(family, layout)`` builds the family's model, shards it as the layout says (transformers 5.x TP
with the model's own plan, then the patched ``prepare``), trains a few steps in FP8 and compares losses
and clipped grad norms with the same model converted to TE and trained in one process on the full batch;
then saves a checkpoint and loads it into a differently initialised model (bit for bit, FP8 state too).
"""

from __future__ import annotations

import os

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import ZOO_FAMILIES as FAMILIES, ZOO_MOE_ONLY as MOE_ONLY  # noqa: F401  (the suite's)
from accel_fp8_fix.testing.training import ZOO_VOCAB as VOCAB
from accel_fp8_fix.internals.transformer_engine.modules import take_fsdp2_weight_path
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import tolerances

STEPS = 3
LR = 0.02
GLOBAL_BATCH = 4
SEQ = 16
# layout: (dp_replicate, dp_shard, tp) on 4 ranks
LAYOUTS = {"fsdp2": (None, 4, None), "tp": (None, None, 4), "fsdp2_tp": (None, 2, 2), "hsdp": (2, 2, None),
           "fsdp2_tp_loaded": (None, 2, 2)}
# sharded at load by transformers (DistributedConfig(tp_size, fsdp_size): its TP and its FSDP2), not by the test
LOADED = {"fsdp2_tp_loaded"}
DECODER_LAYER = {f: training.ZOO_DECODER_LAYER[f] for f in FAMILIES}


def batch(rank_slice=None):
    import torch

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    if rank_slice is not None:
        ids = ids[rank_slice]
    return {"input_ids": ids, "labels": ids.clone()}


@fp8_scenarios.one_process_reference
def reference(family: str, fsdp2: bool, steps: int = STEPS, fp8: bool = True, recipe=None, moe_experts: bool = True):
    """One process, full batch, the family's model converted to TE (lm_head kept, as the ranks keep it; packed MoE
    experts on TE grouped GEMMs when ``moe_experts``, as the ranks convert them) when ``fp8``: (losses, grad norms
    before clipping, converted names, step-0 gradients of 1-D parameters)."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding

    model = training.zoo_model(family)
    from accel_fp8_fix.fixes.convert.fp8_shapes import weight_multiple

    te_recipe = training.zoo_recipe(recipe)
    converted = sorted(convert_after_sharding(model, te, exclude=("lm_head",), dim_multiple=weight_multiple(te_recipe),
                                              moe_experts=moe_experts).converted) if fp8 else []
    if fsdp2:
        take_fsdp2_weight_path(model)  # TE's FSDP2 weight path, as on the ranks
    small_grads, data = {}, batch()
    losses, norms = train_reference(lambda: model, lambda m: m(**data).loss, steps=steps, lr=LR, max_norm=1e9,
                                    recipe=te_recipe, fp8=fp8,
                                    after_first_backward=lambda m: small_grads.update(_small_param_grads(m)))
    return losses, norms, converted, small_grads


def _small_param_grads(model) -> dict:
    """The full gradients of the 1-D parameters (norm weights, biases): the ones TP replicates, whose
    gradient a rank may only hold part of (Qwen3's per-head q_norm) unless it is summed over the TP group."""
    return {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.dim() == 1 and p.grad is not None}


def _accelerator(family, layout, precision, recipe=None):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dp_replicate, dp_shard, tp = LAYOUTS[layout]
    fsdp = dp_shard is not None
    extra = {"mixed_precision_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)} if fsdp else {}
    return scenarios.make_accelerator(fsdp=fsdp, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, mixed_precision=precision,
                              fp8_recipe={"recipe": recipe} if recipe else fp8_scenarios.RECIPE, wrap_cls=[DECODER_LAYER[family]] if fsdp else None,
                              expect="FSDP" if fsdp else "MULTI_GPU", **extra)


def _prepared(family, layout, seed, precision, recipe=None):
    import torch

    acc = _accelerator(family, layout, precision, recipe)
    model = training.zoo_model(family, seed=seed)
    _, dp_shard, tp = LAYOUTS[layout]
    if layout in LOADED:
        model = scenarios.load_sharded_by_transformers(model, tp_size=tp, fsdp_size=dp_shard)
        model.train()  # from_pretrained returns the model in eval mode, where TE autocast is off
    elif tp:
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _data_rank(acc, layout):
    """(this rank's index among the data-parallel ranks, their number): ``training.data_rank``."""
    return training.data_rank(acc)


def _full(param):
    return scenarios.full_tensor(param)


def experts_tp_sharded(model) -> bool:
    """Whether the family's TP plan shards its packed experts (``moe_tp_experts``: transformers <= 5.24's Qwen3-MoE
    and Mixtral plans); from 5.25 the default plans leave them replicated on the TP ranks."""
    return "moe_tp_experts" in dict(getattr(model, "_tp_plan", None) or {}).values()


def _experts_convert(family: str, layout: str) -> bool:
    """Whether the ranks put this family's packed experts on TE grouped GEMMs under ``layout``: their TP-local
    expert width (moe_intermediate_size / tp when the plan shards them) must be a multiple of 16, TE's FP8 GEMM dim
    (fixes/convert/moe_experts.py)."""
    model = training.zoo_model(family)
    width = getattr(model.config, "moe_intermediate_size", None)
    tp = (LAYOUTS[layout][2] or 1) if experts_tp_sharded(model) else 1
    return width is None or (width // tp) % 16 == 0


def sc_zoo(rank, world_size, family, layout, precision="fp8", steps=STEPS, out_dir=None, recipe=None):
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    scenarios.ensure_rehearsal(True)
    ref_losses, ref_norms, ref_converted, ref_grads = reference(family, fsdp2=LAYOUTS[layout][1] is not None, steps=steps,
                                                             fp8=precision == "fp8", recipe=recipe,
                                                             moe_experts=_experts_convert(family, layout))
    acc, model, opt = _prepared(family, layout, seed=0, precision=precision, recipe=recipe)
    setup = getattr(acc, "accel_fp8_fix", None)
    dp_rank, dp_size = _data_rank(acc, layout)
    per = GLOBAL_BATCH // dp_size
    data = batch(slice(dp_rank * per, (dp_rank + 1) * per))
    scenarios.te_reset()
    losses, norms, same = [], [], []
    grad_errors = {}
    for step in range(steps):
        loss = model(**data).loss
        acc.backward(loss)
        if step == 0:  # max |grad - reference| / max |reference| per 1-D parameter (FSDP2 grads: mean over data ranks)
            grads = _small_param_grads(model)
            grad_errors = {n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) if n in grads else None
                           for n, g in ref_grads.items()}
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)  # mean over ranks: TP ranks hold the same loss, data ranks their share
        losses.append(float(value) / world_size)
        same.append(fp8_scenarios._all_equal_across_ranks(fp8_scenarios.reduced_fp8_state(model)))
    stats = scenarios.te_stats()
    leaves = all(p.is_leaf for p in model.parameters())
    facts = {
        "converted": sorted(setup.conversion.converted) if setup else [],
        "experts": list(setup.conversion.experts) if setup else [],
        "experts_expected": _experts_convert(family, layout),
        "reference_converted": ref_converted,
        "skipped": dict(setup.conversion.skipped) if setup else {},
        "fp8_enabled": bool(setup and setup.fp8_enabled),
        "losses": losses, "reference": ref_losses,
        "grad_norms": norms, "reference_grad_norms": ref_norms,
        "fp8_state_identical_every_step": same,
        "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "fast_accum_gemms": stats.get("fast_accum_gemms", 0),
        "row_parallel_ks": tolerances.row_parallel_ks(model.config),
        "recipe": type(setup.recipe).__name__ if setup and setup.fp8_enabled else None,
        "amax_reductions": stats["amax_reductions"],
        "params_are_leaves": leaves,
        "small_param_grad_rel_errors": grad_errors,
    }
    if out_dir:
        path = os.path.join(out_dir, f"{family}-{layout}")
        model.eval()  # an evaluation pass before saving, as training scripts do: TE runs it without FP8 (A19)
        with torch.no_grad():
            model(**data)
        model.train()
        try:
            acc.save_state(path)
        except ValueError as exc:  # a refusal by name of a sharded save
            facts["checkpoint_refused"] = str(exc)
            fp8_scenarios.reset_te_global_state()
            return facts
        saved = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
        saved_fp8 = {k: v.detach().clone() for k, v in fp8_state_tensors(model).items()}
        acc2, model2, _ = _prepared(family, layout, seed=1, precision=precision, recipe=recipe)  # different init: all must come from the checkpoint
        try:
            acc2.load_state(path)
        except Exception as exc:  # noqa: BLE001 — e.g. a DCP size mismatch of TE's _extra_state
            facts["checkpoint_load_error"] = f"{type(exc).__name__}: {exc}"[:500]
            fp8_scenarios.reset_te_global_state()
            return facts
        got = {n: _full(p).detach() for n, p in model2.named_parameters()}
        got_fp8 = fp8_state_tensors(model2)
        facts["checkpoint_param_mismatch"] = sorted(n for n, t in saved.items() if n not in got or not torch.equal(got[n], t))
        facts["checkpoint_fp8_mismatch"] = sorted(k for k, t in saved_fp8.items()
                                                  if k not in got_fp8 or not torch.equal(got_fp8[k], t))
        facts["checkpoint_fp8_compared"] = len(saved_fp8)
        try:
            _export(acc, model, saved, f"{path}-export")
        except ValueError as exc:  # torch < 2.12 cannot gather TP-packed (_StridedShard) experts for a full export
            if "shard_order" not in str(exc):
                raise
            facts["export_error"] = f"{type(exc).__name__}: {exc}"[:300]
    fp8_scenarios.reset_te_global_state()
    return facts


def _export(acc, model, trained: dict, export_dir: str) -> None:
    """``save_model`` as a user publishes a model (plus its config); the trained full weights beside it, for the
    clean-process load of tests/distributed/test_model_zoo.py."""
    import torch

    acc.save_model(model, export_dir)
    if acc.is_main_process:
        acc.unwrap_model(model).config.save_pretrained(export_dir)
        torch.save(trained, f"{export_dir}.trained.pt")
    acc.wait_for_everyone()


def sc_loaded_mesh_mismatch(rank, world_size):
    """A model transformers sharded TP 4 at load, prepared under dp_shard 2 x tp 2: refused by name, before
    anything is converted."""
    import torch

    acc = _accelerator("llama", "fsdp2_tp", "fp8")
    model = scenarios.load_sharded_by_transformers(training.zoo_model("llama"), tp_size=4, fsdp_size=1)
    try:
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        return {"error": None}
    except ValueError as exc:
        return {"error": str(exc), "te_modules": sum(1 for m in model.modules() if hasattr(m, "fp8_meta"))}
    finally:
        fp8_scenarios.reset_te_global_state()


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 600.0}
