"""Reading the records of one data shard (no TensorFlow here).

A shard is ``(path, start, end)`` in the file's position unit (``aimaster.shards``): bytes
for text and TFRecord, bytes of the decompressed stream for gzip files (one shard per
file), rows for Parquet. The shard owns the records that *begin* at a position in
``[start, end)``:

* text: record k begins at ``b_0 = 0`` or just after the k-th newline. A reader at
  ``start == 0`` begins at 0; otherwise at one past the first newline at or after
  ``start - 1`` (so a record beginning exactly at ``start`` is kept). It reads on past
  ``end`` to the newline that ends the last record it owns. The next shard's reader
  skips that record, since it began before its own ``start``. A record is the line
  without its ``\\n`` and one ``\\r`` before it; an empty line is an (empty) record; a
  last line without a newline is a record.
* TFRecord: shards start and end at record boundaries (the AIMaster found them).
* Parquet: rows ``[start, end)``; each row becomes one tab-separated text record, so a
  parser written for TSV lines reads it unchanged. ``parquet_columns`` reads the same
  rows as typed columns instead (no text formatting; ``tf_dataset.parquet_dataset``).

Every reader returns ``(records, next_pos)``: the records (bytes) and, per record, the
position where the record after it begins. A worker that leaves after training records
``[0, i]`` of a shard hands it back with ``next_pos[i]``; the shard is handed out again
starting there, and the rules above make that reader begin exactly at record ``i + 1``.

Bad input (``BadInput``: the file, the position, the reason): a TFRecord whose length or
data CRC (masked crc32c, as TensorFlow writes it) does not match, a record running past
the end of the file, a truncated or corrupt gzip stream, an unreadable file, and with
``fields`` set a text record with another number of fields. ``read_shard`` raises the
first one; given a ``bad`` list it skips instead: a bad record is left out (the records
around it are read; the record before it reports a ``next_pos`` past it), and where the
rest of the shard cannot be framed (a bad length, a truncated stream) the shard ends
there. Each problem is appended to ``bad`` as ``{"path", "offset", "reason"}``.
"""
from __future__ import annotations

import struct
import threading
import zlib

import numpy as np

from deeprec_ext.data import fs

STREAM_END = 1 << 62
_EXTEND = 1 << 16
_MAX_BAD = 20  # problems listed per shard; more are counted in one last entry

try:  # C crc32c (SSE4.2 where the CPU has it)
    from google_crc32c import extend as _crc32c_extend
    from google_crc32c import value as _crc32c
except ImportError:  # pragma: no cover - a dependency; without it CRCs are not checked
    _crc32c = _crc32c_extend = None


class BadInput(ValueError):
    """Unreadable, truncated or corrupt input: ``path``, ``offset`` (the shard's position
    unit: byte; byte of the decompressed stream for gzip; row for Parquet), ``reason``."""

    def __init__(self, path: str, offset: int, reason: str):
        self.path, self.offset, self.reason = path, int(offset), reason
        super().__init__(f"{path}: {reason} at {'row' if _is_parquet(path) else 'byte'} "
                         f"{int(offset)}")

    def as_dict(self) -> dict:
        return {"path": self.path, "offset": self.offset, "reason": self.reason}


def _is_parquet(path: str) -> bool:
    return path.lower().endswith((".parquet", ".pq"))


def _report(bad: list | None, path: str, offset: int, reason: str) -> None:
    """Raise (``bad`` is None: fail) or record one problem (skip)."""
    err = BadInput(path, offset, reason)
    if bad is None:
        raise err
    if len(bad) < _MAX_BAD:
        bad.append(err.as_dict())
    elif len(bad) == _MAX_BAD:
        bad.append({**err.as_dict(), "reason": "more bad records", "count": 1})
    else:
        bad[-1]["count"] += 1


def masked_crc32c(data: bytes) -> int:
    """TFRecord's CRC: crc32c rotated right by 15 bits plus 0xa282ead8."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _unmask(masked: int) -> int:
    """The crc32c behind a TFRecord's masked CRC."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def tfrecord_frame(payload: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the payload, its masked CRC."""
    head = struct.pack("<Q", len(payload))
    return head + struct.pack("<I", masked_crc32c(head)) + payload + \
        struct.pack("<I", masked_crc32c(payload))


def split_text(data: bytes, base: int, start: int, end: int, eof: bool):
    """Records of ``[start, end)`` in ``data`` (whose first byte is at position ``base``,
    ``base <= max(start - 1, 0)``); ``data`` must reach past the newline that ends the
    last owned record, or ``eof`` tells it holds the end of the file."""
    return _split_text(data, base, start, end, eof)[:2]


def _split_text(data: bytes, base: int, start: int, end: int, eof: bool):
    """``split_text`` plus the position where the first record begins."""
    rel = max(start - 1, 0) - base
    if start > 0:
        nl = data.find(b"\n", rel)
        if nl < 0:
            return [], np.zeros(0, np.int64), 0
        begin = nl + 1
    else:
        begin = 0
    stop = min(end - base, len(data))  # records must begin before this index
    if begin >= stop or begin >= len(data):
        return [], np.zeros(0, np.int64), 0
    # the owned records end at the first newline at or after index stop - 1
    last_nl = data.find(b"\n", max(stop - 1, begin))
    if last_nl < 0:
        if not eof:
            raise ValueError("split_text: data ends inside the shard's last record")
        body = data[begin:]
        tail = True  # a last record without a newline
    else:
        body = data[begin:last_nl]
        tail = False
    pieces = body.split(b"\n")
    lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
    next_pos = base + begin + np.cumsum(lengths + 1)
    if tail:
        next_pos[-1] -= 1
    if b"\r" in body:
        pieces = body.replace(b"\r\n", b"\n").split(b"\n")
        if pieces[-1].endswith(b"\r"):  # its newline is outside ``body``
            pieces[-1] = pieces[-1][:-1]
    return pieces, next_pos, base + begin


def text_body(path: str, start: int, end: int, size: int | None = None) -> tuple[bytes, bool]:
    """The owned records of a plain text shard as one byte string, joined by ``\n``
    (their last newline dropped; ``\r`` kept), and whether there is any record (an
    empty body may be one empty record): what the ``tf.data`` reader splits in-graph."""
    data, base, eof = _text_chunk(path, start, end, size)
    if data is None:
        return b"", False
    return _body(data, base, start, end)


def gzip_text_body(path: str, start: int, end: int = STREAM_END,
                   bad: list | None = None) -> tuple[bytes, bool]:
    """``text_body`` of a gzip text shard (positions in the decompressed stream); a cut
    or corrupt stream as ``read_gzip_text``: the records end at the last newline decoded."""
    data, why = _gunzip(path, bad)
    if why:
        data = data[:data.rfind(b"\n") + 1]
        _report(bad, path, len(data), why)
    return _body(data, 0, start, min(end, len(data)))


def _body(data: bytes, base: int, start: int, end: int) -> tuple[bytes, bool]:
    """The owned records of ``[start, end)`` in ``data`` (first byte at ``base``; it
    reaches past the newline ending the last owned record, or to the end of the file)."""
    rel = max(start - 1, 0) - base
    if start > 0:
        nl = data.find(b"\n", rel)
        if nl < 0:
            return b"", False
        begin = nl + 1
    else:
        begin = 0
    stop = min(end - base, len(data))
    if begin >= stop or begin >= len(data):
        return b"", False
    last_nl = data.find(b"\n", max(stop - 1, begin))
    if last_nl < 0:
        return data[begin:], True
    return data[begin:last_nl], True


def read_text_range(path: str, start: int, end: int, size: int | None = None):
    """Records of a plain text shard: one ``pread`` of ``[start - 1, end)`` plus what it
    takes to finish the record crossing ``end`` (64 KiB steps)."""
    return _read_text(path, start, end, size)[:2]


def _read_text(path: str, start: int, end: int, size: int | None = None):
    data, base, eof = _text_chunk(path, start, end, size)
    if data is None:
        return [], np.zeros(0, np.int64), 0
    return _split_text(data, base, start, end, eof)


def _text_chunk(path: str, start: int, end: int, size: int | None):
    """(bytes from ``max(start - 1, 0)`` through the newline ending the record that
    crosses ``end`` or the end of the file, their position, whether that is the end).
    A remote file is read with the first ``fs._TAIL`` bytes past ``end`` in the same
    request (each request costs the S3 client about as much CPU as 7 MB of data), and its
    size is not asked for (a short read tells the end)."""
    base = max(start - 1, 0)
    if start >= end:
        return None, base, True
    with fs.RangeFile(path, size) as f:
        if f.at_eof(base):
            return None, base, True
        want = end - base + (fs._TAIL if f.remote else 0)
        data = f.pread(want, base)
        if not data:
            return None, base, True
        pos = base + len(data)
        eof = len(data) < want or f.at_eof(pos)
        parts = [data]
        # the record crossing ``end`` ends at the first newline at or after index end-base-1
        if data.find(b"\n", max(end - base - 1, 0)) < 0:
            while not eof:
                more = f.pread(_EXTEND, pos)
                if not more:
                    eof = True
                    break
                nl = more.find(b"\n")
                if nl >= 0:
                    parts.append(more[:nl + 1])
                    break
                parts.append(more)
                pos += len(more)
                eof = len(more) < _EXTEND or f.at_eof(pos)
        if len(parts) > 1:
            data = b"".join(parts)
    return data, base, eof


def _crc32c_table() -> np.ndarray:
    """Table of the reflected CRC-32C polynomial, for ``_header_crcs``."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(0x82F63B78), t >> 1).astype(np.uint32)
    return t


_CRC_TABLE = _crc32c_table()


def _header_crcs(arr: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """crc32c of the 8-byte length field at each of ``heads`` in ``arr`` (uint8): one
    table step per byte over all headers at once, not a call per record."""
    crc = np.full(len(heads), 0xFFFFFFFF, np.uint32)
    for k in range(8):
        crc = _CRC_TABLE[(crc ^ arr[heads + k]) & 0xFF] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


def _u32_at(arr: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Little-endian uint32 at each (unaligned) offset ``at`` of ``arr`` (uint8)."""
    b = arr[at[:, None] + np.arange(4)].astype(np.uint32)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _unmask_np(masked: np.ndarray) -> np.ndarray:
    rot = (masked.astype(np.uint64) - 0xA282EAD8) & 0xFFFFFFFF
    return (((rot >> 17) | (rot << 15)) & 0xFFFFFFFF).astype(np.uint32)


_ZERO_CRC_MAX = 4096
_ZERO_CRCS: np.ndarray | None = None  # crc32c of n zero bytes, n <= _ZERO_CRC_MAX
_AR4, _AR12 = np.arange(4), np.arange(12)
_CRC_RUN = 1 << 20


def _zero_crcs(lengths: np.ndarray) -> np.ndarray:
    """crc32c of ``lengths[k]`` zero bytes, per k (a table for short records)."""
    global _ZERO_CRCS
    if _ZERO_CRCS is None:
        _ZERO_CRCS = np.array([_crc32c(bytes(k)) for k in range(_ZERO_CRC_MAX + 1)], np.uint32)
    big = lengths > _ZERO_CRC_MAX
    if not big.any():
        return _ZERO_CRCS[lengths]
    out = _ZERO_CRCS[np.where(big, 0, lengths)]
    u, inv = np.unique(lengths[big], return_inverse=True)
    out[big] = np.array([_crc32c(bytes(int(k))) for k in u], np.uint32)[inv]
    return out


def _data_crcs_match(arr: np.ndarray, heads: np.ndarray, lengths: np.ndarray,
                     stored: np.ndarray) -> bool:
    """Whether every record's payload has the crc32c ``stored`` (unmasked) beside it, in
    two C calls over the whole run of records instead of one per record.

    A CRC with its own value appended (little-endian) leaves a constant register,
    whatever the message: so a copy of the records with the headers zeroed and each
    stored CRC unmasked hashes, if and only if each payload matches, like a buffer of
    the same layout whose payloads are zeros and whose CRC fields hold the CRC of that
    many zeros (same lengths, same zeroed headers). One bad record always shows (the
    difference is that record's own CRC mismatch); several could cancel with odds of
    about 2**-32, as one corrupt record can pass its own 32-bit CRC."""
    lo, hi = int(heads[0]), int(heads[-1] + 16 + lengths[-1])
    heads = heads - lo
    at = ((heads + 12 + lengths)[:, None] + _AR4).ravel()
    d = arr[lo:hi].copy()
    d[(heads[:, None] + _AR12).ravel()] = 0
    d[at] = np.ascontiguousarray(stored, "<u4").view(np.uint8)
    z = np.zeros(hi - lo, np.uint8)
    z[at] = np.ascontiguousarray(_zero_crcs(lengths), "<u4").view(np.uint8)
    d.flags.writeable = z.flags.writeable = False  # the C call takes read-only buffers
    return _crc32c(d) == _crc32c(z)


def _unmask32(masked: np.ndarray) -> np.ndarray:
    """``_unmask`` over a uint32 array, in uint32 (wrapping) arithmetic."""
    rot = masked - np.uint32(0xA282EAD8)
    return (rot >> np.uint32(17)) | (rot << np.uint32(15))


_ZERO8_CRC = None  # crc32c of 8 zero bytes (a length field of 0)


def _all_crcs_match(arr: np.ndarray, heads: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether every record of a run of whole records (``heads``, ``lengths`` in ``arr``)
    has both a good length CRC and a good data CRC, in one C call over the run.

    CRC-32C is affine: ``crc(m) = L(m) ^ crc(zeros(len(m)))`` with ``L`` linear, and a
    message followed by its own ``L`` (little-endian) leaves a zero register when the
    register starts at zero. So in a copy of the run where every stored CRC (unmasked) is
    XORed with the CRC of as many zero bytes as its field covers (8 for a length, the
    payload's length for data), each record is two such pieces exactly when both its
    CRCs match, and the whole copy hashes from a zero register (``extend`` from
    0xFFFFFFFF) to zero. One bad CRC always shows (the register ends at that piece's
    difference, carried by an invertible map); several could cancel with odds of about
    2**-32, as one corrupt record can pass its own 32-bit CRC. A run that fails is
    checked CRC by CRC (``_frame_tfrecords``), to name the bad records."""
    global _ZERO8_CRC
    if _ZERO8_CRC is None:
        _ZERO8_CRC = np.uint32(_crc32c(bytes(8)))
    lo, hi = int(heads[0]), int(heads[-1] + 16 + lengths[-1])
    heads = heads - lo
    d = arr[lo:hi].copy()
    at_len = (heads + 8)[:, None] + _AR4  # (records, 4) byte indices of each CRC field
    at_data = (heads + 12 + lengths)[:, None] + _AR4
    len_crc = np.ascontiguousarray(d[at_len]).view("<u4")[:, 0]
    data_crc = np.ascontiguousarray(d[at_data]).view("<u4")[:, 0]
    d[at_len] = (_unmask32(len_crc) ^ _ZERO8_CRC).astype("<u4").view(np.uint8).reshape(-1, 4)
    d[at_data] = (_unmask32(data_crc) ^ _zero_crcs(lengths)).astype("<u4") \
        .view(np.uint8).reshape(-1, 4)
    return _crc32c_extend(0xFFFFFFFF, d) == 0xFFFFFFFF


def _frame_tfrecords(data: bytes, base: int, start: int, end: int, what: str,
                     bad: list | None = None, truncated: str = ""):
    """The TFRecord framing in ``data`` (byte ``base`` of the stream) for the records that
    begin in ``[start, end)``; ``start`` must be a record boundary. Returns the payloads'
    offsets in ``data``, their lengths and per payload ``next_pos``.

    Both CRCs of every record are checked. A bad data CRC skips that record (its length
    was good); a bad length CRC or a record running past ``data`` ends the shard there
    (``truncated``: the reason to give for the latter, for a stream cut short).
    Only the walk from one length to the next is a Python loop (each header depends on
    the one before). Both CRCs of all records are first checked together by one C call
    per run of about 1 MiB (``_all_crcs_match``); only when that fails are the length
    CRCs checked in numpy over all headers, the data CRCs by two C calls per run
    (``_data_crcs_match``), and one C call per record to find which record is bad."""
    empty = np.zeros(0, np.int64)
    i, stop, n = start - base, min(end - base, len(data)), len(data)
    heads = []
    add_head = heads.append
    unpack = struct.Struct("<Q").unpack_from
    lim = min(stop, n - 11)  # a header (length and its CRC) needs 12 bytes
    while i < lim:
        add_head(i)
        i += 16 + unpack(data, i)[0]
    heads = np.asarray(heads, np.int64)
    lengths = np.empty(len(heads), np.int64)
    if len(heads):  # a length is the gap to the next header; the last one is read
        lengths[:-1] = np.diff(heads) - 16
        lengths[-1] = min(unpack(data, int(heads[-1]))[0], n)
    # a corrupt length may be anything up to 2**64 - 1: bounded by the data's size
    np.minimum(lengths, n, out=lengths)
    fatal, fatal_at, fatal_why = len(heads), None, ""
    if i < stop:  # the walk stopped on a cut header
        fatal_at, fatal_why = i, truncated or "truncated TFRecord header"
    arr = np.frombuffer(data, np.uint8)
    if len(heads) and _crc32c is not None and int(heads[-1] + 16 + lengths[-1]) <= n and \
            _runs_match(arr, heads, lengths):
        # every record whole, both CRCs of each good: no per-check pass
        if fatal_at is not None:
            _report(bad, what, base + fatal_at, fatal_why)
        payload = heads + 12
        return payload, lengths, base + payload + lengths + 4
    if len(heads):
        checks = []
        if _crc32c is not None:
            bad_len = _header_crcs(arr, heads) != _unmask_np(_u32_at(arr, heads + 8))
            if bad_len.any():
                checks.append((int(np.argmax(bad_len)), 0, "corrupt TFRecord length (CRC mismatch)"))
        over = heads + 16 + lengths > n
        if over.any():
            checks.append((int(np.argmax(over)), 1, truncated or "TFRecord runs past the end of "
                           "the data (truncated file)"))
        if checks:
            k, _, why = min(checks)  # the first bad header ends the shard
            fatal, fatal_at, fatal_why = k, int(heads[k]), why
        heads, lengths = heads[:fatal], lengths[:fatal]
    payload = heads + 12
    rec_end = payload + lengths + 4
    keep = np.ones(len(heads), bool)
    if _crc32c is not None and len(heads):
        stored = _unmask_np(_u32_at(arr, payload + lengths))
        # runs of about 1 MiB: scratch buffers that stay in cache (a whole 11 MB file in one
        # run cost 3x more) and are reused by the allocator
        cuts = np.searchsorted(heads, np.arange(heads[0], heads[-1], _CRC_RUN)[1:])
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(heads)]):
            if a == b or _data_crcs_match(arr, heads[a:b], lengths[a:b], stored[a:b]):
                continue
            crc = _crc32c  # a bad record in this run: find it, one C call per record
            got = np.fromiter((crc(data[p:q]) for p, q in zip(payload[a:b].tolist(),
                                                              (payload + lengths)[a:b].tolist())),
                              np.uint32, b - a)
            keep[a:b] = got == stored[a:b]
        for k in np.flatnonzero(~keep).tolist():
            _report(bad, what, base + int(heads[k]), "corrupt TFRecord data (CRC mismatch)")
    if fatal_at is not None:
        _report(bad, what, base + fatal_at, fatal_why)
    kept = np.flatnonzero(keep)
    if not kept.size:
        return empty, empty, empty
    # a kept record resumes after the bad ones that follow it
    last_of_run = np.append(kept[1:] - 1, len(heads) - 1)
    return payload[kept], lengths[kept], base + rec_end[last_of_run]


def _runs_match(arr: np.ndarray, heads: np.ndarray, lengths: np.ndarray) -> bool:
    """``_all_crcs_match`` over runs of about ``_CRC_RUN`` bytes of records: scratch
    copies that stay in cache (one copy of a whole 11 MB file cost 3x more)."""
    cuts = np.searchsorted(heads, np.arange(heads[0], heads[-1], _CRC_RUN)[1:]).tolist()
    return all(a == b or _all_crcs_match(arr, heads[a:b], lengths[a:b])
               for a, b in zip([0, *cuts], [*cuts, len(heads)]))


def _tfrecords(data: bytes, base: int, start: int, end: int, what: str, bad: list | None = None,
               truncated: str = ""):
    """Records (payload bytes) and ``next_pos`` of ``_frame_tfrecords``."""
    offsets, lengths, next_pos = _frame_tfrecords(data, base, start, end, what, bad, truncated)
    return [data[p:q] for p, q in zip(offsets.tolist(), (offsets + lengths).tolist())], next_pos


def read_tfrecord_range(path: str, start: int, end: int, size: int | None = None,
                        bad: list | None = None):
    """Records of a TFRecord shard: ``[start, end)`` lie on record boundaries."""
    if start >= end:
        return [], np.zeros(0, np.int64)
    with fs.RangeFile(path, size) as f:
        data = f.pread(end - start, start)  # short at the end of the file: no size asked
    end = start + len(data)
    if start >= end:
        return [], np.zeros(0, np.int64)
    return _tfrecords(data, start, start, end, path, bad)


def tfrecord_buffer(path: str, start: int, end: int, fmt: str = "tfrecord",
                    size: int | None = None, bad: list | None = None):
    """The records of a TFRecord (or ``tfrecord.gz``) shard without a Python object per
    record: the bytes read, and per record the offset of its payload in them and its
    length (what the ``tf.data`` reader cuts in-graph). Framing and CRCs as ``read_shard``."""
    if fmt == "tfrecord.gz":
        data, why = _gunzip(path, bad)
        offsets, lengths, _ = _frame_tfrecords(data, 0, start, min(end, len(data)), path, bad,
                                               why)
        return data, offsets, lengths
    empty = np.zeros(0, np.int64)
    if start >= end:
        return b"", empty, empty
    with fs.RangeFile(path, size) as f:
        data = f.pread(end - start, start)  # short at the end of the file: no size asked
    end = start + len(data)
    if start >= end:
        return b"", empty, empty
    offsets, lengths, _ = _frame_tfrecords(data, start, start, end, path, bad)
    return data, offsets, lengths


def _gunzip(path: str, bad: list | None = None) -> tuple[bytes, str]:
    """The decompressed stream (every gzip member) and, when it is truncated or corrupt,
    why (``bad`` None: ``BadInput`` is raised instead); the data is what decoded before."""
    out, total, fed, read = [], 0, 0, 0
    d = zlib.decompressobj(31)
    why = ""
    with fs.open_binary(path) as f:
        try:
            while chunk := f.read(1 << 20):
                read += len(chunk)
                while chunk:
                    piece = d.decompress(chunk)
                    out.append(piece)
                    total += len(piece)
                    fed += len(chunk) - len(d.unused_data)
                    if d.eof:  # a member ended; another may follow
                        chunk, d, fed = d.unused_data, zlib.decompressobj(31), 0
                    else:
                        chunk = b""
            if fed and not d.eof:
                why = f"truncated gzip stream (ends at compressed byte {read})"
        except zlib.error as exc:
            why = f"corrupt gzip data ({exc}) in compressed bytes {read - len(chunk)}..{read}"
    if why and bad is None:
        raise BadInput(path, total, why)
    return b"".join(out), why


def read_gzip_text(path: str, start: int, end: int = STREAM_END, bad: list | None = None):
    """A gzip text file is one shard; positions are bytes of the decompressed stream
    (a resumed shard decompresses from the top and starts at ``start``)."""
    return _read_gzip_text(path, start, end, bad)[:2]


def _read_gzip_text(path: str, start: int, end: int = STREAM_END, bad: list | None = None):
    data, why = _gunzip(path, bad)
    if why:  # the last line was cut: the records end at the last newline
        data = data[:data.rfind(b"\n") + 1]
        _report(bad, path, len(data), why)
    return _split_text(data, 0, start, min(end, len(data)), True)


def read_gzip_tfrecord(path: str, start: int, end: int = STREAM_END, bad: list | None = None):
    data, why = _gunzip(path, bad)
    return _tfrecords(data, 0, start, min(end, len(data)), path, bad, why)


def parquet_rows(path: str, start: int, end: int):
    """Rows ``[start, end)`` of a Parquet file as tab-separated records (null -> empty
    field); only the row groups holding them are read."""
    joined = _parquet_joined(path, start, end)
    records = [] if joined is None else joined.to_pylist()
    return records, np.arange(start + 1, start + 1 + len(records), dtype=np.int64)


def parquet_buffer(path: str, start: int, end: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The records of ``parquet_rows`` without a Python object per row: one byte string
    holding them back to back, and per record its offset in it and its length (what the
    ``tf.data`` reader cuts in-graph)."""
    joined = _parquet_joined(path, start, end)
    if joined is None or not len(joined):
        return b"", np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, offsets_buf, data_buf = joined.buffers()
    offsets = np.frombuffer(offsets_buf, np.int64, len(joined) + 1, joined.offset * 8)
    first = int(offsets[0])
    data = data_buf.to_pybytes()[first:int(offsets[-1])] if data_buf is not None else b""
    return data, offsets[:-1] - first, np.diff(offsets)


def _parquet_joined(path: str, start: int, end: int):
    """Rows ``[start, end)`` joined by pyarrow (cast to text, nulls as empty, tab between
    fields) into one ``large_binary`` array, or None when no row group holds them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = parquet_table(path, start, end)
    if table is None:
        return None
    cols = [pc.fill_null(pc.cast(c, pa.string()), "") for c in table.columns]
    joined = cols[0] if len(cols) == 1 else pc.binary_join_element_wise(*cols, "\t")
    # large_binary: 64-bit offsets, so a shard over 2 GiB of text still makes one array
    return pc.cast(joined, pa.large_binary()).combine_chunks()


def parquet_table(path: str, start: int, end: int, columns: list[str] | None = None):
    """Rows ``[start, end)`` of a Parquet file as a pyarrow ``Table`` (only ``columns``,
    all by default), or None when no row group holds them. Only the row groups holding
    the rows are read (remote files: without read-ahead, see ``fs.open_binary``)."""
    import pyarrow.parquet as pq

    if fs.is_remote(path):
        # one ranged GET per read, the footer kept after the file's first shard
        known = _remote_parquet_meta(path)
        rf = fs.RangeFile(path, known[0] if known else None)
        f = rf.reader()
    else:
        known, rf, f = None, None, fs.open_binary(path, sequential=False)
    with f:
        pf = pq.ParquetFile(f, metadata=known[1] if known else None, pre_buffer=True)
        md = pf.metadata
        if rf is not None and known is None:
            _remote_parquet_meta(path, (rf.size, md, pf.schema_arrow))
        if columns is not None:
            missing = [c for c in columns if c not in md.schema.names]
            if missing:
                raise BadInput(path, start, f"no column {', '.join(map(repr, missing))} "
                               f"(the file has {', '.join(md.schema.names)})")
        groups, first_row, row = [], None, 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if row + n > start and row < end:
                groups.append(g)
                first_row = row if first_row is None else first_row
            row += n
        if not groups or start >= end:
            return None
        table = pf.read_row_groups(groups, columns=columns)
    return table.slice(start - first_row, min(end, row) - start)


_PQ_META: dict = {}
_PQ_META_MAX = 256
_PQ_META_LOCK = threading.Lock()


def _remote_parquet_meta(path: str, value=None):
    """The (size, footer, Arrow schema) of a remote Parquet file, kept per process after
    its first shard or schema read: every later shard of the file is then one ranged GET
    (no HEAD, no footer read; each request costs the S3 client about as much CPU as 7 MB
    of data). Data
    files are not rewritten in place (a changed file is not read again, see the guide's
    ``watch``), so the footer stays valid."""
    with _PQ_META_LOCK:  # shards are read by tf.data's parallel map threads
        if value is None:
            return _PQ_META.get(path)
        if len(_PQ_META) >= _PQ_META_MAX:
            _PQ_META.pop(next(iter(_PQ_META)), None)
        _PQ_META[path] = value
        return value


# typed columns: how each Arrow type reaches tf.data (``parquet_kinds``)
NUMBER_KINDS = {"int64": np.int64, "uint64": np.uint64, "float32": np.float32,
                "float64": np.float64, "bool": np.bool_}


def column_kind(arrow_type) -> str | None:
    """``int64``, ``uint64``, ``float32``, ``float64``, ``bool`` or ``string`` for an Arrow
    type a column can be read as (every integer up to 64 bits signed as int64, uint64 as
    uint64, float16/32 as float32; string, binary and their dictionary encodings as
    string); None for the others (nested, timestamps, decimals, ...)."""
    import pyarrow as pa
    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "uint64" if t == pa.uint64() else "int64"
    if pa.types.is_floating(t):
        return "float64" if t == pa.float64() else "float32"
    if pa.types.is_boolean(t):
        return "bool"
    if (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        return "string"
    return None


def parquet_kinds(path: str, columns: list[str] | None = None) -> dict[str, str]:
    """``{column: kind}`` (``column_kind``) of a Parquet file's schema, read from its
    footer, in file order (or in the order of ``columns``); a column of another type
    is an error naming it."""
    import pyarrow.parquet as pq
    if fs.is_remote(path):
        # the footer the file's shards read too, kept per process: a pipeline built again
        # over the same files (an evaluation round, a new epoch) asks the store nothing
        known = _remote_parquet_meta(path)
        if known is None:
            rf = fs.RangeFile(path)
            with rf.reader() as f:
                pf = pq.ParquetFile(f)
                known = _remote_parquet_meta(path, (rf.size, pf.metadata, pf.schema_arrow))
        schema = known[2]
    else:
        with fs.open_binary(path, sequential=False) as f:
            schema = pq.ParquetFile(f).schema_arrow
    names = list(schema.names) if columns is None else list(columns)
    out = {}
    for name in names:
        if name not in schema.names:
            raise ValueError(f"{path}: no column {name!r} (the file has "
                             f"{', '.join(schema.names)})")
        kind = column_kind(schema.field(name).type)
        if kind is None:
            raise ValueError(f"{path}: column {name!r} has type {schema.field(name).type}, "
                             "which cannot be read as a tensor column (numbers, bool, "
                             "string); leave it out with columns=[...] or cast it when "
                             "writing the file")
        out[name] = kind
    return out


def _string_buffer(arr, index_dtype=np.int64) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A string/binary Arrow array (nulls already filled) as one byte string plus per
    value its offset and length in it, as ``index_dtype``: no Python object per value.
    int32 (what ``parquet_dataset`` cuts with) reads Arrow's 32-bit offsets in place: no
    widening copy, half the bytes handed to TensorFlow (measured in docs/BENCHMARKS.md)."""
    import pyarrow as pa
    if not len(arr):
        return b"", np.zeros(0, index_dtype), np.zeros(0, index_dtype)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, offsets_buf, data_buf = arr.buffers()[:3]
    width = 8 if large else 4
    offsets = np.frombuffer(offsets_buf, np.int64 if large else np.int32, len(arr) + 1,
                            arr.offset * width)
    first, last = int(offsets[0]), int(offsets[-1])
    data = data_buf.slice(first, last - first).to_pybytes() if data_buf is not None and \
        last > first else b""
    if offsets.dtype != index_dtype:
        if np.iinfo(index_dtype).max < last - first:
            raise ValueError(f"{last - first} bytes of strings in one column of one shard, "
                             f"more than {np.dtype(index_dtype).name} offsets reach")
        offsets = (offsets - first if first else offsets).astype(index_dtype)
        first = 0
    # a row group read from its first row starts at 0: its offsets serve as they are
    starts = offsets[:-1] if first == 0 else offsets[:-1] - offsets.dtype.type(first)
    return data, starts, np.diff(offsets)


def parquet_columns(path: str, start: int, end: int, kinds: dict[str, str],
                    null_values: dict | None = None, index_dtype=np.int64) -> list:
    """Rows ``[start, end)`` as typed columns, flat, in the order of ``kinds``
    (``parquet_kinds``): a numpy array per number column (a null becomes
    ``null_values.get(name, 0)``, false for bool), and per string column its values as one
    byte string, offsets and lengths (``_string_buffer``, as ``index_dtype``; a null is
    empty). A column missing or of another kind in this file is ``BadInput`` naming it."""
    import pyarrow as pa
    import pyarrow.compute as pc
    null_values = null_values or {}
    table = parquet_table(path, start, end, list(kinds))
    out: list = []
    for name, kind in kinds.items():
        if table is None:
            out += [b"", np.zeros(0, index_dtype), np.zeros(0, index_dtype)] \
                if kind == "string" else [np.zeros(0, NUMBER_KINDS[kind])]
            continue
        col = table.column(name)
        here = column_kind(col.type)
        if here != kind:
            raise BadInput(path, start, f"column {name!r} has type {col.type} here, "
                           f"read as {kind} (from the schema of the first file)")
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        if kind == "string":
            if arr.null_count:
                arr = pc.fill_null(arr, pa.scalar(b"" if pa.types.is_binary(arr.type) or
                                                  pa.types.is_large_binary(arr.type) else "",
                                                  arr.type))
            try:
                out += list(_string_buffer(arr, index_dtype))
            except ValueError as exc:
                raise BadInput(path, start, f"column {name!r}: {exc}; write smaller row "
                               "groups") from None
            continue
        if arr.null_count:
            fill = null_values.get(name, False if kind == "bool" else 0)
            arr = pc.fill_null(arr, pa.scalar(fill, arr.type))
        out.append(arr.to_numpy(zero_copy_only=False).astype(NUMBER_KINDS[kind], copy=False))
    return out


def _field_separators(records: list[bytes], delimiter: bytes) -> np.ndarray:
    """Per record, how many ``delimiter``s it holds; for a one-byte delimiter in numpy
    over the joined records (no Python call per record)."""
    if len(delimiter) != 1:
        return np.fromiter((r.count(delimiter) for r in records), np.int64, len(records))
    arr = np.frombuffer(b"\n".join(records), np.uint8)
    ends = np.flatnonzero(arr == 10)
    if len(ends) != len(records) - 1:  # a record holds a newline (Parquet text): slow path
        return np.fromiter((r.count(delimiter) for r in records), np.int64, len(records))
    # the delimiters before each record's end, less those before the previous record's end
    before_end = np.searchsorted(np.flatnonzero(arr == delimiter[0]), np.append(ends, len(arr)))
    counts = np.diff(before_end, prepend=0)
    return counts


def _check_fields(records, next_pos, first: int, fields: int, delimiter: bytes, path: str,
                  bad: list | None):
    """Leave out the records without exactly ``fields`` fields (a record before a left-out
    one reports a ``next_pos`` past it)."""
    if not records:
        return records, next_pos
    want = fields - 1
    counts = _field_separators(records, delimiter)
    wrong = np.flatnonzero(counts != want)
    if not wrong.size:
        return records, next_pos
    starts = np.concatenate(([first], next_pos[:-1]))
    for k in wrong[:_MAX_BAD + 1] if bad is not None else wrong[:1]:
        _report(bad, path, int(starts[k]), f"{counts[k] + 1} fields, expected {fields}")
    if bad is not None and wrong.size > _MAX_BAD + 1:
        bad[-1]["count"] += int(wrong.size - _MAX_BAD - 1)
    keep = np.ones(len(records), bool)
    keep[wrong] = False
    kept = np.flatnonzero(keep)
    # each kept record resumes after the bad ones that follow it
    last_of_run = np.append(kept[1:] - 1, len(records) - 1)
    return [records[k] for k in kept], next_pos[last_of_run]


def read_shard(path: str, start: int, end: int, fmt: str = "text", size: int | None = None,
               *, bad: list | None = None, fields: int = 0, delimiter: bytes = b"\t"):
    """``(records, next_pos)`` of one shard of any format (see the module docstring).

    Bad input raises ``BadInput``; with a ``bad`` list it is skipped and listed there.
    ``fields`` > 0: a text (or Parquet) record must have that many ``delimiter``-separated
    fields."""
    first = [start]

    def read():
        if fmt == "text":
            records, next_pos, first[0] = _read_text(path, start, end, size or None)
            return records, next_pos
        if fmt == "text.gz":
            records, next_pos, first[0] = _read_gzip_text(path, start, end, bad)
            return records, next_pos
        if fmt == "tfrecord":
            return read_tfrecord_range(path, start, end, size, bad)
        if fmt == "tfrecord.gz":
            return read_gzip_tfrecord(path, start, end, bad)
        if fmt == "parquet":
            return parquet_rows(path, start, end)
        raise ValueError(f"unknown data format {fmt!r}")

    out = _guarded(read, path, start, bad)
    if out is None:
        return [], np.zeros(0, np.int64)
    records, next_pos = out
    if fields > 0 and fmt in ("text", "text.gz", "parquet"):
        records, next_pos = _check_fields(records, next_pos, first[0], fields, delimiter, path,
                                          bad)
    return records, next_pos


def read_buffer(path: str, start: int, end: int, fmt: str, size: int | None = None,
                *, bad: list | None = None) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The records of a TFRecord, ``tfrecord.gz`` or Parquet shard as one byte string and
    per record its offset and length in it (``tfrecord_buffer``, ``parquet_buffer``); bad
    input as ``read_shard`` (an unreadable shard holds no record under ``bad``)."""
    if fmt in ("tfrecord", "tfrecord.gz"):
        read = lambda: tfrecord_buffer(path, start, end, fmt, size, bad)  # noqa: E731
    elif fmt == "parquet":
        read = lambda: parquet_buffer(path, start, end)  # noqa: E731
    else:
        raise ValueError(f"read_buffer: no buffer reader for format {fmt!r}")
    out = _guarded(read, path, start, bad)
    return out if out is not None else (b"", np.zeros(0, np.int64), np.zeros(0, np.int64))


def _guarded(read, path: str, start: int, bad: list | None):
    """``read()``, with an unreadable or corrupt file reported at the shard's start
    (raised, or listed in ``bad`` and None returned)."""
    try:
        return read()
    except BadInput:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        _report(bad, path, start, f"unreadable ({exc})")
        return None
    except ValueError as exc:  # pyarrow's ArrowInvalid among them: a corrupt file
        if str(exc).startswith("unknown data format"):
            raise
        _report(bad, path, start, f"unreadable ({exc})")
        return None


__all__ = ["read_shard", "BadInput", "masked_crc32c", "tfrecord_frame", "read_text_range", "split_text", "text_body", "read_tfrecord_range",
           "read_gzip_text", "read_gzip_tfrecord", "parquet_rows", "parquet_buffer",
           "tfrecord_buffer", "read_buffer", "gzip_text_body", "parquet_table",
           "parquet_kinds", "parquet_columns", "column_kind",
           "STREAM_END"]
