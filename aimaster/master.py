"""The AIMaster: owns one job's membership, routing, data shards and lifecycle.

A thin coordinator built by injection from a JobConfig, a Scaler and a clock, around parts
that each have one job:

- ``Registry``: members and their leases;
- ``PsFleet`` (aimaster/fleet.py): the only code that talks to PS processes;
- ``OperationRunner`` (aimaster/operations.py): publish, rescale, rebalance, recover and
  checkpoint, one at a time, recovery first;
- ``ShardQueue``: the data shards; ``StateStore``: the durable job state;
- plugins, which see the job through a read-only ``JobView`` (aimaster/view.py).

Watchers (scaler exits, lease expiry) report; ``_tick`` decides; the scaler acts. Every
change of job state is written durably before it is acknowledged.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Callable

import grpc
import numpy as np

from aimaster import placement
from aimaster.config import JobConfig
from aimaster.evaluation import EvalRecorder, eval_env_spec
from aimaster.errors import Busy, NotRunning, OperationRefused, Preempted, ScaleRefused  # noqa: F401
from aimaster.fleet import PsFleet
from aimaster.migration import MigrationError, migrate
from aimaster.operations import OperationRunner, OpKind
from aimaster.plugins import MasterPlugin, load_plugins
from aimaster.registry import Member, MemberState, Registry
from aimaster.scaler import NodeState, ScalePlan, Scaler, create_scaler
from aimaster.servicer import MasterServicer
from aimaster.shards import ShardQueue, ShardState, make_shards
from aimaster.state import StateStore
from aimaster.view import FINAL_PHASES, JobPhase, JobView
from deeprec_ext import errors as wire_errors
from deeprec_ext.client.routing import RoutingTable, rebalance
from deeprec_ext.data import fs as data_fs
from deeprec_ext.grpc_util import create_server
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2

class _Background:
    """``fn(*args, **kwargs)`` in a thread; ``wait()`` then read ``error``."""

    def __init__(self, fn, *args, **kwargs):
        self.error: BaseException | None = None

        def run():
            try:
                fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                self.error = exc
        self._thread = threading.Thread(target=run, name="routing-push", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()


def _join(base: str, name: str) -> str:
    """``base/name`` for a local path or a URL (os.path.join would do for both today,
    but a URL must keep '/' whatever the host's separator)."""
    return f"{base.rstrip('/')}/{name}" if data_fs.is_remote(base) else os.path.join(base, name)


log = logging.getLogger("aimaster")




MAX_EVENTS = 1000  # kept in memory
MAX_COUNTER = 2**63 - 1  # int64 fields of the status answer
ROUTING_WAITERS = 4  # GetRouting long polls at once, of the AIMaster's 8 handler threads

__all__ = ["JobMaster", "JobPhase", "FINAL_PHASES", "Busy", "NotRunning", "OperationRefused",
           "Preempted", "ScaleRefused"]


class JobMaster:
    # after a recovery the replacement PS starts this much later (see _recover_ps_once)
    REPLACEMENT_DELAY_SECONDS = 1.0

    def __init__(self, config: JobConfig, scaler_factory: Callable[[str, JobConfig], Scaler] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.started_at = clock()
        self.registry = Registry(config.lease_seconds, clock)
        self.store = StateStore(config.state_dir)
        self.phase = JobPhase.STARTING
        self.message = ""
        self._routing: RoutingTable | None = None
        self._routing_changed = threading.Condition(threading.Lock())
        # long polls of GetRouting hold a handler thread each: a few at most, the others
        # are answered at once and poll as before, so heartbeats always find a thread
        self._routing_waiters = threading.BoundedSemaphore(ROUTING_WAITERS)
        self.epoch = 0
        # the recent events (status shows the last 100, the state keeps the last 200): a job
        # that runs for weeks must not grow its event list without bound
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
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
        self.fleet = PsFleet(config.replication_interval_ms, config.sync_replication)
        self.ops = OperationRunner()
        self.view = JobView(self)
        self._leaving: set[str] = set()
        self._main_calls: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._ended_at: dict[str, float] = {}  # PS id -> time.monotonic() its end was handled
        # PS id -> slots whose rows it holds with no second copy yet: taken over in a
        # recovery (promoted or restored), until its own replica peer has them. Should it
        # die meanwhile, its peer's copy lacks them: they come from the checkpoint
        self._sole_copy: dict[str, np.ndarray] = {}
        self._sole_lock = threading.Lock()
        self._stall_reports: list[tuple[float, float]] = []
        self._barrier_cond = threading.Condition()
        self._barrier_gen = 0
        self._barrier_arrived: set[str] = set()
        self._barrier_members: set[str] = set()
        self.checkpoint_dir = config.checkpoint_dir or os.path.join(config.state_dir, "checkpoints")
        if data_fs.is_remote(self.checkpoint_dir):  # fail at start, not at the first checkpoint
            from aimaster.config import ConfigError
            from checkpoint import CheckpointError, remote
            try:
                remote.check_root(self.checkpoint_dir)
            except CheckpointError as exc:
                raise ConfigError(f"checkpoint.dir: {exc}") from None
        # {"id", "n", "since": {"<ps id>#<incarnation>": {table: seq}}}: the cut of each PS
        # *process*; a new process under the same id (and pid) starts with no cut
        self._ckpt_chain: dict | None = None
        self._last_ckpt = self.clock()
        self._last_samples = (0, self.clock())
        self.plugins: list[MasterPlugin] = load_plugins(config)
        self._signalled = False
        self._closing = False  # shutdown started: no new work for the main thread
        self._warm_tables: set | None = None  # tables of the init_from checkpoint
        # stragglers: worker -> when it last got WAIT for a shard; worker -> (the idle
        # worker its shard's rest is for, when asked), answered with its next heartbeat
        self._waiting: dict[str, float] = {}
        self._split_asks: dict[str, tuple[str, float]] = {}
        self.straggler_marks: dict[str, dict] = {}     # member -> what was measured
        self.straggler_counts: collections.Counter = collections.Counter()  # event kind -> n
        self.final_checkpoint = ""   # directory of the final checkpoint, once taken
        self.export_dir = ""         # the SavedModel exported after it
        # evaluation while training (aimaster/evaluation.py): files checked at job start
        self.eval_files = config.eval.resolved_files() if config.eval is not None else []
        self.evals = EvalRecorder(config.state_dir) if config.eval is not None else None
        self._eval_wait_since: float | None = None

    # -- state ---------------------------------------------------------------------------
    def _load_shards(self) -> ShardQueue | None:
        queue = self._load_shard_queue()
        if queue is not None and self.config.data.watch:
            queue.streaming = True
        return queue

    def _resumable(self, previous: dict | None) -> bool:
        """A previous run to continue: one that did not end, or a streaming (``watch``)
        job that was stopped (it runs until stopped: a stop is its normal end)."""
        if not previous:
            return False
        phase = previous.get("phase")
        return phase not in [p.value for p in FINAL_PHASES] or (
            self.config.data.watch and phase == JobPhase.STOPPED.value)

    def _load_shard_queue(self) -> ShardQueue | None:
        files = self.config.data.resolved_files()
        previous = self.store.load()
        self._resume_from = None
        self._step_base = 0  # global step carried by the checkpoint this job started from
        self.model_spec = (previous or {}).get("model") if self._resumable(previous) else None
        if self._resumable(previous):
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
                    try:
                        return ShardQueue.from_state(extra["shards"])
                    except ValueError as exc:
                        raise RuntimeError(f"cannot resume job {self.config.name}'s data "
                                           f"position: {exc}") from None
            else:
                # without a checkpoint the model of the interrupted run is gone; resuming its
                # data position without its model would skip data: keep it aside, start over
                self.store.set_aside(".interrupted")
                log.warning("previous run of %s did not finish and left no checkpoint; its "
                            "state is kept in %s.interrupted", self.config.name, self.store.path)
        if not files and not self.config.data.watch:
            return None
        per_shard = self.config.data.shard_bytes(files)
        if self.config.data.records_per_shard is not None:
            log.warning("data.records_per_shard is deprecated: using bytes_per_shard=%d "
                        "(estimated from %s); set data.bytes_per_shard", per_shard, files[0])
        try:
            shards = make_shards(files, per_shard, self.config.data.epochs,
                                 self.config.data.format)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"data: {exc}") from None
        log.info("data: %d files, %d bytes, %d shards of <= %d bytes x %d epoch(s)", len(files),
                 sum(s.size for s in shards if s.data_epoch == 0 and s.start == 0),
                 len(shards) // self.config.data.epochs, per_shard, self.config.data.epochs)
        queue = ShardQueue(shards)
        if self.config.data.watch:
            queue.extend([], files)
        return queue

    def _save(self) -> None:
        # one save at a time, in the order the states were built: two RPC threads must not
        # make an older state the durable one after a newer change was acknowledged
        with self._save_lock:
            self._save_locked()

    def _save_locked(self) -> None:
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
                "events": list(self.events)[-200:],
                "global_step": self.global_step(),
                "model": self.model_spec,
                "final_checkpoint": self.final_checkpoint,
                "export_dir": self.export_dir,
            }
        self.store.save(state)

    def record_event(self, kind: str, **fields) -> None:
        with self._lock:
            self.events.append({"kind": kind, "time": time.time(), **fields})
        log.info("event %s %s", kind, fields)

    def _set_phase(self, phase: JobPhase, message: str = "") -> None:
        with self._lock:
            if self.phase in FINAL_PHASES:
                return
            self.phase, self.message = phase, message
        self.record_event("phase", phase=phase.value, message=message)
        self._save()

    @staticmethod
    def _member_dict(m: Member) -> dict:
        return {"role": m.role, "id": m.id, "pid": m.pid, "address": m.address,
                "state": m.state.value, "steps": m.steps, "samples": m.samples}

    @property
    def routing(self) -> RoutingTable | None:
        return self._routing

    @routing.setter
    def routing(self, routing: RoutingTable | None) -> None:
        with self._routing_changed:
            self._routing = routing
            self._routing_changed.notify_all()

    def wait_routing(self, after_epoch: int, timeout: float) -> RoutingTable | None:
        """The routing once its epoch is above ``after_epoch``, or after ``timeout`` s:
        whatever it is then (None before the first). Answers at once when every waiting
        place is taken."""
        routing = self._routing
        if (routing is not None and routing.epoch > after_epoch) or timeout <= 0 \
                or not self._routing_waiters.acquire(blocking=False):
            return routing
        try:
            with self._routing_changed:
                self._routing_changed.wait_for(
                    lambda: self._routing is not None and self._routing.epoch > after_epoch,
                    timeout)
                return self._routing
        finally:
            self._routing_waiters.release()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        """Bind the service, start the PS; returns the AIMaster address."""
        self.server, port = create_server(
            f"{self.config.host}:{self.config.port}",
            interceptors=[i for p in self.plugins for i in p.interceptors()])
        master_pb2_grpc.add_MasterServicer_to_server(MasterServicer(self), self.server)
        for plugin in self.plugins:
            plugin.on_start(self.view, self.server)
        self.server.start()
        self.address = f"{self.config.host}:{port}"
        # the state first: whoever finds master.addr can read the job's state
        self._save()
        with open(os.path.join(self.config.state_dir, "master.addr.tmp"), "w") as f:
            f.write(self.address)
        os.replace(os.path.join(self.config.state_dir, "master.addr.tmp"),
                   os.path.join(self.config.state_dir, "master.addr"))
        self.scaler = self._scaler_factory(self.address, self.config)
        if hasattr(self.scaler, "on_exit"):  # a child's exit wakes the loop at once
            self.scaler.on_exit = self._wake.set
        self.scaler.apply(ScalePlan(ps=self.config.ps.replicas, workers=0))
        if self.config.data.watch and self.shards is not None:
            threading.Thread(target=self._watch_files, name="data-watch", daemon=True).start()
        return self.address

    # -- streaming input (data.watch) ------------------------------------------------------
    def _watch_files(self) -> None:
        """Every ``data.poll_seconds``: list ``data.files``; a new file whose size did not
        change since the previous listing becomes new shards (a file still being written
        waits a poll). The taken files are in the shard state, saved at once: a restarted
        job knows them, so it neither skips nor repeats one."""
        pending: dict[str, int] = {}
        while not self._stop.wait(self.config.data.poll_seconds):
            if self._closing or self.phase in FINAL_PHASES:
                return
            try:
                pending = self.poll_files(pending)
            except Exception:  # noqa: BLE001 - a listing that failed is tried again
                log.exception("data.watch: listing %s failed", list(self.config.data.files))

    def poll_files(self, pending: dict[str, int]) -> dict[str, int]:
        """One listing; returns the files seen for the first time (path -> size)."""
        known = self.shards.paths()
        listed: list[str] = []
        for pattern in self.config.data.files:
            listed += [p for p in data_fs.glob(pattern) if p not in known and p not in listed]
        sizes = {p: data_fs.size(p) for p in listed}
        ready = [p for p in listed if pending.get(p) == sizes[p]]
        if ready:
            per_shard = self.config.data.shard_bytes(ready)
            shards, bad = [], []
            for p in ready:
                try:
                    shards += make_shards([p], per_shard, 1, self.config.data.format,
                                          first_id=self.shards.next_id() + len(shards))
                except (OSError, ValueError) as exc:
                    bad.append(p)
                    self.record_event("data_file_refused", file=p, reason=str(exc))
            self.shards.extend(shards, ready)
            self.record_event("data_files_added", files=[p for p in ready if p not in bad],
                              shards=len(shards))
            self._save()
            self._wake.set()
        return {p: n for p, n in sizes.items() if p not in ready}

    def on_main(self, fn: Callable, timeout: float = 120.0):
        """Run ``fn`` on the main loop thread and return its result. Child processes must
        be forked from the main thread: PR_SET_PDEATHSIG ties them to the forking thread."""
        if self._closing:
            raise NotRunning("the AIMaster is shutting down")
        fut: Future = Future()
        self._main_calls.put((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def _fail_main_calls(self) -> None:
        while True:
            try:
                _, fut = self._main_calls.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(NotRunning("the AIMaster is shutting down"))

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
            getattr(plugin, hook)(self.view, *args)
        except Exception:  # noqa: BLE001
            log.exception("plugin %s: %s failed", plugin.name, hook)

    def shutdown(self) -> None:
        """Bounded, whatever is in flight: pending operations are cancelled, a running one
        is asked to stop and given a few seconds, then the members are stopped."""
        for plugin in self.plugins:
            self._run_hook(plugin, "on_stop")
        self._closing = True
        if not self.ops.close(timeout=5.0):
            log.warning("operation %s still running at shutdown; stopping the members under it",
                        self.ops.running())
        self._fail_main_calls()
        if self.scaler is not None:
            self.scaler.shutdown(timeout=self.config.grace_seconds)
            for m in self.registry.members():
                self.registry.mark(m.id, MemberState.LEFT)
            self._save()
            try:
                os.remove(os.path.join(self.config.state_dir, "master.addr"))
            except FileNotFoundError:
                pass
        if self.evals is not None:
            self.evals.close()
        self.fleet.close()
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
                    self.record_event("worker_replaced", id=node.id, pid=info.pid, reason="left early")
                continue
            if member.state == MemberState.DEAD:  # lease expired earlier; now it is gone
                if node.role == "worker" and self.phase == JobPhase.RUNNING:
                    self._maybe_restart(node.id)
                continue
            state = MemberState.SUCCEEDED if (node.role in ("worker", "evaluator")
                                              and node.exit_code == 0) else MemberState.DEAD
            self.registry.mark(node.id, state)
            self._on_member_end(node.id, node.role, state, f"exit code {node.exit_code}")
        for m in self.registry.expire():
            self._on_member_end(m.id, m.role, MemberState.DEAD, "lease expired")
        if self.phase == JobPhase.STARTING:
            if self.routing is None and self.clock() > ps_deadline:
                ready = len(self.live_ps())
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
                self._start_evaluator()
                return
            self._eval_train_point()
            self._check_done()

    @property
    def ps_target(self) -> int:
        """The PS count the job keeps (replacements restore it after a loss)."""
        return self._ps_target

    @property
    def worker_target(self) -> int:
        """The worker count; 0: a PS-only job, which does not end by itself."""
        return self._worker_target

    def live_ps(self) -> list[Member]:
        return [m for m in self.registry.members("ps") if m.state == MemberState.RUNNING and m.address]

    def _on_member_end(self, member_id: str, role: str, state: MemberState, why: str) -> None:
        if role == "worker":
            returned = self.shards.give_back(member_id) if self.shards else []
            self.record_event("worker_end", id=member_id, state=state.value, reason=why,
                        returned_shards=returned)
            if state == MemberState.DEAD and self.phase == JobPhase.RUNNING:
                self._maybe_restart(member_id)
        elif role == "ps":
            self._ended_at[member_id] = time.monotonic()
            self.record_event("ps_end", id=member_id, state=state.value, reason=why)
            routing = self.routing
            if self.phase == JobPhase.RUNNING and routing is not None and member_id in routing.ps_ids:
                self._submit_recovery(member_id, why)
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
            self.record_event("worker_gave_up", id=member_id, restarts=node.restarts)
            return
        info = self.scaler.restart(member_id)
        self.record_event("worker_restart", id=member_id, pid=info.pid, restarts=info.restarts)

    def _check_done(self) -> None:
        nodes = [n for n in self.scaler.nodes() if n.role == "worker"]
        running = [n for n in nodes if n.state == NodeState.RUNNING]
        if running:
            return
        failed = [n for n in nodes if n.state == NodeState.FAILED]
        if self.shards is not None and not self.shards.finished():
            c = self.shards.counts()
            self._set_phase(JobPhase.FAILED,
                            f"all workers exited with {c['todo'] + c['doing']} shards "
                            f"unprocessed: {self._describe_exits(nodes)}")
        elif failed:
            self._set_phase(JobPhase.FAILED, f"workers failed: {self._describe_exits(nodes)}")
        else:
            if self._awaiting_final_eval():
                return
            if not self._keep_model():
                return
            self._set_phase(JobPhase.SUCCEEDED, "all shards done" if self.shards else "workers finished")

    # -- evaluation while training (aimaster/evaluation.py) ----------------------------------
    def _start_evaluator(self) -> None:
        """The evaluator: the worker command with DEEPREC_ROLE=evaluator (local scaler; on
        Kubernetes the TFJob's Evaluator replica runs it)."""
        if self.config.eval is None or not hasattr(self.scaler, "start_evaluator"):
            return
        info = self.scaler.start_evaluator(json.dumps(eval_env_spec(self.config, self.eval_files)))
        self.record_event("evaluator_start", id=info.id, pid=info.pid)

    def _awaiting_final_eval(self) -> bool:
        """Training is over: wait (bounded) for the evaluator to score the final model."""
        if self.config.eval is None:
            return False
        running = [n for n in self.scaler.nodes()  # local: our child; Kubernetes: its pod
                   if n.role == "evaluator" and n.state == NodeState.RUNNING] + \
                  [m for m in self.registry.members("evaluator") if m.state == MemberState.RUNNING]
        if not running:
            return False
        now = self.clock()
        if self._eval_wait_since is None:
            self._eval_wait_since = now
        if now - self._eval_wait_since < self.config.eval.final_timeout_seconds:
            return True
        self.record_event("evaluator_timeout", ids=[n.id for n in running])
        return False

    def record_eval(self, member_id: str, result: dict) -> None:
        if self.evals is None:
            raise ValueError("this job has no eval section")
        kept = self.evals.record(member_id, result)
        if kept["final"]:  # each round is in eval.jsonl; events keep the final one only
            self.record_event("eval_final", **kept)

    def _eval_train_point(self) -> None:
        if self.evals is None:
            return
        rss = [p.ps_memory_bytes() for p in self.plugins if hasattr(p, "ps_memory_bytes")]
        samples = sum(m.samples for m in self.registry.members("worker"))
        self.evals.train_point(self.global_step(), samples, rss[0] if rss else None)

    def _describe_exits(self, nodes) -> str:
        """How every worker ended, not only those that exited non-zero: a job that failed
        because workers ended early (exit 0 with shards left) says so too."""
        parts = []
        for n in sorted(nodes, key=lambda n: n.id):
            code = n.exit_code
            how = ("still running" if code is None else "exited 0" if code == 0
                   else f"killed by signal {-code}" if code < 0 else f"exited {code}")
            if n.restarts:
                how += f" after {n.restarts} restart(s)"
            parts.append(f"{n.id} {how}")
        return "; ".join(parts) + f" (logs: {os.path.join(self.config.state_dir, 'logs')})"

    def _keep_model(self) -> bool:
        """The job trained to the end: take the final checkpoint, then the export, before
        the PS stop. A failure here fails the job: its model would be lost."""
        if self.config.checkpoint_on_success:
            try:
                event = self._final_checkpoint()
            except Exception as exc:  # noqa: BLE001 - reported as the job's failure
                log.exception("final checkpoint failed")
                self._set_phase(JobPhase.FAILED, f"training finished but the final checkpoint "
                                f"failed: {exc}")
                return False
            self.final_checkpoint = event["path"]
        if self.config.export.dir:
            if not self.final_checkpoint:
                self.record_event("export_skipped", reason="checkpoint.on_success is false: "
                            "nothing to export from")
                return True
            try:
                self.export_dir = self._export(self.final_checkpoint)
            except Exception as exc:  # noqa: BLE001
                self._set_phase(JobPhase.FAILED, f"final checkpoint {self.final_checkpoint} "
                                f"written, but its export failed: {exc}")
                return False
        return True

    def _final_checkpoint(self, attempts: int = 20) -> dict:
        """The final checkpoint; a recovery that pre-empts it (or a periodic checkpoint
        still running) delays it, it does not lose the model."""
        for _ in range(attempts - 1):
            try:
                return self.checkpoint(full=True, final=True)
            except (Busy, Preempted) as exc:
                log.info("final checkpoint waits: %s", exc)
                self._await_idle(timeout=600)
        return self.checkpoint(full=True, final=True)

    def _await_idle(self, timeout: float) -> None:
        deadline = self.clock() + timeout
        while not self.ops.idle() and self.clock() < deadline:
            self._drain_main_calls()
            time.sleep(0.05)

    def _export(self, ckpt_path: str) -> str:
        """Export the final checkpoint in a child process (TensorFlow is not loaded in the
        AIMaster); into ``export.dir/<unix seconds>``, the versioned layout TF Serving
        watches."""
        import subprocess
        import sys
        ex = self.config.export
        out = _join(data_fs.absolute(ex.dir), str(int(time.time())))
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
        self.record_event("export", dir=out, duration_ms=round((self.clock() - start) * 1000, 1),
                    bytes=summary.get("bytes"), tables=summary.get("tables"))
        return out

    def on_ps_registered(self) -> None:
        """Once every PS is up, publish the first routing (and restore a resumed or warm
        started model) -- exactly once, however many PS register at the same moment: the
        publish is an operation, deduplicated by the runner and re-checked when it runs."""
        with self._lock:
            if self.routing is not None or len(self.live_ps()) < self.config.ps.replicas:
                return
        try:
            self.ops.submit(OpKind.PUBLISH, self._publish_first)
        except (Busy, NotRunning):
            pass  # already on its way (or the job is ending)

    def _publish_first(self, cancel: threading.Event) -> None:
        with self._lock:
            if self.routing is not None or self.phase != JobPhase.STARTING:
                return
            ps = self.live_ps()
            if len(ps) < self.config.ps.replicas:
                return
            ps = sorted(ps, key=lambda m: m.rank)[: self.config.ps.replicas]
        # a PS that outlived a restarted AIMaster keeps its epoch: start above it
        self.fleet.observe_epoch(self.epoch)
        self.fleet.learn_epochs([m.address for m in ps])
        routing = RoutingTable.even([m.id for m in ps], [m.address for m in ps],
                                    self.config.num_slots, self.fleet.next_epoch())
        self._push_routing(routing)
        if self._resume_from is not None:
            restored = self.fleet.restore(routing, data_fs.absolute(self.checkpoint_dir),
                                          self._resume_from)
            self.record_event("resumed", checkpoint=self._resume_from, rows=restored,
                              shards=self.shards.counts() if self.shards else None)
        elif self.config.init_from:
            if not self._warm_start(routing):
                return
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        self.record_event("routing", epoch=routing.epoch, ps=list(routing.ps_ids))
        self._set_phase(JobPhase.RUNNING)

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
            rows = self.fleet.restore(routing, data_fs.absolute(str(root)), head.id, warm=True,
                                      reset_optimizer=self.config.reset_optimizer)
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
        where = str(head.path) if not data_fs.is_remote(str(root)) else \
            f"{str(root).rstrip('/')}/{head.name}"
        self.record_event("warm_start", checkpoint=where, rows=rows, tables=tables,
                    global_step=self._step_base, reset_optimizer=self.config.reset_optimizer,
                    from_num_slots=head.manifest["num_slots"], num_slots=routing.num_slots,
                    duration_ms=round((self.clock() - start) * 1000, 1))
        return True

    def _push_routing(self, routing: RoutingTable, skip=()) -> list[str]:
        """Ownership plus the replication ring to every live PS of ``routing`` but those in
        ``skip``; returns the PS skipped because they died too (their own recovery follows)."""
        def is_live(ps_id: str) -> bool:
            member = self.registry.get(ps_id)
            return member is None or member.state == MemberState.RUNNING
        skipped = self.fleet.publish(routing, is_live, skip)
        self.fleet.retain(routing.ps_addresses)  # channels of PS that left are closed
        return skipped

    # -- elasticity ----------------------------------------------------------------------------
    def report_stall(self, stall_ms: float) -> None:
        if stall_ms > 0:
            with self._lock:
                self._stall_reports.append((self.clock(), stall_ms))
                del self._stall_reports[:-1000]

    def _await(self, fut, timeout: float | None):
        """Wait for an operation; on the main thread keep serving ``on_main`` calls (the
        operation may need one: children are forked from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return fut.result(timeout)
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            try:
                return fut.result(0.05)
            except TimeoutError:
                self._drain_main_calls()
                if deadline is not None and self.clock() > deadline:
                    raise
                if self._signalled or self._stop.is_set():  # shutdown is bounded
                    raise NotRunning("the AIMaster is stopping") from None

    def _run_op(self, kind: OpKind, fn, key: str | None = None, timeout: float | None = None):
        return self.ops.run(kind, fn, key, timeout, waiter=self._await)

    def _require_running(self) -> None:
        if self.phase != JobPhase.RUNNING:
            raise NotRunning(f"the job is {self.phase.value}, not running")

    def scale(self, ps: int | None = None, workers: int | None = None,
              timeout: float = 600.0) -> dict:
        """Change the PS and/or worker count of the running job; returns the event.

        Raises OperationRefused (nothing changed) for counts out of bounds, a job that is
        not running, or Busy while another scale is queued or running.
        """
        self._require_running()
        cfg = self.config
        if ps is not None and not max(1, cfg.ps.min_replicas) <= ps <= cfg.ps.max_replicas:
            raise OperationRefused(f"ps={ps} is outside [{max(1, cfg.ps.min_replicas)}, "
                                   f"{cfg.ps.max_replicas}] (ps.min_replicas / ps.max_replicas)")
        if workers is not None:
            if not cfg.worker.min_replicas <= workers <= cfg.worker.max_replicas:
                raise OperationRefused(f"workers={workers} is outside [{cfg.worker.min_replicas}, "
                                       f"{cfg.worker.max_replicas}] (worker.min_replicas / max_replicas)")
            if workers > 0 and not cfg.worker.command:
                raise OperationRefused("workers > 0 needs worker.command in the job file")
        # the wait covers time in the queue (a checkpoint or recovery ahead of it) too
        return self._run_op(OpKind.RESCALE, lambda cancel: self._scale_op(ps, workers, timeout),
                            timeout=timeout + 60)

    def _scale_op(self, ps: int | None, workers: int | None, timeout: float) -> dict:
        self._require_running()
        cfg = self.config
        ps_before = len(self.routing.ps_ids)
        workers_before = len(self.live_workers())
        if ps is not None:
            live = {m.id for m in self.live_ps()}
            dead = [p for p in self.routing.ps_ids if p not in live]
            if dead:
                raise Busy(f"PS {dead} died and their recovery is in progress; scale after it")
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
                         seeded_rows=result.seeded_rows,
                         fence_ms=round(result.fence_ms, 3), epoch=result.routing.epoch,
                         # what the fence window is made of (fence calls, last delta,
                         # publish) and the rows of each round: where a long step went
                         phases_ms=result.phases_ms, round_rows=result.round_rows,
                         round_ms=result.round_ms,
                         # PS whose ring peer changed: their copy there was complete first
                         prepared_replicas=sorted(result.prepared))
        if workers is not None and workers != workers_before:
            self._workers_started = True
            self._worker_target = workers  # before the change: 0 means "no completion check"
            self._scale_workers(workers, start + timeout)
            event["workers"] = [workers_before, len(self.live_workers())]
        event["duration_ms"] = round((self.clock() - start) * 1000, 3)
        if event["fence_ms"]:
            # the fence window bounds any request's wait; clients add their own re-routing
            # round trips on top of it and report them with their next heartbeats. The
            # operation does not wait for those (it held the queue for 2.5 heartbeats):
            # the recorded event is raised to them once they are in
            event["max_stall_ms"] = event["fence_ms"]
            timer = threading.Timer(2.5 * cfg.heartbeat_seconds, self._fold_stalls,
                                    (event, start))
            timer.daemon = True
            timer.start()
        return self._record(event, started_at)

    def _fold_stalls(self, event: dict, since: float) -> None:
        with self._lock:
            reported = [v for t, v in self._stall_reports if t >= since]
            if not reported or max(reported) <= event["max_stall_ms"]:
                return
            event["max_stall_ms"] = round(max(reported), 3)
            event["stall_reported_by_clients"] = True
        if self.phase not in FINAL_PHASES:
            self._save()

    def _publish(self, routing: RoutingTable) -> None:
        """Publish a migration's new layout: PS learn it (and re-form the replication
        ring), then clients through GetRouting."""
        self._push_routing(routing)
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        self.record_event("routing", epoch=routing.epoch, ps=list(routing.ps_ids))
        self._save()

    def _record(self, event: dict, started_at: float) -> dict:
        event["time"] = started_at
        if event["kind"].startswith("straggler_"):
            self.count_straggler_event(event["kind"])
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
                stack.enter_context(plugin.around_migration(self.view))
        except BaseException:
            stack.close()
            raise
        return stack

    def _slot_loads(self, routing: RoutingTable) -> np.ndarray | None:
        stats = self.fleet.slot_stats(routing)
        return None if stats is None else placement.slot_loads(*stats)

    def rebalance(self, tolerance: float = 0.05, timeout: float = 600.0) -> dict:
        """Move slots between the current PS so bytes and lookups are even (placement).
        Returns the event; nothing moves when every PS is within ``tolerance``."""
        self._require_running()
        return self._run_op(OpKind.RESCALE, lambda cancel: self._rebalance_op(tolerance),
                            key="rebalance", timeout=timeout + 60)

    def _rebalance_op(self, tolerance: float, capacity: dict[str, float] | None = None,
                      detail: dict | None = None) -> dict:
        self._require_running()
        old = self.routing
        live = {m.id for m in self.live_ps()}
        if any(p not in live for p in old.ps_ids):
            raise Busy("a PS died and its recovery is in progress; rebalance after it")
        start, started_at = self.clock(), time.time()
        stats = self.fleet.slot_stats(old)
        if stats is None:
            raise Busy("not every PS reported its slot statistics yet")
        nbytes, lookups = stats
        ids, n = list(old.ps_ids), len(old.ps_ids)
        weights = None if capacity is None else [float(capacity.get(i, 1.0)) for i in ids]
        new_owner = placement.balance(old.slot_owner, ids, ids,
                                      placement.slot_loads(nbytes, lookups), tolerance, weights)
        event = {"kind": "rebalance" if capacity is None else "straggler_rebalance", "ps": n,
                 "moved_slots": int((new_owner != old.slot_owner).sum()),
                 "bytes_imbalance": [round(placement.imbalance(old.slot_owner, nbytes, n), 4),
                                     round(placement.imbalance(new_owner, nbytes, n), 4)],
                 "lookup_imbalance": [round(placement.imbalance(old.slot_owner, lookups, n), 4),
                                      round(placement.imbalance(new_owner, lookups, n), 4)],
                 "moved_rows": 0, "moved_bytes": 0, "fence_ms": 0.0}
        if weights is not None:
            event["capacity"] = {i: round(w, 3) for i, w in zip(ids, weights)}
            if lookups.sum() > 0:
                event["lookup_share"] = {i: round(float(lookups[new_owner == k].sum()) /
                                                  float(lookups.sum()), 4)
                                         for k, i in enumerate(ids)}
            event.update(detail or {})
        if event["moved_slots"]:
            try:
                with self._around_migration():
                    result = migrate(self.fleet, old, new_owner, ids, list(old.ps_addresses),
                                     self._publish)
            except MigrationError as exc:
                raise OperationRefused(str(exc)) from exc
            event.update(moved_rows=result.moved_rows, moved_bytes=result.moved_bytes,
                         seeded_rows=result.seeded_rows,
                         fence_ms=round(result.fence_ms, 3), epoch=result.routing.epoch)
            if capacity is not None:
                event["phases_ms"] = result.phases_ms
        event["duration_ms"] = round((self.clock() - start) * 1000, 3)
        return self._record(event, started_at)

    # -- stragglers: a slow PS owns less, then is replaced --------------------------------------
    def straggler_rebalance(self, capacity: dict[str, float], detail: dict,
                            tolerance: float = 0.05, timeout: float = 600.0) -> dict:
        """Re-place slots so each PS's share is proportional to its capacity weight (a PS
        serving at half speed owns about half the load); a live migration queued as an
        operation. Returns the event (kind ``straggler_rebalance``)."""
        self._require_running()
        return self._run_op(OpKind.RESCALE,
                            lambda cancel: self._rebalance_op(tolerance, capacity, detail),
                            key="straggler", timeout=timeout + 60)

    def replace_ps(self, ps_id: str, detail: dict, timeout: float = 600.0) -> dict:
        """Start a new PS, move every slot of ``ps_id`` to the fleet live (the new PS takes
        its share), then retire ``ps_id``: a slow PS's replacement, queued as an
        operation. Returns the event (kind ``straggler_replace``)."""
        self._require_running()
        return self._run_op(OpKind.RESCALE, lambda cancel: self._replace_op(ps_id, detail, timeout),
                            key="straggler", timeout=timeout + 60)

    def prestart_ps(self, slow: str) -> list[str]:
        """Start the PS that would replace ``slow`` now, before any replacement is decided
        (a suspected straggler): its process start is then off the replacement's path.
        Outside the operation queue on purpose (it runs beside a re-placement); a later
        ``replace_ps`` asks the scaler for the same count, which starts nothing more, and
        takes it. Returns the node ids started (none when one runs already)."""
        self._require_running()
        routing = self.routing
        if routing is None or slow not in routing.ps_ids:
            raise OperationRefused(f"{slow} owns no slots")
        refusal = self.scaler.retire_refusal(slow)
        if refusal:
            raise OperationRefused(f"{slow} cannot be retired ({refusal})")
        total = len(routing.ps_ids) + 1
        started = self.on_main(lambda: self.scaler.start_replacement("ps", slow, total))
        return list(started.started)

    def retire_spare_ps(self, spare_ids: list[str], detail: dict,
                        timeout: float = 120.0) -> dict:
        """Let pre-started PS go that no replacement took (``prestart_ps``): the count goes
        back, so no PS that owns slots leaves. Queued as an operation (never beside a
        scale or a replacement). Returns the event (kind ``straggler_spare``)."""
        self._require_running()

        def op(cancel):
            ids = set(self.routing.ps_ids)
            idle = [i for i in spare_ids if i not in ids]  # a spare a scale took stays
            for i in idle:
                self.registry.mark(i, MemberState.LEFT)  # told to stop with its next heartbeat
            if idle:
                self.on_main(lambda: self.scaler.apply(ScalePlan(
                    ps=self._count_keeping("ps", sorted(ids)))))
            event = {"kind": "straggler_spare", "state": "retired", "ids": idle, **detail}
            return self._record(event, time.time())
        return self._run_op(OpKind.RESCALE, op, key="straggler", timeout=timeout)

    def _start_ps(self, total: int, old_ids: list[str], deadline: float,
                  replacing: str | None = None) -> list:
        """Ask the scaler for ``total`` PS and wait for the new ones to register; returns
        them by rank. On timeout the new PS are forgotten and the count goes back.
        ``replacing``: the slow PS the new one replaces (kept off its machine)."""
        want = total - len(old_ids)
        if replacing is None:
            self.on_main(lambda: self.scaler.apply(ScalePlan(ps=total)))
        else:
            self.on_main(lambda: self.scaler.start_replacement("ps", replacing, total))
        try:
            fresh = self._wait(lambda: (lambda new: new if len(new) >= want else None)(
                [m for m in self.live_ps() if m.id not in old_ids]), deadline,
                f"{want} new PS to register")
        except OperationRefused:
            for m in self.live_ps():
                if m.id not in old_ids:
                    self.registry.mark(m.id, MemberState.LEFT)
            self.on_main(lambda: self.scaler.apply(ScalePlan(ps=self._count_keeping("ps", old_ids))))
            raise
        return sorted(fresh, key=lambda m: m.rank)[:want]

    def _move_slots(self, old, old_ids: list[str], new_ids: list[str]):
        """Place the slots of ``old`` on ``new_ids`` (by measured loads when the PS can
        report them) and migrate them live; raises MigrationError."""
        addresses = {m.id: m.address for m in self.live_ps()}
        loads = self._slot_loads(old)
        new_owner = rebalance(old.slot_owner, old_ids, new_ids) if loads is None else \
            placement.balance(old.slot_owner, old_ids, new_ids, loads)
        with self._around_migration():
            return migrate(self.fleet, old, new_owner, new_ids,
                           [addresses[i] for i in new_ids], self._publish,
                           stopping=lambda: self._closing)

    def _replace_op(self, slow: str, detail: dict, timeout: float) -> dict:
        self._require_running()
        old = self.routing
        old_ids = list(old.ps_ids)
        live = {m.id for m in self.live_ps()}
        if any(p not in live for p in old_ids):
            raise Busy("a PS died and its recovery is in progress; replace after it")
        if slow not in old_ids:
            raise OperationRefused(f"{slow} owns no slots")
        refusal = self.scaler.retire_refusal(slow)
        if refusal:
            raise OperationRefused(f"{slow} cannot be retired ({refusal}); it keeps its "
                                   "re-placed share")
        start, started_at = self.clock(), time.time()
        deadline = start + timeout
        n = len(old_ids)
        # a replacement the cluster cannot place (Pending) must not hold the queue long;
        # one pre-started while the PS was suspected (prestart_ps) is taken as it is
        new = self._start_ps(n + 1, old_ids, min(deadline, start + self.config.ps_start_timeout),
                             replacing=slow)[0]
        new_ready = self.clock()
        new_ids = [i for i in old_ids if i != slow] + [new.id]
        try:
            result = self._move_slots(old, old_ids, new_ids)
        except MigrationError as exc:
            # the count goes back (a deleted pod below the count would be re-created)
            self.registry.mark(new.id, MemberState.LEFT)
            self.on_main(lambda: self.scaler.apply(ScalePlan(
                ps=self._count_keeping("ps", old_ids))))
            raise OperationRefused(str(exc)) from exc
        self.registry.mark(slow, MemberState.LEFT)  # told to stop with its next heartbeat
        self.on_main(lambda: self.scaler.retire(slow))  # it owns nothing now: it just exits
        event = {"kind": "straggler_replace", "slow": slow, "new": new.id,
                 "moved_slots": result.moved_slots, "moved_rows": result.moved_rows,
                 "moved_bytes": result.moved_bytes, "fence_ms": round(result.fence_ms, 3),
                 "epoch": result.routing.epoch,
                 # waiting for the new PS (about 0 when it was pre-started), then the move
                 "new_ps_wait_ms": round((new_ready - start) * 1000, 3),
                 "phases_ms": result.phases_ms, **detail}
        event["duration_ms"] = round((self.clock() - start) * 1000, 3)
        return self._record(event, started_at)

    def replace_worker(self, worker_id: str, detail: dict, timeout: float = 600.0) -> dict:
        """Start a new worker, then retire ``worker_id`` at its next step boundary: it hands
        its shards back at the record it reached (the new or another idle worker trains
        the rest) and exits. A slow worker's replacement, queued as an operation; returns
        the event (kind ``straggler_replace``, ``role: worker``)."""
        self._require_running()
        return self._run_op(OpKind.RESCALE,
                            lambda cancel: self._replace_worker_op(worker_id, detail, timeout),
                            key="straggler", timeout=timeout + 60)

    def _replace_worker_op(self, slow: str, detail: dict, timeout: float) -> dict:
        self._require_running()
        cfg = self.config
        live = sorted(self.live_workers(), key=lambda w: w.rank)
        if slow not in {w.id for w in live}:
            raise OperationRefused(f"{slow} is not a live worker")
        if self.shards is not None and self.shards.finished():
            raise OperationRefused("every shard is done: nothing left to hand over")
        refusal = self.scaler.retire_refusal(slow)
        if refusal:
            raise OperationRefused(f"{slow} cannot be retired ({refusal}); its shards are "
                                   "still split for idle workers")
        n = len(live)
        if n + 1 > cfg.worker.max_replicas:
            raise OperationRefused(f"a replacement needs {n + 1} workers for a moment, above "
                                   f"worker.max_replicas ({cfg.worker.max_replicas})")
        start, started_at = self.clock(), time.time()
        deadline = start + timeout
        before = {w.id for w in live}
        started = self.on_main(lambda: self.scaler.start_replacement("worker", slow, n + 1))
        try:
            new = self._wait(lambda: next((w for w in self.live_workers()
                                           if w.id not in before), None),
                             min(deadline, start + cfg.ps_start_timeout),
                             "the new worker to register")
        except OperationRefused:
            # the count goes back (on Kubernetes the operator deletes the Pending pod)
            for node_id in started.started:
                self.registry.mark(node_id, MemberState.LEFT)
            self.on_main(lambda: self.scaler.apply(ScalePlan(
                workers=self._count_keeping("worker", sorted(before)))))
            raise
        # the slow worker is told to leave with its next heartbeat: it finishes the step
        # in flight, hands its shards back at the record it reached, deregisters and exits
        with self._lock:
            self._leaving.add(slow)
        self.record_event("workers_leaving", ids=[slow])
        held_before = sorted(s for s, w in (self.shards.doing() if self.shards else {}).items()
                             if w == slow)

        def gone():
            nodes = {x.id: x for x in self.scaler.nodes()}
            return slow not in nodes or nodes[slow].state != NodeState.RUNNING
        clean = True
        try:
            self._wait(gone, min(deadline, self.clock() + cfg.grace_seconds),
                       f"{slow} to leave")
        except OperationRefused:
            clean = False
            log.warning("%s did not leave in time; stopping it", slow)
        if self.registry.mark(slow, MemberState.LEFT) is not None and self.shards:
            # it did not leave cleanly: its shards go back from their last recorded position
            self.shards.give_back(slow)
        if clean:
            self.on_main(lambda: self.scaler.retire(slow))
        else:  # hung: stopped for good (on Kubernetes its pod is deleted; a fresh one joins)
            self.on_main(lambda: self.scaler.kill(slow))
        event = {"kind": "straggler_replace", "role": "worker", "slow": slow, "new": new.id,
                 "shards": held_before, "left_cleanly": clean, **detail}
        event["duration_ms"] = round((self.clock() - start) * 1000, 3)
        return self._record(event, started_at)

    def _submit_recovery(self, dead: str, why: str) -> None:
        """Queue the recovery of a dead PS ahead of every other operation (it pre-empts a
        running checkpoint). A recovery of the same PS already queued is the same one."""
        def run(cancel: threading.Event) -> None:
            try:
                self._recover_ps_once(dead, why)
            except Exception as exc:  # noqa: BLE001 - a recovery that cannot finish fails loudly
                log.exception("recovery of %s failed", dead)
                self._set_phase(JobPhase.FAILED, f"recovery of {dead} failed: {exc}")
        try:
            self.ops.submit(OpKind.RECOVER, run, key=f"recover-{dead}")
        except Busy:
            pass
        except NotRunning:
            log.warning("%s died while the job shuts down; not recovered", dead)

    def _newest_checkpoint(self):
        return self._newest_checkpoint_in(self.checkpoint_dir)

    @staticmethod
    def _newest_checkpoint_in(root: str):
        from checkpoint import list_chains
        if not data_fs.is_remote(root) and not os.path.isdir(root):
            return None
        try:
            chains = list_chains(root)
        except (OSError, ValueError):
            return None
        return chains[0].head if chains else None

    def _restore_slots_from_checkpoint(self, old: RoutingTable, mask, live, dead: str, why: str,
                                       onto: str | None = None,
                                       copy_gone: str = "its replica peer is not alive"):
        """Both copies of some slots are gone: load them from the newest checkpoint onto a
        live PS (``onto``, else the one with the fewest slots). Updates since that
        checkpoint are lost for those slots (reported)."""
        head = self._newest_checkpoint()
        candidates = [onto] if onto is not None else \
            [p for p in old.ps_ids if p in live and p != dead]
        if head is None or not candidates:
            self._set_phase(JobPhase.FAILED, f"{dead} died ({why}), {copy_gone} and there is "
                            "no checkpoint; its rows are lost")
            return None
        counts = {p: int((old.slot_owner == old.ps_ids.index(p)).sum()) for p in candidates}
        target = min(candidates, key=lambda p: counts[p])
        try:
            rows = self.fleet.restore_slots(old.ps_addresses[old.ps_ids.index(target)], mask,
                                            old.num_slots, data_fs.absolute(self.checkpoint_dir),
                                            head.id)
        except grpc.RpcError as exc:
            self._set_phase(JobPhase.FAILED, f"{dead} died, no live replica, and restoring its "
                            f"slots from checkpoint {head.id} failed: {exc.details()}")
            return None
        age_ms = (time.time() - (head.created or time.time())) * 1000

        return target, head.id, ps_pb2.PromoteResponse(rows=rows, replica_age_ms=age_ms)

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
        op_start = time.monotonic()
        member = self.registry.get(dead)
        silent_ms = (detected - member.last_heartbeat) * 1000 if member else 0.0
        # an operation: nothing else changes the layout meanwhile
        old = self.routing
        if self.phase != JobPhase.RUNNING or dead not in old.ps_ids:
            return
        ids = list(old.ps_ids)
        i = ids.index(dead)
        n = len(ids)
        peer = ids[(i + 1) % n] if n > 1 else None
        live = {m.id for m in self.live_ps()}
        mask = old.slot_owner == i
        with self._sole_lock:
            sole = self._sole_copy.pop(dead, None)
        # slots the dead PS itself had taken over in a recovery and not yet copied on to
        # its peer: the peer's copy lacks them (or holds only the pushes sync replication
        # sent since), so they come whole from the checkpoint
        uncopied = mask & sole if sole is not None and sole.shape == mask.shape \
            else np.zeros_like(mask)
        restored_from = None
        from_ckpt = 0  # slots restored from the checkpoint
        routing = None  # set when the promotion carried it
        peer_only = False  # every slot restored onto the peer: nothing to promote
        if uncopied.any() and peer is not None and peer in live:
            part = self._restore_slots_from_checkpoint(
                old, uncopied, live, dead, why, onto=peer,
                copy_gone=f"its peer {peer} had no copy yet of the slots it had taken over")
            if part is None:
                return
            _, restored_from, restored = part
            from_ckpt = int(uncopied.sum())
            log.warning("%s died before its peer had a copy of %d slot(s) it had taken over: "
                        "%d rows of them restored on %s from checkpoint %s", dead,
                        from_ckpt, restored.rows, peer, restored_from)
            peer_only = not (mask & ~uncopied).any()
        if peer_only:
            resp = restored
        elif peer is None or peer not in live:
            # no live copy: restore only these slots from the newest checkpoint, onto the
            # live PS holding the fewest slots
            target = self._restore_slots_from_checkpoint(old, mask, live, dead, why)
            if target is None:
                return
            peer, restored_from, resp = target
            from_ckpt = int(mask.sum())
        else:
            # the routing goes with the promotion: the peer applies it in the same call,
            # and the other PS (whose slots do not change, only their ring peer) are told
            # meanwhile, so clients learn it one round trip sooner than after a Promote
            # and then a SetRouting round
            routing = self._recovery_routing(old, dead, peer, mask)
            others = _Background(self._push_routing, routing, skip=(peer,))
            resp, peer_answered = self._promote(
                old, ids, peer, dead, mask & ~uncopied,
                self.fleet.routing_request(routing, routing.ps_ids.index(peer)))
            others.wait()  # before any newer routing (a fallback's) goes out
            if resp is None or not resp.routing_applied:
                routing = None
            elif others.error is not None:
                raise others.error
            if resp is None:
                # no promotable copy (the peer died too, not yet noticed, or it holds no
                # complete copy): restore these slots from the checkpoint. A peer that
                # answered is alive and may take them: after a double failure in a ring
                # of 3 it is the only PS left (a ring re-formed after the first death
                # makes it the second one's peer before it holds a copy)
                # (the slots restored onto the peer above stay there if it answered; if
                # it did not, they are restored again, with the rest, elsewhere)
                rest = mask & ~uncopied if peer_answered else mask
                target = self._restore_slots_from_checkpoint(
                    old, rest, live if peer_answered else live - {peer}, dead, why,
                    onto=peer if uncopied.any() and peer_answered else None,
                    copy_gone=f"its replica peer {peer} holds no complete copy of it (a new "
                    "peer after a recovery, whose full copy had not completed)"
                    if peer_answered else "its replica peer is not alive")
                if target is None:
                    return
                peer, restored_from, resp = target
                from_ckpt = int(mask.sum())
            elif uncopied.any():
                resp = ps_pb2.PromoteResponse(rows=resp.rows + restored.rows,
                                              replica_age_ms=restored.replica_age_ms,
                                              routing_applied=resp.routing_applied)
        promoted = time.monotonic()
        if routing is None:  # restored from a checkpoint (or the peer did not apply it)
            routing = self._recovery_routing(old, dead, peer, mask)
            self._push_routing(routing)
        with self._lock:
            self.routing, self.epoch = routing, routing.epoch
        resumed = self.clock()
        published = time.monotonic()
        self._note_sole_copy(peer, mask)
        exit_reported = getattr(self.scaler, "exit_reported", {}).get(dead)
        event = {"kind": "recovery", "dead": dead, "reason": why, "promoted_on": peer,
                 "promoted_rows": resp.rows, "epoch": routing.epoch,
                 "restored_from_checkpoint": restored_from,
                 "slots_from_checkpoint": from_ckpt,
                 "last_heartbeat_age_ms": round(silent_ms, 1),
                 "resumed_ms": round((resumed - detected) * 1000, 1),
                 "replication_interval_ms": 0.0 if self.config.sync_replication
                 else self.config.replication_interval_ms,
                 # the updates at risk are those the dead PS applied after its last
                 # shipment: measured as the replica's age when it was promoted
                 "updates_at_risk_ms": round(resp.replica_age_ms, 1)
                 if restored_from is not None or not self.config.sync_replication else 0.0,
                 "replication": "sync" if self.config.sync_replication else "async",
                 # where the recovery's time went, as time.monotonic() of this host
                 # (one clock for all its processes: a benchmark lines them up with its
                 # kill): the kernel reporting the exit (local scaler only), the AIMaster
                 # handling it, the operation starting, the copy promoted, the routing
                 # on every PS and published to clients
                 "mono": {k: round(v, 6) for k, v in (
                     ("exit_reported", exit_reported
                      if exit_reported is not None and exit_reported <= op_start else None),
                     ("ps_end", self._ended_at.get(dead)), ("op_start", op_start),
                     ("promoted", promoted), ("published", published)) if v is not None},
                 "time": time.time()}
        with self._lock:
            self.events.append(event)
        log.info("event recovery %s", event)
        self._save()
        self._stop_node(dead)
        # the replacement PS's start (seconds of CPU: interpreter, imports) waits for the
        # clients' first steps on the new routing; it restores capacity, not a copy
        timer = threading.Timer(self.REPLACEMENT_DELAY_SECONDS, self._submit_replacement,
                                args=(dead,))
        timer.daemon = True
        timer.start()

    SOLE_COPY_POLL_SECONDS = 0.5
    SOLE_COPY_WATCH_SECONDS = 3600.0

    def _note_sole_copy(self, ps_id: str, mask) -> None:
        """``ps_id`` now holds ``mask``'s rows with no second copy: until its replica peer
        has everything it holds now, a death of ``ps_id`` restores those slots from the
        checkpoint (``_recover_ps_once``). A background watch clears them once the PS
        reports its peer's copy past the sequence number it had after taking them over."""
        with self._sole_lock:
            prev = self._sole_copy.get(ps_id)
            self._sole_copy[ps_id] = mask.copy() if prev is None or prev.shape != mask.shape \
                else prev | mask
        threading.Thread(target=self._watch_sole_copy, args=(ps_id, mask.copy()),
                         name=f"sole-copy-{ps_id}", daemon=True).start()

    def _watch_sole_copy(self, ps_id: str, mask) -> None:
        deadline = time.monotonic() + self.SOLE_COPY_WATCH_SECONDS
        target = None
        while time.monotonic() < deadline and self.phase not in FINAL_PHASES:
            routing = self.routing
            with self._sole_lock:
                if ps_id not in self._sole_copy or routing is None or ps_id not in routing.ps_ids:
                    return  # died (its recovery took the slots) or left
            try:
                st = self.fleet.stats(routing.ps_addresses[routing.ps_ids.index(ps_id)],
                                      timeout=5, replication_only=True)
            except grpc.RpcError:
                time.sleep(self.SOLE_COPY_POLL_SECONDS)
                continue
            if target is None:
                target = st.sequence  # every row it took over is stamped at or before this
            elif st.shipped_sequence >= target:
                with self._sole_lock:
                    cur = self._sole_copy.get(ps_id)
                    if cur is not None:
                        cur &= ~mask
                        if not cur.any():
                            del self._sole_copy[ps_id]
                self.record_event("replica_current", ps=ps_id, slots=int(mask.sum()),
                                  shipped_sequence=int(st.shipped_sequence))
                return
            time.sleep(self.SOLE_COPY_POLL_SECONDS)

    def _recovery_routing(self, old: RoutingTable, dead: str, owner: str, mask) -> RoutingTable:
        """``old`` without ``dead``, its slots (``mask``) owned by ``owner``; a new epoch."""
        ids = list(old.ps_ids)
        new_ids = [x for x in ids if x != dead]
        owner_ids = np.asarray(ids, dtype=object)[old.slot_owner]
        owner_ids[mask] = owner
        index_of = {x: k for k, x in enumerate(new_ids)}
        new_owner = np.array([index_of[x] for x in owner_ids], dtype=np.int32)
        addresses = dict(zip(old.ps_ids, old.ps_addresses))
        return RoutingTable(self.fleet.next_epoch(), old.num_slots, tuple(new_ids),
                            tuple(addresses[x] for x in new_ids), new_owner)

    def _promote(self, old: RoutingTable, ids: list[str], peer: str, dead: str, mask,
                 routing: ps_pb2.SetRoutingRequest | None = None):
        """Promote ``peer``'s replica of ``dead``'s slots: (response, True), or (None,
        whether the peer answered) when it has no promotable copy. A replica being rebuilt
        (full resync) is waited for, within a bound. ``routing``: the peer's routing after
        it, applied in the same call."""
        deadline = self.clock() + self.config.lease_seconds * 10 + 10
        while True:
            try:
                return self.fleet.promote(old.ps_addresses[ids.index(peer)], dead, mask,
                                          old.num_slots, routing=routing), True
            except grpc.RpcError as exc:
                kind = wire_errors.kind_of(exc)
                if kind == wire_errors.ErrorKind.RESYNCING and self.clock() < deadline:
                    time.sleep(0.1)
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE or kind in (
                        wire_errors.ErrorKind.RESYNCING, wire_errors.ErrorKind.NO_REPLICA):
                    log.warning("%s: no promotable replica on %s (%s: %s); restoring from "
                                "checkpoint", dead, peer, exc.code().name, exc.details())
                    return None, exc.code() != grpc.StatusCode.UNAVAILABLE
                raise OperationRefused(f"{dead} died and promoting its replica on {peer} "
                                       f"failed: {exc.code().name}: {exc.details()}") from exc

    def _submit_replacement(self, dead: str) -> None:
        """A replacement for a recovered PS: an ordinary scale-out back to the job's PS
        count, queued behind whatever runs now (its own key: a user's scale request is
        not refused because of it)."""
        def run(cancel: threading.Event):
            if self.phase != JobPhase.RUNNING or len(self.routing.ps_ids) >= self._ps_target:
                return None
            try:
                return self._scale_op(self._ps_target, None, 600.0)
            except Busy:  # e.g. another PS died meanwhile: after its recovery
                if not cancel.is_set():
                    threading.Timer(1.0, self._submit_replacement, args=(dead,)).start()
            except OperationRefused as exc:
                self.record_event("replacement_failed", dead=dead, reason=str(exc))
            return None
        try:
            self.ops.submit(OpKind.RESCALE, run, key=f"replace-{dead}")
        except (Busy, NotRunning):
            pass

    def global_step(self) -> int:
        """Training steps of all workers of this job plus those of the checkpoint it
        started from (a resume or a warm start)."""
        # int64 on the wire: a member's absurd counter must not break every status answer
        return min(self._step_base + sum(m.steps for m in self.registry.members("worker")),
                   MAX_COUNTER)

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
        except RecursionError:
            raise ValueError("model_json is nested too deeply") from None
        if isinstance(spec, dict) and spec.get("kind") == "eval":  # an evaluator's round
            return self.record_eval(worker_id, spec)
        if not isinstance(spec, dict) or spec.get("kind") not in ("keras", "tables"):
            raise ValueError("model_json: expected an object with kind 'keras' or 'tables'")
        if not isinstance(spec.get("tables", {}), dict):
            raise ValueError(f"model_json: 'tables' must be an object of table name -> spec, "
                             f"got {type(spec['tables']).__name__}")
        with self._lock:
            self.model_spec = spec
        self.record_event("model_recorded", worker=worker_id, model_kind=spec["kind"],
                          tables=sorted(spec.get("tables", {})))
        if self._warm_tables is not None:
            fresh = sorted(set(spec.get("tables", {})) - self._warm_tables)
            if fresh:
                log.warning("tables %s are not in the init_from checkpoint: they start fresh", fresh)
                self.record_event("warm_start_fresh_tables", tables=fresh)
        self._save()

    def checkpoint(self, full: bool = False, final: bool = False) -> dict:
        """Take a checkpoint now (an operation: after a running scale, before a pending
        one; a recovery pre-empts it). Busy while another checkpoint is queued or running."""
        self._require_running()
        return self._run_op(OpKind.CHECKPOINT, lambda cancel: self._checkpoint_or_full(cancel, full, final))

    def _checkpoint_or_full(self, cancel: threading.Event, full: bool, final: bool) -> dict:
        """An incremental that a PS cannot cut (its deletion log no longer reaches back to
        the previous checkpoint) is taken again as a full one, in the same operation."""
        try:
            return self._checkpoint_op(cancel, full, final)
        except grpc.RpcError as exc:
            if full or wire_errors.kind_of(exc) != wire_errors.ErrorKind.NEEDS_FULL:
                raise
            self.record_event("checkpoint_needs_full", reason=exc.details())
            return self._checkpoint_op(cancel, True, final)

    @staticmethod
    def _cut_key(member: Member) -> str:
        """Per-process key of a PS's checkpoint cut: its id and incarnation. A replacement
        under the same id -- and, in a container, the same pid 1 -- has no cut yet, so its
        first incremental holds every row it has instead of those past the old one's cut."""
        return f"{member.id}#{member.incarnation}"

    def _checkpoint_op(self, cancel: threading.Event, full: bool, final: bool) -> dict:
        """Every PS writes the rows of its slots (incremental: rows changed since its part
        of the previous checkpoint), then the manifest is committed with the data-shard
        queues and the routing, so model and consumed data match. The layout cannot change
        meanwhile (operations run one at a time); lookups and pushes go on."""
        from checkpoint import CheckpointWriter, apply_retention, next_id
        from checkpoint.format import dir_name
        self._require_running()
        start = self.clock()
        routing = self.routing
        members = {m.id: m for m in self.live_ps()}
        missing = [p for p in routing.ps_ids if p not in members]
        if missing:
            raise Busy(f"PS {missing} are not live (recovery in progress?)")
        chain = self._ckpt_chain
        incr = (not full and chain is not None
                and chain["n"] % self.config.checkpoint_full_every != 0)
        ckpt_id = next_id(self.checkpoint_dir)
        kind = "incr" if incr else "full"
        shard_state = self.shards.to_state() if self.shards else None
        futures = {}
        for ps_id, address in zip(routing.ps_ids, routing.ps_addresses):
            key = self._cut_key(members[ps_id])
            since = (chain["since"].get(key, {}) if incr else {})
            futures[key] = self.fleet.write_checkpoint(address, ps_pb2.WriteCheckpointRequest(
                root=data_fs.absolute(self.checkpoint_dir), ckpt_id=ckpt_id, kind=kind,
                parent=chain["id"] if incr else 0, writer_id=ps_id, since_json=json.dumps(since)))
        # the end of the writes is signalled, not polled: polling every 50 ms added 25 ms
        # on average (up to 50) to every checkpoint, about a third of a 4M-row
        # incremental's time; a pre-emption is still seen within 5 ms
        written, left, counting = threading.Event(), [len(futures)], threading.Lock()

        def one_written(_f) -> None:
            with counting:
                left[0] -= 1
                if left[0] <= 0:
                    written.set()
        if not futures:
            written.set()
        for f in futures.values():
            f.add_done_callback(one_written)
        while not written.wait(0.005):
            if cancel.is_set():
                for f in futures.values():
                    f.cancel()
                # no manifest: the chunks written so far are never part of a checkpoint
                self.record_event("checkpoint_preempted", id=ckpt_id, type=kind)
                raise Preempted(f"checkpoint {ckpt_id} was pre-empted by a PS recovery; "
                                "nothing was committed")
        results = {k: f.result() for k, f in futures.items()}
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
        # manifest checks (checksum, file sizes) of every checkpoint, and the chunk crc32s
        # of the one just committed only: never a read of the whole chain after a commit;
        # restores still verify every chunk they read
        deleted = apply_retention(self.checkpoint_dir, self.config.checkpoint_keep_chains,
                                  verify="new")
        event = {"kind": "checkpoint", "id": ckpt_id, "type": kind,
                 "rows": sum(r.rows for r in results.values()),
                 "bytes": sum(r.bytes for r in results.values()),
                 "duration_ms": round((self.clock() - start) * 1000, 1),
                 "dir": data_fs.absolute(self.checkpoint_dir), "retention_deleted": deleted,
                 "path": _join(data_fs.absolute(self.checkpoint_dir), dir_name(ckpt_id, kind)),
                 "global_step": self.global_step(), "final": final,
                 "time": time.time()}
        with self._lock:
            self.events.append(event)
            self.checkpoint_pointer = event
        log.info("event checkpoint %s", event)
        self._save()
        return event

    def _maybe_periodic_checkpoint(self) -> None:
        every = self.config.checkpoint_interval_seconds
        if not every or self.phase != JobPhase.RUNNING or self.clock() - self._last_ckpt < every:
            return
        self._last_ckpt = self.clock()
        try:
            fut = self.ops.submit(OpKind.CHECKPOINT,
                                  lambda cancel: self._checkpoint_or_full(cancel, False, False))
        except (Busy, NotRunning):
            return

        def done(f) -> None:  # reported as an event; the job goes on
            exc = None if f.cancelled() else f.exception()
            if exc is not None and not isinstance(exc, Preempted):
                self.record_event("checkpoint_failed", reason=str(exc))
        fut.add_done_callback(done)

    def leaving(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._leaving)

    def live_workers(self) -> list[Member]:
        return [m for m in self.registry.members("worker")
                if m.state == MemberState.RUNNING and m.id not in self._leaving]

    def _wait(self, predicate, deadline: float, what: str):
        while self.clock() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise OperationRefused(f"timed out waiting for {what}")

    def _scale_ps(self, n: int, deadline: float):
        old = self.routing
        old_ids = list(old.ps_ids)
        if n > len(old_ids):
            joining = self._start_ps(n, old_ids, deadline)
            new_ids = old_ids + [m.id for m in joining]
        else:
            # the backend decides who leaves (on Kubernetes the operator deletes the
            # highest replica indices): exactly those are drained before the count drops
            leaving = set(self.scaler.leavers("ps", n))
            new_ids = [i for i in old_ids if i not in leaving]
            if not new_ids:
                raise OperationRefused(f"scaling PS to {n} would remove every PS that owns slots")
        try:
            result = self._move_slots(old, old_ids, new_ids)
        except MigrationError as exc:
            joined = [i for i in new_ids if i not in old_ids]
            for ps_id in joined:  # the layout is the old one again: the new PS own nothing
                self.registry.mark(ps_id, MemberState.LEFT)
            if joined:
                self.on_main(lambda: self.scaler.apply(ScalePlan(ps=self._count_keeping("ps", old_ids))))
            raise OperationRefused(str(exc)) from exc
        leaving = [i for i in old_ids if i not in new_ids]
        for ps_id in leaving:
            self.registry.mark(ps_id, MemberState.LEFT)
        if leaving:
            self.on_main(lambda: self.scaler.apply(ScalePlan(ps=n)))
        return result

    def _count_keeping(self, role: str, ids: list[str]) -> int:
        """The smallest count whose scale-in removes none of ``ids`` (a rollback with a
        gap in the indices must not delete a member that owns data)."""
        n = len(ids)
        while set(self.scaler.leavers(role, n)) & set(ids):
            n += 1
        return n

    def _scale_workers(self, m: int, deadline: float) -> None:
        live = sorted(self.live_workers(), key=lambda w: w.rank)
        if m > len(live):
            before = {w.id for w in live}
            self.on_main(lambda: self.scaler.apply(ScalePlan(workers=m)))
            self._wait(lambda: len(self.live_workers()) >= m, deadline,
                       f"{m - len(before)} new worker(s) to register")
            return
        leaving = set(self.scaler.leavers("worker", m))
        victims = [w.id for w in live if w.id in leaving]
        with self._lock:
            self._leaving.update(victims)
        self.record_event("workers_leaving", ids=victims)

        def gone():
            nodes = {n.id: n for n in self.scaler.nodes()}
            return all(v not in nodes or nodes[v].state != NodeState.RUNNING for v in victims)

        try:
            # a leaving worker finishes its step, returns its shards and exits by itself
            self._wait(gone, min(deadline, self.clock() + self.config.grace_seconds),
                       "leaving workers to exit")
        except OperationRefused:
            log.warning("workers %s did not leave in time; stopping them", victims)
        # drained before the count drops: a straggler that missed the grace period (or
        # crashed while leaving) hands its shards back here, then its pod may go
        for v in victims:
            if self.registry.mark(v, MemberState.LEFT) is not None and self.shards:
                self.shards.give_back(v)
        self.on_main(lambda: self.scaler.apply(ScalePlan(workers=m)))

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
                expected = {w.id for w in self.live_workers()}
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

    # -- members and shards (the servicer's requests) ----------------------------------------
    def register(self, role: str, member_id: str, pid: int, address: str,
                 incarnation: str = "", control_address: str = "") -> Member:
        before = self.registry.get(member_id) if member_id else None
        if role == "ps":
            self.fleet.set_control_address(address, control_address)
        member = self.registry.register(role, member_id, pid, address, incarnation)
        if before is None or before.incarnation != member.incarnation:
            # a new process under an id that was scaled in earlier is not leaving (its
            # predecessor's exit, if not seen yet, is told apart by its pid)
            with self._lock:
                self._leaving.discard(member.id)
        self.record_event("register", id=member.id, role=member.role, pid=member.pid,
                          address=member.address)
        self._save()
        if member.role == "ps":
            # publishing may restore a checkpoint: not on the RPC thread of a Register
            threading.Thread(target=self.on_ps_registered, daemon=True).start()
        return member

    def heartbeat(self, member_id: str, steps: int, samples: int, max_stall_ms: float,
                  request=None) -> tuple[bool, bool]:
        """Returns (known, stop): a member that left (scale-in) or whose job ended is told
        to stop, never to register again."""
        member = self.registry.heartbeat(member_id, steps, samples)
        self.report_stall(max_stall_ms)
        if request is not None:
            for plugin in self.plugins:
                self._run_hook(plugin, "on_heartbeat", request)
        known = self.registry.get(member_id)
        left = known is not None and known.state == MemberState.LEFT
        return (member is not None or left,
                left or self.phase in FINAL_PHASES or member_id in self._leaving)

    def deregister(self, member_id: str, reason: str) -> None:
        member = self.registry.mark(member_id, MemberState.LEFT)
        routing = self.routing
        if (member is not None and member.role == "ps" and routing is not None
                and member_id in routing.ps_ids and self.phase == JobPhase.RUNNING):
            # a PS leaving on its own (preemption notice) after handing its last delta to
            # its ring peer: promote that copy, as for a death, and replace it
            self.record_event("ps_end", id=member_id, state="left", reason=reason)
            self._submit_recovery(member_id, reason)
        if member is not None and member.role == "worker" and self.shards:
            returned = self.shards.give_back(member_id)
            self.record_event("worker_left", id=member_id, reason=reason, returned_shards=returned)
            self._save()

    def assign_shard(self, worker_id: str):
        """(state, shard) for a live worker's request; persisted before it is answered."""
        state, shard = self.shards.assign(worker_id)
        if state == ShardState.DOING:
            self._waiting.pop(worker_id, None)
            self._save()
        elif state is None:
            self._waiting[worker_id] = self.clock()
        return state, shard

    # -- stragglers: a slow worker's shard is split for an idle one ----------------------------
    def count_straggler_event(self, kind: str) -> None:
        with self._lock:
            self.straggler_counts[kind] += 1

    def waiting_workers(self, within: float = 2.0) -> list[str]:
        """Live workers that asked for a shard in the last ``within`` seconds and got none."""
        now, live = self.clock(), {m.id for m in self.live_workers()}
        return [w for w, t in list(self._waiting.items()) if now - t <= within and w in live]

    def request_split(self, worker_id: str, for_worker: str) -> bool:
        """Ask ``worker_id`` (with its next heartbeat) to cut its shard at the record it
        reached; the rest is reserved for ``for_worker``. False: an ask is outstanding."""
        with self._lock:
            if worker_id in self._split_asks:
                return False
            self._split_asks[worker_id] = (for_worker, self.clock())
        return True

    def take_split_ask(self, worker_id: str) -> bool:
        """Heartbeat: whether to tell this worker to split (once per ask; an ask left
        unanswered for 3 heartbeats lapses)."""
        with self._lock:
            ask = self._split_asks.get(worker_id)
            if ask is None:
                return False
            if self.clock() - ask[1] > 3 * self.config.heartbeat_seconds + 1:
                del self._split_asks[worker_id]
            return True

    def split_shards(self, worker_id: str, shard_ids: list[int], positions: list[int]) -> list[int]:
        """A worker's answer to a split ask: each shard cut at its position; returns the ids
        that were split (a cut that cannot be exact is refused: the worker keeps all)."""
        with self._lock:
            ask = self._split_asks.pop(worker_id, None)
        for_worker = ask[0] if ask else None
        done = []
        for sid, at in zip(shard_ids, positions):
            rest = self.shards.split(worker_id, int(sid), int(at), reserve_for=for_worker,
                                     reserve_seconds=max(5.0, 3 * self.config.heartbeat_seconds))
            if rest is None:
                continue
            done.append(int(sid))
            self.count_straggler_event("shard_split")
            self.record_event("shard_split", worker=worker_id, shard=int(sid), at=int(at),
                              new_shard=rest.shard_id, rest=rest.end - rest.start
                              if rest.end < (1 << 62) else None, to=for_worker)
        if done:
            self._save()
        return done

    def report_shards(self, worker_id: str, done: list[int], returned: list[int],
                      positions: list[int]) -> list[int]:
        """Done and handed-back shards of a worker (``positions``: where each returned
        shard's untrained records begin); returns the done ids it did not hold."""
        taken = self.shards.complete(worker_id, done)
        if returned:
            starts = [self.shards.position(s) for s in returned]
            back = self.shards.give_back(worker_id, returned, dict(zip(returned, positions)))
            self.record_event("shards_returned", worker=worker_id, shards=back,
                              positions=[int(p) for p in positions[:len(returned)]],
                              progress=[max(int(p) - s, 0) if s is not None else 0
                                        for p, s in zip(positions, starts)])
        self._save()
        return sorted(set(done) - set(taken))

    def report_bad_input(self, worker_id: str, entries: list[dict], fatal: bool) -> None:
        """Bad input a worker found in its shards (``data.on_bad_record``): kept in the
        shard state, an event per new report; ``fatal`` (``fail``): the job fails, naming
        the file and position."""
        if self.shards is None:
            return
        # only the worker a shard is DOING for reports on it (a stray or replayed report
        # must not fail the job), and only within bounds
        entries = [{"shard_id": int(e["shard_id"]), "path": str(e["path"])[:1000],
                    "offset": max(int(e["offset"]), 0), "reason": str(e["reason"])[:1000],
                    "count": min(max(int(e["count"]), 1), 1 << 40)}
                   for e in entries[:1000] if self.shards.holder(e["shard_id"]) == worker_id]
        new = []
        for sid in sorted({e["shard_id"] for e in entries}):
            mine = [{k: e[k] for k in ("path", "offset", "reason", "count")}
                    for e in entries if e["shard_id"] == sid]
            new += [{"shard_id": sid, **e} for e in self.shards.record_bad(sid, mine)]
        for e in new:
            self.record_event("bad_input", worker=worker_id, **e)
            log.warning("bad input in shard %d: %s at %s %d: %s", e["shard_id"], e["path"],
                        "row" if e["path"].lower().endswith((".parquet", ".pq")) else "byte",
                        e["offset"], e["reason"])
        if fatal and entries:
            e = entries[0]
            self._set_phase(JobPhase.FAILED, f"bad input in {e['path']} at position "
                                             f"{e['offset']}: {e['reason']} "
                                             "(data.on_bad_record: fail)")
        self._save()

    def complete_shards(self, shard_ids: list[int]) -> None:
        if self.shards is not None:
            if shard_ids:
                self.shards.mark_done(shard_ids)
            self._save()

    # -- reporting ---------------------------------------------------------------------------
    def progress_line(self) -> str:
        workers = [m for m in self.registry.members("worker")]
        samples = sum(m.samples for m in workers)
        prev_samples, prev_t = self._last_samples
        now = self.clock()
        rate = (samples - prev_samples) / max(now - prev_t, 1e-6)
        self._last_samples = (samples, now)
        live = sum(1 for m in workers if m.state == MemberState.RUNNING)
        parts = [f"[{self.config.name}] epoch {self.epoch}", f"ps {len(self.live_ps())}",
                 f"workers {live}", f"samples {samples}", f"{rate:,.0f} samples/s"]
        if self.shards:
            c = self.shards.counts()
            total = c["todo"] + c["doing"] + c["done"]
            parts.insert(1, f"shards {c['done']}/{total} done ({c['doing']} in progress)")
            if self.config.data.watch:
                parts.insert(2, f"watching: {len(self.shards.files_done())}/"
                                f"{len(self.shards.paths())} files done")
            bad = self.shards.bad_input()
            if bad["shards"]:
                parts.insert(2, f"bad input in {bad['shards']} shards ({bad['records']} records)")
        parts.insert(1, f"step {self.global_step()}")
        for plugin in self.plugins:
            self._run_hook(plugin, "on_progress", parts)
        if self.final_checkpoint:
            parts.append(f"final checkpoint {self.final_checkpoint}")
        if self.export_dir:
            parts.append(f"model exported to {self.export_dir}")
        return " | ".join(parts)

    def _shard_counts(self, counts: dict) -> master_pb2.ShardCounts:
        out = master_pb2.ShardCounts(**counts)
        if self.shards is not None:
            bad = self.shards.bad_input()
            out.bad_shards, out.bad_records = bad["shards"], bad["records"]
            if bad["reports"]:
                out.bad_json = json.dumps(bad["reports"][-100:])
        return out

    def status(self) -> master_pb2.StatusResponse:
        now = self.clock()
        members = [master_pb2.Member(role=m.role, id=m.id, pid=m.pid, address=m.address,
                                     state=m.state.value, last_heartbeat_age=now - m.last_heartbeat,
                                     steps=m.steps, samples=m.samples)
                   for m in self.registry.members()]
        counts = self.shards.counts() if self.shards else {"todo": 0, "doing": 0, "done": 0}
        with self._lock:
            events = [json.dumps(e, sort_keys=True) for e in list(self.events)[-100:]]
        response = master_pb2.StatusResponse(
            events_json=events,
            job_name=self.config.name, epoch=self.epoch, phase=self.phase.value, members=members,
            shards=self._shard_counts(counts), state_dir=os.path.abspath(self.config.state_dir),
            uptime_seconds=now - self.started_at, global_step=self.global_step(),
            placement_json=json.dumps(self.placement()), final_checkpoint=self.final_checkpoint,
            export_dir=self.export_dir, model_recorded=self.model_spec is not None)
        for plugin in self.plugins:
            self._run_hook(plugin, "on_status", response)
        return response
