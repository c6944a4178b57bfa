"""Dense variables shared by all workers through the PS.

Each dense variable is a PS table whose keys are its row indices and whose optimizer is
``assign_add``: the worker's own optimizer takes its step locally, and the worker sends the
difference from the value it last pulled. One push per PS returns the merged value (every
worker's deltas), which becomes the local value for the next step. The first worker to
create a variable's table sets its initial value; the others adopt it.
"""
from __future__ import annotations

import numpy as np

DENSE_PREFIX = "dense/"


def dense_layout(shape) -> tuple[int, int]:
    """[rows, dim] a variable of ``shape`` is stored as (rows = first axis)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], int(np.prod(shape[1:]))


class DenseSync:
    """Pull/push of a fixed list of dense variables (values given as numpy arrays)."""

    def __init__(self, client, names: list[str], shapes: list[tuple]):
        self.client = client
        self.names = [DENSE_PREFIX + n for n in names]
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.layouts = [dense_layout(s) for s in self.shapes]
        self.ids = [np.arange(r, dtype=np.int64) for r, _ in self.layouts]
        self.base: list[np.ndarray] | None = None

    def create(self, initial_values: list[np.ndarray]) -> list[np.ndarray]:
        """Create the tables (first creator's values win) and return the shared values."""
        for name, (rows, dim), ids, value in zip(self.names, self.layouts, self.ids, initial_values):
            self.client.create_table(name, dim, initializer="zeros",
                                     optimizer={"name": "assign_add"}, init_ids=ids,
                                     init_values=np.asarray(value, np.float32).reshape(rows, dim))
        return self.pull()

    def pull(self) -> list[np.ndarray]:
        got = self.client.lookup_many(dict(zip(self.names, self.ids)), insert_missing=False)
        self.base = [got[n].reshape(s) for n, s in zip(self.names, self.shapes)]
        return self.base

    def _push(self, updates: dict, return_tables: list[str]) -> dict:
        return self.client.push_many(updates, return_tables=return_tables)

    def start_sync(self, local_values: list[np.ndarray], pool) -> None:
        """Send the deltas in the background (overlapping the next training step)."""
        snapshot = [np.array(v, np.float32, copy=True) for v in local_values]
        self._pending = (snapshot, pool.submit(self.sync, snapshot))

    def start_sync_with(self, local_values: list[np.ndarray], send_async,
                        copy: bool = True) -> None:
        """Like ``start_sync``, but ``send_async(updates, return_tables)`` sends the deltas
        and returns a Future of the PS' answer (the worker's step batcher: the step's
        embedding push and the dense deltas leave in one call that the next step overlaps).
        ``copy=False``: the values are arrays nobody writes (they are kept as sent)."""
        snapshot = [np.array(v, np.float32, copy=True) if copy else v for v in local_values]
        self._pending = (snapshot, send_async(self._deltas(snapshot), self.names), True)

    def take_answer(self) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """The background sync's answer, adopted as the base of the next deltas, and the
        values it was sent from: ``(merged, sent)``; None if no sync is under way. The
        local value becomes ``merged + (local - sent)`` (``finish_sync``)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return None
        snapshot, fut = pending[:2]
        merged = self._adopt(fut.result()) if len(pending) > 2 else fut.result()
        return merged, snapshot

    def finish_sync(self, local_values: list[np.ndarray]) -> list[np.ndarray] | None:
        """Collect a background sync: the merged value plus whatever the local optimizer
        changed since the snapshot was sent (that change is in the next delta), or None."""
        got = self.take_answer()
        if got is None:
            return None
        merged, snapshot = got
        return [m + (np.asarray(v, np.float32) - s) for m, v, s in zip(merged, local_values, snapshot)]

    def _deltas(self, local_values) -> dict:
        updates = {}
        for name, (rows, dim), ids, local, base in zip(self.names, self.layouts, self.ids,
                                                       local_values, self.base):
            delta = (np.asarray(local, np.float32) - base).reshape(rows, dim)
            updates[name] = (ids, delta)
        return updates

    def _adopt(self, answer: dict) -> list[np.ndarray]:
        self.base = [answer[n].reshape(s) for n, s in zip(self.names, self.shapes)]
        return self.base

    def sync(self, local_values: list[np.ndarray], send=None) -> list[np.ndarray]:
        """Send local - base for every variable; returns (and adopts) the merged values.
        ``send(updates, return_tables)`` replaces the push: the worker's step batcher
        uses it to carry the step's embedding gradients in the same call."""
        return self._adopt((send or self._push)(self._deltas(local_values), self.names))
