"""Per-interval cost of peer replication's delta export: "rows changed since the last
shipment" read from the change log (O(rows changed)) vs a scan of the table (what every
interval cost before the change log).

    .venv/bin/python bench/bench_replication_delta.py [--rows 4000000] [--dim 16]
        [--touch 0.001] [--intervals 20]

One Adagrad table of ``--rows`` keys is filled, then each interval pushes gradients to a
random ``--touch`` fraction of the rows and builds the delta the replicator ships
(``Replicator._delta_batches``: tombstones, changed rows with their counts, encoded as
RowBatch messages). Printed side by side, per interval (median and max):

  change log   the table as the PS has it (change log on)
  scan         the same table without a change log (``track_changes=False``), which
               falls back to comparing every row's sequence number: the previous cost
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deeprec_ext.ps.replication import Replicator  # noqa: E402
from deeprec_ext.store import EmbeddingStore  # noqa: E402


def run(track: bool, rows: int, dim: int, touch: float, intervals: int, seed: int = 0) -> dict:
    store = EmbeddingStore(track_changes=track)
    t = store.create_table("emb", dim, initializer={"name": "normal", "stddev": 0.05},
                           optimizer={"name": "adagrad", "learning_rate": 0.05})
    keys = np.arange(rows, dtype=np.int64) * 7919 + 13
    for i in range(0, rows, 1 << 20):
        t.lookup(keys[i:i + (1 << 20)])
    rep = Replicator(store, {})
    rep.close()  # no background thread: the bench calls the export itself
    rep.origin = "ps-0"
    rep._known_tables = {"emb"}
    rng = np.random.default_rng(seed)
    n = max(1, int(rows * touch))
    since = store.sequence.value
    store.set_consumer("replica", since)
    times, sent = [], []
    for _ in range(intervals):
        sel = keys[rng.choice(rows, n, replace=False)]
        t.apply_gradients(sel, rng.normal(0, 0.1, (n, dim)).astype(np.float32))
        t0 = time.perf_counter()
        batches = rep._delta_batches(since)
        times.append(time.perf_counter() - t0)
        sent.append(sum(len(b.ids) // 8 for b in batches))
        since = store.sequence.value
        store.set_consumer("replica", since)
    return {"ms": np.array(times) * 1000, "rows": int(np.median(sent))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--touch", type=float, default=0.001)
    ap.add_argument("--intervals", type=int, default=20)
    args = ap.parse_args()
    print(f"delta export per interval: {args.rows:,} rows, dim {args.dim}, Adagrad, "
          f"{args.touch:.2%} of the rows touched per interval")
    out = {}
    for name, track in (("change log", True), ("scan", False)):
        out[name] = run(track, args.rows, args.dim, args.touch, args.intervals)
    print(f"{'':12} {'rows sent':>10} {'median ms':>10} {'max ms':>8}")
    for name, r in out.items():
        print(f"{name:12} {r['rows']:10d} {np.median(r['ms']):10.2f} {r['ms'].max():8.2f}")
    print(f"speed-up: {np.median(out['scan']['ms']) / np.median(out['change log']['ms']):.1f}x")


if __name__ == "__main__":
    main()
