"""The exit handler's wait for gloo's worker threads (A20, `accel_fp8_fix/fixes/start/clean_exit.py`): what counts as
parked, the deadline, the fallback without /proc. The real threads: tests/distributed/test_clean_exit.py."""

import time

from accel_fp8_fix.fixes.start import clean_exit


def _feed(monkeypatch, looks):
    """clean_exit reads the workers from ``looks`` (one dict per look; the last repeats), sleeping for real."""
    looks = list(looks)
    seen = []

    def workers():
        seen.append(looks[0] if len(looks) == 1 else looks.pop(0))
        return seen[-1]

    monkeypatch.setattr(clean_exit, "_workers", workers)
    return seen


def test_parked_needs_every_worker_asleep_and_unchanged_over_consecutive_intervals(monkeypatch):
    running = {"7": ("R", "3", "0"), "8": ("S", "5", "1")}
    woke = {"7": ("S", "4", "0"), "8": ("S", "5", "1")}  # 7 blocked again, after running once
    seen = _feed(monkeypatch, [running, running, woke, woke, woke])
    assert clean_exit.wait_for_gloo_workers(time.monotonic() + 5) == "parked: 2"
    # running twice (unchanged but R) is not parked; woke must be seen unchanged twice after its first look
    assert seen == [running, running, woke, woke, woke]


def test_a_worker_that_keeps_switching_is_busy_until_the_deadline(monkeypatch):
    count = iter(range(10**6))
    monkeypatch.setattr(clean_exit, "_workers", lambda: {"7": ("S", str(next(count)), "0")})
    start = time.monotonic()
    assert clean_exit.wait_for_gloo_workers(start + 0.2) == "busy"
    assert 0.2 <= time.monotonic() - start < 2


def test_no_workers_left_returns_at_once_and_without_proc_the_grace_is_held(monkeypatch):
    _feed(monkeypatch, [{}])
    assert clean_exit.wait_for_gloo_workers(time.monotonic() + 5) == "parked: 0"
    _feed(monkeypatch, [None])
    slept = []
    monkeypatch.setattr(clean_exit.time, "sleep", slept.append)
    monkeypatch.setenv(clean_exit.GRACE_ENV, "0.7")
    assert clean_exit.wait_for_gloo_workers(time.monotonic() + 5) == "grace"
    assert slept == [0.7]


def test_workers_are_read_by_thread_name_from_proc(tmp_path, monkeypatch):
    for tid, name, state in (("11", "pt_gloo_runloop", "S (sleeping)"), ("12", "python", "R (running)"),
                             ("13", "pt_gloo_runloop", "R (running)")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "comm").write_text(name + "\n")
        (tmp_path / tid / "status").write_text(
            f"Name:\t{name}\nState:\t{state}\nvoluntary_ctxt_switches:\t{tid}\nnonvoluntary_ctxt_switches:\t2\n")
    (tmp_path / "14").mkdir()  # a thread that ended while being read
    monkeypatch.setattr(clean_exit, "TASKS", str(tmp_path))
    assert clean_exit._workers() == {"11": ("S", "11", "2"), "13": ("R", "13", "2")}
    monkeypatch.setattr(clean_exit, "TASKS", str(tmp_path / "gone"))
    assert clean_exit._workers() is None
