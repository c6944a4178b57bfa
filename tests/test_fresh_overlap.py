"""Overlap mode keeps lookups fresh: a step's push is in flight while the next step looks
its rows up, and the rows the push changed are taken from the push's answer, so the
worker reads what a synchronous push would have left (one worker: exactly)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from deeprec_ext.worker import WorkerContext


def _slow_pushes(ctx, seconds: float):
    real = ctx.client.push_many

    def slow(*args, **kwargs):
        time.sleep(seconds)  # the push is still in flight when the next lookup leaves
        return real(*args, **kwargs)
    ctx.client.push_many = slow


@pytest.mark.parametrize("fresh", [True, False])
def test_lookup_during_an_inflight_push_reads_its_rows(start_job, fresh):
    job = start_job({"name": f"overlap-{fresh}"}, ["--ps", "2", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    try:
        ctx.client.create_table("t", dim=2, initializer="zeros",
                                optimizer={"name": "sgd", "learning_rate": 1.0})
        ctx.async_pushes, ctx.fresh_lookups = True, fresh
        _slow_pushes(ctx, 0.5)
        rng = np.random.default_rng(0)
        expected = {}
        for step in range(4):
            ids = np.unique(rng.integers(0, 3000, 800)).astype(np.int64)
            got = ctx.lookup("t", ids)
            want = np.array([expected.get(int(i), 0.0) for i in ids], np.float32)
            if fresh:  # every earlier push is in what the step reads
                np.testing.assert_array_equal(got[:, 0], want)
                np.testing.assert_array_equal(got[:, 1], 2 * want)
            elif step > 0:  # the previous step's push was still in flight: stale rows
                assert (got[:, 0] != want).any()
            ctx.push_async("t", ids, np.tile(np.array([[-1.0, -2.0]], np.float32), (ids.size, 1)))
            ctx.step_done()
            for i in ids:
                expected[int(i)] = expected.get(int(i), 0.0) + 1.0
        ctx.flush_pushes()
        ids = np.array(sorted(expected), np.int64)
        final = ctx.client.lookup("t", ids, insert_missing=False)
        np.testing.assert_array_equal(final[:, 0], [expected[int(i)] for i in ids])
    finally:
        ctx.close()


def test_overlap_takes_only_its_three_values():
    import deeprec_ext.tf as dtf
    for good in (False, True, "stale"):
        dtf.ElasticCallback(overlap=good)
    with pytest.raises(ValueError, match="overlap must be False, True or 'stale'"):
        dtf.ElasticCallback(overlap="fresh")
