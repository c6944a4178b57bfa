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

``carry=True`` (``ElasticCallback(overlap="carry")``) goes one step further: the step end
sends nothing; its pushes (and dense deltas) ride in the next step's first lookup call,
which the PS applies before it reads (``PSClient.lookup_with_push``), so a step makes one
call per PS. Whatever must not wait for a next lookup (end of training, evaluation, a
flush) calls ``flush``.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
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
        # with pushes in flight (overlap): a step's push leaves, in flight, as soon as
        # every table looked up has pushed (in the backward pass), not at the step's end
        self.early_in_flight = False
        self._lock = threading.Lock()
        self._step = 0
        self._seen: dict[tuple[str, bool], tuple[int, np.ndarray]] = {}
        self._groups: dict[tuple[str, bool], set[str]] = {}
        self._prefetched: dict[tuple[str, bool], tuple[np.ndarray, Future]] = {}
        self._looked_up: set[str] = set()   # tables looked up for training this step
        self._pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.stats = {"lookup_calls": 0, "prefetch_hits": 0, "push_calls": 0}
        # carry mode: the ended step's held push (batch, return tables, Future of their
        # values, the push prepared for the lookup call), and the Future of a lookup call that carries one (later lookups of the
        # step wait for it, so they too read after the push)
        self.carry = False
        self._carry: tuple[dict, list, Future, object] | None = None
        self._carrying: Future | None = None
        self._carry_step = 0
        self.steps_done = 0  # the worker's step count (WorkerContext.step_done)
        # the next batch's rows fetched while this step trains (deeprec_ext.lookahead);
        # followed while pushes come back with the rows they leave (waited, or overlap=True)
        self.lookahead = None
        self.ahead_ok = lambda: True  # pushes come back with rows (not overlap="stale")
        self.served_ahead: set = set()  # tables whose last lookup was fetched ahead

    # -- lookups ---------------------------------------------------------------------
    def lookup(self, table: str, ids: np.ndarray, insert_missing: bool) -> np.ndarray:
        """Values of unique ``ids`` in ``table`` (float32 [n, dim])."""
        self._next_step_if_pushed(table)
        key = (table, insert_missing)
        ahead = self.lookahead if insert_missing and not self.carry and self.ahead_ok() \
            else None
        self.served_ahead.discard(table)
        if ahead is not None:
            values = ahead.take(table, ids)
            if values is not None:
                self.served_ahead.add(table)
                with self._lock:
                    self.stats["ahead_hits"] = self.stats.get("ahead_hits", 0) + 1
                    self._looked_up.add(table)
                    group = sorted(self._groups.get(key, ()))
                ahead.advance(table, ids, group)
                return values
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
        if fut is None and not self.carry:
            values = self.client.lookup(table, ids, insert_missing=insert_missing, unique=True)
            if ahead is not None:
                ahead.advance(table, ids, companions)
            return values
        try:
            out = self._lookup_call({table: ids, **{t: ids for t in companions}},
                                    insert_missing)
        except BaseException as exc:
            if fut is not None:
                fut.set_exception(exc)  # the companions waiting on it fail the same way
            raise
        if fut is not None:
            fut.set_result(out)
        if ahead is not None:
            ahead.advance(table, ids, companions)
        return out[table]

    def _lookup_call(self, requests: dict, insert_missing: bool) -> dict:
        """Carry mode: the held push of the ended step leaves with this lookup (a lookup
        made while another call carries it waits for that call's answer first)."""
        with self._lock:
            carry, self._carry = self._carry, None
            carrying = self._carrying
            if carry is not None:
                self._carrying = carry[2]
                self.stats["carried"] = self.stats.get("carried", 0) + 1
        if carry is None:
            if carrying is not None:
                try:
                    carrying.result()
                except BaseException:  # noqa: BLE001 - that call's own caller raises it
                    pass
            return self.client.lookup_many(requests, insert_missing, unique=True)
        _, _, done, prepared = carry
        try:
            values, pushed = self.client.lookup_with_push(requests, prepared, insert_missing)
        except BaseException as exc:
            done.set_exception(exc)
            raise
        done.set_result(pushed)
        return values

    # -- pushes ----------------------------------------------------------------------
    def _send(self, batch: dict, return_tables=None, wait: bool = True):
        """Send a step's push; it also returns the rows it leaves in the tables looked up
        ahead of it (the lookahead patches the next batch's rows with them)."""
        ahead = self.lookahead
        if ahead is not None and (self.carry or not self.ahead_ok()):
            ahead.forget()  # no rows come back to patch with: nothing is fetched ahead
            ahead = None
        send = self._send_push if wait else partial(self._send_push, wait=False)
        if ahead is None:
            return send(batch, return_tables)
        push, wanted = ahead.before_push(batch)
        extra = wanted - set(return_tables or ())
        try:
            out = send(batch, set(return_tables or ()) | extra or None)
        except BaseException as exc:
            ahead.answered(push, exc)
            raise
        ahead.answered(push, out)
        if wait and extra and out is not None:
            out = {t: v for t, v in out.items() if t not in extra}
        return out  # in flight: a Future whose answer may hold the extra tables too

    def _next_step_if_pushed(self, table: str) -> None:
        """A table that already pushed in this step is looked up or pushed again: a new
        step began without a step end (Keras' ``steps_per_execution`` > 1 runs several
        steps per call and ends them once). The held pushes leave now, before that
        lookup reads their rows, so no step's push replaces another's."""
        with self._lock:
            if table not in self._pending:
                return
        self.flush()  # carry mode: an older held push goes first
        with self._lock:
            batch, self._pending = self._pending, {}
            self._looked_up.clear()
            self._prefetched.clear()
            self._step += 1
            if batch:
                self.stats["push_calls"] += 1
        if batch:
            self._send(batch)

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Queue a push; the step's pushes leave together once every table looked up for
        training this step has pushed (or at ``end_step``)."""
        self._next_step_if_pushed(table)
        with self._lock:
            self._pending[table] = (np.array(ids, copy=True), np.array(grads, copy=True))
            if self.hold_pushes or self.carry or not self._looked_up <= self._pending.keys():
                return
            batch, self._pending = self._pending, {}
            self._looked_up.clear()
            self.stats["push_calls"] += 1
        self._send(batch, wait=not self.early_in_flight)

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
            hold = bool(batch) and self.carry and not (wait and return_tables)
        if hold:  # carried by the next step's lookup; an older one not taken leaves now
            self.flush()
            done: Future = Future()
            # checked and encoded here, in the step end's thread: the lookup op that
            # carries it (on TensorFlow's compute thread) then only sends
            prepared = self.client.prepare_push(batch, return_tables)
            with self._lock:
                self._carry = (batch, list(return_tables or ()), done, prepared)
                self._carry_step = self.steps_done
            return None if wait else done
        if batch:
            return self._send(batch, return_tables, wait=wait)
        return None

    def flush(self, older: bool = False) -> None:
        """Send a held push that no lookup took, and wait for one a lookup carries (carry
        mode; nothing to do otherwise). Re-raises the failure of the call that carried it.
        ``older``: only a push held before the current step (one a whole step went by
        without taking): a step's records count as trained once its push is answered."""
        with self._lock:
            if older and self._carry is not None and self._carry_step >= self.steps_done:
                return
            carry, self._carry = self._carry, None
            carrying, self._carrying = self._carrying, None  # a failure is raised once
        if carry is not None:
            batch, return_tables, done, _ = carry
            try:
                out = self._send_push(batch, return_tables or None)
            except BaseException as exc:
                done.set_exception(exc)
                raise
            done.set_result(out or {})
        elif carrying is not None:
            carrying.result()

    @property
    def groups(self) -> dict[str, list[str]]:
        """Learned groups of tables that share ids (training lookups)."""
        with self._lock:
            return {t: sorted(g) for (t, ins), g in self._groups.items() if ins and g}
