"""Peer replication: each PS keeps its ring peer's copy of its rows current.

The primary ships "rows changed since the last shipped sequence number" plus tombstones,
read with the same per-row sequence numbers (and change log) that serve migration and
incremental checkpoints. Asynchronously every ``interval_ms`` (the updates at risk if this
PS dies are those of the last interval), or synchronously: a push is answered only after
the peer has the rows it changed.

Streams (``Replicate``; the kind travels in the call's metadata, ``x-replica-kind``):

* ``full-new`` / ``full-refresh``: a full copy, streamed in slices of the arena (bounded
  memory on both sides), then a catch-up tail (rows and tombstones since the copy began)
  and every remembered request id. The peer builds it into a separate store and swaps it
  in only once the whole stream arrived, so a copy is never half-built where ``Promote``
  can see it. ``new`` (a new peer) drops the peer's earlier copy at once: it is stale.
  ``refresh`` (the same peer, whose copy fell behind the tombstone log) keeps it usable
  until the new one is complete.
* ``delta`` (``x-replica-base``: the sequence number the delta starts from): the peer
  buffers the stream and applies it whole, under the copy's lock, or not at all; it
  refuses a delta whose base it does not hold (FAILED_PRECONDITION: the primary then
  sends a full copy).
* ``rows``: a synchronous push's rows, all tables and the push's request id in one
  stream, applied whole.
* ``drop``: the primary replicates to another peer now; this copy is no longer kept
  current, so it is dropped (it must never be promoted).

Rows and request ids always match: a push applies its rows and records its request id
under the shared side of the primary's apply gate, and a shipment reads the rows and ids
it sends under the exclusive side (briefly: a delta costs the rows changed since the last
one). So a peer that holds a push's rows knows its id, and the other way round, and a push
resent after a failover applies exactly once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

import grpc
import numpy as np

from deeprec_ext import codec, rowwire, table_spec
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.hashing import DEFAULT_NUM_SLOTS, slot_of
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from deeprec_ext.ps import validation
from deeprec_ext.ps.gate import ReadWriteGate
from deeprec_ext.store import EmbeddingStore, LogTrimmed

log = logging.getLogger(__name__)

CHUNK_ROWS = 1 << 14  # rows per message of a full copy or a delta (~2 MB at dim 16, Adagrad)
DELTA_MAX_ROWS = 1 << 18  # a delta with more changed rows is sent as a (streamed) full copy
REQUEST_ID_WINDOW = 200_000
KIND_KEY = "x-replica-kind"
BASE_KEY = "x-replica-base"
GATED_MAX_ROWS = 1 << 13  # at most about this many changed rows are read under the apply gate
UNGATED_ROUNDS = 3  # ...after up to this many rounds read outside it while deltas are larger
FULL_TIMEOUT = 3600.0       # a full copy of a large table takes a while
PROMOTE_WAIT_SECONDS = 60.0  # Promote waits this long for a copy still streaming in
REPLICATE = "/deeprec_ext.ps.ParameterServer/Replicate"
# tombstones a replica deletes per table-lock hold, yielding the interpreter in between: a
# migration's clean-up ships every moved key (666k at 4M rows) in one delta, and deleting
# them in one pass held the GIL for tens of ms on a PS that is also serving training
APPLY_DELETE_CHUNK = 1 << 14
MAX_ANNOUNCED_ROWS = 1 << 24  # a full copy's announced rows are a sizing hint, capped


class _Pending:
    """One ``RowBatch`` to be written as wire bytes (:mod:`deeprec_ext.rowwire`): rows in
    the store's layout with their counts apart, no generated message and no copy of the
    exported arrays until the one join into the message."""

    __slots__ = ("name", "config", "ids", "rows", "counts", "deleted", "total_rows")

    def __init__(self, name: str, config: bytes, ids=None, rows=None, counts=None,
                 deleted=None, total_rows: int = 0):
        self.name, self.config = name, config
        self.ids = np.empty(0, np.int64) if ids is None else ids
        self.rows, self.counts, self.deleted, self.total_rows = rows, counts, deleted, total_rows

    def encode(self, origin: str, **extra) -> bytes:
        return rowwire.encode(self.config, self.ids, self.rows, self.counts, self.deleted,
                              total_rows=self.total_rows, origin=origin, **extra)


class _ReplicaStub:
    """``Replicate`` over a channel, sending wire bytes as they are (rowwire) and generated
    messages serialized (drops, synchronous pushes)."""

    def __init__(self, channel):
        self._call = channel.stream_unary(
            REPLICATE, request_serializer=_to_wire,
            response_deserializer=ps_pb2.ReplicateResponse.FromString)

    def Replicate(self, batches, timeout=None, metadata=()):  # noqa: N802 - gRPC's name
        return self._call(batches, timeout=timeout, metadata=metadata)


def _to_wire(b) -> bytes:
    return b if isinstance(b, (bytes, bytearray)) else b.SerializeToString()


def table_config(store_configs: dict, name: str, table) -> ps_pb2.TableConfig:
    """The config a table was created with, else its resolved spec."""
    return store_configs.get(name) or table_spec.of_table(table)


class ApplyGate(ReadWriteGate):
    """Writers that record request ids (pushes, promotions) hold the shared side while they
    apply rows and record the id; a shipment holds the exclusive side while it reads rows
    and ids, so what it sends is one consistent cut."""


class IdWindow(OrderedDict):
    """The last ``capacity`` distinct request ids, oldest first: a PS's own window
    (``AppliedRequests``), and a replica copy's. The copy keeps it as a dict while
    deltas arrive (each shipment's few ids), so a promotion adopts it as it is
    (``AppliedRequests.adopt``) instead of recording a full window one id at a time
    (250-350 ms for 200k ids, inside the recovery)."""

    def __init__(self, ids=(), capacity: int = REQUEST_ID_WINDOW):
        super().__init__()
        self.capacity = capacity
        self.extend(ids)

    def extend(self, ids) -> None:
        for rid in ids:
            if rid:
                self[rid] = None
        while len(self) > self.capacity:
            self.popitem(last=False)


class AppliedRequests:
    """Ids of recently applied pushes (bounded), plus, per replication stream (a cursor:
    the peer's, and a future peer's while one is prepared), a log of ids not yet shipped.

    A promotion adopts the dead PS's window whole (``adopt``): it is checked beside this
    PS's own ids until as many newer ids were recorded here as the window holds (it
    would have been forgotten by then), and each stream ships it with its next ids."""

    MAIN = "replica"
    MAX_ADOPTED = 4  # windows adopted and still remembered; the oldest goes first

    def __init__(self, capacity: int = REQUEST_ID_WINDOW):
        self._lock = threading.Lock()
        self._ids = IdWindow(capacity=capacity)
        self._capacity = capacity
        self._unshipped: dict[str, deque[str]] = {self.MAIN: deque(maxlen=capacity)}
        # unshipped ids were lost: that stream's next shipment is a full copy
        self._overflowed: dict[str, bool] = {self.MAIN: False}
        self._recorded = 0  # ids recorded in this PS's own window so far
        # adopted windows, oldest first: (ids, ``_recorded`` when adopted)
        self._adopted: list[tuple[dict, int]] = []
        self._unshipped_adopted: dict[str, list[dict]] = {self.MAIN: []}

    def seen(self, rid: str) -> bool:
        with self._lock:
            if rid in self._ids:
                return True
            if self._adopted:
                self._expire_adopted()
                return any(rid in ids for ids, _ in self._adopted)
            return False

    @property
    def capacity(self) -> int:
        return self._capacity

    def adopt(self, ids: dict, ship: bool = True) -> None:
        """Remember every id of ``ids`` (a dict or set, kept as it is: not changed after
        this), and with ``ship`` send them on every stream with its next ids."""
        if not ids:
            return
        with self._lock:
            self._adopted.append((ids, self._recorded))
            del self._adopted[:-self.MAX_ADOPTED]
            if ship:
                for pending in self._unshipped_adopted.values():
                    pending.append(ids)

    def _expire_adopted(self) -> None:
        while self._adopted and self._recorded - self._adopted[0][1] >= self._capacity:
            self._adopted.pop(0)

    def add(self, rid: str, ship: bool = True) -> None:
        if rid:
            with self._lock:
                self._record((rid,), ship)

    def add_many(self, rids, ship: bool = True) -> None:
        """``add`` of each id, in bulk: a migration's first round hands a destination up
        to the whole window (200k ids), which ``add`` one by one took ~0.8 s."""
        rids = [r for r in dict.fromkeys(rids) if r]
        if rids:
            with self._lock:
                self._record(rids, ship)

    def _record(self, rids, ship: bool) -> None:
        self._ids.extend(rids)  # the oldest forgotten past the capacity
        self._recorded += len(rids)
        if ship:
            for name, log_ in self._unshipped.items():
                if len(log_) + len(rids) > log_.maxlen:
                    self._overflowed[name] = True
                log_.extend(rids)

    def open_cursor(self, name: str, snapshot: bool = False) -> list[str] | None:
        """A new stream's log of unshipped ids, empty: its first shipment is a full copy,
        which sends every remembered id. ``snapshot``: returns those ids, read at the
        same instant (each later one is in the log)."""
        with self._lock:
            self._unshipped[name] = deque(maxlen=self._capacity)
            self._overflowed[name] = False
            self._unshipped_adopted[name] = []
            return self._all() if snapshot else None

    def has_cursor(self, name: str) -> bool:
        with self._lock:
            return name in self._unshipped

    def close_cursor(self, name: str) -> None:
        with self._lock:
            if name != self.MAIN:
                self._unshipped.pop(name, None)
                self._overflowed.pop(name, None)
                self._unshipped_adopted.pop(name, None)

    def move_cursor(self, src: str, dst: str) -> None:
        """``dst`` continues where ``src`` stands (a prepared peer becomes the peer)."""
        with self._lock:
            self._unshipped[dst] = self._unshipped.pop(src, deque(maxlen=self._capacity))
            self._overflowed[dst] = self._overflowed.pop(src, True)
            self._unshipped_adopted[dst] = self._unshipped_adopted.pop(src, [])

    def take_unshipped(self, cursor: str = MAIN) -> tuple[list[str], bool]:
        """The ids not yet shipped (adopted windows first), and whether some were lost
        (more than the window between two shipments): then only a full copy (every id)
        is exact."""
        with self._lock:
            log_ = self._unshipped.setdefault(cursor, deque(maxlen=self._capacity))
            pending = self._unshipped_adopted.get(cursor)
            self._unshipped_adopted[cursor] = []
            out = [rid for ids in pending or () for rid in ids] + list(log_)
            log_.clear()
            lost, self._overflowed[cursor] = self._overflowed.get(cursor, False), False
            return out, lost

    def requeue(self, rids: list[str], cursor: str = MAIN) -> None:
        """Ids taken for a shipment that failed: they go out with the next one."""
        with self._lock:
            log_ = self._unshipped.setdefault(cursor, deque(maxlen=self._capacity))
            if len(log_) + len(rids) > log_.maxlen:
                self._overflowed[cursor] = True
            log_.extendleft(reversed(rids))

    def snapshot(self) -> list[str]:
        """Every remembered id, oldest first (for a new peer or a slot's new owner)."""
        with self._lock:
            return self._all()

    def _all(self) -> list[str]:
        self._expire_adopted()
        if not self._adopted:
            return list(self._ids)
        return [rid for ids, _ in self._adopted for rid in ids] + list(self._ids)


class _NeedsFull(Exception):
    """A delta cannot be exact: ship a full copy (``mode``: new or refresh)."""

    def __init__(self, mode: str, why: str):
        super().__init__(why)
        self.mode = mode


class Replicator:
    """Primary side: ships this PS's changes to its peer."""

    # the background full copy to a new peer that replaces another one starts this much
    # later (see configure); synchronous pushes still send it at once when they need it
    NEW_PEER_DELAY_SECONDS = 1.0

    # a scale event's future peer: the copy prepared there before the routing changes
    NEXT = "replica-next"
    # a preparation gives up (the scale event is called off) after this many failed tries
    PREPARE_FAILURES = 3
    # taking a prepared copy over waits this long for its shipment in flight (a delta)
    TAKE_OVER_WAIT_SECONDS = 5.0

    def __init__(self, store: EmbeddingStore, configs: dict, applied: AppliedRequests | None = None,
                 gate: ApplyGate | None = None, name: str = AppliedRequests.MAIN):
        self.name = name  # the store's log consumer and the request-id cursor of this stream
        self.store = store
        self.configs = configs
        self.applied = applied or AppliedRequests()
        self.gate = gate or ApplyGate()
        self.origin = ""
        self.peer = ""  # as configured; the channel follows at the next shipment
        self._stub_peer = ""  # the peer the channel and ``_since`` are about
        self.interval = 0.2
        self.sync = False
        self._since = -1  # the peer's copy is current to this sequence number; -1: none yet
        self._full_mode = "new"
        self._known_tables: set[str] = set()  # tables the peer's copy has (config sent)
        self._drop_peers: list[str] = []  # former peers to tell to drop their copy
        self._lock = threading.Lock()  # one shipment at a time, in sequence order
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stub = None
        self._channel = None
        self.last_shipped = 0.0
        self._not_before = 0.0  # the background loop ships nothing before this (defer)
        self.shipped_rows = 0
        self.full_copies = 0
        self.errors = 0
        self.failed_in_row = 0  # shipments of the background loop failed in a row
        self.last_error = ""
        # background full copies pace themselves with what this returns (a function called
        # between chunks; the PS sets it): a scale event's new ring makes two full copies
        # of 1.3M rows each right after the publish, which took the CPU from training
        self.pace_factory = None
        # A peer this PS stops replicating to at a migration's publish (hold_unowned): rows
        # of slots this PS does not own are not shipped to it. Such rows are a migration's
        # imports (owned from the publish on, which gives this PS a new peer and that peer
        # a full copy) or rows about to be dropped (a rolled back migration's copies, a
        # source's moved slots). A scale-in's destination whose peer was the leaving PS
        # shipped it every imported row (a delta of 70-110k rows every 0.3 s), to a copy
        # discarded at the publish. (peer, bool mask of the slots held back) or None.
        self._held: tuple[str, np.ndarray] | None = None
        # a prepared stream copies only the slots its PS owns after the routing change
        # (bool per routing slot; None: every row): a source's rows of the slots it gives
        # away would be dropped right after the change
        self.scope: np.ndarray | None = None
        # make-before-break (``prepare``): a second stream keeps a copy of this PS on the
        # peer it will have after a routing change; the change takes it over (``_adopting``
        # until the next shipment) instead of starting a full copy there. Until that copy
        # was complete, a failure of this PS right after a scale event found no copy.
        self._next: Replicator | None = None
        self._adopting: Replicator | None = None
        self._next_lock = threading.Lock()
        self._catch_up = False  # a copy was just taken over: ship its delta before a push
        self._copied = threading.Event()  # the current peer's full copy is complete
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def configure(self, origin: str, peer: str, interval_ms: float, sync: bool) -> None:
        """Never waits for a shipment in flight: SetRouting calls this, and a migration's
        hand-over (or a recovery's routing push) waited for the shipment of all the rows
        just imported, to a peer that may be leaving -- most of a scale-in's fence. A new
        peer takes effect at the next shipment (``_follow_peer``, under the lock), which
        starts its full copy; the shipment in flight ends on the old peer."""
        self.origin = origin
        self.interval = max(interval_ms, 1.0) / 1000.0
        self.sync = sync
        # a routing push ends a migration (its publish, or the rollback's old layout whose
        # copied rows are then dropped): every row this PS owns goes to its peer again
        self._held = None
        # the copy prepared for this peer is taken over at the next shipment; one prepared
        # for another (a rolled back scale event) is dropped
        drop = []
        with self._next_lock:
            prepared = [sb for sb in (self._next, self._adopting) if sb is not None]
            self._next = self._adopting = None
            for sb in prepared:
                if sb.peer == peer and peer != self.peer and self._adopting is None:
                    self._adopting = sb
                else:
                    drop.append(sb)
        for sb in drop:
            self._discard(sb)
        if peer != self.peer:
            if self._adopting is not None:
                self._not_before = 0.0  # its delta goes at once: the copy is the only one
            elif self.peer and peer:
                # a re-formed ring (a recovery, a scale event): the new peer needs a full
                # copy of this PS, seconds of CPU on both. Started at once it ran during
                # the clients' first steps on the new routing (a recovery's critical path)
                self.defer(self.NEW_PEER_DELAY_SECONDS)
            self.peer = peer
            log.info("%s: replicating to %s", origin, peer or "(no peer)")
        self._wake.set()

    def _follow_peer(self) -> None:
        """Point the channel at the configured peer (called under ``_lock``)."""
        peer = self.peer
        if peer == self._stub_peer:
            return
        if self._channel is not None:
            self._channel.close()
        with self._next_lock:  # configure may be handing one over right now
            sb, self._adopting = self._adopting, None
        if sb is not None and sb.peer == peer and self._take_over(sb):
            return
        if sb is not None:
            self._discard(sb)
        if self._stub_peer and self.origin:
            self._drop_peers.append(self._stub_peer)
        self._channel = insecure_channel(peer) if peer else None
        self._stub = _ReplicaStub(self._channel) if peer else None
        self._stub_peer = peer
        self._since = -1  # new peer: full copy
        self._full_mode = "new"
        self._copied.clear()
        self.store.set_consumer(self.name, None if not peer else 0, moved=True)

    # -- make-before-break ------------------------------------------------------------------
    def prepare(self, peer: str, wait: float, origin: str = "",
                scope: np.ndarray | None = None,
                caller_waits=lambda: True) -> tuple[bool, int]:
        """Before a routing change gives this PS the ring peer ``peer``: keep a copy of
        this PS there too (a full copy, then deltas, alongside the current peer's), so that
        the change finds it complete and a failure right after it loses nothing. Waits up
        to ``wait`` seconds for that copy to be complete; returns (complete, the sequence
        number it is current to, -1 while incomplete). Asked again for the same peer it
        only waits; for another peer, the earlier copy is dropped. The wait ends early
        when ``caller_waits()`` turns false (the RPC was cancelled) and, with
        ``ReplicaUnavailable``, when this PS stops: a handler left waiting would keep a
        stopping process alive for the rest of an hour's wait."""
        if origin and self.origin and origin != self.origin:
            raise ValueError(f"this PS is {self.origin}, not {origin}")
        origin = self.origin or origin
        if not origin:
            raise ValueError("this PS has no id yet (neither routing nor ps_id name it)")
        with self._next_lock:
            if peer == self.peer and self._adopting is None:
                sb = self  # already the peer: its copy is the one to wait for
            else:
                sb = self._next
                if sb is None or sb.peer != peer or not _same_scope(sb.scope, scope):
                    if sb is not None:
                        self._discard(sb)
                    self.applied.open_cursor(self.NEXT)
                    sb = Replicator(self.store, self.configs, self.applied, self.gate,
                                    name=self.NEXT)
                    sb.pace_factory = self.pace_factory
                    sb.scope = None if scope is None else np.asarray(scope, dtype=bool)
                    sb.configure(origin, peer, self.interval * 1000.0, False)
                    self._next = sb
                    log.info("%s: preparing a copy on %s, its peer after the routing change",
                             self.origin, peer)
        deadline = time.monotonic() + max(wait, 0.0)
        while not sb._copied.wait(min(0.2, max(deadline - time.monotonic(), 0.0))):
            if sb.failed_in_row >= self.PREPARE_FAILURES:
                if sb is not self:  # given up: not retried in the background for ever
                    with self._next_lock:
                        if self._next is sb:
                            self._next = None
                    self._discard(sb)
                raise ReplicaUnavailable(
                    "unreachable", f"the copy on {peer} failed {sb.failed_in_row} times in "
                                   f"a row, last: {sb.last_error}")
            if self._stop.is_set() or sb._stop.is_set():
                raise ReplicaUnavailable(
                    "stopping", f"the copy on {peer} was stopped before it was complete "
                                "(this PS is stopping or the copy was called off)")
            if time.monotonic() >= deadline or not caller_waits():
                return False, -1
        return True, sb._since

    def _take_over(self, sb: "Replicator") -> bool:
        """The prepared stream ``sb`` becomes this one (under ``_lock``; ``_follow_peer``
        closed the former channel): its channel, its copy's base, its log position and
        request-id cursor. False if its copy is not complete (the caller then starts a
        full copy as for any new peer)."""
        sb._stop.set()
        sb._wake.set()
        if not sb._lock.acquire(timeout=self.TAKE_OVER_WAIT_SECONDS):
            return False
        try:
            if sb._since < 0 or sb._stub is None:
                return False
            if self._stub_peer and self.origin:
                self._drop_peers.append(self._stub_peer)  # the former peer's copy is stale
            self._channel, self._stub, self._stub_peer = sb._channel, sb._stub, sb._stub_peer
            sb._channel = sb._stub = None
            self._since, self._full_mode = sb._since, "refresh"
            self._known_tables = set(sb._known_tables)
            self.store.set_consumer(self.name, self._since, moved=True)
            self.store.set_consumer(sb.name, None)
            self.applied.move_cursor(sb.name, self.name)
            self._copied.set()
            self._catch_up = True
            self.shipped_rows += sb.shipped_rows  # this PS's shipping, whichever stream
            self.full_copies += sb.full_copies
            self.errors += sb.errors
        finally:
            sb._lock.release()
        log.info("%s: replicating to %s, whose copy was prepared (current to %d)",
                 self.origin, self._stub_peer, self._since)
        return True

    def _discard(self, sb: "Replicator") -> None:
        """Stop a prepared stream; its peer drops the copy (at this stream's next shipment:
        never waited for here), and its logs are released."""
        sb.close()
        self.shipped_rows += sb.shipped_rows  # this PS's shipping, whichever stream
        self.full_copies += sb.full_copies
        self.store.set_consumer(sb.name, None)
        self.applied.close_cursor(sb.name)
        if sb._stub_peer and sb._stub_peer != self._stub_peer:
            self._drop_peers.append(sb._stub_peer)
            self._wake.set()
        log.info("%s: the copy prepared on %s is dropped", self.origin, sb.peer)

    def cancel_prepared(self) -> None:
        """The routing change a copy was prepared for was called off: drop it."""
        with self._next_lock:
            sb, self._next = self._next, None
        if sb is not None:
            self._discard(sb)

    def taking_over(self) -> bool:
        """A prepared copy is to become the peer's at the next shipment."""
        return self._adopting is not None

    def switch_now(self, timeout: float) -> None:
        """Take a prepared copy over now and ship it what it lacks (a delta: never a full
        copy, which the background loop makes if the copy cannot be taken over). Bounded
        by ``timeout``; a failure is logged and left to the background loop."""
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            self._follow_peer()
            if self._stub is None or self._since < 0 or not self._catch_up:
                return
            try:
                self._ship_delta(timeout)
            except _NeedsFull as exc:
                self._since, self._full_mode = -1, exc.mode
                self._wake.set()
            except grpc.RpcError as exc:
                self.errors += 1
                log.warning("%s: delta to %s failed: %s", self.origin, self._stub_peer,
                            exc.code().name)
        finally:
            self._lock.release()

    def next_peer(self) -> tuple[str, int]:
        """The peer a copy is prepared on and the sequence number it is current to."""
        sb = self._next or self._adopting
        return (sb.peer, sb.shipped_sequence()) if sb is not None else ("", -1)

    def hold_unowned(self, peer_after: str, owned: np.ndarray | None) -> bool:
        """A migration's background round imports into this PS, which ``peer_after``
        replicates once the migration is published: if that is not the current peer, rows
        of the slots this PS does not own now (``owned``: bool per slot, None = every
        slot) are not shipped to the current one until the next routing push
        (``configure``). The slots are fixed by the first call for that peer: before the
        fence, so a PS that is also a source keeps shipping the slots it gives away.
        Returns whether the hold is in force."""
        peer = self.peer
        if not peer or not peer_after or peer_after == peer or owned is None:
            return False
        held = self._held
        if held is None or held[0] != peer:
            held = self._held = (peer, ~np.asarray(owned, dtype=bool))
            log.info("%s: rows of %d slots it does not own are not shipped to %s (its peer "
                     "after the migration: %s)", self.origin, int(held[1].sum()), peer,
                     peer_after)
        return bool(held[1].any())

    def holds_back(self, slot_mask: np.ndarray) -> bool:
        """Whether rows of any slot of ``slot_mask`` are held back from the current peer
        (``hold_unowned``): its copy of this PS then lacks them."""
        held = self._held
        return held is not None and held[0] == self.peer and held[1].size == slot_mask.size \
            and bool((held[1] & slot_mask).any())

    def _owned_only(self, keys: np.ndarray, *arrays):
        """``keys`` and ``arrays`` without the rows of held slots while the channel's
        peer is held (``hold_unowned``), and of slots outside ``scope``; else as they are."""
        scope = self.scope
        if keys.size and scope is not None:
            keep = scope[slot_of(keys, scope.size)]
            keys, arrays = keys[keep], tuple(a[keep] for a in arrays)
        held = self._held
        if not keys.size or held is None or held[0] != self._stub_peer or not held[1].any():
            return (keys, *arrays)
        keep = ~held[1][slot_of(keys, held[1].size)]
        return (keys[keep], *(a[keep] for a in arrays))

    def defer(self, seconds: float) -> None:
        """Let the background loop ship nothing for ``seconds``. After a promotion the next
        shipment is a full copy of this PS (seconds of CPU on a loaded host); started at
        once it competed with the clients' first steps on the new routing."""
        self._not_before = max(self._not_before, time.monotonic() + max(seconds, 0.0))

    def _meta(self, kind: str, base: int | None = None):
        meta = [(KIND_KEY, kind)]
        if base is not None:
            meta.append((BASE_KEY, str(int(base))))
        return tuple(meta)

    def _send_drops(self) -> None:
        """Tell former peers that their copy of this PS is no longer kept current (best
        effort: a peer that is gone has nothing to drop)."""
        while self._drop_peers:
            address = self._drop_peers.pop()
            try:
                with insecure_channel(address) as ch:
                    ps_pb2_grpc.ParameterServerStub(ch).Replicate(
                        iter([ps_pb2.RowBatch(origin=self.origin)]), timeout=5,
                        metadata=self._meta("drop"))
            except grpc.RpcError as exc:
                log.info("%s: could not tell %s to drop its copy: %s", self.origin, address,
                         exc.code().name)

    def _delta_batches(self, since: int) -> list:
        """Rows and tombstones (moved rows included) since ``since``, in messages of at
        most CHUNK_ROWS rows per table with changes, plus the config of tables the peer
        has not seen. Under the gate."""
        out = []
        for name, table in sorted(self.store.tables().items()):
            # not de-duplicated (a sort of every moved key of a clean-up): the peer deletes
            # each key once whatever the repeats
            deleted = table.tombstones_since(since, include_moved=True, distinct=False)
            keys, (rows, counts), _ = table.export_rows(since, with_counts="apart")
            keys, rows, counts = self._owned_only(keys, rows, counts)
            if keys.size or deleted.size or name not in self._known_tables:
                cfg = table_config(self.configs, name, table).SerializeToString()
                out.append(_Pending(name, cfg, keys[:CHUNK_ROWS], rows[:CHUNK_ROWS],
                                    counts[:CHUNK_ROWS], deleted))
                for i in range(CHUNK_ROWS, keys.size, CHUNK_ROWS):
                    out.append(_Pending(name, cfg, keys[i:i + CHUNK_ROWS],
                                        rows[i:i + CHUNK_ROWS], counts[i:i + CHUNK_ROWS]))
        return out

    def _ungated_rounds(self, since: int) -> tuple[list, int]:
        """``_ungated_stream`` gathered (a delta is sent whole): the batches and the
        sequence number the gated rest starts from."""
        out: dict = {}
        batches = list(self._ungated_stream(since, None, out))
        return batches, out["since"]

    def _copy_mask(self) -> np.ndarray:
        """The slots a full copy reads: ``scope``, else one slot (every key maps to it)."""
        return np.ones(1, dtype=bool) if self.scope is None else self.scope

    def _ungated_stream(self, since: int, pace, out: dict):
        """Rows and tombstones written since ``since``, read outside the apply gate while
        they are large (the gate stops every push on this PS: reading hundreds of
        thousands of rows under it, the rows written during a full copy on a busy PS,
        stalled training for seconds). A row written during a round has a newer sequence
        number and is read again by the next round or by the gated rest, which also sends
        the request ids of every push it holds; ``out["since"]``: where that rest starts.
        Each round is planned (row ids only) and read chunk by chunk, pacing (or yielding
        the interpreter) between chunks: a copy made during a migration's imports has a
        tail of a million rows at 4M, and read in one piece it held the interpreter for
        hundreds of ms."""
        everything = self._copy_mask()
        for _ in range(UNGATED_ROUNDS):
            tables = self.store.tables()
            # tombstones too: the "moved" ones of a migration's clean-up (every key of the
            # slots that left) made each gated read sort hundreds of thousands of keys
            if all(t.changed_at_most(since, GATED_MAX_ROWS)
                   and t.tombstone_count_since(since, include_moved=True) <= GATED_MAX_ROWS
                   for t in tables.values()):
                break
            mark = self.store.sequence.value
            for name, table in sorted(tables.items()):
                cfg = table_config(self.configs, name, table).SerializeToString()
                try:
                    deleted = table.tombstones_since(since, include_moved=True, distinct=False)
                except LogTrimmed as exc:
                    raise _NeedsFull("refresh", str(exc)) from None
                if deleted.size:
                    yield _Pending(name, cfg, deleted=deleted)
                codes, bits = table.plan_export(everything, since)
                for i in range(0, codes.size, CHUNK_ROWS):
                    keys, (rows, counts), _ = table.gather_planned(
                        codes[i:i + CHUNK_ROWS], bits, everything.size, with_counts="apart",
                        since_seq=since)
                    keys, rows, counts = self._owned_only(keys, rows, counts)
                    if keys.size:
                        yield _Pending(name, cfg, keys, rows, counts)
                    if pace is not None:
                        pace()
                    else:
                        time.sleep(0)
            since = mark
        out["since"] = since

    def ship(self, timeout: float = 60.0, paced: bool = False) -> int:
        """Send everything changed since the last shipment; returns rows sent. ``paced``:
        a full copy yields to training between its chunks (the background loop; never in
        sync mode, where pushes wait for the copy)."""
        with self._lock:
            self._follow_peer()
            self._send_drops()
            if self._stub is None:
                return 0
            if self._since >= 0:
                try:
                    return self._ship_delta(timeout)
                except _NeedsFull as exc:
                    log.info("%s: full copy to %s: %s", self.origin, self.peer, exc)
                    self._since, self._full_mode = -1, exc.mode
            return self._ship_full(timeout, paced and not self.sync)

    # a delta this large is logged (rows, time): a migration's imports ship as deltas,
    # and a long training step is matched with what the PS were doing from the logs
    LOG_DELTA_ROWS = 1 << 13

    def _ship_delta(self, timeout: float) -> int:
        t0 = time.monotonic()
        since = self._since
        # after a long outage the delta may be most of the table: a full copy streams it
        # in bounded memory instead of building (and the peer buffering) one huge delta
        # rows held back from this peer do not count: a burst of imports made the delta
        # "too large" and the full copy that followed sent them all the same
        held = self._held[1] if self._held is not None and self._held[0] == self._stub_peer \
            else None
        for table in self.store.tables().values():
            if not table.changed_at_most(since, DELTA_MAX_ROWS, skip_slots=held):
                raise _NeedsFull("refresh", f"more than {DELTA_MAX_ROWS} rows changed")
        pre, mark = self._ungated_rounds(since)
        with self.gate.exclusive():
            ids, lost = self.applied.take_unshipped(self.name)
            if lost:
                raise _NeedsFull("refresh", "more pushes than the request-id window since "
                                            "the last shipment")
            watermark = self.store.sequence.value
            cut = time.monotonic()
            if watermark == since and not ids and self._known_tables >= set(self.store.tables()):
                self.last_shipped = time.monotonic()
                return 0
            try:
                batches = pre + self._delta_batches(mark)
            except LogTrimmed as exc:
                self.applied.requeue(ids, self.name)
                raise _NeedsFull("refresh", str(exc)) from None
        if not batches:
            batches = [_Pending("", b"")]
        last = len(batches) - 1
        # encoded as the stream is sent: one message's bytes alive at a time
        # the end batch says how long ago the cut was: the peer dates its copy from it
        wire = (b.encode(self.origin, origin_sequence=watermark, end=i == last,
                         applied_request_ids=ids if i == 0 else (),
                         cut_age_ms=(time.monotonic() - cut) * 1000 if i == last else 0.0)
                for i, b in enumerate(batches))
        try:
            resp = self._stub.Replicate(wire, timeout=timeout,
                                        metadata=self._meta("delta", since))
        except grpc.RpcError as exc:
            self.applied.requeue(ids, self.name)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the peer lacks the base
                raise _NeedsFull("new", f"the peer refused the delta: {exc.details()}") from None
            raise
        self._known_tables.update(b.name for b in batches if b.name)
        self._since = watermark
        self._catch_up = False
        self.store.set_consumer(self.name, watermark, moved=True)
        self.last_shipped = time.monotonic()
        self.shipped_rows += resp.rows
        if resp.rows >= self.LOG_DELTA_ROWS:
            log.info("%s: delta to %s: %d rows in %.0f ms", self.origin, self._stub_peer,
                     resp.rows, (self.last_shipped - t0) * 1000)
        return resp.rows

    def _ship_full(self, timeout: float, paced: bool = False) -> int:
        """A full copy in slices (no table is copied whole), then, under the apply gate, the
        rows and tombstones written meanwhile and every remembered request id."""
        start = self.store.sequence.value
        self.store.set_consumer(self.name, start, moved=True)  # logs from the start on
        done: dict = {}
        pace = self.pace_factory() if paced and self.pace_factory is not None else None
        t0 = time.monotonic()
        log.info("%s: full copy to %s starts (%s)", self.origin, self._stub_peer,
                 "paced" if pace else "unpaced")

        def stream():
            # RowBatch wire bytes straight from the exported arrays (rowwire), rows in the
            # store's layout: the protobuf copies of this stream were most of a new PS's
            # CPU during a scale-out (its full copy to the ring peer)
            origin = self.origin
            yield rowwire.encode(origin=origin, reset=True)
            everything = self._copy_mask()
            for name, table in sorted(self.store.tables().items()):
                cfg = table_config(self.configs, name, table).SerializeToString()
                # empty tables too; the rows coming are announced so that the peer sizes
                # the copy's table once (+2%: rows written while the copy streams)
                yield rowwire.encode(cfg, origin=origin,
                                     total_rows=int(len(table) * 1.02) + 64)
                row = 0
                while row is not None:
                    # rows written since the start come with the tail: a copy made while
                    # a migration imports (or a fill) sent each new row twice
                    keys, (rows, counts), _, row = table.export_slots(
                        everything, None, row, CHUNK_ROWS, with_counts="apart",
                        upto_seq=start)
                    if keys.size:
                        yield rowwire.encode(cfg, keys, rows, counts, origin=origin)
                    if pace is not None and row is not None:
                        pace()
            tail: dict = {}
            for b in self._ungated_stream(start, pace, tail):  # _NeedsFull: the copy fails
                yield b.encode(origin)
            mark = tail["since"]
            with self.gate.exclusive():
                self.applied.take_unshipped(self.name)  # all of them are in the snapshot
                ids = self.applied.snapshot()
                watermark = self.store.sequence.value
                cut = time.monotonic()
                tail = self._delta_batches(mark)  # LogTrimmed: this copy fails, try again
            done["watermark"] = watermark
            done["tables"] = {b.name for b in tail if b.name}
            done["tables"].update(self.store.tables())
            for b in tail:
                yield b.encode(origin)
            yield rowwire.encode(origin=origin, origin_sequence=watermark,
                                 applied_request_ids=ids, end=True,
                                 cut_age_ms=(time.monotonic() - cut) * 1000)

        self._known_tables = set(self.store.tables())  # the copy sends every config
        resp = self._stub.Replicate(stream(), timeout=max(timeout, FULL_TIMEOUT),
                                    metadata=self._meta(f"full-{self._full_mode}"))
        self._known_tables = done["tables"]
        self._since = done["watermark"]
        self._full_mode = "refresh"
        self._catch_up = False
        self.store.set_consumer(self.name, self._since, moved=True)
        self.last_shipped = time.monotonic()
        self.shipped_rows += resp.rows
        self.full_copies += 1
        self._copied.set()
        log.info("%s: full copy to %s done: %d rows in %.0f ms", self.origin, self._stub_peer,
                 resp.rows, (time.monotonic() - t0) * 1000)
        return resp.rows

    def ship_push(self, tables, request_id: str = "") -> None:
        """Synchronous mode: send the current rows of the keys a push just wrote, every
        table in one stream with the push's request id (the peer applies it whole or not
        at all). ``tables``: [(table name, keys)]. Not under the apply gate: pushes are
        serialized in sync mode, and a background shipment sending the same rows and id
        first is harmless."""
        with self._lock:
            self._follow_peer()
            self._send_drops()
            if self._stub is None:
                return
            if self._catch_up and self._since >= 0:
                # a prepared copy just taken over: what it lacks goes before this push
                try:
                    self._ship_delta(60.0)
                except _NeedsFull as exc:
                    self._since, self._full_mode = -1, exc.mode
            if self._since < 0:  # the peer has no base copy yet: send everything
                self._ship_full(60.0)
                return
            batches = []
            for name, keys in tables:
                table = self.store.get(name)
                found, rows = table.export_keys(keys, with_counts=True)
                batches.append(ps_pb2.RowBatch(
                    config=table_config(self.configs, name, table), origin=self.origin,
                    ids=codec.ids_to_bytes(found), rows=codec.floats_to_bytes(rows),
                    origin_sequence=self.store.sequence.value))
            if not batches:
                batches = [ps_pb2.RowBatch(origin=self.origin)]
            if request_id:
                batches[0].applied_request_ids.append(request_id)
            batches[-1].end = True
            try:
                self._stub.Replicate(iter(batches), timeout=60, metadata=self._meta("rows"))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no copy there
                    self._since, self._full_mode = -1, "new"
                raise

    def shipped_sequence(self) -> int:
        """Every row written up to this sequence number is in the peer's copy; -1 when
        there is no peer or its copy is not made yet."""
        # a new peer (its full copy not started yet: deferred) holds nothing of this PS
        return self._since if self.peer and self.peer == self._stub_peer else -1

    def lag(self) -> dict:
        """Gazer: how far the peer's copy trails this PS (sequence numbers not yet shipped,
        time since the last shipment)."""
        since = self.shipped_sequence()
        next_peer, next_since = self.next_peer()
        sb = self._next or self._adopting
        behind = self.store.sequence.value - since if since >= 0 else self.store.sequence.value
        return {"peer": self.peer, "behind_sequence": max(behind, 0) if self.peer else 0,
                "since_ship_ms": (time.monotonic() - self.last_shipped) * 1000
                if self.peer and self.last_shipped else 0.0,
                "shipped_rows": self.shipped_rows, "errors": self.errors,
                "sequence": self.store.sequence.value, "shipped_sequence": since,
                "next_peer": next_peer, "next_shipped_sequence": next_since,
                "full_copies": self.full_copies + (sb.full_copies if sb is not None else 0)}

    def _loop(self) -> None:
        failed = 0  # shipments failed in a row
        while not self._stop.is_set():
            # a failing peer is retried after a growing pause (up to 5 s), not every
            # interval: with a 1 ms interval an unreachable peer spun a core and the log
            pause = self.interval * 2 ** min(failed, 16) if failed else self.interval
            self._wake.wait(max(self.interval, min(pause, 5.0)))
            self._wake.clear()
            hold = self._not_before - time.monotonic()
            if hold > 0:
                self._stop.wait(hold)
            if self._stop.is_set():
                break
            failed += 1  # unless ship() returns
            try:
                self.ship(paced=True)
                failed = 0
            except grpc.RpcError as exc:
                # the peer is unreachable or slow: the next delta starts from the same base
                # (the peer applies a delta whole or not at all), a full copy only if the
                # peer lost its copy or this PS's logs no longer reach back that far
                self.errors += 1
                self.last_error = f"{exc.code().name}: {exc.details()}"
                log.warning("replication to %s failed: %s", self.peer, exc.code().name)
            except Exception as exc:  # noqa: BLE001 - never let the shipping thread die
                self.errors += 1
                self.last_error = repr(exc)
                log.exception("replication to %s failed", self.peer)
            self.failed_in_row = failed

    def close(self) -> None:
        """Stop shipping and cancel any stream in flight: two PS stopping together would
        otherwise each wait at exit for a handler serving the other's stream."""
        with self._next_lock:
            extra = [sb for sb in (self._next, self._adopting) if sb is not None]
            self._next = self._adopting = None
        for sb in extra:
            sb.close()
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


def _same_scope(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))


class ReplicaUnavailable(Exception):
    """Promote cannot hand over a copy of ``origin``: ``kind`` "resyncing" (a full copy is
    still streaming in: ask again later) or "no_replica" (none here, or the full copy broke
    off with its origin and left nothing usable: restore from a checkpoint)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ReplicaRefused(Exception):
    """A delta or push's rows for a copy this PS does not hold (at that base)."""


MAX_CUT_AGE_MS = 3_600_000.0  # a shipment's reported age above this is not believed


def _cut_time(end_batch) -> float:
    """When the origin cut the shipment that ``end_batch`` (just received) ends, on this
    PS's clock: its arrival less the age the origin gave it (``cut_age_ms``; the end
    batch's one-way trip is not counted). Dated by its arrival alone, a copy looked
    younger than it is by the shipment's encoding and transfer: under load more than
    the recovery's reported updates at risk."""
    age = float(getattr(end_batch, "cut_age_ms", 0.0) or 0.0)
    if not 0.0 <= age <= MAX_CUT_AGE_MS:  # negative, NaN or absurd (a bad peer): not used
        age = 0.0
    return time.monotonic() - age / 1000


class ReplicaCopy:
    """One origin's complete copy: its rows, how current it is, the request ids in it."""

    def __init__(self, store: EmbeddingStore, sequence: int, applied):
        self.store = store
        self.sequence = sequence
        self.updated = time.monotonic()
        self.applied = IdWindow(applied)
        self.lock = threading.Lock()


def _apply_batch(store: EmbeddingStore, b, decoded=None) -> int:
    cfg = b.config
    if not cfg.name:
        return 0
    init, opt = validation.table_config(cfg)  # name, dim, JSON (nesting) checked
    table = store.ensure_table(cfg.name, cfg.dim, init, opt, **table_spec.policies(cfg))
    if decoded is None:
        decoded = _decode(b, table.row_width)
    deleted, ids, rows, counts = decoded
    for i in range(0, deleted.size, APPLY_DELETE_CHUNK):
        if i:
            time.sleep(0)  # let the PS's serving threads run between the slices
        table.delete(deleted[i:i + APPLY_DELETE_CHUNK], log_tombstone=False)
    if b.total_rows > 0:  # a full copy's table: sized once for the rows announced
        table.reserve_import(min(int(b.total_rows), MAX_ANNOUNCED_ROWS))
    if ids.size and counts is not None:  # the store's layout, counts apart (rowwire)
        table.import_block(ids, rows, counts)
    elif ids.size:  # rows with their counts last (synchronous pushes, older primaries)
        table.import_rows(ids, rows)
    return int(ids.size)


def _decode(b, row_width: int):
    deleted = codec.ids_from_bytes(b.deleted_ids, "deleted_ids")
    ids = codec.ids_from_bytes(b.ids)
    rows = counts = None
    if ids.size and len(b.counts):
        rows = codec.floats_from_bytes(b.rows, ids.size, row_width, "rows")
        counts = codec.counts_from_bytes(b.counts, ids.size)
    elif ids.size:
        rows = codec.rows_from_bytes(b.rows, ids.size, row_width)
    return deleted, ids, rows, counts


def _parsed(batches):
    """Batches as messages: wire bytes (an in-process sender) are parsed as views."""
    for b in batches:
        yield rowwire.parse(b) if isinstance(b, (bytes, bytearray, memoryview)) else b


class ReplicaSet:
    """Peer side: copies of other PS's rows, one store per origin PS."""

    def __init__(self):
        self._cond = threading.Condition()
        self.copies: dict[str, ReplicaCopy] = {}
        self._streams: dict[str, int] = {}   # streams of an origin being received
        self._gen: dict[str, int] = {}       # fences full copies in flight
        self._broken: dict[str, str] = {}    # origin -> why its last full copy broke off
        self.num_slots = DEFAULT_NUM_SLOTS   # the job's routing slots (SetRouting)

    # -- receiving ---------------------------------------------------------------------
    def apply(self, batches, kind: str = "", base: int = -1) -> int:
        """Apply one ``Replicate`` stream; returns rows received. ``kind`` from the call's
        metadata (empty: an older primary; inferred from the first batch)."""
        it = _parsed(batches)
        first = next(it, None)
        if first is None:
            return 0
        origin = first.origin
        if not kind:
            kind = "full-new" if first.reset else "rows"
        with self._cond:
            self._streams[origin] = self._streams.get(origin, 0) + 1
        try:
            if kind == "drop":
                self.drop(origin)
                return 0
            if kind.startswith("full"):
                return self._apply_full(origin, first, it, keep_old=kind == "full-refresh")
            return self._apply_delta(origin, first, it, base if kind == "delta" else None)
        finally:
            with self._cond:
                self._streams[origin] -= 1
                if not self._streams[origin]:
                    del self._streams[origin]
                self._cond.notify_all()

    def _apply_full(self, origin: str, first, it, keep_old: bool) -> int:
        with self._cond:
            gen = self._gen[origin] = self._gen.get(origin, 0) + 1
            self._broken.pop(origin, None)
            if not keep_old:  # a new peer relationship: an older copy here is stale
                self.copies.pop(origin, None)
        # each row's routing slot is noted as it arrives (one hash per new key, here on
        # the receiving thread) so that promoting this copy hashes nothing
        staging = EmbeddingStore(track_changes=False, track_slots=self.num_slots)
        ids: list[str] = []
        seq = n = 0
        ended = False
        current_at = time.monotonic()
        try:
            for b in [first] if not first.reset else []:
                n += _apply_batch(staging, b)
            for b in it:
                n += _apply_batch(staging, b)
                ids.extend(b.applied_request_ids)
                seq = max(seq, b.origin_sequence)
                if b.end:
                    current_at = _cut_time(b)
                ended = ended or b.end
            if not ended:
                # an origin killed mid-copy can look like a stream that ended normally
                # (gRPC may report the closed connection as the end of the requests):
                # only the end mark makes a copy complete, else it would promote partial
                raise ReplicaRefused(f"the full copy of {origin!r} stopped without its end "
                                     f"mark after {n} rows")
        except BaseException as exc:
            with self._cond:
                if self._gen.get(origin) == gen:
                    self._broken[origin] = f"its full copy broke off after {n} rows ({type(exc).__name__})"
            raise
        copy = ReplicaCopy(staging, seq, ids)  # its id window built outside the lock
        copy.updated = current_at
        with self._cond:
            if self._gen.get(origin) == gen:  # not fenced by a promotion or a newer copy
                self.copies[origin] = copy
        return n

    def _apply_delta(self, origin: str, first, it, base: int | None) -> int:
        # buffer the whole stream first: a delta is applied whole or not at all. Only its
        # end mark says it is whole: a stream cut by the origin's death can look ended
        # (the first batch carries the request ids, so half a push would count as done)
        batches = [first, *it]
        current_at = _cut_time(batches[-1])
        if not batches[-1].end:
            raise ReplicaRefused(f"a shipment of {origin!r} stopped without its end mark "
                                 f"after {len(batches)} batches; nothing of it applied")
        with self._cond:
            copy = self.copies.get(origin)
        if copy is None:
            raise ReplicaRefused(f"this PS holds no complete copy of {origin!r}")
        with copy.lock:
            with self._cond:
                if self.copies.get(origin) is not copy:  # promoted or replaced meanwhile
                    raise ReplicaRefused(f"the copy of {origin!r} was promoted or replaced")
            if base is not None and copy.sequence < base:
                raise ReplicaRefused(f"the copy of {origin!r} is current to {copy.sequence}, "
                                     f"the delta starts from {base}")
            # decode (and check every size) before changing anything
            decoded = [_decode(b, self._row_width(b)) if b.config.name else None
                       for b in batches]
            n = 0
            for b, d in zip(batches, decoded):
                n += _apply_batch(copy.store, b, d)
                copy.applied.extend(b.applied_request_ids)
                if base is not None:
                    copy.sequence = max(copy.sequence, b.origin_sequence)
            copy.updated = current_at
        return n

    @staticmethod
    def _row_width(b) -> int:
        """Floats per row of ``b``'s table as it will be after ``ensure_table``."""
        from deeprec_ext.store import make_optimizer
        _, opt = validation.table_config(b.config)
        return b.config.dim * (1 + make_optimizer(opt).num_slots)

    def drop(self, origin: str) -> bool:
        with self._cond:
            self._gen[origin] = self._gen.get(origin, 0) + 1
            self._broken.pop(origin, None)
            return self.copies.pop(origin, None) is not None

    # -- promotion ---------------------------------------------------------------------
    def take(self, origin: str, wait: float = PROMOTE_WAIT_SECONDS) -> ReplicaCopy:
        """Hand over the copy of ``origin`` for promotion, waiting up to ``wait`` seconds
        for a stream of it being received (a full copy completes, or breaks off). The copy
        is removed, and streams of ``origin`` still in flight are fenced (they change
        nothing any more). Raises :class:`ReplicaUnavailable` when there is no complete
        copy to promote."""
        deadline = time.monotonic() + max(wait, 0.0)
        with self._cond:
            while self._streams.get(origin) and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(deadline - time.monotonic(), 0.001)))
            copy = self.copies.get(origin)
            if copy is None:
                if self._streams.get(origin):
                    raise ReplicaUnavailable(
                        "resyncing", f"the copy of {origin!r} is still being rebuilt (full "
                        f"copy streaming in after {wait:.0f}s); promoting it would lose rows")
                if origin in self._broken:  # it will not complete: its origin is gone
                    raise ReplicaUnavailable(
                        "no_replica", f"the copy of {origin!r} is incomplete: "
                        f"{self._broken[origin]}; promoting it would lose rows")
                raise ReplicaUnavailable("no_replica", f"this PS holds no copy of {origin!r}")
            self._gen[origin] = self._gen.get(origin, 0) + 1
            del self.copies[origin]
        copy.lock.acquire()  # a delta still being applied finishes first
        copy.lock.release()
        return copy

    def put_back(self, origin: str, copy: ReplicaCopy) -> None:
        """A promotion that failed: the copy is promotable again."""
        with self._cond:
            self.copies.setdefault(origin, copy)

    def current(self, origin: str) -> ReplicaCopy | None:
        """The complete copy of ``origin`` held now (None: none), left in place: a
        migration's destination reads rows of it (``SeedFromReplica``) while deltas keep
        arriving; hold ``copy.lock`` for each read."""
        with self._cond:
            return self.copies.get(origin)

    # -- introspection -----------------------------------------------------------------
    def is_complete(self, origin: str) -> bool:
        with self._cond:
            return origin in self.copies

    def origins(self) -> dict[str, dict]:
        with self._cond:
            return {o: {"sequence": c.sequence, "rows": sum(t.size for t in c.store.tables().values()),
                        "age_ms": (time.monotonic() - c.updated) * 1000}
                    for o, c in self.copies.items()}
