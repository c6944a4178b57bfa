"""Live slot migration between PS: the data movement of a PS scale-out or scale-in.

For each (source, destination) pair: copy a snapshot of the moving slots while the source
keeps serving them, ship "changed since" catch-up rounds until they are small, fence the
moving slots on the sources (requests touching them get "stale routing" until the new
epoch is published), ship the last delta, then hand the slots to their destinations.
Only requests that touch moving slots wait, and only between the fence and the publish.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class MigrationResult:
    routing: RoutingTable
    moved_slots: int = 0
    moved_rows: int = 0        # rows in the snapshot round (distinct rows moved)
    catchup_rows: int = 0      # rows re-sent by catch-up rounds and the final delta
    moved_bytes: int = 0
    rounds: int = 0
    fence_ms: float = 0.0
    drops: dict = field(default_factory=dict)


# Gazer: what the migration in progress (or the last one) is doing, read by the monitor.
PROGRESS = {"active": False, "phase": "", "pairs": 0, "pairs_done": 0, "rows": 0, "started": 0.0}
_progress_lock = threading.Lock()


def _progress(**fields) -> None:
    with _progress_lock:
        PROGRESS.update(fields)


def progress() -> dict:
    with _progress_lock:
        return dict(PROGRESS)


class MigrationError(RuntimeError):
    """A migration step failed; the old layout was restored at a newer epoch."""


def _stub(address: str):
    return ps_pb2_grpc.ParameterServerStub(insecure_channel(address))


def _set_routing(address: str, epoch: int, num_slots: int, owned: np.ndarray) -> None:
    _stub(address).SetRouting(ps_pb2.SetRoutingRequest(
        epoch=epoch, num_slots=num_slots, owned_slots=owned.astype(np.uint8).tobytes()), timeout=30)


def migrate(old: RoutingTable, new_owner: np.ndarray, new_ids: list[str], new_addresses: list[str],
            publish: Callable[[RoutingTable], None], small_delta_rows: int = 2000,
            max_catchup_rounds: int = 4) -> MigrationResult:
    """Move slots from the ``old`` layout to ``new_owner`` (indices into ``new_ids``), then
    call ``publish`` with the new routing table (epoch + 1) before cleaning up."""
    old_owner_ids = np.asarray(old.ps_ids, dtype=object)[old.slot_owner]
    new_owner_ids = np.asarray(new_ids, dtype=object)[new_owner]
    address = dict(zip(old.ps_ids, old.ps_addresses))
    address.update(zip(new_ids, new_addresses))
    moving = old_owner_ids != new_owner_ids
    pairs = sorted({(s, d) for s, d in zip(old_owner_ids[moving], new_owner_ids[moving])})
    masks = {(s, d): (old_owner_ids == s) & (new_owner_ids == d) for s, d in pairs}
    epoch = old.epoch + 1
    new_routing = RoutingTable(epoch, old.num_slots, tuple(new_ids), tuple(new_addresses),
                               new_owner.astype(np.int32))
    result = MigrationResult(new_routing, moved_slots=int(moving.sum()))
    watermark = {p: -1 for p in pairs}
    lock = threading.Lock()
    _progress(active=True, phase="snapshot", pairs=len(pairs), pairs_done=0, rows=0,
              started=time.monotonic())

    def ship(pair, first: bool, last: bool = False):
        src, dst = pair
        resp = _stub(address[src]).MigrateSlots(ps_pb2.MigrateSlotsRequest(
            dst_address=address[dst], slots=masks[pair].astype(np.uint8).tobytes(),
            num_slots=old.num_slots, since_seq=watermark[pair], send_request_ids=last),
            timeout=3600)
        with lock:
            watermark[pair] = resp.watermark
            result.moved_bytes += resp.bytes
            if first:
                result.moved_rows += resp.rows
            else:
                result.catchup_rows += resp.rows
            with _progress_lock:
                PROGRESS["pairs_done"] += 1
                PROGRESS["rows"] += resp.rows
        return resp.rows

    old_ids = list(old.ps_ids)
    fenced = False
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pairs)))) as pool:
        try:
            # 1. snapshot while serving, 2. catch-up rounds until the deltas are small
            list(pool.map(lambda p: ship(p, True), pairs))
            result.rounds = 1
            for _ in range(max_catchup_rounds):
                _progress(phase="catchup", pairs_done=0)
                sent = list(pool.map(lambda p: ship(p, False), pairs))
                result.rounds += 1
                if max(sent, default=0) <= small_delta_rows:
                    break
            # 3. fence: every old PS keeps only what it keeps in the new layout
            fence_start = time.monotonic()
            fenced = True
            _progress(phase="fence", pairs_done=0)
            for ps in old_ids:
                _set_routing(address[ps], epoch, old.num_slots,
                             (old_owner_ids == ps) & (new_owner_ids == ps))
            # 4. last delta: nothing can write the fenced slots any more; the new owners
            # also learn which pushes were applied (a push resent to them is not re-applied)
            list(pool.map(lambda p: ship(p, False, last=True), pairs))
            result.rounds += 1
            # 5. destinations own their new slots; publish the epoch
            _progress(phase="handover")
            for ps in new_ids:
                _set_routing(address[ps], epoch, old.num_slots, new_owner_ids == ps)
            publish(new_routing)
            result.fence_ms = (time.monotonic() - fence_start) * 1000
        except Exception as exc:
            _progress(active=False, phase="failed")
            if fenced:
                rollback = RoutingTable(epoch + 1, old.num_slots, old.ps_ids, old.ps_addresses,
                                        old.slot_owner)
                for ps in old_ids:
                    try:
                        _set_routing(address[ps], epoch + 1, old.num_slots, old_owner_ids == ps)
                    except Exception:  # noqa: BLE001 - best effort, reported below
                        log.exception("rollback of %s failed", ps)
                publish(rollback)
            raise MigrationError(f"slot migration failed: {exc}") from exc
    # 6. free the moved rows on sources that stay (leaving PS exit anyway)
    _progress(phase="cleanup")
    for src in {s for s, _ in pairs if s in new_ids}:
        gone = (old_owner_ids == src) & (new_owner_ids != src)
        try:
            resp = _stub(address[src]).DropSlots(ps_pb2.DropSlotsRequest(
                slots=gone.astype(np.uint8).tobytes(), num_slots=old.num_slots), timeout=600)
            result.drops[src] = resp.rows
        except Exception:  # noqa: BLE001 - the layout is already correct; memory only
            log.exception("could not drop moved rows on %s", src)
    _progress(active=False, phase="done")
    return result
