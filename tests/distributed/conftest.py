"""Fixtures of tests/distributed: the two launches test_stock_failures.py, test_stock_failures_fixed.py and
test_rehearsal.py share (``scenarios.PLAN_2RANK`` on 2 ranks, ``scenarios.PLAN_4RANK`` on 4), in the environment the
test module names as its ``ENV`` (``scenarios.ENV_REHEARSAL``: stock accelerate under the rehearsal;
``scenarios.ENV_FIXED``: the same with the patch set on). Memoised by ``scenarios.launch``: the two modules with
one ``ENV`` share one launch of each."""

from __future__ import annotations

import pytest

from support import scenarios


@pytest.fixture(scope="module")
def two(request):
    return scenarios.launch(scenarios, scenarios.PLAN_2RANK, 2, env=request.module.ENV)


@pytest.fixture(scope="module")
def four(request):
    # stock accelerate's A6 path scatters / broadcasts different sizes per rank (the collective-order audit names
    # it: test_load_full_state_dict.py): audited only with the patch set on
    env = request.module.ENV
    return scenarios.launch(scenarios, scenarios.PLAN_4RANK, 4, env=env, timeout=240,
                            audit_collectives=env.get("ACCEL_FP8_FIX") == "1")
