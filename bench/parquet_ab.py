"""In-process A/B of ``parquet_dataset``: the code of an older commit against the
working tree's, alternated with the reference (``TextLineDataset`` + the line parse over
the text files of the same records), over bench_input.py's data (issue 18, item 7).

    python bench/parquet_ab.py [--old 44da183] [--rounds 7] [--mb 32] [--s3]

The older commit's ``deeprec_ext/data/ranges.py``, ``tf_dataset.py`` and ``fs.py`` are
taken with ``git show`` into a temporary directory and imported beside the current ones,
so every pipeline runs in the same process under the same load; CPU time of this process
per record (all threads), per round and medians. Both pipelines are checked to give the
same batches first. ``--s3``: both read the same objects from a local S3 server
(bench_input.py's: moto's server mode in a subprocess, its CPU not counted), the
reference reads the local text files as in bench_input.py's S3 rows."""
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
    with open(os.path.join(tmp, "old_fs.py"), "w") as f:
        f.write(show("deeprec_ext/data/fs.py"))
    with open(os.path.join(tmp, "old_ranges.py"), "w") as f:
        # the old file-system layer too: its S3 client and its caches are the old ones
        f.write(show("deeprec_ext/data/ranges.py").replace(
            "from deeprec_ext.data import fs\n", "import old_fs as fs\n"))
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
    ap.add_argument("--s3", action="store_true",
                    help="read the Parquet files from a local S3 server")
    a = ap.parse_args()
    if a.s3:
        from bench_input import S3Server, upload
        with S3Server():
            return run(a, upload)
    return run(a, None)


def run(a, upload) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from aimaster.shards import make_shards
    from bench_input import column_count, make_data, parse_count
    from deeprec_ext.data import tf_dataset as new
    data = make_data(a.root, a.mb, a.files, 20000)
    files = upload({"parquet": data["parquet"]})["parquet"] if upload else data["parquet"]
    ranges = [(s.path, s.start, s.end) for s in make_shards(files, 4 << 20, fmt="parquet")]
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
        if upload:
            # the shards' reads and decode alone (no tf.data): old and new over the same
            # objects, and the new code over the local files (what S3 still adds)
            import old_ranges

            from deeprec_ext.data import ranges as new_ranges
            kinds = new_ranges.parquet_kinds(files[0])
            local = [(p, s, e) for p, (_, s, e) in zip(
                [data["parquet"][files.index(r[0])] for r in ranges], ranges)]

            def tables(mod, rs):
                return lambda: sum(mod.parquet_table(*r, list(kinds)).num_rows for r in rs)
            runs.update({"old read+decode": tables(old_ranges, ranges),
                         "new read+decode": tables(new_ranges, ranges),
                         "new read+decode, local": tables(new_ranges, local)})
        cpu = {k: [] for k in runs}
        for fn in runs.values():
            assert fn() == records  # warm: imports, page cache
        print(f"{records} records, {len(ranges)} shards{' on S3' if upload else ''}; "
              f"load {os.getloadavg()[0]:.2f}",
              flush=True)
        for _ in range(a.rounds):
            for k, fn in runs.items():
                c = time.process_time()
                fn()
                cpu[k].append((time.process_time() - c) / records * 1e6)
    ref = cpu["reference"]
    for k, v in cpu.items():
        print(f"{k:24s} us CPU/record: median {statistics.median(v):.3f}, best {min(v):.3f}; "
              + " ".join(f"{x:.2f}" for x in v))
        if k in list(runs)[1:3]:
            pairs = [r / x for r, x in zip(ref, v)]
            print(f"{'':24s} x reference per round " + " ".join(f"{p:.2f}" for p in pairs)
                  + f"; of the medians {statistics.median(ref) / statistics.median(v):.3f}")
    for o, n in ((1, 2), (3, 4))[:len(cpu) // 3]:
        o, n = list(cpu)[o], list(cpu)[n]
        print(f"{o} / {n}, CPU per round: "
              + " ".join(f"{x / y:.2f}" for x, y in zip(cpu[o], cpu[n])))
    if len(cpu) > 5:
        print("S3 less local, new read+decode, us/record per round: " + " ".join(
            f"{x - y:.3f}" for x, y in zip(cpu["new read+decode"], cpu["new read+decode, local"])))
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
