"""The AIMaster: owns one job's membership, routing, data shards and lifecycle.

Built by injection from a JobConfig, a Scaler and a clock. Watchers (scaler exits, lease
expiry) report; ``_tick`` decides; the scaler acts. Every change of job state is written
durably to ``<state_dir>/job_state.json`` before it is acknowledged.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Callable

import grpc
import numpy as np

from aimaster import placement
from aimaster.config import JobConfig
from aimaster.migration import MigrationError, migrate
from aimaster.registry import Member, MemberState, Registry
from aimaster.scaler import NodeState, ScalePlan, Scaler, create_scaler
from aimaster.shards import ShardQueue, ShardState, make_shards
from aimaster.state import StateStore
from deeprec_ext.client.routing import RoutingTable, rebalance
from aimaster.plugins import MasterPlugin, load_plugins
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


class ScaleRefused(ValueError):
    """A request for a change (scale, rebalance, checkpoint) that cannot be carried out
    now or at all; nothing was changed. Callers decide by type, never by message:

    - :class:`Busy`: another operation (scale, checkpoint, recovery) is running: try again;
    - :class:`NotRunning`: the job is not running (starting, or over);
    - the base class: the request itself is wrong (out of bounds, missing config).
    """


class Busy(ScaleRefused):
    """Another operation holds the job; the same request may succeed later."""


class NotRunning(ScaleRefused):
    """The job is not running."""


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
        # the job completes by itself only while it has workers to run (0: PS-only job)
        self._worker_target = config.worker.replicas
        self._ps_target = config.ps.replicas  # what replacements restore after a PS loss
        self._scale_lock = threading.Lock()
        self._leaving: set[str] = set()
        self._main_calls: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stall_reports: list[tuple[float, float]] = []
        self._barrier_cond = threading.Condition()
        self._barrier_gen = 0
        self._barrier_arrived: set[str] = set()
        self._barrier_members: set[str] = set()
        self.checkpoint_dir = config.checkpoint_dir or os.path.join(config.state_dir, "checkpoints")
        self._ckpt_lock = threading.Lock()
        self._ckpt_chain: dict | None = None  # {"id", "since": {(ps id, pid): {table: seq}}, "n"}
        self._last_ckpt = self.clock()
        self._last_samples = (0, self.clock())
        self.plugins: list[MasterPlugin] = load_plugins(config)
        self._signalled = False
        self._warm_tables: set | None = None  # tables of the init_from checkpoint
        self.final_checkpoint = ""   # directory of the final checkpoint, once taken
        self.export_dir = ""         # the SavedModel exported after it

    # -- state ---------------------------------------------------------------------------
    def _load_shards(self) -> ShardQueue | None:
        files = self.config.data.resolved_files()
        previous = self.store.load()
        self._resume_from = None
        self._step_base = 0  # global step carried by the checkpoint this job started from
        self.model_spec = (previous or {}).get("model") if previous and \
            previous.get("phase") not in [p.value for p in FINAL_PHASES] else None
        if previous and previous.get("phase") not in [p.value for p in FINAL_PHASES]:
            head = self._newest_checkpoint_in(self.config.checkpoint_dir
                                              or os.path.join(self.config.state_dir, "checkpoints"))
            extra = head.manifest.get("extra", {}) if head is not None else {}
            if head is not None and extra.get("job") == self.config.name:
                # resume: the model from the newest checkpoint, and the data position that
                # was recorded with it (shards DOING then are handed out again)
                self._resume_from = head.id
                self._step_base = int(extra.get("global_step", 0))
                self.model_spec = self.model_spec or extra.get("model")
                self.epoch = int(previous.get("epoch", 0))
                log.warning("resuming job %s from checkpoint %d", self.config.name, head.id)
                if extra.get("shards"):
                    return ShardQueue.from_state(extra["shards"])
            else:
                # without a checkpoint the model of the interrupted run is gone; resuming its
                # data position without its model would skip data: keep it aside, start over
                os.replace(self.store.path, self.store.path + ".interrupted")
                log.warning("previous run of %s did not finish and left no checkpoint; its "
                            "state is kept in %s.interrupted", self.config.name, self.store.path)
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
                "global_step": self.global_step(),
                "model": self.model_spec,
                "final_checkpoint": self.final_checkpoint,
                "export_dir": self.export_dir,
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
        self.server, port = create_server(
            f"{self.config.host}:{self.config.port}",
            interceptors=[i for p in self.plugins for i in p.interceptors()])
        master_pb2_grpc.add_MasterServicer_to_server(MasterServicer(self), self.server)
        for plugin in self.plugins:
            plugin.on_start(self, self.server)
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

    def on_main(self, fn: Callable, timeout: float = 120.0):
        """Run ``fn`` on the main loop thread and return its result. Child processes must
        be forked from the main thread: PR_SET_PDEATHSIG ties them to the forking thread."""
        fut: Future = Future()
        self._main_calls.put((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def _drain_main_calls(self) -> None:
        while True:
            try:
                fn, fut = self._main_calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def run(self, on_progress: Callable[[str], None] | None = None) -> int:
        """Drive the job until it ends or ``stop()``; returns the process exit code."""
        deadline = self.clock() + self.config.ps_start_timeout
        try:
            while not self._stop.is_set() and not self._signalled:
                self._drain_main_calls()
                self._tick(deadline)
                self._maybe_periodic_checkpoint()
                for plugin in self.plugins:
                    self._run_hook(plugin, "on_tick")
                if self.phase in FINAL_PHASES:
                    if on_progress and self.phase == JobPhase.SUCCEEDED:
                        on_progress(self.progress_line())  # where the model is
                    break
                if on_progress and self.phase == JobPhase.RUNNING and \
                        self.clock() - self._last_progress >= self.config.progress_seconds:
                    self._last_progress = self.clock()
                    on_progress(self.progress_line())
                self._wake.wait(0.2)
                self._wake.clear()
            if self.phase not in FINAL_PHASES:
                self._set_phase(JobPhase.STOPPED, "stopped by signal")
        finally:
            self.shutdown()
        return 0 if self.phase in (JobPhase.SUCCEEDED, JobPhase.STOPPED) else 1

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def stop_from_signal(self) -> None:
        """For signal handlers: takes no lock (the main thread may hold the very Event
        lock a handler would need); the main loop sees the flag within 0.2 s."""
        self._signalled = True

    def _run_hook(self, plugin: MasterPlugin, hook: str, *args) -> None:
        # a failing plugin must not take the job down: log it and go on
        try:
            getattr(plugin, hook)(self, *args)
        except Exception:  # noqa: BLE001
            log.exception("plugin %s: %s failed", plugin.name, hook)

    def shutdown(self) -> None:
        for plugin in self.plugins:
            self._run_hook(plugin, "on_stop")
        if self.scaler is not None:
            self.scaler.shutdown(timeout=self.config.grace_seconds)
            for m in self.registry.members():
                self.registry.mark(m.id, MemberState.LEFT)
            self._save()
            try:
                os.remove(os.path.join(self.config.state_dir, "master.addr"))
            except FileNotFoundError:
                pass
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None

    # -- decisions ---------------------------------------------------------------------------
    def _tick(self, ps_deadline: float) -> None:
        for node in self.scaler.poll_exits():
            member = self.registry.get(node.id)
            if member is None:  # died before it registered
                member = self.registry.register(node.role, node.id, node.pid, "")
            if member.pid != node.pid and member.state == MemberState.RUNNING:
                continue  # an older process of a re-used id; the live one registered since
            if member.state in (MemberState.LEFT, MemberState.SUCCEEDED):
                # an expected exit (scale-in, finished worker) -- unless a worker left on
                # its own (preemption notice) while work remains: replace it
                if (node.role == "worker" and member.state == MemberState.LEFT
                        and node.id not in self._leaving and self.phase == JobPhase.RUNNING
                        and self.shards is not None and not self.shards.finished()):
                    info = self.scaler.restart(node.id)
                    self._event("worker_replaced", id=node.id, pid=info.pid, reason="left early")
                continue
            if member.state == MemberState.DEAD:  # lease expired earlier; now it is gone
                if node.role == "worker" and self.phase == JobPhase.RUNNING:
                    self._maybe_restart(node.id)
                continue
            state = MemberState.SUCCEEDED if (node.role == "worker" and node.exit_code == 0) \
                else MemberState.DEAD
            self.registry.mark(node.id, state)
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
        if self.phase == JobPhase.RUNNING and self._worker_target > 0:
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
            routing = self.routing
            if self.phase == JobPhase.RUNNING and routing is not None and member_id in routing.ps_ids:
                threading.Thread(target=self._recover_ps, args=(member_id, why), daemon=True,
                                 name=f"recover-{member_id}").start()
            elif self.phase == JobPhase.STARTING:
                self._set_phase(JobPhase.FAILED, f"{member_id} died while the job was starting ({why})")
        self._save()

    def _maybe_restart(self, member_id: str) -> None:
        node = next((n for n in self.scaler.nodes() if n.id == member_id), None)
        if node is None:
            return
        if node.state == NodeState.RUNNING:  # lease expired but process alive: hung; replace it
            self.scaler.kill(member_id)
            return  # its exit is seen next tick, then restarted
        if member_id in self._leaving:
            return
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
            if not self._keep_model():
                return
            self._set_phase(JobPhase.SUCCEEDED, "all shards done" if self.shards else "workers finished")

    def _keep_model(self) -> bool:
        """The job trained to the end: take the final checkpoint, then the export, before
        the PS stop. A failure here fails the job: its model would be lost."""
        if self.config.checkpoint_on_success:
            try:
                event = self.checkpoint(full=True, final=True)
            except Exception as exc:  # noqa: BLE001 - reported as the job's failure
                log.exception("final checkpoint failed")
                self._set_phase(JobPhase.FAILED, f"training finished but the final checkpoint "
                                f"failed: {exc}")
                return False
            self.final_checkpoint = event["path"]
        if self.config.export.dir:
            if not self.final_checkpoint:
                self._event("export_skipped", reason="checkpoint.on_success is false: "
                            "nothing to export from")
                return True
            try:
                self.export_dir = self._export(self.final_checkpoint)
            except Exception as exc:  # noqa: BLE001
                self._set_phase(JobPhase.FAILED, f"final checkpoint {self.final_checkpoint} "
                                f"written, but its export failed: {exc}")
                return False
        return True

    def _export(self, ckpt_path: str) -> str:
        """Export the final checkpoint in a child process (TensorFlow is not loaded in the
        AIMaster); into ``export.dir/<unix seconds>``, the versioned layout TF Serving
        watches."""
        import subprocess
        import sys
        ex = self.config.export
        out = os.path.join(os.path.abspath(ex.dir), str(int(time.time())))
        cmd = [sys.executable, "-m", "aimaster.cli", "export", ckpt_path, "--out", out,
               "--dtype", ex.dtype, "--json"]
        if ex.tables:
            cmd += ["--tables", ",".join(ex.tables)]
        if ex.min_count:
            cmd += ["--min-count", str(ex.min_count)]
        start = self.clock()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        log_path = os.path.join(self.config.state_dir, "logs", "export.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "w") as f:
            f.write(proc.stderr)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            said = [ln for ln in lines if ln.startswith("aimaster: error:")] or \
                [ln for ln in lines if "Error" in ln.split(":")[0]] or lines or ["(no output)"]
            raise RuntimeError(f"{said[-1]} (see {log_path})")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        self._event("export", dir=out, duration_ms=round((self.clock() - start) * 1000, 1),
                    bytes=summary.get("bytes"), tables=summary.get("tables"))
        return out

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
        if self._resume_from is not None:
            restored = self._restore_all(routing, os.path.abspath(self.checkpoint_dir),
                                         self._resume_from)
            self._event("resumed", checkpoint=self._resume_from, rows=restored,
                        shards=self.shards.counts() if self.shards else None)
        elif self.config.init_from:
            if not self._warm_start(routing):
                return
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        self._event("routing", epoch=routing.epoch, ps=list(routing.ps_ids))
        self._set_phase(JobPhase.RUNNING)

    def _restore_all(self, routing: RoutingTable, root: str, ckpt_id: int,
                     warm: bool = False) -> int:
        """Every PS loads the rows of its slots (in this job's slot space) from a checkpoint."""
        def one(p: int, address: str) -> int:
            mask = routing.slot_owner == p
            with insecure_channel(address) as ch:
                return ps_pb2_grpc.ParameterServerStub(ch).RestoreCheckpoint(
                    ps_pb2.RestoreCheckpointRequest(
                        root=root, ckpt_id=ckpt_id, slots=mask.astype(np.uint8).tobytes(),
                        num_slots=routing.num_slots, warm_start=warm,
                        reset_optimizer=warm and self.config.reset_optimizer),
                    timeout=3600).rows

        # all PS at once: each reads only the chunks of its slots
        with ThreadPoolExecutor(len(routing.ps_addresses)) as pool:
            return sum(pool.map(one, range(len(routing.ps_addresses)), routing.ps_addresses))

    def _warm_start(self, routing: RoutingTable) -> bool:
        """``init_from``: tables, optimizer slots and dense variables of another job's
        checkpoint, on this job's PS count and num_slots; data and shards are not carried."""
        from checkpoint import CheckpointError, list_chains
        from checkpoint.load import resolve
        start = self.clock()
        try:
            root, ckpt_id = resolve(self.config.init_from)
            chains = [c for c in list_chains(root, verify="manifest")
                      if ckpt_id is None or ckpt_id in c.ids]
            if not chains:
                raise CheckpointError(f"{self.config.init_from}: no restorable checkpoint")
            head = chains[0].head if ckpt_id is None else \
                next(c for c in chains[0].checkpoints if c.id == ckpt_id)
            rows = self._restore_all(routing, str(root.resolve()), head.id, warm=True)
        except (CheckpointError, OSError) as exc:
            self._set_phase(JobPhase.FAILED, f"init_from: {exc}")
            return False
        except grpc.RpcError as exc:
            self._set_phase(JobPhase.FAILED, f"init_from {self.config.init_from}: "
                            f"{exc.details()}")
            return False
        extra = head.manifest.get("extra", {})
        self._step_base = int(extra.get("global_step", 0))
        tables = sorted(t for t in head.manifest["tables"] if not t.startswith("dense/"))
        self._warm_tables = set(head.manifest["tables"])
        self._event("warm_start", checkpoint=str(head.path), rows=rows, tables=tables,
                    global_step=self._step_base, reset_optimizer=self.config.reset_optimizer,
                    from_num_slots=head.manifest["num_slots"], num_slots=routing.num_slots,
                    duration_ms=round((self.clock() - start) * 1000, 1))
        return True

    def _push_routing(self, routing: RoutingTable) -> None:
        """Ownership plus the replication ring (each PS's peer is the next PS in order)."""
        n = len(routing.ps_addresses)
        failed = []
        for p, address in enumerate(routing.ps_addresses):
            owned = (routing.slot_owner == p).astype(np.uint8)
            member = self.registry.get(routing.ps_ids[p])
            if member is not None and member.state != MemberState.RUNNING:
                failed.append(routing.ps_ids[p])  # dead too: its own recovery handles it
                continue
            try:
                with insecure_channel(address) as ch:
                    ps_pb2_grpc.ParameterServerStub(ch).SetRouting(ps_pb2.SetRoutingRequest(
                        epoch=routing.epoch, num_slots=routing.num_slots,
                        owned_slots=owned.tobytes(), ps_id=routing.ps_ids[p],
                        replica_peer=routing.ps_addresses[(p + 1) % n] if n > 1 else "",
                        replication_interval_ms=self.config.replication_interval_ms,
                        sync_replication=self.config.sync_replication),
                        timeout=10, wait_for_ready=True)
            except grpc.RpcError:
                # a PS that died while this routing was being built (two PS killed
                # together) is not an error here: its own recovery follows
                member = self.registry.get(routing.ps_ids[p])
                if member is not None and member.state != MemberState.RUNNING:
                    failed.append(routing.ps_ids[p])
                    continue
                raise
        return failed

    # -- elasticity ----------------------------------------------------------------------------
    def report_stall(self, stall_ms: float) -> None:
        if stall_ms > 0:
            with self._lock:
                self._stall_reports.append((self.clock(), stall_ms))
                del self._stall_reports[:-1000]

    def scale(self, ps: int | None = None, workers: int | None = None,
              timeout: float = 600.0) -> dict:
        """Change the PS and/or worker count of the running job; returns the event.

        Raises ScaleRefused (nothing changed) for counts out of bounds, a job that is not
        running, or while another scale event is in progress.
        """
        if not self._scale_lock.acquire(blocking=False):
            raise Busy("another scale event is in progress; try again when it is done")
        try:
            if self.phase != JobPhase.RUNNING:
                raise NotRunning(f"the job is {self.phase.value}, not running")
            cfg = self.config
            ps_before = len(self.routing.ps_ids)
            workers_before = len(self._live_workers())
            if ps is not None and not max(1, cfg.ps.min_replicas) <= ps <= cfg.ps.max_replicas:
                raise ScaleRefused(f"ps={ps} is outside [{max(1, cfg.ps.min_replicas)}, "
                                   f"{cfg.ps.max_replicas}] (ps.min_replicas / ps.max_replicas)")
            if workers is not None:
                if not cfg.worker.min_replicas <= workers <= cfg.worker.max_replicas:
                    raise ScaleRefused(f"workers={workers} is outside [{cfg.worker.min_replicas}, "
                                       f"{cfg.worker.max_replicas}] (worker.min_replicas / max_replicas)")
                if workers > 0 and not cfg.worker.command:
                    raise ScaleRefused("workers > 0 needs worker.command in the job file")
            if ps is not None:
                live = {m.id for m in self._live_ps()}
                dead = [p for p in self.routing.ps_ids if p not in live]
                if dead:
                    raise Busy(f"PS {dead} died and their recovery is in progress; "
                                       "scale after it")
            start = self.clock()
            started_at = time.time()
            event = {"kind": "scale", "ps": [ps_before, ps_before],
                     "workers": [workers_before, workers_before], "moved_rows": 0,
                     "moved_bytes": 0, "max_stall_ms": 0.0, "fence_ms": 0.0}
            if ps is not None:
                self._ps_target = ps
            if ps is not None and ps != ps_before:
                result = self._scale_ps(ps, start + timeout)
                event.update(ps=[ps_before, ps], moved_rows=result.moved_rows,
                             moved_bytes=result.moved_bytes, moved_slots=result.moved_slots,
                             catchup_rows=result.catchup_rows, rounds=result.rounds,
                             fence_ms=round(result.fence_ms, 3), epoch=result.routing.epoch)
            if workers is not None and workers != workers_before:
                self._workers_started = True
                self._worker_target = workers  # before the change: 0 means "no completion check"
                self._scale_workers(workers, start + timeout)
                event["workers"] = [workers_before, len(self._live_workers())]
            event["duration_ms"] = round((self.clock() - start) * 1000, 3)
            if event["fence_ms"]:
                # workers report their stalls with the next heartbeats (not part of the event)
                time.sleep(2.5 * cfg.heartbeat_seconds)
                with self._lock:
                    reported = [v for t, v in self._stall_reports if t >= start]
                # the fence window bounds any request's wait; client reports add their
                # own re-routing round trips on top of it
                event["max_stall_ms"] = round(max([event["fence_ms"], *reported]), 3)
            return self._record(event, started_at)
        finally:
            self._scale_lock.release()

    def _publish(self, routing: RoutingTable) -> None:
        """Publish a migration's new layout: PS learn it (and re-form the replication
        ring), then clients through GetRouting."""
        self._push_routing(routing)
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        self._event("routing", epoch=routing.epoch, ps=list(routing.ps_ids))
        self._save()

    def _record(self, event: dict, started_at: float) -> dict:
        event["time"] = started_at
        with self._lock:
            self.events.append(event)
        log.info("event %s %s", event["kind"], event)
        self._save()
        return event

    def _around_migration(self) -> contextlib.ExitStack:
        """Every plugin's ``around_migration`` (the consistent mode holds a step boundary
        there, so rows never move in the middle of a step)."""
        stack = contextlib.ExitStack()
        try:
            for plugin in self.plugins:
                stack.enter_context(plugin.around_migration(self))
        except BaseException:
            stack.close()
            raise
        return stack

    def _slot_stats(self, routing: RoutingTable) -> tuple[np.ndarray, np.ndarray] | None:
        """(bytes, lookups) per slot summed over the PS of ``routing``; None if a PS
        cannot answer (placement then falls back to equal slot counts)."""
        nbytes = np.zeros(routing.num_slots, np.int64)
        lookups = np.zeros(routing.num_slots, np.int64)
        for address in routing.ps_addresses:
            try:
                with insecure_channel(address) as ch:
                    r = ps_pb2_grpc.ParameterServerStub(ch).SlotStats(ps_pb2.SlotStatsRequest(),
                                                                      timeout=30)
            except grpc.RpcError as exc:
                log.warning("placement: no slot stats from %s (%s); balancing slot counts",
                            address, exc.code().name)
                return None
            if r.num_slots != routing.num_slots:
                return None
            nbytes += np.frombuffer(r.slot_bytes, "<i8")
            lookups += np.frombuffer(r.slot_lookups, "<i8")
        return nbytes, lookups

    def _slot_loads(self, routing: RoutingTable) -> np.ndarray | None:
        stats = self._slot_stats(routing)
        return None if stats is None else placement.slot_loads(*stats)

    def rebalance(self, tolerance: float = 0.05, timeout: float = 600.0) -> dict:
        """Move slots between the current PS so bytes and lookups are even (placement).
        Returns the event; nothing moves when every PS is within ``tolerance``."""
        if not self._scale_lock.acquire(blocking=False):
            raise Busy("another scale event is in progress; try again when it is done")
        try:
            if self.phase != JobPhase.RUNNING:
                raise NotRunning(f"the job is {self.phase.value}, not running")
            old = self.routing
            live = {m.id for m in self._live_ps()}
            if any(p not in live for p in old.ps_ids):
                raise Busy("a PS died and its recovery is in progress; rebalance after it")
            start, started_at = self.clock(), time.time()
            stats = self._slot_stats(old)
            if stats is None:
                raise Busy("not every PS reported its slot statistics yet")
            nbytes, lookups = stats
            ids, n = list(old.ps_ids), len(old.ps_ids)
            new_owner = placement.balance(old.slot_owner, ids, ids,
                                          placement.slot_loads(nbytes, lookups), tolerance)
            event = {"kind": "rebalance", "ps": n, "moved_slots": int((new_owner != old.slot_owner).sum()),
                     "bytes_imbalance": [round(placement.imbalance(old.slot_owner, nbytes, n), 4),
                                         round(placement.imbalance(new_owner, nbytes, n), 4)],
                     "lookup_imbalance": [round(placement.imbalance(old.slot_owner, lookups, n), 4),
                                          round(placement.imbalance(new_owner, lookups, n), 4)],
                     "moved_rows": 0, "moved_bytes": 0, "fence_ms": 0.0}
            if event["moved_slots"]:
                try:
                    with self._around_migration():
                        result = migrate(old, new_owner, ids, list(old.ps_addresses), self._publish)
                except MigrationError as exc:
                    raise ScaleRefused(str(exc)) from exc
                event.update(moved_rows=result.moved_rows, moved_bytes=result.moved_bytes,
                             fence_ms=round(result.fence_ms, 3), epoch=result.routing.epoch)
            event["duration_ms"] = round((self.clock() - start) * 1000, 3)
            return self._record(event, started_at)
        finally:
            self._scale_lock.release()

    def _recover_ps(self, dead: str, why: str) -> None:
        try:
            self._recover_ps_once(dead, why)
        except Exception as exc:  # noqa: BLE001 - a recovery that cannot finish fails loudly
            log.exception("recovery of %s failed", dead)
            self._set_phase(JobPhase.FAILED, f"recovery of {dead} failed: {exc}")

    def _newest_checkpoint(self):
        return self._newest_checkpoint_in(self.checkpoint_dir)

    @staticmethod
    def _newest_checkpoint_in(root: str):
        from checkpoint import list_chains
        if not os.path.isdir(root):
            return None
        try:
            chains = list_chains(root)
        except (OSError, ValueError):
            return None
        return chains[0].head if chains else None

    def _restore_slots_from_checkpoint(self, old: RoutingTable, mask, live, dead: str, why: str):
        """Both copies of some slots are gone: load them from the newest checkpoint onto a
        live PS. Updates since that checkpoint are lost for those slots (reported)."""
        head = self._newest_checkpoint()
        candidates = [p for p in old.ps_ids if p in live and p != dead]
        if head is None or not candidates:
            self._set_phase(JobPhase.FAILED, f"{dead} died ({why}), its replica peer is not "
                            "alive and there is no checkpoint; its rows are lost")
            return None
        counts = {p: int((old.slot_owner == old.ps_ids.index(p)).sum()) for p in candidates}
        target = min(candidates, key=lambda p: counts[p])
        try:
            with insecure_channel(old.ps_addresses[old.ps_ids.index(target)]) as ch:
                r = ps_pb2_grpc.ParameterServerStub(ch).RestoreCheckpoint(
                    ps_pb2.RestoreCheckpointRequest(
                        root=os.path.abspath(self.checkpoint_dir), ckpt_id=head.id,
                        slots=mask.astype(np.uint8).tobytes(), num_slots=old.num_slots),
                    timeout=3600)
        except grpc.RpcError as exc:
            self._set_phase(JobPhase.FAILED, f"{dead} died, no live replica, and restoring its "
                            f"slots from checkpoint {head.id} failed: {exc.details()}")
            return None
        age_ms = (time.time() - (head.created or time.time())) * 1000

        class _Resp:  # the fields the recovery event reads
            rows = r.rows
            replica_age_ms = age_ms
        return target, head.id, _Resp()

    def _stop_node(self, node_id: str, timeout: float | None = None) -> None:
        """Make sure a departed PS's process is gone (hung, or still exiting) before a
        replacement is started under its id: it must not serve, nor re-register."""
        def running():
            return any(n.id == node_id and n.state == NodeState.RUNNING for n in self.scaler.nodes())
        timeout = max(timeout if timeout is not None else self.config.grace_seconds, 6.0)
        deadline = self.clock() + timeout
        while running() and self.clock() < deadline:
            if self.clock() > deadline - timeout + 5:  # a leaving PS gets 5 s to exit
                self.on_main(lambda: self.scaler.kill(node_id))
            time.sleep(0.1)

    def _recover_ps_once(self, dead: str, why: str) -> None:
        """A PS died: its ring peer already holds its rows. Promote that copy (no bulk copy,
        no checkpoint read), publish a new epoch without the dead PS, re-form the ring,
        then start a replacement that joins by an ordinary scale-out."""
        detected = self.clock()
        member = self.registry.get(dead)
        silent_ms = (detected - member.last_heartbeat) * 1000 if member else 0.0
        with self._scale_lock:
            old = self.routing
            if self.phase != JobPhase.RUNNING or dead not in old.ps_ids:
                return
            ids = list(old.ps_ids)
            i = ids.index(dead)
            n = len(ids)
            peer = ids[(i + 1) % n] if n > 1 else None
            live = {m.id for m in self._live_ps()}
            mask = old.slot_owner == i
            restored_from = None
            if peer is None or peer not in live:
                # no live copy: restore only these slots from the newest checkpoint, onto the
                # live PS holding the fewest slots
                target = self._restore_slots_from_checkpoint(old, mask, live, dead, why)
                if target is None:
                    return
                peer, restored_from, resp = target
            else:
                try:
                    with insecure_channel(old.ps_addresses[ids.index(peer)]) as ch:
                        resp = ps_pb2_grpc.ParameterServerStub(ch).Promote(ps_pb2.PromoteRequest(
                            origin=dead, slots=mask.astype(np.uint8).tobytes(),
                            num_slots=old.num_slots), timeout=120)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        self._set_phase(JobPhase.FAILED, f"{dead} died and promoting its replica "
                                        f"on {peer} failed: {exc.code().name}: {exc.details()}")
                        return
                    # the peer died too (not yet noticed): fall back to the checkpoint
                    log.warning("%s: replica peer %s unreachable; restoring from checkpoint", dead, peer)
                    target = self._restore_slots_from_checkpoint(old, mask, live - {peer}, dead, why)
                    if target is None:
                        return
                    peer, restored_from, resp = target
            new_ids = [x for x in ids if x != dead]
            owner_ids = np.asarray(ids, dtype=object)[old.slot_owner]
            owner_ids[mask] = peer
            index_of = {x: k for k, x in enumerate(new_ids)}
            new_owner = np.array([index_of[x] for x in owner_ids], dtype=np.int32)
            addresses = dict(zip(old.ps_ids, old.ps_addresses))
            routing = RoutingTable(old.epoch + 1, old.num_slots, tuple(new_ids),
                                   tuple(addresses[x] for x in new_ids), new_owner)
            self._push_routing(routing)
            with self._lock:
                self.routing, self.epoch = routing, routing.epoch
            resumed = self.clock()
            event = {"kind": "recovery", "dead": dead, "reason": why, "promoted_on": peer,
                     "promoted_rows": resp.rows, "epoch": routing.epoch,
                     "restored_from_checkpoint": restored_from,
                     "last_heartbeat_age_ms": round(silent_ms, 1),
                     "resumed_ms": round((resumed - detected) * 1000, 1),
                     "replication_interval_ms": 0.0 if self.config.sync_replication
                     else self.config.replication_interval_ms,
                     # the updates at risk are those the dead PS applied after its last
                     # shipment: measured as the replica's age when it was promoted
                     "updates_at_risk_ms": round(resp.replica_age_ms, 1)
                     if restored_from is not None or not self.config.sync_replication else 0.0,
                     "replication": "sync" if self.config.sync_replication else "async",
                     "time": time.time()}
            with self._lock:
                self.events.append(event)
            log.info("event recovery %s", event)
            self._save()
        self._stop_node(dead)
        # replacement: an ordinary scale-out back to the job's PS count (other recoveries
        # or scale events may hold the lock for a while: wait for them)
        deadline = self.clock() + 600
        while self.phase == JobPhase.RUNNING and len(self.routing.ps_ids) < self._ps_target:
            try:
                self.scale(ps=self._ps_target)
            except ScaleRefused as exc:
                if not isinstance(exc, Busy) or self.clock() > deadline:
                    self._event("replacement_failed", dead=dead, reason=str(exc))
                    return
                time.sleep(0.5)

    def global_step(self) -> int:
        """Training steps of all workers of this job plus those of the checkpoint it
        started from (a resume or a warm start)."""
        return self._step_base + sum(m.steps for m in self.registry.members("worker"))

    def placement(self) -> dict:
        """Per PS: the slots it owns (count and contiguous ranges) and its address."""
        routing = self.routing
        if routing is None:
            return {}
        out = {}
        owner = routing.slot_owner
        edges = np.flatnonzero(np.diff(owner)) + 1
        starts = np.concatenate([[0], edges])
        ends = np.concatenate([edges, [owner.size]])
        for p, (ps_id, address) in enumerate(zip(routing.ps_ids, routing.ps_addresses)):
            sel = owner[starts] == p
            out[ps_id] = {"address": address, "slots": int((owner == p).sum()),
                          "ranges": [[int(a), int(b) - 1] for a, b in zip(starts[sel], ends[sel])]}
        return {"epoch": routing.epoch, "num_slots": routing.num_slots, "ps": out}

    def put_model(self, worker_id: str, model_json: str) -> None:
        """Worker 0's record of the model's structure, kept with the job state and in every
        checkpoint so an export needs nothing but the checkpoint."""
        try:
            spec = json.loads(model_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model_json is not valid JSON: {exc}") from None
        if not isinstance(spec, dict) or spec.get("kind") not in ("keras", "tables"):
            raise ValueError("model_json: expected an object with kind 'keras' or 'tables'")
        with self._lock:
            self.model_spec = spec
        self._event("model_recorded", worker=worker_id, model_kind=spec["kind"],
                    tables=sorted(spec.get("tables", {})))
        if self._warm_tables is not None:
            fresh = sorted(set(spec.get("tables", {})) - self._warm_tables)
            if fresh:
                log.warning("tables %s are not in the init_from checkpoint: they start fresh", fresh)
                self._event("warm_start_fresh_tables", tables=fresh)
        self._save()

    def checkpoint(self, full: bool = False, final: bool = False) -> dict:
        """Take a checkpoint now: every PS writes the rows of its slots (incremental: rows
        changed since its part of the previous checkpoint), then the manifest is committed
        with the data-shard queues and the routing, so model and consumed data match."""
        from checkpoint import CheckpointWriter, apply_retention, next_id
        from checkpoint.format import dir_name
        if not self._ckpt_lock.acquire(blocking=False):
            raise Busy("a checkpoint is already being taken")
        try:
            if self.phase != JobPhase.RUNNING:
                raise NotRunning(f"the job is {self.phase.value}, not running")
            start = self.clock()
            with self._scale_lock:  # a stable layout while the PS write
                routing = self.routing
                members = {m.id: m for m in self._live_ps()}
                missing = [p for p in routing.ps_ids if p not in members]
                if missing:
                    raise Busy(f"PS {missing} are not live (recovery in progress?)")
                chain = self._ckpt_chain
                incr = (not full and chain is not None
                        and chain["n"] % self.config.checkpoint_full_every != 0)
                ckpt_id = next_id(self.checkpoint_dir)
                kind = "incr" if incr else "full"
                shard_state = self.shards.to_state() if self.shards else None
                results = {}
                for ps_id, address in zip(routing.ps_ids, routing.ps_addresses):
                    key = f"{ps_id}@{members[ps_id].pid}"
                    since = (chain["since"].get(key, {}) if incr else {})
                    with insecure_channel(address) as ch:
                        results[key] = ps_pb2_grpc.ParameterServerStub(ch).WriteCheckpoint(
                            ps_pb2.WriteCheckpointRequest(
                                root=os.path.abspath(self.checkpoint_dir), ckpt_id=ckpt_id,
                                kind=kind, parent=chain["id"] if incr else 0, writer_id=ps_id,
                                since_json=json.dumps(since)), timeout=3600)
            writer = CheckpointWriter(self.checkpoint_dir, ckpt_id, kind,
                                      parent=chain["id"] if incr else None,
                                      num_slots=routing.num_slots)
            for resp in results.values():
                writer.add_file_entries(json.loads(resp.files_json))
            writer.add_extra({"job": self.config.name, "epoch": routing.epoch,
                              "ps_ids": list(routing.ps_ids), "shards": shard_state,
                              "slot_owner": routing.slot_owner.tolist(),
                              "global_step": self.global_step(), "model": self.model_spec,
                              "final": final})
            writer.commit()
            self._ckpt_chain = {"id": ckpt_id, "n": (chain["n"] + 1) if incr else 1,
                                "since": {k: json.loads(r.cut_json) for k, r in results.items()}}
            self._last_ckpt = self.clock()
            # manifest checks (checksum, file sizes), not a sha256 of the whole chain after
            # every commit; restores still verify every chunk they read
            deleted = apply_retention(self.checkpoint_dir, self.config.checkpoint_keep_chains,
                                      verify="manifest")
            event = {"kind": "checkpoint", "id": ckpt_id, "type": kind,
                     "rows": sum(r.rows for r in results.values()),
                     "bytes": sum(r.bytes for r in results.values()),
                     "duration_ms": round((self.clock() - start) * 1000, 1),
                     "dir": os.path.abspath(self.checkpoint_dir), "retention_deleted": deleted,
                     "path": os.path.join(os.path.abspath(self.checkpoint_dir),
                                          dir_name(ckpt_id, kind)),
                     "global_step": self.global_step(), "final": final,
                     "time": time.time()}
            with self._lock:
                self.events.append(event)
                self.checkpoint_pointer = event
            log.info("event checkpoint %s", event)
            self._save()
            return event
        finally:
            self._ckpt_lock.release()

    def _maybe_periodic_checkpoint(self) -> None:
        every = self.config.checkpoint_interval_seconds
        if every and self.phase == JobPhase.RUNNING and self.clock() - self._last_ckpt >= every \
                and not self._ckpt_lock.locked():
            self._last_ckpt = self.clock()

            def run():
                try:
                    self.checkpoint()
                except Exception as exc:  # noqa: BLE001 - reported as an event, job goes on
                    self._event("checkpoint_failed", reason=str(exc))
            threading.Thread(target=run, daemon=True, name="checkpoint").start()

    def _live_workers(self) -> list[Member]:
        return [m for m in self.registry.members("worker")
                if m.state == MemberState.RUNNING and m.id not in self._leaving]

    def _wait(self, predicate, deadline: float, what: str):
        while self.clock() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise ScaleRefused(f"timed out waiting for {what}")

    def _scale_ps(self, n: int, deadline: float):
        old = self.routing
        old_ids = list(old.ps_ids)
        if n > len(old_ids):
            self.on_main(lambda: self.scaler.apply(ScalePlan(ps=n)))
            try:
                fresh = self._wait(lambda: (lambda new: new if len(new) >= n - len(old_ids) else None)(
                    [m for m in self._live_ps() if m.id not in old_ids]), deadline,
                    f"{n - len(old_ids)} new PS to register")
            except ScaleRefused:
                for m in self._live_ps():
                    if m.id not in old_ids:
                        self.registry.mark(m.id, MemberState.LEFT)
                self.on_main(lambda: self.scaler.apply(ScalePlan(ps=len(old_ids))))
                raise
            joining = sorted(fresh, key=lambda m: m.rank)[: n - len(old_ids)]
            new_ids = old_ids + [m.id for m in joining]
        else:
            keep = sorted(old_ids, key=lambda i: int(i.rsplit("-", 1)[1]))[:n]
            new_ids = [i for i in old_ids if i in keep]
        addresses = {m.id: m.address for m in self._live_ps()}
        loads = self._slot_loads(old)
        new_owner = rebalance(old.slot_owner, old_ids, new_ids) if loads is None else \
            placement.balance(old.slot_owner, old_ids, new_ids, loads)

        try:
            with self._around_migration():
                result = migrate(old, new_owner, new_ids, [addresses[i] for i in new_ids],
                                 self._publish)
        except MigrationError as exc:
            joined = [i for i in new_ids if i not in old_ids]
            for ps_id in joined:  # the layout is the old one again: the new PS own nothing
                self.registry.mark(ps_id, MemberState.LEFT)
            if joined:
                self.on_main(lambda: self.scaler.apply(ScalePlan(ps=len(old_ids))))
            raise ScaleRefused(str(exc)) from exc
        leaving = [i for i in old_ids if i not in new_ids]
        for ps_id in leaving:
            self.registry.mark(ps_id, MemberState.LEFT)
        if leaving:
            self.on_main(lambda: self.scaler.apply(ScalePlan(ps=n)))
        return result

    def _scale_workers(self, m: int, deadline: float) -> None:
        live = sorted(self._live_workers(), key=lambda w: w.rank)
        if m > len(live):
            before = {w.id for w in live}
            self.on_main(lambda: self.scaler.apply(ScalePlan(workers=m)))
            self._wait(lambda: len(self._live_workers()) >= m, deadline,
                       f"{m - len(before)} new worker(s) to register")
            return
        victims = [w.id for w in live[m:]]
        with self._lock:
            self._leaving.update(victims)
        self._event("workers_leaving", ids=victims)

        def gone():
            nodes = {n.id: n for n in self.scaler.nodes()}
            return all(v not in nodes or nodes[v].state != NodeState.RUNNING for v in victims)

        try:
            # a leaving worker finishes its step, returns its shards and exits by itself
            self._wait(gone, min(deadline, self.clock() + self.config.grace_seconds),
                       "leaving workers to exit")
        except ScaleRefused:
            log.warning("workers %s did not leave in time; stopping them", victims)
        self.on_main(lambda: self.scaler.apply(ScalePlan(workers=m)))
        for v in victims:
            if self.registry.mark(v, MemberState.LEFT) is not None and self.shards:
                self.shards.give_back(v)

    def barrier(self, worker_id: str, generation: int, timeout: float) -> tuple[int, list[str], bool]:
        """Step-boundary barrier for synchronous training: returns when every live worker
        (registered, not leaving) has arrived. Joins and leaves take effect here: a worker
        that registered meanwhile is waited for at the next boundary, a leaving or dead
        one is not, and a leaving one is told ``leave`` at the boundary it reaches."""
        deadline = self.clock() + timeout
        with self._barrier_cond:
            if 0 <= generation < self._barrier_gen:  # that barrier already completed
                return self._barrier_gen, self._by_rank(self._barrier_members), worker_id in self._leaving
            gen = self._barrier_gen
            self._barrier_arrived.add(worker_id)
            self._barrier_cond.notify_all()
            while self._barrier_gen == gen:
                expected = {w.id for w in self._live_workers()}
                if self._barrier_arrived >= expected:
                    self._barrier_members = self._barrier_arrived & expected
                    self._barrier_arrived = set()
                    self._barrier_gen += 1
                    self._barrier_cond.notify_all()
                    break
                if self.clock() > deadline:
                    self._barrier_arrived.discard(worker_id)
                    raise TimeoutError(f"barrier {gen}: still waiting for "
                                       f"{sorted(expected - self._barrier_arrived)}")
                self._barrier_cond.wait(0.1)
            return self._barrier_gen, self._by_rank(self._barrier_members), worker_id in self._leaving

    def _by_rank(self, ids) -> list[str]:
        rank = {m.id: m.rank for m in self.registry.members("worker")}
        return sorted(ids, key=lambda i: (rank.get(i, 1 << 30), i))

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
        parts.insert(1, f"step {self.global_step()}")
        if self.final_checkpoint:
            parts.append(f"final checkpoint {self.final_checkpoint}")
        if self.export_dir:
            parts.append(f"model exported to {self.export_dir}")
        return " | ".join(parts)

    def status(self) -> master_pb2.StatusResponse:
        now = self.clock()
        members = [master_pb2.Member(role=m.role, id=m.id, pid=m.pid, address=m.address,
                                     state=m.state.value, last_heartbeat_age=now - m.last_heartbeat,
                                     steps=m.steps, samples=m.samples)
                   for m in self.registry.members()]
        counts = self.shards.counts() if self.shards else {"todo": 0, "doing": 0, "done": 0}
        with self._lock:
            events = [json.dumps(e, sort_keys=True) for e in self.events[-100:]]
        response = master_pb2.StatusResponse(
            events_json=events,
            job_name=self.config.name, epoch=self.epoch, phase=self.phase.value, members=members,
            shards=master_pb2.ShardCounts(**counts), state_dir=os.path.abspath(self.config.state_dir),
            uptime_seconds=now - self.started_at, global_step=self.global_step(),
            placement_json=json.dumps(self.placement()), final_checkpoint=self.final_checkpoint,
            export_dir=self.export_dir, model_recorded=self.model_spec is not None)
        for plugin in self.plugins:
            self._run_hook(plugin, "on_status", response)
        return response


def _refuse(context, exc: ScaleRefused):
    """The refusal's type as a status code: ABORTED when another operation holds the job
    (retry later), FAILED_PRECONDITION otherwise."""
    code = grpc.StatusCode.ABORTED if isinstance(exc, Busy) else grpc.StatusCode.FAILED_PRECONDITION
    context.abort(code, str(exc))


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
        self.m.report_stall(request.max_stall_ms)
        for plugin in self.m.plugins:
            self.m._run_hook(plugin, "on_heartbeat", request)
        known = self.m.registry.get(request.id)
        left = known is not None and known.state == MemberState.LEFT
        # a member that left (scale-in) is told to stop, never to register again
        return master_pb2.HeartbeatResponse(
            epoch=self.m.epoch, known=member is not None or left,
            stop=left or self.m.phase in FINAL_PHASES or request.id in self.m._leaving)

    def Deregister(self, request, context):
        member = self.m.registry.mark(request.id, MemberState.LEFT)
        routing = self.m.routing
        if (member is not None and member.role == "ps" and routing is not None
                and request.id in routing.ps_ids and self.m.phase == JobPhase.RUNNING):
            # a PS leaving on its own (preemption notice) after handing its last delta to
            # its ring peer: promote that copy, as for a death, and replace it
            self.m._event("ps_end", id=request.id, state="left", reason=request.reason)
            threading.Thread(target=self.m._recover_ps, args=(request.id, request.reason),
                             daemon=True, name=f"recover-{request.id}").start()
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
        if request.returned_progress and len(request.returned_progress) != len(request.returned_shard_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "returned_progress must have one entry per returned shard")
        taken = self.m.shards.complete(request.worker_id, request.done_shard_ids)
        missing = sorted(set(request.done_shard_ids) - set(taken))
        if request.returned_shard_ids:
            progress = dict(zip(request.returned_shard_ids, request.returned_progress))
            self.m.shards.give_back(request.worker_id, request.returned_shard_ids, progress)
        self.m._save()
        if missing:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards {missing} are not DOING for {request.worker_id!r} "
                          "(reassigned after a lease loss?)")
        return master_pb2.ReportShardResponse()

    def Status(self, request, context):
        return self.m.status()

    def Scale(self, request, context):
        ps = request.ps if request.HasField("ps") else None
        workers = request.workers if request.HasField("workers") else None
        if request.rebalance:
            if ps is not None or workers is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "rebalance moves slots between the current PS; give no counts with it")
            try:
                event = self.m.rebalance(timeout=request.timeout_seconds or 600.0)
            except ScaleRefused as exc:
                _refuse(context, exc)
            return master_pb2.ScaleResponse(event_json=json.dumps(event, sort_keys=True))
        if ps is None and workers is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a PS count, a worker count or both")
        try:
            event = self.m.scale(ps, workers, request.timeout_seconds or 600.0)
        except ScaleRefused as exc:
            _refuse(context, exc)
        return master_pb2.ScaleResponse(event_json=json.dumps(event, sort_keys=True))

    def Checkpoint(self, request, context):
        try:
            event = self.m.checkpoint(full=request.full)
        except ScaleRefused as exc:
            _refuse(context, exc)
        except (OSError, ValueError, grpc.RpcError) as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {exc}")
        return master_pb2.CheckpointResponse(event_json=json.dumps(event, sort_keys=True))

    def PutModel(self, request, context):
        if len(request.model_json) > 16 << 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model_json is {len(request.model_json)} bytes; at most 16 MiB")
        try:
            self.m.put_model(request.worker_id, request.model_json)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return master_pb2.PutModelResponse()

    def Barrier(self, request, context):
        member = self.m.registry.get(request.worker_id)
        if member is None or member.role != "worker" or member.state != MemberState.RUNNING:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{request.worker_id!r} is not a live registered worker")
        timeout = max(1.0, (context.time_remaining() or 600.0) - 0.5)
        try:
            gen, ids, leave = self.m.barrier(request.worker_id, request.generation, timeout)
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return master_pb2.BarrierResponse(generation=gen, worker_ids=ids, leave=leave)
