"""The autoscale plugin: observe a live job, let ``aimaster/policy.py`` decide, act through
``JobMaster.scale``.

Enabled by ``autoscale: {enabled: true, ...}`` in the job file. Threads:

- ``on_tick`` (main loop) only starts the observer thread; it never blocks.
- The observer thread, every ``interval_seconds``: each live PS's ``Stats`` over gRPC
  (RSS, CPU seconds, memory limit, per table rows/bytes/evicted/candidates), each live worker's samples from the
  registry and its CPU seconds from ``/proc`` (local processes only), TODO shards; feeds
  the policy and the cost ledger; asks for a decision.
- An actor thread per decision calls ``master.scale`` (which blocks until the scale is done
  and forks through ``on_main``; it must never run on an RPC thread or the main loop).

Every decision becomes a job event ``{"kind": "autoscale", "rule", "reason", ...}``.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import grpc
import psutil

from aimaster.errors import Busy, NotRunning, OperationRefused
from aimaster.plugins import MasterPlugin
from aimaster.policy import (CostLedger, Decision, Observation, Policy, PSSample, TableSample,
                             WorkerSample)
from aimaster.view import JobPhase

log = logging.getLogger("aimaster.autoscale")

# refusals that say "not now" rather than "no resources": the decision is dropped, not
# held against the scaler (see JobMaster.scale)


class AutoscalePlugin(MasterPlugin):
    name = "autoscale"

    def __init__(self, config):
        self.job = config
        self.cfg = config.autoscale
        self.policy_config = self.cfg.policy_config(config)
        self.policy = Policy(self.policy_config)
        self.ledger = CostLedger(self.policy_config)
        self._lock = threading.Lock()          # policy + ledger: observer, actor, Status RPC
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._actor: threading.Thread | None = None
        self._followups: list[Decision] = []
        self._last_ps: dict[str, PSSample] = {}
        self._evictions: dict[str, tuple[int, float]] = {}  # table -> steps_to_live, interval
        self._procs: dict[int, psutil.Process] = {}
        self.decisions: list[dict] = []

    # -- hooks
    def on_tick(self, master) -> None:
        if self._thread is None and master.phase == JobPhase.RUNNING:
            self.policy.clock = master.clock
            self._thread = threading.Thread(target=self._loop, args=(master,), daemon=True,
                                            name="autoscale")
            self._thread.start()

    def on_status(self, master, response) -> None:
        with self._lock:
            d = {"enabled": True, "dry_run": self.cfg.dry_run, "recovery": self.cfg.recovery,
                 "policy": self.policy.status() if self.policy.history else {},
                 "cost": self.ledger.summary(), "decisions": self.decisions[-20:]}
        response.autoscale_json = json.dumps(d, sort_keys=True)

    def on_stop(self, master) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    # -- observe
    def _loop(self, master) -> None:
        interval = self.cfg.interval_seconds
        next_at = time.monotonic()
        while not self._stop.is_set() and master.phase == JobPhase.RUNNING:
            try:
                obs = self.observe(master)
                with self._lock:
                    self.policy.observe(obs)
                    self.ledger.add(obs)
                    busy = self._actor is not None and self._actor.is_alive()
                    # while a scale runs, master.scale's own deadline is the max wait
                    decision = (self._followups.pop(0) if self._followups
                                else None if busy else self.policy.decide())
                if decision is not None:
                    self._apply(master, decision)
            except Exception:  # noqa: BLE001 - a bad sample must not stop the policy
                log.exception("autoscale: observation failed")
            next_at += interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - interval)  # do not burst after a stall

    def _ps_sample(self, master, member) -> PSSample | None:
        try:
            s = master.ps_stats(member.address, timeout=max(2.0, 2 * self.cfg.interval_seconds))
        except (grpc.RpcError, ValueError) as exc:  # ValueError: its channel closed (it left)
            # busy (a migration) or gone: reuse its last sample so counts stay right
            log.debug("Stats of %s failed: %s", member.id, exc)
            return self._last_ps.get(member.id)
        # per table: eviction and admission counters bound (or not) the memory growth
        sample = PSSample(member.id, s.rss_bytes, s.cpu_seconds, s.memory_limit_bytes,
                          rows=sum(t.rows for t in s.tables),
                          table_bytes=sum(t.bytes for t in s.tables),
                          tables=tuple(TableSample(t.name, t.rows, t.bytes, t.evicted,
                                                   t.candidates,
                                                   *self._eviction(master, member, t.name))
                                       for t in s.tables),
                          pushes=s.pushes)
        self._last_ps[member.id] = sample
        return sample

    def _eviction(self, master, member, table: str) -> tuple[int, float]:
        """(steps_to_live, interval seconds) of a table (0: none), asked once per table
        (ListTables; a table's policies are fixed when it is created)."""
        if table not in self._evictions:
            try:
                for cfg in master.ps_tables(member.address, timeout=2.0):
                    spec = json.loads(cfg.eviction_json) if cfg.eviction_json else {}
                    self._evictions[cfg.name] = (int(spec.get("steps_to_live", 0)),
                                                 float(spec.get("interval_seconds", 60.0)))
            except (grpc.RpcError, ValueError) as exc:
                log.debug("ListTables of %s failed: %s", member.id, exc)
        return self._evictions.get(table, (0, 0.0))

    def _cpu_and_rss(self, pid: int) -> tuple[float | None, int]:
        """CPU seconds and RSS of a local worker process (None: not ours to measure)."""
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            t = proc.cpu_times()
            # the worker command may be a wrapper: count its children too
            return t.user + t.system + t.children_user + t.children_system, proc.memory_info().rss
        except (psutil.Error, OSError):
            self._procs.pop(pid, None)
            return None, 0

    def observe(self, master) -> Observation:
        from aimaster.registry import MemberState
        routing = master.routing
        in_routing = set(routing.ps_ids) if routing is not None else set()
        ps = [self._ps_sample(master, m) for m in master.live_ps() if m.id in in_routing]
        workers = []
        for m in master.live_workers():
            cpu, rss = self._cpu_and_rss(m.pid) if m.pid else (None, 0)
            workers.append(WorkerSample(m.id, m.samples, cpu, rss))
        counts = master.shard_counts()
        done = sum(1 for m in master.members("worker") if m.state == MemberState.SUCCEEDED)
        target = master.worker_target
        return Observation(
            time=master.clock(), ps=tuple(p for p in ps if p is not None), workers=tuple(workers),
            pending_work=float(counts["todo"]),
            ps_target=master.ps_target,
            # workers that finished their work are not missing
            worker_target=max(0, target - done) if target else None)

    # -- act
    def _record(self, master, d: Decision, applied: bool) -> None:
        event = {k: v for k, v in d.as_event().items() if k != "kind"}
        event["applied"] = applied
        with self._lock:
            self.decisions.append({"time": time.time(), **event})
            del self.decisions[:-100]
        master.record_event("autoscale", **event)

    def _apply(self, master, d: Decision) -> None:
        ps_now, w_now = self.policy.sizes()
        changes = (d.ps is not None and d.ps != ps_now) or (d.workers is not None and d.workers != w_now)
        if self.cfg.dry_run or not changes or (self._actor is not None and self._actor.is_alive()):
            self._record(master, d, applied=False)
            return
        self._record(master, d, applied=True)
        with self._lock:
            self.policy.started(d)
        self._actor = threading.Thread(target=self._scale, args=(master, d), daemon=True,
                                       name="autoscale-scale")
        self._actor.start()

    def _scale(self, master, d: Decision) -> None:
        try:
            event = master.scale(ps=d.ps, workers=d.workers, timeout=self.cfg.max_wait_seconds)
        except OperationRefused as exc:
            with self._lock:
                if isinstance(exc, (Busy, NotRunning)):
                    self.policy.pending = None  # not now: decide again on fresh samples
                    follow = None
                else:
                    follow = self.policy.finished(d, ok=False)
                    if follow is not None:
                        self._followups.append(follow)
            master.record_event("autoscale_refused", rule=d.rule, reason=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - reported, the policy goes on
            log.exception("autoscale: scale failed")
            with self._lock:
                self.policy.pending = None
            master.record_event("autoscale_refused", rule=d.rule, reason=f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            self.policy.finished(d, ok=True, duration=event.get("duration_ms", 0.0) / 1000)


def create(config):
    return AutoscalePlugin(config) if config.autoscale.enabled else None
