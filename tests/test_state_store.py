"""The job state store: exact round trips, writes proportional to the change, durability
across kill -9, clear errors for a damaged database."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aimaster.shards import Shard, ShardQueue
from aimaster.state import DB_NAME, StateStore, StateStoreError, load_state

ROOT = Path(__file__).resolve().parent.parent


def norm(state):
    """What a JSON store gives back (dict keys become strings, tuples lists)."""
    return json.loads(json.dumps(state))


class Sim:
    """A deterministic job: ``step(i)`` is one AIMaster save worth of change (a shard
    handed out or reported, heartbeat counters, events in a 200-window, now and then a
    routing change or a member joining). The state after step i depends only on
    (seed, shards, i)."""

    def __init__(self, shards: int, seed: int = 0, workers: int = 4, ps: int = 2):
        self.seed = seed
        self.q = ShardQueue([Shard(i, f"/data/day-{i // 500:03d}.csv", (i % 500) * 4096,
                                   (i % 500 + 1) * 4096, 0) for i in range(shards)])
        self.members = [{"role": "ps", "id": f"ps-{i}", "pid": 1000 + i, "address": f"127.0.0.1:{7000 + i}",
                         "state": "running", "steps": 0, "samples": 0} for i in range(ps)]
        self.members += [{"role": "worker", "id": f"worker-{i}", "pid": 2000 + i, "address": "",
                          "state": "running", "steps": 0, "samples": 0} for i in range(workers)]
        self.slot_owner = [s % ps for s in range(4096)]
        self.events: list[dict] = []
        self.routing_epoch = 1
        self.seq = 0
        self.phase = "running"

    def step(self) -> None:
        self.seq += 1
        rng = random.Random(self.seed * 1_000_003 + self.seq)
        workers = [m for m in self.members if m["role"] == "worker" and m["state"] == "running"]
        w = rng.choice(workers)["id"]
        r = rng.random()
        if r < 0.45:
            self.q.assign(w)
        elif r < 0.9:
            mine = sorted(s for s, o in self.q._doing.items() if o == w)
            if mine:
                self.q.complete(w, [rng.choice(mine)])
        elif r < 0.95:
            self.q.give_back(w, progress={s: 7 for s in self.q._doing})
        else:
            self.routing_epoch += 1
            for s in rng.sample(range(4096), 64):
                self.slot_owner[s] = rng.randrange(2)
        for m in self.members:
            if m["state"] == "running":
                m["steps"] += rng.randrange(1, 50)
                m["samples"] = m["steps"] * 512
        if rng.random() < 0.02:
            n = len([m for m in self.members if m["role"] == "worker"])
            self.members.append({"role": "worker", "id": f"worker-{n}", "pid": 3000 + n,
                                 "address": "", "state": "running", "steps": 0, "samples": 0})
            self.events.append({"kind": "register", "time": 1e9 + self.seq, "id": f"worker-{n}"})
        self.events.append({"kind": "shard", "time": 1e9 + self.seq + 0.5, "worker": w, "seq": self.seq})

    def state(self) -> dict:
        return {"job_name": "sim", "phase": self.phase, "message": "", "epoch": self.routing_epoch,
                "master_address": "127.0.0.1:5000", "seq": self.seq,
                "routing": {"epoch": self.routing_epoch, "num_slots": 4096, "ps_ids": ["ps-0", "ps-1"],
                            "ps_addresses": ["127.0.0.1:7000", "127.0.0.1:7001"],
                            "slot_owner": list(self.slot_owner)},
                "members": [dict(m) for m in self.members],
                "shards": self.q.to_state(),
                "events": [dict(e) for e in self.events[-200:]],
                "global_step": sum(m["steps"] for m in self.members if m["role"] == "worker"),
                "model": {"tables": [{"name": "emb", "dim": 16}], "dense": {"units": [256, 128]}},
                "final_checkpoint": "", "export_dir": ""}


def sim_state_at(shards: int, seed: int, seq: int) -> dict:
    sim = Sim(shards, seed)
    for _ in range(seq):
        sim.step()
    return sim.state()


def wal_size(store: StateStore) -> int:
    try:
        return os.path.getsize(store.path + "-wal")
    except FileNotFoundError:
        return 0


# -- round trips -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_round_trip_realistic_state(tmp_path):
    sim = Sim(10_000, seed=1)
    for _ in range(300):  # a job well under way: events past the 200 cap, some shards done
        sim.step()
    state = sim.state()
    assert len(state["shards"]["shards"]) == 10_000 and len(state["events"]) == 200
    store = StateStore(str(tmp_path))
    assert store.load() is None
    store.save(state)
    assert StateStore(str(tmp_path)).load() == norm(state)
    assert load_state(str(tmp_path)) == norm(state)
    # a run of saves, checked from a fresh store (no shared memory) every few
    for i in range(60):
        sim.step()
        if i == 20:
            sim.phase = "scaling"
        store.save(sim.state())
        if i % 15 == 14:
            assert StateStore(str(tmp_path)).load() == norm(sim.state())
    # top-level keys that appear, disappear and change type
    s = sim.state()
    s["routing"] = None
    s["extra"] = {"nested": list(range(3000))}
    del s["model"]
    store.save(s)
    assert StateStore(str(tmp_path)).load() == norm(s)
    s["extra"] = "small now"
    s["routing"] = sim.state()["routing"]
    store.save(s)
    loaded = StateStore(str(tmp_path)).load()
    assert loaded == norm(s)
    assert list(loaded) == list(s)  # key order kept


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.45:
        return rng.choice([rng.randrange(-5, 100), rng.random(), "s" * rng.randrange(0, 40),
                           None, True, False, 1.0, 1])
    if r < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 30))]
    return {rng.choice(["a", "b", "c", 1, 2, "k%d" % rng.randrange(20)]): _random_value(rng, depth + 1)
            for _ in range(rng.randrange(0, 12))}


def _mutate(rng: random.Random, v, depth: int = 0):
    """A copy of ``v`` with a few edits of the kinds a job state sees."""
    if isinstance(v, list):
        v = list(v)
        for _ in range(rng.randrange(1, 4)):
            r = rng.random()
            if r < 0.15 and v:
                v.pop(0)                                   # queue head taken
            elif r < 0.3:
                v.insert(0, _random_value(rng, depth + 1))  # given back to the front
            elif r < 0.45:
                v.append(_random_value(rng, depth + 1))     # appended
            elif r < 0.55 and v:
                del v[rng.randrange(len(v))]                # removed from the middle
            elif r < 0.65:
                v.insert(rng.randrange(len(v) + 1), _random_value(rng, depth + 1))
            elif r < 0.7 and len(v) > 3:                    # window slides
                v = v[2:] + [_random_value(rng, depth + 1) for _ in range(2)]
            elif r < 0.75 and len(v) > 2:
                i, j = sorted(rng.sample(range(len(v)), 2))
                v[i], v[j] = v[j], v[i]
            elif v:
                i = rng.randrange(len(v))
                v[i] = _mutate(rng, v[i], depth + 1)
        return v
    if isinstance(v, dict):
        v = dict(v)
        for _ in range(rng.randrange(1, 3)):
            r = rng.random()
            if r < 0.2 or not v:
                v[rng.choice(["a", "x", 3, "k%d" % rng.randrange(30)])] = _random_value(rng, depth + 1)
            elif r < 0.35:
                del v[rng.choice(list(v))]
            else:
                k = rng.choice(list(v))
                v[k] = _mutate(rng, v[k], depth + 1)
        return v
    return _random_value(rng, depth) if rng.random() < 0.7 else tuple(_random_value(rng, 3) for _ in range(3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split_bytes", [16, 200])
def test_random_edits_round_trip(tmp_path, split_bytes):
    """Every edit, small or large, of lists and dicts at any depth, type changes and
    values crossing the split size, reloads exactly."""
    rng = random.Random(split_bytes)
    store = StateStore(str(tmp_path), split_bytes=split_bytes)
    state = {"root": _random_value(rng), "list": [_random_value(rng) for _ in range(50)]}
    for i in range(400):
        state = _mutate(rng, state)
        if not isinstance(state, dict):
            state = {"v": state}
        store.save(state)
        fresh = StateStore(str(tmp_path)).load() if i % 4 == 0 else load_state(str(tmp_path))
        assert fresh == norm(state), f"edit {i}"


@pytest.mark.timeout(60)
def test_list_positions_renumbered_when_a_gap_is_used_up(tmp_path):
    store = StateStore(str(tmp_path), split_bytes=8)
    v = [0, 10 ** 6]
    for i in range(80):  # always between the first two: halves the same gap each time
        v.insert(1, i + 1)
        store.save({"v": v})
    assert StateStore(str(tmp_path)).load() == {"v": v}


@pytest.mark.timeout(60)
def test_concurrent_saves_from_threads(tmp_path):
    store = StateStore(str(tmp_path), split_bytes=64)
    errors = []

    def saver(t):
        try:
            for i in range(40):
                store.save({"t": t, "i": i, "items": [t] * (i % 7) + list(range(i))})
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    last = {"done": True, "items": list(range(100))}
    store.save(last)
    assert StateStore(str(tmp_path)).load() == last


# -- writes proportional to the change ------------------------------------------------------
def _one_shard_change_bytes(tmp_path, shards: int) -> tuple[int, int, int, int]:
    """(WAL bytes of one GetShard save, rows written, JSON size of the state, members)."""
    sim = Sim(shards, seed=2)
    for _ in range(250):
        sim.step()
    store = StateStore(str(tmp_path / f"s{shards}"))
    store.save(sim.state())
    store.checkpoint()
    assert wal_size(store) == 0
    # what GetShard changes: the head of todo goes to doing; and the counters since
    sim.q.assign("worker-0")
    for m in sim.members:
        m["steps"] += 3
    state = sim.state()
    store.save(state)
    grown = wal_size(store)
    assert StateStore(str(tmp_path / f"s{shards}")).load() == norm(state)
    return grown, store.rows_written, len(json.dumps(state)), len(state["members"])


@pytest.mark.timeout(120)
def test_one_shard_change_writes_a_constant_amount(tmp_path):
    small, small_rows, _, _ = _one_shard_change_bytes(tmp_path, 1_000)
    big, big_rows, big_json, members = _one_shard_change_bytes(tmp_path, 10_000)
    page = 1024 + 24  # a WAL frame
    # a handful of pages, the same for 10x the shards (a B-tree may need one more level)
    assert big <= small + 2 * page, (small, big)
    assert big <= 12 * page, big
    assert big * 50 < big_json, (big, big_json)
    assert big_rows == small_rows == members + 3  # todo head, doing, members, global_step
    print(f"one-shard save: {big} WAL bytes ({big_rows} rows) vs {big_json} bytes of JSON")


@pytest.mark.timeout(60)
def test_event_window_slide_writes_two_rows(tmp_path):
    events = [{"kind": "k", "time": float(i), "id": f"worker-{i % 9}"} for i in range(200)]
    store = StateStore(str(tmp_path))
    store.save({"events": events})
    for i in range(200, 220):
        events = (events + [{"kind": "k", "time": float(i), "id": "worker-0"}])[-200:]
        store.save({"events": events})
        assert store.rows_written == 2  # the oldest out, the new one in
    store.save({"events": events})
    assert store.rows_written == 0  # nothing changed, nothing written
    assert load_state(str(tmp_path)) == {"events": events}


@pytest.mark.timeout(60)
def test_wal_is_truncated_periodically(tmp_path):
    store = StateStore(str(tmp_path), checkpoint_every=50)
    for i in range(49):
        store.save({"i": i, "pad": "x" * 5000})
    assert wal_size(store) > 0
    store.save({"i": 49, "pad": "x" * 5000})
    assert wal_size(store) == 0


# -- kill -9 --------------------------------------------------------------------------------
CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from test_state_store import Sim, norm
from aimaster.state import StateStore
shards, seed = int(sys.argv[4]), int(sys.argv[5])
store = StateStore(sys.argv[3], checkpoint_every=5)  # kills land in checkpoints too
sim = Sim(shards, seed)
loaded = store.load()
if loaded is not None:
    while sim.seq < loaded["seq"]:
        sim.step()
    assert norm(sim.state()) == loaded, "resumed state differs"
print("start", sim.seq, flush=True)
while True:
    sim.step()
    store.save(sim.state())
    print(sim.seq, flush=True)
"""


@pytest.mark.timeout(240)
def test_kill_9_loses_nothing_that_was_saved(tmp_path):
    """A child saves in a loop and prints each sequence number once save returned; it is
    killed with SIGKILL at a random moment, four times, each run resuming from what the
    previous one left: the state loaded is the one of a printed sequence number, at least
    the last printed one."""
    shards, seed = 3000, 7
    state_dir = tmp_path / "state"
    rng = random.Random(1234)
    last_loaded = 0
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "tests"), str(state_dir),
             str(shards), str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            first = proc.stdout.readline().split()
            assert first and first[0] == "start", (first, proc.stderr.read() if proc.poll() is not None else "")
            assert int(first[1]) == last_loaded
            saved = proc.stdout.readline()  # at least one save (a loaded machine is slow)
            time.sleep(rng.uniform(0.3, 1.5))  # a random moment: mid-save, mid-checkpoint...
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            printed = [int(line) for line in (saved + proc.stdout.read()).split()]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        assert printed, "the child saved nothing before the kill"
        loaded = StateStore(str(state_dir)).load()
        # save() returned for printed[-1]: durable. One more may have committed.
        assert printed[-1] <= loaded["seq"] <= printed[-1] + 1, (printed[-1], loaded["seq"])
        assert loaded == norm(sim_state_at(shards, seed, loaded["seq"]))
        last_loaded = loaded["seq"]


# -- damaged or foreign files ---------------------------------------------------------------
def _assert_clear(exc_info, path):
    msg = str(exc_info.value)
    assert str(path) in msg and "job state" in msg
    assert exc_info.value.__cause__ is None and exc_info.value.__suppress_context__


@pytest.mark.timeout(60)
def test_garbage_file_gives_a_clear_error(tmp_path):
    db = tmp_path / DB_NAME
    db.write_bytes(os.urandom(8192))
    with pytest.raises(StateStoreError) as e:
        StateStore(str(tmp_path)).load()
    _assert_clear(e, db)
    with pytest.raises(StateStoreError) as e:
        StateStore(str(tmp_path)).save({"a": 1})
    _assert_clear(e, db)
    with pytest.raises(StateStoreError) as e:
        load_state(str(tmp_path))
    _assert_clear(e, db)
    store = StateStore(str(tmp_path))  # what to do about it: set it aside, start over
    assert store.set_aside(".damaged") == str(db) + ".damaged"
    store.save({"a": 1})
    assert StateStore(str(tmp_path)).load() == {"a": 1}


@pytest.mark.timeout(60)
def test_damaged_database_gives_a_clear_error(tmp_path):
    store = StateStore(str(tmp_path))
    store.save(norm(Sim(2000).state()))
    store.close()
    db = tmp_path / DB_NAME
    data = bytearray(db.read_bytes())
    data[4096:len(data) - 4096] = os.urandom(len(data) - 8192)  # header intact, pages not
    db.write_bytes(bytes(data))
    with pytest.raises(StateStoreError) as e:
        StateStore(str(tmp_path)).load()
    _assert_clear(e, db)


@pytest.mark.timeout(60)
def test_foreign_or_unreadable_database(tmp_path):
    db = tmp_path / DB_NAME
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StateStoreError, match="not a job state database") as e:
        StateStore(str(tmp_path)).load()
    assert str(db) in str(e.value)
    if os.geteuid() != 0:  # root reads anything
        db.unlink()
        StateStore(str(tmp_path)).save({"a": 1})
        db.chmod(0)
        try:
            with pytest.raises(StateStoreError) as e:
                StateStore(str(tmp_path)).load()
            _assert_clear(e, db)
        finally:
            db.chmod(0o644)


# -- setting a run aside, older state dirs, readers ------------------------------------------
@pytest.mark.timeout(60)
def test_set_aside_keeps_the_old_state_and_starts_empty(tmp_path):
    store = StateStore(str(tmp_path))
    old = norm(Sim(500).state())
    store.save(old)
    assert store.set_aside(".interrupted") == store.path + ".interrupted"
    assert store.load() is None
    assert load_state(store.path + ".interrupted") == old
    new = {"phase": "starting"}
    store.save(new)
    assert StateStore(str(tmp_path)).load() == new
    assert store.set_aside(".x") and store.set_aside(".y") is None


@pytest.mark.timeout(60)
def test_renaming_the_file_after_load_is_safe(tmp_path):
    """What the AIMaster did with the JSON file: load, then os.replace(path, ...)."""
    store = StateStore(str(tmp_path))
    old = {"phase": "running", "shards": {"todo": list(range(3000))}}
    store.save(old)
    store.close()  # the AIMaster exits
    store = StateStore(str(tmp_path))  # a restarted AIMaster
    assert store.load() == old
    os.replace(store.path, store.path + ".interrupted")
    assert not os.path.exists(store.path + "-wal")  # load() left one self-contained file
    store.save({"phase": "starting"})
    assert StateStore(str(tmp_path)).load() == {"phase": "starting"}
    assert load_state(store.path + ".interrupted") == old


@pytest.mark.timeout(60)
def test_state_dir_of_the_json_version_is_imported(tmp_path):
    legacy = {"phase": "running", "epoch": 3, "shards": {"todo": [1, 2], "doing": {"5": "worker-0"}}}
    (tmp_path / "job_state.json").write_text(json.dumps(legacy))
    assert load_state(str(tmp_path)) == legacy  # read-only: not imported
    assert (tmp_path / "job_state.json").exists()
    store = StateStore(str(tmp_path))
    assert store.load() == legacy
    assert not (tmp_path / "job_state.json").exists()
    assert (tmp_path / "job_state.json.imported").exists()
    assert StateStore(str(tmp_path)).load() == legacy


@pytest.mark.timeout(60)
def test_reader_sees_a_consistent_state_while_the_owner_writes(tmp_path):
    store = StateStore(str(tmp_path))
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            store.save({"i": i, "copy": [i] * 300, "tail": {"i": i}})

    th = threading.Thread(target=writer)
    th.start()
    try:
        deadline = time.time() + 2
        seen = 0
        while time.time() < deadline:
            s = load_state(str(tmp_path))
            if s is not None:
                assert s["copy"] == [s["i"]] * 300 and s["tail"]["i"] == s["i"]
                seen += 1
    finally:
        stop.set()
        th.join(30)
    assert seen > 5


@pytest.mark.timeout(60)
def test_cli_prints_the_state_as_json(tmp_path):
    StateStore(str(tmp_path)).save({"phase": "succeeded", "final_checkpoint": "/c/ckpt-3"})
    out = subprocess.run([sys.executable, "-m", "aimaster.state", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"phase": "succeeded", "final_checkpoint": "/c/ckpt-3"}
    out = subprocess.run([sys.executable, "-m", "aimaster.state", str(tmp_path / "none")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no job state" in out.stderr


def test_aimaster_run_on_a_damaged_state_dir_names_the_file(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / DB_NAME).write_bytes(b"this is not a database" * 100)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "damaged", "ps": {"replicas": 1},
                               "master": {"state_dir": str(state)}}))
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "aimaster.cli", "run", str(job), "--workers", "0"],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode != 0
    assert str(state / DB_NAME) in out.stderr and "Traceback" not in out.stderr, out.stderr
