"""FP8 all-gather under FSDP2 (fixes/all_gather/fp8_all_gather.py) scenarios, for tests/distributed/test_fp8_all_gather.py
and benchmarks/fp8_all_gather.py. Each runs inside a rank of ``run_distributed`` and returns facts.
"""

from __future__ import annotations

import os

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import tolerances

STEPS = 4
LR = 0.05
CLIP = 0.9
GLOBAL_BATCH = 32
ALL_GATHER_ENV = "ACCELERATE_FP8_ALL_GATHER"
RECIPES = {
    "delayed": {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"},
    "current": {"recipe": "current", "fp8_format": "HYBRID"},
    "block": {"recipe": "block", "fp8_format": "HYBRID"},
}


def _batch(dim, out=16, seed=7, rows=GLOBAL_BATCH):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, out, generator=g)


def _te_recipe(kind):
    import transformer_engine.common.recipe as te_recipe

    if kind == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    if kind == "block":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.HYBRID)
    return te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                    reduce_amax=False)


def _reset_te():
    fp8_scenarios.reset_te_global_state()


def _mse_of(dim, out=16, rows=GLOBAL_BATCH):
    import torch

    x, y = _batch(dim, out, rows=rows)
    return lambda model: torch.nn.functional.mse_loss(model(x).float(), y)


def _reference(build, kind, steps, loss_of, exclude=(), fp8_weights=False):
    """(losses, clipped grad norms) of the same model in one process, whole batch, FP8 through TE. Without
    ``fp8_weights`` TE quantizes the high-precision weights in its GEMM (what the switch-off run computes); with it
    every converted weight is quantized once per step as the FP8 all-gather does and handed to TE as a leaf whose
    gradient goes to the master weight (:func:`_fp8_weight_leaves`) — the FP8 all-gather without the all-gather."""
    from accel_fp8_fix.internals import transformer_engine as te_internals

    recipe = _te_recipe(kind)
    params = te_internals.scale_params(recipe)

    def fp8_weight_leaves(model):
        leaves = _fp8_weight_leaves(model, params)

        def back_to_the_masters():
            for module, name, master, leaf in leaves:
                module._parameters[name] = master
                master.grad = leaf.grad
        return back_to_the_masters

    return train_reference(build, loss_of, steps=steps, lr=LR, max_norm=CLIP, recipe=recipe,
                           convert={"exclude": exclude}, fsdp2_weight_path=True,
                           around_backward=fp8_weight_leaves if fp8_weights else None)


@fp8_scenarios.one_process_reference
def _stack_reference(model, dim, depth, out, recipe, steps, global_batch, fp8_weights):
    """:func:`_reference` of :func:`sc_train`'s model and batch."""
    return _reference(_model_for(model, dim, depth, out), recipe, steps, _mse_of(dim, out, global_batch),
                      fp8_weights=fp8_weights)


@fp8_scenarios.one_process_reference
def _zoo_reference(family, recipe, steps, fp8_weights):
    """:func:`_reference` of a model-zoo family on the zoo's batch (lm_head kept in high precision)."""
    from . import zoo_scenarios

    return _reference(lambda: training.zoo_model(family), recipe, steps, lambda m: m(**zoo_scenarios.batch()).loss,
                      exclude=("lm_head",), fp8_weights=fp8_weights)


def linear_stack(dim=training.DIM, depth=2, out=16, seed=0):
    """Blocks of two bias-free Linears (GELU between) and a bias-free head: every parameter FSDP2 gathers is a
    converted weight, so the all-gathered bytes divide by converted parameters exactly."""
    import torch

    torch.manual_seed(seed)
    return training.BlockStack(dim, 2 * dim, depth, out, norm=False, bias=False)


def _digest(acc, net):
    """{parameter: [dtype, sum, sum of squares]} of the full (gathered) master weights."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()
            if not k.endswith("_extra_state")}
    return {k: [str(v.dtype), float(v.double().sum()), float(v.double().pow(2).sum())] for k, v in full.items()}


def _unsharded_bytes(model):
    """Bytes of the FSDP2 all-gather buffers holding unsharded weights right now (freed storage counts 0)."""
    from accel_fp8_fix.internals.torch_fsdp2 import fsdp_params

    storages = {}
    for p in fsdp_params(model):
        for t in list(p.all_gather_outputs) + list(getattr(p, "_unsharded_inner_tensors", [])):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _peak_probe(model, te_mods):
    peak = {"bytes": 0}

    def sample(mod, args):
        peak["bytes"] = max(peak["bytes"], _unsharded_bytes(model))

    handles = [m.register_forward_pre_hook(sample) for m in te_mods.values()]
    return peak, handles


def _model_for(kind_of_model, dim, depth, out=16):
    if kind_of_model == "linear_stack":
        return lambda: linear_stack(dim=dim, depth=depth, out=out)
    return lambda: training.block_stack(dim=dim, hidden=2 * dim, depth=depth, seed=0)


def sc_train(rank, world_size, all_gather="fp8", recipe="delayed", steps=STEPS, model="block_stack", dim=training.DIM,
             depth=2, policy="fp32", reshard=True, dp_replicate=None, dp_shard=None, reference=True, save_dir=None,
             load_dir=None, out=16, global_batch=GLOBAL_BATCH, bits=False, modify=None):
    """FSDP2 + FP8 with ``ACCELERATE_FP8_ALL_GATHER=all_gather``: losses and clipped grad norms per step (and the
    one-process reference), what c10d saw per step (all-gathered bytes, all-reduces), the packed scale
    reductions, the peak bytes of unsharded weights in forward, and what optimizer / checkpoints see; the
    collectives the rank's audit recorder saw inside FSDP2's all-gather hooks; the metadata objects the gathers
    passed. ``bits``: every step, the FP8 tensor each TE Linear receives against TE's quantizer applied to the
    whole master weight (``full_tensor()``), bytes and scales. ``modify``: NO optimizer step; instead, between
    steps, the first block's fc1 weight scaled by 1.5 — in place (``"in_place"``: autograd's version counter
    moves), through ``.data`` then ``weights_changed()`` (``"data_then_weights_changed"``), or through ``.data``
    alone (``"data_only"``: no counter moves, nothing else changed: the scales stay the last ones)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.testing.spy import CollectiveSpy

    scenarios.ensure_rehearsal(True)
    global_batch = scenarios.fp8_rows(global_batch, world_size)
    os.environ[ALL_GATHER_ENV] = all_gather
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[policy]
    build = _model_for(model, dim, depth, out)
    # block scaling: the shards' tiles are the whole weight's tiles, so TE quantizing the whole weight is the reference
    fp8_weights = all_gather == "fp8" and recipe != "block"
    ref = _stack_reference(model, dim, depth, out, recipe, steps, global_batch, fp8_weights) if reference \
        else (None, None)
    acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, dp_replicate=dp_replicate, mixed_precision="fp8",
                             wrap_cls=["Block"], fp8_recipe=RECIPES[recipe], reshard_after_forward=reshard,
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net, opt = acc.prepare(net, opt)
    x, y = _batch(dim, out, rows=global_batch)
    per = global_batch // world_size
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    if load_dir is not None:
        if bits:  # scales computed from the initial weights first: the load must move them
            with torch.no_grad():
                net(x)
        acc.load_state(load_dir)
    loaded_digest = _digest(acc, net) if load_dir is not None else None
    setup = acc.accel_fp8_fix
    te_mods = {n: m for n, m in net.named_modules() if hasattr(m, "fp8_meta")}
    peak, handles = _peak_probe(net, te_mods)
    seen = set()  # the class of the weight each TE Linear's forward received (after FSDP2's unshard)
    handles += [m.register_forward_pre_hook(lambda mod, args: seen.add(type(mod._parameters["weight"]).__name__))
                for m in te_mods.values() if type(m).__name__ == "Linear"]
    ag = setup.all_gather
    probe = _BitsProbe(net, te_mods, setup) if bits and ag is not None else None
    metadata = _MetadataProbe(net, ag) if ag is not None else None
    hooks_audit = _HookAudit()
    scenarios.te_reset()
    losses, norms, per_step = [], [], []
    for step in range(steps):
        if probe is not None:
            probe.expect()  # TE's quantizer on the whole master weights, outside the step's hooks
        before = ag.amax_reductions if ag is not None else 0
        with CollectiveSpy() as spy:
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
            acc.backward(loss)
            norms.append(float(acc.clip_grad_norm_(net.parameters(), CLIP)))
            if not modify:  # (with modify, the edit between steps is the only change)
                opt.step()
            opt.zero_grad()
        gathers = [c for c in spy.calls(layer=None) if "gather" in c.op]
        per_step.append({
            "all_gathers": len(gathers),
            # the dispatch-level record of FSDP2's _allgather_base_ is its output: every rank's bytes
            "all_gathered_bytes": sum(c.nbytes for c in gathers),
            "all_gathered_numel": sum(c.numel for c in gathers),
            "all_gather_dtypes": sorted({str(c.dtype) for c in gathers}),
            "all_reduces": [c.numel for c in spy.calls("all_reduce", top_level=True)],
            "gather_ops": sorted({(c.op, c.layer) for c in gathers}),
            "weight_amax_reductions": (ag.amax_reductions if ag is not None else 0) - before,
        })
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
        if modify and step < steps - 1:
            _modify_weight(net, ag, modify)
    for h in handles:
        h.remove()
    stats = scenarios.te_stats()
    local_types = sorted({type(p.to_local()).__name__ if hasattr(p, "to_local") else type(p).__name__
                          for p in net.parameters()})
    sd = net.state_dict()
    facts = {
        "losses": losses, "grad_norms": norms, "reference": ref[0], "reference_grad_norms": ref[1],
        "per_step": per_step, "peak_unsharded_bytes_forward": peak["bytes"], "te_linear_weight_types": sorted(seen),
        "gathered_weights": list(ag.weights) if ag is not None else [],
        "bits": probe.result() if probe is not None else None,
        "metadata": metadata.result() if metadata is not None else None,
        "collectives_inside_hooks": hooks_audit.inside(),
        "first_forward_pre_hook": _first_pre_hook(net),
        "collectives_recorded": hooks_audit.recorded(),
        "gathered_scale_bytes": _scale_bytes(net, ag, world_size) if ag is not None else 0,
        "scale_reductions": ag.amax_reductions if ag is not None else 0,
        "converted": setup.conversion.converted,
        "model_numel": sum(p.numel() for p in net.parameters()),
        "fp8_weight_numel": sum(m.weight.numel() for n, m in te_mods.items()
                                if ag is not None and f"{n}.weight" in ag.weights),
        "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "fp8_gemms_bwd": stats["fp8_gemms_bwd"],
        "non_fp8_gemms": stats["non_fp8_gemms"], "quantize_calls": {k: v for k, v in stats.items()
                                                                    if k.startswith("quantize_")},
        "param_dtypes": sorted({str(p.dtype) for p in net.parameters()}),
        "grad_dtypes_seen": sorted({str(p.dtype) for p in net.parameters()}),
        "local_tensor_types": local_types,
        "state_dict_types": sorted({type(v.to_local() if hasattr(v, "to_local") else v).__name__
                                    for k, v in sd.items() if not k.endswith("_extra_state")}),
        "optimizer_param_types": sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]}),
    }
    facts["digest_after_load"] = loaded_digest
    if save_dir is not None:
        acc.save_state(save_dir)
        facts["digest_at_save"] = _digest(acc, net)
        full = acc.get_state_dict(net)
        facts["full_state_dict"] = {k: (str(v.dtype), type(v).__name__) for k, v in full.items()
                                    if not k.endswith("_extra_state")} if rank == 0 else {}
    net.eval()  # last, an evaluation pass: TE autocast off (eval mode), the weights still arrive as Float8Tensors
    with torch.no_grad():
        facts["eval_output_finite"] = bool(torch.isfinite(net(x)).all())
    net.train()
    return facts


class _BitsProbe:
    """Every step, at each TE Linear's first forward: the FP8 tensor it received (built from the gathered shards)
    against TE's quantizer applied to the whole master weight (``full_tensor()``) — per-tensor recipes: TE's
    Float8Quantizer at the whole weight's scale (TE's compute_scale_from_amax of its amax); block: TE's
    Float8BlockQuantizer with the recipe's weight settings — row-wise bytes and scales, bit for bit."""

    def __init__(self, net, te_mods, setup):
        import functools

        self.setup, self.expected, self.seen, self.steps = setup, {}, {}, 0
        self.modules = {n: m for n, m in te_mods.items() if f"{n}.weight" in setup.all_gather.weights}
        self.handles = [m.register_forward_pre_hook(functools.partial(self._check, name=n))
                        for n, m in self.modules.items()]

    def expect(self):
        from accel_fp8_fix.internals import transformer_engine as te_internals

        self.steps += 1
        recipe = self.setup.recipe
        for name, module in self.modules.items():
            full = module.weight.full_tensor().detach()
            if self.setup.all_gather.kind == "block":
                self.expected[name] = te_internals.block_rowwise(te_internals.float8_block_weight_quantizer(recipe)(full))
            else:
                params = te_internals.scale_params(recipe)
                scale = te_internals.scales_from_amaxes(full.abs().amax().float().reshape(1), params)
                self.expected[name] = te_internals.float8_rowwise(te_internals.float8_quantizer(scale, params.fp8_dtype)(full))

    def _check(self, mod, args, name):
        import torch

        from accel_fp8_fix.internals import transformer_engine as te_internals

        want = self.expected.pop(name, None)
        if want is None:  # a later forward of the same step (recompute): checked once a step
            return
        weight = mod._parameters["weight"]
        got = te_internals.block_rowwise(weight) if self.setup.all_gather.kind == "block" else te_internals.float8_rowwise(weight)
        ok = all(torch.equal(g.reshape(w.shape), w) for g, w in zip(got, want))
        self.seen.setdefault(name, []).append(ok)

    def result(self):
        for h in self.handles:
            h.remove()
        return {"compared": sorted(self.seen), "steps": self.steps,
                "mismatched": sorted(n for n, oks in self.seen.items() if not all(oks) or len(oks) != self.steps)}


class _MetadataProbe:
    """The all-gather metadata of one weight gathered in FP8, at every gather: which scale tensor storages it
    passed — allocated once, or per gather."""

    def __init__(self, net, ag, name="blocks.0.fc1.weight"):  # a block's: gathered in forward and in backward
        from accel_fp8_fix.internals import torch_fsdp2

        weight = next((w for w in ag.record.weights if w.name == name), ag.record.weights[0])
        shard = torch_fsdp2.sharded_local_tensor(weight.fsdp_param)
        self.state = shard.gather_state
        self.original = self.state.pre_all_gather
        self.scale_storages, self.gathers = set(), 0

        def pre_all_gather(local, orig_size):
            inputs, metadata = self.original(local, orig_size)
            self.gathers += 1
            self.scale_storages.update(t.untyped_storage().data_ptr() for t in metadata if hasattr(t, "dtype"))
            return inputs, metadata

        self.state.pre_all_gather = pre_all_gather

    def result(self):
        del self.state.pre_all_gather  # the class's method again
        return {"gathers": self.gathers, "scale_storages": len(self.scale_storages)}


class _HookAudit:
    """What this rank's collective-order recorder (on in every run_distributed launch) saw from now on."""

    def __init__(self):
        from accel_fp8_fix.diagnostics import collective_order

        self.recorder = collective_order._installed["recorder"]
        self.start = len(self.recorder.records) if self.recorder is not None else 0

    def recorded(self) -> int:
        return len(self.recorder.records) - self.start if self.recorder is not None else -1

    def inside(self) -> list:
        records = self.recorder.records[self.start:] if self.recorder is not None else []
        return [f"{r} inside {r.inside}" for r in records if r.inside]


def _first_pre_hook(net) -> str:
    """The name of the function of the prepared model's first forward pre-hook (FSDP2's root pre-forward is a
    bound ``FSDPState._pre_forward``; the package's refresh a partial of ``_before_forward``)."""
    hook = next(iter(net._forward_pre_hooks.values()), None)
    hook = getattr(hook, "func", hook)
    return getattr(hook, "__qualname__", repr(hook))


def _modify_weight(net, ag, how):
    """Between steps, as a user might: the first block's fc1 weight times 1.5."""
    import torch

    weight = net.blocks[0].fc1.weight
    with torch.no_grad():
        if how == "in_place":
            weight.mul_(1.5)
        elif how in ("data_then_weights_changed", "data_only"):
            weight.data.mul_(1.5)  # autograd's version counters do not see it: say so (or not: a stale scale)
            if how == "data_then_weights_changed":
                ag.weights_changed()
        else:
            raise AssertionError(how)


def _scale_bytes(net, ag, world_size) -> int:
    """Bytes of the block scales FSDP2 gathers in one all-gather of every weight: per weight, each shard's scale
    grid [padded rows / 128, roundup(ceil(cols / 128), 4)] fp32 from every rank (0 under per-tensor scaling: its one
    scale rides in the metadata)."""
    if ag.kind != "block":
        return 0
    total = 0
    for name, p in net.named_parameters():
        if name in ag.weights:
            rows, cols = p.shape
            shard_rows = -(-rows // world_size)
            total += world_size * (shard_rows // 128) * (-(-(-(-cols // 128)) // 4) * 4) * 4
    return total


def sc_llm(rank, world_size, family="llama", all_gather="fp8", dp_shard=None, dp_replicate=None, tp=None, steps=3,
           ckpt_dir=None, grad_ckpt=False, loaded=False, ram_efficient=False, recipe="delayed", accelerate_ac=False):
    """A transformers model of ``family`` (tests/support/zoo_scenarios.py's tiny configs) under FSDP2 / HSDP / FSDP2 x TP
    with the switch: losses and clipped grad norms every step vs the one-process reference (FP8 weights when on),
    which weights were gathered in FP8, the packed reductions per step; ``ckpt_dir``: save_state, then load_state
    into a differently initialised model with the switch, every parameter compared; ``grad_ckpt``: transformers'
    activation checkpointing on; ``loaded``: sharded at load by transformers (``DistributedConfig(tp, fsdp)``, A18);
    ``ram_efficient``: the plugin's ``cpu_ram_efficient_loading``; ``accelerate_ac``: accelerate's own FSDP2
    activation checkpointing (the plugin's ``activation_checkpointing``: ``CheckpointWrapper`` around each decoder
    layer); ``recipe``: "delayed" or "current"."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from . import zoo_scenarios

    if dp_shard is None and dp_replicate is None and tp is None and world_size > 1:
        dp_shard = world_size  # (one rank: FSDP2 without a ParallelismConfig, as a single-GPU script has it)
    scenarios.ensure_rehearsal(True)
    os.environ[ALL_GATHER_ENV] = all_gather
    ref = _zoo_reference(family, recipe, steps, fp8_weights=all_gather == "fp8")

    def prepared(seed):
        acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp, mixed_precision="fp8",
                                 fp8_recipe=fp8_scenarios.RECIPE if recipe == "delayed" else RECIPES[recipe],
                                 wrap_cls=[zoo_scenarios.DECODER_LAYER[family]], cpu_ram_efficient_loading=ram_efficient,
                                 activation_checkpointing=accelerate_ac,
                                 mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                             reduce_dtype=torch.float32))
        model = training.zoo_model(family, seed=seed)
        if accelerate_ac:  # stock too: the recompute would append this step's keys to the KV cache a second time
            model.config.use_cache = False
        if grad_ckpt:  # transformers' activation checkpointing (recompute routed through TE's checkpoint: A14)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if loaded:
            model = scenarios.load_sharded_by_transformers(model, tp_size=tp or 1, fsdp_size=dp_shard)
            model.train()  # from_pretrained returns eval mode
        elif tp:
            model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    acc, model, opt = prepared(0)
    ag = acc.accel_fp8_fix.all_gather
    seen = set()  # the class of the weight each TE Linear's forward received (after FSDP2's unshard)
    import transformer_engine.pytorch as te

    for m in model.modules():
        if isinstance(m, te.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.add(type(mod._parameters["weight"]).__name__))
    dp_rank, dp_size = zoo_scenarios._data_rank(acc, "any")
    per = zoo_scenarios.GLOBAL_BATCH // dp_size
    data = zoo_scenarios.batch(slice(dp_rank * per, (dp_rank + 1) * per))
    scenarios.te_reset()
    losses, norms, reductions = [], [], []
    for _ in range(steps):
        before = ag.amax_reductions if ag is not None else 0
        loss = model(**data).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        reductions.append((ag.amax_reductions if ag is not None else 0) - before)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
    stats = scenarios.te_stats()
    facts = {"losses": losses, "grad_norms": norms, "reference": ref[0], "reference_grad_norms": ref[1],
             "gathered_weights": list(ag.weights) if ag is not None else [],
             "converted": sorted(acc.accel_fp8_fix.conversion.converted), "weight_amax_reductions": reductions,
             "fp8_gemms_fwd": stats["fp8_gemms_fwd"], "non_fp8_gemms": stats["non_fp8_gemms"],
             "te_linear_weight_types": sorted(seen), "recipe": recipe,
             "tp": tp or 1, "row_parallel_ks": tolerances.row_parallel_ks(model.config),
             "checkpoint_wrapped": sorted({type(m).__name__ for m in model.modules() if "Checkpoint" in type(m).__name__})}
    if ckpt_dir:
        path = os.path.join(ckpt_dir, f"{family}-{dp_replicate}-{dp_shard}-{tp}-{all_gather}")
        acc.save_state(path)
        saved = {n: zoo_scenarios._full(p).detach().clone() for n, p in model.named_parameters()}
        acc2, model2, _ = prepared(1)
        acc2.load_state(path)
        got = {n: zoo_scenarios._full(p).detach() for n, p in model2.named_parameters()}
        facts["checkpoint_param_mismatch"] = sorted(n for n, t in saved.items() if not torch.equal(got[n], t))
        loss2 = model2(**data).loss  # the loaded model trains with the switch: FP8 gathered from loaded weights
        acc2.backward(loss2)
        facts["loaded_loss_finite"] = bool(torch.isfinite(loss2))
    _reset_te()
    return facts


def sc_stale(rank, world_size):
    """After an optimizer step, a forward that bypasses the prepared model (a decoder block's own, FSDP2 unsharding
    it alone) would gather with the last step's scales: the hook refuses by name instead (no collective there)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    scenarios.ensure_rehearsal(True)
    os.environ[ALL_GATHER_ENV] = "fp8"
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPES["delayed"],
                             mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
    net = training.block_stack(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net, opt = acc.prepare(net, opt)
    x, y = _batch(training.DIM)
    acc.backward(torch.nn.functional.mse_loss(net(x).float(), y))
    opt.step()
    opt.zero_grad()
    try:
        net.blocks[0](torch.randn(16, training.DIM))
    except Exception as exc:  # noqa: BLE001
        error = (type(exc).__name__, str(exc))
    else:
        error = (None, "")
    _reset_te()
    return {"error_type": error[0], "error": error[1], "reductions": acc.accel_fp8_fix.all_gather.amax_reductions}


def sc_bad_input(rank, world_size, case):
    """The switch where it cannot run: one named error at prepare, nothing converted."""
    import torch

    scenarios.ensure_rehearsal(True)
    os.environ[ALL_GATHER_ENV] = "fp8"
    if case == "no_fsdp2":
        acc = scenarios.make_accelerator(fsdp=False, tp=world_size, mixed_precision="fp8", expect=None)
    elif case == "mxfp8":
        os.environ["ACCEL_FP8_FIX_CPU_TE_ARCH"] = "sm100"
        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"],
                                 fp8_recipe={"fp8_format": "E4M3", "use_mxfp8_block_scaling": True})
    elif case == "cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], cpu_offload=CPUOffloadPolicy())
    elif case == "block_misaligned":  # dim 64: every weight's shard is 32-128 rows, tiles would cross shards
        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPES["block"])
    elif case == "block_1d":
        acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"],
                                 fp8_recipe=dict(RECIPES["block"], w_block_scaling_dim=1))
    else:
        raise AssertionError(case)
    net = training.block_stack(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    try:
        acc.prepare(net, opt)
    except Exception as exc:  # noqa: BLE001
        return {"error_type": type(exc).__name__, "error": str(exc),
                "linear_types": sorted({type(m).__name__ for m in net.modules() if "Linear" in type(m).__name__}),
                "local_tensor_types": sorted({type(getattr(p, "_local_tensor", p)).__name__ for p in net.parameters()})}
    return {"error_type": None}


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {"env": scenarios.ENV_FIXED, "timeout": 300.0, "collective_timeout": 90.0}


# -- packed MoE experts gathered in FP8 (fixes/all_gather/fp8_experts_gather.py, issue 30 item 2) ------------------------------
MOE_BATCH = 8  # sequences of zoo_scenarios.SEQ tokens, split over the data-parallel ranks


def _moe_model(family):
    from . import moe_scenarios, zoo_scenarios

    if family == "qwen3_moe_256":  # every Linear's rows / 2 shard ranks a multiple of 128 (block scaling's tiles)
        import torch
        import transformers as tf

        config = tf.Qwen3MoeConfig(vocab_size=zoo_scenarios.VOCAB, hidden_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1,
                                   max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")
        torch.manual_seed(0)
        model = tf.Qwen3MoeForCausalLM(config)
    elif family.startswith("qwen3_moe_proportioned"):  # "..._6": 6 experts (uneven over 4 shard ranks: 2, 2, 2, 0)
        model = training.proportioned_qwen3_moe(experts=int(family.rsplit("_", 1)[1]) if family[-1].isdigit() else 32)
    else:
        model = training.zoo_model(family)
    model.config._experts_implementation = "eager"
    return model


def _moe_batch():
    import torch

    from . import zoo_scenarios

    ids = torch.randint(0, zoo_scenarios.VOCAB, (MOE_BATCH, zoo_scenarios.SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _fp8_weight_leaves(model, params):
    """Each converted Linear's weight and each converted experts module's 3-D weights quantized from the master
    weight as the FP8 all-gather does (per-tensor current scaling: of the whole weight; of each expert) and put in
    the module as leaves; returns [(module, name, master, leaf)] — the FP8 all-gather without the all-gather."""
    import torch
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.all_gather.fp8_experts_gather import EXPERT_WEIGHTS, Fp8Experts
    from accel_fp8_fix.fixes.convert.moe_experts import is_converted
    from accel_fp8_fix.internals import transformer_engine as te_internals

    out = []
    for module in model.modules():
        if isinstance(module, te.Linear):
            names = ("weight",)
        elif is_converted(module):
            names = EXPERT_WEIGHTS
        else:
            continue
        for name in names:
            master = module._parameters[name]
            w = master.detach()
            if name == "weight":
                scale = te_internals.scales_from_amaxes(w.abs().amax().float().reshape(1), params)
                leaf = te_internals.float8_quantizer(scale.clone(), params.fp8_dtype)(w)
            else:
                scales = te_internals.scales_from_amaxes(w.abs().amax(dim=(1, 2)).float(), params)
                quantizers = [te_internals.float8_quantizer(scales[e:e + 1].clone(), params.fp8_dtype)
                              for e in range(w.shape[0])]
                data = torch.stack([te_internals.quantized_bits(q(w[e])) for e, q in enumerate(quantizers)])
                leaf = Fp8Experts(data, torch.reciprocal(scales), quantizers, w.dtype)
            leaf.requires_grad_(True)
            module._parameters[name] = leaf
            out.append((module, name, master, leaf))
    return out


@fp8_scenarios.one_process_reference
def _moe_reference(family, recipe, steps, fp8_weights):
    """One process, the whole batch (every Linear converted, lm_head too, as FSDP2 alone converts it)."""
    batch = _moe_batch()
    return _reference(lambda: _moe_model(family), recipe, steps, lambda model: model(**batch).loss,
                      fp8_weights=fp8_weights)


def sc_moe(rank, world_size, all_gather="fp8", family="qwen3_moe_proportioned", policy="fp32", recipe="delayed",
           steps=3, reference=True, dp_replicate=None, dp_shard=None, tp=None, ep=None, experts_tp="tp"):
    """A packed-experts model under FSDP2 + FP8 with the switch ``all_gather``: losses and clipped grad norms per
    step (and the one-process reference with the same FP8 weights), bytes FSDP2 all-gathered per step and their
    dtypes, which weights were gathered in FP8 (experts among them) and what the experts' forward received.
    ``tp``: FSDP2 x TP (transformers' packed-colwise / rowwise experts; ``experts_tp="default"``: the family's own
    plan, which leaves them replicated on the TP ranks from transformers 5.25); ``ep``: loaded by transformers with
    ``DistributedConfig(fsdp_size=world, ep_size=ep)`` (expert parallelism), then accelerate FSDP2."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.testing.spy import CollectiveSpy

    from . import moe_scenarios

    warnings.simplefilter("ignore")
    scenarios.ensure_rehearsal(True)
    os.environ[ALL_GATHER_ENV] = all_gather
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[policy]
    # block scaling: each expert's (and Linear's) tiles are the whole weight's, so TE quantizing in its GEMM is the
    # reference; per-tensor recipes: each weight quantized per step as the switch does
    ref = _moe_reference(family, recipe, steps, all_gather == "fp8" and recipe != "block") if reference else (None, None)
    layer = moe_scenarios.DECODER_LAYER["qwen3_moe" if family.startswith("qwen3_moe") else family]
    acc = scenarios.make_accelerator(fsdp=True, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp,
                                     mixed_precision="fp8", wrap_cls=[layer], fp8_recipe=RECIPES[recipe],
                                     mixed_precision_policy=MixedPrecisionPolicy(param_dtype=dtype,
                                                                                 reduce_dtype=torch.float32))
    model = _moe_model(family)
    if tp:
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"], experts=experts_tp)
    if ep:
        model = scenarios.load_sharded_by_transformers(model, tp_size=1, fsdp_size=world_size, ep_size=ep)
        model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    from . import zoo_scenarios

    dp_rank, dp_size = zoo_scenarios._data_rank(acc, "fsdp2")
    data = {k: v.chunk(dp_size)[dp_rank] for k, v in _moe_batch().items()}
    seen = []  # the classes of the experts' weights at their forward (inside a DTensor: its local tensor's)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(
        type(getattr(mod.gate_up_proj, "_local_tensor", mod.gate_up_proj)).__name__)) for m in experts]
    ag = acc.accel_fp8_fix.all_gather
    probe = _ExpertBitsProbe(model, ag, acc.accel_fp8_fix.recipe) if ag is not None and ag.experts else None
    losses, norms, per_step = [], [], []
    for step in range(steps):
        if probe is not None:
            probe.expect()
        with CollectiveSpy() as spy:
            loss = model(**data).loss
            acc.backward(loss)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        gathers = [c for c in spy.calls(layer=None) if "gather" in c.op]
        per_step.append({"all_gathered_bytes": sum(c.nbytes for c in gathers),
                         "all_gather_dtypes": sorted({str(c.dtype) for c in gathers}),
                         "all_reduces": [c.numel for c in spy.calls("all_reduce", top_level=True)]})
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
    for h in handles:
        h.remove()
    numel = sum(p.numel() for p in model.parameters())
    expert_numel = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    _reset_te()
    return {"losses": losses, "grad_norms": norms, "reference": ref[0], "reference_grad_norms": ref[1],
            "per_step": per_step, "model_numel": numel, "expert_share": expert_numel / numel,
            "gathered_weights": list(ag.weights) if ag is not None else [],
            "gathered_experts": list(ag.experts) if ag is not None else [],
            "kept": dict(ag.kept) if ag is not None else {},
            "expert_weight_types": sorted(set(seen)), "experts": acc.accel_fp8_fix.conversion.experts,
            "amax_reductions": ag.amax_reductions if ag is not None else 0,
            "bits": probe.result() if probe is not None else None,
            "local_tensor_types": sorted({type(p.to_local()).__name__ for n, p in model.named_parameters()
                                          if n.endswith(("gate_up_proj", "down_proj"))}),
            "state_dict_types": sorted({type(v.to_local() if hasattr(v, "to_local") else v).__name__
                                        for k, v in model.state_dict().items() if not k.endswith("_extra_state")}),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "eval_output_finite": _eval_finite(model, data)}


def _eval_finite(model, data):
    import torch

    model.eval()  # TE autocast off: TE dequantizes each expert's Float8Tensor
    with torch.no_grad():
        finite = bool(torch.isfinite(model(**data).logits).all())
    model.train()
    return finite


class _ExpertBitsProbe:
    """Every step, at each experts module's first forward: the gathered FP8 experts weight (bytes and the E scales)
    against TE's Float8Quantizer applied to each whole master expert (``full_tensor()``, taken before the step)
    at TE's ``compute_scale_from_amax`` of that expert's amax — block scaling: TE's Float8BlockQuantizer on each
    whole master expert (bytes and tile grid) — bit for bit."""

    def __init__(self, model, ag, recipe):

        from accel_fp8_fix.internals import transformer_engine as te_internals

        self.params = te_internals.scale_params(recipe)
        self.block = te_internals.float8_block_weight_quantizer(recipe) if ag.kind == "block" else None
        self.names = list(ag.experts)
        owners = {w.rsplit(".", 1)[0] for w in self.names}
        self.modules = {n: m for n, m in model.named_modules() if n in owners}
        self.expected, self.oks, self.steps = {}, {}, 0
        self.handles = [m.register_forward_pre_hook(lambda mod, args, n=n: self._check(n, mod))
                        for n, m in self.modules.items()]

    def expect(self):
        import torch

        from accel_fp8_fix.internals import transformer_engine as te_internals

        self.steps += 1
        for n, m in self.modules.items():
            for w in ("gate_up_proj", "down_proj"):
                param = getattr(m, w)
                full = scenarios.full_tensor(param).detach()
                local, start = self._unsharded_local(param)
                if self.block is not None:
                    pairs = [te_internals.block_rowwise(self.block(local[e])) for e in range(local.shape[0])]
                    self.expected[(n, w)] = (torch.stack([d for d, _ in pairs]), torch.stack([g for _, g in pairs]))
                    continue
                # each global expert's scale from its whole weight's amax (all TP slices); this rank's unsharded
                # experts (under EP: its EP rank's) quantized at their experts' scales
                scales = te_internals.scales_from_amaxes(full.abs().amax(dim=(1, 2)).float(), self.params)
                mine = scales[start:start + local.shape[0]]
                data = torch.stack([te_internals.quantized_bits(
                    te_internals.float8_quantizer(mine[e:e + 1].clone(), self.params.fp8_dtype)(local[e]))
                    for e in range(local.shape[0])])
                self.expected[(n, w)] = (data, torch.reciprocal(mine))

    @staticmethod
    def _unsharded_local(param):
        """(the high-precision tensor FSDP2 gathers for this rank — this rank's local shard concatenated along
        dim 0 over each mesh dim FSDP2 shards (a dim-0 ``Shard`` / ``_StridedShard`` on a data-parallel dim), as
        FSDP2's all-gather does —, the global expert where it starts). Gathered with ``all_gather_object``
        (``redistribute`` of a TP ``_StridedShard`` refuses on torch 2.11)."""
        import torch
        import torch.distributed as dist

        from accel_fp8_fix.distributed.mesh_facts import DATA_PARALLEL_DIMS
        from accel_fp8_fix.internals import torch_internals

        if not hasattr(param, "device_mesh"):
            return param.detach(), 0
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        local, start = param.to_local().detach(), torch_internals.global_row_offset(param)
        for i, (name, p) in enumerate(zip(names, param.placements)):
            fsdp_dim = (name in DATA_PARALLEL_DIMS + ("efsdp", "dim0", "dim1") and p.is_shard() and p.dim == 0) or (
                type(p).__name__ == "_StridedShard" and p.dim == 0)
            if fsdp_dim and mesh.size(i) > 1:
                parts = [None] * mesh.size(i)
                dist.all_gather_object(parts, (local, start), group=mesh.get_group(i))
                local, start = torch.cat([t for t, _ in parts]), parts[0][1]
        return local, start

    def _check(self, n, mod):
        import torch

        for w in ("gate_up_proj", "down_proj"):
            want = self.expected.pop((n, w), None)
            if want is None:
                continue
            got = getattr(mod, w)
            got = getattr(got, "_local_tensor", got)
            ok = type(got).__name__ == "Fp8Experts" and torch.equal(got._data, want[0]) and torch.equal(
                got._expert_scale_inv, want[1])
            self.oks.setdefault(f"{n}.{w}", []).append(ok)

    def result(self):
        for h in self.handles:
            h.remove()
        return {"compared": sorted(self.oks), "steps": self.steps,
                "mismatched": sorted(k for k, v in self.oks.items() if not all(v) or len(v) != self.steps)}
