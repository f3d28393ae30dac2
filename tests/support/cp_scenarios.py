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

    _group()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q = torch.randn(SHAPE)
    try:
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            local = DTensor.from_local(q, mesh, [Shard(2)], run_check=False)
            mask = DTensor.from_local(torch.ones(q.shape[:3] + (SHAPE[2],), dtype=torch.bool), mesh, [Shard(2)],
                                      run_check=False)
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(local, local, local, attn_mask=mask)
    except Exception as exc:  # noqa: BLE001
        return {"error": scenarios.err(exc)}
    return {"error": None}


LAUNCH = {"env": scenarios.ENV_REHEARSAL, "timeout": 200.0, "collective_timeout": 60.0}
