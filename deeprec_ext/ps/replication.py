"""Peer replication: each PS keeps its ring peer's copy of its rows current.

The primary ships "rows changed since the last shipped sequence number" plus tombstones,
read with the same per-row sequence numbers that serve migration and incremental
checkpoints. Asynchronously every ``interval_ms`` (the updates at risk if this PS dies are
those of the last interval), or synchronously: a push is answered only after the peer
has the rows it changed. A new peer first gets a full copy (``reset``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque

import grpc
import numpy as np

from deeprec_ext import codec
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from deeprec_ext.store import EmbeddingStore

log = logging.getLogger(__name__)

CHUNK_ROWS = 1 << 16


def table_config(store_configs: dict, name: str, table) -> ps_pb2.TableConfig:
    return store_configs.get(name) or ps_pb2.TableConfig(
        name=name, dim=table.dim, initializer_json=json.dumps(table.initializer.config),
        optimizer_json=json.dumps(table.optimizer.config))


class AppliedRequests:
    """Ids of recently applied pushes (bounded), plus a log of ids not yet replicated."""

    def __init__(self, capacity: int = 200_000):
        self._lock = threading.Lock()
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._unshipped: deque[str] = deque(maxlen=capacity)

    def seen(self, rid: str) -> bool:
        with self._lock:
            return rid in self._ids

    def add(self, rid: str, ship: bool = True) -> None:
        if not rid:
            return
        with self._lock:
            self._ids[rid] = None
            if ship:
                self._unshipped.append(rid)
            while len(self._ids) > self._capacity:  # forget the oldest, O(1) each
                self._ids.popitem(last=False)

    def take_unshipped(self) -> list[str]:
        with self._lock:
            out = list(self._unshipped)
            self._unshipped.clear()
            return out

    def requeue(self, rids: list[str]) -> None:
        """Ids taken for a shipment that failed: they go out with the next one."""
        with self._lock:
            self._unshipped.extendleft(reversed(rids))

    def snapshot(self) -> list[str]:
        """Every remembered id, oldest first (for a new peer or a slot's new owner)."""
        with self._lock:
            return list(self._ids)


class Replicator:
    """Primary side: ships this PS's changes to its peer."""

    def __init__(self, store: EmbeddingStore, configs: dict, applied: AppliedRequests | None = None):
        self.store = store
        self.configs = configs
        self.applied = applied or AppliedRequests()
        self.origin = ""
        self.peer = ""
        self.interval = 0.2
        self.sync = False
        self._since = -1  # -1: the peer has nothing yet (full copy next)
        self._lock = threading.Lock()  # one shipment at a time, in sequence order
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stub = None
        self._channel = None
        self.last_shipped = 0.0
        self.shipped_rows = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="replication", daemon=True)
        self._thread.start()

    def configure(self, origin: str, peer: str, interval_ms: float, sync: bool) -> None:
        with self._lock:
            if peer != self.peer:
                if self._channel is not None:
                    self._channel.close()
                self._channel = insecure_channel(peer) if peer else None
                self._stub = ps_pb2_grpc.ParameterServerStub(self._channel) if peer else None
                self._since = -1  # new peer: full copy
                log.info("%s: replicating to %s", origin, peer or "(no peer)")
            self.origin, self.peer = origin, peer
            self.interval = max(interval_ms, 1.0) / 1000.0
            self.sync = sync
        self._wake.set()

    def _batches(self, since: int):
        """Changed rows since ``since``; ``since < 0``: a full copy, in slices, whose first
        batch tells the peer to drop what it held of this origin."""
        if since < 0:
            yield ps_pb2.RowBatch(origin=self.origin, reset=True)
        everything = np.ones(1, dtype=bool)  # with one slot every key maps to slot 0
        for name, table in sorted(self.store.tables().items()):
            cfg = table_config(self.configs, name, table)
            if since < 0:
                row = 0
                yield ps_pb2.RowBatch(config=cfg, origin=self.origin)  # creates empty tables too
                while row is not None:
                    keys, rows, _, row = table.export_slots(everything, None, row, CHUNK_ROWS,
                                                                with_counts=True)
                    if keys.size:
                        yield ps_pb2.RowBatch(config=cfg, origin=self.origin,
                                              ids=codec.ids_to_bytes(keys),
                                              rows=codec.floats_to_bytes(rows))
                continue
            deleted = table.tombstones_since(since)
            keys, rows, _ = table.export_rows(since, with_counts=True)
            if keys.size or deleted.size:
                yield ps_pb2.RowBatch(config=cfg, origin=self.origin, ids=codec.ids_to_bytes(keys),
                                      rows=codec.floats_to_bytes(rows),
                                      deleted_ids=codec.ids_to_bytes(deleted))

    def ship(self, timeout: float = 60.0) -> int:
        """Send everything changed since the last shipment; returns rows sent."""
        with self._lock:
            if self._stub is None:
                return 0
            # request ids first: every push they name is applied by the watermark below. A
            # new peer (full copy) learns every remembered id, not only the unshipped ones:
            # a push resent to it after a failover must be recognised
            applied = self.applied.take_unshipped()
            full = self._since < 0
            if full:
                applied = self.applied.snapshot()
            watermark = self.store.sequence.value
            if watermark == self._since and not applied:
                self.last_shipped = time.monotonic()
                return 0
            batches = list(self._batches(self._since)) or [ps_pb2.RowBatch(origin=self.origin)]
            for b in batches:
                b.origin_sequence = watermark
            batches[-1].applied_request_ids.extend(applied)
            try:
                resp = self._stub.Replicate(iter(batches), timeout=timeout)
            except Exception:
                if not full:  # (a full copy is sent again whole, ids included)
                    self.applied.requeue(applied)
                raise
            self._since = watermark
            self.last_shipped = time.monotonic()
            self.shipped_rows += resp.rows
            return resp.rows

    def ship_rows(self, table_name: str, keys: np.ndarray, request_id: str = "") -> None:
        """Synchronous mode: send the current rows of ``keys`` (just pushed) now."""
        with self._lock:
            if self._stub is None:
                return
            if self._since < 0:  # the peer has no base copy yet: send everything
                self._lock.release()
                try:
                    self.ship()
                finally:
                    self._lock.acquire()
                return
            table = self.store.get(table_name)
            found, rows = table.export_keys(keys, with_counts=True)
            self._stub.Replicate(iter([ps_pb2.RowBatch(
                config=table_config(self.configs, table_name, table), origin=self.origin,
                ids=codec.ids_to_bytes(found), rows=codec.floats_to_bytes(rows),
                origin_sequence=self.store.sequence.value,
                applied_request_ids=[request_id] if request_id else [])]), timeout=60)

    def lag(self) -> dict:
        """Gazer: how far the peer's copy trails this PS (sequence numbers not yet shipped,
        time since the last shipment)."""
        since = self._since
        behind = self.store.sequence.value - since if since >= 0 else self.store.sequence.value
        return {"peer": self.peer, "behind_sequence": max(behind, 0) if self.peer else 0,
                "since_ship_ms": (time.monotonic() - self.last_shipped) * 1000
                if self.peer and self.last_shipped else 0.0,
                "shipped_rows": self.shipped_rows, "errors": self.errors}

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.ship()
            except grpc.RpcError as exc:
                self.errors += 1
                log.warning("replication to %s failed: %s", self.peer, exc.code().name)
                with self._lock:
                    self._since = -1  # resend everything once the peer is reachable

    def close(self) -> None:
        """Stop shipping and cancel any stream in flight: two PS stopping together would
        otherwise each wait at exit for a handler serving the other's stream."""
        self._stop.set()
        self._wake.set()
        got = self._lock.acquire(timeout=1)  # a shipment may be stuck: close under it anyway
        try:
            if self._channel is not None:
                self._channel.close()
            self._stub = None
        finally:
            if got:
                self._lock.release()


class ReplicaSet:
    """Peer side: copies of other PS's rows, one store per origin PS."""

    def __init__(self):
        self._lock = threading.Lock()
        self.stores: dict[str, EmbeddingStore] = {}
        self.sequence: dict[str, int] = {}
        self.updated: dict[str, float] = {}
        self.applied: dict[str, list[str]] = {}
        self.complete: dict[str, bool] = {}  # False while a full copy is still streaming in

    def apply(self, batches) -> int:
        n = 0
        reset_origin = None
        for b in batches:
            if b.reset:
                reset_origin = b.origin
                with self._lock:
                    self.complete[b.origin] = False
            with self._lock:
                if b.reset or b.origin not in self.stores:
                    self.stores[b.origin] = EmbeddingStore()
                    if b.reset:
                        self.applied[b.origin] = []
                store = self.stores[b.origin]
                if b.applied_request_ids:
                    ids_log = self.applied.setdefault(b.origin, [])
                    ids_log.extend(b.applied_request_ids)
                    del ids_log[:-200_000]
            if b.config.name:
                init = json.loads(b.config.initializer_json) if b.config.initializer_json else "zeros"
                opt = json.loads(b.config.optimizer_json) if b.config.optimizer_json else "sgd"
                table = store.ensure_table(b.config.name, b.config.dim, init, opt)
                deleted = codec.ids_from_bytes(b.deleted_ids, "deleted_ids")
                if deleted.size:
                    table.delete(deleted)
                ids = codec.ids_from_bytes(b.ids)
                if ids.size:
                    table.import_rows(ids, codec.rows_from_bytes(b.rows, ids.size, table.row_width))
                    n += int(ids.size)
            with self._lock:
                self.sequence[b.origin] = max(self.sequence.get(b.origin, 0), b.origin_sequence)
                self.updated[b.origin] = time.monotonic()
        if reset_origin is not None:  # the whole stream arrived: the copy is usable
            with self._lock:
                self.complete[reset_origin] = True
        return n

    def is_complete(self, origin: str) -> bool:
        with self._lock:
            return self.complete.get(origin, False)

    def take_applied(self, origin: str) -> list[str]:
        with self._lock:
            return self.applied.pop(origin, [])

    def take(self, origin: str) -> EmbeddingStore | None:
        with self._lock:
            return self.stores.pop(origin, None)
