"""Pooled ranks give what fresh interpreters give: the scenario each test file's rotation picks runs again in fresh
ranks and its facts must be equal (tests/support/agreement.py). Runs last in the session (tests/conftest.py), over
the launches the session's tests made; with pools off (ACCEL_FP8_FIX_TEST_POOL=0) there is nothing to compare."""

import json

import pytest

from support import agreement, launcher
from support import scenarios

pytestmark = pytest.mark.run_last


def test_each_files_rotating_scenario_equals_its_fresh_interpreter_run():
    chosen = agreement.choices()
    if not chosen:
        pytest.skip("no pooled launch in this session (pools off, or no multi-process test selected)")
    problems, checked = [], []
    for (world_size, env, audit), members in agreement.groups(chosen).items():
        entries = [(c["launch"]["module"], c["name"], c["kwargs"]) for c in members]
        fresh = launcher.run(scenarios.run_entries, world_size, args=(entries,), env=json.loads(env), fresh=True,
                             init_process_group=False, audit_collectives=audit,
                             timeout=sum(c["launch"]["timeout"] for c in members),
                             collective_timeout=max(c["launch"]["collective_timeout"] for c in members))
        for position, c in enumerate(members):
            key = scenarios.key_of(c["launch"]["plan"], c["name"], c["kwargs"])
            for rank in range(world_size):
                pooled_facts = agreement.normalized(c["launch"]["results"][rank][key])
                fresh_facts = agreement.normalized(fresh[rank][position])
                for d in agreement.differences(pooled_facts, fresh_facts):
                    problems.append(f"{c['file']} {c['name']}({c['kwargs']}) rank {rank}: {d}")
            checked.append(f"{c['file']}: {c['name']}")
    assert not problems, "pooled and fresh runs disagree:\n  " + "\n  ".join(problems)
    assert len(checked) == len(chosen)
