"""``tf.data`` datasets of shard ranges: the records of ``(path, start, end)`` triples.

Positions and ownership are those of ``deeprec_ext.data.ranges`` (bytes for text and
TFRecord, rows for Parquet; a shard holds the records that begin in ``[start, end)``).

How a range is read: TensorFlow has no op that reads a byte range of a file with a seek
(``TextLineDataset`` cannot skip without reading every line before, and
``FixedLengthRecordDataset``'s ``header_bytes`` reads through the bytes it skips: measured
in docs/BENCHMARKS.md), so each *shard* costs one ``tf.numpy_function`` call doing a
``pread`` of its byte range (a few MB). Splitting text into records, stripping ``\\r`` and
everything after (batching, parsing) run in the graph; shards are read in parallel
(``map(num_parallel_calls=AUTOTUNE)``, order kept). There is no Python call per record
for text (plain or gzip: the decompressed records are split in-graph the same way).
Parquet and TFRecord shards come out of that call as one byte string plus an offset and a
length per record (pyarrow's joined rows; the TFRecord payloads in the bytes read,
framing and CRCs checked there), cut into records in-graph by ``tf.strings.substr``: no
Python object per record.

Parquet can also be read as typed columns (``parquet_dataset``): a dict of tensors per
batch, numbers as numbers and strings as ``tf.string`` cut from one buffer per column, so
no value is formatted as text and no line needs parsing.
"""
from __future__ import annotations

import collections.abc
import logging
import os

import numpy as np
import tensorflow as tf

from deeprec_ext.data.ranges import (NUMBER_KINDS, BadInput, _guarded, _report, gzip_text_body,
                                     parquet_columns, parquet_kinds, read_buffer, read_shard,
                                     text_body)

log = logging.getLogger(__name__)

# read as one byte string plus (offset, length) per record, cut in-graph by ``substr``:
# no Python object per record (a list of bytes and an object array cost more than
# pyarrow's join, docs/BENCHMARKS.md)
_BUFFERED = ("parquet", "tfrecord", "tfrecord.gz")

_SIGNATURE = (tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int64),
              tf.TensorSpec([], tf.int64))


def _as_str(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _read_gzip_text(skip: bool):
    def read(path, start, end):
        bad = [] if skip else None
        path = _as_str(path)
        out = _guarded(lambda: gzip_text_body(path, int(start), int(end), bad), path,
                       int(start), bad)
        for b in bad or ():
            log.warning("bad input, skipped: %s: %s at %d", b["path"], b["reason"], b["offset"])
        body, any_record = out if out is not None else (b"", False)
        return np.array(body, dtype=object), np.bool_(any_record)
    return read


def _read_text(skip: bool):
    def read(path, start, end):
        try:
            body, any_record = text_body(_as_str(path), int(start), int(end))
        except OSError as exc:  # text has no framing to check: only an unreadable file
            if not skip:
                raise
            log.warning("bad input, skipped: %s: unreadable (%s) at byte %d", _as_str(path),
                        exc, int(start))
            body, any_record = b"", False
        return np.array(body, dtype=object), np.bool_(any_record)
    return read


def _read_buffer(fmt, skip: bool):
    def read(path, start, end):
        bad = [] if skip else None
        data, offsets, lengths = read_buffer(_as_str(path), int(start), int(end), fmt, bad=bad)
        for b in bad or ():
            log.warning("bad input, skipped: %s: %s at %d", b["path"], b["reason"], b["offset"])
        return np.array(data, dtype=object), offsets, lengths
    return read


def _read_other(fmt, skip: bool = False):
    def read(path, start, end):
        bad = [] if skip else None
        records, _ = read_shard(_as_str(path), int(start), int(end), fmt, bad=bad)
        for b in bad or ():
            log.warning("bad input, skipped: %s: %s at %d", b["path"], b["reason"], b["offset"])
        out = np.empty(len(records), dtype=object)
        out[:] = records
        return out
    return read


def ranges_dataset(ranges) -> tf.data.Dataset:
    """``ranges`` as a dataset of (path, start, end): a ``tf.data.Dataset`` of triples,
    a list/tuple of triples, a callable returning an iterable of triples (re-iterated on
    every pass: the way to plug in a shard service) or a one-shot iterable."""
    if isinstance(ranges, tf.data.Dataset):
        return ranges
    if callable(ranges):
        gen = ranges
    elif isinstance(ranges, collections.abc.Sequence):
        items = [(os.fspath(p), int(s), int(e)) for p, s, e in ranges]
        if items:
            paths, starts, ends = zip(*items)
            return tf.data.Dataset.from_tensor_slices((list(paths), list(starts), list(ends)))
        gen = lambda: iter(())  # noqa: E731
    else:
        it = iter(ranges)
        gen = lambda: it  # noqa: E731

    def typed():
        for p, s, e in gen():
            yield os.fspath(p), int(s), int(e)

    return tf.data.Dataset.from_generator(typed, output_signature=_SIGNATURE)


def shard_records(path, start, end, fmt: str = "text", on_bad_record: str = "fail"):
    """A 1-D string tensor: the records of one range (graph ops plus one
    ``numpy_function`` call). Bad input (``deeprec_ext.data.ranges.BadInput``: a TFRecord
    CRC, a cut gzip stream, an unreadable file) fails the pipeline naming the file and
    position, or with ``on_bad_record="skip"`` is left out with a logged warning."""
    if on_bad_record not in ("fail", "skip"):
        raise ValueError(f"on_bad_record must be 'fail' or 'skip', got {on_bad_record!r}")
    skip = on_bad_record == "skip"
    start = tf.cast(start, tf.int64)
    end = tf.cast(end, tf.int64)
    if fmt in ("text", "text.gz"):
        read = _read_text(skip) if fmt == "text" else _read_gzip_text(skip)
        body, any_record = tf.numpy_function(read, [path, start, end], (tf.string, tf.bool),
                                             stateful=False)
        body.set_shape([])
        pieces = tf.strings.split(tf.reshape(body, [1]), "\n").flat_values
        pieces = tf.strings.regex_replace(pieces, "\r$", "")
        return tf.cond(any_record, lambda: pieces, lambda: tf.zeros([0], tf.string))
    if fmt in _BUFFERED:
        data, offsets, lengths = tf.numpy_function(
            _read_buffer(fmt, skip), [path, start, end], (tf.string, tf.int64, tf.int64),
            stateful=False)
        data.set_shape([])
        offsets.set_shape([None])
        lengths.set_shape([None])
        return tf.strings.substr(data, offsets, lengths)
    records = tf.numpy_function(_read_other(fmt, skip), [path, start, end], tf.string,
                                stateful=False)
    records.set_shape([None])
    return records


def record_dataset(ranges, fmt: str = "text", num_parallel_reads=tf.data.AUTOTUNE,
                   deterministic: bool = True, on_bad_record: str = "fail") -> tf.data.Dataset:
    """Records (scalar strings) of ``ranges`` in order: every record of a file split into
    adjacent ranges exactly once. ``fmt``: text, text.gz, tfrecord, tfrecord.gz, parquet
    (Parquet rows come as tab-separated lines). Paths may be URLs (``s3://``...: read
    through ``deeprec_ext.data.fs`` inside the per-shard call). ``on_bad_record``: see
    ``shard_records``."""
    ds = ranges_dataset(ranges)
    ds = ds.map(lambda p, s, e: shard_records(p, s, e, fmt, on_bad_record),
                num_parallel_calls=num_parallel_reads, deterministic=deterministic)
    return ds.unbatch()


_KIND_DTYPES = {"int64": tf.int64, "uint64": tf.uint64, "float32": tf.float32,
                "float64": tf.float64, "bool": tf.bool, "string": tf.string}


def _read_columns(kinds: dict, null_values: dict | None, skip: bool):
    def read(path, start, end):
        bad = [] if skip else None
        path = _as_str(path)

        def columns():
            try:
                return parquet_columns(path, int(start), int(end), kinds, null_values,
                                       index_dtype=np.int32)
            except BadInput as exc:  # a column missing or of another type in this file
                _report(bad, exc.path, exc.offset, exc.reason)
                return None

        out = _guarded(columns, path, int(start), bad)
        for b in bad or ():
            log.warning("bad input, skipped: %s: %s at row %d", b["path"], b["reason"],
                        b["offset"])
        if out is None:  # skipped: the shard holds no row
            out = []
            for kind in kinds.values():
                out += [b"", np.zeros(0, np.int32), np.zeros(0, np.int32)] \
                    if kind == "string" else [np.zeros(0, NUMBER_KINDS[kind])]
        # a scalar string leaves numpy_function as an object array
        return [np.array(x, dtype=object) if isinstance(x, bytes) else x for x in out]
    return read


def shard_columns(path, start, end, kinds: dict, null_values: dict | None = None,
                  on_bad_record: str = "fail") -> dict:
    """The rows of one Parquet range as ``{column: 1-D tensor}`` (``kinds``: ``{column:
    kind}`` as ``ranges.parquet_kinds`` gives). One ``numpy_function`` call per shard;
    string columns are cut in-graph from one buffer each, by int32 offsets and lengths
    (Arrow's own offsets, no widening copy). Bad input as ``shard_records`` (an unreadable
    file, a column missing or of another type in this file)."""
    if on_bad_record not in ("fail", "skip"):
        raise ValueError(f"on_bad_record must be 'fail' or 'skip', got {on_bad_record!r}")
    flat = tf.numpy_function(_read_columns(kinds, null_values, on_bad_record == "skip"),
                             [path, tf.cast(start, tf.int64), tf.cast(end, tf.int64)],
                             column_types(kinds, tf.int32),
                             stateful=False)
    return columns_from_flat(flat, kinds)


def column_types(kinds: dict, index=tf.int64) -> list:
    """The dtypes of ``kinds``' flat layout (``ranges.parquet_columns``): per string
    column ``tf.string`` (its bytes), then its offsets and lengths as ``index`` (int64,
    or int32 as ``shard_columns`` reads them)."""
    out = []
    for kind in kinds.values():
        out += [tf.string, index, index] if kind == "string" else [_KIND_DTYPES[kind]]
    return out


def column_signature(kinds: dict) -> tuple:
    """``column_types`` as ``TensorSpec``s (``Dataset.from_generator``)."""
    out = []
    for kind in kinds.values():
        out += [tf.TensorSpec([], tf.string), tf.TensorSpec([None], tf.int64),
                tf.TensorSpec([None], tf.int64)] if kind == "string" else \
            [tf.TensorSpec([None], _KIND_DTYPES[kind])]
    return tuple(out)


def columns_from_flat(flat, kinds: dict) -> dict:
    """``{column: 1-D tensor}`` from the flat layout: string values cut in-graph from
    their column's one buffer (``tf.strings.substr``; offsets and lengths int32 or int64),
    no Python object per value."""
    out, i = {}, 0
    for name, kind in kinds.items():
        if kind == "string":
            data, offsets, lengths = flat[i:i + 3]
            data.set_shape([])
            offsets.set_shape([None])
            lengths.set_shape([None])
            out[name] = tf.strings.substr(data, offsets, lengths)
            i += 3
        else:
            flat[i].set_shape([None])
            out[name] = flat[i]
            i += 1
    return out


def column_kinds(columns, schema_from, who: str = "parquet_dataset") -> dict[str, str]:
    """``{column: kind}`` of the ``columns`` to read (None: all), their kinds from the
    footer of ``schema_from`` (a Parquet path or URL) or given as ``{column: kind}``."""
    if isinstance(schema_from, dict):
        kinds = dict(schema_from)
        if columns is not None:
            missing = [c for c in columns if c not in kinds]
            if missing:
                raise ValueError(f"{who}: no kind given for columns {missing} in schema_from")
            kinds = {c: kinds[c] for c in columns}
        unknown = {c: k for c, k in kinds.items() if k not in _KIND_DTYPES}
        if unknown:
            raise ValueError(f"{who}: unknown column kinds {unknown} (one of "
                             f"{', '.join(_KIND_DTYPES)})")
    else:
        kinds = parquet_kinds(os.fspath(schema_from), None if columns is None else list(columns))
    if not kinds:
        raise ValueError(f"{who}: no column to read")
    return kinds


def parquet_dataset(ranges, batch_size: int | None = None, columns=None, schema_from=None,
                    null_values: dict | None = None, num_parallel_reads=tf.data.AUTOTUNE,
                    deterministic: bool = True, on_bad_record: str = "fail",
                    drop_remainder: bool = False) -> tf.data.Dataset:
    """Rows of Parquet ``ranges`` (row positions, as ``record_dataset``) as typed columns:
    ``{column: tensor}``, one row per element, or per batch of ``batch_size`` rows
    (``[batch]`` tensors; batches run across shards). No row is formatted as text.

    ``columns``: the columns to read (default: all, in file order). Their types come from
    the footer of ``schema_from`` (a Parquet path or URL; default: the first range's file
    when ``ranges`` is a list) or ``schema_from`` may be ``{column: kind}`` directly.
    Integers reach the graph as int64 (uint64 as uint64), floats as float32 (float64 as
    float64), bool as bool, strings and binaries as ``tf.string``; other types are an error
    naming the column. A null becomes ``null_values.get(column, 0)`` (false, empty
    string). ``on_bad_record``: as ``record_dataset``; a file where a column is missing or
    of another type counts as bad input at the shard's start."""
    if schema_from is None:
        if not (isinstance(ranges, collections.abc.Sequence) and ranges):
            raise ValueError("parquet_dataset: give schema_from=<a Parquet file> (or "
                             "{column: kind}) when ranges is not a non-empty list: the "
                             "columns and their types are read from a file's footer")
        schema_from = ranges[0][0]
    kinds = column_kinds(columns, schema_from, "parquet_dataset")
    ds = ranges_dataset(ranges)
    # plain Python over a fixed dict of columns: autograph's conversion of it only costs
    # (a quarter of building the pipeline, docs/BENCHMARKS.md)
    read = tf.autograph.experimental.do_not_convert(
        lambda p, s, e: shard_columns(p, s, e, kinds, null_values, on_bad_record))
    ds = ds.map(read, num_parallel_calls=num_parallel_reads, deterministic=deterministic)
    if batch_size is None:
        return ds.unbatch()
    # rebatch: unbatch().batch() with one copy, not a dataset element per row
    return _rebatch(ds, int(batch_size), bool(drop_remainder))


def _rebatch(ds: tf.data.Dataset, batch_size: int, drop_remainder: bool) -> tf.data.Dataset:
    """``ds.rebatch(batch_size)`` for a dataset of dense tensors, without the map
    ``Dataset.rebatch`` puts first to turn sparse and ragged components dense: with none
    here, tracing and running that map of one identity per column cost as much CPU as 0.2
    µs per row of a 160,000-row pipeline (measured in docs/BENCHMARKS.md). Same kernel
    (``RebatchDatasetV2``), so the same batches, copies and checkpoints."""
    spec = ds.element_spec
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return ds.rebatch(batch_size, drop_remainder=drop_remainder)
    out = tf.nest.map_structure(
        lambda s: tf.TensorSpec(tf.TensorShape([batch_size if drop_remainder else None])
                                .concatenate(s.shape[1:]), s.dtype), spec)
    flat = tf.nest.flatten(out)
    variant = tf.raw_ops.RebatchDatasetV2(
        input_dataset=tf.data.experimental.to_variant(ds),
        batch_sizes=tf.constant([batch_size], tf.int64),
        drop_remainder=tf.constant(drop_remainder),
        output_types=[s.dtype for s in flat], output_shapes=[s.shape for s in flat])
    batched = tf.data.experimental.from_variant(variant, out)
    options = ds.options()  # from_variant starts a new pipeline: keep the input's options
    return batched if options == tf.data.Options() else batched.with_options(options)


__all__ = ["record_dataset", "ranges_dataset", "shard_records", "parquet_dataset",
           "shard_columns", "column_kinds", "column_signature", "columns_from_flat"]
