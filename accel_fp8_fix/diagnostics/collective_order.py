"""Cross-rank collective-order audit: what NCCL needs and gloo does not check.

gloo completes runs in which ranks issue different collectives, in a different order or with different sizes,
on the same process group; NCCL hangs on them (or corrupts data). This module records, on every rank, each
collective — from c10d's flight recorder where it was on from start-up (:class:`FlightRecorderTrail`, no cost per
op: ``run_distributed`` and ``RankPool`` turn it on), else as it reaches torch's dispatcher
(:class:`CollectiveRecorder`: ``c10d::*`` ops — what the Python c10d API lowers to — and the functional
``_c10d_functional::*`` ops that FSDP2 and DTensor issue) — then compares the ranks' sequences:

* per process group: every member rank must issue the same collectives (kind, dtype, element count) in the
  same order — else :func:`check` names the first divergent collective and the ranks;
* per pair of ranks: the collectives on all groups the two share must interleave in the same order (two
  groups used in opposite orders by two ranks deadlock NCCL even when each group's own sequence matches);
* none inside FSDP2's all-gather extension hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` of a tensor
  subclass — this package's FP8 shard, TE's quantized tensors, torchao's): FSDP2 runs them during an unshard, the
  pre-hook on its all-gather copy-in stream, and gathers on its own communicator right after; a collective issued
  there runs on that side stream and between FSDP2's own (NCCL: a hang or a race gloo completes). Each collective
  records the hook it was issued in (found on the Python stack when it reaches the dispatcher).

Use it three ways:

* ``accel_fp8_fix.testing.run_distributed`` records and checks by default (``audit_collectives=False``
  turns it off for one call);
* a launched job: ``ACCEL_FP8_FIX_COLLECTIVE_AUDIT=DIR accelerate launch ...`` (any process where the
  package's start-up hook runs — one of ``ACCEL_FP8_FIX``, ``ACCELERATE_FP8_ACCEL_FP8_FIX``,
  ``ACCEL_FP8_FIX_REHEARSAL`` or ``ACCEL_FP8_FIX_COLLECTIVE_AUDIT`` set — or after :func:`install` in the
  script) writes one file per rank when the process exits; ``python -m accel_fp8_fix.diagnostics.collective_order
  DIR`` checks them (exit 1 naming the divergence);
* in Python: ``with CollectiveRecorder() as rec: ...`` then ``check({rank: records, ...})``.

Recorded per collective: op kind (``all_reduce``, ``all_gather``, ...; the Python API's ``c10d::allreduce_`` and
the functional ``all_reduce`` are the same kind on the wire), the group's global ranks, dtype and the element
count of this rank's input; seen at the dispatcher (not from the flight recorder, which does not say) also the
reduce op (``sum``, ``max``, ``avg``...: ``reduce_op``) and an all-to-all's input dtype (``sent_dtype``) and this
rank's element count per destination (``splits``) — none compared: gpu_kit's probe derivation reads them.
``all_to_all`` counts may differ by rank (uneven splits) and are not compared;
point-to-point ``send`` / ``recv`` are not collectives and are not recorded. Limits: the calling thread's
collectives only (autograd's CPU backward runs in it).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path

from .. import settings

ENV_DIR = "ACCEL_FP8_FIX_COLLECTIVE_AUDIT"

__all__ = ["CollectiveRecorder", "Collective", "check", "check_dir", "inside_extension_hooks", "install", "load_dir",
           "ENV_DIR", "EXTENSION_HOOKS"]

# dispatcher op base name -> (kind, the schema argument holding this rank's input, compare counts?)
_KINDS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "broadcast": ("broadcast", "input"),
    "reduce_": ("reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "_allgather_base_": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input"),
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", None),
    "alltoall_base_": ("all_to_all", None),
    "all_to_all_single": ("all_to_all", None),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it. ``numel`` is None where ranks may legitimately differ."""

    kind: str
    op: str  # the dispatcher op, e.g. "c10d.allreduce_" or "_c10d_functional.all_gather_into_tensor"
    group: tuple[int, ...]
    dtype: str | None
    numel: int | None
    group_name: str = ""  # c10d's name: two groups of the same ranks are two communicators under NCCL
    inside: str = ""  # the FSDP2 all-gather extension hook it was issued in ("": none)
    reduce_op: str = ""  # "sum", "max", "avg"... (dispatcher records only; not compared)
    splits: tuple[int, ...] = ()  # all_to_all: this rank's input elements per destination (dispatcher records only)
    sent_dtype: str = ""  # all_to_all: the dtype sent (its ``dtype`` stays None, as from the flight recorder)

    def key(self) -> tuple:
        """What must agree across ranks (the op spelling may differ: Python API vs functional)."""
        return (self.kind, self.group, self.group_name, self.dtype, self.numel)

    @property
    def communicator(self) -> tuple:
        return (self.group, self.group_name)

    def __str__(self) -> str:
        size = "" if self.numel is None else f" numel={self.numel}"
        return f"{self.kind} ({self.op}) {self.dtype}{size} on group {list(self.group)}"


EXTENSION_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def _extension_hook_on_stack() -> str:
    """The FSDP2 all-gather extension hook (a method of that name) this thread is inside right now, or "" — read
    from the Python stack, only when a collective is recorded (a few per step)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in EXTENSION_HOOKS:
            return frame.f_code.co_name
        frame = frame.f_back
    return ""


def _tensors(obj, out: list) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    return out


def _group_of(args):
    """(global ranks, name) of the process group among a dispatcher op's arguments, or None."""
    import torch
    import torch.distributed as dist

    for a in args:
        group = None
        try:
            if isinstance(a, dist.ProcessGroup):
                group = a
            elif isinstance(a, torch.ScriptObject):
                group = dist.ProcessGroup.unbox(a)
            elif isinstance(a, str):
                from torch.distributed.distributed_c10d import _resolve_process_group

                group = _resolve_process_group(a)
        except Exception:  # noqa: BLE001 - a tag, a reduce op: not a group
            group = None
        if group is not None:
            try:
                ranks = tuple(dist.get_process_group_ranks(group))
            except Exception:  # noqa: BLE001 - the default group before registration
                ranks = tuple(range(dist.get_world_size()))
            return ranks, getattr(group, "group_name", "") or ""
    return None


def _describe(func, args, kwargs) -> Collective | None:
    namespace = getattr(func, "namespace", "")
    if namespace not in _NAMESPACES:
        return None
    base = func._schema.name.partition("::")[2]
    if base not in _KINDS:
        return None
    kind, payload_arg = _KINDS[base]
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    group = _group_of(list(bound.values()))
    if group is None:
        return None
    payload = _tensors(bound.get(payload_arg), []) if payload_arg else []
    dtype = str(payload[0].dtype).replace("torch.", "") if payload else None
    numel = sum(t.numel() for t in payload) if payload else None
    splits: tuple[int, ...] = ()
    sent_dtype = ""
    if kind == "all_to_all":  # dtype and numel stay None (as compared); what it sends and to whom are noted
        sent = _tensors(bound.get("input", bound.get("input_tensors")), [])
        sent_dtype = str(sent[0].dtype).replace("torch.", "") if sent else ""
        splits = _all_to_all_splits(sent, bound.get("input_split_sizes"), group[0])
    return Collective(kind=kind, op=f"{namespace}.{base}", group=group[0], dtype=dtype, numel=numel,
                      group_name=group[1], inside=_extension_hook_on_stack(), reduce_op=_reduce_op(bound),
                      splits=splits, sent_dtype=sent_dtype)


def _reduce_op(bound: dict) -> str:
    """The reduce op among a dispatcher op's arguments, lower case ("" where it has none or it cannot be read): the
    functional ops carry its name, c10d's a ``ReduceOp`` script object whose ``op()`` is the enum's value."""
    op = bound.get("reduce_op")
    if op is None:
        return ""
    if isinstance(op, str):
        return op.lower()
    try:
        import torch.distributed as dist

        return dist.ReduceOp.RedOpType(int(op.op())).name.lower()
    except Exception:  # noqa: BLE001 - an unknown spelling: not recorded
        return ""


def _all_to_all_splits(sent: list, input_split_sizes, group: tuple) -> tuple[int, ...]:
    """This rank's input elements per destination rank of an all-to-all."""
    if len(sent) > 1:  # c10d's list form: one tensor per destination
        return tuple(t.numel() for t in sent)
    if not sent:
        return ()
    tensor = sent[0]
    row = tensor.numel() // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0
    if input_split_sizes:
        return tuple(int(n) * row for n in input_split_sizes)
    parts = max(len(group), 1)
    return tuple([tensor.numel() // parts] * parts)


def _recorder_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _skip_code():
    """torch's ``skip_code`` (dynamo never compiles that code object's frames), or None where torch lacks it."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    return skip_code


class CollectiveRecorder(_recorder_base()):
    """A ``TorchDispatchMode`` that appends every collective this thread issues to ``records``.

    Ops on DTensors are handed to DTensor (``NotImplemented``, as torch's ``CommDebugMode`` does) with the
    recorder still active, so the collectives a DTensor issues for a redistribution are recorded as plain-tensor
    ops. Other tensor subclasses (TE's quantized tensors, fake tensors) run with the recorder suspended: they
    issue no collectives of their own.
    """

    def __init__(self):
        super().__init__()
        self.records: list[Collective] = []
        self._dtensor = _dtensor_type()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False where torch can mark the recorder's frame skipped (``_skip_own_frame``): torch otherwise wraps
        ``__torch_dispatch__`` in ``torch._disable_dynamo`` (torch/utils/_python_dispatch.py), four eval-frame
        switches on every op of the run — half of what the recorder cost a training step (docs/testing.md)."""
        return _skip_code() is None

    def __enter__(self):
        _skip_own_frame()  # again on every entry: resetting dynamo (the pools do between runs) may forget it
        return super().__enter__()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile's supported opt-in (torch/utils/_python_dispatch.py): without it dynamo skips every frame
        while the recorder is on ("non-infra torch dispatch mode present", torch/_dynamo/convert_frame.py), so an
        audited run never compiles. With it the recorder is off while dynamo compiles and on again when the
        compiled code runs: the collectives still reach it (FSDP2's run eagerly, outside dynamo's graphs)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # every op of the run passes here: a plain-tensor op that is no collective leaves after two cheap tests
        kwargs = kwargs or {}
        if types and any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # DTensor handles it with the recorder active: its redistributions are seen
        if getattr(func, "namespace", "") in _NAMESPACES:
            record = _describe_outside_dynamo()(func, args, kwargs)
            if record is not None:
                self.records.append(record)
        return func(*args, **kwargs)


# -- the same records from c10d's flight recorder: no cost per op ------------------------------------------------

FR_ENV = settings.FLIGHT_RECORDER  # c10d's flight recorder: how many collectives it keeps (0: off, the default)
FR_SINCE = (2, 11)  # the oldest torch whose gloo records into it that the suite checks (test_collective_order.py)
# What run_distributed and RankPool give their ranks, from start-up (c10d reads the variable once). A read costs
# ~80 us an entry kept (the dump symbolises every stack): 5x the suite's largest run (3,097 collectives, a 4-rank
# model-zoo plan) bounds a pooled rank's read at ~1.3 s; a run that outgrows it fails naming the variable.
FR_ENTRIES = settings.FLIGHT_RECORDER_ENTRIES

_FR_KINDS = {"all_reduce": "all_reduce", "sparse_all_reduce": "all_reduce", "broadcast": "broadcast",
             "reduce": "reduce", "all_gather": "all_gather", "all_to_all": "all_to_all", "gather": "gather",
             "scatter": "scatter", "barrier": "barrier", "reduce_scatter": "reduce_scatter"}
_C10_DTYPES = {"Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64", "Half": "float16",
               "Float": "float32", "Double": "float64", "BFloat16": "bfloat16", "Bool": "bool",
               "ComplexFloat": "complex64", "ComplexDouble": "complex128", "UInt16": "uint16", "UInt32": "uint32",
               "UInt64": "uint64"}


def flight_recorder_size() -> int:
    """The flight recorder's capacity this process asked for (``TORCH_FR_BUFFER_SIZE``, or NCCL's older name)."""
    for name in (FR_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            size = int(os.environ.get(name) or 0)
        except ValueError:
            size = 0
        if size > 0:
            return size
    return 0


def _dump_flight_recorder(stacks: bool = True) -> list[dict]:
    import pickle

    import torch

    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, stacks, False)).get("entries", [])


def _group_ranks() -> dict[str, tuple[int, ...]]:
    """c10d's name -> global ranks of every process group alive now."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    return {name: tuple(sorted(c10d._world.pg_group_ranks.get(group, {}))) or tuple(range(dist.get_world_size()))
            for group, name in list(c10d._world.pg_names.items())}


class FlightRecorderTrail:
    """The collectives this process issued from a point on, read from c10d's flight recorder instead of seen op by
    op: the records of :class:`CollectiveRecorder` (kind, group, dtype, element count, the FSDP2 extension hook on
    the stack) at none of its cost — a ``TorchDispatchMode`` puts every op of the run through Python (the test bed's
    step time x1.7, docs/testing.md). Needs the recorder on from start-up (``TORCH_FR_BUFFER_SIZE`` > 0 before
    torch starts: :func:`run_distributed` and ``RankPool`` set it). What differs from the dispatcher view, and how
    it is mended: gloo runs ``reduce_scatter`` as an ``all_reduce`` of the whole input (named from the Python frames
    of torch that issued it); the recorder keeps every thread's collectives (the dispatch mode: its own thread's);
    the op is the backend's name (``gloo:all_reduce``); send / recv are left out, as there."""

    def __init__(self):
        self._records: list[Collective] = []
        self._groups: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()  # a hung run's watchdog writes the audit from its own thread
        # entries before now belong to earlier runs (no stacks: a third of the cost of a full read)
        self._next_id = max((e["record_id"] for e in _dump_flight_recorder(stacks=False)), default=-1) + 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @property
    def records(self) -> list[Collective]:
        self._read()
        return self._records

    def remember_groups(self) -> None:
        """Note the ranks of the groups alive now (before one is destroyed: its records still name its ranks)."""
        self._groups.update(_group_ranks())

    def groups_ending(self, every_group: bool) -> None:
        """Before ``destroy_process_group``: one group's ranks are noted; when every group ends, what was recorded
        so far is read now, under the names it was issued with — c10d numbers the groups of the next
        ``init_process_group`` from 0 again."""
        if every_group:
            self._read()
            self._groups.clear()
        else:
            self.remember_groups()

    def _read(self) -> None:
        with self._lock:
            self._read_locked()

    def _read_locked(self) -> None:
        entries = sorted((e for e in _dump_flight_recorder() if e["record_id"] >= self._next_id),
                         key=lambda e: e["record_id"])
        if not entries:
            return
        if entries[0]["record_id"] != self._next_id:
            raise RuntimeError(
                f"collective-order audit: the flight recorder dropped {entries[0]['record_id'] - self._next_id} "
                f"collective(s) before they were read ({FR_ENV}={flight_recorder_size()} is too small for this run)")
        self.remember_groups()
        self._next_id = entries[-1]["record_id"] + 1
        self._records.extend(filter(None, map(self._collective, entries)))

    def _collective(self, entry: dict) -> Collective | None:
        backend_name = entry["profiling_name"]
        kind = _FR_KINDS.get(backend_name.partition(":")[2])
        if kind is None or entry.get("is_p2p"):
            return None
        frames = entry.get("frames") or []
        if kind == "all_reduce" and _issued_as_reduce_scatter(frames):
            kind = "reduce_scatter"
        sizes, dtypes = ((entry.get("output_sizes"), entry.get("output_dtypes")) if kind == "scatter"
                         else (entry.get("input_sizes"), entry.get("input_dtypes")))
        counted = kind not in ("all_to_all", "barrier") and bool(sizes)
        numel = sum(_product(s) for s in sizes) if counted else None
        dtype = _C10_DTYPES.get(dtypes[0], dtypes[0].lower()) if counted and dtypes else None
        name = str(entry["process_group"][0])
        inside = next((f["name"] for f in frames if f.get("name") in EXTENSION_HOOKS), "")
        return Collective(kind=kind, op=backend_name, group=self._groups.get(name, ()), dtype=dtype, numel=numel,
                          group_name=name, inside=inside)


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _issued_as_reduce_scatter(frames: list) -> bool:
    """Did torch issue this (gloo) all-reduce as a reduce-scatter? The innermost frame named after one of the two
    (c10d's ``reduce_scatter_tensor`` / ``reduce_scatter_single``, the functional ``reduce_scatter_tensor``; c10d's
    and the functional ``all_reduce``) decides; frames of modes or wrappers in between are passed over."""
    for frame in frames[:64]:
        name = frame.get("name", "")
        if "reduce_scatter" in name:
            return True
        if name.startswith(("all_reduce", "allreduce", "_all_reduce")):
            return False
    return False


def _skip_own_frame() -> None:
    """Dynamo never compiles the recorder's ``__torch_dispatch__`` frame; what it calls for a collective runs with
    dynamo off (``_describe_outside_dynamo``); the op itself runs as it would without the recorder."""
    skip = _skip_code()
    if skip is not None:
        skip(CollectiveRecorder.__torch_dispatch__.__code__)


@functools.cache
def _describe_outside_dynamo():
    import torch

    return torch._disable_dynamo(_describe, recursive=True)


# -- comparing ---------------------------------------------------------------------------------------------


def _per_group(records: list[Collective]) -> dict[tuple, list[Collective]]:
    out: dict[tuple, list[Collective]] = defaultdict(list)
    for r in records:
        out[r.communicator].append(r)
    return out


def _first_difference(a: list[Collective], b: list[Collective]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x.key() != y.key():
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(seq: list[Collective], i: int) -> str:
    return str(seq[i]) if i < len(seq) else f"nothing (it issued {len(seq)} on this group)"


def inside_extension_hooks(sequences: dict[int, list[Collective]]) -> list[str]:
    """One problem per rank that issued collectives inside FSDP2's all-gather extension hooks (the first one named,
    with how many in all)."""
    problems = []
    for rank in sorted(sequences):
        inside = [r for r in sequences[rank] if r.inside]
        if inside:
            problems.append(
                f"rank {rank} issued {len(inside)} collective(s) inside FSDP2's all-gather extension hooks, the first "
                f"{inside[0]} inside {inside[0].inside} (FSDP2 runs it during an unshard — on a GPU on its all-gather "
                "copy-in stream — and gathers on its own communicator right after: issue it before the unshard)")
    return problems


def _group_divergences(sequences: dict[int, list[Collective]]) -> list[str]:
    """Per communicator: the first collective its member ranks disagree on (kind, dtype, count, order)."""
    problems: list[str] = []
    by_rank_group = {rank: _per_group(seq) for rank, seq in sequences.items()}
    groups = sorted({g for per in by_rank_group.values() for g in per})
    for communicator in groups:
        group, name = communicator
        members = [r for r in group if r in sequences]
        if len(members) < 2:
            continue
        first = members[0]
        ref = by_rank_group[first].get(communicator, [])
        for other in members[1:]:
            seq = by_rank_group[other].get(communicator, [])
            i = _first_difference(ref, seq)
            if i is not None:
                label = f"group {list(group)}" + (f" ({name!r})" if name and len(groups) > len({g for g, _ in groups}) else "")
                problems.append(
                    f"{label}: collective #{i} differs between ranks {first} and {other}: "
                    f"rank {first} issued {_at(ref, i)}; rank {other} issued {_at(seq, i)}"
                )
                break
    return problems


def _pair_order_divergences(sequences: dict[int, list[Collective]]) -> list[str]:
    """Per pair of ranks: the first collective of their shared groups they issue in a different order."""
    problems = []
    for a, b in combinations(sorted(sequences), 2):
        sa = [r for r in sequences[a] if b in r.group]
        sb = [r for r in sequences[b] if a in r.group]
        i = _first_difference(sa, sb)
        if i is not None:
            problems.append(
                f"ranks {a} and {b} issue their shared groups' collectives in a different order (NCCL deadlocks): "
                f"shared collective #{i}: rank {a} issued {_at(sa, i)}; rank {b} issued {_at(sb, i)}"
            )
    return problems


def check(sequences: dict[int, list[Collective]]) -> list[str]:
    """The collectives issued inside FSDP2's all-gather extension hooks and the divergences between ranks'
    collective sequences (empty: none, and every group agrees). ``sequences`` maps each rank to what it recorded,
    in program order."""
    return inside_extension_hooks(sequences) + (_group_divergences(sequences) or _pair_order_divergences(sequences))


# -- launched jobs: one file per rank -------------------------------------------------------------------------

_installed: dict = {"recorder": None, "dir": None}
_install_lock = threading.Lock()


def _run_id() -> str:
    # The ranks of one launch share the rendezvous port and (torchrun, accelerate launch) the agent process.
    return f"run-{os.environ.get('MASTER_PORT', 'na')}-{os.getppid()}"


def dump(recorder: CollectiveRecorder, path: Path, rank: int, world_size: int, failed: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"rank": rank, "world_size": world_size, "failed": failed, "recorder": type(recorder).__name__,
               "records": [asdict(r) for r in recorder.records]}
    path.write_text(json.dumps(payload))


def _read(path: Path) -> tuple[dict, list[Collective]]:
    data = json.loads(path.read_text())
    records = [Collective(**dict(r, group=tuple(r["group"]), splits=tuple(r.get("splits", ()))))
               for r in data["records"]]
    return data, records


def load_dir(directory) -> dict[str, dict]:
    """``{run id: {"world_size", "failed", "sequences": {rank: [Collective]}, "recorders": {rank: class name}}}`` from a
    recording folder."""
    runs: dict[str, dict] = {}
    for path in sorted(Path(directory).glob("run-*/rank*.json")):
        data, records = _read(path)
        run = runs.setdefault(path.parent.name, {"world_size": data["world_size"], "failed": False, "sequences": {},
                                                 "recorders": {}})
        run["failed"] = run["failed"] or data["failed"]
        run["sequences"][data["rank"]] = records
        run["recorders"][data["rank"]] = data.get("recorder", "CollectiveRecorder")
    return runs


def check_dir(directory) -> list[str]:
    """Divergences in a folder written by launched ranks (``ACCEL_FP8_FIX_COLLECTIVE_AUDIT=DIR``). A run in
    which a rank exited on an exception is not compared (its failure is reported by the job itself); a run with
    ranks missing is reported."""
    problems = []
    for run_id, run in load_dir(directory).items():
        if run["failed"]:
            continue
        missing = sorted(set(range(run["world_size"])) - set(run["sequences"]))
        if missing:
            problems.append(f"{run_id}: no record from ranks {missing} of {run['world_size']} "
                            "(a rank that left with os._exit or was killed writes none)")
            continue
        problems.extend(f"{run_id}: {p}" for p in check(run["sequences"]))
    return problems


def _exiting_on_exception() -> bool:
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _start_recording() -> None:
    """After ``init_process_group``: push the recorder (this thread) and write its file at exit."""
    import torch.distributed as dist

    with _install_lock:
        if _installed["recorder"] is not None or _installed["dir"] is None:
            return  # recording already, or stopped (a pooled rank between runs)
        recorder = FlightRecorderTrail() if _flight_recorder_on() else CollectiveRecorder()
        recorder.__enter__()
        _installed["recorder"] = recorder
    _installed["path"] = Path(_installed["dir"]) / _run_id() / f"rank{dist.get_rank()}.json"
    _installed["world_size"] = dist.get_world_size()
    if not _installed.get("atexit"):
        _installed["atexit"] = True
        atexit.register(lambda: write_now(failed=_exiting_on_exception()))


def _flight_recorder_on() -> bool:
    """Record from the flight recorder when it was asked for before :func:`install` (torch reads the variable once,
    at the first process group; the start-up hook and the test bed's ranks set it first); else the dispatch mode."""
    if not flight_recorder_size() or _installed.get("flight_recorder_asked") is False:
        return False
    import torch
    from packaging.version import Version

    # gloo records into the flight recorder on the torch releases this is tested on (2.11-2.15; older: unchecked)
    return (Version(torch.__version__).release >= FR_SINCE and hasattr(torch._C._distributed_c10d, "_dump_fr_trace"))


def stop() -> None:
    """Stop recording (pooled ranks, after each run): the recorder leaves this thread's dispatch stack and the next
    ``init_process_group`` starts a new recording, into the folder of the next :func:`install`."""
    with _install_lock:
        recorder, _installed["recorder"], _installed["dir"] = _installed["recorder"], None, None
    if recorder is not None:
        recorder.__exit__(None, None, None)


def write_now(failed: bool = False) -> None:
    """Write what this process recorded so far (also done at exit); nothing if recording never started."""
    recorder = _installed["recorder"]
    if recorder is not None:
        rank = int(_installed["path"].stem[len("rank"):])
        dump(recorder, _installed["path"], rank, _installed["world_size"], failed=failed)


def install_hook() -> None:
    """Wrap ``init_process_group`` (and ``destroy_process_group``: the flight-recorder trail notes the ranks of the
    groups it ends) now, recording nothing until :func:`install` names a folder (pooled ranks: the wrappers are part
    of their start-up state, each run's folder comes with the run)."""
    import torch.distributed

    _wrap_init(torch.distributed)


def install(directory=None) -> None:
    """Record this process's collectives from ``init_process_group`` on; write them to ``directory`` (default:
    ``$ACCEL_FP8_FIX_COLLECTIVE_AUDIT``) at exit. Idempotent; a process group that already exists is recorded
    from now on."""
    directory = directory or os.environ.get(ENV_DIR)
    if not directory:
        raise ValueError(f"collective_order.install(): no folder given and {ENV_DIR} is not set")
    _installed["dir"] = str(directory)
    if not flight_recorder_size():
        # the flight recorder was not asked for before this process could have made a process group (the start-up
        # hook and the test bed's ranks ask first): record with the dispatch mode
        _installed["flight_recorder_asked"] = False
    if "torch.distributed" in sys.modules:
        _wrap_init(sys.modules["torch.distributed"])
    else:
        import wrapt

        wrapt.register_post_import_hook(_wrap_init, "torch.distributed")


def _wrap_init(dist_module) -> None:
    import torch.distributed.distributed_c10d as c10d
    import wrapt

    if dist_module.is_available() and dist_module.is_initialized():
        _start_recording()
        return

    def after_init(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        _start_recording()
        return result

    def before_destroy(wrapped, instance, args, kwargs):
        recorder = _installed["recorder"]
        if not isinstance(recorder, FlightRecorderTrail):
            return wrapped(*args, **kwargs)
        group = args[0] if args else kwargs.get("group")
        try:
            recorder.groups_ending(every_group=group is None or group is c10d.GroupMember.WORLD)
        except RuntimeError:  # collectives dropped: said once the groups are gone (nothing else half done)
            wrapped(*args, **kwargs)
            raise
        return wrapped(*args, **kwargs)

    for module in (c10d, dist_module):
        for name, hook in (("init_process_group", after_init), ("destroy_process_group", before_destroy)):
            if not getattr(getattr(module, name), "_self_accel_fp8_fix_audit", False):
                wrapper = wrapt.FunctionWrapper(getattr(module, name), hook)
                wrapper._self_accel_fp8_fix_audit = True
                setattr(module, name, wrapper)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m accel_fp8_fix.diagnostics.collective_order DIR", file=sys.stderr)
        return 2
    runs = load_dir(argv[0])
    problems = check_dir(argv[0])
    for p in problems:
        print(p)
    if not problems:
        print(f"collective order: {len(runs)} run(s), every group's ranks agree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
