"""Every transformers internal this package relies on, grouped by what it serves, hashed per tested release.

transformers ships every two weeks and is not a window the patch set refuses: a user whose model touches none of
these internals (FSDP2 of a plain Llama, say) loses nothing on a release nobody tested. Each *feature* below lists
the transformers functions (or the one statement inside a long function) whose behaviour a fix takes over or
mirrors, with their source sha256 in every tested release (``block_sha256``: read, never imported). When the set
applies, each feature is *verified* — its sources hash to a tested release's — or not; ``prepare`` refuses by
name (:func:`require`) what a model would use of an unverified feature, before it shards or converts anything
(``ACCEL_FP8_FIX_ALLOW_UNTESTED=1``: run it anyway, said once). ``python scripts/source_hashes.py --transformers
DIR`` prints these hashes for a transformers tree or wheel.
"""

from __future__ import annotations

from dataclasses import dataclass

TP = "distributed/tensor_parallel.py"
EP = "distributed/expert_parallel.py"
MOE = "integrations/moe.py"

# name: (what it serves, {(file, qualname[, anchor]): {release: sha256}})
FEATURES: dict[str, tuple[str, dict]] = {
    "tp_styles": (
        "Transformer Engine's own TP for the Linears transformers' colwise / rowwise styles shard, and the forward "
        "its TP styles install (fixes/convert/te_convert.py, fixes/convert/moe_experts.py)", {
            (TP, "TensorParallelLayer.install_forward"): {"5.24.0": "94c17e484a303e2d", "5.25.0": "09aed040e15229bf"},
            (TP, "ColwiseParallel.__init__"): {"5.24.0": "a82498832263e05c", "5.25.0": "a82498832263e05c"},
            (TP, "ColwiseParallel.transform_inputs_pre_forward"):
                {"5.24.0": "2b4f28420a32b1c3", "5.25.0": "ad6481131997e558"},
            (TP, "ColwiseParallel.transform_output_post_forward"):
                {"5.24.0": "8ae7f265a915eafb", "5.25.0": "83d2dfd633929377"},
            (TP, "RowwiseParallel.__init__"): {"5.24.0": "1f431172d0a5add5", "5.25.0": "1f431172d0a5add5"},
            (TP, "RowwiseParallel.transform_inputs_pre_forward"):
                {"5.24.0": "d8781c5b21368204", "5.25.0": "b3e0e2adfd9eeffd"},
            (TP, "RowwiseParallel.transform_output_post_forward"):
                {"5.24.0": "ffa19b3c72113ee6", "5.25.0": "97cc98e116ee12c5"},
        }),
    "grad_allreduce": (
        "the gradient all-reduce of replicated_with_grad_allreduce (per-head q_norm / k_norm: Qwen3, Gemma3, "
        "Qwen3-MoE, ...), taken over under FSDP2 x TP and TP + FP8 (fixes/convert/tp.py, A15)", {
            (TP, "ReplicatedWithGradAllReduce.install_forward"):
                {"5.24.0": "972d589f345572de", "5.25.0": "17469fb515facbc4"},
        }),
    "moe_tp_experts": (
        "TP-sharded packed experts (moe_tp_experts with packed_colwise / rowwise) on TE grouped GEMMs "
        "(fixes/convert/moe_experts.py)", {
            (TP, "MoeExpertsParallel.transform_inputs_pre_forward"):
                {"5.24.0": "f244d6e7ee212c49", "5.25.0": "f244d6e7ee212c49"},
            (TP, "MoeExpertsParallel.transform_output_post_forward"):
                {"5.24.0": "9eb847feeccd1596", "5.25.0": "6c966dd5964531ae"},
            (TP, "PackedColwiseParallel.shard_param"): {"5.24.0": "c005ae6e11ae7756", "5.25.0": "93c2aa9df0523d2d"},
            (TP, "PackedRowwiseParallel.shard_param"): {"5.24.0": "b021804f6e27472c", "5.25.0": "5fa553a880882ebc"},
        }),
    "expert_parallel": (
        "expert-parallel experts (DistributedConfig(ep_size=...)) on TE grouped GEMMs behind transformers' token "
        "dispatch (internals/transformers_ep.py)", {
            (EP, "EPImplementation.__init__"): {"5.24.0": "5e22611ae1eca13f", "5.25.0": "5e22611ae1eca13f"},
            (EP, "AllToAllEP.__call__"): {"5.24.0": "958a9a7c2d03fd0b", "5.25.0": "958a9a7c2d03fd0b"},
            (EP, "AllReduceEP.__call__"): {"5.24.0": "f4b4e2fdec6b1a6c", "5.25.0": "f4b4e2fdec6b1a6c"},
            (EP, "AutoEP.__init__"): {"5.24.0": "433446aa500cd4a9", "5.25.0": "433446aa500cd4a9"},
            (EP, "AutoEP.__call__"): {"5.24.0": "b5878bf1c0c9d2df", "5.25.0": "b5878bf1c0c9d2df"},
            (EP, "EpDispatchExpertsParallel.install_forward"):
                {"5.24.0": "9ef51d730d248fda", "5.25.0": "9ef51d730d248fda"},
        }),
    "experts_implementation": (
        "packed 3-D experts (@use_experts_implementation) on TE grouped GEMMs: the routing, gating and weighting "
        "the package's experts forward mirrors (fixes/convert/moe_experts.py)", {
            (MOE, "use_experts_implementation"): {"5.24.0": "993c3cae142242ed", "5.25.0": "993c3cae142242ed"},
            (MOE, "_default_apply_gate"): {"5.24.0": "2d8844be94e54259", "5.25.0": "2d8844be94e54259"},
            (MOE, "batched_mm_experts_forward"): {"5.24.0": "8f33abfd2e57fb4b", "5.25.0": "8f33abfd2e57fb4b"},
        }),
    "distributed_loading": (
        "models sharded at load (from_pretrained(distributed_config=DistributedConfig(...))): transformers' FSDP2 "
        "and its mesh names (fixes/convert/presharded.py, A18)", {
            ("distributed/fsdp.py", "apply_fully_sharded_data_parallelism"):
                {"5.24.0": "6cd84fee2b7f7b90", "5.25.0": "6cd84fee2b7f7b90"},
        }),
    "trainer_handoff": (
        "Trainer's hand-off of a model sharded at load (prepare_model(..., evaluation_mode=True), then the "
        "optimizer alone: fixes/trainer.py, A22)", {
            ("trainer.py", "Trainer._prepare_for_training", "if self.is_distributed_loading_by_transformers:"):
                {"5.24.0": "465f0aacbde765f1", "5.25.0": "465f0aacbde765f1"},
        }),
}


class UnverifiedInternalError(ValueError):
    """A model needs a transformers internal whose source matches no tested release."""


@dataclass(frozen=True)
class Verdict:
    feature: str
    verified: bool
    releases: tuple = ()  # the tested releases whose source this one matches, block by block (all of them)
    problems: tuple = ()  # the blocks that are gone or changed


_CACHE: dict = {}


def _transformers_version(versions) -> str | None:
    if versions is not None:
        return versions.get("transformers")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def verdicts(versions=None, root=None, features=None) -> dict[str, Verdict]:
    """Each feature's verdict for the installed transformers (or the tree at ``root``: a wheel's ``transformers``
    folder); {} when transformers is not installed. Cached for the installed one. Each file is read once and each
    block hashed once."""
    from . import hashed_blocks, package_root

    features = FEATURES if features is None else features
    cached = root is None and features is FEATURES
    if cached and "verdicts" in _CACHE:
        return _CACHE["verdicts"]
    where = root if root is not None else package_root("transformers")
    out, texts = {}, {}
    if where is not None:
        version = f"transformers {_transformers_version(versions) if root is None else where}"
        for name, (_, blocks) in features.items():
            found = hashed_blocks(where, blocks, version, texts).values()
            problems = tuple(problem for problem, _ in found if problem)
            releases = set.intersection(*(set(r) for _, r in found)) if found and not problems else set()
            out[name] = Verdict(name, not problems, tuple(sorted(releases)), problems)
    if cached:
        _CACHE["verdicts"] = out
    return out


def reset() -> None:
    """Forget the cached verdicts (a test that changes the installed transformers)."""
    _CACHE.clear()


def check(versions) -> list[str]:
    """The set-level check: never refuses the set (a model that touches no unverified feature loses nothing); the
    verdicts are computed here, once, and an unverified feature is said once (the log), naming its blocks."""
    unverified = [v for v in verdicts(versions).values() if not v.verified]
    if unverified:
        from .._log import warn_user

        warn_user("accel_fp8_fix: " + describe(versions) + "; prepare refuses by name what a model would use of "
                  "them: " + "; ".join(f"{v.feature} ({v.problems[0]})" for v in unverified))
    return []


def describe(versions=None) -> str:
    """One line for doctor and the log: which transformers, verified how."""
    found = verdicts(versions)
    version = _transformers_version(versions)
    if not found:
        return "transformers not installed: no transformers internal is used"
    ok = [name for name, v in found.items() if v.verified]
    releases = sorted(set.intersection(*(set(found[n].releases) for n in ok))) if ok else []
    line = (f"transformers {version}: {len(ok)} of {len(found)} internals groups verified by source sha256"
            + (f" (same source as tested {', '.join(releases)})" if releases else ""))
    bad = [name for name, v in found.items() if not v.verified]
    return line + (f"; changed or gone: {', '.join(bad)}" if bad else "")


def require(feature: str, users, versions=None) -> None:
    """Raise :class:`UnverifiedInternalError` naming ``users`` (the modules that need ``feature``), the changed
    blocks, the transformers version and the ways out — unless ``feature`` is verified, transformers is not
    installed, or ``ACCEL_FP8_FIX_ALLOW_UNTESTED=1`` (then said once)."""
    verdict = verdicts(versions).get(feature)
    if verdict is None or verdict.verified:
        return
    users = list(users)
    shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
    what, _ = FEATURES[feature]
    message = (f"accel_fp8_fix: {shown} need(s) {what}; on transformers {_transformers_version(versions)} its "
               f"source matches no tested release: {'; '.join(verdict.problems)}")
    from .. import settings

    if settings.get("ACCEL_FP8_FIX_ALLOW_UNTESTED"):
        from .._log import warn_user

        warn_user(message + " — running it anyway (ACCEL_FP8_FIX_ALLOW_UNTESTED=1)")
        return
    raise UnverifiedInternalError(
        message + ". Install a tested transformers (python -m accel_fp8_fix doctor names the window), or set "
        "ACCEL_FP8_FIX_ALLOW_UNTESTED=1 to run it unverified")
