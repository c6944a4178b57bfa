"""A tf.data source fed by the AIMaster's data-shard service.

Shards are byte ranges of files (records: lines of text such as Criteo TSV, TFRecord
payloads, or Parquet rows as TSV lines or as typed columns; docs/guide-data.md); each is read with one
``pread`` of its range (``deeprec_ext.data.ranges``). The source batches lines itself so that it can flush a short batch before it
waits for more shards: otherwise a worker whose last records sit in an unfinished batch
would wait for shards other workers hold, while they wait for it. A shard is reported DONE
only once the batches holding its records have been trained (see ``ShardTracker``); a
worker that dies mid-shard leaves it DOING and the master hands it to another worker.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import tensorflow as tf

from deeprec_ext.evaluation import is_evaluator
from deeprec_ext.worker import WorkerContext, get_context, shard_batches

# the evaluator's input: the training script's parse_fn, recorded by shard_dataset
EVAL_INPUT: dict = {}


def _first_kinds(ctx: WorkerContext, columns, schema_from, poll_seconds: float = 0.2):
    """Column kinds for ``shard_dataset(columns=...)``: from ``schema_from``, else from
    the footer of the first shard this worker is given (taken now, trained first), else,
    when the job's shards were all DONE before this worker got one, from the job's file
    the AIMaster names with FINISHED (the dataset is then empty)."""
    from deeprec_ext.data.tf_dataset import column_kinds
    from deeprec_ext.proto import master_pb2
    if schema_from is not None:
        return column_kinds(columns, schema_from, "shard_dataset"), None
    if isinstance(columns, dict):
        return column_kinds(None, columns, "shard_dataset"), None
    while not ctx.stop_requested.is_set():
        resp = ctx.try_next_shard()
        if resp.status == master_pb2.GetShardResponse.SHARD:
            return column_kinds(columns, resp.shard.path, "shard_dataset"), resp
        if resp.status == master_pb2.GetShardResponse.FINISHED:
            if resp.shard.path:
                return column_kinds(columns, resp.shard.path, "shard_dataset"), None
            break
        time.sleep(poll_seconds)
    raise ValueError("shard_dataset(columns=...): no data shard to read the columns' types "
                     "from; give schema_from=<a Parquet file> or columns={name: kind}")


def _eval_kinds(columns, schema_from):
    from deeprec_ext.data.tf_dataset import column_kinds
    from deeprec_ext.evaluation import eval_files, eval_spec
    if schema_from is None and not isinstance(columns, dict):
        files = eval_files(eval_spec()["files"])
        schema_from = files[0]
    if isinstance(columns, dict):
        return column_kinds(None, columns, "shard_dataset")
    return column_kinds(columns, schema_from, "shard_dataset")


def shard_dataset(batch_size: int, parse_fn: Callable | None = None,
                  context: WorkerContext | None = None, prefetch: int = 2,
                  columns=None, schema_from=None,
                  null_values: dict | None = None) -> tf.data.Dataset:
    """Batches of lines (or of ``parse_fn(lines)``) from the shards this worker is given.

    ``columns``: read Parquet shards as typed columns instead of lines: each batch is
    ``{column: [batch] tensor}`` (passed to ``parse_fn`` if given). A list of names (their
    types from the footer of ``schema_from``, else of the first shard's file), ``"all"``,
    or ``{name: kind}`` (``int64``, ``uint64``, ``float32``, ``float64``, ``bool``,
    ``string``). Nulls become ``null_values.get(column, 0)`` (false, empty string).

    The dataset ends when every shard of the job is DONE. Use it once per process: the
    ElasticCallback / ElasticSessionHook report progress for it.
    """
    from deeprec_ext.data.tf_dataset import column_signature, columns_from_flat
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(columns, str):
        if columns != "all":
            raise ValueError(f"columns must be a list of names, a {{name: kind}} dict or "
                             f"'all', got {columns!r}")
    elif columns is not None and not isinstance(columns, (list, tuple, dict)):
        raise ValueError(f"columns must be a list of names, a {{name: kind}} dict or 'all', "
                         f"got {type(columns).__name__}")
    names = None if columns in (None, "all") else columns
    ctx = context or get_context()
    if is_evaluator():  # evaluation while training: no training data (deeprec_ext.evaluation)
        if columns is None:
            ds = tf.data.Dataset.from_tensor_slices(tf.zeros([0], tf.string)).batch(batch_size)
            kinds = None
        else:
            kinds = _eval_kinds(names, schema_from)
            ds = tf.data.Dataset.from_generator(lambda: iter(()),
                                                output_signature=column_signature(kinds))
            ds = ds.map(lambda *flat: columns_from_flat(list(flat), kinds))
        ds = ds.map(parse_fn) if parse_fn is not None else ds
        # element_spec: a TF1 graph's iterator outputs are found (and fed) by this structure
        EVAL_INPUT.update(parse_fn=parse_fn, batch_size=batch_size, element_spec=ds.element_spec,
                          kinds=kinds, null_values=null_values)
        return ds
    if columns is None:
        ds = tf.data.Dataset.from_generator(
            lambda: (np.array(b, dtype=object) for b in shard_batches(ctx, batch_size)),
            output_signature=tf.TensorSpec([None], tf.string))
    else:
        kinds, first = _first_kinds(ctx, names, schema_from)
        taken = [first]

        def batches():
            first, taken[0] = taken[0], None  # the peeked shard, once
            for b in shard_batches(ctx, batch_size, kinds=kinds, null_values=null_values,
                                   first=first):
                yield tuple(b.flat())
        ds = tf.data.Dataset.from_generator(batches, output_signature=column_signature(kinds))
        ds = ds.map(lambda *flat: columns_from_flat(list(flat), kinds))
    if parse_fn is not None:
        ds = ds.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return look_ahead(ds, ctx).prefetch(prefetch)


def look_ahead(dataset: tf.data.Dataset, context: WorkerContext | None = None) -> tf.data.Dataset:
    """``dataset`` unchanged, each batch's integer features noted as it is produced, so
    that a step's lookups of the next batch's ids leave while the step trains
    (``deeprec_ext.lookahead``). ``shard_dataset`` does this already; call it on a
    dataset of your own, last before its ``prefetch``. Features a table does not read
    cost their ``tf.unique`` on the input thread and are never looked up."""
    ctx = context or get_context()
    if is_evaluator():
        return dataset

    def note(*uniqs):
        ctx.lookahead.note(uniqs)
        return np.int8(0)

    def mark(*element):
        flat = tf.nest.flatten(element)
        ints = [t for t in flat if t.dtype in (tf.int32, tf.int64) and t.shape.rank != 0]
        if not ints:
            return element if len(element) > 1 else element[0]
        uniqs = [tf.unique(tf.reshape(tf.cast(t, tf.int64), [-1]))[0] for t in ints]
        done = tf.numpy_function(note, uniqs, tf.int8, stateful=True, name="deeprec_note_ids")
        with tf.control_dependencies([done]):
            flat = [tf.identity(t) for t in flat]
        out = tf.nest.pack_sequence_as(element, flat)
        return out if len(out) > 1 else out[0]

    return dataset.map(mark)
