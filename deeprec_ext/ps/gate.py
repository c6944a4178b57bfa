"""A shared/exclusive gate for the PS's data plane (routing fences, replication cuts)."""
from __future__ import annotations

import threading
from contextlib import contextmanager


class ReadWriteGate:
    """Many holders at once (shared), or one (exclusive); writer-preferring: a waiting
    exclusive holder holds back new shared ones, so it waits only for those inside.

    Routing: a request checks slot ownership and applies its update under the shared
    side, so when a fence takes the exclusive side no request that passed the old
    ownership check is still writing. Replication (``ApplyGate``): pushes apply rows and
    record their id under the shared side, a shipment reads rows and ids under the
    exclusive side, so what it sends is one consistent cut.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_shared(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_shared(self):
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_exclusive(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True

    def release_exclusive(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    @contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextmanager
    def exclusive(self):
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()
