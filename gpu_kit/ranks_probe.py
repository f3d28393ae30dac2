"""Which backend can run several ranks on ONE GPU (torchrun worker; standard library + torch only: no Transformer
Engine, no accel_fp8_fix).

NCCL refuses two ranks on the same device; gloo moves CUDA tensors through host memory, but not every collective
of every dtype. The probe tries exactly the collectives the rank jobs issue — ``probe_ops.json`` beside this file
(the union over its jobs; ``python -m gpu_kit.derive_probe`` derives it from the jobs' collective-order audit on
CPU): each on the device's tensors in its dtype, with its reduce op, its form (one tensor, a list, coalesced), its
API (``torch.distributed`` or the functional collectives of DTensor / EP / CP) and, for an uneven all-to-all, uneven
splits (some of them empty); every result's values are checked. Prints one ``RANKS_PROBE {json}`` line per rank:
``{"backend", "rank", "world_size", "device", "init": "ok"|error, "ops": {op_name: "ok"|error}}``
(``gpu_kit.probe_ops.job_verdict`` turns the lines into a verdict per job). Runs at any world size >= 2.
Usage: ``torchrun --nproc_per_node N gpu_kit/ranks_probe.py gloo [cuda|cpu]`` (cpu: the probe's own check, on CPU
tensors); ``GPU_KIT_PROBE_OPS=FILE`` reads another ops file.
"""

import contextlib
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

OPS_FILE = Path(__file__).resolve().with_name("probe_ops.json")
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
FORMS = {  # (kind, api) -> the forms the probe can issue
    ("all_reduce", "c10d"): ("tensor", "coalesced"), ("all_reduce", "functional"): ("tensor", "coalesced"),
    ("all_gather", "c10d"): ("tensor", "list", "coalesced"), ("all_gather", "functional"): ("tensor", "coalesced"),
    ("reduce_scatter", "c10d"): ("tensor", "list", "coalesced"),
    ("reduce_scatter", "functional"): ("tensor", "coalesced"),
    ("broadcast", "c10d"): ("tensor",), ("broadcast", "functional"): ("tensor",),
    ("all_to_all", "c10d"): ("tensor", "list"), ("all_to_all", "functional"): ("tensor",),
    ("barrier", "c10d"): ("tensor",), ("reduce", "c10d"): ("tensor",),
    ("gather", "c10d"): ("list",), ("scatter", "c10d"): ("list",),
}
NEEDS_DTYPE = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce", "gather", "scatter")


def load_ops(path=None) -> dict:
    """``{op_name: spec}``: the union of the ops of every job in the ops file."""
    data = json.loads(Path(path or os.environ.get("GPU_KIT_PROBE_OPS") or OPS_FILE).read_text())
    used = {op for ops in data["jobs"].values() for op in ops}
    return {name: spec for name, spec in data["ops"].items() if name in used}


def unsupported(spec: dict) -> str | None:
    """Why the probe cannot issue this op (None: it can) — a derived op the probe does not know is a failure of that
    op, never a silent skip."""
    kind, api, form = spec.get("kind"), spec.get("api", "c10d"), spec.get("form", "tensor")
    if form not in FORMS.get((kind, api), ()):
        return f"no probe for {kind} in form {form!r} through the {api} API"
    if kind in NEEDS_DTYPE and not isinstance(getattr(torch, str(spec.get("dtype")), None), torch.dtype):
        return f"no probe for dtype {spec.get('dtype')!r} (not a torch dtype here)"
    if kind in ("all_reduce", "reduce_scatter", "reduce") and spec.get("reduce_op") not in REDUCE_OPS:
        return f"no probe for reduce op {spec.get('reduce_op')!r}"
    return None


def _reduced(values, op: str) -> float:
    if op == "sum":
        return float(sum(values))
    if op == "avg":
        return sum(values) / len(values)
    if op == "max":
        return float(max(values))
    if op == "min":
        return float(min(values))
    return float(math.prod(values))


def _wait(tensor):
    return tensor.wait() if hasattr(tensor, "wait") else tensor


class Probe:
    """The collectives of the ops file, issued on the world group on ``device``."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.group = dist.group.WORLD

    # -- tensors and checks ---------------------------------------------------------------------------------
    def full(self, n: int, value: float, dtype) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.float64).to(dtype).to(self.device)

    def cat(self, parts) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64, device=self.device)

    @staticmethod
    def same(got, expected) -> bool:
        got, expected = got.detach().cpu().double(), expected.detach().cpu().double()
        if got.shape != expected.shape:
            return False
        return bool(torch.allclose(got, expected, rtol=2 ** -6, atol=0))  # bf16 / fp16 / fp8 round a reduction

    # -- ops ------------------------------------------------------------------------------------------------
    def run(self, spec: dict) -> bool:
        why = unsupported(spec)
        if why:
            raise NotImplementedError(why)
        kind = spec["kind"]
        dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else torch.float32
        return getattr(self, kind)(spec, dtype, spec.get("api", "c10d"), spec.get("form", "tensor"))

    def barrier(self, spec, dtype, api, form) -> bool:
        dist.barrier()
        return True

    def _c10d_op(self, name: str):
        return getattr(dist.ReduceOp, name.upper())

    def all_reduce(self, spec, dtype, api, form) -> bool:
        op, w, r = spec["reduce_op"], self.world, self.rank
        tensors = [self.full(8, r + 1, dtype), self.full(3, 2 * (r + 1), dtype)]
        expected = [self.full(8, _reduced([q + 1 for q in range(w)], op), torch.float64),
                    self.full(3, _reduced([2 * (q + 1) for q in range(w)], op), torch.float64)]
        if form == "tensor":
            tensors, expected = tensors[:1], expected[:1]
        if api == "functional":
            import torch.distributed._functional_collectives as fc

            outs = ([_wait(fc.all_reduce(tensors[0], op, self.group))] if form == "tensor"
                    else [_wait(t) for t in fc.all_reduce_coalesced(tensors, op, self.group)])
        else:
            with self._coalescing(form):
                for t in tensors:
                    dist.all_reduce(t, op=self._c10d_op(op))
            outs = tensors
        return all(self.same(o, e) for o, e in zip(outs, expected))

    def reduce(self, spec, dtype, api, form) -> bool:
        op, w, r = spec["reduce_op"], self.world, self.rank
        x = self.full(8, r + 1, dtype)
        dist.reduce(x, dst=0, op=self._c10d_op(op))
        return r != 0 or self.same(x, self.full(8, _reduced([q + 1 for q in range(w)], op), torch.float64))

    @contextlib.contextmanager
    def _coalescing(self, form):
        """c10d's coalescing (what FSDP2 / DTensor issue as ``*_coalesced_`` ops); a backend without it (gloo) raises,
        and the group's half-open coalescing state is dropped so that the next op runs on its own."""
        if form != "coalesced":
            yield
            return
        from torch.distributed import distributed_c10d as c10d

        try:
            with c10d._coalescing_manager(group=self.group, device=self.device):
                yield
        finally:
            c10d._world.pg_coalesce_state.pop(c10d._get_default_group() if self.group is None else self.group, None)

    def all_gather(self, spec, dtype, api, form) -> bool:
        w, r, n = self.world, self.rank, 4
        inputs = [self.full(n, r + 1, dtype), self.full(n + 1, 2 * r + 1, dtype)]
        expected = [self.cat([self.full(n, q + 1, torch.float64) for q in range(w)]),
                    self.cat([self.full(n + 1, 2 * q + 1, torch.float64) for q in range(w)])]
        if form != "coalesced":
            inputs, expected = inputs[:1], expected[:1]
        if api == "functional":
            import torch.distributed._functional_collectives as fc

            outs = ([_wait(fc.all_gather_tensor(inputs[0], 0, self.group))] if form == "tensor"
                    else [_wait(t) for t in fc.all_gather_into_tensor_coalesced(inputs, self.group)])
        elif form == "list":
            parts = [torch.empty(n, dtype=dtype, device=self.device) for _ in range(w)]
            dist.all_gather(parts, inputs[0])
            outs = [torch.cat(parts)]
        else:
            outs = [torch.empty(t.numel() * w, dtype=dtype, device=self.device) for t in inputs]
            with self._coalescing(form):
                for out, t in zip(outs, inputs):
                    dist.all_gather_into_tensor(out, t)
        return all(self.same(o, e) for o, e in zip(outs, expected))

    def reduce_scatter(self, spec, dtype, api, form) -> bool:
        op, w, r, n = spec["reduce_op"], self.world, self.rank, 4

        def contribution(q, dest, k):  # what rank q sends to rank dest (k: the coalesced second tensor)
            return (q + 1) * (k + 1) + w * dest

        inputs = [self.cat([self.full(n, contribution(r, d, k), dtype) for d in range(w)]) for k in range(2)]
        expected = [self.full(n, _reduced([contribution(q, r, k) for q in range(w)], op), torch.float64)
                    for k in range(2)]
        if form != "coalesced":
            inputs, expected = inputs[:1], expected[:1]
        if api == "functional":
            import torch.distributed._functional_collectives as fc

            outs = ([_wait(fc.reduce_scatter_tensor(inputs[0], op, 0, self.group))] if form == "tensor"
                    else [_wait(t) for t in fc.reduce_scatter_tensor_coalesced(inputs, op, [0, 0], self.group)])
        elif form == "list":
            out = torch.empty(n, dtype=dtype, device=self.device)
            dist.reduce_scatter(out, list(inputs[0].chunk(w)), op=self._c10d_op(op))
            outs = [out]
        else:
            outs = [torch.empty(n, dtype=dtype, device=self.device) for _ in inputs]
            with self._coalescing(form):
                for out, t in zip(outs, inputs):
                    dist.reduce_scatter_tensor(out, t, op=self._c10d_op(op))
        return all(self.same(o, e) for o, e in zip(outs, expected))

    def broadcast(self, spec, dtype, api, form) -> bool:
        src = self.world - 1  # not rank 0 alone: a root other than the first
        x = self.full(8, self.rank + 1, dtype)
        if api == "functional":
            import torch.distributed._functional_collectives as fc

            x = _wait(fc.broadcast(x, src, self.group))
        else:
            dist.broadcast(x, src=src)
        return self.same(x, self.full(8, src + 1, torch.float64))

    def gather(self, spec, dtype, api, form) -> bool:
        w, r = self.world, self.rank
        parts = [torch.empty(4, dtype=dtype, device=self.device) for _ in range(w)] if r == 0 else None
        dist.gather(self.full(4, r + 1, dtype), gather_list=parts, dst=0)
        return r != 0 or all(self.same(p, self.full(4, q + 1, torch.float64)) for q, p in enumerate(parts))

    def scatter(self, spec, dtype, api, form) -> bool:
        w, r = self.world, self.rank
        out = torch.empty(4, dtype=dtype, device=self.device)
        parts = [self.full(4, q + 1, dtype) for q in range(w)] if r == 0 else None
        dist.scatter(out, scatter_list=parts, src=0)
        return self.same(out, self.full(4, r + 1, torch.float64))

    def all_to_all(self, spec, dtype, api, form) -> bool:
        w = self.world
        # even: 2 elements to each rank; uneven: (q + d) % w elements from q to d (empty ones too: CP's rotation
        # sends to one peer only), then q + d + 1 (every one different, none empty)
        patterns = [lambda q, d: (q + d) % w, lambda q, d: q + d + 1] if spec.get("uneven") else [lambda q, d: 2]
        return all(self._all_to_all(dtype, api, form, sizes) for sizes in patterns)

    def _all_to_all(self, dtype, api, form, sizes) -> bool:
        w, r = self.world, self.rank
        value = lambda q, d: q * w + d + 1  # noqa: E731  (what q sends to d)
        chunks = [self.full(sizes(r, d), value(r, d), dtype) for d in range(w)]
        expected = self.cat([self.full(sizes(q, r), value(q, r), torch.float64) for q in range(w)])
        in_splits, out_splits = [sizes(r, d) for d in range(w)], [sizes(q, r) for q in range(w)]
        if api == "functional":
            import torch.distributed._functional_collectives as fc

            out = _wait(fc.all_to_all_single(torch.cat(chunks), out_splits, in_splits, self.group))
        elif form == "list":
            outs = [torch.empty(n, dtype=dtype, device=self.device) for n in out_splits]
            dist.all_to_all(outs, chunks)
            out = torch.cat(outs)
        else:
            out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
            dist.all_to_all_single(out, torch.cat(chunks), out_splits, in_splits)
        return self.same(out, expected)


def main(backend: str, device_type: str = "cuda") -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = {"backend": backend, "rank": rank, "world_size": world, "device": str(device), "ops": {}}
    try:
        ops = load_ops()
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=30), **kwargs)
        result["init"] = "ok"
        probe = Probe(rank, world, device)
        for name, spec in ops.items():
            try:
                result["ops"][name] = "ok" if probe.run(spec) else "wrong values"
            except Exception as exc:  # noqa: BLE001  (the answer is the error)
                result["ops"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        result["init"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        sys.stdout.flush()
        os.write(1, ("RANKS_PROBE " + json.dumps(result) + "\n").encode())  # one write: ranks share the pipe
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gloo", sys.argv[2] if len(sys.argv) > 2 else "cuda")
