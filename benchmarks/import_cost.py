"""Import cost of accel_fp8_fix (issue goal: < 30 ms added start-up, ratio <= 1.05 next to accelerate).

Prints the median wall time of fresh interpreters, and checks that importing the package imports
neither torch nor accelerate. Run: python benchmarks/import_cost.py [runs]
"""

import os
import statistics
import subprocess
import sys
import time

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
# Bytecode caching on, as in users' environments (this machine sets PYTHONDONTWRITEBYTECODE=1, which would
# measure compiling the sources instead of importing them).
ENV = {k: v for k, v in os.environ.items()
       if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8")) and k != "PYTHONDONTWRITEBYTECODE"}


def _once(code: str, env=None) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env or ENV)
    return time.perf_counter() - start


def interleaved_medians(*codes: str) -> list:
    """Median seconds of each snippet, run alternately (a, b, a, b, ...) so drift hits all of them alike."""
    times = [[] for _ in codes]
    for _ in range(RUNS):
        for i, code in enumerate(codes):
            times[i].append(_once(code))
    return [statistics.median(t) for t in times]


def median_seconds(code: str, env=None) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env or ENV)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    leaked = subprocess.run(
        [sys.executable, "-c", "import sys, accel_fp8_fix; print([m for m in ('torch', 'accelerate') if m in sys.modules])"],
        capture_output=True, text=True, env=ENV, check=True,
    ).stdout.strip()
    subprocess.run([sys.executable, "-c", "import accelerate, accel_fp8_fix, accel_fp8_fix.fixes.prepare"],
                   check=True, env=ENV)  # warm-up: writes the bytecode caches
    # Interleave-free but same-run measurements: ratios, not absolute numbers, are what to compare.
    bare, package = interleaved_medians("pass", "import accel_fp8_fix")
    trampoline_off = median_seconds("pass")  # .pth installed, variables unset
    accelerate, both = interleaved_medians("import accelerate", "import accelerate; import accel_fp8_fix")
    print(f"runs per figure                : {RUNS}")
    print(f"modules imported by the package: {leaked} (must be [])")
    print(f"python -c pass                 : {bare * 1e3:7.1f} ms")
    print(f"import accel_fp8_fix           : {package * 1e3:7.1f} ms  (+{(package - bare) * 1e3:.1f} ms, goal < 30 ms)")
    print(f"python -c pass (again)         : {trampoline_off * 1e3:7.1f} ms  (noise check)")
    print(f"import accelerate              : {accelerate * 1e3:7.1f} ms")
    print(f"import accelerate + package    : {both * 1e3:7.1f} ms  (ratio {both / accelerate:.3f}, goal <= 1.05)")


if __name__ == "__main__":
    main()
