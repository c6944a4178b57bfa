"""Resource-fit under admission and eviction: the growth of a table whose eviction has begun
stops at its plateau; admission candidates keep growing. Pure decisions, a fake clock."""
from __future__ import annotations

import math

import pytest

from aimaster.policy import (CANDIDATE_BYTES, MiB, Observation, Policy, PolicyConfig, PSSample,
                             TableSample, _seconds_left, memory_forecasts, table_growth)

LIMIT = 1000 * MiB  # budget 800 MiB at headroom 0.2


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def policy(clock):
    cfg = PolicyConfig(ps_min=1, ps_max=4, worker_min=0, worker_max=4, interval_seconds=1.0,
                       cooldown_seconds=20.0, settle_seconds=2.0, measure_seconds=8.0,
                       window_seconds=10.0, max_wait_seconds=30.0, lead_seconds=10.0,
                       performance_fit=False, scale_out_reserve=0.0)
    return Policy(cfg, clock=clock)


def stream(rows_in: float, evicted_out: float, candidates_in: float = 0.0,
           rss_mb: float = 650.0, rss_rate_mb: float = 10.0, t0: float = 1000.0):
    """A one-PS job at second t: ``rows_in`` new rows/s, ``evicted_out`` of them evicted/s
    (0: no eviction), candidates arriving at ``candidates_in``/s; 100 B a row."""
    def make(t):
        dt = t - t0
        rows = int(2_000_000 + (rows_in - evicted_out) * dt)
        evicted = int(5_000 + evicted_out * dt) if evicted_out else 0
        cand = int(candidates_in * dt)
        table = TableSample("emb", rows, 100 * rows + CANDIDATE_BYTES * cand, evicted, cand)
        ps = PSSample("ps-0", int((rss_mb + rss_rate_mb * dt) * MiB), 0.0, LIMIT, rows=rows,
                      table_bytes=table.bytes, tables=(table,))
        return Observation(t, (ps,), ())
    return make


def run(make, seconds=10):
    clock = FakeClock()
    p = policy(clock)
    for _ in range(seconds):
        clock.t += 1
        p.observe(make(clock.t))
        d = p.decide()
        if d is not None:
            return p, d
    return p, None


def test_table_growth_from_counters():
    make = stream(rows_in=1_000_000, evicted_out=900_000)
    g = table_growth(make(1000).ps[0], make(1010).ps[0], 10.0)
    # net 100,000 rows/s x 100 B; in 1.0M/s vs out 0.9M/s: 1/0.9 - 1 = 11.1 % more rows
    assert g.bounded == pytest.approx(10_000_000) and g.unbounded == 0
    assert g.cap == pytest.approx((1 / 0.9 - 1) * 3_000_000 * 100, rel=1e-6)
    # no eviction yet: the same net growth has no end in sight
    make = stream(rows_in=100_000, evicted_out=0)
    g = table_growth(make(1000).ps[0], make(1010).ps[0], 10.0)
    assert (g.unbounded, g.bounded, g.cap) == (pytest.approx(10_000_000), 0.0, 0.0)
    # at the plateau (out == in) nothing is left to grow; candidates always count
    make = stream(rows_in=500_000, evicted_out=500_000, candidates_in=20_000)
    g = table_growth(make(1000).ps[0], make(1010).ps[0], 10.0)
    assert g.bounded == 0 and g.cap == 0 and g.unbounded == pytest.approx(20_000 * CANDIDATE_BYTES)


def test_seconds_left_piecewise():
    assert _seconds_left(100, 10, 0, math.inf) == 10
    assert _seconds_left(100, 10, 8, 24) == 3 + (100 - 30) / 2  # bounded part stops at 3 s
    assert _seconds_left(100, 10, 10, 24) == math.inf          # all of it stops
    assert _seconds_left(100, 10, 10, 500) == 10                # stops too late
    assert _seconds_left(0, 10, 0, math.inf) == 0


def test_without_eviction_memory_growth_scales_out():
    # 650 MiB growing 10 MiB/s: within the lead (11 s) of the 800 MiB budget from 690 MiB
    p, d = run(stream(rows_in=100_000, evicted_out=0))
    assert d is not None and d.rule == "resource-fit" and d.ps >= 2, d
    assert d.details["bounded_rate_bytes_per_s"] == 0


def test_eviction_bounds_growth_no_scale_out():
    # the same RSS rise, but eviction runs: rows enter at 1.0M/s and leave at 0.9M/s, so
    # the live set can add ~11 % (about 33 MiB) before its plateau: it fits in the 50 MiB
    # left after 10 s
    p, d = run(stream(rows_in=1_000_000, evicted_out=900_000))
    assert d is None
    fc = memory_forecasts(p.history, 0, p.cfg, 0.0, p.lead_time())[0]
    assert fc.bounded_rate_bytes_per_s == pytest.approx(fc.rate_bytes_per_s, rel=1e-3)
    assert 30 * MiB < fc.bounded_cap_bytes < 40 * MiB and math.isinf(fc.seconds_left)
    st = p.status()["memory"][0]
    assert st["bounded_cap_mb"] == pytest.approx(fc.bounded_cap_bytes / MiB, abs=0.1)


def test_eviction_far_from_plateau_still_scales_out():
    # eviction has begun but rows enter 10x faster than they leave: the cap (a doubling)
    # lies beyond the budget, so the growth still counts
    p, d = run(stream(rows_in=1_000_000, evicted_out=100_000, rss_rate_mb=10.0))
    assert d is not None and d.ps >= 2 and "under eviction" in d.reason, d


def test_admission_candidates_count_as_growth():
    # rows at their plateau, but exact counters for new ids keep arriving (never evicted):
    # the RSS rise is theirs and it does not stop
    p, d = run(stream(rows_in=500_000, evicted_out=500_000, candidates_in=150_000))
    assert d is not None and d.rule == "resource-fit" and d.ps >= 2, d


def test_rss_slope_left_from_filling_the_window_is_not_extrapolated():
    # the window filled from 600 to 750 MiB in 3 s, then eviction keeps pace: the RSS fit
    # still spans the fill, but the tables' counters show no growth any more
    def make(t, counters=True):
        dt = t - 1000
        rows = 2_000_000 + 300_000 * min(dt, 3)
        evicted = 0 if dt <= 3 else 300_000 * (dt - 3)
        table = TableSample("emb", rows, 100 * rows, evicted, 0)
        rss = int((600 + 50 * min(dt, 3)) * MiB)
        ps = (PSSample("ps-0", rss, 0.0, LIMIT, rows, table.bytes, (table,)) if counters
              else PSSample("ps-0", rss, 0.0, LIMIT))
        return Observation(t, (ps,), ())

    def decisions(counters):
        clock = FakeClock(1000.0)
        p = policy(clock)
        out = []
        for dt in range(0, 12):
            clock.t = 1000.0 + dt
            p.observe(make(clock.t, counters))
            if dt >= 6:  # the fill is over (decisions during it are another matter)
                out.append(p.decide())
        return p, [d for d in out if d is not None]

    p, ds = decisions(True)
    assert ds == []
    fc = memory_forecasts(p.history, 0, p.cfg, 0.0, p.lead_time())[0]
    assert fc.rate_bytes_per_s > 5 * MiB and fc.bounded_cap_bytes == 0
    # without table counters the same RSS curve reads as growth and scales out
    _, ds = decisions(False)
    assert ds and ds[0].rule == "resource-fit" and ds[0].ps >= 2


def test_steps_to_live_bounds_growth_before_the_first_eviction():
    # 100,000 rows/s enter, none evicted yet; 20 pushes/s and steps_to_live 100: a row
    # lives 5 s + the 1 s eviction interval, so at most 600,000 rows are ever live
    def sample(t, rows, pushes, stl):
        table = TableSample("emb", rows, 100 * rows, 0, 0, stl, 1.0 if stl else 0.0)
        return PSSample("ps-0", 0, 0.0, LIMIT, rows, table.bytes, (table,), pushes)
    g = table_growth(sample(0, 200_000, 0, 100), sample(2, 400_000, 40, 100), 2.0)
    assert g.evicting and g.unbounded == 0 and g.bounded == pytest.approx(10_000_000)
    assert g.cap == pytest.approx((600_000 - 400_000) * 100)
    # without the spec (or without pushes to count steps) the same rows grow without end
    g = table_growth(sample(0, 200_000, 0, 0), sample(2, 400_000, 40, 0), 2.0)
    assert not g.evicting and g.unbounded == pytest.approx(10_000_000)
    g = table_growth(sample(0, 200_000, 0, 100), sample(2, 400_000, 0, 100), 2.0)
    assert not g.evicting
