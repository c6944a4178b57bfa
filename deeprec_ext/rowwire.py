"""``RowBatch`` on the wire without protobuf's per-field copies (live migration).

A migration moves hundreds of MB of rows. Through the generated message every buffer was
copied three times on each side (numpy -> bytes, bytes -> message, message -> wire, and
back). Here the sender writes the wire bytes with one join of its numpy buffers, and the
receiver reads fields as memoryviews of the received bytes; numpy views them in place. The
bytes are the protobuf encoding of ``ps.proto``'s ``RowBatch``: either side may be the
generated message (``RowBatch.FromString`` reads what :func:`encode` writes, and
:func:`parse` reads what ``SerializeToString`` writes).
"""
from __future__ import annotations

import struct

import numpy as np

from deeprec_ext.proto import ps_pb2

_LEN, _VARINT = 2, 0
# RowBatch field numbers (ps.proto)
_CONFIG, _IDS, _ROWS, _DELETED, _ORIGIN, _RESET, _ORIGIN_SEQ, _APPLIED, _END, _TOTAL, _COUNTS, \
    _BACKGROUND, _REPLICA_AFTER, _CUT_AGE = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14
_FIXED64 = 1


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # int64: negative numbers as their two's complement (10 bytes)
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _len_field(field: int, size: int) -> bytes:
    return _varint(field << 3 | _LEN) + _varint(size)


def encode(config: bytes = b"", ids: np.ndarray | None = None, rows: np.ndarray | None = None,
           counts: np.ndarray | None = None, deleted_ids: np.ndarray | None = None,
           total_rows: int = 0, applied_request_ids=(), origin: str = "",
           reset: bool = False, origin_sequence: int = 0, end: bool = False,
           background: bool = False, replica_after: str = "", cut_age_ms: float = 0.0) -> bytes:
    """Wire bytes of a ``RowBatch``: ``config`` a serialized ``TableConfig``, ``ids`` int64,
    ``rows`` float32 [n, row_width] (the store's layout), ``counts`` uint32 [n]. Each
    array is copied once, into the result. ``origin`` .. ``end``: replication's fields;
    ``background``: rows of a paced migration round (the importer yields to training);
    ``replica_after``: the importer's replication peer once the migration is published."""
    parts: list = []
    if config:
        parts += [_len_field(_CONFIG, len(config)), config]
    if origin:
        b = origin.encode()
        parts += [_len_field(_ORIGIN, len(b)), b]
    if reset:
        parts += [_varint(_RESET << 3 | _VARINT), b"\x01"]
    if origin_sequence:
        parts += [_varint(_ORIGIN_SEQ << 3 | _VARINT), _varint(int(origin_sequence))]
    if end:
        parts += [_varint(_END << 3 | _VARINT), b"\x01"]
    for field, arr, dtype in ((_IDS, ids, "<i8"), (_ROWS, rows, "<f4"),
                              (_DELETED, deleted_ids, "<i8"), (_COUNTS, counts, "<u4")):
        if arr is None or arr.size == 0:
            continue
        arr = np.ascontiguousarray(arr, dtype=dtype)
        parts += [_len_field(field, arr.nbytes), memoryview(arr).cast("B")]
    if applied_request_ids:  # the generated message's encoder: ~20x a loop of ours here
        parts.append(ps_pb2.RowBatch(applied_request_ids=applied_request_ids).SerializeToString())
    if total_rows:
        parts += [_varint(_TOTAL << 3 | _VARINT), _varint(int(total_rows))]
    if background:
        parts += [_varint(_BACKGROUND << 3 | _VARINT), b"\x01"]
    if replica_after:
        b = replica_after.encode()
        parts += [_len_field(_REPLICA_AFTER, len(b)), b]
    if cut_age_ms:
        parts += [_varint(_CUT_AGE << 3 | _FIXED64), struct.pack("<d", float(cut_age_ms))]
    return b"".join(parts)


class RowBatchView:
    """A parsed ``RowBatch`` whose bytes fields are memoryviews of the received message
    (same attribute names as the generated class; ``config`` is parsed on first use)."""

    __slots__ = ("_config", "ids", "rows", "deleted_ids", "origin", "reset", "origin_sequence",
                 "applied_request_ids", "end", "total_rows", "counts", "background",
                 "replica_after", "cut_age_ms")

    def __init__(self):
        self._config = b""
        self.ids = self.rows = self.deleted_ids = self.counts = b""
        self.origin = self.replica_after = ""
        self.reset = self.end = self.background = False
        self.origin_sequence = self.total_rows = 0
        self.cut_age_ms = 0.0
        self.applied_request_ids: list[str] = []

    @property
    def config(self) -> ps_pb2.TableConfig:
        c = self._config
        if not isinstance(c, ps_pb2.TableConfig):
            c = self._config = ps_pb2.TableConfig.FromString(bytes(c))
        return c


def _read_varint(mv: memoryview, i: int, n: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= n or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = mv[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def _int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _merge_tail(out: RowBatchView, tail: memoryview) -> None:
    """The fields of ``tail`` (wire bytes from a field on) into ``out``, read by the
    generated parser; a later field replaces an earlier one, repeated ones add up."""
    try:
        m = ps_pb2.RowBatch.FromString(bytes(tail))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, named by the caller
        raise ValueError(f"bad RowBatch bytes: {exc}") from None
    for fd, val in m.ListFields():
        if fd.name == "applied_request_ids":
            out.applied_request_ids.extend(val)
        elif fd.name == "config":
            out._config = val
        elif fd.name in RowBatchView.__slots__:  # a field this view does not know: skipped
            setattr(out, fd.name, val)


def parse(raw) -> RowBatchView:
    """``RowBatch`` wire bytes -> :class:`RowBatchView` (no copy of the row buffers).
    Raises ValueError on bytes that are not a ``RowBatch``."""
    mv = memoryview(raw).cast("B")
    n, i = len(mv), 0
    out = RowBatchView()
    while i < n:
        start = i
        tag, i = _read_varint(mv, i, n)
        field, wt = tag >> 3, tag & 7
        if field == _APPLIED and wt == _LEN:
            # request ids come last and by the thousand (a migration's first round: up to
            # 200k): the rest of the message goes to the generated parser, ~20x this loop
            _merge_tail(out, mv[start:])
            break
        if field == 0:
            raise ValueError("field number 0")
        if wt == _LEN:
            size, i = _read_varint(mv, i, n)
            j = i + size
            if j > n:
                raise ValueError(f"field {field}: {size} bytes past the end of the message")
            val = mv[i:j]
            i = j
        elif wt == _VARINT:
            val, i = _read_varint(mv, i, n)
        elif wt in (1, 5):  # fixed64 / fixed32: cut_age_ms (a double); others skipped
            j = i + (8 if wt == 1 else 4)
            if j > n:
                raise ValueError(f"field {field}: truncated")
            if field == _CUT_AGE and wt == _FIXED64:
                out.cut_age_ms = struct.unpack_from("<d", mv, i)[0]
            i = j
            continue
        else:
            raise ValueError(f"field {field}: wire type {wt}")
        expected_len = field in (_CONFIG, _IDS, _ROWS, _DELETED, _ORIGIN, _APPLIED, _COUNTS,
                                 _REPLICA_AFTER)
        if expected_len != (wt == _LEN) and field <= _REPLICA_AFTER:
            raise ValueError(f"field {field}: wire type {wt}")
        if field == _CONFIG:
            out._config = val
        elif field == _IDS:
            out.ids = val
        elif field == _ROWS:
            out.rows = val
        elif field == _DELETED:
            out.deleted_ids = val
        elif field == _ORIGIN:
            out.origin = str(val, "utf-8")
        elif field == _RESET:
            out.reset = bool(val)
        elif field == _ORIGIN_SEQ:
            out.origin_sequence = _int64(val)
        elif field == _APPLIED:
            out.applied_request_ids.append(str(val, "utf-8"))
        elif field == _END:
            out.end = bool(val)
        elif field == _TOTAL:
            out.total_rows = _int64(val)
        elif field == _COUNTS:
            out.counts = val
        elif field == _BACKGROUND:
            out.background = bool(val)
        elif field == _REPLICA_AFTER:
            out.replica_after = str(val, "utf-8")
    if not isinstance(out._config, bytes):  # check the nested message here, not in the handler
        out.config  # noqa: B018 - raises on bytes that are not a TableConfig
    return out
