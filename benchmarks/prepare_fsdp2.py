"""FSDP2 + TE FP8 ``Accelerator.prepare``: patched (accel_fp8_fix) vs stock accelerate, on CPU ranks.

Runs a real ``Accelerator(mixed_precision="fp8", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
auto_wrap_policy="transformer_based_wrap", ...), kwargs_handlers=[TERecipeKwargs(...)])`` on 2 and 4 gloo
processes (``accel_fp8_fix.testing.run_distributed``) with Transformer Engine's real Python on CPU (kernel shim) and the CPU
rehearsal gates (``ACCEL_FP8_FIX_REHEARSAL=1``); ``ACCEL_FP8_FIX=1`` is the patched run, ``ACCEL_FP8_FIX=0``
stock accelerate (converts the full-size model to TE *before* ``fully_shard``; on FSDP2 it does not crash,
but FP8 stays off). The model is a stack of pre-norm MLP blocks (LayerNorm, Linear, GELU, Linear; dims
multiples of 16).

Per rank it prints / reports:

* prepare wall time (warm: after a first, instrumented prepare in the same process; per run the slowest rank
  counts, since prepare ends with collectives; the best of ``--timed-runs`` runs is shown);
* memory during prepare, measured in-process on each rank, three ways:
  - peak live bytes: the CPU allocator's alloc / free events recorded by ``torch.profiler`` with
    ``profile_memory=True``, summed in time order; the peak of that running sum is the most memory prepare
    held *above* what was live when it started (the full fp32 model every rank built);
  - largest single allocation (``accel_fp8_fix.testing.alloc.LargestAllocation``, a dispatch-level probe);
  - ``ru_maxrss`` delta (the process high-water mark; coarse: includes allocator / import effects);
* per training step (after a warm-up step): amax reductions issued (the kernel shim's
  ``stats()["amax_reductions"]``), ``all_reduce`` calls seen by ``CollectiveSpy`` at the Python c10d layer,
  and FP8 GEMMs, for two depths, to show the amax collectives do not grow with the number of layers.

The FSDP2 mixed-precision policy is fp32 (accelerate's fp8 default is bf16 params, whose high-precision GEMMs
are ~10x slower on CPU); prepare does not depend on it. Figures are per rank; a rank of the stock run
allocates a second, full-size copy of every weight before sharding.

Run: ``python benchmarks/prepare_fsdp2.py [--dim 1024 --hidden 3072 --depths 8,4 --worlds 2,4]`` (~3 min on
2 cores; writes the tables to stdout, progress to stderr).
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

ENV_COMMON = {"ACCEL_FP8_FIX_REHEARSAL": "1", "ACCELERATE_FP8_ACCEL_FP8_FIX": "0", "OMP_NUM_THREADS": "1"}
MODES = {"patched": {**ENV_COMMON, "ACCEL_FP8_FIX": "1"}, "stock": {**ENV_COMMON, "ACCEL_FP8_FIX": "0"}}
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
BATCH = 16  # rows per rank per step


# -- model ------------------------------------------------------------------------------------------------
_CLASSES: dict = {}


def _classes():
    """``Block`` / ``BlockStack``, built once per process (torch is imported inside the ranks only)."""
    if _CLASSES:
        return _CLASSES["Block"], _CLASSES["BlockStack"]
    import torch
    from torch import nn

    class Block(nn.Module):  # transformer_based_wrap finds it by this class name
        def __init__(self, dim, hidden):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))

    class BlockStack(nn.Module):
        def __init__(self, dim, hidden, depth):
            super().__init__()
            self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))
            self.head = nn.Linear(dim, dim)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    _CLASSES.update(Block=Block, BlockStack=BlockStack)
    return Block, BlockStack


def build_model(dim, hidden, depth, seed=0):
    import torch

    torch.manual_seed(seed)
    return _classes()[1](dim, hidden, depth)


# -- accelerator ------------------------------------------------------------------------------------------
def make_accelerator():
    """A real FSDP2 + FP8 Accelerator (as tests/support/scenarios.py::make_accelerator builds it), afresh."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.rehearsal import gates as rehearsal

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    _reset_te_global_state()
    rehearsal.activate()
    # fp32 around the FP8 GEMMs (CPU kernel shim): accelerate's default bf16 param dtype makes the stock run's
    # high-precision GEMMs ~10x slower on CPU; prepare itself does not depend on it (it applies at unshard).
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    )
    acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[TERecipeKwargs(**RECIPE)])
    assert acc.is_fsdp2 and acc.distributed_type.name == "FSDP" and acc.device.type == "cpu", acc.distributed_type
    return acc


def _fixes_active() -> bool:
    import accel_fp8_fix

    return accel_fp8_fix.active_patch_set() is not None


# -- measurements -----------------------------------------------------------------------------------------
def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _peak_live_bytes(prof) -> tuple[int, int]:
    """(peak, net) of the running sum of CPU allocator events recorded by the profiler, in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


def _prepare_measured(dim, hidden, depth):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from accel_fp8_fix.testing.alloc import LargestAllocation

    acc = make_accelerator()
    model = build_model(dim, hidden, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_weight = max(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    rss0 = _maxrss_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, LargestAllocation() as largest:
        model, opt = acc.prepare(model, opt)
    rss1 = _maxrss_bytes()
    peak, net = _peak_live_bytes(prof)
    return acc, model, opt, {
        "full_model_bytes": full_bytes,
        "largest_weight_bytes": largest_weight,
        "peak_live_bytes": peak,
        "net_bytes_after": net,
        "largest_alloc_bytes": largest.numel * 4,  # every tensor here is fp32 during prepare
        "largest_alloc_op": largest.op,
        "maxrss_delta": rss1 - rss0,
    }


def _prepare_timed(dim, hidden, depth):
    import torch
    import torch.distributed as dist

    acc = make_accelerator()
    model = build_model(dim, hidden, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    model, opt = acc.prepare(model, opt)
    elapsed = time.perf_counter() - start
    return acc, model, opt, elapsed


def _reset_te_global_state():
    """TE's global amax buffers outlive a model: forget the previous models' before counting."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reset()


def _steps(acc, model, opt, dim, steps):
    """One warm-up step, then ``steps`` steps counted: amax reductions, all_reduce calls, FP8 GEMMs per step."""
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.rehearsal import te_on_cpu as emu
    from accel_fp8_fix.testing.spy import CollectiveSpy

    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = torch.randn(BATCH, dim, generator=g), torch.randn(BATCH, dim, generator=g)

    def step():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    step()
    emu.reset_stats()
    with CollectiveSpy(dispatch=True) as spy:
        losses = [step() for _ in range(steps)]
    stats = emu.stats()
    groups = sorted({str(g) for g in stats["amax_reduction_groups"]})
    return {
        "amax_reductions_per_step": stats["amax_reductions"] / steps,
        "amax_elements_per_step": stats["amax_elements_reduced"] / steps,
        "all_reduce_per_step": len(spy.calls("all_reduce", top_level=True)) / steps,
        "collectives_per_step": len(spy.calls(None, layer="dispatch")) / steps,
        "collective_ops": sorted({c.op for c in spy.calls(None, layer=None)}),
        "fp8_gemms_per_step": stats["fp8_gemms"] / steps,
        "amax_groups": groups,
        "loss_finite": all(l == l and abs(l) != float("inf") for l in losses),
        "te_modules": sum(1 for m in model.modules() if hasattr(m, "fp8_meta")),
        "fp8_enabled": bool(getattr(getattr(acc, "accel_fp8_fix", None), "fp8_enabled", False)),
        # the group the patched prepare chose (the mesh's), and whether TE's modules hold exactly it (not None)
        "amax_group_ranks": list(getattr(getattr(acc, "accel_fp8_fix", None), "amax_group_ranks", ())),
        "te_fp8_group_is_amax_group": all(
            m.fp8_meta.get("fp8_group") is not None and m.fp8_meta.get("fp8_group") is acc.accel_fp8_fix.amax_group
            for m in model.modules() if hasattr(m, "fp8_meta")
        ) if getattr(acc, "accel_fp8_fix", None) is not None else False,
    }


def bench_rank(rank, world_size, dim, hidden, depths, steps, timed_runs):
    """Runs in every rank (one process per rank, fixes on or off by the environment)."""
    import torch

    torch.set_num_threads(1)
    out = {"depths": {}}
    first = True
    for depth in depths:
        facts = {}
        if first:
            # Memory first, in a fresh process (the maxrss high-water mark is only meaningful once).
            acc, model, opt, facts["memory"] = _prepare_measured(dim, hidden, depth)
            del acc, model, opt
            gc.collect()
            first = False
        times = []
        for _ in range(timed_runs):
            acc, model, opt, elapsed = _prepare_timed(dim, hidden, depth)
            times.append(elapsed)
            if len(times) < timed_runs:
                del acc, model, opt
                gc.collect()
        facts["prepare_s"] = times
        facts["params"] = sum(p.numel() for p in model.parameters())  # DTensor.numel(): the global size
        facts["steps"] = _steps(acc, model, opt, dim, steps)
        del acc, model, opt
        gc.collect()
        out["depths"][depth] = facts
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    out["fixes_active"] = _fixes_active()  # after accelerate's import: the patch set is chosen lazily
    return out


# -- driver -----------------------------------------------------------------------------------------------
def _mb(n):
    return f"{n / 2**20:8.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--depths", default="8,4", help="first one: memory + time; all: time + collectives")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timed-runs", type=int, default=3)
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]

    from accel_fp8_fix.testing import run_distributed

    results = {}
    t_all = time.perf_counter()
    for world in worlds:
        for mode, env in MODES.items():
            t0 = time.perf_counter()
            per_rank = run_distributed(
                bench_rank, world, args=(args.dim, args.hidden, depths, args.steps, args.timed_runs), env=env,
                init_process_group=False, timeout=900, collective_timeout=300,
            )
            want = mode == "patched"
            assert all(r["fixes_active"] == want for r in per_rank), (mode, [r["fixes_active"] for r in per_rank])
            results[(world, mode)] = per_rank
            print(f"# {mode:7s} on {world} ranks: {time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)

    d0 = depths[0]
    params = results[(worlds[0], "patched")][0]["depths"][d0]["params"]
    full = results[(worlds[0], "patched")][0]["depths"][d0]["memory"]["full_model_bytes"]
    print(f"model: {d0} x Block(LayerNorm {args.dim}, Linear {args.dim}->{args.hidden}, GELU, Linear {args.hidden}->{args.dim})"
          f" + head Linear {args.dim}->{args.dim}: {params / 1e6:.1f} M params, {full / 2**20:.0f} MiB fp32")
    print("TE Python on CPU + CPU rehearsal (gloo), torch threads 1 per rank; patched = ACCEL_FP8_FIX=1, stock = 0\n")

    print(f"## prepare, depth {d0} (time: slowest rank, min of {args.timed_runs} warm runs; memory: max over ranks, MiB)")
    print("| ranks | figure | patched | stock | patched/stock |")
    print("|---|---|---|---|---|")
    for world in worlds:
        p, s = results[(world, "patched")], results[(world, "stock")]

        def prep_time(rs, depth=d0):
            # per run: the slowest rank; then the best run
            runs = zip(*[r["depths"][depth]["prepare_s"] for r in rs])
            return min(max(run) for run in runs)

        def mem(rs, key):
            return max(r["depths"][d0]["memory"][key] for r in rs)

        rows = [("prepare time (s)", prep_time(p), prep_time(s), "{:.2f}")]
        for key, label in (("peak_live_bytes", "peak live bytes above start"), ("largest_alloc_bytes", "largest single allocation"),
                           ("maxrss_delta", "maxrss delta"), ("net_bytes_after", "net retained after prepare")):
            rows.append((label + " (MiB)", mem(p, key) / 2**20, mem(s, key) / 2**20, "{:.1f}"))
        for label, a, b, fmt in rows:
            ratio = f"{a / b:.2f}" if b else "n/a"
            print(f"| {world} | {label} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
    print()

    print(f"## per training step (after 1 warm-up step; mean of {args.steps}), per rank")
    print("| ranks | depth | params (M) | Linear layers | mode | FP8 on | FP8 GEMMs | amax reductions | amax values reduced "
          "| all_reduce calls | all collectives | prepare (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world in worlds:
        for depth in depths:
            for mode in MODES:
                rs = results[(world, mode)]
                f = rs[0]["depths"][depth]
                st = f["steps"]
                runs = zip(*[r["depths"][depth]["prepare_s"] for r in rs])
                t = min(max(run) for run in runs)
                on = "yes" if st["fp8_enabled"] else "no"
                print(f"| {world} | {depth} | {f['params'] / 1e6:.1f} | {2 * depth + 1} | {mode} | {on} | {st['fp8_gemms_per_step']:.0f} "
                      f"| {st['amax_reductions_per_step']:.0f} | {st['amax_elements_per_step']:.0f} | {st['all_reduce_per_step']:.0f} "
                      f"| {st['collectives_per_step']:.0f} | {t:.2f} |")
                assert all(r["depths"][depth]["steps"]["loss_finite"] for r in rs), (world, depth, mode)
    groups = {g for world in worlds for d in depths for r in results[(world, "patched")] for g in r["depths"][d]["steps"]["amax_groups"]}
    explicit = {w: (results[(w, "patched")][0]["depths"][d0]["steps"]["amax_group_ranks"],
                    all(r["depths"][d]["steps"]["te_fp8_group_is_amax_group"] for r in results[(w, "patched")] for d in depths))
                for w in worlds}
    print(f"\namax reduction groups (patched, TE-on-CPU stats): {sorted(groups)}; "
          + "; ".join(f"{w} ranks: mesh group ranks {r}, every TE module's fp8_group is that group object: {ok}"
                      for w, (r, ok) in explicit.items()))
    where = {mode: results[(worlds[0], mode)][0]["depths"][d0]["memory"]["largest_alloc_op"] for mode in MODES}
    ops = sorted({op for mode in MODES for r in results[(worlds[0], mode)] for op in r["depths"][d0]["steps"]["collective_ops"]})
    print(f"collective ops seen in a step (python + dispatch layers): {ops}")
    print(f"largest allocation made by ({worlds[0]} ranks): {where}")
    print(f"largest weight: {results[(worlds[0], 'patched')][0]['depths'][d0]['memory']['largest_weight_bytes'] / 2**20:.1f} MiB")
    print(f"total wall time: {time.perf_counter() - t_all:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
