"""Live elasticity: PS and worker sets change under a running job with no restart of a
surviving process, and every update and every record is accounted for exactly."""
from __future__ import annotations

import json
import os
import signal
import pathlib
import time
import subprocess
import sys
import threading

import numpy as np
import pytest

from deeprec_ext import PSClient
from tests.conftest import ROOT, wait_for


def scale(job, *args, expect_ok=True):
    r = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", job.address,
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if expect_ok:
        assert r.returncode == 0, r.stderr + job.output()[-3000:]
        return json.loads(r.stdout)
    assert r.returncode != 0
    return r.stderr


def pids(job, role):
    return {m["id"]: m["pid"] for m in job.status()["members"]
            if m["role"] == role and m["state"] == "running"}


def kill9_ps_until_replaced(job, ps_id: str, scale_events: int) -> dict:
    """kill -9 ``ps_id``; returns the recovery event once the replacement PS has joined
    (the job's ``scale_events``-th scale event). Counts are exact only from then on: from
    the replacement's hand-over to the end of its clean-up, the source still holds the
    moved rows and counts them too."""
    os.kill(pids(job, "ps")[ps_id], signal.SIGKILL)
    rec = wait_for(lambda: [e for e in job.status()["events"] if e["kind"] == "recovery"],
                   60, "recovery")[0]
    assert rec["promoted_rows"] > 0, rec
    wait_for(lambda: sum(e["kind"] == "scale" for e in job.status()["events"]) == scale_events,
             60, "the replacement PS to join")
    return rec


def test_ps_scale_under_pushes_counts_exact(start_job):
    job = start_job({"name": "counters", "ps": {"replicas": 2, "max_replicas": 4}},
                    ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    client.create_table("c", dim=2, initializer="zeros", optimizer={"name": "sgd", "learning_rate": 1.0})
    client.create_table("a", dim=16, initializer={"name": "normal", "seed": 3}, optimizer="adagrad")
    expected = np.zeros(200_000, dtype=np.int64)
    rng = np.random.default_rng(0)
    stop = threading.Event()
    errors = []

    def pusher():
        try:
            while not stop.is_set():
                ids = rng.integers(0, expected.size, 5000)
                client.push("c", ids, -np.ones((ids.size, 2), np.float32))
                np.add.at(expected, ids, 1)
                client.push("a", ids[:500], np.full((500, 16), 0.1, np.float32))
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    t = threading.Thread(target=pusher)
    t.start()
    try:
        wait_for(lambda: expected.sum() > 200_000, 60, "pushes to start")
        ps0 = pids(job, "ps")["ps-0"]
        before = pids(job, "ps")
        ev = scale(job, "--ps", "3")
        assert ev["kind"] == "scale" and ev["ps"] == [2, 3] and ev["workers"] == [0, 0]
        assert ev["moved_rows"] > 0 and ev["moved_bytes"] > 0 and ev["duration_ms"] > 0
        assert 0 < ev["max_stall_ms"] < 5000
        # the rows of every round (snapshot, catch-ups, the fenced last one) and where
        # the time went, so a long training step can be placed in the migration
        assert ev["round_rows"][0] == ev["moved_rows"] and len(ev["round_rows"]) == ev["rounds"]
        assert sum(ev["round_rows"][1:]) == ev["catchup_rows"]
        assert len(ev["round_ms"]) == ev["rounds"] and all(v >= 0 for v in ev["round_ms"])
        assert {"snapshot", "catchup", "fence_last_delta", "publish"} <= set(ev["phases_ms"])
        assert all(v >= 0 for v in ev["phases_ms"].values())
        after = pids(job, "ps")
        assert all(after[i] == before[i] for i in before), "a surviving PS restarted"
        ev = scale(job, "--ps", "1")
        assert ev["ps"] == [3, 1]
        # ps-2's ring peer is ps-0, its destination: that pair's snapshot came from the
        # copy ps-0 holds (no row streamed); the counts below include those rows
        assert 0 < ev["seeded_rows"] < ev["moved_rows"], ev
        assert pids(job, "ps") == {"ps-0": ps0}
        # refusals change nothing
        assert "outside" in scale(job, "--ps", "0", expect_ok=False)
        assert "outside" in scale(job, "--ps", "5", expect_ok=False)
        assert scale(job, "--ps", "2")["ps"] == [1, 2]
        wait_for(lambda: expected.sum() > 2_000_000, 120, "more pushes after the last change")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert pids(job, "ps")["ps-0"] == ps0
    got = client.lookup("c", np.arange(expected.size, dtype=np.int64), insert_missing=False)
    np.testing.assert_array_equal(got[:, 0].astype(np.int64), expected)
    np.testing.assert_array_equal(got[:, 1].astype(np.int64), expected)
    # every row lives on exactly one PS after the moved rows were dropped
    stats = client.ps_stats()
    assert sum(t.rows for s in stats for t in s.tables if t.name == "c") == int((expected > 0).sum())
    st = job.status()
    assert [e["ps"] for e in st["events"] if e["kind"] == "scale"] == [[2, 3], [3, 1], [1, 2]]
    # epochs only go forward: each migration takes one for its fence and one for the
    # new layout, after the first layout's 1
    assert st["epoch"] == 1 + 2 * 3
    assert [e["epoch"] for e in st["events"] if e["kind"] == "scale"] == [3, 5, 7]
    client.close()


def test_concurrent_scale_is_refused(start_job):
    job = start_job({"name": "busy", "ps": {"replicas": 1, "max_replicas": 3}}, ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    client.create_table("big", dim=16, optimizer="adagrad")
    for i in range(20):
        client.lookup("big", np.arange(i * 100_000, (i + 1) * 100_000, dtype=np.int64))
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("first", scale(job, "--ps", "3")))
    t.start()
    # the first change is underway once its new PS registered (rows still to move)
    wait_for(lambda: len(job.status()["members"]) >= 2, 60, "the first scale to start")
    assert "another scale event is in progress" in scale(job, "--ps", "2", expect_ok=False)
    t.join(120)
    assert results["first"]["ps"] == [1, 3]
    assert client.lookup("big", np.array([0, 1_999_999]), insert_missing=False).shape == (2, 16)
    client.close()


def _records(tmp_path, files=4, per_file=15_000):
    paths = []
    for f in range(files):
        p = tmp_path / f"rec-{f}.txt"
        ids = np.arange(f * per_file, (f + 1) * per_file)
        p.write_text("\n".join(map(str, ids)) + "\n")
        paths.append(str(p))
    return paths, files * per_file


def _counting_job(start_job, paths, ps=2, records_per_shard=1000, delay="0.02", carry=False):
    # workers hold at the end until the test has read the counters (the job then ends)
    job = start_job({
        "name": "stream",
        "ps": {"replicas": ps, "max_replicas": 4},
        "worker": {"replicas": 0, "max_replicas": 4,
                   "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                   "env": {"COUNTING_DELAY": delay, "PYTHONPATH": str(ROOT),
                           "COUNTING_DELAY_FILE": str(paths[0]) + ".pace",
                           "COUNTING_HOLD_FILE": str(paths[0]) + ".release",
                           "COUNTING_CARRY": "1" if carry else "0"}},
        "data": {"files": paths, "records_per_shard": records_per_shard},
        "master": {"heartbeat_seconds": 0.5},
    })
    wait_for(lambda: job.status()["phase"] == "running", 60, "the job to be running")
    return job


def _all_done(job):
    sh = job.status()["shards"]
    return sh["todo"] == 0 and sh["doing"] == 0


def _check_every_record_once(job, total, paths):
    client = PSClient.connect(job.address, timeout=30)
    got = client.lookup("records", np.arange(total, dtype=np.int64), insert_missing=False)[:, 0]
    client.close()
    open(str(paths[0]) + ".release", "w").close()
    assert job.wait(120) == 0, job.output()[-3000:]
    counts = np.bincount(np.clip(got.astype(np.int64), 0, 3), minlength=4)
    assert counts[1] == total, f"records trained 0/1/2/3+ times: {counts.tolist()}"
    state = job.state()
    assert set(state["shards"]["done"]) == {s["shard_id"] for s in state["shards"]["shards"]}


@pytest.mark.parametrize("carry", [False, True], ids=["waited", "carry"])
def test_ps_and_worker_changes_mid_stream_every_record_once(start_job, tmp_path, carry):
    """carry: each step's push rides in the next step's lookup (overlap="carry"); scale
    events, workers leaving mid-stream and the end of training must each send a held
    push, and no record may count as trained before its push was answered."""
    paths, total = _records(tmp_path, files=5, per_file=16_000)
    job = _counting_job(start_job, paths, delay="0.04", carry=carry)
    pace = pathlib.Path(str(paths[0]) + ".pace")
    pace.write_text("0.5")  # slow while the layout changes (a loaded machine starts
    # processes slowly), at full speed after
    assert scale(job, "--workers", "2")["workers"] == [0, 2]
    wait_for(lambda: job.status()["shards"]["done"] >= 3, 120, "training to start")
    w0, ps0 = pids(job, "worker")["worker-0"], pids(job, "ps")["ps-0"]
    steps = [("--ps", "3"), ("--workers", "4"), ("--ps", "1"), ("--workers", "1"), ("--ps", "2")]
    events = []
    for flag, n in steps:
        assert job.status()["shards"]["todo"] > 0, "the stream ended before the changes"
        events.append(scale(job, flag, n))
        assert pids(job, "worker")["worker-0"] == w0 and pids(job, "ps")["ps-0"] == ps0
    assert [e["ps"] for e in events] == [[2, 3], [3, 3], [3, 1], [1, 1], [1, 2]]
    assert [e["workers"] for e in events] == [[2, 2], [2, 4], [4, 4], [4, 1], [1, 1]]
    pace.write_text("0")
    wait_for(lambda: _all_done(job), 300, "every shard DONE")
    _check_every_record_once(job, total, paths)


def test_leaving_worker_returns_shard_progress(start_job, tmp_path):
    """Worker scale-in mid-shard: the shard continues elsewhere exactly where it stopped."""
    paths, total = _records(tmp_path, files=2, per_file=10_000)
    # slow enough that the returned shard is still waiting when the state is read
    job = _counting_job(start_job, paths, ps=1, records_per_shard=2500, delay="0.08")
    scale(job, "--workers", "2")
    wait_for(lambda: job.status()["shards"]["done"] >= 1, 120, "training to start")
    scale(job, "--workers", "1")
    st = job.status()
    left = [e for e in st["events"] if e["kind"] == "worker_left"]
    assert [e["id"] for e in left] == ["worker-1"] and left[0]["reason"] == "finished"
    returned = [e for e in st["events"] if e["kind"] == "shards_returned"]
    assert [e["worker"] for e in returned] == ["worker-1"] and any(returned[0]["progress"]), \
        "the leaving worker returned no partial shard"
    # the id that left can join again (it was kept as "leaving" and told to stop at once)
    ev = scale(job, "--workers", "2", "--timeout", "60")
    assert ev["workers"] == [1, 2]
    wait_for(lambda: _all_done(job), 300, "every shard DONE")
    _check_every_record_once(job, total, paths)


def test_step_barrier_membership_changes_at_boundary(start_job):
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from deeprec_ext.member import MasterSession
    from deeprec_ext.proto import master_pb2

    job = start_job({"name": "barrier", "worker": {"replicas": 0, "max_replicas": 4,
                                                   "command": ["true"]}}, ["--workers", "0"])
    wait_for(lambda: job.status()["phase"] == "running", 60, "running")
    sessions = [MasterSession(job.address, "worker", f"worker-{i}") for i in range(3)]
    for s in sessions:
        s.register()

    def enter(s, gen, timeout=30):
        return s.stub.Barrier(master_pb2.BarrierRequest(worker_id=s.id, generation=gen),
                              timeout=timeout)

    with ThreadPoolExecutor(4) as pool:
        # generation 0: everyone who arrives forms the membership
        first = list(pool.map(lambda s: enter(s, 0), sessions))
        assert {r.generation for r in first} == {1}
        assert list(first[0].worker_ids) == ["worker-0", "worker-1", "worker-2"]
        # generation 1 cannot complete without worker-2 ...
        slow = [pool.submit(enter, s, 1) for s in sessions[:2]]
        time.sleep(1.0)
        assert not any(f.done() for f in slow)
        # ... until worker-2 leaves the job (deregisters): membership shrinks at the boundary
        sessions[2].close("scale-in")
        got = [f.result(timeout=30) for f in slow]
        assert {r.generation for r in got} == {2}
        assert list(got[0].worker_ids) == ["worker-0", "worker-1"]
        # a joining worker is part of the next boundary
        late = MasterSession(job.address, "worker", "worker-3")
        late.register()
        got = list(pool.map(lambda s: enter(s, 2), [sessions[0], sessions[1], late]))
        assert list(got[0].worker_ids) == ["worker-0", "worker-1", "worker-3"]
    # a stale generation returns at once with the current one
    assert enter(sessions[0], 0).generation == 3
    with pytest.raises(grpc.RpcError) as info:
        sessions[0].stub.Barrier(master_pb2.BarrierRequest(worker_id="nobody", generation=3), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_deepfm_training_through_scale_changes_converges(start_job, tmp_path):
    """The example model keeps training, and reaches a useful AUC, while PS and workers
    change under it (2 -> 3 -> 1 -> 2 PS, 2 -> 3 -> 1 workers)."""
    from examples.criteo.generate import generate
    # three epochs of 400k records: room for the five changes while training runs, also on
    # a loaded machine (600k, then 800k once ran out after two of them there)
    data = generate(str(tmp_path / "data"), rows=400_000, files=4, test_rows=30_000, seed=5)
    job = start_job({
        "name": "deepfm-elastic",
        "ps": {"replicas": 2, "max_replicas": 3},
        "worker": {"replicas": 2, "max_replicas": 3,
                   "command": ["{python}", "-m", "examples.criteo.train", "--batch-size", "256",
                               "--test", data["test"]]},
        "data": {"files": data["train"], "records_per_shard": 5000, "epochs": 3},
        "master": {"heartbeat_seconds": 0.5},
    })
    wait_for(lambda: job.status()["shards"]["done"] >= 2, 180, "training to start")
    w0 = pids(job, "worker")["worker-0"]

    def data_left() -> bool:
        if job.proc.poll() is None:
            try:
                return job.status()["shards"]["todo"] > 0
            except AssertionError:  # the AIMaster went away between the poll and the call
                pass
        assert job.proc.wait(timeout=60) == 0, job.output()[-3000:]
        return False

    changes = 0
    for flag, n in [("--ps", "3"), ("--workers", "3"), ("--ps", "1"), ("--workers", "1"), ("--ps", "2")]:
        if not data_left():
            break  # a loaded machine: scale events slow, the data ran out first
        scale(job, flag, n)
        changes += 1
        try:
            members = pids(job, "worker")
        except AssertionError:  # the AIMaster is gone: the data ran out during this change
            assert job.proc.wait(timeout=60) == 0, job.output()[-3000:]
            break
        if "worker-0" not in members:  # worker-0 finished: the data ran out
            break
        assert members["worker-0"] == w0  # never restarted by a change
    # at least PS out, workers out and PS in happened while training went on
    assert changes >= 3, f"training ended after {changes} of the 5 changes"
    assert job.wait(600) == 0, job.output()[-3000:]
    state = job.state()
    assert set(state["shards"]["done"]) == {s["shard_id"] for s in state["shards"]["shards"]}
    metrics = json.loads((job.state_dir / "metrics-worker-0.json").read_text())
    print(f"AUC after elastic training: {metrics['auc']:.4f}; lookahead {metrics['lookahead']}")
    assert metrics["auc"] > 0.72
    # the next batch's rows were fetched while steps trained, through the changes
    assert metrics["lookahead"]["used"] > metrics["steps"] // 2


def test_sync_replication_under_many_pushers_and_a_scale_in_keeps_serving(start_job):
    """More concurrent pushes than a PS has handler threads, in sync replication: each
    push holds a thread until the ring peer has its rows. With peer calls on the same
    threads, every PS of the ring waited on a peer that had no thread left (the 40-minute
    soak hung at a 4 -> 2 scale-in). Peer and AIMaster calls have their own endpoint."""
    from tests.conftest import CounterPusher
    job = start_job({"name": "sync-crowd", "ps": {"replicas": 4, "max_replicas": 4},
                     "replication": {"mode": "sync", "interval_ms": 100}}, ["--workers", "0"])
    clients = [PSClient.connect(job.address, timeout=60) for _ in range(12)]
    clients[0].create_table("c", dim=1, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
    n = 400_000
    pushers = [CounterPusher(c, "c", n, batch=3000, seed=i).start() for i, c in enumerate(clients)]

    def pushed():
        return sum(int(p.expected.sum()) for p in pushers)
    try:
        wait_for(lambda: pushed() > 300_000, 60, "pushes from 12 clients")
        ev = scale(job, "--ps", "2")
        assert ev["ps"] == [4, 2] and ev["moved_rows"] > 0
        after = pushed()
        wait_for(lambda: pushed() > after + 300_000, 60, "pushes after the scale-in")
    finally:
        for p in pushers:
            p.stop()
    expected = sum(p.expected for p in pushers)
    got = clients[0].lookup("c", np.arange(n, dtype=np.int64), insert_missing=False)[:, 0]
    np.testing.assert_array_equal(got.astype(np.int64), expected)
    for c in clients:
        c.close()
