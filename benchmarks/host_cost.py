"""Per-step host (CPU, Python) cost of a training step through the package vs the same TE modules wired by hand.

A model small enough that Python overhead dominates (a stack of TE-converted blocks, dim 64, 16 rows a rank), on
gloo ranks (``accel_fp8_fix.testing.run_distributed``), TE's real Python over the CPU kernel shim. In each rank, in
ONE process, two models trained step by step, INTERLEAVED (package, hand, package, hand, ...; the order flips each
round so neither always runs second):

* **package**: ``Accelerator(mixed_precision="fp8", fsdp_plugin=FSDP2)`` + ``accelerator.prepare`` (conversion after
  sharding, TE autocast with the mesh's amax group, FP8 state as buffers, the patched ``backward`` /
  ``clip_grad_norm_`` / ``optimizer.step``), a step written as a user writes it;
* **hand**: the same model (same seed), converted with the same TE modules (``te.Linear`` / ``te.LayerNorm``) on
  the sharded parameters, ``fully_shard`` per block and at the root, the forward under ``te.autocast(recipe=,
  amax_reduction_group=)`` with the SAME group, ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_`` on the
  DTensor parameters, ``optimizer.step()`` — what a user could write without the package.

Printed per world size: the median step time of each (and the ratio package / hand), and the package's own share
of a package step under cProfile: the self time of the package's runtime frames (``accel_fp8_fix/`` less
``rehearsal/``, the CPU kernel shim that stands in for TE's CUDA kernels, and ``testing/``), of ``wrapt``'s and of
the rehearsal's, over the profiled steps' total. The collective-order audit is off (its dispatch mode would sit on
every op of both). ``--all-gather fp8`` adds a row for the package with the FP8 all-gather on (more work than the
hand run: the weights quantized on the shard, the hooks; the ratio then includes that work).

Run: ``flock /tmp/accel_fp8_fix.mp.lock python benchmarks/host_cost.py [--worlds 1,2 --steps 60 --all-gather fp8]``
(~1-2 min on 2 cores). Not a timed test: figures for docs/benchmarks.md, "Host cost".
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}  # the suite's (fp8_scenarios)
DIM, DEPTH, ROWS = 64, 4, 16  # 16 rows a rank: cuBLASLt's FP8 wgrad needs a leading dimension of 16 (the rehearsal refuses 8)


def _package_model(all_gather):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix.testing import training

    os.environ["ACCELERATE_FP8_ALL_GATHER"] = all_gather
    acc = training.make_accelerator(fsdp=True, mixed_precision="fp8", wrap_cls=["Block"], fp8_recipe=RECIPE,
                                    mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                                reduce_dtype=torch.float32))
    model = training.block_stack(dim=DIM, hidden=2 * DIM, depth=DEPTH, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return acc, step


def _hand_model(mesh, group):
    """The same blocks wired by hand: fully_shard, TE modules on the sharded parameters, te.autocast."""
    import torch
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding

    from accel_fp8_fix.testing.training import block_stack

    model = block_stack(dim=DIM, hidden=2 * DIM, depth=DEPTH, seed=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    convert_after_sharding(model, te)  # the same TE modules, on the same (sharded) Parameters
    recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, y):
        with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def _category(filename: str) -> str | None:
    """Whose frame: the package's runtime, the CPU rehearsal (it stands in for TE's CUDA kernels: not the
    package's cost on a GPU), wrapt, or None (torch, TE's Python, accelerate, ...)."""
    parts = filename.split(os.sep)
    if "accel_fp8_fix" in parts:
        sub = parts[parts.index("accel_fp8_fix") + 1] if parts.index("accel_fp8_fix") + 1 < len(parts) else ""
        return "rehearsal" if sub == "rehearsal" else "testing" if sub == "testing" else "package"
    return "wrapt" if "wrapt" in parts else None


def _own_share(step, x, y, steps):
    """Self time per category (``_category``) over the total, under cProfile, for ``steps`` steps; the package's
    heaviest frames."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(x, y)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in stats.values())
    own = {"package": 0.0, "rehearsal": 0.0, "wrapt": 0.0, "testing": 0.0}
    top = []
    for (filename, line, name), (_cc, calls, tt, _ct, _callers) in stats.items():
        category = _category(filename)
        if category is not None:
            own[category] += tt
        if category == "package":
            top.append((tt, f"{os.path.relpath(filename, os.path.dirname(HERE))}:{line} {name} ({calls // steps} calls)"))
    top.sort(reverse=True)
    return {k: v / total for k, v in own.items()}, [f"{tt / steps * 1e6:.0f} us/step  {where}" for tt, where in top[:6]]


def measure(rank, world_size, steps, all_gather):
    import statistics
    import time

    import torch

    from accel_fp8_fix.testing.training import ensure_rehearsal, reset_te_global_state

    ensure_rehearsal(True)
    acc, package_step = _package_model(all_gather)
    setup = acc.accel_fp8_fix
    hand_step = _hand_model(setup.mesh, setup.amax_group)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 16, generator=g)
    for _ in range(5):  # warm-up: lazy inits, first FP8 state
        package_step(x, y)
        hand_step(x, y)
    times = {"package": [], "hand": []}
    for i in range(steps):
        order = (("package", package_step), ("hand", hand_step))
        for name, step in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            step(x, y)
            times[name].append(time.perf_counter() - start)
    shares, top = _own_share(package_step, x, y, max(steps // 3, 10))
    reset_te_global_state()
    return {"package_s": statistics.median(times["package"]), "hand_s": statistics.median(times["hand"]),
            "shares": shares, "top": top, "weights_gathered_in_fp8": len(setup.all_gather.weights)
            if setup.all_gather else 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--all-gather", default="high_precision", choices=("high_precision", "fp8"))
    args = parser.parse_args(argv)
    from accel_fp8_fix.testing import run_distributed
    from accel_fp8_fix.testing.training import ENV_FIXED

    modes = ["high_precision"] + (["fp8"] if args.all_gather == "fp8" else [])
    print("| ranks | package path | package step (ms) | hand step (ms) | ratio | package self time | wrapt | "
          "rehearsal (CPU kernels) |")
    print("|---|---|---|---|---|---|---|---|")
    tops = []
    for world in (int(w) for w in args.worlds.split(",")):
        for mode in modes:
            results = run_distributed(measure, world, args=(args.steps, mode), env=ENV_FIXED, timeout=600,
                                      init_process_group=False, audit_collectives=False)
            r = results[0]
            label = "stock all-gather" if mode == "high_precision" else f"FP8 all-gather ({r['weights_gathered_in_fp8']} weights)"
            print(f"| {world} | {label} | {r['package_s'] * 1e3:.2f} | {r['hand_s'] * 1e3:.2f} | "
                  f"{r['package_s'] / r['hand_s']:.3f} | {r['shares']['package'] * 100:.2f} % | "
                  f"{r['shares']['wrapt'] * 100:.2f} % | {r['shares']['rehearsal'] * 100:.1f} % |")
            tops.append((world, mode, r["top"]))
    for world, mode, top in tops:
        print(f"\nrank 0, {world} rank(s), {mode}: the package's heaviest frames (self time)")
        for line in top:
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
