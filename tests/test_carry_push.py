"""Carry mode (``ElasticCallback(overlap="carry")``): a step's push rides in the next step's
lookup call, which the PS applies before it reads. Counted against real PS processes:
every update applied exactly once, read fresh by the next step, never lost when no next
lookup comes (a PS the next step does not look up from, a flush, the end of training),
and a bad carried push refused whole with a clear error while the PS keeps serving."""
from __future__ import annotations

import os
import signal

import grpc
import numpy as np
import pytest

from deeprec_ext import codec
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from deeprec_ext.worker import WorkerContext
from tests.conftest import ROOT, wait_for
from tests.test_elasticity import _records, pids


def _counter(ctx, name="t"):
    ctx.client.create_table(name, dim=2, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})


def _step(ctx, ids, expected, table="t"):
    """One training step: look ``ids`` up, check they read every earlier update, push +1
    (+2 in the second column) to each."""
    got = ctx.lookup(table, ids)
    want = np.array([expected.get(int(i), 0.0) for i in ids], np.float32)
    np.testing.assert_array_equal(got[:, 0], want)
    np.testing.assert_array_equal(got[:, 1], 2 * want)
    ctx.push_async(table, ids, np.tile(np.array([[-1.0, -2.0]], np.float32), (ids.size, 1)))
    for i in ids:
        expected[int(i)] = expected.get(int(i), 0.0) + 1.0


def _final(ctx, expected, table="t"):
    ids = np.array(sorted(expected), np.int64)
    got = ctx.client.lookup(table, ids, insert_missing=False)
    np.testing.assert_array_equal(got[:, 0], [expected[int(i)] for i in ids])
    np.testing.assert_array_equal(got[:, 1], [2 * expected[int(i)] for i in ids])


def test_carried_pushes_counted_exactly_on_two_ps(start_job):
    """2 PS: each step's push travels in the next step's lookup, one call per PS per step;
    steps that look up only a few ids (their push's other PS gets the push alone), a
    step without lookups (its held push leaves at the step end) and an early stop
    (``settle``) all leave every update applied once."""
    job = start_job({"name": "carry-2ps"}, ["--ps", "2", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    try:
        _counter(ctx)
        ctx.batcher.carry = True
        rng = np.random.default_rng(0)
        expected: dict[int, float] = {}
        rpcs = []
        for step in range(8):
            before = ctx.client.stats["rpcs"]
            if step in (3, 4):  # a handful of ids: some PS gets only the carried push
                ids = np.unique(rng.integers(0, 3000, 3)).astype(np.int64)
            else:
                ids = np.unique(rng.integers(0, 3000, 800)).astype(np.int64)
            _step(ctx, ids, expected)
            ctx.step_done()
            rpcs.append(ctx.client.stats["rpcs"] - before)
        assert rpcs[0] == 2 and all(r == 2 for r in rpcs[1:])  # one call per PS, steps end free
        assert ctx.batcher.stats["carried"] == 7
        # a step that looks nothing up: the held push leaves at the next step end
        ctx.step_done()
        _final(ctx, expected)
        assert ctx.batcher._carry is None
        # stopped early: the last step's push is held, settle sends it
        ids = np.unique(rng.integers(0, 3000, 500)).astype(np.int64)
        _step(ctx, ids, expected)
        ctx.step_done()
        assert ctx.batcher._carry is not None
        ctx.settle()
        assert ctx.batcher._carry is None
        _final(ctx, expected)
        # flush_pushes (evaluation, a checkpoint barrier) sends it too
        _step(ctx, ids, expected)
        ctx.step_done()
        ctx.flush_pushes()
        _final(ctx, expected)
    finally:
        ctx.close()


def test_bad_carried_push_refused_whole_and_ps_serves_on(start_job):
    """A carried push with NaN gradients, an id not owned... is answered INVALID_ARGUMENT
    naming the table; a bad lookup part (unknown table) refuses the push with it: nothing
    is applied, no row is created, and the next good call is answered."""
    job = start_job({"name": "carry-bad"}, ["--ps", "1", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    try:
        _counter(ctx)
        address = ctx.client.routing.ps_addresses[0]
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))
        ids = np.arange(10, dtype=np.int64)
        good = np.ones((10, 2), np.float32)

        def call(push_vals, lookup_table="t", lookup_ids=np.arange(100, 110, dtype=np.int64)):
            req = ps_pb2.LookupRequest(
                insert_missing=True,
                tables=[ps_pb2.TableIds(table=lookup_table, ids=codec.ids_to_bytes(lookup_ids))])
            req.push.CopyFrom(ps_pb2.PushRequest(request_id="bad-1", tables=[ps_pb2.TableUpdate(
                table="t", ids=codec.ids_to_bytes(ids), values=codec.floats_to_bytes(push_vals))]))
            return stub.Lookup(req, timeout=10)

        bad = good.copy()
        bad[3, 1] = np.nan
        with pytest.raises(grpc.RpcError) as err:
            call(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table 't'" in err.value.details() and "NaN" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            call(good[:, :1])  # values of the wrong width
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table 't'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            call(good, lookup_table="nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
        # nothing applied, no row created by the refused lookups
        stats = ctx.client.ps_stats()[0]
        assert {t.name: t.rows for t in stats.tables}["t"] == 0
        # the client's own check names the table before anything is sent
        from deeprec_ext.errors import InvalidRequestError
        with pytest.raises(InvalidRequestError, match="push 't' gradients: contains NaN"):
            ctx.client.lookup_with_push({"t": ids}, {"t": (ids, bad)})
        # the PS serves on: a good carried push applies once, then the lookup reads it
        resp = call(good, lookup_ids=ids)
        got = codec.floats_from_bytes(resp.values[0], 10, 2, "t")
        np.testing.assert_array_equal(got, -good)
        resp = call(good, lookup_ids=ids)  # the same request id again: not applied twice
        np.testing.assert_array_equal(codec.floats_from_bytes(resp.values[0], 10, 2, "t"), -good)
    finally:
        ctx.close()


def test_carried_pushes_survive_a_ps_kill9_every_record_once(start_job, tmp_path):
    """Counting workers in carry mode, 3 PS with sync replication; kill -9 a PS mid-stream:
    its peer takes over, carried pushes resent after the failover are applied once (their
    request ids), and every record ends trained exactly once."""
    paths, total = _records(tmp_path, files=3, per_file=8_000)
    release = str(paths[0]) + ".release"
    job = start_job({
        "name": "carry-kill",
        "ps": {"replicas": 3, "max_replicas": 4},
        "replication": {"mode": "sync"},
        "worker": {"replicas": 2,
                   "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                   "env": {"COUNTING_DELAY": "0.03", "PYTHONPATH": str(ROOT),
                           "COUNTING_CARRY": "1", "COUNTING_HOLD_FILE": release}},
        "data": {"files": paths, "records_per_shard": 1000},
        "master": {"heartbeat_seconds": 0.5},
    })
    wait_for(lambda: job.status()["shards"]["done"] >= 3, 120, "training to start")
    assert job.status()["shards"]["todo"] > 0, "the data ran out before the kill"
    os.kill(pids(job, "ps")["ps-1"], signal.SIGKILL)
    rec = wait_for(lambda: [e for e in job.status()["events"] if e["kind"] == "recovery"],
                   60, "recovery")[0]
    assert rec["dead"] == "ps-1" and rec["promoted_rows"] > 0
    wait_for(lambda: any(e["kind"] == "scale" and e["ps"] == [2, 3]
                         for e in job.status()["events"]), 120, "the replacement PS to join")
    wait_for(lambda: (lambda s: s["todo"] == 0 and s["doing"] == 0)(job.status()["shards"]),
             300, "every shard DONE")
    from deeprec_ext import PSClient
    client = PSClient.connect(job.address, timeout=60)
    got = client.lookup("records", np.arange(total, dtype=np.int64), insert_missing=False)[:, 0]
    client.close()
    open(release, "w").close()
    assert job.wait(120) == 0, job.output()[-3000:]
    counts = np.bincount(np.clip(got.astype(np.int64), 0, 3), minlength=4)
    assert counts[1] == total, f"records trained 0/1/2/3+ times: {counts.tolist()}"


def test_a_ps_that_ignores_the_carried_push_is_an_error_not_a_loss(start_job):
    """A PS without carried pushes (an older build) answers the lookup and drops the
    unknown field; the client must fail loudly instead of losing the push."""
    from concurrent import futures
    from deeprec_ext.errors import InvalidRequestError
    from deeprec_ext.ps.server import ParameterServerServicer

    class OldPS(ParameterServerServicer):
        def Lookup(self, request, context):  # an older PS: never looks at request.push
            resp = super().Lookup(ps_pb2.LookupRequest(
                epoch=request.epoch, tables=request.tables,
                insert_missing=request.insert_missing), context)
            return ps_pb2.LookupResponse(values=resp.values)

    job = start_job({"name": "carry-old-ps"}, ["--ps", "1", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    svc = None
    try:
        _counter(ctx)
        svc = OldPS("ps-old")
        svc.routing.set(ctx.client.routing.epoch, ctx.client.routing.num_slots,
                        np.ones(ctx.client.routing.num_slots, bool))
        ps_pb2_grpc.add_ParameterServerServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        svc.CreateTable(ps_pb2.CreateTableRequest(config=ctx.client._stub(
            ctx.client.routing.ps_addresses[0]).ListTables(
                ps_pb2.ListTablesRequest(), timeout=10).tables[0]), None)
        from dataclasses import replace
        ctx.client.routing = replace(ctx.client.routing, ps_addresses=(f"127.0.0.1:{port}",))
        ids = np.arange(5, dtype=np.int64)
        with pytest.raises(InvalidRequestError, match="did not apply the carried push"):
            ctx.client.lookup_with_push({"t": ids}, {"t": (ids, np.ones((5, 2), np.float32))})
    finally:
        server.stop(0)
        if svc is not None:
            svc.close()
        ctx.close()
