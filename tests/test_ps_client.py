"""PSClient against a real PS-only job (AIMaster + 2 PS processes on loopback), and the
PS's answers to bad input: a clear status, nothing changed, still serving."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from deeprec_ext import InvalidRequestError, PSClient, UnknownTableError
from deeprec_ext.grpc_util import ROUTING_EPOCH_KEY, insecure_channel
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, Job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("psjob"), {"name": "psonly"}, ["--ps", "2", "--workers", "0"])
    yield j
    j.stop()


@pytest.fixture(scope="module")
def client(job):
    c = PSClient.connect(job.address, timeout=60)
    yield c
    c.close()


def _ps_stubs(client):
    return [ps_pb2_grpc.ParameterServerStub(insecure_channel(a)) for a in client.routing.ps_addresses]


def test_issue_surface_sgd_and_repeated_ids(client):
    client.create_table("t", dim=8, initializer="zeros",
                        optimizer={"name": "sgd", "learning_rate": 1.0})
    ids = np.array([7, 3, 7, -1, 2**62, 3, 7], dtype=np.int64)
    assert client.lookup("t", ids).shape == (7, 8)
    assert not client.lookup("t", ids).any()
    grads = np.tile(np.arange(7, dtype=np.float32)[:, None], (1, 8))
    client.push("t", ids, grads)
    after = client.lookup("t", np.array([7, 3, -1, 2**62], dtype=np.int64))
    # repeated ids summed before one SGD step: 7 -> 0+2+6, 3 -> 1+5
    np.testing.assert_allclose(after[:, 0], [-8, -6, -3, -4])
    # rows spread over both PS, each row stored exactly once
    client.lookup("t", np.arange(1000, 2000, dtype=np.int64))
    rows = {s.ps_id: sum(t.rows for t in s.tables if t.name == "t") for s in client.ps_stats()}
    assert sum(rows.values()) == 1004 and all(v > 300 for v in rows.values()), rows


def test_deterministic_initializer_same_on_any_ps_and_any_order(client, job):
    spec = {"name": "normal", "stddev": 0.01, "seed": 1}
    client.create_table("n", dim=4, initializer=spec, optimizer="adagrad")
    ids = np.arange(1000, dtype=np.int64) * 7919
    a = client.lookup("n", ids, insert_missing=False)
    b = client.lookup("n", ids[::-1])[::-1]
    np.testing.assert_array_equal(a, b)
    assert 0.008 < a.std() < 0.012
    from deeprec_ext.store import make_initializer
    np.testing.assert_array_equal(a, make_initializer(spec, 4)(ids))


def test_each_optimizer_trains(client):
    ids = np.arange(64, dtype=np.int64)
    for opt in ("sgd", "adagrad", "adam", "ftrl"):
        name = f"opt_{opt}"
        client.create_table(name, dim=2, initializer="zeros", optimizer={"name": opt, "learning_rate": 0.1})
        target = np.ones((64, 2), np.float32)
        for _ in range(30):
            v = client.lookup(name, ids)
            client.push(name, ids, v - target)  # gradient of 0.5 * |v - 1|^2
        err = np.abs(client.lookup(name, ids) - 1).mean()
        assert err < 0.9, f"{opt} did not move toward the target (err {err})"


def test_lookup_many_and_push_return_values(client):
    client.create_table("a", dim=3, optimizer={"name": "assign_add"})
    client.create_table("b", dim=5, optimizer={"name": "assign_add"})
    ids = np.arange(10, dtype=np.int64)
    out = client.push_many({"a": (ids, np.ones((10, 3), np.float32)),
                            "b": (ids, np.full((10, 5), 2, np.float32))}, return_values=True)
    np.testing.assert_allclose(out["a"], 1)
    np.testing.assert_allclose(out["b"], 2)
    got = client.lookup_many({"a": ids.reshape(2, 5), "b": ids})
    assert got["a"].shape == (2, 5, 3) and got["b"].shape == (10, 5)


def test_create_table_first_init_wins(client):
    ids = np.arange(6, dtype=np.int64)
    assert client.create_table("d", dim=2, optimizer={"name": "assign_add"}, init_ids=ids,
                               init_values=np.full((6, 2), 3, np.float32))
    assert not client.create_table("d", dim=2, optimizer={"name": "assign_add"}, init_ids=ids,
                                   init_values=np.full((6, 2), 9, np.float32))
    np.testing.assert_allclose(client.lookup("d", ids), 3)


# -- bad input -----------------------------------------------------------------------------

def _values(client, table, ids):
    return client.lookup(table, ids, insert_missing=False)


@pytest.fixture
def guarded(client):
    """A table with known values; the test's bad requests must leave it unchanged."""
    name = "guard"
    client.create_table(name, dim=4, initializer="zeros", optimizer={"name": "sgd", "learning_rate": 1.0})
    ids = np.arange(100, dtype=np.int64)
    client.push(name, ids, np.ones((100, 4), np.float32))
    before = _values(client, name, ids)
    seq_before = [s.sequence for s in client.ps_stats()]
    yield name, ids
    np.testing.assert_array_equal(_values(client, name, ids), before)
    assert [s.sequence for s in client.ps_stats()] == seq_before, "a rejected request wrote"


def test_client_rejects_bad_arguments(client, guarded):
    name, ids = guarded
    with pytest.raises(InvalidRequestError, match="integer array"):
        client.lookup(name, ids.astype(np.float64))
    with pytest.raises(InvalidRequestError, match=r"shape \(100, 3\) does not match \[100, 4\]"):
        client.push(name, ids, np.ones((100, 3), np.float32))
    with pytest.raises(InvalidRequestError, match="float32"):
        client.push(name, ids, np.ones((100, 4), np.int32))
    bad = np.ones((100, 4), np.float32)
    bad[5, 2] = np.nan
    with pytest.raises(InvalidRequestError, match="NaN or Inf"):
        client.push(name, ids, bad)
    with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
        client.lookup("nope", ids)
    with pytest.raises(InvalidRequestError, match="already exists with dim=4"):
        client.create_table(name, dim=8, initializer="zeros", optimizer={"name": "sgd", "learning_rate": 1.0})
    with pytest.raises(InvalidRequestError, match="optimizer"):
        client.create_table("x1", dim=4, optimizer={"name": "rmsprop"})
    with pytest.raises(InvalidRequestError, match="learning_rate"):
        client.create_table("x2", dim=4, optimizer={"name": "sgd", "learning_rate": -1})
    with pytest.raises(InvalidRequestError, match="stddev"):
        client.create_table("x3", dim=4, initializer={"name": "normal", "stddev": -2})
    with pytest.raises(InvalidRequestError, match="dim must be a positive int"):
        client.create_table("x4", dim=0)


def _raw_push(stub, table, ids_bytes, values_bytes):
    return stub.Push(ps_pb2.PushRequest(tables=[ps_pb2.TableUpdate(
        table=table, ids=ids_bytes, values=values_bytes)]), timeout=10)


def test_ps_rejects_malformed_wire_requests(client, guarded):
    """Requests a non-Python or buggy client could send, straight to the PS."""
    name, ids = guarded
    stub = _ps_stubs(client)[0]
    mine = ids[client.routing.owners(ids) == 0]
    cases = [
        (lambda: _raw_push(stub, name, b"\x01\x02\x03", b""), grpc.StatusCode.INVALID_ARGUMENT,
         "not a whole number of int64"),
        (lambda: _raw_push(stub, name, mine.tobytes(), b"\x00" * 12), grpc.StatusCode.INVALID_ARGUMENT,
         "expected"),
        (lambda: _raw_push(stub, name, mine.tobytes(),
                           np.full((mine.size, 4), np.inf, np.float32).tobytes()),
         grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        (lambda: _raw_push(stub, "missing", mine.tobytes(), b""), grpc.StatusCode.NOT_FOUND,
         "unknown table 'missing'"),
        (lambda: stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="j", dim=2, optimizer_json="{not json"))), grpc.StatusCode.INVALID_ARGUMENT,
         "malformed JSON"),
        (lambda: stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table=name, ids=b"1234567")])),
         grpc.StatusCode.INVALID_ARGUMENT, "int64"),
    ]
    for call, code, needle in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
        assert needle in info.value.details()


def test_multi_table_push_is_all_or_nothing(client, guarded):
    name, ids = guarded
    stub = _ps_stubs(client)[0]
    mine = ids[client.routing.owners(ids) == 0]
    good = ps_pb2.TableUpdate(table=name, ids=mine.tobytes(),
                              values=np.ones((mine.size, 4), np.float32).tobytes())
    bad = ps_pb2.TableUpdate(table=name, ids=mine.tobytes(), values=b"short")
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(ps_pb2.PushRequest(tables=[good, bad]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stale_routing_status_carries_epoch(client, guarded):
    name, ids = guarded
    stub = _ps_stubs(client)[0]
    theirs = ids[client.routing.owners(ids) == 1][:3]
    with pytest.raises(grpc.RpcError) as info:
        stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table=name, ids=theirs.tobytes())]),
                    timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale routing" in info.value.details()
    meta = dict(info.value.trailing_metadata())
    assert int(meta[ROUTING_EPOCH_KEY]) == client.routing.epoch


def test_oversized_request_rejected_and_ps_keeps_serving(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--max-message-mb", "1",
                             "--port-file", str(port_file)], cwd=ROOT)
    try:
        from tests.conftest import wait_for
        port = wait_for(lambda: port_file.exists() and port_file.read_text(), 30, "PS port")
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="t", dim=8, optimizer_json=json.dumps("sgd"))), timeout=10)
        big = np.arange(300_000, dtype=np.int64)  # 2.4 MB of ids
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table="t", ids=big.tobytes())]),
                        timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        small = stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(
            table="t", ids=big[:10].tobytes())], insert_missing=False), timeout=10)
        assert len(small.values[0]) == 10 * 8 * 4
        assert stub.Stats(ps_pb2.StatsRequest(), timeout=10).tables[0].rows == 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_json_schema(job, client):
    st = job.status()
    assert isinstance(st["epoch"], int) and st["epoch"] >= 1
    assert st["shards"] == {"todo": 0, "doing": 0, "done": 0, "bad_shards": 0, "bad_records": 0,
                            "bad_input": []}
    ps = [m for m in st["members"] if m["role"] == "ps"]
    assert len(ps) == 2
    for m in ps:
        assert set(m) >= {"role", "id", "pid", "address", "state"}
        assert m["state"] == "running" and m["pid"] > 0 and m["address"].startswith("127.0.0.1:")


def test_push_routing_check_skipped_only_while_every_slot_is_owned():
    """A PS that owns every slot accepts pushes without hashing each key's slot; once the
    routing hands some slots away, a push naming a key it lost is refused with stale
    routing and changes nothing, and owning all again accepts it (real gRPC server)."""
    from deeprec_ext.grpc_util import create_server
    from deeprec_ext.ps.server import ParameterServerServicer
    svc = ParameterServerServicer("ps-r")
    server, port = create_server("127.0.0.1:0", max_workers=4)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(svc, server)
    server.start()
    try:
        stub = ps_pb2_grpc.ParameterServerStub(insecure_channel(f"127.0.0.1:{port}"))
        stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="t", dim=2, optimizer_json=json.dumps({"name": "sgd", "learning_rate": 1.0}))),
            timeout=10)
        ids = np.arange(64, dtype=np.int64)
        lost = ids[slot_of(ids, 16) == 3]
        assert lost.size

        def route(epoch, mask):
            stub.SetRouting(ps_pb2.SetRoutingRequest(epoch=epoch, num_slots=16,
                                                     owned_slots=mask.astype(np.uint8).tobytes()),
                            timeout=10)

        def push(keys):
            return stub.Push(ps_pb2.PushRequest(tables=[ps_pb2.TableUpdate(
                table="t", ids=keys.tobytes(), values=np.full((keys.size, 2), -1.0, np.float32)
                .tobytes())], return_values=True), timeout=10)

        def value(keys):
            got = stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(
                table="t", ids=keys.tobytes())], insert_missing=False), timeout=10)
            return np.frombuffer(got.values[0], np.float32).reshape(-1, 2)

        route(1, np.ones(16, bool))
        got = push(ids)
        np.testing.assert_array_equal(np.frombuffer(got.values[0], np.float32), 1.0)
        partial = np.ones(16, bool)
        partial[3] = False
        route(2, partial)
        with pytest.raises(grpc.RpcError) as info:
            push(ids)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stale routing" in info.value.details()
        kept = ids[slot_of(ids, 16) != 3]
        np.testing.assert_array_equal(value(kept), 1.0)  # the refused push applied nothing
        push(kept)
        np.testing.assert_array_equal(value(kept), 2.0)
        route(3, np.ones(16, bool))
        push(ids)
        np.testing.assert_array_equal(value(lost), 2.0)
        np.testing.assert_array_equal(value(kept), 3.0)
    finally:
        server.stop(0)
        svc.close()
