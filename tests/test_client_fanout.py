"""A call that touches several PS talks to them in parallel: the last part is a blocking
call made while the others' futures are in flight (not after they answered)."""
from __future__ import annotations

import time

import numpy as np

from deeprec_ext import PSClient
from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.grpc_util import create_server
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc

DELAY = 0.4


class SlowPS(ps_pb2_grpc.ParameterServerServicer):
    """A real gRPC server answering Lookup with zeros after DELAY seconds."""

    def __init__(self):
        self.started: list[float] = []

    def Lookup(self, request, context):
        self.started.append(time.monotonic())
        time.sleep(DELAY)
        return ps_pb2.LookupResponse(values=[bytes(len(t.ids) // 2) for t in request.tables])


def test_parts_for_several_ps_are_in_flight_together():
    servers, servicers, addresses = [], [], []
    for _ in range(3):
        svc = SlowPS()
        server, port = create_server("127.0.0.1:0")
        ps_pb2_grpc.add_ParameterServerServicer_to_server(svc, server)
        server.start()
        servers.append(server)
        servicers.append(svc)
        addresses.append(f"127.0.0.1:{port}")
    client = PSClient("127.0.0.1:1")
    try:
        client.routing = RoutingTable.even(["a", "b", "c"], addresses, 8, epoch=1)
        client._dims["t"] = 1
        keys = np.arange(200, dtype=np.int64)
        assert len(client.routing.partition(keys)) == 3
        t = time.monotonic()
        values = client.lookup("t", keys)
        elapsed = time.monotonic() - t
        assert values.shape == (200, 1) and not values.any()
        starts = sorted(s for svc in servicers for s in svc.started)
        assert len(starts) == 3
        # all three were being served at once: one DELAY in all, not three after another
        assert starts[-1] - starts[0] < DELAY / 2, starts
        assert elapsed < 2 * DELAY, elapsed
    finally:
        client.close()
        for server in servers:
            server.stop(0)
