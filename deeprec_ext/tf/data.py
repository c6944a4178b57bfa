"""A tf.data source fed by the AIMaster's data-shard service.

Shards are (file, record range) over line-oriented files (one record per line, such as
Criteo TSV). The source batches lines itself so that it can flush a short batch before it
waits for more shards: otherwise a worker whose last records sit in an unfinished batch
would wait for shards other workers hold, while they wait for it. A shard is reported DONE
only once the batches holding its records have been trained (see ``ShardTracker``); a
worker that dies mid-shard leaves it DOING and the master hands it to another worker.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np
import tensorflow as tf

from deeprec_ext.proto import master_pb2
from deeprec_ext.worker import WorkerContext, get_context

_SHARD = master_pb2.GetShardResponse.SHARD
_FINISHED = master_pb2.GetShardResponse.FINISHED


class _LineCursor:
    """Open file plus the index of its next line, so consecutive shards of one file are
    read without re-skipping from the start."""

    def __init__(self):
        self.path, self.fh, self.next_line = None, None, 0

    def read(self, path: str, start: int, end: int):
        if path != self.path or start < self.next_line:
            self.close()
            self.path, self.fh, self.next_line = path, open(path, "rb"), 0
        if start > self.next_line:
            for _ in itertools.islice(self.fh, start - self.next_line):
                pass
        lines = [line.rstrip(b"\r\n") for line in itertools.islice(self.fh, end - start)]
        self.next_line = start + len(lines)
        if len(lines) != end - start:
            raise ValueError(f"{path}: shard wants lines [{start}, {end}) but the file has "
                             f"{self.next_line} lines")
        return lines

    def close(self):
        if self.fh is not None:
            self.fh.close()
        self.path, self.fh, self.next_line = None, None, 0


def shard_batches(ctx: WorkerContext, batch_size: int, poll_seconds: float = 0.2):
    """Generator of numpy string batches for this worker (flushes before waiting)."""
    cursor = _LineCursor()
    buf: list[bytes] = []

    def emit(n):
        nonlocal buf
        out, buf = buf[:n], buf[n:]
        ctx.tracker.emitted(len(out))
        return np.array(out, dtype=object)

    try:
        while True:
            resp = ctx.try_next_shard()
            if resp.status == _SHARD:
                s = resp.shard
                buf.extend(cursor.read(s.path, s.start, s.end))
                ctx.tracker.add(s.shard_id, s.end - s.start)
                while len(buf) >= batch_size:
                    yield emit(batch_size)
                continue
            if buf:
                yield emit(len(buf))
            if resp.status == _FINISHED:
                return
            time.sleep(poll_seconds)
    finally:
        cursor.close()


def shard_dataset(batch_size: int, parse_fn: Callable | None = None,
                  context: WorkerContext | None = None, prefetch: int = 2) -> tf.data.Dataset:
    """Batches of lines (or of ``parse_fn(lines)``) from the shards this worker is given.

    The dataset ends when every shard of the job is DONE. Use it once per process: the
    ElasticCallback / ElasticSessionHook report progress for it.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ctx = context or get_context()
    ds = tf.data.Dataset.from_generator(lambda: shard_batches(ctx, batch_size),
                                        output_signature=tf.TensorSpec([None], tf.string))
    if parse_fn is not None:
        ds = ds.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(prefetch)
