"""Streaming input (issue 18, item 4): with ``data.watch`` files that appear under the globs
while the job runs become new shards; the taken files are part of the job state and its
checkpoints, so a restarted job neither skips nor repeats a file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from aimaster.config import ConfigError, parse_job
from aimaster.shards import ShardQueue, ShardState, make_shards
from tests.conftest import ROOT, Job, wait_for


def _ids_file(path, ids):
    """Records are decimal ids; written then renamed into place, as a producer should."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_bytes(b"".join(b"%d\n" % i for i in ids))
    os.replace(tmp, path)


def test_streaming_queue_waits_grows_and_round_trips(tmp_path):
    a = tmp_path / "a.txt"
    _ids_file(a, range(100))
    q = ShardQueue(make_shards([str(a)], 200))
    q.streaming = True
    q.extend([], [str(a)])
    taken = []
    while (got := q.assign("w"))[0] == ShardState.DOING:
        taken.append(got[1].shard_id)
    assert got == (None, None)           # nothing TODO: wait, never "finished"
    q.complete("w", taken)
    assert q.assign("w") == (None, None) and not q.finished()
    b, empty = tmp_path / "b.txt", tmp_path / "empty.txt"
    _ids_file(b, range(100, 150))
    empty.write_bytes(b"")
    new = make_shards([str(b), str(empty)], 200, first_id=q.next_id())
    q.extend(new, [str(b), str(empty)])
    assert [s.shard_id for s in new] == list(range(len(taken), len(taken) + len(new)))
    assert q.assign("w")[1].path == str(b)
    q2 = ShardQueue.from_state(json.loads(json.dumps(q.to_state())))
    assert q2.paths() == {str(a), str(b), str(empty)}   # the empty file is known too
    assert q2.files_done() == [str(a)]
    with pytest.raises(ConfigError, match="epochs must be 1"):
        parse_job({"data": {"files": ["x"], "watch": True, "epochs": 2}})
    with pytest.raises(ConfigError, match="not with consistency sync"):
        parse_job({"data": {"files": ["x"], "watch": True},
                   "consistency": {"mode": "sync", "virtual_workers": 1}})
    # a pattern that matches nothing yet is fine when watching
    cfg = parse_job({"data": {"files": [str(tmp_path / "none-*.txt")], "watch": True}})
    assert cfg.data.resolved_files() == [] and cfg.data.poll_seconds == 10.0


def _counts(job, n):
    from deeprec_ext.client import PSClient
    client = PSClient.connect(job.address, timeout=30)
    try:
        return client.lookup("records", np.arange(n, dtype=np.int64), insert_missing=False)[:, 0]
    finally:
        client.close()


def _all_done(job, paths):
    state = job.state()["shards"]
    have = {s["path"] for s in state["shards"]}
    st = job.status()["shards"]
    return set(paths) <= have and st["todo"] == 0 and st["doing"] == 0


def test_watch_job_takes_new_files_and_restart_neither_skips_nor_repeats(tmp_path):
    """A watching job with one counting worker (+1 pushed per record id): files added while
    it runs are trained; it is checkpointed and stopped, a file is added while it is down,
    and the restarted job trains that file only: every id ends at exactly 1."""
    data = tmp_path / "in"
    data.mkdir()
    per = 2000
    files = [data / f"part-{k}.txt" for k in range(4)]
    _ids_file(files[0], range(0, per))
    spec = {"name": "stream", "ps": {"replicas": 1},
            "worker": {"replicas": 1, "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                       "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "500",
                               "PYTHONPATH": str(ROOT)}},
            "data": {"files": [str(data / "part-*.txt")], "bytes_per_shard": 4000,
                     "watch": True, "poll_seconds": 0.3},
            "master": {"heartbeat_seconds": 0.5}}
    job = Job(tmp_path, spec)
    try:
        wait_for(lambda: _all_done(job, [str(files[0])]), 60, "the first file")
        _ids_file(files[1], range(per, 2 * per))
        _ids_file(files[2], range(2 * per, 3 * per))
        wait_for(lambda: _all_done(job, map(str, files[:3])), 60, "files added while running")
        assert job.status()["phase"] == "running"        # it runs until stopped
        assert job.proc.poll() is None
        out = subprocess.run([sys.executable, "-m", "aimaster.cli", "checkpoint", "--master",
                              job.address], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stderr
        before = _counts(job, 3 * per)
        assert (before == 1).all(), np.bincount(before.astype(np.int64))
    finally:
        job.stop()
    assert job.state()["phase"] == "stopped"
    _ids_file(files[3], range(3 * per, 4 * per))      # arrives while the job is down
    (job.state_dir / "master.addr").unlink(missing_ok=True)
    again = Job(tmp_path, spec)
    try:
        wait_for(lambda: any(e["kind"] == "resumed" for e in again.status()["events"]), 60,
                 "resume from the checkpoint")
        wait_for(lambda: _all_done(again, map(str, files)), 60, "the file that came while down")
        got = _counts(again, 4 * per)
        assert np.bincount(np.clip(got.astype(np.int64), 0, 3), minlength=4).tolist() == \
            [0, 4 * per, 0, 0]
        shards = again.state()["shards"]["shards"]
        per_file = {str(f): sum(1 for s in shards if s["path"] == str(f)) for f in files}
        assert all(n >= 3 for n in per_file.values()) and len(shards) == sum(per_file.values())
        assert len({s["shard_id"] for s in shards}) == len(shards)
    finally:
        again.stop()
