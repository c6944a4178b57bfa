"""Real local runs: the size the autoscale policy (performance-fit) picks vs a grid of fixed
sizes, by throughput per allocated core.

Workload: ``tests/counting_worker.py`` (no TensorFlow: each record is an id, a step pushes
+1 per id to a PS table; ``COUNTING_DELAY=0`` so it is CPU-bound) on a generated file of
random ids, read through the shard service for 1,000 epochs so no run runs out of data (a quiet
machine trains 200k+ records/s).

1. Grid: every (workers, PS) in ``--workers`` x ``--ps`` as a fixed-size job; samples/s
   measured over ``--measure`` seconds after ``--warmup`` seconds.
2. Policy: a job starting at 1 worker + 1 PS with ``autoscale: {enabled: true,
   resource_fit: false}`` and the same bounds; after ``--policy-seconds`` the size it holds
   is its choice. Its throughput per core is the grid's figure for that size.

Allocated cores = workers x 1 + PS x 1 (the policy's default worker_cores / ps_cores).
Prints the grid, the policy's decisions and the ratio to the best of the grid:

    .venv/bin/python bench/bench_policy_grid.py [--json out.json]

Target (issue 5): the policy's choice within 10% of the best throughput per core.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deeprec_ext.grpc_util import insecure_channel  # noqa: E402
from deeprec_ext.proto import master_pb2, master_pb2_grpc  # noqa: E402
from tests.conftest import Job  # noqa: E402


def job_spec(data: str, ps: int, workers: int, autoscale: dict | None = None) -> dict:
    spec = {"name": "policy-grid", "num_slots": 256,
            "ps": {"replicas": ps, "min_replicas": 1, "max_replicas": 2},
            "worker": {"replicas": workers, "min_replicas": 1, "max_replicas": 3,
                       "command": ["{python}", str(ROOT / "tests" / "counting_worker.py")],
                       "env": {"COUNTING_DELAY": "0", "COUNTING_BATCH": "200",
                               "PYTHONPATH": str(ROOT)}},
            "data": {"files": [data], "records_per_shard": 20_000, "epochs": 1000}}
    if autoscale:
        spec["autoscale"] = autoscale
    return spec


def status(address: str):
    with insecure_channel(address) as ch:
        return master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(), timeout=10)


def samples(address: str) -> int:
    return sum(m.samples for m in status(address).members if m.role == "worker")


def measure(address: str, warmup: float, seconds: float) -> float:
    time.sleep(warmup)
    t0, s0 = time.monotonic(), samples(address)
    time.sleep(seconds)
    return (samples(address) - s0) / (time.monotonic() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--ps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--measure", type=float, default=12.0)
    p.add_argument("--policy-seconds", type=float, default=100.0)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="policy-grid-"))
    data = tmp / "ids.txt"
    rng = np.random.default_rng(0)
    data.write_text("\n".join(map(str, rng.integers(0, 1_000_000, 200_000))) + "\n")
    print(f"load before: {os.getloadavg()}")

    grid = {}
    for ps in args.ps:
        for w in args.workers:
            (tmp / f"grid-{ps}-{w}").mkdir()
            job = Job(tmp / f"grid-{ps}-{w}", job_spec(str(data), ps, w))
            try:
                rate = measure(job.address, args.warmup, args.measure)
            finally:
                job.stop()
            grid[(w, ps)] = rate
            print(f"fixed workers={w} ps={ps}: {rate:8,.0f} samples/s, "
                  f"{rate / (w + ps):7,.0f} per core", flush=True)

    auto = {"enabled": True, "resource_fit": False, "interval_seconds": 1.0,
            "cooldown_seconds": 8, "settle_seconds": 3, "measure_seconds": 6,
            "window_seconds": 10}
    (tmp / "policy").mkdir()
    job = Job(tmp / "policy", job_spec(str(data), 1, 1, auto))
    try:
        time.sleep(args.policy_seconds)
        st = status(job.address)
        w = sum(1 for m in st.members if m.role == "worker" and m.state == "running")
        ps = sum(1 for m in st.members if m.role == "ps" and m.state == "running")
        decisions = json.loads(st.autoscale_json)["decisions"]
        cost = json.loads(st.autoscale_json)["cost"]
    finally:
        job.stop()
    for d in decisions:
        print(f"  policy: {d['rule']}: {d['reason']}")
    per_core = {k: v / (k[0] + k[1]) for k, v in grid.items()}
    best = max(per_core, key=per_core.get)
    chosen = per_core.get((w, ps))
    print(f"best of grid: workers={best[0]} ps={best[1]}: {per_core[best]:,.0f} samples/s per core")
    ratio = chosen / per_core[best] if chosen else float("nan")
    print(f"policy chose workers={w} ps={ps}: {chosen or float('nan'):,.0f} per core = "
          f"{ratio:.3f}x best (target >= 0.90): {'PASS' if ratio >= 0.9 else 'MISS'}")
    print(f"load after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"grid": {f"w{k[0]}-ps{k[1]}": v for k, v in grid.items()},
                       "per_core": {f"w{k[0]}-ps{k[1]}": v for k, v in per_core.items()},
                       "chosen": [w, ps], "ratio": ratio, "decisions": decisions, "cost": cost},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
