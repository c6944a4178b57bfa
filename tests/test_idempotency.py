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

import numpy as np

from deeprec_ext import PSClient, codec
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, wait_for


def _send(client: PSClient, keys: np.ndarray, rid: str) -> None:
    """Push -1 to every key with request id ``rid``, one request per current owner."""
    routing = client.refresh_routing()
    for p, sel in routing.partition(keys):
        with insecure_channel(routing.ps_addresses[p]) as ch:
            ps_pb2_grpc.ParameterServerStub(ch).Push(ps_pb2.PushRequest(
                request_id=rid, epoch=routing.epoch, tables=[ps_pb2.TableUpdate(
                    table="c", ids=codec.ids_to_bytes(keys[sel]),
                    values=codec.floats_to_bytes(-np.ones((sel.size, 1), np.float32)))]),
                timeout=30)


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
            return Call

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
