"""Vectorized open-addressing hash index: int64 key -> row id.

Layout (``capacity`` entries, capacity a power of two): ONE int32 array ``_tab`` of codes,
4 bytes per position:

* ``0``  empty (a fresh table is ``np.zeros``, whose pages the OS maps lazily);
* ``-1`` deleted (tombstone);
* ``row + 1`` (>= 1) full: the key is **not** stored in the index. It is the owner's
  ``row -> key`` array (``EmbeddingTable._row_key``, which exports need anyway), read
  through ``row_keys()``. Storing the key here too (16-byte key + row entries and a
  1-byte state, the earlier layout) cost 34 bytes per row at load 1/2, half an sgd
  row's floor; now the index costs ~8 bytes per row.
* ``<= -2`` only inside one :meth:`_claim` / :meth:`find_or_insert` call: a position just
  claimed by batch element ``-code - 2``, before its row is written.

Every int64 is a valid key (0, negatives, INT64_MIN/MAX included): emptiness lives in the
code, never in a sentinel key. Row ids are < 2**31 - 1 (int32 codes).

Probing is linear from ``hash64(key, PROBE_SEED) & mask``. The probe hash deliberately
uses a non-zero seed: routing uses ``hash64(key, 0) % num_slots``, so all keys owned by
one PS agree on the low bits of the seed-0 hash and would pile up in a few clusters.

A key is in at most one full position; a lookup walks its chain past tombstones and
other keys' positions until it meets its row (``row_keys()[row] == key``) or an empty
position. All operations probe every key of a batch at once; each round only the
unresolved keys continue (compacted index arrays, not boolean masks over the whole
batch), so the work is ``O(n * mean probe length)`` numpy element operations and a
handful of numpy calls per round. The load factor (full + deleted positions) never
exceeds 1/2, which keeps mean probe lengths around 1.5 (hit) / 2.5 (miss). Inserting an
absent key reads only the 4-byte codes (no key comparison).

Growth is incremental above ``INCREMENTAL_MIN_KEYS`` keys: a rehash of millions of keys
in one call held the table's lock for seconds (1.2 s at 2M keys), a stall of every
training step on that PS. Instead the full index is kept aside as ``_prev`` (frozen but
for removals) and the new, larger one starts empty; every reserve moves the next
``MIGRATE_STEP`` positions of ``_prev`` (and at least 4 per key being inserted, so it is
done long before the new index fills), and lookups that miss in the new index look in
``_prev``. A key lives in exactly one of the two. Both read the same ``row_keys()``.

Without an owner (``HashIndex()`` alone) the index keeps its own row -> key array.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from deeprec_ext.hashing import hash64

PROBE_SEED = 0x5EED
EMPTY, DELETED = 0, -1
MAX_ROWS = 2**31 - 2  # row + 1 must fit an int32 code
_MIN_CAPACITY = 16
INCREMENTAL_MIN_KEYS = 1 << 17  # smaller indexes rehash at once (a few ms)
MIGRATE_STEP = 1 << 15  # positions of the previous index moved per reserve
# Probe chains end in a long tail: a few keys of a batch walk tens of positions while the
# rest are done, one numpy round per position. Keys still walking after the first round
# look at WINDOW positions per round instead (first match / free position by argmax).
WINDOW = 8
TAIL_KEYS = 512
_STEPS = np.arange(WINDOW, dtype=np.int64)


def _next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def _as_keys(keys) -> np.ndarray:
    k = np.asarray(keys)
    if k.dtype != np.int64:
        if k.size == 0:
            k = k.astype(np.int64)
        elif k.dtype.kind in "iu" and np.can_cast(k.dtype, np.int64):
            k = k.astype(np.int64)
        else:
            raise TypeError(f"keys must be int64, got dtype {k.dtype}")
    if k.ndim != 1:
        raise ValueError(f"keys must be 1-D, got shape {k.shape}")
    return np.ascontiguousarray(k)


def _check_rows(rows: np.ndarray) -> None:
    if rows.size and (int(rows.max()) > MAX_ROWS or int(rows.min()) < 0):
        raise OverflowError(f"row ids must be in [0, {MAX_ROWS}], got "
                            f"[{int(rows.min())}, {int(rows.max())}]")


class _OwnKeys:
    """The row -> key array of an index without an owner (grown on demand)."""

    __slots__ = ("arr",)

    def __init__(self):
        self.arr = np.zeros(0, dtype=np.int64)

    def __call__(self) -> np.ndarray:
        return self.arr

    def ensure(self, rows: np.ndarray) -> None:
        need = int(rows.max()) + 1 if rows.size else 0
        if need > self.arr.size:
            arr = np.zeros(max(need, 2 * self.arr.size, 64), dtype=np.int64)
            arr[:self.arr.size] = self.arr
            self.arr = arr


class HashIndex:
    """Open-addressing (linear probing) map from int64 keys to row ids.

    ``row_keys``: a callable returning the owner's current int64 ``row -> key`` array; the
    index writes the keys of the rows it inserts into it (the owner grows it). Not
    thread-safe by itself; the owning :class:`EmbeddingTable` serializes access.
    """

    __slots__ = ("_tab", "_mask", "_size", "_deleted", "_prev", "_cursor", "_row_keys",
                 "_own", "version", "layout")

    def __init__(self, capacity: int = 1024,
                 row_keys: Callable[[], np.ndarray] | None = None):
        # bumped by every change that empties, moves or re-assigns a position (allocation,
        # growth, removal, bulk placement): while it holds, every (position, row) seen in
        # the table stays true and no position becomes empty -- what an index saved with
        # a checkpoint relies on (EmbeddingTable.index_checkpoint_table, install_table).
        # Inserting absent keys into free positions leaves it.
        self.layout = 0
        self._alloc(max(_next_pow2(capacity), _MIN_CAPACITY))
        self._size = 0
        self._prev: HashIndex | None = None  # the index being moved into this one
        self._cursor = 0  # next position of _prev to move
        self._own = _OwnKeys() if row_keys is None else None
        self._row_keys = self._own if row_keys is None else row_keys
        # bumped by every call that may give a present key another row or none (insert,
        # place_rows, remove, clear): rows found at one version hold for the same keys
        # while it is unchanged (inserting absent keys and rehashing move no row)
        self.version = 0

    def _alloc(self, cap: int) -> None:
        self.layout += 1
        self._tab = np.zeros(cap, dtype=np.int32)
        self._mask = cap - 1
        self._deleted = 0

    def _set_keys(self, rows: np.ndarray, keys: np.ndarray) -> None:
        if self._own is not None:
            self._own.ensure(rows)
        self._row_keys()[rows] = keys

    # -- introspection ------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size + (self._prev._size if self._prev is not None else 0)

    @property
    def capacity(self) -> int:
        return self._mask + 1

    @property
    def num_deleted(self) -> int:
        return self._deleted

    @property
    def nbytes(self) -> int:
        """Bytes of the index itself (the row -> key array is the owner's)."""
        prev = self._prev.nbytes if self._prev is not None else 0
        return self._tab.nbytes + prev

    @property
    def growing(self) -> bool:
        """An incremental rehash is under way (``_prev`` still holds keys)."""
        return self._prev is not None

    def keys(self) -> np.ndarray:
        return self.items()[0]

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        codes = self._tab[self._tab > 0]
        rows = codes.astype(np.int64) - 1
        keys = self._row_keys().take(rows)
        if self._prev is not None:
            pk, pr = self._prev.items()
            keys, rows = np.concatenate([keys, pk]), np.concatenate([rows, pr])
        return keys, rows

    def __repr__(self) -> str:
        return (f"HashIndex(size={len(self)}, capacity={self.capacity}, "
                f"deleted={self._deleted}, growing={self.growing})")

    # -- probing ------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        h = hash64(keys, PROBE_SEED)
        np.bitwise_and(h, np.uint64(self._mask), out=h)
        return h.view(np.int64)

    def find(self, keys) -> np.ndarray:
        """Row id of each key, -1 where absent. Duplicates and any order are fine."""
        keys = _as_keys(keys)
        if keys.size == 0:
            return np.empty(0, dtype=np.int64)
        out = self._probe(keys, False)
        if self._prev is not None:
            miss = np.flatnonzero(out < 0)
            if miss.size:
                out[miss] = self._prev._probe(keys.take(miss), False)
        return out

    def _probe(self, keys: np.ndarray, positions: bool) -> np.ndarray:
        """Row (``positions``: position) of each key in this index's own table (not
        ``_prev``), -1 where absent."""
        n = keys.size
        if self._size == 0:
            return np.full(n, -1, dtype=np.int64)
        tab, mask, rk = self._tab, self._mask, self._row_keys()
        p = self._home(keys)
        # Round 1 over the whole batch. ``take(..., mode="clip")`` reads row 0 for the
        # codes that are not rows (-1, -2); the ``r >= 0`` test discards those.
        r = tab.take(p).astype(np.int64)
        r -= 1  # row, or -1 (empty), -2 (deleted)
        hit = rk.take(r, mode="clip") == keys
        hit &= r >= 0
        out = np.where(hit, p, -1) if positions else r
        idx = np.flatnonzero(~hit)
        if idx.size == 0:
            return out
        rr = r.take(idx)
        if not positions:
            out[idx] = -1
        sel = np.flatnonzero(rr != -1)  # an empty position ends the chain: absent
        idx = idx.take(sel)
        p = p.take(idx)
        kq = keys.take(idx)
        while idx.size:
            if idx.size > TAIL_KEYS:  # many keys walking: one position per round
                p += 1
                p &= mask
                r = tab.take(p).astype(np.int64)
                r -= 1
                hit = rk.take(r, mode="clip") == kq
                hit &= r >= 0
                if hit.any():
                    out[idx[hit]] = p[hit] if positions else r[hit]
                    cont = ~hit
                    cont &= r != -1
                else:
                    cont = r != -1
                if not cont.all():
                    sel = np.flatnonzero(cont)
                    idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
                continue
            # the tail: positions p+1 .. p+WINDOW of each key still walking
            pw = p[:, None] + (_STEPS + 1)
            pw &= mask
            r = tab.take(pw).astype(np.int64)
            r -= 1
            hit = rk.take(r, mode="clip") == kq[:, None]
            hit &= r >= 0
            stop = hit | (r == -1)  # its row, or an empty position: the walk ends
            first = stop.argmax(axis=1)
            at = np.arange(idx.size)
            done = stop[at, first]
            fh = np.flatnonzero(done & hit[at, first])
            if fh.size:
                out[idx.take(fh)] = (pw if positions else r)[fh, first.take(fh)]
            p = pw[:, -1]
            if done.any():
                sel = np.flatnonzero(~done)
                idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
        return out

    def _claim(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place absent keys (duplicates allowed) at the first free (empty or deleted)
        position of their probe chain. Returns ``(pos, new_pos)``: the position of every
        input key and the distinct newly filled positions (one per distinct key).

        New positions hold ``-(claimant's batch index) - 2`` until the caller writes
        ``row + 1``. Capacity must have been reserved.
        """
        n = keys.size
        tab, mask = self._tab, self._mask
        out = np.empty(n, dtype=np.int64)
        p = self._home(keys)
        idx = np.arange(n)
        kq = keys
        filled = []
        reused = 0
        first_round = True
        while idx.size:
            if first_round or idx.size > TAIL_KEYS:
                st = tab.take(p)
                first_round = False
            else:  # the walk's tail: jump to the first free position of a window
                pw = p[:, None] + _STEPS
                pw &= mask
                sw = tab.take(pw)
                free = (sw == EMPTY) | (sw == DELETED)
                first = free.argmax(axis=1)
                at = np.arange(idx.size)
                has = free[at, first]
                p = np.where(has, pw[at, first], pw[:, -1])
                st = np.where(has, sw[at, first], np.int32(1))  # 1: not free, step on
            fi = np.flatnonzero((st == EMPTY) | (st == DELETED))
            if fi.size == 0:
                p += 1
                p &= mask
                continue
            cp = p.take(fi)
            code = idx.take(fi)
            code += 2
            np.negative(code, out=code)
            # Conflict resolution among claimants of one free position: every claimant
            # scatters its code, exactly one value survives per position.
            tab[cp] = code
            won = tab.take(cp) == code
            wsel = np.flatnonzero(won)
            wf = fi.take(wsel)
            wp = cp.take(wsel)
            reused += int(np.count_nonzero(st.take(wf) == DELETED))
            out[idx.take(wf)] = wp
            filled.append(wp)
            keep = np.ones(idx.size, dtype=bool)
            keep[wf] = False
            if wf.size != fi.size:
                # Losers carrying the winner's key are duplicates: same position.
                lsel = np.flatnonzero(~won)
                lf = fi.take(lsel)
                lp = cp.take(lsel)
                winner = -tab.take(lp).astype(np.int64) - 2
                dup = keys.take(winner) == kq.take(lf)
                if dup.any():
                    out[idx.take(lf[dup])] = lp[dup]
                    keep[lf[dup]] = False
            sel = np.flatnonzero(keep)
            idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            p += 1
            p &= mask
        if len(filled) == 1:
            new_pos = filled[0]
        else:
            new_pos = np.concatenate(filled) if filled else np.empty(0, dtype=np.int64)
        self._size += new_pos.size
        self._deleted -= reused
        return out, new_pos

    def _claimant(self, pos: np.ndarray) -> np.ndarray:
        """Batch index of the claimant of positions just filled by ``_claim``."""
        b = self._tab.take(pos).astype(np.int64)
        np.negative(b, out=b)
        b -= 2
        return b

    # -- capacity -----------------------------------------------------------------------
    def reserve(self, extra: int, step: int | None = None, purge: bool = False) -> None:
        """Ensure ``extra`` more keys can be inserted without exceeding load 1/2.

        When a rehash is needed the new capacity keeps the live load at or below 3/8, so
        the next rehash is at least capacity/8 insertions or deletions away (amortized
        O(1) even under insert/delete churn). The index never shrinks. Large indexes
        rehash incrementally (module docstring); each call moves the next part.

        ``step``: a hint of keys coming later (a migration's import announces its rows):
        an incremental growth to their final size starts, moving at most ``step``
        positions now; the inserts move the rest as usual. A growth already under way is
        left to them.

        ``purge`` (with ``step``): an index holding deleted positions is rebuilt without
        them even if it has room, so the announced keys can then be placed in bulk
        (:meth:`can_place_rows`); a large one is rebuilt incrementally, as a growth."""
        if step is not None:
            if self._prev is not None:
                return
            budget = int(step)
        else:
            budget = max(MIGRATE_STEP, 4 * extra)
        if self._prev is not None:
            self._migrate(budget)
        cap = self.capacity
        pending = self._prev._size if self._prev is not None else 0
        rebuild = purge and self._prev is None and self._deleted > 0
        if 2 * (self._size + self._deleted + pending + extra) <= cap and not rebuild:
            return
        if self._prev is not None:  # not expected (4 moves per insert): finish at once
            self._migrate(None)
            if 2 * (self._size + self._deleted + extra) <= cap:
                return
        need = self._size + extra
        new_cap = cap  # never smaller: a purge at the same size only drops the tombstones
        while 8 * need > 3 * new_cap:
            new_cap *= 2
        if self._size < INCREMENTAL_MIN_KEYS:
            self._rehash(new_cap)
            return
        prev = HashIndex.__new__(HashIndex)
        prev._tab, prev._mask = self._tab, self._mask
        prev._size, prev._deleted, prev._prev, prev._cursor = self._size, self._deleted, None, 0
        prev._own, prev._row_keys = self._own, self._row_keys
        prev.version = 0  # removals reach it through this index, which counts them
        prev.layout = 0
        self._alloc(new_cap)
        self._size = 0
        self._prev, self._cursor = prev, 0
        self._migrate(budget)

    def advance(self, budget: int) -> None:
        """Move the next ``budget`` positions of a growth under way (nothing otherwise):
        an import that announced its rows ends the growth early, so the rest of its rows
        take the bulk path (:meth:`place_rows`)."""
        if self._prev is not None:
            self._migrate(int(budget))

    def _migrate(self, budget: int | None) -> None:
        """Move the live keys of the next ``budget`` positions of ``_prev`` (all: None)
        into this index. Moved entries become tombstones there, which keeps the probe
        chains of the keys still waiting intact."""
        self.layout += 1
        prev = self._prev
        a = self._cursor
        b = prev.capacity if budget is None else min(a + budget, prev.capacity)
        live = np.flatnonzero(prev._tab[a:b] > 0)
        if live.size:
            live += a
            codes = prev._tab.take(live)
            pos, _ = self._claim(self._row_keys().take(codes.astype(np.int64) - 1))
            self._tab[pos] = codes  # already encoded as row + 1
            prev._tab[live] = DELETED
            prev._size -= live.size
            prev._deleted += live.size
        self._cursor = b
        if b >= prev.capacity:
            self._prev = None

    def _rehash(self, new_cap: int) -> None:
        codes = self._tab[self._tab > 0]
        self._alloc(new_cap)
        self._size = 0
        if codes.size:
            pos, _ = self._claim(self._row_keys().take(codes.astype(np.int64) - 1))
            self._tab[pos] = codes  # already encoded as row + 1

    # -- mutation -----------------------------------------------------------------------
    def insert(self, keys, rows) -> None:
        """Insert keys that the caller guarantees are absent and unique."""
        self.version += 1
        keys = _as_keys(keys)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape != keys.shape:
            raise ValueError(f"rows shape {rows.shape} does not match keys shape {keys.shape}")
        if keys.size == 0:
            return
        _check_rows(rows)
        self.reserve(keys.size)
        self._set_keys(rows, keys)
        pos, _ = self._claim(keys)
        self._tab[pos] = rows + 1

    def _fill(self, keys: np.ndarray, new_pos: np.ndarray, allocate
              ) -> tuple[np.ndarray, np.ndarray]:
        """Rows for the positions ``_claim`` just filled: allocate, record their keys,
        write the codes. Returns ``(new_keys, new_rows)``."""
        new_keys = keys.take(self._claimant(new_pos))
        new_rows = np.asarray(allocate(new_pos.size), dtype=np.int64)
        _check_rows(new_rows)
        self._set_keys(new_rows, new_keys)  # after allocate: the owner's array may grow
        self._tab[new_pos] = new_rows + 1
        return new_keys, new_rows

    def insert_new(self, keys, allocate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Insert keys known to be absent, **duplicates allowed**, without sorting.

        ``allocate(m)`` is called once with the number of distinct keys and must return
        ``m`` row ids. Returns ``(rows, new_keys, new_rows)``: the row of every input key
        (duplicates share one) and the distinct keys with their freshly allocated rows.
        """
        keys = _as_keys(keys)
        if keys.size == 0:
            e = np.empty(0, dtype=np.int64)
            return e, e, e
        self.reserve(keys.size)
        pos, new_pos = self._claim(keys)
        new_keys, new_rows = self._fill(keys, new_pos, allocate)
        rows = self._tab.take(pos).astype(np.int64)
        rows -= 1
        return rows, new_keys, new_rows

    def find_or_insert(self, keys, allocate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row of every key, inserting the absent ones (duplicates allowed), in ONE probing
        pass instead of :meth:`find` then :meth:`insert_new` (bulk loads: restores).

        While the index holds no deleted positions, the first empty position of a key's
        chain proves it absent and is where it goes, so a key is found or placed in the
        same walk; with deleted positions it falls back to find + insert_new.
        ``allocate(m)`` is called once with the number of distinct new keys; their rows
        are handed out in input order (of one occurrence each), so a batch of distinct
        new keys gets its rows in input order (consecutive from a fresh arena). Returns
        ``(rows, new_keys, new_rows)`` like :meth:`insert_new`."""
        keys = _as_keys(keys)
        n = keys.size
        if n == 0:
            e = np.empty(0, dtype=np.int64)
            return e, e, e
        if self._deleted or self._prev is not None:
            rows = self.find(keys)
            miss = np.flatnonzero(rows < 0)
            got, new_keys, new_rows = self.insert_new(keys.take(miss), allocate)
            rows[miss] = got
            return rows, new_keys, new_rows
        self.reserve(n)
        if self._deleted or self._prev is not None:  # reserve() began a rehash
            return self.find_or_insert(keys, allocate)
        tab, mask = self._tab, self._mask
        rk = self._row_keys()
        out = np.empty(n, dtype=np.int64)
        p = self._home(keys)
        idx = np.arange(n)
        kq = keys
        filled = []
        while idx.size:
            st = tab.take(p)
            keep = np.ones(idx.size, dtype=bool)
            fi = np.flatnonzero(st > 0)
            if fi.size:  # a full position holding the key: found
                hit = fi[rk.take(st.take(fi).astype(np.int64) - 1) == kq.take(fi)]
                out[idx.take(hit)] = p.take(hit)
                keep[hit] = False
            # Empty: the key is absent, claim it (as _claim). A position claimed earlier
            # in this call (code <= -2) belongs to another key: duplicates of a key walk
            # in step and meet at the same position in the same round.
            fe = np.flatnonzero(st == EMPTY)
            if fe.size:
                cp = p.take(fe)
                code = -(idx.take(fe) + 2)
                tab[cp] = code
                won = tab.take(cp) == code
                wf = fe[won]
                wp = cp[won]
                out[idx.take(wf)] = wp
                filled.append(wp)
                keep[wf] = False
                lf, lp = fe[~won], cp[~won]
                if lf.size:  # losers carrying the winner's key are duplicates
                    dup = keys.take(self._claimant(lp)) == kq.take(lf)
                    out[idx.take(lf[dup])] = lp[dup]
                    keep[lf[dup]] = False
            sel = np.flatnonzero(keep)
            idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            p += 1
            p &= mask
        new_pos = np.concatenate(filled) if filled else np.empty(0, dtype=np.int64)
        # rows in input order: each new position's code holds its claimant's batch index
        new_pos = new_pos.take(np.argsort(self._claimant(new_pos), kind="stable"))
        self._size += new_pos.size
        new_keys, new_rows = self._fill(keys, new_pos, allocate)
        rows = self._tab.take(out).astype(np.int64)
        rows -= 1
        return rows, new_keys, new_rows

    def can_place_rows(self, n: int) -> bool:
        """:meth:`place_rows` of ``n`` more keys is possible: no deleted positions, no
        growth under way, and room for them at load <= 1/2 without a rehash."""
        return (self._deleted == 0 and self._prev is None
                and 2 * (self._size + n) <= self.capacity)

    def size_for(self, n: int) -> None:
        """Re-allocate an EMPTY index for ``n`` keys at load <= 3/8 (the load a rehash
        targets), so a bulk load of ``n`` keys never grows it on the way."""
        if self._size or self._prev is not None:
            raise RuntimeError("size_for() needs an empty index")
        cap = max(self.capacity, _MIN_CAPACITY)
        while 8 * n > 3 * cap:
            cap *= 2
        if cap != self.capacity or self._deleted:
            self._alloc(cap)

    def place_rows(self, keys, first_row: int, rows: np.ndarray | None = None) -> np.ndarray:
        """Bulk insert for loads (restores): ``keys`` [n] are the keys of the consecutive
        rows ``first_row .. first_row + n - 1``, whose row -> key entries the caller has
        already written. A key already in the index, or repeated in ``keys``, is a
        superseded copy: the index keeps its highest row, i.e. the latest copy in load
        order. Returns the superseded rows (int64, for the caller to free).

        Unlike :meth:`find_or_insert` no claim codes, claimant sort or row allocation: a
        position's code is the row itself, so each probing round is a gather, a scatter
        and a read-back over the keys still walking. A key meeting a full position
        compares its key (a duplicate) or steps on; a key losing an empty position to
        another claimant stays and compares with the winner next round. Needs
        :meth:`can_place_rows` (the caller checks, no growth happens here).

        ``rows`` (instead of consecutive rows from ``first_row``): the keys' rows, strictly
        increasing (e.g. freed rows reused, sorted), so a later key of the batch still has
        the higher row; a key already in the index before the call is superseded by the
        batch's copy whatever its row."""
        self.version += 1
        self.layout += 1
        keys = _as_keys(keys)
        n = keys.size
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if not self.can_place_rows(n):
            raise RuntimeError("place_rows() needs no deleted positions, no growth under way "
                               "and room for the keys")
        batch = None  # the batch's codes, sorted: tells an older occupant from a batch copy
        if rows is not None:
            rows = np.asarray(rows, dtype=np.int64)
            if rows.shape != keys.shape:
                raise ValueError(f"rows shape {rows.shape} does not match keys shape {keys.shape}")
            _check_rows(rows)
            if n > 1 and not (rows[1:] > rows[:-1]).all():
                raise ValueError("place_rows(): rows must be strictly increasing")
            code = (rows + 1).astype(np.int32)
            batch = code
        else:
            if int(first_row) < 0 or int(first_row) + n - 1 > MAX_ROWS:
                raise OverflowError(f"row ids must be in [0, {MAX_ROWS}]")
            code = np.arange(int(first_row) + 1, int(first_row) + n + 1, dtype=np.int32)
        tab, mask, rk = self._tab, self._mask, self._row_keys()
        p = self._home(keys)
        kq = keys
        placed = 0
        dup_pos = []  # positions where copies of one key met
        dup_codes = []  # every code involved there (the highest stays)
        while p.size:
            st = tab.take(p)
            full = st > 0  # no deleted positions and no claim codes here: > 0 or empty
            adv = full  # full positions: step on unless the key is the same (below)
            fi = np.flatnonzero(full)
            if fi.size:
                same = rk.take(st.take(fi).astype(np.int64) - 1) == kq.take(fi)
                if same.any():
                    hits = fi[same]
                    hp, hc = p.take(hits), code.take(hits)
                    hs = st.take(hits)
                    dup_pos.append(hp)
                    dup_codes += [hs, hc]
                    if batch is not None:  # an occupant from before the call loses to any copy
                        at = np.minimum(np.searchsorted(batch, hs), n - 1)
                        older = batch.take(at) != hs
                        if older.any():
                            tab[hp[older]] = 0
                    np.maximum.at(tab, hp, hc)  # the latest copy (highest row) wins
                    adv = full.copy()
                    adv[hits] = False
            if fi.size == p.size:
                stay = adv
            else:
                fe = np.flatnonzero(~full)
                cp, cc = p.take(fe), code.take(fe)
                tab[cp] = cc  # one claimant per empty position survives
                won = tab.take(cp) == cc
                nw = int(np.count_nonzero(won))
                placed += nw
                stay = adv.copy()
                if nw != fe.size:  # losers compare with the winner next round
                    stay[fe[~won]] = True
            p += adv
            p &= mask
            if not stay.all():
                sel = np.flatnonzero(stay)
                p, code, kq = p.take(sel), code.take(sel), kq.take(sel)
        self._size += placed
        if not dup_pos:
            return np.empty(0, dtype=np.int64)
        pos = np.concatenate(dup_pos)
        codes = np.unique(np.concatenate(dup_codes))
        kept = tab.take(pos)
        dead = codes[~np.isin(codes, kept)].astype(np.int64)
        dead -= 1
        return dead

    def remove(self, keys, once: bool = False) -> np.ndarray:
        """Remove keys; returns the removed row per input key (-1 where absent). With
        ``once`` only one occurrence of a key repeated in ``keys`` gets its row (the others
        -1), so the rows >= 0 are distinct and the caller needs no ``np.unique`` (it was
        most of a migration clean-up's delete: a hash or sort per chunk)."""
        self.version += 1
        self.layout += 1
        keys = _as_keys(keys)
        pos = self._probe(keys, True) if keys.size else np.empty(0, dtype=np.int64)
        found = pos >= 0
        rows = np.full(keys.size, -1, dtype=np.int64)
        if self._prev is not None and not found.all():
            rest = np.flatnonzero(~found)
            rows[rest] = self._prev.remove(keys.take(rest), once)
        sel = np.flatnonzero(found)
        if sel.size == 0:
            return rows
        fp = pos.take(sel)
        tab = self._tab
        r = tab.take(fp).astype(np.int64)
        r -= 1
        # Duplicate keys in the request share a position: every one scatters its own code,
        # one survives per position (as in _claim), which counts the distinct positions in
        # O(n) without sorting. Claim codes never outlive this call.
        code = np.arange(-2, -2 - fp.size, -1, dtype=np.int32)
        tab[fp] = code
        won = tab.take(fp) == code
        tab[fp] = DELETED
        gone = int(np.count_nonzero(won))
        self._size -= gone
        self._deleted += gone
        if once and gone != fp.size:
            r[~won] = -1
        rows[sel] = r
        return rows

    # -- an index saved with a checkpoint -----------------------------------------------
    def install_table(self, capacity: int, codes: np.ndarray, first_row: int, n: int) -> bool:
        """Make this EMPTY index the one a checkpoint saved, hashing no key: ``codes``
        (int32 [capacity], as this index's own table: 0 empty, -1 deleted, ``i + 1`` the
        checkpoint's row ``i``) becomes the table, its rows moved to start at
        ``first_row``. Returns False, the index left as it was, if it does not fit (not a
        power of two, not ``n`` rows 0 .. n-1, load over 1/2): the caller places the keys
        instead. Whether the keys are where their probes look is the caller's to check
        (a sample: ``EmbeddingTable.commit_load``)."""
        if self._size or self._prev is not None:
            raise RuntimeError("install_table() needs an empty index")
        cap, n = int(capacity), int(n)
        if (cap < _MIN_CAPACITY or cap & (cap - 1) or codes.dtype != np.int32
                or codes.shape != (cap,) or int(first_row) < 0
                or int(first_row) + n - 1 > MAX_ROWS):
            return False
        full = int(np.count_nonzero(codes > 0))
        used = int(np.count_nonzero(codes))
        if full != n or 2 * used > cap or (n and int(codes.max()) != n) \
                or (used > full and int(codes.min()) < DELETED):
            return False
        if first_row:
            codes[codes > 0] += np.int32(first_row)
        self.version += 1
        self.layout += 1
        self._tab, self._mask = codes, cap - 1
        self._size, self._deleted = n, used - full
        return True

    def clear(self) -> None:
        self.version += 1
        self._alloc(_MIN_CAPACITY)
        self._size = 0
        self._prev, self._cursor = None, 0
