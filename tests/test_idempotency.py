"""A push resent after a failure is applied once, wherever its rows went in between: to
a new owner by a live migration, or to the ring peer promoted after a kill -9. Real PS
processes; the resend is the request a client sends again with the id of its first
attempt (what ``PSClient`` does when a part fails), split over the new layout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np

from deeprec_ext import PSClient, codec
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, wait_for


def _send(client: PSClient, keys: np.ndarray, rid: str) -> None:
    """Push -1 to every key with request id ``rid``, one request per current owner. A PS
    that has not learnt the newest routing yet answers "stale routing": the whole push is
    sent again with the same id (what a client does; parts already applied are skipped)."""
    for attempt in range(50):
        routing = client.refresh_routing()
        try:
            for p, sel in routing.partition(keys):
                with insecure_channel(routing.ps_addresses[p]) as ch:
                    ps_pb2_grpc.ParameterServerStub(ch).Push(ps_pb2.PushRequest(
                        request_id=rid, epoch=routing.epoch, tables=[ps_pb2.TableUpdate(
                            table="c", ids=codec.ids_to_bytes(keys[sel]),
                            values=codec.floats_to_bytes(-np.ones((sel.size, 1), np.float32)))]),
                        timeout=30)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or attempt == 49:
                raise
            time.sleep(0.2)


def _status(job):
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "status", "--master", job.address,
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return json.loads(r.stdout)


def test_resent_push_applies_once_across_migration_and_promotion(start_job):
    job = start_job({"name": "idem", "ps": {"replicas": 2, "max_replicas": 3},
                     "replication": {"mode": "sync"}, "master": {"heartbeat_seconds": 0.5}},
                    ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    client.create_table("c", 1, initializer="zeros",
                        optimizer={"name": "sgd", "learning_rate": 1.0})
    routing = client.refresh_routing()
    keys = np.arange(20_000, dtype=np.int64)
    keys = keys[routing.slot_owner[slot_of(keys, routing.num_slots)] == 0]  # all on ps-0
    _send(client, keys, "resend-me")
    np.testing.assert_array_equal(client.lookup("c", keys, insert_missing=False)[:, 0], 1)

    # a live scale-out moves some of these keys to ps-2: the resend reaches a new owner
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", job.address,
                        "--ps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    routing = client.refresh_routing()
    owners = set(routing.slot_owner[slot_of(keys, routing.num_slots)].tolist())
    assert len(owners) > 1, "the scale-out moved none of the keys"
    _send(client, keys, "resend-me")
    got = client.lookup("c", keys, insert_missing=False)[:, 0]
    assert (got == 1).all(), f"{int((got != 1).sum())} of {keys.size} keys applied twice"

    # kill -9 an owner: its peer's promoted copy knows the push too
    victim = routing.ps_ids[int(routing.slot_owner[slot_of(keys[:1], routing.num_slots)][0])]
    pid = next(m["pid"] for m in _status(job)["members"] if m["id"] == victim)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(e["kind"] == "recovery" for e in _status(job)["events"]), 60,
             "the recovery")
    _send(client, keys, "resend-me")
    got = client.lookup("c", keys, insert_missing=False)[:, 0]
    assert (got == 1).all(), f"{int((got != 1).sum())} of {keys.size} keys applied twice"
    # a new push (another id) is applied as usual
    _send(client, keys, "fresh")
    np.testing.assert_array_equal(client.lookup("c", keys, insert_missing=False)[:, 0], 2)
    client.close()


class _Unavailable(Exception):
    """A gRPC error as a channel raises it (UNAVAILABLE: the PS died mid-call)."""

    def code(self):
        import grpc
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"

    def trailing_metadata(self):
        return ()


def test_client_resends_a_failed_part_under_its_first_id_even_when_split(monkeypatch):
    """The client's side of the same guarantee: a part that failed keeps its request id
    when the new layout splits it over two PS, and is never merged into another part's
    request (its id would then hide, or be hidden by, the other's)."""
    import grpc

    from deeprec_ext.client.routing import RoutingTable
    from deeprec_ext.grpc_util import RetryPolicy
    num_slots = 8
    layouts = [RoutingTable(1, num_slots, ("a", "b"), ("A", "B"),
                            np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)),
               RoutingTable(2, num_slots, ("b", "c"), ("B", "C"),
                            np.array([0, 1, 0, 1, 0, 0, 0, 0], np.int32))]
    sent: list[tuple[str, str, np.ndarray]] = []

    class Future:
        def __init__(self, address, req):
            self.address, self.req = address, req

        def result(self):
            if self.address == "A":  # the first owner dies: this part is retried
                raise _Unavailable()
            return ps_pb2.PushResponse()

        def exception(self):
            return _Unavailable() if self.address == "A" else None

        def add_done_callback(self, fn):  # done at once, as a refused call is
            fn(self)

    class Stub:
        def __init__(self, address):
            self.address = address

        @property
        def Push(self):
            stub = self

            class Call:
                @staticmethod
                def future(req, timeout=None):
                    sent.append((stub.address, req.request_id,
                                 codec.ids_from_bytes(req.tables[0].ids)))
                    return Future(stub.address, req)

                def __call__(self, req, timeout=None):  # the client's blocking call
                    return self.future(req, timeout).result()
            return Call()

    client = PSClient("127.0.0.1:1", retry=RetryPolicy(deadline=5))
    monkeypatch.setattr(grpc, "RpcError", _Unavailable)
    client.routing = layouts[0]
    client._dims["c"] = 1
    monkeypatch.setattr(client, "_stub", lambda address: Stub(address))
    monkeypatch.setattr(client, "refresh_routing", lambda *a, **k: setattr(
        client, "routing", layouts[1]) or layouts[1])
    keys = np.arange(64, dtype=np.int64)
    client.push("c", keys, np.ones((64, 1), np.float32))
    first = {addr: rid for addr, rid, _ in sent[:2]}
    assert set(first) == {"A", "B"} and first["A"] != first["B"]
    resent = sent[2:]
    assert {addr for addr, _, _ in resent} == {"B", "C"}  # A's part, split over B and C
    assert all(rid == first["A"] for _, rid, _ in resent)
    a_part = np.sort(sent[0][2])
    np.testing.assert_array_equal(np.sort(np.concatenate([ids for _, _, ids in resent])), a_part)
    client.close()


def test_update_counts_follow_rows_through_migration_promotion_and_checkpoint(start_job):
    """Each row's update count (what export min_count reads) moves with the row: a live
    scale-out, a kill -9 (the peer's replica promoted), then a checkpoint; every key
    pushed 4 times shows 4, once each time a push included it."""
    import checkpoint
    job = start_job({"name": "counts", "ps": {"replicas": 2, "max_replicas": 3},
                     "replication": {"mode": "sync"}, "master": {"heartbeat_seconds": 0.5}},
                    ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    client.create_table("c", 2, initializer="zeros", optimizer="sgd")
    keys = np.arange(30_000, dtype=np.int64) * 7
    for _ in range(3):
        client.push("c", keys, np.ones((keys.size, 2), np.float32))
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", job.address,
                        "--ps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    client.push("c", keys, np.ones((keys.size, 2), np.float32))
    pid = next(m["pid"] for m in _status(job)["members"] if m["id"] == "ps-1")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(e["kind"] == "recovery" for e in _status(job)["events"]), 60,
             "the recovery")
    client.lookup("c", keys[:10])  # serving again
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "checkpoint", "--master",
                        job.address, "--full"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    t = checkpoint.load(json.loads(r.stdout)["path"]).tables["c"]
    np.testing.assert_array_equal(t.ids, np.sort(keys))
    np.testing.assert_array_equal(t.counts, 4)
    client.close()


# ----------------------------------------------- request ids when replication of a push fails
class _BreakAfter:
    """The replicator's stub, with shipments whose stream breaks after ``n`` more RowBatch
    messages (what a PS dying, or its connection dropping, in the middle of a shipment
    does to the peer)."""

    def __init__(self, stub, n: int):
        self._stub, self.left = stub, n

    def __getattr__(self, name):
        return getattr(self._stub, name)

    @property
    def Replicate(self):
        def call(batches, **kw):
            def stream():
                for b in batches:
                    if self.left <= 0:
                        raise ConnectionError("connection lost in the middle of a shipment")
                    self.left -= 1
                    yield b
            return self._stub.Replicate(stream(), **kw)
        return call


def _serve(name: str):
    from deeprec_ext.grpc_util import create_server
    from deeprec_ext.ps.server import ParameterServerServicer
    svc = ParameterServerServicer(name)
    server, port = create_server("127.0.0.1:0", max_workers=8)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(svc, server)
    server.start()
    address = f"127.0.0.1:{port}"
    return svc, server, ps_pb2_grpc.ParameterServerStub(insecure_channel(address)), address


def _sync_pair():
    """Origin A (sync replication to B, no background shipping) and its peer B, in this
    process on real gRPC servers; two tables, each a counter (SGD, lr 1, gradient -1)."""
    a, a_server, a_stub, _ = _serve("ps-a")
    b, b_server, b_stub, b_addr = _serve("ps-b")
    mask = np.ones(16, np.uint8).tobytes()
    a_stub.SetRouting(ps_pb2.SetRoutingRequest(
        epoch=1, owned_slots=mask, num_slots=16, replica_peer=b_addr, ps_id="ps-a",
        replication_interval_ms=3_600_000.0, sync_replication=True), timeout=30)
    b_stub.SetRouting(ps_pb2.SetRoutingRequest(
        epoch=1, owned_slots=np.zeros(16, np.uint8).tobytes(), num_slots=16, ps_id="ps-b"),
        timeout=30)
    for t in ("t1", "t2"):
        a_stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name=t, dim=1, initializer_json='"zeros"',
            optimizer_json='{"name": "sgd", "learning_rate": 1.0}')), timeout=30)
    return (a, a_server, a_stub), (b, b_server, b_stub)


def _push_both(stub, keys, rid):
    grads = codec.floats_to_bytes(-np.ones((keys.size, 1), np.float32))
    return stub.Push(ps_pb2.PushRequest(request_id=rid, tables=[
        ps_pb2.TableUpdate(table=t, ids=codec.ids_to_bytes(keys), values=grads)
        for t in ("t1", "t2")]), timeout=30)


def _fail_over(a, a_server, b_stub, slots: int = 16):
    """A dies: its peer B promotes A's rows and owns every slot."""
    a.replicator.close()
    a_server.stop(0)
    b_stub.Promote(ps_pb2.PromoteRequest(origin="ps-a", slots=np.ones(slots, np.uint8).tobytes(),
                                         num_slots=slots), timeout=60)
    b_stub.SetRouting(ps_pb2.SetRoutingRequest(epoch=2, owned_slots=np.ones(slots, np.uint8).tobytes(),
                                               num_slots=slots, ps_id="ps-b"), timeout=30)


def _values(stub, keys):
    r = stub.Lookup(ps_pb2.LookupRequest(tables=[
        ps_pb2.TableIds(table=t, ids=codec.ids_to_bytes(keys)) for t in ("t1", "t2")],
        insert_missing=False), timeout=30)
    return [np.frombuffer(v, np.float32) for v in r.values]


def test_sync_push_whose_replication_broke_midway_applies_once_after_failover():
    """A push of two tables; the shipment to the peer breaks after the first table's rows.
    The client gets UNAVAILABLE, A dies, and the client resends the push to B. B must not
    hold one table's update without the push's id (it would apply that table twice)."""
    import grpc
    import pytest
    (a, a_server, a_stub), (b, b_server, b_stub) = _sync_pair()
    try:
        keys = np.arange(1000, dtype=np.int64)
        _push_both(a_stub, np.array([10**9]), "warm-up")  # the peer has its full copy
        a.replicator._stub = _BreakAfter(a.replicator._stub, 1)
        with pytest.raises(grpc.RpcError) as info:
            _push_both(a_stub, keys, "p1")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        _fail_over(a, a_server, b_stub)
        _push_both(b_stub, keys, "p1")  # the client's resend after the failover
        t1, t2 = _values(b_stub, keys)
        assert (t1 == 1).all() and (t2 == 1).all(), \
            f"t1 applied {np.unique(t1)} times, t2 {np.unique(t2)} times"
    finally:
        a.replicator.close()
        b.replicator.close()
        a_server.stop(0)
        b_server.stop(0)
        a.close()
        b.close()


def test_sync_resend_to_the_same_ps_is_acknowledged_only_once_the_peer_has_it():
    """The shipment of a sync push fails (UNAVAILABLE); the client resends it to the same
    PS, which knows the id. Acknowledging it there must still mean "the peer holds it": the
    resend ships the rows and the id, so after A dies B has the push, once."""
    (a, a_server, a_stub), (b, b_server, b_stub) = _sync_pair()
    try:
        import grpc
        import pytest
        keys = np.arange(1000, dtype=np.int64)
        _push_both(a_stub, np.array([10**9]), "warm-up")
        real = a.replicator._stub
        a.replicator._stub = _BreakAfter(real, 0)
        with pytest.raises(grpc.RpcError) as info:
            _push_both(a_stub, keys, "p1")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        a.replicator._stub = real  # the peer is reachable again
        _push_both(a_stub, keys, "p1")  # resend: acknowledged, not applied again
        t1, t2 = _values(a_stub, keys)
        assert (t1 == 1).all() and (t2 == 1).all()
        _fail_over(a, a_server, b_stub)
        t1, t2 = _values(b_stub, keys)
        assert (t1 == 1).all() and (t2 == 1).all(), "an acknowledged sync push is not on the peer"
        _push_both(b_stub, keys, "p1")  # and a further resend is still recognised
        t1, t2 = _values(b_stub, keys)
        assert (t1 == 1).all() and (t2 == 1).all()
    finally:
        a.replicator.close()
        b.replicator.close()
        a_server.stop(0)
        b_server.stop(0)
        a.close()
        b.close()
