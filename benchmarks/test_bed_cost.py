"""What the test bed itself adds to an FP8 training step on CPU: the collective-order audit's two recorders, on vs off.

Every launch of the suite runs its scenarios under the rehearsal (TE's Python over the CPU kernel shim) with the
collective-order audit (``accel_fp8_fix.diagnostics.collective_order``). Its per-op costs, not arithmetic, set the
suite's time: the models are tiny. This measures a one-process training step of a tiny transformers Llama converted
to TE, FP8 delayed scaling, with a data-parallel gradient all-reduce per parameter on a one-rank gloo group (so
that there are collectives to record), INTERLEAVED in one run (the order turns each round): the median step time
with no recorder, with the dispatch-mode recorder (``CollectiveRecorder``: every op through Python) and with the
flight-recorder trail the suite's ranks use (``FlightRecorderTrail``: c10d records, the trail reads at the end of
the round), and their ratios; then, under cProfile, the self time of the kernel shim and of the dispatch recorder.
c10d's flight recorder is on for the whole process (torch reads its variable once), so its own cost per collective
is in all three figures; what the trail adds is its two reads a round (where it starts, what it recorded).

The same step with the kernel shim's kernels run through CUDA-as-CPU's mode (as before stop 44) vs with the mode
popped in them (``cuda_as_cpu.mode_off``, the default), interleaved likewise. ``--pool-starts N``: N rounds of
starting a 4-rank rank pool of the suite's main environment (the rehearsal, its preload), its ranks forked from one
start-up interpreter vs each started anew (``RankPool(fork=...)``), alternating: the wall seconds to a ready pool.

Run: ``flock /tmp/accel_fp8_fix.mp.lock python benchmarks/test_bed_cost.py [--rounds 12 --steps 5]
[--pool-starts 3]`` (~40 s on 2 cores, ~1 min more with pool starts). Not a timed test: figures for
docs/testing.md, "What a step costs the test bed".
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps per round and setting")
    parser.add_argument("--pool-starts", type=int, default=0, help="rounds of 4-rank pool starts, forked vs started")
    args = parser.parse_args()
    if args.pool_starts:
        pool_starts(args.pool_starts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from accel_fp8_fix.diagnostics import collective_order

    os.environ.setdefault(collective_order.FR_ENV, str(collective_order.FR_ENTRIES))  # before torch starts
    import tempfile

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from accel_fp8_fix.testing import training

    training.ensure_te_on_cpu()
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.convert.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.convert.fp8_shapes import weight_multiple
    from accel_fp8_fix.fixes.convert.te_convert import convert_after_sharding
    from accel_fp8_fix.diagnostics.collective_order import CollectiveRecorder, FlightRecorderTrail

    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)

    model = training.zoo_model("llama")
    recipe = training.zoo_recipe()
    convert_after_sharding(model, te, exclude=("lm_head",), dim_multiple=weight_multiple(recipe))
    ids = torch.randint(0, training.ZOO_VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))

    def steps(setting) -> float:
        started = time.perf_counter()
        with setting():  # one recording a round, read at its end (the audit: one a run)
            for _ in range(args.steps):
                with te_autocast(te)(True, recipe, None):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                for p in model.parameters():  # data parallel without buckets: a collective per parameter
                    dist.all_reduce(p.grad)
        return (time.perf_counter() - started) / args.steps

    reads: list = []

    @contextlib.contextmanager
    def trail():
        recorder = FlightRecorderTrail()
        yield recorder
        started = time.perf_counter()
        assert len(recorder.records) == args.steps * len(list(model.parameters()))  # read, as the audit does
        reads.append(time.perf_counter() - started)

    tex = sys.modules["transformer_engine_torch"]

    @contextlib.contextmanager
    def kernels_through_the_mode():  # the shim's kernels unwrapped: their torch calls pass through the mode
        wrapped = {name: fn for name, fn in vars(tex).items() if getattr(fn, "__wrapped__", None) is not None
                   and name in tex.REAL_EXTENSION_NAMES}
        for name, fn in wrapped.items():
            setattr(tex, name, fn.__wrapped__)
        try:
            yield
        finally:
            for name, fn in wrapped.items():
                setattr(tex, name, fn)

    settings = {"recorder off": contextlib.nullcontext, "dispatch recorder": CollectiveRecorder,
                "flight recorder": trail, "shim through mode": kernels_through_the_mode}
    steps(contextlib.nullcontext)  # warm
    times = {name: [] for name in settings}
    for round_ in range(args.rounds):
        for name in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
            times[name].append(steps(settings[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}; tiny Llama (2 layers, hidden 64, 4 x 32 tokens), FP8 delayed scaling, a "
          f"gradient all-reduce per parameter (one-rank gloo); {args.rounds} rounds x {args.steps} steps, interleaved")
    for name, value in median.items():
        print(f"  {name:17s} {value * 1e3:7.1f} ms a step (median)")
    for name in ("dispatch recorder", "flight recorder"):
        print(f"  {name} / off  {median[name] / median['recorder off']:7.2f}")
    print(f"  the shim's kernels through CUDA-as-CPU's mode / popped in them (the default): "
          f"{median['shim through mode'] / median['recorder off']:.2f}")
    print(f"  the flight recorder's read at a round's end (in its figure): {statistics.median(reads) * 1e3:.1f} ms "
          f"median, the buffer holding up to {(3 * args.rounds + 1) * args.steps * len(list(model.parameters()))} "
          f"entries; {len(list(model.parameters()))} collectives a step")

    profile = cProfile.Profile()
    profile.enable()
    steps(CollectiveRecorder)
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(row[2] for row in stats.values())
    shares = {"the kernel shim (rehearsal/te_on_cpu)": "/rehearsal/te_on_cpu/",
              "the recorder (diagnostics/collective_order.py)": "/diagnostics/collective_order.py"}
    for label, part in shares.items():
        own = sum(row[2] for (path, _, _), row in stats.items() if part in path)
        print(f"  self time of {label}: {100 * own / total:.1f} % of a step under the dispatch recorder")
    dist.destroy_process_group()
    if os.path.exists(store.name):  # the file store removes its file when the group ends
        os.unlink(store.name)


def pool_starts(rounds: int) -> None:
    """Wall seconds to a ready 4-rank pool of the suite's main environment, forked vs started, alternating."""
    from accel_fp8_fix.testing.pool import RankPool, preload_for
    from accel_fp8_fix.testing.training import ENV_FIXED

    env = ENV_FIXED
    seconds: dict = {True: [], False: []}
    for round_ in range(rounds):
        for fork in ((True, False) if round_ % 2 == 0 else (False, True)):
            pool = RankPool(4, env=env, preload=preload_for(env), fork=fork)
            try:
                pool._start()
                seconds[fork].append(pool.start_seconds)
            finally:
                pool.close()
    forked, started = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"4-rank pool start ({', '.join(sorted(env))}; preload {', '.join(preload_for(env))}), "
          f"{rounds} rounds alternating: forked {forked:.1f} s, started {started:.1f} s (median), "
          f"forked / started {forked / started:.2f}")


if __name__ == "__main__":
    main()
