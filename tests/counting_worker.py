"""A worker without TensorFlow for exactness tests: each record of its shards is an
integer id; training a record = pushing +1 to that id's row of a counter table (SGD,
learning rate 1, gradient -1). Run by the AIMaster like any worker command."""
import os
import sys
import time

import numpy as np

from deeprec_ext.worker import WorkerContext, shard_batches


def main() -> int:
    delay = float(os.environ.get("COUNTING_DELAY", "0.01"))
    batch = int(os.environ.get("COUNTING_BATCH", "50"))
    ctx = WorkerContext()
    ctx.client.create_table("records", dim=1, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
    pace = os.environ.get("COUNTING_DELAY_FILE")  # the test sets the pace while it runs
    # COUNTING_CARRY=1: train as ElasticCallback(overlap="carry") does: each step looks its
    # ids up, its push is held and rides in the next step's lookup call, and a step's
    # records count as trained once that push was answered (WorkerContext.step_done)
    carry = os.environ.get("COUNTING_CARRY") == "1"
    ctx.batcher.carry = carry
    for lines in shard_batches(ctx, batch):
        ids = np.array([int(x) for x in lines], dtype=np.int64)
        if carry:
            uniq, counts = np.unique(ids, return_counts=True)
            ctx.lookup("records", uniq)
            ctx.push_async("records", uniq, -counts.astype(np.float32)[:, None])
            ctx.step_done(1)
        else:
            ctx.client.push("records", ids, -np.ones((ids.size, 1), np.float32))
            ctx.record_steps(1, ctx.tracker.advance(1))
        if pace:
            try:
                with open(pace) as f:
                    delay = float(f.read() or delay)
            except (OSError, ValueError):
                pass
        time.sleep(delay)
    hold = os.environ.get("COUNTING_HOLD_FILE")
    while hold and not ctx.stop_requested.is_set() and not os.path.exists(hold):
        time.sleep(0.1)  # keep the job (and its PS) up until the test read the counters
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
