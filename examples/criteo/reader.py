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

import collections.abc
import os

import tensorflow as tf

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


_RANGE_SIGNATURE = (tf.TensorSpec([], tf.string),
                    tf.TensorSpec([], tf.int64),
                    tf.TensorSpec([], tf.int64))


def _ranges_to_dataset(ranges):
    if isinstance(ranges, tf.data.Dataset):
        return ranges
    if callable(ranges):        # generator function: re-iterable
        gen = ranges
    elif isinstance(ranges, collections.abc.Sequence):
        items = [(os.fspath(p), int(s), int(e)) for p, s, e in ranges]
        if items:
            paths, starts, ends = zip(*items)
            return tf.data.Dataset.from_tensor_slices(
                (list(paths), list(starts), list(ends)))
        gen = lambda: iter(())  # noqa: E731
    else:                       # one-shot iterable (e.g. a generator)
        it = iter(ranges)
        gen = lambda: it        # noqa: E731

    def typed():
        for p, s, e in gen():
            yield os.fspath(p), int(s), int(e)

    return tf.data.Dataset.from_generator(typed,
                                          output_signature=_RANGE_SIGNATURE)


def line_dataset_for_ranges(ranges, compression_type=None, buffer_size=None):
    """Lines of record ranges, in order.

    ``ranges`` is a ``tf.data.Dataset`` of ``(path, start_record,
    end_record)`` triples (end exclusive), a list/tuple of such triples, a
    callable returning an iterable of triples (re-iterated on every pass, the
    usual way to plug in a data-shard service), or any other iterable
    (consumed once).  Each range yields
    ``TextLineDataset(path).skip(start).take(end - start)``.
    """
    ds = _ranges_to_dataset(ranges)

    def read(path, start, end):
        start = tf.cast(start, tf.int64)
        end = tf.cast(end, tf.int64)
        lines = tf.data.TextLineDataset(path, compression_type=compression_type,
                                        buffer_size=buffer_size)
        return lines.skip(start).take(tf.maximum(end - start, 0))

    return ds.flat_map(read)


def criteo_dataset_for_ranges(ranges, batch_size, vocab_size=None,
                              drop_remainder=False, **kwargs):
    """Parsed (features, label) batches of the lines of record ranges."""
    return _batch_and_parse(line_dataset_for_ranges(ranges, **kwargs),
                            batch_size, vocab_size, drop_remainder)


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
