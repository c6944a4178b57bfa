"""In-process cost of a migration pair: the destination's ``import_rows`` of the moving
rows into a fresh table (in MigrateSlots' 16k-row batches, counts included) and the
source's clean-up, ``EmbeddingTable.delete`` of every key of the moving slots in
``--chunk``-key chunks, from a table of ``--rows`` rows.

Compares this checkout with the code of another commit (``--base``, extracted with
``git archive`` into a temporary directory) in one run: each variant runs in its own
subprocess, alternating, ``--repeat`` times; the figures are the medians.

    python bench/bench_drop.py --rows 2000000 --base HEAD~1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(rows: int, chunk: int, seed: int) -> dict:
    import numpy as np

    from deeprec_ext.store import EmbeddingStore
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(-2**62, 2**62, int(rows * 1.01)))[:rows]
    rng.shuffle(ids)
    t = EmbeddingStore().create_table("t", 16, "zeros", {"name": "adagrad", "learning_rate": 0.1})
    for i in range(0, ids.size, 200_000):
        t.lookup(ids[i:i + 200_000], insert_missing=True)
    mask = np.zeros(4096, bool)
    mask[rng.choice(4096, 4096 // 3, replace=False)] = True  # a third moves (2 -> 3 PS)
    t0 = time.perf_counter()
    keys = t.keys_in_slots(mask)
    out = {"rows": rows, "moved": int(keys.size), "chunk": chunk,
           "keys_in_slots_ms": (time.perf_counter() - t0) * 1e3}
    data = rng.random((keys.size, t.row_width + 1), dtype=np.float32)
    dst = EmbeddingStore().create_table("t", 16, "zeros", {"name": "adagrad", "learning_rate": 0.1})
    t0 = time.perf_counter()
    longest = 0.0
    for i in range(0, keys.size, 1 << 14):
        c0 = time.perf_counter()
        dst.import_rows(keys[i:i + (1 << 14)], data[i:i + (1 << 14)])
        longest = max(longest, time.perf_counter() - c0)
    out["import_ms"] = (time.perf_counter() - t0) * 1e3
    out["import_longest_batch_ms"] = longest * 1e3
    assert len(dst) == keys.size
    del dst, data
    t0 = time.perf_counter()
    longest = 0.0
    for i in range(0, keys.size, chunk):
        c0 = time.perf_counter()
        t.delete(keys[i:i + chunk], log_tombstone=False, moved=True)
        longest = max(longest, time.perf_counter() - c0)
    out["delete_ms"] = (time.perf_counter() - t0) * 1e3
    out["longest_chunk_ms"] = longest * 1e3
    out["us_per_key"] = out["delete_ms"] * 1e3 / max(keys.size, 1)
    assert len(t) == rows - keys.size
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--chunk", type=int, default=1 << 16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", default=None, help="commit to compare with")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.rows, args.chunk, args.seed)))
        return 0
    variants = {"this": ROOT}
    tmp = None
    if args.base:
        tmp = tempfile.TemporaryDirectory(prefix="bench-drop-")
        arch = subprocess.run(["git", "-C", ROOT, "archive", args.base, "deeprec_ext"],
                              check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=arch, check=True)
        variants = {"base": tmp.name, "this": ROOT}
    runs: dict[str, list] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for name, path in variants.items():
            env = dict(os.environ, PYTHONPATH=path)
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  "--rows", str(args.rows), "--chunk", str(args.chunk),
                                  "--seed", str(args.seed)],
                                 env=env, check=True, capture_output=True, text=True, timeout=600)
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    import statistics
    summary = {}
    for name, rs in runs.items():
        summary[name] = {k: round(statistics.median(r[k] for r in rs), 2)
                         for k in ("keys_in_slots_ms", "import_ms", "import_longest_batch_ms",
                                   "delete_ms", "longest_chunk_ms", "us_per_key")}
        summary[name]["moved"] = rs[0]["moved"]
    if "base" in summary:
        for k in ("import_ms", "delete_ms"):
            summary[k.replace("_ms", "_speedup")] = round(summary["base"][k] / summary["this"][k], 2)
    summary.update(rows=args.rows, chunk=args.chunk, repeat=args.repeat, base_commit=args.base,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
