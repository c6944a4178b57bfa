"""Consistent (sync) mode on the AIMaster: virtual workers placed on physical workers.

A job with ``consistency: {mode: sync, virtual_workers: V}`` trains as if V workers ran in
lockstep, whatever the number of physical workers. This plugin serves ``SyncCoordinator``
next to the Master service:

- ``StepBarrier`` is the step boundary. Each physical worker arrives with the state of
  the virtual workers it hosted (data position, random state, next step); when every
  expected worker has arrived, the placement of the V virtual workers over the workers
  present is recomputed and each worker gets its virtual workers and their states back.
  Joins, leaves and deaths take effect only here. A virtual worker whose host died
  mid-step keeps its last committed state and is re-run by its new host first (its PS
  contributions are idempotent per (step, virtual rank), so nothing counts twice).
- ``VirtualShards`` is the data-shard service by virtual rank: shard i belongs to virtual
  rank i % V, and a rank consumes exactly ``micro_batch`` records per step.
- Table rows move between PS (scale, rebalance, from the CLI or the autoscaler) only at a
  step boundary with nothing pending: ``around_migration`` holds the barrier for the
  live migration, then releases it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np

from aimaster.migration import MigrationError
from aimaster.plugins import MasterPlugin
from aimaster.registry import MemberState
from aimaster.shards import virtual_rank_shards
from deeprec_ext.data import fs as data_fs
from deeprec_ext.data.ranges import BadInput, read_shard
from deeprec_ext.proto import master_pb2, sync_pb2, sync_pb2_grpc

if TYPE_CHECKING:  # pragma: no cover
    from aimaster.config import ConsistencyConfig, JobConfig
    from aimaster.view import JobView

log = logging.getLogger("aimaster.consistent")

_Status = sync_pb2.StepBarrierResponse


class StepCoordinator(sync_pb2_grpc.SyncCoordinatorServicer):
    """Barrier state machine. One round per global step r: it completes when every
    expected worker arrived ready for r; the answer tells each what to run."""

    POLL_SECONDS = 1.0  # a barrier call returns WAIT after this long (keeps RPC threads free)

    def __init__(self, config: "ConsistencyConfig"):
        self.virtual_workers = config.virtual_workers
        self.seed = config.seed
        self.max_steps = config.steps
        self.master: "JobView | None" = None
        self._cond = threading.Condition()
        self.round = 0  # the step the open round will start
        self.vw = {r: (0, "") for r in range(self.virtual_workers)}  # rank -> (step, state)
        self.hosts: dict[int, str] = {}
        self._arrived: dict[str, sync_pb2.StepBarrierRequest] = {}
        self._answers: dict[str, tuple[int, sync_pb2.StepBarrierResponse]] = {}
        self._first_arrival = 0.0
        self.micro_batch = 0
        self.finished = False
        self._holds = 0
        self.held = False
        self.changes = 0
        self.generation = 0
        self._shards: list[list] = []  # per rank: [(shard id, cumulative end)]
        self._marked = [0] * self.virtual_workers

    # -- data by virtual rank ------------------------------------------------------------
    def attach(self, master: "JobView") -> None:
        self.master = master
        shards = master.all_shards()
        for r in range(self.virtual_workers):
            mine = virtual_rank_shards(shards, r, self.virtual_workers)
            ends = np.cumsum([self._records_of(s) for s in mine]).tolist()
            self._shards.append(list(zip([s.shard_id for s in mine], ends)))

    @staticmethod
    def _records_of(shard) -> int:
        """Records of a shard: the step barrier needs every virtual rank's record count, so
        sync mode reads its shards once at start (async mode never reads data files)."""
        try:
            return len(read_shard(shard.path, shard.start, shard.end, shard.format, shard.size)[0])
        except BadInput as exc:  # no skip here: every rank's data must be known at start
            raise RuntimeError(f"data: bad input, {exc} (sync mode reads every shard at start "
                               "and does not skip bad records)") from None

    def _total(self, rank: int) -> int:
        return self._shards[rank][-1][1] if self._shards[rank] else 0

    def VirtualShards(self, request, context):
        r = request.virtual_rank
        if not 0 <= r < self.virtual_workers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"virtual_rank {r} is outside [0, {self.virtual_workers})")
        if not self.master.has_data:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job has no data section")
        out = [master_pb2.Shard(shard_id=s.shard_id, path=data_fs.absolute(s.path), start=s.start,
                                end=s.end, data_epoch=s.data_epoch, size=s.size, format=s.format)
               for s in virtual_rank_shards(self.master.all_shards(), r, self.virtual_workers)]
        return sync_pb2.VirtualShardsResponse(shards=out)

    # -- the barrier -------------------------------------------------------------------------
    def StepBarrier(self, request, context):
        m = self.master
        member = m.member(request.worker_id)
        if member is None or member.role != "worker" or member.state != MemberState.RUNNING:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{request.worker_id!r} is not a live registered worker")
        if request.micro_batch <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"micro_batch must be positive, got {request.micro_batch}")
        for s in request.states:
            if not 0 <= s.virtual_rank < self.virtual_workers:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"virtual rank {s.virtual_rank} is outside [0, {self.virtual_workers})")
        deadline = time.monotonic() + self.POLL_SECONDS
        wid = request.worker_id
        with self._cond:
            if self.micro_batch and request.micro_batch != self.micro_batch:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"micro_batch {request.micro_batch} differs from the job's "
                              f"{self.micro_batch}: every worker must use the same")
            self.micro_batch = self.micro_batch or request.micro_batch
            if self.finished:
                return self._finished_answer(wid)
            done = self._answers.get(wid)
            if done is not None and request.generation < done[1].generation:
                return done[1]  # released while it was between two polls
            if wid in self._arrived:  # a re-poll after WAIT
                return self._await(wid, deadline)
            if request.step >= 0 and request.step != self.round:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{wid} is ready for step {request.step} but the open boundary "
                              f"is step {self.round}")
            for s in request.states:  # only the placement we gave it counts
                if self.hosts.get(s.virtual_rank) != wid:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{wid} reports virtual rank {s.virtual_rank}, "
                                  f"hosted by {self.hosts.get(s.virtual_rank)!r}")
            if not self._arrived:
                self._first_arrival = time.monotonic()
            self._arrived[wid] = request
            self._answers.pop(wid, None)
            return self._await(wid, deadline)

    def _await(self, wid: str, deadline: float) -> sync_pb2.StepBarrierResponse:
        """Wait (holding _cond) for the open round to answer ``wid``, at most until deadline."""
        while True:
            self._try_complete()
            if self.finished:
                return self._finished_answer(wid)
            done = self._answers.get(wid)
            if done is not None:
                return done[1]
            left = deadline - time.monotonic()
            if left <= 0:
                return sync_pb2.StepBarrierResponse(status=_Status.WAIT, step=self.round)
            self._cond.wait(min(left, 0.1))

    def _expected(self) -> set[str]:
        m = self.master
        live = {w.id for w in m.members("worker") if w.state == MemberState.RUNNING}
        present = {w.id for w in m.live_workers()}  # running and not being scaled in
        return (set(self.hosts.values()) & live) | present

    def _try_complete(self) -> None:
        """Release the open round if everyone expected is here (caller holds _cond)."""
        if not self._arrived or self.held:
            return
        expected = self._expected()
        if not expected <= set(self._arrived):
            return
        if self._holds:  # a PS change waits for this boundary: nothing is pending now
            self.held = True
            self._cond.notify_all()
            return
        m = self.master
        leaving_ids = m.leaving()
        arrived = dict(self._arrived)
        for wid, req in arrived.items():
            for s in req.states:
                self.vw[s.virtual_rank] = (s.step, s.state_json)
        dead = [w for w in arrived if w not in expected]  # arrived, then died or left
        staying = sorted((w for w in arrived if w not in dead and w not in leaving_ids
                          and not arrived[w].leaving),
                         key=lambda w: (m.member(w).rank, w))
        if not staying:
            # everyone here is leaving: answer them, keep the virtual workers' states for
            # whoever joins next
            self.generation += 1
            self._answers = {}
            for wid in arrived:
                self._answers[wid] = (self.round, sync_pb2.StepBarrierResponse(
                    status=_Status.LEAVE, step=self.round, generation=self.generation))
            self.hosts = {}
            self._arrived = {}
            self._cond.notify_all()
            return
        lagging = [r for r, (step, _) in self.vw.items() if step < self.round]
        target = self.round - 1 if lagging else self.round
        if not lagging and self._should_finish(self.round):
            self._finish(arrived)
            return
        old_hosts = dict(self.hosts)
        self._answers = {}  # answers nobody picked up belong to workers gone since
        self.generation += 1
        blocks = np.array_split(np.arange(self.virtual_workers), len(staying))
        self.hosts = {int(r): w for w, blk in zip(staying, blocks) for r in blk}
        epoch = m.epoch
        for wid in arrived:
            if wid not in staying:
                self._answers[wid] = (self.round, sync_pb2.StepBarrierResponse(
                    status=_Status.LEAVE, step=self.round, generation=self.generation))
                continue
            states = [sync_pb2.VirtualWorkerState(virtual_rank=r, step=self.vw[r][0],
                                                  state_json=self.vw[r][1])
                      for r in sorted(self.hosts) if self.hosts[r] == wid]
            self._answers[wid] = (self.round, sync_pb2.StepBarrierResponse(
                status=_Status.RUN, step=target, states=states,
                virtual_workers=self.virtual_workers, routing_epoch=epoch, seed=self.seed,
                primary=self.hosts.get(0) == wid, generation=self.generation))
        wait_ms = (time.monotonic() - self._first_arrival) * 1000
        if old_hosts != self.hosts:
            self.changes += 1
            moved = sorted(r for r in self.hosts if old_hosts.get(r) != self.hosts[r])
            m.record_event("sync_membership", step=self.round, workers=staying, moved_virtual=moved,
                     lagging=lagging, boundary_wait_ms=round(wait_ms, 1))
        if not lagging:
            self._mark_shards(self.round)
            self.round += 1
        self._arrived = {}
        self._cond.notify_all()

    def _should_finish(self, step: int) -> bool:
        if self.max_steps and step >= self.max_steps:
            return True
        need = (step + 1) * self.micro_batch
        return any(self._total(r) < need for r in range(self.virtual_workers))

    def _mark_shards(self, step: int) -> None:
        """Shards whose records were all trained by the end of step - 1 become DONE."""
        consumed = step * self.micro_batch
        done = []
        for r in range(self.virtual_workers):
            shards = self._shards[r]
            k = self._marked[r]
            while k < len(shards) and shards[k][1] <= consumed:
                done.append(shards[k][0])
                k += 1
            self._marked[r] = k
        if done:
            self.master.complete_shards(done)

    def _finish(self, arrived: dict) -> None:
        self._mark_shards(self.round)
        dropped = sum(self._total(r) - self.round * self.micro_batch
                      for r in range(self.virtual_workers))
        # records that do not fill a whole step (or lie past the step limit) are not
        # trained: every layout stops at the same step
        rest = [sid for r in range(self.virtual_workers) for sid, _ in self._shards[r][self._marked[r]:]]
        self.finished = True
        self.master.record_event("sync_finished", steps=self.round, untrained_records=int(dropped),
                                 membership_changes=self.changes)
        self.master.complete_shards(rest)  # persists the job state, the event with it
        self._arrived = {}
        self._cond.notify_all()

    def _finished_answer(self, wid: str) -> sync_pb2.StepBarrierResponse:
        states = [sync_pb2.VirtualWorkerState(virtual_rank=r, step=s, state_json=j)
                  for r, (s, j) in sorted(self.vw.items()) if self.hosts.get(r) == wid]
        return sync_pb2.StepBarrierResponse(
            status=_Status.FINISHED, step=self.round, states=states,
            virtual_workers=self.virtual_workers, routing_epoch=self.master.epoch,
            seed=self.seed, primary=self.hosts.get(0) == wid, generation=self.generation)

    # -- holding a boundary for a PS change ---------------------------------------------------
    def hold(self, timeout: float) -> float:
        """Stop at the next step boundary (every step applied, nothing in flight); returns
        how long it took (ms). Raises TimeoutError (after un-holding) if it is not reached."""
        start = time.monotonic()
        deadline = start + timeout
        with self._cond:
            self._holds += 1
            while not self.held:
                if self.finished or not self._expected() and not self._arrived:
                    self.held = True  # no worker is training: nothing can be pending
                    break
                self._try_complete()
                if self.held:
                    break
                if time.monotonic() > deadline:
                    self._holds -= 1
                    raise TimeoutError(f"no step boundary within {timeout:.0f}s (step "
                                       f"{self.round}; waiting for "
                                       f"{sorted(self._expected() - set(self._arrived))})")
                self._cond.wait(0.05)
        return (time.monotonic() - start) * 1000

    def release(self) -> None:
        with self._cond:
            self._holds -= 1
            if not self._holds:
                self.held = False
                self._try_complete()
            self._cond.notify_all()

    def summary(self) -> dict:
        with self._cond:
            return {"mode": "sync", "virtual_workers": self.virtual_workers, "step": self.round,
                    "finished": self.finished, "held": self.held, "micro_batch": self.micro_batch,
                    "hosts": {str(r): w for r, w in sorted(self.hosts.items())},
                    "membership_changes": self.changes}


class ConsistentModePlugin(MasterPlugin):
    name = "consistent"

    def __init__(self, config: "ConsistencyConfig"):
        self.coordinator = StepCoordinator(config)

    @contextlib.contextmanager
    def around_migration(self, master, timeout: float = 300.0):
        """Rows move only while the step barrier is held: no contribution is buffered on
        any PS, so a migration never splits a step. Training pauses for the migration
        alone (a new PS has already started and registered)."""
        try:
            waited = self.coordinator.hold(timeout)
        except TimeoutError as exc:
            # the scale's own clean-up (new PS stopped, old layout kept) runs on this
            raise MigrationError(f"sync mode: {exc}") from exc
        step, held_at = self.coordinator.round, time.monotonic()
        log.info("step boundary %d held for a PS change (reached in %.0f ms)", step, waited)
        try:
            yield
        finally:
            self.coordinator.release()
            master.record_event("sync_hold", step=step, reached_ms=round(waited, 1),
                          paused_ms=round((time.monotonic() - held_at) * 1000, 1))

    def on_start(self, master, server) -> None:
        self.coordinator.attach(master)
        sync_pb2_grpc.add_SyncCoordinatorServicer_to_server(self.coordinator, server)

    def on_tick(self, master) -> None:
        # a host that died is no longer expected: re-check the open round
        with self.coordinator._cond:
            self.coordinator._cond.notify_all()

    def on_status(self, master, response) -> None:
        response.sync_json = json.dumps(self.coordinator.summary(), sort_keys=True)


def create(config: "JobConfig") -> ConsistentModePlugin | None:
    if config.consistency.mode != "sync":
        return None
    return ConsistentModePlugin(config.consistency)
