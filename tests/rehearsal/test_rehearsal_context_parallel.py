"""The rehearsal's CPU ring attention is two entries in torch's CP handler table, added when torch's CP module is
imported, removed exactly by uninstall (`accel_fp8_fix/rehearsal/context_parallel.py`). The ring itself:
tests/distributed/test_context_parallel.py."""

import torch

from accel_fp8_fix.internals import torch_context_parallel
from accel_fp8_fix.rehearsal import context_parallel

CPU_OPS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def test_install_adds_only_the_cpu_flash_ops_and_uninstall_removes_exactly_them():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    stock = dict(_attention.custom_ops)
    try:
        context_parallel.uninstall()
        assert {k: v for k, v in _attention.custom_ops.items()} == {k: v for k, v in stock.items() if k not in CPU_OPS}
        assert not context_parallel.is_installed()
        context_parallel.install()
        context_parallel.install()  # idempotent
        table = torch_context_parallel.handler_table()
        assert table is _attention.custom_ops and context_parallel.is_installed()
        assert all(table[op] is context_parallel.cpu_flash_attention_handler for op in CPU_OPS)
        # torch's own entries (the CUDA kernels) untouched
        assert {k: v for k, v in table.items() if k not in CPU_OPS} == {k: v for k, v in stock.items()
                                                                         if k not in CPU_OPS}
        context_parallel.uninstall()
        assert not any(op in _attention.custom_ops for op in CPU_OPS)
    finally:
        _attention.custom_ops.clear()
        _attention.custom_ops.update(stock)
