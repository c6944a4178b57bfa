"""Shard splits (issue 19): a slow worker's shard is cut at the record it reached and the
rest handed to an idle worker. Whatever the cuts, returns and restarts of the AIMaster,
every record of the data is trained exactly once."""
from __future__ import annotations

import json
import random

import pytest

from aimaster.shards import ShardQueue, ShardState, make_shards
from deeprec_ext.data.ranges import read_shard
from tests.test_data_shards import _tfrecord_bytes


def _text_file(tmp_path, n=600):
    path = tmp_path / "f.txt"
    path.write_bytes(b"".join(b"r%05d%s\n" % (i, b"x" * (i % 13)) for i in range(n)))
    return str(path), [b"r%05d%s" % (i, b"x" * (i % 13)) for i in range(n)]


def _tfrecord_file(tmp_path, n=400):
    payloads = [b"t%04d" % i + bytes([i % 251]) * (i % 29) for i in range(n)]
    path = tmp_path / "f.tfrecord"
    path.write_bytes(_tfrecord_bytes(payloads))
    return str(path), payloads


class _Worker:
    """A worker of the counting simulation: takes a shard, trains its records one by one."""

    def __init__(self, wid):
        self.id, self.shard, self.records, self.next_pos, self.i = wid, None, [], [], 0

    def take(self, q):
        state, s = q.assign(self.id)
        if state != ShardState.DOING:
            return state
        self.shard = s
        self.records, self.next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
        self.next_pos = [int(p) for p in self.next_pos]
        self.i = 0
        return state

    def position(self):
        return self.next_pos[self.i - 1] if self.i else self.shard.start


@pytest.mark.parametrize("kind", ["text", "tfrecord"])
@pytest.mark.parametrize("seed", range(6))
def test_random_splits_returns_replacements_and_restarts_train_every_record_once(tmp_path, kind, seed):
    path, expected = (_text_file if kind == "text" else _tfrecord_file)(tmp_path)
    rng = random.Random(seed)
    q = ShardQueue(make_shards([path], rng.choice([300, 1000, 4000])))
    workers = [_Worker(f"w{i}") for i in range(3)]
    trained: list[bytes] = []
    splits = replaced = 0
    for _ in range(100000):
        if q.finished():
            break
        w = rng.choice(workers)
        if w.shard is None:
            w.take(q)
            continue
        r = rng.random()
        if r < 0.7 and w.i < len(w.records):            # train one record
            trained.append(w.records[w.i])
            w.i += 1
        elif r < 0.8:                                    # the master asks it to split
            at = w.position()
            rest = q.split(w.id, w.shard.shard_id, at)
            if rest is not None:
                splits += 1
                assert rest.start == at
                w.records, w.next_pos = w.records[:w.i], w.next_pos[:w.i]
                w.shard = type(w.shard)(**{**w.shard.__dict__, "end": at})
        elif r < 0.83:                                   # it leaves cleanly
            q.give_back(w.id, None, {w.shard.shard_id: w.position()})
            w.shard = None
        elif r < 0.845:                                  # it is replaced (a straggler): a
            replaced += 1                                # new worker joins, the slow one
            workers.append(_Worker(f"new{replaced}"))     # hands back at the
            q.give_back(w.id, None, {w.shard.shard_id: w.position()})  # record reached
            workers.remove(w)                            # and never comes back
            continue
        elif r < 0.85:                                   # the AIMaster's state is saved
            for x in workers:                            # and loaded again, with the workers'
                if x.shard is not None:                  # positions handed back first
                    q.give_back(x.id, None, {x.shard.shard_id: x.position()})
                x.shard = None
            q = ShardQueue.from_state(json.loads(json.dumps(q.to_state())))
            continue
        if w.shard is not None and w.i == len(w.records):
            assert q.complete(w.id, [w.shard.shard_id]) == [w.shard.shard_id]
            w.shard = None
    assert q.finished()
    assert splits > 0 and replaced > 0
    assert sorted(trained) == sorted(expected) and len(trained) == len(expected)
    assert q.records_done() == q.total_records()


def test_split_keeps_the_head_and_queues_the_rest_first(tmp_path):
    path, expected = _text_file(tmp_path, 100)
    q = ShardQueue(make_shards([path], 10**6))          # one shard
    _, s = q.assign("slow")
    records, next_pos = read_shard(s.path, s.start, s.end, s.format, s.size)
    at = int(next_pos[29])                               # 30 records taken in
    rest = q.split("slow", s.shard_id, at)
    assert (rest.start, rest.end) == (at, s.end) and rest.shard_id != s.shard_id
    state, stolen = q.assign("idle")
    assert state == ShardState.DOING and stolen.shard_id == rest.shard_id
    assert read_shard(stolen.path, stolen.start, stolen.end, stolen.format, stolen.size)[0] \
        == records[30:]
    assert q.counts() == {"todo": 0, "doing": 2, "done": 0}
    # the slow worker finishes its head, the idle one the rest: the job is done
    assert q.complete("slow", [s.shard_id]) == [s.shard_id]
    assert q.complete("idle", [rest.shard_id]) == [rest.shard_id]
    assert q.finished() and q.records_done() == q.total_records()


def test_split_is_refused_when_it_cannot_be_exact(tmp_path):
    path, _ = _text_file(tmp_path, 50)
    q = ShardQueue(make_shards([path], 10**6))
    _, s = q.assign("a")
    assert q.split("b", s.shard_id, s.start + 10) is None    # not its shard
    assert q.split("a", s.shard_id, s.start) is None         # nothing kept
    assert q.split("a", s.shard_id, s.end) is None           # nothing handed on
    assert q.split("a", 999, 10) is None                     # no such shard
    gz = tmp_path / "g.txt.gz"
    import gzip
    gz.write_bytes(gzip.compress(b"a\nb\nc\n"))
    q = ShardQueue(make_shards([str(gz)], 10))
    _, g = q.assign("a")
    assert q.split("a", g.shard_id, 2) is None               # one stream: not splittable
    assert q.counts() == {"todo": 0, "doing": 1, "done": 0}


def test_tracker_truncate_moves_the_shard_end_back():
    import numpy as np

    from deeprec_ext.worker import ShardTracker
    done, back = [], []
    t = ShardTracker(done.extend, lambda ids, pos: back.extend(zip(ids, pos)))
    t.add(1, 3, 0, np.array([5, 9, 14]))
    t.add(2, 6, 14, np.array([20, 26, 30, 35, 40, 44]))
    assert t.truncate(2, 4)                      # 2 records kept, 4 handed on (cut at 26)
    assert not t.truncate(2, 9) and not t.truncate(7, 1)
    t.emitted(5)
    t.advance(1)
    assert done == [1, 2] and t.handed_out == 5  # shard 2 done after its 2 kept records
    t.add(3, 4, 50, np.array([52, 54, 56, 58]))
    t.truncate(3, 2)
    t.finish()
    assert back == [(3, 50)]
