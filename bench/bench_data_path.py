"""Data path: byte-range shards vs line ranges (issue 18).

    python bench/bench_data_path.py --file /tmp/data-bench/train-500mb.txt [--make-mb 500]

1. Time to the first record of a 4 MiB shard at the start of the file and near its end:
   - old: ``TextLineDataset(path).skip(start_line).take(n)`` (examples/criteo/reader.py
     before) and the worker's old Python ``LineCursor`` (reads lines from the top);
   - ``FixedLengthRecordDataset(header_bytes=start)`` (why it is not used: it reads
     through the skipped bytes);
   - new: ``deeprec_ext.data.ranges.read_shard`` (worker) and
     ``deeprec_ext.data.tf_dataset.record_dataset`` (tf.data).
2. Records/s over the first ``--throughput-mb`` MB: ``TextLineDataset`` (old) vs ``record_dataset`` over
   4 MiB byte shards vs ``read_shard`` per shard (Python worker path).
Each time is the median of ``--repeat`` runs (page cache warm: the file is read once first).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def make_file(path: str, mb: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        written = 0
        while written < mb << 20:
            n = 20000
            cols = [rng.integers(0, 2, n).astype(str)]
            cols += [rng.integers(0, 1000, n).astype(str) for _ in range(13)]
            cols += [np.char.mod("%08x", rng.integers(0, 2**32, n)) for _ in range(26)]
            lines = ["\t".join(r) for r in zip(*cols)]
            b = ("\n".join(lines) + "\n").encode()
            f.write(b)
            written += len(b)


def median_time(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def old_line_cursor_first(path: str, start_line: int) -> bytes:
    with open(path, "rb") as fh:  # what LineCursor did for a shard of a fresh file
        for _ in itertools.islice(fh, start_line):
            pass
        return next(fh).rstrip(b"\r\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--make-mb", type=int, default=0, help="write the file first (MB)")
    ap.add_argument("--shard-bytes", type=int, default=4 << 20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--throughput-mb", type=int, default=100,
                    help="records/s over the shards holding the first this many MB")
    a = ap.parse_args()
    if a.make_mb and not os.path.exists(a.file):
        make_file(a.file, a.make_mb)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from aimaster.shards import count_records, make_shards
    from deeprec_ext.data.ranges import read_shard
    from deeprec_ext.data.tf_dataset import record_dataset

    path, size = a.file, os.path.getsize(a.file)
    t = time.perf_counter()
    lines = count_records(path)  # also warms the page cache
    count_s = time.perf_counter() - t
    t = time.perf_counter()
    shards = make_shards([path], a.shard_bytes)
    make_s = time.perf_counter() - t
    per_line = size / lines
    print(f"file {path}: {size / 1e6:.0f} MB, {lines} lines ({per_line:.0f} B/line), "
          f"{len(shards)} shards of {a.shard_bytes} B")
    print(f"shard creation: old (count every line) {count_s:.3f} s, new (stat) {make_s * 1e3:.2f} ms")

    first, last = shards[0], shards[-2]  # a full shard near the end
    last_line = int(last.start / per_line)
    n_lines = int(a.shard_bytes / per_line)
    print("\ntime to the first record of a shard (median of %d), start vs near the end "
          "(byte %d, line ~%d):" % (a.repeat, last.start, last_line))
    rows = [
        ("old TextLineDataset.skip(line).take(n)",
         lambda s, ln: next(iter(tf.data.TextLineDataset(path).skip(ln).take(n_lines)))),
        ("old LineCursor (Python, from the top)", lambda s, ln: old_line_cursor_first(path, ln)),
        ("FixedLengthRecordDataset(header_bytes)",
         lambda s, ln: next(iter(tf.data.FixedLengthRecordDataset(
             path, record_bytes=s.end - s.start, header_bytes=s.start,
             footer_bytes=size - s.end)))),
        ("new read_shard (pread + split)", lambda s, ln: read_shard(path, s.start, s.end)[0][0]),
        ("new record_dataset (tf.data)",
         lambda s, ln: next(iter(record_dataset([(path, s.start, s.end)])))),
    ]
    for name, fn in rows:
        fn(first, 0)  # warm up (graph building, imports)
        t0 = median_time(lambda: fn(first, 0), a.repeat)
        t1 = median_time(lambda: fn(last, last_line), a.repeat)
        print(f"  {name:42s} start {t0 * 1e3:8.1f} ms   end {t1 * 1e3:8.1f} ms")

    some = shards[:max(1, (a.throughput_mb << 20) // a.shard_bytes)]
    ranges = [(s.path, s.start, s.end) for s in some]
    n = sum(len(read_shard(path, s.start, s.end, s.format, s.size)[0]) for s in some)
    print("\nrecords/s over the first %d shards (%d records, %.0f MB; median of %d):"
          % (len(some), n, some[-1].end / 1e6, a.repeat))

    def count(ds):  # batched, so the count does not cost a step per record
        return ds.batch(4096).reduce(np.int64(0), lambda c, x: c + tf.size(x, tf.int64)).numpy()

    def python_path():
        return sum(len(read_shard(path, s.start, s.end, s.format, s.size)[0]) for s in some)

    for name, fn in [("old TextLineDataset(path).take(n)",
                      lambda: count(tf.data.TextLineDataset(path).take(n))),
                     ("new record_dataset(byte shards)", lambda: count(record_dataset(ranges))),
                     ("new read_shard per shard (Python worker)", python_path)]:
        assert fn() == n, name
        dt = median_time(fn, a.repeat)
        print(f"  {name:42s} {n / dt / 1e6:6.2f} M records/s ({dt:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
