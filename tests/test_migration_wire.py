"""Migration rows on the wire and into the store: ``rowwire`` (RowBatch bytes without
protobuf copies), ``EmbeddingTable.reserve_import`` / ``import_block`` (the destination
sized once, one bulk index pass), and ``MigrateSlots`` -> ``ImportRows`` between two real
PS processes, counting every row and refusing bad batches while the PS keeps serving."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from deeprec_ext import rowwire
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2 as pb
from deeprec_ext.proto import ps_pb2_grpc as pbg
from deeprec_ext.store import EmbeddingStore
from deeprec_ext.store.hash_index import HashIndex
from tests.conftest import ROOT

ADAGRAD = {"name": "adagrad", "learning_rate": 0.1}


# -- rowwire -------------------------------------------------------------------------------
def test_rowwire_bytes_are_the_generated_message_both_ways():
    cfg = pb.TableConfig(name="emb", dim=4, optimizer_json='"sgd"')
    ids = np.array([-(2**63), -1, 0, 7, 2**63 - 1], np.int64)
    rows = np.arange(20, dtype=np.float32).reshape(5, 4)
    counts = np.array([0, 1, 2, 3, 2**32 - 1], np.uint32)
    wire = rowwire.encode(cfg.SerializeToString(), ids, rows, counts, np.array([5, -6]),
                          total_rows=2**40, applied_request_ids=["r-1", "ü"], background=True,
                          cut_age_ms=12.5)
    m = pb.RowBatch.FromString(wire)
    assert m.background and m.cut_age_ms == 12.5
    assert m.config == cfg and m.ids == ids.tobytes() and m.rows == rows.tobytes()
    assert m.counts == counts.tobytes() and m.deleted_ids == np.array([5, -6], np.int64).tobytes()
    assert m.total_rows == 2**40 and list(m.applied_request_ids) == ["r-1", "ü"]

    full = pb.RowBatch(config=cfg, ids=ids.tobytes(), rows=rows.tobytes(), origin="ps-1",
                       reset=True, origin_sequence=-3, end=True, counts=counts.tobytes(),
                       total_rows=9, applied_request_ids=["a"], background=True,
                       cut_age_ms=3.25)
    v = rowwire.parse(full.SerializeToString())
    assert v.cut_age_ms == 3.25
    assert rowwire.parse(full.SerializeToString()[:-9]).cut_age_ms == 0.0  # field dropped
    assert v.background and not rowwire.parse(rowwire.encode(cfg.SerializeToString())).background
    assert v.config == cfg and bytes(v.ids) == ids.tobytes() and bytes(v.rows) == rows.tobytes()
    assert bytes(v.counts) == counts.tobytes() and v.total_rows == 9 and v.origin == "ps-1"
    assert v.reset and v.end and v.origin_sequence == -3 and v.applied_request_ids == ["a"]
    # thousands of request ids, fields after them, from either encoder
    many = [f"call-{i}-{'x' * (i % 200)}" for i in range(5000)]
    for wire in (rowwire.encode(cfg.SerializeToString(), ids, rows, counts,
                                applied_request_ids=many, total_rows=7, background=True,
                                replica_after="h:1"),
                 pb.RowBatch(config=cfg, ids=ids.tobytes(), rows=rows.tobytes(),
                             counts=counts.tobytes(), applied_request_ids=many, total_rows=7,
                             background=True, replica_after="h:1").SerializeToString()):
        v = rowwire.parse(wire)
        assert v.applied_request_ids == many and v.config == cfg
        assert bytes(v.ids) == ids.tobytes() and bytes(v.counts) == counts.tobytes()
        assert (v.total_rows, v.background, v.replica_after) == (7, True, "h:1")
        assert pb.RowBatch.FromString(wire).applied_request_ids == many
    empty = rowwire.parse(b"")
    assert empty.config.name == "" and len(empty.ids) == 0 and empty.total_rows == 0


@pytest.mark.parametrize("raw", [b"\xff\xff", b"\x12\x05ab", b"\x0a\x02\xff\xff", b"\x13",
                                 b"\x10\x05", b"\x00\x01", b"\x42\x02ab\xff",
                                 b"\x42\x05ab", b"\x42\x01a\x50"])
def test_rowwire_refuses_bytes_that_are_not_a_row_batch(raw):
    with pytest.raises(Exception) as exc:
        rowwire.parse(raw)
    assert str(exc.value)


# -- the store -----------------------------------------------------------------------------
def _rows(n: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, width)).astype(np.float32),
            rng.integers(0, 1000, n).astype(np.uint32))


def test_import_block_into_a_sized_table_never_grows_and_keeps_every_row():
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(-2**62, 2**62, 300_000))
    t = EmbeddingStore().create_table("t", 8, "zeros", ADAGRAD)
    rows, counts = _rows(keys.size, t.row_width)
    t.reserve_import(keys.size)
    cap, arena = t._index.capacity, t._arena.shape[0]
    for i in range(0, keys.size, 1 << 14):
        t.import_block(keys[i:i + (1 << 14)], rows[i:i + (1 << 14)], counts[i:i + (1 << 14)])
        assert t._index.capacity == cap and not t._index.growing  # sized once
        assert t._arena.shape[0] == arena
    assert len(t) == keys.size
    got, block, _ = t.export_rows(with_counts=True)
    order = np.argsort(got)
    assert np.array_equal(got[order], keys)
    assert np.array_equal(block[order, :t.row_width], rows)
    assert np.array_equal(block[order, t.row_width].astype(np.uint32), counts)
    assert np.array_equal(t.counts(keys), counts)


def test_announcements_of_concurrent_streams_add_up():
    """A scale-out's new PS hears from two sources at once: the second announcement sizes
    the index for both, so it does not grow halfway through (and every chunk takes the
    bulk pass)."""
    rng = np.random.default_rng(4)
    # 190k rows fit an index of 2**19 positions at load 3/8, 380k do not fit it at 1/2
    keys = np.unique(rng.integers(-2**62, 2**62, 380_100))[:380_000]
    a, b = keys[::2], keys[1::2]
    t = EmbeddingStore().create_table("t", 8, "zeros", ADAGRAD)
    rows, counts = _rows(keys.size, t.row_width)
    t.reserve_import(a.size)
    t.import_block(a[:5000], rows[:5000], counts[:5000])  # the first stream began
    t.reserve_import(b.size)
    cap, arena = t._index.capacity, t._arena
    ra, rb = rows[:a.size], rows[a.size:]
    ca, cb = counts[:a.size], counts[a.size:]
    for i in range(5000, a.size, 1 << 14):  # both streams, interleaved
        t.import_block(a[i:i + (1 << 14)], ra[i:i + (1 << 14)], ca[i:i + (1 << 14)])
        j = i - 5000
        t.import_block(b[j:j + (1 << 14)], rb[j:j + (1 << 14)], cb[j:j + (1 << 14)])
        assert t._index.capacity == cap and not t._index.growing
        assert np.shares_memory(t._arena[:1], arena[:1])  # never re-allocated
    j = a.size - 5000
    t.import_block(b[j:], rb[j:], cb[j:])
    assert len(t) == keys.size
    assert np.array_equal(t.counts(a), ca) and np.array_equal(t.counts(b), cb)
    assert np.array_equal(t.export_keys(b)[1], rb)


def test_import_block_matches_import_rows_with_present_and_repeated_keys():
    """A key already here is overwritten, a key repeated in a batch keeps its last row:
    the bulk path (room in the index) and the probing one give the same table."""
    rng = np.random.default_rng(2)
    old = np.unique(rng.integers(-2**40, 2**40, 5000))
    batch = np.concatenate([old[:1000], rng.integers(2**41, 2**42, 3000), old[:10]])
    tables = []
    for bulk in (True, False):
        t = EmbeddingStore().create_table("t", 4, "zeros", ADAGRAD)
        t.lookup(old, insert_missing=True)
        if bulk:
            t.reserve_import(batch.size)
            assert t._index.can_place_rows(batch.size)
        else:
            t.delete(old[-1:])  # a deleted position: the bulk pass cannot run
            t.lookup(old[-1:], insert_missing=True)
            assert not t._index.can_place_rows(batch.size)
        rows, counts = _rows(batch.size, t.row_width, 3)
        t.import_block(batch, rows, counts)
        tables.append(t)
    for t in tables:
        assert len(t) == np.union1d(old, batch).size
    keys = np.union1d(old, batch)
    a, b = (t.export_keys(keys, with_counts=True)[1] for t in tables)
    assert np.array_equal(a, b)
    rows, counts = _rows(batch.size, tables[0].row_width, 3)
    last = {k: i for i, k in enumerate(batch)}  # the last occurrence of each key
    k = batch[-1]  # repeated (also in old[:10]): the last row won
    assert np.array_equal(tables[0].export_keys(np.array([k]))[1][0], rows[last[k]])
    for t in tables:  # present keys took the imported counts and rows
        assert np.array_equal(t.counts(batch[10:1000]), counts[10:1000])
        assert np.array_equal(t.export_keys(batch[10:1000])[1], rows[10:1000])


def test_import_block_refuses_bad_rows_and_changes_nothing():
    t = EmbeddingStore().create_table("t", 4, "zeros", ADAGRAD)
    t.lookup(np.arange(10), insert_missing=True)
    before = t.export_rows(with_counts=True)
    rows, counts = _rows(5, t.row_width)
    rows[3, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        t.import_block(np.arange(100, 105), rows, counts)
    with pytest.raises(ValueError, match="counts"):
        t.import_block(np.arange(100, 105), np.zeros((5, t.row_width), np.float32),
                       counts[:4])
    after = t.export_rows(with_counts=True)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_reserve_import_on_a_large_index_starts_growth_without_moving_it_all():
    idx = HashIndex(16)
    keys = np.arange(200_000, dtype=np.int64) * 7919
    idx.insert(keys, np.arange(keys.size))
    cap = idx.capacity
    idx.reserve(1_000_000, step=0)
    assert idx.growing and idx.capacity > cap and len(idx) == keys.size
    assert 8 * (keys.size + 1_000_000) <= 3 * idx.capacity  # the final size, at once
    assert np.array_equal(idx.find(keys), np.arange(keys.size))
    new = np.arange(1, 300_001, dtype=np.int64) * -31
    idx.insert(new, np.arange(keys.size, keys.size + new.size))
    assert np.array_equal(idx.find(keys), np.arange(keys.size))
    assert np.array_equal(idx.find(new), np.arange(keys.size, keys.size + new.size))


def test_scale_in_destination_purges_its_index_and_imports_into_freed_rows_exactly():
    """A scale-in's destination: rows of its own, a third of them dropped by an earlier
    clean-up (deleted positions, freed rows). reserve_import rebuilds the index without the
    deleted positions (growing it), the imports end that early and then take the bulk
    path into the freed rows: the arena does not grow, every imported row and count is
    exact, every row kept is untouched, a present key takes the imported row and a key
    repeated in a piece its last one."""
    rng = np.random.default_rng(7)
    ids = rng.permutation(np.unique(rng.integers(-2**62, 2**62, 460_000)))
    own, incoming = ids[:300_000], ids[300_000:399_000]
    t = EmbeddingStore().create_table("t", 4, "zeros", ADAGRAD)
    for i in range(0, own.size, 50_000):
        t.lookup(own[i:i + 50_000], insert_missing=True)
    t._index.advance(1 << 30)  # a table trained for long: its last growth is done
    gone = own[::3]
    t.delete(gone, moved=True)
    live = np.setdiff1d(own, gone)
    t.apply_gradients(live[:1000], np.ones((1000, 4), np.float32))  # not initial values
    kept_before = t.export_keys(live, with_counts=True)[1]
    assert t._index.num_deleted == gone.size and t._nfree == gone.size
    hwm, arena = t._hwm, t._arena.shape[0]
    # the stream also carries a key this PS holds (a stale copy) and a key twice in a piece
    batch = np.concatenate([incoming, live[5:6], incoming[50_000:50_001]])
    rows, counts = _rows(batch.size, t.row_width, 8)
    t.reserve_import(1000)  # a few rows: not worth moving every key, nothing starts
    assert not t._index.growing and t._index.num_deleted == gone.size
    t._import_target = (0, 0.0)  # (that announcement forgotten)
    t.reserve_import(batch.size)
    assert t._index.growing  # the rebuild began; nothing moved at once
    bulk_pieces = 0
    piece = 4096
    for i in range(0, batch.size, piece):
        bulk = t._index.can_place_rows(min(piece, batch.size - i))
        if bulk:
            bulk_pieces += 1
        t.import_block(batch[i:i + piece], rows[i:i + piece], counts[i:i + piece])
        if i >= batch.size // 2:  # the rebuild ended in the first half of the import
            assert not t._index.growing and t._index.num_deleted == 0
    assert bulk_pieces >= (batch.size // piece) // 2
    assert t._hwm == hwm and t._arena.shape[0] == arena  # into freed rows, no new ones
    assert t._nfree == gone.size - batch.size + 2  # + the two superseded copies' rows
    assert len(t) == live.size + incoming.size
    last = {int(k): j for j, k in enumerate(batch)}
    want = np.array([last[int(k)] for k in incoming])
    got = t.export_keys(incoming, with_counts=True)[1]
    assert np.array_equal(got[:, :t.row_width], rows[want])
    assert np.array_equal(got[:, t.row_width].astype(np.uint32), counts[want])
    assert np.array_equal(t.export_keys(live[5:6])[1][0], rows[last[int(live[5])]])
    rest = np.ones(live.size, bool)
    rest[5] = False
    assert np.array_equal(t.export_keys(live[rest], with_counts=True)[1], kept_before[rest])
    assert t.export_keys(gone)[0].size == 0  # dropped keys stay absent


def test_place_rows_into_given_rows_supersedes_older_copies_and_checks_its_rows():
    """place_rows(rows=...) (freed rows reused): a key already in the index loses to the
    batch's copy even where its row is higher; a key repeated in the batch keeps its
    latest copy; rows not strictly increasing are refused before anything changes."""
    rk = np.zeros(1000, np.int64)  # the owner's row -> key array: the caller writes it
    idx = HashIndex(1 << 12, row_keys=lambda: rk)
    old = np.arange(100, dtype=np.int64) * 13
    rk[900:1000] = old
    idx.place_rows(old, 900)  # rows 900..999
    keys = np.concatenate([old[:20], np.arange(1, 301, dtype=np.int64) * -7, old[:5]])
    rows = np.arange(keys.size, dtype=np.int64) * 2 + 1  # 1, 3, ...: all below the old rows
    rk[rows] = keys
    before = idx._tab.copy()
    with pytest.raises(ValueError, match="strictly increasing"):
        idx.place_rows(keys, 0, rows=rows[::-1].copy())
    assert np.array_equal(idx._tab, before)
    dead = idx.place_rows(keys, 0, rows=rows)
    want = {int(k): 900 + i for i, k in enumerate(old)}
    want.update({int(k): int(r) for k, r in zip(keys, rows)})  # later entries win
    ks = np.array(list(want), dtype=np.int64)
    assert np.array_equal(idx.find(ks), np.array(list(want.values())))
    assert len(idx) == len(want)
    superseded = set(range(900, 920)) | {int(r) for r in rows[:5]}
    assert set(dead.tolist()) == superseded


def test_reserve_with_purge_rebuilds_an_index_that_had_room():
    idx = HashIndex(1 << 20)
    keys = np.arange(400_000, dtype=np.int64) * 7919  # 200k left: a large index
    idx.insert(keys, np.arange(keys.size))
    idx.remove(keys[::2])
    cap = idx.capacity
    idx.reserve(10_000, step=0)  # room enough: no growth, the deleted positions stay
    assert not idx.growing and idx.num_deleted == keys.size // 2
    idx.reserve(10_000, step=0, purge=True)
    assert idx.growing and idx.capacity == cap  # same size, without the deleted positions
    while idx.growing:
        idx.advance(1 << 16)
    assert idx.num_deleted == 0 and idx.can_place_rows(10_000)
    assert np.array_equal(idx.find(keys[1::2]), np.arange(1, keys.size, 2))
    assert (idx.find(keys[::2]) == -1).all()


# -- two PS processes ------------------------------------------------------------------------
def _start_ps(tmp_path, name):
    port_file = tmp_path / f"{name}.port"
    proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--port", "0",
                             "--port-file", str(port_file)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


@pytest.fixture
def two_ps(tmp_path):
    procs = []
    try:
        src, a = _start_ps(tmp_path, "src")
        procs.append(src)
        dst, b = _start_ps(tmp_path, "dst")
        procs.append(dst)
        chans = [grpc.insecure_channel(x) for x in (a, b)]
        yield (pbg.ParameterServerStub(chans[0]), a), (pbg.ParameterServerStub(chans[1]), b)
        for c in chans:
            c.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


CFG = pb.TableConfig(name="emb", dim=4, initializer_json=json.dumps({"name": "normal", "seed": 1}),
                     optimizer_json=json.dumps(ADAGRAD))


def _lookup(stub, ids, insert=False):
    r = stub.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=ids.tobytes())],
                                     insert_missing=insert), timeout=30)
    return np.frombuffer(r.values[0], np.float32).reshape(ids.size, 4)


def _snapshot_then_catch_up(src, dst_addr, mask, moving, touched, pushes):
    """A migration's snapshot round of ``mask``'s slots (every row of ``moving``), then
    ``pushes`` pushes to ``touched`` and the catch-up round, which carries exactly those."""
    r = src.MigrateSlots(pb.MigrateSlotsRequest(dst_address=dst_addr, slots=mask.tobytes(),
                                                num_slots=4096, since_seq=-1), timeout=60)
    assert r.rows == moving.size
    for _ in range(pushes):
        src.Push(pb.PushRequest(tables=[pb.TableUpdate(
            table="emb", ids=touched.tobytes(),
            values=np.full((touched.size, 4), 0.5, np.float32).tobytes())]), timeout=30)
    r2 = src.MigrateSlots(pb.MigrateSlotsRequest(dst_address=dst_addr, slots=mask.tobytes(),
                                                 num_slots=4096, since_seq=r.watermark),
                          timeout=60)
    assert r2.rows == touched.size


def _filled_source(src, seed: int, n: int, every: int):
    """``n`` random keys on the source; the mask of every ``every``-th slot, and the keys
    in those slots."""
    src.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
    ids = np.unique(np.random.default_rng(seed).integers(-2**62, 2**62, n))
    _lookup(src, ids, insert=True)
    mask = np.zeros(4096, np.uint8)
    mask[::every] = 1
    return mask, ids[mask[slot_of(ids, 4096)].astype(bool)]


def test_migration_moves_every_row_of_its_slots_exactly(two_ps):
    (src, _), (dst, dst_addr) = two_ps
    mask, moving = _filled_source(src, 5, 120_000, 3)
    # pushes after the snapshot: the catch-up round carries them, counts included
    _snapshot_then_catch_up(src, dst_addr, mask, moving, moving[:2000], pushes=3)
    st = {t.name: t.rows for t in dst.Stats(pb.StatsRequest(), timeout=30).tables}
    assert st["emb"] == moving.size  # every moved row, once
    assert np.array_equal(_lookup(dst, moving), _lookup(src, moving))


def test_each_round_sends_the_ids_applied_since_the_last_and_resends_are_skipped(two_ps):
    """The ids of applied pushes reach a migration's destination round by round: the
    snapshot round every remembered one, each later round those applied since the one
    before, so the fenced last round carries only the few since the last catch-up (sent
    all at the fence, a full window of 200k ids held it 1-2 s). A round after the last
    sends them all again. Each push resent to the destination is skipped there, whatever
    round carried its id; a new id is applied."""
    (src, _), (dst, dst_addr) = two_ps
    mask, moving = _filled_source(src, 9, 20_000, 2)
    assert moving.size > 1200

    def push(stub, rid, keys):
        stub.Push(pb.PushRequest(request_id=rid, tables=[pb.TableUpdate(
            table="emb", ids=keys.tobytes(),
            values=np.full((keys.size, 4), 0.5, np.float32).tobytes())]), timeout=30)

    def round_(since, last=False):
        return src.MigrateSlots(pb.MigrateSlotsRequest(
            dst_address=dst_addr, slots=mask.tobytes(), num_slots=4096, since_seq=since,
            send_request_ids=last), timeout=60)

    sent = {}  # request id -> the keys its push wrote
    for i in range(1000):
        sent[f"a-{i}"] = moving[i:i + 1]
        push(src, f"a-{i}", sent[f"a-{i}"])
    r1 = round_(-1)
    assert r1.request_ids == 1000
    for i in range(10):
        sent[f"b-{i}"] = moving[1000 + i:1001 + i]
        push(src, f"b-{i}", sent[f"b-{i}"])
    r2 = round_(r1.watermark)
    assert (r2.rows, r2.request_ids) == (10, 10)
    sent["c-0"] = moving[1100:1101]
    push(src, "c-0", sent["c-0"])
    r3 = round_(r2.watermark, last=True)
    assert (r3.rows, r3.request_ids) == (1, 1)
    assert round_(r3.watermark, last=True).request_ids == 1011  # a new cut: every id

    # every moved row is there, as on the source; each resend is skipped
    every = np.concatenate(list(sent.values()))
    before = _lookup(dst, every)
    np.testing.assert_array_equal(before, _lookup(src, every))
    for rid in ("a-0", "a-999", "b-3", "c-0"):
        push(dst, rid, sent[rid])
    np.testing.assert_array_equal(_lookup(dst, every), before)
    push(dst, "d-0", sent["c-0"])  # a push the source never applied
    assert not np.array_equal(_lookup(dst, sent["c-0"]), before[-1:])


def test_request_id_cursors_of_migrations_lost_logs_failures_and_expiry():
    """What each round of a migration to one destination sends (``_applied_ids_for``):
    every id at a snapshot round, or where the log since the last round overflowed; the
    new ones otherwise; the last round closes the cursor, and so does a destination
    forgotten by the migration-consumer expiry (no log kept for it on every push)."""
    from deeprec_ext.ps.replication import AppliedRequests
    from deeprec_ext.ps.server import ParameterServerServicer

    svc = ParameterServerServicer("ps-ids")
    try:
        svc.applied = a = AppliedRequests(capacity=50)
        a.add_many([f"x{i}" for i in range(30)])
        cur = "migrate:127.0.0.1:1"
        assert svc._applied_ids_for(cur, snapshot=True, last=False) == [f"x{i}" for i in range(30)]
        a.add_many(["y0", "y1", "y0", ""])  # repeated and empty ids count once / not at all
        assert svc._applied_ids_for(cur, snapshot=False, last=False) == ["y0", "y1"]
        assert svc._applied_ids_for(cur, snapshot=False, last=False) == []
        a.add_many([f"z{i}" for i in range(60)])  # more than the window since the last round
        assert len(svc._applied_ids_for(cur, snapshot=False, last=False)) == 50  # all kept
        a.add("w0")
        assert svc._applied_ids_for(cur, snapshot=False, last=True) == ["w0"]
        assert not a.has_cursor(cur)
        # a round to a destination whose cursor is gone sends everything
        assert len(svc._applied_ids_for(cur, snapshot=False, last=False)) == 50
        svc._migration_consumer("127.0.0.1:1", 0)
        svc._migrations["127.0.0.1:1"] -= svc.MIGRATION_CONSUMER_SECONDS + 1
        svc._migration_consumer("127.0.0.1:2", 0)  # a later round elsewhere expires it
        assert not a.has_cursor(cur)
        svc._applied_ids_for("migrate:127.0.0.1:2", snapshot=True, last=False)
        svc._migration_consumer(None)  # the migration is over: every cursor closed
        assert not a.has_cursor("migrate:127.0.0.1:2") and a.has_cursor(a.MAIN)
        # a destination: a source's large batch of ids is kept beside its own window,
        # a small one recorded into it
        svc.applied = d = AppliedRequests(capacity=40)
        d.add_many([f"mine{i}" for i in range(40)])
        svc._record_source_ids([f"src{i}" for i in range(40)])
        assert all(d.seen(f"mine{i}") for i in range(40)) and d.seen("src0")
        svc._record_source_ids(["late0", "late1"])
        assert d.seen("late1") and not d.seen("mine0") and d.seen("mine2")
        assert d.take_unshipped()[0][-2:] == ["late0", "late1"]  # for this PS's peer too
    finally:
        svc.close()


def test_add_many_is_add_of_each_id():
    """The window (oldest forgotten first) and each cursor's log, overflow included."""
    from deeprec_ext.ps.replication import AppliedRequests

    rng = np.random.default_rng(3)
    one, bulk = AppliedRequests(capacity=500), AppliedRequests(capacity=500)
    for b in (one, bulk):
        b.open_cursor("other")
    for step in range(60):
        # distinct ids of a sliding range: some new, some seen in recent calls
        batch = [f"r{int(i)}" for i in 20 * step + rng.choice(60, int(rng.integers(0, 40)),
                                                             replace=False)]
        ship = bool(rng.integers(0, 2))
        for rid in batch:
            one.add(rid, ship=ship)
        bulk.add_many(batch, ship=ship)
        assert one.snapshot() == bulk.snapshot()
        if rng.integers(0, 4) == 0:
            for cur in (one.MAIN, "other"):
                got_one, got_bulk = one.take_unshipped(cur), bulk.take_unshipped(cur)
                assert got_one == got_bulk


def test_a_promotion_adopts_the_dead_ps_window_whole():
    """``adopt``: the copy's window is checked as it is (no id recorded one by one inside
    the recovery), shipped on every stream once, included in snapshots (oldest first),
    and forgotten once as many newer ids were recorded here as a window holds."""
    from deeprec_ext.ps.replication import AppliedRequests, IdWindow

    a = AppliedRequests(capacity=100)
    a.add_many([f"own{i}" for i in range(10)])
    a.open_cursor("next")
    a.take_unshipped()
    window = IdWindow([f"dead{i}" for i in range(150)], capacity=100)
    assert list(window) == [f"dead{i}" for i in range(50, 150)]  # the last 100
    a.adopt(window, ship=True)
    assert a.seen("dead120") and a.seen("own3") and not a.seen("dead10")
    assert a.snapshot() == list(window) + [f"own{i}" for i in range(10)]
    a.add("own10")
    got, lost = a.take_unshipped()
    assert got == list(window) + ["own10"] and not lost
    assert a.take_unshipped("next")[0] == list(window) + ["own10"]
    assert a.take_unshipped()[0] == []  # shipped once
    a.open_cursor("late")  # a stream opened after: its full copy sends the snapshot
    assert a.take_unshipped("late")[0] == []
    a.add_many([f"new{i}" for i in range(89)])
    assert a.seen("dead120")  # 90 ids recorded since: still within a window
    a.add_many([f"new{i}" for i in range(89, 100)])
    assert not a.seen("dead120") and a.snapshot() == [f"new{i}" for i in range(100)]


def test_migration_into_a_ps_that_holds_rows_moves_every_row_exactly(two_ps):
    """A scale-in's destination: it serves rows of its own and holds the deleted positions
    of an earlier clean-up. The rows arrive in pieces (``IMPORT_PIECE_ROWS``) between its
    lookups; every moved row lands once, its own rows stay, and a batch with one bad row
    in its last piece is refused whole."""
    (src, _), (dst, dst_addr) = two_ps
    rng = np.random.default_rng(11)
    ids = rng.permutation(np.unique(rng.integers(-2**62, 2**62, 200_000)))
    own, moving_pool = ids[:80_000], ids[80_000:]
    for stub, keys in ((dst, own), (src, moving_pool)):
        stub.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
        _lookup(stub, keys, insert=True)
    gone = np.zeros(4096, np.uint8)
    gone[1::3] = 1  # the destination's earlier clean-up: deleted positions, free rows
    dropped = dst.DropSlots(pb.DropSlotsRequest(slots=gone.tobytes(), num_slots=4096),
                            timeout=30).rows
    kept = own[~gone[slot_of(own, 4096)].astype(bool)]
    assert dropped == own.size - kept.size > 0
    kept_before = _lookup(dst, kept)
    mask = np.zeros(4096, np.uint8)
    mask[::3] = 1
    moving = moving_pool[mask[slot_of(moving_pool, 4096)].astype(bool)]
    assert moving.size > 2 * 16384  # several chunks of several pieces each
    _snapshot_then_catch_up(src, dst_addr, mask, moving, moving[::7], pushes=1)
    st = {t.name: t.rows for t in dst.Stats(pb.StatsRequest(), timeout=30).tables}
    assert st["emb"] == kept.size + moving.size  # every moved row once, its own rows kept
    assert np.array_equal(_lookup(dst, moving), _lookup(src, moving))
    assert np.array_equal(_lookup(dst, kept), kept_before)
    # one bad row in the last piece of a large batch: nothing of the batch lands
    n = 3 * 4096 + 5
    fresh = np.arange(1, n + 1, dtype=np.int64) * 7919
    rows = np.ones((n, 8), np.float32)
    rows[-1, 0] = np.nan
    send = grpc.insecure_channel(dst_addr).stream_unary(
        "/deeprec_ext.ps.ParameterServer/ImportRows", request_serializer=None,
        response_deserializer=pb.ImportRowsResponse.FromString)
    with pytest.raises(grpc.RpcError) as exc:
        send(iter([rowwire.encode(CFG.SerializeToString(), fresh, rows,
                                  np.zeros(n, np.uint32))]), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"row {n - 1}" in exc.value.details(), exc.value.details()
    st = {t.name: t.rows for t in dst.Stats(pb.StatsRequest(), timeout=30).tables}
    assert st["emb"] == kept.size + moving.size


def test_bad_import_batches_are_refused_by_name_and_the_ps_keeps_serving(two_ps):
    _, (dst, dst_addr) = two_ps
    ch = grpc.insecure_channel(dst_addr)
    send = ch.stream_unary("/deeprec_ext.ps.ParameterServer/ImportRows", request_serializer=None,
                           response_deserializer=pb.ImportRowsResponse.FromString)
    cfg = CFG.SerializeToString()
    good_rows = np.ones((3, 8), np.float32)
    ids = np.array([1, 2, 3], np.int64)
    nan_rows = good_rows.copy()
    nan_rows[1, 1] = np.inf
    cases = [
        ([rowwire.encode(cfg, ids, good_rows, np.zeros(2, np.uint32))], "counts"),
        ([rowwire.encode(cfg, ids, nan_rows, np.zeros(3, np.uint32))], "NaN or Inf"),
        ([rowwire.encode(cfg, ids, good_rows[:, :5], np.zeros(3, np.uint32))], "rows"),
        ([b"\x12\x7fab"], "not a message"),
    ]
    for batches, word in cases:
        with pytest.raises(grpc.RpcError) as exc:
            send(iter(batches), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        assert word in exc.value.details(), exc.value.details()
    # a huge announced row count is only a (capped) sizing hint
    r = send(iter([rowwire.encode(cfg, total_rows=2**62),
                   rowwire.encode(cfg, ids, good_rows, np.arange(3, dtype=np.uint32))]),
             timeout=30)
    assert r.rows == 3
    # a sender from before the counts field: counts in the rows' last column
    old = pb.RowBatch(config=CFG, ids=np.array([9], np.int64).tobytes(),
                      rows=np.full((1, 9), 2.0, np.float32).tobytes())
    assert dst.ImportRows(iter([old]), timeout=30).rows == 1
    got = _lookup(dst, np.array([1, 2, 3, 9], np.int64))
    assert np.array_equal(got, np.array([[1] * 4] * 3 + [[2] * 4], np.float32))
    st = {t.name: t.rows for t in dst.Stats(pb.StatsRequest(), timeout=30).tables}
    assert st["emb"] == 4  # the refused batches changed nothing
    ch.close()


# -- replication in the store's layout -------------------------------------------------------
def test_rowwire_writes_replication_fields_as_the_generated_message():
    wire = rowwire.encode(origin="ps-ü", reset=True, origin_sequence=-5, end=True,
                          applied_request_ids=["r"])
    m = pb.RowBatch.FromString(wire)
    assert (m.origin, m.reset, m.origin_sequence, m.end) == ("ps-ü", True, -5, True)
    assert list(m.applied_request_ids) == ["r"]
    assert rowwire.encode() == b"" and pb.RowBatch.FromString(b"") == pb.RowBatch()


def _serve(name):
    from deeprec_ext.grpc_util import create_server
    from deeprec_ext.ps.server import ParameterServerServicer
    from deeprec_ext.ps.validation import DecodeGuard
    svc = ParameterServerServicer(name)
    server, port = create_server("127.0.0.1:0", max_workers=8, interceptors=[DecodeGuard()])
    pbg.add_ParameterServerServicer_to_server(svc, server)
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    return svc, server, ch, pbg.ParameterServerStub(ch), f"127.0.0.1:{port}"


def _rows_and_counts(table):
    keys, (rows, counts), _ = table.export_rows(None, with_counts="apart")
    order = np.argsort(keys)
    return keys[order], rows[order], counts[order]


def test_replica_over_grpc_keeps_rows_and_counts_loses_moved_rows_and_refuses_bad_bytes():
    """A full copy and a migration clean-up's delta travel as rowwire bytes over real gRPC:
    the peer's copy equals the primary's rows and update counts, the moved rows are gone
    from it (a promotion must not bring them back), and bad streams are refused by name
    without touching the copy."""
    a, a_srv, a_ch, a_stub, _ = _serve("ps-a")
    b, b_srv, b_ch, b_stub, b_addr = _serve("ps-b")
    try:
        all_slots = np.ones(4096, np.uint8)
        a_stub.SetRouting(pb.SetRoutingRequest(
            epoch=1, owned_slots=all_slots.tobytes(), num_slots=4096, replica_peer=b_addr,
            replication_interval_ms=60_000, ps_id="ps-a"), timeout=30)
        a_stub.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
        ids = np.unique(np.random.default_rng(7).integers(-2**62, 2**62, 50_000))
        _lookup(a_stub, ids, insert=True)
        for _ in range(2):  # update counts 2 on a subset
            a_stub.Push(pb.PushRequest(tables=[pb.TableUpdate(
                table="emb", ids=ids[:5000].tobytes(),
                values=np.full((5000, 4), 0.5, np.float32).tobytes())]), timeout=30)
        a.replicator.ship()  # the full copy
        src, copy = a.store["emb"], b.replicas.copies["ps-a"].store["emb"]
        for x, y in zip(_rows_and_counts(src), _rows_and_counts(copy)):
            assert np.array_equal(x, y)
        assert _rows_and_counts(copy)[2].max() == 2

        mask = np.zeros(4096, np.uint8)
        mask[1::3] = 1
        moving = ids[mask[slot_of(ids, 4096)].astype(bool)]
        a_stub.SetRouting(pb.SetRoutingRequest(
            epoch=2, owned_slots=(1 - mask).tobytes(), num_slots=4096, replica_peer=b_addr,
            replication_interval_ms=60_000, ps_id="ps-a"), timeout=30)
        assert a_stub.DropSlots(pb.DropSlotsRequest(slots=mask.tobytes(), num_slots=4096),
                                timeout=30).rows == moving.size
        a.replicator.ship()  # the delta: "moved" tombstones
        assert len(copy) == ids.size - moving.size  # every kept row survived, no moved one
        assert not copy.export_keys(moving)[0].size
        for x, y in zip(_rows_and_counts(src), _rows_and_counts(copy)):
            assert np.array_equal(x, y)

        send = b_ch.stream_unary("/deeprec_ext.ps.ParameterServer/Replicate",
                                 request_serializer=None,
                                 response_deserializer=pb.ReplicateResponse.FromString)
        cfg = CFG.SerializeToString()
        three = np.array([1, 2, 3], np.int64)
        base = b.replicas.copies["ps-a"].sequence
        meta = (("x-replica-kind", "delta"), ("x-replica-base", str(base)))
        cases = [([b"\x12\x7fab"], "Replicate"),
                 ([rowwire.encode(cfg, three, np.ones((3, 8), np.float32),
                                  np.zeros(2, np.uint32), origin="ps-a", end=True)], "counts")]
        for batches, word in cases:
            with pytest.raises(grpc.RpcError) as exc:
                send(iter(batches), timeout=30, metadata=meta)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
            assert word in exc.value.details(), exc.value.details()
        assert len(copy) == ids.size - moving.size  # nothing of them applied
        # ...and replication goes on
        kept = np.setdiff1d(ids[:5000], moving)[:100]
        a_stub.Push(pb.PushRequest(tables=[pb.TableUpdate(
            table="emb", ids=kept.tobytes(),
            values=np.full((kept.size, 4), 0.5, np.float32).tobytes())]), timeout=30)
        a.replicator.ship()
        for x, y in zip(_rows_and_counts(src), _rows_and_counts(copy)):
            assert np.array_equal(x, y)
        assert _rows_and_counts(copy)[2].max() == 3
    finally:
        for svc, srv, ch in ((a, a_srv, a_ch), (b, b_srv, b_ch)):
            ch.close()
            svc.replicator.close()
            srv.stop(0).wait(10)
            svc.close()


def test_tombstones_undistinct_list_every_logged_key_and_the_replica_frees_each_once():
    s = EmbeddingStore()
    t = s.create_table("emb", 4, optimizer="sgd")
    t.lookup(np.arange(100))
    seq = s.sequence.value
    t.delete(np.arange(10), log_tombstone=False, moved=True)
    t.lookup(np.arange(5))
    t.delete(np.arange(5), log_tombstone=False, moved=True)  # deleted again
    raw = t.tombstones_since(seq, include_moved=True, distinct=False)
    assert sorted(raw.tolist()) == sorted(list(range(10)) + list(range(5)))
    assert np.array_equal(t.tombstones_since(seq, include_moved=True), np.arange(10))
    r = EmbeddingStore().create_table("emb", 4, optimizer="sgd")
    r.lookup(np.arange(100))
    assert r.delete(raw, log_tombstone=False) == 10 and len(r) == 90


@pytest.mark.parametrize("peer_changes", [True, False])
def test_imports_skip_a_peer_the_destination_leaves_and_reach_the_new_one(peer_changes,
                                                                          monkeypatch):
    """A destination whose ring peer changes at the publish (a scale-in's PS whose peer is
    leaving) does not ship the rows it imports to that peer: its own rows still go there,
    every delta; at the publish the new peer's full copy holds every row, imported ones
    included. When the peer stays, the imports are shipped to it as before. Real gRPC,
    three in-process PS; bad peer addresses are refused by name, nothing imported."""
    s, s_srv, s_ch, s_stub, s_addr = _serve("ps-s")
    d, d_srv, d_ch, d_stub, d_addr = _serve("ps-d")
    p, p_srv, p_ch, p_stub, p_addr = _serve("ps-p")
    try:
        own = np.zeros(4096, np.uint8)
        own[::2] = 1
        moving = np.zeros(4096, np.uint8)
        moving[1::4] = 1  # half of the source's slots

        def routing(stub, epoch, owned, peer, ps_id):
            stub.SetRouting(pb.SetRoutingRequest(
                epoch=epoch, owned_slots=owned.tobytes(), num_slots=4096, replica_peer=peer,
                replication_interval_ms=60_000, ps_id=ps_id), timeout=30)
        routing(d_stub, 1, own, p_addr, "ps-d")
        routing(s_stub, 1, 1 - own, "", "ps-s")
        for stub in (s_stub, d_stub):
            stub.CreateTable(pb.CreateTableRequest(config=CFG), timeout=30)
        ids = np.unique(np.random.default_rng(11).integers(-2**62, 2**62, 60_000))
        slots = slot_of(ids, 4096)
        d_keys, s_keys = ids[own[slots] == 1], ids[own[slots] == 0]
        moved = ids[moving[slots] == 1]
        _lookup(d_stub, d_keys, insert=True)
        _lookup(s_stub, s_keys, insert=True)
        d.replicator.ship()  # the peer's full copy of the destination's own rows
        copy = p.replicas.copies["ps-d"].store["emb"]
        assert len(copy) == d_keys.size

        after = s_addr if peer_changes else p_addr  # the destination's peer after the move
        with pytest.raises(grpc.RpcError) as exc:
            s_stub.MigrateSlots(pb.MigrateSlotsRequest(
                dst_address=d_addr, slots=moving.tobytes(), num_slots=4096, since_seq=-1,
                dst_replica_after="no-port"), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dst_replica_after" in exc.value.details()
        send = d_ch.stream_unary("/deeprec_ext.ps.ParameterServer/ImportRows",
                                 request_serializer=None,
                                 response_deserializer=pb.ImportRowsResponse.FromString)
        with pytest.raises(grpc.RpcError) as exc:
            send(iter([rowwire.encode(CFG.SerializeToString(), replica_after="bad address"),
                       rowwire.encode(CFG.SerializeToString(), moved, np.ones((moved.size, 8),
                                      np.float32), np.ones(moved.size, np.uint32))]), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "replica_after" in exc.value.details()
        assert len(d.store["emb"]) == d_keys.size  # nothing imported

        # a delta larger than this is sent as a full copy: the imports are larger, the
        # destination's own writes are not (held rows do not count towards it)
        from deeprec_ext.ps import replication
        monkeypatch.setattr(replication, "DELTA_MAX_ROWS", 8000)
        full0 = d.replicator.full_copies
        # snapshot, pushes to both sides, a catch-up round; a delta after each
        r = s_stub.MigrateSlots(pb.MigrateSlotsRequest(
            dst_address=d_addr, slots=moving.tobytes(), num_slots=4096, since_seq=-1,
            dst_replica_after=after), timeout=60)
        assert r.rows == moved.size and len(d.store["emb"]) == ids.size - s_keys.size + moved.size
        for stub, keys in ((d_stub, d_keys[:3000]), (s_stub, moved[:2000])):
            stub.Push(pb.PushRequest(tables=[pb.TableUpdate(
                table="emb", ids=keys.tobytes(),
                values=np.full((keys.size, 4), 0.5, np.float32).tobytes())]), timeout=30)
        d.replicator.ship()
        r = s_stub.MigrateSlots(pb.MigrateSlotsRequest(
            dst_address=d_addr, slots=moving.tobytes(), num_slots=4096, since_seq=r.watermark,
            dst_replica_after=after), timeout=60)
        assert r.rows == 2000
        d.replicator.ship()
        # the destination's own rows reached its current peer in every case
        src_rows = _rows_and_counts(d.store["emb"])
        own_rows = [a[np.isin(src_rows[0], d_keys)] for a in src_rows]
        assert moved.size > 8000 and d.replicator.full_copies == full0 + (not peer_changes)
        if not peer_changes:
            copy = p.replicas.copies["ps-d"].store["emb"]  # the full copy's
        got = _rows_and_counts(copy)
        if peer_changes:  # ...and only them, as deltas
            assert len(copy) == d_keys.size
            for x, y in zip(own_rows, got):
                assert np.array_equal(x, y)
        else:  # imports too: the copy equals the destination's table
            assert len(copy) == d_keys.size + moved.size
            for x, y in zip(src_rows, got):
                assert np.array_equal(x, y)

        # the publish: the destination owns the moved slots; its peer is `after`
        routing(d_stub, 2, own | moving, after, "ps-d")
        d.replicator.ship()  # a new peer: a full copy, imported rows included
        final = (s if peer_changes else p).replicas.copies["ps-d"].store["emb"]
        for x, y in zip(_rows_and_counts(d.store["emb"]), _rows_and_counts(final)):
            assert np.array_equal(x, y)
        assert len(final) == d_keys.size + moved.size
    finally:
        for svc, srv, ch in ((s, s_srv, s_ch), (d, d_srv, d_ch), (p, p_srv, p_ch)):
            ch.close()
            svc.replicator.close()
            srv.stop(0).wait(10)
            svc.close()
