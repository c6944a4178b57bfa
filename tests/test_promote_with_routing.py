"""Promote carrying the peer's new routing (one call instead of Promote, then SetRouting):
with real PS processes, a real kill -9 of the origin, and counted rows."""
from __future__ import annotations

import grpc
import numpy as np

from deeprec_ext.proto import ps_pb2
from tests.test_replication_races import ALL, NONE, NUM_SLOTS, _create, _fill, _push, cluster  # noqa: F401

DIM = 1  # _push sends one value per row


def _routing(ps, epoch: int, owned: np.ndarray) -> ps_pb2.SetRoutingRequest:
    return ps_pb2.SetRoutingRequest(epoch=epoch, owned_slots=owned.astype(np.uint8).tobytes(),
                                    num_slots=NUM_SLOTS, ps_id=ps.name,
                                    replication_interval_ms=50.0)


def _promote(b, a, routing, timeout: float = 60):
    return b.stub.Promote(ps_pb2.PromoteRequest(
        origin=a.name, slots=ALL.astype(np.uint8).tobytes(), num_slots=NUM_SLOTS,
        routing=routing), timeout=timeout)


def _dead_origin(cluster, n: int = 20_000):
    """A owns every slot and replicates to B; updates shipped; A killed. Returns (A, B,
    keys, A's values before the kill)."""
    a, b = cluster("ps-a", "ps-b")
    for ps in (a, b):
        _create(ps, "t", DIM, {"name": "normal", "seed": 3}, {"name": "sgd", "learning_rate": 1.0})
    b.route(NONE, None)
    a.route(ALL, b)
    keys = _fill(a, "t", n)
    _push(a, "t", keys[::3], 0.5, rid="r-1")
    a.wait_shipped()
    before = a.lookup("t", keys, DIM)
    a.kill()
    return a, b, keys, before


def test_promote_applies_the_routing_it_carries_and_loses_no_row(cluster):
    a, b, keys, before = _dead_origin(cluster)
    # a routing that does not own the promoted slots is refused whole, nothing promoted
    try:
        _promote(b, a, _routing(b, b.epoch + 1, NONE))
        raise AssertionError("a routing without the promoted slots was accepted")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "promoted slot" in exc.details()
    assert b.rows("t") == 0  # B keeps serving, its copy still promotable
    resp = _promote(b, a, _routing(b, b.epoch + 1, ALL))
    assert resp.routing_applied and resp.rows == keys.size
    # B serves every row at once, as A had it: no SetRouting was needed
    np.testing.assert_array_equal(b.lookup("t", keys, DIM), before)
    # the push A applied is not applied twice when the client resends it to B
    _push(b, "t", keys[::3], 0.5, rid="r-1")
    np.testing.assert_array_equal(b.lookup("t", keys, DIM), before)
    # the epoch is B's: the same epoch again is refused as stale
    try:
        b.stub.SetRouting(_routing(b, b.epoch + 1, ALL), timeout=30)
        raise AssertionError("the promotion's epoch was not applied")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_promote_with_a_stale_routing_promotes_and_leaves_the_routing(cluster):
    a, b, keys, before = _dead_origin(cluster, n=5_000)
    resp = _promote(b, a, _routing(b, b.epoch, ALL))  # not newer than B's own epoch
    assert resp.rows == keys.size and not resp.routing_applied
    try:  # B does not own the slots: its clients are told "stale routing"
        b.lookup("t", keys[:10], DIM)
        raise AssertionError("B served slots its routing does not give it")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    b.route(ALL, None)  # what the AIMaster then sends
    np.testing.assert_array_equal(b.lookup("t", keys, DIM), before)
