"""Distinct-id counting over training data: a vectorized HyperLogLog sketch, and the
sampling of the first N records through the user's parse function.

A table's rows are the distinct ids its feature carries over the whole data set. Sampling
reads the first N records; when the data holds more, the distinct count is extrapolated
with Heaps' law ``D(n) = K * n**beta``, beta taken from the sketch's counts at N/2 and N.
"""
from __future__ import annotations

import glob
import math
import os

import numpy as np

from deeprec_ext.hashing import hash64

_SKETCH_SEED = 0x4C4C  # independent of the routing (0) and probe (0x5EED) hashes


class HyperLogLog:
    """HyperLogLog (Flajolet et al. 2007) over int64 ids, with the small-range (linear
    counting) correction. ``precision`` p: 2**p one-byte registers, standard error about
    ``1.04 / sqrt(2**p)`` (p=14: 0.8%). ``add`` is one vectorized pass per batch."""

    def __init__(self, precision: int = 14):
        if not 4 <= precision <= 18:
            raise ValueError(f"precision must be in [4, 18], got {precision}")
        self.p = precision
        self.m = 1 << precision
        self.registers = np.zeros(self.m, dtype=np.uint8)

    def add(self, ids) -> None:
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return
        h = hash64(ids.astype(np.int64, copy=False), _SKETCH_SEED)
        idx = (h >> np.uint64(64 - self.p)).astype(np.int64)
        rest = h << np.uint64(self.p)  # the remaining 64 - p bits, left-aligned
        # rank = leading zeros + 1; frexp's exponent is the bit length (exact except when
        # float64 rounds up to the next power of two: probability ~2**-53 per id)
        _, bitlen = np.frexp(rest.astype(np.float64))
        rank = np.minimum(65 - bitlen, 64 - self.p + 1).astype(np.uint8)
        np.maximum.at(self.registers, idx, rank)

    def merge(self, other: "HyperLogLog") -> None:
        if other.p != self.p:
            raise ValueError("cannot merge sketches of different precision")
        np.maximum(self.registers, other.registers, out=self.registers)

    def count(self) -> float:
        m = self.m
        alpha = 0.7213 / (1 + 1.079 / m)
        raw = alpha * m * m / float(np.sum(np.ldexp(1.0, -self.registers.astype(np.int64))))
        zeros = int(np.count_nonzero(self.registers == 0))
        if raw <= 2.5 * m and zeros:
            return m * math.log(m / zeros)  # linear counting
        return raw


def heaps_extrapolate(points: list[tuple[int, float]], total: int) -> tuple[float, float]:
    """``(distinct at total, beta)`` from ``[(records, distinct)]`` by a log-log fit."""
    pts = [(n, d) for n, d in points if n > 0 and d > 0]
    if len(pts) < 2 or total <= pts[-1][0]:
        return pts[-1][1] if pts else 0.0, 1.0
    # the local exponent falls as the vocabulary saturates: the last segment's is the
    # closest to what lies beyond the sample (and still an upper bound)
    (n0, d0), (n_last, d_last) = pts[-2], pts[-1]
    beta = float(np.clip(math.log(d_last / d0) / math.log(n_last / n0), 0.0, 1.0))
    return d_last * (total / n_last) ** beta, beta


def expand_files(patterns) -> list[str]:
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(pat))
        if not hits:
            raise FileNotFoundError(f"no data file matches {pat!r}")
        files.extend(hits)
    return files


def count_lines(path: str, chunk: int = 16 << 20) -> int:
    n, last = 0, b"\n"
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            n += b.count(b"\n")
            last = b[-1:]
    return n + (last != b"\n")


def read_lines(files: list[str], limit: int, batch: int):
    """Batches (lists of bytes) of the first ``limit`` lines of ``files``, in order."""
    out, left = [], limit
    for path in files:
        with open(path, "rb") as f:
            for line in f:
                out.append(line.rstrip(b"\r\n"))
                left -= 1
                if len(out) == batch or left == 0:
                    yield out
                    out = []
                if left == 0:
                    return
    if out:
        yield out


def sample_distinct(files: list[str], parse_fn, features: dict[str, str | None],
                    records: int, batch: int = 32768, precision: int = 14,
                    track: set | None = None, batch_records: int = 1024) -> dict:
    """Distinct ids per feature over the first ``records`` lines of ``files``.

    ``parse_fn(lines)`` gets a 1-D string tensor and returns ``(features, label)``, a
    feature dict, or one id tensor. ``features`` maps table -> feature name (None: the
    only id tensor). Returns ``{"records", "per_feature": {feature: [(n, distinct)...]}}``;
    for the features in ``track`` also ``"occurrences": {feature: (ids, batches)}``, the
    distinct (id, training batch of ``batch_records`` records) pairs (``batch_occurrences``).
    """
    import tensorflow as tf

    sketches: dict[str | None, HyperLogLog] = {f: HyperLogLog(precision) for f in set(features.values())}
    marks = sorted({max(1, records // k) for k in (8, 4, 2, 1)})
    curves: dict = {f: [] for f in sketches}
    track = set(track or ())
    occ: dict = {f: [] for f in track}
    seen = 0
    for lines in read_lines(files, records, batch):
        parsed = parse_fn(tf.constant(lines))
        if isinstance(parsed, tuple):
            parsed = parsed[0]
        for feat, sk in sketches.items():
            if isinstance(parsed, dict):
                if feat not in parsed:
                    raise KeyError(f"the parse function returns features {sorted(parsed)}, "
                                   f"not {feat!r}")
                t = parsed[feat]
            else:
                t = parsed
            arr = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
            if arr.dtype.kind not in "iu":
                raise TypeError(f"feature {feat!r} has dtype {arr.dtype}, expected integer ids")
            # count per mark: split the batch at the marks it crosses
            start = 0
            n = arr.shape[0] if arr.ndim else 1
            for m in marks:
                if seen < m <= seen + n:
                    sk.add(arr[start:m - seen])
                    start = m - seen
                    curves[feat].append((m, sk.count()))
            sk.add(arr[start:])
            if feat in occ:
                per = arr.reshape(n, -1)
                b = (seen + np.arange(n, dtype=np.int64)) // batch_records
                occ[feat].append(batch_occurrences(per, np.repeat(b, per.shape[1])))
        seen += len(lines)
    for feat, sk in sketches.items():
        if seen and (not curves[feat] or curves[feat][-1][0] != seen):
            curves[feat].append((seen, sk.count()))
    out = {"records": seen, "per_feature": curves}
    if occ:
        out["occurrences"] = {
            f: batch_occurrences(np.concatenate([i for i, _ in parts]),
                                 np.concatenate([b for _, b in parts]))
            if parts else (np.zeros(0, np.int64), np.zeros(0, np.int64))
            for f, parts in occ.items()}
    return out


def file_records(files: list[str]) -> int:
    return sum(count_lines(f) for f in files if os.path.exists(f))


# -- admission and eviction: rows over time, from the ids of each training batch ------------
def batch_occurrences(ids: np.ndarray, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``(id, batch)`` pairs, sorted by id then batch: an id counts once per
    training batch, as the client de-duplicates a batch before it looks ids up."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    batch = np.asarray(batch, dtype=np.int64).reshape(-1)
    order = np.lexsort((batch, ids))
    ids, batch = ids[order], batch[order]
    keep = np.ones(ids.size, dtype=bool)
    keep[1:] = (ids[1:] != ids[:-1]) | (batch[1:] != batch[:-1])
    return ids[keep], batch[keep]


def _coverage(start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    """int64 [n]: how many of the intervals ``[start, end)`` (in batches) cover each batch."""
    up = np.bincount(start, minlength=n)[:n]
    end = end[end < n]
    down = np.bincount(end, minlength=n)[:n] if end.size else 0
    return np.cumsum(up - down)


def policy_timeline(ids: np.ndarray, batch: np.ndarray, n_batches: int, min_count: int = 1,
                    steps_to_live: int | None = None, bloom: bool = False) -> dict:
    """Replay a table's admission and steps-to-live eviction over sampled batches.

    ``ids`` / ``batch``: the distinct (id, batch) pairs (``batch_occurrences``). A step is a
    training batch (one push to each PS the batch touches). As the store does it: an id
    is counted once per batch and gets its row at its ``min_count``-th count; a row not
    updated for more than ``steps_to_live`` batches is evicted; an exact counter starts
    again from zero after an eviction (a bloom filter's cells are never reset: the id is
    admitted again at once). Returns int64 arrays over the batches: ``rows`` (live rows
    after each batch), ``candidates`` (ids counting towards admission: exact counters),
    ``admitted`` (ids admitted at least once so far), ``evicted`` (evictions so far),
    ``distinct``.

    Vectorized across ids: one pass per occurrence rank (at most one per batch), each
    over the ids seen that many times.
    """
    n = int(n_batches)
    z = np.zeros(max(n, 0), dtype=np.int64)
    if ids.size == 0 or n <= 0:
        return {"rows": z, "admitted": z, "candidates": z, "evicted": z, "distinct": z}
    first = np.ones(ids.size, dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, ids.size))
    order = np.argsort(-counts, kind="stable")
    desc = counts[order]
    need = max(int(min_count), 1)
    stl = steps_to_live
    n_ids = starts.size
    alive = np.zeros(n_ids, dtype=bool)
    count = np.zeros(n_ids, dtype=np.int64)
    last = np.zeros(n_ids, dtype=np.int64)
    cand_from = np.full(n_ids, -1, dtype=np.int64)
    first_adm = np.full(n_ids, -1, dtype=np.int64)
    row_start, row_end, cand_start, cand_end, evict_at = [], [], [], [], []
    for k in range(int(desc[0])):
        m = int(np.count_nonzero(desc > k)) if desc[-1] <= k else n_ids
        sel = order[:m]
        b = batch[starts[sel] + k]
        if stl is not None:  # rows not updated for more than S batches are gone
            gone = alive[sel] & (b - last[sel] > stl)
            g = sel[gone]
            end = last[g] + stl + 1
            row_end.append(end)
            evict_at.append(end)
            alive[g] = False
            if not bloom:
                count[g] = 0
        waiting = sel[~alive[sel]]
        wb = b[~alive[sel]]
        fresh = count[waiting] == 0
        cand_from[waiting[fresh]] = wb[fresh]
        count[waiting] += 1
        ok = count[waiting] >= need
        adm, ab = waiting[ok], wb[ok]
        alive[adm] = True
        row_start.append(ab)
        if need > 1:
            cand_start.append(cand_from[adm])
            cand_end.append(ab)
        if not bloom:
            count[adm] = 0
        cand_from[adm] = -1
        newly = first_adm[adm] < 0
        first_adm[adm[newly]] = ab[newly]
        last[sel[alive[sel]]] = b[alive[sel]]
    if stl is not None:  # rows still live at the end, due within the sample
        live = np.flatnonzero(alive)
        end = last[live] + stl + 1
        evict_at.append(end)
        row_end.append(end)
    waiting = cand_from >= 0
    if need > 1 and waiting.any():  # counting still at the end
        cand_start.append(cand_from[waiting])
        cand_end.append(np.full(int(waiting.sum()), n, dtype=np.int64))

    def cat(parts):
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def cumulative(at):
        at = at[(at >= 0) & (at < n)]
        return np.cumsum(np.bincount(at, minlength=n)[:n])

    rs, re_ = cat(row_start), cat(row_end)
    rows = np.cumsum(np.bincount(rs, minlength=n)[:n]) - cumulative(re_)
    if need > 1:
        cand = cumulative(cat(cand_start)) - cumulative(cat(cand_end))
    else:
        cand = z
    return {"rows": rows, "candidates": cand, "admitted": cumulative(first_adm),
            "evicted": cumulative(cat(evict_at)),
            "distinct": np.cumsum(np.bincount(batch[first], minlength=n)[:n])}
