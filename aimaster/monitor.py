"""Gazer in the AIMaster: aggregates the statistics members send with their heartbeats
into job snapshots, serves them (``Gazer`` gRPC service: one snapshot, a stream of them,
the sampling config workers read) and, with a Prometheus port, as metrics.

Hooks (aimaster/plugins.py): ``on_heartbeat`` (RPC thread) stores a member's report and
its rates since its previous one; ``on_tick`` (main loop) keeps one throughput point per
second; snapshots are built on demand from the registry plus the stored reports.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from aimaster.plugins import MasterPlugin
from deeprec_ext.proto import gazer_pb2, gazer_pb2_grpc
from deeprec_ext.stats import LATENCY_BOUNDS_MS, quantile_ms

if TYPE_CHECKING:  # pragma: no cover
    from aimaster.config import JobConfig
    from aimaster.view import JobView

log = logging.getLogger(__name__)

HISTORY_SECONDS = 60
MAX_WATCHERS = 4         # each stream holds one of the AIMaster's RPC threads
TOP_OPS = 15
DATA_PLANE = ("Lookup", "Push")  # a PS's p99 is over these when it served any


def with_prometheus_port(config: "JobConfig", port: int) -> "JobConfig":
    """``aimaster run --prometheus-port P`` applied to a validated job config."""
    from aimaster.config import ConfigError
    if not 0 < port < 65536:
        raise ConfigError(f"--prometheus-port: {port} is not a TCP port (1-65535)")
    if not config.gazer.enabled:
        raise ConfigError("--prometheus-port needs Gazer, but the job file sets gazer.enabled: false")
    return replace(config, gazer=config.gazer.model_copy(update={"prometheus_port": port}))


class _Report:
    """A member's latest statistics and the rates derived from its previous report."""
    __slots__ = ("stats", "received", "steps", "samples", "requests", "rpc_counts",
                 "steps_per_second", "samples_per_second", "requests_per_second", "p99_ms")

    def __init__(self, stats, received, steps, samples):
        self.stats, self.received, self.steps, self.samples = stats, received, steps, samples
        self.requests = sum(r.count for r in stats.rpcs)
        self.rpc_counts = {r.method: np.asarray(r.counts, dtype=np.int64) for r in stats.rpcs}
        self.steps_per_second = self.samples_per_second = self.requests_per_second = 0.0
        self.p99_ms = 0.0


# a histogram has one count per bucket of LATENCY_BOUNDS_MS plus the open (+Inf) one;
# a report with another shape (another version's buckets, a damaged message) is not used
_BUCKETS = len(LATENCY_BOUNDS_MS) + 1


def _window_p99(new: _Report, old: _Report | None) -> float:
    """p99 of what happened between two reports: the difference of cumulative histograms."""
    if new.stats.role == "worker":
        cur = np.asarray(new.stats.step_counts, dtype=np.int64)
        prev = np.asarray(old.stats.step_counts, dtype=np.int64) if old is not None else None
        if cur.size != _BUCKETS:
            return 0.0
        delta = cur - prev if prev is not None and prev.size == cur.size else cur
        return quantile_ms(np.maximum(delta, 0), 0.99)
    deltas = {}
    for method, counts in new.rpc_counts.items():
        if counts.size != _BUCKETS:
            continue
        before = old.rpc_counts.get(method) if old is not None else None
        d = counts - before if before is not None and before.size == counts.size else counts
        deltas[method] = np.maximum(d, 0)
    chosen = [d for m, d in deltas.items() if m in DATA_PLANE and d.sum()] or \
        [d for d in deltas.values() if d.sum()]
    if not chosen:
        return 0.0
    return quantile_ms(np.sum(chosen, axis=0), 0.99)


def _why(mark: dict) -> str:
    """One line for a straggler mark: what was measured against the median."""
    if mark.get("role") == "worker" and "ratio" in mark:
        return f"{mark['ratio']:.2f} x median records/s"
    if mark.get("cpu_saturated"):
        return f"CPU {mark.get('cpu', 0):.2f} cores, others {mark.get('cpu_others', 0):.2f}"
    return f"{mark.get('ratio', 0):.1f} x median service time" if "ratio" in mark else "slow"


class GazerPlugin(MasterPlugin, gazer_pb2_grpc.GazerServicer):
    name = "gazer"

    def __init__(self, config: "JobConfig"):
        self.config = config.gazer
        self.job_name = config.name
        self.master: "JobView | None" = None
        self._lock = threading.Lock()
        self._reports: dict[str, _Report] = {}
        self._history: deque[float] = deque(maxlen=HISTORY_SECONDS)
        self._last_point: tuple[float, int] | None = None  # (monotonic, total samples)
        self._stopping = threading.Event()
        self._watchers = 0
        self._prometheus = None
        self.prometheus_port = 0

    # -- hooks -------------------------------------------------------------------------------
    def on_start(self, master, server) -> None:
        self.master = master
        gazer_pb2_grpc.add_GazerServicer_to_server(self, server)
        if self.config.prometheus_port:
            from gazer.prometheus import start_exporter
            try:
                self._prometheus, self.prometheus_port = start_exporter(
                    self, master.config.host, self.config.prometheus_port)
            except OSError as exc:
                raise OSError(f"cannot serve Prometheus metrics on port "
                              f"{self.config.prometheus_port}: {exc.strerror or exc}") from exc
            log.info("gazer: Prometheus metrics on http://%s:%d/metrics", master.config.host,
                     self.prometheus_port)

    def on_heartbeat(self, master, request) -> None:
        if not request.gazer_stats or master.member(request.id) is None:
            return  # nothing, or from no member: kept reports are those snapshots show
        try:
            stats = gazer_pb2.MemberStats.FromString(request.gazer_stats)
        except DecodeError:
            log.warning("gazer: unreadable statistics from %s ignored", request.id)
            return
        now = time.monotonic()
        new = _Report(stats, now, request.steps, request.samples)
        with self._lock:
            old = self._reports.get(request.id)
            if old is not None and now - old.received > 1e-3:
                dt = now - old.received
                new.steps_per_second = max(request.steps - old.steps, 0) / dt
                new.samples_per_second = max(request.samples - old.samples, 0) / dt
                new.requests_per_second = max(new.requests - old.requests, 0) / dt
            new.p99_ms = _window_p99(new, old)
            self._reports[request.id] = new

    def on_progress(self, master, parts: list) -> None:
        """Tables with admission or eviction: live rows, admitted, rejected so far and
        evicted, summed over the PS's latest reports."""
        from gazer.view import table_policy_totals
        snap = gazer_pb2.Snapshot()
        with self._lock:
            reports = [(mid, r) for mid, r in self._reports.items()]
        live = {m.id for m in master.members("ps")}
        for mid, r in reports:
            if mid in live:
                snap.members.add(id=mid, role="ps", stats=r.stats)
        for name, c in sorted(table_policy_totals(snap).items()):
            parts.append(f"{name}: {c['rows']:,} rows, {c['admitted']:,} admitted, "
                         f"{c['rejected']:,} rejected, {c['evicted']:,} evicted")

    def on_tick(self, master) -> None:
        now = time.monotonic()
        if self._last_point is not None and now - self._last_point[0] < 1.0:
            return
        total = sum(m.samples for m in master.members("worker"))
        with self._lock:
            if self._last_point is not None:
                t0, s0 = self._last_point
                self._history.append(max(total - s0, 0) / (now - t0))
            self._last_point = (now, total)

    def ps_memory_bytes(self) -> float | None:
        """Resident memory of the live PS processes, summed (their latest reports)."""
        with self._lock:
            rss = [r.stats.rss_bytes for r in self._reports.values() if r.stats.role == "ps"]
        return float(sum(rss)) if rss else None

    def on_stop(self, master) -> None:
        self._stopping.set()
        if self._prometheus is not None:
            self._prometheus.shutdown()
            self._prometheus.server_close()
            self._prometheus = None

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self) -> gazer_pb2.Snapshot:
        m = self.master
        now = time.monotonic()
        counts = m.shard_counts()
        with self._lock:
            reports = dict(self._reports)
            history = list(self._history)
        snap = gazer_pb2.Snapshot(
            job=self.job_name, phase=m.phase.value, epoch=m.epoch, time=time.time(),
            uptime_seconds=m.clock() - m.started_at, shards_todo=counts["todo"],
            shards_doing=counts["doing"], shards_done=counts["done"],
            throughput_history=history, samples_per_second=history[-1] if history else 0.0,
            op_sample_every=self.config.op_sample_every_steps)
        marks, counts = m.stragglers(), m.straggler_counts()
        for kind, n in counts.items():
            snap.straggler_events[kind] = n
        ops: dict = defaultdict(lambda: [0.0, 0, 0.0])  # (name, type) -> [micros, workers, share]
        for member in sorted(m.members(), key=lambda x: (x.role != "ps", x.role, x.rank, x.id)):
            view = snap.members.add(id=member.id, role=member.role, state=member.state.value,
                                    address=member.address, stats_age_seconds=-1.0)
            mark = marks.get(member.id)
            if mark is not None:
                view.straggler = True
                view.straggler_why = _why(mark)
            r = reports.get(member.id)
            if r is None:
                continue
            view.stats.CopyFrom(r.stats)
            view.stats_age_seconds = now - r.received
            view.steps_per_second = r.steps_per_second
            view.samples_per_second = r.samples_per_second
            view.requests_per_second = r.requests_per_second
            view.p99_ms = r.p99_ms
            if member.state.value not in ("running", "left", "succeeded"):
                continue  # a dead worker's last sample may describe a hung step
            step_us = r.stats.step_ms * 1000.0
            for op in r.stats.ops:
                o = ops[(op.name, op.type)]
                o[0] += op.micros
                o[1] += 1
                o[2] += op.micros / step_us if step_us > 0 else 0.0
        top = sorted(ops.items(), key=lambda kv: -kv[1][0] / kv[1][1])[:TOP_OPS]
        for (name, typ), (us, n, share) in top:
            snap.top_ops.add(name=name, type=typ, micros=us / n, workers=n, share=share / n)
        ev = m.eval_state() if hasattr(m, "eval_state") else None
        if ev is not None:  # the job evaluates while training: its latest round
            snap.eval.rounds = ev["rounds"]
            latest = ev["latest"]
            if latest:
                snap.eval.step = latest["step"]
                snap.eval.auc = latest["auc"] if latest["auc"] is not None else math.nan
                snap.eval.logloss = latest["logloss"] if latest["logloss"] is not None else math.nan
                snap.eval.examples = latest["examples"]
                snap.eval.final = latest["final"]
                snap.eval.age_seconds = ev["age_seconds"] or 0.0
        p = m.migration_progress()
        if p["phase"]:
            snap.migration.CopyFrom(gazer_pb2.MigrationProgress(
                active=p["active"], phase=p["phase"], pairs=p["pairs"], pairs_done=p["pairs_done"],
                rows=p["rows"], elapsed_seconds=now - p["started"] if p["started"] else 0.0))
        return snap

    # -- Gazer service -----------------------------------------------------------------------
    def GetSnapshot(self, request, context):
        return self.snapshot()

    def GetConfig(self, request, context):
        return gazer_pb2.ConfigResponse(op_sample_every=self.config.op_sample_every_steps,
                                        top_ops=self.config.top_ops)

    def Watch(self, request, context):
        interval = request.interval_seconds or 1.0
        if not math.isfinite(interval) or not 0.2 <= interval <= 3600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"interval_seconds must lie within [0.2, 3600], got {request.interval_seconds}")
        with self._lock:
            if self._watchers >= MAX_WATCHERS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{MAX_WATCHERS} Gazer streams are open already; close one or use "
                              "`gazer dump` / `gazer top --once`")
            self._watchers += 1
        ended = threading.Event()  # the caller cancelled, or its deadline passed
        if not context.add_callback(ended.set):
            ended.set()
        try:
            yield self.snapshot()
            while self._sleep(interval, ended):
                yield self.snapshot()
        finally:
            with self._lock:
                self._watchers -= 1

    def _sleep(self, seconds: float, ended: threading.Event) -> bool:
        """Wait ``seconds`` between two snapshots of a stream; False as soon as the stream
        ended or the AIMaster stops (a cancelled stream frees its RPC thread and its
        watcher slot at once, not after the interval)."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return not ended.is_set()
            if ended.wait(min(left, 0.25)):
                return False
        return False


def create(config: "JobConfig") -> GazerPlugin | None:
    """FACTORIES entry: a job with ``gazer: {enabled: false}`` runs without Gazer (no
    service, no per-op sampling on workers, no Prometheus endpoint)."""
    return GazerPlugin(config) if config.gazer.enabled else None


__all__ = ["GazerPlugin", "create", "with_prometheus_port", "LATENCY_BOUNDS_MS"]
