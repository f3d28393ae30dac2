"""Scenarios for tests/distributed/test_diagnostics.py: audit of the demo model, error notes, public collectives.

Two launches: 4 ranks with the fixes on (the demo's FSDP2 x TP model audited, planted stray state and a
planted mixed module, user hooks handing a DTensor to c10d in forward and backward, the public
collectives on a 2x2 mesh) and 2 ranks on stock accelerate (A1's mixed-type error and the user's own
broadcast of a DTensor explained by ``explain_errors``, the public collectives on a 1-D mesh).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

from accel_fp8_fix.testing import training

from . import fp8_scenarios
from . import scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED_ERRORS = ("does not have a sharding strategy registered", "found no DeviceMesh from dtensor args")


def _demo():
    """examples/demo.py (a script, not on any path), imported from its file once per rank."""
    import importlib.util

    if "demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
        sys.modules["demo"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["demo"])
    return sys.modules["demo"]


def _error_facts(exc: BaseException) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    return {
        "type": type(exc).__name__,
        "str": str(exc),
        "notes": list(getattr(exc, "__notes__", [])),
        "innermost": (os.path.basename(tb[-1].filename), tb[-1].name, tb[-1].line) if tb else None,
        "frames": [(os.path.basename(f.filename), f.name) for f in tb],
    }


def _catch(fn) -> dict | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at the very exception
        return _error_facts(exc)
    return None


def _demo_accelerator():
    return scenarios.make_accelerator(fsdp=True, dp_shard=2, tp=2, mixed_precision="fp8", fp8_recipe=fp8_scenarios.RECIPE,
                              wrap_cls=["LlamaDecoderLayer"])


def _batch(mesh):
    import torch

    g = torch.Generator().manual_seed(100 + mesh["dp_shard"].get_local_rank())
    ids = torch.randint(0, 512, (2, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


class _Gain:
    """A user module planted after prepare: a DTensor parameter next to a plain buffer (mixed)."""

    @staticmethod
    def build(mesh_tp, dim):
        import torch
        from torch import nn
        from torch.distributed.tensor import Replicate, distribute_tensor

        class Gain(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(distribute_tensor(torch.ones(dim), mesh_tp, [Replicate()]))
                self.register_buffer("scale", torch.ones(dim))

            def forward(self, x):
                return x * (self.weight * self.scale)

        return Gain()


def sc_demo_audit(rank, world_size):
    """The demo model through the patched prepare with ACCEL_FP8_FIX_AUDIT=1; audit, one step, planted faults."""
    import torch
    from torch import nn

    import accel_fp8_fix

    scenarios.ensure_rehearsal(True)
    demo = _demo()
    acc = _demo_accelerator()
    mesh = acc.torch_device_mesh
    model = scenarios.shard_llama_tp(demo.build_model(), mesh["tp"])  # TP by the test, then accelerate's FSDP2
    linears = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected_share = sum(v for n, v in linears.items() if n != "lm_head") / sum(linears.values())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model, opt = acc.prepare(model, opt)
    report = accel_fp8_fix.audit(model)
    q = report.module("model.layers.0.self_attn.q_proj")
    facts = {
        "printed": printed.getvalue(),
        "summary": report.summary,
        "table": report.table(),
        "fp8_modules": sorted(m.name for m in report.fp8_modules),
        "native_tp": sorted(m.name for m in report.fp8_modules if m.parallel_mode),
        "kept": report.kept,
        "amax_group_ranks": list(report.amax_group_ranks or ()),
        "stray": report.stray,
        "mixed": report.mixed,
        "tp_mismatches": report.tp_mismatches,
        "q_proj": {"fsdp_unit": q.fsdp_unit, "parallel_mode": q.parallel_mode, "fp8_state": len(q.fp8_state),
                   "params": [(p.name, p.kind, p.mesh_dims, p.placements) for p in q.params]},
        "lm_head_unit": report.module("lm_head").fsdp_unit,
        "coverage": {"fp8_param_share": report.coverage.fp8_param_share,
                     "fp8_gemm_share": report.coverage.fp8_gemm_share,
                     "fp8_gemms_per_step": report.coverage.fp8_gemms_per_step,
                     "gemms_per_step": report.coverage.gemms_per_step,
                     "high_precision": report.coverage.high_precision},
        "expected_param_share": expected_share,
        "linears": len(linears),
    }
    # one training step: the FP8 GEMMs TE really ran = the audit's FP8 GEMMs per step
    scenarios.te_reset()
    loss = model(**_batch(mesh)).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    stats = scenarios.te_stats()
    facts["measured_fp8_gemms"] = stats["fp8_gemms_fwd"] + stats["fp8_gemms_bwd"]
    facts["measured_high_precision_te_gemms"] = stats["non_fp8_gemms_fwd"]

    # planted stray FP8 state on a TE module (neither parameter nor buffer)
    te_q = model.get_submodule("model.layers.0.self_attn.q_proj")
    te_q.fp8_meta["planted_amax"] = torch.zeros(4)
    facts["stray_planted"] = accel_fp8_fix.audit(model).stray
    del te_q.fp8_meta["planted_amax"]

    # a planted mixed module, called from a user forward hook: the mixed-type error escapes forward
    model.gain = _Gain.build(mesh["tp"], 128)
    facts["mixed_planted"] = accel_fp8_fix.audit(model).mixed
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: model.gain(out))
    facts["mixed_error"] = _catch(lambda: model(**_batch(mesh)))
    handle.remove()
    del model.gain
    return facts


def _user_broadcast(param):
    import torch.distributed as dist

    dist.broadcast(param, src=0)  # the user's own code: a DTensor handed to c10d


def sc_user_hook_errors(rank, world_size):
    """Fixes on: a user forward pre-hook, optimizer step pre-hook and backward hook hand a DTensor parameter to
    dist.broadcast."""
    import torch

    scenarios.ensure_rehearsal(True)
    demo = _demo()
    acc = _demo_accelerator()
    mesh = acc.torch_device_mesh
    model = scenarios.shard_llama_tp(demo.build_model(), mesh["tp"])  # TP by the test, then accelerate's FSDP2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    weight = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    facts = {"weight_is_dtensor": type(weight).__name__ == "DTensor"}
    # the same call outside any wrapper: the stock error, for comparison
    facts["direct"] = _catch(lambda: _user_broadcast(weight))
    handle = model.register_forward_pre_hook(lambda mod, args: _user_broadcast(weight))
    facts["forward"] = _catch(lambda: model(**_batch(mesh)))
    handle.remove()
    # a user's optimizer step pre-hook: the error escapes AcceleratedOptimizer.step
    loss = model(**_batch(mesh)).loss
    acc.backward(loss)
    hook = opt.optimizer.register_step_pre_hook(lambda o, args, kwargs: _user_broadcast(weight))
    facts["step"] = _catch(opt.step)
    hook.remove()
    opt.zero_grad()

    def backward_step():
        loss = model(**_batch(mesh)).loss
        loss.register_hook(lambda grad: _user_broadcast(weight))
        acc.backward(loss)

    facts["backward"] = _catch(backward_step)
    return facts


def _collective_cases(mesh, dims_2d: bool):
    """(label, DTensor) with rank-dependent local data (stale replicas), per placement."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = dist.get_rank()
    cases = []
    rows = [[Shard(0)], [Shard(1)], [Replicate()]]
    if dims_2d:
        rows = [[Shard(0), Replicate()], [Replicate(), Shard(1)], [Replicate(), Replicate()], [Shard(0), Shard(1)]]
    for placements in rows:
        local = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
        cases.append((str(placements), DTensor.from_local(local, mesh, placements, run_check=False)))
    return cases


def _reference(mesh, placements, local_of, op):
    """What every rank must hold: the group along the replicated dims, computed from every rank's local data."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    layout = mesh.mesh
    coord = [int(c) for c in (layout == rank).nonzero()[0]]
    rep = [d for d, p in enumerate(placements) if p.is_replicate()]
    members = [int(r) for r in layout.flatten()
               if all(int((layout == int(r)).nonzero()[0][d]) == coord[d] for d in range(mesh.ndim) if d not in rep)]
    members.sort()
    if op == "broadcast":
        return local_of(members[0])
    return sum((local_of(r) for r in members), torch.zeros(3, 4))


def _full_reference(mesh, placements, local_of):
    """The global tensor after broadcast: each replica group holds its first member's data (replicated
    coordinates 0); shards laid out by their mesh coordinates (at most one mesh dim per tensor dim here)."""
    import itertools

    import torch

    layout = mesh.mesh
    shard_of = {p.dim: i for i, p in enumerate(placements) if p.is_shard()}
    rows = mesh.size(shard_of[0]) if 0 in shard_of else 1
    cols = mesh.size(shard_of[1]) if 1 in shard_of else 1
    full = torch.zeros(3 * rows, 4 * cols)
    for coord in itertools.product(*[range(n) for n in layout.shape]):
        if any(coord[i] for i, p in enumerate(placements) if p.is_replicate()):
            continue
        i0 = coord[shard_of[0]] if 0 in shard_of else 0
        i1 = coord[shard_of[1]] if 1 in shard_of else 0
        full[i0 * 3:(i0 + 1) * 3, i1 * 4:(i1 + 1) * 4] = local_of(int(layout[coord]))
    return full


def sc_public_collectives(rank, world_size, shape):
    """broadcast / all_reduce / all_gather of Shard(0), Shard(1), Replicate DTensors vs references; spy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from accel_fp8_fix.distributed import CollectiveError, all_gather, all_reduce, broadcast
    from accel_fp8_fix.testing.spy import CollectiveSpy

    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    names = ("dp", "tp")[: len(shape)]
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)

    def local_of(r):
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r

    out = {"broadcast": {}, "all_reduce": {}, "all_gather": {}, "refused": {}}
    with CollectiveSpy() as spy:
        for label, dt in _collective_cases(mesh, len(shape) == 2):
            want = _reference(mesh, dt.placements, local_of, "broadcast")
            broadcast(dt, name=label)
            out["broadcast"][label] = torch.equal(dt.to_local(), want)
        for label, dt in _collective_cases(mesh, len(shape) == 2):
            want = _reference(mesh, dt.placements, local_of, "sum")
            all_reduce(dt, name=label)
            out["all_reduce"][label] = torch.equal(dt.to_local(), want)
        for label, dt in _collective_cases(mesh, len(shape) == 2):
            broadcast(dt)  # replicas agree first: the full tensor is then well defined
            full = all_gather(dt)
            out["all_gather"][label] = (type(full).__name__ == "Tensor"
                                        and torch.equal(full, _full_reference(mesh, dt.placements, local_of)))
        plain = torch.full((2,), float(rank))
        gathered = all_gather(plain, mesh, names[-1])
        out["plain_all_gather"] = gathered.tolist()
        all_reduce(plain, mesh)  # all dims
        out["plain_all_reduce"] = plain.tolist()
    out["dtensor_calls"] = len(spy.dtensor_calls)
    out["groups"] = sorted({tuple(c.group_ranks) for c in spy.calls() if c.group_ranks is not None})
    sharded = _collective_cases(mesh, len(shape) == 2)[0][1]
    for key, fn in {
        "plain_without_mesh": lambda: broadcast(torch.ones(2)),
        "sharded_dim": lambda: broadcast(sharded, dims=names[0], name="w"),
    }.items():
        try:
            fn()
            out["refused"][key] = None
        except CollectiveError as exc:
            out["refused"][key] = str(exc)
    return out


def sc_stock_errors_explained(rank, world_size):
    """Stock accelerate (fixes off): A1's mixed-type error in prepare and the user's own broadcast of a DTensor,
    each inside ``explain_errors``; also the 'found a mixture' variant."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from accel_fp8_fix.diagnostics import explain_errors

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=False, tp=world_size, mixed_precision="fp8", expect="MULTI_GPU")
    mesh = acc.torch_device_mesh
    model = scenarios.shard_llama_tp(training.tiny_llama(), mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    facts = {"fixes_active": scenarios.fixes_active()}

    def prepare():
        with explain_errors(model, "Accelerator.prepare"):
            acc.prepare(model, opt)

    facts["a1"] = _catch(prepare)
    dt = DTensor.from_local(torch.ones(4), mesh["tp"], [Replicate()], run_check=False)
    facts["direct"] = _catch(lambda: dist.broadcast(dt, src=0))

    def user_code():
        with explain_errors():
            _user_broadcast(dt)

    facts["user"] = _catch(user_code)

    def mixture():
        with explain_errors():
            torch.cat([dt, torch.ones(4)])

    facts["mixture"] = _catch(mixture)
    return facts


def sc_stock_a2_audit(rank, world_size):
    """Stock accelerate, FSDP2 + fp8 (A2): TE modules exist, FP8 never runs; the audit must say so and why."""
    import torch

    import accel_fp8_fix

    scenarios.ensure_rehearsal(True)
    acc = scenarios.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"])
    model = training.block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    scenarios.te_reset()
    x, y = training.dense_batch()
    # the loss in fp32: torch 2.11's mse_loss backward returns an fp32 gradient for a bf16 input and a fp32 target
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    stats = scenarios.te_stats()
    report = accel_fp8_fix.audit(model)
    return {
        "summary": report.summary,
        "te_modules": len(report.te_modules),
        "fp8_modules": [m.name for m in report.fp8_modules],
        "why_not": {m.name: m.why_not for m in report.modules if m.gemm},
        "coverage": (report.coverage.fp8_param_share, report.coverage.fp8_gemm_share,
                     [n for n, _ in report.coverage.high_precision]),
        "measured_fp8_gemms": stats["fp8_gemms_fwd"] + stats["fp8_gemms_bwd"],
        "fixes_prepared": report.fixes_prepared,
    }


PLAN_FIXED_4 = [("sc_demo_audit", {}), ("sc_user_hook_errors", {}), ("sc_public_collectives", {"shape": [2, 2]})]
PLAN_STOCK_2 = [("sc_stock_errors_explained", {}), ("sc_stock_a2_audit", {}), ("sc_public_collectives", {"shape": [2]})]

# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {"timeout": 400.0, "collective_timeout": 90.0}
