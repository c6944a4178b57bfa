"""Promotion without a copy: a promoted replica's table serves the dead PS's slots as a
segment of the live table (``EmbeddingTable.adopt_segment``) and is merged into it in the
background (``merge_segment``). Every path that reads a table must see the segment's rows
exactly: lookups, pushes, checkpoints, migration and replication exports, deletions,
counts. Each case is compared with a reference table that holds every row itself."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from deeprec_ext.hashing import slot_of
from deeprec_ext.store import EmbeddingStore

NUM_SLOTS = 64
DIM = 4
CFG = ("random_normal", {"name": "adagrad", "learning_rate": 0.1})
ALL = np.ones(NUM_SLOTS, dtype=bool)


def _grads(rng, n: int) -> np.ndarray:
    return (rng.standard_normal((n, DIM)) * 0.1).astype(np.float32)


def _setup(seed: int = 0, n: int = 20_000):
    """(reference, peer store, peer table, dead slots, all keys): the peer's table holds
    its own slots, a replica table (separate store, no change tracking, as on a PS) holds
    the dead PS's slots and is adopted as the peer table's segment."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64))
    dead = np.zeros(NUM_SLOTS, dtype=bool)
    dead[::3] = True
    in_dead = dead[slot_of(keys, NUM_SLOTS)]
    ref = EmbeddingStore().create_table("emb", DIM, *CFG)
    store = EmbeddingStore()
    peer = store.create_table("emb", DIM, *CFG)
    replica = EmbeddingStore(track_changes=False).create_table("emb", DIM, *CFG)
    ref.lookup(keys)
    peer.lookup(keys[~in_dead])
    replica.lookup(keys[in_dead])
    for part, table in ((keys[~in_dead], peer), (keys[in_dead], replica)):
        g = _grads(rng, part.size)
        ref.apply_gradients(part, g)
        table.apply_gradients(part, g)
    own_rows = len(peer)
    assert peer.adopt_segment(replica, dead, NUM_SLOTS) == int(in_dead.sum())
    assert len(peer) == keys.size and peer.segment_rows == int(in_dead.sum())
    assert len(peer._index) == own_rows  # nothing was copied into the peer's own index
    return ref, store, peer, dead, keys, rng


def _rows_by_key(keys: np.ndarray, rows: np.ndarray) -> dict:
    order = np.argsort(keys, kind="stable")
    return dict(zip(keys[order].tolist(), map(bytes, rows[order])))


def _assert_same(ref, peer, keys) -> None:
    np.testing.assert_array_equal(peer.lookup(keys, insert_missing=False),
                                  ref.lookup(keys, insert_missing=False))
    k1, r1 = ref.export_keys(keys, with_counts=True)
    k2, r2 = peer.export_keys(keys, with_counts=True)
    assert _rows_by_key(k1, r1) == _rows_by_key(k2, r2)
    assert len(peer) == len(ref)
    np.testing.assert_array_equal(peer.counts(keys), ref.counts(keys))
    np.testing.assert_array_equal(np.sort(peer.keys_in_slots(ALL)), np.sort(ref.keys_in_slots(ALL)))
    np.testing.assert_array_equal(peer.rows_per_slot(NUM_SLOTS), ref.rows_per_slot(NUM_SLOTS))


def _paged(table, mask, since=None, chunk: int = 997, between=None):
    out_k, out_r = [], []
    row = 0
    while row is not None:
        k, r, _, row = table.export_slots(mask, since, row, chunk, with_counts=True)
        out_k.append(k)
        out_r.append(r)
        if between is not None:
            between()
    return np.concatenate(out_k), np.concatenate(out_r)


def test_promoted_rows_are_served_from_the_segment_and_pushes_land():
    ref, _, peer, dead, keys, rng = _setup()
    _assert_same(ref, peer, keys)
    seg_keys = keys[dead[slot_of(keys, NUM_SLOTS)]]
    for _ in range(20):  # pushes (duplicates included), new keys of both kinds, deletions
        b = rng.choice(keys, 600)
        g = _grads(rng, b.size)
        assert peer.apply_gradients(b, g) > 0
        ref.apply_gradients(b, g)
        new = rng.integers(-2**63, 2**63 - 1, 40, dtype=np.int64)
        ref.lookup(new)
        peer.lookup(new)
        keys = np.unique(np.concatenate([keys, new]))
        gone = rng.choice(keys, 15)
        assert peer.delete(gone) == ref.delete(gone)
        vals = rng.standard_normal((30, DIM)).astype(np.float32)
        some = rng.choice(keys, 30, replace=False)
        ref.insert(some, vals)
        peer.insert(some, vals)
    _assert_same(ref, peer, keys)
    # the dead PS's keys still live in the segment (not merged: no merge ran)
    assert peer.segment_rows > 0.9 * seg_keys.size


def test_exports_after_promotion_contain_the_promoted_rows_exactly(tmp_path):
    """Checkpoint (plan_export + gather_planned through the writer), migration
    (export_slots paging, since a watermark), replication deltas (export_rows) and
    DropSlots (keys_in_slots + delete with "moved" tombstones) see the segment."""
    from checkpoint import CheckpointWriter, restore
    ref, store, peer, dead, keys, rng = _setup(1)
    # checkpoint: exactly the rows of the reference
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    assert w.write_table("ps-1", peer)["rows"] == len(ref)
    w.commit()
    back = EmbeddingStore()
    restore(tmp_path, back)
    _assert_same(ref, back.get("emb"), keys)
    # migration of the promoted slots: a snapshot, then a catch-up since the watermark
    mark = store.sequence.value
    k, r = _paged(peer, dead)
    rk = ref.keys_in_slots(dead)
    assert _rows_by_key(k, r) == _rows_by_key(*ref.export_keys(rk, with_counts=True))
    b = rng.choice(keys, 500)
    g = _grads(rng, b.size)
    peer.apply_gradients(b, g)
    ref.apply_gradients(b, g)
    k2, r2 = _paged(peer, dead, since=mark)
    changed = np.unique(b[dead[slot_of(b, NUM_SLOTS)]])
    assert _rows_by_key(k2, r2) == _rows_by_key(*ref.export_keys(changed, with_counts=True))
    # a replication delta since the adoption: every promoted row (stamped at adoption)
    dk, drows, dseq = peer.export_rows(mark - 1, with_counts=True)
    assert set(rk.tolist()) <= set(dk.tolist()) and (dseq <= store.sequence.value).all()
    # an incremental checkpoint after pushes: exactly the rows pushed (a chain restores)
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1, num_slots=NUM_SLOTS)
    assert w.write_table("ps-1", peer, since_seq=mark)["rows"] == np.unique(b).size
    w.commit()
    back = EmbeddingStore()
    restore(tmp_path, back)
    _assert_same(ref, back.get("emb"), keys)
    # DropSlots of the promoted slots: every segment row goes, with "moved" tombstones
    cut = store.sequence.value
    gone = peer.keys_in_slots(dead)
    assert peer.delete(gone, log_tombstone=False, moved=True) == rk.size
    assert len(peer) == len(ref) - rk.size and peer.segment_rows == 0
    assert set(peer.tombstones_since(cut, include_moved=True).tolist()) == set(rk.tolist())
    assert peer.tombstones_since(cut).size == 0


def test_background_merge_loses_nothing_while_pushes_and_exports_continue(tmp_path):
    from checkpoint import CheckpointWriter, restore
    ref, store, peer, dead, keys, rng = _setup(2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def merge():
        try:
            while not stop.is_set() and peer.merge_segment(151):
                pass
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    # pushes in this thread, the merge in another: the same pushes on the reference
    t = threading.Thread(target=merge)
    t.start()
    try:
        for _ in range(60):
            b = rng.choice(keys, 400)
            g = _grads(rng, b.size)
            peer.apply_gradients(b, g)
            ref.apply_gradients(b, g)
    finally:
        t.join(60)
    assert not errors
    _assert_same(ref, peer, keys)

    # a paged export and a checkpoint, each with merge steps between its reads: every row
    # of the reference exactly once or (moved rows) twice with the same value
    if peer.segment_rows == 0:  # the merge won the race: start again with a segment
        ref, store, peer, dead, keys, rng = _setup(3)
    # free rows in the peer's own arena: merged rows must not land behind the scan
    own = keys[~dead[slot_of(keys, NUM_SLOTS)]][:2000]
    assert peer.delete(own) == ref.delete(own) == own.size
    keys = np.setdiff1d(keys, own)
    k, r = _paged(peer, ALL, between=lambda: peer.merge_segment(97))
    assert _rows_by_key(k, r) == _rows_by_key(*ref.export_keys(keys, with_counts=True))
    codes, row_bits = peer.plan_export(ALL)
    assert peer.segment_rows > 0
    got_k, got_r = [], []
    for s in range(0, codes.size, 800):
        kk, rr, _ = peer.gather_planned(codes[s:s + 800], row_bits, NUM_SLOTS, with_counts=True)
        got_k.append(kk)
        got_r.append(rr)
        peer.merge_segment(113)
    assert _rows_by_key(np.concatenate(got_k), np.concatenate(got_r)) == \
        _rows_by_key(*ref.export_keys(keys, with_counts=True))
    peer.merge_all()
    assert peer.segment_rows == 0 and peer._seg is None
    _assert_same(ref, peer, keys)
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    w.write_table("ps-1", peer)
    w.commit()
    back = EmbeddingStore()
    restore(tmp_path, back)
    _assert_same(ref, back.get("emb"), keys)


def test_merged_rows_are_listed_as_changed_exactly():
    """A moved row is not a write: a consumer that read the segment after the adoption
    does not get it again, one from before the adoption does."""
    ref, store, peer, dead, keys, rng = _setup(4)
    before = store.sequence.value - 1  # before the adoption stamp
    after = store.sequence.value
    peer.merge_all(500)
    k, _, _ = peer.export_rows(after)
    assert k.size == 0
    k, _, _ = peer.export_rows(before)
    assert set(keys[dead[slot_of(keys, NUM_SLOTS)]].tolist()) <= set(k.tolist())
    assert peer.changed_at_most(after, 0)


def test_adopt_refuses_another_config_and_a_second_segment():
    ref, store, peer, dead, keys, rng = _setup(5)
    other = EmbeddingStore().create_table("emb", DIM, "zeros", "sgd")
    assert peer.adopt_segment(other, ~dead, NUM_SLOTS) == -1
    same = EmbeddingStore().create_table("emb", DIM, *CFG)
    assert peer.adopt_segment(same, ~dead, NUM_SLOTS) == -1  # one segment at a time
    with pytest.raises(ValueError):
        same.adopt_segment(peer, dead[:3], NUM_SLOTS)


def test_promote_rpc_adopts_without_copying_and_keeps_request_ids():
    """ParameterServerServicer.Promote in-process: rows served from the segment right
    after, the replica's request ids adopted, the background merge finishes."""
    from deeprec_ext.proto import ps_pb2
    from deeprec_ext.ps.replication import ReplicaCopy
    from deeprec_ext.ps.server import ParameterServerServicer

    class Ctx:
        def time_remaining(self):
            return 60.0

        def abort(self, code, msg):
            raise AssertionError(f"{code}: {msg}")

    rng = np.random.default_rng(6)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 5000, dtype=np.int64))
    dead = np.zeros(NUM_SLOTS, dtype=bool)
    dead[:20] = True
    in_dead = dead[slot_of(keys, NUM_SLOTS)]
    replica = EmbeddingStore(track_changes=False)
    replica.create_table("emb", DIM, *CFG).lookup(keys[in_dead])
    expect = replica.get("emb").lookup(keys[in_dead], insert_missing=False)
    ps = ParameterServerServicer("ps-2")
    ps.MERGE_DELAY_SECONDS = 0.2
    ps.store.create_table("emb", DIM, *CFG).lookup(keys[~in_dead])
    ps.replicas.copies["ps-1"] = ReplicaCopy(replica, 42, ["rid-1", "rid-2"])
    resp = ps.Promote(ps_pb2.PromoteRequest(origin="ps-1", slots=dead.astype(np.uint8).tobytes(),
                                            num_slots=NUM_SLOTS), Ctx())
    table = ps.store.get("emb")
    assert resp.rows == int(in_dead.sum()) and resp.origin_sequence == 42
    assert table.segment_rows == resp.rows  # served as a segment: nothing copied
    assert ps.applied.seen("rid-1") and ps.applied.seen("rid-2")
    np.testing.assert_array_equal(table.lookup(keys[in_dead], insert_missing=False), expect)
    ps._merger.join(30)
    assert table.segment_rows == 0 and len(table) == keys.size
    np.testing.assert_array_equal(table.lookup(keys[in_dead], insert_missing=False), expect)
    ps.replicator.close()


@pytest.mark.parametrize("track", [0, NUM_SLOTS], ids=["hashed", "slot-column"])
def test_a_replica_holding_rows_of_slots_its_origin_gave_away_promotes_only_its_slots(track):
    """The dead PS moved slots S to this PS (a scale-out whose new PS is also its new ring
    peer) and died before the "moved" tombstones of the clean-up reached its replica: the
    replica still holds S's rows as they were before the move. Promoting it (for the dead
    PS's slots, not S) must neither count those rows nor export them: a replication delta
    lists this PS's own rows first and the segment's last, so the stale copy of S's rows
    would overwrite the current ones in this PS's own replica."""
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 6000, dtype=np.int64))
    slots = slot_of(keys, NUM_SLOTS)
    dead, moved = np.zeros(NUM_SLOTS, bool), np.zeros(NUM_SLOTS, bool)
    dead[:32], moved[32:40] = True, True  # the dead PS kept [0, 32), gave [32, 40) away
    kd, km, ko = keys[dead[slots]], keys[moved[slots]], keys[~(dead | moved)[slots]]
    sgd = ("zeros", {"name": "sgd", "learning_rate": 1.0})
    store = EmbeddingStore()
    peer = store.create_table("emb", DIM, *sgd)
    replica = EmbeddingStore(track_changes=False, track_slots=track).create_table("emb", DIM, *sgd)
    one = -np.ones((1, DIM), np.float32)
    replica.apply_gradients(np.concatenate([kd, km]), np.repeat(one, kd.size + km.size, 0))
    # with a slot column the stray rows are found by it, not by hashing the keys
    assert (replica._slot_counts(NUM_SLOTS) is not None) == bool(track)
    peer.apply_gradients(np.concatenate([ko, km]), np.repeat(one, ko.size + km.size, 0))
    peer.apply_gradients(km, np.repeat(one, km.size, 0))  # S's rows moved on: 2 here, 1 there
    mark = store.sequence.value
    assert peer.adopt_segment(replica, dead, NUM_SLOTS) == kd.size
    # counted exactly, at once: no row of S twice, none of them from the segment
    assert len(peer) == keys.size and peer.segment_rows == kd.size
    assert peer.size == keys.size and store.stats()["emb"]["rows"] == keys.size
    assert peer.rows_per_slot(NUM_SLOTS).sum() == keys.size
    # served values: the dead PS's rows 1, S's rows 2 (this PS's), the rest 1
    got = peer.lookup(keys, insert_missing=False)[:, 0]
    np.testing.assert_array_equal(got, np.where(moved[slots], 2.0, 1.0))
    # the replication delta since the adoption: every promoted row once, no stale row of S
    k, r, _ = peer.export_rows(mark, with_counts=True)
    np.testing.assert_array_equal(np.sort(k), np.sort(kd))
    own_copy = EmbeddingStore(track_changes=False).create_table("emb", DIM, *sgd)
    k, r, _ = peer.export_rows(None, with_counts=True)  # what this PS's replica gets
    own_copy.import_rows(k, r)
    np.testing.assert_array_equal(own_copy.lookup(keys, insert_missing=False)[:, 0], got)
    row = 0  # the paged full copy to its peer (a one-slot mask: every row)
    while row is not None:
        k, r, _, row = peer.export_slots(np.ones(1, bool), None, row, 997, with_counts=True)
        own_copy.import_rows(k, r)
    assert len(own_copy) == keys.size
    np.testing.assert_array_equal(own_copy.lookup(keys, insert_missing=False)[:, 0], got)
    peer.merge_all(500)
    assert len(peer) == keys.size and peer.segment_rows == 0
    np.testing.assert_array_equal(peer.lookup(keys, insert_missing=False)[:, 0], got)


def _batches(src, origin: str, keys=None, deleted=()):
    """RowBatch messages of ``src``'s rows (all, or of ``keys``) as a primary ships them."""
    from deeprec_ext import codec, table_spec
    from deeprec_ext.proto import ps_pb2
    k, r = src.export_keys(keys, with_counts=True) if keys is not None else \
        src.export_rows(None, with_counts=True)[:2]
    cfg = table_spec.of_table(src)
    out = [ps_pb2.RowBatch(config=cfg, origin=origin, ids=codec.ids_to_bytes(k[i:i + 700]),
                           rows=codec.floats_to_bytes(r[i:i + 700]))
           for i in range(0, k.size, 700)]
    out[0].deleted_ids = codec.ids_to_bytes(np.asarray(deleted, np.int64))
    out[-1].end = True
    return out


def test_replica_rows_note_their_slot_as_they_arrive_and_promotion_hashes_nothing():
    """A copy built by the replication stream (full copy, then deltas that delete keys and
    re-insert others into the freed rows) keeps each row's routing slot and exact per-slot
    counts; promoting it drops the rows of slots the dead PS gave away by that column, and
    the segment serves every other row exactly; the counts stay exact through the merge."""
    from deeprec_ext.proto import ps_pb2
    from deeprec_ext.ps.replication import ReplicaSet
    rng = np.random.default_rng(11)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 9000, dtype=np.int64))
    slots = slot_of(keys, NUM_SLOTS)
    dead, moved = np.zeros(NUM_SLOTS, bool), np.zeros(NUM_SLOTS, bool)
    dead[:40], moved[40:48] = True, True
    origin = EmbeddingStore().create_table("emb", DIM, *CFG)
    first, later = keys[: keys.size // 2], keys[keys.size // 2:]
    origin.lookup(first[(dead | moved)[slot_of(first, NUM_SLOTS)]])
    rs = ReplicaSet()
    rs.num_slots = NUM_SLOTS
    full = _batches(origin, "ps-1")
    full.append(ps_pb2.RowBatch(origin="ps-1", origin_sequence=origin.sequence.value, end=True))
    assert rs.apply(iter(full), "full-new") > 0
    # deltas: deletions free rows, new keys (some of the moved slots) take them
    gone = first[dead[slot_of(first, NUM_SLOTS)]][::3]
    origin.delete(gone)
    new = later[(dead | moved)[slot_of(later, NUM_SLOTS)]]
    origin.apply_gradients(new, _grads(rng, new.size))
    base = rs.copies["ps-1"].sequence
    assert rs.apply(iter(_batches(origin, "ps-1", new, gone)), "delta", base) == new.size
    replica = rs.copies["ps-1"].store.get("emb")
    live_keys = replica.keys_in_slots(np.ones(NUM_SLOTS, bool))
    held = np.bincount(slot_of(live_keys, NUM_SLOTS), minlength=NUM_SLOTS)
    counts = replica._slot_counts(NUM_SLOTS)
    assert counts is not None  # the column is complete: promotion needs no hash
    np.testing.assert_array_equal(counts, held)
    np.testing.assert_array_equal(replica.rows_per_slot(NUM_SLOTS), held)
    # promote for the dead PS's slots only: the moved slots' rows are strays
    expect_keys = live_keys[dead[slot_of(live_keys, NUM_SLOTS)]]
    expect = origin.lookup(expect_keys, insert_missing=False)
    peer = EmbeddingStore().create_table("emb", DIM, *CFG)
    own = keys[~(dead | moved)[slots]]
    peer.lookup(own)
    copy = rs.take("ps-1")
    assert peer.adopt_segment(copy.store.get("emb"), dead, NUM_SLOTS) == expect_keys.size
    assert len(peer) == own.size + expect_keys.size
    np.testing.assert_array_equal(peer.lookup(expect_keys, insert_missing=False), expect)
    stray = live_keys[moved[slot_of(live_keys, NUM_SLOTS)]]
    assert stray.size
    assert peer.export_keys(stray)[0].size == 0  # not held: neither served nor exported
    per_slot = peer.rows_per_slot(NUM_SLOTS)
    assert per_slot[moved].sum() == 0 and per_slot.sum() == len(peer)
    peer.merge_all(1000)
    assert peer.segment_rows == 0 and len(peer) == own.size + expect_keys.size
    np.testing.assert_array_equal(peer.lookup(expect_keys, insert_missing=False), expect)


def test_a_slot_column_that_missed_rows_falls_back_to_hashing():
    """Rows placed by a path that does not note slots (a bulk load) make the counts
    disagree with the table: the promotion's pass then hashes the keys, and still drops
    exactly the rows of other slots."""
    rng = np.random.default_rng(12)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 4000, dtype=np.int64))
    slots = slot_of(keys, NUM_SLOTS)
    keep = np.zeros(NUM_SLOTS, bool)
    keep[:50] = True
    replica = EmbeddingStore(track_changes=False, track_slots=NUM_SLOTS).create_table(
        "emb", DIM, *CFG)
    replica.lookup(keys[:2000])
    assert replica._slot_counts(NUM_SLOTS) is not None
    assert replica._slot_counts(NUM_SLOTS * 2) is None  # another slot count: no column
    rows = np.zeros((2000, replica.row_width + 1), np.float32)
    replica.load_rows(keys[2000:], rows)
    assert replica._slot_counts(NUM_SLOTS) is None
    assert replica._drop_rows_outside(keep, NUM_SLOTS) == int((~keep[slots]).sum())
    left = replica.keys_in_slots(np.ones(NUM_SLOTS, bool))
    np.testing.assert_array_equal(np.sort(left), np.sort(keys[keep[slots]]))
    # a column enabled on a table with rows hashes them once, then answers
    other = EmbeddingStore(track_changes=False).create_table("emb", DIM, *CFG)
    other.lookup(keys)
    assert other.track_slots(NUM_SLOTS) and other._slot_counts(NUM_SLOTS) is not None
    other.delete(keys[::2])
    np.testing.assert_array_equal(other.rows_per_slot(NUM_SLOTS),
                                  np.bincount(slots[1::2], minlength=NUM_SLOTS))
    assert other._drop_rows_outside(keep, NUM_SLOTS) == int((~keep[slots[1::2]]).sum())
    assert not other.track_slots(1 << 17)  # beyond uint16: no column


def test_the_peers_own_stray_rows_of_promoted_slots_are_never_served_and_are_purged():
    """The peer still holds rows of the dead PS's slots from an older ownership (a
    migration's clean-up that never reached it). Keys the dead PS had deleted since must
    not come back: a lookup treats them as absent (a fresh row), a read-only lookup finds
    nothing, and the merge deletes the rest (with tombstones, for the peer's replica);
    keys the dead PS still held are served from the segment, and win in the merge."""
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(-2**63, 2**63 - 1, 12_000, dtype=np.int64))
    dead = np.zeros(NUM_SLOTS, dtype=bool)
    dead[::4] = True
    in_dead = dead[slot_of(keys, NUM_SLOTS)]
    peer = EmbeddingStore().create_table("emb", DIM, *CFG)
    replica = EmbeddingStore(track_changes=False).create_table("emb", DIM, *CFG)
    peer.lookup(keys)  # the peer once owned every slot: its dead slots' rows stay as strays
    peer.apply_gradients(keys, _grads(rng, keys.size))
    dead_keys = keys[in_dead]
    deleted = dead_keys[::3]  # deleted on the dead PS after the move: not in its replica
    held = np.setdiff1d(dead_keys, deleted)
    replica.lookup(held)
    replica.apply_gradients(held, _grads(rng, held.size))
    want_held = replica.lookup(held, insert_missing=False)
    seq_before = peer.sequence.value
    assert peer.adopt_segment(replica, dead, NUM_SLOTS) == held.size
    # served from the segment, not from the stray rows
    np.testing.assert_array_equal(peer.lookup(held, insert_missing=False), want_held)
    # the deleted keys: a read-only lookup finds nothing (the initializer's values, as
    # on a PS that never saw them), and their stray rows are gone
    never = EmbeddingStore().create_table("emb", DIM, *CFG)
    probe = deleted[:50]
    np.testing.assert_array_equal(peer.lookup(probe, insert_missing=False),
                                  never.lookup(probe, insert_missing=False))
    assert peer.export_keys(probe)[0].size == 0
    # a training lookup gives them fresh rows
    fresh = never.lookup(deleted[50:60])
    np.testing.assert_array_equal(peer.lookup(deleted[50:60]), fresh)
    # the merge deletes every other stray and keeps the segment's rows
    peer.merge_all(max_rows=1000)
    assert peer.segment_rows == 0
    live = np.sort(peer.keys_in_slots(ALL))
    expect = np.sort(np.concatenate([keys[~in_dead], held, deleted[50:60]]))
    np.testing.assert_array_equal(live, expect)
    np.testing.assert_array_equal(peer.lookup(held, insert_missing=False), want_held)
    assert len(peer) == expect.size
    # the purged keys are tombstones for the peer's replica and incremental checkpoints
    # (the ten re-created later are listed too: tombstones first, then rows)
    np.testing.assert_array_equal(peer.tombstones_since(seq_before), np.sort(deleted))
