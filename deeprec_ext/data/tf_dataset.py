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
"""
from __future__ import annotations

import collections.abc
import logging
import os

import numpy as np
import tensorflow as tf

from deeprec_ext.data.ranges import (_guarded, gzip_text_body, read_buffer, read_shard,
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


__all__ = ["record_dataset", "ranges_dataset", "shard_records"]
