"""Context parallelism on CPU ranks (the rehearsal's CPU ring attention, ``rehearsal/context_parallel.py``) for
tests/distributed/test_context_parallel.py. Each runs inside a rank and returns facts."""

from __future__ import annotations

from accel_fp8_fix.testing import training
from accel_fp8_fix.testing.training import train_reference

from . import fp8_scenarios
from . import scenarios
from . import tolerances

SHAPE = (2, 4, 32, 16)  # batch, heads, sequence, head dim: the sequence splits into 2·cp load-balancer chunks


def _group():
    import torch.distributed as dist

    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))


def sc_ring_attention(rank, world_size, dtype="float32", causal=True, load_balance=True):
    """F.scaled_dot_product_attention inside torch's ``context_parallel`` over all ranks (the sequence dim of
    q / k / v sharded in place, as accelerate's ``maybe_context_parallel`` does) against the same attention
    unsharded on one rank: the forward output and the q / k / v gradients, gathered back with
    ``context_parallel_unshard``. Facts: max abs differences, dtypes, which SDPA kernel op ran."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard

    from accel_fp8_fix.rehearsal import context_parallel as cpu_cp

    _group()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(SHAPE, generator=generator).to(dtype) for _ in range(4))

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    want.backward(grad)
    want_grads = [t.grad for t in leaves]

    before = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = load_balance
    sharded = [t.clone() for t in (q, k, v, grad)]
    ops = []
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
                context_parallel(mesh, buffers=sharded, buffer_seq_dims=[2, 2, 2, 2]):
            local = [t.detach().clone().requires_grad_() for t in sharded[:3]]
            got = F.scaled_dot_product_attention(*local, is_causal=causal)
            got.backward(sharded[3])
            got_local, grads_local = got.detach(), [t.grad for t in local]
        ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")})  # kernels
        # unshard under the same load-balancer setting as the shard (it undoes the balancer's chunk order)
        got_full, *got_grads = context_parallel_unshard(mesh, [got_local] + grads_local, [2, 2, 2, 2])
    finally:
        _cp_options.enable_load_balance = before
    return {
        "installed": cpu_cp.is_installed(),
        "local_seq": got_local.shape[2],
        "dtype": str(got_full.dtype),
        "grad_dtypes": [str(g.dtype) for g in got_grads],
        "ops": ops,
        "out_diff": (got_full.float() - want.float()).abs().max().item(),
        "grad_diffs": [(g.float() - w.float()).abs().max().item() for g, w in zip(got_grads, want_grads)],
        "out_scale": want.float().abs().max().item(),
    }


def sc_ring_attention_refuses_a_mask(rank, world_size):
    """The CPU flash op called with an attention mask on sequence-sharded DTensors inside the CP context is refused
    by name (torch's ring takes none; ``F.scaled_dot_product_attention`` with a mask picks the math kernel instead)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel

    import torch.nn.functional as F

    _group()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q = torch.randn(SHAPE)
    sdpa = F.scaled_dot_product_attention  # torch < 2.13 does not restore it when the context exits on an error
    try:
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            local = DTensor.from_local(q, mesh, [Shard(2)], run_check=False)
            mask = DTensor.from_local(torch.ones(q.shape[:3] + (SHAPE[2],), dtype=torch.bool), mesh, [Shard(2)],
                                      run_check=False)
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(local, local, local, attn_mask=mask)
    except Exception as exc:  # noqa: BLE001
        return {"error": scenarios.err(exc)}
    finally:
        if F.scaled_dot_product_attention is not sdpa:
            from torch.distributed.tensor.experimental._context_parallel._attention import (
                _disable_context_parallel_dispatcher_impl)

            _disable_context_parallel_dispatcher_impl()
    return {"error": None}


def sc_fsdp2_cp_fp8_shapes(rank, world_size, cases=((2, 64), (2, 31), (1, 36), (16, 34)), steps=1):
    """accelerate FSDP2 (dp_shard 2) x CP 2 + FP8 through the package on a tiny Llama (SDPA attention), one prepare,
    then per ``(batch, sequence)`` case ``steps`` training steps through ``maybe_context_parallel`` with
    ``input_ids``, ``shift_labels`` and ``position_ids`` as CP buffers (what a CP run passes). Facts per case: the
    error (type: message) or the losses and clipped-grad norms, and the warnings raised."""
    import warnings

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, TERecipeKwargs
    from transformers import LlamaConfig, LlamaForCausalLM

    scenarios.reset_accelerate()
    scenarios.ensure_te_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin,
                      parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2),
                      kwargs_handlers=[TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16,
                                                      amax_compute_algo="max")])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    from accel_fp8_fix.fixes.step.context_parallel import balancer_follows_length

    facts = {"mesh": scenarios.mesh_facts(acc.torch_device_mesh), "fp8_enabled": acc.accel_fp8_fix.fp8_enabled,
             "balancer_follows_length": balancer_follows_length(),
             "te_modules": len(acc.accel_fp8_fix.conversion.te_modules), "cases": []}
    generator = torch.Generator().manual_seed(1)
    dp_rank = acc.torch_device_mesh["dp_shard"].get_local_rank()
    for batch, seq in cases:
        case = {"batch": batch, "seq": seq, "error": None, "losses": [], "norms": [], "warnings": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(steps):
                    ids = torch.randint(0, 128, (2, batch, seq), generator=generator)[dp_rank]
                    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
                    positions = torch.arange(seq).expand(batch, seq).clone()
                    buffers = [ids, labels, positions]
                    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                    no_restore_buffers=set(buffers)):
                        loss = model(input_ids=ids, labels=labels, shift_labels=labels, position_ids=positions).loss
                        acc.backward(loss)
                    case["norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                    opt.step()
                    opt.zero_grad()
                    case["losses"].append(loss.item())
            except Exception as exc:  # noqa: BLE001
                import traceback

                case["error"] = scenarios.err(exc)
                case["traceback"] = traceback.format_exc().splitlines()[-12:]
        case["warnings"] = [str(w.message) for w in caught if "accel_fp8_fix" in str(w.message)]
        facts["cases"].append(case)
    return facts


def sc_cp_exception_exits_the_dispatch(rank, world_size):
    """An exception raised inside accelerate's ``maybe_context_parallel`` (FSDP2 x CP 2, a tiny model, no FP8): is
    CP's dispatch (the ring's SDPA wrapper, DTensor's CP handlers) still on afterwards? Stock torch < 2.13 leaves it
    on; the package turns it off. Turned off here in any case, for the scenarios after."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    from accel_fp8_fix.internals import torch_context_parallel

    scenarios.reset_accelerate()
    sdpa = F.scaled_dot_product_attention
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                      parallelism_config=ParallelismConfig(dp_shard_size=world_size // 2, cp_size=2))
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    ids = torch.zeros(1, 16, dtype=torch.long)
    raised = None
    try:
        with acc.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers={ids}):
            model(torch.ones(2, 16))
            raise RuntimeError("the step failed")
    except RuntimeError as exc:
        raised = str(exc)
    facts = {"raised": raised, "left_on": torch_context_parallel.dispatch_left_on(),
             "sdpa_restored": F.scaled_dot_product_attention is sdpa, "fixes": scenarios.fixes_active()}
    if facts["left_on"]:
        torch_context_parallel.turn_dispatch_off()
    facts["cleaned"] = not torch_context_parallel.dispatch_left_on() and F.scaled_dot_product_attention is sdpa
    return facts


# -- issue 31 item 2: FSDP2 x CP and TP x CP trained like one process -------------------------------------------
# layout: (dp_shard, cp, tp) on 4 ranks; its no-CP twin (the same ranks, the cp dim folded into dp_shard) for resume
CP_LAYOUTS = {"fsdp2_cp": (2, 2, 1), "cp_tp": (1, 2, 2)}
NO_CP = {"fsdp2_cp": (4, 1, 1), "cp_tp": (2, 1, 2)}
CP_BATCH, CP_SEQ = 4, 64  # a CP rank's shard: (4 / dp_shard) x 32 tokens, the FP8 training multiple 16 kept
CP_STEPS, CP_LR, CP_CLIP = 3, 0.05, 0.8  # CP_CLIP: below the step-0 norm, so clipping acts


def cp_batch():
    """The global batch: ``input_ids`` and pre-shifted labels (``shift_labels``) with an SFT-style prompt masked
    (-100) per row, of a different length in each row, so CP shards and data ranks hold unequal numbers of counted
    tokens — what makes a per-rank mean loss differ from the one-process loss."""
    import torch

    from . import zoo_scenarios

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, zoo_scenarios.VOCAB, (CP_BATCH, CP_SEQ), generator=g)
    shift = torch.cat([ids[:, 1:], torch.full((CP_BATCH, 1), -100)], dim=1)
    for row, prompt in enumerate((5, 40, 0, 23)):
        shift[row, :prompt] = -100
    return ids, shift


def _cp_accelerator(family, dp_shard, cp, tp):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, TERecipeKwargs
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from . import zoo_scenarios

    scenarios.reset_accelerate()
    scenarios.ensure_te_on_cpu()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[zoo_scenarios.DECODER_LAYER[family]],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    return Accelerator(mixed_precision="fp8", fsdp_plugin=plugin,
                       parallelism_config=ParallelismConfig(dp_shard_size=dp_shard, cp_size=cp, tp_size=tp),
                       kwargs_handlers=[TERecipeKwargs(**fp8_scenarios.RECIPE)])


def _cp_prepared(family, sizes, seed):
    import torch

    acc = _cp_accelerator(family, *sizes)
    model = training.zoo_model(family, seed=seed, attn_implementation="sdpa")
    if sizes[2] > 1:
        model = scenarios.shard_llama_tp(model, acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=CP_LR, momentum=0.9)  # momentum: optimizer state to checkpoint
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _dp_slice(acc, dp_shard):
    """This rank's rows of the global batch (its dp_shard coordinate; cp and tp ranks of one dp rank share them)."""
    per = CP_BATCH // dp_shard
    index = acc.torch_device_mesh["dp_shard"].get_local_rank() if dp_shard > 1 else 0
    return slice(index * per, (index + 1) * per)


def cp_step(acc, model, opt, sizes):
    """One training step as README "Context parallelism" writes it: ``input_ids``, ``shift_labels`` and
    ``position_ids`` as CP buffers; the loss a sum over this rank's counted tokens divided by the global count over
    the ranks FSDP2 averages gradients over (``num_items_in_batch``: transformers' loss takes it). Returns (the
    global loss, the norm clipping saw, the global loss a plain per-rank mean — ``model(**batch).loss`` without
    ``num_items_in_batch`` — would have reported for the same forward)."""
    import torch
    import torch.distributed as dist

    dp_shard, cp, _tp = sizes
    ids, shift = (t[_dp_slice(acc, dp_shard)].clone() for t in cp_batch())
    positions = torch.arange(CP_SEQ).expand_as(ids).clone()
    counted = (shift != -100).sum()
    mesh = acc.torch_device_mesh  # FSDP2 averages gradients over dp_shard_cp (dp_shard without CP)
    averaged_over = mesh["dp_shard_cp"].size() if cp > 1 else dp_shard
    if dp_shard > 1:  # this dp rank's count, before CP shards the buffers; the global one over the data ranks
        dist.all_reduce(counted, group=mesh["dp_shard"].get_group())
    num_items = counted.float() / averaged_over
    buffers = [ids, shift, positions]
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        loss = model(input_ids=ids, labels=shift, shift_labels=shift, position_ids=positions,
                     num_items_in_batch=num_items).loss
        acc.backward(loss)
        local = (shift != -100).sum()  # this rank's counted tokens: the buffers are its CP shard here
    norm = float(acc.clip_grad_norm_(model.parameters(), CP_CLIP))
    opt.step()
    opt.zero_grad()
    values = torch.stack([loss.detach(), loss.detach() * num_items / local.clamp_min(1)])  # weighted, per-rank mean
    dist.all_reduce(values)  # the global loss: the mean over every rank (tp ranks hold equal copies)
    weighted, unweighted = (values / dist.get_world_size()).tolist()
    return weighted, norm, unweighted


@fp8_scenarios.one_process_reference
def cp_reference(family, steps):
    """One process, the global batch, the family converted to TE (``lm_head`` kept, as the ranks keep it; TE's FSDP2
    weight path, as on the ranks), FP8 delayed scaling without an amax group, SGD with momentum, clipped at CP_CLIP:
    (losses, norms)."""
    from accel_fp8_fix.fixes.convert.fp8_shapes import weight_multiple

    recipe = training.zoo_recipe()
    ids, shift = cp_batch()
    return train_reference(lambda: training.zoo_model(family, attn_implementation="sdpa"),
                           lambda model: model(input_ids=ids, labels=shift, shift_labels=shift).loss, steps=steps,
                           lr=CP_LR, momentum=0.9, max_norm=CP_CLIP, recipe=recipe, fsdp2_weight_path=True,
                           convert={"exclude": ("lm_head",), "dim_multiple": weight_multiple(recipe)})


def _snapshot(model):
    from accel_fp8_fix.fixes.convert.fp8_state import fp8_state_tensors

    return ({n: scenarios.full_tensor(p).detach().clone() for n, p in model.named_parameters()},
            {k: v.detach().clone() for k, v in fp8_state_tensors(model).items()})


def _mismatches(saved, model):
    """(parameter names, FP8 state names) whose loaded value differs from ``saved`` in any bit, or is missing."""
    import torch

    params, fp8 = _snapshot(model)
    return [sorted(n for n, t in saved[0].items() if n not in params or not torch.equal(params[n], t)),
            sorted(k for k, t in saved[1].items() if k not in fp8 or not torch.equal(fp8[k], t))]


def _shared_dir():
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="accel_fp8_fix_cp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def sc_cp_trains_like_one_process(rank, world_size, family="llama", layout="fsdp2_cp"):
    """FSDP2 x CP 2 (or CP 2 x TP 2) + FP8 through the package for CP_STEPS steps against the one-process reference
    (losses and clipped norms every step; FP8 state identical on every rank); then a sharded checkpoint: back into a
    differently initialised CP model bit for bit, resumed without CP (the cp dim folded into dp_shard) for one step
    bit for bit, saved there and resumed with CP again for one more — both steps against the reference."""
    import shutil

    import torch.distributed as dist

    scenarios.ensure_rehearsal(True)
    sizes, flat = CP_LAYOUTS[layout], NO_CP[layout]
    ref_losses, ref_norms = cp_reference(family, CP_STEPS + 2)
    acc, model, opt = _cp_prepared(family, sizes, seed=0)
    setup = acc.accel_fp8_fix
    facts = {"mesh": scenarios.mesh_facts(acc.torch_device_mesh), "fp8_enabled": setup.fp8_enabled,
             "te_modules": len(setup.conversion.te_modules), "converted": len(setup.conversion.converted),
             "reference_losses": ref_losses, "reference_norms": ref_norms,
             "row_parallel_ks": tolerances.row_parallel_ks(acc.unwrap_model(model).config),
             "losses": [], "norms": [], "fp8_state_identical": []}
    scenarios.te_reset()
    for step in range(CP_STEPS):
        loss, norm, unweighted = cp_step(acc, model, opt, sizes)
        facts["losses"].append(loss)
        facts["norms"].append(norm)
        if step == 0:
            facts["unweighted_loss"] = unweighted
        facts["fp8_state_identical"].append(
            fp8_scenarios._all_equal_across_ranks(fp8_scenarios.reduced_fp8_state(model)))
    facts["fp8_gemms_fwd"] = scenarios.te_stats()["fp8_gemms_fwd"]
    path = _shared_dir()
    try:
        acc.save_state(f"{path}/cp")
        saved = _snapshot(model)
        facts["fp8_state_tensors"] = len(saved[1])
        acc, model, opt = _cp_prepared(family, sizes, seed=1)  # a different init: everything from the checkpoint
        acc.load_state(f"{path}/cp")
        facts["roundtrip_mismatch"] = _mismatches(saved, model)
        acc, model, opt = _cp_prepared(family, flat, seed=1)  # no CP
        acc.load_state(f"{path}/cp")
        facts["no_cp_mismatch"] = _mismatches(saved, model)
        facts["no_cp_loss"], facts["no_cp_norm"], _ = cp_step(acc, model, opt, flat)
        acc.save_state(f"{path}/flat")
        saved = _snapshot(model)
        acc, model, opt = _cp_prepared(family, sizes, seed=1)  # and back to CP
        acc.load_state(f"{path}/flat")
        facts["back_mismatch"] = _mismatches(saved, model)
        facts["back_loss"], facts["back_norm"], _ = cp_step(acc, model, opt, sizes)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        fp8_scenarios.reset_te_global_state()
    return facts


def cp_collectives(rank, world_size, plant=False):
    """The collectives this rank's recorder saw while one causal CP attention ran forward and backward (torch's
    ring: K/V rotation, the gradients' rotation), as (kind, group, dtype, numel). ``plant``: rank 1 then runs one
    more CP forward that rank 0 does not — a divergence NCCL would hang on (gloo hangs too)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from accel_fp8_fix.diagnostics import collective_order

    _group()
    recorder = collective_order._installed["recorder"]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(3))
    before = len(recorder.records)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        leaf = q.detach().clone().requires_grad_()
        F.scaled_dot_product_attention(leaf, k, v, is_causal=True).sum().backward()
        if plant and rank == 1:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dist.barrier()
    return [(r.kind, r.group, r.dtype, r.numel) for r in recorder.records[before:]]


LAUNCH = {"env": scenarios.ENV_REHEARSAL, "timeout": 200.0, "collective_timeout": 60.0}
