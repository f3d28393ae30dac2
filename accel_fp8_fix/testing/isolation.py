"""What a pooled rank (:mod:`accel_fp8_fix.testing.pool`) puts back between runs, and what it checks.

:meth:`Baseline.capture` is taken once, after the rank's start-up; :meth:`Baseline.restore` runs after every run
and returns what the run left behind that could not be put back (empty: the next run starts as the first did).

Put back, every run:

* the environment, ``sys.path``, the working directory;
* accelerate's singletons (``AcceleratorState`` / ``PartialState`` / ``GradientState``), DeviceMesh's context
  stack; every process group is destroyed by the worker before this;
* the package's patch set undone and re-applied (or left undone, as at start-up), the rehearsal's gates the same;
  the package's once-per-process caches (``_log``'s said-once set, ``clean_exit``'s registration, the flattened
  groups of ``distributed.collectives``, the patch-set agreement's round counter);
* Transformer Engine's global FP8 state (``FP8GlobalStateManager.reset()``), the rehearsal's kernel counters;
* dynamo's caches (``torch._dynamo.reset()``), torch's default RNG (its state at start-up), default
  dtype, grad mode, intra-op threads, deterministic-algorithms flag, float32 matmul precision;
* ``warnings`` filters and once-registries, the root and package loggers' handlers and levels; a garbage
  collection (models of the run, and the gloo groups they held, go now).

Checked (left behind = the run fails and the pool is rebuilt):

* functions, methods and classes of accelerate, torch.distributed, torch.nn.functional, Transformer Engine and
  this package's fixes that the run replaced and did not restore (a wrapt wrapper counts as what it wraps and
  who wraps it, so re-applying the patch set is not a change; a replacement made by a library's first import
  during the run is that library's, and joins the baseline);
* threads the run started that are still alive (but the daemon threads of :data:`LONG_LIVED_THREADS`, and the
  workers a library starts for the process on its first use, in the run that first imported it).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading
import warnings

# Namespaces whose callables a run must not leave replaced: (module name, attribute holding the namespace or None
# for the module itself). Watched when imported; a module first imported by a run is watched from then on.
WATCHED = (
    ("accelerate.accelerator", None), ("accelerate.accelerator", "Accelerator"), ("accelerate.state", None),
    ("accelerate.state", "PartialState"), ("accelerate.state", "AcceleratorState"), ("accelerate.utils", None),
    ("accelerate.utils.dataclasses", None), ("accelerate.utils.fsdp_utils", None),
    ("accelerate.utils.transformer_engine", None), ("accelerate.parallelism_config", "ParallelismConfig"),
    ("torch.nn.functional", None), ("torch.nn.modules.module", "Module"), ("torch.distributed", None),
    ("torch.distributed.distributed_c10d", None), ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.fsdp", "FSDPModule"), ("transformer_engine.pytorch", None),
    ("transformer_engine_torch", None), ("transformers.modeling_utils", "PreTrainedModel"),
)
_LOGGERS = ("", "accel_fp8_fix")
# Daemon threads libraries keep for the life of a process (started on first use, idle between uses): not state a
# run left behind. tqdm's progress-bar monitor (transformers' weight loading starts it).
LONG_LIVED_THREADS = ("tqdm_monitor",)


def _signature(value):
    """What identifies a namespace entry: its object, seen through wrapt proxies (the package's own wrappers are
    new objects after every re-application; what they wrap and which patch they are is what matters)."""
    if not _is_proxy(value):
        return id(value)
    spec = getattr(value, "_self_fix_spec", None)
    if spec is not None:
        return ("fix", spec.target, _signature(value.__wrapped__))
    wrapper = getattr(value, "_self_wrapper", None)
    return ("proxy", type(value).__qualname__, _signature(value.__wrapped__), getattr(wrapper, "__qualname__", None))


def _is_proxy(value) -> bool:
    """A wrapt proxy (its C and Python ObjectProxy classes differ across wrapt releases: matched by name)."""
    return any(cls.__name__ in ("ObjectProxy", "BaseObjectProxy") for cls in type(value).__mro__[1:])


def _namespace(module_name: str, attribute: str | None):
    module = sys.modules.get(module_name)
    if module is None:
        return None
    target = module if attribute is None else getattr(module, attribute, None)
    return vars(target) if target is not None else None


# And every module of these packages of this one (the fixes read each other's functions by module attribute).
WATCHED_PACKAGES = ("accel_fp8_fix.fixes.", "accel_fp8_fix.distributed.", "accel_fp8_fix.engine.",
                    "accel_fp8_fix.internals.")


def _watched() -> list:
    own = [(name, None) for name in list(sys.modules) if name.startswith(WATCHED_PACKAGES)]
    return list(WATCHED) + sorted(own)


def fingerprint() -> dict:
    """{(module, attribute, name): signature} of every callable in the watched namespaces imported now."""
    out = {}
    for module_name, attribute in _watched():
        names = _namespace(module_name, attribute)
        if names is None:
            continue
        for name, value in list(names.items()):
            if callable(value) and not name.startswith("__"):
                out[(module_name, attribute, name)] = _signature(value)
    return out


def _origin(key: tuple) -> str | None:
    """The module that defined the object now at ``key`` (through wrapt proxies: the wrapper's)."""
    names = _namespace(key[0], key[1])
    value = names.get(key[2]) if names is not None else None
    return getattr(value, "__module__", None)


def _torch_flags() -> dict | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return {"rng": torch.get_rng_state(), "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul": torch.get_float32_matmul_precision()}


def _restore_torch(flags: dict | None) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    flags = flags or _torch_flags()
    torch.set_rng_state(flags["rng"])
    torch.set_default_dtype(flags["dtype"])
    torch.set_grad_enabled(flags["grad"])
    if torch.get_num_threads() != flags["threads"]:
        torch.set_num_threads(flags["threads"])
    torch.use_deterministic_algorithms(flags["deterministic"])
    torch.set_float32_matmul_precision(flags["matmul"])
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(device_mesh, "_mesh_resources", None)
    if resources is not None and hasattr(resources, "mesh_stack"):
        resources.mesh_stack.clear()


def _restore_libraries() -> None:
    """accelerate's singletons, TE's global FP8 state, the rehearsal's counters, DTensor's RNG tracker."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if manager is not None:
            manager.reset()
            break
    dtensor_random = sys.modules.get("torch.distributed.tensor._random")
    if dtensor_random is not None:  # DTensor's RNG tracker: made (and synced over the mesh) by a fresh run's first
        dtensor_random._rng_tracker = None  # random op on a DTensor, as in a fresh interpreter
    _clear_dtensor_caches()


_LRU_CACHE = type(functools.lru_cache(None)(len))


def _clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches hold the meshes of the run that filled them, and ``DeviceMesh.__eq__``
    ignores process groups: a later run's equal mesh would get the output specs of a destroyed one, whose group
    names now resolve to nothing ("Could not resolve the process group registered under the name 29") or to another
    group of the new run (a hang). Cleared, as a fresh interpreter starts."""
    dtensor = sys.modules.get("torch.distributed.tensor._api")
    dispatcher = getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    per_thread = getattr(propagator, "propagate_op_sharding", None)
    if per_thread is not None and hasattr(propagator, "propagate_op_sharding_non_cached"):
        # a threading.local cache: a new one empties it for every thread (transformers loads in worker threads)
        propagator.propagate_op_sharding = type(per_thread)(propagator.propagate_op_sharding_non_cached)
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    torch = sys.modules.get("torch")
    clear_fast_path = getattr(getattr(torch, "_C", None), "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:  # the C++ dispatch fast path's own cache of the same answers
        clear_fast_path()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, _LRU_CACHE):
                value.cache_clear()  # module-level functools caches (_redistribute._gen_transform_infos, ...)


def _patch_modules():
    """The public API (which patch set is applied) and the rehearsal's gates (None without the rehearsal's wheel)."""
    from .. import _api

    try:
        from ..rehearsal import gates
    except ImportError:
        gates = None
    return _api, gates


def _patches_applied() -> dict:
    api, gates = _patch_modules()
    return {"fixes": api.active_patch_set() if api is not None else None,
            "gates": bool(gates is not None and gates.is_applied())}


def _reapply_patches(baseline: dict) -> list[str]:
    """The patch sets undone, then re-applied where start-up had them applied; what differs afterwards."""
    api, gates = _patch_modules()
    if api is not None:
        api.deactivate()
    if gates is not None:
        gates.deactivate()
        gates._last_decision.clear()
        if baseline["gates"]:
            gates.activate()
    if api is not None and baseline["fixes"]:
        api.activate()
    now = _patches_applied()
    return [f"patch sets: {now} after re-applying, {baseline} at start-up"] if now != baseline else []


def _reset_package_caches() -> None:
    """Every module-level cache of the package, emptied through the one registry (accel_fp8_fix/caches.py)."""
    from .. import caches

    caches.reset()


class Baseline:
    """A rank's state after start-up, to return to after every run."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.sys_path = list(sys.path)
        self.cwd = os.getcwd()
        self.torch = _torch_flags()
        self.patches = _patches_applied()
        self.warning_filters = list(warnings.filters)
        self.loggers = {name: self._logger_state(logging.getLogger(name)) for name in _LOGGERS}
        self.threads = set(threading.enumerate())
        self.modules = set(sys.modules)
        self.callables = fingerprint()

    @classmethod
    def capture(cls) -> "Baseline":
        return cls()

    @staticmethod
    def _logger_state(logger: logging.Logger) -> tuple:
        return list(logger.handlers), logger.level, logger.propagate, logger.disabled

    def restore(self, run_module: str | None = None) -> list[str]:
        """Put the rank back; what the run left that could not be put back (empty: nothing). ``run_module``: the
        module of the run's function (what its package defines is never taken for a library's import)."""
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.sys_path
        _restore_libraries()
        _restore_torch(self.torch)
        left = _reapply_patches(self.patches)
        _reset_package_caches()
        self._restore_warnings_and_logging()
        gc.collect()
        first_imports = bool(set(sys.modules) - self.modules)
        return left + self._changed_callables(run_module) + self._new_threads(first_imports)

    def _restore_warnings_and_logging(self) -> None:
        warnings.filters[:] = self.warning_filters
        mutated = getattr(warnings, "_filters_mutated", None)  # how a filters change reaches the C cache (3.10-3.13)
        if mutated is not None:
            mutated()
        for module in list(sys.modules.values()):
            registry = getattr(module, "__warningregistry__", None)
            if isinstance(registry, dict):
                registry.clear()
        for name, (handlers, level, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled

    def _changed_callables(self, run_module: str | None) -> list[str]:
        """Watched callables the run replaced. A replacement made by a library the run imported for the first time
        (Transformer Engine's import patches ``torch.nn.Module.float`` / ``half`` / ``bfloat16``) is that library's
        import, which every later run would see too: it becomes part of the baseline."""
        now, imported = fingerprint(), set(sys.modules) - self.modules
        own = run_module.partition(".")[0] if run_module else None
        changed = []
        for key in sorted(now.keys() & self.callables.keys(), key=lambda k: tuple(part or "" for part in k)):
            if now[key] != self.callables[key]:
                origin = _origin(key)
                if origin in imported and (own is None or origin.partition(".")[0] != own):
                    self.callables[key] = now[key]
                else:
                    changed.append(key)
        for key in now.keys() - self.callables.keys():  # first imported by this run: watched from now on
            self.callables[key] = now[key]
        self.modules = set(sys.modules)
        return [f"{module}{'.' + attr if attr else ''}.{name} replaced and not restored"
                for module, attr, name in changed]

    def _new_threads(self, first_imports: bool, wait_s: float = 2.0) -> list[str]:
        """Threads the run left running. A run that imported a library for the first time may have started its
        process-wide workers (inductor's compile pool: ``ThreadPoolExecutor-*`` threads kept for reuse): those join
        the baseline; the same thread count growing again in a later run is reported."""
        left = [t for t in threading.enumerate()
                if t not in self.threads and t.is_alive() and not (t.daemon and t.name in LONG_LIVED_THREADS)]
        for thread in left:
            thread.join(wait_s / max(len(left), 1))
        left = [t for t in left if t.is_alive()]
        if first_imports:
            self.threads.update(left)
            return []
        return [f"thread {t.name!r} (daemon={t.daemon}) still running" for t in left]
