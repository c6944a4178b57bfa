"""The data-shard service: record ranges move TODO -> DOING -> DONE.

A DOING shard belongs to one worker; when that worker dies or leaves, its shards go back
to the front of TODO, so no record is skipped and none is trained twice by a live worker.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from enum import Enum


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

    @property
    def records(self) -> int:
        return self.end - self.start


def count_records(path: str) -> int:
    """Lines in a file (a last line without a newline counts), in 16 MiB binary chunks."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def make_shards(files: list[str], records_per_shard: int, epochs: int = 1) -> list[Shard]:
    sizes = [(p, count_records(p)) for p in files]
    shards: list[Shard] = []
    for epoch in range(epochs):
        for path, n in sizes:
            for start in range(0, n, records_per_shard):
                shards.append(Shard(len(shards), path, start, min(n, start + records_per_shard), epoch))
    return shards


def virtual_rank_shards(shards: list[Shard], rank: int, virtual_workers: int) -> list[Shard]:
    """Sync mode: the shards virtual worker ``rank`` reads, in order (shard i belongs to
    rank i % V). A pure function of the job's shard list, so the data of every virtual
    worker is the same whatever physical worker hosts it."""
    return [s for s in sorted(shards, key=lambda s: s.shard_id)
            if s.shard_id % virtual_workers == rank]


class ShardQueue:
    def __init__(self, shards: list[Shard]):
        self._lock = threading.Lock()
        self._shards = {s.shard_id: s for s in shards}
        self._todo: deque[int] = deque(s.shard_id for s in shards)
        self._doing: dict[int, str] = {}
        self._done: set[int] = set()
        self._resume: dict[int, int] = {}  # shard id -> first untrained record
        self._shard_dicts: list[dict] | None = None  # to_state's shard list (never mutated)

    def _handout(self, sid: int) -> Shard:
        s = self._shards[sid]
        start = self._resume.get(sid, s.start)
        return s if start == s.start else Shard(s.shard_id, s.path, start, s.end, s.data_epoch)

    def assign(self, worker_id: str) -> tuple[ShardState | None, Shard | None]:
        """(DOING, shard) if one was assigned; (None, None) to wait; (DONE, None) when finished."""
        with self._lock:
            if self._todo:
                sid = self._todo.popleft()
                self._doing[sid] = worker_id
                return ShardState.DOING, self._handout(sid)
            if self._doing:
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
        front. ``progress`` maps shard id -> records of its hand-out already trained: the
        shard is handed out again from there (a worker that left cleanly); without it the
        whole hand-out is repeated (a worker that died mid-shard)."""
        progress = progress or {}
        with self._lock:
            mine = sorted(s for s, w in self._doing.items() if w == worker_id
                          and (shard_ids is None or s in set(shard_ids)))
            for sid in reversed(mine):
                del self._doing[sid]
                start = self._resume.get(sid, self._shards[sid].start)
                consumed = min(max(int(progress.get(sid, 0)), 0), self._shards[sid].end - start)
                if start + consumed >= self._shards[sid].end:
                    self._done.add(sid)
                    self._resume.pop(sid, None)
                    continue
                if consumed:
                    self._resume[sid] = start + consumed
                self._todo.appendleft(sid)
            return mine

    def all_shards(self) -> list[Shard]:
        return sorted(self._shards.values(), key=lambda s: s.shard_id)

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
            return not self._todo and not self._doing

    def records_done(self) -> int:
        with self._lock:
            return sum(self._shards[s].records for s in self._done)

    def total_records(self) -> int:
        return sum(s.records for s in self._shards.values())

    def to_state(self) -> dict:
        with self._lock:
            if self._shard_dicts is None:  # the shard list never changes: built once
                self._shard_dicts = [asdict(s) for s in self._shards.values()]
            return {"shards": list(self._shard_dicts),
                    "todo": list(self._todo), "doing": dict(self._doing), "done": sorted(self._done),
                    "resume": {str(k): v for k, v in self._resume.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "ShardQueue":
        """Rebuild from a saved state; shards that were DOING go back to TODO (their owner
        may be gone), in front of the rest."""
        q = cls([Shard(**s) for s in state["shards"]])
        q._done = set(state["done"])
        q._resume = {int(k): v for k, v in state.get("resume", {}).items()}
        doing = sorted(int(s) for s in state["doing"])
        q._todo = deque(doing + [s for s in state["todo"] if s not in q._done])
        return q
