"""A scaling model of ours (issue 16, item 6): throughput of W workers and P PS on N-core
machines with a given network bandwidth, from costs measured on real jobs here.

    # measure the costs on real jobs, fit, and compare predicted with measured samples/s
    .venv/bin/python bench/scaling_model.py validate --repeat 3 \\
        --out bench/results/scaling-model.json
    # predictions for clusters we cannot run here, from the costs in that file
    .venv/bin/python bench/scaling_model.py predict bench/results/scaling-model.json \\
        --workers 8,32,128 --cores 16 --gbit 10,25
    # fit again from the stored runs (e.g. another calibration set)
    .venv/bin/python bench/scaling_model.py refit bench/results/scaling-model.json

What is measured (``measure``: one real ``aimaster run`` of the example DeepFM, the job
of ``bench/bench_training.py``, with a sampler polling every process of the job):

- CPU seconds of every worker, PS and the AIMaster (``psutil`` ``cpu_times`` user +
  system of the real processes: robust to the machine's noise, unlike wall time);
- RPCs and bytes of every PS (the Gazer counters each PS keeps per method,
  ``deeprec_ext/stats.py``: serialized request and response bytes), read from the
  AIMaster's Gazer snapshot;
- the steady-state window and its samples (``bench_training.steady_rate``); every
  counter above is interpolated to the window's ends, so start-up, tracing and the
  end of the job are excluded;
- the machine's background: cores busy over 3 s right before and after the job.

The model -- every cost per training sample; B = batch, q = 2 P / B the RPCs per sample
of a worker (one lookup and one push per PS per step):

    worker CPU           c_w(P)  = w0 + wr q          client work + a cost per RPC sent
    PS CPU, all PS       c_ps(P) = k  + r q           keys (split 1/P) + a cost per RPC
                                 + rep_cpu (P > 1)    the ring's replication, off the path
    bytes, at a worker   b(P)    = b0 + br q          lookups and pushes, both directions
    replication bytes    rep     per sample, PS to PS (P > 1)
    AIMaster             master  cores per member

``fit`` takes w0, wr, k, r from runs without replication (1+1 and 1+2 with shipping
deferred, ``:norep``), rep_cpu from the 1+2 runs above that line, bytes from all runs.
No measured rate goes into the costs.

Throughput: each worker is a customer of a closed queueing network that loops over one
step (``mva``: exact mean-value analysis, multi-server stations by Seidmann's
approximation). Since the next batch's rows are fetched while a step trains and the push
stays in flight (``Costs.overlap``, the Keras default), a step's calls overlap its
worker's CPU: on one machine the PS' work takes cores beside the steps, on a cluster a
step lasts the longer of the worker's CPU and its round trip (``mva_overlapped``). With
``overlap=False`` (waited pushes, no rows ahead) a step is the chain below:

- one machine (``shared``, the validation here): the step's whole CPU work B (c_w + c_ps
  without replication) queues at one station of N cores, minus what the replication and
  the AIMaster take beside the steps; other programs wanting D cores slow the job by
  N / (J + D) when the job's J and D exceed N;
- a cluster: a worker's CPU is its own (a delay of B c_w / n_w), then the network (a
  round trip and B b / 2 bytes at the NIC's bandwidth), then the PS: a station of
  n_ps cores per PS with demand B c_ps / P per step, minus the replication's share;
  bounded by the NICs (worker: W bw / (b / 2); PS: P bw / (b / 2 + rep)) and by the
  cores a process can use (n_w, n_ps: 1 by default, a GIL-bound Python process).

What it ignores: stragglers (every worker as fast as the median), PS hot keys (keys
split evenly; a skew makes the busiest PS the bound), the fork-join wait of a step for
the slowest of its P PS, sync mode (async only: ``consistency: sync`` adds a barrier),
the AIMaster beyond its CPU, input I/O (local files, parsed on the worker's CPU, which
c_w includes), TCP/gRPC flow control, processes packed on one machine in a cluster, and
that w0, wr, k, r are lines through P = 1 and 2 only: far beyond, they are extrapolated.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TARGET_ERROR = 0.20
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (workers, ps) this machine can run


# ----------------------------------------------------------------------------------------
# the model (pure arithmetic; tests/test_scaling_model.py)
# ----------------------------------------------------------------------------------------

@dataclass
class Costs:
    """Per-sample costs, fitted from measured runs (``fit``)."""
    batch: int
    w0: float            # worker CPU s/sample, independent of P
    wr: float            # worker CPU s per RPC it sends
    k: float             # PS CPU s/sample summed over all PS (keys: split 1/P)
    r: float             # PS CPU s per RPC served
    b0: float            # bytes/sample on the wire at a worker (request + response)
    br: float            # bytes per RPC (headers, per-table framing)
    rep: float = 0.0     # replication bytes/sample between PS (ring), 0 with one PS
    rep_cpu: float = 0.0  # PS CPU s/sample (all PS) of the ring replication, P > 1 only
    master: float = 0.0  # AIMaster cores per member (W + P)
    rpcs_per_step_per_ps: int = 2
    n_w: float = 1.0     # cores one worker process can use (Python + GIL: about 1)
    n_ps: float = 1.0    # cores one PS process can use (gRPC-Python handlers: about 1)
    rtt_s: float = 100e-6  # network round trip on a cluster; 0 on one machine
    # the step's calls overlap the worker's CPU (the next batch's rows fetched ahead, the
    # push in flight: ElasticCallback's default since 2026-11-28); False: one serial chain
    overlap: bool = True

    def q(self, p: int) -> float:
        return self.rpcs_per_step_per_ps * p / self.batch

    def c_w(self, p: int) -> float:
        return self.w0 + self.wr * self.q(p)

    def c_ps(self, p: int, replication: bool = True) -> float:
        return self.k + self.r * self.q(p) + (self.rep_cpu if replication and p > 1 else 0.0)

    def bytes(self, p: int) -> float:
        return self.b0 + self.br * self.q(p)


def mva(customers: int, delay: float, demand: float, servers: float = 1.0) -> float:
    """Throughput (cycles/s) of ``customers`` that each loop over a delay of ``delay`` s
    and one visit of ``demand`` s at a station of ``servers`` servers: exact mean-value
    analysis of the closed network, the multi-server station by Seidmann's approximation
    (a queue of demand/servers plus a delay of demand (servers - 1)/servers)."""
    servers = max(servers, 1e-9)
    sq = demand / servers
    z = delay + (demand * (servers - 1) / servers if servers > 1 else 0.0)
    x = q = 0.0
    for n in range(1, customers + 1):
        resp = sq * (1 + q)
        x = n / (z + resp)
        q = x * resp
    return x


def mva_overlapped(customers: int, own: float, delay: float, demand: float,
                   servers: float = 1.0) -> float:
    """Throughput of ``customers`` whose cycle is the longer of their own work ``own``
    (no one else's) and a round trip of ``delay`` plus one visit of ``demand`` at a
    station of ``servers`` servers, overlapped: a worker computes a step while its PS
    serve the calls of the steps around it. Mean-value analysis as ``mva``, the cycle a
    max instead of a sum."""
    servers = max(servers, 1e-9)
    sq = demand / servers
    z = demand * (servers - 1) / servers if servers > 1 else 0.0
    x = q = 0.0
    for n in range(1, customers + 1):
        resp = sq * (1 + q)
        x = n / max(own, delay + z + resp)
        q = x * resp
    return x


def predict(c: Costs, workers: int, ps: int, cores: float, gbit: float | None = None,
            shared: bool = False, background: float = 0.0, rtt_s: float | None = None,
            replication: bool = True) -> dict:
    """Samples/s of ``workers`` + ``ps`` with per-sample costs ``c``.

    Each worker is a customer of a closed queueing network that loops over one step:
    its own CPU, then its lookups and pushes at the PS, which wait for each other; with
    ``c.overlap`` (rows fetched ahead, pushes in flight) the calls overlap the worker's
    CPU instead: on one machine the PS' work takes cores beside the steps (as the
    replication does), on a cluster a step lasts the longer of the two.

    ``shared`` (this machine): all processes and the AIMaster share ONE machine of
    ``cores`` cores, so the whole CPU work of a step, the worker's and the PS', queues
    at one station of ``cores`` servers; what runs beside the steps (the ring's
    replication, the AIMaster) takes cores away from it. Other programs that want
    ``background`` cores slow the job, when job and they want more than the cores, by
    N / (J + D) (a proportional share; Linux' CFS shares by runnable thread, which this
    approximates).

    Otherwise (a cluster) every process has a machine of ``cores`` cores of its own: a
    worker's CPU is a delay (no one else's), the PS a station of ``min(n_ps, cores)``
    servers that every worker visits once per step (its P PS in parallel, as one station
    of the per-PS demand: symmetric keys, no fork-join wait for the slowest), the
    network a delay of the round trips plus the bytes at ``gbit``, and each NIC a bound.
    """
    if workers < 1 or ps < 1 or cores <= 0:
        raise ValueError(f"need workers >= 1, ps >= 1, cores > 0 (got {workers}, {ps}, {cores})")
    W, P, B = workers, ps, c.batch
    rtt = (0.0 if shared else c.rtt_s) if rtt_s is None else rtt_s
    bw = None if gbit is None else gbit * 1e9 / 8  # bytes/s each direction
    cw, nb = c.c_w(P), c.bytes(P)
    cps_path = c.c_ps(P, replication=False)   # lookups and pushes: on a step's path
    rep_cpu = c.c_ps(P, replication) - cps_path  # shipped in the background
    half = nb / 2  # bytes/sample per direction (lookup answers in, gradients out)
    net = c.rpcs_per_step_per_ps / 2 * rtt + (B * half / bw if bw else 0.0)
    master = c.master * (W + P)
    bounds = {}
    x = 0.0
    if shared:
        if cores - master <= 0:
            raise ValueError(f"no CPU left: {cores} cores, AIMaster {master:.2f}")
        beside = rep_cpu + (cps_path if c.overlap else 0.0)
        on_path = cw + (0.0 if c.overlap else cps_path)
        for _ in range(50):  # fixed point: the work beside the steps depends on the rate
            free = max(cores - master - x * B * beside, 0.05 * cores)
            x = mva(W, net, B * on_path, free)
        bounds["queueing"] = x * B
    else:
        n_ps = min(c.n_ps, cores)
        for _ in range(50):
            free = max(n_ps - x * B * rep_cpu / P, 0.05 * n_ps)
            if c.overlap:
                x = mva_overlapped(W, B * cw / min(c.n_w, cores), net, B * cps_path / P, free)
            else:
                x = mva(W, B * cw / min(c.n_w, cores) + net, B * cps_path / P, free)
        bounds["queueing"] = x * B
        if bw:
            bounds["worker_nic"] = W * bw / half
            # a PS receives 1/P of every worker's bytes (R half / P per direction) and
            # ships as much replication to its ring peer as it receives from the other
            rep = c.rep if P > 1 and replication else 0.0
            bounds["ps_nic"] = P * bw / (half + rep)
    # one process cannot use more than its cores
    bounds["workers_cpu"] = W * min(c.n_w, cores) / cw
    bounds["ps_cpu"] = P * min(c.n_ps, cores) / c.c_ps(P, replication)
    bound = min(bounds, key=bounds.get)
    rate, share = bounds[bound], 1.0
    if shared:
        share = background_share(rate * (cw + c.c_ps(P, replication)) + master, background,
                                 cores)
        rate *= share
    own, calls = B * cw / min(c.n_w, cores), B * cps_path / P + net
    step = max(own, calls) if c.overlap else own + calls  # one step, nothing queued
    return {"workers": W, "ps": P, "cores": cores, "gbit": gbit, "shared": shared,
            "background": background, "share": share, "samples_per_s": rate, "bound": bound,
            "bounds": bounds, "step_ms_unloaded": 1e3 * step,
            "per_sample": {"worker_cpu_s": cw, "ps_cpu_s": c.c_ps(P, replication),
                           "bytes": nb},
            "master_cores": master}


def background_share(job_cores: float, background: float, cores: float) -> float:
    """Factor by which a job that would use ``job_cores`` alone is slowed by other
    programs that want ``background`` cores of the same ``cores``."""
    return min(1.0, cores / (job_cores + background)) if job_cores + background > 0 else 1.0


def best_ps(c: Costs, workers: int, cores: float, gbit: float | None,
            max_ps: int | None = None, within: float = 0.02) -> dict:
    """The fewest PS whose predicted throughput is within ``within`` of the best
    over 1..max_ps (default: ``workers``)."""
    preds = [predict(c, workers, p, cores, gbit) for p in range(1, (max_ps or workers) + 1)]
    top = max(x["samples_per_s"] for x in preds)
    return next(x for x in preds if x["samples_per_s"] >= (1 - within) * top)


def fit(runs: list[dict], batch: int) -> Costs:
    """Per-sample costs from measured runs (medians per layout). Only CPU seconds and
    bytes are fitted; no rate goes in.

    The P-dependence (key work split over the PS vs a fixed cost per RPC) is a
    least-squares line over q = 2 P / B through the runs WITHOUT replication (one PS, or
    several with shipping deferred: ``replication: false`` in the run); the replication's
    PS CPU is then what the runs with several replicating PS cost above that line. With
    one P only, the per-RPC part is 0."""
    all_runs = runs
    runs = [r for r in all_runs if r["ps"] == 1 or not r.get("replication", True)] or all_runs
    q = [2 * r["ps"] / batch for r in runs]
    w0, wr = _line(q, [r["worker_cpu_per_sample"] for r in runs])
    k, r_ = _line(q, [r["ps_cpu_per_sample"] for r in runs])
    # bytes of lookups and pushes: replication travels in its own RPCs
    have = [r for r in all_runs if r["bytes_per_sample"] is not None]
    b0, br = _line([2 * r["ps"] / batch for r in have], [r["bytes_per_sample"] for r in have])
    multi = [r for r in all_runs if r["ps"] > 1 and r.get("replication", True)]
    c = Costs(batch=batch, w0=w0, wr=wr, k=k, r=r_, b0=b0, br=br,
              rep=_median([r["rep_bytes_per_sample"] for r in multi]) if multi else 0.0,
              master=_median([r["master_cores"] / (r["workers"] + r["ps"]) for r in all_runs]))
    if multi:
        c.rep_cpu = max(_median([r["ps_cpu_per_sample"] - c.c_ps(r["ps"], False)
                                 for r in multi]), 0.0)
    return c


def _line(x: list, y: list) -> tuple[float, float]:
    """Least squares y = icpt + slope x; a negative slope (noise) is taken as 0."""
    xm, ym = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - xm) ** 2 for a in x)
    slope = max(sum((a - xm) * (b - ym) for a, b in zip(x, y)) / sxx, 0.0) if sxx else 0.0
    return ym - slope * xm, slope


# ----------------------------------------------------------------------------------------
# measurement: one real job, every process's CPU and every PS's RPC counters sampled
# ----------------------------------------------------------------------------------------

class _Sampler(threading.Thread):
    """Polls (time, CPU s per member, machine CPU s, PS RPC counters) every ``period``."""

    def __init__(self, master_pid: int, state_dir: str, log_path: str, period: float = 0.5):
        super().__init__(daemon=True)
        self.master_pid, self.state_dir, self.log_path = master_pid, state_dir, log_path
        self.period = period
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self._procs: dict = {}
        self._addr = None

    def _members(self) -> list:
        from aimaster.state import load_state
        try:
            return (load_state(self.state_dir) or {}).get("members", [])
        except Exception:  # noqa: BLE001 - the AIMaster may be writing its first state
            return []

    def _address(self):
        if self._addr is None:
            try:
                with open(self.log_path, errors="replace") as f:
                    m = re.search(r"listening on (\S+)", f.read())
                self._addr = m.group(1) if m else None
            except OSError:
                pass
        return self._addr

    def _rpcs(self) -> dict:
        """{ps id: (time the PS collected them, {method: [count, bytes_in, bytes_out]})}
        from the Gazer snapshot (the counters ride on the PS's heartbeat)."""
        addr = self._address()
        if not addr:
            return {}
        from gazer.cli import get_snapshot
        try:
            snap = get_snapshot(addr, 2.0)
        except Exception:  # noqa: BLE001 - the job may be ending
            return {}
        out = {}
        for m in snap.members:
            if m.role == "ps" and m.stats.time:
                out[m.id] = (m.stats.time, {r.method: [r.count, r.bytes_in, r.bytes_out]
                                            for r in m.stats.rpcs})
        return out

    def run(self):
        import psutil
        while not self.stop.is_set():
            t = time.time()
            cpu = {}
            members = [{"id": "master", "role": "master", "pid": self.master_pid}] + \
                [m for m in self._members() if m.get("pid")]
            for m in members:
                key = (m["id"], m["pid"])
                try:
                    p = self._procs.get(key) or self._procs.setdefault(key, psutil.Process(m["pid"]))
                    ct = p.cpu_times()
                    # not children_*: the AIMaster's children are the members themselves
                    cpu[m["id"]] = (m["role"], ct.user + ct.system)
                except (psutil.Error, OSError):
                    pass
            mt = psutil.cpu_times()
            busy = mt.user + mt.nice + mt.system + getattr(mt, "irq", 0) + \
                getattr(mt, "softirq", 0) + getattr(mt, "steal", 0)
            try:
                rpcs = self._rpcs()
            except Exception:  # noqa: BLE001 - a missed poll must not end the sampling
                rpcs = {}
            self.samples.append({"t": t, "cpu": cpu, "machine_busy": busy, "rpcs": rpcs})
            self.stop.wait(self.period)


def _interp(samples: list, t: float, get, when=lambda s: s["t"]) -> float | None:
    """Value of ``get(sample)`` at time ``t`` (linear between the two nearest samples
    that have it; ``when(sample)``: the time the value was taken)."""
    pts = sorted({(when(s), get(s)) for s in samples if get(s) is not None})
    if len(pts) < 2 or not pts[0][0] <= t <= pts[-1][0]:
        return None
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return None


def _machine_busy() -> float:
    import psutil
    mt = psutil.cpu_times()
    return mt.user + mt.nice + mt.system + getattr(mt, "irq", 0) + \
        getattr(mt, "softirq", 0) + getattr(mt, "steal", 0)


def machine_busy_cores(seconds: float) -> float:
    """Cores the machine's other programs keep busy, over ``seconds`` without our job."""
    a, t = _machine_busy(), time.monotonic()
    time.sleep(seconds)
    return (_machine_busy() - a) / (time.monotonic() - t)


def measure(workers: int, ps: int, rows: int, batch: int, timeout: float = 600.0,
            warmup: int = 20, seed: int = 1, files: int = 2, idle_seconds: float = 3.0,
            replication: bool = True) -> dict:
    """One real job of ``workers`` + ``ps``: steady samples/s and the per-sample costs.

    The machine's background load is measured over ``idle_seconds`` right before and
    right after the job (not during it: on a saturated machine, "machine busy minus the
    job" is whatever the job left, which would make the prediction circular)."""
    from bench import bench_training as bt
    data = bt.ensure_data(rows, files, seed, 0)
    tag = f"scaling-{workers}w{ps}p" + ("" if replication else "-norep")
    state_dir = os.path.join(REPO, "runs", f"bench-{tag}")
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    job_path = os.path.join(state_dir, "job.yaml")
    args = argparse.Namespace(batch_size=batch, lr=1e-3, records_per_shard=20_000,
                              init_seed=-1)  # Keras' own initial weights, as calibrated
    bt.write_job(job_path, f"bench-{tag}", data["dir"], args, profile=False)
    if not replication:
        # calibration only: defer the ring's shipping past the job's end, so the PS CPU
        # of this run is lookups and pushes alone (the changes are still tracked)
        import yaml
        with open(job_path) as f:
            job = yaml.safe_load(f)
        job["replication"] = {"mode": "async", "interval_ms": 3.6e6}  # the maximum: 1 h
        with open(job_path, "w") as f:
            yaml.safe_dump(job, f, sort_keys=False)
    cmd = bt._aimaster_cmd() + ["run", job_path, "--ps", str(ps), "--workers", str(workers),
                                "--state-dir", os.path.relpath(state_dir, REPO),
                                "--log-level", "WARNING"]
    log_path = os.path.join(state_dir, "aimaster.out")
    load_before = os.getloadavg()
    bg_before = machine_busy_cores(idle_seconds)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        sampler = _Sampler(proc.pid, state_dir, log_path)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{tag}: timed out after {timeout}s; see {log_path}")
        finally:
            sampler.stop.set()
            sampler.join(10)
            if proc.poll() is None:
                bt._stop_group(proc)
    load_after = os.getloadavg()
    bg_after = machine_busy_cores(idle_seconds)
    if code != 0:
        raise RuntimeError(f"{tag}: aimaster exited with {code}; see {log_path}")
    steps = []
    for path in sorted(_glob(state_dir, "bench-steps-worker-*.json")):
        with open(path) as f:
            steps.append(json.load(f)["series"])
    if len(steps) != workers:
        raise RuntimeError(f"{tag}: {len(steps)} step logs for {workers} workers")
    steady = bt.steady_rate(steps, warmup)
    if not steady.get("samples_per_s"):
        raise RuntimeError(f"{tag}: no steady window ({steady.get('reason')})")
    t1 = min(s[-1][0] for s in steps)
    t0 = t1 - steady["window_seconds"]
    n = steady["window_samples"]
    S = sampler.samples
    with open(os.path.join(state_dir, "scaling-samples.json"), "w") as f:
        json.dump(S, f)

    def delta(get, when=lambda s: s["t"]):
        a, b = _interp(S, t0, get, when), _interp(S, t1, get, when)
        return None if a is None or b is None else b - a

    ids = {(mid, role) for s in S for mid, (role, _) in s["cpu"].items()}
    cpu = {mid: delta(lambda s, m=mid: s["cpu"].get(m, (None, None))[1]) for mid, _ in ids}
    role = dict(ids)
    missing = [m for m, v in cpu.items() if v is None]
    if missing:
        raise RuntimeError(f"{tag}: CPU of {missing} not sampled over the window")
    by_role = {r: sum(v for m, v in cpu.items() if role[m] == r) for r in ("worker", "ps", "master")}
    wall = steady["window_seconds"]
    machine = delta(lambda s: s["machine_busy"])
    job_cpu = sum(cpu.values())
    ps_ids = sorted({p for s in S for p in s["rpcs"]})
    per_ps = {}
    for p in ps_ids:
        have = [s for s in S if p in s["rpcs"]]
        methods = sorted({m for s in have for m in s["rpcs"][p][1]})
        per_ps[p] = {m: [_delta_at(have, t0, t1, lambda s, p=p, m=m, i=i:
                                   # not served yet: its counters are 0
                                   (s["rpcs"][p][1].get(m) or [0, 0, 0])[i],
                                   lambda s, p=p: s["rpcs"][p][0]) for i in range(3)]
                     for m in methods}
    steps_in_window = n / batch
    train_methods = ("Lookup", "Push", "LookupMany", "PushMany")
    rpc_count = rpc_bytes = 0.0
    complete = len(per_ps) == ps
    for p, meths in per_ps.items():
        seen = 0
        for m, (cnt, bi, bo) in meths.items():
            if m in train_methods:
                if None in (cnt, bi, bo):  # a PS's heartbeats did not cover the window
                    complete = False
                    continue
                seen += 1
                rpc_count += cnt
                rpc_bytes += bi + bo
        complete = complete and seen >= 2
    if not complete:
        rpc_count = rpc_bytes = None
    all_rpc_bytes = sum(sum(v[1:]) for meths in per_ps.values() for v in meths.values()
                        if None not in v)
    return {
        "workers": workers, "ps": ps, "replication": replication, "batch": batch,
        "rows": rows, "cores": os.cpu_count(),
        "samples_per_s": steady["samples_per_s"], "window_seconds": wall, "window_samples": n,
        "load_before": load_before, "load_after": load_after,
        "cpu_seconds": {m: round(v, 4) for m, v in sorted(cpu.items())},
        "cores_used": {"worker": by_role["worker"] / wall, "ps": by_role["ps"] / wall,
                       "master": by_role["master"] / wall, "job": job_cpu / wall,
                       "machine": machine / wall if machine else None,
                       # informational only (see the docstring): not a model input
                       "others_during": (machine - job_cpu) / wall if machine else None,
                       "background": (bg_before + bg_after) / 2,
                       "background_before": bg_before, "background_after": bg_after},
        "worker_cpu_per_sample": by_role["worker"] / n,
        "ps_cpu_per_sample": by_role["ps"] / n,
        "master_cores": by_role["master"] / wall,
        # None: the PS' counters did not cover the window (left out of the medians)
        "rpcs_per_step_per_ps": None if rpc_count is None else rpc_count / steps_in_window / ps,
        "bytes_per_sample": None if rpc_bytes is None else rpc_bytes / n,
        # PS -> PS (replication ring, ``Replicate``): on the PS' NICs only
        "rep_bytes_per_sample": sum(sum(v[1:]) for meths in per_ps.values()
                                    for m, v in meths.items()
                                    if m == "Replicate" and None not in v) / n,
        "bytes_per_step_per_ps": None if rpc_bytes is None else rpc_bytes / steps_in_window / ps,
        "other_rpc_bytes_per_sample": None if rpc_bytes is None else (all_rpc_bytes - rpc_bytes) / n,
        "ps_rpcs": per_ps, "state_dir": os.path.relpath(state_dir, REPO),
        "sampler_points": len(S),
    }


def _delta_at(samples, t0, t1, get, when):
    a, b = _interp(samples, t0, get, when), _interp(samples, t1, get, when)
    return None if a is None or b is None else b - a


def _glob(d, pat):
    import glob
    return glob.glob(os.path.join(d, pat))


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _layout_medians(runs: list[dict]) -> list[dict]:
    out = []
    for W, P, R in sorted({(r["workers"], r["ps"], r["replication"]) for r in runs},
                          key=lambda t: (not t[2], t[1], t[0])):
        rs = [r for r in runs if (r["workers"], r["ps"], r["replication"]) == (W, P, R)]
        med = {"workers": W, "ps": P, "replication": R, "name": _name(W, P, R),
               "repeats": len(rs)}
        for key in ("samples_per_s", "worker_cpu_per_sample", "ps_cpu_per_sample",
                    "master_cores", "bytes_per_sample", "rep_bytes_per_sample",
                    "rpcs_per_step_per_ps",
                    "bytes_per_step_per_ps"):
            vals = [r[key] for r in rs if r[key] is not None]
            med[key] = _median(vals) if vals else None
        med["background"] = _median([r["cores_used"]["background"] for r in rs])
        med["all_samples_per_s"] = [round(r["samples_per_s"]) for r in rs]
        out.append(med)
    return out


def _name(w: int, p: int, replication: bool = True) -> str:
    return f"{w}x{p}" + ("" if replication else ":norep")


def validate(meds: list[dict], costs: Costs, cores: float) -> list[dict]:
    rows = []
    for m in meds:
        try:
            p = predict(costs, m["workers"], m["ps"], cores, None, shared=True,
                        background=m["background"], replication=m["replication"])
        except ValueError as exc:  # the machine was saturated by other programs
            rows.append({"workers": m["workers"], "ps": m["ps"], "name": m["name"],
                         "measured": m["samples_per_s"], "predicted": None, "bound": str(exc),
                         "background": m["background"], "error": None,
                         "within_target": False, "bounds": {},
                         "replication": m["replication"]})
            continue
        err = p["samples_per_s"] / m["samples_per_s"] - 1
        rows.append({"workers": m["workers"], "ps": m["ps"], "name": m["name"],
                     "measured": m["samples_per_s"],
                     "predicted": p["samples_per_s"], "bound": p["bound"],
                     "background": m["background"], "error": err,
                     "within_target": bool(abs(err) <= TARGET_ERROR), "bounds": p["bounds"],
                     "replication": m["replication"]})
    return rows


def cluster_table(costs: Costs, workers: list[int], cores: float, gbits: list[float]) -> list:
    out = []
    for g in gbits:
        for w in workers:
            best = best_ps(costs, w, cores, g)
            for p in sorted({max(1, w // 8), max(1, w // 4), max(1, w // 2), best["ps"]}):
                x = predict(costs, w, p, cores, g)
                x["chosen"] = p == best["ps"]
                out.append(x)
    return out


def _print_validation(rows):
    print(f"{'layout':>9} {'measured':>10} {'predicted':>10} {'error':>7} {'bound':>11} "
          f"{'bg cores':>8}")
    for r in rows:
        if r["predicted"] is None:
            print(f"{r['name']:>9} {r['measured']:>10,.0f}  no prediction: {r['bound']}")
            continue
        print(f"{r['name']:>9} {r['measured']:>10,.0f} {r['predicted']:>10,.0f} "
              f"{100 * r['error']:>+6.1f}% {r['bound']:>11} {r['background']:>8.2f}"
              + ("" if r["within_target"] else "  MISS"))


def _print_cluster(rows):
    print(f"{'workers':>7} {'PS':>4} {'Gbit/s':>6} {'samples/s':>12} {'per worker':>10} "
          f"{'bound':>11} {'step ms':>7} {'AIMaster cores':>14}")
    for x in rows:
        print(f"{x['workers']:>7} {x['ps']:>4} {x['gbit']:>6g} {x['samples_per_s']:>12,.0f} "
              f"{x['samples_per_s'] / x['workers']:>10,.0f} {x['bound']:>11} "
              f"{x['step_ms_unloaded']:>7.1f} {x['master_cores']:>14.2f}"
              + ("  <- fewest PS near the best" if x["chosen"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="run the layouts here, fit the costs, compare")
    v.add_argument("--layouts", default="1x1,2x1,1x2,2x2,1x2:norep",
                   help="WxP list (workers x PS; ':norep' defers the PS ring's replication, "
                        "a calibration run), default 1x1,2x1,1x2,2x2,1x2:norep")
    v.add_argument("--repeat", type=int, default=3)
    v.add_argument("--rows", type=int, default=200_000)
    v.add_argument("--batch-size", type=int, default=1024)
    v.add_argument("--timeout", type=float, default=600.0)
    v.add_argument("--calibrate", default="1x1,1x2,1x2:norep",
                   help="layouts whose costs the model is fitted on (default "
                        "1x1,1x2,1x2:norep: the two-worker layouts are then out-of-sample)")
    v.add_argument("--cores", type=float, default=float(os.cpu_count() or 2))
    v.add_argument("--out", default=None)
    f = sub.add_parser("refit", help="fit and validate again from the runs of a results file")
    f.add_argument("results", help="JSON written by validate")
    f.add_argument("--calibrate", default="1x1,1x2,1x2:norep")
    f.add_argument("--cores", type=float, default=float(os.cpu_count() or 2))
    f.add_argument("--out", default=None)
    p = sub.add_parser("predict", help="predictions for a cluster from a results file")
    p.add_argument("results", help="JSON written by validate")
    p.add_argument("--workers", default="8,32,128")
    p.add_argument("--cores", type=float, default=16)
    p.add_argument("--gbit", default="10,25")
    p.add_argument("--ps-cores", type=float, default=None,
                   help="cores one PS process can use (default: the results' n_ps, 1)")
    p.add_argument("--worker-cores", type=float, default=None,
                   help="cores one worker process can use (default: the results' n_w, 1)")
    p.add_argument("--rtt-us", type=float, default=None,
                   help="network round trip in microseconds (default 100)")
    args = ap.parse_args(argv)

    def layouts(s):
        try:
            out = []
            for item in filter(None, s.split(",")):
                wp, _, flag = item.lower().partition(":")
                w, p = (int(x) for x in wp.split("x"))
                if w < 1 or p < 1 or flag not in ("", "norep"):
                    raise ValueError(item)
                out.append((w, p, flag != "norep"))
        except ValueError:
            out = []
        if not out:
            ap.error(f"layouts must be WxP[:norep] with W, P >= 1, comma-separated (got {s!r})")
        return out

    if args.cmd == "predict":
        try:
            with open(args.results) as f:
                res = json.load(f)
            costs = Costs(**res["costs"])
            workers = [int(x) for x in args.workers.split(",")]
            gbits = [float(x) for x in args.gbit.split(",")]
            if min(workers) < 1 or min(gbits) <= 0:
                raise ValueError("--workers must be >= 1 and --gbit > 0")
            for name, v in (("n_ps", args.ps_cores), ("n_w", args.worker_cores),
                            ("rtt_s", None if args.rtt_us is None else args.rtt_us * 1e-6)):
                if v is not None:
                    if v <= 0:
                        raise ValueError(f"{name} must be > 0")
                    setattr(costs, name, v)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"scaling_model: error: cannot use {args.results}: {exc}", file=sys.stderr)
            return 2
        _print_cluster(cluster_table(costs, workers, args.cores, gbits))
        return 0

    todo = layouts(args.layouts) if args.cmd == "validate" else []
    calib = layouts(args.calibrate)
    if args.cmd == "refit":
        try:
            with open(args.results) as f:
                res = json.load(f)
            runs = res["runs"]
        except (OSError, ValueError, KeyError) as exc:
            print(f"scaling_model: error: cannot use {args.results}: {exc}", file=sys.stderr)
            return 2
        res.pop("runs")
        return _analyze(runs, calib, args.cores, runs[0]["batch"], args.out,
                        {k: res[k] for k in ("date", "host", "args", "uptime") if k in res})
    runs, failed = [], []
    start = _uptime()
    print(f"uptime at start: {start}", flush=True)
    for i in range(args.repeat):
        for W, P, R in todo:
            try:
                r = measure(W, P, args.rows, args.batch_size, args.timeout, replication=R)
            except RuntimeError as exc:  # one failed job must not lose the others
                print(f"round {i} {_name(W, P, R)}: FAILED: {exc}", flush=True)
                failed.append({"round": i, "layout": _name(W, P, R), "error": str(exc)})
                continue
            r["round"] = i
            runs.append(r)
            print(f"round {i} {_name(W, P, R)}: {r['samples_per_s']:,.0f} samples/s, cores "
                  f"w {r['cores_used']['worker']:.2f} ps {r['cores_used']['ps']:.2f} "
                  f"master {r['cores_used']['master']:.2f} bg {r['cores_used']['background']:.2f}"
                  f"; load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}", flush=True)
    uptime = {"start": start, "end": _uptime()}
    print(f"uptime at end: {uptime['end']}", flush=True)
    return _analyze(runs, calib, args.cores, args.batch_size, args.out,
                    {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "host": {"cores": os.cpu_count(), "python": platform.python_version()},
                     "args": vars(args), "uptime": uptime, "failed_runs": failed})


def _analyze(runs, calib, cores, batch, out_path, header) -> int:
    meds = _layout_medians(runs)
    cal = [m for m in meds if (m["workers"], m["ps"], m["replication"]) in calib] or meds
    costs = fit(cal, batch)
    print("costs: " + ", ".join(f"{k} {v:.4g}" for k, v in asdict(costs).items()))
    rows = validate(meds, costs, cores)
    _print_validation(rows)
    cluster = cluster_table(costs, [8, 32, 128], 16, [10, 25])
    _print_cluster(cluster)
    if out_path:
        out = dict(header, calibrated_on=[_name(*t) for t in calib], costs=asdict(costs),
                   layouts=meds, validation=rows, cluster_16_cores=cluster, runs=runs)
        with open(out_path, "w") as f:  # numpy scalars from the steady-state window
            json.dump(out, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
        print(f"wrote {out_path}")
    return 0 if all(r["within_target"] for r in rows if r["replication"] or r["ps"] == 1) else 1


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        la = os.getloadavg()
        return f"load average: {la[0]:.2f}, {la[1]:.2f}, {la[2]:.2f}"


if __name__ == "__main__":
    sys.exit(main())
