"""Auto-scaling policy: pure decisions over observed metrics, with an injectable clock.

Observe / decide / act are kept apart. ``aimaster/autoscale.py`` observes a live job
(PS ``Stats``, worker counters) and acts through ``JobMaster.scale``;
``bench/bench_policy_sim.py`` feeds the same ``Policy`` simulated observations on a
simulated clock. Nothing here does I/O, starts a thread or reads the wall clock.

Rules, in the order ``Policy.decide`` applies them:

1. **max wait** - a requested scale that the scaler has not satisfied within
   ``max_wait_seconds`` is downgraded (a PS scale-out by several PS becomes +1) or given up.
2. **recovery** - a member died and the job is below its target: ``wait`` keeps the full
   size as the target (asking again every ``max_wait_seconds``, no other change meanwhile);
   ``continue`` accepts the reduced size once the replacement has not come within
   ``max_wait_seconds``.
3. **resource-fit** - a PS whose RSS, growing at its measured rate, would pass
   ``(1 - memory_headroom) x memory_limit`` within the lead time (how long a scale-out
   takes) triggers a PS scale-out sized so every PS stays under budget for a horizon.
   Not subject to the cool-down: memory does not wait. The growth of a table whose
   eviction has begun is bounded: it is projected to its plateau, not for ever
   (``table_growth``); admission candidates (exact counters are never evicted) count as
   growth that does not stop.
4. **performance-fit** (after the cool-down, on a steady measurement): judge the last
   trial (an added or removed replica must pay: its marginal throughput per core must be at
   least ``min_gain`` x the average throughput per core, else it is reverted and that size
   is not tried again for ``explore_ttl_seconds``); add a PS when PS CPU saturates; add a
   worker while there is pending work and the PS have CPU headroom; remove idle workers;
   remove a PS whose CPU is idle when the others can hold its memory.

Counts always stay within ``[min, max]`` of each role. ``CostLedger`` integrates
resource-seconds allocated vs used per role.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

MiB = 1024 * 1024

RULES = ("resource-fit", "performance-fit", "max-wait", "recovery")


class PolicyError(ValueError):
    """A policy knob is out of range; the message names it."""


@dataclass(frozen=True)
class PolicyConfig:
    ps_min: int = 1
    ps_max: int = 8
    worker_min: int = 0
    worker_max: int = 8
    interval_seconds: float = 1.0     # one observation per interval
    cooldown_seconds: float = 30.0    # between performance-fit changes
    settle_seconds: float = 5.0       # after a change, before measurements count
    measure_seconds: float = 10.0     # steady span a throughput measurement needs
    window_seconds: float = 30.0      # newest span used for rates
    max_wait_seconds: float = 120.0   # a requested scale not satisfied by then is downgraded
    recovery: str = "continue"        # "continue" | "wait"
    resource_fit: bool = True
    performance_fit: bool = True
    memory_headroom: float = 0.2      # fraction of each PS's limit kept free
    lead_seconds: float = 20.0        # at least how long a PS scale-out takes
    # free memory a PS keeps for the scale-out that relieves it, x its data (RSS above the
    # bare process): the migration export, the replica of its ring peer it takes on, and an
    # arena doubling all need memory first (measured here: 1 -> 2 raised the source's RSS
    # by 1.5x its data, 1 -> 3 by 1.7x). Raised to what scale-outs are seen to cost.
    scale_out_reserve: float = 2.0
    replicated: bool = True           # ring replication: with >= 2 PS each holds a peer's copy
    ps_memory_limit_bytes: int = 0    # when a PS reports none
    ps_cpu_high: float = 0.8          # PS CPU (fraction of ps_cores) that counts as saturated
    ps_cpu_low: float = 0.25          # below this a PS is idle
    worker_util_low: float = 0.5      # mean worker CPU below this (no pending work): idle
    min_gain: float = 0.9             # marginal throughput per core / average, to keep a change
    explore_ttl_seconds: float = 300.0
    worker_cores: float = 1.0
    ps_cores: float = 1.0
    worker_memory_bytes: int = 0

    def validate(self) -> "PolicyConfig":
        if not 1 <= self.ps_min <= self.ps_max:
            raise PolicyError(f"ps bounds: need 1 <= min ({self.ps_min}) <= max ({self.ps_max})")
        if not 0 <= self.worker_min <= self.worker_max:
            raise PolicyError(f"worker bounds: need 0 <= min ({self.worker_min}) <= max "
                              f"({self.worker_max})")
        if self.recovery not in ("continue", "wait"):
            raise PolicyError(f"recovery: expected 'continue' or 'wait', got {self.recovery!r}")
        if not 0 <= self.memory_headroom < 1:
            raise PolicyError(f"memory_headroom: expected 0 <= x < 1, got {self.memory_headroom}")
        if not 0 < self.ps_cpu_low < self.ps_cpu_high:
            raise PolicyError(f"ps_cpu_low ({self.ps_cpu_low}) must be > 0 and below "
                              f"ps_cpu_high ({self.ps_cpu_high})")
        if self.scale_out_reserve < 0:
            raise PolicyError(f"scale_out_reserve: expected >= 0, got {self.scale_out_reserve}")
        for name in ("interval_seconds", "measure_seconds", "window_seconds", "max_wait_seconds",
                     "lead_seconds", "worker_cores", "ps_cores"):
            if getattr(self, name) <= 0:
                raise PolicyError(f"{name}: expected a positive number, got {getattr(self, name)}")
        if self.measure_seconds > self.window_seconds:
            raise PolicyError(f"measure_seconds ({self.measure_seconds}) must not exceed "
                              f"window_seconds ({self.window_seconds})")
        return self


# -- observations --------------------------------------------------------------------------
@dataclass(frozen=True)
class TableSample:
    """One table on one PS (its ``TableStats``): counters since the PS started."""
    name: str
    rows: int
    bytes: int                    # rows + the admission candidates' companion table
    evicted: int = 0
    candidates: int = 0           # exact counters (bloom: filter cells allocated)
    steps_to_live: int = 0        # its eviction spec (0: none), from the PS's ListTables
    evict_interval_s: float = 0.0


@dataclass(frozen=True)
class PSSample:
    id: str
    rss_bytes: int
    cpu_seconds: float
    memory_limit_bytes: int = 0   # 0: not reported
    rows: int = 0
    table_bytes: int = 0
    tables: tuple[TableSample, ...] = ()
    pushes: int = 0               # push requests applied so far: a table's steps


@dataclass(frozen=True)
class WorkerSample:
    id: str
    samples: int                       # trained so far (cumulative)
    cpu_seconds: float | None = None   # None: not measurable (remote worker)
    rss_bytes: int = 0


@dataclass(frozen=True)
class Observation:
    """One look at the job. Targets are the sizes the job wants (the master's), so a live
    count below them is a shortfall (a member died and is not replaced yet)."""
    time: float
    ps: tuple[PSSample, ...]
    workers: tuple[WorkerSample, ...]
    pending_work: float = 0.0          # TODO shards (live job) or queued samples (simulation)
    ps_target: int | None = None
    worker_target: int | None = None


@dataclass(frozen=True)
class Decision:
    """Scale to these counts (None: leave that role). Both None: an alert, nothing to do."""
    rule: str
    reason: str
    ps: int | None = None
    workers: int | None = None
    details: dict = field(default_factory=dict)

    def as_event(self) -> dict:
        return {"kind": "autoscale", "rule": self.rule, "reason": self.reason,
                "ps": self.ps, "workers": self.workers, **self.details}


@dataclass(frozen=True)
class MemoryForecast:
    ps_id: str
    rss_bytes: int
    limit_bytes: int
    budget_bytes: float
    rate_bytes_per_s: float | None     # None: not enough samples since the last change
    seconds_left: float                # until budget - reserve at that rate (inf: not growing)
    reserve_bytes: float = 0.0         # kept free for the next scale-out's transients
    # the part of the rate from tables under eviction, and how much more they can grow
    # before their plateau (``table_growth``); the rest of the rate does not stop
    bounded_rate_bytes_per_s: float = 0.0
    bounded_cap_bytes: float = math.inf

    def growth(self, seconds: float, spread: float = 1.0) -> float:
        """RSS growth over ``seconds`` (``spread``: the growth's share per PS after a
        resize, n / n'); the bounded part stops at its cap."""
        rate = max(self.rate_bytes_per_s or 0.0, 0.0)
        bounded = min(max(self.bounded_rate_bytes_per_s, 0.0), rate)
        return spread * ((rate - bounded) * seconds + min(bounded * seconds,
                                                            self.bounded_cap_bytes))


# bytes of one exact admission counter: a dim-1 row (4 B) + row arrays (28 B) + its share of
# the hash index (17 B x 2 positions) + allocator (graph_opt/memory.py)
CANDIDATE_BYTES = 72


@dataclass(frozen=True)
class TableGrowth:
    """Table-byte growth of one PS over a span, split by whether it can stop."""
    unbounded: float = 0.0        # bytes/s: tables without (active) eviction, candidates
    bounded: float = 0.0          # bytes/s: tables whose eviction has begun
    cap: float = math.inf         # bytes the bounded tables may still add (their plateau)
    evicting: bool = False        # some table's eviction has begun


# -- small pure helpers ----------------------------------------------------------------------
def slope(ts, ys) -> float | None:
    """Least-squares slope of ys over ts; None with fewer than 3 points or no time span."""
    n = len(ts)
    if n < 3:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var <= 1e-12:
        return None
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def cores(cfg: PolicyConfig, ps: int, workers: int) -> float:
    return ps * cfg.ps_cores + workers * cfg.worker_cores


def table_growth(first: PSSample, last: PSSample, seconds: float) -> TableGrowth | None:
    """How the tables of one PS grew from ``first`` to ``last`` (None: no table counters).

    Rows enter a table at ``(d rows + d evicted) / dt``. Under ``steps_to_live`` S a row
    lives S steps (pushes to the table: the PS's push rate) plus up to one eviction
    interval, so the live rows are bounded by ``entry rate x (S / push rate + interval)``
    whether or not an eviction ran yet: what is left up to that bound is the table's cap.
    A table that evicts without a known window (``l2_below``) is bounded once eviction
    began: it may grow by ``rows x (in / out - 1)`` (the live set at the current entry
    rate, by Little's law, no more than doubling). Rows of other tables and admission
    candidates (exact counters are never evicted) grow without a bound in sight."""
    if not last.tables or seconds <= 0:
        return None
    before = {t.name: t for t in first.tables}
    step_rate = (last.pushes - first.pushes) / seconds
    unbounded = bounded = 0.0
    cap = 0.0
    evicting = False
    for t in last.tables:
        b = before.get(t.name)
        if b is None:
            continue
        per_row = max(t.bytes - CANDIDATE_BYTES * t.candidates, 0) / max(t.rows, 1)
        unbounded += CANDIDATE_BYTES * (t.candidates - b.candidates) / seconds
        rows_rate = (t.rows - b.rows) * per_row / seconds
        inflow, outflow = t.rows - b.rows + t.evicted - b.evicted, t.evicted - b.evicted
        if t.steps_to_live > 0 and step_rate > 0:
            evicting = True
            bounded += max(rows_rate, 0.0)
            live = inflow / seconds * (t.steps_to_live / step_rate + t.evict_interval_s)
            cap += max(live - t.rows, 0.0) * per_row
        elif t.evicted > 0:
            evicting = True
            bounded += max(rows_rate, 0.0)
            if inflow > outflow:  # else at the plateau: eviction keeps pace
                more = 1.0 if outflow <= 0 else min(inflow / outflow - 1.0, 1.0)
                cap += more * t.rows * per_row
        else:
            unbounded += rows_rate
    return TableGrowth(max(unbounded, 0.0), bounded, cap, evicting)


def _seconds_left(room: float, rate: float, bounded: float, cap: float) -> float:
    """Seconds until growth fills ``room``: ``rate`` bytes/s, of which ``bounded``
    stops after adding ``cap`` bytes."""
    if room <= 0:
        return 0.0
    if bounded <= 0 or math.isinf(cap):
        return room / rate if rate > 0 else math.inf
    t1 = cap / bounded  # when the bounded part stops
    if rate * t1 >= room:
        return room / rate
    rest = rate - bounded
    return t1 + (room - rate * t1) / rest if rest > 0 else math.inf


def memory_forecasts(history: list[Observation], since: float, cfg: PolicyConfig,
                     reserve_factor: float | None = None, lead: float | None = None,
                     base_rss: float | None = None) -> list[MemoryForecast]:
    """Per PS of the newest observation: RSS, budget and RSS growth rate, the rate fitted
    on the samples taken after ``since`` (a PS set change resets what the rate means).

    A growing PS is at risk once ``rss + reserve + rate x t`` reaches the budget; a PS that
    does not grow (less than 1% of its limit over the lead time: noise, free rows being
    reused) only once its RSS itself reaches the budget."""
    factor = cfg.scale_out_reserve if reserve_factor is None else reserve_factor
    lead = cfg.lead_seconds if lead is None else lead
    if base_rss is None:  # the bare process: the smallest RSS any PS had
        base_rss = min((p.rss_bytes for o in history for p in o.ps), default=0)
    if not history:
        return []
    last = history[-1]
    out = []
    for p in last.ps:
        limit = p.memory_limit_bytes or cfg.ps_memory_limit_bytes
        samples = [(o.time, s) for o in history if o.time >= since for s in o.ps if s.id == p.id]
        pts = [(t, s.rss_bytes) for t, s in samples]
        rate = slope([t for t, _ in pts], [y for _, y in pts])
        if rate is not None and pts[-1][0] - pts[0][0] < 2 * cfg.interval_seconds:
            rate = None
        bounded, cap = 0.0, math.inf
        g = None
        if rate is not None and rate > 0:
            # the tables' regime now: the newest third of the span (>= 2 intervals), so a
            # window filled earlier in the span does not read as growth still going on
            recent = samples[-1][0] - max(2 * cfg.interval_seconds,
                                          (samples[-1][0] - samples[0][0]) / 3)
            first = next(s for t, s in samples if t >= recent)
            g = table_growth(first, samples[-1][1],
                             samples[-1][0] - next(t for t, _ in samples if t >= recent))
        if g is not None and g.bounded > 0:
            # RSS grows with the table bytes (plus allocator, replica): split it pro rata
            per_table_byte = rate / (g.bounded + g.unbounded)
            bounded = g.bounded * per_table_byte
            cap = g.cap * min(max(per_table_byte, 1.0), 4.0)
        elif g is not None and g.evicting and g.unbounded <= 0:
            # no table grows any more: an RSS slope left over from filling the eviction
            # window (the fit still spans it) is not growth to extrapolate
            bounded, cap = rate, g.cap
        budget = limit * (1 - cfg.memory_headroom) if limit else math.inf
        reserve = factor * max(0, p.rss_bytes - base_rss)
        f = MemoryForecast(p.id, p.rss_bytes, limit, budget, rate, math.inf, reserve,
                           bounded, cap)
        if rate is None or f.growth(lead) < 0.01 * limit:
            left = 0.0 if p.rss_bytes >= budget else math.inf
        else:
            left = _seconds_left(budget - reserve - p.rss_bytes, rate, bounded, cap)
        out.append(MemoryForecast(p.id, p.rss_bytes, limit, budget, rate, left, reserve,
                                  bounded, cap))
    return out


def ps_needed_for_memory(forecasts: list[MemoryForecast], n: int, horizon: float,
                         cfg: PolicyConfig) -> int | None:
    """Smallest PS count > n (up to ps_max) under which every PS stays below its budget for
    ``horizon`` seconds, assuming new keys spread evenly (a PS's growth scales by n / n'),
    with its reserve for the migration out. A new PS starts at the smallest RSS seen.
    None: not even ps_max suffices."""
    base = min((f.rss_bytes for f in forecasts), default=0)
    for k in range(n + 1, cfg.ps_max + 1):
        ok = True
        # with ring replication each PS also grows with its peer's copy once there are two
        spread = n / k * (2 if cfg.replicated and n == 1 else 1)
        for f in forecasts:
            grow = f.growth(horizon, spread)
            # the source pays the whole reserve whatever k is (export, its new replica)
            if f.rss_bytes + f.reserve_bytes + grow > f.budget_bytes:
                ok = False
            if base + grow > f.budget_bytes:
                ok = False
        if ok:
            return k
    return None


def fits_after_removal(forecasts: list[MemoryForecast], last: Observation, horizon: float,
                       cfg: PolicyConfig) -> bool:
    """Can n - 1 PS hold the memory of n? The leaving PS's table bytes spread over the
    others (table bytes, not RSS: what moves is rows), and their growth scales by n/(n-1)."""
    n = len(forecasts)
    if n <= 1:
        return False
    by_id = {p.id: p for p in last.ps}
    leaving = max(forecasts, key=lambda f: int(f.ps_id.rsplit("-", 1)[-1])
                  if f.ps_id.rsplit("-", 1)[-1].isdigit() else -1)
    moved = by_id[leaving.ps_id].table_bytes / (n - 1)
    for f in forecasts:
        if f is leaving:
            continue
        if f.rate_bytes_per_s is None and f.limit_bytes:
            return False  # growth unknown: do not bet memory on it
        if f.rss_bytes + moved + f.growth(horizon, n / (n - 1)) > f.budget_bytes:
            return False
    return True


@dataclass(frozen=True)
class Throughput:
    samples_per_s: float
    ps_cpu: float | None          # the busiest PS, fraction of ps_cores
    worker_cpu: float | None      # mean over workers, fraction of worker_cores
    span: float


def measure(history: list[Observation], since: float, cfg: PolicyConfig) -> Throughput | None:
    """Job throughput and CPU use over the observations after ``since``; None while the
    span is shorter than ``measure_seconds``."""
    obs = [o for o in history if o.time >= since]
    if len(obs) < 2 or obs[-1].time - obs[0].time < cfg.measure_seconds:
        return None
    first, last = obs[0], obs[-1]
    dt = last.time - first.time
    ts = [o.time for o in obs]
    total = [sum(w.samples for w in o.workers) for o in obs]
    rate = slope(ts, total)
    if rate is None:
        rate = (total[-1] - total[0]) / dt
    before = {p.id: p.cpu_seconds for p in first.ps}
    ps_cpu = [max(0.0, p.cpu_seconds - before[p.id]) / dt / cfg.ps_cores
              for p in last.ps if p.id in before]
    wbefore = {w.id: w.cpu_seconds for w in first.workers if w.cpu_seconds is not None}
    w_cpu = [max(0.0, w.cpu_seconds - wbefore[w.id]) / dt / cfg.worker_cores
             for w in last.workers if w.cpu_seconds is not None and w.id in wbefore]
    return Throughput(max(rate, 0.0), max(ps_cpu) if ps_cpu else None,
                      sum(w_cpu) / len(w_cpu) if w_cpu else None, dt)


# -- the policy -------------------------------------------------------------------------------
@dataclass
class _Pending:
    decision: Decision
    started: float
    from_counts: tuple[int, int]
    downgraded: bool = False


@dataclass
class _Trial:
    kind: str                       # add-worker | add-ps | remove-worker | remove-ps
    before: tuple[int, int]         # (ps, workers)
    after: tuple[int, int]
    judged: bool = False


class Policy:
    """Decision state over a stream of observations. Feed ``observe(obs)``, ask
    ``decide()``; tell it ``started(d)`` when a decision is handed to the scaler and
    ``finished(d, ok, ...)`` when the scaler is done (or gave up)."""

    def __init__(self, config: PolicyConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = config.validate()
        self.clock = clock
        self.history: list[Observation] = []
        self.last_change = -math.inf          # any completed scale (resets rates)
        self.last_ps_change = -math.inf
        self.last_perf_change = -math.inf     # cool-down clock
        self.pending: _Pending | None = None
        self.trial: _Trial | None = None
        self.measured: dict[tuple[int, int], tuple[float, float]] = {}   # size -> (samples/s, at)
        self.rejected: dict[tuple[int, int], float] = {}                 # size -> since
        self.unavailable_until = -math.inf     # after a give-up, no scale-out before this
        self.shortfall_since: float | None = None
        self._accepted: dict[str, tuple[int, int]] = {}   # role -> (job target, accepted size)
        self.last_recovery_ask = -math.inf
        self.scale_durations: list[float] = []
        self.last_alert = -math.inf
        self.decisions: list[Decision] = []
        self.reserve_factor = config.scale_out_reserve
        self._reserve_probe: tuple[float, dict[str, tuple[int, int]]] | None = None

    # -- inputs
    def observe(self, obs: Observation) -> None:
        if self.history and obs.time < self.history[-1].time:
            raise PolicyError(f"observation at {obs.time} is older than the previous one "
                              f"({self.history[-1].time})")
        if not self.history or (len(obs.ps), len(obs.workers)) != \
                (len(self.history[-1].ps), len(self.history[-1].workers)):
            # the size changed (members starting up, registering late, dying): rates
            # measured across the change, or during start-up, would mislead a trial
            self.last_change = max(self.last_change, obs.time)
        self.history.append(obs)
        self._learn_reserve(obs)
        keep = obs.time - max(self.cfg.window_seconds, self.cfg.measure_seconds) * 2
        while self.history and self.history[0].time < keep:
            self.history.pop(0)

    def _learn_reserve(self, obs: Observation) -> None:
        """After a PS scale-out, how much did the RSS of the PS that gave rows away rise,
        per byte of their data? The reserve never goes below what was seen."""
        if self._reserve_probe is None:
            return
        until, before = self._reserve_probe
        if obs.time > until:
            self._reserve_probe = None
            return
        for p in obs.ps:
            if p.id in before and before[p.id][1] > 0:
                seen = (p.rss_bytes - before[p.id][0]) / before[p.id][1]
                self.reserve_factor = min(8.0, max(self.reserve_factor, seen))

    def started(self, decision: Decision) -> None:
        last = self.history[-1] if self.history else None
        if last is not None and decision.ps is not None and decision.ps > len(last.ps):
            base = min((p.rss_bytes for o in self.history for p in o.ps), default=0)
            self._reserve_probe = (math.inf, {p.id: (p.rss_bytes, p.rss_bytes - base)
                                              for p in last.ps})
        counts = (len(last.ps), len(last.workers)) if last else (0, 0)
        # a downgraded request is not downgraded again: the next failure gives up
        self.pending = _Pending(decision, self.clock(), counts,
                                downgraded=bool(decision.details.get("downgraded")))

    def finished(self, decision: Decision, ok: bool, duration: float | None = None) -> Decision | None:
        """The scaler is done with ``decision``. On failure (the resources did not come
        within the wait), returns the follow-up: a downgraded request, or None (given up)."""
        now = self.clock()
        pending, self.pending = self.pending, None
        if ok:
            self.last_change = now
            if self._reserve_probe is not None:  # watch the sources settle a little longer
                self._reserve_probe = (now + self.cfg.settle_seconds, self._reserve_probe[1])
            if decision.ps is not None and pending and decision.ps != pending.from_counts[0]:
                self.last_ps_change = now
                if decision.ps > pending.from_counts[0] and duration is not None:
                    self.scale_durations = (self.scale_durations + [duration])[-5:]
            if decision.rule in ("performance-fit", "recovery"):
                self.last_perf_change = now
            return None
        return self._give_up(decision, pending, now)

    # -- derived
    def lead_time(self) -> float:
        """How far ahead resource-fit must look: a scale-out's duration (the configured
        one, or 1.5x the slowest of the last ones) plus one observation interval."""
        seen = 1.5 * max(self.scale_durations) if self.scale_durations else 0.0
        return max(self.cfg.lead_seconds, seen) + self.cfg.interval_seconds

    def sizes(self) -> tuple[int, int]:
        last = self.history[-1]
        return len(last.ps), len(last.workers)

    # -- the decision
    def decide(self) -> Decision | None:
        if not self.history:
            return None
        now = self.clock()
        for size, since in list(self.rejected.items()):
            if now - since > self.cfg.explore_ttl_seconds:
                del self.rejected[size]
        if self.pending is not None:
            return self._check_pending(now)
        d = self._recovery(now)
        if d is None and self.shortfall_since is None:
            d = self._resource_fit(now)
            if d is None:
                d = self._performance_fit(now)
        if d is not None:
            self.decisions.append(d)
        return d

    def _check_pending(self, now: float) -> Decision | None:
        p = self.pending
        if now - p.started < self.cfg.max_wait_seconds:
            return None
        # the scaler did not deliver in time: the caller cancels it and applies this
        self.pending = None
        d = self._give_up(p.decision, p, now)
        if d is not None:
            self.decisions.append(d)
        return d

    def _give_up(self, decision: Decision, pending: _Pending | None, now: float) -> Decision:
        ps_now, w_now = self.sizes()
        self.unavailable_until = now + self.cfg.max_wait_seconds
        if (decision.ps is not None and decision.ps > ps_now + 1 and pending is not None
                and not pending.downgraded):
            return Decision("max-wait", f"{decision.ps} PS not available within "
                            f"{self.cfg.max_wait_seconds:.0f}s; downgraded to {ps_now + 1}",
                            ps=ps_now + 1, details={"requested": decision.ps, "downgraded": True})
        # give up: keep what is running (the counts the scaler reached)
        return Decision("max-wait", f"gave up on {decision.rule} (ps={decision.ps}, "
                        f"workers={decision.workers}): not satisfied within "
                        f"{self.cfg.max_wait_seconds:.0f}s; staying at ps={ps_now}, "
                        f"workers={w_now}",
                        ps=ps_now if decision.ps is not None else None,
                        workers=w_now if decision.workers is not None else None,
                        details={"gave_up": True, "requested_ps": decision.ps,
                                 "requested_workers": decision.workers})

    def _recovery(self, now: float) -> Decision | None:
        last = self.history[-1]
        ps, w = len(last.ps), len(last.workers)
        # a size accepted by `continue` stands while the job's own target is unchanged
        ps_target, w_target = last.ps_target, last.worker_target
        if self._accepted.get("ps", (None,))[0] == ps_target and ps_target is not None:
            ps_target = self._accepted["ps"][1]
        if self._accepted.get("workers", (None,))[0] == w_target and w_target is not None:
            w_target = self._accepted["workers"][1]
        short_ps = ps_target is not None and ps < ps_target
        short_w = w_target is not None and w < w_target
        if not (short_ps or short_w):
            self.shortfall_since = None
            return None
        if self.shortfall_since is None:
            self.shortfall_since = now
            return None  # the master replaces members itself; give it the wait
        waited = now - self.shortfall_since
        if waited < self.cfg.max_wait_seconds:
            return None
        what = f"ps {ps}/{ps_target}, workers {w}/{w_target}"
        if self.cfg.recovery == "continue":
            self.shortfall_since = None
            if short_ps:
                self._accepted["ps"] = (last.ps_target, ps)
            if short_w:
                self._accepted["workers"] = (last.worker_target, w)
            return Decision("recovery", f"continue at reduced size ({what}): replacements did not "
                            f"come within {self.cfg.max_wait_seconds:.0f}s",
                            ps=ps if short_ps else None, workers=w if short_w else None,
                            details={"strategy": "continue", "waited_s": round(waited, 1)})
        if now - self.last_recovery_ask < self.cfg.max_wait_seconds:
            return None
        self.last_recovery_ask = now
        return Decision("recovery", f"wait for the full size ({what}); asking again for "
                        "the missing replicas", ps=ps_target if short_ps else None,
                        workers=w_target if short_w else None,
                        details={"strategy": "wait", "waited_s": round(waited, 1)})

    def _resource_fit(self, now: float) -> Decision | None:
        cfg = self.cfg
        if not cfg.resource_fit:
            return None
        lead = self.lead_time()
        forecasts = memory_forecasts(self.history, max(self.last_ps_change, now - cfg.window_seconds),
                                     cfg, self.reserve_factor, lead)
        risky = [f for f in forecasts if f.limit_bytes and f.seconds_left <= lead]
        if not risky:
            return None
        n = len(forecasts)
        worst = min(risky, key=lambda f: f.seconds_left)
        rate = worst.rate_bytes_per_s or 0.0
        why = (f"{worst.ps_id} RSS {worst.rss_bytes / MiB:.0f} MiB growing {rate / MiB:.2f} MiB/s "
               f"reaches {1 - cfg.memory_headroom:.0%} of its {worst.limit_bytes / MiB:.0f} MiB "
               f"limit in {worst.seconds_left:.1f}s <= lead {lead:.1f}s")
        why += f" (keeping {worst.reserve_bytes / MiB:.0f} MiB for the scale-out)"
        if worst.bounded_rate_bytes_per_s > 0:
            why += (f"; {worst.bounded_rate_bytes_per_s / MiB:.2f} MiB/s of it from tables under "
                    f"eviction, stopping after {worst.bounded_cap_bytes / MiB:.0f} MiB")
        details = {"ps_id": worst.ps_id, "rss_bytes": worst.rss_bytes,
                   "bounded_rate_bytes_per_s": round(worst.bounded_rate_bytes_per_s, 1),
                   "reserve_bytes": int(worst.reserve_bytes),
                   "limit_bytes": worst.limit_bytes, "rate_bytes_per_s": round(rate, 1),
                   "seconds_left": round(worst.seconds_left, 2), "lead_s": round(lead, 2)}
        if n >= cfg.ps_max or now < self.unavailable_until:
            if now - self.last_alert < cfg.cooldown_seconds:
                return None
            self.last_alert = now
            blocked = "at ps max_replicas" if n >= cfg.ps_max else "PS unavailable (max wait)"
            return Decision("resource-fit", f"{why}; cannot scale out: {blocked}", details=details)
        # the new size must last until a next scale-out could land: this one (lead), three
        # samples to re-measure the growth, and the next one (lead)
        k = ps_needed_for_memory(forecasts, n, 2 * lead + 3 * cfg.interval_seconds, cfg)
        if k is None:  # no count keeps every PS under budget: an emergency, take the most
            k = cfg.ps_max
            why += f"; even {k} PS may not be enough"
        return Decision("resource-fit", f"scale PS {n} -> {k}: {why}", ps=k, details=details)

    def _performance_fit(self, now: float) -> Decision | None:
        cfg = self.cfg
        if not cfg.performance_fit:
            return None
        last = self.history[-1]
        ps, w = len(last.ps), len(last.workers)
        size = (ps, w)
        m = measure(self.history, max(self.last_change + cfg.settle_seconds,
                                      now - cfg.window_seconds), cfg)
        if m is None:
            return None
        self.measured[size] = (m.samples_per_s, now)
        if now - self.last_perf_change < cfg.cooldown_seconds:
            return None
        w_lo = max(cfg.worker_min, 1)
        t = self.trial
        if t is not None and not t.judged and t.after == size and t.before in self.measured:
            t.judged = True
            before_rate = self.measured[t.before][0]
            dc = cores(cfg, *size) - cores(cfg, *t.before)
            per_core = before_rate / max(cores(cfg, *t.before), 1e-9)
            marginal = (m.samples_per_s - before_rate) / dc if dc else 0.0
            # adding pays if the new cores bring >= min_gain x the average per core; a
            # removal pays if the freed cores brought less than that
            worth = marginal >= cfg.min_gain * per_core
            pays = worth if dc > 0 else not worth
            if (t.kind == "add-ps" and m.ps_cpu is not None and m.ps_cpu < cfg.ps_cpu_high
                    and last.pending_work > 0):
                pays = True  # the PS bottleneck is gone; workers are the next one to grow
            details = {"before": list(t.before), "after": list(size),
                       "before_samples_per_s": round(before_rate, 1),
                       "after_samples_per_s": round(m.samples_per_s, 1),
                       "marginal_per_core": round(marginal, 1),
                       "average_per_core": round(per_core, 1)}
            if not pays:
                self.rejected[size] = now
                rel = "<" if dc > 0 else ">="
                return self._perf(f"{t.kind} did not pay: {marginal:+.0f} samples/s per core "
                                  f"{rel} {cfg.min_gain} x {per_core:.0f}; back to ps={t.before[0]}, "
                                  f"workers={t.before[1]}", t.before, size, "revert", details)
        ps_cpu = m.ps_cpu if m.ps_cpu is not None else 0.0
        # pending work growing: capacity is short now, so sizes rejected earlier (under
        # other demand) may pay again; and add as many workers as the growth asks for
        span = [o for o in self.history if o.time >= now - cfg.measure_seconds]
        growth = slope([o.time for o in span], [o.pending_work for o in span]) or 0.0
        step = 1
        if growth > 0 and last.pending_work > 0:
            for size in [s for s in self.rejected if s[0] > ps or s[1] > w]:
                del self.rejected[size]
            if w and m.samples_per_s > 0:
                step = max(1, math.ceil(growth / (m.samples_per_s / w)))
        forecasts = memory_forecasts(self.history, max(self.last_ps_change, now - cfg.window_seconds),
                                     cfg, self.reserve_factor, self.lead_time())
        horizon = self.lead_time() + cfg.window_seconds
        info = {"samples_per_s": round(m.samples_per_s, 1), "ps_cpu": round(ps_cpu, 3),
                "worker_cpu": None if m.worker_cpu is None else round(m.worker_cpu, 3)}
        if ps_cpu >= cfg.ps_cpu_high and ps < cfg.ps_max and (ps + 1, w) not in self.rejected \
                and now >= self.unavailable_until:
            return self._perf(f"PS CPU saturated ({ps_cpu:.0%} >= {cfg.ps_cpu_high:.0%}): "
                              f"add a PS", (ps + 1, w), size, "add-ps", info)
        idle_workers = (m.worker_cpu is not None and m.worker_cpu < cfg.worker_util_low
                        and last.pending_work <= 0)
        if (0 < w < cfg.worker_max and last.pending_work > 0 and ps_cpu < cfg.ps_cpu_high
                and (ps, w + 1) not in self.rejected and now >= self.unavailable_until):
            # worker CPU is not asked: on a shared host it is low from contention, not want
            # of work; whether the worker paid is judged on throughput afterwards
            return self._perf(f"work pending ({last.pending_work:g}) and PS CPU has headroom "
                              f"({ps_cpu:.0%} < {cfg.ps_cpu_high:.0%}): add {step} worker(s)",
                              (ps, w + step), size, "add-worker", info)
        if idle_workers and w > w_lo:
            target = clamp(math.ceil(w * m.worker_cpu / cfg.worker_util_low), w_lo, w - 1)
            return self._perf(f"workers idle ({m.worker_cpu:.0%} CPU < {cfg.worker_util_low:.0%}, "
                              "no pending work): remove what does not pay",
                              (ps, target), size, "remove-worker", info)
        if (ps > cfg.ps_min and m.ps_cpu is not None and ps_cpu < cfg.ps_cpu_low
                and (ps - 1, w) not in self.rejected
                and fits_after_removal(forecasts, last, horizon, cfg)):
            return self._perf(f"PS CPU idle ({ps_cpu:.0%} < {cfg.ps_cpu_low:.0%}) and {ps - 1} PS "
                              "hold the memory: remove a PS", (ps - 1, w), size, "remove-ps", info)
        return None

    def _perf(self, reason: str, to: tuple[int, int], now_size: tuple[int, int], kind: str,
              details: dict) -> Decision | None:
        cfg = self.cfg
        ps = clamp(to[0], cfg.ps_min, cfg.ps_max)
        w = clamp(to[1], cfg.worker_min, cfg.worker_max)
        if (ps, w) == now_size:
            return None
        self.trial = None if kind == "revert" else _Trial(kind, now_size, (ps, w))
        return Decision("performance-fit", reason,
                        ps=ps if ps != now_size[0] else None,
                        workers=w if w != now_size[1] else None,
                        details={"trial": kind, **details})

    def status(self) -> dict:
        """What the policy knows now, for ``aimaster status``."""
        now = self.clock()
        out = {"lead_s": round(self.lead_time(), 2),
               "cooldown_left_s": round(max(0.0, self.cfg.cooldown_seconds
                                            - (now - self.last_perf_change)), 1),
               "pending": None if self.pending is None else {
                   **self.pending.decision.as_event(), "waiting_s": round(now - self.pending.started, 1)},
               "measured": {f"ps={k[0]},workers={k[1]}": round(v[0], 1)
                            for k, v in sorted(self.measured.items())},
               "rejected": [f"ps={k[0]},workers={k[1]}" for k in sorted(self.rejected)],
               "shortfall_s": None if self.shortfall_since is None
               else round(now - self.shortfall_since, 1),
               "trial": None if self.trial is None else {
                   "kind": self.trial.kind, "judged": self.trial.judged}}
        if self.history:
            last = self.history[-1]
            out["size"] = {"ps": len(last.ps), "workers": len(last.workers),
                           "ps_target": last.ps_target, "worker_target": last.worker_target,
                           "pending_work": last.pending_work}
        if self.history:
            fc = memory_forecasts(self.history, max(self.last_ps_change,
                                                    now - self.cfg.window_seconds), self.cfg,
                                  self.reserve_factor, self.lead_time())
            out["reserve_factor"] = round(self.reserve_factor, 2)
            out["memory"] = [{"ps": f.ps_id, "rss_mb": round(f.rss_bytes / MiB, 1),
                              "limit_mb": round(f.limit_bytes / MiB, 1),
                              "reserve_mb": round(f.reserve_bytes / MiB, 1),
                              "rate_mb_s": None if f.rate_bytes_per_s is None
                              else round(f.rate_bytes_per_s / MiB, 3),
                              # growth of tables under eviction, and where it stops
                              "bounded_rate_mb_s": round(f.bounded_rate_bytes_per_s / MiB, 3),
                              "bounded_cap_mb": None if math.isinf(f.bounded_cap_bytes)
                              else round(f.bounded_cap_bytes / MiB, 1),
                              "seconds_left": None if math.isinf(f.seconds_left)
                              else round(f.seconds_left, 1)} for f in fc]
        return out


# -- cost accounting -------------------------------------------------------------------------
@dataclass
class RoleCost:
    allocated_core_s: float = 0.0
    used_core_s: float = 0.0
    allocated_gb_s: float = 0.0
    used_gb_s: float = 0.0
    replica_s: float = 0.0

    def as_dict(self) -> dict:
        return {"replica_seconds": round(self.replica_s, 1),
                "allocated_core_seconds": round(self.allocated_core_s, 1),
                "used_core_seconds": round(self.used_core_s, 1),
                "idle_core_seconds": round(max(0.0, self.allocated_core_s - self.used_core_s), 1),
                "cpu_efficiency": round(self.used_core_s / self.allocated_core_s, 4)
                if self.allocated_core_s else None,
                "allocated_gb_seconds": round(self.allocated_gb_s, 1),
                "used_gb_seconds": round(self.used_gb_s, 1)}


class CostLedger:
    """Resource-seconds per role between consecutive observations: allocated = replicas x
    cores (or GB) x time, used = measured CPU seconds (or RSS x time). A member's CPU
    counter that went backwards (a restarted process) counts from zero."""

    GB = 1024 ** 3

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.roles = {"ps": RoleCost(), "worker": RoleCost()}
        self._prev: Observation | None = None

    def add(self, obs: Observation) -> None:
        prev, self._prev = self._prev, obs
        if prev is None:
            return
        dt = obs.time - prev.time
        if dt <= 0:
            return
        cfg = self.cfg
        for role, members, cores_each in (("ps", "ps", cfg.ps_cores),
                                          ("worker", "workers", cfg.worker_cores)):
            cost = self.roles[role]
            before = {m.id: m for m in getattr(prev, members)}
            cur = getattr(obs, members)
            cost.replica_s += len(before) * dt
            cost.allocated_core_s += len(before) * cores_each * dt
            for m in cur:
                b = before.get(m.id)
                if b is None or m.cpu_seconds is None or b.cpu_seconds is None:
                    continue
                d = m.cpu_seconds - b.cpu_seconds
                cost.used_core_s += d if d >= 0 else m.cpu_seconds
            for m in before.values():
                if role == "ps":
                    alloc = m.memory_limit_bytes or cfg.ps_memory_limit_bytes
                else:
                    alloc = cfg.worker_memory_bytes
                cost.allocated_gb_s += alloc * dt / self.GB
                cost.used_gb_s += m.rss_bytes * dt / self.GB

    def summary(self) -> dict:
        return {role: c.as_dict() for role, c in self.roles.items()}
