"""Which scenarios the pooled-equals-fresh check runs again (tests/support/agreement.py): one per test file, as few
fresh launches as the rotation allows, every eligible scenario of every file chosen on some day."""

import pytest

from support import agreement


def _launch(world_size, env, names):
    return {"module": "m", "plan": [(n, {"ckpt_dir": "/x"} if n.startswith("save") else {}) for n in names],
            "world_size": world_size, "env": env, "audit": True, "timeout": 60, "collective_timeout": 30,
            "results": []}


@pytest.fixture
def records(monkeypatch):
    recs = {
        "tests/distributed/test_a.py": [_launch(2, {"X": "1"}, ["a1", "a2"]), _launch(4, {}, ["a3"])],
        "tests/distributed/test_b.py": [_launch(2, {"X": "1"}, ["b1"]), _launch(2, {"Y": "1"}, ["b2", "save_b"])],
        "tests/distributed/test_c.py": [_launch(4, {}, ["c1"]), _launch(2, {"X": "1"}, ["c2", "c3"])],
        "tests/distributed/test_d.py": [_launch(2, {"Z": "1"}, ["d1"])],
    }
    monkeypatch.setattr(agreement, "RECORDS", recs)
    return recs


def test_one_scenario_per_file_and_no_folder_scenario(records):
    for turn in range(40):
        chosen = agreement.choices(turn, cap=0)
        assert sorted(c["file"] for c in chosen) == sorted(records)
        assert not any(c["name"].startswith("save") for c in chosen)


def test_files_share_fresh_launches(records):
    """test_d can only run with Z; the others can share one environment besides the leader's: at most 3 launches
    where picking each file's scenario by rotation alone would often need 4."""
    for turn in range(40):
        groups = agreement.groups(agreement.choices(turn, cap=0), turn)
        assert len(groups) <= 3, (turn, list(groups))
        assert ((2, '{"Z": "1"}', True)) in groups


@pytest.mark.parametrize("cap", [1, 2])
def test_a_cap_on_fresh_launches_keeps_the_leads_and_still_reaches_every_scenario(records, cap):
    """ACCEL_FP8_FIX_TEST_AGREEMENT_LAUNCHES (the README's command: 1): at most that many fresh launches a turn, the
    leading file always among the files checked, and over the days every eligible scenario still chosen."""
    seen = set()
    for turn in range(200):
        chosen = agreement.choices(turn, cap=cap)
        groups = agreement.groups(chosen, turn)
        assert 1 <= len(groups) <= cap
        assert sorted(records)[turn % len(records)] in {c["file"] for c in chosen}
        seen |= {(c["file"], c["name"]) for c in chosen}
    eligible = {(file, name) for file, launches in records.items() for launch in launches
                for name, _ in launch["plan"] if not name.startswith("save")}
    assert seen == eligible
    uncapped = {len(agreement.groups(agreement.choices(turn, cap=0), turn)) for turn in range(40)}
    assert max(uncapped) > 1  # the cap is what holds it to one


def test_every_eligible_scenario_is_chosen_on_some_day(records):
    seen = {(c["file"], c["name"]) for turn in range(200) for c in agreement.choices(turn, cap=0)}
    eligible = {(file, name) for file, launches in records.items() for launch in launches
                for name, _ in launch["plan"] if not name.startswith("save")}
    assert seen == eligible


def test_every_scenario_of_a_plan_starts_with_te_global_state_empty(monkeypatch):
    """TE's global amax buffers keep every module that ran under its autocast: run_plan empties them before each
    scenario (as a pool does between runs), so a scenario's facts do not depend on the ones before it in its plan —
    the pooled-equals-fresh check found sc_train's amax all-reduce 3x its size after two earlier scenarios."""
    import sys
    from types import ModuleType, SimpleNamespace

    from support import scenarios

    buffer = {}  # stands for FP8GlobalStateManager.global_amax_buffer
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", ModuleType("transformer_engine.pytorch"))
    monkeypatch.setattr(scenarios, "reset_te_global_state", buffer.clear)
    monkeypatch.setattr(scenarios, "reset_accelerate", lambda: None)
    monkeypatch.setattr(scenarios, "meta_facts", lambda: {})

    def sc_one_module(rank, world_size, name):
        seen = sorted(buffer)
        buffer[name] = [rank]  # a module's amax, left behind as TE leaves it
        return {"found": seen}

    plan = [("sc_one_module", {"name": "a"}), ("sc_one_module", {"name": "b"}), ("sc_one_module", {"name": "c"})]
    out = scenarios.run_plan(SimpleNamespace(sc_one_module=sc_one_module), 0, 1, plan)
    assert [out[key]["found"] for key in scenarios.result_keys(plan)] == [[], [], []]
