"""What saving the hash index with a full checkpoint costs the write and saves the restore.

Fills a ``--rows`` table (dim 16, Adagrad, as ``bench_checkpoint.py``), then, for
``--reps`` rounds, alternates in this process:

* a full checkpoint (fsync) with the index saved (``<writer>.<table>.index``) and one
  without (``checkpoint.writer.SAVE_INDEX = False``), wall and CPU;
* a restore of each into a new store: the first installs the saved index, the second
  places every key in a fresh one;
* the second again with the key placement (``HashIndex.place_rows``) stubbed out by one
  that only counts the keys: an experiment (that table is unusable) showing what the
  rest of a restore costs (reading, checking and copying the rows, new memory).

Prints best and median of each (wall, and CPU of every thread of this process) and the
ratios (with / without).

    .venv/bin/python bench/bench_saved_index.py [--rows 4000000] [--reps 7]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.rows <= 0 or args.reps <= 0:
        print("error: --rows and --reps must be positive", file=sys.stderr)
        return 2

    import numpy as np

    import checkpoint.writer as cw
    import deeprec_ext.store.hash_index as hi
    from bench_checkpoint import make_table
    from checkpoint import CheckpointWriter, restore
    from deeprec_ext.store import EmbeddingStore

    _, table, _ = make_table(args.rows)
    work = tempfile.mkdtemp(prefix="saved-index-", dir=args.dir or None)
    runs = {k: [] for k in ("write_with", "write_without", "restore_with", "restore_without",
                            "restore_unplaced")}
    place = hi.HashIndex.place_rows

    def stub(self, keys, *a, **kw):  # counts the keys, places none
        self._size += len(keys)
        return np.empty(0, dtype=np.int64)

    def timed_restore(root, key):
        gc.collect()
        c0, t0 = _cpu(), time.perf_counter()
        store = EmbeddingStore()
        restore(root, store, upto=1, exact=True)
        runs[key].append({"ms": 1e3 * (time.perf_counter() - t0),
                          "cpu_ms": 1e3 * (_cpu() - c0)})
        got = len(store.get("emb"))
        del store
        if got != len(table):
            raise RuntimeError(f"{key}: restored {got} rows of {len(table)}")

    try:
        for i in range(args.reps):
            for saved in (True, False):
                tag = "with" if saved else "without"
                root = os.path.join(work, tag)
                shutil.rmtree(root, ignore_errors=True)
                cw.SAVE_INDEX = saved
                gc.collect()
                c0, t0 = _cpu(), time.perf_counter()
                w = CheckpointWriter(root, 1, "full", sync=True)
                w.write_table("ps-0", table)
                w.commit()
                runs[f"write_{tag}"].append({"ms": 1e3 * (time.perf_counter() - t0),
                                             "cpu_ms": 1e3 * (_cpu() - c0)})
                cw.SAVE_INDEX = True
                timed_restore(root, f"restore_{tag}")
            hi.HashIndex.place_rows = stub
            try:
                timed_restore(os.path.join(work, "without"), "restore_unplaced")
            finally:
                hi.HashIndex.place_rows = place
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]['ms']:.0f} ms"
                                                for k, v in runs.items()), flush=True)
    finally:
        cw.SAVE_INDEX = True
        hi.HashIndex.place_rows = place
        shutil.rmtree(work, ignore_errors=True)

    def stat(key, field="ms"):
        v = [r[field] for r in runs[key]]
        return min(v), statistics.median(v)

    print(f"\n{len(table):,} rows x dim 16, Adagrad, {args.reps} rounds alternated "
          "(best / median):")
    for k in runs:
        (b, m), (cb, cm) = stat(k), stat(k, "cpu_ms")
        print(f"  {k:16s} wall {b:6.0f} / {m:6.0f} ms   cpu {cb:6.0f} / {cm:6.0f} ms")
    for what in ("write", "restore"):
        (wb, wm), (ob, om) = stat(f"{what}_with"), stat(f"{what}_without")
        print(f"  {what}: with the saved index / without: {wb / ob:.2f} (best), "
              f"{wm / om:.2f} (median)")
    (ub, um), (ob, om) = stat("restore_unplaced"), stat("restore_without")
    print(f"  restore without the index: keys unplaced / placed: {ub / ob:.2f} (best), "
          f"{um / om:.2f} (median)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": len(table),
                       "cpus": os.cpu_count(), "load": os.getloadavg(), "runs": runs}, f,
                      indent=1)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
