"""The TensorFlow form of the PS initializers (used by exports for unseen ids) gives the
PS's values bit for bit, for every kind, in a graph with an unknown batch size."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from deeprec_ext.serving.tf_initializers import initial_values  # noqa: E402
from deeprec_ext.store.initializers import make_initializer  # noqa: E402

I64 = np.iinfo(np.int64)
KEYS = np.concatenate([[0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1],
                       np.random.default_rng(0).integers(I64.min, I64.max, 100_000,
                                                         dtype=np.int64)])


@pytest.mark.parametrize("spec,dim", [
    ("zeros", 4), ("ones", 3), ({"name": "constant", "value": 0.3}, 2),
    ("uniform", 1), ({"name": "uniform", "minval": -1.0, "maxval": 3.0, "seed": 5}, 8),
    ({"name": "normal", "stddev": 0.01, "seed": 7}, 8),
    ({"name": "normal", "mean": 1.5, "stddev": 2.0, "seed": -3}, 16),
    ("truncated_normal", 8), ({"name": "truncated_normal", "stddev": 0.3, "seed": 2**63}, 5),
])
def test_bit_identical_to_the_ps(spec, dim):
    init = make_initializer(spec, dim)
    fn = tf.function(lambda k: initial_values(init.config, dim, k),
                     input_signature=[tf.TensorSpec([None], tf.int64)])
    got = fn(tf.constant(KEYS)).numpy()
    want = init(KEYS)
    assert got.shape == want.shape == (KEYS.size, dim)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert fn(tf.constant([], tf.int64)).numpy().shape == (0, dim)


def test_tails_of_the_normal_are_exercised():
    init = make_initializer({"name": "normal", "stddev": 1.0}, 16)
    v = init(KEYS)
    assert (np.abs(v) > 1.97).mean() > 0.03  # the float64 tail branch, |q| > 0.5 - 0.02425
    got = initial_values(init.config, 16, tf.constant(KEYS)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), v.view(np.uint32))
