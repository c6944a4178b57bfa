"""DeepFM for Criteo-style inputs, in Keras 3 and in TF1 graph style.

Inputs (both variants)::

    {"dense": float32 [batch, 13], "cat": int64 [batch, 26]}

Architecture (Guo et al. 2017)::

    e    = embedding(cat)                       [b, 26, dim]
    lin  = sum_j linear(cat)[:, j, 0] + Dense(1)(dense)
    fm   = 0.5 * sum_k ((sum_j e_jk)^2 - sum_j e_jk^2)
    deep = MLP(concat(flatten(e), dense)) -> 1
    p    = sigmoid(lin + fm + deep)

The embedding layers are pluggable: ``embedding_factory(name, dim)`` returns
a layer with the ``keras.layers.Embedding`` call signature (int64 ids of any
shape -> float32 ``ids.shape + [dim]``), so the same model can run with a
local Keras ``Embedding`` or with an elastic parameter-server embedding.
"""

from __future__ import annotations

import keras
import tensorflow as tf

NUM_DENSE = 13
NUM_CAT = 26


def _default_factory(vocab_size):
    if vocab_size is None:
        raise ValueError("vocab_size is required when no embedding_factory "
                         "is given")

    def factory(name, dim):
        return keras.layers.Embedding(
            int(vocab_size), dim, name=name,
            # seeded like the PS tables' initializer (normal, stddev 0.01, seed 7): an
            # unseeded one draws from Keras' global seed, so keras.utils.set_random_seed
            # would give the dense layers other values than with PS embeddings
            embeddings_initializer=keras.initializers.RandomNormal(
                stddev=0.01 if dim > 1 else 0.0, seed=7))
    return factory


def build_deepfm(embedding_factory=None, dim=8, hidden=(128, 64),
                 vocab_size=None, linear_factory=None, name="deepfm"):
    """Keras 3 functional DeepFM returning the click probability [batch, 1].

    ``embedding_factory(name, dim)`` is called with ``("embedding", dim)``
    and -- unless ``linear_factory`` is given, which then is called instead
    -- with ``("linear", 1)``.  With neither factory the model uses
    ``keras.layers.Embedding(vocab_size, dim)`` (ids must already be reduced
    modulo ``vocab_size``, e.g. ``reader.parse_lines(..., vocab_size=...)``).
    The model is not compiled.
    """
    if embedding_factory is None:
        embedding_factory = _default_factory(vocab_size)
    if linear_factory is None:
        linear_factory = embedding_factory

    dense_in = keras.Input(shape=(NUM_DENSE,), dtype="float32", name="dense")
    cat_in = keras.Input(shape=(NUM_CAT,), dtype="int64", name="cat")

    emb = embedding_factory("embedding", dim)(cat_in)          # [b, 26, dim]
    lin_emb = linear_factory("linear", 1)(cat_in)              # [b, 26, 1]

    # first order
    lin_cat = keras.ops.sum(keras.ops.reshape(lin_emb, (-1, NUM_CAT)),
                            axis=1, keepdims=True)             # [b, 1]
    lin_dense = keras.layers.Dense(1, name="linear_dense")(dense_in)

    # second order (FM)
    sum_sq = keras.ops.square(keras.ops.sum(emb, axis=1))      # [b, dim]
    sq_sum = keras.ops.sum(keras.ops.square(emb), axis=1)      # [b, dim]
    fm = 0.5 * keras.ops.sum(sum_sq - sq_sum, axis=1, keepdims=True)

    # deep
    x = keras.ops.concatenate(
        [keras.ops.reshape(emb, (-1, NUM_CAT * dim)), dense_in], axis=1)
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"deep_{i}")(x)
    deep = keras.layers.Dense(1, name="deep_out")(x)

    logit = keras.layers.Add(name="logit")([lin_cat, lin_dense, fm, deep])
    prob = keras.layers.Activation("sigmoid", name="prob")(logit)
    return keras.Model(inputs={"dense": dense_in, "cat": cat_in},
                       outputs=prob, name=name)


def build_deepfm_tf1(features, embedding_lookup_fn, dim=8, hidden=(128, 64),
                     scope="deepfm"):
    """TF1 graph-style DeepFM; returns logits of shape [batch].

    ``features`` is the dict from ``reader.parse_lines``.
    ``embedding_lookup_fn(name, ids, dim)`` must return
    ``ids.shape + [dim]`` float32; it is called with ``("embedding", cat,
    dim)`` and ``("linear", cat, 1)``.  Dense weights are created with
    ``tf.compat.v1.get_variable`` inside ``variable_scope(scope)``.  Apply
    ``tf.sigmoid`` for probabilities; the [batch] shape matches the label
    from the reader for ``tf.nn.sigmoid_cross_entropy_with_logits``.
    """
    v1 = tf.compat.v1
    dense = tf.convert_to_tensor(features["dense"], tf.float32)
    cat = tf.convert_to_tensor(features["cat"], tf.int64)
    with v1.variable_scope(scope):
        emb = embedding_lookup_fn("embedding", cat, dim)       # [b, 26, dim]
        emb = tf.reshape(emb, [-1, NUM_CAT, dim])
        lin_emb = embedding_lookup_fn("linear", cat, 1)        # [b, 26, 1]
        lin_cat = tf.reduce_sum(tf.reshape(lin_emb, [-1, NUM_CAT]), axis=1)

        w_lin = v1.get_variable("linear_dense/kernel", [NUM_DENSE, 1],
                                initializer=v1.glorot_uniform_initializer())
        b_lin = v1.get_variable("linear_dense/bias", [1],
                                initializer=v1.zeros_initializer())
        lin_dense = tf.squeeze(tf.matmul(dense, w_lin) + b_lin, axis=1)

        sum_sq = tf.square(tf.reduce_sum(emb, axis=1))
        sq_sum = tf.reduce_sum(tf.square(emb), axis=1)
        fm = 0.5 * tf.reduce_sum(sum_sq - sq_sum, axis=1)

        x = tf.concat([tf.reshape(emb, [-1, NUM_CAT * dim]), dense], axis=1)
        in_dim = NUM_CAT * dim + NUM_DENSE
        for i, units in enumerate(hidden):
            w = v1.get_variable(f"deep_{i}/kernel", [in_dim, units],
                                initializer=v1.glorot_uniform_initializer())
            b = v1.get_variable(f"deep_{i}/bias", [units],
                                initializer=v1.zeros_initializer())
            x = tf.nn.relu(tf.matmul(x, w) + b)
            in_dim = units
        w = v1.get_variable("deep_out/kernel", [in_dim, 1],
                            initializer=v1.glorot_uniform_initializer())
        b = v1.get_variable("deep_out/bias", [1],
                            initializer=v1.zeros_initializer())
        deep = tf.squeeze(tf.matmul(x, w) + b, axis=1)

        return tf.identity(lin_cat + lin_dense + fm + deep, name="logits")
