"""TensorBoard event files written without TensorFlow (the AIMaster does not import it;
workers use it for their loss curve).

An event file is a TFRecord stream of ``tensorflow.Event`` protos; scalars need only
``Event{wall_time, step, summary{value{tag, simple_value}}}``, hand-encoded here, so
``tensorboard --logdir runs/<job>`` shows the job's curves. One writer per run directory
(``runs/<job>/tensorboard/train``, ``.../eval``).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE = _table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int) -> bytes:
    return _varint((num << 3) | wire)


def _bytes_field(num: int, data: bytes) -> bytes:
    return _field(num, 2) + _varint(len(data)) + data


def encode_event(wall_time: float, step: int = 0, scalars: dict | None = None,
                 file_version: str = "") -> bytes:
    """A serialized ``tensorflow.Event`` (fields: wall_time 1, step 2, file_version 3,
    summary 5; Summary.value 1; Value.tag 1, Value.simple_value 2)."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(int(step))
    if file_version:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5)
                         + struct.pack("<f", float(v)))
            for tag, v in scalars.items())
        out += _bytes_field(5, values)
    return out


def _record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (header + struct.pack("<I", _masked(header)) + payload
            + struct.pack("<I", _masked(payload)))


class ScalarWriter:
    """Appends scalar events to one event file in ``logdir`` (created lazily)."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self._file = None
        self._lock = threading.Lock()

    def _open(self):
        os.makedirs(self.logdir, exist_ok=True)
        now = time.time()
        path = os.path.join(self.logdir, f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
                                         f".{os.getpid()}.{id(self)}")
        self._file = open(path, "ab")
        self._file.write(_record(encode_event(now, file_version="brain.Event:2")))

    def add(self, step: int, scalars: dict, wall_time: float | None = None) -> None:
        scalars = {k: v for k, v in scalars.items() if v is not None}
        if not scalars:
            return
        with self._lock:
            if self._file is None:
                self._open()
            self._file.write(_record(encode_event(wall_time or time.time(), step, scalars)))
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
