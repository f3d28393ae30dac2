"""torch's context parallelism internals, for the rehearsal's CPU ring attention (``rehearsal/context_parallel.py``).

- ``torch.distributed.tensor.experimental._context_parallel._attention.custom_ops``: the handler table that
  ``_enable_cp_dtensor_dispatcher`` merges into DTensor's custom-op handlers while a ``context_parallel`` context is
  open (``{**existing_custom_ops, **custom_ops}``) and ``_disable_cp_dtensor_dispatcher`` drops again;
- its ``_templated_ring_attention`` / ``_templated_ring_attention_backward``: the ring (K/V rotation, the causal
  load-balancing chunks, the log-sum-exp merge), generic over the SDPA op it calls per block;
- DTensor's op dispatcher (``DTensor._op_dispatcher.unwrap_to_op_info`` / ``.wrap``), ``DTensorSpec`` /
  ``TensorMeta`` and ``_utils.compute_global_tensor_info``: a handler's way from DTensors to local tensors and back;
- ``_replaced_functions`` (the SDPA that ``context_parallel`` swapped in), ``existing_custom_ops`` (DTensor's handlers
  before CP) and ``_disable_context_parallel_dispatcher_impl``: how ``fixes/step/context_parallel.py`` tells that a CP
  context torch < 2.13 left on an exception is still dispatching, and turns it off.

The same texts in torch 2.11.0 to 2.15.0 (read from each release's wheel, 2026-12-04).
"""

from __future__ import annotations

ATTENTION_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
_ATTENTION = "distributed/tensor/experimental/_context_parallel/_attention.py"
# (file under torch/, text that must be in it): read, not imported.
_SOURCES = (
    (_ATTENTION, "def _templated_ring_attention(\n    group: dist.ProcessGroup,\n    seq_dim: int,\n"
                 "    op: _AttentionOp,\n    query: torch.Tensor,\n    key: torch.Tensor,\n    value: torch.Tensor,\n"
                 "    is_causal: bool = False,\n    **kwargs: object,\n)"),
    (_ATTENTION, "def _templated_ring_attention_backward(\n    group: dist.ProcessGroup,\n    seq_dim: int,\n"
                 "    op: _AttentionOp,\n    grad_out: torch.Tensor,\n    grad_out_name: str,\n"
                 "    query: torch.Tensor,\n    key: torch.Tensor,\n    value: torch.Tensor,\n    out: torch.Tensor,\n"
                 "    logsumexp: torch.Tensor,\n    is_causal: bool,\n    **kwargs: Any,\n)"),
    (_ATTENTION, "\ncustom_ops = {\n"),
    (_ATTENTION, "    DTensor._op_dispatcher._custom_op_handlers = {\n        **existing_custom_ops,\n"
                 "        **custom_ops,\n    }"),
    (_ATTENTION, "\n_replaced_functions: dict[Callable, tuple[str, Callable]] = {}\n"),
    (_ATTENTION, "\nexisting_custom_ops = DTensor._op_dispatcher._custom_op_handlers\n"),
    (_ATTENTION, "\ndef _disable_context_parallel_dispatcher_impl() -> None:\n"),
    ("distributed/tensor/_dispatch.py", "    def unwrap_to_op_info(\n"),
    ("distributed/tensor/_dispatch.py", "    def wrap(res: object, spec: OutputSpecType) -> object:"),
    ("distributed/tensor/_utils.py", "compute_global_tensor_info = "),
    ("distributed/tensor/_dtensor_spec.py", "class TensorMeta(NamedTuple):"),
    ("distributed/tensor/_dtensor_spec.py", "class DTensorSpec:"),
)


def check(versions) -> list[str]:
    from . import check_sources

    return check_sources("torch", versions, _SOURCES)


def handler_table() -> dict:
    """The CP handler table (``custom_ops``): what it holds is a DTensor custom-op handler while CP is enabled."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention.custom_ops


def ring_forward(group, op, query, key, value, is_causal: bool, **kwargs):
    """torch's ring attention forward over ``group`` with ``op`` per block (sequence dim 2); (out, lse, *rest)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention._templated_ring_attention(group, 2, op, query=query, key=key, value=value,
                                                is_causal=is_causal, **kwargs)


def ring_backward(group, op, grad_out, query, key, value, out, logsumexp, is_causal: bool, **kwargs):
    """torch's ring attention backward (``op``'s gradient argument is named ``grad_out``); (dq, dk, dv, *rest)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention._templated_ring_attention_backward(
        group, 2, op, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out,
        logsumexp=logsumexp, is_causal=is_causal, **kwargs)


def unwrap(op_call, args, kwargs):
    """(mesh, local args, local kwargs) of a DTensor op call, as DTensor's dispatcher unwraps it."""
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    return info.compute_mesh, info.local_args, info.local_kwargs


def wrap_like(local_results, mesh, placements):
    """DTensors on ``mesh`` with ``placements`` around ``local_results`` (their global shapes and strides computed
    from the local ones, as ``DTensor.from_local`` does), as a DTensor op handler returns them."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    specs = []
    for local in local_results:
        shape, stride = compute_global_tensor_info(local, mesh, placements)
        specs.append(DTensorSpec(mesh, tuple(placements),
                                 tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype)))
    return DTensor._op_dispatcher.wrap(tuple(local_results), tuple(specs))


def dispatch_left_on() -> bool:
    """Whether CP's dispatch is on outside any CP context: ``F.scaled_dot_product_attention`` is the wrapper
    ``context_parallel`` swapped in, or DTensor's custom handlers are not the ones from before CP."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return (F.scaled_dot_product_attention in _attention._replaced_functions
            or DTensor._op_dispatcher._custom_op_handlers is not _attention.existing_custom_ops)


def turn_dispatch_off() -> None:
    """What ``context_parallel`` runs when its context exits normally: SDPA restored, DTensor's handlers restored."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention._disable_context_parallel_dispatcher_impl()
