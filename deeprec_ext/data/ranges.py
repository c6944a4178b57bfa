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
  parser written for TSV lines reads it unchanged.

Every reader returns ``(records, next_pos)``: the records (bytes) and, per record, the
position where the record after it begins. A worker that leaves after training records
``[0, i]`` of a shard hands it back with ``next_pos[i]``; the shard is handed out again
starting there, and the rules above make that reader begin exactly at record ``i + 1``.
"""
from __future__ import annotations

import gzip
import struct

import numpy as np

from deeprec_ext.data import fs

STREAM_END = 1 << 62
_EXTEND = 1 << 16


def split_text(data: bytes, base: int, start: int, end: int, eof: bool):
    """Records of ``[start, end)`` in ``data`` (whose first byte is at position ``base``,
    ``base <= max(start - 1, 0)``); ``data`` must reach past the newline that ends the
    last owned record, or ``eof`` tells it holds the end of the file."""
    rel = max(start - 1, 0) - base
    if start > 0:
        nl = data.find(b"\n", rel)
        if nl < 0:
            return [], np.zeros(0, np.int64)
        begin = nl + 1
    else:
        begin = 0
    stop = min(end - base, len(data))  # records must begin before this index
    if begin >= stop or begin >= len(data):
        return [], np.zeros(0, np.int64)
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
    return pieces, next_pos


def text_body(path: str, start: int, end: int, size: int | None = None) -> tuple[bytes, bool]:
    """The owned records of a plain text shard as one byte string, joined by ``\n``
    (their last newline dropped; ``\r`` kept), and whether there is any record (an
    empty body may be one empty record): what the ``tf.data`` reader splits in-graph."""
    data, base, eof = _text_chunk(path, start, end, size)
    if data is None:
        return b"", False
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
    data, base, eof = _text_chunk(path, start, end, size)
    if data is None:
        return [], np.zeros(0, np.int64)
    return split_text(data, base, start, end, eof)


def _text_chunk(path: str, start: int, end: int, size: int | None):
    """(bytes from ``max(start - 1, 0)`` through the newline ending the record that
    crosses ``end`` or the end of the file, their position, whether that is the end)."""
    base = max(start - 1, 0)
    with fs.RangeFile(path, size) as f:
        size = f.size
        if base >= size or start >= end:
            return None, base, True
        data = f.pread(max(min(end, size) - base, 0), base)
        parts, pos, eof = [data], base + len(data), base + len(data) >= size
        if data and data[-1:] != b"\n":
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
                eof = pos >= size
        if len(parts) > 1:
            data = b"".join(parts)
    return data, base, eof or base + len(data) >= size


def _tfrecords(data: bytes, base: int, start: int, end: int, what: str):
    """Records of the TFRecord framing in ``data`` (byte ``base`` of the stream) that
    begin in ``[start, end)``; ``start`` must be a record boundary. CRCs are not checked
    (the framing's lengths are: a bad one fails loudly)."""
    out, pos = [], []
    i, stop, n = start - base, min(end - base, len(data)), len(data)
    unpack = struct.Struct("<Q").unpack_from
    while i < stop:
        if i + 12 > n:
            raise ValueError(f"{what}: truncated TFRecord header at byte {base + i}")
        (length,) = unpack(data, i)
        j = i + 12 + length
        if j + 4 > n:
            raise ValueError(f"{what}: TFRecord at byte {base + i} runs past the data")
        out.append(data[i + 12:j])
        i = j + 4
        pos.append(base + i)
    return out, np.asarray(pos, np.int64)


def read_tfrecord_range(path: str, start: int, end: int, size: int | None = None):
    """Records of a TFRecord shard: ``[start, end)`` lie on record boundaries."""
    with fs.RangeFile(path, size) as f:
        end = min(end, f.size)
        if start >= end:
            return [], np.zeros(0, np.int64)
        data = f.pread(end - start, start)
    return _tfrecords(data, start, start, end, path)


def _gunzip(path: str) -> bytes:
    with fs.open_binary(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
        return f.read()


def read_gzip_text(path: str, start: int, end: int = STREAM_END):
    """A gzip text file is one shard; positions are bytes of the decompressed stream
    (a resumed shard decompresses from the top and starts at ``start``)."""
    data = _gunzip(path)
    return split_text(data, 0, start, min(end, len(data)), True)


def read_gzip_tfrecord(path: str, start: int, end: int = STREAM_END):
    data = _gunzip(path)
    return _tfrecords(data, 0, start, min(end, len(data)), path)


def parquet_rows(path: str, start: int, end: int):
    """Rows ``[start, end)`` of a Parquet file as tab-separated records (null -> empty
    field); only the row groups holding them are read."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with fs.open_binary(path) as f:
        return _parquet_rows(pq.ParquetFile(f), start, end, pa, pc)


def _parquet_rows(pf, start, end, pa, pc):
    md = pf.metadata
    groups, first_row, row = [], None, 0
    for g in range(md.num_row_groups):
        n = md.row_group(g).num_rows
        if row + n > start and row < end:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups or start >= end:
        return [], np.zeros(0, np.int64)
    table = pf.read_row_groups(groups)
    table = table.slice(start - first_row, min(end, row) - start)
    cols = [pc.fill_null(pc.cast(c, pa.string()), "") for c in table.columns]
    joined = cols[0] if len(cols) == 1 else pc.binary_join_element_wise(*cols, "\t")
    records = pc.cast(joined, pa.binary()).to_pylist()
    return records, np.arange(start + 1, start + 1 + len(records), dtype=np.int64)


def read_shard(path: str, start: int, end: int, fmt: str = "text", size: int | None = None):
    """``(records, next_pos)`` of one shard of any format (see the module docstring)."""
    if fmt == "text":
        return read_text_range(path, start, end, size or None)
    if fmt == "text.gz":
        return read_gzip_text(path, start, end)
    if fmt == "tfrecord":
        return read_tfrecord_range(path, start, end, size)
    if fmt == "tfrecord.gz":
        return read_gzip_tfrecord(path, start, end)
    if fmt == "parquet":
        return parquet_rows(path, start, end)
    raise ValueError(f"unknown data format {fmt!r}")


__all__ = ["read_shard", "read_text_range", "split_text", "text_body", "read_tfrecord_range",
           "read_gzip_text", "read_gzip_tfrecord", "parquet_rows", "STREAM_END"]
