"""Admission: an id gets a row only once seen ``min_count`` times (exact counter or counting
bloom filter); counts move with their slot, and bad specs are refused naming the table."""
from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest

from deeprec_ext import InvalidRequestError, PSClient
from deeprec_ext.hashing import slot_of
from deeprec_ext.store import EmbeddingStore
from deeprec_ext.store.policies import candidate_table_name, check_policies
from deeprec_ext.store.table import unhash64
from deeprec_ext.hashing import hash64
from tests.conftest import wait_for

SGD1 = {"name": "sgd", "learning_rate": 1.0}


def test_exact_min_count_per_occurrence_and_default_vector():
    store = EmbeddingStore()
    t = store.create_table("e", 4, "ones", SGD1,
                           admission={"min_count": 3, "default": [0.5, 0, 0, -1]})
    # one call counts every occurrence: 1 twice, 2 once
    out = t.lookup(np.array([1, 2, 1], np.int64))
    np.testing.assert_array_equal(out, np.tile([0.5, 0, 0, -1], (3, 1)).astype(np.float32))
    assert t.size == 0
    np.testing.assert_array_equal(t.candidate_count([1, 2, 3]), [2, 1, 0])
    out = t.lookup(np.array([1, 2], np.int64))  # 1: third sighting -> a row; 2: second
    np.testing.assert_array_equal(out[0], np.ones(4, np.float32))
    np.testing.assert_array_equal(out[1], [0.5, 0, 0, -1])
    assert t.size == 1 and t.candidate_count([1])[0] == 0  # no longer a candidate
    # inference lookups neither count nor insert
    t.lookup(np.array([2, 2, 2], np.int64), insert_missing=False)
    assert t.candidate_count([2])[0] == 2 and t.size == 1
    # a gradient for an id without a row is dropped, no row is created by a push
    t.apply_gradients(np.array([1, 2], np.int64), np.ones((2, 4), np.float32))
    assert t.size == 1
    np.testing.assert_array_equal(t.lookup([1], insert_missing=False), np.zeros((1, 4)))
    st = store.stats()["e"]
    assert st["admitted"] == 1 and st["dropped"] == 1 and st["candidates"] == 1
    assert st["rejected"] == 4
    assert candidate_table_name("e") not in store.stats()  # companion tables are not listed


def test_bloom_admits_every_id_seen_enough_and_stays_bounded():
    store = EmbeddingStore()
    spec = {"min_count": 2, "bloom": {"capacity": 20_000, "fpp": 0.01}}
    t = store.create_table("b", 2, admission=spec)
    rng = np.random.default_rng(0)
    seen_twice = rng.integers(-2**62, 2**62, 5000)
    t.lookup(seen_twice)
    early = t.size  # false positives only: bounded by fpp (with margin)
    assert early < 0.03 * seen_twice.size
    t.lookup(seen_twice)
    assert t.size == np.unique(seen_twice).size  # never a false negative
    # many more candidates than capacity: the filter's cells stay bounded
    for _ in range(5):
        t.lookup(rng.integers(-2**62, 2**62, 20_000))
    cand = store.get(candidate_table_name("b"))
    from deeprec_ext.store.policies import BLOOM_BLOCK, bloom_size
    m, k = bloom_size(20_000, 0.01)
    per_slot = -(-max(-(-m // t.routing_slots), 2 * k) // BLOOM_BLOCK) * BLOOM_BLOCK
    assert cand.size * BLOOM_BLOCK <= t.routing_slots * per_slot
    assert store.stats()["b"]["candidates"] == cand.size * BLOOM_BLOCK
    # each cell routes to the slot of the ids hashed into it: cells move with their slot
    _, blocks, _ = t._bloom_cells_of(seen_twice[:100])
    assert (slot_of(blocks, t.routing_slots) == slot_of(seen_twice[:100], t.routing_slots)[:, None]).all()
    # the estimate never under-counts
    assert (t.candidate_count(seen_twice[:100]) >= 0).all()
    fresh = rng.integers(-2**62, 2**62, 100)
    before = t.candidate_count(fresh)
    t.lookup(fresh)
    assert (t.candidate_count(fresh) >= before + 1).all()


def test_unhash_inverts_hash():
    h = np.random.default_rng(1).integers(0, 2**63, 10_000).astype(np.uint64) * np.uint64(2) + 1
    assert (hash64(unhash64(h)) == h).all()


@pytest.mark.parametrize("bloom", [False, True])
def test_counts_move_with_their_slot(bloom):
    """A migration moves the companion table's rows of the moved slots: the destination
    admits an id exactly when the source would have."""
    spec = {"min_count": 3}
    if bloom:
        spec["bloom"] = {"capacity": 10_000, "fpp": 0.001}
    src, dst = EmbeddingStore(), EmbeddingStore()
    for s in (src, dst):
        s.set_routing_slots(64)
        s.create_table("e", 2, admission=spec)
    ids = np.arange(1000, dtype=np.int64)
    src.get("e").lookup(ids)
    src.get("e").lookup(ids)  # every id seen twice on the source
    mask = np.zeros(64, bool)
    mask[:32] = True
    for name, table in src.tables().items():  # what MigrateSlots / ImportRows do
        keys, rows, _, _ = table.export_slots(mask, None, 0, 1 << 20, with_counts=True)
        dst.get(name).import_rows(keys, rows)
    moved = ids[mask[slot_of(ids, 64)]]
    dst.get("e").lookup(moved)  # third sighting, on the new owner
    assert dst.get("e").size == moved.size


@pytest.mark.parametrize("spec,words", [
    ({"min_count": 0}, ["'t'", "min_count"]),
    ({"min_count": 2.5}, ["'t'", "min_count"]),
    ({"min_count": 2, "bloom": {"capacity": 100, "fpp": 1.0}}, ["'t'", "fpp"]),
    ({"min_count": 2, "bloom": {"capacity": 100, "fpp": 0}}, ["'t'", "fpp"]),
    ({"min_count": 2, "bloom": {"capacity": 0, "fpp": 0.1}}, ["'t'", "capacity"]),
    ({"min_count": 2, "bloom": {"capacity": 10**8, "fpp": 1e-9}}, ["'t'", "cells"]),
    ({"min_count": 2, "bloom": {"capacity": 10**400, "fpp": 0.1}}, ["'t'", "capacity"]),
    ({"min_count": 10**400}, ["'t'", "min_count"]),
    ({"min_count": 2, "default": [1.0]}, ["'t'", "default"]),
    ({"min_count": 2, "min_cout": 3}, ["'t'", "min_cout"]),
    ({"bloom": {"capacity": 10, "fpp": 0.1}}, ["'t'", "min_count"]),
])
def test_bad_admission_specs_are_refused_naming_table_and_key(spec, words):
    with pytest.raises(ValueError) as e:
        EmbeddingStore().create_table("t", 4, admission=spec)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(InvalidRequestError):
        check_policies("t", 4, spec, None)


def test_conflicting_policy_on_an_existing_table_is_refused():
    store = EmbeddingStore()
    store.create_table("t", 2, admission={"min_count": 2})
    assert store.create_table("t", 2, admission={"min_count": 2}) is store.get("t")
    with pytest.raises(ValueError, match="admission"):
        store.create_table("t", 2, admission={"min_count": 3})
    with pytest.raises(ValueError, match="eviction"):
        store.create_table("t", 2, admission={"min_count": 2}, eviction={"l2_below": 1.0})


# -- real processes ----------------------------------------------------------------------
def _rows(client, name):
    client.refresh_routing()
    return sum(t.rows for s in client.ps_stats() for t in s.tables if t.name == name)


def test_admission_exact_across_two_workers_and_ps_layouts(start_job):
    """Two clients (workers) look up the same ids: an id seen N-1 times in all has no row,
    N times has one, on 2 PS, after a scale-out to 3 (partial counts moved) and after a
    kill -9 of a PS (partial counts promoted from its replica)."""
    from tests.test_elasticity import pids, scale
    job = start_job({"name": "admission", "ps": {"replicas": 2, "max_replicas": 3},
                     "replication": {"mode": "async", "interval_ms": 100},
                     "master": {"progress_seconds": 0.5, "heartbeat_seconds": 0.5}},
                    ["--workers", "0"])
    w1 = PSClient.connect(job.address, timeout=60)
    w2 = PSClient.connect(job.address, timeout=60)
    try:
        for w in (w1, w2):
            w.create_table("adm", 4, initializer="ones", optimizer=SGD1,
                           admission={"min_count": 4})
        # a bad spec is refused by the PS too, naming the table; the PS keeps serving
        stub = _stub(w1)
        from deeprec_ext import table_spec
        from deeprec_ext.proto import ps_pb2
        bad = table_spec.to_wire("bad", 4, "zeros", "sgd", {"min_count": 2,
                                                            "bloom": {"capacity": 9, "fpp": 2}})
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateTable(ps_pb2.CreateTableRequest(config=bad), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'bad'" in e.value.details() and "fpp" in e.value.details()
        with pytest.raises(InvalidRequestError, match="'bad2'.*min_count"):
            w1.create_table("bad2", 4, admission={"min_count": -1})

        rng = np.random.default_rng(5)
        ids = np.unique(rng.integers(-2**62, 2**62, 3000))
        short, full = ids[:1500], ids[1500:]
        for w in (w1, w2, w1):  # 3 = N - 1 sightings of every id
            w.lookup("adm", ids)
        assert _rows(w1, "adm") == 0
        w2.lookup("adm", full)  # the N-th sighting of `full` only
        assert _rows(w1, "adm") == full.size
        out = w1.lookup("adm", ids, insert_missing=False)
        np.testing.assert_array_equal(out[:short.size], 0)  # the default vector
        np.testing.assert_array_equal(out[short.size:], 1)  # admitted: initializer rows
        # a gradient for a not yet admitted id is dropped
        w1.push("adm", ids, np.ones((ids.size, 4), np.float32))
        out = w1.lookup("adm", ids, insert_missing=False)
        np.testing.assert_array_equal(out[:short.size], 0)
        np.testing.assert_array_equal(out[short.size:], 0)  # 1 - lr * 1
        # `short` at N-1 on the old layout: its counts move with their slots
        assert scale(job, "--ps", "3")["ps"] == [2, 3]
        assert _rows(w1, "adm") == full.size
        w2.lookup("adm", short[:700])
        assert _rows(w1, "adm") == full.size + 700
        w1.refresh_routing()
        stats = [t for s in w1.ps_stats() for t in s.tables if t.name == "adm"]
        assert len(stats) == 3 and sum(t.admitted for t in stats) >= 700
        assert sum(t.candidates for t in stats) == short.size - 700
        assert not any(t.name.endswith("::admission") for s in w1.ps_stats() for t in s.tables)
        # counts replicated to the ring peer: after a kill -9 the promoted replica admits
        # an id at its N-th sighting exactly (async replication: wait out its interval)
        more = np.unique(rng.integers(-2**62, 2**62, 2000))
        for w in (w1, w2, w1):
            w.lookup("adm", more)
        time.sleep(1.0)
        base = _rows(w1, "adm")
        os.kill(pids(job, "ps")["ps-1"], signal.SIGKILL)
        wait_for(lambda: [e for e in job.status()["events"] if e["kind"] == "recovery"], 60,
                 "recovery")
        wait_for(lambda: sum(e["kind"] == "scale" and e["ps"] == [2, 3]
                             for e in job.status()["events"]) == 2, 120,
                 "the replacement PS to join")
        assert _rows(w1, "adm") == base
        w2.lookup("adm", more[:1000])  # the N-th sighting of half of them
        assert _rows(w1, "adm") == base + 1000
        # the counters in `aimaster status --tables`
        import json
        import subprocess
        import sys
        from tests.conftest import ROOT
        out = subprocess.run([sys.executable, "-m", "aimaster.cli", "status", "--master",
                              job.address, "--tables", "--json"], cwd=ROOT, text=True,
                             capture_output=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stderr
        adm = json.loads(out.stdout)["tables"]["adm"]
        assert adm["rows"] == base + 1000 and adm["candidates"] == \
            short.size - 700 + more.size - 1000
        assert adm["admitted"] >= 1000 and adm["rejected"] > 0 and adm["dropped"] > 0
        assert not any(n.endswith("::admission") for n in json.loads(out.stdout)["tables"])
        # ... in `gazer top` (from the PS's heartbeat statistics) and the progress line
        env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")

        def top():
            r = subprocess.run([sys.executable, "-m", "gazer.cli", "top", "--master",
                                job.address, "--once"], cwd=ROOT, text=True, env=env,
                               capture_output=True, timeout=60)
            assert r.returncode == 0, r.stderr
            line = [x for x in r.stdout.splitlines() if x.strip().startswith("adm ")]
            return line and line[0].split()[1:] == [
                f"{base + 1000:,}", f"{adm['admitted']:,}", f"{adm['rejected']:,}",
                f"{adm['candidates']:,}", "0"] and r.stdout
        assert "tables (all PS)" in wait_for(top, 30, "gazer top to show the counters")
        wait_for(lambda: f"adm: {base + 1000:,} rows, {adm['admitted']:,} admitted" in
                 job.output(), 30, "the counters in the progress line")
    finally:
        w1.close()
        w2.close()


def _stub(client):
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import ps_pb2_grpc
    return ps_pb2_grpc.ParameterServerStub(insecure_channel(client.routing.ps_addresses[0]))


def test_keras_and_tf1_refuse_bad_specs_when_the_model_is_built():
    pytest.importorskip("tensorflow")
    from deeprec_ext.tf.keras_api import ElasticEmbedding
    with pytest.raises(InvalidRequestError, match="'user'.*fpp"):
        ElasticEmbedding(8, table="user",
                         admission={"min_count": 2, "bloom": {"capacity": 10, "fpp": 1.5}})
    with pytest.raises(InvalidRequestError, match="'user'.*steps_to_live"):
        ElasticEmbedding(8, table="user", eviction={"steps_to_live": 0})
    layer = ElasticEmbedding(8, table="user", admission={"min_count": 2},
                             eviction={"l2_below": 1e-3})
    assert layer.get_config()["admission"] == {"min_count": 2}


@pytest.mark.parametrize("bloom", [False, True])
def test_counts_are_checkpointed_full_and_incremental(tmp_path, bloom):
    from checkpoint import CheckpointWriter, restore
    spec = {"min_count": 3}
    if bloom:
        spec["bloom"] = {"capacity": 10_000, "fpp": 0.001}
    store = EmbeddingStore()
    t = store.create_table("e", 2, admission=spec)
    a, b = np.arange(0, 500, dtype=np.int64), np.arange(500, 1000, dtype=np.int64)
    t.lookup(a)
    w = CheckpointWriter(tmp_path, 1, "full")
    cuts = {n: w.write_table("ps-0", x)["cut_seq"] for n, x in sorted(store.tables().items())}
    w.commit()
    t.lookup(a)
    t.lookup(b)
    t.lookup(b)
    t.lookup(b)  # b admitted after the full checkpoint (exact: its counts are deleted)
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1)
    for n, x in sorted(store.tables().items()):
        w.write_table("ps-0", x, since_seq=cuts[n])
    w.commit()
    back = EmbeddingStore()
    restore(str(tmp_path), back)
    r = back.get("e")
    assert r.admission == t.admission and r.size == b.size
    np.testing.assert_array_equal(r.candidate_count(a), t.candidate_count(a))
    r.lookup(a)  # the third sighting of a, counted before and after the restore
    assert r.size == 1000
