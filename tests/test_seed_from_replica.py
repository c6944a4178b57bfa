"""A migration's snapshot round taken by the destination from the copy it holds of its
source (``SeedFromReplica``): at a scale-in the leaving PS's ring peer is one of its
destinations and already holds its rows. Real gRPC between in-process PS; every row
counted against the source, writes and deletes on both sides of the copy's sequence."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2 as pb
from tests.test_migration_wire import CFG, _lookup, _rows_and_counts, _serve

SLOTS = 4096


def _routing(stub, epoch, owned, peer, ps_id):
    stub.SetRouting(pb.SetRoutingRequest(
        epoch=epoch, owned_slots=owned.tobytes(), num_slots=SLOTS, replica_peer=peer,
        replication_interval_ms=60_000, ps_id=ps_id), timeout=30)


def _odd_slots_leave(s_stub, d_stub, peer):
    """ps-s owns the odd slots, all of which move to ps-d; ps-s replicates to ``peer``
    (ps-d's address, or none). Both have routing; ps-s has the table."""
    moving = np.zeros(SLOTS, np.uint8)
    moving[1::2] = 1
    _routing(s_stub, 1, moving, peer, "ps-s")
    _routing(d_stub, 1, 1 - moving, "", "ps-d")
    s_stub.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
    return moving


def _push(stub, keys, value=0.5):
    stub.Push(pb.PushRequest(tables=[pb.TableUpdate(
        table="emb", ids=keys.tobytes(),
        values=np.full((keys.size, 4), value, np.float32).tobytes())]), timeout=30)


def _in_slots(table, mask):
    keys, rows, counts = _rows_and_counts(table)
    keep = mask[slot_of(keys, SLOTS)].astype(bool)
    return keys[keep], rows[keep], counts[keep]


@pytest.fixture
def pair():
    s = _serve("ps-s")
    d = _serve("ps-d")
    try:
        yield s, d
    finally:
        for svc, srv, ch, _, _ in (s, d):
            ch.close()
            svc.replicator.close()
            srv.stop(0).wait(10)
            svc.close()


def test_a_destination_seeded_from_its_copy_ends_with_every_row_of_the_source(pair):
    """The leaving PS (ps-s) replicates to ps-d. Before the copy's last delta and after
    it, ps-s takes pushes, new keys and deletes; the snapshot round to ps-d is seeded from
    ps-d's copy (no row streamed), the catch-up round from the copy's sequence ships the
    rest, tombstones included (kept although the replication moved on meanwhile). ps-d
    then holds exactly the source's rows and update counts, and its own rows as before."""
    (s, _, _, s_stub, _), (d, _, _, d_stub, d_addr) = pair
    own = np.zeros(SLOTS, np.uint8)
    own[::2] = 1  # ps-d's slots; ps-s has the odd ones, all of which move to ps-d
    moving = (1 - own).astype(np.uint8)
    _routing(s_stub, 1, moving, d_addr, "ps-s")
    _routing(d_stub, 1, own, "", "ps-d")
    for stub in (s_stub, d_stub):
        stub.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(-2**62, 2**62, 90_000))
    slots = slot_of(ids, SLOTS)
    d_keys, s_keys = ids[own[slots] == 1], ids[own[slots] == 0]
    _lookup(d_stub, d_keys, insert=True)
    _lookup(s_stub, s_keys, insert=True)
    d_before = _rows_and_counts(d.store["emb"])
    # as once a checkpoint is written: only the replication (and the migration) keep logs
    s.store.set_consumer("checkpoint", None)
    s.replicator.ship()  # the full copy of ps-s on ps-d
    assert len(d.replicas.copies["ps-s"].store["emb"]) == s_keys.size

    # written and shipped: in the copy
    _push(s_stub, s_keys[:5000])
    s.store["emb"].delete(s_keys[5000:5500])
    s.replicator.ship()
    # written after the copy's last delta: only the catch-up can bring these
    _push(s_stub, s_keys[6000:9000], 0.25)
    s.store["emb"].delete(s_keys[9000:9300])
    fresh = np.unique(rng.integers(-2**62, 2**62, 4000))
    fresh = fresh[moving[slot_of(fresh, SLOTS)] == 1]
    _lookup(s_stub, fresh, insert=True)

    r = s_stub.MigrateSlots(pb.MigrateSlotsRequest(
        dst_address=d_addr, slots=moving.tobytes(), num_slots=SLOTS, since_seq=-1), timeout=60)
    in_copy = s_keys.size - 500
    assert r.seeded == r.rows == in_copy and r.bytes == 0
    assert r.watermark == d.replicas.copies["ps-s"].sequence < s.store.sequence.value

    # after the seed: more writes, and a shipment that moves the replication's log
    # consumer past the seed's sequence; the tombstones stay for the catch-up
    s.store["emb"].delete(s_keys[9500:9600])
    _push(s_stub, s_keys[:100], 0.125)
    s.replicator.ship()
    r2 = s_stub.MigrateSlots(pb.MigrateSlotsRequest(
        dst_address=d_addr, slots=moving.tobytes(), num_slots=SLOTS,
        since_seq=r.watermark), timeout=60)
    assert r2.seeded == 0 and r2.deleted >= 400  # both deletes after the copy's sequence

    want = _in_slots(s.store["emb"], moving)
    got = _in_slots(d.store["emb"], moving)
    assert want[0].size == s_keys.size - 900 + fresh.size
    for x, y in zip(want, got):
        assert np.array_equal(x, y)  # every row, value and count, none extra
    for x, y in zip(d_before, _in_slots(d.store["emb"], own)):
        assert np.array_equal(x, y)  # its own rows untouched
    assert len(d.store["emb"]) == d_keys.size + want[0].size


def test_without_a_usable_copy_the_source_streams_the_snapshot(pair):
    """The destination is not the source's ring peer, the source's switch is off, or the
    source holds rows of the moving slots back from it: the round is streamed, as before,
    every row counted. Its peer, switch on, nothing held back: seeded."""
    (s, _, _, s_stub, _), (d, _, _, d_stub, d_addr) = pair
    moving = _odd_slots_leave(s_stub, d_stub, "")
    ids = np.unique(np.random.default_rng(4).integers(-2**62, 2**62, 20_000))
    keys = ids[moving[slot_of(ids, SLOTS)] == 1]
    _lookup(s_stub, keys, insert=True)

    def snapshot():
        return s_stub.MigrateSlots(pb.MigrateSlotsRequest(
            dst_address=d_addr, slots=moving.tobytes(), num_slots=SLOTS, since_seq=-1),
            timeout=60)

    r = snapshot()  # ps-d is not its peer
    assert r.seeded == 0 and r.rows == keys.size and r.bytes > 0
    _routing(s_stub, 2, moving, d_addr, "ps-s")
    s.replicator.ship()
    assert len(d.replicas.copies["ps-s"].store["emb"]) == keys.size
    s.seed_from_replica = False
    r = snapshot()
    assert r.seeded == 0 and r.rows == keys.size and r.bytes > 0
    s.seed_from_replica = True
    # rows of the moving slots held back from ps-d (as a destination whose peer changes
    # holds its imports back): its copy may lack them, so they are streamed
    assert s.replicator.hold_unowned("127.0.0.1:1", (1 - moving).astype(bool))
    r = snapshot()
    assert r.seeded == 0 and r.rows == keys.size and r.bytes > 0
    _routing(s_stub, 3, moving, d_addr, "ps-s")  # a routing push ends the hold
    r = snapshot()
    assert r.seeded == r.rows == keys.size and r.bytes == 0
    assert len(d.store["emb"]) == keys.size


def test_seed_requests_without_a_copy_or_with_bad_fields_are_refused_by_name(pair):
    """Refusals change nothing and leave the PS serving: no copy of that origin, a copy
    older than asked for (FAILED_PRECONDITION: the source then streams), no origin, a
    slot mask of another size, a bad peer address (INVALID_ARGUMENT)."""
    (s, _, _, s_stub, _), (d, _, _, d_stub, d_addr) = pair
    moving = _odd_slots_leave(s_stub, d_stub, d_addr)
    keys = np.arange(1, 5001, dtype=np.int64)
    _lookup(s_stub, keys[moving[slot_of(keys, SLOTS)] == 1], insert=True)
    s.replicator.ship()
    seq = d.replicas.copies["ps-s"].sequence
    cases = [
        (dict(origin="ps-x", slots=moving.tobytes(), num_slots=SLOTS),
         grpc.StatusCode.FAILED_PRECONDITION, "no complete copy of 'ps-x'"),
        (dict(origin="ps-s", slots=moving.tobytes(), num_slots=SLOTS, min_sequence=seq + 1),
         grpc.StatusCode.FAILED_PRECONDITION, f"current to {seq}"),
        (dict(slots=moving.tobytes(), num_slots=SLOTS),
         grpc.StatusCode.INVALID_ARGUMENT, "origin is required"),
        (dict(origin="ps-s", slots=b"\x01\x00", num_slots=2),
         grpc.StatusCode.INVALID_ARGUMENT, "slots"),
        (dict(origin="ps-s", slots=moving.tobytes(), num_slots=SLOTS, replica_after="nowhere"),
         grpc.StatusCode.INVALID_ARGUMENT, "replica_after"),
    ]
    for fields, code, words in cases:
        with pytest.raises(grpc.RpcError) as exc:
            d_stub.SeedFromReplica(pb.SeedFromReplicaRequest(**fields), timeout=30)
        assert exc.value.code() == code, (fields, exc.value.details())
        assert words in exc.value.details(), exc.value.details()
    assert "emb" not in d.store.tables()  # nothing seeded
    r = d_stub.SeedFromReplica(pb.SeedFromReplicaRequest(
        origin="ps-s", slots=moving.tobytes(), num_slots=SLOTS, min_sequence=seq), timeout=30)
    assert r.rows == len(s.store["emb"]) and r.sequence == seq


def test_a_bad_seed_switch_is_refused_at_start():
    import os
    import subprocess
    import sys
    from tests.conftest import ROOT
    for args, env in ((["--seed-from-replica", "yes"], {}),
                      ([], {"DEEPREC_PS_SEED_FROM_REPLICA": "maybe"})):
        r = subprocess.run([sys.executable, "-m", "deeprec_ext.ps", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
        assert r.returncode == 2 and "--seed-from-replica" in r.stderr, r.stderr
        assert (args[-1] if args else env["DEEPREC_PS_SEED_FROM_REPLICA"]) in r.stderr


def test_a_copy_promoted_while_it_seeds_fails_the_round_and_keeps_every_row(pair, monkeypatch):
    """The source dies while its peer seeds from its copy, and the recovery promotes that
    copy: the seed stops at its next slice (ABORTED, never streamed over by the source:
    rows the source deleted after the copy would come back), the source's round fails
    (the migration rolls back), and the promoted table serves every row of the copy."""
    import threading
    import time
    (s, _, _, s_stub, _), (d, _, _, d_stub, d_addr) = pair
    moving = _odd_slots_leave(s_stub, d_stub, d_addr)
    ids = np.unique(np.random.default_rng(6).integers(-2**62, 2**62, 140_000))
    keys = ids[moving[slot_of(ids, SLOTS)] == 1]
    _lookup(s_stub, keys, insert=True)
    _push(s_stub, keys[::3])
    s.replicator.ship()
    assert len(s.store["emb"]) == keys.size > 3 * d.MIGRATE_CHUNK_ROWS  # several slices
    slow = d._import_pieces

    def import_slowly(*args, **kwargs):
        slow(*args, **kwargs)
        time.sleep(0.3)
    monkeypatch.setattr(d, "_import_pieces", import_slowly)
    failed = []

    def snapshot():
        try:
            s_stub.MigrateSlots(pb.MigrateSlotsRequest(
                dst_address=d_addr, slots=moving.tobytes(), num_slots=SLOTS, since_seq=-1),
                timeout=60)
        except grpc.RpcError as exc:
            failed.append(exc)
    t = threading.Thread(target=snapshot)
    t.start()
    deadline = time.monotonic() + 30
    while not ("emb" in d.store.tables() and len(d.store["emb"]) > 0):
        assert time.monotonic() < deadline, "the seed did not start"
        time.sleep(0.01)
    r = d_stub.Promote(pb.PromoteRequest(
        origin="ps-s", slots=moving.tobytes(), num_slots=SLOTS,
        routing=pb.SetRoutingRequest(epoch=2, owned_slots=np.ones(SLOTS, np.uint8).tobytes(),
                                     num_slots=SLOTS, ps_id="ps-d")), timeout=60)
    t.join(60)
    assert r.rows == keys.size
    assert len(failed) == 1 and failed[0].code() == grpc.StatusCode.ABORTED, failed
    assert "promoted or replaced" in failed[0].details(), failed[0].details()
    # served from the promoted copy (rows seeded before it are strays its merge purges)
    assert np.array_equal(_lookup(d_stub, keys), _lookup(s_stub, keys))

