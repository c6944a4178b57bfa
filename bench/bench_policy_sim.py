"""Trace-driven simulation: allocated-but-idle resource-hours of a static maximum allocation
vs the autoscale policy (``aimaster/policy.py``, the same ``Policy`` and ``CostLedger`` the
AIMaster uses, driven by a simulated clock).

The job (documented model, all numbers are knobs below):

- **Demand trace.** An online-training job whose samples arrive at D(t) samples/s over
  ``--hours`` (default 48 h): a diurnal sine between 25% and 100% of ``--peak`` (low at
  04:00, high at 16:00), times bursts (Poisson, ``--bursts-per-day``, each +40..80% for
  10..60 min), times +-5% noise per 10 s step. Seeded: the same trace every run.
- **Capacity.** A worker trains ``WORKER_RATE`` samples/s on its 1 core; a PS serves
  ``PS_RATE`` samples/s on its 1 core. Throughput = min(workers x WORKER_RATE,
  PS x PS_RATE, demand + backlog). Unserved samples queue (backlog) and are trained later.
- **Use.** Worker CPU = throughput / WORKER_RATE cores; PS CPU = 0.05 cores each +
  throughput / PS_RATE. Memory: each PS holds its share of a table that grows with the
  samples trained (plus its ring peer's copy when there are >= 2 PS).
- **Scaler.** A new worker is running 30 s after it is asked for, a PS scale-out takes
  60 s, a scale-in 10 s; during ``--shortage`` windows no new node can be had (the policy's
  max wait gives up).

Static: ``--max-workers`` workers and ``--max-ps`` PS all the time (sized for the peak).
Ours: starts at 1 worker + 1 PS; the policy observes every 10 s and decides.

Idle = allocated core-seconds - used core-seconds (CostLedger), both roles. Throughput =
samples trained by the end of the trace. Prints both side by side and the ratios:

    .venv/bin/python bench/bench_policy_sim.py [--hours 48] [--json out.json]

Targets (issue 5): idle at least 42% lower, throughput at most 5% lower.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aimaster.policy import (CostLedger, Observation, Policy, PolicyConfig,  # noqa: E402
                             PSSample, WorkerSample)

STEP = 10.0            # simulated seconds per step (one observation per step)
WORKER_RATE = 1000.0   # samples/s one worker core trains
PS_RATE = 4000.0       # samples/s one PS core serves
GB = 1024 ** 3


def demand_trace(hours: float, peak: float, bursts_per_day: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(0, hours * 3600, STEP)
    day = (t % 86400) / 3600.0
    diurnal = 0.625 + 0.375 * np.sin(2 * np.pi * (day - 10.0) / 24.0)  # min 04:00, max 16:00
    burst = np.ones_like(t)
    n = rng.poisson(bursts_per_day * hours / 24.0)
    for start, dur, amp in zip(rng.uniform(0, t[-1], n), rng.uniform(600, 3600, n),
                               rng.uniform(0.4, 0.8, n)):
        burst[(t >= start) & (t < start + dur)] += amp
    noise = 1 + rng.uniform(-0.05, 0.05, t.size)
    return np.minimum(peak * diurnal * burst * noise, peak * 1.0)


class SimJob:
    """The simulated job and scaler; produces Observations like the AIMaster plugin does."""

    def __init__(self, workers: int, ps: int, memory_limit: int, shortages=()):
        self.w, self.ps = workers, ps
        self.backlog = 0.0
        self.trained = 0.0
        self.data_bytes = 0.2 * GB
        self.memory_limit = memory_limit
        self.w_cpu: dict[int, float] = {}
        self.w_samples: dict[int, float] = {}
        self.ps_cpu: dict[int, float] = {}
        self.pending: tuple[float, int | None, int | None] | None = None  # ready at, ps, w
        self.shortages = shortages
        self.peak_rss = 0.0

    def short(self, now):
        return any(a <= now < b for a, b in self.shortages)

    def request(self, now, ps, workers):
        grow = (ps or 0) > self.ps or (workers or 0) > self.w
        if grow and self.short(now):
            self.pending = (math.inf, ps, workers)  # never delivered: the policy gives up
            return
        delay = 60.0 if (ps or 0) > self.ps else 30.0 if grow else 10.0
        self.pending = (now + delay, ps, workers)

    def cancel(self):
        self.pending = None

    def step(self, now, demand):
        if self.pending and now >= self.pending[0]:
            _, ps, w = self.pending
            self.ps = ps if ps is not None else self.ps
            self.w = w if w is not None else self.w
            self.pending = None
        cap = min(self.w * WORKER_RATE, self.ps * PS_RATE)
        thr = min(cap, demand + self.backlog / STEP)
        self.backlog = max(0.0, self.backlog + (demand - thr) * STEP)
        self.trained += thr * STEP
        self.data_bytes += thr * STEP * 2.0  # new keys: ~2 bytes of table per sample trained
        for i in range(self.w):
            self.w_cpu[i] = self.w_cpu.get(i, 0.0) + thr / WORKER_RATE / self.w * STEP
            self.w_samples[i] = self.w_samples.get(i, 0.0) + thr / self.w * STEP
        for i in range(self.ps):
            self.ps_cpu[i] = self.ps_cpu.get(i, 0.0) + (0.05 + thr / PS_RATE / self.ps) * STEP
        return thr

    def observe(self, now) -> Observation:
        share = self.data_bytes / self.ps * (2 if self.ps >= 2 else 1)
        rss = int(0.3 * GB + share)
        self.peak_rss = max(self.peak_rss, rss)
        ps = tuple(PSSample(f"ps-{i}", rss, self.ps_cpu[i], self.memory_limit,
                            table_bytes=int(self.data_bytes / self.ps)) for i in range(self.ps))
        workers = tuple(WorkerSample(f"worker-{i}", int(self.w_samples[i]), self.w_cpu[i])
                        for i in range(self.w))
        # a backlog under one step of training is noise, not pending work
        pending = self.backlog if self.backlog > STEP * WORKER_RATE else 0.0
        return Observation(now, ps, workers, pending_work=pending)


def run(demand, policy_cfg: PolicyConfig | None, max_w: int, max_ps: int, memory_limit: int,
        shortages=()) -> dict:
    now = 0.0
    job = SimJob(1 if policy_cfg else max_w, 1 if policy_cfg else max_ps, memory_limit, shortages)
    ledger = CostLedger(policy_cfg or PolicyConfig())
    policy = Policy(policy_cfg, clock=lambda: now) if policy_cfg else None
    in_flight = None
    rules: dict[str, int] = {}
    sizes = []
    for d in demand:
        now += STEP
        job.step(now, d)
        obs = job.observe(now)
        ledger.add(obs)
        sizes.append((job.w, job.ps))
        if policy is None:
            continue
        if in_flight is not None and job.pending is None:  # the scaler delivered
            policy.finished(in_flight, ok=True, duration=30.0)
            in_flight = None
        policy.observe(obs)
        decision = policy.decide()
        if decision is None:
            continue
        rules[decision.rule] = rules.get(decision.rule, 0) + 1
        if in_flight is not None:   # a max-wait give-up/downgrade replaces the stuck request
            job.cancel()
            in_flight = None
        if decision.ps is None and decision.workers is None:
            continue
        if (decision.ps in (None, job.ps)) and (decision.workers in (None, job.w)):
            continue
        policy.started(decision)
        job.request(now, decision.ps, decision.workers)
        in_flight = decision
    cost = ledger.summary()
    alloc = sum(c["allocated_core_seconds"] for c in cost.values())
    used = sum(c["used_core_seconds"] for c in cost.values())
    ws = np.array(sizes)
    return {"trained": job.trained, "backlog_end": job.backlog, "demand_total": float(demand.sum() * STEP),
            "allocated_core_hours": alloc / 3600, "used_core_hours": used / 3600,
            "idle_core_hours": (alloc - used) / 3600, "cost": cost, "decisions": rules,
            "mean_workers": float(ws[:, 0].mean()), "mean_ps": float(ws[:, 1].mean()),
            "peak_rss_gb": job.peak_rss / GB}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hours", type=float, default=48.0)
    p.add_argument("--peak", type=float, default=7000.0, help="peak demand, samples/s")
    p.add_argument("--bursts-per-day", type=float, default=6.0)
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--max-ps", type=int, default=3)
    p.add_argument("--memory-limit-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    demand = demand_trace(args.hours, args.peak, args.bursts_per_day, args.seed)
    limit = int(args.memory_limit_gb * GB)
    cfg = PolicyConfig(ps_min=1, ps_max=args.max_ps, worker_min=1, worker_max=args.max_workers,
                       interval_seconds=STEP, cooldown_seconds=60, settle_seconds=10,
                       measure_seconds=30, window_seconds=60, max_wait_seconds=300,
                       lead_seconds=60, ps_memory_limit_bytes=limit, ps_cpu_high=0.9,
                       ps_cpu_low=0.3, worker_util_low=0.75,
                       explore_ttl_seconds=900, scale_out_reserve=0.5)
    # two 45-minute windows in which no new node can be had (exercises the max wait)
    h = 3600.0
    shortages = ((14 * h, 14.75 * h), (38 * h, 38.75 * h))
    static = run(demand, None, args.max_workers, args.max_ps, limit)
    ours = run(demand, cfg, args.max_workers, args.max_ps, limit, shortages)
    print(f"trace: {args.hours:.0f} h, demand {demand.min():.0f}..{demand.max():.0f} samples/s "
          f"(mean {demand.mean():.0f}), {len(demand)} steps of {STEP:.0f} s")
    print(f"{'':24}{'static max':>14}{'autoscale':>14}{'ratio':>9}")
    rows = [("workers (mean)", "mean_workers"), ("PS (mean)", "mean_ps"),
            ("allocated core-hours", "allocated_core_hours"), ("used core-hours", "used_core_hours"),
            ("idle core-hours", "idle_core_hours"), ("samples trained", "trained"),
            ("backlog at end", "backlog_end"), ("peak PS RSS (GB)", "peak_rss_gb")]
    for label, key in rows:
        a, b = static[key], ours[key]
        print(f"{label:24}{a:14,.1f}{b:14,.1f}{(b / a if a else float('nan')):9.3f}")
    less_idle = 1 - ours["idle_core_hours"] / static["idle_core_hours"]
    less_thr = 1 - ours["trained"] / static["trained"]
    print(f"decisions: {ours['decisions']}")
    print(f"idle resource-hours: {less_idle:.1%} less (target >= 42%): "
          f"{'PASS' if less_idle >= 0.42 else 'MISS'}")
    print(f"throughput: {less_thr:.2%} less (target <= 5%): {'PASS' if less_thr <= 0.05 else 'MISS'}")
    print(f"PS memory: peak {ours['peak_rss_gb']:.2f} GB of {args.memory_limit_gb:.1f} GB limit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"static": static, "autoscale": ours, "less_idle": less_idle,
                       "less_throughput": less_thr, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
