"""Placement: slots balanced over the PS by bytes and by lookups, moving few slots; and a
live rebalance of a skewed job that keeps every row and every concurrent update."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from aimaster.placement import balance, imbalance, slot_loads
from deeprec_ext import PSClient
from deeprec_ext.hashing import slot_of
from tests.conftest import ROOT, CounterPusher, Job

N = 4096
TWO = (np.arange(N) * 2 // N).astype(np.int32)  # the even layout of 2 PS


def _moved(old_owner, old_ids, new_owner, new_ids):
    return int((np.asarray(old_ids)[old_owner] != np.asarray(new_ids)[new_owner]).sum())


def test_no_data_yet_scale_out_and_in_even_counts_fewest_moves():
    loads = slot_loads(np.zeros(N), np.zeros(N))
    three = balance(TWO, ["a", "b"], ["a", "b", "c"], loads)
    assert np.bincount(three).tolist() == [1366, 1366, 1364]
    assert _moved(TWO, ["a", "b"], three, ["a", "b", "c"]) == 1364  # only what c needs
    one = balance(TWO, ["a", "b"], ["b"], loads)
    assert (one == 0).all() and _moved(TWO, ["a", "b"], one, ["b"]) == 2048


def test_skewed_bytes_and_hot_slots_are_evened_out():
    rng = np.random.default_rng(0)
    nbytes = rng.uniform(900, 1100, N)
    nbytes[:2048] *= 3                      # PS a holds 3x the rows of b
    lookups = np.ones(N)
    lookups[2048:2100] = 500                # a few hot slots on b
    loads = slot_loads(nbytes, lookups)
    assert imbalance(TWO, nbytes, 2) > 1.4 and imbalance(TWO, lookups, 2) > 1.3
    new = balance(TWO, ["a", "b"], ["a", "b"], loads)
    # bytes within the growth prior (10% of memory weight goes to the slot count)
    assert imbalance(new, nbytes, 2) < 1.1 and imbalance(new, lookups, 2) < 1.1
    assert _moved(TWO, ["a", "b"], new, ["a", "b"]) < N // 2


def test_balanced_layout_stays_put():
    loads = slot_loads(np.full(N, 1000.0), np.ones(N))
    assert (balance(TWO, ["a", "b"], ["a", "b"], loads) == TWO).all()


def test_bad_input():
    with pytest.raises(ValueError, match="empty"):
        balance(TWO, ["a", "b"], [], slot_loads(np.zeros(N), np.zeros(N)))


@pytest.mark.timeout(240)
def test_live_rebalance_of_a_skewed_job_loses_nothing(tmp_path):
    job = Job(tmp_path, {"name": "placement"}, ["--ps", "2", "--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    try:
        sgd = {"name": "sgd", "learning_rate": 1.0}
        client.create_table("skew", dim=16, initializer={"name": "uniform", "seed": 3},
                            optimizer=sgd)
        client.create_table("cnt", dim=1, initializer="zeros", optimizer=sgd)
        owner = client.routing.slot_owner
        cand = np.arange(2_000_000, dtype=np.int64)
        on_first = cand[owner[slot_of(cand, client.routing.num_slots)] == 0][:150_000]
        keys = np.concatenate([on_first, np.arange(3_000_000, 3_030_000, dtype=np.int64)])
        before = client.lookup("skew", keys)  # inserts: ~5x the rows on the first PS
        rows = lambda: sorted(sum(t.rows for t in s.tables if t.name == "skew")  # noqa: E731
                              for s in client.ps_stats())
        assert rows()[1] > 4 * rows()[0]
        pusher = CounterPusher(client, "cnt", 20_000, batch=500).start()
        out = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master",
                              job.address, "--rebalance", "--timeout", "120"],
                             cwd=ROOT, capture_output=True, text=True, timeout=180)
        pusher.stop()
        assert out.returncode == 0, out.stderr
        event = json.loads(out.stdout)
        assert event["kind"] == "rebalance" and event["moved_slots"] > 0, event
        assert event["bytes_imbalance"][0] > 1.4 and event["bytes_imbalance"][1] < 1.1, event
        small, big = rows()
        assert big < 1.15 * small, (small, big)
        # every row kept its value; every concurrent +1 landed exactly once
        np.testing.assert_array_equal(client.lookup("skew", keys, insert_missing=False), before)
        got = client.lookup("cnt", np.arange(20_000), insert_missing=False)[:, 0]
        np.testing.assert_array_equal(got.astype(np.int64), pusher.expected)
        # nothing to do the second time
        again = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master",
                                job.address, "--rebalance"], cwd=ROOT, capture_output=True,
                               text=True, timeout=180)
        assert again.returncode == 0 and json.loads(again.stdout)["moved_slots"] == 0
        bad = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master",
                              job.address, "--rebalance", "--ps", "3"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "--rebalance keeps the counts" in bad.stderr
    finally:
        client.close()
        job.stop()
