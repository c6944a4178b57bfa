"""Real processes: a source PS exports a snapshot of a third of its slots to a destination
PS (``MigrateSlots`` -> ``ImportRows``, paced by ``--migration-share`` as in a job) while a
client looks up 4096 of its keys back to back (a training step's lookups). Variants differ
in the PS processes' extra arguments (``--variants``, ``;``-separated, e.g. a switch
interval); each runs in fresh processes, alternating, ``--repeat`` times; medians of the
lookup latency during the snapshot and of its duration.

    python bench/bench_migration_serving.py --rows 1000000 \
        --variants "--switch-interval-ms 5;--switch-interval-ms 1" --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_SLOTS = 4096


def start_ps(tmp: str, name: str, extra: list, share: float):
    port_file = os.path.join(tmp, f"{name}.port")
    proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--port", "0", "--port-file",
                             port_file, "--migration-share", str(share), *extra],
                            env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(port_file) and open(port_file).read().strip():
            return proc, f"127.0.0.1:{int(open(port_file).read().strip())}"
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not start")


def run(rows: int, variant: str, share: float, seed: int) -> dict:
    import grpc

    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2 as pb
    from deeprec_ext.proto import ps_pb2_grpc as pbg
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.unique(rng.integers(-2**62, 2**62, int(rows * 1.01)))[:rows])
    mask = np.zeros(NUM_SLOTS, np.uint8)
    mask[rng.choice(NUM_SLOTS, NUM_SLOTS // 3, replace=False)] = 1
    cfg = pb.TableConfig(name="emb", dim=16, initializer_json=json.dumps({"name": "normal", "seed": 1}),
                         optimizer_json=json.dumps({"name": "adagrad", "learning_rate": 0.05}))
    opts = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            src, sa = start_ps(tmp, "src", variant.split(), share)
            procs.append(src)
            dst, da = start_ps(tmp, "dst", variant.split(), share)
            procs.append(dst)
            s = pbg.ParameterServerStub(grpc.insecure_channel(sa, opts))
            s.CreateTable(pb.CreateTableRequest(config=cfg), timeout=60)
            for i in range(0, ids.size, 200_000):
                s.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=ids[i:i + 200_000].tobytes())],
                                          insert_missing=True), timeout=120)
            moving = int(np.count_nonzero(mask[slot_of(ids, NUM_SLOTS)]))
            lat, stop = [], threading.Event()

            def load():
                r = np.random.default_rng(seed + 1)
                while not stop.is_set():
                    q = ids[r.integers(0, ids.size, 4096)]
                    t0 = time.perf_counter()
                    s.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=q.tobytes())]),
                             timeout=60)
                    lat.append((t0, (time.perf_counter() - t0) * 1e3))
            th = threading.Thread(target=load)
            th.start()
            time.sleep(1.0)
            t0 = time.perf_counter()
            r = s.MigrateSlots(pb.MigrateSlotsRequest(dst_address=da, slots=mask.tobytes(),
                                                      num_slots=NUM_SLOTS, since_seq=-1), timeout=600)
            t1 = time.perf_counter()
            time.sleep(1.0)
            stop.set()
            th.join()
            if r.rows != moving:
                raise AssertionError(f"moved {r.rows} rows, expected {moving}")
            before = np.array([d for t, d in lat if t < t0 - 0.05])
            during = np.array([d for t, d in lat if t0 <= t < t1])
            return {"variant": variant, "snapshot_ms": (t1 - t0) * 1e3, "moved_rows": moving,
                    "before_p50_ms": float(np.median(before)), "before_p99_ms": float(np.percentile(before, 99)),
                    "during_lookups_per_s": during.size / (t1 - t0),
                    "before_lookups_per_s": before.size / 0.95,
                    "during_p50_ms": float(np.median(during)), "during_p99_ms": float(np.percentile(during, 99)),
                    "during_max_ms": float(during.max())}
        finally:
            for p in procs:
                p.kill()
                p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--variants", default="--switch-interval-ms 5;--switch-interval-ms 1")
    ap.add_argument("--share", type=float, default=0.3, help="the PS's --migration-share (its default)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(";")]
    runs = {v: [] for v in variants}
    for i in range(a.repeat):
        for v in variants:
            runs[v].append(run(a.rows, v, a.share, a.seed))
            print(f"run {i + 1} [{v}]: " + json.dumps({k: round(x, 2) if isinstance(x, float) else x
                                                          for k, x in runs[v][-1].items()}), flush=True)
    keys = [k for k in runs[variants[0]][0] if k not in ("variant", "moved_rows")]
    med = {v: {k: round(float(np.median([r[k] for r in rs])), 2) for k in keys} for v, rs in runs.items()}
    print("\nmedians:")
    for v, m in med.items():
        print(f"  [{v}]: {m}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg": os.getloadavg(),
                       "rows": a.rows, "share": a.share, "runs": runs, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
