"""Which pools the suite's launcher keeps (tests/support/launcher.py): at most ACCEL_FP8_FIX_TEST_POOLS pools and
ACCEL_FP8_FIX_TEST_POOL_RANKS ranks alive; the pool with the fewest runs goes first, the least recent among equals."""

from collections import OrderedDict

import pytest

from support import launcher


class FakePool:
    def __init__(self, world_size, runs):
        self.world_size, self.runs, self.env, self.starts, self.start_seconds = world_size, runs, {}, 1, 0.0
        self.closed = False

    def close(self):
        self.closed = True


@pytest.fixture
def pools(monkeypatch):
    fake = OrderedDict()
    monkeypatch.setattr(launcher, "_POOLS", fake)
    monkeypatch.setattr(launcher, "STATS", dict(launcher.STATS))
    monkeypatch.setenv("ACCEL_FP8_FIX_TEST_POOLS", "3")
    monkeypatch.setenv("ACCEL_FP8_FIX_TEST_POOL_RANKS", "10")
    return fake


def test_the_busiest_pools_stay_and_the_least_used_goes(pools):
    main4, main2, once = FakePool(4, 9), FakePool(2, 7), FakePool(2, 1)
    pools.update({"main4": main4, "once": once, "main2": main2})  # "main4" least recently used
    launcher._make_room(2)  # 3 pools alive: one must go
    assert list(pools) == ["main4", "main2"] and once.closed and not main4.closed


def test_the_rank_budget_closes_pools_until_the_new_one_fits(pools):
    a, b = FakePool(4, 5), FakePool(4, 5)
    pools.update({"a": a, "b": b})
    launcher._make_room(4)  # 8 + 4 > 10 ranks: the less recent of two equally used pools goes
    assert list(pools) == ["b"] and a.closed
    launcher._make_room(2)  # 4 + 2 fits
    assert list(pools) == ["b"]
