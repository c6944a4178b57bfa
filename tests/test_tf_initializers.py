"""The TensorFlow form of the PS initializers (used by exports for unseen ids) gives the
PS's values bit for bit, for every kind, eagerly, in a graph with an unknown batch size,
in a Keras layer, and in a SavedModel that stock TensorFlow loads without this project."""
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from deeprec_ext.serving.tf_initializers import initial_values  # noqa: E402
from deeprec_ext.store import initializers as np_init  # noqa: E402
from deeprec_ext.store.initializers import make_initializer  # noqa: E402

I64 = np.iinfo(np.int64)
EDGE_KEYS = [0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1]
KEYS = np.concatenate([EDGE_KEYS, np.random.default_rng(0).integers(
    I64.min, I64.max, 100_000, dtype=np.int64, endpoint=True)]).astype(np.int64)
ANY_BATCH = [tf.TensorSpec([None], tf.int64)]


def graph_fn(config, dim):
    """initial_values in a tf.function whose batch size is unknown when traced."""
    def fn(keys):
        return initial_values(config, dim, keys)
    return tf.function(fn, input_signature=ANY_BATCH)


def assert_bits_equal(got, want):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} values differ, e.g. "
                           f"{got[bad][:3]} vs {want[bad][:3]}")


CASES = [
    ("zeros", 1), ("zero", 8), ("ones", 16), ({"name": "one"}, 3),
    ({"name": "constant", "value": 0.3}, 8), ({"name": "constant", "value": -1e30}, 1),
    ("uniform", 1),
    ({"name": "random_uniform", "minval": -1.0, "maxval": 3.0, "seed": 5}, 8),
    ({"name": "uniform", "minval": 0.25, "maxval": 0.25, "seed": -1}, 16),  # zero width
    # maxval - minval overflows float32 to inf; clipping brings values back in range
    ({"name": "uniform", "minval": -3e38, "maxval": 3e38, "seed": 2**64 + 5}, 8),
    ("normal", 1),
    ({"name": "normal", "stddev": 0.01, "seed": 7}, 8),
    ({"name": "random_normal", "mean": 1.5, "stddev": 2.0, "seed": -3}, 16),
    # this seed cancels the domain constant: hash64 runs without a seed xor
    ({"name": "normal", "stddev": 1.0, "seed": np_init._INIT_DOMAIN}, 16),
    ("truncated_normal", 1),
    ({"name": "truncated_normal", "stddev": 0.3, "seed": 2**63}, 8),
    ({"name": "truncated_normal", "mean": -0.5, "stddev": 1.0, "seed": 11}, 16),
]


@pytest.mark.parametrize("spec,dim", CASES, ids=[f"{s if isinstance(s, str) else s['name']}"
                                                 f"-{i}-d{d}" for i, (s, d) in enumerate(CASES)])
def test_bit_identical_to_the_ps_in_a_graph(spec, dim):
    init = make_initializer(spec, dim)
    fn = graph_fn(init.config, dim)
    assert_bits_equal(fn(tf.constant(KEYS)).numpy(), init(KEYS))
    assert fn(tf.constant(KEYS[:1])).numpy().shape == (1, dim)
    assert fn(tf.constant([], tf.int64)).numpy().shape == (0, dim)


def test_every_registered_name_has_a_tf_form():
    for name in sorted(set(np_init._REGISTRY)):
        init = make_initializer(name, 4)
        got = initial_values(name, 4, tf.constant(KEYS[:2000])).numpy()  # a spec works too
        assert_bits_equal(got, init(KEYS[:2000]))


def test_tails_of_the_inverse_cdf_are_exercised_and_exact():
    """The float64 tail branch (|q| > 0.5 - 0.02425, ~5% of normal values) is computed on
    a compacted subset and scattered back; check it is hit and exact, eagerly."""
    for name, bound in (("normal", 1.97), ("truncated_normal", 1.99)):
        init = make_initializer({"name": name, "stddev": 1.0}, 16)
        want = init(KEYS)
        assert (np.abs(want) > bound).mean() > (0.03 if name == "normal" else 1e-3)
        assert_bits_equal(initial_values(init.config, 16, tf.constant(KEYS)).numpy(), want)
    assert np.abs(want).max() <= 2.0


def test_key_dtype_and_shape_are_normalized():
    init = make_initializer("normal", 8)
    small = np.arange(-500, 500, dtype=np.int64)
    want = init(small)
    assert_bits_equal(initial_values(init.config, 8, tf.constant(small, tf.int32)).numpy(), want)
    assert_bits_equal(initial_values(init.config, 8, tf.reshape(small, [10, 100])).numpy(), want)


def test_bad_specs_are_refused_at_trace_time():
    with pytest.raises(ValueError, match="unknown initializer"):
        initial_values({"name": "glorot"}, 4, tf.constant(KEYS[:3]))
    with pytest.raises(ValueError, match="stddev"):
        initial_values({"name": "normal", "stddev": -1.0}, 4, tf.constant(KEYS[:3]))


def test_usable_from_a_keras_layer():
    import keras

    init = make_initializer({"name": "truncated_normal", "stddev": 0.2, "seed": 3}, 8)

    class InitialRows(keras.layers.Layer):
        def call(self, ids):
            return initial_values(init.config, 8, ids)

        def compute_output_shape(self, input_shape):
            return tuple(input_shape) + (8,)

    ids = keras.Input(shape=(), dtype="int64")
    model = keras.Model(ids, InitialRows()(ids))
    keys = KEYS[:5000]
    assert_bits_equal(np.asarray(model(tf.constant(keys))), init(keys))
    traced = tf.function(model, input_signature=ANY_BATCH)
    assert_bits_equal(traced(tf.constant(keys)).numpy(), init(keys))


SAVED_KINDS = {
    "zeros": ("zeros", 8),
    "constant": ({"name": "constant", "value": -0.75}, 8),
    "uniform": ({"name": "uniform", "minval": -0.1, "maxval": 0.2, "seed": 9}, 8),
    "normal": ({"name": "normal", "mean": 0.5, "stddev": 0.01, "seed": -7}, 16),
    "truncated_normal": ({"name": "truncated_normal", "seed": 2**63 + 1}, 1),
}

CHILD = textwrap.dedent("""
    import sys
    sys.modules["deeprec_ext"] = None  # the serving host has stock TensorFlow only
    try:
        import deeprec_ext  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("deeprec_ext was importable in the child")
    import os
    import numpy as np
    import tensorflow as tf

    d = sys.argv[1]
    keys = tf.constant(np.load(os.path.join(d, "keys.npy")))
    m = tf.saved_model.load(os.path.join(d, "model"))
    assert "deeprec_ext" not in sys.modules or sys.modules["deeprec_ext"] is None
    for name in sys.argv[2:]:
        want = np.load(os.path.join(d, name + ".npy"))
        for got in (getattr(m, name)(keys).numpy(),
                    m.signatures[name](keys=keys)["output_0"].numpy()):
            assert got.shape == want.shape, (name, got.shape, want.shape)
            bad = int((got.view(np.uint32) != want.view(np.uint32)).sum())
            assert bad == 0, f"{name}: {bad} values differ"
        assert getattr(m, name)(keys[:0]).shape == (0, want.shape[1])
    print("OK", len(sys.argv) - 2)
""")


def _graph_op_types(concrete) -> set:
    gdef = concrete.graph.as_graph_def()
    ops = {n.op for n in gdef.node}
    for fdef in gdef.library.function:
        ops |= {n.op for n in fdef.node_def}
    return ops


def test_savedmodel_runs_with_stock_tensorflow_only(tmp_path):
    module = tf.Module()
    signatures = {}
    for name, (spec, dim) in SAVED_KINDS.items():
        init = make_initializer(spec, dim)
        fn = graph_fn(init.config, dim)
        setattr(module, name, fn)
        concrete = fn.get_concrete_function()
        signatures[name] = concrete
        assert not _graph_op_types(concrete) & {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
        np.save(tmp_path / f"{name}.npy", init(KEYS))
    np.save(tmp_path / "keys.npy", KEYS)
    tf.saved_model.save(module, str(tmp_path / "model"), signatures=signatures)
    (tmp_path / "child.py").write_text(CHILD)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path),
                           *SAVED_KINDS], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"OK {len(SAVED_KINDS)}", proc.stdout
