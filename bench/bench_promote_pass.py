"""Cost of promotion's slot pass: ``EmbeddingTable.adopt_segment`` drops the replica's rows
of slots the dead PS no longer served before the replica's table becomes a segment.

    .venv/bin/python bench/bench_promote_pass.py [--rows 1330000 4000000] [--reps 3]

For each size, a replica table (Adagrad, dim 8, no change tracking, as on a PS) is filled
and adopted by an empty live table, ``--reps`` times per variant, interleaved, in one
process (compare the columns of one run, not absolute times across runs on a shared
machine):

* ``hash``: a replica without a slot column: every live key is hashed (the pass before
  replicas kept their rows' slots);
* ``column``: a replica that noted each row's slot as it arrived (``track_slots``, as
  replicas on a PS do): no row outside the promoted slots, so the per-slot counts answer;
* ``column, strays``: the same, but 1% of the replica's slots are not promoted (rows its
  origin moved away): the column selects them, nothing is hashed;
* ``no pass``: the pass disabled (what adoption costs without it).

Also printed: the time to fill the replica with and without the column (where the hash
went: onto the replication stream's receiving thread).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from deeprec_ext.hashing import DEFAULT_NUM_SLOTS
from deeprec_ext.store import EmbeddingStore
from deeprec_ext.store.table import EmbeddingTable

NS = DEFAULT_NUM_SLOTS


def fill(n: int, column: bool):
    keys = np.arange(n, dtype=np.int64) * 7 + 3
    store = EmbeddingStore(track_changes=False, track_slots=NS if column else 0)
    replica = store.create_table("e", 8, "zeros", "adagrad")
    rows = np.zeros((1 << 14, replica.row_width + 1), np.float32)
    t = time.perf_counter()
    for i in range(0, n, 1 << 14):  # as replication applies them: import_rows of 16k rows
        k = keys[i:i + (1 << 14)]
        replica.import_rows(k, rows[:k.size])
    return replica, (time.perf_counter() - t) * 1000


def adopt_ms(n: int, variant: str) -> tuple[float, float]:
    replica, fill_ms = fill(n, variant.startswith("column"))
    mask = np.ones(NS, bool)
    if variant == "column, strays":
        mask[::100] = False
    live = EmbeddingStore().create_table("e", 8, "zeros", "adagrad")
    real = EmbeddingTable._drop_rows_outside
    if variant == "no pass":
        EmbeddingTable._drop_rows_outside = lambda self, mask, num_slots: 0
    try:
        t = time.perf_counter()
        got = live.adopt_segment(replica, mask, NS)
        ms = (time.perf_counter() - t) * 1000
    finally:
        EmbeddingTable._drop_rows_outside = real
    assert got == (n if mask.all() else live.size) > 0
    return ms, fill_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_330_000, 4_000_000])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    variants = ["hash", "column", "column, strays", "no pass"]
    for n in args.rows:
        out = {v: [] for v in variants}
        fills = {"without column": [], "with column": []}
        for _ in range(args.reps):
            for v in variants:
                ms, fill_ms = adopt_ms(n, v)
                out[v].append(round(ms, 1))
                if v in ("hash", "column"):
                    fills["with column" if v == "column" else "without column"].append(
                        round(fill_ms))
        print(f"{n} rows: adopt_segment ms {out}")
        print(f"{n} rows: filling the replica ms {fills}")


if __name__ == "__main__":
    main()
