"""The operation runner: the AIMaster's changes to the PS fleet run one at a time.

Publish (the first routing), rescale, rebalance, recover and checkpoint each move or copy
table rows; two of them interleaved could lose rows (a checkpoint of a layout that is being
replaced, a recovery racing a migration). They run on one thread, in a defined order:

    RECOVER  <  PUBLISH  <  CHECKPOINT  <  RESCALE (and rebalance)      (lower runs first)

- within a priority, first come first served;
- a recovery pre-empts a running checkpoint (its ``cancel`` event is set; the checkpoint
  stops before it commits, raising :class:`Preempted`) and goes before any pending
  rescale or checkpoint;
- an operation with the same key as one pending or running is refused with :class:`Busy`
  (two scale requests do not queue up behind each other; a second recovery of the same
  PS is the same recovery).

Lifecycle of one operation: PENDING -> RUNNING -> DONE | FAILED | CANCELLED (stopped
before it ran, when the runner shuts down).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

from aimaster.errors import Busy, NotRunning, OperationRefused

log = logging.getLogger("aimaster.operations")


class OpKind(IntEnum):
    """Operation kinds; the value is the priority (lower runs first)."""
    RECOVER = 0
    PUBLISH = 1
    CHECKPOINT = 2
    RESCALE = 3      # a rebalance too (key "rebalance")


_NAMES = {OpKind.RECOVER: "recover", OpKind.PUBLISH: "publish", OpKind.CHECKPOINT: "checkpoint",
          OpKind.RESCALE: "rescale"}
_LABELS = {"rescale": "scale event", "publish": "routing publish"}  # how users name them


@dataclass(order=True)
class Operation:
    priority: int
    seq: int
    key: str = field(compare=False)
    kind: OpKind = field(compare=False)
    fn: Callable[[threading.Event], object] = field(compare=False)
    future: Future = field(compare=False, default_factory=Future)
    cancel: threading.Event = field(compare=False, default_factory=threading.Event)


class OperationRunner:
    def __init__(self, name: str = "operations"):
        self._heap: list[Operation] = []
        self._keys: set[str] = set()  # pending or running
        self._running: Operation | None = None
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def submit(self, kind: OpKind, fn: Callable[[threading.Event], object],
               key: str | None = None) -> Future:
        """Queue ``fn(cancel_event)``; returns a Future of its result. Raises Busy when an
        operation with the same ``key`` (default: the kind) is pending or running."""
        key = key or _NAMES.get(kind, kind.name.lower())
        with self._cond:
            if self._closed:
                raise NotRunning("the job is shutting down")
            if key in self._keys:
                what = "in progress" if self._running is not None and self._running.key == key \
                    else "queued"
                raise Busy(f"another {_LABELS.get(key, key)} is {what}; try again when it is done")
            op = Operation(int(kind), next(self._seq), key, kind, fn)
            heapq.heappush(self._heap, op)
            self._keys.add(key)
            running = self._running
            if kind == OpKind.RECOVER and running is not None and \
                    running.kind == OpKind.CHECKPOINT:
                log.warning("recovery (%s) pre-empts the running checkpoint", key)
                running.cancel.set()
            self._cond.notify_all()
        return op.future

    def run(self, kind: OpKind, fn: Callable[[threading.Event], object], key: str | None = None,
            timeout: float | None = None, waiter: Callable[[Future, float | None], object] | None = None):
        """``submit`` and wait for the result (re-raising the operation's exception)."""
        fut = self.submit(kind, fn, key)
        return waiter(fut, timeout) if waiter else fut.result(timeout)

    def running(self) -> str | None:
        with self._cond:
            return self._running.key if self._running else None

    def pending(self) -> list[str]:
        with self._cond:
            return [op.key for op in sorted(self._heap)]

    def idle(self) -> bool:
        with self._cond:
            return self._running is None and not self._heap

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return  # closed and drained
                op = heapq.heappop(self._heap)
                self._running = op
            if op.future.set_running_or_notify_cancel():
                try:
                    op.future.set_result(op.fn(op.cancel))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    if not isinstance(exc, OperationRefused):  # the caller's answer
                        log.exception("operation %s failed", op.key)
                    op.future.set_exception(exc)
            with self._cond:
                self._running = None
                self._keys.discard(op.key)
                self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new operations, cancel the pending ones, ask the running one to stop, and
        wait up to ``timeout`` for it. Returns True if the runner ended in time."""
        with self._cond:
            self._closed = True
            for op in self._heap:
                op.cancel.set()
                if op.future.cancel():
                    self._keys.discard(op.key)
            self._heap = [op for op in self._heap if not op.future.cancelled()]
            heapq.heapify(self._heap)
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
