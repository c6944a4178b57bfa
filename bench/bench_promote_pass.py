"""Cost of promotion's slot pass: ``EmbeddingTable.adopt_segment`` drops the replica's rows
of slots the dead PS no longer served (one routing-slot hash per replica row, outside the
live table's lock) before the replica's table becomes a segment.

    .venv/bin/python bench/bench_promote_pass.py [--rows 1330000 4000000] [--reps 3]

For each size, a replica table (Adagrad, dim 8, no change tracking, as on a PS) is filled
and adopted by an empty live table, alternately with the pass and with the pass disabled
(what adoption cost before it), ``--reps`` times each in one process: compare the two
columns of one run, not absolute times across runs on a shared machine.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from deeprec_ext.store import EmbeddingStore
from deeprec_ext.store.table import EmbeddingTable


def adopt_ms(n: int, with_pass: bool) -> float:
    keys = np.arange(n, dtype=np.int64) * 7 + 3
    replica = EmbeddingStore(track_changes=False).create_table("e", 8, "zeros", "adagrad")
    for i in range(0, n, 1 << 18):
        replica.lookup(keys[i:i + (1 << 18)])
    live = EmbeddingStore().create_table("e", 8, "zeros", "adagrad")
    real = EmbeddingTable._drop_rows_outside
    if not with_pass:
        EmbeddingTable._drop_rows_outside = lambda self, mask, num_slots: 0
    try:
        t = time.perf_counter()
        assert live.adopt_segment(replica, np.ones(4096, bool), 4096) == n
        return (time.perf_counter() - t) * 1000
    finally:
        EmbeddingTable._drop_rows_outside = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_330_000, 4_000_000])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for n in args.rows:
        out = {"with pass": [], "without": []}
        for _ in range(args.reps):
            out["with pass"].append(round(adopt_ms(n, True), 1))
            out["without"].append(round(adopt_ms(n, False), 1))
        print(f"{n} rows: adopt_segment ms {out}")


if __name__ == "__main__":
    main()
