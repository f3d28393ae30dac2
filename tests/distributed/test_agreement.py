"""Ranks must agree on the patch set: a clear error on every rank within seconds, never a hang."""

import time

import pytest

from support import launcher


def _disagree(rank, world_size):
    from accel_fp8_fix.distributed.agreement import PatchSetMismatchError, check_patch_set_agreement

    check_patch_set_agreement("accelerate-1.13-1.16")  # agreeing first: passes, and rounds stay in step
    chosen = "accelerate-1.13-1.16" if rank != 1 else "accelerate-1.8-1.12"
    start = time.monotonic()
    try:
        check_patch_set_agreement(chosen, timeout=20)
    except PatchSetMismatchError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_disagreeing_ranks_all_raise_naming_who_chose_what():
    results = launcher.run(_disagree, 3, timeout=90)
    for message, elapsed in results:
        assert message is not None
        assert "'accelerate-1.13-1.16' on ranks [0, 2]" in message
        assert "'accelerate-1.8-1.12' on ranks [1]" in message
        assert elapsed < 5


def _silent_rank(rank, world_size):
    from accel_fp8_fix.distributed.agreement import PatchSetMismatchError, check_patch_set_agreement

    if rank == 1:  # the package is inactive here: it never reports
        time.sleep(6)
        return None
    start = time.monotonic()
    try:
        check_patch_set_agreement("accelerate-1.13-1.16", timeout=3)
    except PatchSetMismatchError as exc:
        return str(exc), time.monotonic() - start
    return None


def test_a_rank_that_never_reports_is_named_after_the_deadline_instead_of_hanging():
    message, elapsed = launcher.run(_silent_rank, 2, timeout=90)[0]
    assert "ranks [1] did not report a patch set within 3s" in message
    assert 2.5 < elapsed < 10


def _through_prepare(rank, world_size):
    import torch

    import accel_fp8_fix.fixes.prepare as prepare_fix
    from accel_fp8_fix.distributed.agreement import PatchSetMismatchError

    import accel_fp8_fix  # noqa: F401
    from accelerate import Accelerator

    assert accel_fp8_fix.report().applied
    original = prepare_fix.calling_patch_set
    if rank == 1:
        prepare_fix.calling_patch_set = lambda: "some-other-set"
    accelerator = Accelerator(cpu=True)
    try:
        accelerator.prepare(torch.nn.Linear(4, 4))
    except PatchSetMismatchError as exc:
        return str(exc)
    finally:
        prepare_fix.calling_patch_set = original
    return "prepared"


def test_first_patched_prepare_runs_the_check_on_every_rank():
    results = launcher.run(_through_prepare, 2, timeout=120)
    for message in results:
        assert "ranks disagree" in message and "'some-other-set' on ranks [1]" in message
