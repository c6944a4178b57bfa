"""Writing checkpoints: :class:`CheckpointWriter`."""
from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import zstandard

from deeprec_ext.hashing import DEFAULT_NUM_SLOTS, slot_of
from deeprec_ext.store import EmbeddingTable
from deeprec_ext.store.hash_index import PROBE_SEED

import checkpoint.format as _fmt
from checkpoint import remote
from checkpoint.format import (CHUNK_FIELDS, FLAG_COUNTS, FLAG_RAW, KIND_ARRAY, KIND_END, KIND_ROWS,
                               KIND_TOMBSTONES, MANIFEST_FORMAT, MANIFEST_NAME, CheckpointError,
                               crc32c, dir_name, encode_header, manifest_checksum,
                               payload_crc, quote_name)

log = logging.getLogger("checkpoint")

ROWS_PER_CHUNK = 1 << 16          # ~64k rows per chunk ...
CHUNK_RAW_BYTES = 4 << 20         # ... but at most ~4 MB uncompressed (wide rows)
TOMBSTONES_PER_CHUNK = 1 << 20    # tombstone chunks hold keys only
# Full exports scan the arena sequentially, SCAN_SLICE_ROWS rows per table-lock hold, and
# deal each slice's rows into SCAN_BUCKETS contiguous slot ranges; a bucket becomes a
# chunk once it holds BUCKET_CHUNK_BYTES. Pending rows: about SCAN_BUCKETS x that.
SCAN_SLICE_ROWS = 1 << 14
SCAN_BUCKETS = 16
BUCKET_CHUNK_BYTES = 1 << 20
ZSTD_LEVEL = 1                    # float rows barely compress; level 1 is ~2x faster than 3
# "auto": a chunk is compressed only when zstd pays, i.e. a sample of it (PROBE_FRACTION of
# its bytes) shrinks by at least ZSTD_MIN_SAVING; otherwise it is stored as is (FLAG_RAW).
# Trained float rows shrink by ~10% at level 1 for ~300 MB/s per core, less than a core
# copies or the page cache takes them; constant or sparse columns (fresh optimizer slots,
# zeros, sequential ids) shrink by 40-90% and compress at GB/s. See docs/BENCHMARKS.md.
COMPRESS = "auto"                 # "auto" | "always" | "never"
ZSTD_MIN_SAVING = 0.25
PROBE_FRACTION = 1 / 16
PROBE_STREAK, PROBE_EVERY = 4, 8  # then one chunk in 8 is probed (_Probe) ...
PROBE_MAX_EVERY = 64              # ... then 16, 32, up to one in 64 while it agrees
WRITEBACK_BYTES = 4 << 20         # start the disk write-back of every ~4 MB as it is written
# (32 MB left an incremental of 28 MB all to its closing fsync: 150 vs 185 ms median)
PREALLOCATE_MIN = 16 << 20       # smaller files gain little from _preallocate
# a stored chunk's crc32c: on the I/O thread, just before its writev, in files expected
# under CRC_ON_IO_BYTES (an incremental: no pool threads started, one hand-off between
# threads fewer per chunk); on the pool in larger ones (a full checkpoint), where the I/O
# thread is the longest stage: 4M rows, 4 runs alternated at load 8-11, wall best / median
# 614-943 / 818-1608 ms with the pool against 821-1413 / 1240-1790 on the I/O thread, at
# the same CPU (~420-520 ms)
CRC_ON_IO_BYTES = 64 << 20
_EXTRA_IN_FLIGHT = 1              # chunks being encoded: one per thread, plus this


def _default_threads() -> int:
    """The pool's size: one thread on 2 cores or fewer, where the scanning thread and the
    I/O thread already keep both busy (4M rows at load ~0.9, 8 alternated rounds: wall
    median 328 -> 303 ms, best 319 -> 287, CPU 438 -> 410 with one pool thread instead of
    two), else as many as the cores, at most 4."""
    n = os.cpu_count() or 1
    return 1 if n <= 2 else min(4, n)


def _env_mmap_threshold() -> int | None:
    try:
        v = int(os.environ.get("MALLOC_MMAP_THRESHOLD_", ""))
    except ValueError:
        return None
    return v if v > 0 else None


# glibc's mmap threshold when the process fixed one (a PS: set_malloc_mmap_threshold, or
# the MALLOC_MMAP_THRESHOLD_ variable), else None (glibc's dynamic threshold)
_MMAP_THRESHOLD = _env_mmap_threshold()


def set_malloc_mmap_threshold(nbytes: int | None) -> None:
    """Tell the writer the process's fixed malloc mmap threshold (``None``: glibc's dynamic
    one). An incremental's chunks are then sized so each chunk's rows stay under it: they
    come from the heap, reused chunk after chunk, instead of a new mapping per chunk,
    page-faulted and zeroed (a 200k-row incremental under a PS's 1 MB threshold: median
    74.7 -> 59.8 ms; with glibc's dynamic threshold the smaller chunks cost more than they
    save, so they are used only when a threshold is fixed)."""
    global _MMAP_THRESHOLD
    _MMAP_THRESHOLD = int(nbytes) if nbytes else None


_IO_QUEUE = 2                     # chunks waiting for the I/O thread beyond those
_LITTLE = sys.byteorder == "little"


def _load_sync_file_range():
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` (Linux): start the write-back
    of a written range without waiting for it, so the final fsync finds little left to
    write. None where unavailable (then the fsync does it all)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _load_fallocate():
    """``fallocate(fd, 0, off, len)`` (Linux), or None. Not ``os.posix_fallocate``: where
    the file system cannot preallocate, glibc emulates it by writing every block."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def _preallocate(fd: int, nbytes: int) -> bool:
    """Reserve the blocks of a new file's expected size in one call (the file is cut to
    its real size when closed). Appending into reserved blocks fills the page cache about
    1.5x faster on ext4 than appending block by block (560 MB: ~90 vs ~140 ms), and a
    full checkpoint without fsync is bound by that copy. Best effort: False if refused
    (no support, no space: the writes then find out for themselves)."""
    if _FALLOCATE is None or nbytes < PREALLOCATE_MIN:
        return False
    return _FALLOCATE(fd, 0, 0, int(nbytes)) == 0


def _write_all(fd: int, bufs) -> int:
    """Write every buffer (bytes or C-contiguous arrays) to ``fd`` with writev, no join."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        n = os.writev(fd, views[:512])
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return total


# Save each full table's hash index beside its rows (``_SavedIndex``); tests and the
# benchmark of the restore's placement path turn it off
SAVE_INDEX = True


class _SavedIndex:
    """The hash index of a table, saved beside a full checkpoint's rows file as
    ``<writer>.<table>.index``: the index's own table (int32 per position: 0 empty, -1
    deleted, ``i + 1`` for the rows file's row ``i``). A restore of the whole table into
    an empty one reads it as its index (``HashIndex.install_table``) instead of hashing
    and placing every key, the larger part of a restore's CPU. 4 bytes per position:
    8-16 per row, beside the rows' 8 + 4 x (row width + 1).

    As the scan emits chunks, their rows are numbered in file order in a map by arena
    row (4 bytes per row while the checkpoint runs). Once the last chunk is out, a
    thread translates the index's table through it, slice by slice, and writes it
    beside the rows file's last writes and fsync. It holds for the restored table if the
    index neither removed, moved nor re-assigned a position since the scan began
    (``HashIndex.layout``, checked before and after the translation): a key inserted
    meanwhile only adds an occupied position, saved as a tombstone, and so do the rows a
    slot mask leaves out (a PS holding rows of slots it no longer owns). Otherwise the
    file is removed and the manifest names none: a restore then places the keys."""

    SLICE = 1 << 18  # positions translated and written (rows placed) at a time

    def __init__(self, path: Path, table: EmbeddingTable):
        self.path = path
        self.table = table
        self.token = table.index_checkpoint_begin()
        # code -> saved code, indexed by code + 1: deleted (-1) -> -1, empty (0) -> 0, row
        # r's code r + 1 -> its file row + 1, or -1 (a tombstone) for a row not written;
        # codes past the end (rows added after the scan) clip to the last entry, -1
        self.lut = None
        if self.token is not None:
            self.lut = np.full(self.token["rows"] + 3, -1, dtype=np.int32)
            self.lut[1] = 0
        self.rows = 0
        self.thread = None
        self.result = None

    @property
    def wanted(self) -> bool:
        return self.token is not None

    def add(self, pieces: list) -> None:
        """The arena rows (int64) of one chunk's rows, its pieces in order: numbered as
        the file's next rows (one scatter per chunk, local to the slices it came from)."""
        if self.token is None:
            return
        rows = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        if not rows.size:
            return
        top = int(rows.max()) + 3
        if top >= self.lut.size:  # rows added to the arena during the scan
            grown = np.full(max(top + 1, 2 * self.lut.size), -1, dtype=np.int32)
            grown[:self.lut.size] = self.lut
            self.lut = grown
        self.lut[rows + 2] = np.arange(self.rows + 1, self.rows + rows.size + 1,
                                       dtype=np.int32)
        self.rows += int(rows.size)

    def start(self) -> None:
        """The scan has emitted its last chunk: translate and write the index on a thread
        of its own, beside the rows file's last writes and its fsync (I/O waits)."""
        if self.token is not None and self.thread is None:
            self.thread = threading.Thread(target=self._write, name="ckpt-index",
                                           daemon=True)
            self.thread.start()

    def finish(self) -> dict | None:
        """After the rows file: the manifest entry's ``index`` field, or None (no file)
        when the index's layout changed. Raises what writing the file raised."""
        self.start()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def _write(self) -> None:
        try:
            self.result = self._translate()
        except BaseException as exc:  # noqa: BLE001 - raised by finish() on the writer's thread
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.result = exc

    def _translate(self) -> dict | None:
        token, self.token = self.token, None
        lut, self.lut = self.lut, None
        tab = self.table.index_checkpoint_table(token) if token is not None else None
        if tab is None:
            return None
        crc, full = 0, 0
        at = np.empty(min(self.SLICE, tab.size), dtype=np.int32)
        out = np.empty_like(at)
        # no fsync: the file is checked (size, crc32c) before a restore uses it, and a
        # checkpoint is complete without it
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for lo in range(0, tab.size, self.SLICE):
                part = tab[lo:lo + self.SLICE]
                a, o = at[:part.size], out[:part.size]
                np.add(part, np.int32(1), out=a)
                lut.take(a, mode="clip", out=o)
                full += int(np.count_nonzero(o > 0))
                crc = crc32c(o, crc)
                _write_all(fd, [o])
        finally:
            os.close(fd)
        # every written row is at a full position (no key removed), once
        if full != self.rows or self.table.index_checkpoint_table(token) is not tab:
            self.path.unlink()
            return None
        return {"path": self.path.name, "capacity": int(tab.size), "rows": self.rows,
                "probe_seed": PROBE_SEED, "size": 4 * int(tab.size), "crc32c": int(crc)}

    def close(self) -> None:
        """The write failed or was cancelled: keep nothing."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.token = self.lut = None


class _Probe:
    """Whether zstd pays for the chunks of one file, probed (a zstd pass over 1/16 of the
    chunk) until ``PROBE_STREAK`` chunks in a row agreed, then for one chunk in
    ``PROBE_EVERY``, a period that doubles with every further agreeing probe up to
    ``PROBE_MAX_EVERY``, the others taking the last answer: the chunks of one table hold
    the same columns, and the probe was a fifth of the scanning thread's time (at one in
    8 still ~10% of a 4M-row full checkpoint's: 62 probes, ~45 ms). A changed answer
    makes probing dense again.

    ``start``: the ``(answer, period)`` the previous file of the same table ended with
    (:data:`_VERDICTS`): the first chunk is probed, and if it agrees the period goes on
    from there instead of ``PROBE_STREAK`` probes in a row again -- an incremental of
    200k rows is 7 chunks, of which 4 were probed every time (~2 ms of the scanning
    thread's, on the critical path)."""

    def __init__(self, pays, start=None):
        self._pays = pays
        self.last, self.streak, self.skip = None, 0, 0
        self.every = PROBE_EVERY
        self.probed = 0
        if start is not None:
            self.last, self.every = start
            self.streak = PROBE_STREAK

    def state(self):
        """``(answer, period)`` to start the next file of the same table with (None: no
        chunk probed)."""
        return None if self.last is None else (self.last, self.every)

    def pays(self, views) -> bool:
        if self.skip:
            self.skip -= 1
            return self.last
        got = self._pays(views)
        self.probed += 1
        if got == self.last:
            self.streak += 1
        else:
            self.streak, self.every = 1, PROBE_EVERY
        self.last = got
        if self.streak >= PROBE_STREAK:
            self.skip = self.every - 1
            if self.streak > PROBE_STREAK:
                self.every = min(2 * self.every, PROBE_MAX_EVERY)
        return got


# (table name, level, format) -> _Probe.state() of that table's last file written by this
# process: the columns of a table compress alike from one checkpoint to the next
_VERDICTS: dict = {}


class _Writeback:
    """Starts the disk write-back of a file's bytes as they are written (every
    ``WRITEBACK_BYTES``), so the fsync that closes it overlaps the encoding instead of
    following it."""

    def __init__(self, fd: int):
        self.fd = fd
        self.done = 0

    def wrote(self, pos: int) -> None:
        if self.fd is None or _SYNC_FILE_RANGE is None or pos - self.done < WRITEBACK_BYTES:
            return
        if _SYNC_FILE_RANGE(self.fd, self.done, pos - self.done, _SYNC_FILE_RANGE_WRITE) == 0:
            self.done = pos


class _SliceBuffers:
    """Reused gather buffers of a full export's slices (``scan_by_slot(out=...)``).

    A slice's rows are dealt into pieces of several chunks, so its buffer is free again
    only once every chunk holding one of its pieces is written: each buffer counts its
    holders (the scanning thread while it deals the slice, then one per piece), released
    by the I/O thread after each chunk's writev. In a PS, whose malloc maps every block
    of 1 MB or more afresh (``--malloc-mmap-threshold-mb``), a new 2 MB buffer per slice
    was a mapping, its page faults and zeroing, and an unmap: a 4M-row write took
    ~800 ms of CPU there against ~450 ms in a process with glibc's default policy. The
    number of buffers is what the pending buckets and the write window hold at once
    (about 16 of 2 MB), as many as were alive before."""

    __slots__ = ("_shape", "_free", "_lock", "allocated")

    def __init__(self, rows: int, width: int):
        self._shape = (rows, width)
        self._free: list = []
        self._lock = threading.Lock()
        self.allocated = 0

    def get(self) -> list:
        """A free buffer ``[array, holders]``, held once by the caller."""
        with self._lock:
            if self._free:
                buf = self._free.pop()
                buf[1] = 1
                return buf
            self.allocated += 1
        return [np.empty(self._shape, dtype=np.float32), 1]

    def hold(self, buf: list) -> None:
        with self._lock:
            buf[1] += 1

    def release(self, bufs) -> None:
        with self._lock:
            for buf in bufs:
                buf[1] -= 1
                if buf[1] == 0:
                    self._free.append(buf)


class CheckpointCancelled(Exception):
    """The caller gave up on the checkpoint (e.g. its RPC was cancelled) while it was
    being written."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def find_checkpoint_dir(root: Path, ckpt_id: int) -> Path | None:
    """The directory of checkpoint ``ckpt_id`` under ``root`` (either kind), or None."""
    for kind in ("full", "incr"):
        p = root / dir_name(ckpt_id, kind)
        if p.is_dir():
            return p
    return None


def _table_info(table: EmbeddingTable) -> dict:
    cfg = table.config
    info = {"dim": int(cfg["dim"]), "initializer": cfg["initializer"],
            "optimizer": cfg["optimizer"], "row_width": int(table.row_width), "counts": True}
    # only when set: older configs compare equal (no "dtype": float32). Rows are written as
    # float32 either way; a float16 table's values are float16-exact, so nothing is lost
    for policy in ("admission", "eviction", "dtype"):
        if cfg.get(policy):
            info[policy] = cfg[policy]
    return info


def _config_of(info: dict) -> dict:
    """A table's config for comparisons along a chain (how rows are stored may differ)."""
    return {k: v for k, v in info.items() if k != "counts"}


def _check_cancelled(cancelled) -> None:
    if cancelled is not None and cancelled():
        raise CheckpointCancelled("cancelled while writing")


def _take_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index] for float32 [n, width], each row moved as one opaque item (2-3x faster
    than ``take(axis=0)``)."""
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 2 or rows.shape[1] == 0 or rows.dtype.kind != "f":
        return rows.take(index, axis=0)
    item = np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))
    return rows.view(item).reshape(-1).take(index).view(rows.dtype).reshape(index.size, -1)


def _slot_order(slots: np.ndarray, num_slots: int) -> np.ndarray:
    """Stable permutation sorting rows by routing slot (radix sort for <= 65536 slots)."""
    if num_slots <= 1 << 16:
        return np.argsort(slots.astype(np.uint16), kind="stable")
    return np.argsort(slots, kind="stable")


class CheckpointWriter:
    """Writes one checkpoint directory ``ROOT/ckpt-<id:08d>-<kind>/``.

    ``kind="full"`` holds every live row of every table written; ``kind="incr"`` holds the
    rows changed and the keys deleted since ``since_seq`` (the ``cut_seq`` the same writer
    reported for the parent checkpoint), and needs ``parent`` (the previous checkpoint's
    id, full or incremental).

    Call :meth:`write_table` once per (writer, table) -- a writer is typically one PS, e.g.
    ``"ps-0"`` -- then :meth:`add_extra` / :meth:`write_dense` as needed, then
    :meth:`commit`, which writes ``manifest.json`` last (temp file + fsync + rename). Until
    then the checkpoint does not exist for readers. Used as a context manager it commits on
    a clean exit and :meth:`abort` s on an exception.

    Incremental checkpoints carry the table configs of their parent forward: a table not
    written in an incremental simply had no changes. Use :meth:`drop_table` to record
    that a table was dropped.

    Several processes may write files of the same checkpoint into the same directory (on
    shared storage): each uses its own ``CheckpointWriter`` and never commits, and passes
    :meth:`file_entries` to the one writer that does (:meth:`add_file_entries`).
    """

    def _close_file(self, fd: int, sha, name: bytes, chunks: int, pos: int,
                    preallocated: bool = False) -> int:
        """The END header that closes a data file, then fsync; returns the new offset."""
        end = encode_header(KIND_END, name, self.num_slots, 0, 0, chunks, 0, pos, 0, 0)
        _write_all(fd, [end])
        if sha is not None:
            sha.update(end)
        if preallocated:  # the file ends at its END header, as readers check
            os.ftruncate(fd, pos + len(end))
        if self.sync:
            os.fsync(fd)
        return pos + len(end)

    def __init__(self, root, ckpt_id: int, kind: str = "full", parent: int | None = None,
                 num_slots: int = DEFAULT_NUM_SLOTS, level: int = ZSTD_LEVEL,
                 threads: int | None = None, compress: str | None = None, sync: bool = True):
        if kind not in ("full", "incr"):
            raise ValueError(f"kind must be 'full' or 'incr', got {kind!r}")
        if isinstance(ckpt_id, bool) or not isinstance(ckpt_id, (int, np.integer)) or ckpt_id < 0:
            raise ValueError(f"ckpt_id must be a non-negative integer, got {ckpt_id!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) \
                or not 1 <= num_slots < 1 << 32:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        # a URL root (s3://...): files are written into a private local staging directory
        # and uploaded as each is closed; the manifest object is PUT last (see
        # checkpoint.remote). A local root is written in place, as always.
        self.url = str(root).rstrip("/") if remote.is_remote(str(root)) else None
        self._listing = remote.listing(self.url) if self.url else None
        self.root = Path(tempfile.mkdtemp(prefix="deeprec-ckpt-stage-")) if self.url \
            else Path(root)
        self.id = int(ckpt_id)
        self.kind = kind
        self.num_slots = int(num_slots)
        self.level = int(level)
        # sync=False: no fsync/write-back (benchmarks against writers that do not sync,
        # scratch copies); a crash may then leave a committed checkpoint incomplete
        self.sync = bool(sync) and self.url is None  # remote: the upload is what lasts
        # the layout written: format 3, or (tests, tools) an older one exactly as it was
        self.version = int(_fmt.FORMAT_VERSION)
        compress = COMPRESS if compress is None else compress
        if compress not in ("auto", "always", "never"):
            raise ValueError(f"compress must be 'auto', 'always' or 'never', got {compress!r}")
        self.compress = compress if self.version >= 3 else "always"
        self.threads = max(1, int(threads if threads is not None else _default_threads()))
        self._lock = threading.Lock()
        self._files: dict[str, dict] = {}
        self._created_files: list[Path] = []
        self._uploaded: set[str] = set()
        self._extra: dict = {}
        self._dropped: set[str] = set()
        self._tables: dict[str, dict] = {}
        self._watermarks: dict[str, dict[str, int]] = {}
        self._committed = False
        self._pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()
        self.parent = None
        self._parent_checksum = None

        try:
            self.root.mkdir(parents=True, exist_ok=True)
            other = self._find(self.id)
            self.dir = self.root / dir_name(self.id, kind)
            if other is not None and other != self.dir:
                raise FileExistsError(f"checkpoint id {self.id} already exists as "
                                      f"{self._where(other)}")
            if (self.dir / MANIFEST_NAME).exists() if self.url is None else \
                    MANIFEST_NAME in self._listing.get(self.dir.name, {}):
                raise FileExistsError(f"checkpoint {self._where(self.dir)} is already committed")
            if kind == "incr":
                if parent is None:
                    raise ValueError("an incremental checkpoint needs parent=<id of the previous "
                                     "checkpoint>")
                parent = int(parent)
                if parent >= self.id:
                    raise ValueError(f"parent id {parent} must be smaller than the checkpoint id "
                                     f"{self.id}")
                from checkpoint.reader import load_manifest  # late: reader imports this module
                pdir = self._find(parent)
                if pdir is None:
                    raise CheckpointError(f"parent checkpoint {parent} not found under "
                                          f"{self.url or self.root}")
                if self.url is not None:  # its manifest only, into the staging directory
                    pdir.mkdir()
                    remote.get_manifest(self.url, pdir.name, pdir)
                pm = load_manifest(pdir, cached=True)  # read only here
                if pm["num_slots"] != self.num_slots:
                    raise ValueError(f"num_slots={self.num_slots} differs from the parent's "
                                     f"num_slots={pm['num_slots']}")
                self.parent = parent
                self._parent_checksum = pm["checksum"]
                for name, info in pm["tables"].items():
                    self._tables[name] = {k: copy.deepcopy(v) for k, v in info.items()
                                          if k in ("dim", "initializer", "optimizer", "row_width",
                                                   "counts", "admission", "eviction",
                                                   "dtype")}
            elif parent is not None:
                raise ValueError("a full checkpoint has no parent")

            try:
                self.dir.mkdir()
                created = True
            except FileExistsError:  # another writer of this checkpoint (a PS) made it
                if not self.dir.is_dir():
                    raise
                created = False
            # the new directory's entry, made durable by the writer that created it before
            # it writes (the AIMaster commits after every PS's write returned: its own
            # fsync of the root found nothing to do, 0.2-4 ms on a shared disk)
            if self.sync and created:
                _fsync_dir(self.root)
        except BaseException:
            if self.url is not None:  # no staging directory left behind by a refusal
                shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _find(self, ckpt_id: int) -> Path | None:
        if self.url is None:
            return find_checkpoint_dir(self.root, ckpt_id)
        for kind in ("full", "incr"):
            if dir_name(ckpt_id, kind) in self._listing:
                return self.root / dir_name(ckpt_id, kind)
        return None

    def _where(self, path: Path) -> str:
        """A path of this checkpoint as the user knows it (the URL for a remote root)."""
        return str(path) if self.url is None else remote.join(
            self.url, *path.relative_to(self.root).parts)

    def _publish(self, path: Path) -> None:
        """Remote root: upload a closed data file and drop the staged copy."""
        if self.url is None:
            return
        remote.upload(path, remote.join(self.url, self.dir.name, path.name))
        self._uploaded.add(path.name)
        path.unlink()

    # -- context manager ----------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self._committed:
            self.commit()
        return False

    # -- writing ------------------------------------------------------------------------
    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._tls, "c", None)
        if c is None:
            c = self._tls.c = zstandard.ZstdCompressor(level=self.level, write_checksum=True,
                                                       write_content_size=True)
        return c

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-write")
            return self._pool

    def _check_open(self):
        if self._committed:
            raise RuntimeError(f"checkpoint {self.dir} is already committed")

    def write_table(self, writer_id: str, table: EmbeddingTable, since_seq: int | None = None,
                    slot_mask: np.ndarray | None = None, cancelled=None) -> dict:
        """Write the rows of ``table`` held by ``writer_id`` to ``<writer>.<table>.rows``.

        Full checkpoint: every live row (``since_seq`` must be None). Incremental: the rows
        written and the keys deleted after ``since_seq`` (required: the ``cut_seq`` this
        writer reported for the previous checkpoint of the chain). ``slot_mask`` (bool
        [num_slots]) restricts the rows and deletions to the slots this writer owns.

        Streaming, in bounded memory: the sequence watermark ``cut_seq`` is read first.
        A full checkpoint (format 3) then scans the arena in row order, a slice of
        ``SCAN_SLICE_ROWS`` rows per short table-lock hold (``EmbeddingTable.scan_live``),
        and deals each slice, sorted by slot, into ``SCAN_BUCKETS`` slot ranges written
        as chunks of ~``BUCKET_CHUNK_BYTES`` (:meth:`_scan_chunks`). An incremental reads
        a plan of the changed rows sorted by slot (8 bytes per row, from the change log;
        ``EmbeddingTable.plan_export``), then the rows chunk by chunk
        (``gather_planned``). Chunks are encoded and written while the next is read. The
        table keeps serving lookups and pushes throughout; no copy of the table is ever
        held. Every write with a sequence number <= cut_seq is in this checkpoint (or an
        earlier one of the chain): a row rewritten after it was read is in the next
        incremental, a row deleted before it was read is skipped (its change is after
        the cut). Writes after the cut may appear twice, harmlessly.

        ``cancelled``: a callable polled between chunks; when it returns True the write
        stops with :class:`CheckpointCancelled`. Returns stats: writer, table, file,
        rows, tombstones, bytes, raw_bytes, chunks, seconds, since_seq, cut_seq.
        """
        self._check_open()
        t0 = time.perf_counter()
        writer_id = str(writer_id)
        if not writer_id:
            raise ValueError("writer_id must be a non-empty string")
        if self.kind == "full":
            if since_seq is not None:
                raise ValueError("a full checkpoint writes every row: since_seq must be None")
        elif since_seq is None:
            raise ValueError("an incremental checkpoint needs since_seq (the cut_seq of this "
                             "writer's previous checkpoint of the chain)")
        cut = int(table.sequence.value)  # read BEFORE exporting
        if since_seq is not None:
            since_seq = int(since_seq)
            if since_seq < 0 or since_seq > cut:
                raise ValueError(f"since_seq={since_seq} is outside [0, {cut}] (the table's "
                                 "sequence counter): it must come from this table's PS")
        if slot_mask is not None:
            slot_mask = np.asarray(slot_mask)
            if slot_mask.dtype != np.bool_ or slot_mask.shape != (self.num_slots,):
                raise ValueError(f"slot_mask must be bool [{self.num_slots}], got "
                                 f"{slot_mask.dtype} {slot_mask.shape}")
            export_mask = slot_mask
        else:
            export_mask = np.ones(self.num_slots, dtype=bool)

        info = _table_info(table)
        name = table.name
        with self._lock:
            have = self._tables.get(name)
            if have is not None and _config_of(have) != _config_of(info):
                raise ValueError(f"table '{name}': config {info} differs from the config "
                                 f"{have} recorded in this chain (write a full checkpoint "
                                 f"after re-creating a table with another config)")
            fname = f"{quote_name(writer_id)}.{quote_name(name)}.rows"
            if fname in self._files:
                raise ValueError(f"writer '{writer_id}' already wrote table '{name}'")
            self._files[fname] = {}  # reserve

        saved = None  # the table's hash index, saved beside its rows
        try:
            tomb = (table.tombstones_since(since_seq) if self.kind == "incr"
                    else np.empty(0, np.int64))
            if tomb.size and slot_mask is not None:
                tomb = tomb[slot_mask[slot_of(tomb, self.num_slots)]]
            written = [0]
            chunks = self._tombstone_chunks(tomb)
            # a table serving a promoted replica as a segment (until its background
            # merge ends) has rows outside its arena: the plan covers both
            if self.kind == "full" and self.version >= 3 and not table.segment_rows:
                if self.version >= 4 and info.get("counts") and SAVE_INDEX:
                    saved = _SavedIndex(self.dir / (fname[:-len(".rows")] + ".index"),
                                        table)
                    self._created_files.append(saved.path)
                rows_chunks = self._scan_chunks(table, info, slot_mask, written, cancelled,
                                                saved)
                expect = len(table) if slot_mask is None else \
                    int(len(table) * float(slot_mask.mean()))
            else:  # the rows changed since since_seq, from the change log: a plan
                codes, row_bits = table.plan_export(export_mask, since_seq)
                rows_chunks = self._row_chunks(table, info, codes, row_bits, written,
                                               cancelled, since_seq)
                expect = int(codes.size)
            path = self.dir / fname
            # the expected size (keys, rows, counts; headers are small) for _preallocate
            expect = expect * (8 + 4 * (info["row_width"] + 1)) + 8 * int(tomb.size)
            entry = self._write_data_file(path, name, (*chunks, rows_chunks), expect)
            if saved is not None:
                kept = saved.finish()
                if kept is not None:
                    self._publish(saved.path)
                    entry["index"] = kept
        except BaseException:
            if saved is not None:
                saved.close()
            with self._lock:
                self._files.pop(fname, None)
            raise
        entry.update({"path": fname, "type": "rows", "writer": writer_id, "table": name,
                      "rows": written[0], "tombstones": int(tomb.size),
                      "since_seq": since_seq, "cut_seq": cut})
        with self._lock:
            self._files[fname] = entry
            self._tables[name] = info  # this checkpoint's files: with counts (format 2)
            self._watermarks.setdefault(writer_id, {})[name] = cut
        return {"writer": writer_id, "table": name, "file": fname, "rows": entry["rows"],
                "tombstones": entry["tombstones"], "bytes": entry["size"],
                "raw_bytes": entry["raw_bytes"], "chunks": len(entry["chunks"]),
                "seconds": time.perf_counter() - t0, "since_seq": since_seq, "cut_seq": cut}

    def _tombstone_chunks(self, keys: np.ndarray):
        """Tombstone chunks (kind, keys, None, slot_lo, slot_hi), sorted by slot."""
        m = int(keys.size)
        if m == 0:
            return ()
        slots = slot_of(keys, self.num_slots)
        order = _slot_order(slots, self.num_slots)
        keys, slots = keys.take(order), slots.take(order)
        per = min(TOMBSTONES_PER_CHUNK, max(4096, -(-m // self.threads)))
        return ([(KIND_TOMBSTONES, [keys[s:s + per]], None, int(slots[s]),
                  int(slots[min(s + per, m) - 1]))] for s in range(0, m, per))

    def _row_chunks(self, table: EmbeddingTable, info: dict, codes: np.ndarray, row_bits: int,
                    written: list, cancelled, since_seq: int | None = None):
        """Row chunks (kind, keys, rows, slot_lo, slot_hi) of a plan, each read under one
        table-lock hold when it is about to be written (a generator: one chunk at a time)."""
        with_counts = bool(info.get("counts"))
        w = info["row_width"] + (1 if with_counts else 0)
        m = int(codes.size)
        per = max(1024, min(ROWS_PER_CHUNK, CHUNK_RAW_BYTES // (8 + 4 * w)))
        # small exports (incrementals): still one chunk per compression thread
        per = min(per, max(4096, -(-m // self.threads)))
        if _MMAP_THRESHOLD:  # a chunk's rows under the mmap threshold (see above)
            per = min(per, max(1024, (_MMAP_THRESHOLD - 65536) // (4 * w)))
        # format 4: rows and counts gathered apart, into the arrays written (the counted
        # block was cut into two new copies here: 25 MB more per 200k-row incremental)
        apart = with_counts and self.version >= 4
        for s in range(0, m, per):
            _check_cancelled(cancelled)
            keys, rows, slots = table.gather_planned(
                codes[s:s + per], row_bits, self.num_slots,
                with_counts="apart" if apart else with_counts, since_seq=since_seq)
            counts = None
            if apart:
                rows, counts = rows
            if rows.shape[1] + (counts is not None) != w:
                raise ValueError(f"table '{table.name}' was reconfigured while being written")
            if keys.size:
                written[0] += int(keys.size)
                if apart:  # the store's columns (format 4)
                    yield (KIND_ROWS, [keys], [rows], int(slots[0]), int(slots[-1]), [counts])
                else:
                    yield KIND_ROWS, [keys], [rows], int(slots[0]), int(slots[-1])

    def _scan_chunks(self, table: EmbeddingTable, info: dict, slot_mask, written: list,
                     cancelled, saved: "_SavedIndex | None" = None):
        """Row chunks of a full export, streaming the arena in row order
        (``EmbeddingTable.scan_live``: one sequential copy per slice under one short
        table-lock hold) -- no plan, no global sort, no random gather over the table.

        Each slice is sorted by slot (a radix sort of a few thousand rows) and dealt into
        ``SCAN_BUCKETS`` contiguous slot ranges; a bucket is written as one chunk once it
        holds about ``BUCKET_CHUNK_BYTES`` (its pieces are written as they are, no join).
        A chunk's keys lie in its slot range, sorted by slot within each piece (format
        3); a restore of some slots reads the chunks of the buckets they touch only.

        ``saved``: each chunk's rows' arena rows go there, in file order."""
        with_counts = bool(info.get("counts"))
        w = info["row_width"] + (1 if with_counts else 0)
        # format 4: keys, rows and counts as the store holds them, no float count column
        # to interleave on the way out (nor to split on the way back)
        apart = with_counts and self.version >= 4
        nb = max(1, min(SCAN_BUCKETS, self.num_slots))
        span = -(-self.num_slots // nb)  # slots per bucket
        target = max(256, BUCKET_CHUNK_BYTES // (8 + 4 * w))
        pend = [[] for _ in range(nb)]
        count = np.zeros(nb, dtype=np.int64)
        edges = np.arange(nb + 1, dtype=np.int64) * span
        bufs = _SliceBuffers(SCAN_SLICE_ROWS, w - 1) if apart else None
        # the slice copied sequentially under the lock, then sorted by slot and gathered
        # from outside it (scan_by_slot(stage=)): the scanning thread's CPU at 4M rows,
        # median ~170 -> ~145 ms
        stage = np.empty((SCAN_SLICE_ROWS, w - 1), np.float32) if apart else None

        def emit(b):
            parts = pend[b]
            pend[b] = []
            count[b] = 0
            held = [p[5] for p in parts if p[5] is not None]
            # the chunk's pieces lie in slice buffers: free them once it is written
            done = (lambda: bufs.release(held)) if held else None
            if saved is not None:
                saved.add([p[6] for p in parts])
            return (KIND_ROWS, [p[0] for p in parts], [p[1] for p in parts],
                    min(p[2] for p in parts), max(p[3] for p in parts),
                    [p[4] for p in parts] if apart else None, done)

        def deal(keys, rows, counts, slots, buf=None, arena=None):
            # rows sorted by slot into the pending buckets; full buckets become chunks
            bounds = np.searchsorted(slots, edges)
            for b in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
                s, e = int(bounds[b]), int(bounds[b + 1])
                if buf is not None:
                    bufs.hold(buf)
                pend[b].append((keys[s:e], rows[s:e], int(slots[s]), int(slots[e - 1]),
                                counts[s:e] if counts is not None else None, buf,
                                arena[s:e] if arena is not None else None))
                count[b] += e - s
                if count[b] >= target:
                    yield emit(b)

        row = 0
        while row is not None:
            _check_cancelled(cancelled)
            if apart:  # sorted by slot and filtered by the mask in the lock hold
                buf = bufs.get()
                got = table.scan_by_slot(row, SCAN_SLICE_ROWS, self.num_slots, slot_mask,
                                         out=buf[0], stage=stage,
                                         arena_rows=saved is not None and saved.wanted)
                keys, rows, counts, slots, row = got[:5]
                arena = got[5] if len(got) > 5 else None
                if rows.shape[1] + 1 != w:
                    raise ValueError(f"table '{table.name}' was reconfigured while being "
                                     "written")
                if keys.size:
                    written[0] += int(keys.size)
                    yield from deal(keys, rows, counts, slots,
                                    buf if np.shares_memory(rows, buf[0]) else None, arena)
                bufs.release([buf])  # the scanning thread's hold
                continue
            keys, rows, row = table.scan_live(row, SCAN_SLICE_ROWS, with_counts=with_counts)
            if rows.shape[1] != w:
                raise ValueError(f"table '{table.name}' was reconfigured while being written")
            if not keys.size:
                continue
            slots = slot_of(keys, self.num_slots)
            if slot_mask is not None:
                keep = slot_mask[slots]
                if not keep.all():
                    keep = np.flatnonzero(keep)
                    keys, rows, slots = keys.take(keep), rows.take(keep, axis=0), \
                        slots.take(keep)
                    if not keys.size:
                        continue
            order = _slot_order(slots, self.num_slots)
            keys, rows, slots = keys.take(order), _take_rows(rows, order), slots.take(order)
            written[0] += int(keys.size)
            yield from deal(keys, rows, None, slots)
        for b in range(nb):
            if count[b]:
                yield emit(b)
        if saved is not None:  # every chunk emitted: the index's file meanwhile
            saved.start()

    def _write_data_file(self, path: Path, name: str, parts, expect: int = 0) -> dict:
        """Write chunks given by ``parts`` (iterables of (kind, keys, rows, slot_lo,
        slot_hi), in slot order); returns the file's manifest entry (size, sha256 (None
        from format 3 on), raw_bytes, chunk index).

        Stages run side by side: this thread produces the chunks (the table scan, the
        sort by slot, the zstd probe); the pool compresses the chunks zstd pays for and
        checksums (crc32c) the others in a large file; one I/O thread of this file
        checksums the stored chunks of a small one (``CRC_ON_IO_BYTES``) and writes the
        chunks, in order, with one writev of header + payload buffers (no joined copy).
        ``expect``: the file's likely size, preallocated (:func:`_preallocate`). The disk write-back of the file is
        started as it grows (:class:`_Writeback`)."""
        bname = name.encode("utf-8")
        pool = self._get_pool()
        index = []
        sha = hashlib.sha256() if self.version < 3 else None
        state = {"pos": 0, "raw": 0}

        def write_one(fd, wb, kind, n, lo, hi, w, job, apart, done):
            # on the I/O thread, one chunk after the other: the file order is the order
            # of submission
            bufs, raw_len, comp_len, ccrc, flags = job.result() if hasattr(job, "result") \
                else self._stored(*job)
            if apart:
                flags |= FLAG_COUNTS
            head = encode_header(kind, bname, self.num_slots, lo, hi, n, w, raw_len,
                                 comp_len, ccrc, flags)
            _write_all(fd, [head, *bufs])
            if sha is not None:
                sha.update(head)
                for b in bufs:
                    sha.update(b)
            index.append([state["pos"], kind, n, lo, hi, raw_len, comp_len, ccrc])
            state["pos"] += len(head) + comp_len
            state["raw"] += raw_len
            wb.wrote(state["pos"])
            if done is not None:  # the chunk's source buffers may be reused
                done()

        self._created_files.append(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        io = ThreadPoolExecutor(1, thread_name_prefix="ckpt-io")
        window = deque()
        memo = (name, self.level, self.version)
        probe = _Probe(self._pays, _VERDICTS.get(memo))
        crc_on_io = expect < CRC_ON_IO_BYTES
        try:
            pre = _preallocate(fd, expect)
            wb = _Writeback(fd if self.sync else None)
            for part in parts:
                for kind, keys, rows, lo, hi, *more in part:
                    counts = more[0] if more else None  # format 4: a uint32 column apart
                    done = more[1] if len(more) > 1 else None  # called once it is written
                    w = 0 if rows is None else int(rows[0].shape[1]) + (counts is not None)
                    while len(window) >= self.threads + _EXTRA_IN_FLIGHT + _IO_QUEUE:
                        window.popleft().result()
                    views, raw_len = self._views(keys, rows, counts)
                    # compressed or checksummed (stored) on the pool, beside the I/O
                    # thread's writev: crc32c and the copy into the page cache were
                    # each about as long as this thread's scan
                    if self.compress == "always" or (self.compress == "auto"
                                                     and probe.pays(views)):
                        job = pool.submit(self._compressed, views, raw_len)
                    elif crc_on_io:
                        job = (views, raw_len)
                    else:
                        job = pool.submit(self._stored, views, raw_len)
                    window.append(io.submit(write_one, fd, wb, kind,
                                            sum(int(k.size) for k in keys), lo, hi, w, job,
                                            counts is not None, done))
                    del keys, rows, views, counts, done
            while window:
                window.popleft().result()
            pos = self._close_file(fd, sha, bname, len(index), state["pos"], pre)
            if probe.state() is not None and self.compress == "auto":
                _VERDICTS[memo] = probe.state()
        finally:
            for fut in window:  # an error: do not leave writes queued
                fut.cancel()
            io.shutdown(wait=True)
            os.close(fd)
        self._publish(path)
        return {"size": pos, "sha256": sha.hexdigest() if sha is not None else None,
                "raw_bytes": state["raw"], "chunks": index}

    def _pays(self, views: list) -> bool:
        """Whether zstd pays for a payload: a sample of it (PROBE_FRACTION of each part,
        from its start) shrinks by at least ZSTD_MIN_SAVING at this writer's level."""
        # the same fraction of every part, so the sample has the chunk's mix of columns
        # (a small, very compressible part such as format 4's counts must not weigh more)
        total = sum(v.nbytes for v in views)
        frac = max(PROBE_FRACTION, min(1.0, 4096 / max(total, 1)))
        sample = [v[:int(v.nbytes * frac)] for v in views]
        n = sum(v.nbytes for v in sample)
        if n == 0:
            return False
        comp = self._compressor().compress(b"".join(sample))
        return len(comp) <= (1.0 - ZSTD_MIN_SAVING) * n

    def _encode(self, keys: list, rows: list | None):
        """One chunk's payload ``keys int64 LE || rows float32 LE`` from lists of pieces
        (``keys``: any arrays for a dense piece): ``(buffers, raw_len, comp_len, crc32,
        flags)``, either one zstd frame or (format 3, where zstd does not pay) the pieces
        themselves, stored."""
        views, raw_len = self._views(keys, rows)
        if self.compress == "never" or (self.compress == "auto" and not self._pays(views)):
            return self._stored(views, raw_len)
        return self._compressed(views, raw_len)

    @staticmethod
    def _views(keys: list, rows: list | None, counts: list | None = None):
        """Byte views of a payload's pieces (keys first, then rows, then counts) and its
        length."""
        arrays = list(keys) + (list(rows) if rows is not None else []) + list(counts or [])
        if _LITTLE:
            parts = [np.ascontiguousarray(a) for a in arrays]
        else:  # pragma: no cover - the format is little-endian
            parts = [np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for a in arrays]
        views = [memoryview(p).cast("B") for p in parts]
        return views, sum(v.nbytes for v in views)

    def _stored(self, views: list, raw_len: int):
        c = 0
        for v in views:
            c = payload_crc(v, self.version, c)
        return views, raw_len, raw_len, c, FLAG_RAW

    def _compressed(self, views: list, raw_len: int):
        cobj = self._compressor().compressobj(size=raw_len)
        comp = b"".join([*(cobj.compress(v) for v in views), cobj.flush()])
        return [comp], raw_len, len(comp), payload_crc(comp, self.version), 0

    def write_dense(self, variables: dict, writer_id: str = "dense") -> dict:
        """Store named numeric numpy arrays (e.g. dense variables or other worker state
        that does not live on a PS) in ``<writer>.dense``; a restore returns the newest
        value of each name along the chain in ``RestoreInfo.dense``."""
        self._check_open()
        t0 = time.perf_counter()
        fname = f"{quote_name(str(writer_id))}.dense"
        arrays = {}
        for name, a in variables.items():
            a = np.asarray(a)
            if a.dtype.kind not in "biufc":
                raise TypeError(f"dense variable '{name}': dtype {a.dtype} is not numeric")
            arrays[str(name)] = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        with self._lock:
            if fname in self._files:
                raise ValueError(f"writer '{writer_id}' already wrote dense variables")
            self._files[fname] = {}
        try:
            path = self.dir / fname
            self._created_files.append(path)
            sha = hashlib.sha256() if self.version < 3 else None
            index, pos, raw_total = [], 0, 0
            meta = {}
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for name, a in arrays.items():
                    meta[name] = {"dtype": a.dtype.str, "shape": list(a.shape),
                                  "chunks": 0}
                    bname = name.encode("utf-8")
                    raw = a.reshape(-1).view(np.uint8)
                    for s in range(0, max(raw.size, 1), CHUNK_RAW_BYTES):
                        piece = raw[s:s + CHUNK_RAW_BYTES]
                        bufs, raw_len, comp_len, ccrc, flags = self._encode([piece], None)
                        head = encode_header(KIND_ARRAY, bname, self.num_slots, 0, 0,
                                             piece.size, 0, raw_len, comp_len, ccrc, flags)
                        _write_all(fd, [head, *bufs])
                        if sha is not None:
                            sha.update(head)
                            for b in bufs:
                                sha.update(b)
                        index.append([pos, KIND_ARRAY, piece.size, 0, 0, raw_len,
                                      comp_len, ccrc])
                        pos += len(head) + comp_len
                        raw_total += raw_len
                        meta[name]["chunks"] += 1
                pos = self._close_file(fd, sha, b"", len(index), pos)
            finally:
                os.close(fd)
            self._publish(path)
        except BaseException:
            with self._lock:
                self._files.pop(fname, None)
            raise
        entry = {"path": fname, "type": "dense", "writer": str(writer_id), "table": None,
                 "size": pos, "sha256": sha.hexdigest() if sha is not None else None,
                 "raw_bytes": raw_total,
                 "chunks": index, "arrays": meta}
        with self._lock:
            self._files[fname] = entry
        return {"writer": str(writer_id), "file": fname, "arrays": len(meta), "bytes": pos,
                "raw_bytes": raw_total, "seconds": time.perf_counter() - t0}

    def add_extra(self, extra: dict) -> None:
        """Merge JSON-serializable caller state into the manifest's ``extra`` (e.g. the
        AIMaster's data-shard queues and dense variable info)."""
        self._check_open()
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra must be JSON-serializable: {e}") from None
        with self._lock:
            self._extra.update(copy.deepcopy(extra))

    def drop_table(self, name: str) -> None:
        """Record that ``name`` was dropped since the parent: a restore of this checkpoint
        (or a later one of the chain) does not bring back its earlier rows. A table
        re-created under the same name is written after this call (any config)."""
        self._check_open()
        with self._lock:
            if any(e.get("table") == name for e in self._files.values()):
                raise ValueError(f"table '{name}' was written in this checkpoint")
            self._dropped.add(name)
            self._tables.pop(name, None)

    def file_entries(self) -> list[dict]:
        """JSON-serializable records of the files written by this writer, to be committed
        by another writer of the same checkpoint (:meth:`add_file_entries`)."""
        if self.url is not None:  # every file is uploaded: nothing left to stage
            shutil.rmtree(self.root, ignore_errors=True)
        with self._lock:
            return [{"entry": copy.deepcopy(e),
                     "table_info": copy.deepcopy(self._tables.get(e.get("table")))}
                    for e in self._files.values() if e]

    def add_file_entries(self, records: list[dict]) -> None:
        """Adopt files written into this checkpoint's directory by other writers."""
        self._check_open()
        with self._lock:
            for rec in records:
                e, info = rec["entry"], rec.get("table_info")
                if e["path"] in self._files:
                    raise ValueError(f"file {e['path']} is already part of this checkpoint")
                name = e.get("table")
                if name is not None:
                    have = self._tables.get(name)
                    if have is not None and _config_of(have) != _config_of(info):
                        raise ValueError(f"table '{name}': config {info} differs from {have}")
                    self._tables[name] = info
                    if e.get("cut_seq") is not None:
                        self._watermarks.setdefault(e["writer"], {})[name] = e["cut_seq"]
                self._files[e["path"]] = copy.deepcopy(e)

    # -- commit -------------------------------------------------------------------------
    def commit(self) -> dict:
        """Write ``manifest.json`` atomically (last); returns the manifest."""
        self._check_open()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            files = [e for e in self._files.values() if e]
            if len(files) != len(self._files):
                raise RuntimeError("commit() while a write is still in progress")
            have = remote.listing(self.url).get(self.dir.name, {}) if self.url else None
            for e in files:
                p = self.dir / e["path"]
                try:
                    size = p.stat().st_size if have is None else int(have[e["path"]]["size"])
                except (FileNotFoundError, KeyError):
                    raise CheckpointError(f"{self._where(p)}: file missing at commit") from None
                if size != e["size"]:
                    raise CheckpointError(f"{self._where(p)}: size {size} != recorded "
                                          f"{e['size']}")
            tables = {}
            for name, info in sorted(self._tables.items()):
                mine = [e for e in files if e.get("table") == name]
                tables[name] = dict(info, rows=sum(e["rows"] for e in mine),
                                    tombstones=sum(e["tombstones"] for e in mine))
            now = time.time()
            body = {
                "format": MANIFEST_FORMAT, "version": self.version,
                "id": self.id, "kind": self.kind, "parent": self.parent,
                "parent_checksum": self._parent_checksum,
                "created": now,
                "created_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(
                    timespec="seconds"),
                "num_slots": self.num_slots,
                "tables": tables,
                "dropped_tables": sorted(self._dropped),
                "files": sorted(files, key=lambda e: e["path"]),
                "chunk_fields": CHUNK_FIELDS,
                "watermarks": self._watermarks,
                "totals": {"rows": sum(e.get("rows", 0) for e in files),
                           "tombstones": sum(e.get("tombstones", 0) for e in files),
                           "bytes": sum(e["size"] for e in files),
                           "raw_bytes": sum(e["raw_bytes"] for e in files)},
                "extra": self._extra,
            }
            # the checksum is of the body as a reader parses it: JSON turns int keys into
            # strings, which sort differently ({99, 100} -> "100" < "99"), so a body with
            # int keys (a shard queue's) would fail its own check once read back
            body = json.loads(json.dumps(body, allow_nan=False))
            body["checksum"] = manifest_checksum(body)
            blob = json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
            if self.url is not None:
                # one PUT, after every data object: the checkpoint appears complete or not
                remote.put_bytes(remote.join(self.url, self.dir.name, MANIFEST_NAME), blob)
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                if self.sync:
                    _fsync_dir(self.dir)  # directory entries of the data files
                tmp = self.dir / f".{MANIFEST_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"
                with open(tmp, "wb") as f:
                    f.write(blob)
                    f.flush()
                    if self.sync:
                        os.fsync(f.fileno())
                os.replace(tmp, self.dir / MANIFEST_NAME)
                if self.sync:
                    _fsync_dir(self.dir)
            self._committed = True
        log.info("checkpoint %s committed: %d files, %d rows, %d tombstones, %d bytes",
                 self.dir.name, len(files), body["totals"]["rows"],
                 body["totals"]["tombstones"], body["totals"]["bytes"])
        return body

    def abort(self) -> None:
        """Remove the files this writer created (never a committed checkpoint)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._committed:
            return
        if self.url is not None:
            # the objects uploaded so far (a manifest was never PUT), and the staging copy
            try:
                remote.delete(self.url, self.dir.name,
                              files=[p.name for p in self._created_files
                                     if p.name in self._uploaded])
            finally:
                shutil.rmtree(self.root, ignore_errors=True)
                self._committed = True
            return
        for p in self._created_files:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        try:
            self.dir.rmdir()  # only if empty (other writers' files stay)
        except OSError:
            pass
        self._committed = True  # closed
