"""Context parallelism on CPU ranks (the rehearsal's CPU ring attention, ``rehearsal/context_parallel.py``) for
tests/distributed/test_context_parallel.py. Each runs inside a rank and returns facts."""

from __future__ import annotations

from . import scenarios

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
    from accel_fp8_fix.fixes.context_parallel import balancer_follows_length

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


def cp_collectives(rank, world_size, plant=False):
    """The collectives this rank's recorder saw while one causal CP attention ran forward and backward (torch's
    ring: K/V rotation, the gradients' rotation), as (kind, group, dtype, numel). ``plant``: rank 1 then runs one
    more CP forward that rank 0 does not — a divergence NCCL would hang on (gloo hangs too)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from accel_fp8_fix.testing import collective_order

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
