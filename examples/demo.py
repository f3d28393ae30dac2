"""The demo: a small transformers Llama trained with FSDP2 (dp_shard 2) x tensor parallelism (tp 2) and
Transformer Engine FP8, through `accelerate launch` — and the script never imports accel_fp8_fix.

The model is loaded the way transformers 5.x documents N-D loading, ``from_pretrained(...,
distributed_config=DistributedConfig(tp_size, fsdp_size))``, with the sizes of the accelerate config.
Everything else comes from the accelerate config file (examples/fsdp2_tp_fp8.yaml): FSDP2, the
parallelism config, `mixed_precision: fp8` with the TE backend, and `fp8_config: {accel_fp8_fix: true}`,
which switches this package on in every worker. scripts/demo.sh runs it on 4 CPU processes (gloo) with
Transformer Engine's real Python over a CPU kernel shim (the rehearsal); on GPUs with real TE the script
is the same.
"""

import logging
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accelerate import Accelerator


def build_model(seed=0):
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_demo_checkpoint(accelerator) -> str:
    """The demo's stand-in for a Hub checkpoint: rank 0 saves ``build_model()`` in a temporary folder that every
    rank then loads from; rank 0 removes it once every rank has loaded (``main``; at exit as a fallback)."""
    import atexit
    import shutil
    import tempfile

    from accelerate.utils import broadcast_object_list

    path = [None]
    if accelerator.is_main_process:
        path = [tempfile.mkdtemp(prefix="accel_fp8_fix_demo_")]
        build_model().save_pretrained(path[0])
        atexit.register(shutil.rmtree, path[0], True)
    broadcast_object_list(path)
    return path[0]


def load_model(path, accelerator):
    """Load the model sharded N-D the way transformers 5.x documents it: ``from_pretrained(...,
    distributed_config=DistributedConfig(tp_size, fsdp_size))`` with the sizes of the accelerate config.
    transformers applies its TP plan and FSDP2 at load; prepare converts to TE on those shards."""
    from transformers import DistributedConfig

    pc = accelerator.parallelism_config
    # fsdp_mixed_precision: accelerate's mixed precision reaches an FSDP2 model only through fully_shard's policy,
    # here transformers' (bf16 parameters, fp32 gradient reduction); without it, all but TE's FP8 GEMMs run in fp32
    config = DistributedConfig(tp_size=pc.tp_size, fsdp_size=pc.dp_shard_size, fsdp_mixed_precision=True)
    model = LlamaForCausalLM.from_pretrained(path, distributed_config=config)
    return model.train()  # from_pretrained returns eval mode, where TE autocast (FP8) is off


def _wait_for_all_failed(accelerator, timeout_s=20.0):
    """Count this rank's failure in the process group's store and wait until every rank has counted its own
    (or ``timeout_s``): unlike a barrier, a rank that did not fail cannot make this hang."""
    import time

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    store.add("demo_prepare_failed", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("demo_prepare_failed", 0) < accelerator.num_processes and time.monotonic() < deadline:
        time.sleep(0.05)


def main(steps):
    # Keep the demo's output readable: torch's FSDP2 view-tensor and DTensor redistribution notices.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message="Slicing a flattened dim")  # torch, on accelerate's mesh slicing
    logging.basicConfig(format="%(message)s", level=logging.WARNING)  # accel_fp8_fix speaks once, from rank 0
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the checkpoint's save / load bars, once per rank
    accelerator = Accelerator()
    mesh = accelerator.torch_device_mesh
    accelerator.print(f"mesh {tuple(mesh.mesh_dim_names)} {tuple(mesh.shape)}, distributed type {accelerator.distributed_type}")
    import transformer_engine.pytorch  # noqa: F401
    from importlib.metadata import version

    kernels = sys.modules["transformer_engine_torch"].__name__
    if not kernels.startswith("transformer_engine"):  # the CPU rehearsal's kernel shim
        accelerator.print(f"Transformer Engine {version('transformer-engine')}: its Python on CPU, kernels from {kernels} "
                          "(FP8 numerics, no GPU speed)")
    path = save_demo_checkpoint(accelerator)
    model = load_model(path, accelerator)
    # Every rank has loaded before rank 0 removes the checkpoint (removing it at rank 0's exit raced the other
    # ranks' loading: FileNotFoundError tracebacks next to the stock error with DEMO_PATCHES=off).
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except Exception as exc:  # what stock accelerate does (run with DEMO_PATCHES=off)
        # Every rank says it, then waits (bounded) until every rank has said it: the first rank to exit makes the
        # launcher stop the others, which could otherwise be stopped before they print.
        print(f"[rank {accelerator.process_index}] prepare() failed: {type(exc).__name__}: {exc}", flush=True)
        _wait_for_all_failed(accelerator)
        raise SystemExit(1)

    dp_rank = mesh["dp_shard"].get_local_rank()
    generator = torch.Generator().manual_seed(100 + dp_rank)  # each data-parallel rank its own data
    ids = torch.randint(0, 512, (4, 64), generator=generator)
    te_modules = [m for m in model.modules() if hasattr(m, "fp8_meta")]
    for step in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        fp8_active = bool(te_modules) and all(m.fp8 for m in te_modules)
        accelerator.print(
            f"step {step}: loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}  "
            f"grad norm {float(grad_norm):.3f}  FP8 active: {fp8_active}"
        )

    setup = getattr(accelerator, "accel_fp8_fix", None)
    if setup is None:
        accelerator.print("accel_fp8_fix: not active - stock accelerate")
    else:
        import accel_fp8_fix

        report = accel_fp8_fix.report()
        accelerator.print(f"patch set: {report.patch_set}  (activated by: {report.mode})")
        accelerator.print(
            f"TE modules: {len(setup.conversion.te_modules)} converted after sharding "
            f"({sum(1 for m in te_modules if getattr(m, 'parallel_mode', None))} with TE-native TP), "
            f"kept: {[n for n, _ in setup.conversion.skipped]}; amax group ranks {list(setup.amax_group_ranks)}"
        )
        accelerator.print(accel_fp8_fix.audit(model).coverage)  # FP8 share of GEMM parameters and GEMMs, each kept one named
    accelerator.end_training()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
