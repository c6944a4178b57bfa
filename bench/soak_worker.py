"""The soak's worker (bench/soak.py): a counting model with a push ledger.

Each record of its shards is an integer id; training a record pushes +1 to that id's row
of the ``records`` table (SGD, learning rate 1, gradient -1), like tests/counting_worker.py.
Around every push it appends to its own ledger file (one per process, O_APPEND, one
``write`` per line, so a ``kill -9`` leaves whole lines):

    I <seq> <unix time> <a>-<b>,<c>-<d>   about to push ids [a, b) and [c, d)
    A <seq> <unix time>                   that push was acknowledged
    E <seq> <unix time>                   the process ends cleanly (it left or finished)

so the soak knows, per record, which pushes were acknowledged (they must be in the
table) and which were in flight when a process died (they may or may not be).

Environment (set by the soak in the job file's ``worker.env``):
  SOAK_LEDGER_DIR  where ledger files go: ``<AIMaster pid>-<member id>-<pid>.ledger``
  SOAK_PACE_FILE   a file holding the sleep (seconds) after each batch; re-read every 0.5 s
  SOAK_BATCH       records per push (default 100)
  SOAK_RELEASE     once every shard is DONE, hold (keeping the job and its PS up) until
                   this file exists, so the soak can read the final tables
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from deeprec_ext.worker import get_context, shard_batches


def id_ranges(ids: np.ndarray) -> str:
    """``a-b,c-d``: the half-open runs of consecutive ids (a batch is one or two runs)."""
    if ids.size == 0:
        return ""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    return ",".join(f"{ids[s]}-{ids[e - 1] + 1}" for s, e in zip(starts, ends))


class Pace:
    def __init__(self, path: str | None):
        self.path, self.value, self.read_at = path, 0.0, 0.0

    def __call__(self) -> float:
        now = time.monotonic()
        if self.path and now - self.read_at > 0.5:
            self.read_at = now
            try:
                with open(self.path) as f:
                    self.value = max(0.0, float(f.read().strip() or 0))
            except (OSError, ValueError):
                pass
        return self.value


def main() -> int:
    ledger_dir = os.environ["SOAK_LEDGER_DIR"]
    batch = int(os.environ.get("SOAK_BATCH", "100"))
    release = os.environ.get("SOAK_RELEASE")
    pace = Pace(os.environ.get("SOAK_PACE_FILE"))
    ctx = get_context()  # SIGTERM: leave at the next step; parent gone: exit at once
    name = f"{os.environ.get('DEEPREC_PARENT_PID', '0')}-{ctx.worker_id}-{os.getpid()}.ledger"
    fd = os.open(os.path.join(ledger_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ctx.client.create_table("records", dim=1, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
    seq = 0
    for lines in shard_batches(ctx, batch):
        ids = np.array([int(x) for x in lines], dtype=np.int64)
        delay = pace()  # the step's "compute", while the shard is held
        if delay:
            time.sleep(delay)
        os.write(fd, f"I {seq} {time.time():.6f} {id_ranges(ids)}\n".encode())
        ctx.client.push("records", ids, -np.ones((ids.size, 1), np.float32))
        os.write(fd, f"A {seq} {time.time():.6f}\n".encode())
        seq += 1
        ctx.record_steps(1, ctx.tracker.advance(1))  # reports shards DONE after the ack
    while release and not ctx.stop_requested.is_set() and not os.path.exists(release):
        time.sleep(0.1)
    ctx.close()
    os.write(fd, f"E {seq} {time.time():.6f}\n".encode())
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
