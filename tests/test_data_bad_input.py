"""Bad input (issue 18, item 6): a corrupt TFRecord CRC, a truncated or corrupt gzip
stream, a line with the wrong number of fields, an unreadable file. The reader names the
file and the position; with a ``bad`` list it skips and lists the problem instead, every
good record read exactly once."""
from __future__ import annotations

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from aimaster.shards import STREAM_END, make_shards
from deeprec_ext.data.ranges import BadInput, read_shard, tfrecord_frame


def _all(path, per_shard, bad=None, **kw):
    out = []
    for s in make_shards([path], per_shard):
        out += read_shard(s.path, s.start, s.end, s.format, s.size, bad=bad, **kw)[0]
    return out


def test_tfrecord_bad_data_crc_skips_one_record_bad_length_ends_the_shard(tmp_path):
    payloads = [b"rec-%03d" % i for i in range(50)]
    frames = [tfrecord_frame(p) for p in payloads]
    offsets = np.cumsum([0] + [len(f) for f in frames])
    data = bytearray(b"".join(frames))
    data[offsets[10] + 12 + 2] ^= 0xFF          # record 10's payload: its data CRC fails
    path = tmp_path / "f.tfrecord"
    path.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=rf"f.tfrecord: corrupt TFRecord data \(CRC mismatch\) "
                                       rf"at byte {offsets[10]}"):
        read_shard(str(path), 0, len(data), "tfrecord")
    for per_shard in (60, 10**6):
        bad = []
        assert _all(str(path), per_shard, bad) == payloads[:10] + payloads[11:]
        assert bad == [{"path": str(path), "offset": int(offsets[10]),
                        "reason": "corrupt TFRecord data (CRC mismatch)"}]
    # resuming after record 9 skips the bad record 10 too: nothing read twice
    records, next_pos = read_shard(str(path), 0, len(data), "tfrecord", bad=[])
    assert next_pos[9] == offsets[11]
    # a corrupt length: its CRC fails, the framing cannot go on: the shard ends there
    data[offsets[30] + 3] ^= 0x01
    path.write_bytes(bytes(data))
    bad = []
    assert _all(str(path), 10**6, bad) == payloads[:10] + payloads[11:30]
    assert [(b["offset"], b["reason"]) for b in bad] == [
        (int(offsets[10]), "corrupt TFRecord data (CRC mismatch)"),
        (int(offsets[30]), "corrupt TFRecord length (CRC mismatch)")]


def test_truncated_and_corrupt_gzip(tmp_path):
    lines = [b"%d\tx" % i for i in range(20000)]
    raw = b"\n".join(lines) + b"\n"
    whole = gzip.compress(raw)
    path = tmp_path / "f.tsv.gz"
    path.write_bytes(whole[:len(whole) // 2])     # truncated
    with pytest.raises(BadInput, match=r"f.tsv.gz: truncated gzip stream .* at byte \d+"):
        read_shard(str(path), 0, STREAM_END, "text.gz")
    bad = []
    records, next_pos = read_shard(str(path), 0, STREAM_END, "text.gz", bad=bad)
    assert 0 < len(records) < len(lines) and records == lines[:len(records)]
    assert bad[0]["offset"] == next_pos[-1] == sum(len(r) + 1 for r in records)
    assert "truncated gzip stream" in bad[0]["reason"]
    corrupt = bytearray(whole)
    corrupt[len(whole) // 2:len(whole) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(corrupt))
    bad = []
    records, _ = read_shard(str(path), 0, STREAM_END, "text.gz", bad=bad)
    assert records == lines[:len(records)] and len(records) < len(lines)
    assert "gzip" in bad[0]["reason"] and bad[0]["offset"] == sum(len(r) + 1 for r in records)
    # a TFRecord.gz cut short: the records before the cut, the cut one named
    frames = b"".join(tfrecord_frame(b"p%d" % i) for i in range(100))
    tpath = tmp_path / "f.tfrecord.gz"
    tpath.write_bytes(gzip.compress(frames)[:-30])
    bad = []
    records, _ = read_shard(str(tpath), 0, STREAM_END, "tfrecord.gz", bad=bad)
    assert records == [b"p%d" % i for i in range(len(records))] and len(bad) == 1
    assert "truncated gzip stream" in bad[0]["reason"]


def test_wrong_field_count_is_named_and_skipped(tmp_path):
    rows = [b"1\ta\tb", b"2\ta\tb", b"3\ta", b"4\ta\tb", b"5\ta\tb\tc", b"6\ta\tb", b"7\ta\tb"]
    data = b"\r\n".join(rows) + b"\r\n"
    path = tmp_path / "f.tsv"
    path.write_bytes(data)
    starts = [data.index(r + b"\r\n") for r in rows]
    with pytest.raises(BadInput, match=rf"f.tsv: 2 fields, expected 3 at byte {starts[2]}"):
        read_shard(str(path), 0, len(data), "text", fields=3)
    good = [r for r in rows if r.count(b"\t") == 2]
    for per_shard in range(1, len(data) + 1, 7):
        bad = []
        assert _all(str(path), per_shard, bad, fields=3) == good, per_shard
        assert [(b["offset"], b["reason"]) for b in bad] == \
            [(starts[2], "2 fields, expected 3"), (starts[4], "4 fields, expected 3")]
    # resuming after a kept record never re-reads the bad ones after it
    records, next_pos = read_shard(str(path), 0, len(data), "text", bad=[], fields=3)
    for i in range(len(records)):
        rest, _ = read_shard(str(path), int(next_pos[i]), len(data), "text", bad=[], fields=3)
        assert rest == records[i + 1:]
    # CSV with another delimiter
    path.write_bytes(b"a,b\nc\nd,e\n")
    bad = []
    assert read_shard(str(path), 0, 10, "text", bad=bad, fields=2, delimiter=b",")[0] == \
        [b"a,b", b"d,e"]
    assert bad[0]["offset"] == 4


def test_unreadable_file_and_many_bad_records(tmp_path):
    missing = str(tmp_path / "gone.txt")
    with pytest.raises(BadInput, match="gone.txt: unreadable"):
        read_shard(missing, 100, 200, "text")
    bad = []
    assert read_shard(missing, 100, 200, "text", bad=bad)[0] == []
    assert bad[0]["offset"] == 100 and "unreadable" in bad[0]["reason"]
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"not parquet at all")
    bad = []
    assert read_shard(str(pq), 0, 5, "parquet", bad=bad)[0] == [] and len(bad) == 1
    # a shard with thousands of bad lines lists 20 and counts the rest in one entry
    path = tmp_path / "many.tsv"
    path.write_bytes(b"".join(b"%d\n" % i if i % 2 else b"%d\tx\n" % i for i in range(5000)))
    bad = []
    assert len(read_shard(str(path), 0, 10**6, "text", bad=bad, fields=2)[0]) == 2500
    assert len(bad) == 21 and bad[-1]["count"] == 2500 - 20


def _bad_files(tmp_path, per=1000):
    """Four files of decimal ids: good CSV; CSV with a 2-field line; a TFRecord file with
    one corrupt record; a truncated gzip file. Returns (files, ids trained, ids not)."""
    ids = [np.arange(k * per, (k + 1) * per) for k in range(4)]
    lines = [b"%d" % i for i in ids[1]]
    lines[100] = b"%d,extra" % ids[1][100]
    (tmp_path / "a.csv").write_bytes(b"".join(b"%d\n" % i for i in ids[0]))
    (tmp_path / "b.csv").write_bytes(b"\n".join(lines) + b"\n")
    frames = [tfrecord_frame(b"%d" % i) for i in ids[2]]
    frames[500] = frames[500][:-1] + bytes([frames[500][-1] ^ 1])   # its data CRC fails
    (tmp_path / "c.tfrecord").write_bytes(b"".join(frames))
    gz = gzip.compress(b"".join(b"%d\n" % i for i in ids[3]))
    (tmp_path / "d.csv.gz").write_bytes(gz[:len(gz) * 2 // 3])
    records, _ = read_shard(str(tmp_path / "d.csv.gz"), 0, STREAM_END, "text.gz", bad=[])
    kept = len(records)
    skipped = np.concatenate([ids[1][100:101], ids[2][500:501], ids[3][kept:]])
    files = [str(tmp_path / n) for n in ("a.csv", "b.csv", "c.tfrecord", "d.csv.gz")]
    return files, np.setdiff1d(np.arange(4 * per), skipped), skipped


def _spec(files, tmp_path, **data):
    from tests.conftest import ROOT
    return {"name": "bad", "ps": {"replicas": 1},
            "worker": {"replicas": 2, "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                       "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "300", "PYTHONPATH": str(ROOT),
                               "COUNTING_HOLD_FILE": str(tmp_path / "release")}},
            "data": {"files": files, "bytes_per_shard": 2000, "fields": 1, "delimiter": ",", **data},
            "master": {"heartbeat_seconds": 0.5}}


def test_job_skips_bad_records_reports_them_and_trains_the_rest_once(start_job, tmp_path):
    from deeprec_ext.client import PSClient
    from tests.conftest import ROOT, wait_for
    files, good, skipped = _bad_files(tmp_path)
    job = start_job(_spec(files, tmp_path))          # on_bad_record: skip, the default
    wait_for(lambda: (lambda s: s["todo"] == 0 and s["doing"] == 0)(job.status()["shards"]),
             120, "every shard DONE")
    st = job.status()
    text = subprocess.run([sys.executable, "-m", "aimaster.cli", "status", "--master", job.address],
                          capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert "bad input in 3 shards, 3 records:" in text and "b.csv at 500: 2 fields" in text
    client = PSClient.connect(job.address, timeout=30)
    got = client.lookup("records", np.arange(4000, dtype=np.int64), insert_missing=False)[:, 0]
    client.close()
    (tmp_path / "release").write_text("")
    assert job.wait(60) == 0, job.output()[-3000:]
    assert (got[good] == 1).all() and (got[skipped] == 0).all()
    sh = st["shards"]
    assert sh["bad_shards"] == 3 and sh["bad_records"] == 3
    named = sorted((os.path.basename(b["path"]), b["reason"].split(" (")[0]) for b in sh["bad_input"])
    assert named == [("b.csv", "2 fields, expected 1"), ("c.tfrecord", "corrupt TFRecord data"),
                     ("d.csv.gz", "truncated gzip stream")]
    b = next(b for b in sh["bad_input"] if b["path"].endswith("b.csv"))
    assert b["offset"] == 100 * 5                     # ids 1000..1099 are 5 bytes a line
    assert any(e["kind"] == "bad_input" for e in st["events"])
    assert job.state()["shards"]["bad"]               # kept with the shard state


def test_job_with_on_bad_record_fail_fails_naming_file_and_offset(start_job, tmp_path):
    files, _, _ = _bad_files(tmp_path)
    job = start_job(_spec([files[2]], tmp_path, on_bad_record="fail"))
    assert job.wait(90) == 1, job.output()[-3000:]
    state = job.state()
    assert state["phase"] == "failed"
    offset = 500 * len(tfrecord_frame(b"2500"))
    assert f"c.tfrecord at position {offset}: corrupt TFRecord data" in state["message"]
    assert "on_bad_record: fail" in state["message"]


def test_tf_data_reader_fails_naming_the_record_or_skips_it(tmp_path):
    import tensorflow as tf

    from deeprec_ext.data.tf_dataset import record_dataset
    frames = [tfrecord_frame(b"p%d" % i) for i in range(30)]
    frames[7] = frames[7][:-1] + bytes([frames[7][-1] ^ 1])
    path = tmp_path / "f.tfrecord"
    path.write_bytes(b"".join(frames))
    ranges = [(s.path, s.start, s.end) for s in make_shards([str(path)], 100)]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"f.tfrecord: corrupt TFRecord data .* at byte {7 * len(frames[0])}"):
        list(record_dataset(ranges, "tfrecord").as_numpy_iterator())
    got = list(record_dataset(ranges, "tfrecord", on_bad_record="skip").as_numpy_iterator())
    assert got == [b"p%d" % i for i in range(30) if i != 7]
    gone = [(str(tmp_path / "gone.txt"), 0, 10), *[(str(path), 0, 0)]]
    assert list(record_dataset(gone, "text", on_bad_record="skip").as_numpy_iterator()) == []


def test_only_the_holder_of_a_shard_reports_bad_input(tmp_path):
    """A report on a shard the worker does not hold (stray, replayed after a reassignment)
    is ignored: it neither counts nor fails the job; a report by the holder is kept once."""
    from aimaster.config import parse_job
    from aimaster.master import JobMaster
    from aimaster.view import JobPhase
    path = tmp_path / "a.txt"
    path.write_bytes(b"1\n2\n")
    m = JobMaster(parse_job({"data": {"files": [str(path)], "on_bad_record": "fail"},
                             "master": {"state_dir": str(tmp_path / "state")}}))
    try:
        m.phase = JobPhase.RUNNING
        _, shard = m.shards.assign("worker-0")
        report = {"shard_id": shard.shard_id, "path": str(path), "offset": 2, "reason": "x",
                  "count": 1}
        m.report_bad_input("worker-1", [report], fatal=True)
        assert m.phase == JobPhase.RUNNING and m.shards.bad_input()["shards"] == 0
        for _ in range(2):
            m.report_bad_input("worker-0", [report], fatal=False)
        assert m.shards.bad_input()["records"] == 1
        m.report_bad_input("worker-0", [report], fatal=True)
        assert m.phase == JobPhase.FAILED and f"{path} at position 2: x" in m.message
    finally:
        m.shutdown()


def test_tf_reader_tfrecord_problems_match_the_python_reader(tmp_path):
    """The tf.data reader frames TFRecord in numpy + one CRC call per record: a bad data
    CRC, then a bad length CRC, then a cut record in one file give, under skip, exactly
    the records ``read_shard`` gives; under fail, the first problem, named."""
    import tensorflow as tf
    from deeprec_ext.data.tf_dataset import record_dataset
    payloads = [b"rec-%03d" % i for i in range(60)]
    frames = [tfrecord_frame(p) for p in payloads]
    offsets = np.cumsum([0] + [len(f) for f in frames])
    data = bytearray(b"".join(frames))
    data[offsets[5] + 12 + 1] ^= 0xFF            # data CRC of record 5
    data[offsets[25] + 2] ^= 0x01                # length CRC of record 25: shard ends there
    data = bytes(data[:offsets[50] + 7])        # record 50 cut (a later shard)
    path = tmp_path / "f.tfrecord"
    path.write_bytes(data)
    for per_shard in (100, 10**6):
        ranges = [(s.path, s.start, s.end, s.size) for s in make_shards([str(path)], per_shard)]
        bad: list = []
        python = [r for p, s, e, z in ranges for r in read_shard(p, s, e, "tfrecord", z, bad=bad)[0]]
        assert [b["offset"] for b in bad][:2] == [int(offsets[5]), int(offsets[25])]
        got = list(record_dataset([r[:3] for r in ranges], "tfrecord",
                                  on_bad_record="skip").as_numpy_iterator())
        assert got == python and payloads[4] in got and payloads[5] not in got, per_shard
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"corrupt TFRecord data .* at byte {offsets[5]}"):
            list(record_dataset([r[:3] for r in ranges], "tfrecord").as_numpy_iterator())


def test_tf_reader_gzip_text_is_split_in_graph_like_the_python_reader(tmp_path):
    """gzip text reaches tf.data as the decompressed body, split in-graph as plain text:
    CRLF, empty lines and a last line without newline as ``read_shard``; a resumed
    position; a truncated stream: skip keeps what decoded whole, fail names the file."""
    import tensorflow as tf
    from deeprec_ext.data.tf_dataset import record_dataset
    lines = [b"%d\tx" % i for i in range(3000)] + [b"", b"crlf\r", b"last"]
    path = tmp_path / "f.tsv.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines)))
    records, next_pos = read_shard(str(path), 0, STREAM_END, "text.gz")
    assert records == lines[:-2] + [b"crlf", b"last"]
    got = list(record_dataset([(str(path), 0, STREAM_END)], "text.gz").as_numpy_iterator())
    assert got == records
    resumed = [(str(path), int(next_pos[99]), STREAM_END)]
    assert list(record_dataset(resumed, "text.gz").as_numpy_iterator()) == records[100:]
    whole = gzip.compress(b"\n".join(lines[:3000]) + b"\n")
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    bad: list = []
    python = read_shard(str(cut), 0, STREAM_END, "text.gz", bad=bad)[0]
    assert 0 < len(python) < 3000 and bad and "truncated gzip" in bad[0]["reason"]
    ranges = [(str(cut), 0, STREAM_END), (str(tmp_path / "gone.gz"), 0, STREAM_END)]
    assert list(record_dataset(ranges, "text.gz", on_bad_record="skip")
                .as_numpy_iterator()) == python
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cut.tsv.gz: truncated gzip"):
        list(record_dataset(ranges, "text.gz").as_numpy_iterator())


@pytest.mark.parametrize("run", [4096, 1 << 20])
def test_tfrecord_data_crcs_checked_over_the_whole_shard_find_every_bad_record(tmp_path, run,
                                                                               monkeypatch):
    """The data CRCs are checked by two C calls per run of records (``run`` bytes; 4096:
    many runs); each corrupt record (a payload byte or a CRC byte, one or several
    records, short and long payloads past the zero-CRC table) is still found and named,
    and every other record is read."""
    from deeprec_ext.data import ranges
    monkeypatch.setattr(ranges, "_CRC_RUN", run)
    rng = np.random.default_rng(7)
    sizes = [0, 1, 4096, 4097, 70000] + rng.integers(0, 600, 295).tolist()
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    frames = [tfrecord_frame(p) for p in payloads]
    offsets = np.cumsum([0] + [len(f) for f in frames])
    clean = b"".join(frames)
    path = tmp_path / "f.tfrecord"
    path.write_bytes(clean)
    assert _all(str(path), 10**6, []) == payloads
    assert _all(str(path), 20000, []) == payloads
    for trial in range(12):
        data = bytearray(clean)
        hit = sorted(rng.choice(len(payloads), size=1 + trial % 3, replace=False).tolist())
        for k in hit:
            # a payload byte, or a byte of the data CRC (an empty payload has only that)
            span = sizes[k] + 4 if trial % 2 == 0 else 4
            at = offsets[k + 1] - 4 - (sizes[k] if span > 4 else 0) + int(rng.integers(span))
            data[at] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
        bad = []
        got = _all(str(path), 10**6, bad)
        assert got == [p for k, p in enumerate(payloads) if k not in hit], (trial, hit)
        assert [b["offset"] for b in bad] == [int(offsets[k]) for k in hit], trial
        assert {b["reason"] for b in bad} == {"corrupt TFRecord data (CRC mismatch)"}


def test_tfrecord_one_crc_pass_catches_any_flipped_bit(tmp_path):
    """Both CRCs of every record are checked by one C pass per run (``_all_crcs_match``):
    clean records pass; one flipped bit anywhere (a length, a length CRC, a payload, a data
    CRC) fails it; and through the reader a flipped length-CRC bit (the length itself
    intact, so the framing walks on) still ends the shard there, naming the record."""
    from deeprec_ext.data import ranges
    rng = np.random.default_rng(11)
    sizes = [0, 1, 8, 4096, 4097, 9000] + rng.integers(0, 300, 60).tolist()
    frames = [tfrecord_frame(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    heads = np.cumsum([0] + [len(f) for f in frames])[:-1].astype(np.int64)
    lengths = np.array(sizes, np.int64)
    clean = np.frombuffer(b"".join(frames), np.uint8)
    assert ranges._all_crcs_match(clean, heads, lengths)
    for at in rng.choice(len(clean), 300, replace=False).tolist() + [0, len(clean) - 1]:
        data = clean.copy()
        data[at] ^= np.uint8(1 << int(rng.integers(8)))
        assert not ranges._all_crcs_match(data, heads, lengths), at
    # the reader: a length CRC byte flipped in record 20
    data = bytearray(clean.tobytes())
    data[int(heads[20]) + 9] ^= 0x10
    path = tmp_path / "f.tfrecord"
    path.write_bytes(bytes(data))
    bad = []
    records, _ = read_shard(str(path), 0, len(data), "tfrecord", bad=bad)
    assert len(records) == 20
    assert bad == [{"path": str(path), "offset": int(heads[20]),
                    "reason": "corrupt TFRecord length (CRC mismatch)"}]
