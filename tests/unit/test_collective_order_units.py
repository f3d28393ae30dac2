"""accel_fp8_fix.diagnostics.collective_order.check: the comparison itself (no processes); where the audit lives."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel_fp8_fix.diagnostics.collective_order import Collective, check, check_dir, dump, CollectiveRecorder


def c(kind, group, numel=4, dtype="float32"):
    return Collective(kind=kind, op=f"c10d.{kind}", group=tuple(group), dtype=dtype, numel=numel)


def test_agreeing_sequences_pass():
    seq = [c("all_reduce", [0, 1]), c("broadcast", [0, 1])]
    assert check({0: list(seq), 1: list(seq)}) == []


def test_a_group_only_its_members_compare():
    # rank 2 is not in group [0, 1]: what it does there is not compared
    assert check({0: [c("all_reduce", [0, 1])], 1: [c("all_reduce", [0, 1])], 2: [c("barrier", [2, 3])]}) == []


def test_the_first_divergent_collective_and_the_ranks_are_named():
    problems = check({0: [c("all_reduce", [0, 1]), c("broadcast", [0, 1])],
                      1: [c("all_reduce", [0, 1]), c("all_gather", [0, 1])]})
    assert problems == ["group [0, 1]: collective #1 differs between ranks 0 and 1: rank 0 issued broadcast "
                        "(c10d.broadcast) float32 numel=4 on group [0, 1]; rank 1 issued all_gather (c10d.all_gather) "
                        "float32 numel=4 on group [0, 1]"]


def test_a_missing_collective_is_named():
    problems = check({0: [c("all_reduce", [0, 1])], 1: []})
    assert "rank 1 issued nothing (it issued 0 on this group)" in problems[0]


def test_two_groups_used_in_opposite_orders_deadlock_nccl_and_are_named():
    a, b = c("all_reduce", [0, 1]), c("all_reduce", [0, 1, 2])
    problems = check({0: [a, b], 1: [b, a], 2: [b]})
    assert len(problems) == 1
    assert problems[0].startswith("ranks 0 and 1 issue their shared groups' collectives in a different order")


def test_two_communicators_of_the_same_ranks_are_told_apart_by_name():
    a = Collective(kind="all_reduce", op="c10d.allreduce_", group=(0, 1), dtype="float32", numel=3, group_name="0")
    b = Collective(kind="all_reduce", op="c10d.allreduce_", group=(0, 1), dtype="float32", numel=3, group_name="7f")
    problems = check({0: [a, b], 1: [b, a]})  # each communicator agrees; their order does not
    assert problems and problems[0].startswith("ranks 0 and 1 issue their shared groups' collectives in a different")
    c = Collective(kind="all_reduce", op="c10d.allreduce_", group=(0, 1), dtype="int64", numel=3, group_name="7f")
    problems = check({0: [a, b], 1: [a, c]})
    assert problems[0].startswith("group [0, 1] ('7f'): collective #0 differs between ranks 0 and 1")


def test_uneven_all_to_all_counts_are_not_compared():
    x = Collective(kind="all_to_all", op="c10d.alltoall_base_", group=(0, 1), dtype="float32", numel=None)
    assert check({0: [x], 1: [x]}) == []


def test_check_dir_skips_failed_runs_and_reports_missing_ranks(tmp_path):
    rec = CollectiveRecorder()
    rec.records.append(c("all_reduce", [0, 1]))
    dump(rec, tmp_path / "run-1-1" / "rank0.json", 0, 2)
    assert check_dir(tmp_path) == ["run-1-1: no record from ranks [1] of 2 (a rank that left with os._exit or "
                                   "was killed writes none)"]
    dump(rec, tmp_path / "run-1-1" / "rank1.json", 1, 2, failed=True)
    assert check_dir(tmp_path) == []


def test_a_collective_inside_fsdp2s_all_gather_extension_hooks_is_named():
    inside = Collective(kind="all_reduce", op="c10d.allreduce_", group=(0, 1), dtype="float32", numel=5,
                        inside="fsdp_pre_all_gather")
    problems = check({0: [inside, inside], 1: [inside, inside]})  # the ranks agree: still two problems
    assert problems == [f"rank {r} issued 2 collective(s) inside FSDP2's all-gather extension hooks, the first "
                        "all_reduce (c10d.allreduce_) float32 numel=5 on group [0, 1] inside fsdp_pre_all_gather "
                        "(FSDP2 runs it during an unshard — on a GPU on its all-gather copy-in stream — and gathers "
                        "on its own communicator right after: issue it before the unshard)" for r in (0, 1)]
    outside = Collective(kind="all_reduce", op="c10d.allreduce_", group=(0, 1), dtype="float32", numel=5)
    assert check({0: [outside], 1: [outside]}) == [] and outside.key() == inside.key()


class _Hooked:
    """Stands in for a tensor subclass with FSDP2's all-gather extension hooks: the recorder reads the stack."""

    def __init__(self, collective):
        self.collective = collective

    def fsdp_pre_all_gather(self):
        return self.collective()

    def fsdp_post_all_gather(self):
        return self.collective()


def test_the_recorder_marks_collectives_issued_inside_the_hooks(tmp_path):
    import torch
    import torch.distributed as dist

    from accel_fp8_fix.distributed import collectives

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with CollectiveRecorder() as rec:
            collectives.all_reduce(torch.ones(3), group=dist.group.WORLD, name="outside")
            hooked = _Hooked(lambda: collectives.all_reduce(torch.ones(2), group=dist.group.WORLD, name="inside"))
            hooked.fsdp_pre_all_gather()
            _Hooked(lambda: dist.all_reduce(torch.ones(4))).fsdp_post_all_gather()  # raw c10d (TE's) too
    finally:
        dist.destroy_process_group()
    assert [(r.numel, r.inside) for r in rec.records] == [(3, ""), (2, "fsdp_pre_all_gather"),
                                                          (4, "fsdp_post_all_gather")]
    dump(rec, tmp_path / "run-1-1" / "rank0.json", 0, 1)  # written and read back with the mark
    assert len(check_dir(tmp_path)) == 1 and "inside fsdp_pre_all_gather" in check_dir(tmp_path)[0]


def test_the_start_up_hook_installs_the_audit_without_the_test_bed(tmp_path):
    """ACCEL_FP8_FIX_COLLECTIVE_AUDIT at start-up: the audit (diagnostics/) installed, the test bed not imported."""
    code = ("import sys, accel_fp8_fix._bootstrap\n"
            "from accel_fp8_fix.diagnostics import collective_order\n"
            "print(collective_order._installed['dir'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('accel_fp8_fix.testing')))\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_FP8_"))}
    env.update(ACCEL_FP8_FIX_COLLECTIVE_AUDIT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(tmp_path), "[]"]


def test_the_old_module_path_is_a_deprecated_alias():
    from accel_fp8_fix.diagnostics import collective_order

    sys.modules.pop("accel_fp8_fix.testing.collective_order", None)
    with pytest.warns(DeprecationWarning, match="accel_fp8_fix.diagnostics.collective_order"):
        from accel_fp8_fix.testing.collective_order import CollectiveRecorder as old, _installed
    assert old is CollectiveRecorder and _installed is collective_order._installed
