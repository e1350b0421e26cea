"""The killable worker pool: deadlines, replacement of killed workers, order, errors."""

import time

import pytest

from posttrain.rewards.pool import WorkerPool

pytestmark = pytest.mark.timeout(60)


def test_overrun_is_killed_replaced_and_results_stay_in_order():
    pool = WorkerPool(2)
    try:
        t0 = time.monotonic()
        out = pool.map(time.sleep, [(0.01,), (30,), (0.01,), (0.02,)], timeout=1.0)
        assert time.monotonic() - t0 < 20
        assert [o.timed_out for o in out] == [False, True, False, False]
        assert [o.ok for o in out] == [True, False, True, True]
        assert pool.killed == 1
        out = pool.map(int, [("12",), ("x",), ("7",)], timeout=5.0)  # the pool still works
        assert [o.value for o in out] == [12, None, 7]
        assert out[1].error.startswith("ValueError")
        out = pool.map(lambda: 1, [()], timeout=5.0)  # unpicklable: an error, not a hang
        assert out[0].error
    finally:
        pool.close()
