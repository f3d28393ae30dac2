"""Faults survived, nothing lost (issue 47 item 3, A25 in docs/failures.md): under ``accelerate launch
--max_restarts 2``, process 1 of an FP8 run is SIGKILLed twice — between two checkpoints, then inside ``save_state``
— and the job ends bit-identical to its uninterrupted first attempt (which ran to the end before the first kill): every loss after each resume, every weight shard, FP8
state tensor (delayed-scaling histories and scales, per-expert under EP, the FP8 all-gather's under TP) and
optimizer state. The checkpoint the second kill tore is refused by name when a plain ``load_state()`` would pick
it. The script is a user's (tests/support/resumable_training.py): FSDP2 x TP Llama with the FP8 all-gather on 4
processes, FSDP2 x EP Qwen3-MoE on 2.

torchrun's in-place restart over gloo can connect to a killed worker's old address: the agent's store outlives the
round and the workers' keys carry no attempt (docs/troubleshooting.md, pytorch#135712). ``accelerate launch`` on one
machine uses torchrun's static rendezvous, whose store is always kept (a restarted job hung in
``init_process_group`` here). The launches run torchrun's standalone c10d rendezvous (``PET_STANDALONE=1``: a free
port and a job id of its own; plain ``--rdzv_backend c10d`` takes localhost:29400 and the id "none", shared by every
job on the machine) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a fresh store each round, as the troubleshooting
page tells users to. Nothing is retried here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "resumable_training.py"
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_FP8_FIX", "ACCELERATE_"))}
WORLD = {"tp": 4, "ep": 2}
STEPS, SAVE_EVERY = 6, 4
# One launch, three attempts. Attempt 0 runs uninterrupted to the end (checkpoint_0 at step 4), reports its end state,
# then process 1 is killed before the final save: steps 5-6 are lost (killed between checkpoints). Attempt 1 resumes
# from checkpoint_0 and is killed inside the final save_state (checkpoint_1 torn). Attempt 2 refuses checkpoint_1,
# resumes from checkpoint_0 again and finishes. Both resumed attempts must end as attempt 0 did, bit for bit.
KILLS = (f"0:between:{STEPS}", f"1:saving:{STEPS}")


def _launch(layout: str, project: Path, restarts: int = 0, kills=()) -> tuple[subprocess.CompletedProcess, list]:
    out = project.with_suffix(".jsonl")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(WORLD[layout]),
               "--num_machines", "1", "--main_process_port", "0", "--dynamo_backend", "no", "--monitor_interval", "1",
               "--max_restarts", str(restarts), str(SCRIPT), "--layout", layout, "--project-dir", str(project),
               "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    for kill in kills:
        command += ["--kill", kill]
    env = {**ENV, "ACCEL_FP8_FIX_REHEARSAL": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PET_STANDALONE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    project.with_suffix(".log").write_text(proc.stdout + proc.stderr)  # the whole launch, for a failure's reader
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, records


def _by_attempt(records: list) -> dict:
    attempts = {}
    for r in records:
        attempts.setdefault(r["attempt"], []).append(r)
    return attempts


def _losses(records: list) -> dict:
    return {r["step"]: r["loss"] for r in records if "step" in r}


@pytest.mark.parametrize("layout", sorted(WORLD))
def test_killed_between_checkpoints_and_while_saving_resumes_bit_identical(layout, tmp_path):
    from accel_fp8_fix.fixes.checkpoint.checkpoint_complete import MARKER, missing_parts

    proc, records = _launch(layout, tmp_path / "run", restarts=2, kills=KILLS)
    tail = proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    attempts = _by_attempt(records)
    assert sorted(attempts) == [0, 1, 2], tail  # two kills, two restarts: no more, no fewer
    uninterrupted = attempts[0]
    reference = _losses(uninterrupted)
    assert sorted(reference) == list(range(1, STEPS + 1)) and uninterrupted[0]["start"] == 0
    first, second = attempts[1][0], attempts[2][0]
    assert (first["start"], first["resumed_from"], first["plain_load_state"]) == (SAVE_EVERY, "checkpoint_0", "loaded")
    assert (second["start"], second["resumed_from"]) == (SAVE_EVERY, "checkpoint_0")
    refusal = second["plain_load_state"]
    assert refusal.startswith("accel_fp8_fix: load_state refuses ") and "checkpoint_1 before reading anything" in refusal
    assert "random_states_1.pkl (process 1's RNG states)" in refusal and "checkpoint_0" in refusal, refusal
    # each resumed attempt reruns the lost steps with the uninterrupted losses and ends in its end state, bit for bit:
    # per process, every weight shard, FP8 state tensor and optimizer state
    want = next(r["digests"] for r in uninterrupted if "digests" in r)
    assert len(want) == WORLD[layout]
    for attempt in (attempts[1], attempts[2]):
        assert _losses(attempt) == {step: reference[step] for step in range(SAVE_EVERY + 1, STEPS + 1)}
        assert next(r["digests"] for r in attempt if "digests" in r) == want
    names = set(want[0])
    assert any(n.startswith("optim:") for n in names) and any(n.startswith("param:") for n in names)
    fp8 = [n for n in names if n.startswith("buffer:") and ("amax_history" in n or "scale" in n)]
    assert fp8, sorted(names)[:20]  # FP8 state is in the comparison
    if layout == "ep":
        assert any("experts" in n for n in fp8), fp8
    # the torn folder was moved aside by the script; every checkpoint left is complete and marked
    torn = tmp_path / "run" / "torn" / "checkpoint_1.attempt2"
    assert torn.is_dir() and not (torn / MARKER).exists() and missing_parts(str(torn), WORLD[layout])
    left = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [p.name for p in left] == ["checkpoint_0", "checkpoint_1"]
    assert all((p / MARKER).exists() and not missing_parts(str(p)) for p in left)
