"""PsFleet: the only code of the AIMaster that talks to PS processes.

- one cached, authenticated channel per PS address (closed when the PS leaves the job);
- one retry policy, gRPC's own: every channel carries a service config that retries
  UNAVAILABLE with backoff (``grpc_util.retry_config``), no hand-written loops;
- routing epochs only go forward: the fleet hands out epochs (``next_epoch``) above every
  epoch it pushed or saw on a PS, and a PS refuses a push that is not newer
  (``ErrorKind.STALE_EPOCH``), so a slow push can never roll a layout back;
- one builder of ``SetRouting``: ``publish`` (ownership + replication ring) and ``fence``
  (ownership only, during a migration).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import grpc
import numpy as np

from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.grpc_util import insecure_channel, retry_config
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc

log = logging.getLogger("aimaster.fleet")

PS_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
# a PS being replaced answers again within a second; longer outages are the recovery's
# business (the lease), not the retry policy's
_RETRY = retry_config(PS_SERVICE, max_attempts=4, initial_backoff=0.05, max_backoff=0.4)


class PsFleet:
    def __init__(self, replication_interval_ms: float = 200.0, sync_replication: bool = False):
        self.replication_interval_ms = replication_interval_ms
        self.sync_replication = sync_replication
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, ps_pb2_grpc.ParameterServerStub] = {}
        # a PS's data address -> its control endpoint (same service, own threads): every
        # call from here, and every PS-to-PS call, goes there
        self._control: dict[str, str] = {}
        self._lock = threading.Lock()
        self._epoch = 0  # the highest epoch handed out, pushed or seen on a PS

    # -- channels ------------------------------------------------------------------------
    def set_control_address(self, address: str, control: str) -> None:
        """Learned at registration; without one (an older PS) the data address serves."""
        with self._lock:
            if control:
                self._control[address] = control
            else:
                self._control.pop(address, None)
            if self._channels.get(address) is not None:  # reopen to the new endpoint
                self._stubs.pop(address, None)
                stale = self._channels.pop(address)
            else:
                stale = None
        if stale is not None:
            stale.close()

    def control_address(self, address: str) -> str:
        with self._lock:
            return self._control.get(address, address)

    def stub(self, address: str) -> ps_pb2_grpc.ParameterServerStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = insecure_channel(self._control.get(address, address),
                                           service_config=_RETRY)
                self._channels[address] = channel
                stub = self._stubs[address] = ps_pb2_grpc.ParameterServerStub(channel)
            return stub

    def forget(self, addresses: Iterable[str]) -> None:
        """Close the channels of PS that left the job."""
        with self._lock:
            channels = [self._channels.pop(a, None) for a in addresses]
            for a in addresses:
                self._stubs.pop(a, None)
        for ch in channels:
            if ch is not None:
                ch.close()

    def retain(self, addresses: Iterable[str]) -> None:
        """Close every channel except those to ``addresses`` (the PS of the job)."""
        keep = set(addresses)
        with self._lock:
            gone = [a for a in self._channels if a not in keep]
        self.forget(gone)

    def open_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        with self._lock:
            addresses = list(self._channels)
        self.forget(addresses)

    # -- epochs --------------------------------------------------------------------------
    def next_epoch(self) -> int:
        """A routing epoch newer than every epoch handed out or seen before."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def observe_epoch(self, epoch: int) -> None:
        with self._lock:
            self._epoch = max(self._epoch, int(epoch))

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def learn_epochs(self, addresses: Iterable[str], timeout: float = 10.0) -> int:
        """Raise the epoch floor to the highest epoch any of these PS already has (a PS
        that outlived a restarted AIMaster keeps its epoch)."""
        for address in addresses:
            try:
                r = self.stub(address).Stats(ps_pb2.StatsRequest(), timeout=timeout,
                                             wait_for_ready=True)
                self.observe_epoch(r.epoch)
            except grpc.RpcError as exc:
                log.warning("no epoch from %s (%s)", address, exc.code().name)
        return self.epoch

    # -- routing -------------------------------------------------------------------------
    PUBLISH_LIVENESS_POLL_SECONDS = 0.05

    def routing_request(self, routing: RoutingTable, p: int) -> ps_pb2.SetRoutingRequest:
        """What PS ``p`` of ``routing`` is told: the slots it owns and its replication
        peer (the next PS in ring order)."""
        n = len(routing.ps_addresses)
        return ps_pb2.SetRoutingRequest(
            epoch=routing.epoch, num_slots=routing.num_slots,
            owned_slots=(routing.slot_owner == p).astype(np.uint8).tobytes(),
            ps_id=routing.ps_ids[p],
            replica_peer=self.control_address(routing.ps_addresses[(p + 1) % n]) if n > 1 else "",
            replication_interval_ms=self.replication_interval_ms,
            sync_replication=self.sync_replication)

    def publish(self, routing: RoutingTable, is_live: Callable[[str], bool],
                skip: Iterable[str] = ()) -> list[str]:
        """Push ``routing`` to each of its PS: the slots it owns and its replication peer
        (the next PS in ring order). Returns the ids of PS that are dead (not an error: a
        PS that died while this routing was built is left to its own recovery).

        The calls go out together and are then waited for: one after the other, a
        recovery's routing took a round trip per PS (each PS checks the epoch itself, so
        the order in which they apply it does not matter)."""
        self.observe_epoch(routing.epoch)
        skip = set(skip)
        skipped = []
        calls = []
        for p, address in enumerate(routing.ps_addresses):
            ps_id = routing.ps_ids[p]
            if ps_id in skip:  # told already (a promotion carries its PS's routing)
                continue
            if not is_live(ps_id):
                skipped.append(ps_id)
                continue
            calls.append((ps_id, self.stub(address).SetRouting.future(
                self.routing_request(routing, p), timeout=10, wait_for_ready=True)))
        failed = None
        for ps_id, call in calls:
            while True:
                try:
                    call.result(timeout=self.PUBLISH_LIVENESS_POLL_SECONDS)
                except grpc.FutureTimeoutError:
                    # a PS that died since the calls went out (its death noticed now) is
                    # not waited for: wait_for_ready held a recovery 10 s on a second
                    # dead PS whose death was noticed a few ms after the push began
                    if is_live(ps_id):
                        continue
                    call.cancel()
                    skipped.append(ps_id)
                except grpc.RpcError as exc:
                    if not is_live(ps_id):
                        skipped.append(ps_id)
                    elif failed is None:
                        failed = exc  # raised once every call has ended
                break
        if failed is not None:
            raise failed
        return skipped

    def fence(self, address: str, epoch: int, num_slots: int, owned: np.ndarray) -> None:
        """Ownership only (the ring is unchanged): a migration fences its moving slots."""
        self.observe_epoch(epoch)
        self.stub(address).SetRouting(ps_pb2.SetRoutingRequest(
            epoch=epoch, num_slots=num_slots, owned_slots=owned.astype(np.uint8).tobytes()),
            timeout=30)

    # -- data operations -----------------------------------------------------------------
    def slot_stats(self, routing: RoutingTable) -> tuple[np.ndarray, np.ndarray] | None:
        """(bytes, lookups) per slot summed over the PS of ``routing``; None if a PS
        cannot answer (placement then falls back to equal slot counts)."""
        nbytes = np.zeros(routing.num_slots, np.int64)
        lookups = np.zeros(routing.num_slots, np.int64)
        for address in routing.ps_addresses:
            try:
                r = self.stub(address).SlotStats(ps_pb2.SlotStatsRequest(), timeout=30)
            except grpc.RpcError as exc:
                log.warning("placement: no slot stats from %s (%s); balancing slot counts",
                            address, exc.code().name)
                return None
            if r.num_slots != routing.num_slots:
                return None
            nbytes += np.frombuffer(r.slot_bytes, "<i8")
            lookups += np.frombuffer(r.slot_lookups, "<i8")
        return nbytes, lookups

    def stats(self, address: str, timeout: float = 2.0,
              replication_only: bool = False) -> ps_pb2.StatsResponse:
        """A PS's statistics; ``replication_only``: only its sequence number and how far
        its peer's copy is current (reads no Gazer window)."""
        return self.stub(address).Stats(ps_pb2.StatsRequest(replication_only=replication_only),
                                        timeout=timeout)

    def restore(self, routing: RoutingTable, root: str, ckpt_id: int, warm: bool = False,
                reset_optimizer: bool = False) -> int:
        """Every PS of ``routing`` loads the rows of its slots from a checkpoint, all at
        once (each reads only the chunks of its slots). Returns the rows restored."""
        def one(p: int) -> int:
            return self.restore_slots(routing.ps_addresses[p], routing.slot_owner == p,
                                      routing.num_slots, root, ckpt_id, warm, reset_optimizer)
        with ThreadPoolExecutor(len(routing.ps_addresses)) as pool:
            return sum(pool.map(one, range(len(routing.ps_addresses))))

    def restore_slots(self, address: str, mask: np.ndarray, num_slots: int, root: str,
                      ckpt_id: int, warm: bool = False, reset_optimizer: bool = False) -> int:
        return self.stub(address).RestoreCheckpoint(ps_pb2.RestoreCheckpointRequest(
            root=root, ckpt_id=ckpt_id, slots=mask.astype(np.uint8).tobytes(),
            num_slots=num_slots, warm_start=warm, reset_optimizer=warm and reset_optimizer),
            timeout=3600).rows

    def promote(self, address: str, origin: str, mask: np.ndarray, num_slots: int,
                timeout: float = 120.0,
                routing: ps_pb2.SetRoutingRequest | None = None) -> ps_pb2.PromoteResponse:
        """``routing``: the PS's routing after the promotion, applied in the same call
        (``routing_applied`` in the answer says whether it was)."""
        if routing is not None:
            self.observe_epoch(routing.epoch)
        return self.stub(address).Promote(ps_pb2.PromoteRequest(
            origin=origin, slots=mask.astype(np.uint8).tobytes(), num_slots=num_slots,
            routing=routing), timeout=timeout)

    def write_checkpoint(self, address: str, request: ps_pb2.WriteCheckpointRequest):
        """A future: the checkpoint can be cancelled (a recovery pre-empts it)."""
        return self.stub(address).WriteCheckpoint.future(request, timeout=3600)

    def migrate_slots(self, src: str, dst: str, mask: np.ndarray, num_slots: int,
                      since_seq: int, send_request_ids: bool, fence_epoch: int = 0,
                      fence_owned: np.ndarray | None = None,
                      dst_replica_after: str = "") -> ps_pb2.MigrateSlotsResponse:
        """``fence_epoch``/``fence_owned``: the last round fences its source first (one
        call instead of a ``fence`` and then the round). ``dst_replica_after``: the
        destination's ring peer in the new layout (its imports skip a peer it leaves)."""
        if fence_epoch:
            self.observe_epoch(fence_epoch)
        return self.stub(src).MigrateSlots(ps_pb2.MigrateSlotsRequest(
            dst_address=self.control_address(dst), slots=mask.astype(np.uint8).tobytes(), num_slots=num_slots,
            since_seq=since_seq, send_request_ids=send_request_ids, fence_epoch=fence_epoch,
            fence_owned=b"" if fence_owned is None else fence_owned.astype(np.uint8).tobytes(),
            dst_replica_after=self.control_address(dst_replica_after) if dst_replica_after else ""),
            timeout=3600)

    def prepare_replica(self, address: str, ps_id: str, peer: str, wait: float,
                        owned_after: np.ndarray | None = None) -> ps_pb2.PrepareReplicaResponse:
        """Make-before-break: the PS at ``address`` (``ps_id``) keeps a copy of itself on
        ``peer``, its ring peer after the routing change to come (only the rows of
        ``owned_after``, its slots then); waits up to ``wait`` seconds for that copy to be
        complete. An empty ``peer`` drops such a copy."""
        return self.stub(address).PrepareReplica(ps_pb2.PrepareReplicaRequest(
            peer=self.control_address(peer) if peer else "", wait_seconds=wait, ps_id=ps_id,
            slots=b"" if owned_after is None else owned_after.astype(np.uint8).tobytes(),
            num_slots=0 if owned_after is None else int(owned_after.size)),
            timeout=wait + 30.0)

    def drop_slots(self, address: str, mask: np.ndarray, num_slots: int) -> int:
        return self.stub(address).DropSlots(ps_pb2.DropSlotsRequest(
            slots=mask.astype(np.uint8).tobytes(), num_slots=num_slots), timeout=600).rows
