"""The suite's one way to start ranks: pooled interpreters (``accel_fp8_fix.testing.pool.RankPool``), one pool per
world size and environment, kept for the pytest session.

``run(fn, world_size, args=..., env=...)`` is ``run_distributed``'s call with pooled ranks: a rank imports torch,
accelerate, transformers and Transformer Engine once per session instead of once per launch. What a pool cannot
give (an interpreter's start-up and exit: the ``.pth`` activation, exit status, ``accelerate launch``) is tested
with ``run_distributed`` or subprocesses directly. ``ACCEL_FP8_FIX_TEST_POOL=0`` makes ``run`` start fresh
interpreters every time (the suite as it ran before pools); ``ACCEL_FP8_FIX_TEST_POOLS`` (default 6) and
``ACCEL_FP8_FIX_TEST_POOL_RANKS`` (default 14) are how many pools and how many ranks stay alive at once (an idle
rank holds ~0.5-0.7 GB); past either, the pool with the fewest runs so far is closed (the least recently used
among equals): the suite's main environments serve most files, and closing them by recency alone restarted each
of them three times a session.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from accel_fp8_fix.testing import run_distributed
from accel_fp8_fix.testing.pool import RankPool, preload_for

_POOLS: OrderedDict = OrderedDict()
STATS = {"runs": 0, "fresh": 0, "pools": 0, "starts": 0, "start_s": 0.0}


def pooled() -> bool:
    return os.environ.get("ACCEL_FP8_FIX_TEST_POOL", "1").strip().lower() not in ("0", "false", "no", "off")


def _max_alive() -> int:
    return max(int(os.environ.get("ACCEL_FP8_FIX_TEST_POOLS", "6")), 1)


def _max_ranks() -> int:
    return max(int(os.environ.get("ACCEL_FP8_FIX_TEST_POOL_RANKS", "14")), 1)


def _make_room(world_size: int) -> None:
    """Close pools until one of ``world_size`` more ranks fits: the fewest runs first, then the least recent."""
    while _POOLS and (len(_POOLS) >= _max_alive()
                      or sum(p.world_size for p in _POOLS.values()) + world_size > _max_ranks()):
        order = list(_POOLS)  # least recently used first
        victim = min(order, key=lambda key: (_POOLS[key].runs, order.index(key)))
        _retire(_POOLS.pop(victim), "fewest runs")


def pool_for(world_size: int, env: dict | None) -> RankPool:
    """The pool of ``world_size`` ranks started with ``env`` (started on its first run)."""
    env = dict(env or {})
    key = (world_size, json.dumps(env, sort_keys=True))
    if key in _POOLS:
        _POOLS.move_to_end(key)
        return _POOLS[key]
    _make_room(world_size)
    _POOLS[key] = RankPool(world_size, env=env, preload=preload_for(env))
    return _POOLS[key]


def run(fn, world_size: int, *, args: tuple = (), env: dict | None = None, timeout: float = 150.0,
        collective_timeout: float = 45.0, init_process_group: bool = True, audit_collectives: bool = True,
        fresh: bool = False) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` pooled ranks (``fresh=True`` or pools off: new
    interpreters, ``run_distributed``); results by rank."""
    STATS["runs"] += 1
    if fresh or not pooled():
        STATS["fresh"] += 1
        return run_distributed(fn, world_size, args=args, env=env, timeout=timeout,
                               collective_timeout=collective_timeout, init_process_group=init_process_group,
                               audit_collectives=audit_collectives)
    return pool_for(world_size, env).run(fn, args=args, timeout=timeout, collective_timeout=collective_timeout,
                                         init_process_group=init_process_group, audit_collectives=audit_collectives)


def retire(world_size: int, env: dict | None) -> None:
    """Close the pool of ``world_size`` and ``env`` (its next run starts new ranks)."""
    pool = _POOLS.pop((world_size, json.dumps(dict(env or {}), sort_keys=True)), None)
    if pool is not None:
        _retire(pool, "retired")


def _retire(pool: RankPool, why: str) -> None:
    _note_retire(pool, why)
    STATS["pools"] += 1
    STATS["starts"] += pool.starts
    STATS["start_s"] += pool.start_seconds
    pool.close()


def close_all() -> dict:
    """Close every pool (end of the session); the session's figures: runs (pooled and fresh), pools, rank starts
    and the seconds spent starting them."""
    while _POOLS:
        _retire(_POOLS.popitem(last=False)[1], "end of session")
    return dict(STATS)


def _note_retire(pool: RankPool, why: str) -> None:
    """With ACCEL_FP8_FIX_TEST_PROFILE=FILE: a line saying which pool closed and why (scripts/suite_profile.py)."""
    out = os.environ.get("ACCEL_FP8_FIX_TEST_PROFILE")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps({"retire": why, "world_size": pool.world_size, "pool_env": pool.env,
                                 "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "runs": pool.runs}) + "\n")
