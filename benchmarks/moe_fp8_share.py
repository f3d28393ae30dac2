"""FP8 share of an MoE training step's GEMM FLOPs, before and after the experts ran on TE grouped GEMMs
(fixes/convert/moe_experts.py), in one run.

A real ``Accelerator(mixed_precision="fp8", FSDP2 plugin, TERecipeKwargs(HYBRID delayed))`` on 2 gloo ranks
(``accel_fp8_fix.testing.run_distributed``), Transformer Engine 2.20.2's Python over the CPU kernel shim; the model is
transformers' ``Qwen3MoeForCausalLM`` with a real MoE's proportions (``accel_fp8_fix.testing.training.
proportioned_qwen3_moe``: 32 experts, top-8, expert MLP 32 of hidden 64 — Qwen3-30B-A3B has 128 experts, top-8, 768
of 2048). "Before": the same prepare with the experts left to transformers (what the package did before issue 19);
"after": the package's prepare as it is; both in the same ranks, one after the other. Measured on the last of 2 steps,
rank 0 (``gemm_share``; 8 x 64 tokens a rank, ~128 rows an expert): every TE GEMM from its operands (2 m n k, FP8
when both operands are TE quantized tensors; a grouped GEMM per group), every other matmul at the dispatcher (aten
mm / addmm / bmm / baddbmm / _grouped_mm: transformers' experts, the routers, lm_head) — ``GemmFlops``.

Run: ``python benchmarks/moe_fp8_share.py`` (~1 min on 2 cores).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

LR = 0.02
RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}  # the suite's (fp8_scenarios)


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= int(v)
    return result


class GemmFlops:
    """FLOPs of a step's GEMMs, split FP8 / high precision: TE's GEMMs (``generic_gemm``, each group of
    ``te_general_grouped_gemm``) from their operands (2 m n k; FP8 when both operands are TE quantized tensors), every
    other matmul at the dispatcher (aten mm / addmm / bmm / baddbmm / _grouped_mm, e.g. transformers' experts)."""

    MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")

    def __init__(self):
        self.fp8 = self.high = 0
        self._inside_te = 0

    @staticmethod
    def _rows_cols(t):
        shape = list(t.size())
        return (int(_prod(shape[:-1])), int(shape[-1])) if len(shape) > 1 else (1, int(shape[0]))

    def _te_flops(self, a, transa, b, transb) -> int:
        (ar, ac), (br, bc) = self._rows_cols(a), self._rows_cols(b)
        n, k = (ar, ac) if transa else (ac, ar)
        m = bc if transb else br
        return 2 * m * n * k

    def _count_te(self, pairs, transa, transb):
        for a, b in pairs:
            flops = self._te_flops(a, transa, b, transb)
            quantized = all(type(t).__module__.startswith("transformer_engine.") for t in (a, b))
            if quantized:
                self.fp8 += flops
            else:
                self.high += flops

    def _counting(self, original, pairs_of):
        def gemm(*args, **kwargs):
            if not self._inside_te:  # the CPU shim's grouped GEMM calls its generic_gemm per group: counted once
                self._count_te(pairs_of(args), args[1], args[3])
            self._inside_te += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside_te -= 1
        return gemm

    def wrap(self, tex):
        """Count TE's GEMMs (a grouped GEMM group by group, empty groups skipped); returns the originals."""
        saved = {"generic_gemm": tex.generic_gemm, "te_general_grouped_gemm": tex.te_general_grouped_gemm}
        tex.generic_gemm = self._counting(saved["generic_gemm"], lambda args: [(args[0], args[2])])
        tex.te_general_grouped_gemm = self._counting(
            saved["te_general_grouped_gemm"],
            lambda args: [(a, b) for a, b in zip(args[0], args[2]) if _prod(a.size()) and _prod(b.size())])
        return saved

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Matmuls(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if not counter._inside_te and name in GemmFlops.MATMULS:
                    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
                    counter.high += 2 * out.numel() * int(a.shape[-1])
                return out

        return _Matmuls()


def gemm_share(rank, experts=True, steps=2):
    """FP8 share of a training step's GEMM FLOPs on the proportioned Qwen3-MoE prepared by the package under FSDP2
    (delayed scaling), with the experts on TE grouped GEMMs (``experts=True``) or left to transformers (before this
    package converted them): FP8 and high-precision GEMM FLOPs of the last step, per rank."""
    import torch

    import transformer_engine_torch as tex

    from accel_fp8_fix.testing import training

    training.ensure_rehearsal(True)
    acc = training.make_accelerator(fsdp=True, mixed_precision="fp8", fp8_recipe=RECIPE,
                                    wrap_cls=[training.ZOO_DECODER_LAYER["qwen3_moe"]])
    model = training.proportioned_qwen3_moe()
    model.config._experts_implementation = "eager"
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if experts:
            model, opt = acc.prepare(model, opt)
        else:
            from unittest import mock

            with mock.patch("accel_fp8_fix.fixes.convert.te_convert.convert_experts", lambda *a, **k: ([], [])):
                model, opt = acc.prepare(model, opt)
    # 8 x 64 tokens a rank: ~128 rows an expert (top-8 of 32), so FP8's padding to 16 rows is a few percent, as
    # at real batch sizes (a tiny batch would pad most of each expert's GEMM)
    ids = torch.randint(0, training.ZOO_VOCAB, (8, 64), generator=torch.Generator().manual_seed(11 + rank))
    data = {"input_ids": ids, "labels": ids.clone()}
    for step in range(steps):
        counter = GemmFlops()
        saved = counter.wrap(tex) if step == steps - 1 else None
        try:
            with counter.mode() if saved else contextlib.nullcontext():
                acc.backward(model(**data).loss)
                opt.step()
                opt.zero_grad()
        finally:
            if saved:
                tex.generic_gemm, tex.te_general_grouped_gemm = saved["generic_gemm"], saved["te_general_grouped_gemm"]
    training.reset_te_global_state()
    return {"fp8_flops": counter.fp8, "high_flops": counter.high, "experts": list(acc.accel_fp8_fix.conversion.experts),
            "tokens": int(data["input_ids"].numel())}


def measure(rank, world_size, plan):
    """Each ``experts`` of ``plan`` in turn in these ranks, each from the launch's environment (accelerate writes
    ``ACCELERATE_USE_FSDP`` / ``FSDP_*`` into ``os.environ``)."""
    from accel_fp8_fix.testing.training import reset_accelerate

    environ, out = dict(os.environ), []
    for experts in plan:
        os.environ.clear()
        os.environ.update(environ)
        out.append(gemm_share(rank, experts=experts))
    reset_accelerate()
    return out


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from accel_fp8_fix.testing import run_distributed
    from accel_fp8_fix.testing.training import ENV_FIXED

    plan = [False, True]
    results = run_distributed(measure, 2, args=(plan,), env=ENV_FIXED, timeout=900, collective_timeout=90,
                              init_process_group=False)
    print("| experts | GEMM MFLOP / step | FP8 | high precision | FP8 share of GEMM FLOPs | experts on TE grouped GEMMs |")
    print("|---|---|---|---|---|---|")
    for experts, f in zip(plan, results[0]):
        total = f["fp8_flops"] + f["high_flops"]
        label = "TE grouped GEMMs (this package)" if experts else "transformers' loop (before)"
        print(f"| {label} | {total / 1e6:.1f} | {f['fp8_flops'] / 1e6:.1f} | {f['high_flops'] / 1e6:.1f} | "
              f"{f['fp8_flops'] / total:.1%} | {len(f['experts'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
