"""Races of the replication data plane, with real PS processes driven the way the
AIMaster drives them (SetRouting, MigrateSlots, DropSlots, Promote): a promotion during
a full resync, and rows of slots a PS gave away coming back from its replica."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from deeprec_ext import codec, errors
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import gazer_pb2, ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, wait_for

NUM_SLOTS = 64


class Ps:
    """One standalone PS process (``python -m deeprec_ext.ps``) that the test routes."""

    def __init__(self, tmp_path, name: str):
        self.name = name
        port_file = tmp_path / f"{name}.port"
        self.log = open(tmp_path / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deeprec_ext.ps", "--id", name, "--port-file", str(port_file)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=self.log,
            stderr=subprocess.STDOUT)
        port = wait_for(lambda: port_file.exists() and port_file.read_text(), 30, f"{name} port")
        self.address = f"127.0.0.1:{port}"
        self.channel = insecure_channel(self.address)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.epoch = 0

    def route(self, owned: np.ndarray, peer: "Ps | None", interval_ms: float = 50.0,
              sync: bool = False) -> None:
        self.epoch += 1
        self.routing = (owned, peer, interval_ms, sync)
        self.stub.SetRouting(ps_pb2.SetRoutingRequest(
            epoch=self.epoch, owned_slots=owned.astype(np.uint8).tobytes(), num_slots=NUM_SLOTS,
            replica_peer=peer.address if peer else "", replication_interval_ms=interval_ms,
            sync_replication=sync, ps_id=self.name), timeout=30)

    def ship(self) -> None:
        """A routing change (the same layout at a new epoch) wakes the shipping thread;
        wait until the peer's copy is current."""
        self.route(*self.routing)
        self.wait_shipped()

    def replication(self):
        raw = self.stub.Stats(ps_pb2.StatsRequest(), timeout=30).gazer_stats
        return gazer_pb2.MemberStats.FromString(raw).replication

    def wait_shipped(self, timeout: float = 120) -> None:
        """Until the peer's copy is current (nothing written since the last shipment)."""
        wait_for(lambda: self.replication().behind_sequence == 0, timeout,
                 f"{self.name}'s replica to catch up")

    def lookup(self, table: str, ids: np.ndarray, dim: int) -> np.ndarray:
        r = self.stub.Lookup(ps_pb2.LookupRequest(
            tables=[ps_pb2.TableIds(table=table, ids=codec.ids_to_bytes(ids))],
            insert_missing=False), timeout=60)
        return np.frombuffer(r.values[0], np.float32).reshape(ids.size, dim)

    def rows(self, table: str) -> int:
        return sum(t.rows for t in self.stub.Stats(ps_pb2.StatsRequest(), timeout=30).tables
                   if t.name == table)

    def promote(self, origin: "Ps", mask: np.ndarray, timeout: float = 120):
        return self.stub.Promote(ps_pb2.PromoteRequest(
            origin=origin.name, slots=mask.astype(np.uint8).tobytes(), num_slots=NUM_SLOTS),
            timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture
def cluster(tmp_path):
    started: list[Ps] = []

    def start(*names: str) -> list[Ps]:
        out = [Ps(tmp_path, n) for n in names]
        started.extend(out)
        return out

    yield start
    for p in started:
        p.stop()


ALL = np.ones(NUM_SLOTS, dtype=bool)
NONE = np.zeros(NUM_SLOTS, dtype=bool)


def _create(ps: Ps, name: str, dim: int, init, opt) -> None:
    ps.stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
        name=name, dim=dim, initializer_json=json.dumps(init),
        optimizer_json=json.dumps(opt))), timeout=30)


def _fill(ps: Ps, table: str, n: int, batch: int = 200_000) -> np.ndarray:
    keys = np.arange(n, dtype=np.int64) * 7 + 3
    for i in range(0, n, batch):
        ps.stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(
            table=table, ids=codec.ids_to_bytes(keys[i:i + batch]))], insert_missing=True),
            timeout=120)
    return keys


def _push(ps: Ps, table: str, keys: np.ndarray, grad: float, rid: str = "") -> None:
    ps.stub.Push(ps_pb2.PushRequest(request_id=rid, tables=[ps_pb2.TableUpdate(
        table=table, ids=codec.ids_to_bytes(keys),
        values=codec.floats_to_bytes(np.full((keys.size, 1), grad, np.float32)))]), timeout=60)


# ------------------------------------------------------------ 1. promote during a full resync

def _move_slots(a, n, b, moving, slow: float) -> dict:
    """A migration's data steps from A to N: snapshot, fence (A keeps ~moving, replicating
    to B), last delta. Returns the slot request, for the clean-up's DropSlots."""
    req = dict(slots=moving.astype(np.uint8).tobytes(), num_slots=NUM_SLOTS,
               dst_address=n.address)
    w = a.stub.MigrateSlots(ps_pb2.MigrateSlotsRequest(since_seq=-1, **req), timeout=120).watermark
    a.route(~moving, b, interval_ms=slow)  # fence
    a.stub.MigrateSlots(ps_pb2.MigrateSlotsRequest(since_seq=w, send_request_ids=True, **req),
                        timeout=120)
    return req

def test_promote_during_full_resync_waits_for_it_and_loses_nothing(cluster):
    """The ring re-forms: A's new peer B starts a full copy of A's rows. A Promote of A on
    B arriving meanwhile waits for that copy and promotes every row (it used to fail at
    once, "the replica is incomplete", and the AIMaster failed the job)."""
    a, b = cluster("ps-a", "ps-b")
    a.route(ALL, None)
    b.route(NONE, None)
    _create(a, "emb", 16, {"name": "normal", "stddev": 0.1, "seed": 5}, "adagrad")
    keys = _fill(a, "emb", 600_000)
    want = a.lookup("emb", keys, 16)
    a.route(ALL, b)  # the ring re-forms: a full copy of A's 600k rows to B starts now
    time.sleep(0.3)
    t0 = time.monotonic()
    resp = b.promote(a, ALL)
    waited = time.monotonic() - t0
    assert resp.rows == keys.size, f"promoted {resp.rows} of {keys.size} rows"
    b.route(ALL, None)
    np.testing.assert_array_equal(b.lookup("emb", keys, 16), want)
    print(f"promote waited {waited:.2f}s for the resync; promoted {resp.rows} rows")


def test_promote_of_a_replica_whose_resync_broke_is_a_typed_refusal(cluster):
    """The origin dies in the middle of its full copy: the copy can never complete. Promote
    answers FAILED_PRECONDITION with a kind the AIMaster acts on (restore those slots from
    a checkpoint) and promotes nothing partial."""
    a, b = cluster("ps-a", "ps-b")
    a.route(ALL, None)
    b.route(NONE, None)
    _create(a, "emb", 16, {"name": "normal", "stddev": 0.1, "seed": 5}, "adagrad")
    _fill(a, "emb", 600_000)
    a.route(ALL, b)
    # kill well before the copy of 600k rows can finish (it may not have begun: the
    # test accepts both); a copy that completed would make the promote legitimate
    time.sleep(0.05)
    a.kill()
    with pytest.raises(grpc.RpcError) as info:
        b.promote(a, ALL)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # its rebuild broke off with A (or never began): nothing to wait for, restore instead
    assert errors.kind_of(info.value) is errors.ErrorKind.NO_REPLICA
    assert b.rows("emb") == 0  # nothing partial was promoted


def test_replica_is_replaced_atomically_and_deltas_continue_after_a_resync(cluster):
    """Deltas after a full copy, a second full copy (a new peer), and a promotion: every
    counter exact, with pushes running all along."""
    a, b, c = cluster("ps-a", "ps-b", "ps-c")
    a.route(ALL, b)
    b.route(NONE, None)
    c.route(NONE, None)
    _create(a, "c", 1, "zeros", {"name": "sgd", "learning_rate": 1.0})
    keys = np.arange(20_000, dtype=np.int64)
    for _ in range(3):
        _push(a, "c", keys, -1.0)
    a.wait_shipped()
    a.route(ALL, c)  # new peer: full copy to C, B's copy is dropped
    for _ in range(2):
        _push(a, "c", keys, -1.0)
    a.wait_shipped()
    a.kill()
    resp = c.promote(a, ALL)
    assert resp.rows == keys.size
    c.route(ALL, None)
    np.testing.assert_array_equal(c.lookup("c", keys, 1)[:, 0], 5)
    # B no longer holds a copy of A: promoting it there is refused, not stale rows
    with pytest.raises(grpc.RpcError) as info:
        b.promote(a, ALL, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert errors.kind_of(info.value) is errors.ErrorKind.NO_REPLICA


# ------------------------------------------------- 3. slots migrated away leave the replica
def test_slots_migrated_away_do_not_come_back_from_the_replica(cluster):
    """A gives slots S to N (MigrateSlots, fence, DropSlots). N dies and A, N's ring peer,
    promotes S back; A dies before its next shipment. B promotes A's slots, S included:
    B's copy of A must not hand back the rows S had before it left A (stale values). The
    rows A dropped are tombstoned on its replica."""
    a, b, n = cluster("ps-a", "ps-b", "ps-n")
    slow = 3_600_000.0  # A ships only when its routing changes (each SetRouting wakes it)
    a.route(ALL, b, interval_ms=slow)
    b.route(NONE, a)
    n.route(NONE, None)
    _create(a, "c", 1, "zeros", {"name": "sgd", "learning_rate": 1.0})
    keys = np.arange(50_000, dtype=np.int64)
    _push(a, "c", keys, -1.0)  # every key: 1
    a.ship()
    moving = np.zeros(NUM_SLOTS, dtype=bool)
    moving[: NUM_SLOTS // 2] = True
    in_s = moving[slot_of(keys, NUM_SLOTS)]

    # scale event: S moves A -> N (snapshot, fence, last delta, hand-over, clean-up)
    req = _move_slots(a, n, b, moving, slow)
    n.route(moving, a)  # N replicates to A (ring a -> b, n -> a)
    a.stub.DropSlots(ps_pb2.DropSlotsRequest(slots=req["slots"], num_slots=NUM_SLOTS), timeout=60)
    assert a.rows("c") == int((~in_s).sum())
    a.ship()  # A's drop reaches its replica on B
    _push(n, "c", keys[in_s], -1.0)  # S's keys: 2, on N
    n.wait_shipped()

    # N dies: A promotes S from its copy of N (S's keys: 2, new sequence numbers on A)
    n.kill()
    assert a.promote(n, moving).rows == int(in_s.sum())
    # ... and A dies before shipping them: B promotes A's slots, S included
    a.kill()
    b.promote(a, ALL)
    b.route(ALL, None)
    got = b.lookup("c", keys, 1)[:, 0]
    np.testing.assert_array_equal(got[~in_s], 1)
    stale = int((got[in_s] == 1).sum())
    assert stale == 0, f"{stale} rows of slots A gave away came back with their old values"
    # S's rows were A's updates at risk (never shipped): absent, not stale
    assert set(np.unique(got[in_s]).tolist()) <= {0.0, 2.0}


# ------------------------------- 4. a promoted replica holding rows its origin moved away
def test_promoted_replica_counts_and_ships_only_the_dead_ps_slots(cluster):
    """A scale-out moves slots S from A to the new PS N, which is also A's new ring peer:
    A's full copy to N starts at the hand-over and holds S's rows, A's clean-up (DropSlots)
    follows, and A is killed before its next shipment carries the "moved" tombstones. N
    promotes its copy of A for A's slots (not S): right after, N's row count and every
    value are exact, and N's next shipment to its own peer B does not carry the stale
    copy of S's rows -- they used to overwrite N's current rows there, so when N died in
    turn, B served S's keys with the values they had before the move."""
    a, b, n = cluster("ps-a", "ps-b", "ps-n")
    slow = 3_600_000.0  # A ships only when its routing changes (each SetRouting wakes it)
    a.route(ALL, b, interval_ms=slow)
    b.route(NONE, a)
    n.route(NONE, None)
    _create(a, "c", 1, "zeros", {"name": "sgd", "learning_rate": 1.0})
    keys = np.arange(50_000, dtype=np.int64)
    _push(a, "c", keys, -1.0)  # every key: 1
    moving = np.zeros(NUM_SLOTS, dtype=bool)
    moving[: NUM_SLOTS // 4] = True
    in_s = moving[slot_of(keys, NUM_SLOTS)]

    # scale-out: S moves A -> N; the ring becomes a -> n -> b -> a
    req = _move_slots(a, n, b, moving, slow)
    n.route(moving, b)
    b.route(NONE, a)
    a.route(~moving, n, interval_ms=slow)  # hand-over: A's full copy to N, S's rows in it
    a.wait_shipped()
    a.stub.DropSlots(ps_pb2.DropSlotsRequest(slots=req["slots"], num_slots=NUM_SLOTS), timeout=60)
    assert a.rows("c") == int((~in_s).sum())
    _push(n, "c", keys[in_s], -1.0)  # S's keys: 2, on N
    n.wait_shipped()
    a.kill()  # before its next shipment: N's copy still holds S's rows (value 1)

    assert n.promote(a, ~moving).rows == int((~in_s).sum())
    want = np.where(in_s, 2.0, 1.0).astype(np.float32)
    assert n.rows("c") == keys.size  # at once: no wait, no row of S counted twice
    n.route(ALL, b)
    np.testing.assert_array_equal(n.lookup("c", keys, 1)[:, 0], want)
    n.wait_shipped()  # the promoted rows reach B (a delta)
    n.kill()
    assert b.promote(n, ALL).rows == keys.size
    b.route(ALL, None)
    got = b.lookup("c", keys, 1)[:, 0]
    stale = int((got[in_s] == 1).sum())
    assert stale == 0, f"{stale} rows of S came back from B's copy of N with their old values"
    np.testing.assert_array_equal(got, want)
    assert b.rows("c") == keys.size


# ------------------------------------------------------ 5. a full resync in bounded memory
def test_full_copy_streams_from_the_primary_in_bounded_memory():
    """A full copy (a new peer, or a resync) is read and sent slice by slice: the primary
    never holds a copy of its table (it used to build every message of the copy first)."""
    import threading

    from deeprec_ext.ps.replication import Replicator
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    t = store.create_table("emb", 16, initializer={"name": "normal", "stddev": 0.05},
                           optimizer="adagrad")
    keys = np.arange(1_000_000, dtype=np.int64)
    t.lookup(keys)
    received = {"rows": 0}

    class Peer:  # consumes the stream message by message, as gRPC does
        def Replicate(self, batches, **kw):
            from deeprec_ext import rowwire
            for b in batches:  # wire bytes, as the channel sends them
                received["rows"] += len(rowwire.parse(b).ids) // 8
            return ps_pb2.ReplicateResponse(rows=received["rows"])

    rep = Replicator(store, {})
    rep.close()  # no background shipping: this test ships
    rep.origin, rep.peer, rep._since, rep._stub = "ps-a", "peer", -1, Peer()
    rep._stub_peer = "peer"  # the channel already follows the configured peer

    def rss():  # protobuf messages live outside Python's allocator: measure the process
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    top, done = [rss()], threading.Event()

    def sample():
        while not done.is_set():
            top[0] = max(top[0], rss())
            time.sleep(0.002)

    base = top[0]
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        rep.ship()
    finally:
        done.set()
        sampler.join()
    peak = top[0] - base
    assert received["rows"] == keys.size
    print(f"full copy of {t.nbytes / 2**20:.0f} MB: peak extra {peak / 2**20:.1f} MB")
    assert peak < 0.10 * t.nbytes, f"{peak / 2**20:.0f} MB held for a {t.nbytes / 2**20:.0f} MB table"


# ------------------------------------------------------------- the replica set, in process
def _batch(origin, table="t", keys=(), value=0.0, **kw):
    keys = np.asarray(keys, dtype=np.int64)
    rows = np.full((keys.size, 2), value, np.float32)  # sgd, dim 1: value + count column
    return ps_pb2.RowBatch(config=ps_pb2.TableConfig(name=table, dim=1, optimizer_json='"sgd"'),
                           origin=origin, ids=codec.ids_to_bytes(keys),
                           rows=codec.floats_to_bytes(rows), **kw)


def _broken(batches):
    yield from batches
    raise grpc.RpcError("the origin died")


def test_replica_set_swaps_copies_whole_and_keeps_a_refreshed_copy_usable():
    from deeprec_ext.ps.replication import ReplicaRefused, ReplicaSet, ReplicaUnavailable
    rs = ReplicaSet()
    reset = ps_pb2.RowBatch(origin="a", reset=True)
    rs.apply([reset, _batch("a", keys=range(10), value=1.0, origin_sequence=5,
                            applied_request_ids=["r1"], end=True)], "full-new")
    # a delta from a base this copy does not have is refused (the origin sends a full copy)
    with pytest.raises(ReplicaRefused):
        rs.apply([_batch("a", keys=[1], value=9.0, origin_sequence=9, end=True)], "delta", base=7)
    # a delta that breaks off changes nothing
    with pytest.raises(grpc.RpcError):
        rs.apply(_broken([_batch("a", keys=[1], value=2.0, origin_sequence=6),
                          _batch("a", table="u", keys=[1], value=2.0, end=True)]), "delta",
                 base=5)
    # a refresh that breaks off leaves the previous copy promotable, unchanged
    with pytest.raises(grpc.RpcError):
        rs.apply(_broken([reset, _batch("a", keys=range(3), value=3.0)]), "full-refresh")
    copy = rs.take("a", wait=0)
    assert set(copy.store.tables()) == {"t"} and list(copy.applied) == ["r1"]
    np.testing.assert_array_equal(copy.store["t"].lookup(np.arange(10), False)[:, 0], 1.0)
    # taken: a later delta of that origin is refused, promoting it again finds nothing
    with pytest.raises(ReplicaRefused):
        rs.apply([_batch("a", keys=[1], value=9.0, end=True)], "delta", base=5)
    with pytest.raises(ReplicaUnavailable) as info:
        rs.take("a", wait=0)
    assert info.value.kind == "no_replica"
    # a new peer's copy that breaks off: nothing to promote, and it says why
    with pytest.raises(grpc.RpcError):
        rs.apply(_broken([reset, _batch("a", keys=range(3), value=3.0)]), "full-new")
    with pytest.raises(ReplicaUnavailable, match="broke off"):
        rs.take("a", wait=0)


def test_full_copy_that_stops_without_its_end_mark_is_not_promotable():
    """An origin killed mid-copy can look to the receiver like a stream that ended
    normally. Only the end mark makes a full copy complete: without it nothing partial
    becomes promotable, and an earlier complete copy (a refresh) stays as it was."""
    from deeprec_ext.ps.replication import ReplicaRefused, ReplicaSet, ReplicaUnavailable
    rs = ReplicaSet()
    reset = ps_pb2.RowBatch(origin="a", reset=True)
    with pytest.raises(ReplicaRefused, match="end mark after 3 rows"):
        rs.apply(iter([reset, _batch("a", keys=range(3), value=3.0, origin_sequence=4)]),
                 "full-new")
    with pytest.raises(ReplicaUnavailable, match="incomplete"):
        rs.take("a", wait=0)
    rs.apply([reset, _batch("a", keys=range(10), value=1.0, origin_sequence=5, end=True)],
             "full-new")
    with pytest.raises(ReplicaRefused):
        rs.apply(iter([reset, _batch("a", keys=range(3), value=3.0)]), "full-refresh")
    copy = rs.take("a", wait=0)
    np.testing.assert_array_equal(copy.store["t"].lookup(np.arange(10), False)[:, 0], 1.0)


def test_shipment_that_stops_without_its_end_mark_applies_nothing():
    """A delta or a sync push's rows whose stream stops early (the origin killed) may look
    ended to the peer: without the end mark none of it is applied, so the request ids on
    its first batch never mark half a push as done."""
    from deeprec_ext.ps.replication import ReplicaRefused, ReplicaSet
    rs = ReplicaSet()
    rs.apply([ps_pb2.RowBatch(origin="a", reset=True),
              _batch("a", keys=range(10), value=1.0, origin_sequence=5, end=True)], "full-new")
    for kind, base in (("delta", 5), ("rows", -1)):
        with pytest.raises(ReplicaRefused, match="end mark"):
            rs.apply(iter([_batch("a", keys=range(10), value=7.0, origin_sequence=6,
                                  applied_request_ids=["p1"])]), kind, base)
    copy = rs.take("a", wait=0)
    assert list(copy.applied) == []
    np.testing.assert_array_equal(copy.store["t"].lookup(np.arange(10), False)[:, 0], 1.0)


def test_promote_waits_for_a_delta_being_applied():
    """A delta still being received when Promote arrives is applied first, whole."""
    import threading

    from deeprec_ext.ps.replication import ReplicaSet
    rs = ReplicaSet()
    rs.apply([ps_pb2.RowBatch(origin="a", reset=True), _batch("a", keys=range(10), value=1.0,
                                                              origin_sequence=5, end=True)],
             "full-new")
    release = threading.Event()

    def slow():
        yield _batch("a", keys=range(10), value=2.0, origin_sequence=8)
        release.wait(10)
        yield _batch("a", table="u", keys=range(5), value=2.0, origin_sequence=8,
                     applied_request_ids=["r2"], end=True)

    th = threading.Thread(target=rs.apply, args=(slow(), "delta", 5))
    th.start()
    time.sleep(0.2)
    threading.Timer(0.3, release.set).start()
    copy = rs.take("a", wait=10)
    th.join()
    assert set(copy.store.tables()) == {"t", "u"} and list(copy.applied) == ["r2"]
    np.testing.assert_array_equal(copy.store["t"].lookup(np.arange(10), False)[:, 0], 2.0)


class _LocalPeer:
    """A peer's ReplicaSet behind the calls the replicator makes (in process); records the
    kind of every stream, and can fail the next ones like an unreachable peer."""

    class Unavailable(grpc.RpcError):
        def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="peer unreachable"):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    def __init__(self):
        from deeprec_ext.ps.replication import ReplicaSet
        self.replicas = ReplicaSet()
        self.kinds: list[str] = []
        self.fail = 0

    def Replicate(self, batches, timeout=None, metadata=()):
        from deeprec_ext.ps.replication import BASE_KEY, KIND_KEY, ReplicaRefused
        meta = dict(metadata)
        self.kinds.append(meta.get(KIND_KEY, ""))
        if self.fail:
            self.fail -= 1
            raise self.Unavailable()
        try:
            n = self.replicas.apply(batches, meta.get(KIND_KEY, ""), int(meta.get(BASE_KEY, "-1")))
        except ReplicaRefused as exc:
            raise self.Unavailable(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return ps_pb2.ReplicateResponse(rows=n)


def _same_rows(a, b):
    ka, ra, _ = a.export_rows(with_counts=True)
    kb, rb, _ = b.export_rows(with_counts=True)
    oa, ob = np.argsort(ka), np.argsort(kb)
    np.testing.assert_array_equal(ka[oa], kb[ob])
    np.testing.assert_array_equal(ra[oa], rb[ob])


def _table_with_local_peer(rows: int):
    """A table of ``rows`` rows and a Replicator (no background thread) shipping it to an
    in-process peer: (table, peer, replicator)."""
    from deeprec_ext.ps import replication
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    t = store.create_table("c", 4, optimizer="adagrad")
    t.lookup(np.arange(rows))
    peer = _LocalPeer()
    rep = replication.Replicator(store, {})
    rep.close()  # no background shipping: the tests ship
    rep.origin, rep.peer, rep._since, rep._stub = "ps-a", "peer", -1, peer
    rep._stub_peer = "peer"  # the channel already follows the configured peer
    return t, peer, rep


def test_failed_deltas_are_retried_from_their_base_and_big_ones_become_full_copies(monkeypatch):
    """A delta that did not arrive is sent again from the same base (no full copy after
    every hiccup); a delta larger than DELTA_MAX_ROWS goes as a streamed full copy; the
    peer's copy equals the primary's table after each."""
    t, peer, rep = _table_with_local_peer(1000)
    rep.ship()
    t.apply_gradients(np.arange(50), np.ones((50, 4), np.float32))
    peer.fail = 2
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            rep.ship()
    rep.ship()
    assert peer.kinds == ["full-new", "delta", "delta", "delta"]
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])
    from deeprec_ext.ps import replication
    monkeypatch.setattr(replication, "DELTA_MAX_ROWS", 100)
    t.apply_gradients(np.arange(500), np.ones((500, 4), np.float32))
    t.delete(np.arange(990, 1000))
    rep.ship()
    assert peer.kinds[-1] == "full-refresh"
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])
    t.apply_gradients(np.arange(10), np.ones((10, 4), np.float32))
    rep.ship()
    assert peer.kinds[-1] == "delta"
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])


def test_large_deltas_are_read_outside_the_apply_gate_and_the_copy_stays_exact(monkeypatch):
    """Rows written during a full copy (and a large delta) are read in rounds outside the
    apply gate, which stops every push, chunk by chunk: only the last, small part is read
    under it. The peer's copy still equals the primary's table, deletions included."""
    from deeprec_ext.ps import replication
    monkeypatch.setattr(replication, "GATED_MAX_ROWS", 64)
    monkeypatch.setattr(replication, "CHUNK_ROWS", 256)
    t, peer, rep = _table_with_local_peer(5000)
    gated = []  # (rows, tombstones) read under the gate, per shipment
    real = rep._delta_batches

    def delta_batches(since):
        out = real(since)
        gated.append((sum(b.ids.size for b in out),
                      sum(0 if b.deleted is None else b.deleted.size for b in out)))
        return out

    monkeypatch.setattr(rep, "_delta_batches", delta_batches)
    ungated_tombstones = []
    stream = rep._ungated_stream

    def ungated(*a, **kw):
        for b in stream(*a, **kw):
            ungated_tombstones.append(0 if b.deleted is None else b.deleted.size)
            yield b

    monkeypatch.setattr(rep, "_ungated_stream", ungated)
    first = t.export_slots  # the full scan: rows change under it too

    def scan(*a, **kw):
        t.apply_gradients(np.arange(2000, 2600), np.ones((600, 4), np.float32))
        return first(*a, **kw)

    monkeypatch.setattr(t, "export_slots", scan)
    # the ungated rounds are planned and read chunk by chunk (gather_planned), with
    # "pushes" landing between the chunks
    chunks = []
    gather = t.gather_planned
    tail_writes = iter(range(3))

    def gather_chunk(codes, *a, **kw):
        out = gather(codes, *a, **kw)
        chunks.append(out[0].size)
        if next(tail_writes, None) is not None:
            t.apply_gradients(np.arange(100, 400), np.ones((300, 4), np.float32))
            t.delete(np.arange(4000 + len(chunks), 4003 + len(chunks)))
        return out

    monkeypatch.setattr(t, "gather_planned", gather_chunk)
    rep.ship()
    monkeypatch.setattr(t, "export_slots", first)
    assert peer.kinds == ["full-new"]
    # the tail was read ungated in chunks of at most CHUNK_ROWS...
    assert len(chunks) >= 2 and sum(chunks) > 64 and max(chunks) <= 256, chunks
    assert len(gated) == 1 and gated[0][0] <= 1000, gated  # ...the gated rest is small
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])
    # a large delta, pushes landing while it is read
    chunks.clear(), gated.clear()
    tail_writes = iter(range(2))
    t.apply_gradients(np.arange(3000, 4000), np.ones((1000, 4), np.float32))
    rep.ship()
    assert peer.kinds[-1] == "delta", peer.kinds
    assert len(chunks) >= 2 and sum(chunks) >= 1000 and max(chunks) <= 256, chunks
    assert len(gated) == 1 and gated[0][0] <= 1000, gated
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])
    # a migration's clean-up: many "moved" tombstones and no changed row
    chunks.clear(), gated.clear(), ungated_tombstones.clear()
    tail_writes = iter(())
    t.delete(np.arange(0, 3000), log_tombstone=False, moved=True)
    rep.ship()
    assert peer.kinds[-1] == "delta", peer.kinds
    assert sum(ungated_tombstones) >= 3000, ungated_tombstones  # read ungated...
    assert len(gated) == 1 and gated[0][1] <= 64, gated  # ...not under the gate
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])


def test_background_full_copies_pace_between_chunks_and_stay_exact(monkeypatch):
    """A background full copy (a scale event's new ring) yields between its chunks; the
    copy is still exact. In sync mode (pushes wait for the copy) and for a direct
    shipment (a hand-off) it does not pace."""
    from deeprec_ext.ps import replication
    monkeypatch.setattr(replication, "CHUNK_ROWS", 256)
    t, peer, rep = _table_with_local_peer(3000)
    paces = []
    rep.pace_factory = lambda: (lambda: paces.append(time.monotonic()))
    rep.ship(paced=True)
    assert peer.kinds == ["full-new"] and len(paces) >= 3000 // 256 - 1, len(paces)
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])
    paces.clear()
    for kw, sync in (({"paced": True}, True), ({}, False)):
        rep._since, rep.sync = -1, sync
        t.apply_gradients(np.arange(100), np.ones((100, 4), np.float32))
        rep.ship(**kw)
        assert not paces and peer.kinds[-1].startswith("full")
        _same_rows(t, peer.replicas.copies["ps-a"].store["c"])


def test_a_full_copy_made_while_rows_are_inserted_sends_each_row_once(monkeypatch):
    """Rows inserted while a full copy scans (a migration's imports into the PS, a fill)
    come with the copy's tail only: the scan skips rows written after its start. Before,
    the scan sent them as it reached them and the tail again, so a copy made during a
    scale-in's imports sent 2.8M rows for a 2.7M-row table; the copy stays exact."""
    from deeprec_ext.ps import replication
    monkeypatch.setattr(replication, "CHUNK_ROWS", 500)
    t, peer, rep = _table_with_local_peer(5000)
    t.apply_gradients(np.arange(5000), np.ones((5000, 4), np.float32))
    first = t.export_slots
    inserted = iter(range(4))

    def scan(*a, **kw):  # 1000 new rows (and updates of old ones) land between chunks
        i = next(inserted, None)
        if i is not None:
            t.lookup(np.arange(10_000 + i * 1000, 11_000 + i * 1000))
            t.apply_gradients(np.arange(i * 10, i * 10 + 10), np.ones((10, 4), np.float32))
        return first(*a, **kw)

    monkeypatch.setattr(t, "export_slots", scan)
    sent = rep.ship()
    monkeypatch.setattr(t, "export_slots", first)
    assert peer.kinds == ["full-new"]
    assert len(t) == 9000
    # each new row once; an old row updated after the scan passed it, twice (<= 40)
    assert sent <= len(t) + 40, sent
    _same_rows(t, peer.replicas.copies["ps-a"].store["c"])


@pytest.mark.parametrize("wire", [False, True])
def test_a_copy_is_as_old_as_the_origin_cut_it_not_as_its_arrival(wire):
    """The end batch of a shipment says how long before sending it the origin cut it
    (``cut_age_ms``): the copy is dated from the cut, so the updates at risk a promotion
    reports (``replica_age_ms``) include the shipment's encoding and transfer. Dated by
    its arrival, a loaded origin's copy looked younger than it was, and
    ``test_async_replication_loss_within_reported_bound`` lost updates outside the
    reported window. Through the generated message and through ``rowwire``."""
    from deeprec_ext import rowwire
    from deeprec_ext.ps.replication import ReplicaSet

    def as_sent(b):
        return rowwire.parse(b.SerializeToString()) if wire else b

    rs = ReplicaSet()
    t0 = time.monotonic()
    rs.apply([as_sent(ps_pb2.RowBatch(origin="a", reset=True)),
              as_sent(_batch("a", keys=range(4), value=1.0, origin_sequence=3, end=True,
                             cut_age_ms=400.0))], "full-new")
    assert rs.current("a").updated <= t0 - 0.4 + 0.05
    t1 = time.monotonic()
    rs.apply([as_sent(_batch("a", keys=[1], value=2.0, origin_sequence=4, end=True,
                             cut_age_ms=250.0))], "delta", base=3)
    assert t1 - 0.25 - 0.001 <= rs.current("a").updated <= time.monotonic() - 0.25
    rs.apply([as_sent(_batch("a", keys=[2], value=2.0, origin_sequence=5, end=True))],
             "delta", base=4)  # an origin that does not say: dated by the arrival
    assert rs.current("a").updated >= t1
    # a bad peer's age (negative, NaN, absurd) is not used: dated by the arrival
    for seq, bad in enumerate((-5.0, float("nan"), 1e300), start=6):
        t2 = time.monotonic()
        rs.apply([as_sent(_batch("a", keys=[3], value=2.0, origin_sequence=seq, end=True,
                                 cut_age_ms=bad))], "delta", base=seq - 1)
        assert t2 <= rs.current("a").updated <= time.monotonic()
