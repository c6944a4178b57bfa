"""TF1-style graphs: ``embedding_lookup`` (a PS-backed ``tf.nn.embedding_lookup``) and
``ElasticSessionHook`` for ``tf.compat.v1.train.MonitoredTrainingSession``."""
from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from deeprec_ext.evaluation import is_evaluator
from deeprec_ext.store.spec import check_dtype
from deeprec_ext.tf.dense import DenseSync
from deeprec_ext.tf.keras_api import (DEFAULT_INITIALIZER, DEFAULT_OPTIMIZER, _embedding_tables,
                                      record_table_spec)
from deeprec_ext.tf.op_sampler import sampler_for
from deeprec_ext.tf.ops import ANCHOR_SUFFIX, elastic_lookup
from deeprec_ext.tf.tf1_eval import TF1Evaluator
from deeprec_ext.worker import get_context

v1 = tf.compat.v1
log = logging.getLogger(__name__)
ANCHOR_COLLECTION = "deeprec_ext_push_anchors"


def embedding_lookup(name: str, ids, dim: int, initializer=None, optimizer=None,
                     training: bool = True, admission=None, eviction=None,
                     storage_dtype="float32") -> tf.Tensor:
    """Rows of PS table ``name`` for ``ids`` (any shape) -> ids.shape + [dim].

    Replaces ``tf.nn.embedding_lookup(tf.compat.v1.get_variable(name, [V, dim]), ids)``;
    the gradient is pushed to the PS when the optimizer computes it. ``admission`` /
    ``eviction``: the table's policies, ``storage_dtype`` ("float32" or "float16") how the
    PS stores its values, as for ``ElasticEmbedding``.
    """
    initializer = initializer if initializer is not None else DEFAULT_INITIALIZER
    optimizer = optimizer if optimizer is not None else DEFAULT_OPTIMIZER
    get_context().client.create_table(name, dim, initializer=initializer, optimizer=optimizer,
                                      admission=admission, eviction=eviction,
                                      dtype=storage_dtype)
    record_table_spec(name, dim, initializer, optimizer, admission, eviction,
                      check_dtype(storage_dtype, name))
    with v1.variable_scope(None, default_name=f"{name}_ps"):
        anchor = v1.get_variable(ANCHOR_SUFFIX, shape=[], dtype=tf.float32,
                                 initializer=v1.zeros_initializer(), trainable=True,
                                 use_resource=True)
    v1.add_to_collection(ANCHOR_COLLECTION, anchor)
    return elastic_lookup(name, dim, ids, anchor.read_value(), training=training)


class ElasticSessionHook(v1.train.SessionRunHook):
    """Shares the graph's dense trainable variables through the PS, reports progress and
    consumed data shards. Assumes each ``run`` of the session trains one batch."""

    def __init__(self, sync_every: int = 1):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every = sync_every
        self._since_sync = 0

    def begin(self):
        anchors = set(v1.get_collection(ANCHOR_COLLECTION))
        self._vars = [v for v in v1.trainable_variables() if v not in anchors]
        self._evaluator = None
        if is_evaluator():  # score the graph, never train it (deeprec_ext.tf.tf1_eval)
            self._evaluator = TF1Evaluator(self._vars)
            return
        self._placeholders = [v1.placeholder(v.dtype.base_dtype, v.shape) for v in self._vars]
        self._assign_op = tf.group(*[v.assign(p) for v, p in zip(self._vars, self._placeholders)])
        self._dense = DenseSync(get_context().client, [v.op.name for v in self._vars],
                                [tuple(v.shape.as_list()) for v in self._vars])
        # synced every step: the step's embedding gradients and dense deltas share one
        # push per PS (held by the batcher until after_run)
        get_context().batcher.hold_pushes = self.sync_every == 1 and bool(self._vars)

    def _assign(self, session, values):
        if self._vars:
            session.run(self._assign_op, feed_dict=dict(zip(self._placeholders, values)))

    def after_create_session(self, session, coord):
        if is_evaluator():
            # the evaluation rounds run here, until training ends; then the session stops
            # before the script's first training run
            self._evaluator.run(session)
            coord.request_stop()
            return
        if self._vars:
            self._assign(session, self._dense.create(session.run(self._vars)))
        ctx = get_context()
        if ctx.rank == 0:  # the tables, for `aimaster export` (a lookup signature per table)
            ctx.put_model({"kind": "tables", "tables": _embedding_tables(ctx.client.table_specs),
                           "dense_shapes": {v.op.name: v.shape.as_list() for v in self._vars},
                           "tensorflow": tf.__version__})

    def before_run(self, run_context):
        if is_evaluator():  # a script that ignores should_stop(): its input is over
            raise tf.errors.OutOfRangeError(None, None, "the evaluator trains nothing")
        # Gazer: every N steps trace this run's ops (RunMetadata.step_stats)
        options = sampler_for(get_context()).run_options()
        return v1.train.SessionRunArgs(fetches=None, options=options) if options else None

    def after_run(self, run_context, run_values):
        ctx = get_context()
        sampler_for(ctx).add_run_metadata(run_values.run_metadata)
        session = run_context.session
        if ctx.batcher.hold_pushes:
            self._assign(session, self._dense.sync(session.run(self._vars),
                                                   send=ctx.batcher.end_step))
            ctx.step_done(1)
        else:
            ctx.step_done(1)
            self._since_sync += 1
            if self._since_sync >= self.sync_every and self._vars:
                self._assign(session, self._dense.sync(session.run(self._vars)))
                self._since_sync = 0
        if ctx.stop_requested.is_set():
            run_context.request_stop()  # leave at this step boundary

    def end(self, session):
        if is_evaluator():
            return
        ctx = get_context()
        ctx.batcher.hold_pushes = False
        ctx.settle()
        if self._vars and self._dense.base is not None:
            self._dense.sync(session.run(self._vars))
        ctx.tracker.finish()
