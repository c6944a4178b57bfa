"""Make-before-break replica hand-over, with real PS processes driven the way the AIMaster
drives a scale event: ``PrepareReplica`` keeps a copy of a PS on the peer a routing change
is about to give it, the routing push takes that copy over (no new full copy), one that
names another peer drops it. Every counter is checked exactly."""
from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from deeprec_ext import errors
from deeprec_ext.proto import ps_pb2
from tests.conftest import wait_for
from tests.test_replication_races import ALL, NONE, NUM_SLOTS, _create, _push, cluster  # noqa: F401


def _prepare(ps, peer, wait: float = 60.0, ps_id: str | None = None, slots=None):
    return ps.stub.PrepareReplica(ps_pb2.PrepareReplicaRequest(
        peer=peer.address if peer is not None else "", wait_seconds=wait,
        ps_id=ps.name if ps_id is None else ps_id,
        slots=b"" if slots is None else slots.astype(np.uint8).tobytes(),
        num_slots=0 if slots is None else slots.size), timeout=wait + 30)


def _no_copy_of(ps, origin) -> None:
    with pytest.raises(grpc.RpcError) as info:
        ps.promote(origin, ALL, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value
    assert errors.kind_of(info.value) is errors.ErrorKind.NO_REPLICA


def _counters(sync: bool, cluster):
    a, b, c = cluster("ps-a", "ps-b", "ps-c")
    a.route(ALL, b, interval_ms=50, sync=sync)
    b.route(NONE, None)
    c.route(NONE, None)
    _create(a, "c", 1, "zeros", {"name": "sgd", "learning_rate": 1.0})
    keys = np.arange(20_000, dtype=np.int64)
    _push(a, "c", keys, -1.0, rid="p1")
    return a, b, c, keys


@pytest.mark.parametrize("sync", [False, True])
def test_a_prepared_copy_is_taken_over_whole_and_the_old_one_dropped(cluster, sync):
    """A replicates to B. Prepared on C, A's copy there is complete before the routing
    changes and kept current while pushes go on; the routing push to C takes it over: no
    second full copy, C holds every push (and its request id: a resent push applies once),
    and B, no longer kept current, dropped its copy."""
    a, b, c, keys = _counters(sync, cluster)
    r = _prepare(a, c)
    assert r.complete and r.sequence >= 0, r
    rep = a.replication()
    assert rep.next_peer == c.address and rep.peer == b.address
    _push(a, "c", keys[:5000], -1.0, rid="p2")  # after the copy: both peers must get it
    if not sync:
        wait_for(lambda: a.replication().next_shipped_sequence >= a.replication().sequence, 30,
                 "the prepared copy to be current")
    copies = a.replication().full_copies
    assert copies == 2  # to B, and the prepared one to C
    a.route(ALL, c, interval_ms=50, sync=sync)  # the ring changes: C is A's peer now
    _push(a, "c", keys[:100], -1.0, rid="p3")
    a.wait_shipped()
    rep = a.replication()
    assert rep.peer == c.address and rep.next_peer == ""
    assert rep.full_copies == copies, rep  # deltas only to C from the change on
    wait_for(lambda: _dropped(b, a), 30, "B to drop its copy of A")
    _no_copy_of(b, a)
    resp = c.promote(a, ALL)
    assert resp.rows == keys.size
    c.route(ALL, None)
    want = np.full(keys.size, 1.0, np.float32)
    want[:5000] += 1
    want[:100] += 1
    np.testing.assert_array_equal(c.lookup("c", keys, 1)[:, 0], want)
    _push(c, "c", keys[:5000], -1.0, rid="p2")  # resent after the failover: known, not applied
    np.testing.assert_array_equal(c.lookup("c", keys, 1)[:, 0], want)


def _holds(ps, origin) -> bool:
    """Whether ``ps`` holds a (complete) copy of ``origin`` (its Gazer statistics)."""
    return any(h.origin == origin.name for h in ps.replication().held)


def _dropped(ps, origin) -> bool:
    return not _holds(ps, origin)


def test_a_copy_prepared_for_a_change_called_off_is_dropped(cluster):
    """A cancelled preparation (empty peer), and a routing push naming another peer than
    the prepared one (a rolled back scale event), both drop the prepared copy; A's own
    peer keeps its copy current throughout."""
    a, b, c, keys = _counters(False, cluster)
    assert _prepare(a, c).complete and _holds(c, a)
    _prepare(a, None)  # called off
    assert a.replication().next_peer == ""
    wait_for(lambda: _dropped(c, a), 30, "C to drop the cancelled copy")
    assert _prepare(a, c).complete and _holds(c, a)
    a.route(ALL, b, interval_ms=50)  # the old ring again, at a newer epoch
    assert a.replication().next_peer == ""
    wait_for(lambda: _dropped(c, a), 30, "C to drop the copy of a change rolled back")
    _no_copy_of(c, a)
    _push(a, "c", keys, -1.0, rid="p2")
    a.wait_shipped()
    assert b.promote(a, ALL).rows == keys.size
    b.route(ALL, None)
    np.testing.assert_array_equal(b.lookup("c", keys, 1)[:, 0], 2.0)


def test_a_prepared_copy_holds_only_the_slots_owned_after_the_change(cluster):
    """A source gives half its slots away in the change: its prepared copy holds the other
    half only (the given rows would be dropped right after), with pushes to both halves
    while it is kept current."""
    a, b, c, keys = _counters(False, cluster)
    from deeprec_ext.hashing import slot_of
    keeps = np.arange(NUM_SLOTS) % 2 == 0
    kept = keeps[slot_of(keys, NUM_SLOTS)]
    assert _prepare(a, c, slots=keeps).complete
    _push(a, "c", keys, -1.0, rid="p2")
    wait_for(lambda: a.replication().next_shipped_sequence >= a.replication().sequence, 30,
             "the prepared copy to be current")
    held = {h.origin: h.rows for h in c.replication().held}
    assert held == {"ps-a": int(kept.sum())}, held
    a.route(ALL, c, interval_ms=50)
    a.wait_shipped()
    assert c.promote(a, keeps).rows == int(kept.sum())
    c.route(keeps, None)
    np.testing.assert_array_equal(c.lookup("c", keys[kept], 1)[:, 0], 2.0)


def test_bad_prepare_requests_are_refused_and_the_ps_serves_on(cluster):
    a, b, c, keys = _counters(False, cluster)
    cases = [
        (dict(peer="no-port", wait_seconds=1, ps_id="ps-a"), grpc.StatusCode.INVALID_ARGUMENT, "peer"),
        (dict(peer=c.address, wait_seconds=-1, ps_id="ps-a"), grpc.StatusCode.INVALID_ARGUMENT,
         "wait_seconds"),
        (dict(peer=c.address, wait_seconds=float("nan"), ps_id="ps-a"),
         grpc.StatusCode.INVALID_ARGUMENT, "wait_seconds"),
        (dict(peer=c.address, wait_seconds=1, ps_id="ps-z"), grpc.StatusCode.FAILED_PRECONDITION,
         "ps-a"),
        (dict(peer=c.address, wait_seconds=1, ps_id="ps-a", slots=b"\x01" * 5, num_slots=64),
         grpc.StatusCode.INVALID_ARGUMENT, "slots"),
    ]
    for req, code, word in cases:
        with pytest.raises(grpc.RpcError) as info:
            a.stub.PrepareReplica(ps_pb2.PrepareReplicaRequest(**req), timeout=30)
        assert info.value.code() == code, (req, info.value)
        assert word in info.value.details(), (req, info.value.details())
    assert a.replication().next_peer == ""
    _push(a, "c", keys, -1.0, rid="p2")
    a.wait_shipped()
    np.testing.assert_array_equal(a.lookup("c", keys, 1)[:, 0], 2.0)


def test_a_copy_on_an_unreachable_peer_is_refused_as_unavailable(cluster):
    """A future peer that cannot be reached: the preparation answers UNAVAILABLE naming it
    after a few failed tries (the AIMaster then calls the scale event off), not at the end
    of its long wait; A's own peer stays current."""
    a, b, c, keys = _counters(False, cluster)
    c.kill()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        _prepare(a, c, wait=120)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert c.address in info.value.details() and "UNAVAILABLE" in info.value.details()
    assert time.monotonic() - t0 < 30
    assert a.replication().next_peer == ""  # given up, not retried in the background
    _push(a, "c", keys, -1.0, rid="p2")
    a.wait_shipped()
    assert b.promote(a, ALL).rows == keys.size


def test_a_ps_stopping_while_it_waits_for_a_copy_exits_in_seconds(cluster):
    """SIGTERM to a PS whose copy on its future peer cannot finish (the peer is frozen):
    the PrepareReplica waiting for it is answered UNAVAILABLE at once and the process
    exits in seconds. The wait used to run to its end (an hour for the AIMaster's) and
    its handler thread kept the stopping process alive until the launcher's SIGKILL."""
    a, b, c, keys = _counters(False, cluster)
    c.proc.send_signal(signal.SIGSTOP)  # takes the stream, never answers
    try:
        waiting = a.stub.PrepareReplica.future(ps_pb2.PrepareReplicaRequest(
            peer=c.address, wait_seconds=600, ps_id=a.name), timeout=630)
        time.sleep(1.0)
        assert not waiting.done()  # the copy cannot complete
        t0 = time.monotonic()
        a.proc.terminate()
        a.proc.wait(20)
        assert time.monotonic() - t0 < 10, "the PS took too long to exit after SIGTERM"
        with pytest.raises(grpc.RpcError) as info:
            waiting.result(timeout=10)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        c.proc.send_signal(signal.SIGCONT)
