"""Prometheus endpoint of the AIMaster: the numbers of a Gazer snapshot as metrics.

Every scrape builds one snapshot (the same one `gazer dump` prints), so the endpoint
and the terminal view never disagree. Member metrics carry ``role`` and ``member``
labels; per-method RPC metrics add ``method``, per-table ``table``, per-op ``op`` and
``op_type``.
"""
from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

M = ["role", "member"]


class SnapshotCollector:
    def __init__(self, plugin):
        self.plugin = plugin

    def collect(self):
        snap = self.plugin.snapshot()
        job = [snap.job]
        g = {}

        def gauge(name, doc, labels):
            g[name] = GaugeMetricFamily(name, doc, labels=labels)
            return g[name]

        def counter(name, doc, labels):
            g[name] = CounterMetricFamily(name, doc, labels=labels)
            return g[name]

        gauge("gazer_job_samples_per_second", "Training throughput of the job", ["job"]) \
            .add_metric(job, snap.samples_per_second)
        shards = gauge("gazer_job_shards", "Data shards by state", ["job", "state"])
        for state, n in (("todo", snap.shards_todo), ("doing", snap.shards_doing),
                         ("done", snap.shards_done)):
            shards.add_metric([snap.job, state], n)
        gauge("gazer_job_routing_epoch", "Routing epoch", ["job"]).add_metric(job, snap.epoch)
        strag = counter("gazer_straggler_events", "Straggler detections and actions, by kind",
                        ["job", "kind"])
        for kind, n in sorted(snap.straggler_events.items()):
            strag.add_metric([snap.job, kind], n)
        mig = snap.migration
        gauge("gazer_migration_active", "1 while a PS scale moves slots", ["job", "phase"]) \
            .add_metric([snap.job, mig.phase or "none"], 1.0 if mig.active else 0.0)
        gauge("gazer_migration_rows", "Rows moved by the current (or last) migration", ["job"]) \
            .add_metric(job, mig.rows)
        if snap.HasField("eval") and snap.eval.rounds:  # evaluation while training
            ev = snap.eval
            for name, doc, value in (
                    ("gazer_eval_auc", "AUC of the latest evaluation round", ev.auc),
                    ("gazer_eval_logloss", "Log loss of the latest evaluation round", ev.logloss),
                    ("gazer_eval_step", "Global step of the model the latest round scored", ev.step),
                    ("gazer_eval_rounds", "Evaluation rounds so far", ev.rounds)):
                gauge(name, doc, ["job"]).add_metric(job, value)
        up = gauge("gazer_member_up", "1 for a running member", M + ["state"])
        cpu = gauge("gazer_cpu_percent", "CPU use of the member process (100 = one core)", M)
        cpu_s = counter("gazer_cpu_seconds", "CPU time of the member process", M)
        rss = gauge("gazer_rss_bytes", "Resident memory of the member process", M)
        steps = counter("gazer_worker_steps", "Training steps done", M)
        ahead = counter("gazer_worker_lookahead_lookups",
                        "Table lookups fetched while the previous step trained, by outcome "
                        "(used, dropped)", M + ["outcome"])
        patched = counter("gazer_worker_lookahead_patched_rows",
                          "Rows fetched ahead replaced by what the step's push left", M)
        sps = gauge("gazer_worker_steps_per_second", "Training steps per second", M)
        samples = gauge("gazer_worker_samples_per_second", "Samples trained per second", M)
        step_s = gauge("gazer_worker_step_seconds", "Mean wall time of a training step", M)
        step_p99 = gauge("gazer_worker_step_p99_seconds", "p99 step time, last report interval", M)
        op_s = gauge("gazer_op_seconds", "Time per step of a TensorFlow op (latest sample)",
                     M + ["op", "op_type"])
        rps = gauge("gazer_requests_per_second", "RPCs served per second", M)
        p99 = gauge("gazer_rpc_p99_seconds", "p99 latency of served data-plane RPCs, last report "
                    "interval", M)
        lat = HistogramMetricFamily("gazer_rpc_latency_seconds", "Latency of served RPCs",
                                    labels=M + ["method"])
        errors = counter("gazer_rpc_errors", "Served RPCs that ended with an error", M + ["method"])
        bin_ = counter("gazer_rpc_received_bytes", "Serialized request bytes", M + ["method"])
        bout = counter("gazer_rpc_sent_bytes", "Serialized response bytes", M + ["method"])
        rows = gauge("gazer_ps_table_rows", "Rows of a table on a PS", M + ["table"])
        tbytes = gauge("gazer_ps_table_bytes", "Bytes of a table on a PS", M + ["table"])
        fill = gauge("gazer_ps_arena_fill_ratio", "Used rows / allocated arena rows", M + ["table"])
        # admission / eviction (docs/guide-ps.md): counters since the PS started
        admitted = counter("gazer_ps_table_admitted", "Rows created once their id reached "
                           "min_count", M + ["table"])
        rejected = counter("gazer_ps_table_rejected", "Looked-up ids answered with the default "
                           "vector (not admitted yet)", M + ["table"])
        evicted = counter("gazer_ps_table_evicted", "Rows deleted by the eviction policy",
                          M + ["table"])
        cands = gauge("gazer_ps_table_candidates", "Ids counted but not admitted (bloom: "
                      "filter cells)", M + ["table"])
        behind = gauge("gazer_ps_replication_behind_updates",
                       "Update sequence numbers not yet shipped to the ring peer", M + ["peer"])
        ship = gauge("gazer_ps_replication_since_ship_seconds",
                     "Time since the last shipment to the ring peer", M + ["peer"])
        slow = gauge("gazer_member_straggler", "1 while the member is marked a straggler", M)
        for mv in snap.members:
            lab = [mv.role, mv.id]
            up.add_metric(lab + [mv.state], 1.0 if mv.state == "running" else 0.0)
            slow.add_metric(lab, 1.0 if mv.straggler else 0.0)
            if mv.stats_age_seconds < 0:
                continue
            s = mv.stats
            cpu.add_metric(lab, s.cpu_percent)
            cpu_s.add_metric(lab, s.cpu_seconds)
            rss.add_metric(lab, s.rss_bytes)
            if mv.role == "worker":
                steps.add_metric(lab, s.steps)
                if s.HasField("lookahead"):
                    ahead.add_metric(lab + ["used"], s.lookahead.used)
                    ahead.add_metric(lab + ["dropped"], s.lookahead.dropped)
                    patched.add_metric(lab, s.lookahead.patched_rows)
                sps.add_metric(lab, mv.steps_per_second)
                samples.add_metric(lab, mv.samples_per_second)
                step_s.add_metric(lab, s.step_ms / 1000.0)
                step_p99.add_metric(lab, mv.p99_ms / 1000.0)
                for op in s.ops:
                    op_s.add_metric(lab + [op.name, op.type], op.micros / 1e6)
            if s.rpcs:
                rps.add_metric(lab, mv.requests_per_second)
                p99.add_metric(lab, mv.p99_ms / 1000.0)
            for r in s.rpcs:
                cum, buckets = 0, []
                for bound, n in zip(list(r.bounds_ms) + [float("inf")], r.counts):
                    cum += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1000.0), cum))
                lat.add_metric(lab + [r.method], buckets, r.sum_ms / 1000.0)
                errors.add_metric(lab + [r.method], r.errors)
                bin_.add_metric(lab + [r.method], r.bytes_in)
                bout.add_metric(lab + [r.method], r.bytes_out)
            for t in s.tables:
                rows.add_metric(lab + [t.name], t.rows)
                tbytes.add_metric(lab + [t.name], t.bytes)
                fill.add_metric(lab + [t.name], t.rows / t.capacity if t.capacity else 0.0)
                for fam, v in ((admitted, t.admitted), (rejected, t.rejected),
                               (evicted, t.evicted), (cands, t.candidates)):
                    fam.add_metric(lab + [t.name], v)
            if s.replication.peer:
                behind.add_metric(lab + [s.replication.peer], s.replication.behind_sequence)
                ship.add_metric(lab + [s.replication.peer], s.replication.since_ship_ms / 1000.0)
        yield from g.values()
        yield lat


def start_exporter(plugin, host: str, port: int):
    """Serve /metrics on host:port from a private registry; returns (server, bound port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(plugin))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
