"""CPU rehearsal of a GPU FP8 run: Transformer Engine's real Python on CPU plus accelerate's CPU gates.

    ACCEL_FP8_FIX_REHEARSAL=1 accelerate launch ...     # or: from accel_fp8_fix import rehearsal; rehearsal.install()

Three parts: the first two run an FSDP2 / TP FP8 job on CPU processes (gloo), the third context
parallelism:

- ``te_on_cpu``: TE's own ``transformer_engine.pytorch`` (the installed ``transformer-engine`` wheel) over
  a CPU stand-in for its kernel extension, with CUDA-as-CPU answers for TE's frames only;
- ``gates``: two accelerate wrappers that let its FSDP2 / ParallelismConfig code run on CPU ranks;
- ``context_parallel``: torch's ring attention (context parallelism) with the CPU flash-attention kernel.

The rehearsal changes where TE's kernels run and which accelerate gates open; it never turns the fixes
on by itself. Not for GPUs: with CUDA present it refuses.
"""

from __future__ import annotations

__all__ = ["install", "is_installed"]


def install(strict: bool = True) -> None:
    """Idempotent: TE's Python on CPU (before ``transformer_engine`` is imported), the gates, CP on CPU."""
    from . import context_parallel, gates, te_on_cpu

    te_on_cpu.install()
    gates.activate(strict=strict)
    context_parallel.install()


def is_installed() -> bool:
    from . import gates, te_on_cpu

    return te_on_cpu.is_installed() and gates.is_active()
