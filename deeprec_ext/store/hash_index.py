"""Vectorized open-addressing hash index: int64 key -> int64 row id.

Layout (``capacity`` entries, capacity a power of two):

* ``_kv``    int64 [capacity, 2] - key and ``row id + 1`` of a position, interleaved so
  one probe touches one cache line (``_keys``/``_vals`` are strided column views). The key
  is stale after a delete; the ``row + 1`` entry is **always 0 at a position that is not
  full** (0-based encoding: a fresh table is ``np.zeros``, whose pages the OS maps lazily
  instead of being written up front).
* ``_state`` uint8 [capacity]    - 0 empty, 1 full, 2 deleted (tombstone).

Every int64 is a valid key (0, negatives, INT64_MIN/MAX included): emptiness lives in
``_state``, never in a sentinel key.

Probing is linear from ``hash64(key, PROBE_SEED) & mask``. The probe hash deliberately
uses a non-zero seed: routing uses ``hash64(key, 0) % num_slots``, so all keys owned by
one PS agree on the low bits of the seed-0 hash and would pile up in a few clusters.

All operations probe every key of a batch at once; each round only the unresolved keys
continue (compacted index arrays, not boolean masks over the whole batch), so the work is
``O(n * mean probe length)`` numpy element operations and a handful of numpy calls per
round. The load factor (full + deleted positions) never exceeds 1/2, which keeps mean
probe lengths around 1.5 (hit) / 2.5 (miss).

Growth is incremental above ``INCREMENTAL_MIN_KEYS`` keys: a rehash of millions of keys
in one call held the table's lock for seconds (1.2 s at 2M keys), a stall of every
training step on that PS. Instead the full index is kept aside as ``_prev`` (frozen but
for removals) and the new, larger one starts empty; every reserve moves the next
``MIGRATE_STEP`` positions of ``_prev`` (and at least 4 per key being inserted, so it is
done long before the new index fills), and lookups that miss in the new index look in
``_prev``. A key lives in exactly one of the two.

Two invariants make ``find`` cheap:

1. ``_vals`` (row + 1) is 0 at every position that is not full, so a position whose
   stored key equals the query answers the query directly (row id, or -1 for a
   tombstone) without reading ``_state``.
2. A key is always placed at the *first* non-full position of its probe chain. Hence a
   live copy of a key precedes every stale (deleted) copy of the same key in that chain,
   and meeting a stale copy first proves the key is absent.
"""
from __future__ import annotations

import numpy as np

from deeprec_ext.hashing import hash64

PROBE_SEED = 0x5EED
EMPTY, FULL, DELETED = 0, 1, 2
_MIN_CAPACITY = 16
INCREMENTAL_MIN_KEYS = 1 << 17  # smaller indexes rehash at once (a few ms)
MIGRATE_STEP = 1 << 15  # positions of the previous index moved per reserve


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


class HashIndex:
    """Open-addressing (linear probing) map from int64 keys to int64 row ids.

    Not thread-safe by itself; the owning :class:`EmbeddingTable` serializes access.
    """

    __slots__ = ("_kv", "_kvv", "_keys", "_vals", "_state", "_mask", "_size", "_deleted",
                 "_prev", "_cursor")

    def __init__(self, capacity: int = 1024):
        self._alloc(max(_next_pow2(capacity), _MIN_CAPACITY))
        self._size = 0
        self._prev: HashIndex | None = None  # the index being moved into this one
        self._cursor = 0  # next position of _prev to move

    def _alloc(self, cap: int) -> None:
        self._kv = np.zeros((cap, 2), dtype=np.int64)
        self._kvv = self._kv.view(np.dtype((np.void, 16))).reshape(-1)  # one item per entry
        self._keys = self._kv[:, 0]  # strided views: read with [] (take would copy)
        self._vals = self._kv[:, 1]
        self._state = np.zeros(cap, dtype=np.uint8)
        self._mask = cap - 1
        self._deleted = 0

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
        prev = self._prev.nbytes if self._prev is not None else 0
        return self._kv.nbytes + self._state.nbytes + prev

    @property
    def growing(self) -> bool:
        """An incremental rehash is under way (``_prev`` still holds keys)."""
        return self._prev is not None

    def keys(self) -> np.ndarray:
        own = self._keys[self._state == FULL]
        return own if self._prev is None else np.concatenate([own, self._prev.keys()])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = np.flatnonzero(self._state == FULL)
        keys, rows = self._keys[live], self._vals[live] - 1
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
        out = self._find_own(keys)
        if self._prev is not None:
            miss = np.flatnonzero(out < 0)
            if miss.size:
                out[miss] = self._prev._find_own(keys.take(miss))
        return out

    def _find_own(self, keys: np.ndarray) -> np.ndarray:
        """``find`` in this index's own table (not ``_prev``)."""
        kvv, ts, mask = self._kvv, self._state, self._mask
        pos = self._home(keys)
        # Round 1 over the whole batch: a matching stored key answers directly (its row
        # entry is the row, or -1 for a tombstone -- invariants 1 and 2).
        g = kvv.take(pos).view(np.int64).reshape(-1, 2)
        out = g[:, 1] - 1
        idx = np.flatnonzero(g[:, 0] != keys)
        if idx.size == 0:
            return out
        out[idx] = -1
        p = pos.take(idx)
        # An empty position ends the chain: absent. Compaction uses flatnonzero + take
        # (branch-free) rather than boolean-mask indexing.
        sel = np.flatnonzero(ts.take(p) != EMPTY)
        idx, p = idx.take(sel), p.take(sel)
        kq = keys.take(idx)
        while idx.size:
            p += 1
            p &= mask
            g = kvv.take(p).view(np.int64).reshape(-1, 2)
            hit = g[:, 0] == kq
            if hit.any():
                out[idx[hit]] = g[:, 1][hit] - 1
                sel = np.flatnonzero(~hit)
                idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            cont = ts.take(p) != EMPTY
            if not cont.all():
                sel = np.flatnonzero(cont)
                idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
        return out

    def _locate(self, keys: np.ndarray) -> np.ndarray:
        """Position of each key's live entry, -1 where absent."""
        n = keys.size
        out = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return out
        tk, ts, mask = self._keys, self._state, self._mask
        p = self._home(keys)
        idx = np.arange(n)
        kq = keys
        while idx.size:
            hit = tk[p] == kq
            if hit.any():
                hp = p[hit]
                full = ts.take(hp) == FULL
                out[idx[hit][full]] = hp[full]
                sel = np.flatnonzero(~hit)  # a stale match also ends the chain (inv. 2)
                idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            sel = np.flatnonzero(ts.take(p) != EMPTY)
            idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            p += 1
            p &= mask
        return out

    def _claim(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place absent keys (duplicates allowed) at the first non-full position of their
        probe chain. Returns ``(pos, new_pos)``: the position of every input key and the
        distinct newly filled positions (one per distinct key, in claim order).

        ``_vals`` of new positions temporarily holds the claimant's batch index + 1; the
        caller must overwrite it with ``row + 1``. Capacity must have been reserved.
        """
        n = keys.size
        tk, tv, ts, mask = self._keys, self._vals, self._state, self._mask
        out = np.empty(n, dtype=np.int64)
        p = self._home(keys)
        idx = np.arange(n)
        kq = keys
        filled = []
        reused = 0
        while idx.size:
            st = ts.take(p)
            fi = np.flatnonzero(st != FULL)
            if fi.size == 0:
                p += 1
                p &= mask
                continue
            cp = p.take(fi)
            cid = idx.take(fi)
            cid += 1  # never 0, the "no row" value
            # Conflict resolution among claimants of one free position: every claimant
            # scatters its batch index, exactly one value survives per position.
            tv[cp] = cid
            won = tv[cp] == cid
            wsel = np.flatnonzero(won)
            wf = fi.take(wsel)
            wp = cp.take(wsel)
            tk[wp] = kq.take(wf)
            reused += int(np.count_nonzero(st.take(wf) == DELETED))
            ts[wp] = FULL
            out[idx.take(wf)] = wp
            filled.append(wp)
            keep = np.ones(idx.size, dtype=bool)
            keep[wf] = False
            if wf.size != fi.size:
                # Losers carrying the winner's key are duplicates: same position.
                lsel = np.flatnonzero(~won)
                lf = fi.take(lsel)
                lp = cp.take(lsel)
                dup = tk[lp] == kq.take(lf)
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

    # -- capacity -----------------------------------------------------------------------
    def reserve(self, extra: int) -> None:
        """Ensure ``extra`` more keys can be inserted without exceeding load 1/2.

        When a rehash is needed the new capacity keeps the live load at or below 3/8, so
        the next rehash is at least capacity/8 insertions or deletions away (amortized
        O(1) even under insert/delete churn). The index never shrinks. Large indexes
        rehash incrementally (module docstring); each call moves the next part.
        """
        if self._prev is not None:
            self._migrate(max(MIGRATE_STEP, 4 * extra))
        cap = self.capacity
        pending = self._prev._size if self._prev is not None else 0
        if 2 * (self._size + self._deleted + pending + extra) <= cap:
            return
        if self._prev is not None:  # not expected (4 moves per insert): finish at once
            self._migrate(None)
            if 2 * (self._size + self._deleted + extra) <= cap:
                return
        need = self._size + extra
        new_cap = cap
        while 8 * need > 3 * new_cap:
            new_cap *= 2
        if self._size < INCREMENTAL_MIN_KEYS:
            self._rehash(new_cap)
            return
        prev = HashIndex.__new__(HashIndex)
        prev._kv, prev._kvv, prev._keys, prev._vals = self._kv, self._kvv, self._keys, self._vals
        prev._state, prev._mask = self._state, self._mask
        prev._size, prev._deleted, prev._prev, prev._cursor = self._size, self._deleted, None, 0
        self._alloc(new_cap)
        self._size = 0
        self._prev, self._cursor = prev, 0
        self._migrate(max(MIGRATE_STEP, 4 * extra))

    def _migrate(self, budget: int | None) -> None:
        """Move the live keys of the next ``budget`` positions of ``_prev`` (all: None)
        into this index. Moved entries become tombstones there, which keeps the probe
        chains of the keys still waiting intact."""
        prev = self._prev
        a = self._cursor
        b = prev.capacity if budget is None else min(a + budget, prev.capacity)
        live = np.flatnonzero(prev._state[a:b] == FULL)
        if live.size:
            live += a
            keys, vals = prev._keys[live], prev._vals[live]  # copies (fancy indexing)
            pos, _ = self._claim(keys)
            self._vals[pos] = vals  # already encoded as row + 1
            prev._state[live] = DELETED
            prev._vals[live] = 0
            prev._size -= live.size
            prev._deleted += live.size
        self._cursor = b
        if b >= prev.capacity:
            self._prev = None

    def _rehash(self, new_cap: int) -> None:
        live = np.flatnonzero(self._state == FULL)
        keys, rows = self._keys[live], self._vals[live]
        self._alloc(new_cap)
        self._size = 0
        if keys.size:
            pos, _ = self._claim(keys)
            self._vals[pos] = rows  # already encoded as row + 1

    # -- mutation -----------------------------------------------------------------------
    def insert(self, keys, rows) -> None:
        """Insert keys that the caller guarantees are absent and unique."""
        keys = _as_keys(keys)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape != keys.shape:
            raise ValueError(f"rows shape {rows.shape} does not match keys shape {keys.shape}")
        if keys.size == 0:
            return
        self.reserve(keys.size)
        pos, _ = self._claim(keys)
        self._vals[pos] = rows + 1

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
        new_rows = np.asarray(allocate(new_pos.size), dtype=np.int64)
        self._vals[new_pos] = new_rows + 1
        return self._vals[pos] - 1, self._keys[new_pos], new_rows

    def find_or_insert(self, keys, allocate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row of every key, inserting the absent ones (duplicates allowed), in ONE probing
        pass instead of :meth:`find` then :meth:`insert_new` (bulk loads: restores).

        While the index holds no deleted positions, the first non-full position of a
        key's chain proves it absent and is where it goes, so a key is found or placed
        in the same walk; with deleted positions it falls back to find + insert_new.
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
        tk, tv, ts, mask = self._keys, self._vals, self._state, self._mask
        out = np.empty(n, dtype=np.int64)
        p = self._home(keys)
        idx = np.arange(n)
        kq = keys
        filled = []
        while idx.size:
            st = ts.take(p)
            keep = np.ones(idx.size, dtype=bool)
            fi = np.flatnonzero(st == FULL)
            if fi.size:  # a full position holding the key: found
                hit = fi[tk[p.take(fi)] == kq.take(fi)]
                out[idx.take(hit)] = p.take(hit)
                keep[hit] = False
            fe = np.flatnonzero(st != FULL)  # empty: the key is absent, claim it (_claim)
            if fe.size:
                cp = p.take(fe)
                cid = idx.take(fe) + 1
                tv[cp] = cid
                won = tv[cp] == cid
                wf = fe[won]
                wp = cp[won]
                tk[wp] = kq.take(wf)
                ts[wp] = FULL
                out[idx.take(wf)] = wp
                filled.append(wp)
                keep[wf] = False
                lf, lp = fe[~won], cp[~won]
                if lf.size:  # losers carrying the winner's key are duplicates
                    dup = tk[lp] == kq.take(lf)
                    out[idx.take(lf[dup])] = lp[dup]
                    keep[lf[dup]] = False
            sel = np.flatnonzero(keep)
            idx, p, kq = idx.take(sel), p.take(sel), kq.take(sel)
            p += 1
            p &= mask
        new_pos = np.concatenate(filled) if filled else np.empty(0, dtype=np.int64)
        # rows in input order: each new position's claimant batch index is in _vals
        new_pos = new_pos.take(np.argsort(tv[new_pos], kind="stable"))
        new_rows = np.asarray(allocate(new_pos.size), dtype=np.int64)
        tv[new_pos] = new_rows + 1
        self._size += new_pos.size
        return tv[out] - 1, tk[new_pos], new_rows

    def remove(self, keys) -> np.ndarray:
        """Remove keys; returns the removed row per input key (-1 where absent)."""
        keys = _as_keys(keys)
        pos = self._locate(keys)
        found = pos >= 0
        rows = np.full(keys.size, -1, dtype=np.int64)
        if self._prev is not None and not found.all():
            rest = np.flatnonzero(~found)
            rows[rest] = self._prev.remove(keys.take(rest))
        if not found.any():
            return rows
        fp = pos[found]
        rows[found] = self._vals[fp] - 1
        up = np.unique(fp)  # duplicate keys in the request remove one entry
        self._state[up] = DELETED
        self._vals[up] = 0
        self._size -= up.size
        self._deleted += up.size
        return rows

    def clear(self) -> None:
        self._alloc(_MIN_CAPACITY)
        self._size = 0
        self._prev, self._cursor = None, 0
