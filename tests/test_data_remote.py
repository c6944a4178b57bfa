"""Data files on S3 (issue 18, item 3): a real S3-compatible server (moto's server mode on
a free 127.0.0.1 port) holds text, gzip, TFRecord and Parquet files; shards are listed,
sized and read through the file-system layer (fsspec), every record exactly once."""
from __future__ import annotations

import gzip
import io
import logging
import os
import socket

import numpy as np
import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from aimaster.shards import make_shards  # noqa: E402
from deeprec_ext.data import fs  # noqa: E402
from deeprec_ext.data.ranges import read_shard  # noqa: E402

BUCKET = "deeprec-data"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """The server's endpoint, with the AWS_* variables set for this process and its
    children (the AIMaster and workers of a job inherit them)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        s3fs_, _ = fs.filesystem(f"s3://{BUCKET}")
        # moto's store is per process, not per server: another module's server (the
        # checkpoint tests use this fixture too) may have left the bucket behind
        if not s3fs_.exists(BUCKET):
            s3fs_.mkdir(BUCKET)
        yield s3fs_
        s3fs_.rm(BUCKET, recursive=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _tfrecords(payloads) -> bytes:
    """TFRecord bytes written by TensorFlow (real masked-crc32c CRCs)."""
    import tempfile

    import tensorflow as tf
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for p in payloads:
                w.write(p)
        with open(path, "rb") as f:
            return f.read()


def _upload(s3, prefix: str, per: int = 600) -> dict[str, list[bytes]]:
    """One file of each format; records are decimal ids, unique across files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    ids = [np.arange(k * per, (k + 1) * per) for k in range(5)]
    files = {
        "a.csv": (b"".join(b"%d\r\n" % i for i in ids[0]), ids[0]),
        "b.txt.gz": (gzip.compress(b"".join(b"%d\n" % i for i in ids[1])), ids[1]),
        "c.tfrecord": (_tfrecords([b"%d" % i for i in ids[2]]), ids[2]),
        "d.tfrecord.gz": (gzip.compress(_tfrecords([b"%d" % i for i in ids[3]])), ids[3]),
    }
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids[4]}), buf, row_group_size=100)
    files["e.parquet"] = (buf.getvalue(), ids[4])
    out = {}
    for name, (data, idx) in files.items():
        s3.pipe(f"{BUCKET}/{prefix}/{name}", data)
        out[f"s3://{BUCKET}/{prefix}/{name}"] = [b"%d" % i for i in idx]
    return out


def test_s3_every_format_every_record_once_and_resume(s3):
    expected = _upload(s3, "formats")
    files = fs.glob(f"s3://{BUCKET}/formats/*")
    assert files == sorted(expected)
    assert fs.size(files[0]) == len(s3.cat_file(files[0]))
    for per_shard in (700, 10**6):
        shards = make_shards(files, per_shard)
        got = {p: [] for p in files}
        for s in shards:
            records, next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
            assert len(records) == len(next_pos)
            got[s.path] += records
        assert got == expected, per_shard
    assert len([s for s in make_shards(files, 700) if s.path.endswith("a.csv")]) > 3
    # a shard handed back mid-way resumes at a byte (row) offset, no record twice
    for s in make_shards(files, 700)[1::3]:
        records, next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
        if len(records) > 3:
            rest, _ = read_shard(s.path, int(next_pos[2]), s.end, s.format, s.size)
            assert rest == records[3:], s


def test_s3_tf_data_reader(s3):
    from deeprec_ext.data.tf_dataset import record_dataset
    expected = _upload(s3, "tfdata", per=200)
    for name, fmt in (("a.csv", "text"), ("c.tfrecord", "tfrecord"), ("e.parquet", "parquet")):
        path = f"s3://{BUCKET}/tfdata/{name}"
        ranges = [(s.path, s.start, s.end) for s in make_shards([path], 300)]
        assert len(ranges) >= 2
        assert list(record_dataset(ranges, fmt).as_numpy_iterator()) == expected[path], name
    # Parquet as typed columns, from the same server
    from deeprec_ext.data.tf_dataset import parquet_dataset
    path = f"s3://{BUCKET}/tfdata/e.parquet"
    ranges = [(s.path, s.start, s.end) for s in make_shards([path], 300)]
    got = [int(i) for b in parquet_dataset(ranges, 64).as_numpy_iterator() for i in b["id"]]
    assert [b"%d" % i for i in got] == expected[path]
    rest = [int(i) for b in parquet_dataset([(path, 150, 200)], 64).as_numpy_iterator()
            for i in b["id"]]
    assert [b"%d" % i for i in rest] == expected[path][150:]


def test_s3_ranges_without_the_size(s3):
    """The tf.data reader does not ask a remote file's size (one ranged GET reads a shard
    and its tail, a short read tells the end): a file ending exactly where that read ends,
    without a newline, and a range starting at the end still read right."""
    from deeprec_ext.data.ranges import text_body
    from deeprec_ext.data.tf_dataset import record_dataset
    size = 5 + fs._TAIL
    s3.pipe(f"{BUCKET}/nosize/long.txt", b"x" * size)
    s3.pipe(f"{BUCKET}/nosize/short.txt", b"ab\ncd\nef")
    url = f"s3://{BUCKET}/nosize/"
    assert text_body(url + "long.txt", 0, 5) == (b"x" * size, True)
    assert text_body(url + "long.txt", 5, size) == (b"", False)
    assert list(record_dataset([(url + "long.txt", 0, 5), (url + "long.txt", 5, size),
                                (url + "short.txt", 0, 4), (url + "short.txt", 4, 8),
                                (url + "short.txt", 8, 100)]).as_numpy_iterator()) == \
        [b"x" * size, b"ab", b"cd", b"ef"]
    with fs.RangeFile(url + "short.txt") as f:
        assert f.pread(10, 6) == b"ef" and f.size == 8 and f.pread(4, 8) == b""
    with fs.RangeFile(url + "short.txt") as f:
        assert f.pread(4, 8) == b"" and f.size == 8


def test_job_reads_s3_globs_every_record_once(s3, start_job, tmp_path):
    """An AIMaster job whose data.files is an s3:// glob; two counting workers (records are
    ids, +1 pushed per record): every id ends at exactly 1."""
    from deeprec_ext.client import PSClient
    from tests.conftest import ROOT, wait_for
    expected = _upload(s3, "job", per=1000)
    n = sum(len(v) for v in expected.values())
    job = start_job({
        "name": "s3data", "ps": {"replicas": 1},
        "worker": {"replicas": 2, "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                   "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "300", "PYTHONPATH": str(ROOT),
                           "COUNTING_HOLD_FILE": str(tmp_path / "release")}},
        "data": {"files": [f"s3://{BUCKET}/job/*.csv", f"s3://{BUCKET}/job/*.gz",
                           f"s3://{BUCKET}/job/*.tfrecord", f"s3://{BUCKET}/job/*.parquet"],
                 "bytes_per_shard": 1500},
        "master": {"heartbeat_seconds": 0.5},
    })
    wait_for(lambda: job.status()["shards"]["todo"] == 0 and job.status()["shards"]["doing"] == 0,
             120, "every shard DONE")
    client = PSClient.connect(job.address, timeout=30)
    got = client.lookup("records", np.arange(n, dtype=np.int64), insert_missing=False)[:, 0]
    client.close()
    (tmp_path / "release").write_text("")
    assert job.wait(60) == 0, job.output()[-3000:]
    assert np.bincount(np.clip(got.astype(np.int64), 0, 3), minlength=4).tolist() == [0, n, 0, 0]
    paths = {s["path"] for s in job.state()["shards"]["shards"]}
    assert paths == set(expected)


def test_watch_over_s3_takes_new_objects(s3, tmp_path):
    """The AIMaster's watcher (one listing at a time, in process) over an s3:// glob: an
    object uploaded after the job started becomes shards after two listings that agree,
    once; the listing is not served from a stale cache."""
    from aimaster.config import parse_job
    from aimaster.master import JobMaster
    s3.pipe(f"{BUCKET}/watch/a.txt", b"".join(b"%d\n" % i for i in range(100)))
    cfg = parse_job({"data": {"files": [f"s3://{BUCKET}/watch/*.txt"], "watch": True,
                              "bytes_per_shard": 100},
                     "master": {"state_dir": str(tmp_path / "state")}})
    m = JobMaster(cfg)
    try:
        assert m.shards.streaming and m.shards.paths() == {f"s3://{BUCKET}/watch/a.txt"}
        n0 = len(m.shards.all_shards())
        pending = m.poll_files({})
        assert pending == {}
        s3.pipe(f"{BUCKET}/watch/b.txt", b"".join(b"%d\n" % i for i in range(100, 150)))
        pending = m.poll_files(pending)                      # seen once: not taken yet
        assert pending == {f"s3://{BUCKET}/watch/b.txt": 200} and len(m.shards.all_shards()) == n0
        pending = m.poll_files(pending)                      # same size again: taken
        assert pending == {}
        new = [s for s in m.shards.all_shards() if s.path.endswith("b.txt")]
        got = []
        for s in new:
            got += read_shard(s.path, s.start, s.end, s.format, s.size)[0]
        assert got == [b"%d" % i for i in range(100, 150)]
        assert m.poll_files({}) == {} and len(m.shards.all_shards()) == n0 + len(new)
        assert m.store.load()["shards"]["files"] == sorted(m.shards.paths())
    finally:
        m.shutdown()


def test_unlistable_url_is_a_config_error():
    from aimaster.config import ConfigError, parse_job
    for url, why in (("nosuch://b/x*.csv", "nosuch"), ("gs://b/x*.csv", "gs:")):
        cfg = parse_job({"data": {"files": [url]}})
        with pytest.raises(ConfigError, match=f"data.files: cannot list .*{why}"):
            cfg.data.resolved_files()


def test_s3_parquet_later_shards_are_one_request(s3, monkeypatch):
    """A remote Parquet file's footer is kept after its first shard: each later shard is
    one ranged GET (no HEAD, no footer read, no s3fs request), and reads the same rows."""
    from deeprec_ext.data import ranges
    expected = _upload(s3, "pqreq", per=1000)
    path = f"s3://{BUCKET}/pqreq/e.parquet"
    ranges._PQ_META.pop(path, None)
    calls = []
    for name in ("cat_file", "size", "info", "open"):  # the requests a reader can make
        orig = getattr(s3, name)

        def counted(*a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(*a, **k)
        monkeypatch.setattr(s3, name, counted)
    orig_get = fs._s3_get  # ranged reads go through botocore's client, not s3fs

    def get(*a, **k):
        calls.append("get")
        return orig_get(*a, **k)
    monkeypatch.setattr(fs, "_s3_get", get)
    shards = make_shards([path], 1)  # one row group (100 rows) a shard
    calls.clear()
    got = []
    for k, s in enumerate(shards):
        before = len(calls)
        got += read_shard(s.path, s.start, s.end, s.format)[0]
        if k:
            assert calls[before:] == ["get"], (k, calls)
    assert got == expected[path]
    assert calls[:1] == ["size"] and len(shards) == 10
    # the schema (parquet_dataset builds a pipeline from it) comes from the same footer:
    # read first, it serves the shards after it; kept, it costs no request
    ranges._PQ_META.pop(path, None)
    before = len(calls)
    kinds = ranges.parquet_kinds(path)
    assert kinds and "get" in calls[before:] and "open" not in calls[before:]
    before = len(calls)
    assert ranges.parquet_kinds(path) == kinds and calls[before:] == []
    rows = read_shard(path, shards[0].start, shards[0].end, "parquet")[0]
    assert rows == expected[path][:100] and calls[before:] == ["get"]


def test_s3_read_errors_name_the_url_and_the_rest_is_read(s3, monkeypatch):
    """Ranged reads (botocore's client): a missing object, credentials the server refuses
    and an endpoint nobody listens on are errors naming the URL (``read_shard``: bad input
    at the shard's start; ``tf.data``: the pipeline's error), and the good files are read
    before and after."""
    import moto.settings
    import tensorflow as tf

    from deeprec_ext.data.ranges import BadInput
    from deeprec_ext.data.tf_dataset import record_dataset
    good = f"s3://{BUCKET}/errors/good.txt"
    s3.pipe(good[5:], b"1\n2\n3\n")
    missing = f"s3://{BUCKET}/errors/missing.txt"
    for fmt in ("text", "tfrecord", "parquet", "text.gz"):
        with pytest.raises(BadInput, match=f"{missing}: unreadable .*no such object"):
            read_shard(missing, 0, 100, fmt)
    bad = []
    assert read_shard(missing, 0, 100, "text", bad=bad)[0] == [] and \
        bad[0]["path"] == missing and "no such object" in bad[0]["reason"]
    with pytest.raises(tf.errors.OpError, match=f"{missing}: no such object"):
        list(record_dataset([(good, 0, 6), (missing, 0, 100)]).as_numpy_iterator())
    assert list(record_dataset([(good, 0, 6), (missing, 0, 100)], on_bad_record="skip")
                .as_numpy_iterator()) == [b"1", b"2", b"3"]

    # the server checks signatures against its IAM users: "testing" is none of them
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    with pytest.raises(BadInput, match=f"{good}: unreadable .*access denied .*AWS_ACCESS_KEY_ID"):
        read_shard(good, 0, 6, "text")
    monkeypatch.undo()
    assert read_shard(good, 0, 6, "text")[0] == [b"1", b"2", b"3"]

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", down)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(BadInput, match=f"{good}: unreadable .*cannot read from S3 at {down}"):
        read_shard(good, 0, 6, "text")
    monkeypatch.undo()
    assert read_shard(good, 0, 6, "text")[0] == [b"1", b"2", b"3"]


def test_s3_ranged_reads_presigned_and_their_fallback(s3, monkeypatch):
    """A ranged read is one GET of a presigned URL on botocore's HTTP session (no
    ``get_object`` call); an answer that is not the whole range (an error status, a body cut
    short by the server, no connection) is read again through ``get_object``: the bytes
    come out right, and the URL is signed again on the next read."""
    import threading

    data = bytes(range(256)) * 4096  # 1 MiB
    url = f"s3://{BUCKET}/presigned/obj.bin"
    s3.pipe(url[5:], data)
    client, _ = fs._s3_client()
    calls = []
    orig = client.get_object

    def counted(**k):
        calls.append(k["Range"])
        return orig(**k)
    monkeypatch.setattr(client, "get_object", counted)
    ukey = (id(client), BUCKET, "presigned/obj.bin")
    fs._urls.pop(ukey, None)
    n = len(data)
    for start, end in ((0, 1), (1000, 300_000), (300_000, n), (n - 5, n + 9)):
        assert fs._s3_get(url, start, end) == data[start:end]
    assert calls == [] and ukey in fs._urls
    signed = fs._urls[ukey]
    # past the end: the server's 416 goes to get_object, whose InvalidRange reads nothing
    assert fs._s3_get(url, len(data), len(data) + 10) == b"" and len(calls) == 1

    # a URL the server refuses (here a missing object's: 404): read again right through
    # get_object, signed again next time
    gone = client.generate_presigned_url(
        "get_object", Params={"Bucket": BUCKET, "Key": "presigned/gone.bin"}, ExpiresIn=60)
    fs._urls[ukey] = (gone, signed[1])
    calls.clear()
    assert fs._s3_get(url, 10, 5000) == data[10:5000] and calls == ["bytes=10-4999"]
    assert ukey not in fs._urls
    assert fs._s3_get(url, 10, 5000) == data[10:5000] and len(calls) == 1

    # a server that sends half the body it announced, then closes
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    served = []

    def serve():
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4990\r\n"
                         b"Connection: close\r\n\r\n" + data[10:2000])
            served.append(1)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cut = f"http://127.0.0.1:{sock.getsockname()[1]}"
    fs._urls[ukey] = (f"{cut}/{BUCKET}/presigned/obj.bin", signed[1])
    calls.clear()
    assert fs._s3_get(url, 10, 5000) == data[10:5000] and calls == ["bytes=10-4999"]
    t.join(10)
    sock.close()
    assert served == [1] and ukey not in fs._urls
    # nobody listens there now: no connection, read through get_object all the same
    fs._urls[ukey] = (f"{cut}/x", signed[1])
    assert fs._s3_get(url, 0, 100) == data[:100] and len(calls) == 2
