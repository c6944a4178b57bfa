"""Checkpoints and exports on S3 (issue 18, item 3): the real local S3 server of
test_data_remote (moto's server mode), the real checkpoint writer, reader and CLI.

A checkpoint on an object store is visible only once its manifest object is; a writer
killed -9 half-way leaves data objects that no restore, warm start or ``next_id`` mistakes
for a checkpoint; a bad URL, a missing bucket or refused credentials are errors naming the
location."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("s3fs")

import checkpoint  # noqa: E402
from checkpoint import (CheckpointError, NoValidCheckpoint, apply_retention,  # noqa: E402
                        list_chains, next_id, restore)
from checkpoint.format import MANIFEST_NAME  # noqa: E402
from deeprec_ext.store import EmbeddingStore  # noqa: E402
from tests.test_checkpoint import (ROOT, assert_same, make_store, mutate, snap,  # noqa: E402
                                   write)
from tests.test_data_remote import BUCKET, s3  # noqa: E402,F401 - the server fixture


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test mirrors into its own cache: nothing is served from another test's copy."""
    monkeypatch.setenv("DEEPREC_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _store(rng, n=6000):
    """Two embedding tables (adagrad, adam) of the checkpoint tests, no dense table:
    ``mutate`` gives it random keys, which ``load`` rightly refuses for a dense variable."""
    s = make_store(rng, n)
    s.drop_table("dense/w")
    return s


def _objects(s3, prefix):
    s3.invalidate_cache()
    return sorted(p.split(f"{prefix}/", 1)[1] for p in s3.find(f"{BUCKET}/{prefix}"))


def test_full_and_incrementals_on_s3_restore_exactly(s3, tmp_path, cache):
    url = f"s3://{BUCKET}/ckpt-exact"
    rng = np.random.default_rng(5)
    store = _store(rng)
    assert next_id(url) == 1
    cuts = write(url, 1, store)
    first = snap(store)
    rows1 = {n: len(t) for n, t in store.tables().items()}
    for ckpt in (2, 3):
        mutate(store, rng)
        cuts = write(url, ckpt, store, "incr", parent=ckpt - 1, cuts=cuts)
    objs = _objects(s3, "ckpt-exact")
    assert {o.split("/")[0] for o in objs} == {"ckpt-00000001-full", "ckpt-00000002-incr",
                                               "ckpt-00000003-incr"}
    assert next_id(url) == 4
    # the writer staged locally and left nothing behind; the files are objects
    assert all(o.endswith((".rows", ".dense", ".index", MANIFEST_NAME)) for o in objs)
    # a full checkpoint's tables carry their saved index; incrementals do not
    assert {o.split("/")[0] for o in objs if o.endswith(".index")} == {"ckpt-00000001-full"}

    s2 = EmbeddingStore()
    info = restore(url, s2)
    assert info.chain == [1, 2, 3] and info.dir == f"{url}/ckpt-00000003-incr"
    assert_same(snap(store), snap(s2))
    assert {n: st["live_rows"] for n, st in info.tables.items()} == \
        {n: len(t) for n, t in store.tables().items()}

    loaded = checkpoint.load(url)
    assert sorted(loaded.tables) == sorted(store.tables())
    for name, t in store.tables().items():
        keys, rows, _ = t.export_rows()
        o = np.argsort(keys)
        np.testing.assert_array_equal(loaded.tables[name].ids, keys[o])
        np.testing.assert_array_equal(loaded.tables[name].values.view(np.uint32),
                                      rows[o, :t.dim].view(np.uint32))
    one = checkpoint.load(f"{url}/ckpt-00000001-full")   # one checkpoint of the root, by URL
    assert one.chain == [1] and {n: len(t) for n, t in one.tables.items()} == \
        {n: rows1[n] for n in one.tables}
    for name, t in one.tables.items():
        np.testing.assert_array_equal(t.ids, first[name][0])

    # the CLI verifies every byte of the remote checkpoints
    out = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", url, "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["root"] == url and rep["chains"] == [[1, 2, 3]] and rep["ok"]

    # retention: a second chain, then the first one's objects go (manifest first)
    write(url, 4, store)
    assert apply_retention(url, keep_chains=1) == ["ckpt-00000001-full", "ckpt-00000002-incr",
                                                   "ckpt-00000003-incr"]
    assert {o.split("/")[0] for o in _objects(s3, "ckpt-exact")} == {"ckpt-00000004-full"}
    s3b = EmbeddingStore()
    assert restore(url, s3b).chain == [4]
    assert_same(snap(store), snap(s3b))
    # the local mirror follows: the deleted checkpoints are gone from the cache too
    list_chains(url, verify="manifest")
    assert sorted(p.name for p in next(cache.iterdir()).iterdir()
                  if p.name.startswith("ckpt-")) == ["ckpt-00000004-full"]


_CRASH_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from checkpoint import CheckpointWriter
    from deeprec_ext.store import EmbeddingStore
    s = EmbeddingStore()
    t = s.create_table("extra", 8)
    t.insert(np.arange(50_000), np.ones((50_000, 8), np.float32))
    w = CheckpointWriter(sys.argv[1], int(sys.argv[2]), "incr", parent=int(sys.argv[3]),
                         num_slots=4096)
    w.write_table("ps-0", t, since_seq=0)   # uploaded: a data object, no manifest
    print("written", flush=True)
    time.sleep(600)                          # killed -9 here, before commit
""")


def test_writer_killed_before_its_manifest_is_never_picked(s3, tmp_path):
    url = f"s3://{BUCKET}/ckpt-crash"
    rng = np.random.default_rng(6)
    store = make_store(rng, n=3000)
    cuts = write(url, 1, store)
    mutate(store, rng)
    write(url, 2, store, "incr", parent=1, cuts=cuts)
    # TMPDIR: the dead writer's staging directory stays in this test's directory
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_WRITER, url, "3", "2"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    objs = _objects(s3, "ckpt-crash")
    assert "ckpt-00000003-incr/ps-0.extra.rows" in objs
    assert "ckpt-00000003-incr/manifest.json" not in objs
    # recovery and warm start take checkpoint 2; the half-written 3 is not restorable,
    # and its id is never reused
    assert [c.ids for c in list_chains(url)] == [[1, 2]]
    s2 = EmbeddingStore()
    info = restore(url, s2)
    assert info.chain == [1, 2]
    assert_same(snap(store), snap(s2))
    assert "extra" not in s2.tables()  # nothing of the dead writer
    assert next_id(url) == 4
    from aimaster.master import JobMaster  # what a restarted AIMaster resumes from
    assert JobMaster._newest_checkpoint_in(url).id == 2
    with pytest.raises(CheckpointError, match="ckpt-00000003-incr/manifest.json: missing"):
        checkpoint.load(f"{url}/ckpt-00000003-incr")
    # a new full chain: retention removes the abandoned objects with the old chain
    write(url, 4, store)
    assert "ckpt-00000003-incr" in apply_retention(url, keep_chains=1)
    assert {o.split("/")[0] for o in _objects(s3, "ckpt-crash")} == {"ckpt-00000004-full"}


def test_bad_locations_are_named(s3, tmp_path):
    store = make_store(np.random.default_rng(7), n=100)
    for url, why in ((f"nosuch://{BUCKET}/x", "nosuch"),
                     ("s3://no-such-bucket-here/ckpt", "bucket 'no-such-bucket-here' does not "
                                                       "exist")):
        with pytest.raises(CheckpointError, match=f"checkpoint location .*{why}"):
            write(url, 1, store)
        with pytest.raises(CheckpointError, match=why):
            restore(url, EmbeddingStore())
        with pytest.raises(CheckpointError, match=why):
            checkpoint.load(url)
        out = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", url],
                             capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2 and why in out.stderr, out.stderr
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        checkpoint.load(f"s3://{BUCKET}/empty-prefix")
    with pytest.raises(NoValidCheckpoint):
        restore(f"s3://{BUCKET}/empty-prefix", EmbeddingStore())


def test_refused_credentials_are_named(s3, monkeypatch):
    """The server checks signatures (moto's IAM auth on): the key of this process is not
    one it knows, so every request is refused."""
    from moto import settings
    write(f"s3://{BUCKET}/ckpt-auth", 1, make_store(np.random.default_rng(8), n=100))
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    with pytest.raises(CheckpointError, match=r"checkpoint location s3://.*ckpt-auth: "
                                              r"access denied: the credentials were rejected"):
        restore(f"s3://{BUCKET}/ckpt-auth", EmbeddingStore())
    with pytest.raises(CheckpointError, match="ckpt-auth: access denied"):
        write(f"s3://{BUCKET}/ckpt-auth", 2, make_store(np.random.default_rng(8), n=100))


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "aimaster.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


_LOAD_EXPORT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    m = tf.saved_model.load(sys.argv[1])
    ids = np.arange(int(sys.argv[2]), dtype=np.int64)
    out = m.signatures["lookup_records"](ids=tf.constant(ids))["values"].numpy()
    print(json.dumps(np.round(out[:, 0]).astype(int).tolist()))
""")


def test_job_checkpoints_exports_and_warm_starts_on_s3(s3, start_job, tmp_path):
    """A job whose checkpoint.dir and export.dir are s3:// URLs: a full and an incremental
    checkpoint while it runs, the final checkpoint and the SavedModel when it ends; a
    second job warm-starts from the incremental (init_from: its URL). Every id's counter
    is exact in both, and in the export loaded by stock TensorFlow from a download."""
    from deeprec_ext.client import PSClient
    from tests.conftest import wait_for
    from tests.test_data_remote import _upload
    expected = _upload(s3, "ckjob", per=400)
    n = sum(len(v) for v in expected.values())
    ck = f"s3://{BUCKET}/ckjob-ckpt"
    ex = f"s3://{BUCKET}/ckjob-export"
    job = start_job({
        "name": "s3ckpt", "ps": {"replicas": 2},
        "worker": {"replicas": 1, "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                   "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "500", "PYTHONPATH": str(ROOT),
                           "COUNTING_HOLD_FILE": str(tmp_path / "release")}},
        "data": {"files": [f"s3://{BUCKET}/ckjob/*"], "bytes_per_shard": 4000},
        "checkpoint": {"dir": ck, "keep_chains": 2}, "export": {"dir": ex},
        "master": {"heartbeat_seconds": 0.5},
    }, subdir="day1")
    wait_for(lambda: job.status()["shards"]["todo"] == 0 and job.status()["shards"]["doing"] == 0,
             120, "every shard DONE")
    out = _cli("checkpoint", "--master", job.address, "--full")
    assert out.returncode == 0, out.stderr
    full = json.loads(out.stdout)
    assert full["type"] == "full" and full["path"] == f"{ck}/ckpt-00000001-full"
    client = PSClient.connect(job.address, timeout=30)
    client.push("records", np.arange(100, dtype=np.int64), -np.ones((100, 1), np.float32))
    client.close()
    out = _cli("checkpoint", "--master", job.address)
    assert out.returncode == 0, out.stderr
    incr = json.loads(out.stdout)
    assert incr["type"] == "incr" and incr["path"] == f"{ck}/ckpt-00000002-incr"
    assert incr["rows"] == 100  # the incremental holds the rows changed, no more
    (tmp_path / "release").write_text("")
    assert job.wait(180) == 0, job.output()[-3000:]
    st = job.state()
    assert st["final_checkpoint"] == f"{ck}/ckpt-00000003-full", st
    assert st["export_dir"].startswith(f"{ex}/"), st
    want = np.ones(n, np.int64)
    want[:100] = 2

    # the final checkpoint, read back from S3
    got = checkpoint.load(st["final_checkpoint"]).tables["records"]
    np.testing.assert_array_equal(got.ids, np.arange(n))
    np.testing.assert_array_equal(got.values[:, 0].astype(np.int64), want)

    # the export: downloaded, loaded by TensorFlow in a process without the project
    local = tmp_path / "export"
    s3.invalidate_cache()
    s3.get(st["export_dir"].split("://", 1)[1] + "/", str(local), recursive=True)
    assert (local / "saved_model.pb").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-I", "-c", _LOAD_EXPORT, str(local), str(n)],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == want.tolist()

    # `aimaster export` to a URL that exists, or into a missing bucket: refused, named
    out = _cli("export", ck, "--out", st["export_dir"])
    assert out.returncode == 1 and f"{st['export_dir']} exists" in out.stderr, out.stderr
    out = _cli("export", ck, "--out", "s3://no-such-bucket-here/m/1")
    assert out.returncode == 1 and "bucket 'no-such-bucket-here' does not exist" in out.stderr

    # warm start from the incremental, by URL, onto 3 PS
    job2 = start_job({"name": "s3warm", "ps": {"replicas": 3},
                      "init_from": f"{ck}/ckpt-00000002-incr"}, ["--workers", "0"], subdir="day2")
    c = PSClient.connect(job2.address, timeout=60)
    c.create_table("records", dim=1, initializer="zeros",
                   optimizer={"name": "sgd", "learning_rate": 1.0})
    got = c.lookup("records", np.arange(n + 50, dtype=np.int64), insert_missing=False)[:, 0]
    # a PS asked to write to or restore from a bad location answers with a status naming
    # it, and keeps serving
    import grpc

    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
    stub = ps_pb2_grpc.ParameterServerStub(insecure_channel(c.routing.ps_addresses[0]))
    for root, why in (("s3://no-such-bucket-here/ck", "bucket 'no-such-bucket-here' does not"),
                      ("nosuch://b/ck", "nosuch")):
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteCheckpoint(ps_pb2.WriteCheckpointRequest(root=root, ckpt_id=1, kind="full"),
                                 timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.RestoreCheckpoint(ps_pb2.RestoreCheckpointRequest(
                root=root, ckpt_id=1, slots=b"\1" * c.routing.num_slots,
                num_slots=c.routing.num_slots), timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert why in err.value.details()
    assert (c.lookup("records", np.arange(n, dtype=np.int64), insert_missing=False)[:, 0]
            == got[:n]).all()
    c.close()
    np.testing.assert_array_equal(got[:n].astype(np.int64), want)
    assert not got[n:].any()
    ev = next(e for e in job2.status()["events"] if e["kind"] == "warm_start")
    # rows applied along the chain: every id from the full, the 100 again from the incr
    assert ev["checkpoint"] == f"{ck}/ckpt-00000002-incr" and ev["rows"] == n + 100


def test_job_with_a_missing_checkpoint_bucket_fails_at_start(s3, tmp_path):
    """Refused before anything starts: no PS, no worker, exit 2, the bucket named."""
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "nobucket", "ps": {"replicas": 1},
                               "checkpoint": {"dir": "s3://no-such-bucket-here/ck"},
                               "master": {"state_dir": str(tmp_path / "state")}}))
    out = _cli("run", str(job), "--workers", "0", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "aimaster: error: checkpoint.dir: checkpoint location s3://no-such-bucket-here/ck: " \
           "bucket 'no-such-bucket-here' does not exist" in out.stderr
