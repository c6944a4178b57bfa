"""The control plane's parts: the operation runner's order and pre-emption, the PS fleet's
epochs and channels, and the races they close (a double publish, checkpoint cuts keyed by
process incarnation, a checkpoint pre-empted by a recovery). The PS are real gRPC servers
(the PS servicer in this process, on free loopback ports); the AIMaster is a JobMaster
in-process, with a scaler that starts nothing (the test plays the PS's registrations)."""
from __future__ import annotations

import json
import os
import threading
import time

import grpc
import numpy as np
import pytest

from aimaster.config import load_job
from checkpoint.format import MANIFEST_NAME
from aimaster.errors import Busy, NotRunning, Preempted
from aimaster.fleet import PsFleet
from aimaster.master import JobMaster, JobPhase
from aimaster.operations import OperationRunner, OpKind
from aimaster.registry import Registry
from aimaster.scaler import NodeInfo, ScalePlan, ScaleResult, Scaler
from deeprec_ext import errors as wire
from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.grpc_util import create_server
from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import ps_pb2_grpc
from deeprec_ext.ps.server import ParameterServerServicer


# -- the operation runner ----------------------------------------------------------------
def _blocker():
    started, release = threading.Event(), threading.Event()

    def fn(cancel):
        started.set()
        release.wait(10)
        return "blocker"
    return fn, started, release


def test_runner_order_recover_first_then_checkpoint_then_rescale():
    runner = OperationRunner()
    order = []
    fn, started, release = _blocker()
    first = runner.submit(OpKind.RESCALE, fn, key="first")
    assert started.wait(5)
    futs = [runner.submit(OpKind.RESCALE, lambda c: order.append("rescale"), key="rescale"),
            runner.submit(OpKind.CHECKPOINT, lambda c: order.append("checkpoint")),
            runner.submit(OpKind.RECOVER, lambda c: order.append("recover-a"), key="recover-a"),
            runner.submit(OpKind.RECOVER, lambda c: order.append("recover-b"), key="recover-b")]
    assert runner.pending() == ["recover-a", "recover-b", "checkpoint", "rescale"]
    release.set()
    for f in [first, *futs]:
        f.result(5)
    assert order == ["recover-a", "recover-b", "checkpoint", "rescale"]
    assert runner.close(5)


def test_runner_refuses_a_duplicate_and_a_closed_runner():
    runner = OperationRunner()
    fn, started, release = _blocker()
    runner.submit(OpKind.CHECKPOINT, fn)
    assert started.wait(5)
    with pytest.raises(Busy, match="another checkpoint is in progress"):
        runner.submit(OpKind.CHECKPOINT, lambda c: None)
    queued = runner.submit(OpKind.RESCALE, lambda c: None)
    with pytest.raises(Busy, match="another scale event is queued"):
        runner.submit(OpKind.RESCALE, lambda c: None)
    release.set()
    queued.result(5)
    assert runner.close(5)
    with pytest.raises(NotRunning):
        runner.submit(OpKind.RESCALE, lambda c: None)


def test_recovery_preempts_a_running_checkpoint():
    runner = OperationRunner()
    seen = threading.Event()

    def checkpoint(cancel):
        seen.set()
        if cancel.wait(10):
            raise Preempted("pre-empted")
        return "committed"
    ckpt = runner.submit(OpKind.CHECKPOINT, checkpoint)
    assert seen.wait(5)
    t0 = time.monotonic()
    rec = runner.submit(OpKind.RECOVER, lambda c: "recovered", key="recover-ps-1")
    assert rec.result(5) == "recovered"
    with pytest.raises(Preempted):
        ckpt.result(0)
    assert time.monotonic() - t0 < 2
    assert runner.close(5)


def test_close_cancels_pending_and_asks_the_running_one_to_stop():
    runner = OperationRunner()
    seen = threading.Event()

    def long_op(cancel):
        seen.set()
        cancel.wait(30)
        return "stopped"
    running = runner.submit(OpKind.RESCALE, long_op)
    assert seen.wait(5)
    pending = runner.submit(OpKind.CHECKPOINT, lambda c: "never")
    t0 = time.monotonic()
    assert runner.close(5)
    assert time.monotonic() - t0 < 2
    assert pending.cancelled() and running.result(0) == "stopped"


# -- real PS servers in this process ------------------------------------------------------
class _PS:
    def __init__(self, ps_id: str, servicer_cls=ParameterServerServicer):
        self.servicer = servicer_cls(ps_id)
        self.server, port = create_server("127.0.0.1:0")
        ps_pb2_grpc.add_ParameterServerServicer_to_server(self.servicer, self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def stop(self):
        self.server.stop(0).wait()
        self.servicer.close()


@pytest.fixture
def two_ps():
    servers = [_PS("ps-0"), _PS("ps-1")]
    yield servers
    for s in servers:
        s.stop()


def test_fleet_epochs_only_go_forward(two_ps):
    fleet = PsFleet()
    a, b = (s.address for s in two_ps)
    owner = np.array([0, 1] * 8, np.int32)
    routing = RoutingTable(fleet.next_epoch(), 16, ("ps-0", "ps-1"), (a, b), owner)
    assert fleet.publish(routing, lambda ps_id: True) == []
    assert two_ps[0].servicer.routing.epoch == 1
    # a push that is not newer is refused by the PS, with its kind; the layout stays
    with pytest.raises(grpc.RpcError) as info:
        fleet.fence(a, 1, 16, np.zeros(16, bool))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert wire.kind_of(info.value) == wire.ErrorKind.STALE_EPOCH
    assert two_ps[0].servicer.routing.owned.sum() == 8
    # epochs handed out later are above every one pushed or seen
    fleet2 = PsFleet()
    assert fleet2.learn_epochs([a, b]) == 1 and fleet2.next_epoch() == 2
    fleet.fence(a, fleet.next_epoch(), 16, np.zeros(16, bool))
    assert two_ps[0].servicer.routing.epoch == 2 and two_ps[0].servicer.routing.owned.sum() == 0
    fleet.close()
    fleet2.close()


def test_fleet_publishes_to_every_ps_at_once_and_reports_a_refusal_after_all_ended(two_ps):
    """The routing goes to all PS together (a recovery waited one round trip per PS): a PS
    that refuses it (here: it already holds a newer epoch) fails the publish, but only
    once the others have it, and a PS that died meanwhile is skipped, not an error."""
    fleet = PsFleet()
    a, b = (s.address for s in two_ps)
    owner = np.array([0, 1] * 8, np.int32)
    fleet.fence(a, 5, 16, np.zeros(16, bool))  # ps-0 is ahead: it refuses epoch 2
    routing = RoutingTable(2, 16, ("ps-0", "ps-1"), (a, b), owner)
    with pytest.raises(grpc.RpcError) as info:
        fleet.publish(routing, lambda ps_id: True)
    assert wire.kind_of(info.value) == wire.ErrorKind.STALE_EPOCH
    assert two_ps[1].servicer.routing.epoch == 2 and two_ps[1].servicer.routing.owned.sum() == 8
    assert two_ps[0].servicer.routing.epoch == 5
    # ps-0 died (as its refusal is examined): skipped, ps-1 gets the next epoch
    routing = RoutingTable(6, 16, ("ps-0", "ps-1"), (a, b), owner)
    assert fleet.publish(routing, lambda ps_id: ps_id != "ps-0") == ["ps-0"]
    assert two_ps[1].servicer.routing.epoch == 6
    fleet.close()


def test_fleet_caches_one_channel_per_ps_and_closes_those_that_left(two_ps):
    fleet = PsFleet()
    a, b = (s.address for s in two_ps)
    for _ in range(50):
        fleet.stats(a)
        fleet.stats(b)
    assert fleet.open_channels() == 2
    fleet.retain([a])
    assert fleet.open_channels() == 1
    fleet.close()
    assert fleet.open_channels() == 0


class _NoScaler(Scaler):
    """Starts nothing: the test registers the PS itself."""

    def apply(self, plan: ScalePlan) -> ScaleResult:
        return ScaleResult()

    def leavers(self, role, count):
        return []

    def nodes(self) -> list[NodeInfo]:
        return []

    def poll_exits(self) -> list[NodeInfo]:
        return []

    def restart(self, node_id):
        raise NotImplementedError

    def kill(self, node_id, sig=9):
        pass

    def shutdown(self, timeout=10.0):
        pass


def _master(tmp_path, ps: int = 2) -> JobMaster:
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "ops", "ps": {"replicas": ps},
                               "master": {"state_dir": str(tmp_path / "state")}}))
    cfg = load_job(str(job))
    m = JobMaster(cfg, scaler_factory=lambda address, c: _NoScaler())
    m.start()
    return m


def _running_master(tmp_path, servers, incarnation: str = "i") -> JobMaster:
    """A master whose PS (in-process servers) registered and got the first routing."""
    master = _master(tmp_path, ps=len(servers))
    for i, s in enumerate(servers):
        master.registry.register("ps", f"ps-{i}", 1, s.address, f"{incarnation}-{i}")
    master.on_ps_registered()
    deadline = time.monotonic() + 20
    while master.phase != JobPhase.RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert master.phase == JobPhase.RUNNING
    return master


def test_ps_registering_together_publish_the_routing_once(tmp_path, two_ps):
    master = _master(tmp_path)
    try:
        for i, s in enumerate(two_ps):  # both registered before either triggers a publish
            master.registry.register("ps", f"ps-{i}", 1, s.address, f"inc-{i}")
        gate = threading.Barrier(8)

        def trigger():
            gate.wait()
            master.on_ps_registered()
        threads = [threading.Thread(target=trigger) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        deadline = time.monotonic() + 20
        while master.phase != JobPhase.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while not master.ops.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert master.phase == JobPhase.RUNNING
        published = [e for e in master.events if e["kind"] == "routing"]
        assert len(published) == 1, published
        assert [s.servicer.routing.epoch for s in two_ps] == [master.epoch, master.epoch]
    finally:
        master.stop()
        master.shutdown()


def test_a_new_process_under_the_same_id_and_pid_is_a_new_incarnation():
    reg = Registry(10.0, time.monotonic)
    first = reg.register("ps", "ps-0", 1, "10.0.0.1:5000", "aaa")
    again = reg.register("ps", "ps-0", 1, "10.0.0.1:5000", "aaa")  # the same process
    replaced = reg.register("ps", "ps-0", 1, "10.0.0.2:5000", "bbb")  # a new one, pid 1 too
    assert JobMaster._cut_key(first) == JobMaster._cut_key(again)
    assert JobMaster._cut_key(replaced) != JobMaster._cut_key(first)
    # an old member without an incarnation: a new pid is a new process, as before
    legacy = reg.register("worker", "worker-0", 7, "", "")
    assert reg.register("worker", "worker-0", 7, "", "").incarnation == legacy.incarnation
    assert reg.register("worker", "worker-0", 8, "", "").incarnation != legacy.incarnation


def test_incremental_after_a_replacement_under_the_same_pid_holds_every_row(tmp_path, two_ps):
    """The bug: cuts keyed by ``ps_id@pid`` gave the replacement (same id, same pid 1 in
    a container) the old process's cut, so its first incremental skipped its rows."""
    from checkpoint import load
    from deeprec_ext import PSClient
    master = _running_master(tmp_path, two_ps, "first")
    try:
        client = PSClient.connect(master.address, timeout=30)
        client.create_table("t", 2, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
        ids = np.arange(2000, dtype=np.int64)
        client.push("t", ids, -np.ones((ids.size, 2), np.float32))
        master.checkpoint(full=True)
        client.push("t", ids, -np.ones((ids.size, 2), np.float32))
        # ps-1 is replaced by a new process: same id, same pid, an empty store that is
        # then filled (as promotion + migration would) by writes of its own
        old = two_ps[1]
        old.stop()
        fresh = _PS("ps-1")
        two_ps[1] = fresh
        master.registry.register("ps", "ps-1", 1, fresh.address, "second-1")
        routing = master.routing
        master.routing = RoutingTable(master.fleet.next_epoch(), routing.num_slots, routing.ps_ids,
                                      (routing.ps_addresses[0], fresh.address), routing.slot_owner)
        master._push_routing(master.routing)
        client.refresh_routing()
        client.create_table("t", 2, initializer="zeros",  # the new process's (empty) table
                            optimizer={"name": "sgd", "learning_rate": 1.0})
        client.push("t", ids, -2 * np.ones((ids.size, 2), np.float32))  # new rows on ps-1: 2
        event = master.checkpoint()
        assert event["type"] == "incr"
        tables = load(event["path"]).tables
        got = dict(zip(tables["t"].ids.tolist(), tables["t"].values[:, 0].tolist()))
        on_fresh = ids[master.routing.slot_owner[slot_of(ids, routing.num_slots)] == 1]
        assert on_fresh.size > 0
        missing = [k for k in on_fresh.tolist() if got.get(k) != 2.0]
        assert not missing, f"{len(missing)} rows of the replacement are not in the incremental"
        client.close()
    finally:
        master.stop()
        master.shutdown()


class _SlowCheckpointPS(ParameterServerServicer):
    """A PS whose checkpoint writes take long (a big table), to pre-empt one."""

    def WriteCheckpoint(self, request, context):
        deadline = time.monotonic() + 20
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().WriteCheckpoint(request, context)


def test_recovery_preempts_a_checkpoint_and_nothing_is_committed(tmp_path):
    servers = [_PS("ps-0", _SlowCheckpointPS), _PS("ps-1", _SlowCheckpointPS)]
    master = _running_master(tmp_path, servers, "i")
    try:
        result = {}

        def take():
            try:
                result["event"] = master.checkpoint(full=True)
            except Exception as exc:  # noqa: BLE001 - inspected below
                result["error"] = exc
        t = threading.Thread(target=take)
        t.start()
        deadline = time.monotonic() + 10
        while master.ops.running() != "checkpoint" and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        ran = threading.Event()
        master.ops.submit(OpKind.RECOVER, lambda cancel: ran.set(), key="recover-test")
        t.join(10)
        assert ran.wait(5) and time.monotonic() - t0 < 5
        assert isinstance(result.get("error"), Preempted), result
        ckpt_dir = master.checkpoint_dir
        committed = [d for d in os.listdir(ckpt_dir)] if os.path.isdir(ckpt_dir) else []
        assert not any(os.path.exists(os.path.join(ckpt_dir, d, MANIFEST_NAME))
                       for d in committed), committed
        assert any(e["kind"] == "checkpoint_preempted" for e in master.events)
    finally:
        master.stop()
        master.shutdown()
        for s in servers:
            s.stop()


def test_the_event_log_stays_bounded(tmp_path):
    from aimaster.master import MAX_EVENTS
    master = _master(tmp_path)
    try:
        for i in range(3 * MAX_EVENTS):
            master.record_event("tick", i=i)
        assert len(master.events) == MAX_EVENTS and master.events[-1]["i"] == 3 * MAX_EVENTS - 1
        assert len(master.status().events_json) == 100
    finally:
        master.stop()
        master.shutdown()


class _NoIncrementalPS(ParameterServerServicer):
    """A PS whose deletion log no longer reaches back to the previous checkpoint (more
    deletions than it keeps since then): it refuses an incremental, as the real one does."""

    def WriteCheckpoint(self, request, context):
        if request.kind == "incr":
            wire.abort(context, grpc.StatusCode.FAILED_PRECONDITION, wire.ErrorKind.NEEDS_FULL,
                       "checkpoint: an incremental is impossible, take a full one")
        return super().WriteCheckpoint(request, context)


def test_an_incremental_a_ps_cannot_cut_is_taken_as_a_full_one(tmp_path):
    servers = [_PS("ps-0"), _PS("ps-1", _NoIncrementalPS)]
    master = _running_master(tmp_path, servers, "i")
    try:
        assert master.checkpoint()["type"] == "full"  # the first of a chain
        event = master.checkpoint()
        assert event["type"] == "full", event
        assert any(e["kind"] == "checkpoint_needs_full" for e in master.events)
        assert os.path.exists(os.path.join(event["path"], MANIFEST_NAME))
    finally:
        master.stop()
        master.shutdown()
        for s in servers:
            s.stop()


class _TimedCheckpointPS(ParameterServerServicer):
    """A PS that notes when each of its checkpoint writes returned."""

    def __init__(self, ps_id):
        super().__init__(ps_id)
        self.returned = []

    def WriteCheckpoint(self, request, context):
        try:
            return super().WriteCheckpoint(request, context)
        finally:
            self.returned.append(time.monotonic())


def test_checkpoint_commits_as_soon_as_the_ps_writes_end(tmp_path, monkeypatch):
    """The master waits for the PS's writes on their completion, not on a poll: it polled
    every 50 ms, 25 ms on average (a third of a 4M-row incremental) between the last
    write and the commit."""
    import checkpoint
    commits = []

    class Writer(checkpoint.CheckpointWriter):  # the real writer, timed as it is opened
        def __init__(self, *a, **k):  # (by each PS, then by the master to commit)
            commits.append(time.monotonic())
            super().__init__(*a, **k)

    monkeypatch.setattr(checkpoint, "CheckpointWriter", Writer)
    servers = [_PS("ps-0", _TimedCheckpointPS), _PS("ps-1", _TimedCheckpointPS)]
    master = _running_master(tmp_path, servers, "i")
    try:
        gaps = []
        for _ in range(9):
            commits.clear()
            master.checkpoint()
            last = max(s.servicer.returned[-1] for s in servers)
            gaps.append(commits[-1] - last)
        gaps.sort()
        assert gaps[4] < 0.012, gaps  # with the poll: uniform over 0-50 ms
    finally:
        master.stop()
        master.shutdown()
        for s in servers:
            s.stop()


class _FailingFleet(PsFleet):
    """A real fleet whose N-th migration round fails (a source or destination lost)."""

    def __init__(self, fail_round: int):
        super().__init__()
        self.fail_round, self.rounds = fail_round, 0

    def migrate_slots(self, *args, **kwargs):
        self.rounds += 1
        if self.rounds == self.fail_round:
            raise RuntimeError("injected: the destination went away")
        return super().migrate_slots(*args, **kwargs)


def _two_ps_with_table(fleet, two_ps):
    """Both PS at one published epoch, table ``t`` (dim 2, sgd lr 1) on each; 16 slots
    alternating between them. Returns the addresses, the slot count, the owner array,
    the routing and the keys ps-0 owns (1..20000)."""
    from deeprec_ext.proto import ps_pb2
    (a, b), n = (s.address for s in two_ps), 16
    owner = np.array([0, 1] * 8, np.int32)
    old = RoutingTable(fleet.next_epoch(), n, ("ps-0", "ps-1"), (a, b), owner)
    assert fleet.publish(old, lambda ps_id: True) == []
    for ps in (a, b):
        fleet.stub(ps).CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="t", dim=2, initializer_json='{"name": "zeros"}',
            optimizer_json='{"name": "sgd", "learning_rate": 1.0}')), timeout=10)
    keys = np.arange(1, 20001, dtype=np.int64)
    keys = keys[owner[slot_of(keys, n)] == 0]  # ps-0's rows
    return a, b, n, owner, old, keys


@pytest.mark.parametrize("fail_at", ["catch-up", "publish"])
def test_a_failed_migration_leaves_no_copied_rows_on_its_destination(two_ps, fail_at):
    """Rows a failed migration copied to its destination belong to slots it never owned.
    Left there, a later move of those slots to it, or a promotion of them onto it, would
    serve them again -- also the copy of a key the owner deleted meanwhile. Before the
    fence (a round fails) and after it (the publish fails, the old layout is restored),
    the destination drops them; the source keeps every row."""
    from aimaster.migration import MigrationError, migrate
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2
    fleet = _FailingFleet(fail_round=2 if fail_at == "catch-up" else 0)
    a, b, n, owner, old, keys = _two_ps_with_table(fleet, two_ps)
    fleet.stub(a).Push(ps_pb2.PushRequest(epoch=old.epoch, tables=[ps_pb2.TableUpdate(
        table="t", ids=codec.ids_to_bytes(keys),
        values=codec.floats_to_bytes(-np.ones((keys.size, 2), np.float32)))]), timeout=30)
    new_owner = owner.copy()
    new_owner[[0, 2, 4]] = 1  # three of ps-0's slots move to ps-1
    published = []

    def publish(routing):
        published.append(routing.epoch)
        if fail_at == "publish" and len(published) == 1:
            raise RuntimeError("injected: the hand-over failed")
        assert fleet.publish(routing, lambda ps_id: True) == []

    with pytest.raises(MigrationError, match="injected"):
        migrate(fleet, old, new_owner, ["ps-0", "ps-1"], [a, b], publish)
    src, dst = (s.servicer for s in two_ps)
    moving = np.isin(slot_of(keys, n), [0, 2, 4])
    assert moving.sum() > 1000
    assert dst.store.get("t").size == 0, "rows copied by the failed migration stayed"
    assert src.store.get("t").size == keys.size
    np.testing.assert_array_equal(src.store.get("t").lookup(keys, insert_missing=False), 1.0)
    if fail_at == "publish":  # the old layout again, at a newer epoch, on both PS
        assert dst.routing.epoch == src.routing.epoch == published[-1] > old.epoch
        assert dst.routing.owned.sum() == 8 and not dst.routing.owned[[0, 2, 4]].any()
    fleet.close()


class _FailingPrepareFleet(PsFleet):
    """A real fleet whose wait for a prepared copy fails (the future peer unreachable,
    as the PS answers it: UNAVAILABLE after 3 failed tries)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def prepare_replica(self, address, ps_id, peer, wait, owned_after=None):
        self.calls.append((ps_id, peer, wait))
        if peer and wait > 0:
            raise RuntimeError("injected: the copy on the new peer failed 3 times in a row")
        return super().prepare_replica(address, ps_id, peer, wait, owned_after)


def _scale_in_of_three(fleet):
    """Three in-process PS holding 30,000 rows (-1 pushed once, so 1.0 each), and the
    layout of a scale-in 3 -> 2 that gives ps-2's slots to ps-0 and ps-1."""
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2
    servers = [_PS(f"ps-{i}") for i in range(3)]
    addrs, n = [s.address for s in servers], 12
    owner = np.array([0, 1, 2] * 4, np.int32)
    old = RoutingTable(fleet.next_epoch(), n, ("ps-0", "ps-1", "ps-2"), tuple(addrs), owner)
    assert fleet.publish(old, lambda ps_id: True) == []
    for a in addrs:
        fleet.stub(a).CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
            name="t", dim=2, initializer_json='{"name": "zeros"}',
            optimizer_json='{"name": "sgd", "learning_rate": 1.0}')), timeout=10)
    keys = np.arange(1, 30001, dtype=np.int64)
    by_ps = owner[slot_of(keys, n)]
    for p, a in enumerate(addrs):
        fleet.stub(a).Push(ps_pb2.PushRequest(epoch=old.epoch, tables=[ps_pb2.TableUpdate(
            table="t", ids=codec.ids_to_bytes(keys[by_ps == p]),
            values=codec.floats_to_bytes(-np.ones((int((by_ps == p).sum()), 2),
                                                  np.float32)))]), timeout=30)
    new_owner = np.where(owner == 2, np.arange(n) % 2, owner).astype(np.int32)
    return servers, addrs, old, new_owner, keys, by_ps


@pytest.fixture
def three_ps():
    """``_scale_in_of_three`` on a given fleet; the fleet and the PS are closed after."""
    made = []

    def make(fleet):
        out = _scale_in_of_three(fleet)
        made.append((fleet, out[0]))
        return out
    yield make
    for fleet, servers in made:
        fleet.close()
        for s in servers:
            s.stop()


def _nothing_changed_hands(servers, old, keys, by_ps) -> None:
    for p, s in enumerate(servers):
        assert s.servicer.routing.epoch == old.epoch  # never fenced
        assert s.servicer.replicator.next_peer()[0] == ""  # prepared copies dropped
        t = s.servicer.store.get("t")
        assert t.size == int((by_ps == p).sum()), (p, t.size)  # copied rows dropped
        np.testing.assert_array_equal(t.lookup(keys[by_ps == p], insert_missing=False), 1.0)


def test_a_copy_on_a_new_ring_peer_that_cannot_be_made_calls_the_scale_in_off(three_ps):
    """Scale-in 3 -> 2: ps-1's ring peer would change from the leaving ps-2 to ps-0, so
    ps-1 prepares a copy on ps-0 as the migration starts. When that copy cannot be
    completed the migration fails before its fence: no PS changed epoch, the rows copied
    to the destinations are dropped, the prepared copy is dropped, every row stays."""
    from aimaster.migration import MigrationError, migrate
    fleet = _FailingPrepareFleet()
    servers, addrs, old, new_owner, keys, by_ps = three_ps(fleet)
    with pytest.raises(MigrationError, match="3 times in a row"):
        migrate(fleet, old, new_owner, ["ps-0", "ps-1"], addrs[:2],
                lambda routing: fleet.publish(routing, lambda ps_id: True))
    assert ("ps-1", addrs[0], 0.0) in fleet.calls  # started with the migration...
    assert ("ps-1", "", 0.0) in fleet.calls        # ...and called off
    _nothing_changed_hands(servers, old, keys, by_ps)


class _SlowPrepareFleet(PsFleet):
    """A real fleet whose prepared copies never report complete (a copy of a large PS
    still streaming), and which notes each wait it asked for."""

    def __init__(self):
        super().__init__()
        self.waits = []

    def prepare_replica(self, address, ps_id, peer, wait, owned_after=None):
        r = super().prepare_replica(address, ps_id, peer, wait, owned_after)
        if peer and wait > 0:
            self.waits.append(wait)
            return type(r)(complete=False, sequence=-1)
        return r


def test_a_stopping_aimaster_calls_a_migration_off_while_it_waits_for_a_copy(three_ps):
    """SIGTERM to the AIMaster while a scale-in waits for a copy on a new ring peer: the
    wait is asked for in pieces, so the migration sees the AIMaster stopping within one
    piece and calls the scale-in off before its fence, rolled back while the PS still
    answer: no epoch changed, copied rows and the prepared copy dropped, every row kept.
    It used to wait on (an hour's wait in one call) until the PS were stopped under it."""
    from aimaster import migration
    fleet = _SlowPrepareFleet()
    servers, addrs, old, new_owner, keys, by_ps = three_ps(fleet)
    stop_at = []

    def stopping():
        if len(fleet.waits) >= 2 and not stop_at:
            stop_at.append(time.monotonic())
        return bool(stop_at)
    t0 = time.monotonic()
    with pytest.raises(migration.MigrationError, match="called off: the AIMaster is stopping"):
        migration.migrate(fleet, old, new_owner, ["ps-0", "ps-1"], addrs[:2],
                          lambda routing: fleet.publish(routing, lambda ps_id: True),
                          stopping=stopping)
    assert fleet.waits and max(fleet.waits) <= migration.PREPARE_POLL_SECONDS
    assert time.monotonic() - t0 < 30
    _nothing_changed_hands(servers, old, keys, by_ps)


def test_a_last_round_with_the_fence_moves_every_row_and_refuses_bad_fences(two_ps):
    """The last round carries its source's fence (one call instead of two): the source
    refuses writes to the moved slots from then on and the destination holds every row of
    them with its value; the same fence again (another destination's last round) is
    accepted. Bad fences are refused with a message naming the problem, nothing fenced,
    and the PS keeps serving: a wrong-sized mask, a fence outside the last round, a mask
    keeping a moving slot, an older epoch, another layout at the same epoch."""
    from deeprec_ext import codec
    from deeprec_ext.proto import ps_pb2
    fleet = PsFleet()
    a, b, n, owner, old, keys = _two_ps_with_table(fleet, two_ps)

    def push(ids, epoch):
        fleet.stub(a).Push(ps_pb2.PushRequest(epoch=epoch, tables=[ps_pb2.TableUpdate(
            table="t", ids=codec.ids_to_bytes(ids),
            values=codec.floats_to_bytes(-np.ones((ids.size, 2), np.float32)))]), timeout=30)
    push(keys, old.epoch)
    moving = np.zeros(n, bool)
    moving[[0, 2, 4]] = True
    keeps = (owner == 0) & ~moving
    src, dst = (s.servicer for s in two_ps)
    snap = fleet.migrate_slots(a, b, moving, n, -1, send_request_ids=False)
    push(keys[~np.isin(slot_of(keys, n), [0, 2, 4])], old.epoch)  # rows that stay
    moved = keys[np.isin(slot_of(keys, n), [0, 2, 4])]
    push(moved[:500], old.epoch)  # written after the snapshot: the last round carries them
    bad = [(dict(fence_owned=np.ones(n - 1, bool)), grpc.StatusCode.INVALID_ARGUMENT, "fence_owned"),
           (dict(send_request_ids=False, fence_owned=keeps), grpc.StatusCode.INVALID_ARGUMENT,
            "last round"),
           (dict(fence_owned=keeps | moving), grpc.StatusCode.INVALID_ARGUMENT, "moves away"),
           (dict(fence_owned=keeps, fence_epoch=old.epoch), grpc.StatusCode.FAILED_PRECONDITION,
            "not newer")]
    for kw, code, words in bad:
        args = dict(send_request_ids=True, fence_epoch=old.epoch + 1) | kw
        with pytest.raises(grpc.RpcError) as info:
            fleet.migrate_slots(a, b, moving, n, snap.watermark, **args)
        assert info.value.code() == code and words in info.value.details(), info.value.details()
        assert src.routing.epoch == old.epoch and src.routing.owned.sum() == 8  # not fenced
    push(moved[:10], old.epoch)  # still serving, the moving slots too
    last = fleet.migrate_slots(a, b, moving, n, snap.watermark, send_request_ids=True,
                               fence_epoch=old.epoch + 1, fence_owned=keeps)
    assert last.rows >= 500
    assert src.routing.epoch == old.epoch + 1 and not src.routing.owned[moving].any()
    with pytest.raises(grpc.RpcError) as info:  # writes to the moved slots: stale routing
        push(moved[:1], old.epoch + 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale routing" in info.value.details()
    push(keys[~np.isin(slot_of(keys, n), [0, 2, 4])][:10], old.epoch + 1)  # kept slots serve
    # the same fence again (the last round to another destination): accepted, no change
    again = fleet.migrate_slots(a, b, moving, n, last.watermark, send_request_ids=True,
                                fence_epoch=old.epoch + 1, fence_owned=keeps)
    assert again.rows == 0 and src.routing.epoch == old.epoch + 1
    with pytest.raises(grpc.RpcError) as info:  # another layout at that epoch: refused
        fleet.migrate_slots(a, b, moving, n, last.watermark, send_request_ids=True,
                            fence_epoch=old.epoch + 1, fence_owned=keeps & (np.arange(n) > 8))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # every moved row arrived with its value: 2 pushes of -1 (lr 1) for the first 500 and
    # the first 10 of them 3, 1 for the rest
    want = np.ones(moved.size, np.float32)
    want[:500] += 1
    want[:10] += 1
    got = dst.store.get("t").lookup(moved, insert_missing=False)
    np.testing.assert_array_equal(got[:, 0], want)
    assert dst.store.get("t").size == moved.size
    fleet.close()


def test_get_routing_long_poll_answers_when_the_epoch_is_published(tmp_path, two_ps):
    """A client that lost a PS asks for an epoch above its own and is answered the moment
    the new routing is published, not at its next poll; a poll with no new epoch ends at
    the cap; beyond the AIMaster's few waiting places a call is answered at once."""
    from aimaster.master import ROUTING_WAITERS
    from deeprec_ext.client.client import PSClient
    from deeprec_ext.proto import master_pb2, master_pb2_grpc

    master = _running_master(tmp_path, two_ps)
    channel = grpc.insecure_channel(master.address)
    stub = master_pb2_grpc.MasterStub(channel)
    try:
        old = master.routing
        # already above: at once
        t = time.monotonic()
        r = stub.GetRouting(master_pb2.GetRoutingRequest(after_epoch=old.epoch - 1, wait_ms=5000),
                            timeout=10)
        assert r.epoch == old.epoch and time.monotonic() - t < 0.2
        # nothing published: the wait ends at the cap (250 ms), with the current routing
        t = time.monotonic()
        r = stub.GetRouting(master_pb2.GetRoutingRequest(after_epoch=old.epoch, wait_ms=60_000),
                            timeout=10)
        took = time.monotonic() - t
        assert r.epoch == old.epoch and 0.2 <= took < 2.0, took

        def publish_later(epoch, after):
            time.sleep(after)
            master.routing = RoutingTable(epoch, old.num_slots, old.ps_ids, old.ps_addresses,
                                          old.slot_owner)
            return time.monotonic()

        # a raw long poll returns right after the publish
        answers = {}

        def ask(k):
            answers[k] = stub.GetRouting(master_pb2.GetRoutingRequest(
                after_epoch=old.epoch, wait_ms=250), timeout=10).epoch, time.monotonic()
        # more askers than waiting places: the extra ones are answered at once, old epoch
        askers = [threading.Thread(target=ask, args=(k,)) for k in range(ROUTING_WAITERS + 2)]
        for a in askers:
            a.start()
        published = publish_later(old.epoch + 1, 0.1)
        for a in askers:
            a.join(10)
        late = sorted(at - published for epoch, at in answers.values() if epoch == old.epoch + 1)
        early = [epoch for epoch, at in answers.values() if epoch == old.epoch]
        assert len(answers) == ROUTING_WAITERS + 2
        assert len(late) == ROUTING_WAITERS and len(early) == 2, answers
        assert max(late) < 0.1, late  # answered when published, not at the cap

        # the PS client's wait after an unreachable PS returns the published routing
        client = PSClient.connect(master.address, timeout=10)
        try:
            assert client.routing.epoch == old.epoch + 1
            publisher = threading.Thread(target=publish_later, args=(old.epoch + 2, 0.05))
            publisher.start()
            t = time.monotonic()
            routing = client._await_new_epoch(2.0)
            took = time.monotonic() - t
            publisher.join(5)
            assert routing is not None and routing.epoch == old.epoch + 2
            assert took < 0.2, took
            # bad input: a negative wait is an ordinary immediate answer
            r = stub.GetRouting(master_pb2.GetRoutingRequest(after_epoch=10**12, wait_ms=-5),
                                timeout=10)
            assert r.epoch == old.epoch + 2
        finally:
            client.close()
    finally:
        channel.close()
        master.stop()
        master.shutdown()


class _LaggingCopyFleet(PsFleet):
    """A real fleet whose prepared copies report complete but behind their PS (deltas
    still streaming) for the first ``lag_calls`` waits, or for ever (``None``)."""

    def __init__(self, lag_calls):
        super().__init__()
        self.lag_calls, self.waits = lag_calls, 0

    def prepare_replica(self, address, ps_id, peer, wait, owned_after=None):
        r = super().prepare_replica(address, ps_id, peer, wait, owned_after)
        if peer and wait > 0:
            self.waits += 1
        if peer and (self.lag_calls is None or (wait > 0 and self.waits <= self.lag_calls)):
            return type(r)(complete=True, sequence=-1)
        return r


@pytest.mark.parametrize("lag_calls", [3, None])
def test_a_copy_is_waited_for_until_it_holds_its_ps_imports(three_ps, lag_calls, monkeypatch):
    """After the snapshot the migration waits until each copy on a new ring peer is
    current to its PS's sequence (its imports included), not merely complete; one that
    never gets there fails the migration before its fence, every row kept."""
    from aimaster import migration
    fleet = _LaggingCopyFleet(lag_calls)
    servers, addrs, old, new_owner, keys, by_ps = three_ps(fleet)
    if lag_calls is None:
        with pytest.raises(RuntimeError, match="was not current within"):
            migration._current(fleet, addrs[1], "ps-1", addrs[0], new_owner == 1, wait=0.5)
        monkeypatch.setattr(migration, "CURRENT_WAIT_SECONDS", 0.5)
        with pytest.raises(migration.MigrationError, match="was not current within"):
            migration.migrate(fleet, old, new_owner, ["ps-0", "ps-1"], addrs[:2],
                              lambda routing: fleet.publish(routing, lambda i: True))
        _nothing_changed_hands(servers, old, keys, by_ps)
    else:
        target = fleet.stats(addrs[1], replication_only=True).sequence
        seq = migration._current(fleet, addrs[1], "ps-1", addrs[0], new_owner == 1)
        assert seq >= target and fleet.waits == lag_calls + 1
