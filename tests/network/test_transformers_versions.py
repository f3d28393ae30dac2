"""The transformers window against the releases' own sources: the wheels of its low end (5.24.0) and of the suite's
pin (5.25.0), installed from the registry into the test cache (``pip install --no-deps --target``, as the accelerate
releases), never imported here — their files are hashed.

What it proves: the hashes recorded in internals/transformers_features.py are those releases' sources; and, with only
5.24.0's hashes known, 5.25.0 is named by exactly the blocks that changed between the two wheels — the pre-hook of
``replicated_with_grad_allreduce`` (the A15 crash of 5.25) among them, and nothing that did not change. (The 5.24
form trained: CI runs all of tests/distributed on the window's low end, scripts/ci_torch_window.sh.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_fp8_fix.internals import block_sha256, transformers_features as features
from support import versions

LOW, PIN = "5.24.0", "5.25.0"
CHANGED_5_25 = {  # read in the two wheels (docs/compatibility.md, "transformers")
    "tp_styles": ["TensorParallelLayer.install_forward", "ColwiseParallel.transform_inputs_pre_forward",
                  "ColwiseParallel.transform_output_post_forward", "RowwiseParallel.transform_inputs_pre_forward",
                  "RowwiseParallel.transform_output_post_forward"],
    "grad_allreduce": ["ReplicatedWithGradAllReduce.install_forward"],
    "moe_tp_experts": ["MoeExpertsParallel.transform_output_post_forward", "PackedColwiseParallel.shard_param",
                       "PackedRowwiseParallel.shard_param"],
}


@pytest.fixture(scope="module")
def trees():
    return {v: Path(versions.require(v, package="transformers")) / "transformers" for v in (LOW, PIN)}


def test_the_recorded_hashes_are_the_wheels_sources(trees):
    for name, (_, blocks) in features.FEATURES.items():
        for (file, qualname, *anchor), known in blocks.items():
            for release, tree in trees.items():
                assert block_sha256((tree / file).read_text(), qualname, *anchor) == known[release], (name, qualname)


def test_with_only_the_low_end_known_5_25_is_named_by_exactly_what_changed(trees):
    only_low = {name: (what, {key: {LOW: known[LOW]} for key, known in blocks.items()})
                for name, (what, blocks) in features.FEATURES.items()}
    low = features.verdicts(root=trees[LOW], features=only_low)
    assert all(v.verified and v.releases == (LOW,) for v in low.values()), low
    pin = features.verdicts(root=trees[PIN], features=only_low)
    named = {name: [p.split(": ")[2].split(" changed")[0] for p in v.problems] for name, v in pin.items() if not v.verified}
    assert named == CHANGED_5_25
    (problem,) = pin["grad_allreduce"].problems
    ((_, known),) = features.FEATURES["grad_allreduce"][1].items()
    assert problem.endswith(f"ReplicatedWithGradAllReduce.install_forward changed (source sha256 {known[PIN]}; "
                            f"written against {LOW} {known[LOW]})")
    # the style's new form is a forward pre-hook: the source says so, and the package recognises it by that name
    source = (trees[PIN] / "distributed/tensor_parallel.py").read_text()
    assert "module.register_forward_pre_hook(tp_forward_pre_hook)" in source
    assert "module.forward = tp_forward" in (trees[LOW] / "distributed/tensor_parallel.py").read_text()
