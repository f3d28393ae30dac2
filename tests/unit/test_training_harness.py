"""The shared training harness (accel_fp8_fix/testing/training.py, docs/testing.md): ``train_and_compare`` in one
process on the toy model — equal to its one-process reference for the same run, a mismatch naming the step for a run
that differs — and the module's import cost (torch only)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from accel_fp8_fix.testing.training import block_stack, compare, dense_batch, train_and_compare, train_reference

STEPS, LR, CLIP = 3, 0.1, 0.5


def _mse():
    x, y = dense_batch(batch=16)
    return lambda model: torch.nn.functional.mse_loss(model(x).float(), y)


def _reference():
    return train_reference(block_stack, _mse(), steps=STEPS, lr=LR, max_norm=CLIP)


def test_an_identical_run_matches_its_reference_bit_for_bit():
    facts = train_and_compare(block_stack(), _mse(), _reference, steps=STEPS, max_norm=CLIP, lr=LR, check=True)
    assert facts["mismatches"] == []
    assert facts["losses"] == facts["reference_losses"] and facts["grad_norms"] == facts["reference_grad_norms"]
    assert len(facts["losses"]) == STEPS and facts["grad_norms"][0] > CLIP  # clipping acts


def test_a_run_that_differs_names_the_step():
    model = block_stack()
    opt = torch.optim.SGD(model.parameters(), lr=LR * 2)  # step 0 equal; from step 1 on, another trajectory
    facts = train_and_compare(model, _mse(), _reference(), steps=STEPS, max_norm=CLIP, optimizer=opt)
    assert facts["mismatches"] and all(m.startswith(("step 1:", "step 2:")) for m in facts["mismatches"])
    assert "step 1: loss" in facts["mismatches"][0]
    with pytest.raises(AssertionError, match=r"step 1: loss"):
        train_and_compare(block_stack(), _mse(), _reference(), steps=STEPS, max_norm=CLIP,
                          optimizer=torch.optim.SGD(block_stack().parameters(), lr=LR), check=True)


def test_tolerances_and_step_counts():
    assert compare([1.0, 2.0], [1.0, 1.0], [1.0, 2.0 + 1e-7], [1.0, 1.0], rtol=1e-6) == []
    assert compare([1.0, 2.0], [1.0, 1.0], [1.0, 2.1], [1.0, 1.0], rtol=1e-6) == ["step 1: loss 2.0 vs reference 2.1"]
    assert compare([1.0], [1.0], [1.0, 2.0], [1.0, 1.0])[-1].startswith("steps: 1 losses")


def test_importing_the_harness_needs_only_torch():
    script = ("import sys, accel_fp8_fix.testing.training; "
              "print(sorted(m for m in ('transformers', 'transformer_engine', 'accelerate') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PATH": "", "PYTHONPATH": ":".join(sys.path), "ACCEL_FP8_FIX": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]"], proc.stdout
