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
from typing import TYPE_CHECKING, Callable

import numpy as np

from deeprec_ext.client.routing import RoutingTable

if TYPE_CHECKING:  # pragma: no cover
    from aimaster.fleet import PsFleet

log = logging.getLogger(__name__)


@dataclass
class MigrationResult:
    routing: RoutingTable
    moved_slots: int = 0
    moved_rows: int = 0        # rows in the snapshot round (distinct rows moved)
    catchup_rows: int = 0      # rows re-sent by catch-up rounds and the final delta
    # rows of the snapshot round a destination took from its copy of the source (its ring
    # peer's replica), not sent over the network (part of moved_rows)
    seeded_rows: int = 0
    moved_bytes: int = 0
    rounds: int = 0
    fence_ms: float = 0.0
    # PS whose ring peer changes, and the sequence number each one's copy on its new peer
    # was current to when it was complete, before the routing change (make-before-break)
    prepared: dict = field(default_factory=dict)
    drops: dict = field(default_factory=dict)
    # where the time went: snapshot, catchup (all rounds), fence_last_delta (the last
    # round's calls, each fencing its source first), publish; what a move waits on (a
    # slow source shows in each)
    phases_ms: dict = field(default_factory=dict)
    round_rows: list = field(default_factory=list)  # rows of each round, summed over pairs
    round_ms: list = field(default_factory=list)    # wall time of each round (its slowest pair)


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


class MigrationCancelled(RuntimeError):
    """The AIMaster is stopping: called off before the fence (nothing changed hands)."""


def migrate(fleet: "PsFleet", old: RoutingTable, new_owner: np.ndarray, new_ids: list[str],
            new_addresses: list[str], publish: Callable[[RoutingTable], None],
            small_delta_rows: int = 2000, max_catchup_rounds: int = 4,
            stopping: Callable[[], bool] = lambda: False) -> MigrationResult:
    """Move slots from the ``old`` layout to ``new_owner`` (indices into ``new_ids``), then
    call ``publish`` with the new routing table before cleaning up. Epochs: the fence takes
    one from the fleet, the new layout the next (a PS only ever moves forward).

    ``stopping()`` true (the AIMaster is shutting down) calls the migration off at its next
    step before the fence, rolled back like any failure while the PS still answer; from the
    fence on it finishes (a fenced layout is left only by a publish)."""
    old_owner_ids = np.asarray(old.ps_ids, dtype=object)[old.slot_owner]
    new_owner_ids = np.asarray(new_ids, dtype=object)[new_owner]
    address = dict(zip(old.ps_ids, old.ps_addresses))
    address.update(zip(new_ids, new_addresses))
    moving = old_owner_ids != new_owner_ids
    pairs = sorted({(s, d) for s, d in zip(old_owner_ids[moving], new_owner_ids[moving])})
    masks = {(s, d): (old_owner_ids == s) & (new_owner_ids == d) for s, d in pairs}
    fence_epoch = fleet.next_epoch()
    new_routing = RoutingTable(fleet.next_epoch(), old.num_slots, tuple(new_ids), tuple(new_addresses),
                               new_owner.astype(np.int32))
    result = MigrationResult(new_routing, moved_slots=int(moving.sum()))
    watermark = {p: -1 for p in pairs}
    lock = threading.Lock()
    _progress(active=True, phase="snapshot", pairs=len(pairs), pairs_done=0, rows=0,
              started=time.monotonic())

    keeps = {ps: (old_owner_ids == ps) & (new_owner_ids == ps) for ps in old.ps_ids}
    # each PS's replication peer in the new layout (the next in ring order, as publish sets
    # it): a destination that replicates elsewhere now skips that peer for its imports
    ring_after = {ps: new_addresses[(p + 1) % len(new_ids)] if len(new_ids) > 1 else ""
                  for p, ps in enumerate(new_ids)}
    ring_before = {ps: old.ps_addresses[(p + 1) % len(old.ps_ids)] if len(old.ps_ids) > 1
                   else "" for p, ps in enumerate(old.ps_ids)}
    # make-before-break: a PS whose peer changes keeps a copy of itself on the new peer
    # too, complete before the routing change. Changed at the publish alone, the new peer
    # had no copy until its full copy after it: a failure of that PS seconds after a
    # scale event found none (its updates since the last checkpoint lost, or the job)
    rechained = {ps: ring_after[ps] for ps in new_ids
                 if ring_after[ps] and ring_after[ps] != ring_before.get(ps)}

    def check_stop() -> None:
        if stopping():
            raise MigrationCancelled("the AIMaster is stopping")

    def ship(pair, first: bool, last: bool = False):
        src, dst = pair
        # the last round fences its source in the same call (one round trip less while
        # requests for moving slots wait); the source reads its watermark after the fence
        resp = fleet.migrate_slots(address[src], address[dst], masks[pair], old.num_slots,
                                   watermark[pair], send_request_ids=last,
                                   fence_epoch=fence_epoch if last else 0,
                                   fence_owned=keeps[src] if last else None,
                                   dst_replica_after=ring_after.get(dst, ""))
        with lock:
            watermark[pair] = resp.watermark
            result.moved_bytes += resp.bytes
            if first:
                result.moved_rows += resp.rows
                result.seeded_rows += resp.seeded
            else:
                result.catchup_rows += resp.rows
            with _progress_lock:
                PROGRESS["pairs_done"] += 1
                PROGRESS["rows"] += resp.rows
        return resp.rows

    old_ids = list(old.ps_ids)
    fenced = False
    phases = result.phases_ms
    clock = [time.monotonic()]

    def lap(phase: str) -> None:
        now = time.monotonic()
        phases[phase] = round(phases.get(phase, 0.0) + (now - clock[0]) * 1000, 3)
        clock[0] = now

    # one thread per pair, and one per old PS for the fence
    with ThreadPoolExecutor(max_workers=max(1, min(8, max(len(pairs), len(old_ids))))) as pool:
        try:
            # 0. every copy on a new ring peer complete before the first row moves; the
            # imports then reach it as the copy's deltas while they arrive. Waited for
            # after the catch-up rounds instead (the copies streaming beside the
            # snapshot), a scale-in's 2.5M-row copy kept the event waiting 5-7 s while
            # training wrote 0.6M more rows of moving slots, all shipped again by the
            # catch-up after it (bench_migration, 4M rows: 0.24-0.28M catch-up rows this
            # way against 0.60-0.76M, scale-in throughput 0.62-0.67x against 0.52-0.65x).
            if rechained:
                _progress(phase="prepare_replicas")
                for ps in sorted(rechained):
                    _prepare(fleet, address[ps], ps, rechained[ps], new_owner_ids == ps,
                             wait=0.0)
                prepared = list(pool.map(
                    lambda ps: _prepare(fleet, address[ps], ps, rechained[ps],
                                        new_owner_ids == ps, stopping=stopping),
                    sorted(rechained)))
                result.prepared = dict(zip(sorted(rechained), prepared))
                lap("prepare_replicas")
            # 1. snapshot while serving, 2. catch-up rounds until the deltas are small
            check_stop()
            _progress(phase="snapshot")
            t_round = time.monotonic()
            result.round_rows.append(sum(pool.map(lambda p: ship(p, True), pairs)))
            result.round_ms.append(round((time.monotonic() - t_round) * 1000, 3))
            result.rounds = 1
            lap("snapshot")

            def catch_up() -> None:
                for _ in range(max_catchup_rounds):
                    check_stop()
                    _progress(phase="catchup", pairs_done=0)
                    t_round = time.monotonic()
                    sent = list(pool.map(lambda p: ship(p, False), pairs))
                    result.round_ms.append(round((time.monotonic() - t_round) * 1000, 3))
                    result.round_rows.append(sum(sent))
                    result.rounds += 1
                    if max(sent, default=0) <= small_delta_rows:
                        break

            if rechained:
                # each new peer's copy current to what its PS holds after the snapshot
                # (the imports included), before the catch-up rounds: the publish's
                # take-over then ships only what those rounds and training wrote since.
                # Waited for after the catch-up instead, the rows written during this
                # wait (4 s on a scale-out) all went into the fenced last round (a 590-
                # 760 ms stall)
                _progress(phase="replicas_current")
                result.prepared = dict(zip(sorted(rechained), pool.map(
                    lambda ps: _current(fleet, address[ps], ps, rechained[ps],
                                        new_owner_ids == ps, stopping), sorted(rechained))))
                lap("replicas_current")
            catch_up()
            lap("catchup")
            check_stop()
            # 3. fence + 4. last delta, in one call per pair: every source keeps only what
            # it keeps in the new layout, then (nothing can write its moving slots any
            # more) ships what changed since the last round; the new owners also learn
            # which pushes were applied (a push resent to them is not re-applied). Old PS
            # that send nothing are fenced at the same time (their ownership is unchanged;
            # they learn the epoch). A failure from here on restores the old layout.
            fence_start = time.monotonic()
            fenced = True
            _progress(phase="fence", pairs_done=0)
            sources = {s for s, _ in pairs}
            quiet = [pool.submit(fleet.fence, address[ps], fence_epoch, old.num_slots, keeps[ps])
                     for ps in old_ids if ps not in sources]
            result.round_rows.append(sum(pool.map(lambda p: ship(p, False, last=True), pairs)))
            result.round_ms.append(round((time.monotonic() - fence_start) * 1000, 3))
            for f in quiet:
                f.result()
            result.rounds += 1
            lap("fence_last_delta")
            # 5. hand over: every PS learns the new layout (and ring) at the next epoch,
            # then the clients
            _progress(phase="handover")
            publish(new_routing)
            lap("publish")
            result.fence_ms = (time.monotonic() - fence_start) * 1000
        except Exception as exc:
            _progress(active=False, phase="failed")
            rolled_back = not fenced
            if fenced:
                # the old layout again, at an epoch newer than anything pushed so far
                rollback = RoutingTable(fleet.next_epoch(), old.num_slots, old.ps_ids,
                                        old.ps_addresses, old.slot_owner)
                try:
                    publish(rollback)
                    rolled_back = True
                except Exception:  # noqa: BLE001 - reported with the migration's error
                    log.exception("rollback to the old layout failed")
            if rolled_back:
                _drop_copied(fleet, masks, address, old.num_slots, stopping)
            _cancel_prepared(fleet, {ps: address[ps] for ps in rechained}, stopping)
            if isinstance(exc, MigrationCancelled):
                raise MigrationError(f"slot migration called off: {exc}") from exc
            raise MigrationError(f"slot migration failed: {exc}") from exc
    # 6. free the moved rows on sources that stay (leaving PS exit anyway)
    _progress(phase="cleanup")
    for src in {s for s, _ in pairs if s in new_ids}:
        gone = (old_owner_ids == src) & (new_owner_ids != src)
        dropped = _drop_with_retries(fleet, address[src], gone, old.num_slots)
        if dropped is not None:
            result.drops[src] = dropped
    _progress(active=False, phase="done")
    return result


PREPARE_REPLICA_SECONDS = 3600.0  # a full copy of a large PS takes a while
PREPARE_POLL_SECONDS = 2.0  # the wait is asked for in pieces: a stopping AIMaster leaves


def _prepare(fleet: "PsFleet", address: str, ps_id: str, peer: str, owned_after: np.ndarray,
             wait: float = PREPARE_REPLICA_SECONDS,
             stopping: Callable[[], bool] = lambda: False) -> int:
    """A copy of the PS at ``address`` on ``peer`` (the rows of ``owned_after``, its
    slots after the change), complete (raises otherwise: the migration then fails before
    its fence, and the old layout stays). ``wait=0``: only start it (returns -1 unless
    it is complete already). Waits in pieces (asked again, the PS only waits), so that
    ``stopping()`` ends the wait (``MigrationCancelled``)."""
    deadline = time.monotonic() + wait
    while True:
        piece = min(PREPARE_POLL_SECONDS, max(0.0, deadline - time.monotonic()))
        r = fleet.prepare_replica(address, ps_id, peer, piece, owned_after)
        if not wait or r.complete:
            return int(r.sequence)
        if stopping():
            raise MigrationCancelled("the AIMaster is stopping")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the copy of {address} on {peer}, its ring peer after the "
                               f"change, was not complete within {wait:.0f} s")


CURRENT_WAIT_SECONDS = 300.0  # a copy's deltas of a PS's imports, shipped paced
CURRENT_POLL_SECONDS = 0.05


def _current(fleet: "PsFleet", address: str, ps_id: str, peer: str, owned_after: np.ndarray,
             stopping: Callable[[], bool] = lambda: False,
             wait: float | None = None) -> int:
    """Until the (complete) copy of the PS at ``address`` on ``peer`` is current to the
    sequence number that PS has now; returns the sequence it is current to. Raises like
    :func:`_prepare` (the migration then fails before its fence)."""
    wait = CURRENT_WAIT_SECONDS if wait is None else wait
    target = fleet.stats(address, timeout=10, replication_only=True).sequence
    deadline = time.monotonic() + wait
    while True:
        seq = _prepare(fleet, address, ps_id, peer, owned_after,
                       wait=max(0.0, deadline - time.monotonic()), stopping=stopping)
        if seq >= target:
            return seq
        if stopping():
            raise MigrationCancelled("the AIMaster is stopping")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the copy of {address} on {peer}, its ring peer after the "
                               f"change, was not current within {wait:.0f} s (at {seq}, "
                               f"its PS at {target})")
        time.sleep(CURRENT_POLL_SECONDS)


def _cancel_prepared(fleet: "PsFleet", addresses: dict,
                     stopping: Callable[[], bool] = lambda: False) -> None:
    """After a failed migration: the copies prepared for the new ring are dropped (best
    effort: left, a copy is shipped deltas until the next routing push)."""
    for ps_id, address in addresses.items():
        try:
            fleet.prepare_replica(address, ps_id, "", 0.0)
        except Exception:  # noqa: BLE001 - a PS that is gone has nothing to drop
            log.info("could not drop the copy %s prepared", ps_id, exc_info=not stopping())


DROP_RETRY_SECONDS = (0.2, 1.0)  # short: a queued recovery waits behind this operation


def _drop_with_retries(fleet: "PsFleet", address: str, mask: np.ndarray,
                       num_slots: int, stopping: Callable[[], bool] = lambda: False) -> int | None:
    """Drop the rows of ``mask``'s slots on a PS that does not own them, retried: left
    there, they are not just memory. A later promotion of those slots onto this PS, or a
    move of them back to it, would serve its stale copy of a key deleted meanwhile by the
    owner. Returns the rows dropped, or None when every attempt failed (logged). One
    attempt only once the AIMaster is stopping (its members stop with it)."""
    for attempt, pause in enumerate((0.0, *DROP_RETRY_SECONDS)):
        time.sleep(pause)
        try:
            return fleet.drop_slots(address, mask, num_slots)
        except Exception:  # noqa: BLE001 - retried, then reported
            last = attempt == len(DROP_RETRY_SECONDS) or stopping()
            log.warning("could not drop rows of slots it does not own on %s (attempt %d)",
                        address, attempt + 1, exc_info=last and not stopping())
            if last:
                break
    return None


def _drop_copied(fleet: "PsFleet", masks: dict, address: dict, num_slots: int,
                 stopping: Callable[[], bool] = lambda: False) -> None:
    """After a failed migration (the old layout in force again): the destinations drop
    what the snapshot and catch-up rounds copied to them, rows of slots they never
    owned. A destination that is gone (a new PS the caller retires) is skipped."""
    by_dst: dict[str, np.ndarray] = {}
    for (_, dst), mask in masks.items():
        by_dst[dst] = by_dst[dst] | mask if dst in by_dst else mask.copy()
    for dst, mask in by_dst.items():
        _drop_with_retries(fleet, address[dst], mask, num_slots, stopping)
