"""Context parallelism on CPU ranks: torch's ring attention with the CPU flash-attention kernel per block.

torch's ``context_parallel`` (what accelerate's ``maybe_context_parallel`` opens) shards the sequence dim of the
given buffers and runs ``F.scaled_dot_product_attention`` on DTensors; DTensor hands the SDPA kernel op to CP's
handler table, which maps only the CUDA kernels (flash, memory-efficient, cuDNN) to the ring. On CPU the op is
``aten._scaled_dot_product_flash_attention_for_cpu``, absent from the table: "does not have a sharding strategy
registered" at the first forward, in torch 2.11 to 2.15 alike.

The rehearsal adds the CPU kernel's forward and backward ops to that table, each handled exactly as torch handles
``_scaled_dot_product_flash_attention``: the local blocks go through torch's own ring
(``_templated_ring_attention`` / ``_backward``: K/V rotation, the load balancer's causal chunks, the log-sum-exp
merge), calling the CPU flash kernel per block. The CPU kernel is the same online-softmax (flash) algorithm as
the CUDA one, with the same outputs (the output and an fp32 log-sum-exp per query row): only its block sizes, and
so the summation order inside a block, differ (docs/rehearsal.md, "Context parallelism"). The table is torch's:
CP's enable merges it into DTensor's handlers and its disable drops it again, so nothing is active outside a CP
context. Installed only by the rehearsal (never with CUDA present), when torch's CP module is imported;
:func:`uninstall` removes the two entries. The private pieces: ``internals/torch_context_parallel.py``.
"""

from __future__ import annotations

import threading

from ..engine.import_hooks import when_imported
from ..internals import torch_context_parallel

__all__ = ["install", "uninstall", "is_installed"]

_lock = threading.Lock()
_wanted = False


def _ops():
    import torch

    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def install() -> None:
    """Add the CPU flash-attention ops to CP's handler table, now or when torch's CP module is imported."""
    global _wanted
    with _lock:
        _wanted = True
    when_imported(torch_context_parallel.ATTENTION_MODULE, _add)


def uninstall() -> None:
    global _wanted
    with _lock:
        _wanted = False
        import sys

        if torch_context_parallel.ATTENTION_MODULE in sys.modules:
            table = torch_context_parallel.handler_table()
            for op in _ops():
                if table.get(op) is cpu_flash_attention_handler:
                    del table[op]


def is_installed() -> bool:
    import sys

    if torch_context_parallel.ATTENTION_MODULE not in sys.modules:
        return _wanted
    table = torch_context_parallel.handler_table()
    return all(table.get(op) is cpu_flash_attention_handler for op in _ops())


def _add(_module) -> None:
    with _lock:
        if not _wanted:
            return
        import torch

        if torch.cuda.is_available():  # the rehearsal refuses CUDA machines; never change a GPU run's CP
            return
        table = torch_context_parallel.handler_table()
        for op in _ops():
            table.setdefault(op, cpu_flash_attention_handler)


def _sequence_sharded(mesh, args) -> tuple:
    """The placements of the call's DTensor arguments: all the same, one mesh dim, ``Shard(2)`` (the sequence of
    ``[batch, heads, sequence, head_dim]``) — what CP's SDPA input function makes; anything else is refused."""
    from torch.distributed.tensor import DTensor, Shard

    placements = {tuple(a.placements) for a in args if isinstance(a, DTensor)}
    if mesh.ndim != 1 or placements != {(Shard(2),)}:
        raise NotImplementedError(
            "accel_fp8_fix rehearsal: CPU ring attention takes query/key/value sharded on their sequence dim (2) "
            f"over one CP mesh dim, as torch's context_parallel shards them; got placements {sorted(placements)} "
            f"on a {mesh.ndim}-D mesh")
    return (Shard(2),)


def _forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return query, key, value, dropout_p, is_causal, attn_mask, scale


def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    return grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale


def cpu_flash_attention_handler(op_call, args, kwargs):
    """CP's handler for the CPU flash-attention ops (the signature of torch's ``_sdpa_handler``)."""
    forward_op, backward_op = _ops()
    mesh, local_args, local_kwargs = torch_context_parallel.unwrap(op_call, args, kwargs)
    placements = _sequence_sharded(mesh, list(args) + list(kwargs.values()))
    group = mesh.get_group()
    if op_call == forward_op:
        query, key, value, dropout_p, is_causal, attn_mask, scale = _forward(*local_args, **local_kwargs)
        _refuse_mask(attn_mask)
        out, lse, *_ = torch_context_parallel.ring_forward(
            group, forward_op, query, key, value, is_causal, dropout_p=dropout_p, scale=scale)
        return torch_context_parallel.wrap_like((out, lse), mesh, placements)
    grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask, scale = _backward(
        *local_args, **local_kwargs)
    _refuse_mask(attn_mask)
    grads = torch_context_parallel.ring_backward(
        group, backward_op, grad_out, query, key, value, out, lse, is_causal, dropout_p=dropout_p, scale=scale)
    return torch_context_parallel.wrap_like(grads[:3], mesh, placements)


def _refuse_mask(attn_mask) -> None:
    if attn_mask is not None:  # torch's ring refuses attn_bias for the CUDA kernels too
        raise NotImplementedError("accel_fp8_fix rehearsal: CPU ring attention with an attention mask is not "
                                  "supported (torch's CP takes none: is_causal=True, no mask)")
