"""Where a full restore's time goes: the hash index against everything else.

Writes one full checkpoint of a ``--rows`` table (dim 16, Adagrad, as
``bench_checkpoint.py``), then restores it into a new store ``--reps`` times in each of
two modes, alternated:

* ``restore``: as a PS restores, timing the calls that place the keys in the index
  (``HashIndex.place_rows``) apart;
* ``no-index``: the same with ``place_rows`` replaced by a stub that only counts the
  keys. The table is then unusable: an experiment that shows what the restore would
  cost if the index were free (what reading, checking and copying the rows costs).

Prints wall and CPU (this process, every thread) per mode, best and median. On 2 cores
the restore is CPU-bound (the main thread places keys while two threads read chunks),
so the CPU figures say what a faster index could buy.

    .venv/bin/python bench/bench_restore_parts.py [--rows 4000000] [--reps 3]
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
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="", help="where to write (default: a temp dir)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.rows <= 0 or args.reps <= 0:
        print("error: --rows and --reps must be positive", file=sys.stderr)
        return 2

    import numpy as np

    import deeprec_ext.store.hash_index as hi
    from bench_checkpoint import make_table
    from checkpoint import CheckpointWriter, restore
    from deeprec_ext.store import EmbeddingStore

    work = tempfile.mkdtemp(prefix="restore-parts-", dir=args.dir or None)
    try:
        _, table, _ = make_table(args.rows)
        root = os.path.join(work, "ckpt")
        w = CheckpointWriter(root, 1, "full")
        w.write_table("ps-0", table)
        w.commit()
        del table
        gc.collect()
        place = hi.HashIndex.place_rows
        spent = []

        def timed(self, keys, *a, **kw):
            t = time.perf_counter()
            try:
                return place(self, keys, *a, **kw)
            finally:
                spent.append(time.perf_counter() - t)

        def stub(self, keys, *a, **kw):  # counts the keys, places none
            self._size += len(keys)
            return np.empty(0, dtype=np.int64)

        runs = {"restore": [], "no-index": []}
        for i in range(args.reps):
            for mode in runs:
                hi.HashIndex.place_rows = timed if mode == "restore" else stub
                spent.clear()
                gc.collect()
                c0, t0 = _cpu(), time.perf_counter()
                store = EmbeddingStore()
                restore(root, store, upto=1, exact=True)
                wall, cpu = time.perf_counter() - t0, _cpu() - c0
                rows = len(store.get("emb"))
                del store
                hi.HashIndex.place_rows = place
                if rows != args.rows:
                    raise RuntimeError(f"{mode}: restored {rows} rows of {args.rows}")
                runs[mode].append({"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu,
                                   "index_ms": 1e3 * sum(spent), "index_calls": len(spent)})
                print(f"round {i + 1} {mode:9s} wall {1e3 * wall:6.0f} ms  cpu {1e3 * cpu:6.0f} ms"
                      + (f"  in place_rows {1e3 * sum(spent):5.0f} ms ({len(spent)} calls)"
                         if mode == "restore" else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def stat(mode, key):
        v = [r[key] for r in runs[mode]]
        return min(v), statistics.median(v)

    print(f"\n{args.rows:,} rows x dim 16, Adagrad, {args.reps} rounds alternated (best / median):")
    for mode in runs:
        (wb, wm), (cb, cm) = stat(mode, "wall_ms"), stat(mode, "cpu_ms")
        print(f"  {mode:9s} wall {wb:6.0f} / {wm:6.0f} ms   cpu {cb:6.0f} / {cm:6.0f} ms")
    ib, im = stat("restore", "index_ms")
    print(f"  index placement inside the restore: {ib:.0f} / {im:.0f} ms wall; CPU the index "
          f"adds: {stat('restore', 'cpu_ms')[1] - stat('no-index', 'cpu_ms')[1]:.0f} ms (medians)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": args.rows,
                       "cpus": os.cpu_count(), "load": os.getloadavg(), "runs": runs}, f,
                      indent=1)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
