"""In-process A/B of ``parquet_dataset``: the code of an older commit against the
working tree's, alternated with the reference (``TextLineDataset`` + the line parse over
the text files of the same records), over bench_input.py's data (issue 18, item 7).

    python bench/parquet_ab.py [--old 44da183] [--rounds 7] [--mb 32]

The older commit's ``deeprec_ext/data/ranges.py`` and ``tf_dataset.py`` are taken with
``git show`` into a temporary directory and imported beside the current ones, so every
pipeline runs in the same process under the same load; CPU time of this process per
record (all threads), per round and medians. Both pipelines are checked to give the
same batches first."""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def old_module(rev: str, tmp: str):
    """``tf_dataset`` of commit ``rev``, importing that commit's ``ranges``."""
    def show(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout
    with open(os.path.join(tmp, "old_ranges.py"), "w") as f:
        f.write(show("deeprec_ext/data/ranges.py"))
    with open(os.path.join(tmp, "old_tf_dataset.py"), "w") as f:
        f.write(show("deeprec_ext/data/tf_dataset.py").replace(
            "from deeprec_ext.data.ranges import", "from old_ranges import"))
    sys.path.insert(0, tmp)
    # a regular import: autograph converts the old per-shard function as it did
    return importlib.import_module("old_tf_dataset")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="44da183", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--root", default="/tmp/bench-input")
    a = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from aimaster.shards import make_shards
    from bench_input import column_count, make_data, parse_count
    from deeprec_ext.data import tf_dataset as new
    data = make_data(a.root, a.mb, a.files, 20000)
    ranges = [(s.path, s.start, s.end) for s in make_shards(data["parquet"], 4 << 20,
                                                            fmt="parquet")]
    with tempfile.TemporaryDirectory() as tmp:
        old = old_module(a.old, tmp)
        first = [list(m.parquet_dataset(ranges, 4096).as_numpy_iterator()) for m in (old, new)]
        assert len(first[0]) == len(first[1]) and all(
            x[k].dtype == y[k].dtype and (x[k] == y[k]).all()
            for x, y in zip(*first) for k in x), "old and new batches differ"
        records = sum(len(b["label"]) for b in first[1])
        runs = {"reference": lambda: parse_count(tf.data.TextLineDataset(data["text"])),
                f"old ({a.old})": lambda: column_count(old.parquet_dataset(ranges, 4096)),
                "new": lambda: column_count(new.parquet_dataset(ranges, 4096))}
        cpu = {k: [] for k in runs}
        for fn in runs.values():
            assert fn() == records  # warm: imports, page cache
        print(f"{records} records, {len(ranges)} shards; load {os.getloadavg()[0]:.2f}",
              flush=True)
        for _ in range(a.rounds):
            for k, fn in runs.items():
                c = time.process_time()
                fn()
                cpu[k].append((time.process_time() - c) / records * 1e6)
    ref = cpu["reference"]
    for k, v in cpu.items():
        print(f"{k:22s} us CPU/record: median {statistics.median(v):.3f}, best {min(v):.3f}; "
              + " ".join(f"{x:.2f}" for x in v))
        if k != "reference":
            pairs = [r / x for r, x in zip(ref, v)]
            print(f"{'':22s} x reference per round " + " ".join(f"{p:.2f}" for p in pairs)
                  + f"; of the medians {statistics.median(ref) / statistics.median(v):.3f}")
    o, n = list(cpu.values())[1:]
    print("old / new CPU per round: " + " ".join(f"{x / y:.2f}" for x, y in zip(o, n))
          + f"; load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
