"""Look the next batch's rows up while this step trains, and patch them with this step's push.

A waited step is a chain: the lookup call, the forward and backward pass, the push call.
The PS is idle during the pass and the worker idle during the calls. The input pipeline
already holds the next batch, so its ids are known a step early: ``note_ids`` (a map at
the end of ``shard_dataset``) records the unique ids of every integer feature of each
batch, in order. When a step's lookup of a table is answered, the next batch's ids of the
feature that table reads are sent at once, in the background, and the PS answers them
while this step computes. The step's own push then changes some of those rows: it
returns the rows it leaves for the tables that have a lookup ahead, and the next step
replaces the rows of the ids both batches share with them. A step thus reads exactly
what a waited push followed by a lookup would have read: this worker's own updates are
never missed (``tests/test_lookahead.py`` trains the same rows both ways); other workers'
updates arrive asynchronously, as always.

Nothing here guesses. Which feature a table reads is learned by equality (a table's
unique ids equal, element for element, the noted unique ids of one feature of the batch
being trained); a prefetched answer is used only for exactly the ids it was fetched for,
only if every push this worker sent since it left is accounted for (none, or the one
whose returned rows patch it), and only if its call succeeded. Anything else drops it and
the table is looked up as usual. Waited pushes and pushes left in flight with fresh
lookups (``overlap=True``) are followed: a step whose rows were fetched ahead waits for
the last step's push answer only to patch them. With ``overlap="stale"`` (no rows come
back) or ``"carry"`` (the push rides in the lookup) nothing is fetched ahead.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

ENV = "DEEPREC_LOOKAHEAD"  # "0": never fetch ahead (A/B measurements, debugging)
MAX_NOTED = 16  # batches noted ahead of training; the input pipeline's prefetch is smaller


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a, b)


def enabled_by_env() -> bool:
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV} must be 1/true/yes/on or 0/false/no/off, got "
                     f"{os.environ[ENV]!r}")


def match(prev: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``(dst, src)`` with ``nxt[dst] == prev[src]`` (both unique)."""
    if not prev.size or not nxt.size:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(prev)
    ordered = prev[order]  # a direct binary search: a third faster than through a sorter
    pos = np.searchsorted(ordered, nxt)
    np.minimum(pos, prev.size - 1, out=pos)
    dst = np.flatnonzero(ordered[pos] == nxt)
    return dst, order[pos[dst]]


class _Push:
    """A push this worker sent while a lookup ahead was out: its answer (a Future, done
    once the PS applied it) holds the rows it left in the tables it was asked for."""

    __slots__ = ("answer", "tables")

    def __init__(self, tables=()):
        self.answer: Future = Future()
        self.tables = frozenset(tables)  # the tables it updates


class _Ahead:
    """One lookup sent ahead for a group of tables that read the same feature."""

    __slots__ = ("seq", "tables", "ids", "prev", "future", "pushes", "push", "pushed", "bad")

    def __init__(self, seq: int, tables: tuple, ids: np.ndarray, prev: np.ndarray,
                 future: Future):
        self.seq = seq        # the noted batch it is for
        self.tables = tables
        self.ids = ids        # the next batch's unique ids (the lookup's order)
        self.prev = prev      # this step's unique ids: the order of its push's rows
        self.future = future  # ({table: values}, dst, src)
        self.pushes = 0       # pushes this worker sent since the lookup left
        self.push: _Push | None = None  # the first of them
        self.pushed: set = set()        # the tables it updated
        self.bad = False


class Lookahead:
    def __init__(self, client):
        self.client = client
        self.enabled = enabled_by_env()
        self._lock = threading.Lock()
        self._noted: collections.deque = collections.deque(maxlen=MAX_NOTED)  # (seq, [uniq])
        self._seq = 0
        self._feature: dict[str, int] = {}          # table -> feature index it reads
        self._pending: dict[str, list[_Ahead]] = {}  # table -> lookups sent ahead, oldest first
        self._inflight: list[_Push] = []
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"ahead": 0, "used": 0, "dropped": 0, "patched_rows": 0}

    def fill(self, out) -> None:
        """This worker's counts into a Gazer ``MemberStats`` (its heartbeat)."""
        with self._lock:
            stats = dict(self.stats)
        if stats["ahead"] or stats["dropped"]:
            for k, v in stats.items():
                setattr(out.lookahead, k, v)

    # -- the input pipeline ------------------------------------------------------------
    def note(self, uniqs) -> None:
        """The unique ids of each integer feature of the next batch (input thread)."""
        with self._lock:
            self._seq += 1
            self._noted.append((self._seq, [np.array(u, dtype=np.int64, copy=True)
                                            for u in uniqs]))

    # -- lookups -------------------------------------------------------------------------
    def take(self, table: str, ids: np.ndarray) -> np.ndarray | None:
        """The rows of ``ids`` fetched ahead and patched with this worker's push since,
        or None (look the table up as usual)."""
        with self._lock:
            queue = self._pending.get(table)
            at = next((i for i, a in enumerate(queue) if _same(a.ids, ids)), None) \
                if queue else None
            if at is None:
                return None  # none for this batch (one for the next may be under way)
            ahead = queue[at]
            del queue[:at + 1]  # and those for batches that were never trained
        why, rows = None, None
        if ahead.bad or ahead.pushes > 1:
            why = "pushes not followed"
        elif table in ahead.pushed:
            try:  # the push may still be in flight (overlap mode): its rows are needed
                rows = (ahead.push.answer.result() or {}).get(table)
            except Exception as exc:  # noqa: BLE001 - raised to training by the push itself
                why = f"the push since failed ({exc.__class__.__name__})"
            else:
                if rows is None:
                    why = "push rows missing"
                else:
                    rows = np.asarray(rows).reshape(ahead.prev.size, -1)
        if why is None:
            try:
                values, dst, src = ahead.future.result()
            except Exception as exc:  # noqa: BLE001 - the usual lookup reports it, if lasting
                why = f"its call failed ({exc.__class__.__name__})"
        if why is not None:
            with self._lock:
                self.stats["dropped"] += 1
            log.debug("lookup ahead of %r dropped: %s", table, why)
            return None
        out = values[table]
        if rows is not None and dst.size:
            out[dst] = rows[src]
        with self._lock:
            self.stats["used"] += 1
            self.stats["patched_rows"] += int(dst.size) if rows is not None else 0
        return out

    def advance(self, table: str, ids: np.ndarray, group) -> None:
        """``table`` (and ``group``, the tables looked up with the same ids) was just
        answered for the batch being trained: send the next batch's lookup of its feature."""
        if not self.enabled:
            return
        tables = frozenset((table, *group))
        with self._lock:
            # only pushes of these tables: the step end's dense sync changes no row fetched
            # ahead, and it is answered last
            inflight = [p for p in self._inflight if p.tables & tables]
        for push in inflight:  # the last step's push, in flight in overlap mode: a lookup
            try:               # sent now must read after it (the step waits for it anyway)
                push.answer.result()
            except Exception:  # noqa: BLE001 - raised to training by the push itself; a
                pass           # lookup sent now reads whatever it left, as any lookup
        with self._lock:
            self._inflight = [p for p in self._inflight if not p.answer.done()]
            if any(p.tables & tables for p in self._inflight):
                return
            feature = self._find(table, ids)
            if feature is None:
                return
            if len(self._noted) < 2:
                return  # the input pipeline has not produced the next batch yet
            nseq, nxt = self._noted[1]
            tables = tuple(t for t in dict.fromkeys((table, *group))
                           if self._feature.get(t, feature) == feature)
            if any(a.seq >= nseq for t in tables for a in self._pending.get(t, ())):
                return  # already sent for the next batch (with a companion table)
            nids = nxt[feature]
            prev = np.array(ids, dtype=np.int64, copy=True)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lookahead")
            ahead = _Ahead(nseq, tables, nids, prev,
                           self._pool.submit(self._fetch, tables, nids, prev))
            for t in tables:
                queue = self._pending.setdefault(t, [])
                queue[:] = [a for a in queue if a.seq >= nseq - 1]  # this batch's, if untaken
                queue.append(ahead)
            self.stats["ahead"] += 1

    def _find(self, table: str, ids: np.ndarray) -> int | None:
        """The feature of the noted batch that ``ids`` are; that batch becomes the first
        noted (those before it are forgotten). None: not a noted batch. Lock held."""
        learned = self._feature.get(table)
        for at, (_, uniqs) in enumerate(self._noted):
            cands = (learned,) if learned is not None else range(len(uniqs))
            for f in cands:
                if f < len(uniqs) and _same(uniqs[f], ids):
                    for _ in range(at):
                        self._noted.popleft()
                    self._feature[table] = f
                    return f
        return None

    def _fetch(self, tables: tuple, ids: np.ndarray, prev: np.ndarray):
        values = self.client.lookup_many({t: ids for t in tables}, True, unique=True)
        dst, src = match(prev, ids)
        return values, dst, src

    # -- pushes --------------------------------------------------------------------------
    def before_push(self, batch: dict) -> tuple[_Push, set]:
        """A push of ``batch`` ({table: (unique ids, grads)}) is about to leave: it is
        followed (``answered`` gives its answer), and returns the rows it leaves in the
        tables of the set (a lookup ahead of them left before it)."""
        push = _Push(batch)
        wanted = set()
        with self._lock:
            # answered pushes are forgotten here too: a table never looked up ahead must
            # not keep every step's answer (merged dense values) alive
            self._inflight = [p for p in self._inflight if not p.answer.done()]
            self._inflight.append(push)
            aheads = {id(a): a for queue in self._pending.values() for a in queue}
            for ahead in aheads.values():
                if not any(t in batch for t in ahead.tables):
                    continue  # it changes none of the rows fetched ahead (a dense sync)
                ahead.pushes += 1
                if ahead.pushes > 1:
                    continue  # two pushes to follow: dropped when taken
                ahead.push = push
                for t in ahead.tables:
                    if t not in batch:
                        continue
                    ahead.pushed.add(t)
                    wanted.add(t)
                    if not _same(np.asarray(batch[t][0]).ravel(), ahead.prev):
                        ahead.bad = True  # rows in another order than the lookup's
        return push, wanted

    @staticmethod
    def answered(push: _Push, answer) -> None:
        """The push's answer: a Future (in flight), the values it returned, or the error
        it raised."""
        if isinstance(answer, Future):
            answer.add_done_callback(lambda f: Lookahead._settle(push, f))
        elif isinstance(answer, BaseException):
            push.answer.set_exception(answer)
        else:
            push.answer.set_result(answer)

    @staticmethod
    def _settle(push: _Push, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            push.answer.set_exception(exc)
        else:
            push.answer.set_result(fut.result())

    def forget(self) -> None:
        """Drop every lookup ahead (no rows will come back to patch them with)."""
        with self._lock:
            self._pending.clear()
            self._inflight.clear()

    def close(self) -> None:
        self.forget()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
