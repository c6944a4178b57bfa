"""A tf.data source fed by the AIMaster's data-shard service.

Shards are (file, record range) over line-oriented files (one record per line, such as
Criteo TSV). A shard is reported DONE only once the batches holding its records have been
trained (see ``ShardTracker``); a worker that dies mid-shard leaves it DOING, and the
master hands it to another worker.
"""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

from deeprec_ext.worker import WorkerContext, get_context


def shard_dataset(batch_size: int, parse_fn: Callable | None = None,
                  context: WorkerContext | None = None, prefetch: int = 2) -> tf.data.Dataset:
    """Batches of lines (or of ``parse_fn(lines)``) from the shards this worker is given.

    The dataset ends when every shard of the job is DONE. Use it once per process: the
    ElasticCallback / ElasticSessionHook report progress for it.
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ctx = context or get_context()
    ctx.tracker.batch_size = batch_size

    def shards():
        while True:
            shard = ctx.next_shard()
            if shard is None:
                return
            ctx.tracker.add(shard.shard_id, shard.end - shard.start)
            yield shard.path, shard.start, shard.end

    ranges = tf.data.Dataset.from_generator(shards, output_signature=(
        tf.TensorSpec((), tf.string), tf.TensorSpec((), tf.int64), tf.TensorSpec((), tf.int64)))
    lines = ranges.flat_map(lambda path, start, end:
                            tf.data.TextLineDataset(path).skip(start).take(end - start))
    ds = lines.batch(batch_size)
    if parse_fn is not None:
        ds = ds.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(prefetch)
