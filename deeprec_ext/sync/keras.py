"""Keras models in the sync mode: ``SyncEmbedding`` layers and ``KerasStepModel``.

``SyncEmbedding`` is called, like ``keras.layers.Embedding``, on an int64 id feature; in
the sync loop that feature holds positions into the micro-batch's unique ids, whose rows
the runtime fetched from the PS for this step. The layer gathers from a per-micro-batch
variable, so the gradient of the loss with respect to those rows comes out of one
``tf.GradientTape`` along with the dense gradients, and the loop sends both to the PS.
"""
from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf


def configure_determinism(seed: int = 0) -> None:
    """Make a process compute bit-identical gradients for the same inputs: deterministic
    TF kernels, one intra/inter-op thread (no reduction order that depends on scheduling)
    and seeded Python/numpy/TF/Keras generators, so every worker builds the same initial
    dense weights. Call before any TensorFlow op runs."""
    os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(seed)


class SyncEmbedding(keras.layers.Layer):
    """Rows of PS table ``table`` for the positions in id feature ``feature``."""

    def __init__(self, dim: int, table: str, feature: str, initializer="zeros",
                 optimizer=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"SyncEmbedding: dim must be a positive int, got {dim!r}")
        self.dim, self.table, self.feature = dim, table, feature
        self.initializer = initializer
        self.optimizer_spec = optimizer or {"name": "adam", "learning_rate": 1e-3}
        # not a Keras weight: the runtime assigns this micro-batch's rows before each step
        self.rows = tf.Variable(tf.zeros([0, dim]), shape=tf.TensorShape([None, dim]),
                                trainable=False, name=f"{table}_rows")

    def call(self, positions):
        return tf.gather(self.rows, tf.cast(positions, tf.int64))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.dim,)


class KerasStepModel:
    """Adapts a Keras model built with ``SyncEmbedding`` layers to the sync step loop.

    ``loss_fn(label, prediction)`` returns the mean loss of a micro-batch; it is divided
    by V, so the PS sum of the V contributions is the gradient of the global batch's
    mean loss. Dense variables are trained on the PS with ``dense_optimizer``.
    """

    def __init__(self, model: keras.Model, loss_fn, virtual_workers_hint: int = 1,
                 dense_optimizer: dict | None = None):
        self.model = model
        self.loss_fn = loss_fn
        self.embeddings = [layer for layer in model._flatten_layers()
                           if isinstance(layer, SyncEmbedding)]
        row_ids = {id(layer.rows) for layer in self.embeddings}
        self.dense_vars = [v for v in model.trainable_variables if id(v) not in row_ids]
        self._dense_optimizer = dense_optimizer or {"name": "adam", "learning_rate": 1e-3}
        self._scale = tf.Variable(1.0 / virtual_workers_hint, trainable=False, dtype=tf.float32)
        self._grads = tf.function(self._gradients, reduce_retracing=True)

    def tables(self):
        return {l.table: (l.dim, l.feature, l.initializer, l.optimizer_spec) for l in self.embeddings}

    def dense(self):
        return [(v.path, tuple(v.shape), np.asarray(v.numpy())) for v in self.dense_vars]

    def dense_optimizer(self):
        return self._dense_optimizer

    def set_dense(self, values):
        for v, value in zip(self.dense_vars, values):
            v.assign(value)

    def set_virtual_workers(self, v: int) -> None:
        self._scale.assign(1.0 / v)

    def _gradients(self, features, label):
        rows = [layer.rows for layer in self.embeddings]
        with tf.GradientTape() as tape:
            tape.watch(rows)
            pred = self.model(features, training=True)
            loss = self.loss_fn(label, pred) * self._scale
        grads = tape.gradient(loss, self.dense_vars + rows)
        n = len(self.dense_vars)
        dense = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for v, g in zip(self.dense_vars, grads[:n])]
        row_grads = [tf.zeros_like(r) if g is None else tf.convert_to_tensor(g)
                     for r, g in zip(rows, grads[n:])]
        return loss, dense, row_grads

    def gradients(self, features, label, rows):
        for layer in self.embeddings:
            layer.rows.assign(rows[layer.table])
        loss, dense, row_grads = self._grads(features, label)
        return (float(loss), [g.numpy() for g in dense],
                {layer.table: g.numpy() for layer, g in zip(self.embeddings, row_grads)})
