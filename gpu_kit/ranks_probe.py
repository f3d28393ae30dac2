"""Which backend can run several ranks on ONE GPU (torchrun worker; no Transformer Engine needed).

NCCL refuses two ranks on the same device; gloo moves CUDA tensors through host memory. Each collective
FSDP2 and TE use is tried on CUDA tensors and its values checked. Prints one ``RANKS_PROBE {json}`` line
per rank. Usage: ``torchrun --nproc_per_node 2 gpu_kit/ranks_probe.py gloo [cuda|cpu]`` (cpu: the probe's own
check, on CPU tensors).
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(backend: str, device_type: str = "cuda") -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = {"backend": backend, "rank": rank, "world_size": world, "ops": {}}

    def attempt(name, run):
        try:
            result["ops"][name] = "ok" if run() else "wrong values"
        except Exception as exc:  # noqa: BLE001  (the answer is the error)
            result["ops"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"

    def all_reduce():
        x = torch.full((8,), float(rank + 1), device=device)
        dist.all_reduce(x)
        return torch.equal(x, torch.full((8,), float(world * (world + 1) // 2), device=device))

    def all_reduce_max():
        x = torch.full((8,), float(rank + 1), device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return torch.equal(x, torch.full((8,), float(world), device=device))

    def all_gather_into_tensor():
        out = torch.empty(8 * world, device=device)
        dist.all_gather_into_tensor(out, torch.full((8,), float(rank), device=device))
        return torch.equal(out, torch.arange(world, device=device).float().repeat_interleave(8))

    def reduce_scatter_tensor():
        out = torch.empty(8, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(8 * world, device=device).float())
        return torch.equal(out, world * torch.arange(8 * rank, 8 * rank + 8, device=device).float())

    def reduce_scatter_tensor_avg():  # what FSDP2 uses for fp32 / bf16 gradients at world size > 1
        out = torch.empty(8, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(8 * world, device=device).float(), op=dist.ReduceOp.AVG)
        return torch.equal(out, torch.arange(8 * rank, 8 * rank + 8, device=device).float())

    def all_gather_into_tensor_bf16():  # FSDP2's all-gather in a bf16 parameter dtype
        out = torch.empty(8 * world, device=device, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.full((8,), float(rank), device=device, dtype=torch.bfloat16))
        return torch.equal(out.float(), torch.arange(world, device=device).float().repeat_interleave(8))

    def broadcast():
        x = torch.full((8,), float(rank), device=device)
        dist.broadcast(x, src=0)
        return torch.equal(x, torch.zeros(8, device=device))

    def all_to_all_single():  # context parallelism's "alltoall" rotation (and expert dispatch)
        out = torch.empty(2 * world, device=device)
        dist.all_to_all_single(out, torch.full((2 * world,), float(rank), device=device))
        return torch.equal(out, torch.arange(world, device=device).float().repeat_interleave(2))

    def all_gather_list():
        outs = [torch.empty(8, device=device) for _ in range(world)]
        dist.all_gather(outs, torch.full((8,), float(rank), device=device))
        return all(torch.equal(o, torch.full((8,), float(r), device=device)) for r, o in enumerate(outs))

    try:
        kwargs = {"device_id": device} if backend == "nccl" else {}
        result["device"] = str(device)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=30), **kwargs)
        result["init"] = "ok"
        for name, run in (("all_reduce", all_reduce), ("all_reduce_max", all_reduce_max),
                          ("all_gather_into_tensor", all_gather_into_tensor),
                          ("reduce_scatter_tensor", reduce_scatter_tensor),
                          ("reduce_scatter_tensor_avg", reduce_scatter_tensor_avg),
                          ("all_gather_into_tensor_bf16", all_gather_into_tensor_bf16), ("broadcast", broadcast),
                          ("all_gather", all_gather_list), ("all_to_all_single", all_to_all_single)):
            attempt(name, run)
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
