"""Peak extra memory and lookup latency while a PS writes a full checkpoint of a large
table (numpy + zstandard, one process per measurement so RSS is not shared).

    .venv/bin/python bench/bench_checkpoint_memory.py [--rows 4000000] [--dim 16]
        [--writers streaming,copy] [--lookup-batch 1000]

For each writer, a fresh process fills one Adagrad table with ``--rows`` keys, then writes
a full checkpoint while a second thread looks up ``--lookup-batch`` random existing keys in
a loop. It reports:

  table MB        ``EmbeddingTable.nbytes`` (arena, per-row arrays, hash index)
  peak extra MB   highest RSS during the write minus RSS just before it (sampled every
                  2 ms), and as a percentage of the table
  write s         time of ``CheckpointWriter.write_table``
  lookups         lookups served during the write; p50 / p99 / max latency in ms

Writers: ``streaming`` is ``checkpoint.writer`` as it is now (a slot-sorted plan of 8
bytes per row, then chunks read under short table-lock holds and compressed while the
next is read); ``copy`` is the writer of commit 8f0adb3, which exported the whole table
into memory (sliced, then concatenated and sorted) before writing it.
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
sys.path.insert(0, ROOT)

OLD_COMMIT = "8f0adb3"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _writer_class(kind: str):
    if kind == "streaming":
        from checkpoint import CheckpointWriter
        return CheckpointWriter
    # the writer before streaming, loaded from git into a module of its own
    from bench.bench_checkpoint import old_writer_class
    return old_writer_class(OLD_COMMIT)


def measure(kind: str, rows: int, dim: int, lookup_batch: int) -> dict:
    """One measurement, in this process."""
    from deeprec_ext.store import EmbeddingTable
    writer_cls = _writer_class(kind)
    t = EmbeddingTable("emb", dim, initializer={"name": "normal", "stddev": 0.05},
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
    keys = np.arange(rows, dtype=np.int64) * 7919 + 13
    for i in range(0, rows, 1 << 20):
        t.lookup(keys[i:i + (1 << 20)])
    rng = np.random.default_rng(0)
    root = tempfile.mkdtemp(prefix="ckpt-mem-")
    import gc
    gc.collect()
    base = _rss()
    peak = [base]
    lat: list[float] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    def lookups():
        while not stop.is_set():
            q = keys[rng.integers(0, rows, lookup_batch)]
            t0 = time.perf_counter()
            t.lookup(q, insert_missing=False)
            lat.append(time.perf_counter() - t0)
            time.sleep(0.001)

    threads = [threading.Thread(target=sample, daemon=True),
               threading.Thread(target=lookups, daemon=True)]
    for th in threads:
        th.start()
    time.sleep(0.2)
    lat.clear()
    w = writer_cls(root, 1, "full")
    t0 = time.perf_counter()
    stats = w.write_table("ps-0", t)
    seconds = time.perf_counter() - t0
    n_lat = len(lat)
    stop.set()
    for th in threads:
        th.join()
    w.commit()
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    ms = np.array(lat[:n_lat]) * 1000 if n_lat else np.zeros(1)
    return {"writer": kind, "rows": rows, "written": stats["rows"],
            "table_mb": t.nbytes / 2**20, "peak_extra_mb": (peak[0] - base) / 2**20,
            "peak_extra_pct": 100 * (peak[0] - base) / t.nbytes, "write_s": seconds,
            "lookups": n_lat, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--writers", default="streaming,copy")
    ap.add_argument("--lookup-batch", type=int, default=1000)
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rows, args.dim, args.lookup_batch)))
        return
    print(f"full checkpoint of one table: {args.rows:,} rows, dim {args.dim}, Adagrad")
    print(f"{'writer':10} {'table MB':>9} {'peak extra MB':>14} {'% of table':>10} "
          f"{'write s':>8} {'lookups':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    for kind in args.writers.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--rows", str(args.rows),
                              "--dim", str(args.dim), "--lookup-batch", str(args.lookup_batch)],
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            raise SystemExit(1)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{kind:10} {r['table_mb']:9.0f} {r['peak_extra_mb']:14.1f} "
              f"{r['peak_extra_pct']:9.1f}% {r['write_s']:8.2f} {r['lookups']:8d} "
              f"{r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['max_ms']:7.1f}")


if __name__ == "__main__":
    main()
