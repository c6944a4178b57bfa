"""Checkpoint benchmark: full vs incremental cost, restore, verify.

    python -m checkpoint.bench [--rows 1000000] [--dim 16] [--touched 0.05] [--reps 3]

One table, Adagrad (row = value + accumulator = 2 * dim floats), one gradient step on
every row. Then a fraction of the rows is touched again and an incremental is written.
Times are wall-clock for write_table + commit (fsync included), best and median of
``--reps``. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from deeprec_ext.store import EmbeddingStore

from checkpoint import CheckpointWriter, list_chains, restore, verify


def _write(root, ckpt_id, table, kind, parent=None, since=None):
    t0 = time.perf_counter()
    w = CheckpointWriter(root, ckpt_id, kind, parent=parent)
    st = w.write_table("ps-0", table, since_seq=since)
    m = w.commit()
    return time.perf_counter() - t0, m["totals"]["bytes"], st


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--touched", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    s = EmbeddingStore()
    t = s.create_table("emb", args.dim, initializer={"name": "normal", "stddev": 0.05},
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
    keys = rng.integers(-2**63, 2**63 - 1, size=args.rows, dtype=np.int64)
    for i in range(0, keys.size, 200_000):
        k = keys[i:i + 200_000]
        t.apply_gradients(k, rng.normal(0, 0.1, (k.size, args.dim)).astype(np.float32))
    try:
        fulls = [_write(root, 1 + i, t, "full") for i in range(args.reps)]
        cut = fulls[-1][2]["cut_seq"]
        parent = args.reps
        touched = keys[rng.choice(keys.size, int(args.touched * keys.size), replace=False)]
        t.apply_gradients(touched, rng.normal(0, 0.1, (touched.size, args.dim))
                          .astype(np.float32))
        incrs = [_write(root, 100 + i, t, "incr", parent=parent, since=cut)
                 for i in range(args.reps)]
        # keep one chain: parent full + first incremental
        for p in root.iterdir():
            if p.name not in (f"ckpt-{parent:08d}-full", "ckpt-00000100-incr"):
                shutil.rmtree(p)
        t0 = time.perf_counter()
        s2 = EmbeddingStore()
        info = restore(root, s2)
        t_restore = time.perf_counter() - t0
        mask = np.arange(4096) * 3 // 4096 == 1
        t0 = time.perf_counter()
        info3 = restore(root, EmbeddingStore(), slot_mask=mask)
        t_restore3 = time.perf_counter() - t0
        t0 = time.perf_counter()
        rep = verify(root)
        t_verify = time.perf_counter() - t0
        assert rep["ok"] and [c.ids for c in list_chains(root)] == [[parent, 100]]
        ft = [f[0] for f in fulls]
        it = [i[0] for i in incrs]
        out = {
            "rows": args.rows, "dim": args.dim, "row_width": t.row_width,
            "touched_rows": int(touched.size),
            "full": {"seconds_best": min(ft), "seconds_median": statistics.median(ft),
                     "bytes": fulls[0][1], "raw_bytes": fulls[0][2]["raw_bytes"]},
            "incr": {"seconds_best": min(it), "seconds_median": statistics.median(it),
                     "bytes": incrs[0][1], "raw_bytes": incrs[0][2]["raw_bytes"],
                     "rows": incrs[0][2]["rows"]},
            "incr_vs_full": {"time_best": min(it) / min(ft),
                             "time_median": statistics.median(it) / statistics.median(ft),
                             "bytes": incrs[0][1] / fulls[0][1]},
            "restore_chain_seconds": t_restore, "restored_rows": len(s2["emb"]),
            "restore_one_of_3_ps_seconds": t_restore3,
            "restore_one_of_3_ps_bytes_read": info3.bytes_read,
            "restore_chain_bytes_read": info.bytes_read,
            "verify_seconds": t_verify,
        }
        print(json.dumps(out, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
