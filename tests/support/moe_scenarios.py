"""MoE experts in FP8 (fixes/convert/moe_experts.py, issue 19) scenarios: the one-process checks of
tests/unit/test_moe_experts.py (each in a fresh process: TE's Python over the CPU shim) and the ranks of
tests/distributed/test_moe_fp8.py (Qwen3-MoE and Qwen2-MoE under FSDP2, HSDP and FSDP2 x TP).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import tolerances
from . import zoo_scenarios

FAMILIES = ("qwen3_moe", "qwen2_moe")
# more packed-experts families, trained FP8 under FSDP2 (and FSDP2 x TP, tests/distributed/test_moe_fp8.py) so that
# nothing lets their experts drop out of FP8 unseen (issue 30 item 3)
MORE_FAMILIES = ("mixtral", "olmoe", "deepseek_v3")
# GPT-OSS's layout ([E, in, out] experts with biases, gate / up interleaved, clamped SwiGLU): one process here and
# FSDP2 in tests/distributed/test_moe_fp8.py (its TP plan shards only the embedding: no FSDP2 x TP case)
FSDP2_ONLY_FAMILIES = ("gpt_oss",)
UNIT_FAMILIES = FAMILIES + FSDP2_ONLY_FAMILIES  # the one-process checks of tests/unit/test_moe_experts.py
DECODER_LAYER = {f: training.ZOO_DECODER_LAYER[f] for f in FAMILIES + MORE_FAMILIES + FSDP2_ONLY_FAMILIES}
LAYOUTS = {"fsdp2": (None, 2, None), "tp": (None, None, 2), "hsdp": (2, 2, None), "fsdp2_tp": (None, 2, 2),
           "fsdp2_one_rank": (None, None, None)}  # (dp_replicate, dp_shard, tp); one rank: FSDP2, no ParallelismConfig
STEPS = 3
LR = 0.02
TOKENS = 40  # rows of the experts-level checks: 80 (token, expert) pairs over 4 experts (no count a multiple of 16)


def _te():
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.pytorch as te

    return te


def _recipe(kind):
    import transformer_engine.common.recipe as te_recipe

    if kind == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    if kind == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    return te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max", reduce_amax=False)


def _experts_of(model, layer=0):
    return model.model.layers[layer].mlp.experts


def _eager(experts, implementation="eager"):
    """A copy of transformers' experts module running ``implementation`` (its own loop: "eager")."""
    ref = copy.deepcopy(experts)
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = implementation
    return ref


def _routing(family, zero_experts=()):
    """(hidden [T, H], top_k_index, top_k_weights) from the model's own router; ``zero_experts`` never chosen."""
    import torch

    model = training.zoo_model(family)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, 64, generator=g)
    mlp = model.model.layers[0].mlp
    logits = (mlp.router if hasattr(mlp, "router") else mlp.gate)(hidden)[0].detach()
    for e in zero_experts:
        logits[:, e] = -1e9
    weights, index = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    return hidden, index, weights


def _run_experts(experts, hidden, index, weights, grad, autocast=None):
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    with autocast if autocast is not None else contextlib.nullcontext():
        out = experts(h, index, w)
    out.backward(grad)
    return {"out": out.detach(), "hidden": h.grad, "weights": w.grad, **_param_grads(experts)}


def _param_grads(experts) -> dict:
    """Every parameter's gradient of an experts module (the 3-D weights; GPT-OSS: and their biases)."""
    return {n: p.grad.clone() for n, p in experts.named_parameters(recurse=False)}


def _compare(got, want) -> dict:
    """{tensor: [exactly equal, max |diff|, ||diff|| / ||want||]}."""
    import torch

    out = {}
    for k, v in want.items():
        diff = (got[k] - v).float()
        out[k] = [bool(torch.equal(got[k], v)), float(diff.abs().max()),
                  float(diff.norm() / v.float().norm().clamp_min(1e-30))]
    return out


def _te_linear_loop(experts, hidden, index, weights, grad, autocast):
    """transformers' eager loop with each expert GEMM a ``te.Linear`` on ``gate_up_proj[e]`` / ``down_proj[e]``
    (``[out, in]``; GPT-OSS's ``[in, out]`` transposed contiguous, with its bias; rows zero-padded to 16 for FP8),
    gated by the class's own ``_apply_gate``: what the grouped GEMM must reproduce expert by expert."""
    import torch
    import transformer_engine.pytorch as te

    transposed = getattr(experts, "is_transposed", False)

    def linear(x, name, e):
        weight = getattr(experts, name)[e]
        weight = weight.t().contiguous() if transposed else weight
        bias = getattr(experts, f"{name}_bias")[e] if getattr(experts, "has_bias", False) else None
        lin = te.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        lin._parameters["weight"] = weight
        if bias is not None:
            lin._parameters["bias"] = bias
        rows = -(-x.shape[0] // 16) * 16
        padded = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
        return lin(padded)[: x.shape[0]]

    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    final = torch.zeros_like(h)
    mask = torch.nn.functional.one_hot(index, num_classes=experts.num_experts).permute(2, 1, 0)
    with autocast:
        for e in range(experts.num_experts):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            gated = experts._apply_gate(linear(h[token], "gate_up_proj", e))
            out = linear(gated, "down_proj", e) * w[token, slot, None]
            final.index_add_(0, token, out)
    final.backward(grad)
    return {"out": final.detach(), "hidden": h.grad, "weights": w.grad, **_param_grads(experts)}


def _splits_probe(experts):
    """m_splits each TE runner received, per call."""
    seen = []
    for name in ("te_gate_up", "te_down"):
        getattr(experts, name).register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[1].tolist())))
    return seen


def _experts_case(family, zero_experts=(), recipes=("delayed", "current")) -> dict:
    """transformers' experts (eager loop, and grouped_mm) vs the TE grouped-GEMM forward, FP8 off and on."""
    import torch

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.moe_experts import convert_experts

    te = _te()
    hidden, index, weights = _routing(family, zero_experts)
    grad = torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(4))
    facts = {"counts": torch.bincount(index.reshape(-1), minlength=4).tolist()}
    model = training.zoo_model(family)
    experts = _experts_of(model)
    eager, grouped_mm = _eager(experts), _eager(experts, "grouped_mm")
    want = _run_experts(eager, hidden, index, weights, grad)
    facts["vs_grouped_mm_of_transformers"] = _compare(_run_experts(grouped_mm, hidden, index, weights, grad), want)
    facts["converted"], facts["skipped"] = convert_experts(model, te)
    seen = _splits_probe(experts)
    scenarios.te_reset()
    with tolerances.tf32_set("off"):  # the wiring: transformers' loop bit for bit where the GEMMs compute in fp32
        got = _run_experts(experts, hidden, index, weights, grad, te_autocast(te)(False, _recipe("delayed"), None))
    facts["fp8_off"] = _compare(got, want)
    facts["fp8_off_splits"], facts["fp8_off_stats"] = list(seen), scenarios.te_stats()
    experts.zero_grad()
    scenarios.te_reset()  # as on the device: TE's all-fp32 GEMMs in TF32
    got = _run_experts(experts, hidden, index, weights, grad, te_autocast(te)(False, _recipe("delayed"), None))
    facts["fp8_off_tf32"] = _compare(got, want)
    facts["fp8_off_tf32_gemms"] = scenarios.te_stats().get("tf32_gemms", 0)
    for kind in recipes:
        seen.clear()
        experts.zero_grad()
        scenarios.te_reset()
        got = _run_experts(experts, hidden, index, weights, grad, te_autocast(te)(True, _recipe(kind), None))
        facts[f"fp8_{kind}"] = _compare(got, want)
        facts[f"fp8_{kind}_splits"], facts[f"fp8_{kind}_stats"] = list(seen), scenarios.te_stats()
        fp8_scenarios.reset_te_global_state()
        if kind == "current":  # stateless scaling: a te.Linear per expert quantizes exactly as the grouped GEMM
            loop_model = training.zoo_model(family)
            loop = _te_linear_loop(_experts_of(loop_model), hidden, index, weights, grad,
                                   te_autocast(te)(True, _recipe(kind), None))
            facts["fp8_current_vs_te_linear_loop"] = _compare(got, loop)
            fp8_scenarios.reset_te_global_state()
    experts.zero_grad()
    return facts


def _model_case(family) -> dict:
    """A whole model, FP8 off: only the experts on TE grouped GEMMs vs plain transformers (eager experts)."""
    import torch

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.moe_experts import convert_experts

    te = _te()
    ref, model = training.zoo_model(family), training.zoo_model(family)
    ref.config._experts_implementation = "eager"
    convert_experts(model, te)
    data = zoo_scenarios.batch()
    ref_loss = ref(**data).loss
    ref_loss.backward()
    with tolerances.tf32_set("off"):  # the wiring, as _experts_case's
        with te_autocast(te)(False, _recipe("delayed"), None):
            loss = model(**data).loss
        loss.backward()
    grads = dict(ref.named_parameters())
    unequal = sorted(n for n, p in model.named_parameters() if not torch.equal(p.grad, grads[n].grad))
    worst = max(float((p.grad - grads[n].grad).abs().max() / grads[n].grad.abs().max().clamp_min(1e-30))
                for n, p in model.named_parameters())
    return {"loss": [float(loss), float(ref_loss)], "loss_equal": bool(torch.equal(loss, ref_loss)),
            "unequal_grads": unequal, "max_grad_rel_error": worst}


def _state_dict_case(family) -> dict:
    """convert_after_sharding (Linear, LayerNorm and the experts): the parameters and state_dict of plain
    transformers, plus TE's _extra_state."""
    import torch

    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding

    te = _te()
    plain, model = training.zoo_model(family), training.zoo_model(family)
    before = {n: id(p) for n, p in model.named_parameters()}
    report = convert_after_sharding(model, te)
    sd, ref = model.state_dict(), plain.state_dict()
    ours = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    return {
        "experts": report.experts, "skipped": dict(report.skipped),
        "same_keys": sorted(ours) == sorted(ref),
        "extra_keys": sorted(k for k in sd if k not in ref),
        "same_shapes_dtypes": all(ours[k].shape == ref[k].shape and ours[k].dtype == ref[k].dtype for k in ref),
        "same_values": all(torch.equal(ours[k], ref[k]) for k in ref),
        "same_parameter_objects": {n: id(p) for n, p in model.named_parameters()} == before,
        "runner_params": sum(len(list(m.parameters())) for n, m in model.named_modules() if n.endswith(("te_gate_up", "te_down"))),
    }


def _coverage_case(family) -> dict:
    """audit(model).coverage after the prepare-like steps in one process: convert (lm_head included, as FSDP2
    alone converts it), FP8 state with num_gemms=E, forward wrapped in TE autocast, one FP8 training step."""
    import torch

    import accel_fp8_fix
    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast, wrap_forward
    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding
    from accel_fp8_fix.internals.transformer_engine import gemms_per_forward

    te = _te()
    model = training.zoo_model(family)
    recipe = _recipe("delayed")
    report = convert_after_sharding(model, te)
    with torch.no_grad(), te_autocast(te)(True, recipe, None):
        for module in report.te_modules:
            module.init_fp8_metadata(num_gemms=gemms_per_forward(module))
    runner = _experts_of(model).te_gate_up
    shapes = [list(runner.fp8_meta["scaling_fwd"].amax_history.shape), list(runner.fp8_meta["scaling_bwd"].amax_history.shape)]
    wrap_forward(model, te, recipe, None, False)
    model.train()
    model(**zoo_scenarios.batch()).loss.backward()
    coverage = accel_fp8_fix.audit(model).coverage
    fp8_scenarios.reset_te_global_state()
    return {"fp8_param_share": coverage.fp8_param_share, "high_precision": coverage.high_precision,
            "fp8_params": coverage.fp8_params, "gemm_params": coverage.gemm_params, "meta_shapes": shapes,
            "meta_shapes_after_forward": [list(runner.fp8_meta["scaling_fwd"].amax_history.shape)],
            "summary": str(coverage)}


def sc_single(rank, world_size, family):
    """Every one-process check of one family (a fresh process: TE's global state and the shim's stats)."""
    warnings.simplefilter("ignore")
    return {"experts": _experts_case(family), "zeros": _experts_case(family, zero_experts=(3,), recipes=("delayed",)),
            "model": _model_case(family), "state_dict": _state_dict_case(family), "coverage": _coverage_case(family)}


def sc_mxfp8_padding(rank, world_size):
    """MXFP8 (Blackwell, ACCEL_FP8_FIX_CPU_TE_ARCH=sm100): every expert's rows padded to 32."""
    warnings.simplefilter("ignore")
    out = _experts_case("qwen3_moe", zero_experts=(2,), recipes=("mxfp8",))
    out["row_multiples"] = _row_multiples()
    return out


def _row_multiples() -> dict:
    """{recipe: (the package's expert row multiple, TE's get_align_size_for_quantization)} for every built-in
    recipe (the sm100 target: NVFP4 exists there)."""
    from transformer_engine.common import recipe as te_recipe
    from transformer_engine.pytorch.quantization import get_align_size_for_quantization

    from accel_fp8_fix.fixes.convert.moe_experts import expert_row_multiple

    recipes = {"delayed": te_recipe.DelayedScaling(), "current": te_recipe.Float8CurrentScaling(), "block": te_recipe.Float8BlockScaling(),
               "mxfp8": te_recipe.MXFP8BlockScaling(), "nvfp4": te_recipe.NVFP4BlockScaling()}
    return {name: [expert_row_multiple(r), get_align_size_for_quantization(r)] for name, r in recipes.items()}


# -- distributed -------------------------------------------------------------------------------------------
def _full(tensor):
    return scenarios.full_tensor(tensor)


def _expert_grads(model) -> dict:
    return {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()
            if p.dim() == 3 and p.grad is not None}


@fp8_scenarios.one_process_reference
def reference(family, fp8, convert, steps=STEPS):
    """One process, full batch: (losses, grad norms, step-0 expert gradients). ``convert``: the experts (and
    every Linear but lm_head) on TE, run under TE autocast with FP8 ``fp8``; without it plain transformers
    (eager experts loop)."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding

    model = training.zoo_model(family)
    model.config._experts_implementation = "eager"
    if convert:
        convert_after_sharding(model, te, exclude=("lm_head",))
    grads, batch = {}, zoo_scenarios.batch()
    losses, norms = train_reference(lambda: model, lambda m: m(**batch).loss, steps=steps, lr=LR, max_norm=1e9,
                                    recipe=_recipe("delayed"), fp8=fp8,
                                    after_first_backward=lambda m: grads.update(_expert_grads(m)))
    return losses, norms, grads


def _prepared(family, layout, experts_tp="tp"):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dp_replicate, dp_shard, tp = LAYOUTS[layout]
    fsdp = dp_shard is not None or layout == "fsdp2_one_rank"
    extra = {"mixed_precision_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
             "wrap_cls": [DECODER_LAYER[family]]} if fsdp else {}
    acc = scenarios.make_accelerator(fsdp=fsdp, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, mixed_precision="fp8",
                             fp8_recipe=fp8_scenarios.RECIPE, expect="FSDP" if fsdp else "MULTI_GPU", **extra)
    model = training.zoo_model(family)
    model.config._experts_implementation = "eager"
    if tp:
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"], experts=experts_tp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _runner_calls(model) -> list:
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith(("te_gate_up", "te_down")):
            module.register_forward_pre_hook(lambda mod, args: calls.__setitem__(0, calls[0] + 1))
    return calls


def sc_moe(rank, world_size, family, layout, fp8=True, steps=STEPS, experts=True, experts_tp="tp"):
    """``_sc_moe``; without FP8 the experts' TE GEMMs compute in fp32 (TF32 off): the check is the wiring's, to
    summation order (TF32 as on the device: tests/unit/test_moe_experts.py)."""
    with tolerances.tf32_set(None if fp8 else "off"):
        return _sc_moe(rank, world_size, family, layout, fp8, steps, experts, experts_tp)


def _sc_moe(rank, world_size, family, layout, fp8=True, steps=STEPS, experts=True, experts_tp="tp"):
    """Train ``steps`` steps prepared by the package (experts on TE grouped GEMMs): losses, clipped grad norms
    and step-0 expert gradients vs the one-process references. ``fp8=False``: the same prepared model run with
    its TE autocast off (eval mode: the wrapped forward turns FP8 off there), against plain transformers.
    ``experts_tp``: under TP, the experts TP-sharded by ``moe_tp_experts`` ("tp") or as the family's own plan
    leaves them ("default": replicated on the TP ranks from transformers 5.25)."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    scenarios.ensure_rehearsal(True)
    ref = reference(family, fp8=fp8, convert=fp8, steps=steps)
    if experts:
        acc, model, opt = _prepared(family, layout, experts_tp)
    else:  # the experts left to transformers (everything else prepared as usual): what TP alone does
        from unittest import mock

        with mock.patch("accel_fp8_fix.fixes.convert.te_convert.convert_experts", lambda *a, **k: ([], [])):
            acc, model, opt = _prepared(family, layout, experts_tp)
    setup = acc.accel_fp8_fix
    dp_rank, dp_size = zoo_scenarios._data_rank(acc, layout)
    per = zoo_scenarios.GLOBAL_BATCH // dp_size
    data = zoo_scenarios.batch(slice(dp_rank * per, (dp_rank + 1) * per))
    calls = _runner_calls(model)
    if not fp8:
        model.eval()
    scenarios.te_reset()
    losses, norms, same, grad_errors = [], [], [], {}
    for step in range(steps):
        loss = model(**data).loss
        acc.backward(loss)
        if step == 0:
            grads = _expert_grads(model)
            step0_grads = {n: g.tolist() for n, g in grads.items()} if layout == "tp" else None
            grad_errors = {n: float((grads[n] - g).abs().max() / g.abs().max()) if n in grads else None
                           for n, g in ref[2].items()}
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
        same.append(fp8_scenarios._all_equal_across_ranks(fp8_scenarios.reduced_fp8_state(model)))
    stats = scenarios.te_stats()
    import accel_fp8_fix

    coverage = accel_fp8_fix.audit(model, acc).coverage
    output_layer = acc.unwrap_model(model).lm_head.weight.numel()  # global elements (a DTensor's numel is global)
    facts = {"experts": setup.conversion.experts, "skipped": dict(setup.conversion.skipped),
             "losses": losses, "reference": ref[0], "grad_norms": norms, "reference_grad_norms": ref[1],
             "expert_grad_rel_errors": grad_errors, "fp8_state_identical_every_step": same,
             "step0_expert_grads": step0_grads,
             "runner_calls": calls[0], "grouped_gemms": stats.get("grouped_gemms", 0),
             "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "non_fp8_gemms_fwd": stats["non_fp8_gemms_fwd"],
             "coverage": coverage.fp8_param_share, "high_precision": coverage.high_precision,
             "fp8_share_outside_lm_head": coverage.fp8_params / (coverage.gemm_params - output_layer),
             "params_are_leaves": all(p.is_leaf for p in model.parameters()),
             "expert_placements": {n: [str(x) for x in getattr(p, "placements", ())] for n, p in model.named_parameters()
                                   if n.startswith("model.layers.0.mlp.experts.")},
             "runner_features": [[m.in_features, m.out_features] for n, m in model.named_modules()
                                 if n.startswith("model.layers.0.mlp.experts.te_")],
             "param_names": sorted(n for n, _ in model.named_parameters())}
    fp8_scenarios.reset_te_global_state()
    return facts


def sc_proportioned_coverage(rank, world_size):
    """The demo line's figure on a Qwen3-MoE with a real model's proportions (``training.proportioned_qwen3_moe``),
    prepared by the package under FSDP2: ``audit(model).coverage`` after one FP8 step, and what the coverage
    warning at ``prepare`` said."""
    import torch

    import accel_fp8_fix

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=fp8_scenarios.RECIPE, wrap_cls=[DECODER_LAYER["qwen3_moe"]])
    model = training.proportioned_qwen3_moe()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = acc.prepare(model, opt)
    per = zoo_scenarios.GLOBAL_BATCH // world_size
    acc.backward(model(**zoo_scenarios.batch(slice(rank * per, (rank + 1) * per))).loss)
    coverage = accel_fp8_fix.audit(model, acc).coverage
    fp8_scenarios.reset_te_global_state()
    return {"coverage": coverage.fp8_param_share, "high_precision": coverage.high_precision,
            "skipped": dict(acc.accel_fp8_fix.conversion.skipped), "coverage_warnings": [str(w.message) for w in caught if "FP8 covers" in str(w.message)]}


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 900.0}

@contextlib.contextmanager
def _handed_weights_probe():
    """Yields the list of ``is_contiguous()`` of every weight the package hands a TE grouped GEMM (GPT-OSS: TE
    reads storage, not strides — a transposed view would be silently wrong on a GPU in a non-FP8 pass)."""
    from unittest import mock

    from accel_fp8_fix.internals import transformer_engine as te_internals

    seen, original = [], te_internals.grouped_linear_on_views

    def probe(module, weights, inp, m_splits, biases=None):
        seen.extend(w.is_contiguous() for w in weights)
        return original(module, weights, inp, m_splits, biases)

    with mock.patch.object(te_internals, "grouped_linear_on_views", probe):
        yield seen


def sc_unit(rank, world_size):
    """Every family's one-process checks in one fresh process."""
    facts = {}
    for family in UNIT_FAMILIES:
        with _handed_weights_probe() as handed:
            facts[family] = sc_single(rank, world_size, family)
        facts[family]["handed_weights_contiguous"] = [len(handed), all(handed)]
    return facts
