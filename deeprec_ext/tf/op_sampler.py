"""Gazer per-op sampling: time every TensorFlow op of one training step, every N steps.

- Keras / eager (``tf.function`` train steps): a TensorFlow profiler session around the
  sampled step. ``ProfilerSession.stop()`` returns the trace in memory (no log dir), and
  each op execution is a trace event whose ``long_name`` argument is ``"node:OpType"``.
- TF1 sessions: ``RunOptions(trace_level=FULL_TRACE)`` on the sampled ``run`` and the
  ``RunMetadata.step_stats`` it fills (node name, ``"name = OpType(...)"`` label, start
  and end times).

Unsampled steps cost one integer comparison; a sampled step costs the trace (well under
a millisecond to start and stop, plus the ops' own tracing), so the default of one step
in 100 stays far below the 3% overhead budget (bench/bench_gazer.py).
"""
from __future__ import annotations

import logging
from collections import defaultdict

from deeprec_ext.proto import gazer_pb2
from deeprec_ext.stats import DEFAULT_TOP_OPS, MemberCollector, op_sample_every_from_master

log = logging.getLogger(__name__)

# Ops that only call a function whose own ops are listed too: counting them would count
# their children twice.
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile",
                       "If", "StatelessIf", "Case", "StatelessCase", "_Retval", "_Arg",
                       "NoOp", "_SOURCE", "_SINK"})
WARMUP_STEPS = 3  # the first steps trace and compile the graph: not representative


def top_ops(totals: dict, steps: int, top: int) -> list[tuple[str, str, float, int]]:
    """[(name, type, micros per step, executions per step)] of the ``top`` slowest ops."""
    steps = max(steps, 1)
    rows = [(name, typ, us / steps, max(1, round(n / steps)))
            for (name, typ), (us, n) in totals.items() if typ not in _CALL_OPS]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def ops_from_trace(raw: bytes) -> dict:
    """{(node name, op type): [micros, executions]} from a profiler trace."""
    trace = gazer_pb2.TfTrace.FromString(raw)
    totals: dict = defaultdict(lambda: [0.0, 0])
    for ev in trace.trace_events:
        for arg in ev.args:
            if arg.key == b"long_name":
                name, _, typ = arg.value.decode("utf-8", "replace").rpartition(":")
                if not name:  # no "node:" prefix: the name is the type
                    name = typ
                t = totals[(name, typ)]
                t[0] += ev.duration_ps / 1e6
                t[1] += 1
                break
    return totals


def ops_from_step_stats(step_stats) -> dict:
    """{(node name, op type): [micros, executions]} from a TF1 RunMetadata.step_stats."""
    totals: dict = defaultdict(lambda: [0.0, 0])
    for dev in step_stats.dev_stats:
        for ns in dev.node_stats:
            label = ns.timeline_label
            typ = label.split(" = ", 1)[1].split("(", 1)[0] if " = " in label else ""
            t = totals[(ns.node_name, typ or ns.node_name)]
            t[0] += max(ns.op_end_rel_micros - ns.op_start_rel_micros, 0)
            t[1] += 1
    return totals


class OpSampler:
    """Decides which steps are sampled and hands the result to the process collector."""

    def __init__(self, collector: MemberCollector, every: int, top: int = DEFAULT_TOP_OPS):
        self.collector = collector
        self.every = max(int(every), 0)
        self.top = top
        self.samples = 0
        self._session = None
        self._broken = False
        collector.op_sample_every = self.every

    def due(self) -> bool:
        """Sample the step about to run?"""
        if not self.every or self._broken:
            return False
        step = self.collector.steps
        return step >= WARMUP_STEPS and (step - WARMUP_STEPS) % self.every == 0

    def _publish(self, totals: dict, steps: int) -> None:
        self.samples += 1
        self.collector.set_ops(top_ops(totals, steps, self.top), self.collector.steps)

    # -- eager / Keras: a profiler session around the step ------------------------------
    def begin_trace(self) -> None:
        if self._session is not None or not self.due():
            return
        from tensorflow.python.profiler.internal import _pywrap_profiler
        session = _pywrap_profiler.ProfilerSession()
        try:
            session.start("", {})
        except Exception as exc:  # noqa: BLE001 - e.g. the user runs a profiler of their own
            log.warning("gazer: per-op sampling off, the TensorFlow profiler is busy: %s", exc)
            self._broken = True
            return
        self._session = session

    def end_trace(self, steps: int = 1) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        try:
            totals = ops_from_trace(session.stop())
        except Exception as exc:  # noqa: BLE001 - an unknown trace format: stop sampling
            log.warning("gazer: per-op sampling off, cannot read the profiler trace: %s", exc)
            self._broken = True
            return
        if totals:
            self._publish(totals, steps)

    # -- TF1 sessions: RunOptions / RunMetadata -----------------------------------------
    def run_options(self):
        """RunOptions to pass to the step about to run, or None when it is not sampled."""
        if not self.due():
            return None
        import tensorflow as tf
        return tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)

    def add_run_metadata(self, run_metadata) -> None:
        if run_metadata is None or not run_metadata.step_stats.dev_stats:
            return
        totals = ops_from_step_stats(run_metadata.step_stats)
        if totals:
            self._publish(totals, 1)


def sampler_for(ctx) -> OpSampler:
    """The op sampler of a WorkerContext, created once per process; the sampling period
    comes from the AIMaster's Gazer config (or ``DEEPREC_GAZER_OP_SAMPLE_EVERY``)."""
    sampler = getattr(ctx, "_gazer_op_sampler", None)
    if sampler is None:
        every, top = op_sample_every_from_master(ctx.session.channel)
        sampler = OpSampler(ctx.gazer, every, top)
        ctx._gazer_op_sampler = sampler
        log.info("gazer: per-op sampling %s", f"every {every} steps" if every else "off")
    return sampler
