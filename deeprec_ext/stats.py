"""Gazer collectors that run inside every member process (no TensorFlow import).

- ``RpcStats`` + ``StatsInterceptor``: per-method latency histograms, errors and bytes in
  and out of a gRPC server, measured around the real (de)serializers;
- ``MemberCollector``: CPU, RSS, step times and the latest per-op sample of one process,
  packed into a ``gazer_pb2.MemberStats`` that rides on the lease heartbeat.

Everything here is a few counter updates per call or per step; the expensive part (a
TensorFlow trace) happens only on sampled steps (``deeprec_ext/tf/op_sampler.py``).
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from typing import Callable

import grpc
import numpy as np
import psutil

from deeprec_ext.proto import gazer_pb2, gazer_pb2_grpc

log = logging.getLogger(__name__)

# Upper bounds of the latency buckets (ms); one more bucket catches everything slower.
LATENCY_BOUNDS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
                     1000.0, 2500.0, 5000.0, 10000.0)

OP_SAMPLE_ENV = "DEEPREC_GAZER_OP_SAMPLE_EVERY"
DEFAULT_OP_SAMPLE_EVERY = 100
DEFAULT_TOP_OPS = 20


def quantile_ms(counts, q: float, bounds=LATENCY_BOUNDS_MS) -> float:
    """The ``q`` quantile of a bucketed histogram, linearly interpolated inside its bucket
    (the last, open bucket reports its lower bound). 0 for an empty histogram."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return 0.0
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, q * total, side="left"))
    if i >= len(bounds):
        return float(bounds[-1])
    lo = 0.0 if i == 0 else bounds[i - 1]
    before = cum[i - 1] if i else 0.0
    frac = (q * total - before) / counts[i] if counts[i] else 1.0
    return float(lo + (bounds[i] - lo) * min(max(frac, 0.0), 1.0))


class _Method:
    __slots__ = ("counts", "sum_ms", "count", "errors", "bytes_in", "bytes_out")

    def __init__(self):
        self.counts = np.zeros(len(LATENCY_BOUNDS_MS) + 1, dtype=np.int64)
        self.sum_ms = 0.0
        self.count = self.errors = self.bytes_in = self.bytes_out = 0


class RpcStats:
    """Counters of the RPCs one server handled, per method, since the process started."""

    def __init__(self):
        self._lock = threading.Lock()
        self._methods: dict[str, _Method] = {}

    def _get(self, method: str) -> _Method:
        m = self._methods.get(method)
        if m is None:
            m = self._methods.setdefault(method, _Method())
        return m

    def observe(self, method: str, ms: float, ok: bool) -> None:
        bucket = bisect.bisect_left(LATENCY_BOUNDS_MS, ms)
        with self._lock:
            m = self._get(method)
            m.counts[bucket] += 1
            m.sum_ms += ms
            m.count += 1
            if not ok:
                m.errors += 1

    def add_bytes(self, method: str, inbound: int = 0, outbound: int = 0) -> None:
        with self._lock:
            m = self._get(method)
            m.bytes_in += inbound
            m.bytes_out += outbound

    def to_proto(self) -> list:
        with self._lock:
            return [gazer_pb2.RpcMethodStats(
                method=name, bounds_ms=LATENCY_BOUNDS_MS, counts=m.counts.tolist(),
                sum_ms=m.sum_ms, count=m.count, errors=m.errors, bytes_in=m.bytes_in,
                bytes_out=m.bytes_out) for name, m in sorted(self._methods.items())]


class StatsInterceptor(grpc.ServerInterceptor):
    """Times every call and counts its serialized bytes.

    Bytes are counted by wrapping the method's own deserializer and serializer, so they are
    exact and cost no extra serialization. A call counts as an error when the handler
    raised (``context.abort`` raises) or left a non-OK code.
    """

    def __init__(self, stats: RpcStats):
        self.stats = stats

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        stats = self.stats

        def deserialize(raw):
            stats.add_bytes(method, inbound=len(raw))
            return handler.request_deserializer(raw) if handler.request_deserializer else raw

        def serialize(msg):
            raw = handler.response_serializer(msg) if handler.response_serializer else msg
            stats.add_bytes(method, outbound=len(raw))
            return raw

        def timed(behavior):
            def run(request_or_iterator, context):
                start = time.perf_counter()
                ok = False
                try:
                    out = behavior(request_or_iterator, context)
                    ok = context.code() in (None, grpc.StatusCode.OK) if hasattr(context, "code") else True
                    return out
                finally:
                    stats.observe(method, (time.perf_counter() - start) * 1000.0, ok)
            return run

        def timed_stream(behavior):
            def run(request_or_iterator, context):
                start = time.perf_counter()
                ok = False
                try:
                    yield from behavior(request_or_iterator, context)
                    ok = True
                finally:
                    stats.observe(method, (time.perf_counter() - start) * 1000.0, ok)
            return run

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(timed(handler.unary_unary), deserialize, serialize)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(timed(handler.stream_unary), deserialize, serialize)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(timed_stream(handler.unary_stream), deserialize, serialize)
        return grpc.stream_stream_rpc_method_handler(timed_stream(handler.stream_stream), deserialize, serialize)


class MemberCollector:
    """CPU, RSS, steps and the latest op sample of this process, as a MemberStats.

    ``collect()`` is called once per heartbeat; CPU percent and step time are averages
    over the time since the previous call. ``extra`` fills role-specific fields (PS
    tables, replication)."""

    def __init__(self, role: str, rpc: RpcStats | None = None,
                 extra: Callable[[gazer_pb2.MemberStats], None] | None = None):
        self.role = role
        self.rpc = rpc
        self.extra = extra
        self.op_sample_every = 0
        self._proc = psutil.Process(os.getpid())
        self._lock = threading.Lock()
        self._last_cpu = self._cpu()
        self._last_wall = time.monotonic()
        self._steps = 0
        self._timed_steps = 0
        self._step_seconds = 0.0
        self._step_counts = np.zeros(len(LATENCY_BOUNDS_MS) + 1, dtype=np.int64)       # wall time of the steps since the last collect
        self._last_step_end: float | None = None
        self._ops: list = []
        self._ops_step = 0

    def _cpu(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def steps_done(self, n: int = 1) -> None:
        """A training step (or Keras execution of ``n`` steps) ended: one clock read."""
        now = time.perf_counter()
        with self._lock:
            if self._last_step_end is not None:  # the first step has no start mark
                dt = now - self._last_step_end
                self._step_seconds += dt
                self._timed_steps += n
                self._step_counts[bisect.bisect_left(LATENCY_BOUNDS_MS, 1000.0 * dt / n)] += n
            self._last_step_end = now
            self._steps += n

    def pause_steps(self) -> None:
        """Training stopped (end of fit, waiting for data): the gap is not a step."""
        with self._lock:
            self._last_step_end = None

    @property
    def steps(self) -> int:
        return self._steps

    def set_ops(self, ops: list, step: int) -> None:
        """The op sampler's latest result: [(name, type, micros per step, count)]."""
        with self._lock:
            self._ops, self._ops_step = ops, step

    def collect(self, member_id: str = "") -> gazer_pb2.MemberStats:
        now = time.monotonic()
        cpu = self._cpu()
        out = gazer_pb2.MemberStats(id=member_id, role=self.role, time=time.time(),
                                    cpu_seconds=cpu, rss_bytes=self._proc.memory_info().rss,
                                    op_sample_every=self.op_sample_every)
        wall = now - self._last_wall
        out.cpu_percent = 100.0 * (cpu - self._last_cpu) / wall if wall > 0 else 0.0
        self._last_cpu, self._last_wall = cpu, now
        with self._lock:
            out.steps = self._steps
            if self._steps:
                out.step_counts.extend(self._step_counts.tolist())
            if self._timed_steps:
                out.step_ms = 1000.0 * self._step_seconds / self._timed_steps
            self._timed_steps, self._step_seconds = 0, 0.0
            ops, out.ops_step = self._ops, self._ops_step
        out.ops.extend(gazer_pb2.OpStat(name=n, type=t, micros=us, count=c) for n, t, us, c in ops)
        if self.rpc is not None:
            out.rpcs.extend(self.rpc.to_proto())
        if self.extra is not None:
            try:
                self.extra(out)
            except Exception:  # noqa: BLE001 - statistics must never break the heartbeat
                log.exception("gazer: collecting %s statistics failed", self.role)
        return out

    def collect_bytes(self, member_id: str = "") -> bytes:
        return self.collect(member_id).SerializeToString()


def op_sample_every_from_master(channel: grpc.Channel | None) -> tuple[int, int]:
    """(sample every N steps, top ops) for this job: ``DEEPREC_GAZER_OP_SAMPLE_EVERY`` if
    set, else the AIMaster's Gazer config; (0, ...) when the job runs without Gazer."""
    top = DEFAULT_TOP_OPS
    env = os.environ.get(OP_SAMPLE_ENV, "")
    if env:
        try:
            return max(int(env), 0), top
        except ValueError:
            log.warning("%s=%r is not an integer; per-op sampling off", OP_SAMPLE_ENV, env)
            return 0, top
    if channel is None:
        return 0, top
    try:
        resp = gazer_pb2_grpc.GazerStub(channel).GetConfig(gazer_pb2.ConfigRequest(), timeout=5)
    except grpc.RpcError as exc:
        # UNIMPLEMENTED: the job runs with `gazer: {enabled: false}`
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            log.warning("gazer: no sampling config from the AIMaster (%s); per-op sampling off",
                        exc.code().name)
        return 0, top
    return max(resp.op_sample_every, 0), resp.top_ops or top
