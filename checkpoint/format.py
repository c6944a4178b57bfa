"""Byte-level format of checkpoint files: chunk headers, names, manifest checksum.

Chunk (all integers little-endian)::

    fixed header  HEADER struct (54 bytes, see below)
    table name    name_len bytes of UTF-8
    header crc    u32 crc32 of fixed header + name
    payload       comp_len bytes of  keys int64[n] || rows float32[n, row_width]  (rows/tombstones)
                                  or a piece of a dense array's raw bytes        (array)
                  either as one zstd frame (with content size and xxh64 content checksum)
                  or, with flag RAW (format 3), stored as is (comp_len == raw_len)

Fixed header fields: magic ``DRCK``, format version (u16), kind (u8), flags (u8: 0, or
``FLAG_RAW`` from format 3 on),
num_slots (u32), slot_lo, slot_hi (u32: inclusive range of the routing slots of the keys in
the chunk), n (u64: rows, keys, or bytes for an array piece), row_width (u32: floats per row,
0 for tombstones/arrays), raw_len (u64: decompressed length), comp_len (u64), payload crc32
(u32, of the compressed bytes), name_len (u16).

A file ends with an END chunk (no payload, ``n`` = number of chunks before it, ``raw_len`` =
its own offset), so a file truncated at a chunk boundary is detectable even without the
manifest.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib

MAGIC = b"DRCK"
# 2: rows carry each row's update count as a last float32 column (table info "counts")
# 3: a chunk's payload may be stored uncompressed (flag RAW) when zstd does not pay, and
#    files carry no sha256 (the manifest's "sha256" is null): the header crc32 and the
#    payload crc32 of every chunk, whose index tiles the file, cover every byte already
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
FLAG_RAW = 1  # payload stored as is, not as a zstd frame (format 3)
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
    if flags & ~FLAG_RAW or (flags and version < 3):
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
