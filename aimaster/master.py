"""The AIMaster: owns one job's membership, routing, data shards and lifecycle.

Built by injection from a JobConfig, a Scaler and a clock. Watchers (scaler exits, lease
expiry) report; ``_tick`` decides; the scaler acts. Every change of job state is written
durably to ``<state_dir>/job_state.json`` before it is acknowledged.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from enum import Enum
from typing import Callable

import grpc
import numpy as np

from aimaster.config import JobConfig
from aimaster.registry import Member, MemberState, Registry
from aimaster.scaler import NodeState, ScalePlan, Scaler, create_scaler
from aimaster.shards import ShardQueue, ShardState, make_shards
from aimaster.state import StateStore
from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.grpc_util import create_server, insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc

log = logging.getLogger("aimaster")


class JobPhase(str, Enum):
    """STARTING (waiting for every PS) -> RUNNING -> SUCCEEDED | FAILED | STOPPED."""
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


FINAL_PHASES = (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


class JobMaster:
    def __init__(self, config: JobConfig, scaler_factory: Callable[[str, JobConfig], Scaler] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self.registry = Registry(config.lease_seconds, clock)
        self.store = StateStore(config.state_dir)
        self.phase = JobPhase.STARTING
        self.message = ""
        self.routing: RoutingTable | None = None
        self.epoch = 0
        self.events: list[dict] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._scaler_factory = scaler_factory or (
            lambda address, cfg: create_scaler("local", master_address=address, config=cfg,
                                               log_dir=os.path.join(cfg.state_dir, "logs")))
        self.scaler: Scaler | None = None
        self.server: grpc.Server | None = None
        self.address = ""
        self.shards = self._load_shards()
        self._last_progress = 0.0
        self._workers_started = False
        self._last_samples = (0, self.clock())

    # -- state ---------------------------------------------------------------------------
    def _load_shards(self) -> ShardQueue | None:
        files = self.config.data.resolved_files()
        previous = self.store.load()
        if previous and previous.get("phase") not in [p.value for p in FINAL_PHASES]:
            # The model of an interrupted run lived only in its PS processes; resuming its
            # data position without its model would skip data. Keep it aside, start over.
            os.replace(self.store.path, self.store.path + ".interrupted")
            log.warning("previous run of %s did not finish; its state is kept in %s.interrupted",
                        self.config.name, self.store.path)
        if not files:
            return None
        shards = make_shards(files, self.config.data.records_per_shard, self.config.data.epochs)
        log.info("data: %d files, %d records, %d shards x %d epoch(s)", len(files),
                 sum(s.records for s in shards), len(shards), self.config.data.epochs)
        return ShardQueue(shards)

    def _save(self) -> None:
        with self._lock:
            state = {
                "job_name": self.config.name, "phase": self.phase.value, "message": self.message,
                "epoch": self.epoch, "master_address": self.address,
                "routing": None if self.routing is None else {
                    "epoch": self.routing.epoch, "num_slots": self.routing.num_slots,
                    "ps_ids": list(self.routing.ps_ids),
                    "ps_addresses": list(self.routing.ps_addresses),
                    "slot_owner": self.routing.slot_owner.tolist()},
                "members": [self._member_dict(m) for m in self.registry.members()],
                "shards": self.shards.to_state() if self.shards else None,
                "events": self.events[-200:],
            }
        self.store.save(state)

    def _event(self, kind: str, **fields) -> None:
        with self._lock:
            self.events.append({"kind": kind, "time": time.time(), **fields})
        log.info("event %s %s", kind, fields)

    def _set_phase(self, phase: JobPhase, message: str = "") -> None:
        with self._lock:
            if self.phase in FINAL_PHASES:
                return
            self.phase, self.message = phase, message
        self._event("phase", phase=phase.value, message=message)
        self._save()

    @staticmethod
    def _member_dict(m: Member) -> dict:
        return {"role": m.role, "id": m.id, "pid": m.pid, "address": m.address,
                "state": m.state.value, "steps": m.steps, "samples": m.samples}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        """Bind the service, start the PS; returns the AIMaster address."""
        self.server, port = create_server(f"{self.config.host}:{self.config.port}")
        master_pb2_grpc.add_MasterServicer_to_server(MasterServicer(self), self.server)
        self.server.start()
        self.address = f"{self.config.host}:{port}"
        with open(os.path.join(self.config.state_dir, "master.addr.tmp"), "w") as f:
            f.write(self.address)
        os.replace(os.path.join(self.config.state_dir, "master.addr.tmp"),
                   os.path.join(self.config.state_dir, "master.addr"))
        self.scaler = self._scaler_factory(self.address, self.config)
        self._save()
        self.scaler.apply(ScalePlan(ps=self.config.ps.replicas, workers=0))
        return self.address

    def run(self, on_progress: Callable[[str], None] | None = None) -> int:
        """Drive the job until it ends or ``stop()``; returns the process exit code."""
        deadline = self.clock() + self.config.ps_start_timeout
        try:
            while not self._stop.is_set():
                self._tick(deadline)
                if self.phase in FINAL_PHASES:
                    break
                if on_progress and self.phase == JobPhase.RUNNING and \
                        self.clock() - self._last_progress >= self.config.progress_seconds:
                    self._last_progress = self.clock()
                    on_progress(self.progress_line())
                self._stop.wait(0.2)
            if self.phase not in FINAL_PHASES:
                self._set_phase(JobPhase.STOPPED, "stopped by signal")
        finally:
            self.shutdown()
        return 0 if self.phase in (JobPhase.SUCCEEDED, JobPhase.STOPPED) else 1

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        if self.scaler is not None:
            self.scaler.shutdown()
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None

    # -- decisions ---------------------------------------------------------------------------
    def _tick(self, ps_deadline: float) -> None:
        for node in self.scaler.poll_exits():
            state = MemberState.SUCCEEDED if (node.role == "worker" and node.exit_code == 0) \
                else MemberState.DEAD
            if self.registry.get(node.id) is None:  # died before it registered
                self.registry.register(node.role, node.id, node.pid, "")
            if self.registry.mark(node.id, state) is not None or state == MemberState.DEAD:
                self._on_member_end(node.id, node.role, state, f"exit code {node.exit_code}")
        for m in self.registry.expire():
            self._on_member_end(m.id, m.role, MemberState.DEAD, "lease expired")
        if self.phase == JobPhase.STARTING:
            if self.routing is None and self.clock() > ps_deadline:
                ready = len(self._live_ps())
                self._set_phase(JobPhase.FAILED,
                                f"only {ready}/{self.config.ps.replicas} PS registered within "
                                f"{self.config.ps_start_timeout:.0f}s; see {self.config.state_dir}/logs")
            return
        if self.phase == JobPhase.RUNNING and self.config.worker.replicas > 0:
            if not self._workers_started:
                # Launch from this (main) thread: children die with the thread that forked
                # them (PR_SET_PDEATHSIG), so never fork from a short-lived RPC thread.
                self._workers_started = True
                self.scaler.apply(ScalePlan(workers=self.config.worker.replicas))
                return
            self._check_done()

    def _live_ps(self) -> list[Member]:
        return [m for m in self.registry.members("ps") if m.state == MemberState.RUNNING and m.address]

    def _on_member_end(self, member_id: str, role: str, state: MemberState, why: str) -> None:
        if role == "worker":
            returned = self.shards.give_back(member_id) if self.shards else []
            self._event("worker_end", id=member_id, state=state.value, reason=why,
                        returned_shards=returned)
            if state == MemberState.DEAD and self.phase == JobPhase.RUNNING:
                self._maybe_restart(member_id)
        elif role == "ps":
            self._event("ps_end", id=member_id, state=state.value, reason=why)
            if self.phase in (JobPhase.STARTING, JobPhase.RUNNING):
                # Without a peer replica (fault-tolerance issue) a dead PS's rows are gone;
                # restarting it empty would silently lose the model, so fail loudly.
                self._set_phase(JobPhase.FAILED, f"{member_id} died ({why}); its rows have no replica")
        self._save()

    def _maybe_restart(self, member_id: str) -> None:
        node = next((n for n in self.scaler.nodes() if n.id == member_id), None)
        if node is None:
            return
        if node.state == NodeState.RUNNING:  # lease expired but process alive: hung; replace it
            self.scaler.kill(member_id)
            return  # its exit is seen next tick, then restarted
        if node.restarts >= self.config.worker.max_restarts:
            self._event("worker_gave_up", id=member_id, restarts=node.restarts)
            return
        info = self.scaler.restart(member_id)
        self._event("worker_restart", id=member_id, pid=info.pid, restarts=info.restarts)

    def _check_done(self) -> None:
        nodes = [n for n in self.scaler.nodes() if n.role == "worker"]
        running = [n for n in nodes if n.state == NodeState.RUNNING]
        if running:
            return
        failed = [n.id for n in nodes if n.state == NodeState.FAILED]
        if self.shards is not None and not self.shards.finished():
            c = self.shards.counts()
            self._set_phase(JobPhase.FAILED,
                            f"all workers exited with {c['todo'] + c['doing']} shards unprocessed"
                            + (f"; failed: {failed}" if failed else ""))
        elif failed:
            self._set_phase(JobPhase.FAILED, f"workers failed: {failed}")
        else:
            self._set_phase(JobPhase.SUCCEEDED, "all shards done" if self.shards else "workers finished")

    def on_ps_registered(self) -> None:
        """Publish routing once every PS is up, then start the workers."""
        with self._lock:
            if self.routing is not None:
                return
            ps = self._live_ps()
            if len(ps) < self.config.ps.replicas:
                return
            ps = sorted(ps, key=lambda m: m.rank)[: self.config.ps.replicas]
            routing = RoutingTable.even([m.id for m in ps], [m.address for m in ps],
                                        self.config.num_slots, self.epoch + 1)
        self._push_routing(routing)
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        self._event("routing", epoch=routing.epoch, ps=list(routing.ps_ids))
        self._set_phase(JobPhase.RUNNING)

    def _push_routing(self, routing: RoutingTable) -> None:
        for p, address in enumerate(routing.ps_addresses):
            owned = (routing.slot_owner == p).astype(np.uint8)
            with insecure_channel(address) as ch:
                ps_pb2_grpc.ParameterServerStub(ch).SetRouting(ps_pb2.SetRoutingRequest(
                    epoch=routing.epoch, num_slots=routing.num_slots, owned_slots=owned.tobytes()),
                    timeout=10, wait_for_ready=True)

    # -- reporting ---------------------------------------------------------------------------
    def progress_line(self) -> str:
        workers = [m for m in self.registry.members("worker")]
        samples = sum(m.samples for m in workers)
        prev_samples, prev_t = self._last_samples
        now = self.clock()
        rate = (samples - prev_samples) / max(now - prev_t, 1e-6)
        self._last_samples = (samples, now)
        live = sum(1 for m in workers if m.state == MemberState.RUNNING)
        parts = [f"[{self.config.name}] epoch {self.epoch}", f"ps {len(self._live_ps())}",
                 f"workers {live}", f"samples {samples}", f"{rate:,.0f} samples/s"]
        if self.shards:
            c = self.shards.counts()
            total = c["todo"] + c["doing"] + c["done"]
            parts.insert(1, f"shards {c['done']}/{total} done ({c['doing']} in progress)")
        return " | ".join(parts)

    def status(self) -> master_pb2.StatusResponse:
        now = self.clock()
        members = [master_pb2.Member(role=m.role, id=m.id, pid=m.pid, address=m.address,
                                     state=m.state.value, last_heartbeat_age=now - m.last_heartbeat,
                                     steps=m.steps, samples=m.samples)
                   for m in self.registry.members()]
        counts = self.shards.counts() if self.shards else {"todo": 0, "doing": 0, "done": 0}
        return master_pb2.StatusResponse(
            job_name=self.config.name, epoch=self.epoch, phase=self.phase.value, members=members,
            shards=master_pb2.ShardCounts(**counts), state_dir=os.path.abspath(self.config.state_dir),
            uptime_seconds=now - self.started_at)


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, master: JobMaster):
        self.m = master

    def Register(self, request, context):
        if request.role not in ("ps", "worker", "client"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"role must be 'ps', 'worker' or 'client', got {request.role!r}")
        if request.role == "ps" and not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a PS must register with its address")
        try:
            member = self.m.registry.register(request.role, request.id, request.pid, request.address)
        except ValueError as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        self.m._event("register", id=member.id, role=member.role, pid=member.pid,
                      address=member.address)
        self.m._save()
        if member.role == "ps":
            threading.Thread(target=self.m.on_ps_registered, daemon=True).start()
        cfg = self.m.config
        return master_pb2.RegisterResponse(id=member.id, lease_seconds=cfg.lease_seconds,
                                           heartbeat_seconds=cfg.heartbeat_seconds,
                                           epoch=self.m.epoch, rank=member.rank, job_name=cfg.name)

    def Heartbeat(self, request, context):
        member = self.m.registry.heartbeat(request.id, request.steps, request.samples)
        return master_pb2.HeartbeatResponse(epoch=self.m.epoch, known=member is not None,
                                            stop=self.m.phase in FINAL_PHASES)

    def Deregister(self, request, context):
        member = self.m.registry.mark(request.id, MemberState.LEFT)
        if member is not None and member.role == "worker" and self.m.shards:
            returned = self.m.shards.give_back(request.id)
            self.m._event("worker_left", id=request.id, reason=request.reason,
                          returned_shards=returned)
            self.m._save()
        return master_pb2.DeregisterResponse()

    def GetRouting(self, request, context):
        routing = self.m.routing
        if routing is None:
            ready = len(self.m._live_ps())
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"routing not ready: {ready}/{self.m.config.ps.replicas} PS registered")
        return routing.to_proto()

    def GetShard(self, request, context):
        if self.m.shards is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this job has no data section: no shards to hand out")
        member = self.m.registry.get(request.worker_id)
        if member is None or member.state != MemberState.RUNNING:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker {request.worker_id!r} is not a registered live member")
        state, shard = self.m.shards.assign(request.worker_id)
        if state == ShardState.DOING:
            self.m._save()
            return master_pb2.GetShardResponse(
                status=master_pb2.GetShardResponse.SHARD,
                shard=master_pb2.Shard(shard_id=shard.shard_id, path=os.path.abspath(shard.path),
                                       start=shard.start, end=shard.end, data_epoch=shard.data_epoch))
        status = master_pb2.GetShardResponse.FINISHED if state == ShardState.DONE \
            else master_pb2.GetShardResponse.WAIT
        return master_pb2.GetShardResponse(status=status)

    def ReportShard(self, request, context):
        if self.m.shards is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job has no data section")
        taken = self.m.shards.complete(request.worker_id, request.done_shard_ids)
        missing = sorted(set(request.done_shard_ids) - set(taken))
        if request.returned_shard_ids:
            self.m.shards.give_back(request.worker_id, request.returned_shard_ids)
        self.m._save()
        if missing:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards {missing} are not DOING for {request.worker_id!r} "
                          "(reassigned after a lease loss?)")
        return master_pb2.ReportShardResponse()

    def Status(self, request, context):
        return self.m.status()
