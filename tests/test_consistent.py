"""Accuracy-consistent (sync) mode: the same model bit for bit whatever the number of
physical workers, across live worker and PS scale events (issue 8).

Each run trains DeepFM (examples/criteo) for 200 global steps with V = 4 virtual workers
of 32 records, from a real AIMaster job (real PS processes, real TensorFlow workers), and
takes a full checkpoint of the final model; the checkpoints are restored and compared
row by row on their raw bytes. Long: about 3-5 minutes on a quiet 2-core machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from tests.conftest import ROOT, wait_for

V, MICRO, STEPS = 4, 32, 200
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def sync_data(tmp_path_factory):
    from examples.criteo.generate import generate
    out = tmp_path_factory.mktemp("criteo-sync")
    # about 200 steps: 4 ranks x 10 shards x ~640 records = 4 x 200 x 32 (shards are byte
    # ranges of ~640 records: a rank may hold a few records less, and the run stops at
    # the step where the first rank runs out)
    return generate(str(out), rows=V * MICRO * STEPS, files=2, seed=11)


def _job(data, workers=1, ps=1, throttle_ms=0, extra=(), max_restarts=0):
    return {"name": "sync", "num_slots": 256,
            "ps": {"replicas": ps, "max_replicas": 4},
            "worker": {"replicas": workers, "max_replicas": 4, "max_restarts": max_restarts,
                       "command": ["{python}", "-m", "examples.criteo.train_sync",
                                   "--micro-batch", str(MICRO), "--feature-dropout", "0.1",
                                   "--throttle-ms", str(throttle_ms),
                                   *extra]},
            "data": {"files": data["train"], "records_per_shard": 640},
            "consistency": {"mode": "sync", "virtual_workers": V, "seed": 5},
            "master": {"heartbeat_seconds": 0.5, "lease_seconds": 5}}


def scale(job, *args):
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", job.address,
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr + job.output()[-3000:]
    return json.loads(r.stdout)


def sync_status(job) -> dict:
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    with insecure_channel(job.address) as ch:
        resp = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(), timeout=10)
    return json.loads(resp.sync_json) if resp.sync_json else {}


def final_model(job) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table of the final checkpoint: (keys, rows value+slots) sorted by key."""
    from checkpoint import restore
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    restore(str(job.state_dir / "checkpoints"), store)
    out = {}
    for name, table in store.tables().items():
        keys, rows, _ = table.export_rows()
        order = np.argsort(keys)
        out[name] = (keys[order], rows[order])
    return out


def run(start_job, data, subdir, workers=1, ps=1, throttle_ms=0, during=None, max_restarts=0):
    job = start_job(_job(data, workers, ps, throttle_ms, max_restarts=max_restarts), subdir=subdir)
    if during is not None:
        during(job)
    assert job.wait(900) == 0, job.output()[-4000:]
    state = job.state()
    events = state["events"]
    fin = [e for e in events if e["kind"] == "sync_finished"]
    assert fin and STEPS - 5 <= fin[0]["steps"] <= STEPS, events[-10:]
    # every record is either trained or reported untrained (the ranks' leftovers)
    assert fin[0]["steps"] * V * MICRO + fin[0]["untrained_records"] == V * MICRO * STEPS, fin
    # the AIMaster's final checkpoint holds the model (no call in the training script)
    assert any(e["kind"] == "checkpoint" and e["final"] for e in events)
    return final_model(job), events


def assert_same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: tables differ: {sorted(a)} vs {sorted(b)}"
    for name in a:
        ka, ra = a[name]
        kb, rb = b[name]
        assert ka.tobytes() == kb.tobytes(), f"{what}: table {name} has different keys"
        assert ra.shape == rb.shape and ra.tobytes() == rb.tobytes(), \
            f"{what}: table {name} differs in {int((ra != rb).any(axis=1).sum())} rows"


def test_same_bits_on_1_2_and_elastic_workers(start_job, sync_data):
    one, _ = run(start_job, sync_data, "w1", workers=1)
    assert {"embedding", "linear"} <= set(one) and any(n.startswith("dense/") for n in one)
    assert one["embedding"][0].size > 1000
    # the comparison sees a single flipped bit
    keys, rows = one["embedding"]
    flipped = rows.copy()
    flipped.view(np.uint32)[7, 3] ^= 1
    with pytest.raises(AssertionError, match="differs in 1 rows"):
        assert_same(one, {**one, "embedding": (keys, flipped)}, "control")

    # 2 workers, with a live PS scale-out 1 -> 2 half-way (held at a step boundary)
    def ps_scale(job):
        wait_for(lambda: sync_status(job).get("step", 0) >= 60, 300, "step 60")
        ev = scale(job, "--ps", "2")
        assert ev["ps"] == [1, 2] and ev["moved_rows"] > 0
        assert sync_status(job)["step"] < STEPS, "the PS change did not land mid-run"

    two, events = run(start_job, sync_data, "w2", workers=2, throttle_ms=20, during=ps_scale)
    assert any(e["kind"] == "routing" and len(e["ps"]) == 2 for e in events)
    assert [e["kind"] for e in events].count("sync_hold") == 1
    assert_same(one, two, "2 workers + PS scale-out vs 1 worker")

    # 1 -> 4 -> 2 workers while training
    def elastic(job):
        wait_for(lambda: sync_status(job).get("step", 0) >= 20, 300, "step 20")
        assert scale(job, "--workers", "4")["workers"][1] == 4
        wait_for(lambda: len(set(sync_status(job)["hosts"].values())) == 4, 300, "4 hosts")
        at_four = sync_status(job)["step"]
        wait_for(lambda: sync_status(job)["step"] >= at_four + 10, 300, "10 steps on 4 workers")
        scale(job, "--workers", "2")
        assert sync_status(job)["step"] < STEPS, "the scale-in did not land mid-run"

    three, events = run(start_job, sync_data, "w142", workers=1, throttle_ms=60, during=elastic)
    layouts = [len(e["workers"]) for e in events if e["kind"] == "sync_membership"]
    assert layouts[:1] == [1] and 4 in layouts and layouts[-1] == 2, layouts
    assert_same(one, three, "1 -> 4 -> 2 workers vs 1 worker")

    # a worker killed mid-run (SIGKILL): its virtual workers resume on the survivor from
    # their last committed state; the restarted process joins again later
    def kill(job):
        wait_for(lambda: sync_status(job).get("step", 0) >= 80, 300, "step 80")
        victim = [m for m in job.status()["members"] if m["id"] == "worker-1"][0]["pid"]
        os.kill(victim, 9)

    four, events = run(start_job, sync_data, "kill", workers=2, throttle_ms=30, during=kill,
                       max_restarts=1)
    assert any(e["kind"] == "worker_restart" for e in events), [e["kind"] for e in events]
    assert any(e["kind"] == "sync_membership" and e["workers"] == ["worker-0"] for e in events)
    assert_same(one, four, "2 workers, one killed and restarted, vs 1 worker")


# -- fast checks: PS step aggregation and the coordinator, without TensorFlow ---------------

@pytest.fixture
def standalone_ps(tmp_path):
    """Two standalone PS processes (each owns every slot)."""
    procs, stubs, chans = [], [], []
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import ps_pb2_grpc, sync_pb2_grpc
    for i in range(2):
        port_file = tmp_path / f"ps{i}.port"
        procs.append(subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--port-file",
                                       str(port_file)], cwd=ROOT,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT))))
        port = wait_for(lambda: port_file.exists() and port_file.read_text(), 30, "PS port")
        ch = insecure_channel(f"127.0.0.1:{port}")
        chans.append(ch)
        stubs.append((ps_pb2_grpc.ParameterServerStub(ch), sync_pb2_grpc.SyncParameterServerStub(ch)))
    yield stubs
    for ch in chans:
        ch.close()
    for p in procs:
        p.terminate()
        p.wait(20)


def _contribution(rank, ids, grads):
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2, sync_pb2
    return sync_pb2.Contribution(virtual_rank=rank, tables=[ps_pb2.TableUpdate(
        table="t", ids=codec.ids_to_bytes(ids), values=codec.floats_to_bytes(grads))])


def test_ps_sums_in_rank_order_whatever_the_arrival_order(standalone_ps):
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2, sync_pb2
    rng = np.random.default_rng(0)
    contribs = []
    for step in range(3):
        per_rank = []
        for rank in range(V):
            ids = np.unique(rng.integers(0, 500, 300))
            # magnitudes far apart: float addition order shows in the low bits
            grads = (rng.standard_normal((ids.size, 4)) * 10.0 ** rng.integers(-6, 6, (ids.size, 1))
                     ).astype(np.float32)
            per_rank.append((rank, ids, grads))
        contribs.append(per_rank)
    finals = []
    for k, (ps, sync) in enumerate(standalone_ps):
        ps.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="t", dim=4, initializer_json='{"name": "normal", "seed": 1}',
            optimizer_json='{"name": "adam", "learning_rate": 0.01}')))
        for step, per_rank in enumerate(contribs):
            lookups = sync.StepLookup(sync_pb2.StepLookupRequest(step=step, tables=[
                ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(np.arange(500)))]), timeout=10)
            assert lookups.applied_step == step - 1
            # PS 0: ranks arrive 0..3 one per RPC; PS 1: reversed, two per RPC ("hosts"),
            # plus a resend of rank 3 (a moved virtual worker re-sending its step)
            order = per_rank if k == 0 else per_rank[::-1]
            groups = [[c] for c in order] if k == 0 else [order[:2], order[:1], order[2:]]
            for group in groups:
                resp = sync.Contribute(sync_pb2.ContributeRequest(
                    step=step, virtual_workers=V,
                    contributions=[_contribution(*c) for c in group]), timeout=10)
            assert resp.applied_step == step
            if k == 1:
                assert resp.duplicates == 0
                again = sync.Contribute(sync_pb2.ContributeRequest(
                    step=step, virtual_workers=V, contributions=[_contribution(*per_rank[3])]),
                    timeout=10)
                assert again.duplicates == 1 and again.applied_step == step
        got = sync.StepLookup(sync_pb2.StepLookupRequest(step=3, tables=[
            ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(np.arange(500)))]), timeout=10)
        finals.append(got.values[0])
        # a re-run of the last step reads the rows as they were before it
        before = sync.StepLookup(sync_pb2.StepLookupRequest(step=2, tables=[
            ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(np.arange(500)))]), timeout=10)
        assert before.values[0] != got.values[0]
    assert finals[0] == finals[1]  # raw bytes
    # the reference: the same sums computed here, in rank order, differ from another order
    from deeprec_ext.ps.sync_service import sum_in_rank_order
    ids, acc = sum_in_rank_order([(i, g) for _, i, g in contribs[0]], 4)
    _, rev = sum_in_rank_order([(i, g) for _, i, g in contribs[0][::-1]], 4)
    assert not np.array_equal(acc, rev), "test data too tame to show the summation order"


def test_ps_rejects_bad_contributions_and_keeps_serving(standalone_ps):
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2, sync_pb2
    ps, sync = standalone_ps[0]
    ps.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
        name="t", dim=2, initializer_json='"zeros"', optimizer_json='{"name": "sgd", "learning_rate": 1}')))
    ids = np.arange(3, dtype=np.int64)
    ok = np.ones((3, 2), np.float32)
    bad = [
        (sync_pb2.ContributeRequest(step=0, virtual_workers=2, contributions=[
            _contribution(0, ids, np.full((3, 2), np.nan, np.float32))]), "NaN"),
        (sync_pb2.ContributeRequest(step=0, virtual_workers=2, contributions=[
            _contribution(5, ids, ok)]), "virtual ranks"),
        (sync_pb2.ContributeRequest(step=-1, virtual_workers=2), "step >= 0"),
        (sync_pb2.ContributeRequest(step=0, virtual_workers=2, contributions=[
            _contribution(0, np.array([1, 1, 2]), ok)]), "unique"),
        (sync_pb2.ContributeRequest(step=0, virtual_workers=2, contributions=[
            sync_pb2.Contribution(virtual_rank=0, tables=[ps_pb2.TableUpdate(
                table="nope", ids=codec.ids_to_bytes(ids), values=codec.floats_to_bytes(ok))])]),
         "unknown table"),
    ]
    for req, message in bad:
        with pytest.raises(grpc.RpcError) as err:
            sync.Contribute(req, timeout=10)
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert message in err.value.details()
    state = sync.SyncState(sync_pb2.SyncStateRequest(), timeout=10)
    assert state.applied_step == -1 and list(state.pending_steps) == []  # nothing changed
    sync.Contribute(sync_pb2.ContributeRequest(step=0, virtual_workers=2,
                                               contributions=[_contribution(0, ids, ok)]), timeout=10)
    with pytest.raises(grpc.RpcError) as err:  # a different V for the same step
        sync.Contribute(sync_pb2.ContributeRequest(step=0, virtual_workers=3, contributions=[
            _contribution(1, ids, ok)]), timeout=10)
    assert "virtual_workers 3 != 2" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # step 0 is incomplete: a step-1 lookup waits
        sync.StepLookup(sync_pb2.StepLookupRequest(step=1, wait_seconds=0.3, tables=[
            ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(ids))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "[1]" in err.value.details()
    sync.Contribute(sync_pb2.ContributeRequest(step=0, virtual_workers=2,
                                               contributions=[_contribution(1, ids, ok)]), timeout=10)
    got = sync.StepLookup(sync_pb2.StepLookupRequest(step=1, tables=[
        ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(ids))]), timeout=10)
    assert np.array_equal(codec.floats_from_bytes(got.values[0], 3, 2), -2 * ok)


def test_coordinator_rejects_bad_barrier_calls(start_job, sync_data):
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.member import MasterSession
    from deeprec_ext.proto import sync_pb2, sync_pb2_grpc
    job = start_job({**_job(sync_data), "worker": {"replicas": 0}}, ["--workers", "0"])
    session = MasterSession(job.address, "worker", "worker-7")
    session.register()
    with insecure_channel(job.address) as ch:
        stub = sync_pb2_grpc.SyncCoordinatorStub(ch)
        shards = stub.VirtualShards(sync_pb2.VirtualShardsRequest(virtual_rank=1), timeout=10).shards
        assert [s.shard_id % V for s in shards] == [1] * 10
        for req, code, message in [
            (sync_pb2.StepBarrierRequest(worker_id="nobody", step=-1, micro_batch=32),
             grpc.StatusCode.FAILED_PRECONDITION, "not a live registered worker"),
            (sync_pb2.StepBarrierRequest(worker_id="worker-7", step=-1, micro_batch=0),
             grpc.StatusCode.INVALID_ARGUMENT, "micro_batch"),
            (sync_pb2.StepBarrierRequest(worker_id="worker-7", step=-1, micro_batch=32, states=[
                sync_pb2.VirtualWorkerState(virtual_rank=9)]),
             grpc.StatusCode.INVALID_ARGUMENT, "outside"),
            (sync_pb2.StepBarrierRequest(worker_id="worker-7", step=5, micro_batch=32),
             grpc.StatusCode.FAILED_PRECONDITION, "open boundary is step 0"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.StepBarrier(req, timeout=10)
            assert err.value.code() == code and message in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.VirtualShards(sync_pb2.VirtualShardsRequest(virtual_rank=4), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # still serving: the registered worker joins and gets all four virtual workers
        resp = stub.StepBarrier(sync_pb2.StepBarrierRequest(worker_id="worker-7", step=-1,
                                                            micro_batch=32), timeout=10)
        assert resp.status == sync_pb2.StepBarrierResponse.RUN and resp.step == 0
        assert [s.virtual_rank for s in resp.states] == [0, 1, 2, 3] and resp.primary
        with pytest.raises(grpc.RpcError) as err:  # the job's micro-batch is fixed now
            stub.StepBarrier(sync_pb2.StepBarrierRequest(worker_id="worker-7", step=1,
                                                         micro_batch=64), timeout=10)
        assert "differs" in err.value.details()
    session.close()


def test_config_validation():
    from aimaster.config import ConfigError, parse_job
    with pytest.raises(ConfigError, match="virtual_workers"):
        parse_job({"consistency": {"mode": "sync"}})
    with pytest.raises(ConfigError, match="mode 'sync' only"):
        parse_job({"consistency": {"virtual_workers": 4}})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_job({"consistency": {"mode": "sync", "virtual_workers": 2, "micro": 3}})
    cfg = parse_job({"consistency": {"mode": "sync", "virtual_workers": 4, "steps": 10, "seed": 3}})
    assert (cfg.consistency.virtual_workers, cfg.consistency.steps, cfg.consistency.seed) == (4, 10, 3)
