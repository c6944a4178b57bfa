"""Durable job state: one JSON document replaced atomically (write temp, fsync, rename)."""
from __future__ import annotations

import json
import os
import threading


class StateStore:
    def __init__(self, state_dir: str, filename: str = "job_state.json"):
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, filename)
        self._lock = threading.Lock()

    def load(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def save(self, state: dict) -> None:
        data = json.dumps(state, sort_keys=True).encode()
        with self._lock:
            tmp = f"{self.path}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)  # make the rename itself durable
            finally:
                os.close(dfd)
