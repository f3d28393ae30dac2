"""A finished run exits 0 (A20, `accel_fp8_fix/fixes/start/clean_exit.py`).

A user's script (`tests/support/clean_exit_script.py`: FSDP2 + Transformer Engine FP8 through `accelerate launch`
with the `fp8_config: {accel_fp8_fix: true}` flag on 2 CPU processes, a tiny transformers Qwen2, a few steps, no
`end_training()`) is launched repeatedly under the project's heavy load (`scripts/loaded.sh --heavy`: four busy
loops and a disk-churn loop beside it); every launch must exit 0 with no "terminate called" in its output.
Without the fix, gloo's worker threads race interpreter teardown and a finished worker aborts now and then
(SIGABRT, exit 1; more often with a collective still in flight at the end: half the launches here end that way).
Half the launches end with `accelerator.end_training()` (stock destroys the default group there and returns while
the groups FSDP2 and the mesh still hold keep gloo's workers releasing: 4 of 10 such launches aborted beside the
heavy load before its destroy was wrapped, 0 of 10 after; examples/demo.py aborted so once in CI).

The suite launches it 4 times (each combination of in flight / end_training once: exit 0 is asserted every time),
side by side under one heavy load (each launch has the busy loops, the disk churn and three other launches beside it:
a heavier load than one launch at a time, in half the wall time); the abort *rate* is a measurement, not a suite test: ``ACCEL_FP8_FIX_CLEAN_EXIT_LAUNCHES=40 python -m pytest -q tests/distributed/test_clean_exit.py``
(and ``ACCEL_FP8_FIX_CLEAN_EXIT_SHOW_STOCK=1`` for the stock rate under the same load; figures: docs/failures.md).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "clean_exit_script.py"
LAUNCHES = int(os.environ.get("ACCEL_FP8_FIX_CLEAN_EXIT_LAUNCHES", "4"))
SIDE_BY_SIDE = 4  # launches at a time: 8 ranks beside the loops

CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: 0
mixed_precision: fp8
fp8_config:
  backend: TE
  accel_fp8_fix: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  fsdp_cpu_ram_efficient_loading: false
  fsdp_reshard_after_forward: true
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_")) and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    # the fixes on through the config flag (accelerate launch exports it), TE and FSDP2 on CPU through the rehearsal
    env.update(ACCEL_FP8_FIX_REHEARSAL="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _launch_side_by_side(config: Path, runs: list, tmp_path: Path) -> list:
    """``accelerate launch`` of the user script once per ``(args, extra_env)`` of ``runs``, up to ``SIDE_BY_SIDE`` at
    a time, each wave under one heavy load (the loops end with the wave's last launch): ``(exit status, output)``
    per run, in order."""
    results = []
    for first in range(0, len(runs), SIDE_BY_SIDE):
        wave = runs[first:first + SIDE_BY_SIDE]
        lines = []
        for i, (args, extra) in enumerate(wave, start=first):
            cmd = ["env", *(f"{k}={v}" for k, v in extra.items()), sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(config), str(SCRIPT), *args]
            out, rc = tmp_path / f"launch{i}.out", tmp_path / f"launch{i}.rc"
            lines.append(f"({shlex.join(cmd)} >{shlex.quote(str(out))} 2>&1; echo $? >{shlex.quote(str(rc))}) &")
        subprocess.run(["bash", str(ROOT / "scripts" / "loaded.sh"), "--heavy", "bash", "-c", "\n".join(lines + ["wait"])],
                       env=_env(), capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
        for i in range(first, first + len(wave)):
            results.append((int((tmp_path / f"launch{i}.rc").read_text()), (tmp_path / f"launch{i}.out").read_text()))
    return results


def test_finished_runs_exit_zero(tmp_path):
    config = tmp_path / "fsdp2.yaml"
    config.write_text(CONFIG)
    from accel_fp8_fix.diagnostics.collective_order import check_dir, load_dir

    runs = []
    for i in range(LAUNCHES):
        in_flight, end_training = i % 2 == 1, i // 2 % 2 == 1
        args = ["--steps", "2"] + (["--in-flight"] if in_flight else []) + (["--end-training"] if end_training else [])
        # the user script's collectives agree across ranks, too
        runs.append((args, {"ACCEL_FP8_FIX_COLLECTIVE_AUDIT": str(tmp_path / f"collectives{i}")}))
    failures = []
    for i, ((args, extra), (returncode, out)) in enumerate(zip(runs, _launch_side_by_side(config, runs, tmp_path))):
        assert "training done" in out, f"launch {i} did not finish training:\n{out[-4000:]}"
        assert "mixed precision fp8, te modules 14" in out, out[-4000:]  # it trained in FP8
        audit = Path(extra["ACCEL_FP8_FIX_COLLECTIVE_AUDIT"])
        assert check_dir(audit) == [] and [len(r["sequences"]) for r in load_dir(audit).values()] == [2], i
        if returncode != 0 or "terminate called" in out:
            failures.append(f"launch {i} ({' '.join(args)}): exit {returncode}\n{out[-1500:]}")
    assert not failures, f"{len(failures)} of {LAUNCHES} finished launches did not exit cleanly:\n" + "\n".join(failures)


def test_clean_exit_handler_is_a_no_op_once_undone():
    """The atexit handler acts only while the patch set is applied; after deactivate() it leaves the process
    group alone (stock behaviour), and it never runs a destroy when no group exists."""
    code = (
        "import torch.distributed as dist, accel_fp8_fix\n"
        "from accel_fp8_fix.fixes.start import clean_exit\n"
        "from accelerate.state import PartialState\n"
        "import os\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "print(clean_exit.destroy_at_exit())\n"
        "PartialState(cpu=True)\n"
        "assert dist.is_initialized() and clean_exit._registered\n"
        "accel_fp8_fix.deactivate()\n"
        "print(clean_exit.destroy_at_exit())\n"
        "assert dist.is_initialized()\n"
        "accel_fp8_fix.activate()\n"
        "print(clean_exit.destroy_at_exit())\n"
        "assert not dist.is_initialized()\n"
    )
    env = {k: v for k, v in _env(ACCEL_FP8_FIX="1").items() if k != "ACCEL_FP8_FIX_REHEARSAL"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["skipped:", "no", "process", "group", "skipped:", "patch", "set", "not", "applied",
                                   "destroyed"], proc.stdout


@pytest.mark.skipif(os.environ.get("ACCEL_FP8_FIX_CLEAN_EXIT_SHOW_STOCK") != "1",
                    reason="measures the stock abort rate (set ACCEL_FP8_FIX_CLEAN_EXIT_SHOW_STOCK=1)")
def test_stock_runs_abort_at_exit_sometimes(tmp_path):
    """With the fixes off the same launches abort at teardown now and then (a rate, not a certainty)."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(CONFIG)
    runs = [(["--steps", "2", "--in-flight"], {"ACCEL_FP8_FIX": "0"})] * LAUNCHES
    aborted = sum(returncode != 0 and "terminate called" in out
                  for returncode, out in _launch_side_by_side(config, runs, tmp_path))
    print(f"stock: {aborted} of {LAUNCHES} finished launches aborted at exit")
    assert aborted > 0


@pytest.mark.parametrize("ending", ["exit handler", "end_training"])
def test_exit_handler_drains_every_gloo_group_then_sees_its_workers_parked(ending):
    """Before destroying, the exit handler (or end_training()'s destroy) issues an async barrier on every gloo group
    this rank belongs to (gloo's barrier completes only after the group's queued and running collectives) and waits
    for them; after it, gloo's worker threads of the groups still referenced are parked. One process, world size 1,
    a real gloo subgroup."""
    code = (
        "import os, time, torch, torch.distributed as dist, accel_fp8_fix\n"
        "from accel_fp8_fix.fixes.start import clean_exit\n"
        "from accelerate.state import PartialState\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "PartialState(cpu=True)\n"
        "sub = dist.new_group([0])\n"
        "barriers, stock = [], dist.barrier\n"
        "def barrier(group=None, async_op=False, **kwargs):\n"
        "    work = stock(group=group, async_op=async_op, **kwargs)\n"
        "    barriers.append((group is dist.group.WORLD, group is sub, async_op, work))\n"
        "    return work\n"
        "dist.barrier = barrier\n"
        "pending = dist.all_reduce(torch.ones(1 << 20), group=sub, async_op=True)  # never waited by the script\n"
        "deadline = time.monotonic() + 30\n"
        "while len(clean_exit._workers()) < 4 and time.monotonic() < deadline:  # a new worker names itself first\n"
        "    time.sleep(0.01)\n"
        "before = len(clean_exit._workers())\n"
        + ("print(clean_exit.destroy_at_exit())\n" if ending == "exit handler" else
           "from accelerate import Accelerator\n"
           "print(Accelerator(cpu=True).end_training() or ('destroyed' if not dist.is_initialized() else 'kept'))\n")
        + "print([(world, subgroup, a, w.is_completed()) for world, subgroup, a, w in barriers], pending.is_completed())\n"
        "print(before, clean_exit.wait_for_gloo_workers(time.monotonic() + 30))\n"
    )
    env = _env(ACCEL_FP8_FIX="1")
    env.pop("ACCEL_FP8_FIX_REHEARSAL")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "destroyed", proc.stdout
    assert lines[1] == "[(True, False, True, True), (False, True, True, True)] True", proc.stdout
    # two worker threads per gloo group (ProcessGroupGloo's default); the default group's are joined by the
    # destroy (its last reference), the subgroup's (still referenced by the script) are parked
    assert lines[2] == "4 parked: 2", proc.stdout
