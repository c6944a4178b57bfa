"""Training throughput of the example DeepFM: ours vs single-process Keras vs TF's
ParameterServerStrategy vs TensorFlow Recommenders-Addons (TFRA), all measured in ONE run
and printed as ratios, with every configuration's AUC on the same test file.

    .venv/bin/python bench/bench_training.py [--rows 400000] [--batch-size 1024] \
        [--out bench/results/training.json] [--profile] [--quick]
    bench/tfra/setup-venv && .venv/bin/python bench/bench_training.py --configs tfra

Configurations (same DeepFM: dim 8, hidden (128, 64), Adam lr 1e-3, same data, same batch):

  single    one process, ``keras.layers.Embedding`` over ids reduced modulo ``--vocab``
            (default 2**18 = 262,144: the smallest power of two >= the 207,437 distinct
            categorical values of the synthetic data), ``model.fit`` on
            ``examples.criteo.reader.criteo_dataset``
  single@V  the same with ``--extra-vocab`` (default 2**20), informational only
  tf-pss    ``tf.distribute.experimental.ParameterServerStrategy``: 1 worker + 1 PS
            ``tf.distribute.Server`` subprocesses on free 127.0.0.1 ports, a coordinator
            process (the "chief"), local Keras Embedding (vocab ``--vocab``) whose
            variables live on the PS, custom loop of ``ClusterCoordinator.schedule`` over a
            per-worker dataset
  tf-pss-x10  the same with 10 steps inside each scheduled ``tf.function`` (fewer
            coordinator round trips; TF's own advice for small steps), informational only
  ours-1x1  ``aimaster run <job> --ps 1 --workers 1`` running examples/criteo/train.py
  ours-2x2  ``aimaster run <job> --ps 2 --workers 2``

  The TF 2.16 configurations run in ``bench/.venv-tfra`` (``bench/tfra/setup-venv``: TF
  2.16.2, tf-keras, TFRA 0.8.1) with ``TF_USE_LEGACY_KERAS=1``; the same DeepFM written for
  tf-keras (``build_deepfm_tfk``), the same reader, data, batch and loop:

  tfra-single  TFRA ``dynamic_embedding.keras.layers.Embedding`` on the raw int64 ids (no
            vocabulary), ``DynamicEmbeddingOptimizer``, ``model.fit``
  tfra-pss  the same tables placed on the PS of a ParameterServerStrategy 1 worker + 1 PS
            (in-process cluster as in TF's tutorial, ``--pss-cluster``), the tf-pss loop
  tfk-single, tfk-pss  stock tf-keras ``Embedding`` (vocab ``--vocab``), single process and
            PSS 1 + 1, like single and tf-pss but on TF 2.16 + tf-keras

  ``--configs tfra`` runs tfra-single, tfra-pss, tfk-single, tfk-pss, single, tf-pss,
  ours-1x1 and ours-2x2, then all of them again with ``--fair-optimizer`` (Adagrad, lr
  ``--fair-lr``, for the dense layers and the tables, ids de-duplicated before the stock
  Embedding): an optimizer whose update of a row not in the batch is zero in every
  implementation, so no side pays for dense slot updates that another skips (Keras' Adam
  decays the slots of every row of a fixed-size table on every step; TFRA's and ours touch
  the batch's rows only).

Every configuration runs in its own process group (killed on ``--timeout``), so no TF
state leaks between them. Throughput is *steady-state*: samples trained after the first
``--warmup-steps`` steps divided by the time they took (graph tracing, process start-up,
table creation are excluded). For several workers the window is the interval in which
all of them train (from the last worker's warm-up end to the first worker's last step)
and the samples of all workers in that window are summed. The end-to-end figure (total
samples / time of the training call, i.e. the worker-reported ``train_seconds`` for ours)
is printed next to it. After training, every configuration predicts the test file
(``--test-rows``, generated with the training data) and its AUC is computed by ``auc``.

``--profile`` adds one more ours 1+1 run with per-call wall-clock accounting of the PS
client in the worker and, if ``py-spy`` is installed in the venv, sampling profiles of the
worker and PS processes (``runs/bench-ours-1x1-profile/py-spy-*.txt``, summarized).

For ours the worker command is this file with ``--_ours-worker``: it runs
``examples.criteo.train.main`` unchanged, only subclassing ``ElasticCallback`` to record a
timestamp after every step (and, with ``--profile``, timing the PS client calls; with
``BENCH_OPTIMIZER``, swapping the optimizer for the fair rows).

``--quick``: a smoke run (60k rows, 10k test rows, one round).

Data: ``examples.criteo.generate.generate`` into ``runs/bench-data/`` (cached).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TARGET_VS_PSS = 2.0
TARGET_VS_SINGLE = 0.85  # issue 16, item 4
# --configs tfra: ours 1+1 against TFRA and stock TF on tf-keras
TARGET_VS_TFRA = 1.0
TARGET_VS_TFRA_PSS = 2.0
TARGET_VS_TFK_PSS = 1.0
DIM = 8
HIDDEN = (128, 64)


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------

def ensure_data(rows: int, files: int, seed: int, test_rows: int = 0) -> dict:
    """Generate (once) the synthetic training files and the test file;
    returns {"dir", "train": [paths], "test": path or None}."""
    out = os.path.join(REPO, "runs", "bench-data", f"criteo-rows{rows}-files{files}-seed{seed}")
    meta_path = os.path.join(out, "meta.json")
    want = {"rows": rows, "files": files, "seed": seed, "test_rows": test_rows}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        test = meta.get("test")
        if meta.get("params") == want and all(os.path.exists(p) for p in meta["train"]) \
                and (test is None or os.path.exists(test)):
            return {"dir": out, "train": meta["train"], "test": test, "generated": False}
    from examples.criteo.generate import generate
    t0 = time.time()
    print(f"generating {rows:,} synthetic Criteo rows (+ {test_rows:,} test rows) into "
          f"{os.path.relpath(out, REPO)} ...", flush=True)
    # the training rows do not depend on test_rows (independent random streams)
    res = generate(out, rows, files=files, test_rows=test_rows, seed=seed)
    with open(meta_path + ".tmp", "w") as f:
        json.dump({"params": want, "train": res["train"], "test": res["test"],
                   "seconds": round(time.time() - t0, 2)}, f, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    return {"dir": out, "train": res["train"], "test": res["test"], "generated": True}


def auc(labels, scores) -> float:
    """ROC AUC by the rank-sum formula, ties get average ranks (the formula of
    ``examples.criteo.train.auc``; numpy only, so both venvs use this one function)."""
    import numpy as np
    labels, scores = np.asarray(labels).ravel(), np.asarray(scores, dtype=np.float64).ravel()
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts - 1) / 2.0 + 1, counts)
    pos = labels.astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_labels(path: str):
    """Labels of a Criteo text file (first column), in file order."""
    import numpy as np
    with open(path, "rb") as f:
        return np.array([line[:1] == b"1" for line in f if line.strip()], dtype=np.int8)


# ----------------------------------------------------------------------------------------
# steady-state throughput from per-step (time, cumulative samples) series
# ----------------------------------------------------------------------------------------

def steady_rate(series_list: list, warmup_steps: int) -> dict:
    """``series_list``: one [(t, cumulative_samples)] per worker (one point per step).

    Window = [max over workers of the end of step ``warmup_steps``, min over workers of the
    end of their last step]; samples of every worker inside it (linear interpolation
    between step ends) / window length.
    """
    import numpy as np
    series = [np.asarray(s, dtype=np.float64) for s in series_list if len(s)]
    if not series or any(len(s) <= warmup_steps + 1 for s in series):
        return {"samples_per_s": None, "reason": "too few steps after warm-up"}
    t0 = max(s[warmup_steps - 1, 0] if warmup_steps else s[0, 0] for s in series)
    t1 = min(s[-1, 0] for s in series)
    if t1 <= t0:
        return {"samples_per_s": None, "reason": "workers' training intervals do not overlap"}
    samples = sum(float(np.interp(t1, s[:, 0], s[:, 1]) - np.interp(t0, s[:, 0], s[:, 1]))
                  for s in series)
    return {"samples_per_s": samples / (t1 - t0), "window_seconds": t1 - t0,
            "window_samples": samples}


# ----------------------------------------------------------------------------------------
# children (each configuration runs in its own process)
# ----------------------------------------------------------------------------------------

def _tf_quiet():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _optimizer(keras_mod, name: str, lr: float, legacy: bool = False):
    """The dense (and, for the stock baselines, embedding) optimizer of a configuration:
    ``adam`` (the default: Keras Adam, lr 1e-3) or ``adagrad`` (the fair-optimizer rows).
    ``legacy``: tf-keras' ``optimizers.legacy`` class (the OptimizerV2 that TFRA's
    DynamicEmbeddingOptimizer and its PSS example use)."""
    opts = keras_mod.optimizers.legacy if legacy else keras_mod.optimizers
    if name == "adam":
        return opts.Adam(lr)
    if name == "adagrad":  # Keras defaults: initial accumulator 0.1, epsilon 1e-7
        return opts.Adagrad(lr)
    raise ValueError(f"unknown optimizer {name!r}")


def _series_from_stamps(stamps: list, rows: int, b: int) -> tuple[list, int]:
    cum, series = 0, []
    for i, t in enumerate(stamps):
        cum += min(b, rows - i * b)
        series.append((t, cum))
    return series, cum


def _eval_single(tf, predict, test_file: str | None, vocab) -> dict:
    """AUC of ``predict(features) -> prob`` (a tf.function) on the test file."""
    if not test_file:
        return {}
    from examples.criteo.reader import criteo_dataset
    t = time.time()
    labels, scores = [], []
    for features, label in criteo_dataset([test_file], 4096, vocab_size=vocab):
        scores.append(tf.reshape(predict(features), [-1]).numpy())
        labels.append(label.numpy())
    import numpy as np
    return {"auc": auc(np.concatenate(labels), np.concatenate(scores)),
            "test_rows": int(sum(len(x) for x in labels)), "eval_seconds": time.time() - t}


def _keras3_factory(keras, tf, args):
    """``None`` (build_deepfm's own Keras Embedding) or, with ``--unique-ids`` (the
    fair-optimizer rows), the same Embedding looked up with the batch's unique ids and
    gathered back: its gradient then has one row per id (the sum of the duplicates' rows),
    as in TFRA (``with_unique``) and ours, instead of one row per occurrence, which Keras'
    Adagrad/Adam square one by one into the accumulator."""
    if not args.unique_ids:
        return None

    class UniqueEmbedding(keras.layers.Layer):
        def __init__(self, dim, name):
            super().__init__(name=name)
            self.dim = dim
            self.table = keras.layers.Embedding(
                int(args.vocab), dim, name=name + "_table",
                embeddings_initializer=keras.initializers.RandomNormal(
                    stddev=0.01 if dim > 1 else 0.0, seed=7))  # as build_deepfm's

        def call(self, ids):
            uniq, idx = tf.unique(tf.reshape(ids, [-1]))
            return tf.reshape(tf.gather(self.table(uniq), idx), [-1, ids.shape[-1], self.dim])

        def compute_output_shape(self, ids_shape):
            return tuple(ids_shape) + (self.dim,)

    return lambda name, dim: UniqueEmbedding(dim, name)


def child_single(args) -> dict:
    """Single-process Keras 3: local Embedding, model.fit on criteo_dataset."""
    _tf_quiet()
    import keras
    import tensorflow as tf
    from examples.criteo.model import build_deepfm
    from examples.criteo.reader import criteo_dataset

    files = args.files_list
    model = build_deepfm(dim=DIM, hidden=HIDDEN, vocab_size=args.vocab,
                         embedding_factory=_keras3_factory(keras, tf, args))
    model.compile(optimizer=_optimizer(keras, args.optimizer, args.lr),
                  loss="binary_crossentropy")
    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.time())

    ds = criteo_dataset(files, args.batch_size, vocab_size=args.vocab)
    start = time.time()
    hist = model.fit(ds, epochs=1, verbose=0, callbacks=[Stamp()], shuffle=False)
    fit_seconds = time.time() - start
    series, cum = _series_from_stamps(stamps, args.rows, args.batch_size)
    out = {"series": [series], "samples": cum, "fit_seconds": fit_seconds,
           "steps": len(stamps), "final_loss": float(hist.history["loss"][-1]),
           "jit_compile": bool(model.jit_compile), "optimizer": args.optimizer,
           "versions": {"tensorflow": tf.__version__, "keras": keras.__version__}}
    out.update(_eval_single(tf, tf.function(lambda f: model(f, training=False)),
                            args._test, args.vocab))
    return out


_SERVER_CODE = r"""
import ctypes, json, os, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the coordinator
except OSError:
    pass
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
if len(sys.argv) > 3 and sys.argv[3]:
    __import__(sys.argv[3])  # e.g. TFRA: registers its ops and kernels in this server
cluster, job = json.loads(sys.argv[1]), sys.argv[2]
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=0,
                              protocol="grpc", start=True)
print("ready", flush=True)
server.join()
"""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _start_pss_cluster(mode: str, server_import: str = "") -> tuple[dict, list]:
    """1 worker + 1 PS ``tf.distribute.Server`` on free 127.0.0.1 ports, plus the chief's
    address. ``processes``: each server in its own subprocess (started before this process
    imports TensorFlow); ``in-process``: both servers inside this process, as TF's "Parameter
    server training" tutorial (``create_in_process_cluster``) and TFRA's PSS example do.
    Returns (cluster dict, handles to keep alive / stop)."""
    chief, worker, ps = _free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"],
               "ps": [f"127.0.0.1:{ps}"]}
    handles = []
    if mode == "in-process":
        import tensorflow as tf
        if server_import:
            __import__(server_import)
        spec = tf.train.ClusterSpec(cluster)
        for job in ("worker", "ps"):
            handles.append(tf.distribute.Server(spec, job_name=job, task_index=0,
                                                protocol="grpc", start=True))
        return cluster, handles
    if mode != "processes":
        raise ValueError(f"unknown --pss-cluster {mode!r}")
    for job in ("worker", "ps"):
        handles.append(subprocess.Popen(
            [sys.executable, "-c", _SERVER_CODE, json.dumps(cluster), job, server_import],
            # unbuffered: readline() must not pull "ready" into a buffer select() cannot see
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, bufsize=0))
    deadline = time.time() + 120
    for p in handles:  # wait for "ready" from each server
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"tf.distribute.Server exited with {p.returncode}")
            r, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.time()))
            if not r:
                raise TimeoutError("tf.distribute.Server did not start in 120 s")
            if p.stdout.readline().strip() == b"ready":
                break
    return cluster, handles


def _stop_pss_cluster(handles: list) -> None:
    for p in handles:
        if isinstance(p, subprocess.Popen):
            if p.poll() is None:
                p.kill()
            p.wait()


def _pss_strategy(tf, cluster: dict):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return strategy, coordinator


def _pss_train(tf, args, strategy, coordinator, model, optimizer, loss_fn, vocab) -> dict:
    """The PSS custom loop (shared by Keras 3, tf-keras and TFRA): ``ClusterCoordinator
    .schedule`` of a ``tf.function`` train step (``--pss-inner-steps`` steps per call) over a
    per-worker dataset; the warm-up calls are joined before the clock starts. Then the test
    file is predicted the same way (scheduled functions on the worker, inline evaluation)."""
    from examples.criteo.reader import criteo_dataset
    files, b = args.files_list, args.batch_size

    def dataset_fn():
        return criteo_dataset(files, b, vocab_size=vocab, drop_remainder=True).repeat()

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker)
    inner = max(1, args.pss_inner_steps)

    def replica_fn(batch):
        features, label = batch
        with tf.GradientTape() as tape:
            prob = model(features, training=True)
            loss = loss_fn(tf.reshape(label, [-1, 1]), prob)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(it):  # one scheduled function = one step (the baseline) ...
        return strategy.run(replica_fn, args=(next(it),))

    @tf.function
    def train_steps(it):  # ... or `inner` steps per scheduled function (informational)
        loss = tf.constant(0.0)
        for _ in tf.range(inner):
            loss = strategy.run(replica_fn, args=(next(it),))
        return loss

    fn = train_step if inner == 1 else train_steps
    calls = max(2, (args.rows // b) // inner)
    warm = min(max(1, args.warmup_steps // inner), calls - 1)
    start = time.time()
    for _ in range(warm):
        coordinator.schedule(fn, args=(iterator,))
    coordinator.join()
    t0 = time.time()
    last = None
    for _ in range(calls - warm):
        last = coordinator.schedule(fn, args=(iterator,))
    coordinator.join()
    t1 = time.time()
    loss = float(last.fetch()) if last is not None else None
    per = inner * b
    devices = []
    for v in model.trainable_variables:
        try:
            devices.append(str(v.device))
        except (AttributeError, ValueError, RuntimeError):
            pass
    out = {"series": [[(t0, warm * per), (t1, calls * per)]], "samples": calls * per,
           "fit_seconds": t1 - start, "steps": calls * inner, "final_loss": loss,
           "variable_devices": sorted(set(devices)), "pre_warmed": True,
           "inner_steps": inner, "optimizer": args.optimizer, "pss_cluster": args.pss_cluster}
    if args._test:
        import numpy as np
        te = time.time()
        n_batches = -(-args.test_rows // 4096)
        test_it = iter(coordinator.create_per_worker_dataset(
            lambda: criteo_dataset([args._test], 4096, vocab_size=vocab)))

        @tf.function
        def eval_step(it):
            def fn(batch):
                features, label = batch
                return tf.reshape(model(features, training=False), [-1]), label
            return strategy.run(fn, args=(next(it),))

        results = [coordinator.schedule(eval_step, args=(test_it,)) for _ in range(n_batches)]
        coordinator.join()
        pairs = [r.fetch() for r in results]
        labels = np.concatenate([np.asarray(p[1]) for p in pairs])
        scores = np.concatenate([np.asarray(p[0]) for p in pairs])
        out.update({"auc": auc(labels, scores), "test_rows": int(len(labels)),
                    "eval_seconds": time.time() - te})
    return out


def child_pss(args) -> dict:
    """tf.distribute ParameterServerStrategy (Keras 3), 1 worker + 1 PS, coordinator = this
    process."""
    _tf_quiet()
    cluster, handles = _start_pss_cluster(args.pss_cluster)
    try:
        import keras
        import tensorflow as tf
        from examples.criteo.model import build_deepfm

        strategy, coordinator = _pss_strategy(tf, cluster)
        with strategy.scope():
            model = build_deepfm(dim=DIM, hidden=HIDDEN, vocab_size=args.vocab,
                                 embedding_factory=_keras3_factory(keras, tf, args))
            optimizer = _optimizer(keras, args.optimizer, args.lr)
        out = _pss_train(tf, args, strategy, coordinator, model, optimizer,
                         keras.losses.BinaryCrossentropy(), args.vocab)
        out["variable_devices"] = sorted({v.value.device for v in model.trainable_variables})
        out["versions"] = {"tensorflow": tf.__version__, "keras": keras.__version__}
        return out
    finally:
        _stop_pss_cluster(handles)


# ----------------------------------------------------------------------------------------
# the TF 2.16 children (bench/.venv-tfra, TF_USE_LEGACY_KERAS=1): stock tf-keras and TFRA
# ----------------------------------------------------------------------------------------

def _tf216():
    """TensorFlow with tf.keras = tf-keras (Keras 2), as TFRA needs."""
    _tf_quiet()
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    if not tf.keras.layers.Dense.__module__.startswith("tf_keras"):
        raise RuntimeError("tf.keras is not tf-keras: run with TF_USE_LEGACY_KERAS=1 and "
                           "tf-keras installed (bench/tfra/setup-venv)")
    # TF 2.16's AutoGraph leaves `keras` (Keras 3, and Keras 2 before TF 2.16) unconverted but
    # not `tf_keras`: the first trace of a train step then transpiles ~600 tf-keras functions
    # (20-190 s on this machine). tf-keras is written for graph mode without conversion, so
    # skip it like `keras`: only the start-up changes (steady-state throughput excludes it).
    from tensorflow.python.autograph.core import config as autograph_config
    rule = autograph_config.DoNotConvert("tf_keras")
    if not any(getattr(r, "_prefix", None) == "tf_keras"
               for r in autograph_config.CONVERSION_RULES):
        autograph_config.CONVERSION_RULES = (rule,) + tuple(autograph_config.CONVERSION_RULES)
    return tf


def _legacy(args, tfra: bool) -> bool:
    """Whether a TF 2.16 row uses tf-keras' ``optimizers.legacy`` classes. ``auto``: the TFRA
    rows do (as TFRA's PSS example), the stock rows use tf-keras' default classes. TFRA's
    DynamicEmbeddingOptimizer around a default-class optimizer creates the slots of new keys
    with zeros whatever the optimizer's initial value: its Adagrad accumulator starts at 0
    instead of 0.1 (a first step of lr * sign(g)), unlike Keras, the legacy class and ours."""
    if args.tf216_optimizer == "auto":
        return tfra
    return args.tf216_optimizer == "legacy"


def _tfk_versions(tf) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {"tensorflow": tf.__version__}
    for pkg in ("tf-keras", "tensorflow-recommenders-addons", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def build_deepfm_tfk(tf, embedding_factory, dim=DIM, hidden=HIDDEN, unique_ids=False):
    """``examples.criteo.model.build_deepfm`` for tf-keras (Keras 2 has no ``keras.ops``):
    the same layers, initializers and formula, as a subclassed ``tf.keras.Model``.
    ``unique_ids``: look the tables up with the batch's unique ids and gather back (see
    ``_keras3_factory``)."""
    keras = tf.keras
    num_cat = 26

    class DeepFM(keras.Model):
        def __init__(self):
            super().__init__(name="deepfm")
            self.embedding = embedding_factory("embedding", dim)
            self.linear = embedding_factory("linear", 1)
            self.linear_dense = keras.layers.Dense(1, name="linear_dense")
            self.deep = [keras.layers.Dense(u, activation="relu", name=f"deep_{i}")
                         for i, u in enumerate(hidden)]
            self.deep_out = keras.layers.Dense(1, name="deep_out")

        def call(self, features, training=False):
            cat, dense = features["cat"], features["dense"]
            if unique_ids:
                ids, idx = tf.unique(tf.reshape(cat, [-1]))
                emb, lin = (tf.gather(self.embedding(ids), idx), tf.gather(self.linear(ids), idx))
            else:
                emb, lin = self.embedding(cat), self.linear(cat)
            emb = tf.reshape(emb, [-1, num_cat, dim])                            # [b, 26, dim]
            lin_cat = tf.reduce_sum(tf.reshape(lin, [-1, num_cat]), axis=1, keepdims=True)
            lin_dense = self.linear_dense(dense)
            fm = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(emb, axis=1))
                                     - tf.reduce_sum(tf.square(emb), axis=1),
                                     axis=1, keepdims=True)
            x = tf.concat([tf.reshape(emb, [-1, num_cat * dim]), dense], axis=1)
            for layer in self.deep:
                x = layer(x)
            return tf.sigmoid(lin_cat + lin_dense + fm + self.deep_out(x))

    return DeepFM()


def _stock_factory(tf, vocab):
    def factory(name, d):
        return tf.keras.layers.Embedding(
            int(vocab), d, name=name,
            embeddings_initializer=tf.keras.initializers.RandomNormal(
                stddev=0.01 if d > 1 else 0.0))
    return factory


def _tfra_factory(tf, de, devices=None):
    """TFRA ``dynamic_embedding`` layers: raw int64 ids, no vocabulary; same initializers as
    the Keras Embedding (normal 0.01 for the embedding, zeros for the linear table)."""
    def factory(name, d):
        init = (tf.keras.initializers.RandomNormal(stddev=0.01) if d > 1
                else tf.keras.initializers.Zeros())
        return de.keras.layers.Embedding(d, key_dtype=tf.int64, value_dtype=tf.float32,
                                         initializer=init, devices=devices, name=name)
    return factory


def _child_tf216_single(args, tfra: bool) -> dict:
    tf = _tf216()
    from examples.criteo.reader import criteo_dataset
    if tfra:
        import tensorflow_recommenders_addons.dynamic_embedding as de
        vocab = None
        model = build_deepfm_tfk(tf, _tfra_factory(tf, de))
        optimizer = de.DynamicEmbeddingOptimizer(
            _optimizer(tf.keras, args.optimizer, args.lr, _legacy(args, True)))
    else:
        vocab = args.vocab
        model = build_deepfm_tfk(tf, _stock_factory(tf, vocab), unique_ids=args.unique_ids)
        optimizer = _optimizer(tf.keras, args.optimizer, args.lr, _legacy(args, False))
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    stamps: list[float] = []

    class Stamp(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.time())

    ds = criteo_dataset(args.files_list, args.batch_size, vocab_size=vocab)
    start = time.time()
    hist = model.fit(ds, epochs=1, verbose=0, callbacks=[Stamp()], shuffle=False)
    fit_seconds = time.time() - start
    series, cum = _series_from_stamps(stamps, args.rows, args.batch_size)
    out = {"series": [series], "samples": cum, "fit_seconds": fit_seconds,
           "steps": len(stamps), "final_loss": float(hist.history["loss"][-1]),
           "optimizer": args.optimizer, "versions": _tfk_versions(tf)}
    if tfra:
        out["table_sizes"] = {layer.name: int(layer.params.size())
                              for layer in (model.embedding, model.linear)}
    out.update(_eval_single(tf, tf.function(lambda f: model(f, training=False)),
                            args._test, vocab))
    return out


def _child_tf216_pss(args, tfra: bool) -> dict:
    _tf_quiet()
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    cluster, handles = _start_pss_cluster(
        args.pss_cluster, "tensorflow_recommenders_addons" if tfra else "")
    try:
        tf = _tf216()
        strategy, coordinator = _pss_strategy(tf, cluster)
        if tfra:
            import tensorflow_recommenders_addons.dynamic_embedding as de
            vocab = None
            ps_devices = ["/job:ps/replica:0/task:0/device:CPU:0"]
            with strategy.scope():
                model = build_deepfm_tfk(tf, _tfra_factory(tf, de, ps_devices))
                optimizer = de.DynamicEmbeddingOptimizer(
                    _optimizer(tf.keras, args.optimizer, args.lr, _legacy(args, True)))
        else:
            vocab = args.vocab
            with strategy.scope():
                model = build_deepfm_tfk(tf, _stock_factory(tf, vocab),
                                         unique_ids=args.unique_ids)
                optimizer = _optimizer(tf.keras, args.optimizer, args.lr, _legacy(args, False))
        # tf-keras refuses a mean-reducing loss object under a tf.distribute strategy (outside
        # model.fit): per-example losses averaged over the batch, the same value
        per_example = tf.keras.losses.BinaryCrossentropy(
            reduction=tf.keras.losses.Reduction.NONE)

        def loss_fn(label, prob):
            return tf.nn.compute_average_loss(per_example(label, prob))

        out = _pss_train(tf, args, strategy, coordinator, model, optimizer, loss_fn, vocab)
        out["versions"] = _tfk_versions(tf)
        return out
    finally:
        _stop_pss_cluster(handles)


def child_tfk_single(args) -> dict:
    """Stock tf-keras (TF 2.16) single process: Embedding over ids mod --vocab, model.fit."""
    return _child_tf216_single(args, tfra=False)


def child_tfra_single(args) -> dict:
    """TFRA single process: dynamic_embedding on raw int64 ids, model.fit."""
    return _child_tf216_single(args, tfra=True)


def child_tfk_pss(args) -> dict:
    """Stock tf-keras (TF 2.16) ParameterServerStrategy 1 worker + 1 PS."""
    return _child_tf216_pss(args, tfra=False)


def child_tfra_pss(args) -> dict:
    """TFRA dynamic_embedding (tables on the PS) under ParameterServerStrategy 1 + 1."""
    return _child_tf216_pss(args, tfra=True)


CHILDREN = {"single": child_single, "pss": child_pss,
            "tfk-single": child_tfk_single, "tfk-pss": child_tfk_pss,
            "tfra-single": child_tfra_single, "tfra-pss": child_tfra_pss}
TF216_KINDS = {"tfk-single", "tfk-pss", "tfra-single", "tfra-pss"}


# ----------------------------------------------------------------------------------------
# ours: the worker wrapper (runs inside the aimaster-launched worker process)
# ----------------------------------------------------------------------------------------

def ours_worker(argv: list[str]) -> int:
    """Run examples.criteo.train.main(argv) with a per-step timestamp recorder."""
    _tf_quiet()
    import deeprec_ext.tf as dtf
    from deeprec_ext.worker import get_context
    import examples.criteo.train as train

    profile = bool(os.environ.get("BENCH_PROFILE"))
    prof = _install_profiler() if profile else None
    series: list[tuple[float, int]] = []
    base = dtf.ElasticCallback

    class TimedElasticCallback(base):
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            series.append((time.time(), get_context().session.samples))
            if prof is not None:
                prof["step_ends"].append(time.perf_counter())

        def _sync(self):
            if prof is None:
                return super()._sync()
            t = time.perf_counter()
            try:
                return super()._sync()
            finally:
                prof["dense_sync_total"] += time.perf_counter() - t

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            ctx = get_context()
            out = {"worker": ctx.worker_id, "series": series, "threads": _thread_cpu(),
                   "lookahead": dict(ctx.lookahead.stats), "batcher": dict(ctx.batcher.stats)}
            if prof is not None:
                out["profile"] = _summarize_profile(prof)
            path = os.path.join(os.environ.get("DEEPREC_STATE_DIR", "."),
                                f"bench-steps-{ctx.worker_id}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(path + ".tmp", path)

    dtf.ElasticCallback = TimedElasticCallback
    opt = os.environ.get("BENCH_OPTIMIZER", "adam")
    if opt != "adam":  # the fair-optimizer rows: the same optimizer on the PS and locally
        import keras
        orig_specs, orig_build = train.embedding_specs, train.build_keras

        def embedding_specs(lr):
            return {name: (init, {"name": opt, "learning_rate": lr})
                    for name, (init, _) in orig_specs(lr).items()}

        def build_keras(lr, dim):
            model = orig_build(lr, dim)
            model.compile(optimizer=_optimizer(keras, opt, lr), loss="binary_crossentropy")
            return model

        train.embedding_specs, train.build_keras = embedding_specs, build_keras
    return train.main(argv)


def _thread_cpu() -> dict:
    """CPU seconds of this process's live threads so far, summed by thread name (Linux
    ``/proc/self/task``): which of the worker's threads a mode's CPU goes to."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(") ", 1)
        except (OSError, ValueError):
            continue
        fields = rest.split()
        out[comm] = round(out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / tick, 2)
    return out


def _install_profiler() -> dict:
    """Wall-clock accounting of the PS client calls of this worker (opt-in, --profile)."""
    import threading
    from deeprec_ext.client.client import PSClient
    from deeprec_ext.worker import WorkerContext

    prof = {"calls": {}, "step_ends": [], "dense_sync_total": 0.0, "lock": threading.Lock()}

    def add(key, dt):
        with prof["lock"]:
            n, s = prof["calls"].get(key, (0, 0.0))
            prof["calls"][key] = (n + 1, s + dt)

    def kind(names):
        names = list(names)
        return "dense" if names and all(n.startswith("dense/") for n in names) else "+".join(names)

    orig_lookup, orig_push, orig_fan = PSClient.lookup_many, PSClient.push_many, PSClient._fan_out
    orig_shard = WorkerContext.try_next_shard

    def lookup_many(self, requests, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_lookup(self, requests, *args, **kwargs)
        finally:
            add(f"lookup {kind(requests)}", time.perf_counter() - t)

    def push_many(self, updates, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_push(self, updates, *args, **kwargs)
        finally:
            add(f"push {kind(updates)}", time.perf_counter() - t)

    def _fan_out(self, tables, build, method, store, what, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_fan(self, tables, build, method, store, what, *args, **kwargs)
        finally:
            add(f"  rpc part of {what} {kind(n for n, _ in tables)}", time.perf_counter() - t)

    def try_next_shard(self):
        t = time.perf_counter()
        try:
            return orig_shard(self)
        finally:
            add("get shard (master RPC)", time.perf_counter() - t)

    PSClient.lookup_many, PSClient.push_many, PSClient._fan_out = lookup_many, push_many, _fan_out
    WorkerContext.try_next_shard = try_next_shard
    return prof


def _summarize_profile(prof: dict) -> dict:
    ends = prof["step_ends"]
    skip = min(20, max(len(ends) - 2, 0))
    steps = len(ends)
    wall = ends[-1] - ends[0] if steps > 1 else 0.0
    return {"steps": steps, "wall_seconds_all_steps": wall,
            "ms_per_step": 1e3 * wall / max(steps - 1, 1),
            "ms_per_step_after_warmup": 1e3 * (ends[-1] - ends[skip]) / max(steps - 1 - skip, 1)
            if steps > skip + 1 else None,
            "dense_sync_ms_per_step": 1e3 * prof["dense_sync_total"] / max(steps, 1),
            "calls": {k: {"count": n, "total_s": s, "ms_per_call": 1e3 * s / max(n, 1),
                          "ms_per_step": 1e3 * s / max(steps, 1)}
                      for k, (n, s) in sorted(prof["calls"].items())}}


# ----------------------------------------------------------------------------------------
# ours: job file + aimaster run
# ----------------------------------------------------------------------------------------

def write_job(path: str, name: str, data_dir: str, args, profile: bool,
              overlap: bool | str = False, optimizer: str = "adam", lr: float | None = None,
              test: str | None = None, predictions: str | None = None) -> None:
    import yaml
    env = {"BENCH_PROFILE": "1"} if profile else {}
    if optimizer != "adam":
        env["BENCH_OPTIMIZER"] = optimizer
    eval_args = ["--test", test, "--predictions-out", predictions] if test else []
    job = {
        "name": name,
        "num_slots": 4096,
        "ps": {"replicas": 1},
        "worker": {
            "replicas": 1,
            "command": ["{python}", os.path.abspath(__file__), "--_ours-worker",
                        "--batch-size", str(args.batch_size), "--dim", str(DIM),
                        "--lr", str(args.lr if lr is None else lr)]
                       + (["--seed", str(args.init_seed)] if args.init_seed >= 0 else [])
                       + (["--overlap"] + ([overlap] if overlap in ("stale", "carry", "off")
                                           else [])
                          if overlap else []) + eval_args,
            "max_restarts": 0,
            "env": env,
        },
        "data": {"files": [os.path.join(data_dir, "train-*.txt")],
                 "records_per_shard": args.records_per_shard, "epochs": 1},
        "master": {"progress_seconds": 5},
    }
    with open(path, "w") as f:
        f.write("# generated by bench/bench_training.py (like examples/criteo/job.yaml on "
                "the bench data; worker 0 predicts the test file after training)\n")
        yaml.safe_dump(job, f, sort_keys=False)



class _CpuSampler:
    """CPU seconds of every process of an ours run (psutil, every 0.2 s): the AIMaster,
    each PS and each worker. On 2 shared cores what limits throughput is the CPU a step
    costs in all processes together, not where the wall time overlaps."""

    def __init__(self, root_pid: int, period: float = 0.2):
        import threading
        self.root, self.period = root_pid, period
        self.samples: dict[int, tuple[str, list]] = {}  # pid -> (role, [(t, cpu_s)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _role(proc, root: int) -> str:
        cmd = " ".join(proc.cmdline())
        if "--_child" in cmd:
            return "process"
        if proc.pid == root:
            return "aimaster"
        if "deeprec_ext.ps" in cmd:
            return "ps"
        if "--_ours-worker" in cmd:
            return "worker"
        return "other"

    def _run(self):
        import psutil
        try:
            root = psutil.Process(self.root)
        except psutil.Error:
            return
        procs: dict[int, object] = {}
        while not self._stop.is_set():
            try:
                for p in [root] + root.children(recursive=True):
                    procs.setdefault(p.pid, p)
            except psutil.Error:
                pass
            now = time.time()
            for pid, p in list(procs.items()):
                try:
                    c = p.cpu_times()
                    if pid not in self.samples:
                        self.samples[pid] = (self._role(p, self.root), [])
                    self.samples[pid][1].append((now, c.user + c.system))
                except psutil.Error:
                    procs.pop(pid)
            self._stop.wait(self.period)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def per_step(self, series_list: list, warmup: int) -> dict | None:
        """CPU ms per step of each role (summed over its processes) in the steady window
        (the one ``steady_rate`` uses), and their total."""
        import numpy as np
        series = [np.asarray(s, dtype=np.float64) for s in series_list if len(s)]
        if not series or any(len(s) <= warmup + 1 for s in series):
            return None
        t0 = max(s[warmup - 1, 0] if warmup else s[0, 0] for s in series)
        t1 = min(s[-1, 0] for s in series)
        steps = sum(int(((s[:, 0] > t0) & (s[:, 0] <= t1)).sum()) for s in series)
        if t1 <= t0 or not steps:
            return None
        out: dict[str, float] = {}
        for role, pts in self.samples.values():
            a = np.asarray(pts)
            if len(a) < 2 or a[0, 0] > t0 or a[-1, 0] < t1:
                continue  # not alive over the whole window
            cpu = float(np.interp(t1, a[:, 0], a[:, 1]) - np.interp(t0, a[:, 0], a[:, 1]))
            out[role] = out.get(role, 0.0) + cpu
        res = {f"{k}_cpu_ms_per_step": 1e3 * v / steps for k, v in sorted(out.items())}
        res["total_cpu_ms_per_step"] = 1e3 * sum(out.values()) / steps
        res["wall_ms_per_step"] = 1e3 * (t1 - t0) / steps * len(series)
        res["steps"] = steps
        return res


def _aimaster_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "aimaster")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "aimaster.cli"]


def run_ours(args, data: dict, ps: int, workers: int, profile: bool = False,
             tag: str | None = None, overlap: bool | str = False, optimizer: str = "adam",
             lr: float | None = None, look_ahead: bool = True) -> dict:
    tag = tag or (f"{ps}x{workers}" + ({"stale": "-overlap-stale", "carry": "-carry",
                                        "off": "-waited"}
                                       .get(overlap, "-overlap")
                                       if overlap else "")
                  + ("" if look_ahead else "-no-lookahead")
                  + ("" if optimizer == "adam" else f"-{optimizer}"))
    state_dir = os.path.join(REPO, "runs", f"bench-ours-{tag}")
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    job_path = os.path.join(state_dir, "job.yaml")
    predictions = os.path.join(state_dir, "test-predictions.npy")
    write_job(job_path, f"bench-ours-{tag}", data["dir"], args, profile, overlap,
              optimizer, lr, data.get("test"), predictions)
    cmd = _aimaster_cmd() + ["run", job_path, "--ps", str(ps), "--workers", str(workers),
                             "--state-dir", os.path.relpath(state_dir, REPO),
                             "--log-level", "WARNING"]
    log_path = os.path.join(state_dir, "aimaster.out")
    pyspy = None
    with open(log_path, "wb") as log:
        # the A/B row: the next batch's rows not fetched ahead (deeprec_ext.lookahead)
        env = dict(os.environ, DEEPREC_LOOKAHEAD="1" if look_ahead else "0")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        cpu = _CpuSampler(proc.pid)
        try:
            if profile and args.py_spy:
                pyspy = _start_py_spy(state_dir, ps, workers, args.timeout)
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise RuntimeError(f"ours {tag}: timed out after {args.timeout}s; see {log_path}")
        finally:
            cpu.stop()
            if proc.poll() is None:
                _stop_group(proc)
            for p in pyspy or []:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    if code != 0:
        raise RuntimeError(f"ours {tag}: aimaster exited with {code}; see {log_path} and "
                           f"{state_dir}/logs/")
    metrics = []
    for path in sorted(glob.glob(os.path.join(state_dir, "metrics-worker-*.json"))):
        with open(path) as f:
            metrics.append(json.load(f))
    steps = []
    for path in sorted(glob.glob(os.path.join(state_dir, "bench-steps-worker-*.json"))):
        with open(path) as f:
            steps.append(json.load(f))
    if len(metrics) != workers or len(steps) != workers:
        raise RuntimeError(f"ours {tag}: expected {workers} worker metrics files, found "
                           f"{len(metrics)} metrics / {len(steps)} step logs in {state_dir}")
    samples = sum(m["samples"] for m in metrics)
    out = {"series": [s["series"] for s in steps], "samples": samples,
           "fit_seconds": max(m["train_seconds"] for m in metrics),
           "steps": sum(m["steps"] for m in metrics),
           "worker_metrics": metrics, "state_dir": os.path.relpath(state_dir, REPO),
           "optimizer": optimizer,
           "cpu": cpu.per_step([s["series"] for s in steps], args.warmup_steps)}
    if data.get("test"):
        import numpy as np
        if not os.path.exists(predictions):
            raise RuntimeError(f"ours {tag}: worker 0 wrote no test predictions; see "
                               f"{state_dir}/logs/")
        scores = np.load(predictions)
        out.update({"auc": auc(test_labels(data["test"]), scores),
                    "test_rows": int(len(scores))})
    if profile:
        out["profile"] = {s["worker"]: s.get("profile") for s in steps}
        if pyspy:
            out["py_spy"] = {os.path.relpath(p, REPO): summarize_py_spy(p)
                             for p in sorted(glob.glob(os.path.join(state_dir, "py-spy-*.txt")))}
    return out


def _start_py_spy(state_dir: str, ps: int, workers: int, timeout: float) -> list:
    """Attach py-spy (raw collapsed stacks) to every PS and worker once they registered."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        print("  (py-spy not installed: skipping sampling profiles)", flush=True)
        return []
    deadline = time.time() + min(timeout, 120)
    from aimaster.state import load_state
    members = []
    while time.time() < deadline:
        try:
            members = (load_state(state_dir) or {}).get("members", [])
        except (OSError, ValueError, RuntimeError):
            members = []
        if sum(1 for m in members if m["role"] == "ps") >= ps and \
                sum(1 for m in members if m["role"] == "worker") >= workers:
            break
        time.sleep(0.2)
    procs = []
    for m in members:
        out = os.path.join(state_dir, f"py-spy-{m['id']}.txt")
        procs.append(subprocess.Popen(
            [exe, "record", "--pid", str(m["pid"]), "--format", "raw", "--rate", "200",
             "--nonblocking", "--threads", "--output", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def summarize_py_spy(path: str, top: int = 12) -> dict:
    """Share of non-idle samples per function (inclusive), from ``py-spy --format raw``."""
    import collections
    import re
    incl, total = collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")[1:]  # first frame: thread
            last = frames[-1] if frames else ""
            # threads parked in grpc's completion-queue poll / thread-pool queue are idle
            if re.search(r"^(_serve|_status|_worker|channel_spin|_run_channel_spin_thread|"
                         r"Condition.wait|_wait_once) ", last):
                continue
            n = int(n)
            total += n
            for name in {re.sub(r" \(.*$", "", fr) for fr in frames}:
                incl[name] += n
    keep = [(k, c) for k, c in incl.most_common() if not k.startswith(("Thread.", "_bootstrap",
                                                                        "<module>"))]
    return {"busy_samples": total,
            "top_inclusive": [(k, round(100.0 * c / max(total, 1), 1)) for k, c in keep[:top]]}


def _stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------

def run_child(args, kind: str, vocab: int, data: dict, log_dir: str, inner: int = 1,
              optimizer: str = "adam", lr: float | None = None, unique: bool = False) -> dict:
    lr = args.lr if lr is None else lr
    tag = f"{kind}-{vocab}-x{inner}" + ("" if optimizer == "adam" else f"-{optimizer}")
    result_path = os.path.join(log_dir, f"{tag}.json")
    log_path = os.path.join(log_dir, f"{tag}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    env = dict(os.environ)
    if kind in TF216_KINDS:  # TF 2.16 + tf-keras + TFRA, in their own venv
        python = args.tfra_python
        env["TF_USE_LEGACY_KERAS"] = "1"
    else:
        python = sys.executable
    cmd = ([python, os.path.abspath(__file__), "--_child", kind, "--_result", result_path,
           "--_files", json.dumps(data["train"]), "--_test", data.get("test") or "",
           "--test-rows", str(args.test_rows), "--rows", str(args.rows),
           "--batch-size", str(args.batch_size), "--vocab", str(vocab), "--lr", str(lr),
           "--optimizer", optimizer, "--warmup-steps", str(args.warmup_steps),
           "--pss-inner-steps", str(inner), "--pss-cluster", _pss_cluster_of(args, kind),
           "--tf216-optimizer", args.tf216_optimizer, "--init-seed", str(args.init_seed)]
           + (["--unique-ids"] if unique else []))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        cpu = _CpuSampler(proc.pid)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{kind}: timed out after {args.timeout}s; see {log_path}")
        finally:
            cpu.stop()
            _stop_group(proc)  # also reaps tf.distribute.Server grandchildren
    if not os.path.exists(result_path):
        raise RuntimeError(f"{kind}: no result (exit code {proc.returncode}); see {log_path}")
    with open(result_path) as f:
        out = json.load(f)
    if not out.get("pre_warmed"):  # PSS children report only a pre-warmed window
        out["cpu"] = cpu.per_step(out["series"], args.warmup_steps)
    return out


def _pss_cluster_of(args, kind: str) -> str:
    """``auto``: the Keras 3 baseline keeps its server subprocesses (as measured so far); the
    TF 2.16 rows (tf-keras, TFRA) use the in-process cluster of TF's PSS tutorial and TFRA's
    PSS example."""
    if args.pss_cluster != "auto":
        return args.pss_cluster
    return "in-process" if kind in TF216_KINDS else "processes"


def _summarize(name: str, raw: dict, warmup: int) -> dict:
    if raw.get("pre_warmed"):  # PSS: the child already timed only post-warm-up steps
        s = raw["series"][0]
        steady = {"samples_per_s": (s[1][1] - s[0][1]) / (s[1][0] - s[0][0]),
                  "window_seconds": s[1][0] - s[0][0], "window_samples": s[1][1] - s[0][1]}
    else:
        steady = steady_rate(raw["series"], warmup)
    out = {"config": name, "samples_per_s": steady["samples_per_s"],
           "end_to_end_samples_per_s": raw["samples"] / raw["fit_seconds"],
           "samples": raw["samples"], "steps": raw["steps"], "fit_seconds": raw["fit_seconds"],
           "steady": steady}
    for k in ("auc", "test_rows", "eval_seconds", "final_loss", "optimizer", "pss_cluster",
              "versions", "table_sizes", "worker_metrics", "variable_devices", "jit_compile",
              "state_dir", "profile", "py_spy", "cpu"):
        if k in raw:
            out[k] = raw[k]
    return out


def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


CONFIGS = ("single", "pss", "tfk-single", "tfk-pss", "tfra-single", "tfra-pss", "ours-1x1",
           "ours-1x1-overlap", "ours-1x1-overlap-stale", "ours-1x1-carry", "ours-1x1-waited",
           "ours-1x1-no-lookahead", "ours-2x2", "ours-2x2-waited")
DEFAULT_CONFIGS = "single,pss,ours-1x1,ours-1x1-overlap,ours-2x2"
# --configs tfra: TFRA and the stock TF baselines in both Keras flavours next to ours
TFRA_PRESET = ("tfra-single", "tfra-pss", "tfk-single", "tfk-pss", "single", "pss",
               "ours-1x1", "ours-2x2")
# row name of each configuration (the existing names are kept for the JSON's readers)
ROW = {"single": "single", "pss": "tf-pss", "tfk-single": "tfk-single", "tfk-pss": "tfk-pss",
       "tfra-single": "tfra-single", "tfra-pss": "tfra-pss", "ours-1x1": "ours-1x1",
       "ours-1x1-overlap": "ours-1x1-overlap", "ours-1x1-overlap-stale": "ours-1x1-overlap-stale",
       "ours-1x1-carry": "ours-1x1-carry", "ours-1x1-waited": "ours-1x1-waited",
       "ours-1x1-no-lookahead": "ours-1x1-no-lookahead",
       "ours-2x2": "ours-2x2", "ours-2x2-waited": "ours-2x2-waited"}
QUICK = {"rows": 60_000, "test_rows": 10_000, "repeat": 1, "extra_vocab": 0,
         "extra_pss_inner_steps": 0, "timeout": 300.0, "warmup_steps": 10}
DEFAULTS = {"rows": 400_000, "test_rows": 50_000, "repeat": 2, "extra_vocab": 2 ** 20,
            "extra_pss_inner_steps": 10, "timeout": 420.0, "warmup_steps": 20}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_ours-worker"]:
        return ours_worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="training rows (default 400k)")
    ap.add_argument("--test-rows", type=int, default=None,
                    help="rows of the test file every configuration's AUC is measured on "
                         "(default 50k; 0: no AUC)")
    ap.add_argument("--files", type=int, default=2, help="training files to split rows into")
    ap.add_argument("--init-seed", type=int, default=0,
                    help="Keras seed every configuration builds its model with, so that all "
                         "start from the same dense weights and their AUCs compare training, "
                         "not initial draws (unseeded, DeepFM's first loss ranges 0.7-4 on "
                         "this data); negative: unseeded")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=("adam", "adagrad"), default="adam",
                    help="optimizer of the main rows (default adam: Keras Adam for the stock "
                         "baselines and TFRA, PS-side lazy Adam for ours)")
    ap.add_argument("--fair-optimizer", choices=("adagrad", "none"), default=None,
                    help="also run every configuration with this optimizer everywhere (dense "
                         "and sparse), whose update of a row that is not in the batch is "
                         "zero in every implementation; default: adagrad with --configs tfra, "
                         "none otherwise")
    ap.add_argument("--fair-lr", type=float, default=0.3,
                    help="learning rate of the --fair-optimizer rows (default 0.3: Adagrad's "
                         "accumulator starts at 0.1, and at 0.05 one epoch reaches only ~0.69 AUC)")
    ap.add_argument("--vocab", type=int, default=2 ** 18,
                    help="Keras Embedding vocabulary of the baselines (ids mod vocab)")
    ap.add_argument("--extra-vocab", type=int, default=None,
                    help="also run single-process with this vocabulary (informational; 0: skip; "
                         "default 2**20, 0 with --configs tfra or --quick)")
    ap.add_argument("--extra-pss-inner-steps", type=int, default=None,
                    help="also run TF-PSS with this many steps per scheduled tf.function "
                         "(informational; 0: skip; default 10, 0 with --configs tfra or --quick)")
    ap.add_argument("--tf216-optimizer", choices=("auto", "default", "legacy"), default="auto",
                    help="optimizer classes of the tf-keras / TFRA rows: tf-keras' default "
                         "(tf.keras.optimizers.Adam, ...) or tf.keras.optimizers.legacy.*; "
                         "auto (default): legacy for TFRA, default for stock tf-keras")
    ap.add_argument("--pss-inner-steps", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--unique-ids", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pss-cluster", choices=("auto", "processes", "in-process"),
                    default="auto",
                    help="where the PSS worker and PS servers run: own subprocesses, or inside "
                         "the coordinator process (TF's tutorial); auto (default): subprocesses "
                         "for Keras 3, in-process for the TF 2.16 / TFRA rows")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="steps excluded from the steady-state window (default 20, 10 with "
                         "--quick)")
    ap.add_argument("--records-per-shard", type=int, default=20_000)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated subset of {','.join(CONFIGS)}, or tfra (= "
                         f"{','.join(TFRA_PRESET)}, plus the fair-optimizer rows); default "
                         f"{DEFAULT_CONFIGS}")
    ap.add_argument("--tfra-python",
                    default=os.path.join(REPO, "bench", ".venv-tfra", "bin", "python"),
                    help="python of the TF 2.16 + tf-keras + TFRA venv (bench/tfra/setup-venv)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds over all configurations (default 2); each configuration's "
                         "best round is reported, every round is kept in the JSON")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 60k rows, 10k test rows, 10 warm-up steps, 1 round, no "
                         "informational extras (explicit options win)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per configuration (default 420)")
    ap.add_argument("--profile", action="store_true",
                    help="also run ours 1+1 once with per-call timing (and py-spy if installed)")
    ap.add_argument("--no-py-spy", dest="py_spy", action="store_false")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "training.json"))
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_files", help=argparse.SUPPRESS)
    ap.add_argument("--_test", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    requested = [c.strip() for c in args.configs.split(",") if c.strip()]
    preset = "tfra" in requested
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else
                    0 if preset and k.startswith("extra") else v)

    if args._child:
        args.files_list = json.loads(args._files)
        if args.init_seed >= 0:  # the same initial dense weights in every configuration
            import tensorflow as tf
            tf.keras.utils.set_random_seed(args.init_seed)
        res = CHILDREN[args._child](args)
        with open(args._result + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(args._result + ".tmp", args._result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip TF teardown (the PS coordinator can block on dead servers)

    configs = []
    for c in requested:
        for x in (TFRA_PRESET if c == "tfra" else (c,)):
            if x not in configs:
                configs.append(x)
    bad = set(configs) - set(CONFIGS)
    if bad:
        ap.error(f"unknown config(s) {sorted(bad)}")
    fair = args.fair_optimizer or ("adagrad" if preset else "none")
    if fair == args.optimizer:
        fair = "none"
    if set(configs) & TF216_KINDS and not os.path.exists(args.tfra_python):
        ap.error(f"{args.tfra_python} not found: run bench/tfra/setup-venv first")
    started = time.time()
    data = ensure_data(args.rows, args.files, args.seed, args.test_rows)
    log_dir = os.path.join(REPO, "runs", "bench-training-logs")
    os.makedirs(log_dir, exist_ok=True)
    load_before = os.getloadavg()

    groups = [(args.optimizer, args.lr, "")]
    if fair != "none":
        groups.append((fair, args.fair_lr, f"+{fair}"))
    plan = []  # (row name, group suffix, function)
    for opt, lr, sfx in groups:
        def child(kind, vocab=args.vocab, inner=1, opt=opt, lr=lr, unique=bool(sfx)):
            # the fair rows: the stock baselines de-duplicate ids like TFRA and ours do
            return lambda: run_child(args, kind, vocab, data, log_dir, inner, opt, lr, unique)

        def ours(ps, workers, overlap=False, opt=opt, lr=lr, look_ahead=True):
            return lambda: run_ours(args, data, ps, workers, overlap=overlap, optimizer=opt,
                                    lr=lr, look_ahead=look_ahead)

        for c in configs:
            if c in ("single", "tfk-single", "tfra-single", "tfk-pss", "tfra-pss"):
                plan.append((ROW[c] + sfx, sfx, child(c)))
                if c == "single" and args.extra_vocab and not sfx:
                    plan.append((f"single@{args.extra_vocab}", sfx,
                                 child("single", args.extra_vocab)))
            elif c == "pss":
                plan.append(("tf-pss" + sfx, sfx, child("pss")))
                if args.extra_pss_inner_steps > 1 and not sfx:
                    plan.append((f"tf-pss-x{args.extra_pss_inner_steps}", sfx,
                                 child("pss", inner=args.extra_pss_inner_steps)))
            elif c == "ours-1x1":
                plan.append(("ours-1x1" + sfx, sfx, ours(1, 1)))
            elif c == "ours-1x1-overlap":
                plan.append(("ours-1x1-overlap" + sfx, sfx, ours(1, 1, True)))
            elif c == "ours-1x1-overlap-stale":
                plan.append(("ours-1x1-overlap-stale" + sfx, sfx, ours(1, 1, "stale")))
            elif c == "ours-1x1-carry":
                plan.append(("ours-1x1-carry" + sfx, sfx, ours(1, 1, "carry")))
            elif c == "ours-1x1-waited":
                plan.append(("ours-1x1-waited" + sfx, sfx, ours(1, 1, "off")))
            elif c == "ours-1x1-no-lookahead":  # the configuration before the lookahead
                plan.append(("ours-1x1-no-lookahead" + sfx, sfx,
                             ours(1, 1, "off", look_ahead=False)))
            elif c == "ours-2x2":
                plan.append(("ours-2x2" + sfx, sfx, ours(2, 2)))
            elif c == "ours-2x2-waited":
                plan.append(("ours-2x2-waited" + sfx, sfx, ours(2, 2, "off")))

    runs: dict[str, list] = {}
    for r in range(args.repeat):
        for name, _, fn in plan:
            print(f"[{time.time() - started:6.1f}s] {name} (round {r + 1}/{args.repeat}, "
                  f"load {os.getloadavg()[0]:.1f}) ...", flush=True)
            try:
                res = _summarize(name, fn(), args.warmup_steps)
            except Exception as exc:  # keep going: report what could be measured
                print(f"  FAILED: {exc}", flush=True)
                res = {"config": name, "samples_per_s": None, "error": str(exc)}
            runs.setdefault(name, []).append(res)
            if res.get("samples_per_s"):
                print(f"  {res['samples_per_s']:,.0f} samples/s steady, "
                      f"{res['end_to_end_samples_per_s']:,.0f} end-to-end"
                      + (f", AUC {res['auc']:.4f}" if res.get("auc") is not None else ""),
                      flush=True)
                if res.get("cpu"):
                    print("  CPU ms/step: " + ", ".join(
                        f"{k.replace('_cpu_ms_per_step', '')} {v:.1f}"
                        for k, v in res["cpu"].items() if k.endswith("_cpu_ms_per_step"))
                        + f" (wall {res['cpu']['wall_ms_per_step']:.1f})", flush=True)
            elif "error" not in res:
                print(f"  no steady-state figure: {res['steady'].get('reason')}", flush=True)
    load_after = os.getloadavg()

    profile = None
    if args.profile:
        print(f"[{time.time() - started:6.1f}s] ours-1x1 profiled run ...", flush=True)
        try:
            profile = _summarize("ours-1x1 (profiled)", run_ours(args, data, 1, 1, True,
                                                                 tag="1x1-profile"),
                                 args.warmup_steps)
        except Exception as exc:
            print(f"  FAILED: {exc}", flush=True)
            profile = {"error": str(exc)}

    def best(name):
        ok = [r for r in runs.get(name, []) if r.get("samples_per_s")]
        return max(ok, key=lambda r: r["samples_per_s"]) if ok else None

    v = f"{args.vocab:,}"
    labels = {
        "tfra-single": "TFRA single process, dynamic_embedding (raw ids)",
        "tfra-pss": "TFRA + TF PSS 1 worker + 1 PS",
        "tfk-single": f"stock tf-keras single process, vocab {v}",
        "tfk-pss": f"stock tf-keras PSS 1 worker + 1 PS, vocab {v}",
        "single": f"{'stock Keras 3' if preset else 'single-process Keras'}"
                  f"{' single process' if preset else ''}, Embedding vocab {v}",
        f"single@{args.extra_vocab}":
            f"single-process Keras, Embedding vocab {args.extra_vocab:,} (info)",
        "tf-pss": f"{'stock Keras 3 PSS' if preset else 'TF ParameterServerStrategy'} "
                  f"1 worker + 1 PS, vocab {v}",
        f"tf-pss-x{args.extra_pss_inner_steps}":
            f"TF PSS, {args.extra_pss_inner_steps} steps per schedule() (info)",
        "ours-1x1": "ours 1 worker + 1 PS",
        "ours-1x1-overlap": "ours 1 worker + 1 PS, --overlap (fresh lookups, the default)",
        "ours-1x1-waited": "ours 1 worker + 1 PS, --overlap off (every push waited)",
        "ours-1x1-overlap-stale": "ours 1 worker + 1 PS, --overlap stale",
        "ours-1x1-carry": "ours 1 worker + 1 PS, --overlap carry (push in the next lookup)",
        "ours-1x1-no-lookahead": "ours 1 worker + 1 PS, waited, no rows fetched ahead",
        "ours-2x2": "ours 2 workers + 2 PS",
        "ours-2x2-waited": "ours 2 workers + 2 PS, --overlap off (every push waited)",
    }
    names = [n for n, _, _ in plan]
    bases = [(key, base, title) for key, base, title in
             (("vs_tfra", "tfra-single", "vs TFRA"), ("vs_single", "single", "vs single"),
              ("vs_tf_pss", "tf-pss", "vs TF-PSS"))
             if any(n == base or n.startswith(base + "+") for n in names)]
    rows_out = []
    for name, sfx, _ in plan:
        b = best(name)
        sps = b["samples_per_s"] if b else None
        base_name = name[:-len(sfx)] if sfx else name
        label = labels.get(base_name, base_name)
        if sfx:
            label += f", {sfx[1:].capitalize()} lr {args.fair_lr:g}"
        row = {"config": name, "label": label, "optimizer": sfx[1:] or args.optimizer,
               "samples_per_s": sps,
               "end_to_end_samples_per_s": b["end_to_end_samples_per_s"] if b else None,
               "auc": b.get("auc") if b else None,
               "all_rounds_samples_per_s": [r.get("samples_per_s") for r in runs[name]],
               "all_rounds_auc": [r.get("auc") for r in runs[name]]}
        for key, base, _ in bases:  # ratios within the same optimizer group
            ref = best(base + sfx)
            row[key] = sps / ref["samples_per_s"] if sps and ref else None
        rows_out.append(row)

    print()
    print(f"DeepFM dim {DIM}, hidden {HIDDEN}, batch {args.batch_size}, {args.rows:,} rows; "
          f"{args.optimizer} lr {args.lr:g}"
          + (f" (and {fair} lr {args.fair_lr:g} everywhere)" if fair != "none" else "")
          + f"; steady-state after {args.warmup_steps} warm-up steps; AUC on "
          f"{args.test_rows:,} test rows; {os.cpu_count()} CPUs; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    w = max(len(r["label"]) for r in rows_out)
    print(f"{'config':{w}}  {'samples/s':>10}  {'end-to-end':>10}  "
          + "".join(f"{t:>9}  " for _, _, t in bases)
          + f"{'AUC':>6}  samples/s of every round")
    for r in rows_out:
        print(f"{r['label']:{w}}  {_fmt(r['samples_per_s']):>10}  "
              f"{_fmt(r['end_to_end_samples_per_s']):>10}  "
              + "".join(f"{_fmt(r[k], '.2f'):>8}x  " for k, _, _ in bases)
              + f"{_fmt(r['auc'], '.4f'):>6}  "
              + " / ".join(_fmt(x) for x in r["all_rounds_samples_per_s"]))

    goals = [("tf-pss", TARGET_VS_PSS, "ParameterServerStrategy"),
             ("single", TARGET_VS_SINGLE, "single-process")]
    if preset or "tfra-single" in configs:
        goals = [("tfra-single", TARGET_VS_TFRA, "TFRA single-process"),
                 ("tfra-pss", TARGET_VS_TFRA_PSS, "TFRA + PSS 1+1"),
                 ("tfk-pss", TARGET_VS_TFK_PSS, "stock TF PSS 1+1 (tf-keras)")]
    targets = []
    for _, _, sfx in groups:
        ours_runs = runs.get("ours-1x1" + sfx, [])
        ours_best = best("ours-1x1" + sfx)
        for base, goal, what in goals:
            ref = best(base + sfx)
            if ref is None and base + sfx not in runs:
                continue
            got = (ours_best["samples_per_s"] / ref["samples_per_s"]
                   if ours_best and ref else None)
            verdict = "n/a" if got is None else ("PASS" if got >= goal else "MISS")
            per_round = [a["samples_per_s"] / c["samples_per_s"]
                         if a.get("samples_per_s") and c.get("samples_per_s") else None
                         for a, c in zip(ours_runs, runs.get(base + sfx, []))]
            targets.append({"target": f"ours 1+1 >= {goal}x {what}"
                                      + (f" [{sfx[1:]}]" if sfx else ""),
                            "ratio": got, "goal": goal, "result": verdict,
                            "ratio_within_each_round": per_round})
    print()
    for t in targets:
        rounds = ", ".join(_fmt(x, ".2f") for x in t["ratio_within_each_round"])
        short = "" if t["result"] != "MISS" else f" by {100 * (1 - t['ratio'] / t['goal']):.0f}%"
        print(f"target: {t['target']:56s} {_fmt(t['ratio'], '.2f')}x  {t['result']}{short}"
              f"   (within each round: {rounds})")
    if profile and profile.get("profile"):
        print()
        print("profile of ours 1+1 (per-call wall time in the worker; calls inside a step "
              "may overlap):")
        for worker, p in profile["profile"].items():
            if not p:
                continue
            print(f"  {worker}: {p['steps']} steps, {p['ms_per_step_after_warmup']:.1f} ms/step "
                  f"after warm-up, dense sync {p['dense_sync_ms_per_step']:.1f} ms/step")
            for k, c in p["calls"].items():
                print(f"    {k:48s} {c['count']:6d} calls  {c['ms_per_call']:7.2f} ms/call  "
                      f"{c['ms_per_step']:7.2f} ms/step")

    if profile and profile.get("py_spy"):
        print("py-spy, share of busy samples per function (inclusive):")
        for path, summ in profile["py_spy"].items():
            print(f"  {path} ({summ['busy_samples']} busy samples)")
            for name, pct in summ["top_inclusive"]:
                print(f"    {pct:5.1f}%  {name}")

    elapsed = time.time() - started
    tf216 = next((r["versions"] for rs in runs.values() for r in rs
                  if r.get("config", "").startswith(("tfra", "tfk")) and r.get("versions")), None)
    result = {
        "benchmark": "bench/bench_training.py",
        "command": " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO)
                             else sys.executable, "bench/bench_training.py"] + argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": _versions(), "versions_tf216_venv": tf216,
        "params": {"rows": args.rows, "test_rows": args.test_rows, "files": args.files,
                   "seed": args.seed, "init_seed": args.init_seed,
                   "batch_size": args.batch_size, "lr": args.lr,
                   "optimizer": args.optimizer, "fair_optimizer": fair,
                   "fair_lr": args.fair_lr, "dim": DIM,
                   "hidden": list(HIDDEN), "vocab": args.vocab,
                   "extra_vocab": args.extra_vocab, "warmup_steps": args.warmup_steps,
                   "records_per_shard": args.records_per_shard, "repeat": args.repeat,
                   "extra_pss_inner_steps": args.extra_pss_inner_steps,
                   "tf216_optimizer": args.tf216_optimizer,
                   "pss_cluster": {c: _pss_cluster_of(args, c) for c in configs
                                   if c.endswith("pss")}, "quick": args.quick},
        "data_dir": os.path.relpath(data["dir"], REPO),
        "table": rows_out, "targets": targets,
        "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "series"} for r in v]
                 for k, v in runs.items()},
        "profile": profile, "elapsed_seconds": elapsed,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nsaved {os.path.relpath(os.path.abspath(args.out), REPO)} "
          f"(total {elapsed:.0f} s)")
    return 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("tensorflow-cpu", "tensorflow", "keras", "numpy", "grpcio"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
