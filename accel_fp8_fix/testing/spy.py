"""``CollectiveSpy``: record every collective a block of code issues, to assert on it.

    from accel_fp8_fix.testing.spy import CollectiveSpy
    with CollectiveSpy() as spy:
        fsdp2_load_full_state_dict(accelerator, model, full_sd)
    spy.assert_no_dtensor()                       # no DTensor reached c10d (raised or not)
    assert spy.groups("all_reduce") == [(0, 1)]   # the amax all-reduce used group [0, 1]
    spy.nbytes("broadcast")                       # bytes broadcast by this rank's top-level calls

Two layers are recorded:

* ``layer="python"``: the Python c10d API. Every name in :data:`PYTHON_OPS` is wrapped on both
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` (library code calls either; calls
  made *inside* c10d, e.g. the broadcasts ``broadcast_object_list`` issues, go through the module
  globals of ``distributed_c10d`` and are recorded too, with ``depth`` > 0). Names bound earlier with
  ``from torch.distributed import broadcast`` are not seen at this layer.
* ``layer="dispatch"`` (``dispatch=True``, the default): a ``TorchDispatchMode`` that sees what reaches the
  dispatcher as a ``c10d.*`` op (what the Python API lowers to, and what DTensor dispatch rejects) or a
  ``_c10d_functional.*`` op (functional collectives: ``DTensor.full_tensor()``, ``redistribute``, FSDP2's
  all-gathers are issued this way), whoever called it. Limits: only the calling thread, and not ops that a
  tensor subclass issues from inside its own ``__torch_dispatch__`` while the mode is suspended.

Each record (:class:`CollectiveCall`) says: op, layer, whether any tensor argument was a DTensor, the
principal tensor's dtype / numel / bytes, the group's GLOBAL ranks, the root (global src/dst) when there is
one, the nesting depth and the error text if the call raised. Spies nest; exit them in LIFO order.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..distributed.dtensor import is_dtensor

__all__ = ["CollectiveSpy", "CollectiveCall", "PYTHON_OPS"]

# op name -> the argument whose tensor is "the payload" of this rank (what it sends / the buffer it fills)
PYTHON_OPS: dict[str, str | None] = {
    "broadcast": "tensor",
    "all_reduce": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "scatter": "tensor",
    "gather": "tensor",
    "barrier": None,
    "broadcast_object_list": None,
    "all_gather_object": None,
    "gather_object": None,
    "scatter_object_list": None,
    "send_object_list": None,
    "recv_object_list": None,
}
_ROOT_ARGS = (("src", False), ("group_src", True), ("dst", False), ("group_dst", True))
_FUNCTIONAL_NOT_COMMS = {"wait_tensor", "_wrap_tensor_autograd"}


@dataclass
class CollectiveCall:
    op: str  # "broadcast" (python layer) or "c10d.broadcast_" / "_c10d_functional.all_gather_into_tensor"
    layer: str  # "python" | "dispatch"
    rank: int | None
    dtensor: bool  # any tensor argument was a DTensor
    dtype: torch.dtype | None
    numel: int
    nbytes: int
    group_ranks: tuple[int, ...] | None  # GLOBAL ranks of the group (None: unknown)
    root: int | None = None  # GLOBAL src / dst rank, when the op has one
    depth: int = 0  # 0: called from user code; > 0: issued inside another recorded python-level call
    error: str | None = None

    @property
    def top_level(self) -> bool:
        return self.depth == 0

    def __str__(self) -> str:
        where = f"group={list(self.group_ranks)}" if self.group_ranks is not None else "group=?"
        extra = f" root={self.root}" if self.root is not None else ""
        dt = " DTensor" if self.dtensor else ""
        err = f" RAISED {self.error}" if self.error else ""
        return f"[{self.layer}/d{self.depth}] {self.op}{dt} {self.dtype} numel={self.numel} {where}{extra}{err}"


def _leaves(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _leaves(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _leaves(o, out)
    return out


def _payload(tensors):
    if not tensors:
        return None, 0, 0
    numel = sum(t.numel() for t in tensors)
    return tensors[0].dtype, numel, sum(t.numel() * t.element_size() for t in tensors)


def _ranks_of(group) -> tuple[int, ...] | None:
    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            return None
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:  # noqa: BLE001 - a group this rank is not in, or a destroyed one
        return None


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class _Local(threading.local):
    depth = 0


_local = _Local()


class CollectiveSpy:
    """Context manager recording collectives (see the module docstring)."""

    def __init__(self, dispatch: bool = True, ops: tuple[str, ...] | None = None):
        self.dispatch = dispatch
        self.ops = tuple(ops) if ops is not None else tuple(PYTHON_OPS)
        self.records: list[CollectiveCall] = []
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode = None

    # -- context ---------------------------------------------------------------------------------------
    def __enter__(self) -> "CollectiveSpy":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped_by_original: dict[int, Callable] = {}
        for name in self.ops:
            for module in (c10d, dist):
                original = getattr(module, name, None)
                if original is None:
                    continue
                wrapper = wrapped_by_original.get(id(original))
                if wrapper is None:
                    wrapper = wrapped_by_original[id(original)] = self._wrap(name, original)
                self._saved.append((module, name, original))
                setattr(module, name, wrapper)
        if self.dispatch:
            self._mode = _DispatchSpy(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):  # pragma: no cover
            signature = None
        principal = PYTHON_OPS.get(name)
        spy = self

        @functools.wraps(original)
        def recorder(*args, **kwargs):
            record = spy._python_record(name, signature, principal, args, kwargs)
            _local.depth += 1
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                _local.depth -= 1

        recorder.__wrapped_by_collective_spy__ = True
        return recorder

    def _python_record(self, name, signature, principal, args, kwargs) -> CollectiveCall:
        bound = {}
        if signature is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
        every = _leaves(list(args) + list(kwargs.values()), [])
        main = _leaves(bound.get(principal), []) if principal else []
        dtype, numel, nbytes = _payload(main)
        group = bound.get("group")
        root = None
        for arg, is_group_rank in _ROOT_ARGS:
            value = bound.get(arg)
            if value is not None:
                root = value
                if is_group_rank:
                    try:
                        import torch.distributed as dist

                        root = dist.get_global_rank(group if group is not None else dist.group.WORLD, value)
                    except Exception:  # noqa: BLE001
                        pass
                break
        record = CollectiveCall(
            op=name, layer="python", rank=_rank(), dtensor=any(is_dtensor(t) for t in every), dtype=dtype,
            numel=numel, nbytes=nbytes, group_ranks=_ranks_of(group), root=root, depth=_local.depth,
        )
        self._add(record)
        return record

    def _add(self, record: CollectiveCall) -> None:
        with self._lock:
            self.records.append(record)

    # -- queries ---------------------------------------------------------------------------------------
    def calls(self, op: str | None = None, *, layer: str | None = "python", top_level: bool | None = None):
        """Records, filtered: ``op`` matches the python name or the dispatcher op (``"c10d.broadcast_"``,
        or just ``"broadcast_"``); ``layer`` "python" (default), "dispatch" or None for both."""
        out = []
        for r in list(self.records):
            if layer is not None and r.layer != layer:
                continue
            if top_level is not None and r.top_level != top_level:
                continue
            if op is not None and r.op != op and r.op.rpartition(".")[2] != op:
                continue
            out.append(r)
        return out

    @property
    def dtensor_calls(self) -> list[CollectiveCall]:
        return [r for r in self.records if r.dtensor]

    def assert_no_dtensor(self) -> None:
        bad = self.dtensor_calls
        if bad:
            raise AssertionError("a DTensor reached c10d:\n  " + "\n  ".join(map(str, bad)))

    def nbytes(self, op: str | None = None, *, layer: str | None = "python", top_level: bool | None = True) -> int:
        return sum(r.nbytes for r in self.calls(op, layer=layer, top_level=top_level))

    def groups(self, op: str | None = None, *, layer: str | None = "python", top_level: bool | None = True):
        """Distinct group rank tuples used by ``op`` (first-use order)."""
        seen = []
        for r in self.calls(op, layer=layer, top_level=top_level):
            if r.group_ranks not in seen:
                seen.append(r.group_ranks)
        return seen

    def clear(self) -> None:
        with self._lock:
            self.records.clear()

    def summary(self) -> str:
        return "\n".join(map(str, self.records)) or "(no collectives)"


def _dispatch_mode_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _DispatchSpy(_dispatch_mode_base()):
    """Records ``c10d.*`` and ``_c10d_functional.*`` ops as they reach the dispatcher."""

    def __init__(self, spy: CollectiveSpy):
        super().__init__()
        self.spy = spy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            base = func._schema.name.partition("::")[2]
            if base not in _FUNCTIONAL_NOT_COMMS:
                record = self._record(func, namespace, base, types, args, kwargs)
                try:
                    return func(*args, **kwargs)
                except BaseException as exc:
                    record.error = f"{type(exc).__name__}: {exc}"
                    raise
        return func(*args, **kwargs)

    def _record(self, func, namespace, base, types, args, kwargs) -> CollectiveCall:
        everything = _leaves(list(args) + list(kwargs.values()), [])
        first = _leaves(args[0], []) if args else []
        dtensor = any(is_dtensor(t) for t in everything) or any(
            getattr(t, "__name__", "") == "DTensor" for t in types
        )
        dtype, numel, nbytes = _payload(first)
        group = None
        for a in list(args) + list(kwargs.values()):
            group = _group_from_dispatch_arg(a)
            if group is not None:
                break
        record = CollectiveCall(
            op=f"{namespace}.{base}", layer="dispatch", rank=_rank(), dtensor=dtensor, dtype=dtype, numel=numel,
            nbytes=nbytes, group_ranks=_ranks_of(group) if group is not None else None, depth=_local.depth,
        )
        self.spy._add(record)
        return record


def _group_from_dispatch_arg(a):
    import torch.distributed as dist

    try:
        if isinstance(a, dist.ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a)
        if isinstance(a, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(a)
    except Exception:  # noqa: BLE001 - not a process group (a reduce op, a tag, ...)
        return None
    return None
