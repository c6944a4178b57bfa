"""Data-plane calls of the sync mode, on top of PSClient's routing: per-step lookups that
see exactly the state after the previous step, and (step, virtual rank) contributions."""
from __future__ import annotations

import logging
import time

import grpc
import numpy as np

from deeprec_ext import codec
from deeprec_ext.client import PSClient
from deeprec_ext.errors import InvalidRequestError, StaleRoutingError, UnknownTableError
from deeprec_ext.grpc_util import ROUTING_EPOCH_KEY, insecure_channel
from deeprec_ext.proto import ps_pb2, sync_pb2, sync_pb2_grpc

log = logging.getLogger(__name__)


def _stale_epoch(exc: grpc.RpcError) -> int:
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return -1
    for key, value in exc.trailing_metadata() or ():
        if key == ROUTING_EPOCH_KEY:
            return int(value)
    return -1


class SyncPSClient:
    """Step lookups and contributions over the PS fleet. ``wait_seconds`` bounds how long
    a call waits for a step another worker has not finished (e.g. its host is replaced)."""

    def __init__(self, client: PSClient, wait_seconds: float = 600.0, rpc_timeout: float = 60.0):
        self.client = client
        self.wait_seconds = wait_seconds
        self.rpc_timeout = rpc_timeout
        self._stubs: dict[str, sync_pb2_grpc.SyncParameterServerStub] = {}
        self._channels: list[grpc.Channel] = []

    def _stub(self, address: str) -> sync_pb2_grpc.SyncParameterServerStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = insecure_channel(address)
            self._channels.append(ch)
            stub = self._stubs[address] = sync_pb2_grpc.SyncParameterServerStub(ch)
        return stub

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        self._stubs.clear()

    def _retry(self, exc: grpc.RpcError, what: str, deadline: float) -> None:
        """Decide on a failed call: refresh routing and go again, or raise."""
        epoch = _stale_epoch(exc)
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            raise UnknownTableError(f"{what}: {exc.details()}") from exc
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequestError(f"{what}: {exc.details()}") from exc
        if epoch < 0 and code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise exc
        if time.monotonic() > deadline:
            if epoch >= 0:
                raise StaleRoutingError(exc.details(), epoch) from exc
            raise exc
        if epoch < 0:
            time.sleep(0.05)
        log.debug("%s: %s; retrying", what, exc.details())
        self.client.refresh_routing(epoch)

    def step_lookup(self, step: int, requests: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Values of unique ids per table as of the end of step - 1 (waits for it)."""
        dims = {name: self.client.dim(name) for name in requests}
        out = {name: np.empty((ids.size, dims[name]), np.float32) for name, ids in requests.items()}
        pending = {name: np.arange(ids.size) for name, ids in requests.items() if ids.size}
        deadline = time.monotonic() + self.wait_seconds
        while pending:
            routing = self.client.routing or self.client.refresh_routing()
            by_ps: dict[int, list] = {}
            for name, pos in pending.items():
                for p, sel in routing.partition(requests[name][pos]):
                    by_ps.setdefault(p, []).append((name, pos[sel]))
            calls = []
            for p, parts in by_ps.items():
                req = sync_pb2.StepLookupRequest(step=step, wait_seconds=10.0, tables=[
                    ps_pb2.TableIds(table=n, ids=codec.ids_to_bytes(requests[n][pos])) for n, pos in parts])
                calls.append((parts, self._stub(routing.ps_addresses[p]).StepLookup.future(
                    req, timeout=self.rpc_timeout)))
            retry: dict[str, list] = {}
            failure = None
            for parts, fut in calls:
                try:
                    resp = fut.result()
                except grpc.RpcError as exc:
                    failure = exc
                    for n, pos in parts:
                        retry.setdefault(n, []).append(pos)
                    continue
                for (n, pos), payload in zip(parts, resp.values):
                    out[n][pos] = codec.floats_from_bytes(payload, pos.size, dims[n], n)
            pending = {n: np.concatenate(p) for n, p in retry.items()}
            if failure is not None:
                self._retry(failure, f"step {step} lookup", deadline)
        return out

    def contribute(self, step: int, virtual_workers: int,
                   contributions: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]) -> int:
        """Send each virtual rank's gradients (unique ids per table) to every PS, one RPC
        per PS. Every PS gets every rank, empty or not: that is how it knows the step is
        complete. Resends are harmless (idempotent per step and rank). Returns duplicates."""
        deadline = time.monotonic() + self.wait_seconds
        todo = None  # PS addresses still to send to (None: all of the current routing)
        while True:
            routing = self.client.routing or self.client.refresh_routing()
            parts = {rank: {name: dict(routing.partition(ids)) for name, (ids, _) in tables.items()}
                     for rank, tables in contributions.items()}
            calls = []
            for p, address in enumerate(routing.ps_addresses):
                if todo is not None and address not in todo:
                    continue
                req = sync_pb2.ContributeRequest(step=step, virtual_workers=virtual_workers)
                for rank in sorted(contributions):
                    c = req.contributions.add(virtual_rank=rank)
                    for name, (ids, grads) in contributions[rank].items():
                        sel = parts[rank][name].get(p)
                        if sel is not None and sel.size:
                            c.tables.append(ps_pb2.TableUpdate(
                                table=name, ids=codec.ids_to_bytes(ids[sel]),
                                values=codec.floats_to_bytes(grads[sel])))
                calls.append((address, self._stub(address).Contribute.future(req, timeout=self.rpc_timeout)))
            failed, failure, dup = [], None, 0
            for address, fut in calls:
                try:
                    dup += fut.result().duplicates
                except grpc.RpcError as exc:
                    failed.append(address)
                    failure = exc
            if failure is None:
                return dup
            before = routing.epoch
            self._retry(failure, f"step {step} contribution", deadline)
            # same layout: resend to the PS that failed; a new layout: to every PS (the
            # ones that already hold a rank's part drop the resend)
            todo = set(failed) if (self.client.routing and self.client.routing.epoch == before) else None
