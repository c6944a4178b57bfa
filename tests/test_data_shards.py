"""Byte-range shards: boundaries, resume positions and formats (issue 18).

A shard owns the records that begin in [start, end); whatever the shard size, the union of
all shards' records is the file's records, in order, exactly once.
"""
from __future__ import annotations

import gzip
import json
import os
import random

import numpy as np
import pytest

from aimaster.config import ConfigError, parse_job
from aimaster.shards import (STREAM_END, ShardQueue, detect_format, make_shards,
                             tfrecord_boundaries)
from deeprec_ext.data.ranges import BadInput, read_shard, read_text_range, tfrecord_frame


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _all_records(path, per_shard, fmt="auto"):
    out = []
    for s in make_shards([path], per_shard, fmt=fmt):
        records, next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
        assert len(records) == len(next_pos)
        out += records
    return out


CASES = {
    "plain": (b"aa\nbbb\nc\n", [b"aa", b"bbb", b"c"]),
    "no final newline": (b"aa\nbbb\nc", [b"aa", b"bbb", b"c"]),
    "empty lines": (b"\n\na\n\n\nb\n\n", [b"", b"", b"a", b"", b"", b"b", b""]),
    "crlf": (b"a\r\nbb\r\n\r\nccc\r\n", [b"a", b"bb", b"", b"ccc"]),
    "crlf no final newline": (b"a\r\nbb\r", [b"a", b"bb"]),
    "one record": (b"only\n", [b"only"]),
    "one record no newline": (b"only", [b"only"]),
    "empty file": (b"", []),
    "just a newline": (b"\n", [b""]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_text_every_record_once_for_every_shard_size(tmp_path, name):
    data, expected = CASES[name]
    path = _write(tmp_path / "f.txt", data)
    for per_shard in range(1, len(data) + 3):  # many tiny shards .. one shard
        assert _all_records(path, per_shard) == expected, (per_shard, data)


def test_records_exactly_at_shard_edges(tmp_path):
    # 4-byte records: with 4-byte shards every record begins exactly at a shard start,
    # and the newline of each lies on the byte before the next shard
    path = _write(tmp_path / "f.txt", b"aaa\nbbb\nccc\nddd\n")
    shards = make_shards([path], 4)
    assert [(s.start, s.end) for s in shards] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert [read_text_range(path, s.start, s.end)[0] for s in shards] == \
        [[b"aaa"], [b"bbb"], [b"ccc"], [b"ddd"]]
    # a shard ending one byte into a record finishes that record; the next skips it
    assert read_text_range(path, 0, 5)[0] == [b"aaa", b"bbb"]
    assert read_text_range(path, 5, 16)[0] == [b"ccc", b"ddd"]
    # a shard inside one long record owns nothing
    path = _write(tmp_path / "g.txt", b"x" * 100 + b"\ny\n")
    assert read_text_range(path, 10, 50)[0] == []
    assert _all_records(path, 7) == [b"x" * 100, b"y"]


def test_random_files_and_shard_sizes(tmp_path):
    rng = random.Random(7)
    for trial in range(60):
        recs = [bytes(rng.choice(b"ab,\t") for _ in range(rng.randint(0, 30)))
                for _ in range(rng.randint(1, 40))]
        nl = rng.choice([b"\n", b"\r\n"])
        trailing = rng.random() < 0.7
        data = nl.join(recs) + (nl if trailing else b"")
        # without a final newline, an empty last record is no record
        expected = recs if trailing or recs[-1] else recs[:-1]
        path = _write(tmp_path / f"r{trial}.csv", data)
        assert _all_records(path, rng.randint(1, 50)) == expected


def test_resume_from_each_record_position(tmp_path):
    """A shard handed back after record i resumes at next_pos[i]: it reads records i+1..
    of the shard, no more, no less, whatever the line endings."""
    data = b"first\r\nsecond\n\nfourth\r\nfifth-no-newline"
    path = _write(tmp_path / "f.txt", data)
    for start, end in [(0, len(data)), (3, 20), (7, 30), (0, 8)]:
        records, next_pos = read_text_range(path, start, end)
        for i in range(len(records)):
            rest, _ = read_text_range(path, int(next_pos[i]), end)
            assert rest == records[i + 1:], (start, end, i)
        if records:
            assert next_pos[-1] <= len(data)
    records, next_pos = read_text_range(path, 0, len(data))
    assert next_pos.tolist() == [7, 14, 15, 23, len(data)]


def test_queue_resumes_a_returned_shard_at_its_position(tmp_path):
    path = _write(tmp_path / "f.txt", b"".join(b"record-%03d\n" % i for i in range(100)))
    q = ShardQueue(make_shards([path], 400))
    _, s = q.assign("w0")
    records, next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
    trained = 13
    assert q.give_back("w0", [s.shard_id], {s.shard_id: int(next_pos[trained - 1])}) == [s.shard_id]
    _, again = q.assign("w1")
    assert (again.shard_id, again.start, again.end) == (s.shard_id, int(next_pos[trained - 1]), s.end)
    assert read_shard(again.path, again.start, again.end)[0] == records[trained:]
    # a position outside the hand-out repeats it whole; one at its end completes it
    q.give_back("w1", None, {s.shard_id: 10**9})
    _, third = q.assign("w2")
    assert third.start == again.start
    q.give_back("w2", None, {s.shard_id: s.end})
    assert s.shard_id in q.to_state()["done"]
    # the saved state round-trips, the resume position with it
    q2 = ShardQueue.from_state(json.loads(json.dumps(q.to_state())))
    assert q2.counts() == q.counts()


def test_old_line_range_state_is_refused_clearly():
    old = {"shards": [{"shard_id": 0, "path": "f", "start": 0, "end": 10, "data_epoch": 0}],
           "todo": [0], "doing": {}, "done": [], "resume": {}}
    with pytest.raises(ValueError, match="line-range shards.*older version"):
        ShardQueue.from_state(old)


def test_make_shards_only_stats_text_files(tmp_path, monkeypatch):
    path = _write(tmp_path / "f.txt", b"x\n" * 1000)
    import builtins
    real_open = builtins.open

    def no_read(p, *a, **k):
        assert os.fspath(p) != path, "make_shards opened a text data file"
        return real_open(p, *a, **k)
    monkeypatch.setattr(builtins, "open", no_read)
    shards = make_shards([path], 300, epochs=2)
    assert len(shards) == 2 * 7 and shards[-1].end == 2000 and shards[7].data_epoch == 1


def test_config_bytes_per_shard_and_deprecated_records_per_shard(tmp_path):
    path = _write(tmp_path / "f.txt", b"0123456789\n" * 1000)  # 11 bytes a record
    cfg = parse_job({"data": {"files": [path], "bytes_per_shard": 1000}})
    assert cfg.data.shard_bytes([path]) == 1000
    cfg = parse_job({"data": {"files": [path], "records_per_shard": 100}})
    assert cfg.data.shard_bytes([path]) == 1100  # 100 x the sampled 11 bytes
    assert parse_job({"data": {"files": [path]}}).data.shard_bytes([path]) == 4 << 20
    with pytest.raises(ConfigError, match="not both"):
        parse_job({"data": {"files": [path], "records_per_shard": 1, "bytes_per_shard": 1}})
    with pytest.raises(ConfigError, match="format"):
        parse_job({"data": {"files": [path], "format": "xml"}})


def test_detect_format():
    assert detect_format("a/train.csv") == "text"
    assert detect_format("a/train.tsv.gz") == "text.gz"
    assert detect_format("a/x.tfrecord") == "tfrecord"
    assert detect_format("a/x.tfrecords.gz") == "tfrecord.gz"
    assert detect_format("a/x.parquet") == "parquet"
    assert detect_format("a/x.bin", "tfrecord") == "tfrecord"
    assert detect_format("a/x.bin.gz", "text") == "text.gz"


# -- formats -------------------------------------------------------------------------------
def test_gzip_text_is_one_shard_and_resumes_by_stream_position(tmp_path):
    lines = [b"line %d" % i for i in range(500)]
    path = str(tmp_path / "f.csv.gz")
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    shards = make_shards([path], 100)
    assert [(s.start, s.end, s.format) for s in shards] == [(0, STREAM_END, "text.gz")]
    records, next_pos = read_shard(path, 0, STREAM_END, "text.gz")
    assert records == lines
    assert read_shard(path, int(next_pos[99]), STREAM_END, "text.gz")[0] == lines[100:]


def _tfrecord_bytes(payloads):
    return b"".join(tfrecord_frame(p) for p in payloads)  # with TFRecord's masked CRCs


def test_tfrecord_split_at_record_boundaries(tmp_path):
    payloads = [bytes([i % 251]) * (i % 37) for i in range(300)]
    path = _write(tmp_path / "f.tfrecord", _tfrecord_bytes(payloads))
    for per_shard in (1, 100, 1000, 10**6):
        shards = make_shards([path], per_shard)
        assert all(s.format == "tfrecord" for s in shards)
        got = []
        for s in shards:
            got += read_shard(s.path, s.start, s.end, s.format)[0]
        assert got == payloads, per_shard
    b = tfrecord_boundaries(path, 500)
    assert b[0] == 0 and b[-1] == os.path.getsize(path) and b == sorted(set(b))
    # resume inside a shard from a returned position
    s = make_shards([path], 2000)[1]
    records, next_pos = read_shard(s.path, s.start, s.end, "tfrecord")
    assert read_shard(path, int(next_pos[4]), s.end, "tfrecord")[0] == records[5:]
    # a truncated file still gets shards; the one holding the cut record names it
    bad = _write(tmp_path / "bad.tfrecord", _tfrecord_bytes([b"abc"] * 20)[:-6])
    shards = make_shards([bad], 100)
    assert shards[-1].end == os.path.getsize(bad)
    with pytest.raises(BadInput, match="runs past the end.* at byte 361"):
        read_shard(bad, shards[-1].start, shards[-1].end, "tfrecord")


def test_tfrecord_gzip_one_shard(tmp_path):
    payloads = [b"r%d" % i for i in range(50)]
    path = str(tmp_path / "f.tfrecord.gz")
    with gzip.open(path, "wb") as f:
        f.write(_tfrecord_bytes(payloads))
    (s,) = make_shards([path], 10)
    records, next_pos = read_shard(s.path, s.start, s.end, s.format)
    assert s.format == "tfrecord.gz" and records == payloads
    assert read_shard(path, int(next_pos[9]), STREAM_END, s.format)[0] == payloads[10:]


def test_parquet_split_by_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    n = 1000
    table = pa.table({"label": np.arange(n) % 2, "x": np.arange(n, dtype=np.float64) + 0.5,
                      "c": [None if i % 7 == 0 else f"v{i}" for i in range(n)]})
    path = str(tmp_path / "f.parquet")
    pq.write_table(table, path, row_group_size=128)
    expected = [f"{i % 2}\t{i + 0.5}\t{'' if i % 7 == 0 else f'v{i}'}".encode() for i in range(n)]
    for per_shard in (1, 3000, 10**9):
        shards = make_shards([path], per_shard)
        assert all(s.format == "parquet" and (s.start % 128 == 0) for s in shards)
        got = []
        for s in shards:
            got += read_shard(s.path, s.start, s.end, s.format)[0]
        assert got == expected, per_shard
    assert len(make_shards([path], 1)) == 8  # one row group a shard at least
    records, next_pos = read_shard(path, 0, 256, "parquet")
    assert read_shard(path, int(next_pos[99]), 256, "parquet")[0] == records[100:]


# -- the tf.data reader ------------------------------------------------------------------
def test_tf_record_dataset_matches_the_python_reader(tmp_path):
    import tensorflow as tf
    from deeprec_ext.data.tf_dataset import record_dataset
    # every case in one file each, read as one list of ranges (one pipeline per size)
    paths, expected = [], []
    for i, (name, (data, records)) in enumerate(sorted(CASES.items())):
        paths.append(_write(tmp_path / f"f{i}.txt", data))
        expected += records
    for per_shard in (1, 3, 1000):
        ranges = [(s.path, s.start, s.end) for s in make_shards(paths, per_shard)]
        got = list(record_dataset(ranges).as_numpy_iterator())
        assert got == expected, per_shard
    # TFRecord written by TensorFlow (real CRCs), through the same dataset
    path = str(tmp_path / "f.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for i in range(40):
            w.write(b"p%d" % i)
    ranges = [(s.path, s.start, s.end) for s in make_shards([path], 50)]
    assert len(ranges) > 3
    assert list(record_dataset(ranges, "tfrecord").as_numpy_iterator()) == \
        [r.numpy() for r in tf.data.TFRecordDataset(path)] == [b"p%d" % i for i in range(40)]


def test_tracker_returns_positions_and_completes_empty_shards():
    from deeprec_ext.worker import ShardTracker
    done, back = [], []
    t = ShardTracker(done.extend, lambda ids, pos: back.extend(zip(ids, pos)))
    t.add(1, 3, 0, np.array([5, 9, 14]))
    t.add(2, 0, 14, np.zeros(0, np.int64))       # a range holding no record
    t.add(3, 2, 20, np.array([26, 30]))
    for n in (2, 2):
        t.emitted(n)
    t.advance(0)
    assert done == []                            # shard 2 waits for shard 1
    t.advance(1)
    assert done == []
    t.advance(1)                                 # 4 records: shards 1 and 2 done
    assert done == [1, 2]
    t.finish()                                   # 1 of shard 3's records trained
    assert back == [(3, 26)]
    t = ShardTracker(done.extend, lambda ids, pos: back.extend(zip(ids, pos)))
    t.add(7, 2, 40, np.array([45, 50]))
    t.finish()                                   # nothing trained: its hand-out start
    assert back[-1] == (7, 40)


def test_job_over_every_format_trains_every_record_once(start_job, tmp_path):
    """An AIMaster job over gzip text, CSV with CRLF, TFRecord and Parquet files: the
    counting worker (records are integer ids) pushes +1 per record; every id ends at 1."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from deeprec_ext.client import PSClient
    from tests.conftest import ROOT, wait_for
    per = 3000
    ids = [np.arange(k * per, (k + 1) * per) for k in range(4)]
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(b"".join(b"%d\n" % i for i in ids[0]))
    (tmp_path / "b.csv").write_bytes(b"".join(b"%d\r\n" % i for i in ids[1]))
    (tmp_path / "c.tfrecord").write_bytes(_tfrecord_bytes([b"%d" % i for i in ids[2]]))
    pq.write_table(pa.table({"id": ids[3]}), tmp_path / "d.parquet", row_group_size=500)
    files = [str(tmp_path / n) for n in ("a.txt.gz", "b.csv", "c.tfrecord", "d.parquet")]
    job = start_job({
        "name": "formats", "ps": {"replicas": 1},
        "worker": {"replicas": 2, "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                   "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "500", "PYTHONPATH": str(ROOT),
                           "COUNTING_HOLD_FILE": str(tmp_path / "release")}},
        "data": {"files": files, "bytes_per_shard": 4000},
        "master": {"heartbeat_seconds": 0.5},
    })
    wait_for(lambda: job.status()["shards"]["todo"] == 0 and job.status()["shards"]["doing"] == 0,
             120, "every shard DONE")
    client = PSClient.connect(job.address, timeout=30)
    got = client.lookup("records", np.arange(4 * per, dtype=np.int64), insert_missing=False)[:, 0]
    client.close()
    (tmp_path / "release").write_text("")
    assert job.wait(60) == 0, job.output()[-3000:]
    assert np.bincount(np.clip(got.astype(np.int64), 0, 3), minlength=4).tolist() == [0, 4 * per, 0, 0]
    shards = job.state()["shards"]["shards"]
    formats = {os.path.basename(s["path"]): s["format"] for s in shards}
    assert formats == {"a.txt.gz": "text.gz", "b.csv": "text", "c.tfrecord": "tfrecord",
                       "d.parquet": "parquet"}
    assert sum(1 for s in shards if s["path"].endswith("b.csv")) > 3


def test_tf_reader_cuts_parquet_and_tfrecord_from_one_buffer(tmp_path):
    """Parquet and TFRecord shards reach tf.data as one byte string plus an offset and a
    length per record (``ranges.read_buffer``): a value holding a newline, a tab or a
    trailing ``\\r`` stays inside its record, a NUL byte and an empty record survive, and
    every shard size yields the Python reader's records exactly once."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    import tensorflow as tf

    from deeprec_ext.data.ranges import read_buffer
    from deeprec_ext.data.tf_dataset import record_dataset
    n = 600
    odd = ["a\nb", "tab\there", "cr\r", "", "nul\x00", None]
    table = pa.table({"i": np.arange(n), "s": [odd[i % 6] for i in range(n)]})
    path = str(tmp_path / "f.parquet")
    pq.write_table(table, path, row_group_size=64)
    expected = [b"%d\t%s" % (i, (odd[i % 6] or "").encode()) for i in range(n)]
    payloads = [b"", b"\n", b"x\r", bytes(range(256))] + [b"p%d\n" % i for i in range(200)]
    tpath = _write(tmp_path / "f.tfrecord", _tfrecord_bytes(payloads))
    for p, fmt, want in ((path, "parquet", expected), (tpath, "tfrecord", payloads)):
        for per_shard in (1, 700, 10**9):
            shards = make_shards([p], per_shard)
            ranges = [(s.path, s.start, s.end) for s in shards]
            assert list(record_dataset(ranges, fmt).as_numpy_iterator()) == want, (fmt, per_shard)
            python = [r for s in shards for r in read_shard(s.path, s.start, s.end, fmt)[0]]
            assert python == want
    # the buffer itself: offsets and lengths cut exactly the records
    data, offsets, lengths = read_buffer(path, 64, 128, "parquet")
    assert [data[o:o + k] for o, k in zip(offsets, lengths)] == expected[64:128]
    assert offsets.dtype == lengths.dtype == np.int64
    assert read_buffer(path, 10**6, 10**6 + 5, "parquet")[0] == b""
    # the numpy check of the length CRCs agrees with the C crc32c
    from deeprec_ext.data import ranges as R
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 4096, dtype=np.uint8)
    heads = np.arange(0, 4000, 37)
    assert R._header_crcs(raw, heads).tolist() == [R._crc32c(raw[h:h + 8].tobytes())
                                                   for h in heads]
    assert tf.strings.substr(tf.constant(b""), tf.zeros([0], tf.int64),
                             tf.zeros([0], tf.int64)).shape == [0]


def test_a_range_to_the_end_of_the_file_reads_only_the_file(tmp_path):
    """A range whose end means "to the end" (far past it, as 1 << 40) reads the file's
    bytes, not a buffer of the range's size (that was a MemoryError)."""
    from deeprec_ext.data.fs import RangeFile
    from deeprec_ext.data.ranges import read_shard
    path = _write(tmp_path / "a.txt", b"".join(b"%d\n" % i for i in range(100)))
    records, _ = read_shard(path, 50, 1 << 40, "text")
    assert records[0] == b"20" and records[-1] == b"99"  # "20" begins at byte 50
    with RangeFile(path) as f:
        assert len(f.pread(1 << 40, 0)) == f.size
