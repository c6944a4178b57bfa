"""In-process A/B of the TFRecord input path (``record_dataset(..., "tfrecord")``): the
code of an older commit against the working tree's, local files and a local S3 server in
one process, alternated with TensorFlow's reader (issue 18, item 7).

    python bench/tfrecord_ab.py [--old b295bd4] [--rounds 7] [--mb 32]

The older commit's ``deeprec_ext/data/fs.py``, ``ranges.py`` and ``tf_dataset.py`` are
imported beside the current ones (``parquet_ab.old_module``). Every round runs, in this
order: the reference (``TFRecordDataset`` over the local files, the target of both the
local and the S3 row of bench_input.py), the old and the new pipeline over the local
files, the old and the new pipeline over the same files on a local S3 server (moto's
server mode in a subprocess, its CPU not counted), and the parts without tf.data: the
shards' bytes alone (``pread``, ``fs._s3_get``) and read + framing + CRCs
(``tfrecord_buffer``), old and new, local and S3. All pipelines are checked to give the
same records first. CPU time of this process per record (all threads), medians."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="b295bd4", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--shard-bytes", type=int, default=4 << 20)
    ap.add_argument("--root", default="/tmp/bench-input")
    a = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from bench_input import S3Server, upload
    with S3Server():
        return run(a, upload)


def run(a, upload) -> int:
    import tensorflow as tf

    from aimaster.shards import make_shards
    from bench_input import make_data, parse_count
    from deeprec_ext.data import fs as new_fs
    from deeprec_ext.data import ranges as new_ranges
    from deeprec_ext.data import tf_dataset as new
    from parquet_ab import old_module
    data = make_data(a.root, a.mb, a.files, 20000)
    local = data["tfrecord"]
    remote = upload({"tfrecord": local})["tfrecord"]
    lr = [(s.path, s.start, s.end) for s in make_shards(local, a.shard_bytes, fmt="tfrecord")]
    sr = [(s.path, s.start, s.end) for s in make_shards(remote, a.shard_bytes, fmt="tfrecord")]
    with tempfile.TemporaryDirectory() as tmp:
        old = old_module(a.old, tmp)
        import old_fs
        import old_ranges
        want = list(tf.data.TFRecordDataset(local).as_numpy_iterator())
        for mod in (old, new):
            for rs in (lr, sr):
                assert list(mod.record_dataset(rs, "tfrecord").as_numpy_iterator()) == want
        records = len(want)

        def pipeline(mod, rs):
            return lambda: parse_count(mod.record_dataset(rs, "tfrecord"))

        def pread():
            for p, s, e in lr:
                with new_fs.RangeFile(p) as f:
                    f.pread(e - s, s)

        def get(mod):
            def f():
                for p, s, e in sr:
                    mod._s3_get(p, s, e)
            return f

        def buffers(mod, rs):
            def f():
                for p, s, e in rs:
                    mod.tfrecord_buffer(p, s, e)
            return f
        runs = {"reference TFRecordDataset": lambda: parse_count(tf.data.TFRecordDataset(local)),
                f"old local ({a.old})": pipeline(old, lr), "new local": pipeline(new, lr),
                f"old S3 ({a.old})": pipeline(old, sr), "new S3": pipeline(new, sr),
                "bytes: pread": pread, "bytes: old _s3_get": get(old_fs),
                "bytes: new _s3_get": get(new_fs),
                "read+frame: old local": buffers(old_ranges, lr),
                "read+frame: new local": buffers(new_ranges, lr),
                "read+frame: old S3": buffers(old_ranges, sr),
                "read+frame: new S3": buffers(new_ranges, sr)}
        for fn in runs.values():
            fn()  # warm: tracing, connections, page cache
        cpu = {k: [] for k in runs}
        print(f"{records} records, {len(lr)} shards; load {os.getloadavg()[0]:.2f}", flush=True)
        for _ in range(a.rounds):
            for k, fn in runs.items():
                c = time.process_time()
                fn()
                cpu[k].append((time.process_time() - c) / records * 1e6)
    ref = cpu["reference TFRecordDataset"]
    for k, v in cpu.items():
        line = (f"{k:30s} us CPU/record: median {statistics.median(v):.3f}, best {min(v):.3f}; "
                + " ".join(f"{x:.2f}" for x in v))
        if k.startswith(("old ", "new ")):
            pairs = [r / x for r, x in zip(ref, v)]
            line += (f"\n{'':30s} x reference per round " + " ".join(f"{p:.2f}" for p in pairs)
                     + f"; of the medians {statistics.median(ref) / statistics.median(v):.3f}")
        print(line)
    for o, n in (("old local", "new local"), ("old S3", "new S3")):
        o = next(k for k in cpu if k.startswith(o))
        print(f"{o} / {n}, CPU per round: "
              + " ".join(f"{x / y:.2f}" for x, y in zip(cpu[o], cpu[n])))
    print("new S3 less new local, us/record per round: "
          + " ".join(f"{x - y:.3f}" for x, y in zip(cpu["new S3"], cpu["new local"])))
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
