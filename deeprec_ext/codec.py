"""numpy <-> wire bytes. Raw little-endian buffers; shapes come from the table's dim.

Decoding validates sizes and returns read-only views over the message bytes (no copy),
so a malformed payload is an error naming the field, never a silent reinterpretation.
"""
from __future__ import annotations

import numpy as np

from deeprec_ext.errors import InvalidRequestError

_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=_I64).tobytes()


def floats_to_bytes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=_F32).tobytes()


def ids_from_bytes(buf: bytes, field: str = "ids") -> np.ndarray:
    if len(buf) % 8:
        raise InvalidRequestError(f"{field}: {len(buf)} bytes is not a whole number of int64 ids")
    return np.frombuffer(buf, dtype=_I64)


def rows_from_bytes(buf: bytes, n: int, row_width: int, field: str = "rows") -> np.ndarray:
    """Full table rows [n, row_width], or [n, row_width + 1] when each row carries its
    update count last (rows moved by replication and migration)."""
    if n and len(buf) == n * (row_width + 1) * 4:
        return floats_from_bytes(buf, n, row_width + 1, field)
    return floats_from_bytes(buf, n, row_width, field)


def floats_from_bytes(buf: bytes, rows: int, dim: int, field: str = "values") -> np.ndarray:
    expected = rows * dim * 4
    if len(buf) != expected:
        raise InvalidRequestError(
            f"{field}: got {len(buf)} bytes, expected {expected} for {rows} rows of dim {dim} float32")
    return np.frombuffer(buf, dtype=_F32).reshape(rows, dim)


def counts_from_bytes(buf, n: int, field: str = "counts") -> np.ndarray:
    """uint32 update counts [n] (rows moved by a migration carry them apart)."""
    if len(buf) != 4 * n:
        raise InvalidRequestError(f"{field}: got {len(buf)} bytes, expected {4 * n} for {n} "
                                  "uint32 counts")
    return np.frombuffer(buf, dtype=_U32)
