"""Rows of Parquet shards as typed columns, buffered between shards and batches.

The worker's shard loop (``deeprec_ext.worker.shard_batches``) treats its buffer as a
sequence of records: ``len``, slices, ``extend``. ``ColumnRows`` gives typed columns that
interface, so a batch may span shards and a shard may be cut at any row (a straggler's
split, a leaving worker's hand-back) exactly as with lines.

A column is held in the flat form ``ranges.parquet_columns`` returns: a numpy array per
number column; per string column one byte string with an offset and a length per value.
Slices share memory; a batch is assembled once (``flat``), in one copy of its bytes, and
cut into ``tf.string`` values in the graph (``tf_dataset.columns_from_flat``): no Python
object per value.
"""
from __future__ import annotations

import numpy as np

from deeprec_ext.data.ranges import NUMBER_KINDS


def _empty(kind: str):
    if kind == "string":
        return (memoryview(b""), np.zeros(0, np.int64), np.zeros(0, np.int64))
    return np.zeros(0, NUMBER_KINDS[kind])


class ColumnRows:
    """Rows of typed columns (``kinds``: ``{column: kind}`` as ``ranges.parquet_kinds``),
    as pieces that share the buffers they were read into."""

    __slots__ = ("kinds", "_pieces", "_n")

    def __init__(self, kinds: dict[str, str], flat: list | None = None):
        self.kinds = dict(kinds)
        self._pieces: list[tuple[int, list]] = []
        self._n = 0
        if flat is not None:
            self._add(self._from_flat(flat))

    def _from_flat(self, flat: list) -> tuple[int, list]:
        cols, i, n = [], 0, None
        for kind in self.kinds.values():
            if kind == "string":
                data, offsets, lengths = flat[i:i + 3]
                i += 3
                col = (memoryview(data), np.asarray(offsets, np.int64),
                       np.asarray(lengths, np.int64))
                rows = len(col[1])
            else:
                col = np.asarray(flat[i])
                i += 1
                rows = len(col)
            if n is not None and rows != n:
                raise ValueError(f"columns of one piece differ in length ({rows} vs {n})")
            n = rows
            cols.append(col)
        return (n or 0, cols)

    def _add(self, piece) -> None:
        if piece[0]:
            self._pieces.append(piece)
            self._n += piece[0]

    def __len__(self) -> int:
        return self._n

    def extend(self, other: "ColumnRows") -> None:
        if other.kinds != self.kinds:
            raise ValueError("cannot join rows of other columns")
        for piece in other._pieces:
            self._add(piece)

    @staticmethod
    def _slice_piece(piece, a: int, b: int):
        n, cols = piece
        out = []
        for col in cols:
            if isinstance(col, tuple):
                data, offsets, lengths = col
                offsets, lengths = offsets[a:b], lengths[a:b]
                if len(offsets):  # values lie back to back: keep only their bytes
                    lo = int(offsets[0])
                    hi = int(offsets[-1] + lengths[-1])
                    out.append((data[lo:hi], offsets - lo, lengths))
                else:
                    out.append((data[0:0], offsets, lengths))
            else:
                out.append(col[a:b])
        return (b - a, out)

    def __getitem__(self, key) -> "ColumnRows":
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ColumnRows takes contiguous slices only")
        start, stop, _ = key.indices(self._n)
        out = ColumnRows(self.kinds)
        pos = 0
        for piece in self._pieces:
            n = piece[0]
            a, b = max(start - pos, 0), min(stop - pos, n)
            if a < b:
                out._add(piece if (a, b) == (0, n) else self._slice_piece(piece, a, b))
            pos += n
            if pos >= stop:
                break
        return out

    def flat(self) -> list:
        """The rows as one flat list (numbers: an array per column; strings: bytes,
        offsets, lengths), the layout ``tf_dataset.columns_from_flat`` reads."""
        out = []
        for j, kind in enumerate(self.kinds.values()):
            parts = [cols[j] for _, cols in self._pieces]
            if kind != "string":
                out.append(np.concatenate(parts) if parts else _empty(kind))
                continue
            if not parts:
                out += [b"", np.zeros(0, np.int64), np.zeros(0, np.int64)]
                continue
            shift, offsets = 0, []
            for data, offs, _ in parts:
                offsets.append(offs + shift)
                shift += len(data)
            out += [b"".join(p[0] for p in parts), np.concatenate(offsets),
                    np.concatenate([p[2] for p in parts])]
        return out
