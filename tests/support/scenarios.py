"""Scenarios that run inside the ranks of :func:`accel_fp8_fix.testing.run_distributed` (CPU, gloo).

Every scenario is a module-level function ``scenario(rank, world_size, **kwargs) -> dict`` that builds a real
``Accelerator`` (through :func:`make_accelerator`, which asserts the distributed type and mesh it expects,
so nothing falls back silently), runs accelerate's own code and returns *measurable facts*: distributed
type, mesh, parameter types / placements, the error ``prepare()`` raised (or ``None``), kernel-shim counters,
losses. Tests assert on the facts; the same scenario re-run with the fixes on flips those assertions.

Several scenarios run in one launch (a launch costs seconds): :func:`suite` runs a plan of
``(scenario name, kwargs)`` in order, resetting accelerate's singletons between them, and
:func:`launch` memoises whole launches per pytest process, so two test modules asking for the same plan
pay once. The process group survives between scenarios of a launch (the first rehearsal ``Accelerator``
creates it; ``PartialState`` reuses an initialised one).

Environments (``env=`` of ``run_distributed``): :data:`ENV_STOCK` (no fixes, no TE on CPU, no
rehearsal), :data:`ENV_REHEARSAL` (no fixes, TE's Python on CPU + rehearsal via the ``.pth`` bootstrap),
:data:`ENV_FIXED` (fixes on + TE's Python on CPU + rehearsal). Scenarios also call :func:`ensure_rehearsal` so
they state which gate setting they expect.

``python tests/support/scenarios.py --out FILE`` (run by ``accelerate launch``) is the launched-script mode:
each rank writes what it saw to ``FILE.rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from accel_fp8_fix.testing.training import DIM, block_stack, dense_batch, tiny_llama, token_batch, train_and_compare
# the environments, as the suite names them (scenarios.ENV_FIXED ...): accel_fp8_fix.testing.training's
from accel_fp8_fix.testing.training import ENV_FIXED, ENV_REHEARSAL, ENV_STOCK, ensure_te_on_cpu  # noqa: F401
from accel_fp8_fix.testing.training import ensure_rehearsal
from accel_fp8_fix.testing.training import make_accelerator, reset_accelerate, reset_te_global_state, train, train_reference
from accel_fp8_fix.testing.training import experts_tp_plan, load_sharded_by_transformers  # noqa: F401
from accel_fp8_fix.testing.training import shard_tp as shard_llama_tp  # noqa: F401  (the suite's name)

# cuBLASLt's per-tensor FP8 GEMMs on Hopper need every leading dimension a multiple of 16 (TE's
# cublaslt_gemm.cu:159-163; a wgrad's is the rank's token count): TE's own Python checks only a multiple of 8.
FP8_ROWS_PER_RANK = 16


def runtime_error_of(call) -> str | None:
    """The message of the RuntimeError ``call()`` raises, or None when it returns (a silent answer)."""
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return None


def fp8_rows(rows: int, world_size: int) -> int:
    """A global batch of at least ``rows`` that gives each of ``world_size`` ranks 16 rows (an H200 refuses 8)."""
    return max(rows, FP8_ROWS_PER_RANK * world_size)


# -- process-level helpers --------------------------------------------------------------------------------
def torch_below(minor: int) -> bool:
    """The installed torch is older than 2.<minor>."""
    import torch
    from packaging.version import Version

    return Version(torch.__version__).release[:2] < (2, minor)


def full_tensor(tensor):
    """The whole tensor of a DTensor (a plain tensor as it is). torch < 2.12 cannot redistribute a TP-packed
    DTensor (``_StridedShard`` on a 1-D TP mesh: "use_strided_shard_as_shard_order ... unable to be interpreted"):
    there every rank's local tensor is gathered and placed by the boxes the package describes it with to DCP
    (fixes/checkpoint/packed_checkpoint.py ``local_boxes``) — so the comparison checks those boxes too."""
    if type(tensor).__name__ != "DTensor":
        return tensor
    try:
        return tensor.full_tensor()
    except ValueError as exc:
        if "shard_order" not in str(exc):
            raise
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.fixes.checkpoint.packed_checkpoint import local_boxes

    boxes = local_boxes(tensor)
    if boxes is None:
        raise ValueError(f"no boxes for a DTensor torch cannot gather: {tensor.placements}")
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tensor.to_local().detach().cpu(), boxes))
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    for local, rank_boxes in pieces:
        for offsets, local_offsets, sizes in rank_boxes:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = \
                local[tuple(slice(o, o + n) for o, n in zip(local_offsets, sizes))]
    return out.to(tensor.to_local().device)


def te_stats() -> dict:
    from accel_fp8_fix.rehearsal import te_on_cpu

    return te_on_cpu.stats()


def te_reset() -> None:
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.reset_stats()


def count_forward_gemms(modules: dict):
    """{name: FP8 GEMMs run inside that module's forward}, kept up to date by forward hooks."""
    from collections import Counter

    counts: Counter = Counter()
    for name, module in modules.items():
        def pre(mod, args, name=name):
            mod._gemms_before = te_stats()["fp8_gemms_fwd"]

        def post(mod, args, out, name=name):
            counts[name] += te_stats()["fp8_gemms_fwd"] - mod._gemms_before

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return counts


def fixes_active() -> bool:
    import accel_fp8_fix

    return accel_fp8_fix.active_patch_set() is not None


def err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- models -----------------------------------------------------------------------------------------------
def _torch():
    import torch

    return torch


# -- facts ------------------------------------------------------------------------------------------------
def state_facts(acc) -> dict:
    mesh = acc.torch_device_mesh
    return {
        "distributed_type": acc.distributed_type.name,
        "is_fsdp2": bool(acc.is_fsdp2),
        "device": str(acc.device),
        "backend": acc.state.backend,
        "num_processes": acc.num_processes,
        "mixed_precision": acc.mixed_precision,
        "mesh": mesh_facts(mesh),
    }


def mesh_facts(mesh) -> dict | None:
    if mesh is None:
        return None
    return {"device_type": mesh.device_type, "dim_names": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape)}


def param_facts(model) -> dict:
    from torch.distributed.tensor import DTensor

    kinds, placements, meshes, te_modules, fsdp_modules = {}, {}, set(), 0, 0
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            kinds[name] = "DTensor"
            placements[name] = [str(pl) for pl in p.placements]
            m = p.device_mesh
            meshes.add((m.device_type, tuple(m.mesh_dim_names or ()), tuple(m.shape)))
        else:
            kinds[name] = type(p).__name__
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if type(module).__module__.startswith("transformer_engine"):
            te_modules += 1
        if isinstance(module, FSDPModule):
            fsdp_modules += 1
    return {
        "param_kinds": kinds,
        "all_dtensor": bool(kinds) and all(k == "DTensor" for k in kinds.values()),
        "any_dtensor": any(k == "DTensor" for k in kinds.values()),
        "placements": placements,
        "param_meshes": sorted([list(m[:1]) + [list(m[1]), list(m[2])] for m in meshes]),
        "te_modules": te_modules,
        "fsdp_modules": fsdp_modules,
        "model_type": type(model).__name__,
    }


CLIP = 0.5  # max grad norm in the training comparisons: small enough that clipping acts at every step


def _reference_losses(build, batch_fn, steps: int, lr: float):
    """(losses, grad norms before clipping) of the same model / data / optimizer trained undistributed in
    this process, clipped to ``CLIP`` (the oracle)."""
    return train_reference(build, batch_fn, steps=steps, lr=lr, max_norm=CLIP)


def _train_and_compare(acc, model, opt, batch_fn, steps: int, build, lr: float, reference: bool) -> dict:
    """{losses, grad_norms, reference_losses, reference_grad_norms}: ``steps`` clipped training steps through
    ``acc`` (the norm as a training script logs it), then the undistributed oracle of ``build`` (None without
    ``reference``); the tests judge them."""
    facts = train_and_compare(model, batch_fn, (lambda: _reference_losses(build, batch_fn, steps, lr)) if reference
                              else None, steps=steps, max_norm=CLIP, accelerator=acc, optimizer=opt)
    del facts["mismatches"]
    return facts


def _mse(model):
    torch = _torch()
    x, y = dense_batch(batch=FP8_ROWS_PER_RANK)  # FP8 on: cuBLASLt's leading-dimension rule wants 16 rows
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _lm(model):
    out = model(**token_batch())
    return out.loss


# -- scenarios: rehearsal gates ---------------------------------------------------------------------------
def sc_fsdp2_train(rank, world_size, mixed_precision="no", dp_shard=None, cpu=False, steps=2, lr=0.1):
    """FSDP2 (optionally on a ParallelismConfig(dp_shard) mesh): prepare, train ``steps`` SGD steps, compare
    with the undistributed oracle (every rank sees the same batch, so FSDP2's averaged gradients equal it)."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=True, dp_shard=dp_shard, mixed_precision=mixed_precision, cpu=cpu, wrap_cls=["Block"])
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    facts = {**state_facts(acc), **param_facts(model)}
    facts.update(_train_and_compare(acc, model, opt, _mse, steps, block_stack, lr, mixed_precision == "no"))
    facts["optimizer_params_dtensor"] = all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
    return facts


def sc_tp_train(rank, world_size, mixed_precision="no", steps=2, lr=0.1):
    """ParallelismConfig(tp_size=world) without FSDP: tiny Llama sharded by transformers' TP on the
    accelerator's "tp" mesh, prepare, train; compare with the undistributed oracle."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=False, tp=world_size, mixed_precision=mixed_precision, expect="MULTI_GPU")
    model = shard_llama_tp(tiny_llama(), acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    facts = {**state_facts(acc)}
    model, opt = acc.prepare(model, opt)
    facts.update(param_facts(model))
    facts.update(_train_and_compare(acc, model, opt, _lm, steps, tiny_llama, lr, mixed_precision == "no"))
    return facts


def sc_tp_without_tp_size(rank, world_size):
    """ParallelismConfig(tp_size=world) with a model transformers did not shard: accelerate's own refusal."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=False, tp=world_size, mixed_precision="no", expect="MULTI_GPU")
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        acc.prepare(model, opt)
        return {"prepare_error": None}
    except Exception as exc:  # noqa: BLE001
        return {"prepare_error": err(exc)}


def sc_stock_gates(rank, world_size):
    """Rehearsal OFF in this process: what stock accelerate does with the same requests on CPU ranks."""
    torch = _torch()
    ensure_rehearsal(False)
    facts = {}
    try:
        # 1. torchrun-style rank (LOCAL_RANK set), no cpu=True, FSDP2 plugin: silently undistributed.
        acc = make_accelerator(fsdp=True, mixed_precision="no", expect=None)
        model, opt = block_stack(), None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        facts["fsdp2_plugin"] = {**state_facts(acc), **param_facts(model)}
        # 2. cpu=True, FSDP2 plugin: MULTI_CPU, FSDP plugin ignored, DDP.
        acc = make_accelerator(fsdp=True, mixed_precision="no", cpu=True, expect=None)
        model = block_stack()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        facts["fsdp2_plugin_cpu"] = {**state_facts(acc), **param_facts(model)}
        # 3. ParallelismConfig(dp_shard=world) + FSDP2: refused (without cpu=True: size check; with: type check).
        for key, cpu in (("parallelism_config", False), ("parallelism_config_cpu", True)):
            try:
                make_accelerator(fsdp=True, dp_shard=world_size, mixed_precision="no", cpu=cpu, expect=None)
                facts[key] = {"error": None}
            except Exception as exc:  # noqa: BLE001
                facts[key] = {"error": err(exc)}
        # 4. TP only, cpu=True.
        try:
            make_accelerator(fsdp=False, tp=world_size, mixed_precision="no", cpu=True, expect=None)
            facts["tp_cpu"] = {"error": None}
        except Exception as exc:  # noqa: BLE001
            facts["tp_cpu"] = {"error": err(exc)}
    finally:
        ensure_rehearsal(True)
    return facts


def sc_fsdp2_cpu_true(rank, world_size):
    """Rehearsal on, ``Accelerator(cpu=True, fsdp_plugin=...)``: still FSDP2 (not MULTI_CPU + DDP)."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=True, dp_shard=world_size, mixed_precision="no", cpu=True)
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return {**state_facts(acc), **param_facts(model)}


def sc_partial_state_first(rank, world_size):
    """``PartialState()`` first (as TrainingArguments / many scripts do), intent only in the launcher's
    environment (ACCELERATE_USE_FSDP=true, FSDP_VERSION=2), then ``Accelerator()`` with no arguments."""
    torch = _torch()
    ensure_rehearsal(True)
    reset_accelerate()
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="Block")
    from accelerate import Accelerator, PartialState

    ps = PartialState()
    facts = {"partial_state": {"distributed_type": ps.distributed_type.name, "backend": ps.backend, "device": str(ps.device)}}
    acc = Accelerator()
    facts.update(state_facts(acc))
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    facts.update(param_facts(model))
    return facts


def sc_mesh_2d(rank, world_size, dp_shard=2, tp=2, mixed_precision="no", steps=1, lr=0.1):
    """FSDP2 x TP: ParallelismConfig(dp_shard, tp) builds the 2-D mesh on cpu; tiny Llama TP-sharded on
    mesh["tp"]; prepare (A10 on stock with transformers 5.x); a training step when prepare succeeds."""
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp, mixed_precision=mixed_precision, wrap_cls=["LlamaDecoderLayer"])
    mesh = acc.torch_device_mesh
    facts = state_facts(acc)
    facts["flattened"] = sorted(n for n in ("dp", "dp_shard_cp", "dp_cp") if _has_mesh_dim(mesh, n))
    facts["coordinate"] = list(mesh.get_coordinate())
    model = shard_llama_tp(tiny_llama(), mesh["tp"])
    return _prepare_and_train_llama(acc, model, facts, steps, lr, reference=mixed_precision == "no")


def _prepare_and_train_llama(acc, model, facts, steps, lr, reference=True):
    """prepare (its error in ``facts["prepare_error"]``), then train ``steps`` steps next to the one-process
    reference of ``tiny_llama``."""
    torch = _torch()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    try:
        model, opt = acc.prepare(model, opt)
        facts["prepare_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["prepare_error"] = err(exc)
        return facts
    facts.update(param_facts(model))
    facts.update(_train_and_compare(acc, model, opt, _lm, steps, tiny_llama, lr, reference))
    return facts


# transformers' own meshes after DistributedConfig(tp_size=2, fsdp_size=2): parameters its TP plan shards on
# ('fsdp', 'tp'), the others (norms) FSDP-sharded only, on 'fsdp'
ND_LOADED_MESHES = [["cpu", ["fsdp"], [2]], ["cpu", ["fsdp", "tp"], [2, 2]]]


def sc_a18_nd_loaded(rank, world_size, dp_shard=2, tp=2, mixed_precision="no", steps=2, lr=0.1):
    """A18: the model loaded the supported way of transformers 5.x (TP ``tp`` x FSDP2 ``dp_shard`` applied at
    load), then accelerate's prepare with the same sizes (auto-wrap by layer class, as accelerate's N-D example)."""
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp, mixed_precision=mixed_precision, wrap_cls=["LlamaDecoderLayer"])
    model = load_sharded_by_transformers(tiny_llama(), tp_size=tp, fsdp_size=dp_shard)
    return _prepare_and_train_llama(acc, model, {"loaded": param_facts(model)}, steps, lr)


def _has_mesh_dim(mesh, name):
    try:
        mesh[name]
        return True
    except Exception:  # noqa: BLE001
        return False


# -- scenarios: stock failures (the "before" of each fix) -------------------------------------------------
def sc_a1_tp_te(rank, world_size):
    """A1: ParallelismConfig(tp_size=world) + tiny Llama sharded by transformers' TP + mixed_precision="fp8".
    Stock: ``prepare()`` raises "got mixed torch.Tensor and DTensor" (convert_model copies a DTensor weight
    into a plain te.Linear). Facts when it succeeds: FP8 GEMMs in a forward, loss finite."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=False, tp=world_size, mixed_precision="fp8", expect="MULTI_GPU")
    model = shard_llama_tp(tiny_llama(), acc.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = state_facts(acc)
    try:
        model, opt = acc.prepare(model, opt)
        facts["prepare_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["prepare_error"] = err(exc)
        # the source lines of the frames, innermost last (torch releases add frames of their own below)
        facts["traceback_tail"] = [f.line for f in traceback.extract_tb(exc.__traceback__) if f.line][-12:]
        return facts
    facts.update(param_facts(model))
    te_reset()
    loss = _lm(model)
    facts["fwd_stats"] = _pick(te_stats())
    facts["loss"] = float(loss.detach())
    with _torch().no_grad():
        facts["reference_loss"] = float(_lm(tiny_llama()))  # the unsharded model in fp32
    return facts


def sc_a2_fsdp2_te(rank, world_size, dp_shard=None):
    """A2: FSDP2 + mixed_precision="fp8". Stock: prepare succeeds, te modules exist, but the forward runs zero
    FP8 GEMMs (apply_fp8_autowrap is never called on the FSDP2 path)."""
    torch = _torch()
    ensure_rehearsal(True)
    acc = make_accelerator(fsdp=True, dp_shard=dp_shard, mixed_precision="fp8", wrap_cls=["Block"])
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = state_facts(acc)
    try:
        model, opt = acc.prepare(model, opt)
        facts["prepare_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["prepare_error"] = err(exc)
        return facts
    facts.update(param_facts(model))
    te_reset()
    loss = _mse(model)
    facts["fwd_stats"] = _pick(te_stats())
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    facts["step_stats"] = _pick(te_stats())
    facts["loss"] = float(loss.detach())
    return facts


def _pick(stats: dict) -> dict:
    keys = ("fp8_gemms", "fp8_gemms_fwd", "fp8_gemms_bwd", "non_fp8_gemms", "non_fp8_gemms_fwd", "non_fp8_gemms_bwd",
            "amax_reductions", "amax_reduction_groups")
    return {k: stats.get(k) for k in keys}


def sc_a4_convert_model(rank, world_size):
    """A4 (local, no collective): ``accelerate.utils.transformer_engine.convert_model`` on a module whose
    second Linear has out_features 40 (not divisible by 16). Stock: siblings after it stay torch modules."""
    torch = _torch()
    nn = torch.nn
    # convert_model reads AcceleratorState (GatheredParameters), so an Accelerator must exist: an undistributed
    # one (no FSDP / mesh requested, so the rehearsal leaves it alone).
    make_accelerator(fsdp=False, mixed_precision="fp8", expect="NO")
    from accelerate.utils.transformer_engine import convert_model

    torch.manual_seed(0)
    model = nn.Module()
    model.first = nn.Linear(DIM, DIM)
    model.odd = nn.Linear(DIM, 40)
    model.after = nn.Linear(DIM, DIM)
    model.norm_after = nn.LayerNorm(DIM)
    model.nested = nn.Sequential(nn.Linear(DIM, DIM))
    with torch.no_grad():
        convert_model(model)
    return {name: type(child).__module__.split(".")[0] + "." + type(child).__name__ for name, child in model.named_children()} | {
        "nested.0": type(model.nested[0]).__module__.split(".")[0] + "." + type(model.nested[0]).__name__
    }


def sc_a5_ram_efficient(rank, world_size, kind="buffer"):
    """A5: FSDP2 with ``cpu_ram_efficient_loading=True``. ``kind="buffer"``: a model with a persistent plain
    buffer (mixed "no"); ``kind="te"``: te modules (``_extra_state`` in the state dict, mixed "fp8").
    Stock: ``fsdp2_load_full_state_dict`` reads ``.device_mesh`` of a plain tensor -> AttributeError."""
    torch = _torch()
    ensure_rehearsal(True)
    mp = "fp8" if kind == "te" else "no"
    acc = make_accelerator(fsdp=True, dp_shard=world_size, mixed_precision=mp, cpu_ram_efficient_loading=True, wrap_cls=["Block"])
    model = block_stack(buffer=(kind == "buffer"))
    reference = {k: v.detach().clone() for k, v in block_stack(buffer=(kind == "buffer")).state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = state_facts(acc)
    try:
        model, opt = acc.prepare(model, opt)
        facts["prepare_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["prepare_error"] = err(exc)
        from torch.distributed.tensor import DTensor

        # What fsdp2_load_full_state_dict met: the state-dict entries that are not DTensors after fully_shard.
        facts["plain_state_dict_entries"] = sorted(k for k, v in model.state_dict().items() if not isinstance(v, DTensor))
        return facts
    facts.update(param_facts(model))
    # The loaded weights must be the original ones (rank 0's), whole after gathering.
    mismatched = []
    for name, value in model.state_dict().items():
        if name.endswith("_extra_state") or name not in reference:
            continue
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if full.shape != reference[name].shape or not torch.allclose(full.float(), reference[name].float()):
            mismatched.append(name)
    facts["mismatched_after_load"] = mismatched
    facts["loss"] = float(_mse(model).detach())
    return facts


def sc_a6_tp_full_sd(rank, world_size, dp_shard=2, tp=2):
    """A6: ``fsdp2_load_full_state_dict`` with TP-sharded params, exactly as ``fsdp2_prepare_model`` calls it
    for cpu_ram_efficient_loading (state_dict of the TP'd model -> meta -> fully_shard on the dp_shard mesh
    -> load). Called directly because ``prepare()`` stops earlier on A10. Stock: rank 0 broadcasts its local
    TP shard while the others expect the global shape."""
    torch = _torch()
    ensure_rehearsal(True)
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from torch.distributed.fsdp import fully_shard

    acc = make_accelerator(fsdp=True, dp_shard=dp_shard, tp=tp, mixed_precision="no", cpu_ram_efficient_loading=True)
    mesh = acc.torch_device_mesh
    model = shard_llama_tp(tiny_llama(), mesh["tp"])
    reference = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    original_sd = model.state_dict()
    model = model.to(torch.device("meta"))
    fsdp_mesh = mesh[tuple(acc.parallelism_config.fsdp_dim_names)]
    facts = {**state_facts(acc), "fsdp_mesh": mesh_facts(fsdp_mesh)}
    try:
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        facts["shard_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["shard_error"] = err(exc)
        return facts
    try:
        fsdp2_load_full_state_dict(acc, model, original_sd)
        facts["load_error"] = None
    except Exception as exc:  # noqa: BLE001
        facts["load_error"] = err(exc)
        return facts
    # Compare this rank's local shards with the expected ones, without any collective (rank 0 may be gone).
    from torch.distributed.tensor import DTensor, distribute_tensor

    mismatched = []
    for name, value in model.state_dict().items():
        if not isinstance(value, DTensor):
            continue
        expected = distribute_tensor(reference[name], value.device_mesh, value.placements, src_data_rank=None)
        local, want = value.to_local(), expected.to_local()
        if local.shape != want.shape or not torch.allclose(local, want):
            mismatched.append(name)
    facts["mismatched_local_shards"] = mismatched
    return facts


# -- suites and launches ----------------------------------------------------------------------------------
def suite(rank, world_size, module, plan):
    """What every launch runs in its ranks: ``plan`` of the scenario module named ``module`` (imported by name)."""
    import importlib

    return run_plan(importlib.import_module(module), rank, world_size, plan)


def result_keys(plan) -> list[str]:
    """The key of each entry's facts: its scenario's name, ``name#i`` for the i-th entry when the name repeats."""
    keys, seen = [], set()
    for i, (name, _kwargs) in enumerate(plan):
        keys.append(name if name not in seen else f"{name}#{i}")
        seen.add(name)
    return keys


def run_plan(module, rank, world_size, plan):
    """Run ``plan`` = [(scenario name in ``module``, kwargs), ...] in order; {name or name#i: facts}.

    A scenario that raises records ``{"scenario_error": ..., "traceback": [...]}`` instead of aborting the
    launch (the tests then fail on that scenario with its traceback).
    """
    out = {}
    environ = dict(os.environ)
    for key, (name, kwargs) in zip(result_keys(plan), plan):
        # accelerate writes ACCELERATE_USE_FSDP / FSDP_* into os.environ: start every scenario from the launch's.
        os.environ.clear()
        os.environ.update(environ)
        # TE's global amax buffers keep every TE module that ran under its autocast, models long gone included: a
        # scenario's facts (the amax all-reduce's size) would depend on the scenarios before it in the plan, where
        # the pooled-equals-fresh check runs it as a run of its own (its ranks put back, TE's state too)
        if "transformer_engine.pytorch" in sys.modules:
            reset_te_global_state()
        try:
            out[key] = getattr(module, name)(rank, world_size, **(kwargs or {}))
        except Exception as exc:  # noqa: BLE001
            out[key] = {"scenario_error": err(exc), "traceback": traceback.format_exc().splitlines()[-25:]}
    reset_accelerate()
    out["_meta"] = meta_facts()
    return out


def run_entries(rank, world_size, entries):
    """Run ``entries`` = [(module name, scenario name, kwargs), ...] in order, each as a run of its own on pooled
    ranks would (tests/support/agreement.py: the fresh-interpreter side): between two entries the ranks leave the
    default group and put themselves back as a pool's ranks do between runs (accel_fp8_fix.testing.isolation), so
    an entry sees neither the facts nor the leftovers of the one before. [facts, ...]; what an entry left behind is
    added to its facts (``left_behind``)."""
    import importlib

    from accel_fp8_fix.testing import free_port, isolation

    from support import launcher

    for preloaded in launcher.preload_for(dict(os.environ)):  # a pool's baseline: its ranks import these first
        importlib.import_module(preloaded)  # (with accelerate imported, the patch set is active in the baseline)
    baseline, out = isolation.Baseline.capture(), []
    for i, (module, name, kwargs) in enumerate(entries):
        out.append(run_plan(importlib.import_module(module), rank, world_size, [(name, kwargs)])[name])
        if i + 1 == len(entries):
            break
        port = _leave_default_group(rank, free_port)
        left = baseline.restore(module)
        if left:
            out[-1] = {**out[-1], "left_behind": left}
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)  # the next entry's accelerate makes its group there
    return out


def _leave_default_group(rank, free_port):
    """Destroy the default group (every rank together); the port rank 0 chose for the next one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    return port[0]


def meta_facts() -> dict:
    """Which layers were on in this rank: the fix set, the rehearsal wrappers, TE's Python on CPU."""
    from accel_fp8_fix.rehearsal import gates, te_on_cpu

    return {"fixes_active": fixes_active(), "rehearsal_applied": gates.is_applied(), "te_on_cpu": te_on_cpu.is_installed()}


# The launches both test modules share (memoised by launch()): rehearsal gates + stock failures on 2 ranks,
# 2-D mesh / A10 / A6 on 4 ranks. A6 stays last: after it rank 0 may have left its collectives.
PLAN_2RANK = [
    ("sc_fsdp2_train", {}),
    ("sc_fsdp2_train", {"dp_shard": 2}),
    ("sc_fsdp2_cpu_true", {}),
    ("sc_tp_train", {}),
    ("sc_tp_without_tp_size", {}),
    ("sc_partial_state_first", {}),
    ("sc_a4_convert_model", {}),
    ("sc_a2_fsdp2_te", {}),
    ("sc_a1_tp_te", {}),
    ("sc_a5_ram_efficient", {"kind": "buffer"}),
    ("sc_a5_ram_efficient", {"kind": "te"}),
    ("sc_stock_gates", {}),
]
# sc_a6_tp_full_sd runs stock accelerate's A6 path, whose ranks scatter / broadcast different sizes (the
# collective-order audit names it: tests/distributed/test_load_full_state_dict.py): launched with the audit off.
PLAN_4RANK = [
    ("sc_fsdp2_train", {"dp_shard": 4}),
    ("sc_mesh_2d", {}),
    ("sc_a18_nd_loaded", {}),
    ("sc_a18_nd_loaded", {"dp_shard": 4, "tp": 1}),
    ("sc_a6_tp_full_sd", {}),
]


def key_of(plan, name, kwargs=None) -> str:
    """The result key of the first ``(name, kwargs)`` entry of ``plan`` (any kwargs when ``kwargs`` is None)."""
    for key, (n, kw) in zip(result_keys(plan), plan):
        if n == name and (kwargs is None or (kw or {}) == kwargs):
            return key
    raise KeyError((name, kwargs))


_LAUNCHES: dict = {}


def launch(module, plan, world_size: int, *, env: dict | None = None, timeout: float | None = None,
           collective_timeout: float | None = None, audit_collectives: bool = True):
    """The suite's one launcher: ``plan`` = [(scenario name, kwargs), ...] of the scenario module ``module`` (the
    module or its name) on ``world_size`` pooled ranks (tests/support/launcher.py), memoised for the life of the
    (pytest) process so test files asking for the same launch pay once; the per-rank dicts of :func:`run_plan`.

    What is not given comes from the module's ``LAUNCH`` dict (``env`` — also when ``env`` is empty —,
    ``timeout``, ``collective_timeout``), else 150 s / 45 s and the inherited environment.
    ``audit_collectives=False`` only for plans that run stock accelerate's failures on purpose (their
    collectives diverge: that is the bug)."""
    import importlib

    from support import launcher

    name = module if isinstance(module, str) else module.__name__
    defaults = getattr(importlib.import_module(name), "LAUNCH", {})
    env = env or defaults.get("env")
    timeout = timeout or defaults.get("timeout", 150.0)
    collective_timeout = collective_timeout or defaults.get("collective_timeout", 45.0)
    key = (name, json.dumps(plan, sort_keys=True), world_size, json.dumps(env or {}, sort_keys=True),
           audit_collectives)
    if key not in _LAUNCHES:
        from support import agreement

        results = launcher.run(suite, world_size, args=(name, plan), env=env, init_process_group=False,
                               timeout=timeout, collective_timeout=collective_timeout,
                               audit_collectives=audit_collectives)
        if any("scenario_error" in (facts or {}) for res in results for facts in res.values()
               if isinstance(facts, dict)):
            launcher.retire(world_size, env)  # a scenario raised: its ranks may hold its state, start the next afresh
        elif launcher.pooled():
            agreement.record(name, plan, world_size, env, audit_collectives, timeout, collective_timeout, results)
        _LAUNCHES[key] = results
    return _LAUNCHES[key]


def facts_of(results, name):
    """The facts of scenario ``name`` on every rank; fails with the rank's traceback if it raised."""
    out, errors = [], []
    for rank, res in enumerate(results):
        f = res[name]
        if isinstance(f, dict) and "scenario_error" in f:
            errors.append(f"--- rank {rank}: {f['scenario_error']}\n" + "\n".join(f["traceback"]))
        out.append(f)
    if errors:
        raise AssertionError(f"scenario {name} raised on {len(errors)} of {len(results)} ranks:\n" + "\n".join(errors))
    return out


def plan_facts(results, plan, name, kwargs=None):
    """:func:`facts_of` the entry ``(name, kwargs)`` of ``plan`` (:func:`key_of`)."""
    return facts_of(results, key_of(plan, name, kwargs))


# -- launched-script mode (accelerate launch tests/support/scenarios.py --out FILE) ------------------------------
def _launched_main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(format="%(message)s", level=logging.WARNING)  # show the package's messages (rank 0)
    torch = _torch()
    from accelerate import Accelerator
    from accel_fp8_fix.rehearsal import gates as rehearsal

    acc = Accelerator()  # everything comes from the launcher's environment (FSDP plugin, mixed precision)
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = {
        "rehearsal_applied": rehearsal.is_applied(),
        "rehearsal_decision": rehearsal.last_decision(),
        "env": {k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_FSDP", "FSDP_VERSION",
                                               "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION")},
        "fsdp_version": getattr(acc.state.fsdp_plugin, "fsdp_version", None) if acc.is_fsdp2 or acc.distributed_type.name == "FSDP" else None,
    }
    facts.update(state_facts(acc))
    try:
        model, opt = acc.prepare(model, opt)
        facts["prepare_error"] = None
        facts.update(param_facts(model))
        te_reset()
        facts["losses"], facts["grad_norms"] = train(model, _mse, steps=args.steps, max_norm=CLIP, accelerator=acc,
                                                      optimizer=opt)
        facts["stats"] = _pick(te_stats())
    except Exception as exc:  # noqa: BLE001
        facts["prepare_error"] = err(exc)
    with open(f"{args.out}.rank{acc.process_index}.json", "w") as fh:
        json.dump(facts, fh, indent=1, default=str)
    acc.end_training() if hasattr(acc, "end_training") else None
    return 0


if __name__ == "__main__":
    sys.exit(_launched_main())
