"""One rank: the features that have a one-rank form, in ONE launch of ``world_size=1`` (docs/testing.md, "A
feature with a one-rank form is tested there too"). FSDP2 over one rank is single-GPU FSDP2, a common first try:
torch's FSDP2 takes its own world-size-1 paths there (``FSDPParamGroup.unshard`` / ``wait_for_unshard``: no
all-gather, the first all-gather input copied into the output buffer), which no multi-rank test reaches.

The plan reuses the multi-rank scenario functions of the sibling modules with ``world_size=1``; each entry is
``("sc", {"module": ..., "scenario": ..., "kwargs": {...}})`` and :func:`facts` finds one by the same three.
tests/distributed/test_fp8_all_gather.py, test_fsdp2_fp8.py and test_moe_fp8.py read it (memoised: one launch for
the pytest process).
"""

from __future__ import annotations

import importlib
import os

from . import scenarios

AG_BLOCK = {"recipe": "block", "model": "linear_stack", "dim": 256, "out": 256, "steps": 3}


def plan(folder: str) -> list:
    """The one-rank plan; ``folder`` for the checkpoints it writes and reads back."""
    def entry(module, scenario, **kwargs):
        return ("sc", {"module": module, "scenario": scenario, "kwargs": kwargs})

    return [
        # FP8 all-gather: the three recipes it serves, on and off, the TE tensors checked bit for bit every step
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="fp8", recipe="delayed", bits=True),
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="high_precision", recipe="delayed"),
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="fp8", recipe="current", bits=True),
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="high_precision", recipe="current", reference=False),
        entry("fp8_all_gather_scenarios", "sc_train", **AG_BLOCK, all_gather="fp8", bits=True),
        entry("fp8_all_gather_scenarios", "sc_train", **AG_BLOCK, all_gather="high_precision"),
        *[entry("fp8_all_gather_scenarios", "sc_train", all_gather=ag, model="linear_stack", steps=2, reference=False,
                policy=policy) for ag, policy in (("fp8", "fp32"), ("high_precision", "fp32"), ("high_precision", "bf16"))],
        # packed MoE experts gathered in FP8 over one shard rank (per-expert scales; block scaling's tile grids in
        # the metadata: FSDP2's world-size-1 path copies only the first all-gather input)
        entry("fp8_all_gather_scenarios", "sc_moe", family="qwen3_moe", recipe="current", steps=2),
        entry("fp8_all_gather_scenarios", "sc_moe", family="qwen3_moe_256", recipe="block", steps=2),
        # a user's in-place edit between steps, and a write no version counter sees (then weights_changed())
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="fp8", steps=3, reference=False, bits=True,
              modify="in_place"),
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="fp8", steps=3, reference=False, bits=True,
              modify="data_then_weights_changed"),
        entry("fp8_all_gather_scenarios", "sc_train", all_gather="fp8", steps=3, reference=False, bits=True,
              modify="data_only"),  # the probe's own check: without weights_changed() the scale is stale
        # checkpoints with the switch: save, then load into a differently initialised model, bit for bit; Llama with
        # transformers' activation checkpointing (the recompute through TE's checkpoint)
        entry("fp8_all_gather_scenarios", "sc_llm", family="llama", ckpt_dir=os.path.join(folder, "llm")),
        entry("fp8_all_gather_scenarios", "sc_llm", family="llama", grad_ckpt=True),
        entry("fp8_all_gather_scenarios", "sc_train", **dict(AG_BLOCK, steps=2), all_gather="fp8", reference=False,
              save_dir=os.path.join(folder, "block_on")),
        entry("fp8_all_gather_scenarios", "sc_train", **dict(AG_BLOCK, steps=1), all_gather="fp8", reference=False,
              load_dir=os.path.join(folder, "block_on"), bits=True),
        # FSDP2 + FP8 conversion, checkpoints (weights and FP8 state bit for bit), activation checkpointing, MoE
        entry("fp8_scenarios", "sc_fsdp2_fp8_train"),
        entry("fp8_scenarios", "sc_checkpoint_save", out_dir=folder),
        entry("fp8_scenarios", "sc_checkpoint_load", out_dir=folder),
        *[entry("fp8_scenarios", "sc_activation_checkpointing", how=how) for how in
          ("none", "accelerate", "none-llama", "transformers")],
        *[entry("moe_scenarios", "sc_moe", family=family, layout="fsdp2_one_rank") for family in
          ("qwen3_moe", "qwen2_moe")],
        # last: a forward that bypasses the prepared model after a change is refused (FSDP2 left mid-unshard)
        entry("fp8_all_gather_scenarios", "sc_stale"),
    ]


def sc(rank, world_size, module, scenario, kwargs):
    """Run ``scenario`` of the sibling scenario module ``module``."""
    return getattr(importlib.import_module(f"{__package__}.{module}"), scenario)(rank, world_size, **kwargs)


# The defaults scenarios.launch(this module, plan, world_size) takes where its call does not say.
LAUNCH = {"env": scenarios.ENV_FIXED, "timeout": 900.0, "collective_timeout": 90.0}

class OneRank:
    """The one-rank launch's facts, for a plan whose checkpoints live in ``folder``."""

    def __init__(self, folder: str):
        self.folder = folder

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def __call__(self, module: str, scenario: str, **kwargs) -> dict:
        """The facts of one scenario (its traceback if it raised)."""
        key = scenarios.key_of(plan(self.folder), "sc", {"module": module, "scenario": scenario, "kwargs": kwargs})
        (only,) = scenarios.facts_of(scenarios.launch(__name__, plan(self.folder), 1), key)
        return only
