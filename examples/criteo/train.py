"""DeepFM on Criteo-format data, trained by an elastic PS job (the worker command).

Launched by ``aimaster run examples/criteo/job.yaml``; each worker reads the shards the
AIMaster hands it. Worker 0 waits for the whole job to finish, then evaluates AUC on the
test file; every worker writes ``metrics-<worker id>.json`` into the job's state dir.

    --mode keras   model.fit with ElasticEmbedding + ElasticCallback (default)
    --mode tf1     MonitoredTrainingSession with embedding_lookup + ElasticSessionHook
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import deeprec_ext.tf as dtf  # noqa: E402
from examples.criteo.model import build_deepfm, build_deepfm_tf1  # noqa: E402
from examples.criteo.reader import (CAT_NAMES, DENSE_NAMES, criteo_dataset,  # noqa: E402
                                    parse_columns, parse_lines)

log = logging.getLogger("train")


def embedding_specs(lr: float) -> dict:
    opt = {"name": "adam", "learning_rate": lr}
    return {
        "embedding": ({"name": "normal", "stddev": 0.01, "seed": 7}, opt),
        "linear": ("zeros", opt),
    }


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula (ties get average ranks)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    # average ranks over ties, vectorized
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    pos = labels.astype(bool)
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def build_keras(lr: float, dim: int, storage_dtype: str = "float32") -> keras.Model:
    specs = embedding_specs(lr)

    def factory(name, d):
        init, opt = specs[name]
        return dtf.ElasticEmbedding(d, table=name, initializer=init, optimizer=opt, name=name,
                                    storage_dtype=storage_dtype)

    model = build_deepfm(embedding_factory=factory, dim=dim)
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="binary_crossentropy")
    return model


def predict_keras(model, test_file: str, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    labels, scores = [], []
    for features, label in criteo_dataset([test_file], batch_size):
        scores.append(model(features, training=False).numpy().ravel())
        labels.append(label.numpy())
    return np.concatenate(labels), np.concatenate(scores)


def training_input(args):
    """The job's shards: lines parsed by ``parse_lines``, or with ``--parquet-columns``
    Parquet shards read as typed columns and parsed by ``parse_columns``."""
    if args.parquet_columns:
        return dtf.shard_dataset(args.batch_size, parse_fn=parse_columns,
                                 columns=["label", *DENSE_NAMES, *CAT_NAMES])
    return dtf.shard_dataset(args.batch_size, parse_fn=parse_lines)


def run_keras(args, ctx) -> dict:
    model = build_keras(args.lr, args.dim, args.storage_dtype)
    ds = training_input(args)
    callback = dtf.ElasticCallback(overlap={"off": False, "fresh": True, "stale": "stale",
                                            "carry": "carry"}[args.overlap])
    if args.predictions_before_out and args.test and ctx.rank == 0:
        # the model as the job starts (e.g. warm-started): shared weights, nothing trained
        callback.set_model(model)
        callback.on_train_begin()
        _, scores = predict_keras(model, args.test, 4096)
        np.save(args.predictions_before_out, scores)
    start = time.monotonic()
    history = model.fit(ds, epochs=1, callbacks=[callback], verbose=2,
                        shuffle=False)
    out = {"train_seconds": time.monotonic() - start, "steps": ctx.session.steps,
           "samples": ctx.session.samples,
           "final_loss": float(history.history["loss"][-1]) if history.history.get("loss") else None,
           "lookahead": dict(ctx.lookahead.stats)}  # lookups fetched while a step trained
    if args.test and ctx.rank == 0 and not ctx.stop_requested.is_set():
        ctx.wait_all_done()
        callback.on_test_begin()  # pull the final dense weights every worker contributed to
        labels, scores = predict_keras(model, args.test, 4096)
        out["auc"] = auc(labels, scores)
        if args.predictions_out:
            np.save(args.predictions_out, scores)
    return out


def run_tf1(args, ctx) -> dict:
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    specs = embedding_specs(args.lr)

    def lookup(name, ids, d):
        init, opt = specs[name]
        return dtf.embedding_lookup(name, ids, d, initializer=init, optimizer=opt,
                                    storage_dtype=args.storage_dtype)

    ds = training_input(args)
    features, label = v1.data.make_one_shot_iterator(ds).get_next()
    logits = build_deepfm_tf1(features, lookup, dim=args.dim)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=label, logits=tf.reshape(logits, [-1])))
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.AdamOptimizer(args.lr).minimize(loss, global_step=global_step)
    start = time.monotonic()
    last = None
    with v1.train.MonitoredTrainingSession(hooks=[dtf.ElasticSessionHook()],
                                           save_checkpoint_secs=None, save_summaries_steps=None,
                                           log_step_count_steps=None) as sess:
        while not sess.should_stop():
            _, last = sess.run([train_op, loss])
            if ctx.session.steps % 100 == 0:
                log.info("step %d loss %.4f", ctx.session.steps, last)
    return {"train_seconds": time.monotonic() - start, "steps": ctx.session.steps,
            "samples": ctx.session.samples, "final_loss": float(last) if last is not None else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("keras", "tf1"), default="keras")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--parquet-columns", action="store_true",
                   help="data files are Parquet (label, I1..I13, C1..C26): read typed columns")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=None,
                   help="seed Keras' initializers (every worker builds the same initial model)")
    p.add_argument("--test", default="", help="test file; worker 0 reports its AUC")
    p.add_argument("--storage-dtype", default="float32", choices=("float32", "float16"),
                   help="how the PS stores the embedding values (float16: half the bytes)")
    p.add_argument("--overlap", nargs="?", const="fresh", default="fresh",
                   choices=("fresh", "off", "stale", "carry"),
                   help="'fresh' (the default): each step's push stays in flight while the "
                        "next step starts, its rows patched into the next step's; 'off': "
                        "every push waited; 'stale' also skips fresh lookups; 'carry' sends "
                        "a step's push in the next step's lookup call "
                        "(see docs/guide-tensorflow.md)")
    p.add_argument("--predictions-out", default="",
                   help="worker 0 saves its predictions on --test at the end (.npy)")
    p.add_argument("--predictions-before-out", default="",
                   help="worker 0 saves its predictions on --test before training (.npy)")
    p.add_argument("--metrics-out", default="",
                   help="default: $DEEPREC_STATE_DIR/metrics-<worker>.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    ctx = dtf.get_context()
    log.info("worker %s (rank %d) starting, mode %s", ctx.worker_id, ctx.rank, args.mode)
    out = run_keras(args, ctx) if args.mode == "keras" else run_tf1(args, ctx)
    out.update(worker=ctx.worker_id, rank=ctx.rank, mode=args.mode)
    path = args.metrics_out or os.path.join(os.environ.get("DEEPREC_STATE_DIR", "."),
                                            f"metrics-{ctx.worker_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(path + ".tmp", path)
    log.info("done: %s", out)
    ctx.close()  # pushes settled, shards reported, lease given back
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is settled and reported. TensorFlow's teardown can hold interpreter exit
    # for tens of seconds (tf.data generator threads), which delays scale-in and job end.
    os._exit(code)
