"""Where a training step of ours spends its PS time, without TensorFlow training around it.

    .venv/bin/python bench/profile_ps_calls.py [--rows 400000] [--batches 60]

Replays real DeepFM batches (26 categorical ids per row, batch 1024, from the
bench_training data in ``runs/bench-data/``) through the calls one training step of
``examples/criteo/train.py`` makes, and times each layer separately:

  1. PS handler only: ``ParameterServerServicer.Lookup/Push`` called in-process (no gRPC)
     -- the store work per request (hash index, Adam, validation, routing check);
  2. client-side preparation only: what ``PSClient.lookup_many``/``push_many`` do to the
     ids/gradients before sending (np.unique, argsort/reduceat, isfinite);
  3. full client calls over gRPC against a real PS (``aimaster run --ps 1 --workers 0``):
     ``lookup``/``push`` per table as ``elastic_lookup`` issues them, and
     ``lookup_many``/``push_many`` of both tables at once.

Tables as in the example: ``embedding`` (dim 8) and ``linear`` (dim 1), Adam on the PS.
Prints ms per batch (best of 3 passes; push calls change the table, so passes are not
identical); compare rows with each other, not with other runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def _ms(fn, items, repeat: int = 3) -> float:
    """ms per item: best of ``repeat`` passes over ``items`` (least disturbed pass)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best / max(len(items), 1)


class _Ctx:  # minimal grpc ServicerContext for in-process handler calls
    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")

    def set_trailing_metadata(self, md):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400_000, help="which bench_training data set")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=60)
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_training import ensure_data
    from examples.criteo.reader import criteo_dataset

    data = ensure_data(args.rows, args.files, args.seed)
    warm = 20
    batches = [f["cat"].numpy().ravel() for _, (f, _) in
               zip(range(args.batches + warm), criteo_dataset(data["train"], args.batch_size))]
    n_ids = batches[0].size
    uniq = [np.unique(b) for b in batches]
    print(f"{len(batches) - warm} timed batches of {args.batch_size} rows = {n_ids:,} ids, "
          f"{np.mean([u.size for u in uniq[warm:]]):,.0f} distinct per batch on average")
    opt = {"name": "adam", "learning_rate": 1e-3}
    rows = []

    # 1. PS handlers in-process ------------------------------------------------------------
    from deeprec_ext import codec
    from deeprec_ext.hashing import DEFAULT_NUM_SLOTS
    from deeprec_ext.proto import ps_pb2
    from deeprec_ext.ps.server import ParameterServerServicer
    svc, ctx = ParameterServerServicer("ps-0"), _Ctx()
    svc.routing.set(1, DEFAULT_NUM_SLOTS, np.ones(DEFAULT_NUM_SLOTS, bool))
    for name, dim in (("embedding", 8), ("linear", 1)):
        svc.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name=name, dim=dim, initializer_json=json.dumps("zeros"),
            optimizer_json=json.dumps(opt))), ctx)

    def lreq(name, u):
        return ps_pb2.LookupRequest(epoch=1, insert_missing=True, tables=[
            ps_pb2.TableIds(table=name, ids=codec.ids_to_bytes(u))])

    def preq(name, u, dim):
        return ps_pb2.PushRequest(epoch=1, tables=[ps_pb2.TableUpdate(
            table=name, ids=codec.ids_to_bytes(u),
            values=codec.floats_to_bytes(np.full((u.size, dim), 1e-3, np.float32)))])

    for u in uniq[:warm]:
        svc.Lookup(lreq("embedding", u), ctx)
        svc.Lookup(lreq("linear", u), ctx)
    # in-process handler calls (Push changes the table: later passes see the same keys)
    for label, make, call in (
            ("Lookup embedding", lambda u: lreq("embedding", u), svc.Lookup),
            ("Lookup linear", lambda u: lreq("linear", u), svc.Lookup),
            ("Push embedding", lambda u: preq("embedding", u, 8), svc.Push),
            ("Push linear", lambda u: preq("linear", u, 1), svc.Push)):
        reqs = [make(u) for u in uniq[warm:]]
        rows.append(("1. PS handler (in-process, no gRPC)", label,
                     _ms(lambda r: call(r, ctx), reqs)))

    # 2. client-side preparation ------------------------------------------------------------
    g8 = np.full((n_ids, 8), 1e-3, np.float32)

    def push_prep(b, g=g8):
        u, inv = np.unique(b, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        starts = np.searchsorted(inv[order], np.arange(u.size))
        np.add.reduceat(g[order], starts, axis=0)
        np.isfinite(g).all()

    timed = batches[warm:]
    rows.append(("2. client prep (numpy, per table)", "np.unique(ids, return_inverse) [lookup]",
                 _ms(lambda b: np.unique(b, return_inverse=True), timed)))
    rows.append(("2. client prep (numpy, per table)", "push: unique+argsort+reduceat+isfinite",
                 _ms(push_prep, timed)))
    import tensorflow as tf
    tb = [tf.constant(b) for b in timed]
    tg = tf.constant(g8)

    def tf_dedupe(b):
        u, idx = tf.unique(b)
        tf.math.unsorted_segment_sum(tg, idx, tf.shape(u)[0])

    rows.append(("2. client prep (numpy, per table)", "(alt.) tf.unique in TF",
                 _ms(lambda b: tf.unique(b), tb)))
    rows.append(("2. client prep (numpy, per table)", "(alt.) tf.unique + unsorted_segment_sum",
                 _ms(tf_dedupe, tb)))

    # 3. full client calls against a real PS over gRPC -----------------------------------------
    state = tempfile.mkdtemp(prefix="bench-ps-calls-")
    job = os.path.join(state, "job.yaml")
    with open(job, "w") as f:
        f.write("name: bench-ps-calls\nps: {replicas: 1}\n")
    exe = os.path.join(os.path.dirname(sys.executable), "aimaster")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "aimaster.cli"]) + \
        ["run", job, "--ps", "1", "--workers", "0", "--state-dir", state, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        line = proc.stdout.readline().decode()
        if "listening on " not in line:
            raise RuntimeError(f"aimaster did not start: {line!r}")
        address = line.split("listening on ")[1].split()[0]
        from deeprec_ext import PSClient
        client = PSClient.connect(address, timeout=60)
        client.create_table("embedding", 8, initializer="zeros", optimizer=opt)
        client.create_table("linear", 1, initializer="zeros", optimizer=opt)
        for b in batches[:warm]:
            client.lookup_many({"embedding": b, "linear": b})
        g1 = np.full((n_ids, 1), 1e-3, np.float32)
        calls = [
            ("lookup embedding", lambda b: client.lookup("embedding", b)),
            ("lookup linear", lambda b: client.lookup("linear", b)),
            ("push embedding", lambda b: client.push("embedding", b, g8)),
            ("push linear", lambda b: client.push("linear", b, g1)),
            ("lookup_many embedding+linear", lambda b: client.lookup_many(
                {"embedding": b, "linear": b})),
            ("push_many embedding+linear", lambda b: client.push_many(
                {"embedding": (b, g8), "linear": (b, g1)})),
        ]
        for label, fn in calls:
            rows.append(("3. PSClient call over gRPC (1 PS)", label, _ms(fn, timed)))
        # what a training step sends: the batch's distinct ids (TF de-duplicates them in
        # the graph) with unique=True, both tables in one call each way
        ug = [(u, np.full((u.size, 8), 1e-3, np.float32), np.full((u.size, 1), 1e-3, np.float32))
              for u in uniq[warm:]]
        for label, fn in [
                ("lookup_many, distinct ids, unique=True", lambda x: client.lookup_many(
                    {"embedding": x[0], "linear": x[0]}, unique=True)),
                ("push_many, distinct ids, unique=True", lambda x: client.push_many(
                    {"embedding": (x[0], x[1]), "linear": (x[0], x[2])}, unique=True))]:
            rows.append(("3. PSClient call over gRPC (1 PS)", label, _ms(fn, ug)))
        client.close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(state, ignore_errors=True)

    section = None
    for sec, label, ms in rows:
        if sec != section:
            print(sec)
            section = sec
        print(f"   {label:44s} {ms:7.2f} ms/batch")
    per_step = sum(ms for sec, label, ms in rows if sec.startswith("3.") and
                   label in ("lookup embedding", "lookup linear", "push embedding", "push linear"))
    print(f"PS calls of one training step as elastic_lookup issues them (4 calls): "
          f"{per_step:.1f} ms, i.e. at most {args.batch_size / per_step * 1e3:,.0f} samples/s "
          f"for a worker doing nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main())
