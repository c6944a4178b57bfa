"""Parquet read as typed columns (``tf_dataset.parquet_dataset``, issue 18 items 2 and 7):
the same row-range shards as the text-line path, every row exactly once, resume at a row,
bad input naming the file and row, and the Criteo example's parse giving the same
features from columns as from lines."""
from __future__ import annotations

import logging

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402
import tensorflow as tf  # noqa: E402

from aimaster.shards import make_shards  # noqa: E402
from deeprec_ext.data.ranges import parquet_kinds, read_shard  # noqa: E402
from deeprec_ext.data.tf_dataset import parquet_dataset  # noqa: E402


def _table(first: int, n: int):
    """Rows with ids ``first..first+n``; nulls in an int and a string column."""
    ids = np.arange(first, first + n)
    return pa.table({
        "id": ids,
        "small": pa.array([None if i % 5 == 0 else int(i % 100) for i in ids], pa.int8()),
        "x": pa.array(ids * 0.5, pa.float64()),
        "f": pa.array(ids.astype(np.float32) + 0.25, pa.float32()),
        "s": pa.array([None if i % 7 == 0 else f"v{i}\t\n" for i in ids], pa.string()),
        "b": pa.array([bytes([i % 128, 0]) for i in ids], pa.binary()),
        "ok": pa.array([i % 3 == 0 for i in ids]),
        "big": pa.array(ids.astype(np.uint64) + np.uint64(2**63), pa.uint64()),
        "d": pa.array([f"k{i % 3}" for i in ids]).dictionary_encode(),
    })


def _expected(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {"id": ids, "small": np.where(ids % 5 == 0, 0, ids % 100),
            "x": ids * 0.5, "f": ids.astype(np.float32) + 0.25,
            "s": [b"" if i % 7 == 0 else b"v%d\t\n" % i for i in ids],
            "b": [bytes([i % 128, 0]) for i in ids], "ok": ids % 3 == 0,
            "big": ids.astype(np.uint64) + np.uint64(2**63), "d": [b"k%d" % (i % 3) for i in ids]}


def _concat(batches) -> dict:
    out = {}
    for b in batches:
        for k, v in b.items():
            out.setdefault(k, []).append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in out.items()}


def _check(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert list(got[k]) == list(v), k


@pytest.fixture()
def files(tmp_path):
    """Two files of 700 and 300 rows in row groups of 128 (ids unique across files)."""
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(_table(0, 700), a, row_group_size=128)
    pq.write_table(_table(700, 300), b, row_group_size=128)
    return [a, b]


def test_typed_columns_every_row_once_for_every_shard_size(files):
    ds = parquet_dataset([(files[0], 0, 10)], 4)
    spec = ds.element_spec
    assert {k: v.dtype for k, v in spec.items()} == {
        "id": tf.int64, "small": tf.int64, "x": tf.float64, "f": tf.float32, "s": tf.string,
        "b": tf.string, "ok": tf.bool, "big": tf.uint64, "d": tf.string}
    assert pa.types.is_dictionary(pq.read_table(files[0]).schema.field("d").type)
    want = _expected(0, 1000)
    for per_shard in (1, 3000, 10**9):
        shards = make_shards(files, per_shard)
        ranges = [(s.path, s.start, s.end) for s in shards]
        for batch in (1, 300, 4096):
            batches = list(parquet_dataset(ranges, batch).as_numpy_iterator())
            assert all(len(b["id"]) == batch for b in batches[:-1])
            _check(_concat(batches), want)
        # one row an element (no batch_size), and a subset of columns in the asked order
        rows = list(parquet_dataset(ranges, columns=["s", "id"]).as_numpy_iterator())
        assert [r["id"] for r in rows] == list(range(1000))
        assert [r["s"] for r in rows] == want["s"]
        assert list(rows[0]) == ["s", "id"]
    # the same rows as the text-line reader, shard by shard (row positions are shared)
    for s in make_shards(files, 3000):
        lines = read_shard(s.path, s.start, s.end, "parquet")[0]
        cols = _concat(parquet_dataset([(s.path, s.start, s.end)], 1000).as_numpy_iterator())
        assert [int(r.split(b"\t")[0]) for r in lines] == list(cols["id"])


def test_resume_at_the_row_reached(files):
    """A shard handed back after k rows resumes at its ``next_pos`` (a row number): the
    rows before it and the resumed rest are the shard's rows, each once."""
    for s in make_shards(files, 3000):
        whole = _concat(parquet_dataset([(s.path, s.start, s.end)], 64).as_numpy_iterator())
        _, next_pos = read_shard(s.path, s.start, s.end, "parquet")
        for k in (0, 1, 37, len(next_pos) - 1):
            at = int(next_pos[k])
            rest = list(parquet_dataset([(s.path, at, s.end)], 64).as_numpy_iterator())
            got = list(whole["id"][:k + 1]) + (list(_concat(rest)["id"]) if rest else [])
            assert got == list(whole["id"]), (s, k)
    # a range past the last row holds nothing; a dataset of ranges needs schema_from
    assert list(parquet_dataset([(files[1], 10**6, 10**6 + 5)], 8).as_numpy_iterator()) == []
    with pytest.raises(ValueError, match="schema_from"):
        parquet_dataset(lambda: iter([(files[0], 0, 5)]), 8)
    gen = lambda: iter([(files[0], 0, 5), (files[1], 0, 3)])  # noqa: E731
    got = _concat(parquet_dataset(gen, 8, schema_from=files[0]).as_numpy_iterator())
    assert list(got["id"]) == [0, 1, 2, 3, 4, 700, 701, 702]


def test_batches_match_tensorflows_rebatch_and_resume_from_a_checkpoint(files, tmp_path):
    """``parquet_dataset`` batches with ``RebatchDatasetV2`` directly (no dense-normalizing
    map first): the same batches and static shapes as ``Dataset.rebatch``, the input's
    options kept, and an iterator checkpoint taken mid-way resumes at the next row."""
    from deeprec_ext.data.tf_dataset import _rebatch
    ranges = [(s.path, s.start, s.end) for s in make_shards(files, 3000)]
    per_shard = parquet_dataset(ranges)  # rows, then batched both ways below
    per_shard = per_shard.batch(97)  # uneven pieces: batches cross their edges
    for drop in (False, True):
        ours = _rebatch(per_shard, 64, drop)
        theirs = per_shard.rebatch(64, drop_remainder=drop)
        assert ours.element_spec == theirs.element_spec
        a, b = list(ours.as_numpy_iterator()), list(theirs.as_numpy_iterator())
        assert len(a) == len(b) == (1000 // 64 if drop else -(-1000 // 64))
        for x, y in zip(a, b):
            _check(x, y)
    opts = tf.data.Options()
    opts.deterministic = False
    assert _rebatch(per_shard.with_options(opts), 64, False).options().deterministic is False
    ds = parquet_dataset(ranges, 100)
    it = iter(ds)
    first = [next(it)["id"].numpy() for _ in range(3)]
    ckpt = tf.train.Checkpoint(it=it)
    path = ckpt.write(str(tmp_path / "it"))
    rest = [b["id"].numpy() for b in it]
    it2 = iter(ds)
    tf.train.Checkpoint(it=it2).read(path).assert_consumed()
    again = [b["id"].numpy() for b in it2]
    assert [list(x) for x in again] == [list(x) for x in rest]
    assert list(np.concatenate(first + rest)) == list(range(1000))


def test_string_offsets_large_and_narrow(tmp_path):
    """Strings are cut by int32 offsets: Arrow's 64-bit offsets (``large_string``) are
    narrowed, and a column too large for the index type is bad input naming it."""
    from deeprec_ext.data.ranges import BadInput, parquet_columns
    path = str(tmp_path / "l.parquet")
    vals = [f"value-{i}" * (i % 4) for i in range(300)]
    pq.write_table(pa.table({"id": np.arange(300), "s": pa.array(vals, pa.large_string())}),
                   path, row_group_size=128)
    assert pa.types.is_large_string(pq.read_schema(path).field("s").type)
    for start, end in ((0, 300), (130, 290), (5, 6)):
        got = _concat(parquet_dataset([(path, start, end)], 50).as_numpy_iterator())
        assert list(got["s"]) == [v.encode() for v in vals[start:end]]
        assert list(got["id"]) == list(range(start, end))
    # offsets of another width than the values need: named, not wrapped around
    with pytest.raises(BadInput, match=r"l\.parquet: column 's': .*more than int8.* at row 0"):
        parquet_columns(path, 0, 300, {"s": "string"}, index_dtype=np.int8)


def test_bad_files_are_named_and_the_rest_is_read(files, tmp_path, caplog):
    bad = tmp_path / "c.parquet"
    bad.write_bytes(b"not parquet at all")
    other = str(tmp_path / "d.parquet")  # column "s" holds numbers here
    pq.write_table(_table(0, 10).set_column(4, "s", pa.array(np.arange(10))), other)
    missing = str(tmp_path / "e.parquet")
    pq.write_table(_table(0, 10).drop_columns(["x"]), missing)
    ranges = [(s.path, s.start, s.end) for s in make_shards(files, 3000)]
    for path, why in ((str(bad), r"c\.parquet: unreadable .* at row 3"),
                      (other, r"d\.parquet: column 's' has type int64 here, read as string"),
                      (missing, r"e\.parquet: no column 'x'")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=why):
            list(parquet_dataset(ranges[:1] + [(path, 3, 8)] + ranges[1:], 64))
        with caplog.at_level(logging.WARNING, logger="deeprec_ext.data.tf_dataset"):
            got = _concat(parquet_dataset(ranges[:1] + [(path, 3, 8)] + ranges[1:], 64,
                                          on_bad_record="skip").as_numpy_iterator())
        _check(got, _expected(0, 1000))  # every good row once, the bad shard holds none
        assert any("bad input, skipped" in r.message and path in r.message
                   for r in caplog.records)
    # a column no tensor can hold is named when the dataset is built
    nested = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"id": [1, 2], "l": [[1], [2, 3]]}), nested)
    with pytest.raises(ValueError, match=r"column 'l' has type list<.*leave it out"):
        parquet_dataset([(nested, 0, 2)], 2)
    assert list(parquet_dataset([(nested, 0, 2)], 2, columns=["id"])
                .as_numpy_iterator())[0]["id"].tolist() == [1, 2]
    with pytest.raises(ValueError, match="no column 'nope'"):
        parquet_kinds(files[0], ["id", "nope"])


def test_criteo_columns_parse_like_lines(tmp_path):
    """The example's columnar parse gives the features of its line parse, for the same
    records written as TSV and as Parquet (missing fields as nulls)."""
    from examples.criteo import reader
    txt = str(tmp_path / "d.tsv")
    _criteo_lines(txt)
    path = str(tmp_path / "d.parquet")
    rows = reader.tsv_to_parquet(txt, path, row_group_size=700)
    table = pq.read_table(path)
    assert table.column("I1").null_count and table.column("C1").null_count
    lines = reader.criteo_dataset_for_ranges(
        [(s.path, s.start, s.end) for s in make_shards([txt], 50_000)], 512)
    cols = reader.criteo_parquet_dataset_for_ranges(
        [(s.path, s.start, s.end) for s in make_shards([path], 50_000)], 512)
    n = 0
    for (fl, ll), (fc, lc) in zip(lines, cols):
        np.testing.assert_array_equal(ll.numpy(), lc.numpy())
        np.testing.assert_allclose(fl["dense"].numpy(), fc["dense"].numpy(), rtol=1e-6)
        np.testing.assert_array_equal(fl["cat"].numpy(), fc["cat"].numpy())
        n += len(ll)
    assert n == rows


def _criteo_lines(path: str, n: int = 3000):
    rng = np.random.default_rng(5)
    with open(path, "w") as f:
        for _ in range(n):
            ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 1000)))
                    for _ in range(13)]
            cats = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}"
                    for _ in range(26)]
            f.write("\t".join([str(int(rng.integers(0, 2)))] + ints + cats) + "\n")
