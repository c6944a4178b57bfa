"""The data-shard service: byte ranges of files move TODO -> DOING -> DONE.

A shard is ``(file, start, end)`` in the file's *position* unit (see ``FORMATS``): bytes
for plain text and TFRecord, rows for Parquet, and for a compressed file (one shard per
file: it cannot be split) bytes of the decompressed stream. A shard owns the records that
*begin* in ``[start, end)``: the record that crosses ``end`` is read to its end by this
shard and skipped by the next one, so every record is read exactly once and none is split
(``deeprec_ext.data.ranges`` reads them). The AIMaster lists and ``stat``s files, it does
not read them (exceptions, documented in docs/guide-data.md: TFRecord files, whose record
headers are walked once; Parquet footers; the 64 KiB sample of the deprecated
``records_per_shard``).

A DOING shard belongs to one worker; when that worker dies or leaves, its shards go back
to the front of TODO, so no record is skipped and none is trained twice by a live worker.
A worker that leaves cleanly reports, per shard, the position where its untrained records
begin; the shard is handed out again from there.
"""
from __future__ import annotations

import struct
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from enum import Enum

from deeprec_ext.data import fs

# position unit per format; "gz" formats are one shard per file
FORMATS = ("text", "text.gz", "tfrecord", "tfrecord.gz", "parquet")
STREAM_END = 1 << 62  # ``end`` of a compressed file's shard: the end of the stream
STATE_UNIT = "position-v2"  # to_state marker: shards are byte/row ranges, not line ranges
SAMPLE_BYTES = 64 << 10


class ShardState(str, Enum):
    """TODO --assign--> DOING --report done--> DONE;  DOING --owner lost/returned--> TODO."""
    TODO = "todo"
    DOING = "doing"
    DONE = "done"


@dataclass(frozen=True)
class Shard:
    shard_id: int
    path: str
    start: int
    end: int
    data_epoch: int = 0
    size: int = 0        # file size in bytes (at job start), for the reader
    format: str = "text"

    @property
    def records(self) -> int:
        """Length in position units (bytes, or rows for Parquet); kept for callers that
        only compare or sum shard sizes."""
        return max(min(self.end, self.size or self.end) - self.start, 0)


def detect_format(path: str, configured: str = "auto") -> str:
    """The configured format, with ``.gz`` added for gzip files; ``auto``: by extension
    (``.tfrecord``/``.tfrecords``/``.tfr``, ``.parquet``/``.pq``, else text)."""
    name = path.lower()
    gz = name.endswith((".gz", ".gzip"))
    if gz:
        name = name.rsplit(".", 1)[0]
    if configured != "auto":
        base = configured.removesuffix(".gz")
        if base not in ("text", "tfrecord", "parquet"):
            raise ValueError(f"unknown data format {configured!r}; one of auto, {', '.join(FORMATS)}")
        gz = gz or configured.endswith(".gz")
    elif name.endswith((".tfrecord", ".tfrecords", ".tfr")):
        base = "tfrecord"
    elif name.endswith((".parquet", ".pq")):
        base = "parquet"
    else:
        base = "text"
    if base == "parquet":
        if gz:
            raise ValueError(f"{path}: a gzip-compressed Parquet file is not supported "
                             "(Parquet compresses its own pages)")
        return base
    return base + (".gz" if gz else "")


def count_records(path: str) -> int:
    """Lines in a file (a last line without a newline counts), in 16 MiB binary chunks.
    Not used to make shards (the AIMaster does not read data files); kept for tools."""
    n, last = 0, b"\n"
    with fs.open_binary(path) as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def mean_record_bytes(path: str, sample: int = SAMPLE_BYTES) -> float:
    """Mean line length (newline included) over the first ``sample`` bytes of a text file:
    the approximation behind the deprecated ``records_per_shard``."""
    with fs.RangeFile(path) as f:
        head = f.pread(sample, 0)
    lines = head.count(b"\n")
    return len(head) / lines if lines else float(max(len(head), 1))


def tfrecord_boundaries(path: str, every: int) -> list[int]:
    """Record boundaries of a TFRecord file about ``every`` bytes apart (first 0, last the
    file size), found by reading each record's 12-byte header (``pread``; the data is
    skipped, not read; a remote file is read in 1 MiB blocks). A header that is cut, or
    a length running past the end of the file, ends the walk: the rest of the file is the
    last shard, whose reader names the bad record (``data.on_bad_record``)."""
    f = fs.RangeFile(path)
    size = f.size
    out, pos, nxt = [0], 0, every
    try:
        while pos < size:
            head = f.pread(8, pos)
            if len(head) < 8:
                break
            (length,) = struct.unpack("<Q", head)
            pos += 16 + length
            if pos >= size:
                break
            if pos >= nxt:
                out.append(pos)
                nxt = pos + every
    finally:
        f.close()
    out.append(size)
    return out if size else [0]


def parquet_row_groups(path: str) -> list[int]:
    """Row counts of a Parquet file's row groups, from its footer."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise ValueError(f"{path}: Parquet needs pyarrow ({exc})") from None
    with fs.open_binary(path, sequential=False) as f:  # the footer only
        md = pq.ParquetFile(f).metadata
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


def _ranges(path: str, fmt: str, size: int, bytes_per_shard: int) -> list[tuple[int, int]]:
    if fmt.endswith(".gz"):
        return [(0, STREAM_END)] if size else []
    if fmt == "text":
        return [(s, min(size, s + bytes_per_shard)) for s in range(0, size, bytes_per_shard)]
    if fmt == "tfrecord":
        b = tfrecord_boundaries(path, bytes_per_shard)
        return list(zip(b[:-1], b[1:]))
    # parquet: whole row groups, as many as fit in bytes_per_shard of the file (at least one)
    groups, out, row, first = parquet_row_groups(path), [], 0, 0
    per_row = size / max(sum(groups), 1)
    for n in groups:
        if row > first and (row + n - first) * per_row > bytes_per_shard:
            out.append((first, row))
            first = row
        row += n
    if row > first:
        out.append((first, row))
    return out


def make_shards(files: list[str], bytes_per_shard: int, epochs: int = 1,
                fmt: str = "auto", first_id: int = 0) -> list[Shard]:
    """Shards of about ``bytes_per_shard`` bytes, from the files' sizes (``stat``); ids
    from ``first_id`` on (``watch`` adds the shards of new files to a running queue)."""
    if bytes_per_shard <= 0:
        raise ValueError(f"bytes_per_shard must be positive, got {bytes_per_shard}")
    per_file = []
    for p in files:
        f, size = detect_format(p, fmt), fs.size(p)
        per_file.append((p, f, size, _ranges(p, f, size, bytes_per_shard)))
    shards: list[Shard] = []
    for epoch in range(epochs):
        for path, f, size, ranges in per_file:
            for start, end in ranges:
                shards.append(Shard(first_id + len(shards), path, start, end, epoch, size, f))
    return shards


def bytes_for_records(files: list[str], records_per_shard: int) -> int:
    """Deprecated ``records_per_shard`` -> bytes: records x the mean line length of a
    64 KiB sample of the first file (an approximation: shards hold about that many
    records)."""
    if not files:
        return 1
    return max(1, int(round(records_per_shard * mean_record_bytes(files[0]))))


def virtual_rank_shards(shards: list[Shard], rank: int, virtual_workers: int) -> list[Shard]:
    """Sync mode: the shards virtual worker ``rank`` reads, in order (shard i belongs to
    rank i % V). A pure function of the job's shard list, so the data of every virtual
    worker is the same whatever physical worker hosts it."""
    return [s for s in sorted(shards, key=lambda s: s.shard_id)
            if s.shard_id % virtual_workers == rank]


class ShardQueue:
    # ``data.watch``: the shard list grows while the job runs (``extend``); with nothing
    # TODO a worker is told to wait, never that the data is finished
    streaming = False

    def __init__(self, shards: list[Shard]):
        self._lock = threading.Lock()
        self._shards = {s.shard_id: s for s in shards}
        self._todo: deque[int] = deque(s.shard_id for s in shards)
        self._doing: dict[int, str] = {}
        self._done: set[int] = set()
        self._resume: dict[int, int] = {}  # shard id -> position of its first untrained record
        self._shard_dicts: list[dict] | None = None  # to_state's shard list (never mutated)
        self._files: set[str] = set()  # streaming: files taken (some may have no shard)
        self._bad: dict[int, list[dict]] = {}  # shard id -> bad input found in it
        self._reserved: dict[int, tuple[str, float]] = {}  # split rest -> (worker, until)

    def _handout(self, sid: int) -> Shard:
        s = self._shards[sid]
        start = self._resume.get(sid, s.start)
        return s if start == s.start else Shard(s.shard_id, s.path, start, s.end, s.data_epoch,
                                                s.size, s.format)

    def assign(self, worker_id: str) -> tuple[ShardState | None, Shard | None]:
        """(DOING, shard) if one was assigned; (None, None) to wait; (DONE, None) when finished."""
        with self._lock:
            if self._todo:
                sid = self._take(worker_id)
                if sid is None:  # all reserved for other (idle) workers: theirs to take
                    return None, None
                self._doing[sid] = worker_id
                return ShardState.DOING, self._handout(sid)
            if self._doing or self.streaming:
                return None, None
            return ShardState.DONE, None

    def complete(self, worker_id: str, shard_ids) -> list[int]:
        """Mark shards DONE; ignores ids the worker does not hold (returns the ones taken)."""
        taken = []
        with self._lock:
            for sid in shard_ids:
                if self._doing.get(sid) == worker_id:
                    del self._doing[sid]
                    self._done.add(sid)
                    self._resume.pop(sid, None)
                    taken.append(sid)
        return taken

    def give_back(self, worker_id: str, shard_ids=None, progress: dict | None = None) -> list[int]:
        """Return a worker's DOING shards (all of them if ``shard_ids`` is None) to TODO's
        front. ``progress`` maps shard id -> the position (byte offset; row for Parquet)
        where the shard's first untrained record begins, i.e. the end of the last record
        trained: the shard is handed out again from there (a worker that left cleanly).
        Without it, or with a position outside the hand-out, the whole hand-out is
        repeated (a worker that died mid-shard)."""
        progress = progress or {}
        with self._lock:
            mine = sorted(s for s, w in self._doing.items() if w == worker_id
                          and (shard_ids is None or s in set(shard_ids)))
            for sid in reversed(mine):
                del self._doing[sid]
                shard = self._shards[sid]
                start = self._resume.get(sid, shard.start)
                pos = int(progress.get(sid, start))
                if not start <= pos <= max(shard.end, start):
                    pos = start
                if pos >= shard.end:
                    self._done.add(sid)
                    self._resume.pop(sid, None)
                    continue
                if pos > start:
                    self._resume[sid] = pos
                self._todo.appendleft(sid)
            return mine

    def _take(self, worker_id: str) -> int | None:
        """The first TODO shard this worker may take: not one reserved for another worker
        (a split's rest, until its reservation lapses). Caller holds the lock."""
        now = time.monotonic()
        for sid in self._todo:
            who, until = self._reserved.get(sid, (worker_id, 0.0))
            if who == worker_id or until < now:
                self._todo.remove(sid)
                self._reserved.pop(sid, None)
                return sid
        return None

    def split(self, worker_id: str, sid: int, at: int, reserve_for: str | None = None,
              reserve_seconds: float = 5.0) -> Shard | None:
        """Split a DOING shard of ``worker_id`` at position ``at`` (the end of the last
        record the worker has taken in; a record boundary): the worker keeps the records
        that begin in ``[hand-out start, at)`` under the same id, and those that begin in
        ``[at, end)`` become a new shard at the front of TODO, for an idle worker. Returns
        the new shard; None (nothing changes) when the worker does not hold the shard, the
        shard cannot be split (a compressed file is one stream) or ``at`` leaves one side
        empty. ``reserve_for``: only that worker may take the rest for ``reserve_seconds``
        (the slow worker asks for its next shard at once and would take it back). The sum of the parts is the shard: no record is skipped or trained twice."""
        with self._lock:
            s = self._shards.get(sid)
            if s is None or self._doing.get(sid) != worker_id or s.format.endswith(".gz"):
                return None
            start = self._resume.get(sid, s.start)
            at = int(at)
            if not start < at < min(s.end, s.size or s.end):
                return None
            new_id = max(self._shards) + 1
            rest = Shard(new_id, s.path, at, s.end, s.data_epoch, s.size, s.format)
            self._shards[sid] = Shard(s.shard_id, s.path, s.start, at, s.data_epoch, s.size,
                                      s.format)
            self._shards[new_id] = rest
            self._todo.appendleft(new_id)
            if reserve_for and reserve_for != worker_id:  # not straight back to the slow one
                self._reserved[new_id] = (reserve_for, time.monotonic() + reserve_seconds)
            self._shard_dicts = None  # the shard list changed
            return rest

    def doing(self) -> dict[int, str]:
        """DOING shard id -> its worker."""
        with self._lock:
            return dict(self._doing)

    def position(self, sid: int) -> int | None:
        """Where shard ``sid``'s next hand-out starts (None: no such shard)."""
        with self._lock:
            s = self._shards.get(sid)
            return None if s is None else self._resume.get(sid, s.start)

    def all_shards(self) -> list[Shard]:
        return sorted(self._shards.values(), key=lambda s: s.shard_id)

    def any_shard(self) -> Shard | None:
        """One shard of the job (the first made), without sorting them all: asked by
        every worker polling at the end."""
        with self._lock:
            return next(iter(self._shards.values()), None)

    def mark_done(self, shard_ids) -> list[int]:
        """Sync mode: shards are read by virtual rank, not handed out on request; the
        coordinator marks them DONE once every record was trained (TODO or DOING -> DONE)."""
        taken = []
        with self._lock:
            for sid in shard_ids:
                if sid in self._shards and sid not in self._done:
                    self._doing.pop(sid, None)
                    if sid in self._todo:
                        self._todo.remove(sid)
                    self._done.add(sid)
                    self._resume.pop(sid, None)
                    taken.append(sid)
        return taken

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"todo": len(self._todo), "doing": len(self._doing), "done": len(self._done)}

    def finished(self) -> bool:
        with self._lock:
            return not self.streaming and not self._todo and not self._doing

    # -- bad input (data.on_bad_record) ------------------------------------------------------
    def record_bad(self, shard_id: int, entries: list[dict]) -> list[dict]:
        """Keep a shard's bad-input reports (one per position: a shard read again after
        its worker died reports the same ones); returns the new ones."""
        new = []
        with self._lock:
            have = self._bad.setdefault(int(shard_id), [])
            seen = {(e["path"], e["offset"], e["reason"]) for e in have}
            for e in entries:
                if (e["path"], e["offset"], e["reason"]) not in seen:
                    have.append(dict(e))
                    new.append(e)
            if not have:
                del self._bad[int(shard_id)]
        return new

    def holder(self, shard_id: int) -> str | None:
        """The worker a shard is DOING for (None: not DOING)."""
        with self._lock:
            return self._doing.get(int(shard_id))

    def bad_input(self) -> dict:
        """``{"shards", "records", "reports"}``: how many shards had bad input, how many
        bad records, and every report (shard id, file, position, reason, count)."""
        with self._lock:
            reports = [{"shard_id": sid, **e} for sid in sorted(self._bad) for e in self._bad[sid]]
        return {"shards": len({r["shard_id"] for r in reports}),
                "records": sum(int(r.get("count", 1)) for r in reports), "reports": reports}

    # -- streaming (data.watch) ---------------------------------------------------------------
    def extend(self, shards: list[Shard], files=()) -> None:
        """Append the shards of new ``files`` at the end of TODO (ids from ``next_id()``);
        the files are known from now on, even one without shards (an empty file)."""
        with self._lock:
            self._files.update(files)
            nxt = max(self._shards, default=-1) + 1
            for s in shards:
                if s.shard_id in self._shards:  # a split took the id since next_id(): renumber
                    s = replace(s, shard_id=nxt)
                nxt = max(nxt, s.shard_id) + 1
                self._shards[s.shard_id] = s
                self._todo.append(s.shard_id)
            self._shard_dicts = None

    def next_id(self) -> int:
        with self._lock:
            return max(self._shards, default=-1) + 1

    def paths(self) -> set[str]:
        """Every file that has shards in the queue (whatever their state)."""
        with self._lock:
            return self._files | {s.path for s in self._shards.values()}

    def files_done(self) -> list[str]:
        """Files all of whose shards are DONE."""
        with self._lock:
            open_paths = {self._shards[i].path for i in self._shards if i not in self._done}
            return sorted({s.path for s in self._shards.values()} - open_paths)

    def records_done(self) -> int:
        with self._lock:
            return sum(self._shards[s].records for s in self._done)

    def total_records(self) -> int:
        return sum(s.records for s in self._shards.values())

    def to_state(self) -> dict:
        with self._lock:
            if self._shard_dicts is None:  # built once, again after a split
                self._shard_dicts = [asdict(s) for s in self._shards.values()]
            return {"unit": STATE_UNIT, "shards": list(self._shard_dicts),
                    "todo": list(self._todo), "doing": dict(self._doing), "done": sorted(self._done),
                    "resume": {str(k): v for k, v in self._resume.items()},
                    "files": sorted(self._files),
                    "bad": {str(k): v for k, v in self._bad.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "ShardQueue":
        """Rebuild from a saved state; shards that were DOING go back to TODO (their owner
        may be gone), in front of the rest. A state written before shards were byte
        ranges (line ranges, no ``unit``) cannot be resumed: ValueError says so."""
        if state.get("unit") != STATE_UNIT and state.get("shards"):
            raise ValueError(
                "the saved data position uses line-range shards (written by an older "
                "version); this version's shards are byte ranges, so that position cannot "
                "be resumed. Finish the job with the older version, or start the data over: "
                "restart the job with a new state_dir (its checkpoints can still seed the "
                "model through checkpoint.init_from)")
        q = cls([Shard(**s) for s in state["shards"]])
        q._done = set(state["done"])
        q._resume = {int(k): v for k, v in state.get("resume", {}).items()}
        q._files = set(state.get("files", ()))
        q._bad = {int(k): v for k, v in state.get("bad", {}).items()}
        doing = sorted(int(s) for s in state["doing"])
        q._todo = deque(doing + [s for s in state["todo"] if s not in q._done])
        return q
