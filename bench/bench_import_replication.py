"""What a migration's imports cost in replication on the destination and its ring peer
(issue 16, item 3): with the destination's peer unchanged by the migration its imports
are shipped to it; with a peer that the destination leaves at the publish (a scale-in's
PS whose peer is the leaving PS) they are held back (``RowBatch.replica_after``).

    PYTHONPATH=. .venv/bin/python bench/bench_import_replication.py --rows 667000 \
        --repeat 3 --out bench/results/import-replication.json

Two real PS servicers in this process over real gRPC: the destination owns half the
slots and holds ``--own`` rows of them (its peer holds a full copy); it imports
``--rows`` rows of slots it does not own in 16k-row batches (as a snapshot stream, one
batch every ``--pace-ms``), while its replication thread ships deltas every 200 ms; the
run ends when the peer's copy is current. Reported: CPU seconds of this process (both
PS) from the first import to the end, rows the peer received. Modes alternate, each run
in a fresh process."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def one(mode: str, rows: int, own: int, pace_ms: float) -> dict:
    import numpy as np

    from deeprec_ext import rowwire
    from deeprec_ext.grpc_util import create_server, insecure_channel
    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2 as pb
    from deeprec_ext.proto import ps_pb2_grpc as pbg
    from deeprec_ext.ps.server import ParameterServerServicer

    svcs, servers, addrs = [], [], []
    for name in ("ps-d", "ps-p"):
        svc = ParameterServerServicer(name, migration_share=0.3)
        server, port = create_server("127.0.0.1:0", max_workers=8)
        pbg.add_ParameterServerServicer_to_server(svc, server)
        server.start()
        svcs.append(svc)
        servers.append(server)
        addrs.append(f"127.0.0.1:{port}")
    d, p = svcs
    try:
        stub = pbg.ParameterServerStub(insecure_channel(addrs[0]))
        owned = np.zeros(4096, np.uint8)
        owned[::2] = 1
        stub.SetRouting(pb.SetRoutingRequest(
            epoch=1, owned_slots=owned.tobytes(), num_slots=4096, replica_peer=addrs[1],
            replication_interval_ms=200, ps_id="ps-d"), timeout=30)
        cfg = pb.TableConfig(name="emb", dim=16, initializer_json='{"name": "normal", "seed": 1}',
                             optimizer_json='{"name": "adagrad", "learning_rate": 0.05}')
        stub.CreateTable(pb.CreateTableRequest(config=cfg), timeout=30)
        rng = np.random.default_rng(5)
        ids = np.unique(rng.integers(-2**62, 2**62, 3 * (own + rows)))
        mine = ids[owned[slot_of(ids, 4096)] == 1][:own]
        theirs = ids[owned[slot_of(ids, 4096)] == 0][:rows]
        table = d.store["emb"]
        for i in range(0, mine.size, 200_000):
            table.lookup(mine[i:i + 200_000])
        d.replicator.ship()  # the peer's full copy
        width = table.row_width
        cfg_b = cfg.SerializeToString()
        after = addrs[1] if mode == "ship" else "127.0.0.1:1"  # unchanged peer / another one
        batches = [rowwire.encode(cfg_b, total_rows=rows, replica_after=after)]
        for i in range(0, theirs.size, 1 << 14):
            k = theirs[i:i + (1 << 14)]
            batches.append(rowwire.encode(cfg_b, k, np.full((k.size, width), 0.5, np.float32),
                                          np.ones(k.size, np.uint32), background=True))
        received0 = p.replicas.origins()["ps-d"]["rows"]

        def stream():
            for b in batches:
                yield rowwire.parse(b)
                time.sleep(pace_ms / 1000)
        c0, t0 = time.process_time(), time.monotonic()
        d.ImportRows(stream(), None)
        while d.replicator.lag()["behind_sequence"] > 0 and time.monotonic() - t0 < 120:
            time.sleep(0.02)
        cpu, wall = time.process_time() - c0, time.monotonic() - t0
        copy = p.replicas.origins()["ps-d"]["rows"]
        return {"mode": mode, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "peer_copy_rows_added": int(copy - received0),
                "shipped_rows": int(d.replicator.shipped_rows)}
    finally:
        for svc, server in zip(svcs, servers):
            svc.replicator.close()
            server.stop(0).wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=667_000)
    ap.add_argument("--own", type=int, default=1_333_000)
    ap.add_argument("--pace-ms", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--one", choices=("ship", "hold"))
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.rows, a.own, a.pace_ms)))
        return 0
    runs = []
    for _ in range(a.repeat):
        for mode in ("ship", "hold"):
            r = subprocess.run([sys.executable, __file__, "--one", mode, "--rows", str(a.rows),
                                "--own", str(a.own), "--pace-ms", str(a.pace_ms)],
                               capture_output=True, text=True, timeout=600,
                               env=dict(os.environ, PYTHONPATH=REPO))
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    import statistics
    summary = {m: {k: statistics.median(x[k] for x in runs if x["mode"] == m)
                   for k in ("cpu_s", "wall_s", "peer_copy_rows_added")} for m in ("ship", "hold")}
    print(json.dumps(summary))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "loadavg": os.getloadavg(), "runs": runs,
                       "median": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
