"""Which layout for an MoE: memory and bytes on the wire per rank, FSDP2 x TP (experts replicated or TP-sharded) vs
FSDP2 x EP vs FSDP2 alone, in one run on 4 CPU ranks.

transformers 5.25's default TP plans for Qwen3-MoE and Mixtral no longer shard the experts: under ``tp_size`` each
TP rank holds and runs every expert whole (the package serves them in FP8, replicated on ``tp``). The explicit
``moe_tp_experts`` plan (deprecated, "removal in v5.28.0") shards each expert's intermediate dim over TP; expert
parallelism (``DistributedConfig(ep_size=...)``) places whole experts on ranks and moves tokens with all-to-all.
Each row: a Qwen3-MoE with a real model's proportions (``accel_fp8_fix.testing.training.proportioned_qwen3_moe``:
32 experts, top-8, experts ~85 % of the parameters), sharded as the layout says (``training.shard_tp`` /
``training.load_sharded_by_transformers``), prepared by the package in FP8 (delayed scaling, FSDP2 param_dtype bf16,
the FP8 all-gather off), 2 steps on Transformer Engine's Python over the CPU shim (``layout_run``, every layout in
turn in the same 4 ranks of ``accel_fp8_fix.testing.run_distributed``); measured on rank 0 at the c10d dispatch layer
(``CollectiveSpy``) on the last step, and the bytes of the parameters the rank holds (its shards; with FSDP2 the
unsharded weights exist only while a unit runs).

Run: ``python benchmarks/moe_layouts.py`` (~2 min on 2 cores). Figures: README "Mixture-of-experts" and
docs/benchmarks.md, "MoE layouts".
"""

from __future__ import annotations

import os
import sys

LAYOUTS = {  # name: (layout_run keyword arguments, what it is)
    "FSDP2 4": ({"dp_shard": 4}, "experts sharded by FSDP2 over 4 ranks"),
    "FSDP2 2 x TP 2, experts replicated (5.25 default plan)": (
        {"dp_shard": 2, "tp": 2, "experts_tp": "default"}, "each TP rank holds and runs every expert"),
    "FSDP2 2 x TP 2, moe_tp_experts (explicit plan)": (
        {"dp_shard": 2, "tp": 2, "experts_tp": "tp"}, "each TP rank holds I / 2 of every expert"),
    "FSDP2 4 x EP 2 (DistributedConfig(ep_size=2))": ({"ep": 2}, "each EP rank holds half the experts, whole"),
}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}  # HYBRID delayed scaling
LR, CLIP = 0.05, 0.9
BATCH, SEQ = 8, 16  # sequences, split over the data-parallel ranks


def layout_run(rank, world_size, dp_shard=None, tp=None, experts_tp="tp", ep=None, steps=2):
    """The proportioned Qwen3-MoE in one layout, prepared in FP8 and trained ``steps`` steps: the losses, the bytes
    this rank sent into each kind of collective per step, and the bytes of the parameters (experts) it holds."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.testing import training
    from accel_fp8_fix.testing.spy import CollectiveSpy

    warnings.simplefilter("ignore")
    training.ensure_rehearsal(True)
    os.environ["ACCELERATE_FP8_ALL_GATHER"] = "high_precision"
    acc = training.make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp, mixed_precision="fp8", fp8_recipe=RECIPE,
                                    wrap_cls=[training.ZOO_DECODER_LAYER["qwen3_moe"]],
                                    mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                reduce_dtype=torch.float32))
    model = training.proportioned_qwen3_moe()
    model.config._experts_implementation = "eager"
    if tp:
        model = training.shard_tp(model, acc.torch_device_mesh["tp"], experts=experts_tp)
    if ep:
        model = training.load_sharded_by_transformers(model, tp_size=1, fsdp_size=world_size, ep_size=ep)
        model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    dp_rank, dp_size = training.data_rank(acc)
    ids = torch.randint(0, training.ZOO_VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    data = {"input_ids": ids.chunk(dp_size)[dp_rank], "labels": ids.clone().chunk(dp_size)[dp_rank]}
    losses, bytes_by_op = [], []
    for _ in range(steps):
        with CollectiveSpy() as spy:
            loss = model(**data).loss
            acc.backward(loss)
            float(acc.clip_grad_norm_(model.parameters(), CLIP))  # as a training script logs it
            opt.step()
            opt.zero_grad()
        by_op = {}
        for c in spy.calls(layer="dispatch"):
            kind = next((k for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
                         if k.replace("_", "") in c.op.replace("_", "")), "other")
            by_op[kind] = by_op.get(kind, 0) + c.nbytes
        bytes_by_op.append(by_op)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world_size)
    held = {n: getattr(p, "_local_tensor", p) for n, p in model.named_parameters()}
    training.reset_te_global_state()
    return {"losses": losses, "bytes_by_op": bytes_by_op, "experts": list(acc.accel_fp8_fix.conversion.experts),
            "param_bytes_held": sum(t.numel() * t.element_size() for t in held.values()),
            "expert_bytes_held": sum(t.numel() * t.element_size() for n, t in held.items()
                                     if n.endswith(("gate_up_proj", "down_proj")))}


def measure(rank, world_size, plan):
    """Each layout of ``plan`` in turn in these ranks, each from the launch's environment (accelerate writes
    ``ACCELERATE_USE_FSDP`` / ``FSDP_*`` into ``os.environ``)."""
    from accel_fp8_fix.testing.training import reset_accelerate

    environ, out = dict(os.environ), []
    for kwargs in plan:
        os.environ.clear()
        os.environ.update(environ)
        out.append(layout_run(rank, world_size, **kwargs))
    reset_accelerate()
    return out


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from accel_fp8_fix.testing import run_distributed
    from accel_fp8_fix.testing.training import ENV_FIXED

    plan = [kwargs for kwargs, _ in LAYOUTS.values()]
    print("running 4 ranks ...", file=sys.stderr, flush=True)
    results = run_distributed(measure, 4, args=(plan,), env=ENV_FIXED, timeout=900, collective_timeout=90,
                              init_process_group=False)
    print("| layout | parameters held / rank (MiB) | experts held / rank (MiB) | "
          + " | ".join(f"{op} / step (MiB)" for op in OPS) + " | experts in FP8 | losses |")
    print("|---|---|---|" + "---|" * len(OPS) + "---|---|")
    for name, f in zip(LAYOUTS, results[0]):
        by_op = f["bytes_by_op"][-1]
        mib = lambda b: f"{b / 2 ** 20:.2f}"  # noqa: E731
        print(f"| {name} | {mib(f['param_bytes_held'])} | {mib(f['expert_bytes_held'])} | "
              + " | ".join(mib(by_op.get(op, 0)) for op in OPS)
              + f" | {len(f['experts'])} | {', '.join(f'{x:.4f}' for x in f['losses'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
