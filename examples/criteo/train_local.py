"""The same DeepFM trained the ordinary way: one process, local keras Embedding.

The reference that elastic PS training is compared against (AUC and throughput):
    python -m examples.criteo.train_local --train 'runs/criteo-data/train-*.txt' --test runs/criteo-data/test.txt
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from examples.criteo.model import build_deepfm  # noqa: E402
from examples.criteo.reader import criteo_dataset  # noqa: E402
from examples.criteo.train import auc  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", required=True, help="glob of training files")
    p.add_argument("--test", default="")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--vocab-size", type=int, default=2 ** 20)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=None, help="seed Keras' initializers")
    p.add_argument("--metrics-out", default="")
    args = p.parse_args(argv)
    files = sorted(glob.glob(args.train))
    if not files:
        raise SystemExit(f"--train {args.train!r} matches no file")
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    model = build_deepfm(dim=args.dim, vocab_size=args.vocab_size)
    model.compile(optimizer=keras.optimizers.Adam(args.lr), loss="binary_crossentropy")
    ds = criteo_dataset(files, args.batch_size, vocab_size=args.vocab_size)
    start = time.monotonic()
    model.fit(ds, epochs=args.epochs, verbose=2)
    out = {"train_seconds": time.monotonic() - start}
    if args.test:
        labels, scores = [], []
        for features, label in criteo_dataset([args.test], 4096, vocab_size=args.vocab_size):
            scores.append(model(features, training=False).numpy().ravel())
            labels.append(label.numpy())
        out["auc"] = auc(np.concatenate(labels), np.concatenate(scores))
    print(json.dumps(out))
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
