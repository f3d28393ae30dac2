"""What the suite's scenarios and the benchmarks share: toy models, their batches, and one training comparison.

    from accel_fp8_fix.testing.training import block_stack, dense_batch, train_and_compare, train_reference

* Models: :class:`Block` / :class:`BlockStack` (plain torch: pre-norm MLP blocks and a head; ``Block`` is the FSDP2
  wrap unit found by class name), :func:`block_stack`, :func:`tiny_llama` / :func:`tiny_qwen2` (``transformers``
  models from a config, no download); batches: :func:`dense_batch`, :func:`token_batch` — each seeded, so every
  rank builds the same one.
* :func:`train` — the one training loop: ``steps`` SGD steps, the loss from ``loss_of(model)``, the gradient norm
  clipped to ``max_norm``; in one process (``loss.backward()``, torch's ``clip_grad_norm_``) or through an
  ``Accelerator`` (``accelerator.backward``, ``accelerator.clip_grad_norm_``), optionally under Transformer Engine's
  autocast (``recipe``). Returns (losses, clipped grad norms) per step.
* :func:`train_reference` — the one-process reference a multi-rank run is compared with: the model built, converted
  to TE (``convert``) and trained by :func:`train`, TE's global FP8 state reset at the end.
* :func:`train_and_compare` — a run through :func:`train` next to a reference: the losses and norms of both and the
  steps where they differ beyond ``rtol`` / ``atol`` (``mismatches``, each naming its step); ``check=True`` raises.
* Where a run starts from: the environments of ``run_distributed(env=...)`` (:data:`ENV_STOCK`,
  :data:`ENV_REHEARSAL`, :data:`ENV_FIXED`), :func:`ensure_rehearsal`, :func:`ensure_te_on_cpu`,
  :func:`reset_accelerate`, :func:`make_accelerator` (a real ``Accelerator`` whose distributed type and mesh are
  asserted, so nothing falls back silently).
* A model's layout before ``prepare``: :func:`shard_tp` (transformers' TP plan on a TP mesh; :func:`experts_tp_plan`
  its packed-experts rules), :func:`load_sharded_by_transformers` (``DistributedConfig`` N-D loading), and
  :func:`data_rank` (a rank's index among the data-parallel ranks: which slice of the batch it trains on).
* The model zoo: :func:`zoo_model` (tiny configs of transformers families), :data:`ZOO_DECODER_LAYER` (each family's
  FSDP2 wrap unit), :func:`zoo_recipe` and :func:`proportioned_qwen3_moe` (a Qwen3-MoE with a real MoE's
  proportions).
* :func:`fsdp2_fp8_compile_run` — a rank of FSDP2 + FP8 under accelerate's torch.compile setting (its facts: losses,
  step times, FP8 GEMMs, dynamo's counters), the run the compile test and benchmark share.

Import cost: torch only. transformers, Transformer Engine and accelerate are imported inside the functions that need
them, so ``import accel_fp8_fix.testing.training`` stays as cheap as torch.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

__all__ = ["DIM", "Block", "BlockStack", "block_stack", "tiny_llama", "tiny_qwen2", "dense_batch", "token_batch",
           "train", "train_reference", "train_and_compare", "compare", "reset_te_global_state", "ENV_STOCK",
           "ENV_REHEARSAL", "ENV_FIXED", "ensure_rehearsal", "ensure_te_on_cpu", "reset_accelerate",
           "make_accelerator", "shard_tp", "experts_tp_plan", "load_sharded_by_transformers", "data_rank", "ZOO_VOCAB",
           "ZOO_FAMILIES", "ZOO_MOE_ONLY", "ZOO_DECODER_LAYER", "zoo_model", "zoo_recipe", "proportioned_qwen3_moe",
           "COMPILE_VOCAB", "COMPILE_TOKENS", "fsdp2_fp8_compile_run"]

DIM = 64  # every Linear dim is a multiple of 16 (TE's FP8 GEMM requirement) unless a scenario says otherwise


# -- models ---------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``; ``norm=False``: no LayerNorm; ``bias=False``: bias-free Linears."""

    def __init__(self, dim: int, hidden: int, norm: bool = True, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else None
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x if self.norm is None else self.norm(x))))


class BlockStack(nn.Module):
    """``depth`` Blocks and a Linear head to ``out``; ``buffer=True`` scales the input by a persistent plain buffer
    ``scale`` (it is in ``state_dict()``)."""

    def __init__(self, dim: int, hidden: int, depth: int, out: int, buffer: bool = False, norm: bool = True,
                 bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden, norm=norm, bias=bias) for _ in range(depth))
        self.head = nn.Linear(dim, out, bias=bias)
        if buffer:
            self.register_buffer("scale", torch.full((dim,), 0.5))
        else:
            self.scale = None

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_stack(dim: int = DIM, hidden: int = 2 * DIM, depth: int = 2, out: int = 16, buffer: bool = False,
                seed: int = 0):
    """A :class:`BlockStack` (pre-norm MLP blocks and a head) initialised from ``torch.manual_seed(seed)``.

    ``buffer=True`` adds a persistent plain buffer ``scale`` (it is in ``state_dict()``; A5).
    """
    torch.manual_seed(seed)
    return BlockStack(dim, hidden, depth, out, buffer)


def tiny_llama(hidden: int = DIM, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 2 * DIM,
               vocab: int = 256, seed: int = 0, **config_kwargs):
    """A small ``transformers`` ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download), fp32, eval-free."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **config_kwargs,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_qwen2(vocab: int = 128, seed: int = 0):
    """A small ``transformers`` ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads), fp32, from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def token_batch(vocab: int = 256, batch: int = 2, seq: int = 16, seed: int = 1):
    """``{"input_ids", "labels"}``: ``batch`` x ``seq`` random tokens (labels the same ids) from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def dense_batch(dim: int = DIM, batch: int = 8, seed: int = 1):  # 8 tokens: TE FP8 GEMMs need multiples of 8
    """``(x, y)``: ``batch`` x ``dim`` inputs and ``batch`` x 16 targets from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, 16, generator=g)


# -- training -------------------------------------------------------------------------------------------------------
def reset_te_global_state():
    """TE's global amax buffers outlive a model: a reference trained in a rank leaves none behind."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reset()


def _value(tensor) -> float:
    """A loss or norm as a float: the whole mesh's value of a DTensor."""
    tensor = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    return float(tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)


def _logged_norm(norm) -> float:
    """``accelerator.clip_grad_norm_``'s norm as a training script logs it. With the fixes on, float() of it must
    already be the whole mesh's (A17); stock accelerate (rehearsal-only runs) on torch 2.9 returns a Partial DTensor
    whose float() is one rank's share, so there the norm is gathered first."""
    from .._api import active_patch_set

    if active_patch_set() is None and hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def train(model, loss_of, *, steps: int, max_norm: float, optimizer=None, lr: float | None = None,
          momentum: float | None = None, accelerator=None, recipe=None, fp8: bool = True, criterion=None,
          around_backward=None, after_first_backward=None) -> tuple[list, list]:
    """(losses, clipped grad norms) of ``steps`` SGD steps of ``model`` on ``loss_of(model)``.

    ``optimizer``: the one to step (an accelerator's prepared one); without it ``SGD(lr[, momentum])`` is made here.
    ``accelerator``: backward and clipping through it, the loss and norm as the whole mesh's values; without it
    ``loss.backward()`` and torch's ``clip_grad_norm_`` in this process. ``recipe``: the forward under TE's autocast
    (FP8 on unless ``fp8=False``); ``criterion``: applied to ``loss_of``'s output after the autocast exits (the
    forward alone under it). ``around_backward(model)``: called before each forward, what it returns is called after
    that step's backward (e.g. weights swapped for leaves and back). ``after_first_backward(model)``: once, with step
    0's gradients in place, before clipping."""
    if optimizer is None:
        kwargs = {} if momentum is None else {"momentum": momentum}
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, **kwargs)
    if recipe is not None:
        import transformer_engine.pytorch as te

        from ..fixes.convert.fp8_autocast import te_autocast

        autocast = te_autocast(te)
    losses, norms = [], []
    for step in range(steps):
        after = around_backward(model) if around_backward is not None else None
        with autocast(fp8, recipe, None) if recipe is not None else contextlib.nullcontext():
            loss = loss_of(model)
        if criterion is not None:
            loss = criterion(loss)
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        if after is not None:
            after()
        if step == 0 and after_first_backward is not None:
            after_first_backward(model)
        if accelerator is not None:
            norms.append(_logged_norm(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_value(loss) if accelerator is not None else float(loss))
    return losses, norms


def train_reference(build, loss_of, *, steps: int, lr: float, max_norm: float, recipe=None, fp8: bool = True,
                    convert: dict | None = None, fsdp2_weight_path: bool = False, **train_kwargs) -> tuple[list, list]:
    """The one-process reference: (losses, clipped grad norms) of ``build()`` trained by :func:`train` in this
    process on the whole batch — what a multi-rank run of the same model, data and optimizer is compared with.

    ``convert``: the model's Linears (and MoE experts) converted to TE first, these the keyword arguments of
    ``fixes.convert.te_convert.convert_after_sharding`` (``{}``: every Linear); ``fsdp2_weight_path``: every
    converted module takes TE's FSDP2 weight path (``_is_fsdp2``: the FP8 weight re-quantized in backward, as on the
    FSDP2 ranks — the comparison exact rather than FP8-resolution). ``recipe``: a TE recipe (without an amax group:
    one process sees every sample's amax); with it TE's global FP8 state is reset at the end. The rest goes to
    :func:`train` (``momentum``, ``criterion``, ``around_backward``, ``after_first_backward``)."""
    model = build()
    if convert is not None:
        import transformer_engine.pytorch as te

        from ..fixes.convert.te_convert import convert_after_sharding

        convert_after_sharding(model, te, **convert)
    if fsdp2_weight_path:
        from ..internals.transformer_engine.modules import take_fsdp2_weight_path

        take_fsdp2_weight_path(model)
    result = train(model, loss_of, steps=steps, lr=lr, max_norm=max_norm, recipe=recipe, fp8=fp8, **train_kwargs)
    if recipe is not None:
        reset_te_global_state()
    return result


def compare(losses, norms, reference_losses, reference_norms, *, rtol: float = 0.0, atol: float = 0.0) -> list[str]:
    """The steps where a run's losses or clipped grad norms differ from the reference's beyond ``atol + rtol *
    |reference|`` (a step count that differs too), each as ``"step N: loss 1.25 vs reference 1.5"``."""
    out = []
    for step, values in enumerate(zip(losses, norms, reference_losses, reference_norms)):
        for what, got, want in (("loss", values[0], values[2]), ("grad norm", values[1], values[3])):
            if not (got == want or math.isclose(got, want, rel_tol=rtol, abs_tol=atol)):
                out.append(f"step {step}: {what} {got!r} vs reference {want!r}")
    if (len(losses), len(norms)) != (len(reference_losses), len(reference_norms)):
        out.append(f"steps: {len(losses)} losses, {len(norms)} norms vs reference {len(reference_losses)}, "
                   f"{len(reference_norms)}")
    return out


def train_and_compare(model, loss_of, reference, *, steps: int, max_norm: float, rtol: float = 0.0,
                      atol: float = 0.0, check: bool = False, **train_kwargs) -> dict:
    """``model`` trained by :func:`train` (``accelerator=``, ``optimizer=`` / ``lr=``, ``recipe=`` ... as the
    scenario trains it) next to a one-process ``reference``: its (losses, norms), or a callable computing them after
    the run (e.g. ``lambda: train_reference(...)``; None: no reference). Returns ``{"losses", "grad_norms",
    "reference_losses", "reference_grad_norms", "mismatches"}`` — ``mismatches`` from :func:`compare` at ``rtol`` /
    ``atol`` (bit for bit by default); ``check=True`` raises AssertionError with them instead of returning any."""
    losses, norms = train(model, loss_of, steps=steps, max_norm=max_norm, **train_kwargs)
    if callable(reference):
        reference = reference()
    reference_losses, reference_norms = reference if reference is not None else (None, None)
    mismatches = ([] if reference is None else
                  compare(losses, norms, reference_losses, reference_norms, rtol=rtol, atol=atol))
    if check and mismatches:
        raise AssertionError("the run differs from its one-process reference:\n  " + "\n  ".join(mismatches))
    return {"losses": losses, "grad_norms": norms, "reference_losses": reference_losses,
            "reference_grad_norms": reference_norms, "mismatches": mismatches}


# -- environments and the accelerator (what a rank of the suite, or a benchmark, starts from) -------------------------
# ``env=`` of run_distributed: ENV_STOCK (no fixes, no TE on CPU, no rehearsal), ENV_REHEARSAL (no fixes, TE's Python
# on CPU + the rehearsal through the ``.pth`` bootstrap), ENV_FIXED (fixes on + TE's Python on CPU + rehearsal).
_OFF = {"ACCELERATE_FP8_ACCEL_FP8_FIX": "0"}
ENV_STOCK = {**_OFF, "ACCEL_FP8_FIX": "0", "ACCEL_FP8_FIX_REHEARSAL": "0"}
ENV_REHEARSAL = {**_OFF, "ACCEL_FP8_FIX": "0", "ACCEL_FP8_FIX_REHEARSAL": "1"}
ENV_FIXED = {**_OFF, "ACCEL_FP8_FIX": "1", "ACCEL_FP8_FIX_REHEARSAL": "1"}


def ensure_rehearsal(on: bool = True) -> None:
    """Put the rehearsal gates in the state the scenario expects (activate / deactivate in this process)."""
    from ..rehearsal import gates as rehearsal

    if on:
        rehearsal.activate()
        import accelerate  # noqa: F401  (applies the wrappers now)

        assert rehearsal.is_applied(), "rehearsal wrappers are not applied"
    else:
        rehearsal.deactivate()
        assert not rehearsal.is_applied()


def ensure_te_on_cpu() -> None:
    """Transformer Engine's real Python on CPU (normally installed by the bootstrap with ACCEL_FP8_FIX_REHEARSAL=1)."""
    from ..rehearsal import te_on_cpu

    te_on_cpu.install()
    from accelerate.utils import is_fp8_available, is_transformer_engine_available

    assert is_transformer_engine_available() and is_fp8_available(), "Transformer Engine not visible to accelerate"
    import transformer_engine.pytorch  # noqa: F401  (TE's Python, over the CPU kernel shim)


def reset_accelerate() -> None:
    """Forget accelerate's singletons (keeps the process group), so the next Accelerator is built afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_accelerator(
    fsdp: bool = True,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
    tp: int | None = None,
    mixed_precision: str = "fp8",
    cpu_ram_efficient_loading: bool = False,
    cpu: bool = False,
    wrap_cls: list | None = None,
    fp8_recipe: dict | None = None,
    expect: str | None = "auto",
    **plugin_kwargs,
):
    """A real ``Accelerator``: ``FullyShardedDataParallelPlugin(fsdp_version=2, ...)`` when ``fsdp``,
    ``ParallelismConfig`` when any of ``dp_shard`` / ``dp_replicate`` / ``tp`` is given, ``TERecipeKwargs``
    (``fp8_recipe``, default HYBRID delayed scaling) when ``mixed_precision="fp8"``.

    ``expect`` is the ``DistributedType`` name that must result (``"FSDP"``, ``"MULTI_GPU"``, ``"MULTI_CPU"``,
    ``"NO"``); ``"auto"``: ``FSDP`` with ``fsdp``, else ``MULTI_GPU`` (what the rehearsal gives); ``None``:
    not checked (the caller asserts). For a rehearsal result it also asserts device cpu, backend gloo,
    ``is_fsdp2`` and a mesh on "cpu" with the ParallelismConfig's dims.
    """
    reset_accelerate()
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, TERecipeKwargs

    if mixed_precision == "fp8":
        ensure_te_on_cpu()
    plugin = None
    if fsdp:
        kwargs = dict(fsdp_version=2, cpu_ram_efficient_loading=cpu_ram_efficient_loading)
        if wrap_cls:
            kwargs.update(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=list(wrap_cls))
        kwargs.update(plugin_kwargs)
        plugin = FullyShardedDataParallelPlugin(**kwargs)
    pc = None
    if any(v is not None for v in (dp_shard, dp_replicate, tp)):
        pc = ParallelismConfig(dp_shard_size=dp_shard or 1, dp_replicate_size=dp_replicate or 1, tp_size=tp or 1)
    handlers = []
    if mixed_precision == "fp8":
        fp8_recipe = fp8_recipe or {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
        if "recipe" in fp8_recipe:  # another TE recipe by name (accel_fp8_fix.te_recipe_kwargs)
            from ..fixes.start.recipe_kwargs import te_recipe_kwargs

            handlers.append(te_recipe_kwargs(**fp8_recipe))
        else:
            handlers.append(TERecipeKwargs(**fp8_recipe))
    acc = Accelerator(
        mixed_precision=mixed_precision, fsdp_plugin=plugin, parallelism_config=pc, kwargs_handlers=handlers or None, cpu=cpu
    )
    if expect == "auto":
        expect = "FSDP" if fsdp else "MULTI_GPU"
    if expect is not None:
        found = acc.distributed_type.name
        assert found == expect, f"expected DistributedType.{expect}, got {acc.distributed_type} (silent fallback?)"
        if expect in ("FSDP", "MULTI_GPU"):
            assert acc.device.type == "cpu", acc.device
            assert acc.state.backend == "gloo", acc.state.backend
            assert acc.num_processes == int(os.environ["WORLD_SIZE"]), acc.num_processes
            if fsdp:
                assert acc.is_fsdp2, "FSDP but not FSDP2"
            if pc is not None:
                mesh = acc.torch_device_mesh
                assert mesh is not None and mesh.device_type == "cpu", mesh
                want = tuple(n for n, s in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp)) if (s or 1) > 1)
                assert tuple(mesh.mesh_dim_names) == want, (mesh.mesh_dim_names, want)
    return acc


# -- layouts a model is sharded into before prepare (transformers' TP / N-D loading) -----------------------------
def shard_tp(model, mesh_tp, experts: str = "default"):
    """Shard ``model`` with transformers 5.x tensor parallelism on ``mesh_tp`` (1-D, on its own ranks).

    Uses ``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` with the model's own TP plan
    (``from_pretrained(tp_plan=...)`` shards over the whole world on CPU, docs/failures.md A18) and records the
    TP degree where accelerate's ``get_model_tp_size`` looks (``model.tp_size`` -> ``model._tp_size``).
    ``experts="tp"``: packed experts TP-sharded by transformers' ``moe_tp_experts`` (:func:`experts_tp_plan`) —
    the default plans' rule up to 5.24, an explicit one from 5.25; ``"default"``: the model's own plan (5.25's
    leaves the experts replicated on the TP ranks).
    """
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp_size = mesh_tp.size()
    plan = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_size))[0]
    if experts == "tp":
        plan = {**plan, **experts_tp_plan(model)}
    elif experts != "default":
        raise ValueError(f"experts={experts!r}: 'default' or 'tp'")
    apply_tensor_parallelism(model, mesh_tp, plan)
    model._tp_size = tp_size
    return model


def experts_tp_plan(model) -> dict:
    """transformers' expert TP rules for every ``[E, out, in]`` packed-experts module of ``model``: ``packed_colwise``
    gate_up_proj, ``rowwise`` down_proj, ``moe_tp_experts`` on the module (Qwen3-MoE's and Mixtral's default plans
    up to 5.24; deprecated from 5.25, "removal in v5.28.0")."""
    plan = {}
    for name, module in model.named_modules():
        gate_up = module._parameters.get("gate_up_proj")
        if gate_up is not None and gate_up.dim() == 3 and not getattr(module, "is_transposed", False):
            plan.update({f"{name}.gate_up_proj": "packed_colwise", f"{name}.down_proj": "rowwise",
                         name: "moe_tp_experts"})
    return plan


def load_sharded_by_transformers(model, tp_size: int, fsdp_size: int, ep_size: int | None = None):
    """N-D loading as transformers 5.x documents it: ``from_pretrained(path, distributed_config=
    DistributedConfig(tp_size, fsdp_size[, ep_size]))`` — transformers applies TP (or EP) *and* FSDP2 at load, on a
    mesh of its own. ``model`` is saved first by rank 0 (transformers saves and reads on rank 0 only) in a folder all
    ranks share."""
    import shutil
    import tempfile

    import torch.distributed as dist
    from transformers import DistributedConfig

    path = [tempfile.mkdtemp(prefix="accel_fp8_fix_nd_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    path = path[0]
    try:
        model.save_pretrained(path)  # rank 0 writes
        dist.barrier()
        config = DistributedConfig(tp_size=tp_size, fsdp_size=fsdp_size,
                                   **({"ep_size": ep_size} if ep_size is not None else {}))
        return type(model).from_pretrained(path, distributed_config=config, dtype=model.dtype)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def data_rank(acc) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number)."""
    mesh = acc.torch_device_mesh
    if mesh is None:  # one rank, no ParallelismConfig
        return 0, 1
    names = [n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names]
    if not names:
        return 0, 1
    dp = mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]
    coords = dp.get_coordinate()
    index = 0
    for dim, coord in enumerate(coords):
        index = index * dp.size(dim) + coord
    return index, dp.size()


# -- the model zoo: tiny configs of transformers families ---------------------------------------------------------
ZOO_VOCAB = 256
ZOO_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "exaone4")
ZOO_MOE_ONLY = ("qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")  # trained by tests/distributed/test_moe_fp8.py
# each family's decoder layer: the FSDP2 wrap unit (``make_accelerator(wrap_cls=[...])``)
ZOO_DECODER_LAYER = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
                     "gemma3": "Gemma3DecoderLayer", "phi3": "Phi3DecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
                     "exaone4": "Exaone4DecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer",
                     "mixtral": "MixtralDecoderLayer", "olmoe": "OlmoeDecoderLayer",
                     "deepseek_v3": "DeepseekV3DecoderLayer", "gpt_oss": "GptOssDecoderLayer"}


def zoo_model(family: str, seed: int = 0, attn_implementation: str = "eager"):
    """A tiny fp32 ``*ForCausalLM`` of ``family``: 2 layers, hidden 64, 4 heads (4 KV heads, so TP 4 divides
    them), head_dim 16 — every GEMM dim a multiple of 16 on each rank, as TE's FP8 GEMMs need. Context
    parallelism needs ``attn_implementation="sdpa"``."""
    import transformers as tf

    common = dict(vocab_size=ZOO_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                  attn_implementation=attn_implementation)
    if family == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM  # q/k/v carry a bias
    elif family == "qwen3":
        config, cls = tf.Qwen3Config(head_dim=16, **common), tf.Qwen3ForCausalLM  # per-head q_norm / k_norm
    elif family == "gemma3":
        config = tf.Gemma3TextConfig(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, **common)
        cls = tf.Gemma3ForCausalLM
    elif family == "phi3":
        config, cls = tf.Phi3Config(pad_token_id=0, **common), tf.Phi3ForCausalLM  # fused qkv / gate_up
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   decoder_sparse_step=1, norm_topk_prob=True, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "exaone4":  # post-norm layers, per-head q_norm / k_norm (replicated_with_grad_allreduce), sliding
        config = tf.Exaone4Config(head_dim=16, sliding_window=8, **common)  # window on 3 layers of 4 (here: layer 0)
        cls = tf.Exaone4ForCausalLM
    elif family == "qwen2_moe":  # packed experts plus a shared expert (an MLP) gated by a Linear(hidden, 1)
        config = tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=False,
                                   **common)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":  # packed experts, a router of its own weight
        config = tf.MixtralConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif family == "olmoe":  # q_norm / k_norm over all heads, experts of intermediate_size
        config, cls = tf.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **common), tf.OlmoeForCausalLM
    elif family == "deepseek_v3":  # multi-head latent attention (5 Linears), a shared expert, grouped routing
        config = tf.DeepseekV3Config(num_mtp_layers=0, **{
            **common, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 0})
        cls = tf.DeepseekV3ForCausalLM
    elif family == "gpt_oss":  # experts [E, in, out] with biases, gate / up interleaved, clamped SwiGLU; attention
        # sinks, sliding window on every other layer (GPT-OSS's TP plan covers the embedding only: FSDP2 here)
        config = tf.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                 rope_parameters={"rope_type": "default", "rope_theta": 150000.0},  # no YaRN at 64
                                 **{**common, "intermediate_size": 32})
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; known: {ZOO_FAMILIES + ZOO_MOE_ONLY}")
    torch.manual_seed(seed)
    return cls(config)


def zoo_recipe(name=None):
    """The recipe the ranks ask for: HYBRID delayed scaling without the amax reduction (one process), or
    the TE recipe ``name`` as this package builds it from the accelerate config."""
    import transformer_engine.common.recipe as te_recipe

    if name is not None:
        from ..fixes.start.recipe_kwargs import te_recipe_kwargs
        from ..fixes.start.recipes import build

        return build(te_recipe_kwargs(name))[0]
    return te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max",
                                    reduce_amax=False)


def proportioned_qwen3_moe(experts: int = 32):
    """A Qwen3-MoE with a real model's proportions (Qwen3-30B-A3B: 128 experts, top-8, expert MLP 768 of hidden
    2048; here 32 experts, top-8, expert MLP 32 of hidden 64, a 256-token vocabulary); ``experts``: another count
    (top-k at most 8). Its wrap unit: ``ZOO_DECODER_LAYER["qwen3_moe"]``."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=ZOO_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, head_dim=16, num_experts=experts,
                               num_experts_per_tok=min(8, max(2, experts // 4)), moe_intermediate_size=32,
                               decoder_sparse_step=1, max_position_embeddings=64, tie_word_embeddings=False,
                               attn_implementation="eager")
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(config)


# -- a run under accelerate's torch.compile setting ----------------------------------------------------------------
COMPILE_VOCAB = 128
COMPILE_TOKENS = (2, 8)  # 16 tokens per rank: a multiple of 8, as TE's FP8 GEMMs need


def fsdp2_fp8_compile_run(rank, world_size, backend: str = "INDUCTOR", steps: int = 3, lr: float = 1e-3) -> dict:
    """A rank of FSDP2 + FP8 through the patched prepare with accelerate's dynamo setting ``backend`` ("NO": the
    uncompiled comparison), set as ``accelerate launch`` sets it (``ACCELERATE_DYNAMO_BACKEND``), on
    :func:`tiny_qwen2` (AdamW, 2 x 8 tokens a rank). Facts: the error, if any (with its type and traceback), the
    losses, per-step wall time, FP8 GEMM counts (the CPU rehearsal's), dynamo's counters, and the collectives the
    collective-order audit saw during the steps (None: no audit in this launch). Run by
    tests/distributed/test_compile_fp8.py and benchmarks/compile_fp8.py."""
    import time
    import traceback

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ..diagnostics import collective_order
    from ..rehearsal import te_on_cpu

    ensure_rehearsal(True)
    counters.clear()  # dynamo's counters are per process: count this run's compilation only
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = backend  # what dynamo_config: {dynamo_backend: ...} launches with
    acc = make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Qwen2DecoderLayer"],
                           mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                       reduce_dtype=torch.float32))
    facts = {"dynamo_backend": str(acc.state.dynamo_plugin.backend), "error": None, "losses": [], "step_s": []}
    model = tiny_qwen2(vocab=COMPILE_VOCAB, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, COMPILE_VOCAB, (world_size,) + COMPILE_TOKENS, generator=g)[rank] for _ in range(steps)]
    try:
        model, opt = acc.prepare(model, opt)
        facts["compiled"] = type(model).__name__
        facts["fp8_enabled"] = acc.accel_fp8_fix.fp8_enabled
        te_on_cpu.reset_stats()
        recorder = collective_order._installed.get("recorder")  # the audit's recorder of this rank
        audited_before = len(recorder.records) if recorder is not None else None
        for ids in batches:
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            facts["step_s"].append(time.perf_counter() - t0)
            value = loss.detach().clone()
            dist.all_reduce(value)
            facts["losses"].append(float(value) / world_size)
        facts["audited_collectives"] = len(recorder.records) - audited_before if recorder is not None else None
    except Exception as exc:  # noqa: BLE001
        facts["error"] = f"{type(exc).__name__}: {exc}"
        facts["error_type"] = type(exc).__name__
        facts["traceback"] = traceback.format_exc().splitlines()[-60:]
    stats = te_on_cpu.stats()
    facts["dynamo"] = {"graphs": counters["stats"].get("unique_graphs", 0),
                       "frames_ok": counters["frames"].get("ok", 0), "frames_total": counters["frames"].get("total", 0),
                       "graph_breaks": sum(counters["graph_break"].values()),
                       "break_reasons": sorted(counters["graph_break"])[:8]}
    facts.update(fp8_gemms_fwd=stats["fp8_gemms_fwd"], fp8_gemms_bwd=stats["fp8_gemms_bwd"],
                 non_fp8_gemms=stats["non_fp8_gemms"])
    try:
        from torch import _dynamo  # (``import torch._dynamo`` would make ``torch`` local to this function)

        _dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    return facts
