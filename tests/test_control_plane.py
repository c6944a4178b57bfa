"""Units of the AIMaster: config validation, shard queue, registry leases, durable state."""
import json

import pytest
import yaml

from aimaster.config import ConfigError, load_job, parse_job, with_overrides
from aimaster.registry import MemberState, Registry
from aimaster.shards import Shard, ShardQueue, ShardState, count_records, make_shards
from aimaster.state import StateStore


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_job_file_and_flag_overrides(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"name": "j", "ps": {"replicas": 3},
                                 "worker": {"replicas": 2, "command": ["python", "x.py"]},
                                 "data": {"files": [], "records_per_shard": 5}}))
    cfg = with_overrides(load_job(str(f)), ps=2, workers=0, port=0, state_dir=str(tmp_path / "s"))
    assert cfg.ps.replicas == 2 and cfg.worker.replicas == 0 and cfg.worker.command == ("python", "x.py")
    assert cfg.state_dir == str(tmp_path / "s") and cfg.data.records_per_shard == 5


@pytest.mark.parametrize("doc,needle", [
    ({"ps": {"replicas": 0}}, "ps.replicas"),
    ({"ps": {"command": ["x"]}}, "unknown key"),
    ({"worker": {"command": ["x"]}, "workers": {}}, "not both"),
    ({"master": {"lease_seconds": 1, "heartbeat_seconds": 1}}, "heartbeat_seconds"),
    ({"num_slots": 2, "ps": {"replicas": 1, "max_replicas": 3}}, "max_replicas"),
    ({"ps": {"replicas": "two"}}, "ps.replicas"),
    ({"pss": 1}, "unknown key"),
    ({"worker": {"replicas": 2}}, "worker.command"),
    ({"data": {"records_per_shard": 0}}, "data.records_per_shard"),
    ({"data": {"files": 3}}, "data.files"),
    ({"master": {"lease_seconds": -1}}, "master.lease_seconds"),
    ({"master": {"grace_seconds": 0}}, "master.grace_seconds"),
    ([1, 2], "expected a mapping"),
])
def test_bad_job_config_names_the_field(doc, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_job(doc)


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(str(bad))
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_job(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="--ps"):
        with_overrides(parse_job({}), ps=0)


def test_count_records_and_shards(tmp_path):
    a = tmp_path / "a.txt"
    a.write_bytes(b"".join(b"line%d\n" % i for i in range(25)))
    b = tmp_path / "b.txt"
    b.write_bytes(b"x\ny\nz")  # no trailing newline: 3 records
    assert count_records(str(a)) == 25 and count_records(str(b)) == 3
    size_a = a.stat().st_size  # 140 bytes
    shards = make_shards([str(a), str(b)], 64, epochs=2)  # byte ranges, from stat alone
    assert [(s.start, s.end) for s in shards[:4]] == [(0, 64), (64, 128), (128, size_a), (0, 5)]
    assert {(s.size, s.format) for s in shards} == {(size_a, "text"), (5, "text")}
    assert sum(s.records for s in shards) == 2 * (size_a + 5)
    assert {s.data_epoch for s in shards} == {0, 1}


def test_shard_queue_dead_worker_shards_go_back():
    q = ShardQueue([Shard(i, "f", i * 10, i * 10 + 10) for i in range(4)])
    st, s0 = q.assign("w0")
    _, s1 = q.assign("w1")
    _, s2 = q.assign("w0")
    assert st == ShardState.DOING and q.counts() == {"todo": 1, "doing": 3, "done": 0}
    assert q.complete("w0", [s0.shard_id]) == [s0.shard_id]
    assert q.complete("w1", [s0.shard_id]) == []  # not w1's: ignored
    assert q.give_back("w0") == [s2.shard_id]     # w0 died holding s2
    assert q.counts() == {"todo": 2, "doing": 1, "done": 1}
    _, again = q.assign("w1")
    assert again.shard_id == s2.shard_id           # returned shards come first
    _, s3 = q.assign("w1")
    assert q.assign("w1") == (None, None)          # nothing TODO, s1 still DOING: wait
    q.complete("w1", [s1.shard_id, again.shard_id, s3.shard_id])
    assert q.assign("w1") == (ShardState.DONE, None) and q.finished()
    assert q.records_done() == q.total_records() == 40


def test_shard_queue_state_round_trip_requeues_doing():
    q = ShardQueue([Shard(i, "f", 0, 1) for i in range(3)])
    _, a = q.assign("w0")
    _, b = q.assign("w0")
    q.complete("w0", [a.shard_id])
    state = json.loads(json.dumps(q.to_state()))
    r = ShardQueue.from_state(state)
    assert r.counts() == {"todo": 2, "doing": 0, "done": 1}
    assert r.assign("w9")[1].shard_id == b.shard_id


def test_registry_leases_expire_with_fake_clock():
    clock = FakeClock()
    reg = Registry(lease_seconds=10, clock=clock)
    ps = reg.register("ps", "ps-0", 11, "127.0.0.1:1")
    w = reg.register("worker", "", 12, "")
    assert w.id == "worker-0" and w.rank == 0 and ps.rank == 0
    clock.t += 6
    assert reg.heartbeat("ps-0", 0, 0) is not None
    clock.t += 6
    dead = reg.expire()
    assert [m.id for m in dead] == ["worker-0"]
    assert reg.get("worker-0").state == MemberState.DEAD
    assert reg.heartbeat("worker-0") is None       # dead members must re-register
    assert reg.register("worker", "worker-0", 13, "").state == MemberState.RUNNING
    with pytest.raises(ValueError, match="already used by a worker"):
        reg.register("ps", "worker-0", 1, "a:1")


def test_state_store_save_load(tmp_path):
    store = StateStore(str(tmp_path))
    assert store.load() is None
    store.save({"epoch": 1})
    store.save({"epoch": 2, "x": [1, 2]})
    assert store.load() == {"epoch": 2, "x": [1, 2]}
    # no temp files; load() folded the WAL into the database
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job_state.db"]
