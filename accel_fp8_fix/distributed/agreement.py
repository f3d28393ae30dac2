"""Every rank must run the same patch set: checked once, on the first patched ``prepare``.

The check goes through the process group's key-value store (not a collective on the model's backend),
with a deadline: a rank that chose another set makes every rank raise, naming who chose what; a rank
that never reports (package inactive there) makes the others raise when the deadline passes, instead
of hanging in a collective that rank will never join.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

from .. import caches

_round = itertools.count()


def _restart_rounds() -> None:  # rounds count per default group's store: a new group starts again at 0
    global _round
    _round = itertools.count()


caches.register("distributed.agreement: patch-set check rounds", _restart_rounds)


class PatchSetMismatchError(RuntimeError):
    """Ranks disagree on the patch set (or some never reported one)."""


def check_patch_set_agreement(chosen: str | None, timeout: float = 30.0) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world == 1:
        return
    rank = dist.get_rank()
    from ..internals.torch_internals import default_store

    store = default_store()
    prefix = f"accel_fp8_fix/patch_set/{next(_round)}"
    store.set(f"{prefix}/{rank}", chosen or "none")
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError depending on version
        missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        raise PatchSetMismatchError(
            f"accel_fp8_fix: rank {rank} runs patch set {chosen or 'none'!r}, but ranks {missing} did not report "
            f"a patch set within {timeout:.0f}s; is accel_fp8_fix active on every rank (same environment, same "
            "ACCEL_FP8_FIX / config flag)? Refusing to train half-patched."
        ) from None
    seen = {r: store.get(k).decode() for r, k in enumerate(keys)}
    if len(set(seen.values())) > 1:
        by_set = {}
        for r, name in seen.items():
            by_set.setdefault(name, []).append(r)
        detail = "; ".join(f"{name!r} on ranks {ranks}" for name, ranks in sorted(by_set.items()))
        raise PatchSetMismatchError(
            f"accel_fp8_fix: ranks disagree on the patch set ({detail}). Every rank must have the same "
            "accelerate/torch/transformer-engine versions and the same accel_fp8_fix settings."
        )
