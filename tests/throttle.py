"""Throttle a process to a fraction of a core: a SIGSTOP/SIGCONT duty cycle (the test and
benchmark stand-in for a noisy neighbour or a slow node)."""
from __future__ import annotations

import os
import signal
import threading
import time


class Throttle:
    """Runs ``pid`` for ``share`` of every ``period`` seconds, stopped the rest, until
    ``stop()`` (which always leaves it running) or until it exits."""

    def __init__(self, pid: int, share: float = 0.3, period: float = 0.1):
        self.pid, self.share, self.period = pid, share, period
        self.started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"throttle-{pid}")

    def start(self) -> "Throttle":
        self.started = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                if self._stop.wait(self.period * (1 - self.share)):
                    break
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait(self.period * self.share)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> "Throttle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
