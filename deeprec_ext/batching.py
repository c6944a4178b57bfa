"""One step's PS calls, grouped: one lookup RPC and one push RPC per PS per step.

Models look several tables up with the same ids (DeepFM: the embedding and the linear
weights of every categorical column). Each layer's op calls the PS on its own, so a step
would cost one lookup and one push per table per PS. ``StepBatcher`` learns which tables
are looked up with identical ids, fetches them together with the first of them (the others
wait on that call instead of making their own), and holds a step's pushes until every
table looked up for training in that step has pushed, then sends them in one call.

Nothing here guesses: a prefetched result is used only if the ids are equal, element for
element, to the ids it was fetched for; otherwise the table is looked up on its own and
stops being prefetched. Held pushes are sent at the latest when the step ends.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a, b)


class StepBatcher:
    def __init__(self, client, send_push: Callable[..., dict | None]):
        """``send_push({table: (ids, grads)}, return_tables=None)`` pushes one step's
        updates (unique ids) and returns the values of ``return_tables`` after them."""
        self.client = client
        self._send_push = send_push
        # hold every push until end_step, which may add the dense sync to the same call
        self.hold_pushes = False
        self._lock = threading.Lock()
        self._step = 0
        self._seen: dict[tuple[str, bool], tuple[int, np.ndarray]] = {}
        self._groups: dict[tuple[str, bool], set[str]] = {}
        self._prefetched: dict[tuple[str, bool], tuple[np.ndarray, Future]] = {}
        self._looked_up: set[str] = set()   # tables looked up for training this step
        self._pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.stats = {"lookup_calls": 0, "prefetch_hits": 0, "push_calls": 0}

    # -- lookups ---------------------------------------------------------------------
    def lookup(self, table: str, ids: np.ndarray, insert_missing: bool) -> np.ndarray:
        """Values of unique ``ids`` in ``table`` (float32 [n, dim])."""
        key = (table, insert_missing)
        with self._lock:
            entry = self._prefetched.pop(key, None)
        if entry is not None:
            if _same(entry[0], ids):
                values = entry[1].result()[table]
                with self._lock:
                    self.stats["prefetch_hits"] += 1
                    if insert_missing:
                        self._looked_up.add(table)
                return values
            with self._lock:  # ids diverged: this table no longer travels with the others
                self._groups.pop(key, None)
                for group in self._groups.values():
                    group.discard(table)
        ids = np.array(ids, copy=True)  # numpy_function inputs may alias TF buffers
        with self._lock:
            if insert_missing:
                self._looked_up.add(table)
            for (other, ins), (step, seen) in self._seen.items():
                if ins == insert_missing and other != table and step == self._step \
                        and _same(seen, ids):
                    self._groups.setdefault((other, ins), set()).add(table)
                    self._groups.setdefault(key, set()).add(other)
            self._seen[key] = (self._step, ids)
            companions = sorted(self._groups.get(key, ()))
            fut: Future | None = None
            if companions:
                fut = Future()
                for other in companions:
                    self._prefetched[(other, insert_missing)] = (ids, fut)
            self.stats["lookup_calls"] += 1
        if fut is None:
            return self.client.lookup(table, ids, insert_missing=insert_missing, unique=True)
        try:
            out = self.client.lookup_many({table: ids, **{t: ids for t in companions}},
                                          insert_missing, unique=True)
        except BaseException as exc:
            fut.set_exception(exc)  # the companions waiting on it fail the same way
            raise
        fut.set_result(out)
        return out[table]

    # -- pushes ----------------------------------------------------------------------
    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Queue a push; the step's pushes leave together once every table looked up for
        training this step has pushed (or at ``end_step``)."""
        with self._lock:
            self._pending[table] = (np.array(ids, copy=True), np.array(grads, copy=True))
            if self.hold_pushes or not self._looked_up <= self._pending.keys():
                return
            batch, self._pending = self._pending, {}
            self._looked_up.clear()
            self.stats["push_calls"] += 1
        self._send_push(batch)

    def end_step(self, extra: dict | None = None, return_tables=None, wait: bool = True):
        """The step is over: send what it still holds, plus ``extra`` updates, in one call;
        returns the values of ``return_tables`` after it (``wait=False``: a Future of them,
        the call left in flight). Forgets the step's prefetches."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._looked_up.clear()
            self._prefetched.clear()
            self._step += 1
            batch.update(extra or {})
            if batch:
                self.stats["push_calls"] += 1
        if batch:
            if not wait:
                return self._send_push(batch, return_tables, wait=False)
            return self._send_push(batch, return_tables)
        return None

    @property
    def groups(self) -> dict[str, list[str]]:
        """Learned groups of tables that share ids (training lookups)."""
        with self._lock:
            return {t: sorted(g) for (t, ins), g in self._groups.items() if ins and g}
