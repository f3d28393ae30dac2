"""transformers as a declared, tested dependency (internals/transformers_features.py): each feature's sources hashed
per tested release, the installed transformers verified, an unverified feature refused by name at prepare (never
the whole set), and ``replicated_with_grad_allreduce`` taken over in the form the installed transformers installs.
The 5.24 -> 5.25 change against both wheels' sources: tests/network/test_transformers_versions.py."""

from __future__ import annotations

import pytest

from accel_fp8_fix.engine.declarations import load_patch_sets
from accel_fp8_fix.engine.versions import installed_version
from accel_fp8_fix.internals import block_sha256, transformers_features as features

TRANSFORMERS = installed_version("transformers")


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    features.reset()
    yield
    features.reset()


def test_every_feature_names_its_blocks_and_every_tested_release():
    (fix_set,) = [s for s in load_patch_sets() if s.kind == "fix"]
    tested = fix_set.tested["transformers"]
    assert str(tested) == "<5.26,>=5.24"
    for name, (what, blocks) in features.FEATURES.items():
        assert what and blocks, name
        for key, known in blocks.items():
            assert set(known) == {"5.24.0", "5.25.0"}, (name, key)  # the releases the suite ran
            assert all(tested.contains(release) for release in known)
            assert all(len(sha) == 16 for sha in known.values())


def test_the_installed_transformers_is_verified_and_said_so():
    assert TRANSFORMERS in ("5.24.0", "5.25.0"), "the suite's pin or the window's low end"
    found = features.verdicts()
    assert set(found) == set(features.FEATURES)
    assert all(v.verified and TRANSFORMERS in v.releases and not v.problems for v in found.values()), found
    line = features.describe()
    assert line.startswith(f"transformers {TRANSFORMERS}: {len(found)} of {len(found)} internals groups verified")


def _one_changed(monkeypatch, feature="grad_allreduce"):
    what, blocks = features.FEATURES[feature]
    key = next(iter(blocks))
    changed = {**features.FEATURES, feature: (what, {key: {"5.24.0": "0" * 16}})}
    monkeypatch.setattr(features, "FEATURES", changed)
    return key


def test_a_changed_block_is_named_and_refused_only_where_used(monkeypatch):
    key = _one_changed(monkeypatch)
    found = features.verdicts()
    assert not found["grad_allreduce"].verified and found["tp_styles"].verified
    (problem,) = found["grad_allreduce"].problems
    assert problem.startswith(f"transformers {TRANSFORMERS}: transformers/{key[0]}: {key[1]} changed (source sha256 ")
    assert "written against 5.24.0 0000000000000000" in problem
    features.require("tp_styles", ["model.layers.0.self_attn.q_proj"])  # verified: nothing said
    with pytest.raises(features.UnverifiedInternalError) as err:
        features.require("grad_allreduce", [f"model.layers.{i}.self_attn.q_norm" for i in range(5)])
    message = str(err.value)
    assert message.startswith("accel_fp8_fix: model.layers.0.self_attn.q_norm, model.layers.1.self_attn.q_norm, "
                              "model.layers.2.self_attn.q_norm and 2 more need(s) the gradient all-reduce of "
                              "replicated_with_grad_allreduce")
    assert f"on transformers {TRANSFORMERS} its source matches no tested release" in message
    assert problem in message and "ACCEL_FP8_FIX_ALLOW_UNTESTED=1" in message
    assert "grad_allreduce" in features.describe() and "6 of 7" in features.describe()


def test_allow_untested_runs_an_unverified_feature_with_a_warning(monkeypatch):
    _one_changed(monkeypatch)
    monkeypatch.setenv("ACCEL_FP8_FIX_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="running it anyway"):
        features.require("grad_allreduce", ["model.layers.0.self_attn.q_norm"])


def test_the_set_level_check_never_refuses_and_warns_once(monkeypatch):
    _one_changed(monkeypatch, "trainer_handoff")
    from accel_fp8_fix import _log

    monkeypatch.setattr(_log, "_said", set())
    with pytest.warns(RuntimeWarning, match=r"prepare refuses by name what a model would use of them: trainer_handoff"):
        assert features.check({"transformers": TRANSFORMERS}) == []


def test_an_anchored_statement_is_hashed_alone():
    source = ("class T:\n    def f(self):\n        x = 1\n        if self.loaded:\n            a()\n        elif b:\n"
              "            c()\n        return x\n")
    whole = block_sha256(source, "T.f")
    branch = block_sha256(source, "T.f", "if self.loaded:")
    assert whole and branch and whole != branch
    assert branch == block_sha256(source.replace("x = 1", "x = 2"), "T.f", "if self.loaded:")  # outside it
    assert branch != block_sha256(source.replace("c()", "d()"), "T.f", "if self.loaded:")  # its elif is part of it
    assert block_sha256(source, "T.f", "if self.gone:") is None


def test_a_block_with_a_string_at_column_0_is_hashed_to_its_end():
    source = 'def f():\n    s = """\nat column 0\n"""\n    return s\n\ndef g():\n    pass\n'
    import hashlib

    assert block_sha256(source, "f") == hashlib.sha256(source.split("\n\ndef g")[0].encode() + b"\n").hexdigest()[:16]


def test_grad_allreduce_is_taken_off_in_the_installed_form_and_summed_by_the_package():
    """A Qwen3 q_norm given the real ``replicated_with_grad_allreduce`` by the installed transformers (5.25: a forward
    pre-hook), on a 1-rank gloo TP mesh: without the take-over its hook hands a DTensor gradient to c10d (the 5.25
    crash, A15); with it the style is gone, backward runs and the gradient reaches the Replicate DTensor parameter."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from torch.distributed.tensor import DTensor, Replicate

    from accel_fp8_fix.fixes.convert.tp import check_grad_allreduce, replicate_plain_parameters
    from accel_fp8_fix.internals import transformers_tp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        results = {}
        for take_over in (False, True):
            norm = Qwen3RMSNorm(16)
            ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"].install_forward(norm, mesh)
            assert transformers_tp.has_grad_allreduce(norm)
            wrapper = torch.nn.Sequential(norm)
            if take_over:
                check_grad_allreduce(wrapper)
                replicate_plain_parameters(wrapper, mesh)
                assert not transformers_tp.has_grad_allreduce(norm)
            else:  # what the package did before 5.25: the parameter wrapped, the style left in place
                norm._parameters["weight"] = torch.nn.Parameter(
                    DTensor.from_local(norm.weight.data, mesh, [Replicate()], run_check=False))
            x = torch.randn(4, 16, requires_grad=True)
            try:
                norm(x if take_over else DTensor.from_local(x, mesh, [Replicate()], run_check=False)).sum().backward()
                results[take_over] = norm.weight.grad
            except NotImplementedError as exc:
                results[take_over] = str(exc)
    finally:
        dist.destroy_process_group()
    assert "c10d.allreduce_.default does not have a sharding strategy" in results[False]  # 5.25's form
    grad = results[True]
    assert type(grad).__name__ == "DTensor" and [str(p) for p in grad.placements] == ["R"]
    assert grad.to_local().shape == (16,) and grad.to_local().abs().sum() > 0
