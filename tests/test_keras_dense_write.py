"""The dense sync's write of Keras variables (``keras_api._writer``): the variable's own
tf.Variable assigned without Keras' wrapper, exactly what Keras' ``assign`` leaves."""
from __future__ import annotations

import keras
import numpy as np
import pytest

from deeprec_ext.tf.keras_api import _DenseStep, _raw_variables, _writer


def _model():
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return m


def test_writer_leaves_what_keras_assign_leaves_and_training_goes_on():
    a, b = _model(), _model()
    rng = np.random.default_rng(1)
    x, y = rng.random((32, 6), np.float32), rng.random((32, 1), np.float32)
    writers = [_writer(v) for v in a.trainable_variables]
    assert all(w.__name__ == "write" for w in writers)  # the direct path is taken
    for step in range(3):
        values = [rng.standard_normal(v.shape).astype(np.float32)
                  for v in a.trainable_variables]
        kept = [v.copy() for v in values]
        for w, value in zip(writers, values):
            w(value)
        for v, value in zip(b.trainable_variables, values):
            v.assign(value)
        for va, vb in zip(a.trainable_variables, b.trainable_variables):
            np.testing.assert_array_equal(va.numpy(), vb.numpy())
        a.train_on_batch(x, y)
        b.train_on_batch(x, y)
        for va, vb in zip(a.trainable_variables, b.trainable_variables):
            np.testing.assert_array_equal(va.numpy(), vb.numpy())  # the optimizer saw them
        for value, k in zip(values, kept):  # the variable does not share the array
            np.testing.assert_array_equal(value, k)
    assert not np.array_equal(a.trainable_variables[0].numpy(), values[0])  # it trained


def test_writer_refuses_a_wrong_shape_and_falls_back_for_other_dtypes():
    m = _model()
    v = m.trainable_variables[0]
    before = v.numpy().copy()
    with pytest.raises(ValueError, match=r"variable.shape=\(6, 5\).*value.shape=\(5, 6\)"):
        _writer(v)(np.zeros((5, 6), np.float32))
    np.testing.assert_array_equal(v.numpy(), before)
    d = keras.Variable(np.zeros(3), dtype="float64")
    write = _writer(d)
    assert write == d.assign  # not float32: Keras' own assign
    write(np.arange(3.0))
    np.testing.assert_array_equal(d.numpy(), [0.0, 1.0, 2.0])


def test_dense_step_reads_and_adopts_in_one_call_exactly_as_numpy():
    """The step end's ``merged + (local - sent)`` as one TensorFlow call: bit for bit
    ``DenseSync.finish_sync``'s float32 arithmetic, assigned to the variables, returned
    as arrays that later training does not change."""
    a = _model()
    rng = np.random.default_rng(2)
    x, y = rng.random((32, 6), np.float32), rng.random((32, 1), np.float32)
    raws = _raw_variables(a.trainable_variables)
    assert raws is not None and len(raws) == 4
    step = _DenseStep(raws)
    for _ in range(3):
        local = [v.numpy().copy() for v in a.trainable_variables]
        read = step.read()
        for r, v in zip(read, local):
            np.testing.assert_array_equal(r, v)
        merged = [rng.standard_normal(v.shape).astype(np.float32) for v in local]
        sent = [v - rng.random(v.shape).astype(np.float32) for v in local]
        want = [m + (v - s) for m, v, s in zip(merged, local, sent)]
        got = step.adopt(merged, sent)
        for g, w, v in zip(got, want, a.trainable_variables):
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(v.numpy(), w)
        kept = [g.copy() for g in got]
        a.train_on_batch(x, y)  # the optimizer steps from the adopted values
        for g, k in zip(got, kept):
            np.testing.assert_array_equal(g, k)
        assert not np.array_equal(a.trainable_variables[0].numpy(), kept[0])
    assert _raw_variables([keras.Variable(np.zeros(3), dtype="float64")]) is None

