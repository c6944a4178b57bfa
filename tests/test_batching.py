"""StepBatcher against a real PS-only job: tables sharing ids travel in one RPC per PS, a
step's pushes leave together, and the values are exactly those of ungrouped calls."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from deeprec_ext import PSClient
from deeprec_ext.batching import StepBatcher
from tests.conftest import Job

SGD = {"name": "sgd", "learning_rate": 1.0}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("batchjob"), {"name": "batching"}, ["--ps", "2", "--workers", "0"])
    c = PSClient.connect(job.address, timeout=60)
    yield c
    c.close()
    job.stop()


def _batcher(client):
    return StepBatcher(client, lambda batch, return_tables=None: client.push_many(
        batch, unique=True, return_tables=return_tables))


def _step(b, tables, ids, grad_of):
    """One training step as the TF ops run it: every lookup, then every push."""
    out = {t: b.lookup(t, ids, True) for t in tables}
    for t in tables:
        b.push(t, ids, grad_of(t, out[t]))
    b.end_step()
    return out


def test_grouped_steps_match_ungrouped_calls_and_use_fewer_rpcs(client):
    for name in ("g_emb", "g_lin", "r_emb", "r_lin"):
        client.create_table(name, dim=4 if "emb" in name else 1, initializer="zeros",
                            optimizer=SGD)
    b = _batcher(client)
    rng = np.random.default_rng(0)
    grad = lambda t, v: np.full(v.shape, 0.5, np.float32) + v * 0.1  # noqa: E731
    for step in range(6):
        ids = np.unique(rng.integers(0, 5000, 300)).astype(np.int64)
        before = client.stats["rpcs"]
        grouped = _step(b, ["g_emb", "g_lin"], ids, grad)
        rpcs = client.stats["rpcs"] - before
        # the reference: each table on its own, ungrouped
        ref = {t: client.lookup(t, ids, unique=True) for t in ("r_emb", "r_lin")}
        for t in ("r_emb", "r_lin"):
            client.push(t, ids, grad(t, ref[t]), unique=True)
        np.testing.assert_array_equal(grouped["g_emb"], ref["r_emb"])
        np.testing.assert_array_equal(grouped["g_lin"], ref["r_lin"])
        if step >= 1:  # learned after the first step: 1 lookup + 1 push RPC per PS
            assert rpcs == 2 * len(client.routing.ps_addresses), rpcs
    assert b.groups == {"g_emb": ["g_lin"], "g_lin": ["g_emb"]}
    assert b.stats["prefetch_hits"] == 5


def test_diverging_ids_fall_back_and_unlearn(client):
    client.create_table("d_a", dim=2, initializer="zeros", optimizer=SGD)
    client.create_table("d_b", dim=2, initializer="zeros", optimizer=SGD)
    b = _batcher(client)
    ids = np.arange(100, dtype=np.int64)
    _step(b, ["d_a", "d_b"], ids, lambda t, v: np.ones(v.shape, np.float32))
    # same first table, different ids for the second: the prefetch is not used
    a = b.lookup("d_a", ids, True)
    other = np.arange(1000, 1050, dtype=np.int64)
    got = b.lookup("d_b", other, True)
    assert got.shape == (50, 2) and not got.any()  # fresh rows, not d_b's rows of `ids`
    np.testing.assert_array_equal(a, np.full((100, 2), -1.0, np.float32))
    assert b.groups == {}  # unlearned both ways
    b.end_step()


def test_held_push_leaves_at_step_end_and_concurrent_lookups_wait(client):
    client.create_table("h_a", dim=3, initializer="zeros", optimizer=SGD)
    client.create_table("h_b", dim=3, initializer="zeros", optimizer=SGD)
    b = _batcher(client)
    ids = np.arange(10, dtype=np.int64)
    _step(b, ["h_a", "h_b"], ids, lambda t, v: np.ones(v.shape, np.float32))
    # both tables looked up, only one pushes (the other had no gradient): held until the
    # step ends, then applied
    results = {}
    threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, b.lookup(t, ids, True)))
               for t in ("h_a", "h_b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    np.testing.assert_array_equal(results["h_a"], results["h_b"])
    b.push("h_a", ids, np.ones((10, 3), np.float32))
    assert client.lookup("h_a", ids, unique=True)[0, 0] == -1.0  # still held
    b.end_step()
    assert client.lookup("h_a", ids, unique=True)[0, 0] == -2.0
    assert client.lookup("h_b", ids, unique=True)[0, 0] == -1.0


def test_held_pushes_and_dense_sync_share_one_call(client):
    """hold_pushes: the step's gradients wait for end_step, which carries the dense deltas
    too and returns only the dense values."""
    client.create_table("f_emb", dim=2, initializer="zeros", optimizer=SGD)
    client.create_table("f_dense", dim=3, initializer="zeros", optimizer={"name": "assign_add"})
    b = _batcher(client)
    b.hold_pushes = True
    ids = np.arange(50, dtype=np.int64)
    b.lookup("f_emb", ids, True)
    b.push("f_emb", ids, np.ones((50, 2), np.float32))
    assert client.lookup("f_emb", ids, unique=True)[0, 0] == 0.0  # held
    before = client.stats["rpcs"]
    out = b.end_step({"f_dense": (np.arange(2, dtype=np.int64), np.full((2, 3), 0.25, np.float32))},
                     ["f_dense"])
    assert client.stats["rpcs"] - before == len(client.routing.ps_addresses)  # one per PS
    assert set(out) == {"f_dense"}
    np.testing.assert_array_equal(out["f_dense"], np.full((2, 3), 0.25, np.float32))
    assert client.lookup("f_emb", ids, unique=True)[0, 0] == -1.0
