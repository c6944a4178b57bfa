"""In-process cost of the replication a scale event sets off (issue 16, item 3).

A new PS's full copy to its ring peer, then the delta of a migration's clean-up (a
third of the keys leave as "moved" tombstones), shipped by ``Replicator`` to a peer's
``ReplicaSet`` in this process. Each message goes through the bytes a channel carries:
the sender's stream is serialized (generated messages) or sent as they are (wire bytes),
the receiver deserializes with the PS's own request deserializer for ``Replicate``. CPU
times are the sender's (the shipment: export, tombstones, encode, serialize) and the
receiver's (parse + apply), so the
script runs unchanged on an older tree: ``--base COMMIT`` runs the same in an export of
that commit, alternating, in fresh processes.

    PYTHONPATH=. .venv/bin/python bench/bench_replication_wire.py --rows 2000000 \\
        --base e8f01ca~1 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(rows: int) -> dict:
    from deeprec_ext.proto import ps_pb2
    from deeprec_ext.ps import replication, validation
    from deeprec_ext.store import EmbeddingStore
    method = "/deeprec_ext.ps.ParameterServer/Replicate"
    parse = validation.FAST_DESERIALIZERS.get(method, ps_pb2.RowBatch.FromString)
    store = EmbeddingStore()
    t = store.create_table("emb", 16, initializer={"name": "normal", "stddev": 0.05},
                           optimizer="adagrad")
    keys = np.arange(rows, dtype=np.int64) * 7919
    for i in range(0, rows, 200_000):
        t.lookup(keys[i:i + 200_000])
        t.apply_gradients(keys[i:i + 200_000], np.ones((min(200_000, rows - i), 16), np.float32))
    peer = replication.ReplicaSet()
    out: dict = {}

    class Peer:
        def Replicate(self, batches, timeout=None, metadata=()):  # noqa: N802
            meta = dict(metadata)
            wire = [b if isinstance(b, bytes) else b.SerializeToString() for b in batches]
            s1 = time.process_time()
            n = peer.apply((parse(w) for w in wire), meta.get(replication.KIND_KEY, ""),
                           int(meta.get(replication.BASE_KEY, "-1")))
            s2 = time.process_time()
            out.setdefault("calls", []).append(
                {"kind": meta.get(replication.KIND_KEY), "apply_cpu_ms": (s2 - s1) * 1000, "bytes": sum(len(w) for w in wire),
                 "rows": n})
            return ps_pb2.ReplicateResponse(rows=n)

    rep = replication.Replicator(store, {})
    rep.close()
    rep.origin, rep.peer, rep._since, rep._stub = "ps-a", "peer", -1, Peer()
    rep._stub_peer = "peer"
    def ship():  # the sender's CPU: the whole shipment minus the receiver's apply
        c0 = time.process_time()
        rep.ship()
        call = out["calls"][-1]
        call["send_cpu_ms"] = (time.process_time() - c0) * 1000 - call["apply_cpu_ms"]

    ship()  # full copy
    moved = keys[::3]
    for i in range(0, moved.size, 1 << 14):  # DropSlots' slices
        t.delete(moved[i:i + (1 << 14)], log_tombstone=False, moved=True)
    t.apply_gradients(keys[1:20_000:3], np.ones((keys[1:20_000:3].size, 16), np.float32))
    ship()  # the clean-up's delta: moved tombstones + a few rows
    copy = peer.copies["ps-a"].store["emb"]
    assert len(copy) == len(t), (len(copy), len(t))
    k, r, _ = t.export_rows(None)
    order = np.argsort(k)
    got = copy.export_keys(k[order])[1]
    assert np.array_equal(got, r[order]), "the copy differs"
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--base", default="", help="also run an export of this commit")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.rows)))
        return
    trees = {"this": REPO}
    tmp = None
    if a.base:
        tmp = tempfile.mkdtemp(prefix="repl-base-")
        subprocess.run(f"git -C {REPO} archive {a.base} | tar -x -C {tmp}", shell=True, check=True)
        trees = {"base": tmp, "this": REPO}
    res: dict = {k: [] for k in trees}
    for _ in range(a.repeat):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2")
            r = subprocess.run([sys.executable, os.path.join(REPO, "bench", os.path.basename(__file__)),
                                "--one", "--rows", str(a.rows)], env=env, cwd=tree,
                               capture_output=True, text=True, timeout=600)
            if r.returncode:
                sys.exit(f"{name}: {r.stderr[-2000:]}")
            res[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, runs in res.items():
        for i, kind in enumerate(("full", "delta")):
            for f in ("send_cpu_ms", "apply_cpu_ms", "bytes"):
                v = float(np.median([run["calls"][i][f] for run in runs]))
                summary.setdefault(name, {})[f"{kind}_{f}"] = round(v, 1)
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "rows": a.rows, "base": a.base, "median": summary, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
