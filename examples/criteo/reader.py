"""tf.data input pipeline for Criteo display-ads format text files.

Each line holds 40 tab-separated columns: ``label I1..I13 C1..C26``; any
integer or categorical field may be empty (missing).

Parsed features::

    {"dense": float32 [batch, 13]   log1p(max(x, 0)), missing -> 0
     "cat":   int64   [batch, 26]   stable 64-bit ids}
    label:   float32 [batch]

Categorical id of value ``s`` in column ``Cj`` (``j`` = 1..26, as in the
Criteo column names) is ``Fingerprint64("C<j>:" + s) mod 2**62`` computed by
``tf.strings.to_hash_bucket_fast`` -- non-negative and stable across
processes, machines and TF versions.  A missing value hashes the empty string
(``"C<j>:"``), i.e. it becomes one more per-column id.  With ``vocab_size``
the ids are additionally reduced modulo ``vocab_size`` (for a local
``keras.layers.Embedding``).

All functions build plain TF ops / tf.data pipelines and work both eagerly
and in TF1 graph mode (``tf.compat.v1`` + ``Session``).
"""

from __future__ import annotations

import os

import tensorflow as tf

# deeprec_ext.data.tf_dataset is imported where it is used: the plain text readers here
# also serve the baselines of bench_training.py that run in a TF 2.16 venv without
# this project's protobuf

NUM_DENSE = 13
NUM_CAT = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT
HASH_BUCKETS = 2 ** 62

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
CAT_NAMES = tuple(f"C{i}" for i in range(1, NUM_CAT + 1))
_CAT_PREFIXES = tuple(f"{name}:" for name in CAT_NAMES)

# Plain python defaults (not eager tensors) so the module also works when
# building TF1 graphs.
_RECORD_DEFAULTS = [[0.0]] * (1 + NUM_DENSE) + [[""]] * NUM_CAT


def parse_lines(lines, vocab_size=None):
    """Parse a 1-D string tensor of Criteo lines.

    Returns ``(features, label)`` with ``features = {"dense": float32
    [batch, 13], "cat": int64 [batch, 26]}`` and ``label`` float32 [batch].
    """
    lines = tf.convert_to_tensor(lines, dtype=tf.string)
    cols = tf.io.decode_csv(lines, record_defaults=_RECORD_DEFAULTS,
                            field_delim="\t", na_value="")
    label = cols[0]
    dense = tf.stack(cols[1:1 + NUM_DENSE], axis=1)
    dense = tf.math.log1p(tf.maximum(dense, 0.0))
    cat_str = tf.stack(cols[1 + NUM_DENSE:], axis=1)            # [b, 26]
    prefixes = tf.broadcast_to(tf.constant(_CAT_PREFIXES), tf.shape(cat_str))
    cat = tf.strings.to_hash_bucket_fast(
        tf.strings.join([prefixes, cat_str]), HASH_BUCKETS)     # int64
    if vocab_size is not None:
        cat = tf.math.floormod(cat, tf.constant(int(vocab_size), tf.int64))
    return {"dense": dense, "cat": cat}, label


def criteo_dataset(files, batch_size, vocab_size=None, shuffle=False,
                   shuffle_buffer=None, seed=None, num_parallel_reads=None,
                   drop_remainder=False):
    """(features, label) batches from Criteo text files.

    ``TextLineDataset -> [shuffle] -> batch -> map(parse_lines) -> prefetch``.
    With ``shuffle`` the file order is shuffled and lines go through a
    shuffle buffer (default ``16 * batch_size``) before batching.
    """
    if isinstance(files, (str, bytes, os.PathLike)):
        files = [files]
    files = [os.fspath(f) for f in files]
    if shuffle:
        ds = tf.data.Dataset.from_tensor_slices(files)
        ds = ds.shuffle(len(files), seed=seed)
        ds = ds.interleave(tf.data.TextLineDataset,
                           cycle_length=num_parallel_reads or 1,
                           num_parallel_calls=num_parallel_reads)
        ds = ds.shuffle(shuffle_buffer or 16 * batch_size, seed=seed)
    else:
        ds = tf.data.TextLineDataset(files,
                                     num_parallel_reads=num_parallel_reads)
    return _batch_and_parse(ds, batch_size, vocab_size, drop_remainder)


def _batch_and_parse(lines_ds, batch_size, vocab_size, drop_remainder=False):
    ds = lines_ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(lambda lines: parse_lines(lines, vocab_size),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def line_dataset_for_ranges(ranges, compression_type=None, num_parallel_reads=None):
    """Lines of byte ranges, in order.

    ``ranges`` is a ``tf.data.Dataset`` of ``(path, start_byte, end_byte)`` triples, a
    list/tuple of such triples, a callable returning an iterable of triples (re-iterated
    on every pass, the usual way to plug in a data-shard service), or any other iterable
    (consumed once). A range yields the lines that *begin* in ``[start, end)``, the one
    crossing ``end`` read to its end, so adjacent ranges read every line once
    (``deeprec_ext.data.ranges``). The range is read with one seek, wherever it lies in
    the file; the split into lines runs in the graph. With ``compression_type="GZIP"``
    positions are bytes of the decompressed stream (use ``(path, 0, 2**62)`` for a whole
    file).
    """
    fmt = "text.gz" if (compression_type or "").upper() == "GZIP" else "text"
    from deeprec_ext.data.tf_dataset import record_dataset
    return record_dataset(ranges, fmt,
                          num_parallel_reads=num_parallel_reads or tf.data.AUTOTUNE)


def criteo_dataset_for_ranges(ranges, batch_size, vocab_size=None,
                              drop_remainder=False, **kwargs):
    """Parsed (features, label) batches of the lines of byte ranges."""
    return _batch_and_parse(line_dataset_for_ranges(ranges, **kwargs),
                            batch_size, vocab_size, drop_remainder)


def tsv_to_parquet(txt: str, out: str, row_group_size: int = 20_000,
                   missing_as_null: bool = True) -> int:
    """Write the Criteo TSV file ``txt`` as Parquet ``out`` with the columns
    ``parse_columns`` reads (``label``, ``I1``..``I13`` int64, ``C1``..``C26`` string;
    missing fields null, or empty strings with ``missing_as_null=False``). Returns the
    rows written."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq
    names = ["label", *DENSE_NAMES, *CAT_NAMES]
    types = {n: pa.string() if n in CAT_NAMES else pa.int64() for n in names}
    table = pcsv.read_csv(txt, read_options=pcsv.ReadOptions(column_names=names),
                          parse_options=pcsv.ParseOptions(delimiter="\t"),
                          convert_options=pcsv.ConvertOptions(
                              column_types=types, strings_can_be_null=missing_as_null))
    pq.write_table(table, out, row_group_size=row_group_size)
    return table.num_rows


def parse_columns(cols, vocab_size=None):
    """``parse_lines`` for typed columns (``parquet_dataset``): ``cols`` holds ``label``,
    ``I1``..``I13`` (numbers) and ``C1``..``C26`` (strings) of a batch; a null is 0 or the
    empty string there, as a missing field in a line, so both give the same features."""
    label = tf.cast(cols["label"], tf.float32)
    dense = tf.stack([tf.cast(cols[n], tf.float32) for n in DENSE_NAMES], axis=1)
    dense = tf.math.log1p(tf.maximum(dense, 0.0))
    cat_str = tf.stack([cols[n] for n in CAT_NAMES], axis=1)
    prefixes = tf.broadcast_to(tf.constant(_CAT_PREFIXES), tf.shape(cat_str))
    cat = tf.strings.to_hash_bucket_fast(
        tf.strings.join([prefixes, cat_str]), HASH_BUCKETS)
    if vocab_size is not None:
        cat = tf.math.floormod(cat, tf.constant(int(vocab_size), tf.int64))
    return {"dense": dense, "cat": cat}, label


def criteo_parquet_dataset_for_ranges(ranges, batch_size, vocab_size=None,
                                      drop_remainder=False, **kwargs):
    """Parsed (features, label) batches of Parquet row ranges read as typed columns
    (``label``, ``I1``..``I13``, ``C1``..``C26``): decoding the columns is the parse, no
    row is formatted as a line. ``kwargs`` go to ``parquet_dataset`` (``schema_from``
    when ``ranges`` is not a list, ``on_bad_record``, ...)."""
    from deeprec_ext.data.tf_dataset import parquet_dataset
    ds = parquet_dataset(ranges, batch_size, columns=("label",) + DENSE_NAMES + CAT_NAMES,
                         drop_remainder=drop_remainder, **kwargs)
    ds = ds.map(lambda cols: parse_columns(cols, vocab_size),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def count_records(path, chunk_size=16 << 20) -> int:
    """Number of records (lines) in a text file, as TextLineDataset sees it:
    newline count, plus one for a final line without a trailing newline."""
    n = 0
    last = b"\n"
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")
