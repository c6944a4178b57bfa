"""DeepFM on Criteo-format data in the accuracy-consistent (sync) mode: the worker command
of a job with ``consistency: {mode: sync, virtual_workers: V}``.

Every global step trains V micro-batches of ``--micro-batch`` records, one per virtual
worker, whatever the number of physical workers; the final model is the same bit for bit
for 1, 2 or 4 workers, and across scale events. ``--feature-dropout`` replaces each
categorical value by its column's "missing" id with that probability, drawn from the
virtual worker's own random generator (which moves with it between hosts).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

log = logging.getLogger("train_sync")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=256, help="records per virtual worker per step")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0, help="initial dense weights (same on every worker)")
    p.add_argument("--feature-dropout", type=float, default=0.0)
    p.add_argument("--throttle-ms", type=float, default=0.0,
                   help="sleep after each step (demos/tests: room to scale mid-run)")
    p.add_argument("--metrics-out", default="")
    args = p.parse_args(argv)
    if not 0.0 <= args.feature_dropout < 1.0:
        p.error(f"--feature-dropout must be in [0, 1), got {args.feature_dropout}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from deeprec_ext.sync.keras import KerasStepModel, SyncEmbedding, configure_determinism
    configure_determinism(args.seed)  # before any TF op
    import keras
    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from deeprec_ext.sync import SyncTrainer
    from examples.criteo.model import NUM_CAT, build_deepfm
    from examples.criteo.reader import parse_lines
    from examples.criteo.train import embedding_specs

    specs = embedding_specs(args.lr)

    def factory(name, d):
        init, opt = specs[name]
        return SyncEmbedding(d, table=name, feature="cat", initializer=init, optimizer=opt, name=name)

    model = build_deepfm(embedding_factory=factory, dim=args.dim)
    step_model = KerasStepModel(
        model, lambda y, pred: tf.reduce_mean(keras.losses.binary_crossentropy(y[:, None], pred)),
        dense_optimizer={"name": "adam", "learning_rate": args.lr})
    # the id of an empty value in each column: what a dropped feature becomes
    missing = parse_lines(tf.constant(["\t" * 39]))[0]["cat"].numpy()[0]

    def prepare(lines, rng):
        features, label = parse_lines(tf.constant(lines))
        out = {"dense": features["dense"].numpy(), "cat": features["cat"].numpy()}
        if args.feature_dropout:
            drop = rng.random(out["cat"].shape) < args.feature_dropout
            out["cat"] = np.where(drop, missing[None, :NUM_CAT], out["cat"])
        return out, label.numpy()

    # register only now: the AIMaster's barrier waits for registered workers, so a worker
    # joins once it is ready to train
    ctx = dtf.get_context()
    log.info("worker %s (rank %d) starting, sync mode", ctx.worker_id, ctx.rank)
    trainer = SyncTrainer(ctx, step_model, args.micro_batch, prepare,
                          throttle_seconds=args.throttle_ms / 1000)
    out = trainer.run()
    secs = trainer.stats["step_seconds"]
    ends = trainer.stats["step_ends"]
    if len(ends) > 10:  # steady state: after 5 warm-up steps (tracing, first lookups)
        out["steady_steps_per_second"] = (len(ends) - 6) / (ends[-1] - ends[5])
    out.update(worker=ctx.worker_id, rank=ctx.rank,
               mean_step_seconds=float(np.mean(secs)) if secs else None,
               last_loss=trainer.stats["losses"][-1] if trainer.stats["losses"] else None,
               series=trainer.stats["series"])
    path = args.metrics_out or os.path.join(os.environ.get("DEEPREC_STATE_DIR", "."),
                                            f"metrics-{ctx.worker_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(path + ".tmp", path)
    log.info("done: %s", {k: v for k, v in out.items() if k not in ("checkpoint", "series")})
    ctx.close()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # TensorFlow's teardown can hold the exit for seconds
