"""Real Transformer Engine Python on CPU: TE's own ``transformer_engine.pytorch`` over a kernel shim.

    from accel_fp8_fix.rehearsal import te_on_cpu
    te_on_cpu.install()               # before anything imports transformer_engine
    import transformer_engine.pytorch as te   # TE's real Python (the installed wheel)

Needs the pure-Python ``transformer-engine`` wheel (``pip install --no-deps transformer-engine==2.20.2``);
supplies what a CPU lacks: ``transformer_engine_torch`` (``tex.py`` over ``kernels.py``), CUDA-as-CPU answers
for TE's frames (``cuda_as_cpu.py``), and a way past TE's core-library loading. Refuses to run where
CUDA is present: on a GPU machine use the real extension.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from .installed import te_version

__all__ = ["install", "is_installed", "te_version", "stats", "reset_stats", "TESTED_TE_VERSIONS"]

# TE releases whose Python this shim has run (tests/rehearsal/test_te_on_cpu*.py and the distributed suite).
TESTED_TE_VERSIONS = ("2.8.0", "2.20.2")

_installed = {"finder": None}


class _CommonLoaderHook(importlib.abc.MetaPathFinder):
    """Runs ``transformer_engine.common`` without loading TE's core library, then makes
    ``load_framework_extension("torch")`` resolve to the CPU shim."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformer_engine.common":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            previous = os.environ.get("NVTE_PROJECT_BUILDING")
            os.environ["NVTE_PROJECT_BUILDING"] = "1"  # skips libtransformer_engine.so / CUDA libs
            try:
                real_exec(module)
            finally:
                if previous is None:
                    os.environ.pop("NVTE_PROJECT_BUILDING", None)
                else:
                    os.environ["NVTE_PROJECT_BUILDING"] = previous
            module.load_framework_extension = _load_framework_extension

        spec.loader.exec_module = exec_module
        return spec


def _load_framework_extension(framework: str) -> None:
    if framework != "torch":
        raise RuntimeError(f"Transformer Engine on CPU supports the torch framework only, not {framework!r}")
    from . import tex

    sys.modules.setdefault("transformer_engine_torch", tex)


def _observe_amax_reductions() -> None:
    """Count TE's delayed-scaling amax all-reduces (and their group) without changing them."""
    import wrapt

    def observe(wrapped, instance, args, kwargs):
        from . import tex

        import torch.distributed as dist

        def bind(tensor, group):
            return tensor, group

        tensor, group = bind(*args, **kwargs)
        if dist.is_initialized():
            tex.record_amax_reduction(group, tensor.numel())
        return wrapped(*args, **kwargs)

    def on_import(module):
        manager = vars(module).get("FP8GlobalStateManager")
        if manager is None or "reduce_tensor_across_group_op_max" not in vars(manager):
            return
        if not getattr(manager, "_accel_fp8_fix_observed", False):  # 2.9+ re-exports it from fp8.py
            wrapt.wrap_function_wrapper(module, "FP8GlobalStateManager.reduce_tensor_across_group_op_max", observe)
            manager._accel_fp8_fix_observed = True

    # FP8GlobalStateManager lives in pytorch/quantization.py since TE 2.9, in pytorch/fp8.py before.
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        wrapt.register_post_import_hook(on_import, name)


def is_installed() -> bool:
    return _installed["finder"] is not None


def install() -> None:
    """Idempotent. Must run before ``transformer_engine`` is imported."""
    if is_installed():
        return
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("accel_fp8_fix.rehearsal.te_on_cpu: CUDA is available here; use the real "
                           "Transformer Engine extension instead of the CPU rehearsal")
    if importlib.util.find_spec("transformer_engine") is None:
        raise RuntimeError(
            "accel_fp8_fix.rehearsal.te_on_cpu needs Transformer Engine's Python: "
            f"pip install --no-deps transformer-engine=={TESTED_TE_VERSIONS[-1]}"
        )
    if "transformer_engine.pytorch" in sys.modules and "transformer_engine_torch" not in sys.modules:
        raise RuntimeError("accel_fp8_fix.rehearsal.te_on_cpu.install() must run before "
                           "transformer_engine is imported")
    from ... import caches
    from . import cuda_as_cpu, tex

    caches.register("rehearsal.te_on_cpu: kernel counters", tex.reset_stats)
    cuda_as_cpu.install()
    # TE warns (per TP module, per rank) unless this is set for its TP/SP comm overlap; a CPU has no
    # CUDA connections to limit, so the rehearsal answers it as a tuned GPU job would.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.modules["transformer_engine_torch"] = tex
    _observe_amax_reductions()
    finder = _CommonLoaderHook()
    sys.meta_path.insert(0, finder)
    _installed["finder"] = finder


def stats() -> dict:
    from . import tex

    return tex.stats()


def reset_stats() -> None:
    from . import tex

    tex.reset_stats()
