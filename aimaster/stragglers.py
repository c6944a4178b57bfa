"""Stragglers: a slow PS or a slow worker does not hold the job back (issue 19).

Enabled by ``stragglers: {enabled: true, ...}`` in the job file; docs/guide-stragglers.md.

Detection, from what members already send with their heartbeats (Gazer statistics):

- a PS is slow when the p50 or the p99 of its data-plane service time (Lookup and Push,
  between two of its reports) stays above ``k`` x the median of the other PS, or when it is
  CPU-saturated while the median other PS is not;
- a worker is slow when its records/s (samples over ``window_seconds``) stays below 1/k of
  the median of the other workers'.

Both go through :class:`Hysteresis`: a member is marked only once its condition held for a
whole window, and cleared only once it did not for a whole window (one GC pause does
nothing). Observations without enough evidence (too few requests) change nothing.

Mitigation, each an operation of the control plane (``JobMaster`` queues it; the same live
migration as a scale, so no update is lost) or a shard-service change, each an event:

- slow PS: below ``replace_below`` x the other PS' service rate, ``straggler_replace`` at
  once: a new PS, the slow one's slots moved to the fleet live, the slow one retired;
  otherwise first a re-placement by capacity (``straggler_rebalance``: each PS's share of
  bytes and lookups proportional to its measured service rate), and the replacement when
  it is still slow a window later. The new PS is started when the PS is first suspected
  (``straggler_spare``) and retired if no replacement takes it;
- idle worker while another holds a shard (the tail of the data, or a slow worker): the
  holder is asked to split its shard at the record it reached; the rest goes to the idle
  worker (``shard_split``, aimaster/shards.py). Never a fast worker's shard for a slower
  idle one.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from aimaster.errors import Busy, OperationRefused
from aimaster.placement import capacity_weights, service_rates
from aimaster.plugins import MasterPlugin
from aimaster.view import JobPhase
from deeprec_ext.proto import gazer_pb2
from deeprec_ext.stats import LATENCY_BOUNDS_MS, quantile_ms

log = logging.getLogger("aimaster.stragglers")

DATA_PLANE = ("Lookup", "Push")
_BUCKETS = len(LATENCY_BOUNDS_MS) + 1
STEAL_SPEEDUP = 1.5  # an idle worker steals from a holder at least this much slower
FLOOR_MS = LATENCY_BOUNDS_MS[0]  # below the first bucket's bound times are not told apart
# a probe's round trip on a busy host varies by a millisecond or two: not a straggler
PROBE_FLOOR_MS = 2.0
PROBES = 5  # per PS and observation, spread over the interval


class Hysteresis:
    """Per member: marked once ``bad`` held for ``mark_after`` seconds (default
    ``window``), cleared once it did not for ``window`` seconds. ``None`` (no evidence)
    changes nothing."""

    def __init__(self, window: float, mark_after: float | None = None):
        self.window = window
        self.mark_after = window if mark_after is None else mark_after
        self.marked: dict[str, float] = {}        # member -> when it was marked
        self._bad_since: dict[str, float] = {}
        self._good_since: dict[str, float] = {}

    def update(self, member: str, now: float, bad: bool | None) -> str | None:
        """``"detected"``, ``"cleared"`` or None."""
        if bad is None:
            return None
        if bad:
            self._good_since.pop(member, None)
            since = self._bad_since.setdefault(member, now)
            if member not in self.marked and now - since >= self.mark_after:
                self.marked[member] = now
                return "detected"
        else:
            self._bad_since.pop(member, None)
            since = self._good_since.setdefault(member, now)
            if member in self.marked and now - since >= self.window:
                del self.marked[member]
                return "cleared"
        return None

    def bad_since(self, member: str) -> float | None:
        """Since when ``member`` has been slow without a break (None: it is not)."""
        return self._bad_since.get(member)

    def forget(self, member: str) -> None:
        for d in (self.marked, self._bad_since, self._good_since):
            d.pop(member, None)


@dataclass
class PsWindow:
    """What a PS served between two of its reports."""
    requests: int
    p50_ms: float
    p99_ms: float
    cpu: float            # cores used
    probe_ms: float = 0.0  # median time to answer the AIMaster's probes (0: not probed)
    mean_ms: float = 0.0   # mean service time: the inverse of its service rate
    probe_mean_ms: float = 0.0  # the probes' mean, the largest tenth left out


def ps_verdicts(windows: dict[str, PsWindow], k: float, min_requests: int,
                cpu_saturated: float) -> dict[str, tuple[bool | None, dict]]:
    """Per PS: (slow?, what was measured); None when it served too little to tell or there
    is no other PS to compare with."""
    out: dict[str, tuple[bool | None, dict]] = {}
    for ps, w in windows.items():
        others = [o for p, o in windows.items() if p != ps]
        if not others:
            out[ps] = (None, {})
            continue
        cpu_others = float(np.median([o.cpu for o in others]))
        saturated = w.cpu >= cpu_saturated and cpu_others < cpu_saturated / 2
        timed = [o for o in others if o.requests >= min_requests]
        detail = {"cpu": round(w.cpu, 3), "cpu_others": round(cpu_others, 3),
                  "requests": w.requests}
        if w.requests >= min_requests:
            # its own service time, even with no other PS timed: the capacity weights need
            # the healthy PS's too (a throttled peer may serve too few requests to time)
            detail.update(p50_ms=round(w.p50_ms, 3), p99_ms=round(w.p99_ms, 3),
                          mean_ms=round(w.mean_ms, 3))
        probed = [o.probe_ms for o in others if o.probe_ms > 0]
        probe_ratio = 0.0
        if w.probe_ms > 0 and probed:
            medp = max(float(np.median(probed)), PROBE_FLOOR_MS)
            probe_ratio = w.probe_ms / medp
            detail.update(probe_ms=round(w.probe_ms, 3), median_probe_ms=round(medp, 3),
                          probe_mean_ms=round(w.probe_mean_ms, 3))
        if w.requests < min_requests or not timed:
            if probe_ratio:
                # too few requests to time (a PS slow enough serves few: clients wait on
                # it), but the AIMaster's probes were answered: judge by them
                detail.update(ratio=round(probe_ratio, 2), cpu_saturated=saturated)
                out[ps] = (probe_ratio > k or saturated, detail)
            else:
                out[ps] = (True if saturated else None, {**detail, "cpu_saturated": saturated})
            continue
        med50 = max(float(np.median([o.p50_ms for o in timed])), FLOOR_MS)
        med99 = max(float(np.median([o.p99_ms for o in timed])), FLOOR_MS)
        ratio = max(w.p50_ms / med50, w.p99_ms / med99, probe_ratio)
        detail.update(median_p50_ms=round(med50, 3), median_p99_ms=round(med99, 3))
        detail.update(ratio=round(ratio, 2), cpu_saturated=saturated)
        out[ps] = (ratio > k or saturated, detail)
    return out


def worker_verdicts(rates: dict[str, float], k: float) -> dict[str, tuple[bool | None, dict]]:
    """Per worker (records/s over the window): slow when below 1/k of the median of the
    others'."""
    out = {}
    for w, r in rates.items():
        others = [x for o, x in rates.items() if o != w]
        if not others:
            out[w] = (None, {})
            continue
        med = float(np.median(others))
        if med <= 0:
            out[w] = (None, {})
            continue
        out[w] = (r < med / k, {"records_per_second": round(r, 2),
                                "median_others": round(med, 2), "ratio": round(r / med, 3)})
    return out


def _data_plane_counts(stats) -> np.ndarray | None:
    """The data-plane histogram with the total milliseconds appended (cumulative)."""
    chosen = [(np.asarray(r.counts, np.int64), r.sum_ms) for r in stats.rpcs
              if r.method in DATA_PLANE and len(r.counts) == _BUCKETS]
    if not chosen:
        return None
    return np.append(np.sum([c for c, _ in chosen], axis=0).astype(np.float64),
                     sum(ms for _, ms in chosen))


class StragglerPlugin(MasterPlugin):
    name = "stragglers"

    def __init__(self, config):
        self.job = config
        self.cfg = config.stragglers
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._actor: threading.Thread | None = None
        # PS: its reports over the last window, (received, cumulative data-plane
        # histogram, CPU seconds), and the AIMaster's probes, (time, ms): each verdict
        # pools a whole window (a p99 of one heartbeat's 25 requests is their maximum)
        self._ps_reports: dict[str, deque] = {}
        self._ps_probes: dict[str, deque] = {}
        self._ps_service: dict[str, deque] = {}
        self._worker_samples: dict[str, deque] = {}
        # a PS verdict pools a whole window, and its probe median turns only once half of
        # that window was slow: half a window more of slow verdicts makes a window of
        # slowness (one stall moves neither the median nor, among hundreds of requests,
        # the p99). A worker's records/s is a mean over the window: it keeps a whole one
        self.ps_marks = Hysteresis(float(self.cfg.window_seconds),
                                   max(float(self.cfg.window_seconds) / 2,
                                       float(self.cfg.interval_seconds)))
        self.worker_marks = Hysteresis(float(self.cfg.window_seconds))
        self._details: dict[str, dict] = {}
        self._reweighted: dict[str, float] = {}   # PS -> when its share was cut
        self._noop_at: dict[str, float] = {}      # PS -> when a re-placement moved nothing
        self._replaced: set[str] = set()
        # PS suspected slow -> (PS pre-started to replace it, when); the last slow verdict
        self._spares: dict[str, tuple[list[str], float]] = {}
        self._last_bad: dict[str, float] = {}
        self._prestarting: set[str] = set()
        self._hot_reported: set[int] = set()
        self._rates: dict[str, float] = {}        # worker -> records/s over the window
        self.actions: list[dict] = []             # what was done, for tests and logs
        self._rng = np.random.default_rng()

    # -- hooks ---------------------------------------------------------------------------
    def on_heartbeat(self, master, request) -> None:
        if not request.gazer_stats:
            return
        member = master.member(request.id)
        if member is None or member.role != "ps":
            return
        try:
            stats = gazer_pb2.MemberStats.FromString(request.gazer_stats)
        except DecodeError:
            return
        counts = _data_plane_counts(stats)
        if counts is None:
            return
        now = time.monotonic()
        with self._lock:
            q = self._ps_reports.setdefault(request.id, deque())
            if q and q[-1][1].shape != counts.shape:
                q.clear()
            q.append((now, counts, stats.cpu_seconds))
            while len(q) > 2 and now - q[1][0] >= self.cfg.window_seconds:
                q.popleft()

    def on_tick(self, master) -> None:
        if self._thread is None and master.phase == JobPhase.RUNNING:
            self._thread = threading.Thread(target=self._loop, args=(master,), daemon=True,
                                            name="stragglers")
            self._thread.start()

    def on_stop(self, master) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    # -- the loop ------------------------------------------------------------------------
    def _loop(self, master) -> None:
        interval = float(self.cfg.interval_seconds)
        # an interval between observations, the probes' time (about half an interval) on
        # top: with one observation per interval a worker whose records/s sits near 1/k
        # had more chances per window to measure above it once and start its window again
        # (marked 17.5 s after it slowed instead of 12.6-12.9 s, one run)
        while not self._stop.wait(interval) and master.phase == JobPhase.RUNNING:
            try:
                self.step(master, time.monotonic())
            except Exception:  # noqa: BLE001 - a bad sample must not stop the detector
                log.exception("stragglers: observation failed")

    def step(self, master, now: float) -> None:
        self._observe_ps(master, now)
        self._observe_workers(master, now)
        master.set_stragglers({**{p: {"role": "ps", **self._details.get(p, {})}
                                  for p in self.ps_marks.marked},
                               **{w: {"role": "worker", **self._details.get(w, {})}
                                  for w in self.worker_marks.marked}})
        if self.cfg.split_shards and not self.cfg.dry_run:
            self._steal(master)

    # PS
    def _observe_ps(self, master, now: float) -> None:
        routing = master.routing
        if routing is None:
            return
        owners = set(routing.ps_ids)
        live = {m.id for m in master.live_ps()}
        fresh = 2 * max(float(self.job.heartbeat_seconds), float(self.cfg.interval_seconds)) + 1
        window = float(self.cfg.window_seconds)
        probes = self._probe(master, routing)
        with self._lock:
            for p in list(self._ps_reports):
                if p not in owners or p not in live:
                    self._ps_reports.pop(p, None)
                    self._ps_probes.pop(p, None)
                    self.ps_marks.forget(p)
            windows = {}
            for p, q in self._ps_reports.items():
                # a PS whose last report is stale (stopped, busy migrating): no evidence
                if p not in owners or len(q) < 2 or time.monotonic() - q[-1][0] > fresh:
                    continue
                (t0, c0, cpu0), (t1, c1, cpu1) = q[0], q[-1]
                delta = np.maximum(c1 - c0, 0)
                hist, total_ms = delta[:-1], float(delta[-1])
                n = int(hist.sum())
                windows[p] = PsWindow(n, quantile_ms(hist, 0.5), quantile_ms(hist, 0.99),
                                      max(cpu1 - cpu0, 0.0) / max(t1 - t0, 1e-3),
                                      mean_ms=total_ms / n if n else 0.0)
            for p, ms in probes.items():
                pq = self._ps_probes.setdefault(p, deque())
                pq.extend((now, v) for v in ms)
                while pq and now - pq[0][0] > window:
                    pq.popleft()
                if p in windows:
                    vals = np.sort([v for _, v in pq])
                    windows[p].probe_ms = float(np.median(vals))
                    windows[p].probe_mean_ms = float(vals[:max(1, int(0.9 * vals.size))].mean())
        if len(windows) < 2:
            return
        verdicts = ps_verdicts(windows, float(self.cfg.k), self.cfg.min_requests,
                               float(self.cfg.cpu_saturated))
        log.debug("stragglers: PS %s", {p: (b, d) for p, (b, d) in verdicts.items()})
        for ps, (bad, detail) in verdicts.items():
            if bad:
                self._last_bad[ps] = now
            # its service time: the mean of its requests (a stop inside some of them counts
            # in full), or the probes' mean wait when that is longer. The mean, not the
            # median the verdict uses: what clients wait on average is what sets their
            # speed, and a median of probes turns only once half the window was slow,
            # while the mean follows at once (the verdict, robust, decides whether; this,
            # how much). Not below the probes' floor: loopback jitter is no capacity
            probe = detail.get("probe_mean_ms", 0.0)
            service = max(detail.get("mean_ms", 0.0), max(probe, PROBE_FLOOR_MS) if probe else 0.0)
            if service:
                self._ps_service.setdefault(ps, deque(maxlen=64)).append((now, service))
            change = self.ps_marks.update(ps, now, bad)
            if bad:
                self._details[ps] = detail
            if change == "detected":
                master.straggler_event("straggler_detected", role="ps", id=ps,
                                    window_seconds=self.cfg.window_seconds, **detail)
                self._report_hot_slot(master)
                self._act_on_ps(master, ps, now, first=True)
            elif change == "cleared":
                master.straggler_event("straggler_cleared", role="ps", id=ps, **detail)
                self._details.pop(ps, None)
            elif ps in self.ps_marks.marked and bad:  # still slow in the newest window
                self._act_on_ps(master, ps, now, first=False)
            if bad:
                self._maybe_prestart(master, ps, now)
        self._tend_spares(master, owners, now)

    # a spare PS: started while a PS is only suspected, so that its replacement does not
    # wait for a process to start; retired when no replacement took it
    def _maybe_prestart(self, master, ps: str, now: float) -> None:
        """A PS slow at two observations in a row (one interval), or marked: start the
        PS that would replace it."""
        since = self.ps_marks.bad_since(ps)
        if (not self.cfg.replace or self.cfg.dry_run or ps in self._spares
                or ps in self._replaced or since is None
                or (now - since < float(self.cfg.interval_seconds)
                    and ps not in self.ps_marks.marked)):
            return
        self._spares[ps] = ([], now)
        self._prestarting.add(ps)
        threading.Thread(target=self._prestart, args=(master, ps, now), daemon=True,
                         name="stragglers-prestart").start()

    def _prestart(self, master, ps: str, now: float) -> None:
        try:
            ids = master.prestart_ps(ps)
        except Exception as exc:  # noqa: BLE001 - the replacement starts its own PS then
            log.info("stragglers: no spare PS for %s (%s)", ps, exc)
            ids = []
        self._spares[ps] = (ids, now)  # before it may be tended
        self._prestarting.discard(ps)
        if ids:
            master.straggler_event("straggler_spare", state="started", ids=ids, id=ps)

    def _tend_spares(self, master, owners: set, now: float) -> None:
        """Forget the spare of a PS that was replaced (the replacement took it) or is well
        again (no slow verdict for a window while unmarked: retired)."""
        routing = master.routing
        for ps, (ids, _) in list(self._spares.items()):
            if ps in self._prestarting:
                continue
            gone = ps not in owners
            calm = (ps not in self.ps_marks.marked
                    and now - self._last_bad.get(ps, -np.inf) >= self.cfg.window_seconds)
            if not (gone or calm):
                continue
            idle = [i for i in ids if routing is None or i not in routing.ps_ids]
            if not idle:
                self._spares.pop(ps, None)
            elif (not self.cfg.dry_run and
                  (self._actor is None or not self._actor.is_alive())):
                self._spares.pop(ps, None)
                self._start(master, "retire_spare", ps,
                            {"reason": f"{ps} was replaced" if gone else f"{ps} is well again",
                             "spare_ids": idle})

    def _probe(self, master, routing) -> dict[str, list[float]]:
        """Probe times per PS: PROBES trivial requests to every PS, spread over about half
        an interval (a PS stopped part of the time answers some of them late)."""
        times: dict[str, list[float]] = {p: [] for p in routing.ps_ids}
        # at random moments, each a random time after the previous probe came back: probes
        # at fixed times fell in step with a periodic stall (a CPU quota's 100 ms period,
        # a stop/continue duty cycle), and a probe due while one waited went out just as
        # the PS resumed; either way they found a PS stopped 70% of the time running
        gap = float(self.cfg.interval_seconds) / 2 / PROBES
        for _ in range(PROBES):
            if self._stop.wait(self._rng.uniform(0.0, 2 * gap)):
                break
            for p, address in zip(routing.ps_ids, routing.ps_addresses):
                try:
                    times[p].append(master.ps_probe_ms(address, timeout=2.0))
                except Exception:  # noqa: BLE001 - no answer in 2 s: as slow as that
                    times[p].append(2000.0)
        return times

    def _service_ms(self, now: float) -> dict[str, float]:
        """Each PS's service time (mean, or its probes' wait), the newest measured within
        the window: the inverse of its service rate. Each is pooled over a window already;
        averaging them again made the rate lag a second window behind."""
        out = {}
        for ps, q in self._ps_service.items():
            if q and now - q[-1][0] <= self.cfg.window_seconds:
                out[ps] = max(float(q[-1][1]), FLOOR_MS)
        return out

    def _act_on_ps(self, master, ps: str, now: float, first: bool) -> None:
        if self.cfg.dry_run or (self._actor is not None and self._actor.is_alive()):
            return
        routing = master.routing
        if routing is None or ps not in routing.ps_ids or ps in self._replaced:
            return
        service = self._service_ms(now)
        ids = list(routing.ps_ids)
        measured = {p: service.get(p, 0.0) for p in ids}
        weights = dict(zip(ids, capacity_weights(measured, ids, float(self.cfg.min_weight))))
        # unclamped (min_weight bounds the placement, not the verdict)
        rate = dict(zip(ids, service_rates(measured, ids))).get(ps, 1.0)
        detail = {"slow": ps, "service_rate": round(rate, 3)}
        if self.cfg.replace and (rate < self.cfg.replace_below or (
                ps in self._reweighted and now - self._reweighted[ps] >= self.cfg.window_seconds)):
            why = "below replace_below" if rate < self.cfg.replace_below else \
                "still slow a window after re-placement"
            self._replaced.add(ps)
            self._start(master, "replace", ps, dict(detail, reason=why))
        elif (self.cfg.reweight and ps not in self._reweighted
              and (first or now - self._noop_at.get(ps, -np.inf) >= self.cfg.window_seconds)):
            # on detection; again a window after a re-placement that moved nothing (its
            # service rates, read over the window, did not yet set it apart)
            self._reweighted[ps] = now
            self._start(master, "rebalance", ps, dict(detail, capacity_weights=weights),
                        weights)

    def _start(self, master, action: str, ps: str, detail: dict, weights=None) -> None:
        self._actor = threading.Thread(target=self._run_action,
                                       args=(master, action, ps, detail, weights),
                                       daemon=True, name=f"stragglers-{action}")
        self._actor.start()

    def _run_action(self, master, action: str, ps: str, detail: dict, weights) -> None:
        started = time.monotonic()
        try:
            if action == "rebalance":
                event = master.straggler_rebalance(weights, {"slow": ps})
                if event.get("moved_slots", 0):
                    self._reweighted[ps] = time.monotonic()  # the next window starts now
                else:  # nothing moved: its share was not cut, try again a window later
                    self._reweighted.pop(ps, None)
                    self._noop_at[ps] = time.monotonic()
            elif action == "retire_spare":
                event = master.retire_spare_ps(detail["spare_ids"], {"id": ps,
                                                                     "reason": detail["reason"]})
            elif action == "replace_worker":
                event = master.replace_worker(ps, dict(detail))
                # nor is its replacement replaced in turn: slow too, it points at the host
                self._replaced.add(event.get("new", ""))
            else:
                event = master.replace_ps(ps, {k: detail[k] for k in ("reason", "service_rate")
                                               if k in detail})
            ok = True
        except OperationRefused as exc:
            event, ok = {"reason": str(exc)}, False
            if action == "replace" or (action == "replace_worker" and isinstance(exc, Busy)):
                self._replaced.discard(ps)  # a worker's refusal for good is told once
            master.straggler_event("straggler_refused", action=action, id=ps, reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - reported, the detector goes on
            log.exception("stragglers: %s of %s failed", action, ps)
            event, ok = {"reason": f"{type(exc).__name__}: {exc}"}, False
            master.straggler_event("straggler_refused", action=action, id=ps,
                                reason=event["reason"])
        with self._lock:
            self.actions.append({"time": time.time(), "action": action, "id": ps, "ok": ok,
                                 "seconds": round(time.monotonic() - started, 3),
                                 "moved_slots": event.get("moved_slots")})

    def _report_hot_slot(self, master) -> None:
        """A slot carrying ``hot_slot_share`` of all lookups: reported once (placement
        moves whole slots and cannot spread it)."""
        stats = master.slot_stats()
        routing = master.routing
        if stats is None or routing is None:
            return
        lookups = stats[1].astype(np.float64)
        total = lookups.sum()
        if total <= 0:
            return
        slot = int(np.argmax(lookups))
        share = float(lookups[slot] / total)
        if share >= self.cfg.hot_slot_share and slot not in self._hot_reported:
            self._hot_reported.add(slot)
            owner = routing.ps_ids[int(routing.slot_owner[slot])]
            master.straggler_event("hot_slot", slot=slot, lookup_share=round(share, 4), ps=owner,
                                note="one slot's keys cannot be spread over PS by placement; "
                                     "see docs/guide-stragglers.md")

    # workers
    def _observe_workers(self, master, now: float) -> None:
        window = float(self.cfg.window_seconds)
        live = {m.id: m for m in master.live_workers()}
        for w in list(self._worker_samples):
            if w not in live:
                del self._worker_samples[w]
                self.worker_marks.forget(w)
        rates = {}
        for w, m in live.items():
            q = self._worker_samples.setdefault(w, deque())
            q.append((now, m.samples))
            while len(q) > 2 and now - q[1][0] >= window:
                q.popleft()
            if now - q[0][0] >= 0.8 * window:
                rates[w] = (q[-1][1] - q[0][1]) / (q[-1][0] - q[0][0])
        self._rates = rates
        if len(rates) < 2:
            return
        waiting = set(master.waiting_workers(2 * float(self.job.heartbeat_seconds) + 1))
        for w, (bad, detail) in worker_verdicts(rates, float(self.cfg.k)).items():
            if w in waiting:
                bad = None  # waiting for data is not being slow
            change = self.worker_marks.update(w, now, bad)
            if bad:
                self._details[w] = detail
            if change == "detected":
                master.straggler_event("straggler_detected", role="worker", id=w,
                                    window_seconds=self.cfg.window_seconds, **detail)
            elif change == "cleared":
                master.straggler_event("straggler_cleared", role="worker", id=w, **detail)
                self._details.pop(w, None)
            if bad and w in self.worker_marks.marked:
                self._act_on_worker(master, w, now, detail)

    def _act_on_worker(self, master, w: str, now: float, detail: dict) -> None:
        """A marked worker is replaced at once while data is left in TODO (no split can
        help then: splits only serve an idle worker at the tail) or when its records/s is
        below ``replace_below`` x the median; at the tail, when it is still slow a window
        after it was marked (a split of its shard did not make up for it). Each worker id
        at most once: a replacement that is slow too points at the host, not the worker."""
        if (not self.cfg.replace_workers or self.cfg.dry_run or w in self._replaced
                or (self._actor is not None and self._actor.is_alive())):
            return
        ratio = float(detail.get("ratio", 1.0))
        if ratio < self.cfg.replace_below:
            why = "below replace_below"
        elif master.shard_counts()["todo"]:
            why = "slow with data left to hand out"
        elif now - self.worker_marks.marked[w] >= self.cfg.window_seconds:
            why = "still slow a window after detection"
        else:
            return
        self._replaced.add(w)
        self._start(master, "replace_worker", w, {"reason": why, "ratio": ratio})

    def _steal(self, master) -> None:
        """An idle worker while another holds a shard: ask the holder to split it (the
        slowest holder first; never a faster worker's shard for a slower idle one)."""
        if master.shard_counts()["todo"]:
            return
        waiting = master.waiting_workers(1.5 * float(self.job.heartbeat_seconds) + 0.5)
        if not waiting:
            return
        holders = sorted(set(master.shards_doing().values()) - set(waiting))
        rates = self._rates
        idle = max(waiting, key=lambda w: rates.get(w, 0.0))
        # a peer as fast as the idle worker gains nothing from handing its rest over
        victims = [h for h in holders
                   if h in self.worker_marks.marked or idle not in rates or h not in rates
                   or rates[h] * STEAL_SPEEDUP < rates[idle]]
        if not victims:
            return
        victim = min(victims, key=lambda h: rates.get(h, 0.0))
        if master.request_split(victim, idle):
            log.info("stragglers: asking %s to split its shard for %s", victim, idle)


def create(config):
    return StragglerPlugin(config) if config.stragglers.enabled else None
