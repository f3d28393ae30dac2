"""What the test bed itself adds to an FP8 training step on CPU: the collective-order audit's recorder, on vs off.

Every launch of the suite runs its scenarios under the rehearsal (TE's Python over the CPU kernel shim) with the
collective-order recorder (a ``TorchDispatchMode`` that sees every op of the run, ``accel_fp8_fix.testing.
collective_order``). Their per-op costs, not arithmetic, set the suite's time: the models are tiny. This measures
a one-process training step of a tiny transformers Llama converted to TE, FP8 delayed scaling, INTERLEAVED in one
run (off, on, off, on, ...; the order flips each round): the median step time with the recorder off and on, and
their ratio; then, under cProfile, the self time of the rehearsal's kernel shim and of the recorder over a step.

Run: ``flock /tmp/accel_fp8_fix.mp.lock python benchmarks/test_bed_cost.py [--rounds 12 --steps 5]`` (~30 s on 2
cores). Not a timed test: figures for docs/testing.md, "What a step costs the test bed".
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

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps per round and setting")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import torch

    torch.set_num_threads(1)
    from support import scenarios, zoo_scenarios

    scenarios.ensure_te_on_cpu()
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.fp8_autocast import te_autocast
    from accel_fp8_fix.fixes.fp8_shapes import weight_multiple
    from accel_fp8_fix.fixes.te_convert import convert_after_sharding
    from accel_fp8_fix.testing.collective_order import CollectiveRecorder

    model = zoo_scenarios.build("llama")
    recipe = zoo_scenarios._recipe()
    convert_after_sharding(model, te, exclude=("lm_head",), dim_multiple=weight_multiple(recipe))
    ids = torch.randint(0, zoo_scenarios.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))

    def steps(setting) -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            with setting():
                with te_autocast(te)(True, recipe, None):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        return (time.perf_counter() - started) / args.steps

    settings = {"recorder off": contextlib.nullcontext, "recorder on": CollectiveRecorder}
    steps(contextlib.nullcontext)  # warm
    times = {name: [] for name in settings}
    for round_ in range(args.rounds):
        for name in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
            times[name].append(steps(settings[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}; tiny Llama (2 layers, hidden 64, 4 x 32 tokens), FP8 delayed scaling, "
          f"{args.rounds} rounds x {args.steps} steps, interleaved")
    for name, value in median.items():
        print(f"  {name:13s} {value * 1e3:7.1f} ms a step (median)")
    print(f"  on / off      {median['recorder on'] / median['recorder off']:7.2f}")

    profile = cProfile.Profile()
    profile.enable()
    steps(CollectiveRecorder)
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(row[2] for row in stats.values())
    shares = {"the kernel shim (rehearsal/te_on_cpu)": "/rehearsal/te_on_cpu/",
              "the recorder (testing/collective_order.py)": "/testing/collective_order.py"}
    for label, part in shares.items():
        own = sum(row[2] for (path, _, _), row in stats.items() if part in path)
        print(f"  self time of {label}: {100 * own / total:.1f} % of a step under the recorder")


if __name__ == "__main__":
    main()
