"""FP8 under accelerate's torch.compile setting (``dynamo_backend: INDUCTOR``, FSDP2, a tiny Qwen2) for
tests/distributed/test_compile_fp8.py. The run is the harness's (``accel_fp8_fix.testing.training.
fsdp2_fp8_compile_run``, which benchmarks/compile_fp8.py launches too); each runs inside a rank and returns facts."""

from __future__ import annotations

from accel_fp8_fix.testing.training import fsdp2_fp8_compile_run as sc_fsdp2_fp8_compile  # noqa: F401

from . import scenarios

# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
# Launched with the collective-order audit: its recorder declares ``ignore_compile_internals`` (before, its
# ``TorchDispatchMode`` made dynamo skip every frame — "non-infra torch dispatch mode present",
# torch/_dynamo/convert_frame.py — so nothing compiled under it).
LAUNCH = {"env": scenarios.ENV_FIXED, "timeout": 240.0, "collective_timeout": 120.0}
