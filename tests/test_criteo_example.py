"""Tests for the Criteo example: generator, reader and DeepFM builders."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from examples.criteo import generate as gen  # noqa: E402
from examples.criteo import model as model_lib  # noqa: E402
from examples.criteo import reader  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "tests", "data", "criteo_sample.txt")

INT_RE = re.compile(r"^(-?\d+)?$")
CAT_RE = re.compile(r"^([0-9a-f]{8})?$")

# Fingerprint64-based id of "C1:68fd1e64" -- must never change (ids are
# shared between processes / stored in checkpoints).
ID_C1_68FD1E64 = 4225933912914515378


def _sample_lines():
    with open(SAMPLE) as f:
        return f.read().splitlines()


def _np_auc(labels, scores):
    labels = np.asarray(labels).ravel().astype(bool)
    scores = np.asarray(scores, dtype=np.float64).ravel()
    s = np.sort(scores)
    ranks = (np.searchsorted(s, scores, "left")
             + np.searchsorted(s, scores, "right") + 1) / 2.0   # avg ranks
    n1 = labels.sum()
    n0 = labels.size - n1
    return (ranks[labels].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0)


def _run_graph(fetch_fn):
    """Build with fetch_fn() in a fresh TF1 graph and run to exhaustion."""
    with tf.Graph().as_default():
        ds = fetch_fn()
        nxt = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        out = []
        with tf.compat.v1.Session() as sess:
            while True:
                try:
                    out.append(sess.run(nxt))
                except tf.errors.OutOfRangeError:
                    return out


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo_small")
    return gen.generate(str(d), rows=3000, files=3, test_rows=1000, seed=7)


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo_train")
    return gen.generate(str(d), rows=100_000, files=2, test_rows=30_000,
                        seed=0)


# ---------------------------------------------------------------- generator

def test_generate_files_and_format(small_data):
    assert [os.path.basename(p) for p in small_data["train"]] == [
        "train-00000.txt", "train-00001.txt", "train-00002.txt"]
    assert os.path.basename(small_data["test"]) == "test.txt"
    counts = []
    cat_values = [set() for _ in range(26)]
    neg = missing_int = missing_cat = 0
    for path in small_data["train"] + [small_data["test"]]:
        with open(path, "rb") as f:
            data = f.read()
        assert data.endswith(b"\n")
        lines = data.decode("ascii").split("\n")[:-1]
        counts.append(len(lines))
        for line in lines:
            cols = line.split("\t")
            assert len(cols) == 40, line
            assert cols[0] in ("0", "1")
            for c in cols[1:14]:
                assert INT_RE.match(c), c
                if c == "":
                    missing_int += 1
                elif int(c) < 0:
                    assert c == "-1"
                    neg += 1
            for j, c in enumerate(cols[14:]):
                assert CAT_RE.match(c), c
                if c == "":
                    missing_cat += 1
                else:
                    cat_values[j].add(c)
    assert counts == [1000, 1000, 1000, 1000]
    assert neg > 0 and missing_int > 0
    n_cat = 4000 * 26
    assert 0.01 < missing_cat / n_cat < 0.15
    # hex strings are unique per (column, value): no overlap across columns
    for a in range(26):
        for b in range(a + 1, 26):
            assert not (cat_values[a] & cat_values[b])
    # Zipf: small columns are saturated, big ones have many distinct values
    assert len(cat_values[8]) <= 10 and len(cat_values[2]) > 300


def test_generate_deterministic_and_distribution(small_data, tmp_path):
    again = gen.generate(str(tmp_path / "a"), rows=3000, files=3,
                         test_rows=1000, seed=7)
    for p, q in zip(small_data["train"] + [small_data["test"]],
                    again["train"] + [again["test"]]):
        with open(p, "rb") as f1, open(q, "rb") as f2:
            assert f1.read() == f2.read()
    other = gen.generate(str(tmp_path / "b"), rows=1000, seed=8)
    with open(other["train"][0], "rb") as f1, \
            open(small_data["train"][0], "rb") as f2:
        assert f1.read() != f2.read()
    assert other["test"] is None

    # same value -> hex mapping for train and test (same hidden spec)
    def top_c1(path):
        vals = [line.split("\t")[14] for line in open(path)]
        return max(set(vals), key=vals.count)
    assert top_c1(small_data["train"][0]) == top_c1(small_data["test"])


def test_positive_rate(train_data):
    labels = np.concatenate([
        np.array([line[0] == "1" for line in open(p)])
        for p in train_data["train"]])
    assert labels.size == 100_000
    assert 0.22 < labels.mean() < 0.28


def test_planted_signal_oracle():
    label, logit = gen.oracle_sample(50_000, seed=0)
    assert 0.22 < label.mean() < 0.28
    assert _np_auc(label, logit) > 0.85


def test_generate_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "examples.criteo.generate", "--out",
         str(tmp_path), "--rows", "500", "--files", "2", "--test-rows", "50",
         "--seed", "3"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "train-00001.txt" in out.stdout
    assert reader.count_records(tmp_path / "train-00000.txt") == 250
    assert reader.count_records(tmp_path / "train-00001.txt") == 250
    assert reader.count_records(tmp_path / "test.txt") == 50


# ------------------------------------------------------------------- reader

def test_parse_sample_values():
    lines = _sample_lines()
    assert len(lines) == 20
    feats, label = reader.parse_lines(tf.constant(lines))
    dense, cat, label = (feats["dense"].numpy(), feats["cat"].numpy(),
                         label.numpy())
    assert dense.shape == (20, 13) and dense.dtype == np.float32
    assert cat.shape == (20, 26) and cat.dtype == np.int64
    assert label.dtype == np.float32
    np.testing.assert_array_equal(np.nonzero(label)[0], [7, 12, 14, 18])

    # line 0: 1 1 5 0 1382 4 15 2 181 1 2 <missing> 2
    expect0 = np.log1p([1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2])
    np.testing.assert_allclose(dense[0], expect0, rtol=1e-6)
    # line 4: I2 = -1 -> 0, I3 missing -> 0, I13 missing
    np.testing.assert_allclose(
        dense[4], np.log1p([3, 0, 0, 0, 2, 0, 3, 0, 0, 1, 1, 0, 0]),
        rtol=1e-6)
    # line 12: only I2 (-1) and C1 present
    assert np.all(dense[12] == 0)

    assert cat[0, 0] == ID_C1_68FD1E64
    assert np.all(cat >= 0) and np.all(cat < 2 ** 62)
    # same string in the same column -> same id (C1 = 68fd1e64)
    assert {cat[i, 0] for i in (0, 1, 3, 7, 15)} == {ID_C1_68FD1E64}
    assert cat[2, 0] != ID_C1_68FD1E64
    # missing value -> id of the empty string of that column
    empty = tf.strings.to_hash_bucket_fast(
        [f"C{j + 1}:" for j in range(26)], 2 ** 62).numpy()
    assert cat[0, 21] == empty[21]                   # C22 missing on line 0
    np.testing.assert_array_equal(cat[12, 1:], empty[1:])
    assert cat[12, 0] != empty[0]
    assert len(set(empty)) == 26                     # differs per column
    # the same string in different columns gives different ids
    line = "\t".join(["0"] + [""] * 13 + ["68fd1e64"] * 26)
    ids = reader.parse_lines([line])[0]["cat"].numpy()[0]
    assert len(set(ids)) == 26 and ids[0] == ID_C1_68FD1E64


def test_parse_stable_and_vocab_modulo():
    lines = _sample_lines()
    a = reader.parse_lines(lines)[0]["cat"].numpy()
    b = reader.parse_lines(tf.constant(lines[::-1]))[0]["cat"].numpy()
    np.testing.assert_array_equal(a, b[::-1])
    v = 1000
    m = reader.parse_lines(lines, vocab_size=v)[0]["cat"].numpy()
    np.testing.assert_array_equal(m, a % v)
    assert m.dtype == np.int64 and m.min() >= 0 and m.max() < v


def test_criteo_dataset_eager_and_graph():
    ds = reader.criteo_dataset([SAMPLE], batch_size=8)
    eager = list(ds.as_numpy_iterator())
    assert [f["cat"].shape[0] for f, _ in eager] == [8, 8, 4]
    ref_f, ref_l = reader.parse_lines(_sample_lines())
    np.testing.assert_array_equal(
        np.concatenate([f["cat"] for f, _ in eager]), ref_f["cat"].numpy())
    np.testing.assert_allclose(
        np.concatenate([f["dense"] for f, _ in eager]), ref_f["dense"].numpy())
    np.testing.assert_array_equal(np.concatenate([lb for _, lb in eager]),
                                  ref_l.numpy())

    graph = _run_graph(lambda: reader.criteo_dataset(SAMPLE, batch_size=8,
                                                     vocab_size=97))
    assert len(graph) == 3
    np.testing.assert_array_equal(
        np.concatenate([f["cat"] for f, _ in graph]), ref_f["cat"].numpy() % 97)

    shuffled = list(reader.criteo_dataset(
        [SAMPLE, SAMPLE], batch_size=40, shuffle=True, seed=1,
        drop_remainder=True).as_numpy_iterator())
    assert len(shuffled) == 1
    assert sorted(shuffled[0][0]["cat"][:, 0].tolist()) == sorted(
        ref_f["cat"].numpy()[:, 0].tolist() * 2)


def test_line_dataset_for_ranges(small_data):
    path = small_data["train"][1]
    with open(path) as f:
        all_lines = f.read().splitlines()
    sample = _sample_lines()

    def at(p, lines, i):  # byte offset of line i (ranges are byte ranges)
        return sum(len(x) + 1 for x in lines[:i])

    # a range [a, b) holds the lines that begin in it: line-start offsets select
    # lines exactly; an offset inside a line moves to the next line
    ranges = [(path, at(path, all_lines, 10), at(path, all_lines, 25)),
              (SAMPLE, at(SAMPLE, sample, 3) - 5, at(SAMPLE, sample, 5) - 2),
              (path, at(path, all_lines, 999), at(path, all_lines, 1000) + 10),
              (path, 7, 7), (path, 0, at(path, all_lines, 1) + 1)]
    expected = all_lines[10:25] + sample[3:5] + all_lines[999:1000] + \
        all_lines[0:2]

    def check(got):
        assert [x.decode() if isinstance(x, bytes) else x for x in got] == \
            expected

    # list of triples
    check(list(reader.line_dataset_for_ranges(ranges).as_numpy_iterator()))
    # tf.data.Dataset of triples
    ds = tf.data.Dataset.from_tensor_slices(
        ([r[0] for r in ranges], [r[1] for r in ranges],
         [r[2] for r in ranges]))
    check(list(reader.line_dataset_for_ranges(ds).as_numpy_iterator()))
    # generator function (re-iterable) and one-shot generator
    lines_ds = reader.line_dataset_for_ranges(lambda: iter(ranges))
    check(list(lines_ds.as_numpy_iterator()))
    check(list(lines_ds.as_numpy_iterator()))
    check(list(reader.line_dataset_for_ranges(
        (r for r in ranges)).as_numpy_iterator()))
    # empty
    assert list(reader.line_dataset_for_ranges([]).as_numpy_iterator()) == []
    # TF1 graph mode, both list and generator sources
    check(_run_graph(lambda: reader.line_dataset_for_ranges(ranges)))
    check(_run_graph(lambda: reader.line_dataset_for_ranges(
        lambda: iter(ranges))))
    # parsed batches of ranges
    parsed = list(reader.criteo_dataset_for_ranges(
        ranges, batch_size=64).as_numpy_iterator())
    assert len(parsed) == 1 and parsed[0][0]["cat"].shape == (20, 26)


def test_count_records(small_data, tmp_path):
    assert reader.count_records(SAMPLE) == 20
    for p in small_data["train"]:
        assert reader.count_records(p) == 1000
        assert reader.count_records(p, chunk_size=4096) == 1000
    no_nl = tmp_path / "no_newline.txt"
    no_nl.write_bytes(b"a\nb\nc")
    assert reader.count_records(no_nl) == 3
    assert reader.count_records(no_nl, chunk_size=2) == 3
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert reader.count_records(empty) == 0
    # agrees with TextLineDataset
    n = sum(1 for _ in tf.data.TextLineDataset(str(no_nl)))
    assert n == 3


# -------------------------------------------------------------------- model

def test_build_deepfm_factory_contract():
    import keras
    calls = []

    def factory(name, dim):
        calls.append((name, dim))
        return keras.layers.Embedding(1000, dim, name=name)

    m = model_lib.build_deepfm(
        embedding_factory=lambda n, d: factory(n, d), dim=4, hidden=(16,))
    assert calls == [("embedding", 4), ("linear", 1)]
    feats, _ = reader.parse_lines(_sample_lines(), vocab_size=1000)
    out = m(feats)
    assert tuple(out.shape) == (20, 1)
    # probabilities: a float32 sigmoid of an untrained model's large logit rounds to 1.0
    p = out.numpy()
    assert np.all(np.isfinite(p) & (p >= 0) & (p <= 1)), p

    lin_calls = []
    model_lib.build_deepfm(
        embedding_factory=factory, dim=4,
        linear_factory=lambda n, d: (lin_calls.append((n, d)),
                                     keras.layers.Embedding(10, d, name=n))[1])
    assert lin_calls == [("linear", 1)]
    with pytest.raises(ValueError):
        model_lib.build_deepfm()


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_keras_deepfm_trains_to_auc(train_data):
    import keras
    vocab = 2 ** 20
    keras.utils.set_random_seed(0)
    model = model_lib.build_deepfm(vocab_size=vocab, dim=8, hidden=(128, 64))
    model.compile(optimizer=keras.optimizers.Adam(0.005),
                  loss="binary_crossentropy")
    train = reader.criteo_dataset(train_data["train"], 512, vocab_size=vocab)
    t0 = time.time()
    model.fit(train, epochs=1, verbose=0, shuffle=False)
    secs = time.time() - t0
    test = reader.criteo_dataset([train_data["test"]], 4096,
                                 vocab_size=vocab)
    labels = np.concatenate([lb for _, lb in test.as_numpy_iterator()])
    preds = model.predict(test, verbose=0)
    auc = _np_auc(labels, preds)
    print(f"\n[criteo] keras DeepFM 1 epoch on 100k rows: test AUC "
          f"{auc:.4f}, {100_000 / secs:.0f} samples/s ({secs:.1f} s)")
    assert preds.shape == (30_000, 1)
    assert auc > 0.70


def _tf1_train_losses(features, label, steps=5):
    vocab, v1 = 10_007, tf.compat.v1

    def lookup(name, ids, dim):
        table = v1.get_variable(
            f"{name}/table", [vocab, dim],
            initializer=v1.random_normal_initializer(stddev=0.01))
        return tf.nn.embedding_lookup(table, tf.math.floormod(ids, vocab))

    logits = model_lib.build_deepfm_tf1(features, lookup, dim=8,
                                        hidden=(32, 16))
    assert logits.shape.as_list() == [None]
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=label, logits=logits))
    step = v1.train.AdamOptimizer(0.01).minimize(loss)
    names = {v.op.name for v in v1.global_variables()}
    assert "deepfm/embedding/table" in names
    assert "deepfm/deep_0/kernel" in names
    losses = []
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for _ in range(steps):
            losses.append(sess.run([loss, step])[0])
    return losses


def test_tf1_deepfm_graph_trains():
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        ds = reader.criteo_dataset([SAMPLE], batch_size=20).repeat()
        features, label = tf.compat.v1.data.make_one_shot_iterator(
            ds).get_next()
        losses = _tf1_train_losses(features, label)
    assert losses[-1] < losses[0]


def test_tf1_deepfm_with_eager_disabled():
    """Whole pipeline in a real TF1 process (eager execution disabled)."""
    script = textwrap.dedent(f"""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        from tests.test_criteo_example import _tf1_train_losses
        from examples.criteo import reader
        ranges = [({SAMPLE!r}, 0, 1000), ({SAMPLE!r}, 1000, 1 << 40)]  # bytes
        ds = reader.criteo_dataset_for_ranges(lambda: iter(ranges), 20)
        it = tf.compat.v1.data.make_initializable_iterator(ds.repeat())
        features, label = it.get_next()
        with tf.compat.v1.Session() as s:
            s.run(it.initializer)
            f, lb = s.run([features, label])
        assert f["cat"].shape == (20, 26) and lb.sum() == 4, lb
        losses = _tf1_train_losses(*tf.compat.v1.data.make_one_shot_iterator(
            reader.criteo_dataset({SAMPLE!r}, 20).repeat()).get_next())
        assert losses[-1] < losses[0], losses
        print("OK", losses)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_text_reader_needs_no_deeprec_ext():
    """The text readers also feed the baselines of bench_training.py that run in a TF 2.16
    venv (TFRA, tf-keras), where this project's protobuf stubs do not import: reading text
    must not import ``deeprec_ext``."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["deeprec_ext"] = None  # any import of it fails
        from examples.criteo.reader import criteo_dataset
        ds = criteo_dataset([{SAMPLE!r}], 8, vocab_size=1000)
        features, label = next(iter(ds))
        print(int(label.shape[0]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "8"


def test_seed_gives_the_same_dense_weights_with_ps_or_local_embeddings():
    """``--seed`` compares like with like: the single-process model (local Keras
    embeddings) and the PS job's (ElasticEmbedding) start from the same dense weights,
    so a quality gap between them is the training's, not the initial draw's."""
    import keras

    import deeprec_ext.tf as dtf

    def dense_weights(**kwargs):
        keras.utils.set_random_seed(0)
        m = model_lib.build_deepfm(dim=8, **kwargs)
        return {w.path: w.numpy() for w in m.weights
                if w.path.split("/")[0] not in ("embedding", "linear")}

    local = dense_weights(vocab_size=1000)
    ps = dense_weights(embedding_factory=lambda name, d: dtf.ElasticEmbedding(
        d, table=name, initializer="zeros", optimizer="sgd", name=name))
    ps = {k: v for k, v in ps.items() if k in local}
    assert sorted(ps) == sorted(local) and len(local) == 8
    for k in local:
        np.testing.assert_array_equal(ps[k], local[k], err_msg=k)
