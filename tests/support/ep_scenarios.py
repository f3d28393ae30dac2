"""Expert parallelism with FP8 (issue 30 item 1): MoE models sharded at load by transformers
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=F, ep_size=E))``: its EP token dispatch —
an all-to-all over gloo — and its FSDP2, the experts on their own ``efsdp`` mesh), then accelerate FSDP2 + fp8
with the package (tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import contextlib
import warnings

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import moe_scenarios
from . import scenarios
from . import tolerances
from . import zoo_scenarios

STEPS = 3
LAUNCH = {**fp8_scenarios.LAUNCH, "timeout": 400.0}
RUNNERS = ("te_gate_up", "te_down")


def _runners(model) -> dict:
    """{"<layer>.<runner>": TE GroupedLinear} of every experts module."""
    return {f"{n.split('.')[2]}.{r}": getattr(m, r) for n, m in model.named_modules()
            if n.endswith("mlp.experts") and hasattr(m, RUNNERS[0]) for r in RUNNERS}


def _fwd_amax(model) -> dict:
    return {k: r.fp8_meta["scaling_fwd"].amax_history.clone() for k, r in _runners(model).items()}


@contextlib.contextmanager
def _skewed_routing(model, experts):
    """Every token routed to ``experts`` (a forward hook on transformers' router, whose output is (logits, top-k
    scores, top-k indices)): the EP rank holding none of them gets no rows at all."""
    import torch

    def hook(module, args, output):
        logits, scores, indices = output
        return logits, scores, torch.tensor(list(experts), dtype=indices.dtype).expand_as(indices).contiguous()

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@fp8_scenarios.one_process_reference
def reference(family, fp8, steps, skew=None):
    """One process, full batch: (losses, clipped grad norms, the experts' forward amax histories after step 0)."""
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding

    model = training.zoo_model(family)
    model.config._experts_implementation = "eager"
    if fp8:
        convert_after_sharding(model, te, exclude=("lm_head",))
    amax, batch = {}, zoo_scenarios.batch()
    with _skewed_routing(model, skew) if skew else contextlib.nullcontext():
        losses, norms = train_reference(
            lambda: model, lambda m: m(**batch).loss, steps=steps, lr=moe_scenarios.LR, max_norm=1e9,
            recipe=moe_scenarios._recipe("delayed"), fp8=fp8,
            after_first_backward=lambda m: amax.update(_fwd_amax(m) if fp8 else {}))
    return losses, norms, amax


def sc_ep(rank, world_size, family="qwen3_moe", fsdp=4, ep=2, fp8=True, steps=STEPS, skew=None, tp=None):
    """``_sc_ep``; without FP8 the experts' TE GEMMs compute in fp32 (TF32 off): the wiring's check."""
    with tolerances.tf32_set(None if fp8 else "off"):
        return _sc_ep(rank, world_size, family, fsdp, ep, fp8, steps, skew, tp)


def _sc_ep(rank, world_size, family="qwen3_moe", fsdp=4, ep=2, fp8=True, steps=STEPS, skew=None, tp=None):
    """Train ``steps`` steps of ``family`` loaded with transformers' FSDP2 x EP (x TP with ``tp``: its TP plan on
    the dense modules, accelerate FSDP2 x TP on the same ranks) and prepared by the package: losses, clipped grad
    norms and the experts' FP8 state against the one-process reference. ``skew``: every token routed to those
    experts (the other EP rank runs none)."""
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.fixes.convert.fp8_state import amax_group_of

    warnings.simplefilter("ignore")
    scenarios.ensure_rehearsal(True)
    ref = reference(family, fp8, steps, skew)
    acc, model, opt = _prepared_ep(family, fsdp, ep, tp=tp)
    experts = model.model.layers[0].mlp.experts
    ep_rank = experts.gate_up_proj.device_mesh["ep"].get_local_rank()
    local = experts.num_experts
    setup = acc.accel_fp8_fix
    dp_rank, dp_size = zoo_scenarios._data_rank(acc, "fsdp2")
    per = zoo_scenarios.GLOBAL_BATCH // dp_size
    data = zoo_scenarios.batch(slice(dp_rank * per, (dp_rank + 1) * per))
    implementation = transformers_ep_names(experts)
    if not fp8:  # the same prepared model with TE autocast off (eval mode: the wrapped forward turns FP8 off)
        model.eval()
    counts = []
    hook = experts.te_gate_up.register_forward_pre_hook(lambda m, args: counts.append(int(sum(args[1]))))
    scenarios.te_reset()
    losses, norms, amax0, states = [], [], {}, []
    with _skewed_routing(model, skew) if skew else contextlib.nullcontext():
        for step in range(steps):
            loss = model(**data).loss
            acc.backward(loss)
            if step == 0 and fp8:
                amax0 = _fwd_amax(model)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            dist.all_reduce(value)
            losses.append(float(value) / world_size)
            states.append({k: float(v.double().sum()) for k, v in _fwd_amax(model).items()})
    hook.remove()
    stats = scenarios.te_stats()  # of the training steps
    eval_loss = None
    if tp:  # an evaluation pass: transformers' AutoEP dispatches by all-reduce when the EP group shares one batch
        model.eval()
        with torch.no_grad():
            eval_loss = float(model(**data).loss)
        model.train()
    import accel_fp8_fix

    coverage = accel_fp8_fix.audit(model, acc).coverage
    output_layer = acc.unwrap_model(model).lm_head.weight.numel()  # global elements
    group = amax_group_of(experts, None)
    # this rank's experts' columns of the reference's amax histories: GEMM i's three forward tensors are
    # columns 3i..3i+2 (TE's GroupedLinear), global expert = ep_rank * local + i
    cols = slice(3 * ep_rank * local, 3 * (ep_rank + 1) * local)
    facts = {"experts": setup.conversion.experts, "skipped": dict(setup.conversion.skipped),
             "losses": losses, "reference": ref[0], "grad_norms": norms, "reference_grad_norms": ref[1],
             "coverage": coverage.fp8_param_share, "high_precision": coverage.high_precision,
             "fp8_share_outside_lm_head": coverage.fp8_params / (coverage.gemm_params - output_layer),
             "stats": stats, "ep_rank": ep_rank, "local_experts": local,
             "ep_implementations": implementation, "tp_linears": _tp_linears(model), "eval_loss": eval_loss,
             "dp_rank": dp_rank,
             "expert_group": dist.get_process_group_ranks(group) if group is not None else None,
             "rows_per_step": counts, "amax_states": states,
             "amax_step0_equal_reference": {k: bool(torch.equal(v, ref[2][k][:, cols])) for k, v in amax0.items()},
             "amax_step0_equal_other_experts": {
                 k: bool(torch.equal(v, ref[2][k][:, slice(3 * (1 - ep_rank) * local, 3 * (2 - ep_rank) * local)]))
                 for k, v in amax0.items()} if ep == 2 else None,
             "amax_step0_equal_any_other_expert": {
                 k: any(torch.equal(v, ref[2][k][:, slice(3 * r * local, 3 * (r + 1) * local)])
                        for r in range(ep) if r != ep_rank) for k, v in amax0.items()}}
    fp8_scenarios.reset_te_global_state()
    return facts


def transformers_ep_names(experts) -> list:
    """The class names of the EP implementations transformers' dispatch runs on ``experts`` (AutoEP and those it
    delegates to)."""
    from accel_fp8_fix.internals import transformers_ep

    implementation = transformers_ep.dispatch(experts)
    return sorted({type(c).__name__ for c in transformers_ep._callers(implementation)}) if implementation else []


def _tp_linears(model) -> dict:
    """{name: TE's parallel_mode} of layer 0's attention projections run by TE in TP (TE-native TP)."""
    attention = model.model.layers[0].self_attn
    return {n: m.parallel_mode for n, m in attention.named_children() if getattr(m, "parallel_mode", None)}


def _prepared_ep(family, fsdp, ep, seed=0, tp=None):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    acc = scenarios.make_accelerator(
        fsdp=True, dp_shard=fsdp, tp=tp, mixed_precision="fp8", fp8_recipe=fp8_scenarios.RECIPE,
        wrap_cls=[moe_scenarios.DECODER_LAYER[family]],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    model = training.zoo_model(family, seed=seed)
    model.config._experts_implementation = "eager"
    model = scenarios.load_sharded_by_transformers(model, tp_size=tp or 1, fsdp_size=fsdp, ep_size=ep)  # ep None: no EP
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=moe_scenarios.LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _local_state(model) -> dict:
    """This rank's local parameter shards and the experts runners' FP8 state (clones)."""
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    fp8 = {k: v.clone() for k, v in fp8_state_tensors(model).items()}
    return {"params": params, "fp8": fp8}


def _train_steps(acc, model, opt, steps):
    dp_rank, dp_size = zoo_scenarios._data_rank(acc, "fsdp2")
    per = zoo_scenarios.GLOBAL_BATCH // dp_size
    data = zoo_scenarios.batch(slice(dp_rank * per, (dp_rank + 1) * per))
    losses = []
    for _ in range(steps):
        loss = model(**data).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def sc_ep_checkpoint(rank, world_size, out_dir, family="qwen3_moe", fsdp=4, ep=2):
    """Train 2 steps under EP, ``save_state``; a differently initialised EP model loads it: every local parameter
    shard and every piece of FP8 state (the experts' per EP rank) bit for bit, then the next step's loss equal."""
    import os

    import torch

    warnings.simplefilter("ignore")
    scenarios.ensure_rehearsal(True)
    acc, model, opt = _prepared_ep(family, fsdp, ep)
    _train_steps(acc, model, opt, 2)
    path = os.path.join(out_dir, "ep")
    acc.save_state(path)
    saved = _local_state(model)
    export = os.path.join(out_dir, "export")
    acc.save_model(model, export)  # an export: full tensors, no FP8 state, loadable by plain transformers
    acc.wait_for_everyone()
    full = {n: scenarios.full_tensor(p).detach().clone() for n, p in model.named_parameters()}  # every rank
    if rank == 0:  # what the export must hold; the test loads it with plain transformers in its own process
        torch.save(full, f"{export}_reference.pt")
    acc.wait_for_everyone()
    after = _train_steps(acc, model, opt, 1)
    fp8_scenarios.reset_te_global_state()
    acc2, model2, opt2 = _prepared_ep(family, fsdp, ep, seed=99)
    acc2.load_state(path)
    got = _local_state(model2)
    resumed = _train_steps(acc2, model2, opt2, 1)
    fp8_scenarios.reset_te_global_state()

    def unequal(kind):
        return sorted(k for k, v in saved[kind].items() if k not in got[kind] or not torch.equal(v, got[kind][k]))

    experts = [k for k in saved["fp8"] if ".experts.te_" in k]
    return {"params_unequal": unequal("params"), "fp8_unequal": unequal("fp8"), "fp8_compared": len(saved["fp8"]),
            "expert_fp8_keys": len(experts), "export": export,
            "expert_fp8_sum": sum(float(saved["fp8"][k].double().sum()) for k in experts),
            "loss_after": after, "loss_resumed": resumed}


def _runner_state(model) -> dict:
    """{"<layer>.<runner>.<fwd|bwd>.<tensor>": clone} of the experts runners' delayed-scaling tensors."""
    from accel_fp8_fix.internals.transformer_engine import delayed_scaling_tensors

    return {f"{k}.{n}": t.detach().clone() for k, r in _runners(model).items()
            for n, t in delayed_scaling_tensors(r).items()}


def _full_params(model) -> dict:
    return {n: scenarios.full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def sc_ep_resize(rank, world_size, out_dir, family="qwen3_moe", fsdp=4):
    """A checkpoint across EP sizes: EP 2 saves; the model without EP (experts FSDP2-sharded) loads every weight
    and every expert's FP8 state (its runners' columns: the EP ranks' blocks in EP order); it saves; EP 2 loads
    that back — each EP rank's experts' state bit for bit what it saved."""
    import os

    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    scenarios.ensure_rehearsal(True)
    acc, model, opt = _prepared_ep(family, fsdp, 2)
    _train_steps(acc, model, opt, 2)
    acc.save_state(os.path.join(out_dir, "ep2"))
    ep_state, ep_params = _runner_state(model), _full_params(model)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {k: v.tolist() for k, v in ep_state.items()})
    fp8_scenarios.reset_te_global_state()

    acc1, model1, opt1 = _prepared_ep(family, fsdp, None, seed=99)
    acc1.load_state(os.path.join(out_dir, "ep2"))
    one_state, one_params = _runner_state(model1), _full_params(model1)
    # without EP a runner holds all 4 experts: EP rank 0's 2 experts' columns, then EP rank 1's (ranks 0 and 1)
    want = {k: torch.cat([torch.tensor(gathered[0][k]), torch.tensor(gathered[1][k])], dim=-1) for k in ep_state}
    facts = {"no_ep_fp8_unequal": sorted(k for k in want if not torch.equal(want[k], one_state[k])),
             "no_ep_params_unequal": sorted(n for n in ep_params if not torch.equal(ep_params[n], one_params[n])),
             "no_ep_experts_parallel": any(getattr(m, "_is_expert_parallel", False) for m in model1.modules()),
             "no_ep_runner_shape": list(one_state["0.te_gate_up.fwd.amax_history"].shape)}
    acc1.save_state(os.path.join(out_dir, "ep1"))
    fp8_scenarios.reset_te_global_state()

    acc2, model2, opt2 = _prepared_ep(family, fsdp, 2, seed=7)
    acc2.load_state(os.path.join(out_dir, "ep1"))
    back, back_params = _runner_state(model2), _full_params(model2)
    facts["back_fp8_unequal"] = sorted(k for k in ep_state if not torch.equal(ep_state[k], back[k]))
    facts["back_params_unequal"] = sorted(n for n in ep_params if not torch.equal(ep_params[n], back_params[n]))
    facts["ep_runner_shape"] = list(ep_state["0.te_gate_up.fwd.amax_history"].shape)
    fp8_scenarios.reset_te_global_state()
    return facts
