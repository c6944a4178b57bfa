"""Microbenchmark of the PS embedding store (numpy only). Prints keys/s.

    .venv/bin/python bench/bench_store_micro.py [--rows 1000000] [--batch 100000] [--dim 8]

Measures, on a table pre-filled with ``--rows`` keys:
  fill from empty        lookup(insert_missing=True) of all ``--rows`` keys into an empty
                         table, batch by batch (amortizes index rehash + arena growth)
  insert() over existing insert() of values for keys already present
  lookup existing        lookup() of a batch of keys already in the table
  lookup+insert new      lookup(insert_missing=True) of a batch of never-seen keys
  insert new (values)    insert() of a batch of never-seen keys with given values
  apply_gradients        apply_gradients() on existing keys (unique / with duplicates)
  index find             HashIndex.find alone

Each line shows the median batch rate and, in parentheses, total keys / total time
(which includes the occasional doubling of the hash index or the arena).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deeprec_ext.store import EmbeddingTable  # noqa: E402


def _rate(fn, batch: int, repeat: int) -> tuple[float, float]:
    """(median, overall) keys/s; 'overall' includes occasional index/arena growth."""
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return batch / float(np.median(times)), batch * repeat / float(np.sum(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--optimizers", default="sgd,adagrad,adam")
    ap.add_argument("--initializers", default="zeros,normal")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, b, dim, rep = args.rows, args.batch, args.dim, args.repeat
    keys = rng.integers(-2**63, 2**63 - 1, size=n, dtype=np.int64)
    vals = rng.standard_normal((n, dim)).astype(np.float32)
    print(f"table rows={n:,} batch={b:,} dim={dim} (median of {rep} batches; M keys/s)")
    for opt in args.optimizers.split(","):
        for init in args.initializers.split(","):
            t = EmbeddingTable("bench", dim, initializer=init, optimizer=opt)
            t0 = time.perf_counter()
            for s in range(0, n, b):
                t.lookup(keys[s:s + b])  # fill from empty: includes every growth step
            fill = n / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for s in range(0, n, b):
                t.insert(keys[s:s + b], vals[s:s + b])
            overwrite = n / (time.perf_counter() - t0)
            q = [rng.choice(keys, b) for _ in range(rep)]
            new = [rng.integers(-2**63, 2**63 - 1, size=b, dtype=np.int64) for _ in range(2 * rep)]
            g = rng.standard_normal((b, dim)).astype(np.float32) * 1e-3
            qu = [rng.permutation(keys)[:b] for _ in range(rep)]
            res = {
                "index find": _rate(lambda i: t._index.find(q[i]), b, rep),
                "lookup existing": _rate(lambda i: t.lookup(q[i]), b, rep),
                "lookup(insert_missing=False) new": _rate(
                    lambda i: t.lookup(new[i], insert_missing=False), b, rep),
                "lookup+insert new": _rate(lambda i: t.lookup(new[i]), b, rep),
                "insert new (values)": _rate(lambda i: t.insert(new[rep + i], g), b, rep),
                "apply_gradients unique": _rate(lambda i: t.apply_gradients(qu[i], g), b, rep),
                "apply_gradients w/ dups": _rate(lambda i: t.apply_gradients(q[i], g), b, rep),
            }
            print(f"-- optimizer={opt} initializer={init} row_width={t.row_width} "
                  f"size={t.size:,} MB={t.nbytes / 2**20:.0f}")
            print(f"   {'fill from empty (lookup+insert)':34s} {fill / 1e6:7.2f} M keys/s  (amortized)")
            print(f"   {'insert() over existing keys':34s} {overwrite / 1e6:7.2f} M keys/s")
            for k, (med, overall) in res.items():
                print(f"   {k:34s} {med / 1e6:7.2f} M keys/s  ({overall / 1e6:6.2f})")


if __name__ == "__main__":
    main()
