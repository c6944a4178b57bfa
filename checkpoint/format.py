"""Byte-level format of checkpoint files: chunk headers, names, manifest checksum.

Chunk (all integers little-endian)::

    fixed header  HEADER struct (54 bytes, see below)
    table name    name_len bytes of UTF-8
    header crc    u32 crc32 of fixed header + name
    payload       comp_len bytes of  keys int64[n] || rows float32[n, row_width]  (rows/tombstones)
                                  or, format 4 rows with flag COUNTS (update counts):
                                     keys int64[n] || rows float32[n, row_width - 1]
                                     || counts uint32[n]  (the store's own columns)
                                  or a piece of a dense array's raw bytes        (array)
                  either as one zstd frame (with content size and xxh64 content checksum)
                  or, with flag RAW (format 3), stored as is (comp_len == raw_len)

Fixed header fields: magic ``DRCK``, format version (u16), kind (u8), flags (u8: 0, or
``FLAG_RAW`` from format 3 on, ``FLAG_COUNTS`` from format 4 on),
num_slots (u32), slot_lo, slot_hi (u32: inclusive range of the routing slots of the keys in
the chunk), n (u64: rows, keys, or bytes for an array piece), row_width (u32: floats per row,
0 for tombstones/arrays), raw_len (u64: decompressed length), comp_len (u64), payload crc32
(u32, of the compressed bytes: zlib's crc32 up to format 3, crc32c (Castagnoli) from
format 4 on), name_len (u16). The header crc is zlib's crc32 in every format.

A file ends with an END chunk (no payload, ``n`` = number of chunks before it, ``raw_len`` =
its own offset), so a file truncated at a chunk boundary is detectable even without the
manifest.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import re
import struct
import zlib

import numpy as np

MAGIC = b"DRCK"
# 2: rows carry each row's update count as a last float32 column (table info "counts")
# 3: a chunk's payload may be stored uncompressed (flag RAW) when zstd does not pay, and
#    files carry no sha256 (the manifest's "sha256" is null): the header crc32 and the
#    payload crc32 of every chunk, whose index tiles the file, cover every byte already
# 4: payload crc is crc32c (hardware, ~3x zlib's crc32 here), and a rows chunk of a table
#    with counts holds its columns as the store does (keys, then the rows of value + slots,
#    then the uint32 counts), so a restore reads a chunk straight into the table's arrays
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
FLAG_RAW = 1  # payload stored as is, not as a zstd frame (format 3)
FLAG_COUNTS = 2  # rows chunk: keys || rows [n, row_width - 1] || counts uint32 [n] (format 4)
MANIFEST_FORMAT = "deeprec-ext-checkpoint"
MANIFEST_NAME = "manifest.json"

KIND_ROWS = 1
KIND_TOMBSTONES = 2
KIND_ARRAY = 3
KIND_END = 15
KIND_NAMES = {KIND_ROWS: "rows", KIND_TOMBSTONES: "tombstones", KIND_ARRAY: "array",
              KIND_END: "end"}

HEADER = struct.Struct("<4sHBBIIIQIQQIH")
CRC = struct.Struct("<I")

# Columns of a chunk entry in the manifest's per-file chunk index.
CHUNK_FIELDS = ["offset", "kind", "n", "slot_lo", "slot_hi", "raw_len", "comp_len", "crc32"]

DIR_RE = re.compile(r"^ckpt-(\d{8,})-(full|incr)$")


class CheckpointError(Exception):
    """A checkpoint (or one of its files) is missing, truncated, corrupt or inconsistent."""


class NoValidCheckpoint(CheckpointError):
    """No restorable checkpoint chain was found."""


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _load_crc32c():
    """``crc32c_extend(crc, address, length)`` of the C library google-crc32c ships (SSE4.2),
    called through ctypes: no copy of the buffer and the GIL released, which the module's
    own ``extend`` does for ``bytes`` only (it takes no memoryview or array). None if the
    library is not found (then a slower path through the module). Returns the function
    twice: releasing the GIL, and holding it (for small buffers, see crc32c)."""
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - a declared dependency
        return None, None
    base = os.path.dirname(google_crc32c.__file__)
    cands = sorted(glob.glob(os.path.join(base, os.pardir, "google_crc32c.libs", "libcrc32c*")))
    cands += glob.glob(os.path.join(base, "libcrc32c*"))
    for path in cands:
        fns = []
        for dll in (ctypes.CDLL, ctypes.PyDLL):
            try:
                fn = dll(path).crc32c_extend
            except (OSError, AttributeError):
                break
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_uint32
            if fn(0, ctypes.c_char_p(b"123456789"), 9) != 0xE3069283:  # the check value
                break
            fns.append(fn)
        if len(fns) == 2:
            return fns[0], fns[1]
    return None, None


_CRC32C, _CRC32C_GIL = _load_crc32c()
# buffers smaller than this are checksummed holding the GIL (a few us): a full
# checkpoint's chunk has ~16 pieces of keys and counts of 4-8 KB, and releasing the GIL
# for each let another thread take it before the checksumming thread got it back; the
# rows' pieces (128 KB, most of the bytes) are checksummed with it released, beside the
# other threads (4M rows, 10 rounds, load 4-9: wall best 627 ms against 775 holding it
# up to 1 MB and 689 never holding it; CPU 458 / 465 / 476 ms)
_CRC_GIL_MAX = 64 << 10


def crc32c(data, crc: int = 0) -> int:
    """crc32c of any C-contiguous buffer (bytes, memoryview, numpy array), continuing
    from ``crc``."""
    if _CRC32C is not None and isinstance(data, memoryview) and not data.readonly \
            and data.c_contiguous:  # the writer's views: no numpy array made
        n = data.nbytes
        if not n:
            return crc
        fn = _CRC32C_GIL if n < _CRC_GIL_MAX else _CRC32C
        return fn(crc, ctypes.addressof(ctypes.c_char.from_buffer(data)), n)
    a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else \
        data.reshape(-1).view(np.uint8)
    if not a.size:
        return crc
    if _CRC32C is not None:
        fn = _CRC32C_GIL if a.size < _CRC_GIL_MAX else _CRC32C
        return fn(crc, a.ctypes.data, a.size)
    import google_crc32c  # pragma: no cover - library not found: one copy per call
    return google_crc32c.extend(crc, a.tobytes())


def payload_crc(data, version: int, crc: int = 0) -> int:
    """The checksum of a chunk payload of format ``version`` (crc32c from 4 on)."""
    if version >= 4:
        return crc32c(data, crc)
    return zlib.crc32(data, crc) & 0xFFFFFFFF

def encode_header(kind: int, name: bytes, num_slots: int, slot_lo: int, slot_hi: int, n: int,
                  row_width: int, raw_len: int, comp_len: int, payload_crc: int,
                  flags: int = 0) -> bytes:
    fixed = HEADER.pack(MAGIC, FORMAT_VERSION, kind, flags, num_slots, slot_lo, slot_hi, n,
                        row_width, raw_len, comp_len, payload_crc, len(name))
    head = fixed + name
    return head + CRC.pack(crc32(head))


def header_size(name: bytes) -> int:
    return HEADER.size + len(name) + CRC.size


def decode_header(buf: bytes, where: str) -> dict:
    """Parse and check one chunk header at the start of ``buf``; raises CheckpointError."""
    if len(buf) < HEADER.size:
        raise CheckpointError(f"{where}: truncated chunk header ({len(buf)} bytes)")
    (magic, version, kind, flags, num_slots, slot_lo, slot_hi, n, row_width, raw_len,
     comp_len, payload_crc, name_len) = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CheckpointError(f"{where}: bad chunk magic {magic!r}")
    end = HEADER.size + name_len
    if len(buf) < end + CRC.size:
        raise CheckpointError(f"{where}: truncated chunk header")
    (want,) = CRC.unpack_from(buf, end)
    if crc32(buf[:end]) != want:
        raise CheckpointError(f"{where}: chunk header crc32 mismatch")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{where}: unsupported chunk format version {version}")
    if kind not in KIND_NAMES:
        raise CheckpointError(f"{where}: unknown chunk kind {kind}")
    if flags & ~(FLAG_RAW | FLAG_COUNTS) or (flags and version < 3) or (
            flags & FLAG_COUNTS and (version < 4 or kind != KIND_ROWS or not row_width)):
        raise CheckpointError(f"{where}: unknown chunk flags {flags:#x}")
    if flags & FLAG_RAW and comp_len != raw_len:
        raise CheckpointError(f"{where}: stored chunk with comp_len {comp_len} != raw_len "
                              f"{raw_len}")
    return {"kind": kind, "version": version, "flags": flags, "num_slots": num_slots, "slot_lo": slot_lo,
            "slot_hi": slot_hi, "n": n, "row_width": row_width, "raw_len": raw_len,
            "comp_len": comp_len, "crc32": payload_crc,
            "name": bytes(buf[HEADER.size:end]).decode("utf-8", "replace"),
            "header_len": end + CRC.size}


_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


def quote_name(name: str) -> str:
    """File-name-safe, injective encoding of a table or writer name (``%XX`` escapes)."""
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8")), name)


def dir_name(ckpt_id: int, kind: str) -> str:
    return f"ckpt-{int(ckpt_id):08d}-{kind}"


def manifest_checksum(body: dict) -> str:
    """sha256 of the canonical JSON of the manifest without its ``checksum`` field."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def data_width(table_info: dict) -> int:
    """Floats per row in a table's data chunks: the table's row width, plus the update
    count column when the checkpoint records counts (format 2)."""
    return int(table_info.get("row_width", 0)) + (1 if table_info.get("counts") else 0)
