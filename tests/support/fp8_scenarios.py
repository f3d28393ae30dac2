"""FSDP2 + TE FP8 scenarios (CPU, gloo, Transformer Engine's real Python on CPU) for tests/distributed/test_fsdp2_fp8.py.

Each runs inside a rank of ``run_distributed`` (through ``_scenarios.launch``) and returns facts.
"""

from __future__ import annotations

import functools
import os

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.shared import once_per_run
from accel_fp8_fix.testing.training import reset_te_global_state, train_reference

from . import scenarios

STEPS = 10
LR = 0.05
GLOBAL_BATCH = 32  # on 2 ranks; more on 4 (scenarios.fp8_rows: cuBLASLt's FP8 GEMMs need 16 tokens a rank)
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
CLIP = 0.9  # max grad norm: below the model's norm for the first steps, so clipping acts (asserted in the tests)


def _global_batch(dim=training.DIM, rows=GLOBAL_BATCH):
    """The GLOBAL_BATCH samples, repeated to ``rows`` (a multiple): the same mean loss and gradients, so a 4-rank
    run (16 rows a rank) meets the same calibrated figures as a 2-rank one (the step-0 norm above CLIP)."""
    import torch

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(GLOBAL_BATCH, dim, generator=g), torch.randn(GLOBAL_BATCH, 16, generator=g)
    assert rows % GLOBAL_BATCH == 0, rows
    return x.repeat(rows // GLOBAL_BATCH, 1), y.repeat(rows // GLOBAL_BATCH, 1)


def _freeze(model, frozen):
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0] in frozen:
            param.requires_grad_(False)
    return model


def one_process_reference(fn):
    """``fn``, a one-process reference, computed by one rank of the run for all of them
    (:func:`accel_fp8_fix.testing.shared.once_per_run`); every rank then resets TE's global FP8 state, as the
    references do at their end, so the ranks that read the result go on from the state the computing one has."""
    shared = once_per_run(fn)

    @functools.wraps(fn)
    def reference(*args, **kwargs):
        try:
            return shared(*args, **kwargs)
        finally:
            reset_te_global_state()

    return reference


@one_process_reference
def _reference_fp8_losses(steps=STEPS, frozen=(), rows=GLOBAL_BATCH):
    """(losses, grad norms before clipping) of the same FP8 model trained in this one process on the full
    batch, clipped to ``CLIP`` (no collectives: reduce_amax=False — one process already sees every sample's amax).
    TE takes another weight path under FSDP2 (module/base.py ``is_fsdp2``): the FP8 weight is not saved in forward
    but re-quantized in backward with the scale updated at autocast exit. The reference takes the same path, so the
    comparison is exact rather than FP8-resolution. The loss is taken after the autocast exits."""
    import torch
    import transformer_engine.common.recipe as te_recipe

    recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                      reduce_amax=False)
    x, y = _global_batch(rows=rows)
    return train_reference(lambda: _freeze(training.block_stack(seed=0), frozen), lambda model: model(x), steps=steps,
                           lr=LR, max_norm=CLIP, recipe=recipe, convert={}, fsdp2_weight_path=True,
                           criterion=lambda out: torch.nn.functional.mse_loss(out.float(), y))


# -- assertions shared by test_fsdp2_fp8.py and test_accelerate_versions.py ------------------------------
LINEARS = {"head", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"}


def check_fp8_gemms(f, steps=STEPS):
    """Every converted Linear ran its forward GEMM in FP8 each step, and dgrad + wgrad in FP8 in backward
    (counted by the CPU kernel shim under TE's real Python); no GEMM in high precision."""
    assert {n: c for n, c in f["fp8_gemms_fwd_per_module"].items() if c} == {n: steps for n in LINEARS}
    assert f["fp8_gemms_fwd"] == len(LINEARS) * steps and f["fp8_gemms_bwd"] == 2 * len(LINEARS) * steps
    assert f["non_fp8_gemms"] == 0


def check_losses(f, reference):
    """Before any weight update the FP8 math is identical (the reference takes TE's FSDP2 weight path too);
    afterwards the gradient reduction's summation order differs and a last-bit difference can flip an FP8
    rounding (a 2**-3 relative step for e4m3), so later steps agree within FP8 resolution."""
    import pytest

    assert f["losses"][0] == pytest.approx(reference[0], rel=1e-6)
    assert f["losses"][1] == pytest.approx(reference[1], rel=1e-3)
    assert f["losses"] == pytest.approx(reference, rel=1e-2)


def check_grad_norms(f):
    """The norm ``clip_grad_norm_`` returned (as ``float()`` reads it) is the one-process norm, and clipping
    acted on it (the reference norm exceeds ``CLIP``; the losses after clipped updates match in check_losses).
    Within FP8 resolution: the per-rank backward casts its own gradients to E5M2, so single roundings differ
    from the whole batch's (the exact comparison is test_rehearsal.py's, precision "no"). One rank's share,
    the failure this guards against (A17), is 29% or more off."""
    import pytest

    assert len(f["grad_norms"]) == len(f["losses"]) and f["reference_grad_norms"][0] > CLIP
    assert f["grad_norms"][0] == pytest.approx(f["reference_grad_norms"][0], rel=STEP0_NORM_REL)
    assert f["grad_norms"] == pytest.approx(f["reference_grad_norms"], rel=2e-2), (f["grad_norms"],
                                                                                   f["reference_grad_norms"])


# Step 0's norm (the same weights on both sides) tells TE's FSDP2 weight path apart: measured 8.4e-5 relative
# with it, 1.19e-3 with it disabled on the ranks (the weight's FP8 copy from forward reused in backward).
STEP0_NORM_REL = 3e-4


def fsdp2_weight_path_facts(model, te_mods: dict) -> dict:
    """Every TE module answers TE's ``is_fsdp2`` True, and the FSDP2 state TE cached for it (``_te_cached_parent_fsdp_state``,
    set by TE's ``_get_module_fsdp_state``) is its enclosing FSDP2 unit's — the state whose hooks re-gather the
    weight that TE re-quantizes in backward."""
    units = {n: m for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state")}

    def enclosing(name):
        best = max((u for u in units if u == "" or name == u or name.startswith(u + ".")), key=len)
        return units[best]

    cached_ok = {}
    for name, m in te_mods.items():
        if hasattr(m, "_get_fsdp_state"):
            cached_ok[name] = True  # an FSDP2 unit itself: TE asks it directly
        else:
            cached_ok[name] = getattr(m, "_te_cached_parent_fsdp_state", None) is enclosing(name)._get_fsdp_state()
    # TE releases before the FSDP2 weight path (2.8) have no is_fsdp2: None
    is_fsdp2 = {n: (bool(m.is_fsdp2) if hasattr(type(m), "is_fsdp2") else None) for n, m in te_mods.items()}
    return {"is_fsdp2": is_fsdp2, "cached_state_is_enclosing_unit": cached_ok}


def reduced_fp8_state(model) -> dict:
    """The FP8 state that TE has reduced over the amax group: scales and the amax history without its
    row 0. Row 0 is the current step's pending, rank-local amax (under FSDP2 TE's backward re-quantizes the
    weight and writes its amax there, and TP shards differ); the next reduction takes its max over ranks."""
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    return {k: (v[1:] if k.endswith("amax_history") else v) for k, v in fp8_state_tensors(model).items()}


def _all_equal_across_ranks(tensors: dict) -> bool:
    """Every rank holds the same names with bit-identical tensors (dtype and shape included), and none holds a NaN
    (``torch.equal`` would call NaN unequal to itself). Ranks exchange one SHA-256 digest each: gathering the tensors
    themselves cost ~6 % of a 4-rank FP8 file (unpickling hundreds of small tensors every step)."""
    import hashlib

    import torch
    import torch.distributed as dist

    digest = hashlib.sha256()
    nan = False
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        nan = nan or bool(t.is_floating_point() and torch.isnan(t).any())
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (digest.hexdigest(), nan))
    return not any(n for _, n in gathered) and len({d for d, _ in gathered}) == 1


def sc_equal_across_ranks_probe(rank, world_size):
    """What ``_all_equal_across_ranks`` answers: equal tensors; one rank's value changed by one ulp; a NaN on every
    rank; the same bytes under another dtype on one rank; a name only one rank has."""
    import torch

    base = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int32)}
    ulp = dict(base, a=torch.nextafter(base["a"], torch.tensor(1e9)) if rank == 1 else base["a"])
    nan = dict(base, a=torch.full((2, 3), float("nan")))
    dtype = dict(base, b=base["b"].view(torch.float32) if rank == 1 else base["b"])
    name = dict(base, **({"c": torch.zeros(1)} if rank == 1 else {}))
    return {k: _all_equal_across_ranks(v) for k, v in
            {"equal": base, "one_ulp": ulp, "nan": nan, "dtype": dtype, "extra_name": name}.items()}


def sc_fsdp2_fp8_train(rank, world_size, dp_replicate=None, dp_shard=None, steps=STEPS, frozen=(), te_fsdp2_path=True):
    """FSDP2 + FP8 through the patched prepare: FP8 on, state registered + identical, losses vs one process.
    ``frozen``: module names whose parameters do not train (PEFT-style frozen first layers), in both.
    ``te_fsdp2_path=False``: a mutation — TE's FSDP2 weight path turned off on the ranks (the reference keeps it),
    to show the checks tell the two apart."""
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    from torch.distributed.fsdp import MixedPrecisionPolicy

    scenarios.ensure_rehearsal(True)
    # fp32 around the FP8 GEMMs (accelerate's default for fp8 is bf16 params/reduce), so that the
    # single-process reference can match exactly what the FP8 ranks compute.
    acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, dp_replicate=dp_replicate, mixed_precision="fp8",
                             wrap_cls=["Block"], fp8_recipe=RECIPE,
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
    rows = scenarios.fp8_rows(GLOBAL_BATCH, world_size)
    reference, reference_norms = _reference_fp8_losses(steps, frozen, rows)
    model = _freeze(training.block_stack(seed=0), frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, opt = acc.prepare(model, opt)
    setup = acc.accel_fp8_fix
    te_mods = {n: m for n, m in model.named_modules() if hasattr(m, "fp8_meta")}
    if not te_fsdp2_path:
        for m in te_mods.values():
            m._is_fsdp2 = False  # what TE's is_fsdp2 property caches
    facts = {
        "mp_policy": str(acc.state.fsdp_plugin.mixed_precision_policy),
        "converted": setup.conversion.converted,
        "skipped": setup.conversion.skipped,
        "fp8_enabled": setup.fp8_enabled,
        "amax_group_ranks": list(setup.amax_group_ranks),
        "mesh_ranks": sorted(setup.mesh.mesh.flatten().tolist()),
        "fp8_group_is_amax_group": all(m.fp8_meta.get("fp8_group") is setup.amax_group for m in te_mods.values()),
        "registered": sorted({r.path[-1] for r in setup.registered_state}),
        "buffers_visible": sorted(n for n, _ in model.named_buffers() if "_fp8_" in n)[:4],
        "params_are_dtensors": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "optimizer_holds_model_params": {id(p) for g in opt.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters() if p.requires_grad},
    }
    x, y = _global_batch(rows=rows)
    per = rows // world_size
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    scenarios.te_reset()
    fwd_gemms = scenarios.count_forward_gemms(te_mods)
    losses, same_state, norms = [], [], []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        # float() as a training script logs it: the returned norm must already be the whole mesh's (A17)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / world_size)
        same_state.append(_all_equal_across_ranks(reduced_fp8_state(model)))
    stats = scenarios.te_stats()
    facts.update(fsdp2_weight_path_facts(model, te_mods))
    facts.update(
        losses=losses,
        reference=reference,
        grad_norms=norms,
        reference_grad_norms=reference_norms,
        fp8_state_identical_every_step=same_state,
        fp8_gemms_fwd_per_module=dict(fwd_gemms),
        fp8_gemms_fwd=stats["fp8_gemms_fwd"], fp8_gemms_bwd=stats["fp8_gemms_bwd"],
        non_fp8_gemms=stats["non_fp8_gemms"],
        amax_reductions=stats["amax_reductions"],
        amax_groups=[g if g == "WORLD" else list(g) for g in stats["amax_reduction_groups"]],
        scales_moved=any(float(t.float().abs().sum()) != t.numel() for k, t in fp8_state_tensors(model).items()
                         if k.endswith("scale")),
    )
    return facts


def sc_te_version(rank, world_size):
    """Which Transformer Engine Python this rank imported (tests/network/test_te_versions.py shadows the venv's)."""
    from importlib.metadata import version

    import transformer_engine
    import transformer_engine.pytorch as te

    return {"version": version("transformer-engine"), "file": transformer_engine.__file__,
            "has_autocast": hasattr(te, "autocast")}


def sc_no_convertible_layer(rank, world_size):
    """Bad input: nothing TE can take -> the kept layers logged, a warning that FP8 is off at the user's
    prepare() line (rank 0 only: one voice), training still works."""
    import logging
    import warnings

    import torch

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=RECIPE)
    model = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("accel_fp8_fix").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = acc.prepare(model, opt)
    logging.getLogger("accel_fp8_fix").removeHandler(handler)
    loss = model(torch.randn(4, 10)).sum()
    acc.backward(loss)
    opt.step()
    return {
        "warnings": [str(w.message) for w in caught if "accel_fp8_fix" in str(w.message)],
        "warning_files": [os.path.basename(w.filename) for w in caught if "accel_fp8_fix" in str(w.message)],
        "logged": [m for m in logged if "kept" in m],
        "fp8_enabled": acc.accel_fp8_fix.fp8_enabled,
        "loss_finite": bool(torch.isfinite(loss)),
        "types": [type(m).__name__ for m in model.modules()][1:],
    }


def sc_optimizer_without_model(rank, world_size):
    import torch

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=RECIPE)
    opt = torch.optim.SGD(torch.nn.Linear(16, 16).parameters(), lr=0.1)
    try:
        acc.prepare(opt)
    except Exception as exc:  # noqa: BLE001
        return {"error": scenarios.err(exc)}
    return {"error": None}


def sc_largest_allocation(rank, world_size):
    """Largest tensor created while prepare converts: patched (after sharding) vs stock (before)."""
    import torch

    from accel_fp8_fix.testing.alloc import LargestAllocation

    scenarios.ensure_rehearsal(True)
    out = {}
    for label in ("patched", "stock"):
        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPE)
        model = training.block_stack(dim=256, seed=0)
        full = max(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if label == "stock":
            import accel_fp8_fix

            accel_fp8_fix.deactivate()
        with LargestAllocation() as largest:
            model, opt = acc.prepare(model, opt)
        if label == "stock":
            accel_fp8_fix.activate()
        out[label] = {"largest": largest.numel, "where": largest.op, "full_weight": full}
    return out


def sc_checkpoint_save(rank, world_size, out_dir):
    """Train a few FP8 steps, save_state (sharded DCP) + the full state dict as reference."""
    import torch

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPE)
    model = training.block_stack(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x, y = _global_batch()
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(os.path.join(out_dir, "ckpt"))
    full = acc.get_state_dict(model, unwrap=False)  # everything save_state keeps, FP8 state included
    export = acc.get_state_dict(model)  # unwrap=True: an export (save_model), without the FP8 state
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(out_dir, "reference.pt"))
        torch.save({k: v.detach().clone() for k, v in fp8_state_tensors(model).items()},
                   os.path.join(out_dir, "reference_fp8.pt"))
    return {"keys": sorted(full) if rank == 0 else None, "export_keys": sorted(export) if rank == 0 else None}


def sc_checkpoint_load(rank, world_size, out_dir, recompute_entry=False):
    """A fresh model on another world size loads the checkpoint: every weight and FP8 state bit for bit.
    ``recompute_entry``: first, each TE module's FP8 metadata gets the entry TE's activation-checkpoint recompute
    adds (``copy_forward_fp8_meta_tensors_for_recompute``, what a resumed run with gradient checkpointing meets):
    its ``_extra_state`` pickle is then longer than the checkpoint's (2201 -> 2241 bytes)."""
    import torch

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPE)
    model = training.block_stack(seed=123)  # different init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    sizes = {}
    if recompute_entry:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        for name, module in model.named_modules():
            if hasattr(module, "fp8_meta") and "scaling_fwd" in module.fp8_meta:
                before = module.get_extra_state().numel()
                FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(module.fp8_meta)
                sizes[name] = (before, module.get_extra_state().numel())
    acc.load_state(os.path.join(out_dir, "ckpt"))
    full = acc.get_state_dict(model, unwrap=False)  # gathered on rank 0 only
    if rank != 0:
        full = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    reference = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    # _extra_state bytes are a pickle (not byte-stable across re-pickling): its content is compared
    # decoded, through the FP8 state tensors it restored.
    mismatched = sorted(k for k in reference if not k.endswith("_extra_state")
                        and (k not in full or not torch.equal(full[k].cpu(), reference[k].cpu())))
    ref_fp8 = torch.load(os.path.join(out_dir, "reference_fp8.pt"), weights_only=False)
    got_fp8 = fp8_state_tensors(model)
    fp8_mismatched = sorted(k for k in ref_fp8 if k not in got_fp8 or not torch.equal(got_fp8[k], ref_fp8[k]))
    missing = sorted(set(reference) ^ set(full))
    extra_state_keys = [k for k in reference if k.endswith("_extra_state")]
    nonempty = [k for k in extra_state_keys if reference[k].numel() > 0]
    same_fp8 = _all_equal_across_ranks(fp8_state_tensors(model))
    return {"mismatched": mismatched, "missing": missing, "extra_state_keys": len(extra_state_keys),
            "fp8_mismatched": fp8_mismatched, "fp8_compared": len(ref_fp8),
            "fp8_nontrivial": sum(int(float(v.float().abs().sum()) not in (0.0, v.numel())) for v in ref_fp8.values()),
            "nonempty_extra_state": len(nonempty), "fp8_state_identical": same_fp8, "extra_state_sizes": sizes}


def sc_gradient_checkpointing_resume(rank, world_size, out_dir, steps=4, saved_at=2):
    """transformers' gradient checkpointing with FP8 under FSDP2, stopped and resumed (issue 47 item 4): one run
    saves at step ``saved_at`` — its TE modules carry the recompute's extra fp8_meta entry by then, so its
    ``_extra_state`` pickles are longer than a fresh model's (A24) — and a fresh model (another init) and accelerator
    load it and train on to ``steps``. Against the uninterrupted run: the losses after the resume, every weight shard
    and every FP8 state, bit for bit. The batch of step ``i`` depends on ``i`` alone (the data position)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    scenarios.ensure_rehearsal(True)

    def train(seed, first, last, load=None, save=None):
        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=RECIPE,
                                         wrap_cls=["LlamaDecoderLayer"],
                                         mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                                     reduce_dtype=torch.float32))
        model = training.tiny_llama(seed=seed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        if load:
            acc.load_state(load)
        losses = []
        for step in range(first, last):
            loss = model(**training.token_batch(batch=2, seq=8, seed=1000 * step + rank)).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        if save:
            acc.save_state(save)
        shards = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                  for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        return losses, shards, {k: v.clone() for k, v in fp8_state_tensors(model).items()}

    whole_losses, whole, whole_fp8 = train(0, 0, steps)
    checkpoint = os.path.join(out_dir, "gradient_checkpointing")
    first_losses, _, _ = train(0, 0, saved_at, save=checkpoint)
    resumed_losses, resumed, resumed_fp8 = train(1, saved_at, steps, load=checkpoint)
    return {"whole_losses": whole_losses, "first_losses": first_losses, "resumed_losses": resumed_losses,
            "weights": len(whole), "unequal_weights": sorted(k for k in whole if not torch.equal(whole[k], resumed[k])),
            "fp8_states": len(whole_fp8),  # trained, not initial values (scales of 1, histories of 0)
            "fp8_nontrivial": sum(int(float(v.float().abs().sum()) not in (0.0, v.numel())) for v in whole_fp8.values()),
            "unequal_fp8": sorted(k for k in whole_fp8 if k not in resumed_fp8 or not torch.equal(whole_fp8[k],
                                                                                                resumed_fp8[k]))}


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {"env": scenarios.ENV_FIXED, "timeout": 300.0, "collective_timeout": 90.0}

def sc_activation_checkpointing(rank, world_size, how, fix=True, steps=3, reentrant=False):
    """FP8 training with activation checkpointing: ``how`` = "transformers" (a Llama with
    ``gradient_checkpointing_enable()`` before prepare) or "accelerate" (FSDP2 plugin
    ``activation_checkpointing=True``: torch's CheckpointWrapper around each Block), or "none" (the
    same model without checkpointing, the comparison). ``fix=False`` leaves the checkpoint functions as
    they are (what stock routing does): the recompute then runs outside TE's FP8 autocast."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import accel_fp8_fix.fixes.prepare as prepare_fix

    scenarios.ensure_rehearsal(True)
    from accel_fp8_fix.fixes.step.activation_checkpointing import route_checkpointing_through_te

    if not fix:
        prepare_fix.route_checkpointing_through_te = lambda model: ([], [])
    llama = how in ("transformers", "none-llama")
    kwargs = {"activation_checkpointing": True} if how == "accelerate" else {}
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=RECIPE,
                             wrap_cls=["LlamaDecoderLayer"] if llama else ["Block"],
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32), **kwargs)
    model = training.tiny_llama(seed=0) if llama else training.block_stack(seed=0)
    if how == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    facts = {"routed": acc.accel_fp8_fix.checkpointing_routed, "error": None}
    scenarios.te_reset()
    losses = []
    try:
        for _ in range(steps):
            if llama:
                loss = model(**training.token_batch(batch=2, seq=8, seed=rank)).loss
            else:
                rows = scenarios.fp8_rows(GLOBAL_BATCH, world_size)
                x, y = _global_batch(rows=rows)
                per = rows // world_size
                loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]).float(),
                                                    y[rank * per:(rank + 1) * per])
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            dist.all_reduce(value)
            losses.append(float(value) / world_size)
    except Exception as exc:  # noqa: BLE001
        facts["error"] = scenarios.err(exc)
    stats = scenarios.te_stats()
    facts.update(losses=losses, fp8_gemms_fwd=stats["fp8_gemms_fwd"], fp8_gemms_bwd=stats["fp8_gemms_bwd"],
                 non_fp8_gemms=stats["non_fp8_gemms"], amax_reductions=stats["amax_reductions"],
                 amax_groups=sorted({str(g) for g in stats["amax_reduction_groups"]}))
    prepare_fix.route_checkpointing_through_te = route_checkpointing_through_te
    return facts


MXFP8_RECIPE = {"fp8_format": "E4M3", "use_mxfp8_block_scaling": True}


def sc_fsdp2_mxfp8_train(rank, world_size, steps=4):
    """FSDP2 + MXFP8 (accelerate's ``use_mxfp8_block_scaling``) through the patched prepare, on TE's Python
    answering as a Blackwell (``ACCEL_FP8_FIX_CPU_TE_ARCH=sm100``): 32 tokens per rank (MXFP8 scales
    32-element blocks); losses vs the same recipe in one process; a stateless recipe: no amax reduction,
    empty ``_extra_state``."""
    import torch
    import torch.distributed as dist
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding
    from accel_fp8_fix.internals.transformer_engine.modules import take_fsdp2_weight_path

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=MXFP8_RECIPE,
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(32 * world_size, training.DIM, generator=g), torch.randn(32 * world_size, 16, generator=g)
    # the reference: same model and recipe, whole batch, one process (TE's FSDP2 weight path, as the ranks)
    ref_model = training.block_stack(seed=0)
    convert_after_sharding(ref_model, te, dim_multiple=32)  # head (64 -> 16) stays high precision, as on the ranks
    take_fsdp2_weight_path(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    recipe = te_recipe.MXFP8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    reference = []
    for _ in range(steps):
        with te_autocast(te)(True, recipe, None):
            loss = torch.nn.functional.mse_loss(ref_model(x).float(), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.append(float(loss))
    reset_te_global_state()
    model = training.block_stack(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    setup = acc.accel_fp8_fix
    scenarios.te_reset()
    mine = slice(rank * 32, (rank + 1) * 32)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
    stats = scenarios.te_stats()
    extra = {k: v.numel() for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    return {"recipe": type(setup.recipe).__name__, "fp8_enabled": setup.fp8_enabled, "losses": losses,
            "skipped": [[n, why] for n, why in setup.conversion.skipped],
            "reference": reference, "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "fp8_gemms_bwd": stats["fp8_gemms_bwd"],
            "non_fp8_gemms": stats["non_fp8_gemms"], "mxfp8_casts": stats.get("quantize_MXFP8Quantizer", 0),
            "amax_reductions": stats["amax_reductions"], "extra_state_sizes": sorted(set(extra.values()))}
