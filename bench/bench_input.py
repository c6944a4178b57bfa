"""Input pipeline alone (read + parse, no training), issue 18 item 7.

    python bench/bench_input.py [--quick] [--mb 32] [--big-mb 2048] [--no-s3]
                                [--rates-only] [--formats tfrecord,parquet]

1. Records/s and CPU time per record of the input pipeline over byte/row-range shards
   (``aimaster.shards.make_shards``) for text, gzip text, TFRecord and Parquet, from local
   disk and from a local S3 server (moto's server mode on a free 127.0.0.1 port). Text,
   gzip and TFRecord: ``record_dataset`` and the line parse (batches of 4096 records,
   ``tf.strings.split(batch, "\\t")``, counted with ``reduce``); Parquet: typed columns
   (``parquet_dataset``, batches of 4096: decoding is the parse). The target's reference
   is TensorFlow's own reader of the format (``TextLineDataset``, with ``"GZIP"`` for
   gzip, ``TFRecordDataset``) over the same files, or for S3 rows over the local copies
   of the objects (this TensorFlow has no s3:// file system), and a plain
   ``TextLineDataset`` over the text files of the same records for Parquet (TensorFlow
   has no Parquet reader), with the line parse; the plain text reader is also given for
   every row as information. Reference runs alternate with ours, so all see the same
   load (the target's reference next to ours, before it in even rounds and after it in
   odd ones; every pipeline run once before timing).
2. Read amplification (bytes read by all workers / bytes of the files) with 1, 2 and 4
   workers: shards dealt round-robin, every worker a fresh subprocess reading its shards
   with ``read_shard`` (the worker's path). Local files: ``/proc/self/io`` ``rchar``
   delta around the reads of each format. S3: bytes returned by ``fs._s3_get`` (ranged
   reads) and s3fs's ``_cat_file`` and ``S3File._fetch_range`` (sockets are not counted
   by ``rchar``), wrapped in the worker.
3. Time to the first record of a 4 MiB shard at the start and at the end of a big text
   file (2 GB by default; made by repeating the generated text: the records repeat).

Data: criteo-like TSV (label, 13 ints, 26 hex categoricals), the same records written as
text, gzip text, TFRecord (one line per record) and Parquet (several row groups), split
into ``--files`` files (the parts hold the same records: bench_data_path's generator has
a fixed seed), cached under /tmp/bench-input/ keyed by size.
Output: a table with PASS/MISS per target and JSON (``--out``).
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

FORMATS = ("text", "text.gz", "tfrecord", "parquet")
# rate rows: the formats, plus Parquet read as text lines (the form a line parse_fn takes)
PIPELINES = FORMATS + ("parquet.lines",)
EXT = {"text": ".txt", "text.gz": ".txt.gz", "tfrecord": ".tfrecord", "parquet": ".parquet"}
BUCKET = "bench-input"
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1"}
RATE_TARGET, AMP_TARGET, TTFR_TARGET = 0.9, 1.05, 1.5


# ---------------------------------------------------------------- data

def make_data(root: str, mb: int, files: int, row_group: int) -> dict[str, list[str]]:
    """The same records in every format, ``files`` files each; made once per size."""
    from bench_data_path import make_file
    d = os.path.join(root, f"{mb}mb-{files}f")
    out = {f: [os.path.join(d, f"part-{i}{EXT[f]}") for i in range(files)] for f in FORMATS}
    done = os.path.join(d, "DONE")
    if os.path.exists(done):
        return out
    os.makedirs(d, exist_ok=True)
    import tensorflow as tf

    from examples.criteo.reader import tsv_to_parquet
    for i in range(files):
        txt = out["text"][i]
        make_file(txt, max(1, mb // files))
        with open(txt, "rb") as f:
            data = f.read()
        with gzip.open(out["text.gz"][i], "wb", compresslevel=6) as g:
            g.write(data)
        with tf.io.TFRecordWriter(out["tfrecord"][i]) as w:
            for line in data.splitlines():
                w.write(line)
        tsv_to_parquet(txt, out["parquet"][i], row_group_size=row_group, missing_as_null=False)
    open(done, "w").close()
    return out


def make_big(root: str, mb: int, seed_file: str) -> str:
    """A text file of ``mb`` MB made by repeating ``seed_file`` (whole lines)."""
    path = os.path.join(root, f"big-{mb}mb.txt")
    if os.path.exists(path) and os.path.getsize(path) >= mb << 20:
        return path
    with open(seed_file, "rb") as f:
        block = f.read()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        written = 0
        while written < mb << 20:
            f.write(block)
            written += len(block)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- S3 server

class S3Server:
    """moto's server mode in a subprocess on a free 127.0.0.1 port (its CPU is not counted
    in the pipeline's process time); the AWS_* variables are set for this process and its
    children while it runs."""

    def __enter__(self):
        import urllib.request
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        self.saved = {k: os.environ.get(k) for k in [*AWS, "AWS_ENDPOINT_URL"]}
        os.environ.update(AWS, AWS_ENDPOINT_URL=url)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def upload(data: dict[str, list[str]]) -> dict[str, list[str]]:
    from deeprec_ext.data import fs
    s3, _ = fs.filesystem(f"s3://{BUCKET}")
    s3.mkdir(BUCKET)
    out = {}
    for fmt, paths in data.items():
        out[fmt] = []
        for p in paths:
            url = f"s3://{BUCKET}/{os.path.basename(p)}"
            s3.put_file(p, url)
            out[fmt].append(url)
    return out


# ---------------------------------------------------------------- rates

def median_time(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process: every thread, TensorFlow's and
    pyarrow's included, result) of one call."""
    c, t = time.process_time(), time.perf_counter()
    result = fn()
    return time.perf_counter() - t, time.process_time() - c, result


def parse_count(ds):
    """The same parse on every line pipeline: batches split into fields, rows counted."""
    import numpy as np
    import tensorflow as tf
    ds = ds.batch(4096).map(lambda x: tf.strings.split(x, "\t"),
                            num_parallel_calls=tf.data.AUTOTUNE)
    return int(ds.reduce(np.int64(0), lambda c, r: c + r.nrows(out_type=tf.int64)).numpy())


def column_count(ds):
    """Rows of a columnar pipeline (batches of typed columns: decoding is its parse)."""
    import numpy as np
    import tensorflow as tf
    return int(ds.reduce(np.int64(0),
                         lambda c, b: c + tf.shape(b["label"], out_type=tf.int64)[0]).numpy())


def native_dataset(fmt: str, paths: list[str]):
    """TensorFlow's own reader of ``fmt`` (None: it has none)."""
    import tensorflow as tf
    if fmt == "text":
        return tf.data.TextLineDataset(paths)
    if fmt == "text.gz":
        return tf.data.TextLineDataset(paths, compression_type="GZIP")
    if fmt == "tfrecord":
        return tf.data.TFRecordDataset(paths)
    return None  # no Parquet reader in TensorFlow


REF_NAMES = {"text": "TextLineDataset", "text.gz": 'TextLineDataset("GZIP")',
             "tfrecord": "TFRecordDataset"}


def references(fmt: str, where: str, local) -> list[tuple[str, str, object]]:
    """``(role, name, fn)`` of the pipelines ``fmt`` is compared with, over the local files
    (same records; TensorFlow here has no s3:// file system). ``target``: TensorFlow's own
    reader of the format over the same files, local or the local copies of the S3 objects
    (text, gzip, TFRecord: what reading that format costs TensorFlow, so an S3 row
    measures what remote storage adds), else the plain ``TextLineDataset`` over the text
    files of the same records (Parquet: TensorFlow has no reader of it). ``plain``: that
    plain text reader, as information, for every row whose target is another pipeline."""
    import tensorflow as tf
    plain = ("plain", "TextLineDataset", lambda: parse_count(tf.data.TextLineDataset(local["text"])))
    if fmt in REF_NAMES:
        name = REF_NAMES[fmt] + (" same files" if where == "local" else " local copies")
        if fmt == "text":
            return [("target", name, plain[2])]
        return [("target", name, lambda: parse_count(native_dataset(fmt, local[fmt]))), plain]
    return [("target", "TextLineDataset of the text files", plain[2])]


def ours(fmt: str, ranges):
    """Our pipeline: Parquet as typed columns (``parquet_dataset``), the rest as lines
    (``record_dataset``) with the line parse."""
    from deeprec_ext.data.tf_dataset import parquet_dataset, record_dataset
    if fmt == "parquet":
        return lambda: column_count(parquet_dataset(ranges, 4096))
    if fmt == "parquet.lines":
        return lambda: parse_count(record_dataset(ranges, "parquet"))
    return lambda: parse_count(record_dataset(ranges, fmt))


def rates(data, where: str, shard_bytes: int, repeat: int, records: int, local,
          formats=FORMATS) -> list[dict]:
    """Per format: our runs alternate with the reference pipelines (``references``), so all
    see the same load, the target's reference next to ours and before it in every other
    round; every pipeline run once before timing; medians of ``repeat`` each, of the wall
    time and of this process's CPU time (less sensitive to other jobs on the machine than
    the wall time)."""
    from aimaster.shards import make_shards
    rows = []
    for fmt in formats:
        base = fmt.split(".lines")[0]
        shards = make_shards(data[base], shard_bytes, fmt=base)
        ranges = [(s.path, s.start, s.end) for s in shards]
        run = ours(fmt, ranges)
        refs = references(fmt, where, local)
        # the target's reference runs next to ours, before it in even rounds and after it
        # in odd ones: no pipeline always follows the other (whatever one leaves behind,
        # TensorFlow's spinning pool threads, a drift of the load, falls on both)
        order = [(role, fn) for role, _, fn in refs[::-1]] + [("ours", run)]
        for _, fn in order:
            fn()  # warm every pipeline: graph tracing, imports, page cache, connections
        wall = {role: [] for role, _ in order}
        cpu = {role: [] for role, _ in order}
        for k in range(repeat):
            for role, fn in order if k % 2 == 0 else order[::-1]:
                t, c, n = timed(fn)
                assert n == records, (fmt, where, role, n, records)
                wall[role].append(t)
                cpu[role].append(c)
        med = {k: statistics.median(v) for k, v in cpu.items()}
        medw = {k: statistics.median(v) for k, v in wall.items()}
        row = {"format": fmt, "where": where, "shards": len(shards), "records": records,
               "pipeline": "parquet_dataset (typed columns)" if fmt == "parquet"
               else "record_dataset + line parse",  # parquet.lines too
               "references": {role: name for role, name, _ in refs},
               "seconds": medw["ours"], "records_per_s": records / medw["ours"],
               "cpu_us_per_record": med["ours"] / records * 1e6,
               "wall_seconds_all": wall, "cpu_seconds_all": cpu}
        for role, _, _ in refs:
            row[f"{role}_cpu_us_per_record"] = med[role] / records * 1e6
            row[f"{role}_records_per_s"] = records / medw[role]
            row[f"x_{role}_cpu"] = med[role] / med["ours"]
            row[f"x_{role}_cpu_pairs"] = [r / o for r, o in zip(cpu[role], cpu["ours"])]
            row[f"x_{role}_wall"] = medw[role] / medw["ours"]
        if "plain" not in row["references"]:  # the target is the plain text reader
            row["x_plain_cpu"] = row["x_target_cpu"]
        if fmt in REF_NAMES:  # the target is TensorFlow's reader of the format
            row["x_native_cpu"] = row["x_target_cpu"]
        rows.append(row)
        print(f"  {where:5s} {fmt:8s} {records / medw['ours'] / 1e6:6.3f} M records/s, "
              f"{row['cpu_us_per_record']:5.2f} us CPU/record; " + "; ".join(
                  f"{role} {name}: {row[role + '_cpu_us_per_record']:5.2f} us CPU/record, "
                  f"x {row['x_' + role + '_cpu']:.2f}" for role, name, _ in refs), flush=True)
    return rows


# ---------------------------------------------------------------- read amplification

def reader_main(spec: str) -> int:
    """A worker subprocess: reads its shards of every format, prints bytes read."""
    job = json.loads(spec)
    import importlib
    for mod in ("zlib", "gzip", "pyarrow", "pyarrow.compute", "pyarrow.parquet", "fsspec"):
        importlib.import_module(mod)  # before counting: rchar counts what imports read
    from deeprec_ext.data.ranges import read_shard
    counted = [0]
    if job["remote"]:
        import s3fs.core as c
        orig_cat, orig_fetch = c.S3FileSystem._cat_file, c.S3File._fetch_range

        async def cat(self, path, *a, **k):
            d = await orig_cat(self, path, *a, **k)
            counted[0] += len(d)
            return d

        def fetch(self, start, end):
            d = orig_fetch(self, start, end)
            counted[0] += len(d)
            return d
        c.S3FileSystem._cat_file, c.S3File._fetch_range = cat, fetch
        from deeprec_ext.data import fs as _fs
        orig_get = _fs._s3_get  # ranged reads: botocore's client

        def get(url, start, end):
            d = orig_get(url, start, end)
            counted[0] += len(d)
            return d
        _fs._s3_get = get

    def rchar() -> int:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
        return 0

    out = {}
    for fmt, shards in job["shards"].items():
        counted[0] = 0
        r0 = rchar()
        n = 0
        for path, start, end, size in shards:
            n += len(read_shard(path, start, end, fmt, size)[0])
        r1 = rchar()
        out[fmt] = {"bytes": counted[0] if job["remote"] else r1 - r0, "records": n}
    print(json.dumps(out))
    return 0


def amplification(data, where: str, shard_bytes: int, workers=(1, 2, 4)) -> list[dict]:
    from aimaster.shards import make_shards
    from deeprec_ext.data import fs
    remote = where == "s3"
    rows = []
    for w in workers:
        jobs = [{"remote": remote, "shards": {}} for _ in range(w)]
        for fmt in FORMATS:
            shards = make_shards(data[fmt], shard_bytes, fmt=fmt)
            for i, s in enumerate(shards):
                jobs[i % w]["shards"].setdefault(fmt, []).append([s.path, s.start, s.end, s.size])
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_reader",
                                   json.dumps(j)], stdout=subprocess.PIPE) for j in jobs]
        outs = [p.communicate()[0] for p in procs]  # every reader waited for, even on failure
        failed = [p.returncode for p in procs if p.returncode]
        if failed:
            raise RuntimeError(f"reader subprocess failed (exit codes {failed})")
        results = [json.loads(o.decode().strip().splitlines()[-1]) for o in outs]
        for fmt in FORMATS:
            total = sum(fs.size(p) for p in data[fmt])
            read = sum(r.get(fmt, {}).get("bytes", 0) for r in results)
            busy = sum(1 for r in results if fmt in r)
            rows.append({"format": fmt, "where": where, "workers": w, "workers_with_shards": busy,
                         "bytes_read": read, "file_bytes": total, "amplification": read / total,
                         "counted_by": "fs._s3_get + s3fs _cat_file/_fetch_range bytes" if remote
                         else "/proc/self/io rchar delta"})
            print(f"  {where:5s} {fmt:8s} W={w}: {read / total:.4f}", flush=True)
    return rows


# ---------------------------------------------------------------- time to first record

def first_record(big: str, shard_bytes: int, repeat: int) -> list[dict]:
    from aimaster.shards import make_shards
    from deeprec_ext.data.ranges import read_shard
    from deeprec_ext.data.tf_dataset import record_dataset
    shards = make_shards([big], shard_bytes)
    first, last = shards[0], shards[-1]
    readers = [
        ("read_shard (worker path)", lambda s: read_shard(big, s.start, s.end, "text", s.size)[0][0]),
        ("record_dataset (tf.data, built each time)",
         lambda s: next(iter(record_dataset([(big, s.start, s.end)])))),
    ]
    rows = []
    for name, fn in readers:
        fn(first)  # warm up imports and graph building
        t0, _ = median_time(lambda: fn(first), repeat)
        t1, _ = median_time(lambda: fn(last), repeat)
        rows.append({"reader": name, "start_s": t0, "end_s": t1, "end_byte": last.start,
                     "file_bytes": os.path.getsize(big)})
        print(f"  {name:42s} start {t0 * 1e3:7.1f} ms  end {t1 * 1e3:7.1f} ms", flush=True)
    return rows


# ---------------------------------------------------------------- main

def loadavg() -> float:
    return os.getloadavg()[0]


def table(res: dict) -> str:
    lines = ["x target: the target reference's CPU time per record / ours (this process, all "
             "threads), alternated runs, medians; reference: TensorFlow's own reader of the "
             "format over the same files (S3 rows: the local copies of the objects) for text, "
             "gzip and TFRecord (= x native), else TextLineDataset over the text files of "
             "the same records (Parquet)",
             "x plain: against TextLineDataset over the local text files (information)", "",
             f"{'input rate':22s} {'M rec/s':>8s} {'us CPU/rec':>10s} {'target ref':>38s} "
             f"{'ref us':>6s} {'x target':>8s} {'x plain':>7s} {'x native':>8s} {'x wall':>6s}"
             f"  target >= {RATE_TARGET} (CPU)"]
    for r in res["rates"]:
        opt = lambda k: f"{r[k]:.2f}" if k in r else "n/a"  # noqa: E731
        x = r["x_target_cpu"]
        lines.append(f"  {r['where'] + ' ' + r['format']:20s} {r['records_per_s'] / 1e6:8.3f} "
                     f"{r['cpu_us_per_record']:10.2f} {r['references']['target']:>38s} "
                     f"{r['target_cpu_us_per_record']:6.2f} {x:8.2f} {opt('x_plain_cpu'):>7s} "
                     f"{opt('x_native_cpu'):>8s} {r['x_target_wall']:6.2f}  "
                     f"{'PASS' if x >= RATE_TARGET else 'MISS'}")
    lines += ["", f"{'read amplification':28s} {'W=1':>7s} {'W=2':>7s} {'W=4':>7s}  target <= {AMP_TARGET}"]
    by = {}
    for r in res["amplification"]:
        by.setdefault((r["where"], r["format"]), {})[r["workers"]] = r["amplification"]
    for (where, fmt), amps in by.items():
        worst = max(amps.values())
        lines.append(f"  {where + ' ' + fmt:26s} " + " ".join(f"{amps.get(w, float('nan')):7.4f}"
                                                           for w in (1, 2, 4))
                     + f"  {'PASS' if worst <= AMP_TARGET else 'MISS'}")
    lines += ["", f"{'time to first record':42s} {'start':>8s} {'end':>8s}  target end/start <= "
              f"{TTFR_TARGET} (or within 10 ms)"]
    for r in res["first_record"]:
        ok = r["end_s"] <= TTFR_TARGET * r["start_s"] or r["end_s"] - r["start_s"] <= 0.010
        lines.append(f"  {r['reader']:40s} {r['start_s'] * 1e3:6.1f}ms {r['end_s'] * 1e3:6.1f}ms  "
                     f"{'PASS' if ok else 'MISS'}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 MB of records, a 256 MB big file")
    ap.add_argument("--mb", type=int, default=32, help="MB of text records (per format)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--big-mb", type=int, default=2048, help="the file for time to first record")
    ap.add_argument("--shard-bytes", type=int, default=4 << 20)
    ap.add_argument("--row-group", type=int, default=20000, help="Parquet rows per row group")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--root", default="/tmp/bench-input")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--rates-only", action="store_true",
                    help="input rates only (no read amplification, no time to first record)")
    ap.add_argument("--formats", default=",".join(PIPELINES),
                    help="rate rows: formats, and parquet.lines (Parquet as text lines)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "input.json"))
    ap.add_argument("--_reader", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._reader:
        return reader_main(a._reader)
    if a.quick:
        a.mb, a.big_mb = 8, 256
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    res = {"args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
           "load_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    t = time.perf_counter()
    data = make_data(a.root, a.mb, a.files, a.row_group)
    big = None if a.rates_only else make_big(a.root, a.big_mb, data["text"][0])
    print(f"data: {a.files} files per format in {os.path.dirname(data['text'][0])}"
          + (f", big file {big} ({os.path.getsize(big) / 1e9:.2f} GB)" if big else "")
          + f", ready in {time.perf_counter() - t:.1f} s; load {loadavg():.2f}", flush=True)
    import tensorflow as tf
    from deeprec_ext.data import fs
    records = parse_count(tf.data.TextLineDataset(data["text"]))
    res["data"] = {f: {"files": ps, "bytes": sum(fs.size(p) for p in ps)} for f, ps in data.items()}
    res["records"] = records
    print(f"{records} records per format", flush=True)
    formats = tuple(f for f in a.formats.split(",") if f)
    assert set(formats) <= set(PIPELINES), formats

    print("records/s (read + parse), median of %d:" % a.repeat, flush=True)
    res["rates"] = rates(data, "local", a.shard_bytes, a.repeat, records, data, formats)
    res["amplification"], res["first_record"] = [], []
    if not a.rates_only:
        print("read amplification:", flush=True)
        res["amplification"] += amplification(data, "local", a.shard_bytes)
    if not a.no_s3:
        with S3Server():
            t = time.perf_counter()
            remote = upload(data)
            print(f"uploaded to the local S3 server in {time.perf_counter() - t:.1f} s", flush=True)
            res["rates"] += rates(remote, "s3", a.shard_bytes, a.repeat, records, data, formats)
            if not a.rates_only:
                res["amplification"] += amplification(remote, "s3", a.shard_bytes)
    if not a.rates_only:
        print("time to first record of a %d B shard, median of %d:" % (a.shard_bytes, a.repeat),
              flush=True)
        res["first_record"] = first_record(big, a.shard_bytes, a.repeat)
    res["load_end"] = os.getloadavg()
    print()
    print(table(res))
    print(f"\nload average: start {res['load_start'][0]:.2f}, end {res['load_end'][0]:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
