"""Embedding tables of the PS: HashIndex + row arena, and the per-PS EmbeddingStore.

Row arena
---------
Each table keeps every row -- value **and** optimizer slots -- in ONE float32 array
``arena[capacity, dim * (1 + num_slots)]``. A row is therefore one contiguous vector:

* ``apply_gradients`` reads and writes value+slots of a batch with a single fancy-index
  gather and a single scatter (one random memory access -- usually one cache line -- per
  row instead of one per array; the random accesses, not the arithmetic, dominate);
* a row can never be observed half-updated relative to its slots, and a snapshot
  (``export_rows``) or migration copies a self-consistent (value, slots) unit.

Gathers/scatters go through a 1-D "void" view of the arena in which a whole row (or the
value part of a row) is one opaque item: ~2-3x faster than 2-D fancy indexing. For the
optimizer math a gathered block is transposed (moving ``dim``-float vectors) into
plane-major ``[1 + num_slots, n, dim]`` so the element-wise work runs on contiguous arrays.

The arena grows geometrically (x2), so appends are amortized O(1). Deleted rows go to a
free list and are reused before the arena grows. Memory per row: ``4 * row_width`` bytes
of arena + 20 bytes of per-row arrays (``row_seq``, ``row_key``, ``row_count``) + 4
bytes per hash-index position (load 3/8..1/2, i.e. ~8-11 bytes per key: the index holds
int32 row ids and reads keys from ``row_key``).

Parallel per-row arrays: ``row_seq`` (int64, sequence number of the row's last write,
>= 1; 0 for a free row), ``row_key`` (int64, the key owning the row: exports, and the
hash index's key comparisons) and ``row_count`` (uint32 updates).

float16 storage (``dtype="float16"``)
-------------------------------------
The arena row is then a packed record ``[value float16 x dim | slots float32 x dim *
num_slots]`` (``_record_dtype``), still moved as one opaque item. Every gather converts it
to the float32 row ``[n, row_width]`` the rest of the table (optimizer math, lookups,
exports, migration, replication, checkpoints) works with, and every scatter rounds the
value part back to float16 (round-to-nearest-even): outside the arena a float16 table
looks like a float32 one whose values happen to be float16-representable. Float32 tables
keep the plain float32 arena and their code paths unchanged.

Sequence numbers
----------------
One :class:`SequenceCounter` is shared by all tables of a PS. Every mutating batch takes
ONE new number **while holding the table lock** and stamps every row it wrote; deletions
append ``(seq, keys)`` to a tombstone log. Incremental sync is therefore::

    cut = store.sequence.value          # read BEFORE exporting
    for each table: tombstones_since(prev) then export_rows(since_seq=prev)
    prev = cut

which never misses a write (batches with seq <= cut finished under the lock before the
export could take it); writes after ``cut`` may be sent twice, harmlessly (upserts).
Consumers apply the tombstones first, then the rows.

Change log and bounded logs
---------------------------
Every mutating batch also appends the row ids it stamped to a change log (one vectorized
copy per batch), so "rows changed since V" costs O(rows written since V), not a scan of
the table: an idle or lightly-touched table costs its consumers (replication every
interval, incremental checkpoints, migration catch-up) almost nothing. The change log is
only an accelerator: once it no longer reaches back to V (trimmed), the same answer comes
from the full scan.

Tombstones are not optional: a consumer that missed some cannot rebuild them. Both logs
are trimmed with :meth:`EmbeddingTable.trim_logs` once every consumer has passed a
sequence number (the PS keeps the list of consumers, see ``EmbeddingStore.consumers``),
and each has a hard cap past which its oldest entries go anyway: the change log keeps
about one entry per 16 arena rows (beyond that a scan costs as much), the tombstone log
about one key per arena row. ``tombstones_since(V)`` for a V older than what is left
raises :class:`LogTrimmed`: that consumer fell too far behind and needs a full copy
instead of a delta.

Migration clean-up (``DropSlots``) does not delete anything from the model: the rows moved
to another PS. It logs "moved" tombstones, which only this PS's replica consumes (its copy
must lose those rows too, or a later promotion brings them back); incremental checkpoints
and migrations do not see them.

Threading: one ``threading.RLock`` per table around every public method.
"""
from __future__ import annotations

import collections
import logging
import mmap
import numbers
import sys
import threading
import time

import numpy as np

from deeprec_ext.hashing import DEFAULT_NUM_SLOTS, hash64, slot_of

from deeprec_ext.store.hash_index import INCREMENTAL_MIN_KEYS, MIGRATE_STEP, HashIndex
from deeprec_ext.store.initializers import Initializer, make_initializer
from deeprec_ext.store.optimizers import Optimizer, make_optimizer
from deeprec_ext.store.spec import check_dtype
from deeprec_ext.store.policies import (BLOOM_BLOCK, bloom_size, candidate_table_name,
                                        is_candidate_table, make_admission, make_eviction)

_CHUNK_FLOATS = 1 << 19  # optimizer works on ~2 MB of rows at a time
_SCAN_SLICE_ROWS = 1 << 18  # arena rows scanned per table-lock hold by sliced scans
_GATHER_ROWS_PER_HOLD = 1 << 13  # planned rows read per table-lock hold (about 1 ms)
_LOG_MIN_CAP = 1 << 16  # change-log entries / tombstone keys kept at least (hard cap floor)
_RECENT_LOOKUPS = 4  # lookups whose rows a push of the same keys reuses (per table)
_RECENT_MAX_KEYS = 1 << 16  # at most 4 MB a table (keys + rows); larger lookups are probed
_PUSH_MEMO_MAX_KEYS = 1 << 12  # a push this small is kept as a lookup is (dense tables)
_SEG_CURSOR = 1 << 61   # export_slots cursor flags: in the segment, ...
_MAIN_CURSOR = 1 << 60  # ... in this table's rows after the segment's
_LOG_CURSOR = 1 << 59   # ... in the change log's rows, from this arena row on

log = logging.getLogger(__name__)


# Arena growth without a copy: large per-row arrays live in an anonymous mapping that
# reserves address space (not memory: MAP_NORESERVE, pages appear when first written), so
# growing within it is a new view. Doubling a 2M-row arena by copying held the table lock
# for 0.4-0.9 s, a stall of every training step on the PS (and more as tables grow).
_RESERVE_MIN_BYTES = 8 << 20      # smaller arrays grow by copying (a few ms)
_RESERVE_BYTES = 1 << 36          # address space reserved per array: 64 GiB


# Python exposes the flag from 3.13 on; the value is Linux's (elsewhere: no flag, and the
# mapping may be refused under strict accounting, then arrays grow by copying)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _mapping_of(a: np.ndarray):
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def _huge_pages(mm: mmap.mmap) -> None:
    """Ask for 2 MB pages in a reservation (Linux THP, ``enabled`` = always or madvise;
    a no-op where there is none). A PS killed -9 is noticed only once the kernel has
    freed its memory: 4 KB pages made that 60-190 ms for 600 MB on a busy host, most of
    a recovery's detection, 2 MB pages 6-12 ms. Row arrays grow sequentially, so at most
    one partly used 2 MB page per array."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except (OSError, ValueError):
            pass


def _grown(a: np.ndarray, new_rows: int, keep: int) -> np.ndarray:
    """``a`` (rows along axis 0) with room for ``new_rows`` rows, rows ``[:keep]`` kept and
    the rest zero: a view of the same reservation when it is big enough, else a new
    array (a new reservation when large) with ``[:keep]`` copied."""
    tail = a.shape[1:]
    per_row = int(np.prod(tail, dtype=np.int64)) if tail else 1
    row_bytes = per_row * a.dtype.itemsize
    mm = _mapping_of(a)
    if mm is not None and new_rows * row_bytes <= len(mm):
        return np.frombuffer(mm, dtype=a.dtype, count=new_rows * per_row).reshape((new_rows,) + tail)
    out = None
    if new_rows * row_bytes >= _RESERVE_MIN_BYTES:
        size = max(2 * new_rows * row_bytes, _RESERVE_BYTES)
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
            _huge_pages(mm)
            out = np.frombuffer(mm, dtype=a.dtype, count=new_rows * per_row).reshape((new_rows,) + tail)
        except (OSError, ValueError, OverflowError):  # strict overcommit, 32-bit: copy
            out = None
    if out is None:
        out = np.zeros((new_rows,) + tail, dtype=a.dtype)
    out[:keep] = a[:keep]
    return out


class _TableLock:
    """A table's lock (reentrant) that knows whether a thread is waiting for it, so that
    a long export releasing it between short holds gives the CPU away (:func:`_yield`)
    only when a lookup or push waits. ``time.sleep(0)`` is a ~70 us timer sleep at the
    least, and on 2 busy cores the thread often waits far longer to run again: a 200k-row
    incremental's gather yields 25 times, 2 ms alone and 7-37 ms inside the writer's
    pipeline, with nobody waiting."""

    __slots__ = ("_lock", "_waiting", "_count")

    def __init__(self):
        self._lock = threading.RLock()
        self._waiting = 0
        self._count = threading.Lock()  # guards _waiting; taken on the contended path only

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):  # uncontended (or held by this thread): no counting
            return True
        if not blocking:
            return False
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @property
    def contended(self) -> bool:
        """Whether some thread is blocked waiting for this lock right now."""
        return self._waiting > 0


def _yield(lock: _TableLock) -> None:
    """Let a thread waiting for a table lock just released take it: a lock is not fair,
    and a loop re-acquiring it at once would keep a waiting lookup out for many holds.
    Only when a thread waits for ``lock`` (see :class:`_TableLock`)."""
    if lock.contended:
        time.sleep(0)


_U64 = 1 << 64
_INV_M1 = np.uint64(pow(0xBF58476D1CE4E5B9, -1, _U64))
_INV_M2 = np.uint64(pow(0x94D049BB133111EB, -1, _U64))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _unshift(z: np.ndarray, s: int) -> np.ndarray:
    """Inverse of ``z ^ (z >> s)`` on uint64."""
    x = z.copy()
    for _ in range(64 // s + 1):
        x = z ^ (x >> np.uint64(s))
    return x


def unhash64(h: np.ndarray) -> np.ndarray:
    """int64 keys ``k`` with ``hash64(k) == h`` (the splitmix64 finalizer is a bijection)."""
    z = np.asarray(h, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _unshift(z, 31) * _INV_M2
        z = _unshift(z, 27) * _INV_M1
        z = _unshift(z, 30) - _GOLDEN
    return z.view(np.int64)


def _by_slot(keys: np.ndarray, sel, num_slots: int, slot_mask):
    """Keys of a run of rows (``sel``: their positions in the run, None for all) kept to
    ``slot_mask``, with their slots and the stable order that sorts them by slot."""
    slots = slot_of(keys, num_slots)
    if slot_mask is not None:
        keep = np.flatnonzero(slot_mask[slots])
        if keep.size != keys.size:
            sel = keep if sel is None else sel.take(keep)
            keys, slots = keys.take(keep), slots.take(keep)
    order = (np.argsort(slots.astype(np.uint16), kind="stable")
             if num_slots <= 1 << 16 else np.argsort(slots, kind="stable"))
    return keys, slots, sel, order


class LogTrimmed(LookupError):
    """The tombstone log no longer reaches back to the requested sequence number: that
    consumer fell too far behind and needs a full copy instead of a delta."""


class _ChangeLog:
    """Row ids written per mutating batch, in sequence order (one table, under its lock).

    Entries ``rows[start:end]``; batch ``b`` (``bstart <= b < bend``) wrote the entries from
    ``pos[b]`` on, with sequence number ``seq[b]`` (increasing: batches of one table take
    their numbers under its lock). ``floor``: batches with seq <= floor were trimmed, so
    ``since(v)`` is exact for ``v >= floor`` only.
    """

    def __init__(self):
        self.rows = np.empty(1024, dtype=np.int64)
        self.start = self.end = 0
        self.seq = np.empty(64, dtype=np.int64)
        self.pos = np.empty(64, dtype=np.int64)
        self.bstart = self.bend = 0
        self.floor = 0

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.seq.nbytes + self.pos.nbytes

    def append(self, seq: int, rows: np.ndarray) -> None:
        n = int(rows.size)
        if n == 0:
            return
        if self.end + n > self.rows.size:
            live = self.end - self.start
            if self.start and live + n <= self.rows.size // 2:  # compact in place
                self.rows[:live] = self.rows[self.start:self.end]
            else:
                grown = np.empty(max(2 * self.rows.size, live + n), dtype=np.int64)
                grown[:live] = self.rows[self.start:self.end]
                self.rows = grown
            self.pos[self.bstart:self.bend] -= self.start
            self.start, self.end = 0, live
        if not (self.bend > self.bstart and self.seq[self.bend - 1] == seq):
            if self.bend == self.seq.size:
                nb = self.bend - self.bstart
                if self.bstart and nb < self.seq.size // 2:
                    self.seq[:nb] = self.seq[self.bstart:self.bend]
                    self.pos[:nb] = self.pos[self.bstart:self.bend]
                else:
                    seq_a = np.empty(2 * self.seq.size, dtype=np.int64)
                    pos_a = np.empty(2 * self.seq.size, dtype=np.int64)
                    seq_a[:nb] = self.seq[self.bstart:self.bend]
                    pos_a[:nb] = self.pos[self.bstart:self.bend]
                    self.seq, self.pos = seq_a, pos_a
                self.bstart, self.bend = 0, nb
            self.seq[self.bend] = seq
            self.pos[self.bend] = self.end
            self.bend += 1
        self.rows[self.end:self.end + n] = rows
        self.end += n

    def since(self, v: int) -> np.ndarray | None:
        """Row ids written by batches with seq > v (repeats included), or None when the
        log no longer reaches back to ``v``."""
        if v < self.floor:
            return None
        b = self.bstart + int(np.searchsorted(self.seq[self.bstart:self.bend], v, side="right"))
        if b >= self.bend:
            return self.rows[:0]
        return self.rows[self.pos[b]:self.end]

    def trim(self, upto: int) -> None:
        """Forget batches with seq <= ``upto``."""
        b = self.bstart + int(np.searchsorted(self.seq[self.bstart:self.bend], upto, side="right"))
        if b == self.bstart:
            return
        self.floor = max(self.floor, int(self.seq[b - 1]))
        if b >= self.bend:
            self.start = self.end = self.bstart = self.bend = 0
        else:
            self.start, self.bstart = int(self.pos[b]), b

    def drop_through(self, seq: int) -> None:
        """Forget every batch and answer no ``since(v)`` for v < ``seq``: what appending
        a batch ``seq`` too large to keep, then capping, would leave."""
        self.start = self.end = self.bstart = self.bend = 0
        self.floor = max(self.floor, int(seq))

    def cap(self, limit: int) -> None:
        """Keep at most ``limit`` entries: the oldest batches go, as few as needed. (It
        went down to half: a batch of more than half the limit then dropped every batch,
        itself included, so a checkpoint after two such batches (5% of a 4M-row table
        each) found the log short and scanned every row's sequence number: 17 ms instead
        of 10.)"""
        if self.end - self.start <= limit:
            return
        keep_from = self.end - limit
        b = self.bstart + int(np.searchsorted(self.pos[self.bstart:self.bend], keep_from, side="left"))
        if b > self.bstart:
            self.trim(int(self.seq[b - 1]))
        if self.end - self.start > limit:  # one huge batch: drop it all
            self.trim(int(self.seq[self.bend - 1]))


class SequenceCounter:
    """Thread-safe, monotonically increasing counter shared by the tables of one PS.

    ``next()`` returns 1, 2, 3, ...; ``value`` is the last number issued (0 initially).
    """

    def __init__(self, start: int = 0):
        self._value = int(start)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._value += 1
            return self._value

    __next__ = next

    @property
    def value(self) -> int:
        return self._value

    def advance_to(self, value: int) -> int:
        """Make sure future numbers are > ``value`` (e.g. after a restore)."""
        with self._lock:
            self._value = max(self._value, int(value))
            return self._value

    def __repr__(self) -> str:
        return f"SequenceCounter(value={self._value})"


def _check_keys(keys, what: str = "keys") -> np.ndarray:
    if not isinstance(keys, np.ndarray):
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError(f"{what} must be a 1-D int64 array, got {type(keys).__name__}")
        keys = np.asarray(keys)
        if keys.size == 0:
            keys = keys.astype(np.int64)
    if keys.dtype != np.int64:
        if keys.dtype.kind == "i" or (keys.dtype.kind == "u" and keys.dtype.itemsize < 8):
            keys = keys.astype(np.int64)
        else:
            raise TypeError(f"{what} must be int64, got dtype {keys.dtype}")
    if keys.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {keys.shape}")
    return np.ascontiguousarray(keys)


def _check_floats(a, shape: tuple, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        if isinstance(a, (str, bytes)) or not hasattr(a, "__len__"):
            raise TypeError(f"{what} must be a float32 array, got {type(a).__name__}")
        a = np.asarray(a, dtype=np.float32)
    if a.dtype.kind != "f":
        raise TypeError(f"{what} must be float32, got dtype {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {a.shape}")
    if a.dtype != np.float32:
        with np.errstate(over="ignore"):  # overflow -> inf, rejected below
            a = a.astype(np.float32)
    a = np.ascontiguousarray(a)
    if not np.isfinite(a).all():
        bad = int(np.argmin(np.isfinite(a).reshape(a.shape[0], -1).all(axis=1)))
        raise ValueError(f"{what} contain NaN or Inf (first at row {bad}); nothing changed")
    return a


def _record_dtype(dim: int, num_slots: int) -> np.dtype:
    """A float16 table's packed arena row: value float16 [dim], then float32 slots."""
    fields = [("v", np.float16, (dim,))]
    if num_slots:
        fields.append(("s", np.float32, (dim * num_slots,)))
    return np.dtype(fields)


def _zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeroed rows ``shape``; a large one (a table created at a restore's row count) in a
    reservation with 2 MB pages, as growth makes them (:func:`_grown`): a restore's
    first touch of 512 MB took 0.25-1.1 s in 4 KB pages here, 0.08-0.15 s in 2 MB pages
    from two reader threads."""
    return _grown(np.zeros((0,) + tuple(shape[1:]), dtype=dtype), int(shape[0]), 0)


def _new_arena(cap: int, width: int, dim: int, num_slots: int, fp16: bool) -> np.ndarray:
    if fp16:
        return _zeros((cap,), _record_dtype(dim, num_slots))
    return _zeros((cap, width), np.float32)


class EmbeddingTable:
    """One sparse embedding table: ``HashIndex`` (key -> row) + row arena."""

    def __init__(self, name: str, dim: int, initializer="zeros", optimizer="sgd",
                 sequence: SequenceCounter | None = None, initial_capacity: int = 1024,
                 track_changes: bool = True, admission=None, eviction=None,
                 dtype="float32"):
        if not isinstance(name, str) or not name:
            raise ValueError(f"table name must be a non-empty string, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0:
            raise ValueError(f"table '{name}': dim must be a positive integer, got {dim!r}")
        if (isinstance(initial_capacity, bool) or not isinstance(initial_capacity, numbers.Integral)
                or initial_capacity < 0):
            raise ValueError(f"table '{name}': initial_capacity must be a non-negative integer, "
                             f"got {initial_capacity!r}")
        self.name = name
        self.dim = int(dim)
        self.dtype = check_dtype(dtype, name)
        self._fp16 = self.dtype == "float16"
        self.initializer: Initializer = make_initializer(initializer, self.dim)
        self.optimizer: Optimizer = make_optimizer(optimizer)
        self.admission = make_admission(admission, name, self.dim)
        self.eviction = make_eviction(eviction, name)
        self.sequence = sequence if sequence is not None else SequenceCounter()
        self._num_slots = self.optimizer.num_slots
        self._width = self.dim * (1 + self._num_slots)
        self._slot_init = self.optimizer.init_slots(1, self.dim).reshape(-1)
        self._lock = _TableLock()
        cap = max(int(initial_capacity), 16)
        # the index keeps no keys: it reads this table's row -> key array (_row_key)
        self._index = HashIndex(2 * cap, self._current_row_keys)
        self._arena = _new_arena(cap, self._width, self.dim, self._num_slots, self._fp16)
        self._set_views()
        self._row_seq = _zeros((cap,), np.int64)
        # updates per row: pushes that included the key (export min_count, admission)
        self._row_count = _zeros((cap,), np.uint32)
        self._row_key = _zeros((cap,), np.int64)
        # steps_to_live eviction: per-row step of its last update (the table's push clock)
        self._clock = 0
        self._row_step = (np.zeros(cap, dtype=np.int64)
                          if self.eviction and "steps_to_live" in self.eviction else None)
        # admission: the companion table of candidate counts (bloom: cells), set by the
        # store; routing slots the bloom cells are keyed for
        self._cand: EmbeddingTable | None = None
        self.routing_slots = DEFAULT_NUM_SLOTS
        self._default: np.ndarray | None = None
        self.policy_counters = {"admitted": 0, "rejected": 0, "evicted": 0, "dropped": 0}
        self.recalls = 0  # pushes that took their rows from a recent lookup
        self._set_policies()
        self._hwm = 0  # rows [0, hwm) have been handed out at least once
        self._bulk_mark = None  # (hwm, sequence) after a bulk load_rows batch
        self._reserved = 0  # rows reserved by reserve_load, not yet committed
        self._loads: list = []  # (first row, rows, the arrays handed out) per reservation
        self.index_from_checkpoint = False  # the last commit_load installed a saved index
        self._free = np.empty(0, dtype=np.int64)  # stack of free row ids
        self._nfree = 0
        # (keys, rows, index, index version) of the last training lookups: a step pushes
        # the keys it looked up, so its push takes their rows from here instead of probing
        # the index again (about a third of a push's time); valid while the index is the
        # same object at the same version
        # small pushes are kept too: a dense variable's table is never looked up while
        # training, and every step pushes all its rows (8 index probes a step for
        # DeepFM, 40% of pushing its dense deltas)
        self._recent: collections.deque = collections.deque(maxlen=_RECENT_LOOKUPS)
        self._scratch: tuple[np.ndarray, np.ndarray] | None = None  # _optimizer_scratch
        # change log and tombstone log (off for copies nobody exports from: replicas)
        self._track = bool(track_changes)
        self._changes = _ChangeLog()
        self._tombstones: list[tuple[int, np.ndarray, bool]] = []  # (seq, keys, moved)
        self._tomb_keys = 0
        self._tomb_floor = 0   # deletions: tombstones_since(v) is exact for v >= this
        self._moved_floor = 0  # the same for "moved" tombstones (only replicas read them)
        # segment: a promoted replica's table serving some routing slots (adopt_segment)
        self._seg: EmbeddingTable | None = None
        self._seg_mask: np.ndarray | None = None  # bool [seg_ns]: the slots it serves
        self._seg_ns = 0
        self._seg_cursor = 0  # background merge: segment rows below this were moved
        # this table's own rows of the segment's slots written before the adoption are
        # strays (left by a clean-up that never reached this PS): rows below _purge_hwm
        # are checked by the merge from _purge_cursor on, and a key of those slots that
        # misses the segment never reads one (_split)
        self._seg_seq = 0
        self._purge_cursor = self._purge_hwm = 0
        # the segment's row -> key array, kept after the merge for export plans made before
        self._seg_keys: np.ndarray | None = None
        # replicas (track_slots): each row's routing slot, noted when a key gets its row,
        # and the live rows per slot, so that a promotion finds rows of other slots by a
        # count (usually none) or a column, not by hashing every key on its critical path
        self._row_slot: np.ndarray | None = None
        self._slot_live: np.ndarray | None = None  # int64 [_slot_ns]
        self._slot_ns = 0

    # -- properties ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        # under the lock: a merge step or a delete spanning both parts moves rows between
        # them, and a count read halfway counted some rows twice or not at all
        with self._lock:
            seg = self._seg
            return len(self._index) + (len(seg._index) if seg is not None else 0)

    def __len__(self) -> int:
        return self.size

    @property
    def segment_rows(self) -> int:
        """Rows still served by a segment (0: none, or merged)."""
        with self._lock:
            seg = self._seg
            return len(seg._index) if seg is not None else 0

    @property
    def capacity(self) -> int:
        """Rows the arena holds before it has to grow (a segment's arena included)."""
        seg = self._seg
        return self._arena.shape[0] + (seg._arena.shape[0] if seg is not None else 0)

    @property
    def row_width(self) -> int:
        """Floats per row: ``dim * (1 + num_slots)`` (value then slots)."""
        return self._width

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def nbytes(self) -> int:
        seg = self._seg
        return (self._arena.nbytes + self._row_seq.nbytes + self._row_key.nbytes
                + self._row_count.nbytes
                + self._free.nbytes + self._index.nbytes
                + (seg.nbytes if seg is not None else 0))

    @property
    def log_nbytes(self) -> int:
        """Bytes held by the change log and the tombstone log (bounded, see trim_logs)."""
        seg = self._seg
        return (self._changes.nbytes + 8 * self._tomb_keys
                + (seg._changes.nbytes if seg is not None else 0))

    @property
    def config(self) -> dict:
        cfg = {"name": self.name, "dim": self.dim, "initializer": self.initializer.config,
               "optimizer": self.optimizer.config}
        if self.admission is not None:
            cfg["admission"] = self.admission
        if self.eviction is not None:
            cfg["eviction"] = self.eviction
        if self._fp16:  # only when set: float32 configs compare equal to older ones
            cfg["dtype"] = self.dtype
        return cfg

    @property
    def arena_row_bytes(self) -> int:
        """Bytes of one arena row (value + slots) in this table's storage dtype."""
        return int(self._arena.dtype.itemsize * (1 if self._fp16 else self._width))

    def set_dtype(self, dtype) -> bool:
        """Convert the arena to another storage dtype, keeping every row (a replica
        following its source, a warm start taking the job's option); float32 -> float16
        rounds the values. Returns True when the storage changed."""
        dtype = check_dtype(dtype, self.name)
        with self._lock:
            if dtype == self.dtype:
                return False
            cap = self._arena.shape[0]
            block = self._read_slice(0, cap)
            self.dtype, self._fp16 = dtype, dtype == "float16"
            self._arena = _new_arena(cap, self._width, self.dim, self._num_slots, self._fp16)
            self._set_views()
            self._write_slice(0, block)
            if self._seg is not None:
                self._seg.set_dtype(dtype)
        return True

    # -- admission / eviction -----------------------------------------------------------
    def _set_policies(self) -> None:
        adm = self.admission
        if adm is None:
            self._default = None
            return
        d = np.zeros(self.dim, dtype=np.float32)
        d[:] = adm.get("default", 0.0)
        self._default = d
        if "bloom" in adm:
            self._bloom_cells, self._bloom_hashes = bloom_size(adm["bloom"]["capacity"],
                                                               adm["bloom"]["fpp"])

    def set_policies(self, admission, eviction) -> None:
        """Adopt other admission / eviction policies (a copy following its source)."""
        adm = make_admission(admission, self.name, self.dim)
        ev = make_eviction(eviction, self.name)
        with self._lock:
            self.admission, self.eviction = adm, ev
            if ev and "steps_to_live" in ev and self._row_step is None:
                self._row_step = np.full(self._arena.shape[0], self._clock, dtype=np.int64)
            elif not (ev and "steps_to_live" in ev):
                self._row_step = None
            self._set_policies()

    def attach_candidates(self, cand: EmbeddingTable | None) -> None:
        """The companion table holding this table's admission candidates (the store's)."""
        with self._lock:
            self._cand = cand

    def _bloom_cells_of(self, keys: np.ndarray):
        """The filter cells of ``keys``: ``(codes, blocks, pos)``, each [n, k]. A cell is
        ``(slot, column)`` of the id's routing slot (``codes = column * slots + slot``);
        cells are stored BLOOM_BLOCK to a companion-table row, keyed ``blocks`` so that
        the row routes to that same slot (``slot_of(block key) == slot``): the cells move
        with their slot like rows. Each slot has its share of the filter's cells, at least
        ``2 k`` (``k`` hash functions), in whole blocks."""
        ns = np.uint64(int(self.routing_slots))
        k = self._bloom_hashes
        b = np.uint64(BLOOM_BLOCK)
        per_slot = max(-(-self._bloom_cells // int(ns)), 2 * k)
        per_slot = np.uint64(-(-per_slot // BLOOM_BLOCK) * BLOOM_BLOCK)
        slots = hash64(keys) % ns
        cols = np.empty((keys.size, k), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(k):  # k <= 16 vectorized passes
                cols[:, i] = hash64(keys, seed=i + 1) % per_slot
            codes = cols * ns + slots[:, None]
            blocks = unhash64(((cols // b) * ns + slots[:, None]).reshape(-1))
        return codes, blocks.reshape(keys.size, k), (cols % b).astype(np.int64)

    def _bloom_read(self, keys: np.ndarray, add: np.ndarray | None = None) -> np.ndarray:
        """float64 [n]: the filter's estimate for distinct ``keys`` (the smallest of their
        cells); with ``add`` (float [n]), first add it to each key's cells (a cell two of
        a key's hash functions chose counts it once) and write the cells back."""
        cand = self._cand
        codes, blocks, pos = self._bloom_cells_of(keys)
        n, k = codes.shape
        ub, binv = np.unique(blocks.reshape(-1), return_inverse=True)
        cells = cand.lookup(ub, insert_missing=False).astype(np.float64)  # [nb, BLOCK]
        flat_pos = pos.reshape(-1)
        if add is not None:
            order = np.argsort(codes, axis=1)
            sc = np.take_along_axis(codes, order, axis=1)
            w = np.repeat(np.asarray(add, np.float64)[:, None], k, axis=1)
            dup = np.zeros((n, k), dtype=bool)
            dup[:, 1:] = sc[:, 1:] == sc[:, :-1]
            np.put_along_axis(w, order, np.where(dup, 0.0, w), axis=1)
            cells += np.bincount(binv * BLOOM_BLOCK + flat_pos, weights=w.reshape(-1),
                                 minlength=cells.size).reshape(cells.shape)
            np.minimum(cells, float(1 << 24), out=cells)
            cand.insert(ub, cells.astype(np.float32))
        return cells[binv, flat_pos].reshape(n, k).min(axis=1)

    def _admit(self, keys: np.ndarray) -> np.ndarray:
        """Count one sighting per occurrence of ``keys`` (ids without a row, under the
        lock); bool [n]: whose count reached ``min_count`` (they get a row now)."""
        cand = self._cand
        need = self.admission["min_count"]
        if cand is None or need <= 1:
            return np.ones(keys.size, dtype=bool)
        uk, inv, cnt = np.unique(keys, return_inverse=True, return_counts=True)
        if "bloom" in self.admission:
            ok = self._bloom_read(uk, cnt) >= need
        else:
            est = cand.lookup(uk, insert_missing=False)[:, 0] + cnt
            ok = est >= need
            if not ok.all():
                wait = np.flatnonzero(~ok)
                cand.insert(uk.take(wait), est.take(wait).astype(np.float32)[:, None])
            if ok.any():  # admitted: no longer a candidate (the delete reaches every copy)
                cand.delete(uk[ok])
        return ok.take(inv)

    def candidate_count(self, keys) -> np.ndarray:
        """float64 [n]: the admission count of ``keys`` so far (bloom: its estimate); 0
        for a table without admission or an id already admitted (exact counter)."""
        keys = _check_keys(keys)
        cand = self._cand
        if cand is None or self.admission is None:
            return np.zeros(keys.size)
        with self._lock:
            if "bloom" in self.admission:
                uk, inv = np.unique(keys, return_inverse=True)
                return self._bloom_read(uk).take(inv)
            return cand.lookup(keys, insert_missing=False)[:, 0].astype(np.float64)

    def policy_stats(self) -> dict:
        """Admission / eviction counters of this table on this PS (since it started) and
        the candidates held now (bloom: filter cells allocated)."""
        cand = self._cand
        out = dict(self.policy_counters)
        out["candidates"] = (0 if cand is None else
                             cand.size * (cand.dim if "bloom" in self.admission else 1))
        out["rows"] = self.size
        return out

    def _due(self, part: EmbeddingTable, rows: np.ndarray) -> np.ndarray:
        """bool [n]: which live ``rows`` of ``part`` (this table or its segment) are due
        for eviction (under the lock)."""
        ev = self.eviction
        due = np.zeros(rows.size, dtype=bool)
        if "steps_to_live" in ev and part._row_step is not None:
            due |= (self._clock - part._row_step.take(rows)) > ev["steps_to_live"]
        if "l2_below" in ev:
            bound = np.float32(ev["l2_below"]) ** 2
            step = max(1024, _CHUNK_FLOATS // max(self.dim, 1))
            for s in range(0, rows.size, step):
                v = part._gather_values(rows[s:s + step])
                due[s:s + step] |= np.einsum("ij,ij->i", v, v) < bound
        return due

    def _evictable(self, part: EmbeddingTable) -> np.ndarray:
        """Keys of ``part``'s live rows due for eviction (under the lock)."""
        live = np.flatnonzero(part._row_seq[:part._hwm] > 0)
        return part._row_key.take(live[self._due(part, live)])

    def _still_due(self, keys: np.ndarray) -> np.ndarray:
        """Those of ``keys`` that still hold a row due for eviction (under the lock): a
        row updated since the scan is kept."""
        split = self._split(keys) if self._seg is not None else None
        parts = [(self, keys)] if split is None else \
            [(self, keys.take(split[2])), (self._seg, keys.take(split[0]))]
        out = []
        for part, k in parts:
            rows = part._index.find(k)
            hit = np.flatnonzero(rows >= 0)
            k, rows = k.take(hit), rows.take(hit)
            out.append(k[self._due(part, rows)])
        return out[0] if len(out) == 1 else np.concatenate(out)

    EVICT_CHUNK_ROWS = 1 << 14  # rows deleted per table-lock hold

    def evict(self, slot_mask: np.ndarray | None = None) -> int:
        """Delete the rows due under the eviction policy (of the slots set in
        ``slot_mask``, all without), through :meth:`delete`: a tombstone is logged, so the
        replica, migrations and the next incremental checkpoint drop them too, and their
        arena rows are reused. One scan under the lock, then deletes of EVICT_CHUNK_ROWS
        rows per lock hold (each re-checked: a row updated meanwhile stays). Returns the
        rows deleted (0 without a policy)."""
        if self.eviction is None:
            return 0
        with self._lock:
            keys = self._evictable(self)
            seg = self._seg
            if seg is not None:
                sk = self._evictable(seg)
                keys = np.concatenate([keys, sk[self._seg_mask[slot_of(sk, self._seg_ns)]]])
        if slot_mask is not None and keys.size:
            keys = keys[slot_mask[slot_of(keys, int(slot_mask.size))]]
        n = 0
        for i in range(0, keys.size, self.EVICT_CHUNK_ROWS):
            with self._lock:
                if self.eviction is None:
                    break
                k = self._still_due(keys[i:i + self.EVICT_CHUNK_ROWS])
                d = self.delete(k) if k.size else 0
                self.policy_counters["evicted"] += d
                n += d
            _yield(self._lock)
        return n

    # -- row allocation -----------------------------------------------------------------
    def _grow_arena(self, need_rows: int) -> None:
        cap = self._arena.shape[0]
        if need_rows <= cap:
            return
        new_cap = max(2 * cap, need_rows)
        hwm = self._hwm
        # untouched pages are mapped lazily by the OS, only [:hwm] is ever copied; within
        # a reservation nothing is (_grown)
        self._arena = _grown(self._arena, new_cap, hwm)
        self._row_seq = _grown(self._row_seq, new_cap, hwm)
        self._row_count = _grown(self._row_count, new_cap, hwm)
        self._row_key = _grown(self._row_key, new_cap, hwm)
        if self._row_step is not None:
            self._row_step = _grown(self._row_step, new_cap, hwm)
        if self._row_slot is not None:
            self._row_slot = _grown(self._row_slot, new_cap, hwm)
        self._set_views()

    def _current_row_keys(self) -> np.ndarray:
        return self._row_key

    def _set_views(self) -> None:
        # Row-granular views of the arena: numpy moves a whole row (or the value part of
        # a row) as ONE opaque item, which makes gathers/scatters 2-3x faster than 2-D
        # fancy indexing.
        a = self._arena
        if self._fp16:
            self._rec = a.dtype
            self._row_dtype = np.dtype((np.void, a.dtype.itemsize))
            self._arena_v = a.view(self._row_dtype)
            self._value_v = np.ndarray((a.shape[0],), dtype=np.dtype((np.void, 2 * self.dim)),
                                       buffer=a, strides=(a.dtype.itemsize,))
            return
        self._row_dtype = np.dtype((np.void, 4 * self._width))
        self._arena_v = a.view(self._row_dtype).reshape(-1)
        self._value_v = np.ndarray((a.shape[0],), dtype=np.dtype((np.void, 4 * self.dim)),
                                   buffer=a, strides=(4 * self._width,))

    def _widen(self, rec: np.ndarray) -> np.ndarray:
        """float16 records [n] -> float32 rows [n, row_width]."""
        out = np.empty((rec.shape[0], self._width), dtype=np.float32)
        out[:, :self.dim] = rec["v"]
        if self._num_slots:
            out[:, self.dim:] = rec["s"]
        return out

    def _narrow(self, block: np.ndarray) -> np.ndarray:
        """float32 rows [n, row_width] -> float16 records [n] (values rounded to nearest)."""
        rec = np.empty(block.shape[0], dtype=self._rec)
        rec["v"] = block[:, :self.dim]
        if self._num_slots:
            rec["s"] = block[:, self.dim:]
        return rec

    def _gather_rows(self, rows: np.ndarray) -> np.ndarray:
        """Full rows (value + slots), float32 [n, row_width], a copy."""
        if self._fp16:
            return self._widen(self._arena_v.take(rows).view(self._rec))
        return self._arena_v.take(rows).view(np.float32).reshape(rows.size, self._width)

    def _scatter_rows(self, rows: np.ndarray, block: np.ndarray) -> None:
        """arena[rows] = block (float32 [n, row_width], C-contiguous); last write wins."""
        if self._fp16:
            np.put(self._arena_v, rows, self._narrow(block).view(self._row_dtype))
            return
        np.put(self._arena_v, rows, block.view(self._row_dtype).reshape(-1))

    def _read_slice(self, start: int, stop: int) -> np.ndarray:
        """Arena rows [start, stop) as float32 [n, row_width] (a copy for float16)."""
        if self._fp16:
            return self._widen(self._arena[start:stop])
        return self._arena[start:stop]

    def _write_slice(self, start: int, block: np.ndarray) -> None:
        """Arena rows [start, start + n) = float32 rows ``block`` [n, row_width]."""
        if self._fp16:
            self._arena[start:start + block.shape[0]] = self._narrow(block)
        else:
            self._arena[start:start + block.shape[0]] = block

    def _allocate(self, m: int) -> np.ndarray:
        take = min(m, self._nfree)
        rows = np.empty(m, dtype=np.int64)
        if take:
            rows[:take] = self._free[self._nfree - take:self._nfree]
            self._nfree -= take
        fresh = m - take
        if fresh:
            self._grow_arena(self._hwm + fresh)
            rows[take:] = np.arange(self._hwm, self._hwm + fresh, dtype=np.int64)
            self._hwm += fresh
        return rows

    def _allocate_fresh(self, m: int) -> np.ndarray:
        """``m`` new rows past the high-water mark (never a freed row): rows merged from a
        segment must land after any position a paged export has already scanned."""
        self._grow_arena(self._hwm + m)
        rows = np.arange(self._hwm, self._hwm + m, dtype=np.int64)
        self._hwm += m
        return rows

    def _release(self, rows: np.ndarray, live: bool = True) -> None:
        """Rows back to the free list (``live``: they held keys until now, which the slot
        column counted; rows of a reservation never did)."""
        need = self._nfree + rows.size
        if need > self._free.size:
            free = np.empty(max(need, 2 * self._free.size, 64), dtype=np.int64)
            free[:self._nfree] = self._free[:self._nfree]
            self._free = free
        self._free[self._nfree:need] = rows
        self._nfree = need
        self._row_seq[rows] = 0
        self._row_count[rows] = 0
        if live:
            self._uncount_slots(rows)

    def _init_rows(self, rows: np.ndarray, keys: np.ndarray, seq: int) -> None:
        """Write fresh rows: initializer value + initial slots."""
        self._scatter_rows(rows, self._with_fresh_slots(self.initializer(keys)))
        self._row_seq[rows] = seq
        self._row_count[rows] = 0
        if self._row_step is not None:
            self._row_step[rows] = self._clock

    def _create_missing(self, keys: np.ndarray, rows: np.ndarray, seq_holder: list,
                        log: bool = True) -> None:
        """Fill ``rows`` (-1 entries) by inserting the missing keys with initial values.
        Takes a sequence number (stored in ``seq_holder``) if it has to write."""
        miss = np.flatnonzero(rows < 0)
        if miss.size == 0:
            return
        if not seq_holder:
            seq_holder.append(self.sequence.next())
        got, new_keys, new_rows = self._index.insert_new(keys.take(miss), self._allocate)
        self._note_slots(new_rows, new_keys)
        self._init_rows(new_rows, new_keys, seq_holder[0])
        if log:
            self._log_write(seq_holder[0], new_rows)
        rows[miss] = got

    def _log_write(self, seq: int, rows: np.ndarray) -> None:
        """Record the rows a batch stamped with ``seq`` (under the table lock)."""
        self._log_range(seq, 0, rows.size, rows)

    def _log_range(self, seq: int, r0: int, n: int, rows: np.ndarray | None = None) -> None:
        """:meth:`_log_write` of ``rows``, or else of rows ``[r0, r0 + n)``. A batch too
        large to keep is not listed (a restore's 4M rows: 32 MB written to be dropped,
        ~60 ms): capping would drop it, and every batch before it, anyway."""
        if not self._track:
            return
        # beyond about 1/16 of the rows a scan is as cheap as the log (_changed_rows)
        limit = max(_LOG_MIN_CAP, self._arena.shape[0] // 16)
        if n > limit:
            self._changes.drop_through(seq)
            return
        self._changes.append(seq, np.arange(r0, r0 + n, dtype=np.int64) if rows is None
                             else rows)
        self._changes.cap(limit)

    def _with_fresh_slots(self, values: np.ndarray) -> np.ndarray:
        """float32 [n, row_width] rows: ``values`` followed by initial slots."""
        if not self._num_slots:
            return np.ascontiguousarray(values, dtype=np.float32)
        block = np.empty((values.shape[0], self._width), dtype=np.float32)
        block[:, :self.dim] = values
        block[:, self.dim:] = self._slot_init
        return block

    def _gather_values(self, rows: np.ndarray) -> np.ndarray:
        """Values float32 [n, dim] of rows (one strided gather of the value part)."""
        if self._fp16:
            return (self._value_v[rows].view(np.float16).reshape(rows.size, self.dim)
                    .astype(np.float32))
        if self._num_slots == 0:
            g = self._arena_v.take(rows)
        else:
            g = self._value_v[rows]
        return g.view(np.float32).reshape(rows.size, self.dim)

    def _find_duplicates(self, rows: np.ndarray):
        """O(n) duplicate detection, using ``_row_seq`` (indexed by row id) as scratch:
        every caller stamps ``_row_seq[rows]`` right after, under the same lock hold. A
        separate int64 scratch array was 8 resident bytes per row of a trained table.

        Returns ``None`` when ``rows`` has no duplicates (the common, fast case), else
        ``rep``: for each batch position, the position of its group's representative
        (one surviving writer per distinct row).
        """
        ar = np.arange(rows.size, dtype=np.int64)
        mark = self._row_seq
        mark[rows] = ar
        rep = mark.take(rows)
        if (rep == ar).all():
            return None
        return rep

    def _sum_duplicates(self, rows, grads, rep):
        """Distinct rows and their summed gradients (no sort: representatives keep their
        gradient, the few non-representatives are added with ``np.add.at``)."""
        ar = np.arange(rows.size, dtype=np.int64)
        is_rep = rep == ar
        rsel = np.flatnonzero(is_rep)
        nsel = np.flatnonzero(~is_rep)
        gid = np.empty(rows.size, dtype=np.int64)
        gid[rsel] = np.arange(rsel.size, dtype=np.int64)
        sums = grads.take(rsel, axis=0)
        np.add.at(sums, gid.take(rep.take(nsel)), grads.take(nsel, axis=0))
        return rows.take(rsel), sums

    def _last_occurrences(self, rows: np.ndarray) -> np.ndarray:
        """Batch positions of the last occurrence of each distinct row (``_row_seq`` as
        scratch, like :meth:`_find_duplicates`)."""
        ar = np.arange(rows.size, dtype=np.int64)
        mark = self._row_seq
        mark[rows] = -1
        np.maximum.at(mark, rows, ar)
        return np.flatnonzero(mark.take(rows) == ar)

    def _apply_optimizer(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """Gather rows, run the optimizer, scatter back; in chunks that stay in cache.

        Rows are gathered whole (one random access per row), then transposed -- moving
        each ``dim``-float vector as one opaque item -- into plane-major order
        ``[1 + num_slots, n, dim]``, so the optimizer's element-wise math runs on
        contiguous arrays (numpy is ~10x slower on the interleaved [n, dim] views).
        """
        k, dim = self._num_slots, self.dim
        vec = np.dtype((np.void, 4 * dim))
        step = max(1024, _CHUNK_FLOATS // self._width)
        for s in range(0, rows.size, step):
            r, g = rows[s:s + step], grads[s:s + step]
            m = r.size
            rows_buf, planes_buf = self._optimizer_scratch(min(rows.size, step), vec)
            if self._fp16:  # float32 math on the widened rows, rounded back on the scatter
                block = self._gather_rows(r).view(np.dtype((np.void, 4 * self._width)))
                block = block.reshape(-1)
            else:  # mode="clip": no buffered copy for ``out`` (the rows are valid)
                block = np.take(self._arena_v, r, out=rows_buf[:m], mode="clip")
            if k == 0:
                vals = block.view(np.float32).reshape(m, dim)
                self.optimizer.apply(vals, None, g)
            else:
                bv = block.view(vec).reshape(m, 1 + k)
                pv = planes_buf[:(1 + k) * m].reshape(1 + k, m)
                np.copyto(pv, bv.T)
                planes = pv.view(np.float32).reshape(1 + k, m, dim)
                self.optimizer.apply(planes[0], planes[1:].transpose(1, 0, 2), g)
                bv[...] = pv.T
            if self._fp16:
                self._scatter_rows(r, block.view(np.float32).reshape(m, self._width))
            else:
                np.put(self._arena_v, r, block)

    def _optimizer_scratch(self, m: int, vec: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Buffers for the optimizer's gather of ``m`` rows and their plane-major copy,
        kept between updates: at most one chunk each (2 MB of rows, or 1,024 rows of a
        table wider than 512 floats), sized by the largest push. A PS fixes glibc's mmap
        threshold at 1 MB (``bound_malloc_retention``), so every larger block is a new
        mapping, page-faulted and zeroed: two per push. Reused, an Adam push of 15k
        rows of dim 8 took 1.20 instead of 2.17 ms. Lock held."""
        buf = self._scratch
        rows_m = 0 if self._fp16 else m  # float16 rows are gathered widened, elsewhere
        if buf is None or buf[0].size < rows_m or buf[0].dtype != self._row_dtype \
                or buf[1].dtype != vec or buf[1].size < (1 + self._num_slots) * m:
            buf = self._scratch = (np.empty(rows_m, self._row_dtype),
                                   np.empty((1 + self._num_slots) * m, vec))
        return buf

    # -- public API ---------------------------------------------------------------------
    def lookup(self, keys, insert_missing: bool = True) -> np.ndarray:
        """Values float32 [n, dim] of ``keys`` (any order, duplicates allowed).

        Missing keys get their deterministic initial value; with ``insert_missing`` they
        are also inserted (slots initialized, stamped with one new sequence number),
        otherwise the table is not modified.
        """
        keys = _check_keys(keys)
        with self._lock:
            split = self._split(keys) if self._seg is not None else None
            if split is None:
                return self._lookup_main(keys, insert_missing)
            spos, srows, mpos = split
            out = np.empty((keys.size, self.dim), dtype=np.float32)
            out[spos] = self._seg._gather_values(srows)
            if mpos.size:
                out[mpos] = self._lookup_main(keys.take(mpos), insert_missing)
            return out

    def _lookup_main(self, keys: np.ndarray, insert_missing: bool) -> np.ndarray:
        """``lookup`` in this table's own index and arena (not the segment)."""
        with self._lock:
            rows = self._index.find(keys)
            if self.admission is not None:
                return self._lookup_admitted(keys, rows, insert_missing)
            if insert_missing:
                self._create_missing(keys, rows, [])
                self._remember(keys, rows)
                return self._gather_values(rows)
            miss = np.flatnonzero(rows < 0)
            if miss.size == 0:
                return self._gather_values(rows)
            out = np.empty((keys.size, self.dim), dtype=np.float32)
            out[miss] = self.initializer(keys.take(miss))
            if miss.size < keys.size:
                hit = np.flatnonzero(rows >= 0)
                out[hit] = self._gather_values(rows.take(hit))
            return out

    def _remember(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Keep the rows a lookup (or a small push) found, all present, for a push of the
        same keys. Lock held; only for this table's own index (no segment, no admission)."""
        if self._seg is None and self.admission is None and 0 < keys.size <= _RECENT_MAX_KEYS:
            self._recent.append((np.array(keys, copy=True), rows.copy(), self._index,
                                 self._index.version))

    def _recall(self, keys: np.ndarray) -> np.ndarray:
        """The rows of ``keys``: from a recent lookup of exactly these keys if no row of
        the index changed since, else probed. Lock held."""
        index = self._index
        for k, rows, ix, version in reversed(self._recent):
            if ix is index and version == index.version and k.shape == keys.shape \
                    and k[0] == keys[0] and np.array_equal(k, keys):
                self.recalls += 1
                return rows.copy()
        return index.find(keys)

    def _lookup_admitted(self, keys: np.ndarray, rows: np.ndarray,
                         insert_missing: bool) -> np.ndarray:
        """``_lookup_main`` of a table with admission: ids without a row are counted
        (training lookups) and get a row once admitted; the others read the default."""
        miss = np.flatnonzero(rows < 0)
        if miss.size and insert_missing:
            ok = self._admit(keys.take(miss))
            if ok.any():
                sel = miss[ok]
                sub = rows.take(sel)
                self._create_missing(keys.take(sel), sub, [])
                rows[sel] = sub
                self.policy_counters["admitted"] += int(np.unique(keys.take(sel)).size)
                miss = miss[~ok]
            self.policy_counters["rejected"] += int(miss.size)
        out = np.empty((keys.size, self.dim), dtype=np.float32)
        if miss.size < keys.size:
            hit = np.flatnonzero(rows >= 0)
            out[hit] = self._gather_values(rows.take(hit))
        if miss.size:
            out[miss] = self._default
        return out

    def apply_gradients(self, keys, grads, update=None) -> int:
        """Apply the optimizer to rows of ``keys`` with ``grads`` float32 [n, dim].

        Gradients of duplicate keys are summed first. Missing keys are created with their
        initial value, then updated. Non-finite gradients raise ValueError and change
        nothing. Returns the sequence number stamped on the rows (0 for an empty batch).
        ``update``: the logical update these rows are part of (a push call's id); calls
        with the same one in a row are one step of the optimizer (Adam's t). None: this
        call is a step.
        """
        keys = _check_keys(keys)
        grads = _check_floats(grads, (keys.size, self.dim), f"table '{self.name}': gradients")
        if keys.size == 0:
            return 0
        with self._lock:
            self.optimizer.begin_update(object() if update is None else update)
            self._clock += 1  # steps_to_live: one step per gradient batch
            split = self._split(keys) if self._seg is not None else None
            if split is None:
                return self._apply_main(keys, grads)
            spos, srows, mpos = split
            seq = (self._apply_main(keys.take(mpos), grads.take(mpos, axis=0)) if mpos.size
                   else self.sequence.next())
            self._seg._apply_rows(srows, grads.take(spos, axis=0), seq, self._clock)
            return seq

    def _apply_main(self, keys: np.ndarray, grads: np.ndarray) -> int:
        with self._lock:
            if self.admission is not None:
                rows = self._index.find(keys)  # no row is created by a push: drop the rest
                hit = rows >= 0
                if not hit.all():
                    self.policy_counters["dropped"] += int(keys.size - np.count_nonzero(hit))
                    sel = np.flatnonzero(hit)
                    rows, grads = rows.take(sel), grads.take(sel, axis=0)
                seq = self.sequence.next()
                if rows.size:
                    self._apply_rows(rows, grads, seq, self._clock)
                return seq
            rows = self._recall(keys) if self._seg is None else self._index.find(keys)
            return self._apply_found(keys, rows, grads)

    def _apply_found(self, keys: np.ndarray, rows: np.ndarray, grads: np.ndarray) -> int:
        """The update of ``keys`` whose rows ``find`` gave (-1: missing, created here and
        filled into ``rows``); no admission. Returns the stamped sequence number."""
        seq = []
        self._create_missing(keys, rows, seq, log=False)
        seq = seq[0] if seq else self.sequence.next()
        self._apply_rows(rows, grads, seq, self._clock)
        return seq

    def apply_and_lookup(self, keys, grads, update=None) -> np.ndarray:
        """``apply_gradients(keys, grads)`` followed by ``lookup(keys, insert_missing=False)``
        under one lock hold, the values read from the rows the update found: one index
        probe and one argument check instead of two (a push that returns its rows: every
        dense sync, fresh overlapped lookups)."""
        keys = _check_keys(keys)
        grads = _check_floats(grads, (keys.size, self.dim), f"table '{self.name}': gradients")
        with self._lock:
            if keys.size == 0 or self._seg is not None or self.admission is not None:
                self.apply_gradients(keys, grads, update)  # rows split or dropped: general
                return self.lookup(keys, insert_missing=False)
            self.optimizer.begin_update(object() if update is None else update)
            self._clock += 1  # as apply_gradients
            recalls = self.recalls
            rows = self._recall(keys)
            self._apply_found(keys, rows, grads)
            if recalls == self.recalls and keys.size <= _PUSH_MEMO_MAX_KEYS:
                self._remember(keys, rows)  # probed: all present now (missing ones made)
            return self._gather_values(rows)

    def _apply_rows(self, rows: np.ndarray, grads: np.ndarray, seq: int, step: int) -> None:
        """The optimizer step on existing ``rows`` (duplicates summed), stamped ``seq``
        (and ``step``, for steps_to_live eviction)."""
        rep = self._find_duplicates(rows)
        if rep is not None:
            rows, grads = self._sum_duplicates(rows, grads, rep)
        self._row_seq[rows] = seq  # also ends _find_duplicates' scratch use
        self._apply_optimizer(rows, grads)
        self._row_count[rows] += np.uint32(1)  # rows are unique here
        if self._row_step is not None:
            self._row_step[rows] = step
        self._log_write(seq, rows)

    def insert(self, keys, values, only_if_absent: bool = False) -> int:
        """Set values float32 [n, dim] (optimizer slots reset to their initial values).

        With ``only_if_absent`` existing keys are left alone. For duplicate keys the last
        occurrence wins. Returns the stamped sequence number (0 if nothing was written).
        """
        keys = _check_keys(keys)
        values = _check_floats(values, (keys.size, self.dim), f"table '{self.name}': values")
        return self._upsert(keys, values, full_rows=False, only_if_absent=only_if_absent)

    def reconfigure(self, initializer, optimizer) -> bool:
        """Adopt another initializer and optimizer, keeping every row's value (a warm start
        whose job changed hyperparameters). The optimizer slots are kept when the optimizer
        is the same kind (same slot layout), else reset to their initial values; returns
        True when they were reset. Sequence numbers are unchanged: no row is rewritten."""
        init = make_initializer(initializer, self.dim)
        opt = make_optimizer(optimizer)
        with self._lock:
            reset = opt.name != self.optimizer.name or opt.num_slots != self._num_slots
            if reset:
                width = self.dim * (1 + opt.num_slots)
                cap = self._arena.shape[0]
                values = self._read_slice(0, cap)[:, :self.dim]
                block = np.empty((cap, width), dtype=np.float32)
                block[:, :self.dim] = values
                slot_init = opt.init_slots(1, self.dim).reshape(-1)
                block[:, self.dim:] = slot_init
                self._arena = _new_arena(cap, width, self.dim, opt.num_slots, self._fp16)
                self._width, self._num_slots = width, opt.num_slots
                self._slot_init = slot_init
                self._set_views()
                self._write_slice(0, block)
            self.initializer, self.optimizer = init, opt
            if self._seg is not None:
                self._seg.reconfigure(initializer, optimizer)
                self._seg.initializer, self._seg.optimizer = init, opt
        return reset

    def import_rows(self, keys, rows) -> int:
        """Upsert full rows float32 [n, row_width] (value + slots, as from ``export_rows``),
        or [n, row_width + 1] with each row's update count last (``with_counts=True``
        exports: how counts travel with rows); stamps one new sequence number, which is
        returned (0 for an empty batch). Without counts, a row keeps its count."""
        keys = _check_keys(keys)
        rows = np.asarray(rows)
        counted = rows.ndim == 2 and rows.shape[1] == self._width + 1
        rows = _check_floats(rows, (keys.size, self._width + counted),
                             f"table '{self.name}': rows")
        if not counted:
            return self._upsert(keys, rows, full_rows=True, only_if_absent=False)
        counts = np.clip(rows[:, self._width], 0, 2**32 - 1).astype(np.uint32)
        return self._upsert(keys, np.ascontiguousarray(rows[:, :self._width]), full_rows=True,
                            only_if_absent=False, counts=counts)

    # announcements of rows still arriving add up for this long (then they are forgotten:
    # a stream that broke off must not make every later import over-reserve)
    IMPORT_ANNOUNCE_SECONDS = 120.0

    def reserve_import(self, n: int) -> None:
        """``n`` rows are about to be imported (a migration's snapshot): size the arena and
        the index for them once, instead of doubling both on the way. Announcements of
        streams running at once add up (a scale-out's new PS hears from every source).
        An empty or small index is made for all of them at once; a large one starts
        growing to its final size incrementally (the imports move the rest). A large index
        with deleted positions (a scale-in's destination, after an earlier clean-up) is
        rebuilt without them in the same growth, even where it had room, when the rows
        announced are at least a quarter of its keys: the imports end it early
        (:meth:`import_block`) and the rest of their rows are placed in bulk."""
        n = int(n)
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            target, at = getattr(self, "_import_target", (0, 0.0))
            base = target if now - at < self.IMPORT_ANNOUNCE_SECONDS else 0
            target = max(base, self._hwm) + n
            self._import_target = (target, now)
            more = target - self._hwm  # rows still to come, this stream's and the others'
            self._grow_arena(target)
            idx = self._index
            if idx.growing:
                return
            if len(idx) == 0:
                if not idx.can_place_rows(more):
                    idx.size_for(more)
            elif len(idx) < INCREMENTAL_MIN_KEYS:
                idx.reserve(more)  # small: rebuilt at once for every row announced
            else:
                # a rebuild moves every key once: worth it for an import of a real share
                # of the table (a scale-in's destination takes 1/2 to 1/3 more rows), not
                # for a few rows, which would leave most of the moving to training's inserts
                idx.reserve(more, step=0, purge=4 * more >= len(idx))

    # Positions of a growth under way moved per imported row (import_block): a growth or
    # purge set off by reserve_import then ends within the first ~1/5 of a scale-in's
    # snapshot (a 4M-position index in 4k-row pieces: 32 pieces, a few ms each), and the
    # rest of the rows take the bulk path instead of find + claim against two indexes.
    IMPORT_GROWTH_PER_ROW = 32

    def check_block(self, keys, rows, counts):
        """The checks of :meth:`import_block` (keys, finite rows of this table's width,
        uint32 counts), raising ValueError/TypeError; returns the checked arrays. A caller
        importing a batch in pieces checks it whole first, so a bad row refuses all of it."""
        keys = _check_keys(keys)
        rows = _check_floats(rows, (keys.size, self._width), f"table '{self.name}': rows")
        counts = np.asarray(counts)
        if counts.dtype != np.uint32 or counts.shape != keys.shape:
            raise ValueError(f"table '{self.name}': counts must be uint32 of shape "
                             f"{keys.shape}, got {counts.dtype} {counts.shape}")
        return keys, rows, counts

    def import_block(self, keys, rows, counts) -> int:
        """:meth:`import_rows` of rows in the store's layout: float32 ``rows`` [n,
        row_width] and their uint32 update ``counts`` [n] (``export_slots(...,
        with_counts="apart")``), e.g. views of a received message. The rows are checked
        (finite) and copied once, into the arena. Into a table whose index has room and no
        deleted positions (a migration's new PS, sized by :meth:`reserve_import`) the rows
        go to consecutive new arena rows and their keys are placed in one bulk pass
        (``HashIndex.place_rows``; a key already here keeps the imported row); freed rows
        are reused first (sorted, as ``place_rows`` needs). A growth under way moves
        ``IMPORT_GROWTH_PER_ROW`` positions per row first. Otherwise as
        :meth:`import_rows`. Returns the sequence number stamped (0: empty batch)."""
        keys, rows, counts = self.check_block(keys, rows, counts)
        n = int(keys.size)
        if n == 0:
            return 0
        with self._lock:
            if self._index.growing and self._seg is None:
                self._index.advance(self.IMPORT_GROWTH_PER_ROW * n)
            if (self._seg is not None or self._reserved
                    or not self._index.can_place_rows(n)):
                return self._upsert(keys, rows, True, False, counts)
            seq = self.sequence.next()
            if self._nfree:  # freed rows first (a scale-in's destination has many)
                new = np.sort(self._allocate(n))
                self._row_key[new] = keys  # the index reads keys from here
                dead = self._index.place_rows(keys, 0, rows=new)
                self._scatter_rows(new, rows)
                at = new
            else:
                r0 = self._hwm
                self._grow_arena(r0 + n)
                self._hwm = r0 + n
                new = np.arange(r0, r0 + n, dtype=np.int64)
                self._row_key[r0:r0 + n] = keys  # the index reads keys from here
                dead = self._index.place_rows(keys, r0)
                self._write_slice(r0, rows)
                at = slice(r0, r0 + n)
            self._row_count[at] = counts
            self._row_seq[at] = seq
            if self._row_step is not None:  # written (imported, moved) rows: a fresh lease
                self._row_step[at] = self._clock
            self._note_slots(new, keys)
            if dead.size:  # keys present before, or repeated in the batch: the later row won
                self._release(dead)
            self._log_write(seq, new)
            return seq

    def load_rows(self, keys: np.ndarray, rows) -> int:
        """Bulk :meth:`import_rows` for restores: int64 ``keys`` [n] and float32 ``rows``
        [n, row_width + 1] (update count last), from a checksummed checkpoint, so the
        finiteness check of ``import_rows`` is skipped. ``rows`` may also be a list of
        such arrays (consecutive parts of the batch, e.g. the chunks a restore read; ``keys``
        are theirs, concatenated): each part is copied into the arena as is, never joined.
        Same effect as ``import_rows`` otherwise (one new sequence number, present keys
        overwritten, the last of duplicate keys wins).

        Into an empty table, and then for every further batch of the same load (nothing
        else wrote to the store in between, :meth:`end_load` not called), rows go to
        consecutive new arena rows and the index places their keys in bulk
        (``HashIndex.place_rows``): a key already loaded is a superseded copy, whose old
        row is freed. Into a table that had rows before, keys are found or placed in one
        probing pass (``HashIndex.find_or_insert``) and present keys overwritten in place."""
        keys = _check_keys(keys)
        parts = list(rows) if isinstance(rows, (list, tuple)) else [np.asarray(rows)]
        width = self._width
        if (sum(p.shape[0] for p in parts) != keys.size
                or any(p.dtype != np.float32 or p.ndim != 2 or p.shape[1] != width + 1
                       for p in parts)):
            return self.import_rows(keys, parts[0] if len(parts) == 1 else np.concatenate(parts))
        n = int(keys.size)
        if n == 0:
            return 0
        with self._lock:
            if self._width != width:
                raise ValueError(f"table '{self.name}' was reconfigured during a load")
            if self._bulk_ok(n):
                return self._bulk_load(keys, parts)
            return self._load_present(keys, parts[0] if len(parts) == 1 else np.concatenate(parts))

    def end_load(self) -> None:
        """End a bulk load: the next :meth:`load_rows` treats the table as one that had
        rows before (find-or-insert, overwrite in place) unless it is empty."""
        with self._lock:
            self._bulk_mark = None

    def _bulk_ok(self, n: int) -> bool:
        """Under the lock: may ``n`` rows be bulk-loaded (see :meth:`load_rows`)?"""
        if self._seg is not None:
            return False
        if self._hwm == 0 and len(self._index) == 0 and not self._index.growing:
            # first batch into an empty table: size the index for the rows the arena was
            # made for (a restore creates the table at its checkpoint's row count), at the
            # load a rehash would target, so the load never grows it on the way
            self._index.size_for(max(n, self._arena.shape[0]))
        elif self._bulk_mark != (self._hwm, self.sequence.value):
            return False
        if self._index.can_place_rows(n + self._reserved):
            return True
        if self._nfree or self._index.num_deleted or self._index.growing or self._reserved:
            return False
        # the load outgrew the index (a table made small, then restored into): every key
        # in it came from this load, on rows [0, hwm) with none superseded (no free
        # rows), so a bigger index is built in bulk from them, sized geometrically
        idx = HashIndex(16, self._current_row_keys)
        idx.size_for(max(2 * (self._hwm + n), self._arena.shape[0]))
        idx.place_rows(self._row_key[:self._hwm], 0)
        self._index = idx
        return idx.can_place_rows(n)

    def reserve_load(self, n: int):
        """Reserve ``n`` consecutive new rows for a restore that reads rows straight into
        the table's arrays (checkpoint format 4). Only into an empty table or after
        earlier loads of the same restore (as :meth:`load_rows`' bulk path), float32
        storage, no segment; else None. Returns ``(first_row, keys, rows, counts)``: views
        of the row -> key array, the arena (float32 [n, row_width]) and the update counts
        (uint32) for those rows, to be filled by the caller (from any thread) and made
        live with :meth:`commit_load`, in order. Until then the rows are not live: no
        lookup, export or index sees them."""
        n = int(n)
        with self._lock:
            if n <= 0 or self._fp16 or self._seg is not None or not self._bulk_ok(n):
                return None
            r0 = self._hwm
            self._grow_arena(r0 + n)
            self._hwm = r0 + n
            self._reserved += n
            self._bulk_mark = (self._hwm, self.sequence.value)
            views = (self._row_key[r0:r0 + n], self._arena[r0:r0 + n], self._row_count[r0:r0 + n])
            # the arrays the caller fills: if a write to the table (a PS restoring while it
            # serves other slots) grows the arena meanwhile, commit_load copies from these
            self._loads.append((r0, n, views))
            return (r0, *views)

    def _settle_reserved(self, r0: int, n: int, reserved: int) -> None:
        """Under the lock: rows ``[r0, r0 + reserved)`` of a reservation are done being
        filled. If the arena was re-allocated since :meth:`reserve_load` (another writer
        grew it), the filled rows are copied from the arrays the caller wrote into."""
        for i, (a, m, (keys, arena, counts)) in enumerate(self._loads):
            if not a <= r0 < a + m:
                continue
            lo = r0 - a
            if n and not np.shares_memory(arena[lo:lo + 1], self._arena[r0:r0 + 1]):
                self._row_key[r0:r0 + n] = keys[lo:lo + n]
                self._arena[r0:r0 + n] = arena[lo:lo + n]
                self._row_count[r0:r0 + n] = counts[lo:lo + n]
            if r0 + reserved >= a + m:
                del self._loads[i]  # the reservation's last rows: forget its arrays
            return

    def _load_present(self, keys: np.ndarray, rows: np.ndarray) -> int:
        """Under the lock: :meth:`load_rows` into a table that has rows: keys found or
        placed in one probing pass, present keys overwritten, the last duplicate wins."""
        width = self._width
        n = int(keys.size)
        counts = np.clip(rows[:, width], 0, 2**32 - 1).astype(np.uint32)
        seq = self.sequence.next()
        # one probing pass finds the present keys and places the new ones
        got, new_keys, new_rows = self._index.find_or_insert(keys, self._allocate)
        r0 = int(got[0])
        if new_rows.size == n and int(got[-1]) == r0 + n - 1 and \
                (n == 1 or bool((np.diff(got) == 1).all())):
            self._write_slice(r0, rows[:, :width])
            self._row_seq[r0:r0 + n] = seq
            self._row_count[r0:r0 + n] = counts
            if self._row_step is not None:  # a restored row starts a fresh lease
                self._row_step[r0:r0 + n] = self._clock
            self._log_write(seq, got)
            return seq
        if self._find_duplicates(got) is not None:  # last occurrence wins
            last = self._last_occurrences(got)
            got, rows, counts = got.take(last), rows.take(last, axis=0), counts.take(last)
        self._scatter_rows(got, np.ascontiguousarray(rows[:, :width]))
        self._row_seq[got] = seq
        self._row_count[got] = counts
        if self._row_step is not None:
            self._row_step[got] = self._clock
        self._log_write(seq, got)
        return seq

    def commit_load(self, r0: int, n: int, reserved: int | None = None,
                    saved_index: tuple | None = None) -> int:
        """Make rows ``[r0, r0 + n)`` of a :meth:`reserve_load` live: their keys are
        placed in the index in bulk (a key loaded before is a superseded copy, whose row
        is freed: the later row wins), one new sequence number is stamped. Returns it.
        ``reserved`` (>= n): the rows of the reservation this settles; those past the
        first ``n`` were not filled (keys filtered out) and are freed.

        ``saved_index``: ``(capacity, codes)``, the index a full checkpoint saved with
        these rows (every row of the table, in order; ``HashIndex.install_table``). Into
        an otherwise empty table it becomes the index, no key hashed (placing the keys
        was ~70% of a restore's time at 4M rows), once a sample of the keys is found at
        its rows; else the keys are placed as usual. ``index_from_checkpoint`` says which
        (True: installed)."""
        r0, n = int(r0), int(n)
        reserved = n if reserved is None else int(reserved)
        with self._lock:
            if reserved <= 0:
                return 0
            if n < 0 or n > reserved or self._reserved < reserved or r0 + reserved > self._hwm:
                raise ValueError(f"table '{self.name}': rows [{r0}, {r0 + reserved}) were "
                                 "not reserved")
            self._settle_reserved(r0, n, reserved)
            if n < reserved:
                self._release(np.arange(r0 + n, r0 + reserved, dtype=np.int64), live=False)
            if n == 0:
                self._reserved -= reserved
                return 0
            self._reserved -= reserved
            if not self._index.can_place_rows(n + self._reserved):
                # something else wrote to the table during the restore (its index grew or
                # has deleted positions): place these rows as a load into a table with rows
                width = self._width
                rows = np.empty((n, width + 1), np.float32)
                rows[:, :width] = self._arena[r0:r0 + n]
                rows[:, width] = self._row_count[r0:r0 + n]
                keys = self._row_key[r0:r0 + n].copy()
                self._release(np.arange(r0, r0 + n, dtype=np.int64), live=False)
                self._bulk_mark = None
                return self._load_present(keys, rows)
            seq = self.sequence.next()
            self.index_from_checkpoint = (saved_index is not None
                                          and self._install_index(r0, n, saved_index))
            if self.index_from_checkpoint:
                dead = np.empty(0, dtype=np.int64)
            else:
                dead = self._index.place_rows(self._row_key[r0:r0 + n], r0)
            self._row_seq[r0:r0 + n] = seq
            if self._row_step is not None:  # a restored row starts a fresh lease
                self._row_step[r0:r0 + n] = self._clock
            if dead.size:
                self._release(dead)
            self._log_range(seq, r0, n)
            self._bulk_mark = (self._hwm, self.sequence.value)
            return seq

    INDEX_SAMPLE = 1024  # keys of an installed index looked up before it is trusted

    def _install_index(self, r0: int, n: int, saved: tuple) -> bool:
        """Under the lock (:meth:`commit_load`): install a saved index for rows ``[r0, r0
        + n)``, the table's only rows. False (the index as it was) if the table has
        other rows, the saved index does not fit, or a sample of keys is not found at
        its rows (a checkpoint of another hash layout)."""
        capacity, codes = saved
        idx = self._index
        if len(idx) or idx.growing or self._reserved or self._nfree or self._hwm != r0 + n:
            return False
        if idx.install_table(capacity, codes, r0, n):
            at = np.unique(np.linspace(0, n - 1, min(n, self.INDEX_SAMPLE)).astype(np.int64))
            if np.array_equal(idx.find(self._row_key.take(at + r0)), at + r0):
                return True
            log.warning("table '%s': the index saved with the checkpoint does not find "
                        "its keys; placing them instead", self.name)
        idx.clear()  # empty again, sized for the keys to be placed
        idx.size_for(max(n, self._arena.shape[0]))
        return False

    def _bulk_load(self, keys: np.ndarray, parts: list) -> int:
        """Rows ``parts`` to new consecutive arena rows, keys placed in bulk."""
        n, width = int(keys.size), self._width
        seq = self.sequence.next()
        r0 = self._hwm
        self._grow_arena(r0 + n)
        self._hwm = r0 + n
        self._row_key[r0:r0 + n] = keys  # the index reads keys from here
        dead = self._index.place_rows(keys, r0)
        at = r0
        for p in parts:  # straight from the read buffers into the arena
            m = p.shape[0]
            self._write_slice(at, p[:, :width])
            self._row_count[at:at + m] = np.clip(p[:, width], 0, 2**32 - 1)
            at += m
        self._row_seq[r0:r0 + n] = seq
        if self._row_step is not None:  # a restored row starts a fresh lease
            self._row_step[r0:r0 + n] = self._clock
        if dead.size:  # earlier copies of keys loaded again (the later copy won)
            self._release(dead)
        self._log_range(seq, r0, n)
        self._bulk_mark = (self._hwm, self.sequence.value)
        return seq

    def _upsert(self, keys, data, full_rows: bool, only_if_absent: bool, counts=None) -> int:
        if keys.size == 0:
            return 0
        with self._lock:
            split = self._split(keys) if self._seg is not None else None
            if split is None:
                return self._upsert_main(keys, data, full_rows, only_if_absent, counts)
            spos, srows, mpos = split
            seq = 0
            if mpos.size:
                seq = self._upsert_main(keys.take(mpos), data.take(mpos, axis=0), full_rows,
                                        only_if_absent,
                                        None if counts is None else counts.take(mpos))
            if not only_if_absent:  # the segment's keys exist
                seq = self.sequence.next()
                self._seg._write_rows(srows, data.take(spos, axis=0), full_rows,
                                      None if counts is None else counts.take(spos), seq)
                if self._seg._row_step is not None:  # a lease by this table's clock
                    self._seg._row_step[srows] = self._clock
            return seq

    def _upsert_main(self, keys, data, full_rows: bool, only_if_absent: bool, counts) -> int:
        with self._lock:
            rows = self._index.find(keys)
            miss = np.flatnonzero(rows < 0)
            if only_if_absent:
                if miss.size == 0:
                    return 0
                keys, data = keys.take(miss), data.take(miss, axis=0)
                counts = counts.take(miss) if counts is not None else None
                rows = np.full(miss.size, -1, dtype=np.int64)
            seq = self.sequence.next()
            if miss.size:
                got, new_keys, new_rows = self._index.insert_new(
                    keys.take(np.flatnonzero(rows < 0)), self._allocate)
                self._note_slots(new_rows, new_keys)
                rows[rows < 0] = got
            self._write_rows(rows, data, full_rows, counts, seq)
            return seq

    def _write_rows(self, rows, data, full_rows: bool, counts, seq: int) -> None:
        """Write existing ``rows`` (duplicates: the last occurrence wins), stamped ``seq``."""
        if self._find_duplicates(rows) is not None:
            last = self._last_occurrences(rows)
            rows, data = rows.take(last), data.take(last, axis=0)
            counts = counts.take(last) if counts is not None else None
        self._scatter_rows(rows, data if full_rows else self._with_fresh_slots(data))
        self._row_seq[rows] = seq
        if counts is not None:
            self._row_count[rows] = counts
        if self._row_step is not None:  # written (imported, moved) rows: a fresh lease
            self._row_step[rows] = self._clock
        self._log_write(seq, rows)

    def delete(self, keys, log_tombstone: bool = True, moved: bool = False) -> int:
        """Remove keys; returns how many were present. Logs a tombstone (``log_tombstone``),
        or with ``moved`` a "moved" tombstone: the rows only left this PS (migration
        clean-up), which is not a deletion from the model; only the replica of this PS
        consumes those (``tombstones_since(..., include_moved=True)``)."""
        keys = _check_keys(keys)
        if keys.size == 0:
            return 0
        with self._lock:
            split = self._split(keys) if self._seg is not None else None
            parts = [(self, keys)] if split is None else \
                [(self, keys.take(split[2])), (self._seg, keys.take(split[0]))]
            removed = []
            for part, k in parts:
                # once: a key repeated in ``k`` gets its row once, so the found rows are
                # distinct without a sort
                rows = part._index.remove(k, once=True) if k.size else k
                found = np.flatnonzero(rows >= 0)
                if found.size == 0:
                    continue
                removed.append(k.take(found))
                part._release(rows.take(found))
            if not removed:
                return 0
            # one tombstone entry (this table's log) for the segment's rows too
            removed_keys = removed[0] if len(removed) == 1 else np.concatenate(removed)
            seq = self.sequence.next()
            if self._track and (moved or log_tombstone):
                self._tombstones.append((seq, removed_keys, bool(moved)))
                self._tomb_keys += int(removed_keys.size)
                self._cap_tombstones()
            return int(removed_keys.size)

    def _cap_tombstones(self) -> None:
        """Over the cap, the oldest "moved" tombstones go first (only a replica reads
        them, and it recovers with a full copy), then the oldest deletions."""
        limit = max(_LOG_MIN_CAP, self._arena.shape[0])
        if self._tomb_keys <= limit:
            return
        for moved_only in (True, False):
            keep = []
            for entry in self._tombstones:
                s, k, m = entry
                if self._tomb_keys > limit // 2 and (m or not moved_only):
                    self._tomb_keys -= int(k.size)
                    self._moved_floor = max(self._moved_floor, s)
                    if not m:
                        self._tomb_floor = max(self._tomb_floor, s)
                else:
                    keep.append(entry)
            self._tombstones = keep

    def tombstone_count_since(self, seq: int, include_moved: bool = False) -> int:
        """How many keys ``tombstones_since`` would list at most (before de-duplication),
        without building the list: a cheap size check for callers that read in rounds."""
        with self._lock:
            return sum(int(k.size) for s, k, m in self._tombstones
                       if s > seq and (include_moved or not m))

    def tombstones_since(self, seq: int, include_moved: bool = False,
                         distinct: bool = True) -> np.ndarray:
        """Distinct keys deleted by a batch with sequence number > ``seq`` (sorted).
        ``distinct=False``: the logged keys as they are, unsorted, a key deleted twice
        listed twice (replication: the peer's delete frees each key once, and sorting a
        clean-up's every moved key cost tens of ms per shipment).
        A key deleted and re-inserted afterwards is listed here *and* exported by
        ``export_rows``: apply tombstones first, then rows. ``include_moved``: also the
        keys of rows that moved to another PS (what a replica of this PS must drop).

        Raises :class:`LogTrimmed` when the log no longer reaches back to ``seq``."""
        with self._lock:
            floor = max(self._tomb_floor, self._moved_floor) if include_moved else self._tomb_floor
            if seq < floor:
                raise LogTrimmed(f"table '{self.name}': tombstones up to sequence {floor} "
                                 f"were trimmed; {seq} is older")
            parts = [k for s, k, m in self._tombstones if s > seq and (include_moved or not m)]
        if not parts:
            return np.empty(0, dtype=np.int64)
        keys = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if not distinct:
            return keys
        # sort, then drop repeats: numpy 2.x's np.unique (a hash pass for plain calls) took
        # ~10x np.sort's time on 444k moved keys, holding the GIL in ~80 ms pieces
        keys = np.sort(keys)
        if keys.size > 1:
            keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
        return keys

    def trim_logs(self, upto_seq: int, moved_upto: int | None = None) -> None:
        """Every consumer has passed ``upto_seq``: forget the change-log entries and the
        tombstones of batches with sequence numbers <= it; "moved" tombstones up to
        ``moved_upto`` (default: ``upto_seq``), how far the consumers of those (a
        replica) have read."""
        upto = int(upto_seq)
        moved_upto = upto if moved_upto is None else int(moved_upto)
        with self._lock:
            self._changes.trim(upto)
            if self._seg is not None:
                self._seg._changes.trim(upto)
            keep = [t for t in self._tombstones if t[0] > (moved_upto if t[2] else upto)]
            if len(keep) != len(self._tombstones):
                if any(not m and s <= upto for s, _, m in self._tombstones):
                    self._tomb_floor = max(self._tomb_floor, upto)
                if any(m and s <= moved_upto for s, _, m in self._tombstones):
                    self._moved_floor = max(self._moved_floor, moved_upto)
                self._tombstones = keep
                self._tomb_keys = sum(int(k.size) for _, k, _ in keep)

    def truncate_tombstones(self, upto_seq: int) -> int:
        """Forget tombstones with sequence number <= ``upto_seq`` (all consumers have them);
        returns how many batches were dropped."""
        with self._lock:
            before = len(self._tombstones)
        self.trim_logs(upto_seq)
        with self._lock:
            return before - len(self._tombstones)

    @property
    def log_sizes(self) -> dict:
        """Entries held by the change log and the tombstone log (keys)."""
        with self._lock:
            return {"changes": len(self._changes), "tombstones": self._tomb_keys,
                    "tombstone_batches": len(self._tombstones)}

    def _counted(self, rows: np.ndarray, block: np.ndarray) -> np.ndarray:
        """``block`` (gathered ``rows``) with each row's update count as a last column."""
        out = np.empty((block.shape[0], self._width + 1), dtype=np.float32)
        out[:, :self._width] = block
        out[:, self._width] = self._row_count.take(rows)
        return out

    def counts(self, keys) -> np.ndarray:
        """uint32 [n]: how many pushes updated each key (0 for a missing key)."""
        keys = _check_keys(keys)
        with self._lock:
            split = self._split(keys) if self._seg is not None else None
            if split is not None:
                spos, srows, mpos = split
                out = np.empty(keys.size, dtype=np.uint32)
                out[spos] = self._seg._row_count.take(srows)
                out[mpos] = self.counts(keys.take(mpos)) if mpos.size else 0
                return out
            rows = self._index.find(keys)
            out = np.zeros(keys.size, dtype=np.uint32)
            hit = rows >= 0
            out[hit] = self._row_count.take(rows[hit])
            return out

    def _changed_rows(self, since: int, check_seq: bool = True,
                      most: int = 16) -> np.ndarray | None:
        """Sorted distinct ids of live rows written after ``since``, read from the change
        log (cost: the entries since then); None when the log does not reach back that
        far, or holds more than 1/``most`` as many entries as the table has rows (a
        scan would be about as cheap). Under the table lock. ``check_seq=False``:
        the distinct rows logged after ``since``, some of them since freed or (a merged
        segment's rows) last written before it: the caller checks each row's sequence
        number where it reads the row anyway (:meth:`gather_planned`)."""
        if not self._track:
            return None
        logged = self._changes.since(since)
        if logged is None or most * logged.size > self._hwm + 4096:
            return None
        # distinct and sorted through a bitmap over the rows (the log holds at most 1/16
        # of them here): np.unique's hash path took 55-100 ms for the 200k entries of a
        # 5% incremental of 4M rows, under the lock; this takes a few ms
        mark = np.zeros(self._hwm, dtype=bool)
        mark[logged] = True
        sel = np.flatnonzero(mark)
        if not check_seq:
            return sel
        return sel[self._row_seq.take(sel) > since]

    def changed_at_most(self, since_seq: int, limit: int,
                        skip_slots: np.ndarray | None = None) -> bool:
        """Whether at most ``limit`` live rows were written after ``since_seq`` (cheap
        while the change log holds few entries since then; exact otherwise).
        ``skip_slots`` (bool per routing slot): rows of those slots are not counted (a
        replica peer held back from them; the segment's rows are all counted)."""
        since = max(int(since_seq), 0)
        with self._lock:
            seg = self._seg
            if seg is not None:
                sel = seg._changed_rows(since)
                n = (int(sel.size) if sel is not None
                     else int(np.count_nonzero(seg._row_seq[:seg._hwm] > since)))
                if n > limit:
                    return False
                limit -= n
            logged = self._changes.since(since) if self._track else None
            if logged is not None and logged.size <= limit:
                return True
            sel = self._changed_rows(since)
            if skip_slots is not None:
                if sel is None:
                    sel = np.flatnonzero(self._row_seq[:self._hwm] > since)
                skip = skip_slots[slot_of(self._row_key.take(sel), int(skip_slots.size))]
                return int(sel.size) - int(np.count_nonzero(skip)) <= limit
            if sel is not None:
                return int(sel.size) <= limit
            return int(np.count_nonzero(self._row_seq[:self._hwm] > since)) <= limit

    def export_rows(self, since_seq: int | None = None, with_counts: bool = False):
        """``(keys, rows, row_seq)`` of live rows, ordered by row id.

        ``since_seq=None``: every live row. Otherwise only rows whose last write has a
        sequence number > ``since_seq``: O(rows written since then) through the change
        log while it reaches back that far, else one scan. ``rows`` is float32
        [m, row_width] (value then slots), ``row_seq`` int64 [m]. Arrays are copies.
        ``with_counts="apart"``: ``rows`` is a pair (float32 [m, row_width], uint32
        counts [m]), the store's layout (replication's wire).
        """
        threshold = 0 if since_seq is None else max(int(since_seq), 0)
        with self._lock:
            sel = self._changed_rows(threshold) if since_seq is not None else None
            if sel is None:
                sel = np.flatnonzero(self._row_seq[:self._hwm] > threshold)
            block = self._gather_rows(sel)
            apart = with_counts == "apart"
            if apart:
                block = (block, self._row_count.take(sel))
            elif with_counts:
                block = self._counted(sel, block)
            out = self._row_key.take(sel), block, self._row_seq.take(sel)
            if self._seg is not None:  # the segment's rows follow
                seg_out = self._seg.export_rows(since_seq, with_counts)
                cat = lambda a, b: (tuple(np.concatenate(p) for p in zip(a, b))  # noqa: E731
                                    if isinstance(a, tuple) else np.concatenate([a, b]))
                out = tuple(cat(a, b) for a, b in zip(out, seg_out))
            return out

    def export_slots(self, slot_mask: np.ndarray, since_seq: int | None = None,
                     row_start: int = 0, max_rows: int = 1 << 18, with_counts: bool = False,
                     upto_seq: int | None = None):
        """Live rows whose key's routing slot is set in ``slot_mask`` (bool [num_slots]),
        scanning arena rows [row_start, row_start + max_rows) so that a large table is
        exported in slices without holding the table lock for long.

        With ``since_seq`` (and no ``upto_seq``), the rows changed since then come from
        the change log while it reaches back that far: ``max_rows`` changed rows per call.

        Returns ``(keys, rows, row_seq, next_row)``; ``next_row`` is None when the scan
        reached the end of the arena. ``with_counts="apart"``: ``rows`` is a pair
        ``(float32 [m, row_width], uint32 counts [m])``, the store's layout (migration). Pass 0 first, then each ``next_row`` returned (an
        opaque cursor: with a segment, the segment's rows come first, then this table's).
        ``upto_seq``: only rows last written at or before it (a full copy's scan: what is
        written after its start comes with its tail, not twice).
        """
        if row_start & _SEG_CURSOR or (row_start == 0 and self._seg is not None):
            with self._lock:
                seg = self._seg
                if seg is not None:
                    keys, rows, seqs, nxt = seg._export_slots_main(
                        self._seg_slots(slot_mask), since_seq, row_start & ~_SEG_CURSOR,
                        max_rows, with_counts, upto_seq)
                    return keys, rows, seqs, (_SEG_CURSOR | nxt if nxt is not None
                                              else _MAIN_CURSOR)
            # merged meanwhile: its rows are in this table, after any row scanned so far
            row_start = _MAIN_CURSOR
        flag = row_start & _MAIN_CURSOR
        keys, rows, seqs, nxt = self._export_slots_main(slot_mask, since_seq,
                                                        row_start & ~_MAIN_CURSOR, max_rows,
                                                        with_counts, upto_seq)
        return keys, rows, seqs, (None if nxt is None else nxt | flag)

    def _export_slots_main(self, slot_mask, since_seq, row_start, max_rows, with_counts,
                           upto_seq=None):
        threshold = 0 if since_seq is None else max(int(since_seq), 0)
        num_slots = int(slot_mask.size)
        from_log = since_seq is not None and upto_seq is None and (
            row_start == 0 or bool(row_start & _LOG_CURSOR))
        row_start &= ~_LOG_CURSOR
        with self._lock:
            # Rows changed since ``since_seq`` come from the change log, ``max_rows`` of
            # them per call in arena order (the cursor: the next one's row). A catch-up
            # round of a migration scanned the whole arena in ``max_rows`` slices
            # otherwise, yielding to training after each: at 4M rows 81 slices, so its
            # rounds took 200-550 ms for 24-67k rows, and rows written meanwhile made the
            # next round, and the fenced last one, longer. The log is read while it holds
            # up to a quarter as many entries as the table has rows (not 1/16 as for a
            # checkpoint: the scan's cost here is its slices' yields, wall time, not its
            # CPU; each call's bitmap over the rows stays a few ms). A log gone since
            # (trimmed or too long) continues as a scan from the cursor's row.
            sel = self._changed_rows(threshold, most=4) if from_log else None
            if sel is not None:
                if row_start:
                    sel = sel[np.searchsorted(sel, row_start):]
                nxt = None
                if sel.size > max_rows:
                    nxt, sel = _LOG_CURSOR | int(sel[max_rows]), sel[:max_rows]
                keys = self._row_key.take(sel)
                sel = sel[slot_mask[slot_of(keys, num_slots)]]
                block = self._gather_rows(sel)
                if with_counts == "apart":
                    block = (block, self._row_count.take(sel))
                elif with_counts:
                    block = self._counted(sel, block)
                return self._row_key.take(sel), block, self._row_seq.take(sel), nxt
            stop = min(self._hwm, row_start + max_rows)
            seqs = self._row_seq[row_start:stop]
            sel = np.flatnonzero(seqs > threshold if upto_seq is None
                                 else (seqs > threshold) & (seqs <= upto_seq))
            if sel.size:
                keys = self._row_key[row_start:stop].take(sel)
                sel = sel[slot_mask[slot_of(keys, num_slots)]]
            sel += row_start
            block = self._gather_rows(sel)
            if with_counts == "apart":
                block = (block, self._row_count.take(sel))
            elif with_counts:
                block = self._counted(sel, block)
            out = (self._row_key.take(sel), block, self._row_seq.take(sel))
            return (*out, stop if stop < self._hwm else None)

    # -- streaming exports (checkpoints) ------------------------------------------------
    def plan_export(self, slot_mask: np.ndarray, since_seq: int | None = None
                    ) -> tuple[np.ndarray, int]:
        """See :meth:`_plan_export_main`. With a segment, its rows are planned first (with
        the top row bit set), then this table's: a row the background merge moves
        meanwhile lands in this table after the rows planned so far, and a planned
        segment row that moved is found again by its key (:meth:`gather_planned`)."""
        slot_mask = np.asarray(slot_mask, dtype=bool)
        seg = self._seg
        if seg is None:
            return self._plan_export_main(slot_mask, since_seq)
        seg_codes, row_bits = seg._plan_export_main(self._seg_slots(slot_mask), since_seq)
        codes, _ = self._plan_export_main(slot_mask, since_seq)
        seg_codes |= np.int64(1 << (row_bits - 1))
        codes = np.concatenate([codes, seg_codes])
        codes.sort()
        return codes, row_bits

    def _plan_export_main(self, slot_mask: np.ndarray, since_seq: int | None = None
                          ) -> tuple[np.ndarray, int]:
        """What a streaming export writes, sorted by routing slot without copying any row:
        ``(codes, row_bits)``, int64 ``codes = slot << row_bits | row id`` of the live rows
        whose slot is set in ``slot_mask`` (bool [num_slots]) and, with ``since_seq``,
        whose last write is newer. 8 bytes per selected row; the table lock is held per
        slice of the scan (or once, for the change log). Read the rows with
        :meth:`gather_planned`, chunk by chunk, passing it the same ``since_seq``: a plan
        from the change log also lists rows freed since, or last written before
        ``since_seq`` (a merged segment's), which it skips."""
        slot_mask = np.asarray(slot_mask, dtype=bool)
        num_slots = int(slot_mask.size)
        threshold = 0 if since_seq is None else max(int(since_seq), 0)
        slot_bits = max(num_slots - 1, 1).bit_length()
        with self._lock:
            # each row's sequence number is checked by gather_planned(since_seq=), which
            # reads it anyway: one random read of 200k rows' fewer (~2 ms of 10)
            changed = self._changed_rows(threshold, check_seq=False) \
                if since_seq is not None else None
            if changed is not None:
                keys = self._row_key.take(changed)
            bound = max(self.size, 16)  # live rows now; more may come while scanning
        row_bits = max(63 - slot_bits, 1)
        if changed is not None:
            slots = slot_of(keys, num_slots)
            keep = slot_mask[slots]
            slots, changed = slots[keep], changed[keep]
            # changed rows come ascending: a stable radix sort by slot gives the codes'
            # order (slot, then row) without a comparison sort of the codes
            order = (np.argsort(slots.astype(np.uint16), kind="stable") if num_slots <= 1 << 16
                     else np.argsort(slots, kind="stable"))
            codes = (slots.take(order) << row_bits) | changed.take(order)
            return codes, row_bits
        codes = np.empty(bound + bound // 16 + 1024, dtype=np.int64)
        n = start = 0
        while True:
            with self._lock:
                hwm = self._hwm
                if start >= hwm:
                    break
                stop = min(hwm, start + _SCAN_SLICE_ROWS)
                sel = np.flatnonzero(self._row_seq[start:stop] > threshold)
                keys = self._row_key[start:stop].take(sel)
            if hwm >= 1 << (row_bits - 1):  # the top bit marks a segment's rows
                raise ValueError(f"table '{self.name}': {hwm} rows do not fit {row_bits} bits "
                                 f"beside {num_slots} slots")
            slots = slot_of(keys, num_slots)
            keep = np.flatnonzero(slot_mask[slots])
            m = keep.size
            if n + m > codes.size:  # rows inserted during the scan
                grown = np.empty(max(2 * codes.size, n + m), dtype=np.int64)
                grown[:n] = codes[:n]
                codes = grown
            out = codes[n:n + m]
            np.left_shift(slots.take(keep).astype(np.int64), row_bits, out=out)
            out |= sel.take(keep) + start
            n += m
            start = stop
            _yield(self._lock)
        codes = codes[:n]
        codes.sort()
        return codes, row_bits

    def gather_planned(self, codes: np.ndarray, row_bits: int, num_slots: int,
                       with_counts: bool = False, since_seq: int | None = None):
        """Rows of a slice of a :meth:`plan_export` plan, read under one table-lock hold:
        ``(keys, rows, slots)`` of the planned rows that still hold a key of the planned
        slot (a row freed, or reused by another slot's key, since the plan is skipped: it
        was deleted or rewritten after the plan, i.e. after the caller's cut). ``rows`` is
        float32 [n, row_width (+1 count)]; each row is self-consistent.
        ``with_counts="apart"``: ``rows`` is a pair ``(float32 [n, row_width], uint32
        counts [n])``, the store's layout (format 4), each gathered straight into its
        final array (no count column to cut off again: one copy of the rows less).
        ``since_seq``: the plan's; rows last written at or before it are skipped."""
        apart = with_counts == "apart"
        threshold = 0 if since_seq is None else max(int(since_seq), 0)
        return self._gather_planned(codes, row_bits, num_slots, bool(with_counts), apart,
                                    threshold)

    def _gather_planned(self, codes, row_bits, num_slots, with_counts, apart, threshold=0):
        rows = codes & np.int64((1 << row_bits) - 1)
        n = int(rows.size)
        in_seg = None
        if self._seg_keys is not None:  # a segment's rows have the top row bit set
            flag = np.int64(1 << (row_bits - 1))
            in_seg = (rows & flag) != 0
            if in_seg.any():
                rows = rows & (flag - 1)
            else:
                in_seg = None
        width = self._width
        keys = np.empty(n, dtype=np.int64)
        block = np.empty((n, width + (1 if with_counts and not apart else 0)),
                         dtype=np.float32)
        counts = np.empty(n, dtype=np.uint32) if apart else None
        live = np.empty(n, dtype=bool)
        # apart, float32 rows are gathered into ``block`` itself (mode="clip": the default
        # mode gathers into a temporary first; the rows are in range: an arena never
        # shrinks). Checked per hold: set_dtype may convert the arena in between.
        flat = block.view(np.dtype((np.void, 4 * width))).reshape(-1) if apart else None
        step = _GATHER_ROWS_PER_HOLD
        for s in range(0, n, step):  # short lock holds: lookups and pushes go in between
            r = rows[s:s + step]
            with self._lock:
                if self._width != width:
                    raise ValueError(f"table '{self.name}' was reconfigured during an export")
                if in_seg is not None:
                    if apart:  # rare (a promoted segment): the counted path, then split
                        tmp = np.empty((r.size, width + 1), dtype=np.float32)
                        self._gather_mixed(r, in_seg[s:s + step], keys[s:s + step], tmp,
                                           live[s:s + step], True, threshold)
                        block[s:s + step] = tmp[:, :width]
                        counts[s:s + step] = np.clip(tmp[:, width], 0, 2**32 - 1)
                    else:
                        self._gather_mixed(r, in_seg[s:s + step], keys[s:s + step],
                                           block[s:s + step], live[s:s + step], with_counts,
                                           threshold)
                    _yield(self._lock)
                    continue
                live[s:s + step] = self._row_seq.take(r) > threshold
                self._row_key.take(r, out=keys[s:s + step], mode="clip")
                if apart and not self._fp16:
                    self._arena_v.take(r, out=flat[s:s + r.size], mode="clip")
                else:
                    block[s:s + step, :width] = self._gather_rows(r)
                if apart:
                    self._row_count.take(r, out=counts[s:s + step], mode="clip")
                elif with_counts:
                    block[s:s + step, width] = self._row_count.take(r)
            _yield(self._lock)  # a waiting lookup gets the lock now, not after the whole chunk
        slots = slot_of(keys, num_slots)
        ok = live & (slots == (codes >> row_bits))
        if not ok.all():
            keep = np.flatnonzero(ok)
            keys, block, slots = keys.take(keep), block.take(keep, axis=0), slots.take(keep)
            if apart:
                counts = counts.take(keep)
        return keys, (block, counts) if apart else block, slots

    def _gather_mixed(self, r, in_seg, keys, block, live, with_counts: bool,
                      threshold: int = 0) -> None:
        """One hold of :meth:`gather_planned` for a plan with segment rows (under the
        lock): a segment row that was merged meanwhile is read from this table, found by
        the key its segment row held."""
        width = self._width

        def put(pos, table, rows):
            keys[pos] = table._row_key.take(rows)
            block[pos, :width] = table._gather_rows(rows)
            if with_counts:
                block[pos, width] = table._row_count.take(rows)

        live[:] = False
        pos = np.flatnonzero(~in_seg)
        if pos.size:
            rows = r.take(pos)
            live[pos] = self._row_seq.take(rows) > threshold
            put(pos, self, rows)
        pos = np.flatnonzero(in_seg)
        rows = r.take(pos)
        seg = self._seg
        here = (seg._row_seq.take(rows) > 0) if seg is not None else np.zeros(pos.size, bool)
        if here.any():
            sel = np.flatnonzero(here)
            live[pos.take(sel)] = True
            put(pos.take(sel), seg, rows.take(sel))
        if not here.all():
            sel = np.flatnonzero(~here)
            moved_keys = self._seg_keys.take(rows.take(sel))
            found = self._index.find(moved_keys)
            ok = np.flatnonzero(found >= 0)
            p = pos.take(sel)
            keys[p] = moved_keys
            if ok.size:
                live[p.take(ok)] = True
                put(p.take(ok), self, found.take(ok))

    def scan_live(self, row_start: int, max_rows: int, with_counts: bool = False):
        """Live rows of arena rows ``[row_start, row_start + max_rows)``, in row order, read
        under one table-lock hold: ``(keys, rows, next_row)``; ``rows`` float32
        [n, row_width (+1 update count)], each row self-consistent; ``next_row`` is None
        once the scan reached the end of the arena. Full exports stream the table with it
        (checkpoints before format 4; :meth:`scan_by_slot` since): one sequential copy per
        slice, nothing hashed under the lock."""
        extra = 1 if with_counts else 0
        with self._lock:
            width = self._width
            stop = min(self._hwm, int(row_start) + int(max_rows))
            start = min(int(row_start), stop)
            live = self._row_seq[start:stop] > 0
            n = int(np.count_nonzero(live))
            out = np.empty((n, width + extra), dtype=np.float32)
            if n == stop - start:  # no free rows in the slice: plain sequential copies
                keys = self._row_key[start:stop].copy()
                out[:, :width] = self._read_slice(start, stop)
                if extra:
                    out[:, width] = self._row_count[start:stop]
            else:
                sel = np.flatnonzero(live)
                sel += start
                keys = self._row_key.take(sel)
                out[:, :width] = self._gather_rows(sel)
                if extra:
                    out[:, width] = self._row_count.take(sel)
            return keys, out, (stop if stop < self._hwm else None)

    def scan_by_slot(self, row_start: int, max_rows: int, num_slots: int,
                     slot_mask: np.ndarray | None = None, out: np.ndarray | None = None,
                     stage: np.ndarray | None = None, arena_rows: bool = False):
        """Like :meth:`scan_live`, with the counts as their own column (checkpoint format
        4): the slice's live rows (of the slots set in ``slot_mask``, if given) sorted by
        routing slot (stable) and gathered in that order from the arena under the lock
        hold (or from its copy, ``stage``): ``(keys, rows float32 [n, row_width], counts
        uint32 [n], slots, next_row)``. Without ``stage`` the lock hold grows by hashing
        the slice's keys (~0.2 ms for 16k). ``out``: a float32 C-contiguous
        [>= max_rows, row_width] buffer the rows are gathered into (``rows`` is then a
        view of it), so a caller scanning slice after slice reuses its buffers instead of
        allocating each slice (a PS's malloc maps every block of 1 MB or more afresh:
        page faults, zeroing).

        ``stage`` (with ``out``; same shape rules): a reused buffer the slice is copied
        into first, sequentially, under the lock hold; the hashing, the sort and the
        gather then run on that copy after the lock is released. A gather in slot order
        straight from the arena misses the cache on nearly every row (each row's first
        touch, in random order); the same gather from a 2 MB copy that was just made
        hits it (sort + gather of 4M rows in 16k-row slices, alone: 113-166 -> 64-87 ms
        of CPU), and the lock is held for sequential copies only.

        ``arena_rows``: also returns the returned rows' arena row ids (int64), a sixth
        element (a checkpoint saving the index looks their positions up at its end).
        """
        def fits(b, n):
            return (b is not None and not self._fp16 and b.dtype == np.float32
                    and b.ndim == 2 and b.shape[1] == self._width and b.shape[0] >= n
                    and b.flags.c_contiguous)

        if fits(out, int(max_rows)) and fits(stage, int(max_rows)):
            with self._lock:  # sequential copies only
                stop = min(self._hwm, int(row_start) + int(max_rows))
                start = min(int(row_start), stop)
                nxt = stop if stop < self._hwm else None
                live = self._row_seq[start:stop] > 0
                keys = self._row_key[start:stop].copy()
                counts = self._row_count[start:stop].copy()
                np.copyto(stage[:stop - start], self._arena[start:stop])
            sel = None if bool(live.all()) else np.flatnonzero(live)
            if sel is not None:
                keys = keys.take(sel)
            keys, slots, sel, order = _by_slot(keys, sel, num_slots, slot_mask)
            at = order if sel is None else sel.take(order)
            rows = out[:at.size]
            stage.view(self._row_dtype).reshape(-1).take(
                at, out=rows.view(self._row_dtype).reshape(-1), mode="clip")
            got = (keys.take(order), rows, counts.take(at), slots.take(order), nxt)
            return (*got, at + start) if arena_rows else got
        with self._lock:
            stop = min(self._hwm, int(row_start) + int(max_rows))
            start = min(int(row_start), stop)
            live = self._row_seq[start:stop] > 0
            if bool(live.all()):
                keys = self._row_key[start:stop]
                sel = None
            else:
                sel = np.flatnonzero(live)
                keys = self._row_key[start:stop].take(sel)
            keys, slots, sel, order = _by_slot(keys, sel, num_slots, slot_mask)
            rows_at = (order if sel is None else sel.take(order)) + start
            n = rows_at.size
            if fits(out, n):
                rows = out[:n]
                # mode="clip": with the default "raise" numpy gathers into a temporary
                # and copies it over (the allocation this avoids); rows_at are in range
                self._arena_v.take(rows_at, out=rows.view(self._row_dtype).reshape(-1),
                                   mode="clip")
            else:  # no buffer, or one that does not fit (a reconfigured table)
                rows = self._gather_rows(rows_at)
            got = (keys.take(order), rows, self._row_count.take(rows_at), slots.take(order),
                   (stop if stop < self._hwm else None))
            return (*got, rows_at) if arena_rows else got

    # -- an index saved with a full checkpoint ------------------------------------------
    def index_checkpoint_begin(self) -> dict | None:
        """Start saving the index with a full checkpoint (``checkpoint.writer``): a token
        naming the index, its ``layout`` count and capacity. None where it cannot be
        saved (a segment, float16 rows). A growth under way is finished first, a step
        per short lock hold: it ends only as new keys arrive, so after a bulk fill it
        can stay half done for long (1.4M keys inserted in 200k batches leave it so),
        every lookup probing two tables meanwhile, and no index could be saved."""
        steps = 0
        while True:
            with self._lock:
                idx = self._index
                if self._seg is not None or self._fp16:
                    return None
                if not idx.growing:
                    return {"index": idx, "layout": idx.layout, "capacity": idx.capacity,
                            "rows": self._hwm}
                if steps > 4 * (idx.capacity // MIGRATE_STEP) + 16:
                    return None  # growing again and again under writes: not now
                idx.advance(MIGRATE_STEP)  # a few ms
            steps += 1

    def index_checkpoint_table(self, token: dict) -> np.ndarray | None:
        """The index's table (int32 [capacity] codes: 0 empty, -1 deleted, row + 1) if
        its layout held since :meth:`index_checkpoint_begin`, else None. Held layout: no
        position was removed, moved or re-assigned, so a row's position seen at any time
        since still holds, no key was scanned twice and no position a written row's
        probe chain passed has become empty. The table is read without the lock; the
        caller asks again once it has read it, and keeps what it read only if the
        answer is the same."""
        with self._lock:
            idx = self._index
            if idx is not token["index"] or idx.layout != token["layout"] or idx.growing:
                return None
            return idx._tab

    def export_keys(self, keys, with_counts: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Full rows (value + slots [+ count]) of those ``keys`` that exist: ``(keys, rows)``."""
        keys = _check_keys(keys)
        with self._lock:
            split = self._split(keys) if self._seg is not None else None
            if split is not None:
                spos, srows, mpos = split
                mk, mb = self.export_keys(keys.take(mpos), with_counts)
                sb = self._seg._gather_rows(srows)
                if with_counts:
                    sb = self._seg._counted(srows, sb)
                return np.concatenate([mk, keys.take(spos)]), np.concatenate([mb, sb])
            rows = self._index.find(keys)
            hit = np.flatnonzero(rows >= 0)
            sel = rows.take(hit)
            block = self._gather_rows(sel)
            return keys.take(hit), self._counted(sel, block) if with_counts else block

    def keys_in_slots(self, slot_mask: np.ndarray) -> np.ndarray:
        """Keys of live rows whose routing slot is set in ``slot_mask``."""
        with self._lock:
            live = np.flatnonzero(self._row_seq[:self._hwm] > 0)
            keys = self._row_key.take(live)
            seg = self._seg
            seg_keys = seg.keys_in_slots(self._seg_slots(slot_mask)) if seg is not None else None
        keys = keys[slot_mask[slot_of(keys, int(slot_mask.size))]]
        return keys if seg_keys is None else np.concatenate([keys, seg_keys])

    def rows_per_slot(self, num_slots: int) -> np.ndarray:
        """int64 [num_slots]: live rows of each routing slot (placement input)."""
        with self._lock:
            out = self._slot_counts(num_slots)  # a slot column answers without hashing
            if out is None:
                live = np.flatnonzero(self._row_seq[:self._hwm] > 0)
                keys = self._row_key.take(live)
            else:
                out = out.copy()
            seg = self._seg
            extra = seg.rows_per_slot(num_slots) if seg is not None else None
            if extra is not None and num_slots == self._seg_ns:
                extra *= self._seg_mask
        if out is None:
            out = np.bincount(slot_of(keys, num_slots), minlength=num_slots).astype(np.int64)
        return out if extra is None else out + extra

    def clear(self) -> None:
        """Drop every row (no tombstones are logged)."""
        with self._lock:
            cap = self._arena.shape[0]
            self._index = HashIndex(2 * cap, self._current_row_keys)
            self._row_seq.fill(0)
            self._row_count.fill(0)
            self._hwm = 0
            self._nfree = 0
            self._reserved = 0
            self._loads = []
            self._bulk_mark = None
            if self._slot_live is not None:
                self._slot_live.fill(0)
            floor = max(self._tomb_floor, self.sequence.value)
            self._tombstones, self._tomb_keys, self._tomb_floor = [], 0, floor
            self._moved_floor = max(self._moved_floor, floor)
            self._changes = _ChangeLog()
            self._changes.floor = floor
            self._seg = self._seg_mask = self._seg_keys = None

    # -- segments (promotion without a copy) --------------------------------------------
    def track_slots(self, num_slots: int) -> bool:
        """Keep each row's routing slot for ``num_slots`` slots (uint16: 2 bytes per row)
        and the live rows per slot, noted as keys get their rows (a replica: the key's hash
        is paid once as its row arrives, off any critical path). A promotion then finds the
        rows outside its slots by a count, usually none, instead of hashing every key
        (:meth:`_drop_rows_outside`). Rows already here are hashed now. Returns False (no
        column) for more than 65536 slots."""
        ns = int(num_slots)
        if not 0 < ns <= 1 << 16:
            return False
        with self._lock:
            live = np.flatnonzero(self._row_seq[:self._hwm] > 0)
            slots = slot_of(self._row_key.take(live), ns)
            col = np.zeros(self._row_seq.shape[0], dtype=np.uint16)
            col[live] = slots
            self._row_slot, self._slot_ns = col, ns
            self._slot_live = np.bincount(slots, minlength=ns).astype(np.int64)
        return True

    def _note_slots(self, rows: np.ndarray, keys: np.ndarray) -> None:
        """``keys`` (distinct) just got the new ``rows``: note their slots (under the lock)."""
        if self._row_slot is not None and rows.size:
            slots = slot_of(keys, self._slot_ns)
            self._row_slot[rows] = slots
            self._slot_live += np.bincount(slots, minlength=self._slot_ns)

    def _uncount_slots(self, rows: np.ndarray) -> None:
        """``rows`` (distinct, live until now) lose their keys (under the lock)."""
        if self._slot_live is not None and rows.size:
            self._slot_live -= np.bincount(self._row_slot.take(rows), minlength=self._slot_ns)

    def _slot_counts(self, num_slots: int) -> np.ndarray | None:
        """Live rows per slot from the slot column (under the lock), or None: no column,
        another slot count, or a key placed by a path that does not note slots (bulk
        loads), which the totals reveal: they then differ by the rows not noted."""
        live = self._slot_live
        if live is None or self._slot_ns != int(num_slots) or int(live.sum()) != len(self._index):
            return None
        return live

    def _seg_slots(self, slot_mask: np.ndarray) -> np.ndarray:
        """``slot_mask`` restricted to the segment's slots (when over the same slots)."""
        slot_mask = np.asarray(slot_mask, dtype=bool)
        return slot_mask & self._seg_mask if slot_mask.size == self._seg_ns else slot_mask

    def _split(self, keys: np.ndarray):
        """Where each key lives, for a table with a segment (under the lock):
        ``(spos, srows, mpos)`` -- positions of the keys the segment holds and their rows
        there, and the other positions (this table: its own slots, plus keys of the
        segment's slots that are new or already merged); None when none is in the
        segment. New keys always go to this table, never to the segment."""
        seg = self._seg
        if seg is None or keys.size == 0:
            return None
        spos = np.flatnonzero(self._seg_mask[slot_of(keys, self._seg_ns)])
        if spos.size == 0:
            return None
        srows = seg._index.find(keys.take(spos))
        hit = srows >= 0
        if not hit.all():
            self._purge_strays(keys.take(spos[~hit]))
            sel = np.flatnonzero(hit)
            if sel.size == 0:
                return None
            spos, srows = spos.take(sel), srows.take(sel)
        main = np.ones(keys.size, dtype=bool)
        main[spos] = False
        return spos, srows, np.flatnonzero(main)

    def _purge_strays(self, keys: np.ndarray) -> int:
        """Delete this table's rows of ``keys`` (keys of the segment's slots, distinct or
        not) that were written before the adoption (under the lock): strays of an older
        ownership of those slots whose clean-up never reached this PS. The dead PS had
        deleted (or evicted) these keys, or moved them on, so serving them would bring
        back stale rows; they are deleted with a tombstone, so this PS's replica and its
        incremental checkpoints drop them too. Returns the rows deleted."""
        rows = self._index.find(keys)
        ok = rows >= 0
        if not ok.any():
            return 0
        rows = rows[ok]
        seqs = self._row_seq.take(rows)
        stray = (seqs > 0) & (seqs < self._seg_seq)
        if not stray.any():
            return 0
        rows = np.unique(rows[stray])
        gone = self._row_key.take(rows)
        self._index.remove(gone)
        self._release(rows)
        if self._track:
            self._tombstones.append((self.sequence.next(), gone, False))
            self._tomb_keys += int(gone.size)
            self._cap_tombstones()
        log.warning("table %s: deleted %d stray rows of promoted slots (left by a clean-up "
                    "that never reached this PS)", self.name, gone.size)
        return int(gone.size)

    def _purge_step(self, max_rows: int) -> bool:
        """Check the next ``max_rows`` of this table's rows from before the adoption for
        strays of the segment's slots (under the lock). True once every row was checked."""
        c = self._purge_cursor
        stop = min(self._purge_hwm, c + max(int(max_rows), 1))
        if c < stop:
            seqs = self._row_seq[c:stop]
            old = np.flatnonzero((seqs > 0) & (seqs < self._seg_seq))
            if old.size:
                old += c
                keys = self._row_key.take(old)
                mine = self._seg_mask[slot_of(keys, self._seg_ns)]
                if mine.any():
                    keys = keys[mine]
                    # a key the segment holds is overwritten by the merge (its row wins)
                    self._purge_strays(keys[self._seg._index.find(keys) < 0])
        self._purge_cursor = stop
        return stop >= self._purge_hwm

    def adopt_segment(self, other: EmbeddingTable, slot_mask: np.ndarray,
                      num_slots: int) -> int:
        """Serve the rows of ``other`` (a promoted replica's table, same config) for the
        routing slots set in ``slot_mask`` (bool [num_slots]) without copying them: it
        becomes this table's segment. This table should hold no key of those slots (slot
        ownership makes both key sets disjoint); rows it still holds from an older
        ownership (a clean-up that never reached it) are strays: a key missing from the
        segment never reads one, and the merge deletes them (:meth:`_purge_strays`). Every method of this table sees the
        segment's rows; new keys still go to this table; :meth:`merge_segment` moves the
        rows over in bounded steps.

        Rows of ``other`` in other slots are dropped from it first: a replica can still
        hold rows its origin moved to another PS (the origin died before the "moved"
        tombstones of the migration's clean-up reached it). Nobody owns them through
        this segment, and kept they were counted in this table's rows and shipped in
        its replication deltas after this table's own rows -- an older copy of a row
        this PS may hold itself, which then overwrote the current one in its replica.

        Costs one pass over the segment's keys (their routing slots, outside this
        table's lock) and one over its sequence numbers: its rows are stamped with a new
        sequence number of this table, so every consumer of this table's changes
        (replica, incremental checkpoint, migration) sees them as written now.
        Returns the rows adopted, or -1 when ``other`` cannot be a segment here (another
        config, or a segment is already held): copy its rows instead."""
        slot_mask = np.asarray(slot_mask, dtype=bool)
        if slot_mask.shape != (int(num_slots),):
            raise ValueError(f"slot_mask must be bool [{num_slots}], got {slot_mask.shape}")
        if not self._can_adopt(other):
            return -1
        other._drop_rows_outside(slot_mask, int(num_slots))
        with self._lock:
            if not self._can_adopt(other):  # another adoption won meanwhile
                return -1
            with other._lock:  # a delta still applying to it finishes first
                other._lock = self._lock
            other.name = self.name
            other.sequence = self.sequence
            other.initializer, other.optimizer = self.initializer, self.optimizer
            seq = self.sequence.next()
            stamps = other._row_seq[:other._hwm]
            np.copyto(stamps, seq, where=stamps > 0)
            if other._row_step is not None:  # promoted rows start a fresh lease here
                other._row_step[:other._hwm] = self._clock
            other._cand = None  # admission runs in this table (new keys come here)
            other._track = self._track
            other._changes = _ChangeLog()
            other._changes.floor = seq  # rows written before seq: all of them (a scan)
            other._tombstones, other._tomb_keys = [], 0  # deletions go to this table's log
            self._seg, self._seg_mask, self._seg_ns = other, slot_mask.copy(), int(num_slots)
            self._recent.clear()  # keys now split between two indexes
            self._seg_cursor = 0
            self._seg_seq, self._purge_cursor, self._purge_hwm = seq, 0, self._hwm
            self._seg_keys = other._row_key  # the segment never allocates: stable
            return len(other._index)

    def _can_adopt(self, other: EmbeddingTable) -> bool:
        with self._lock:
            mine = {k: v for k, v in self.config.items() if k != "name"}
            theirs = {k: v for k, v in other.config.items() if k != "name"}
            return not (self._seg is not None or other is self or mine != theirs
                        or other._width != self._width)

    _SLOT_PASS_ROWS = 1 << 16  # keys hashed per step: the temporaries stay in cache

    def _drop_rows_outside(self, slot_mask: np.ndarray, num_slots: int) -> int:
        """Remove the live rows whose key's routing slot is not set in ``slot_mask``
        (this table is a replica about to become a segment: it never allocates again, so
        the rows are only unlinked, not put on the free list). Returns the rows removed.

        With a slot column (:meth:`track_slots`) for ``num_slots``, the per-slot counts
        answer first: no live row outside the mask (the usual case) costs one look at
        ``num_slots`` counts; else the column selects the rows. Without one, every live
        key is hashed."""
        with self._lock:
            counts = self._slot_counts(num_slots)
            if counts is not None and not counts[~slot_mask].any():
                return 0
            hwm = self._hwm
            if counts is not None:  # one pass over the column: a byte per row, no hash
                out = ~slot_mask[self._row_slot[:hwm]]
                out &= self._row_seq[:hwm] > 0
                rows = np.flatnonzero(out)
            else:
                parts = []
                for start in range(0, hwm, self._SLOT_PASS_ROWS):
                    stop = min(hwm, start + self._SLOT_PASS_ROWS)
                    live = np.flatnonzero(self._row_seq[start:stop] > 0)
                    if live.size:
                        live += start
                        slots = slot_of(self._row_key.take(live), num_slots)
                        parts.append(live[~slot_mask[slots]])
                rows = np.concatenate(parts) if parts else np.empty(0, np.int64)
            if rows.size:
                self._index.remove(self._row_key.take(rows))
                self._uncount_slots(rows)
                self._row_seq[rows] = 0
                self._row_count[rows] = 0
            return int(rows.size)

    def merge_segment(self, max_rows: int = 1 << 14) -> int:
        """Move the next ``max_rows`` arena rows of the segment into this table, under one
        table-lock hold; returns the rows the segment still holds (0: merged, the segment
        is gone). A moved row keeps its value, slots, count and sequence number (it is not
        a write); it is put in this table's change log so that "changed since V" stays
        exact, and it goes to a fresh row past the high-water mark (a paged export reads
        the segment first, then this table). Rows of other slots than the segment's
        (never served) are dropped."""
        with self._lock:
            seg = self._seg
            if seg is None:
                return 0
            c = self._seg_cursor
            stop = min(seg._hwm, c + max(int(max_rows), 1))
            sel = np.flatnonzero(seg._row_seq[c:stop] > 0)
            if sel.size:
                sel += c
                keys = seg._row_key.take(sel)
                ours = self._seg_mask[seg._row_slot.take(sel) if seg._slot_ns == self._seg_ns
                                      else slot_of(keys, self._seg_ns)]
                if not ours.all():
                    seg._index.remove(keys[~ours])
                    seg._uncount_slots(sel[~ours])
                    seg._row_seq[sel[~ours]] = 0
                    keep = np.flatnonzero(ours)
                    sel, keys = sel.take(keep), keys.take(keep)
            if sel.size:
                block = seg._gather_rows(sel)
                # a key this table already holds (left over from an older owner of these
                # slots): the segment's row wins, as a copy would have overwritten it
                rows = self._index.find(keys)
                miss = np.flatnonzero(rows < 0)
                if miss.size:
                    got, new_keys, new_rows = self._index.insert_new(keys.take(miss),
                                                                     self._allocate_fresh)
                    rows[miss] = got
                self._scatter_rows(rows, block)
                self._row_seq[rows] = seg._row_seq.take(sel)
                self._row_count[rows] = seg._row_count.take(sel)
                if self._row_step is not None and seg._row_step is not None:
                    self._row_step[rows] = seg._row_step.take(sel)
                # logged under the newest number issued: "changed since V" for any V below
                # a moved row's own number lists it (it is filtered by its row_seq)
                self._log_write(self.sequence.value, rows)
                seg._index.remove(keys)
                seg._uncount_slots(sel)
                seg._row_seq[sel] = 0  # not onto the free list: the segment never allocates
                seg._row_count[sel] = 0
            self._seg_cursor = stop
            purged = self._purge_step(max_rows)
            if (stop >= seg._hwm or not len(seg._index)) and purged:
                self._seg = self._seg_mask = None  # _seg_keys stays for plans made before
                return 0
            return max(len(seg._index), 1)

    def merge_all(self, max_rows: int = 1 << 14) -> None:
        """Merge the whole segment, releasing the lock between steps."""
        while self.merge_segment(max_rows):
            _yield(self._lock)


class EmbeddingStore:
    """The tables of one PS, sharing one :class:`SequenceCounter`."""

    def __init__(self, sequence: SequenceCounter | None = None, track_changes: bool = True,
                 track_slots: int = 0):
        self.sequence = sequence if sequence is not None else SequenceCounter()
        self._tables: dict[str, EmbeddingTable] = {}
        self._lock = threading.Lock()
        # change and tombstone logs: off for copies nobody exports deltas from (replicas)
        self.track_changes = bool(track_changes)
        # replicas: every table keeps its rows' routing slots for this many slots (0: no)
        self.track_slots = int(track_slots)
        # consumer name -> sequence number it has read up to: the logs are trimmed to the
        # oldest of them (trim_logs). A consumer that fell too far behind the hard caps
        # gets LogTrimmed from tombstones_since and starts over with a full copy.
        self._consumers: dict[str, int] = {}
        self._moved_consumers: set[str] = set()  # those that also read "moved" tombstones

    def create_table(self, name: str, dim: int, initializer="zeros", optimizer="sgd",
                     initial_capacity: int = 1024, admission=None,
                     eviction=None, dtype="float32") -> EmbeddingTable:
        """Create a table, or return the existing one if its config is identical.
        A conflicting config raises ValueError naming the first differing field.
        ``admission`` / ``eviction``: the table's policies (see ``store.policies``); a
        table with admission gets a companion table of candidates
        (``candidate_table_name``), which moves, replicates and is checkpointed like any
        table."""
        with self._lock:
            existing = self._tables.get(name)
            if existing is None:
                table = EmbeddingTable(name, dim, initializer, optimizer, sequence=self.sequence,
                                       initial_capacity=initial_capacity,
                                       track_changes=self.track_changes,
                                       admission=admission, eviction=eviction, dtype=dtype)
                table.routing_slots = self.routing_slots
                if self.track_slots:
                    table.track_slots(self.track_slots)
                self._tables[name] = table
                if table.admission is not None:
                    table.attach_candidates(self._candidates_of(name))
                return table
        # Validate the requested config the same way a new table would.
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0:
            raise ValueError(f"table '{name}': dim must be a positive integer, got {dim!r}")
        if existing.dim != dim:
            raise ValueError(f"table '{name}' already exists with dim={existing.dim}, "
                             f"requested dim={dim}")
        init = make_initializer(initializer, int(dim)).config
        if init != existing.initializer.config:
            raise ValueError(f"table '{name}' already exists with initializer="
                             f"{existing.initializer.config}, requested initializer={init}")
        opt = make_optimizer(optimizer).config
        if opt != existing.optimizer.config:
            raise ValueError(f"table '{name}' already exists with optimizer="
                             f"{existing.optimizer.config}, requested optimizer={opt}")
        adm = make_admission(admission, name, int(dim))
        if adm != existing.admission:
            raise ValueError(f"table '{name}' already exists with admission="
                             f"{existing.admission}, requested admission={adm}")
        ev = make_eviction(eviction, name)
        if ev != existing.eviction:
            raise ValueError(f"table '{name}' already exists with eviction="
                             f"{existing.eviction}, requested eviction={ev}")
        dt = check_dtype(dtype, name)
        if dt != existing.dtype:
            raise ValueError(f"table '{name}' already exists with dtype={existing.dtype}, "
                             f"requested dtype={dt}")
        return existing

    routing_slots = DEFAULT_NUM_SLOTS  # the job's routing slots (bloom cells are keyed by them)

    def set_routing_slots(self, num_slots: int) -> None:
        """The job's routing slot count: bloom admission cells route like the ids in them."""
        self.routing_slots = int(num_slots)
        for t in self.tables().values():
            t.routing_slots = self.routing_slots

    def _candidates_of(self, name: str) -> EmbeddingTable:
        """The companion table of ``name``'s admission candidates (under the store lock):
        the one already here (it may have arrived first, by a migration or a replica
        delta), else a new one: dim 1 (exact counts), or BLOOM_BLOCK (bloom cells). One of
        the other kind (the policy changed at a warm start) is replaced: counts start
        over."""
        cname = candidate_table_name(name)
        cand = self._tables.get(cname)
        dim = BLOOM_BLOCK if "bloom" in self._tables[name].admission else 1
        if cand is None or cand.dim != dim:
            cand = EmbeddingTable(cname, dim, "zeros", "sgd", sequence=self.sequence,
                                  track_changes=self.track_changes)
            cand.routing_slots = self.routing_slots
            if self.track_slots:
                cand.track_slots(self.track_slots)
            self._tables[cname] = cand
        return cand

    def user_tables(self) -> dict[str, EmbeddingTable]:
        """Snapshot ``{name: table}`` without the admission companion tables."""
        return {n: t for n, t in self.tables().items() if not is_candidate_table(n)}

    def evict(self, slot_mask: np.ndarray | None = None) -> dict[str, int]:
        """Run every table's eviction policy now: ``{table: rows evicted}``."""
        return {n: t.evict(slot_mask) for n, t in self.tables().items() if t.eviction}

    def ensure_table(self, name: str, dim: int, initializer, optimizer, admission=None,
                     eviction=None, dtype="float32") -> EmbeddingTable:
        """Create the table, or make the existing one take this config (same ``dim``). For
        copies that follow an authoritative source (replicas), whose config may change once,
        at a warm start."""
        try:
            return self.create_table(name, dim, initializer, optimizer, admission=admission,
                                     eviction=eviction, dtype=dtype)
        except ValueError:
            if name not in self._tables:
                raise
            self.reconfigure(name, dim, initializer, optimizer)
            return self.set_policies(name, admission, eviction, dtype=dtype)

    def set_policies(self, name: str, admission, eviction, dtype=None) -> EmbeddingTable:
        """Give an existing table other admission / eviction policies and, unless ``dtype``
        is None, that storage dtype (a replica following its source, a warm start taking
        the job's)."""
        table = self.get(name)
        if dtype is not None:
            check_dtype(dtype, name)
        table.set_policies(admission, eviction)
        if dtype is not None:
            table.set_dtype(dtype)
        if table.admission is not None:
            with self._lock:
                table.attach_candidates(self._candidates_of(name))
        return table

    def reconfigure(self, name: str, dim: int, initializer, optimizer) -> bool:
        """Give an existing table another initializer/optimizer (same ``dim``, else
        ValueError); see :meth:`EmbeddingTable.reconfigure`."""
        table = self.get(name)
        if table.dim != dim:
            raise ValueError(f"table '{name}' has dim={table.dim}, requested dim={dim}")
        return table.reconfigure(initializer, optimizer)

    def get(self, name: str) -> EmbeddingTable:
        try:
            return self._tables[name]
        except KeyError:
            raise KeyError(f"unknown table '{name}'") from None

    def __getitem__(self, name: str) -> EmbeddingTable:
        return self.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def drop_table(self, name: str) -> None:
        with self._lock:
            if name not in self._tables:
                raise KeyError(f"unknown table '{name}'")
            del self._tables[name]

    def tables(self) -> dict[str, EmbeddingTable]:
        """Snapshot ``{name: table}``."""
        with self._lock:
            return dict(self._tables)

    # -- log consumers ------------------------------------------------------------------
    def set_consumer(self, name: str, seq: int | None, moved: bool = False) -> None:
        """Record how far consumer ``name`` has read (None: it is gone), then trim the logs
        to the oldest consumer. ``moved``: it also reads "moved" tombstones (a replica);
        those are kept only for such consumers."""
        with self._lock:
            if seq is None:
                self._consumers.pop(name, None)
                self._moved_consumers.discard(name)
            else:
                self._consumers[name] = int(seq)
                if moved:
                    self._moved_consumers.add(name)
                else:
                    self._moved_consumers.discard(name)
        self.trim_logs()

    def consumers(self) -> dict[str, int]:
        with self._lock:
            return dict(self._consumers)

    def trim_logs(self) -> int:
        """Trim every table's change and tombstone logs up to the oldest consumer's
        position; returns it (-1: no consumer is registered, nothing is trimmed beyond
        the hard caps)."""
        with self._lock:
            if not self._consumers:
                return -1
            upto = min(self._consumers.values())
            moved = [self._consumers[n] for n in self._moved_consumers]
            # "moved" tombstones nobody reads (no replica) are dropped at once
            moved_upto = min(moved) if moved else self.sequence.value
        for table in self.tables().values():
            table.trim_logs(upto, moved_upto)
        return upto

    def stats(self) -> dict[str, dict]:
        """``{name: {"rows", "bytes", "dim", "capacity", "optimizer"}}``, and for a table
        with admission or eviction its counters (``admitted``, ``rejected``, ``dropped``,
        ``evicted``, ``candidates``); a companion table's bytes count in its table's."""
        tables = self.tables()
        out = {}
        for name, t in sorted(tables.items()):
            if is_candidate_table(name):
                continue
            cand = tables.get(candidate_table_name(name))
            out[name] = {"rows": t.size,
                         "bytes": t.nbytes + (cand.nbytes if cand is not None else 0),
                         "dim": t.dim, "capacity": t.capacity, "optimizer": t.optimizer.name}
            if t.admission is not None or t.eviction is not None:
                out[name].update(t.policy_stats())
        return out
