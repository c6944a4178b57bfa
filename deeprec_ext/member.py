"""Membership of one process in a job: register with the AIMaster, keep the lease alive.

Used by PS processes and workers alike. The heartbeat answer carries the routing epoch,
so a member learns of a new layout within one heartbeat without any restart.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Callable

import grpc

from deeprec_ext.grpc_util import RetryPolicy, call_with_retry, insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)
# this process's registrations share it; a new process under the same id gets another
INCARNATION = uuid.uuid4().hex

MASTER_ENV = "DEEPREC_MASTER_ADDR"
MEMBER_ID_ENV = "DEEPREC_MEMBER_ID"


def master_address_from_env(explicit: str | None = None) -> str:
    address = explicit or os.environ.get(MASTER_ENV, "")
    if not address:
        raise RuntimeError(f"no AIMaster address: pass one or set {MASTER_ENV}")
    return address


class MasterSession:
    """A registered member: lease heartbeats on a daemon thread, deregistration on close."""

    def __init__(self, master_address: str, role: str, member_id: str = "", address: str = "",
                 on_epoch: Callable[[int], None] | None = None,
                 on_stop: Callable[[], None] | None = None,
                 stall_source: Callable[[], float] | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 stats_source: Callable[[], bytes] | None = None,
                 control_address: str = "",
                 on_split: Callable[[], None] | None = None):
        self.master_address = master_address
        self.role = role
        self.requested_id = member_id
        self.address = address
        self.control_address = control_address
        self.on_epoch = on_epoch
        self.on_stop = on_stop
        self.on_split = on_split  # worker: the AIMaster asks it to split its shard
        self.stall_source = stall_source
        self.stats_source = stats_source  # Gazer: serialized MemberStats for each beat
        self.retry = retry
        self.channel = insecure_channel(master_address)
        self.stub = master_pb2_grpc.MasterStub(self.channel)
        self.id = ""
        self.rank = -1
        self.epoch = -1
        self.heartbeat_seconds = 1.0
        self.steps = 0
        self.samples = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self) -> master_pb2.RegisterResponse:
        req = master_pb2.RegisterRequest(role=self.role, id=self.id or self.requested_id,
                                         pid=os.getpid(), address=self.address,
                                         control_address=self.control_address,
                                         host=socket.gethostname(), incarnation=INCARNATION)
        resp = call_with_retry(lambda: self.stub.Register(req, timeout=10),
                               f"register {self.role} with {self.master_address}", self.retry)
        self.id, self.rank = resp.id, resp.rank
        self.heartbeat_seconds = resp.heartbeat_seconds or 1.0
        self._set_epoch(resp.epoch)
        log.info("registered as %s (rank %d) with AIMaster %s", self.id, self.rank,
                 self.master_address)
        return resp

    def start(self) -> "MasterSession":
        if not self.id:
            self.register()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.id}", daemon=True)
        self._thread.start()
        return self

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            if self.on_epoch is not None:
                self.on_epoch(epoch)

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat_seconds):
            try:
                stall = self.stall_source() if self.stall_source is not None else 0.0
                stats = self._stats()
                resp = self.stub.Heartbeat(master_pb2.HeartbeatRequest(
                    id=self.id, steps=self.steps, samples=self.samples, max_stall_ms=stall,
                    gazer_stats=stats), timeout=5)
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", exc.code().name)
                continue
            if not resp.known:
                log.warning("AIMaster does not know %s any more; registering again", self.id)
                try:
                    self.register()
                except grpc.RpcError:
                    continue
                continue
            self._set_epoch(resp.epoch)
            if resp.stop and self.on_stop is not None:
                self.on_stop()
            elif resp.split_shard and self.on_split is not None:
                self.on_split()

    def _stats(self) -> bytes:
        if self.stats_source is None:
            return b""
        try:
            return self.stats_source()
        except Exception:  # noqa: BLE001 - statistics must never stop the lease
            log.exception("gazer statistics failed")
            return b""

    def close(self, reason: str = "exit") -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self.id:
            try:  # a last beat carries the final step/sample counts
                self.stub.Heartbeat(master_pb2.HeartbeatRequest(
                    id=self.id, steps=self.steps, samples=self.samples), timeout=3)
            except grpc.RpcError:
                pass
            try:
                self.stub.Deregister(master_pb2.DeregisterRequest(id=self.id, reason=reason),
                                     timeout=3)
            except grpc.RpcError:
                pass
        self.channel.close()
