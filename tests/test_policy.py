"""The auto-scaling policy's decision functions, driven by a fake clock."""
from __future__ import annotations

import math

import pytest

from aimaster.config import ConfigError, parse_job
from aimaster.policy import (MiB, CostLedger, Observation, Policy, PolicyConfig, PolicyError,
                             PSSample, WorkerSample, memory_forecasts, slope)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def obs(t, ps_rss, ps_cpu=None, samples=(), worker_cpu=None, limit_mb=100, pending=10.0,
        ps_target=None, worker_target=None, table_bytes=0):
    """ps_rss: MiB per PS; ps_cpu / worker_cpu: cumulative CPU seconds per member."""
    ps_cpu = ps_cpu or [0.0] * len(ps_rss)
    ps = tuple(PSSample(f"ps-{i}", int(r * MiB), c, int(limit_mb * MiB), rows=0,
                        table_bytes=table_bytes) for i, (r, c) in enumerate(zip(ps_rss, ps_cpu)))
    workers = tuple(WorkerSample(f"worker-{i}", int(s),
                                 None if worker_cpu is None else worker_cpu[i])
                    for i, s in enumerate(samples))
    return Observation(t, ps, workers, pending, ps_target, worker_target)


def policy(clock, **kw):
    base = dict(ps_min=1, ps_max=4, worker_min=1, worker_max=4, interval_seconds=1.0,
                cooldown_seconds=20.0, settle_seconds=2.0, measure_seconds=8.0,
                window_seconds=10.0, max_wait_seconds=30.0, lead_seconds=10.0,
                performance_fit=False, scale_out_reserve=0.0)
    base.update(kw)
    return Policy(PolicyConfig(**base), clock=clock)


def feed(p, clock, seconds, make):
    """One observation per second for ``seconds``; returns the first decision, if any."""
    for _ in range(seconds):
        clock.t += 1
        p.observe(make(clock.t))
        d = p.decide()
        if d is not None:
            return d
    return None


def test_slope_needs_three_points():
    assert slope([0, 1], [0, 5]) is None
    assert slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2.0)
    assert slope([1, 1, 1], [1, 2, 3]) is None


def test_config_is_validated():
    with pytest.raises(PolicyError, match="recovery"):
        PolicyConfig(recovery="maybe").validate()
    with pytest.raises(PolicyError, match="ps bounds"):
        PolicyConfig(ps_min=3, ps_max=2).validate()
    with pytest.raises(PolicyError, match="memory_headroom"):
        PolicyConfig(memory_headroom=1.0).validate()
    with pytest.raises(PolicyError, match="measure_seconds"):
        PolicyConfig(measure_seconds=60, window_seconds=30).validate()


def test_job_file_autoscale_section():
    cfg = parse_job({"ps": {"replicas": 1, "max_replicas": 3},
                     "autoscale": {"enabled": True, "ps_memory_limit_mb": 256,
                                   "recovery": "wait", "cooldown_seconds": 5}})
    a = cfg.autoscale
    assert a.enabled and a.ps_memory_limit_mb == 256 and a.recovery == "wait"
    pc = a.policy_config(cfg)
    assert pc.ps_max == 3 and pc.ps_memory_limit_bytes == 256 * MiB and pc.cooldown_seconds == 5
    for bad, msg in (({"recovery": "retry"}, "autoscale.recovery"),
                     ({"bogus": 1}, "unknown key"),
                     ({"memory_headroom": 1.5}, "autoscale.memory_headroom"),
                     ({"ps_memory_limit_mb": -1}, "autoscale.ps_memory_limit_mb"),
                     ({"interval_seconds": 0}, "autoscale.interval_seconds")):
        with pytest.raises(ConfigError, match=msg):
            parse_job({"autoscale": {"enabled": True, **bad}})


# -- resource-fit ---------------------------------------------------------------------------
def test_resource_fit_scales_out_before_the_limit():
    clock = FakeClock()
    p = policy(clock)
    # 2 MiB/s of growth on a 100 MiB limit with 20% headroom: budget 80 MiB
    start = clock.t
    d = feed(p, clock, 40, lambda t: obs(t, [30 + 2 * (t - start)]))
    assert d is not None and d.rule == "resource-fit" and d.ps >= 2
    t_decided = clock.t - start
    rss_at_decision = 30 + 2 * t_decided
    # decided once the budget (80 MiB) is within the lead time (10 s + 1 s interval) at
    # 2 MiB/s, and within one observation of that moment: not earlier, not too late
    seconds_left = (80 - rss_at_decision) / 2
    assert p.lead_time() - 1.0 <= seconds_left <= p.lead_time()
    assert "ps-0" in d.reason and "lead" in d.reason
    # one PS growing alone: the new count keeps it under budget for the horizon
    assert d.details["ps_id"] == "ps-0"


def test_resource_fit_ignores_flat_memory_and_sizes_for_fast_growth():
    clock = FakeClock()
    p = policy(clock)
    assert feed(p, clock, 30, lambda t: obs(t, [70, 60])) is None  # high but flat
    clock2 = FakeClock()
    p2 = policy(clock2, ps_max=8)
    s = clock2.t
    d = feed(p2, clock2, 40, lambda t: obs(t, [20 + 3 * (t - s), 20 + 3 * (t - s)]))
    assert d.rule == "resource-fit" and d.ps > 3  # fast growth on 2 PS needs more than +1


def test_resource_fit_at_max_alerts_without_scaling():
    clock = FakeClock()
    p = policy(clock, ps_max=1)
    s = clock.t
    d = feed(p, clock, 40, lambda t: obs(t, [30 + 2 * (t - s)]))
    assert d.rule == "resource-fit" and d.ps is None and d.workers is None
    assert "max_replicas" in d.reason


def test_rate_resets_after_a_ps_change():
    clock = FakeClock()
    p = policy(clock)
    s = clock.t
    d = feed(p, clock, 40, lambda t: obs(t, [30 + 2 * (t - s)]))
    p.started(d)
    clock.t += 5
    assert p.finished(d, ok=True, duration=5.0) is None
    # after the scale-out the old PS no longer grows; only fresh samples count
    level = 30 + 2 * (clock.t - 5 - s)
    assert feed(p, clock, 20, lambda t: obs(t, [level, 20])) is None
    fc = memory_forecasts(p.history, p.last_ps_change, p.cfg)
    assert fc[0].rate_bytes_per_s == pytest.approx(0.0, abs=1.0)


def test_lead_time_learns_from_slow_scale_outs():
    clock = FakeClock()
    p = policy(clock)
    assert p.lead_time() == pytest.approx(11.0)
    s = clock.t
    d = feed(p, clock, 40, lambda t: obs(t, [30 + 2 * (t - s)]))
    p.started(d)
    p.finished(d, ok=True, duration=20.0)
    assert p.lead_time() == pytest.approx(31.0)


# -- performance-fit --------------------------------------------------------------------------
def perf_policy(clock, **kw):
    return policy(clock, performance_fit=True, resource_fit=False, **kw)


def run_size(p, clock, seconds, rate, ps_util, n_ps, n_w, pending=10.0, w_util=None, state=None):
    """Feed a steady job: ``rate`` samples/s in total, PS CPU at ``ps_util`` cores each."""
    state = state if state is not None else {"samples": 0.0, "ps_cpu": 0.0, "w_cpu": 0.0}
    for _ in range(seconds):
        clock.t += 1
        state["samples"] += rate
        state["ps_cpu"] += ps_util
        state["w_cpu"] += w_util or 0.0
        per = state["samples"] / n_w if n_w else 0
        p.observe(obs(clock.t, [10] * n_ps, [state["ps_cpu"]] * n_ps, [per] * n_w,
                      None if w_util is None else [state["w_cpu"]] * n_w, pending=pending))
        d = p.decide()
        if d is not None:
            return d, state
    return None, state


def apply(p, clock, d):
    p.started(d)
    clock.t += 1
    assert p.finished(d, ok=True, duration=1.0) is None


def test_adds_workers_while_they_pay_and_reverts_one_that_does_not():
    clock = FakeClock()
    p = perf_policy(clock)
    d, st = run_size(p, clock, 40, 1000, 0.3, 1, 1)
    assert d.rule == "performance-fit" and d.workers == 2 and "add 1 worker(s)" in d.reason
    apply(p, clock, d)
    d, st = run_size(p, clock, 40, 1900, 0.5, 1, 2, state=st)  # +900 on 1 core: pays
    assert d is not None and d.workers == 3
    apply(p, clock, d)
    d, st = run_size(p, clock, 40, 2000, 0.6, 1, 3, state=st)  # +100: does not pay
    assert d.workers == 2 and "did not pay" in d.reason and d.details["trial"] == "revert"
    apply(p, clock, d)
    d, st = run_size(p, clock, 60, 1900, 0.5, 1, 2, state=st)
    assert d is None  # 3 workers are rejected; nothing else to do
    assert "ps=1,workers=3" in p.status()["rejected"]


def test_cooldown_blocks_performance_changes():
    clock = FakeClock()
    p = perf_policy(clock, cooldown_seconds=30.0)
    d, st = run_size(p, clock, 40, 1000, 0.3, 1, 1)
    apply(p, clock, d)
    t0 = clock.t
    d, st = run_size(p, clock, 40, 2000, 0.3, 1, 2, state=st)
    assert d is not None and clock.t - t0 >= 30


def test_adds_ps_when_ps_cpu_saturates_and_respects_max():
    clock = FakeClock()
    p = perf_policy(clock, ps_max=2)
    d, st = run_size(p, clock, 40, 1000, 0.95, 1, 2)
    assert d.ps == 2 and "PS CPU saturated" in d.reason
    apply(p, clock, d)
    d, st = run_size(p, clock, 40, 2000, 0.9, 2, 2, state=st)
    assert d is None or d.ps is None  # ps_max reached: never 3
    assert d is None or "add a PS" not in d.reason


def test_no_worker_added_without_pending_work_and_idle_workers_removed():
    clock = FakeClock()
    p = perf_policy(clock)
    d, _ = run_size(p, clock, 40, 1000, 0.3, 1, 3, pending=0, w_util=0.2)
    assert d.workers == 2 and "idle" in d.reason  # ceil(3 x 0.2 / 0.5) = 2
    clock2 = FakeClock()
    p2 = perf_policy(clock2, worker_max=8)
    d, _ = run_size(p2, clock2, 40, 1000, 0.3, 1, 1, pending=0, w_util=0.9)
    assert d is None


def test_removes_idle_ps_only_when_memory_fits():
    clock = FakeClock()
    p = perf_policy(clock)
    d, _ = run_size(p, clock, 40, 1000, 0.05, 2, 4, pending=0)
    assert d.ps == 1 and "remove a PS" in d.reason
    # same job, but the PS are full: keeping them is what pays
    clock2 = FakeClock()
    p2 = perf_policy(clock2)
    st = {"samples": 0.0, "ps_cpu": 0.0, "w_cpu": 0.0}
    for _ in range(40):
        clock2.t += 1
        st["samples"] += 1000
        st["ps_cpu"] += 0.05
        p2.observe(obs(clock2.t, [60, 60], [st["ps_cpu"]] * 2, [st["samples"] / 4] * 4, pending=0,
                       table_bytes=40 * MiB))
        assert p2.decide() is None


def test_bounds_min_max_are_kept():
    clock = FakeClock()
    p = perf_policy(clock, worker_max=1)
    d, _ = run_size(p, clock, 60, 1000, 0.3, 1, 1)
    assert d is None  # would add a worker, but max is 1
    clock2 = FakeClock()
    p2 = perf_policy(clock2, worker_min=3)
    d, _ = run_size(p2, clock2, 60, 1000, 0.3, 1, 3, pending=0, w_util=0.1)
    assert d is None  # idle, but already at min


# -- max wait -----------------------------------------------------------------------------------
def test_max_wait_downgrades_then_gives_up():
    clock = FakeClock()
    p = policy(clock, ps_max=8)
    s = clock.t
    grow = lambda t: obs(t, [20 + 3 * (t - s), 20 + 3 * (t - s)])  # noqa: E731
    d = feed(p, clock, 40, grow)
    assert d.ps > 3
    p.started(d)
    # the scaler cannot deliver: nothing changes for max_wait
    assert feed(p, clock, 29, lambda t: obs(t, [60, 60])) is None
    d2 = feed(p, clock, 2, lambda t: obs(t, [60, 60]))
    assert d2.rule == "max-wait" and d2.ps == 3 and d2.details["downgraded"]
    p.started(d2)
    d3 = feed(p, clock, 31, lambda t: obs(t, [60, 60]))
    assert d3.rule == "max-wait" and d3.details["gave_up"] and d3.ps == 2
    # and no new scale-out is asked for while resources are known to be short
    d4 = feed(p, clock, 5, lambda t: obs(t, [75, 75]))
    assert d4 is None or (d4.ps is None and "unavailable" in d4.reason)


def test_scale_failure_reported_by_the_scaler_gives_up():
    clock = FakeClock()
    p = policy(clock)
    s = clock.t
    d = feed(p, clock, 40, lambda t: obs(t, [30 + 2 * (t - s)]))
    p.started(d)
    follow = p.finished(d, ok=False)
    assert follow.rule == "max-wait" and p.pending is None


# -- recovery ------------------------------------------------------------------------------------
def test_recovery_continue_accepts_reduced_size_after_the_wait():
    clock = FakeClock()
    p = policy(clock, recovery="continue")
    short = lambda t: obs(t, [10, 10], samples=[0], ps_target=2, worker_target=2)  # noqa: E731
    assert feed(p, clock, 29, short) is None  # the master gets max_wait to replace it
    d = feed(p, clock, 3, short)
    assert d.rule == "recovery" and d.workers == 1 and d.ps is None
    assert d.details["strategy"] == "continue"


def test_recovery_wait_keeps_full_size_and_blocks_other_rules():
    clock = FakeClock()
    p = policy(clock, recovery="wait", performance_fit=True)
    s = clock.t
    # memory grows while a worker is missing: under `wait` nothing but recovery happens
    short = lambda t: obs(t, [30 + 2 * (t - s)], samples=[0], ps_target=1, worker_target=2)  # noqa
    d = feed(p, clock, 31, short)
    assert d.rule == "recovery" and d.workers == 2 and d.details["strategy"] == "wait"
    assert feed(p, clock, 25, short) is None  # asks again only after another max_wait
    d = feed(p, clock, 10, short)
    assert d.rule == "recovery" and d.workers == 2


def test_recovery_clears_when_size_is_back():
    clock = FakeClock()
    p = policy(clock, recovery="continue")
    feed(p, clock, 10, lambda t: obs(t, [10], samples=[0], ps_target=1, worker_target=2))
    assert p.shortfall_since is not None
    feed(p, clock, 1, lambda t: obs(t, [10], samples=[0, 0], ps_target=1, worker_target=2))
    assert p.shortfall_since is None


# -- cost accounting -------------------------------------------------------------------------------
def test_cost_ledger_allocated_vs_used():
    cfg = PolicyConfig(ps_cores=2.0, worker_cores=1.0, worker_memory_bytes=2 * 1024 ** 3)
    ledger = CostLedger(cfg)
    gb = 1024 ** 3
    a = Observation(0.0, (PSSample("ps-0", gb, 10.0, 4 * gb),),
                    (WorkerSample("worker-0", 0, 5.0, gb), WorkerSample("worker-1", 0, 1.0, gb)))
    b = Observation(10.0, (PSSample("ps-0", gb, 15.0, 4 * gb),),
                    (WorkerSample("worker-0", 0, 13.0, gb), WorkerSample("worker-1", 0, 3.0, gb)))
    # worker-1 restarted: its CPU counter went back to 0.5
    c = Observation(20.0, (PSSample("ps-0", 2 * gb, 20.0, 4 * gb),),
                    (WorkerSample("worker-0", 0, 21.0, gb), WorkerSample("worker-1", 0, 0.5, gb)))
    for o in (a, b, c):
        ledger.add(o)
    s = ledger.summary()
    assert s["ps"]["allocated_core_seconds"] == 40.0       # 1 PS x 2 cores x 20 s
    assert s["ps"]["used_core_seconds"] == 10.0
    assert s["ps"]["idle_core_seconds"] == 30.0
    assert s["ps"]["cpu_efficiency"] == 0.25
    assert s["ps"]["allocated_gb_seconds"] == 80.0         # 4 GB x 20 s
    assert s["ps"]["used_gb_seconds"] == 20.0              # 1 GB x 10 s + 1 GB x 10 s (left sums)
    assert s["worker"]["allocated_core_seconds"] == 40.0   # 2 x 1 core x 20 s
    assert s["worker"]["used_core_seconds"] == 8 + 2 + 8 + 0.5
    assert s["worker"]["allocated_gb_seconds"] == 80.0
    assert s["worker"]["replica_seconds"] == 40.0


def test_observations_must_move_forward():
    clock = FakeClock()
    p = policy(clock)
    p.observe(obs(10.0, [10]))
    with pytest.raises(PolicyError, match="older"):
        p.observe(obs(9.0, [10]))
    assert math.isinf(memory_forecasts(p.history, 0, p.cfg)[0].seconds_left)


def test_recovery_continue_is_not_repeated_for_the_same_target():
    clock = FakeClock()
    p = policy(clock, recovery="continue")
    short = lambda t: obs(t, [10], samples=[0], ps_target=1, worker_target=2)  # noqa: E731
    d = feed(p, clock, 32, short)
    assert d.rule == "recovery"
    assert feed(p, clock, 100, short) is None  # the reduced size is the size now
    # the job's target changes (e.g. a later scale-out): shortfalls count again
    d = feed(p, clock, 40, lambda t: obs(t, [10], samples=[0], ps_target=1, worker_target=3))
    assert d is not None and d.rule == "recovery"


def test_reserve_for_the_scale_out_moves_the_trigger_earlier_and_is_learned():
    def run(factor):
        clock = FakeClock()
        p = policy(clock, scale_out_reserve=factor)
        s = clock.t
        # the bare process is 30 MiB; 1 MiB/s of data on top
        d = feed(p, clock, 60, lambda t: obs(t, [30 + 1 * (t - s)]))
        return d, clock.t - s, p, clock
    d0, t0, _, _ = run(0.0)
    d1, t1, p, clock = run(1.0)  # as much free as the data: budget 80 = 30 + 2 x data + lead
    assert d0.rule == d1.rule == "resource-fit"
    assert t0 == pytest.approx(50 - p.lead_time(), abs=1.5)
    assert t1 == pytest.approx((50 - p.lead_time()) / 2, abs=1.5)
    assert d1.details["reserve_bytes"] == pytest.approx(t1 * MiB, rel=0.1) and "keeping" in d1.reason
    # the scale-out then costs the source 3x its data: learned
    p.started(d1)
    rss = 30 + t1
    p.observe(obs(clock.t + 1, [rss + 3 * t1]))
    assert p.reserve_factor == pytest.approx(3.0, rel=0.1)
    p.finished(d1, ok=True, duration=2.0)
    assert p.status()["reserve_factor"] == pytest.approx(3.0, rel=0.1)
