"""A TensorFlow worker reading Parquet shards as typed columns
(``shard_dataset(columns=...)``): each row holds an integer ``id`` and a string ``name``
that must equal ``b"n<id>"``; training a row = pushing +1 to that id's counter (SGD,
learning rate 1, gradient -1). Rows whose name does not match are pushed to id -1, so a
test sees any mix-up of columns or rows."""
import os
import sys
import time

import numpy as np

from deeprec_ext.tf.data import shard_dataset
from deeprec_ext.worker import WorkerContext, set_context


def main() -> int:
    batch = int(os.environ.get("COUNTING_BATCH", "100"))
    ctx = WorkerContext()
    set_context(ctx)
    ctx.client.create_table("records", dim=1, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
    ds = shard_dataset(batch, columns=["id", "name"])
    for cols in ds:
        ids = cols["id"].numpy()
        names = cols["name"].numpy()
        ok = np.array([n == b"n%d" % i for i, n in zip(ids, names)], dtype=bool)
        ids = np.where(ok, ids, -1).astype(np.int64)
        ctx.client.push("records", ids, -np.ones((ids.size, 1), np.float32))
        ctx.record_steps(1, ctx.tracker.advance(1))
    hold = os.environ.get("COUNTING_HOLD_FILE")
    while hold and not ctx.stop_requested.is_set() and not os.path.exists(hold):
        time.sleep(0.1)  # keep the job (and its PS) up until the test read the counters
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
