"""A tf.data source fed by the AIMaster's data-shard service.

Shards are byte ranges of files (records: lines of text such as Criteo TSV, TFRecord
payloads, or Parquet rows as TSV lines; docs/guide-data.md); each is read with one
``pread`` of its range (``deeprec_ext.data.ranges``). The source batches lines itself so that it can flush a short batch before it
waits for more shards: otherwise a worker whose last records sit in an unfinished batch
would wait for shards other workers hold, while they wait for it. A shard is reported DONE
only once the batches holding its records have been trained (see ``ShardTracker``); a
worker that dies mid-shard leaves it DOING and the master hands it to another worker.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from deeprec_ext.evaluation import is_evaluator
from deeprec_ext.worker import WorkerContext, get_context, shard_batches

# the evaluator's input: the training script's parse_fn, recorded by shard_dataset
EVAL_INPUT: dict = {}


def shard_dataset(batch_size: int, parse_fn: Callable | None = None,
                  context: WorkerContext | None = None, prefetch: int = 2) -> tf.data.Dataset:
    """Batches of lines (or of ``parse_fn(lines)``) from the shards this worker is given.

    The dataset ends when every shard of the job is DONE. Use it once per process: the
    ElasticCallback / ElasticSessionHook report progress for it.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ctx = context or get_context()
    if is_evaluator():  # evaluation while training: no training data (deeprec_ext.evaluation)
        ds = tf.data.Dataset.from_tensor_slices(tf.zeros([0], tf.string)).batch(batch_size)
        ds = ds.map(parse_fn) if parse_fn is not None else ds
        # element_spec: a TF1 graph's iterator outputs are found (and fed) by this structure
        EVAL_INPUT.update(parse_fn=parse_fn, batch_size=batch_size, element_spec=ds.element_spec)
        return ds
    ds = tf.data.Dataset.from_generator(
        lambda: (np.array(b, dtype=object) for b in shard_batches(ctx, batch_size)),
                                        output_signature=tf.TensorSpec([None], tf.string))
    if parse_fn is not None:
        ds = ds.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(prefetch)
