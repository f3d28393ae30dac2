"""Several ranks on ONE GPU through ``accelerate launch`` with the config flag (``fp8_config: {accel_fp8_fix:
true}``): FSDP2 (dp_shard N) or FSDP2 x TP, real Transformer Engine FP8, a few training steps, then every
rank's FP8 scaling state compared. The script never imports accel_fp8_fix: the config flag activates it.

NCCL refuses two ranks on one device, so the process group is made here with the backend gpu_kit's probe
found working (gloo: CUDA tensors through host memory), before accelerate makes its own; and every rank is
told it is local rank 0 (accelerate would put rank r on cuda:r). Rank 0 prints ``RANKS_RESULT {json}``.
Usage (gpu_kit.gpu_run does this): accelerate launch --config_file X gpu_kit/ranks_job.py <backend> <steps> [load]
(load: "build", the model built and TP-sharded here; "distributed_config", loaded N-D by transformers;
"expert_parallel", a Qwen3-MoE loaded with ``DistributedConfig(fsdp_size=world, ep_size=2)``: transformers' EP,
its all-to-all dispatch, each rank's experts on TE grouped GEMMs in FP8 — FP8 state compared within each group of
ranks holding the same experts, the rest across all ranks).
With a ``cp`` dim (FSDP2 x CP) each step runs inside ``accelerator.maybe_context_parallel`` as README "Context
parallelism" writes it (``input_ids``, ``shift_labels``, ``position_ids`` as buffers): a functional check — loss
finite and the same global loss on every rank, FP8 state equal — not a throughput figure (the ranks share one GPU).

``GPU_KIT_RANKS_DEVICE=cpu``: the same job on CPU processes over plain gloo (no CUDA call; the accelerate config from
``rank_jobs.config_text(job, "cpu")``, TE's Python over the CPU rehearsal with ``ACCEL_FP8_FIX_REHEARSAL=1``) — only
for ``gpu_kit.derive_probe``, which audits the collectives the job issues; the backend argument is then ignored.
"""

import os
import sys

os.environ["LOCAL_RANK"] = "0"  # before accelerate is imported: every rank on cuda:0

import json  # noqa: E402
import math  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CPU = os.environ.get("GPU_KIT_RANKS_DEVICE", "cuda") == "cpu"  # derive_probe's CPU run of the job


def build_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def shard_tensor_parallel(model, tp_mesh):
    """transformers' own TP plan on the accelerator's "tp" mesh, then accelerate's FSDP2 in prepare."""
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))[0]
    apply_tensor_parallelism(model, tp_mesh, plan)
    model._tp_size = tp_mesh.size()
    return model


def build_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, decoder_sparse_step=1,
                            tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def load_distributed(model, tp_size, fsdp_size, ep_size=None):
    """N-D loading the transformers 5.x way (A18): rank 0 saves, every rank loads with
    ``DistributedConfig(tp_size, fsdp_size[, ep_size])`` — transformers applies TP (or EP) and FSDP2 at load."""
    import shutil
    import tempfile

    from transformers import DistributedConfig

    path = [tempfile.mkdtemp(prefix="gpu_kit_nd_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        model.save_pretrained(path[0])
    dist.barrier()
    extra = {"ep_size": ep_size} if ep_size else {}
    loaded = type(model).from_pretrained(
        path[0], distributed_config=DistributedConfig(tp_size=tp_size, fsdp_size=fsdp_size, **extra))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return loaded.train()  # from_pretrained returns eval mode, where TE autocast is off


def fp8_state(model) -> dict:
    state = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not meta:
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            if key in meta:
                state[f"{name}.{key}.scale"] = meta[key].scale.detach().float().cpu().tolist()
                # row 0 is the step's pending, rank-local amax (the next reduction takes its max over ranks): TP
                # shards differ there by design; the rows TE has reduced must agree (tests/support/fp8_scenarios.py
                # reduced_fp8_state, the suite's same comparison)
                state[f"{name}.{key}.amax_history"] = meta[key].amax_history[1:].detach().float().cpu().tolist()
    return state


def main(backend: str, steps: int, load: str = "build") -> None:
    if CPU:
        backend = "gloo"
    else:
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=90))
    from accelerate import Accelerator

    accelerator = Accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = accelerator.torch_device_mesh
    names = tuple(mesh.mesh_dim_names) if mesh is not None else ()
    model = build_moe() if load == "expert_parallel" else build_model()
    if load == "distributed_config":
        pc = accelerator.parallelism_config
        model = load_distributed(model, tp_size=pc.tp_size, fsdp_size=pc.dp_shard_size)
    elif load == "expert_parallel":
        model = load_distributed(model, tp_size=1, fsdp_size=accelerator.parallelism_config.dp_shard_size, ep_size=2)
    elif "tp" in names and mesh["tp"].size() > 1:
        model = shard_tensor_parallel(model, mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    setup = getattr(accelerator, "accel_fp8_fix", None)

    dp_rank = mesh["dp_shard"].get_local_rank() if "dp_shard" in names else rank
    generator = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, 1024, (4, 64), generator=generator).to(accelerator.device)
    te_modules = [m for m in model.modules() if type(m).__module__.startswith("transformer_engine.")
                  and hasattr(m, "fp8_meta")]
    cp = "cp" in names and mesh["cp"].size() > 1
    losses, fp8_active = [], []
    for _ in range(steps):
        if cp:
            batch = ids.clone()
            shift = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
            positions = torch.arange(batch.shape[1], device=batch.device).expand_as(batch).clone()
            buffers = [batch, shift, positions]
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                    no_restore_buffers=set(buffers)):
                loss = model(input_ids=batch, labels=shift, shift_labels=shift, position_ids=positions).loss
                accelerator.backward(loss)
        else:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        fp8_active.append(bool(te_modules) and all(m.fp8 for m in te_modules))
    if not CPU:
        torch.cuda.synchronize()

    states, rank_losses = [None] * world, [None] * world
    dist.all_gather_object(states, fp8_state(model))
    dist.all_gather_object(rank_losses, losses)
    experts = getattr(setup, "conversion", None)
    experts = list(experts.experts) if experts is not None else []
    if rank == 0:
        # under EP the experts' runners hold each EP rank's own experts: compared within ranks of the same EP rank
        ep = 2 if load == "expert_parallel" else 1
        shared = [k for k in states[0] if not (ep > 1 and ".experts.te_" in k)]
        unequal = sorted(k for k in shared if any(s.get(k) != states[0][k] for s in states[1:]))
        unequal += sorted(k for k in states[0] if k not in shared
                          if any(states[r].get(k) != states[r % ep].get(k) for r in range(ep, world)))
        moved = sum(1 for k, v in states[0].items() if k.endswith(".scale") and any(x != 1.0 for x in v))
        import accel_fp8_fix

        report = accel_fp8_fix.report()
        result = {
            "backend": backend, "load": load, "world_size": world, "mesh": dict(zip(names, mesh.shape)) if mesh is not None else {},
            "distributed_type": str(accelerator.distributed_type), "device": str(accelerator.device),
            "activated_by": report.mode, "patch_set": report.patch_set, "fixes_active": setup is not None,
            "te_modules": len(te_modules), "losses": losses, "losses_finite": all(map(math.isfinite, losses)),
            "losses_equal_across_ranks": all(r == losses for r in rank_losses), "context_parallel": cp,
            "fp8_active_each_step": fp8_active, "fp8_state_entries": len(states[0]), "scales_moved": moved,
            "equal_fp8_state_across_ranks": not unequal and bool(states[0]), "unequal": unequal[:10],
            "amax_group_ranks": list(setup.amax_group_ranks) if setup is not None else None,
            "experts_in_fp8": experts,
            "peak_memory_gib": None if CPU else round(torch.cuda.max_memory_allocated() / 2**30, 3),
        }
        print("RANKS_RESULT " + json.dumps(result), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda:gloo,cpu:gloo", int(sys.argv[2]) if len(sys.argv) > 2 else 3,
         sys.argv[3] if len(sys.argv) > 3 else "build")
