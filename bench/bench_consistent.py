"""Throughput of the accuracy-consistent (sync) mode vs the asynchronous mode, at 1, 2 and 4
workers, and the cost of a membership change -- all from ONE run, printed as ratios.

    .venv/bin/python bench/bench_consistent.py [--micro-batch 128] [--virtual 4] \
        [--steps 200] [--workers 1,2,4] [--repeat 2] [--out bench/results/consistent.json]

Same DeepFM (examples/criteo, dim 8, hidden (128, 64), Adam lr 1e-3 for tables and dense
weights), same data, 1 PS. Each global step of the sync mode trains V micro-batches of
``--micro-batch`` records; the async run gives each of its n workers batches of V x
micro-batch / n records, so both modes train the same records per worker per step.

  sync-n   examples/criteo/train_sync.py, n physical workers, V virtual workers
  async-n  examples/criteo/train.py (model.fit + ElasticCallback, no overlap), n workers

Throughput, steady state (the headline): samples trained by all workers in the window in
which every worker trains, after 5 warm-up steps each (``bench_training.steady_rate``, from
per-step timestamps). End to end, informational: total samples / the longest worker's
``train_seconds`` (async: the whole ``model.fit`` call, start-up included; sync: first step
to last, tracing included -- not the same span, so do not read much into it).

Membership change: one sync run starts with 2 workers; at step ``--steps``/3 it is scaled
in to 1 worker, at 2/3 the PS are scaled out 1 -> 2. Reported: the barrier wait of the
boundary where the placement changed (first arrival to release) next to the median step
time, and the held-boundary PS scale's duration.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def ensure_data(rows: int, seed: int = 21) -> dict:
    from examples.criteo.generate import generate
    d = os.path.join(REPO, "runs", "bench-data", f"criteo-sync-rows{rows}-seed{seed}")
    if not os.path.exists(os.path.join(d, "train-00001.txt")):
        generate(d, rows=rows, files=2, seed=seed)
    return {"train": [os.path.join(d, "train-00000.txt"), os.path.join(d, "train-00001.txt")]}


def job_doc(name: str, data: dict, args, mode: str, workers: int) -> dict:
    per_shard = args.micro_batch * max(1, args.steps // 10)
    if mode == "sync":
        cmd = ["{python}", "-m", "examples.criteo.train_sync", "--micro-batch", str(args.micro_batch)]
        extra = {"consistency": {"mode": "sync", "virtual_workers": args.virtual}}
    else:
        # bench_training's worker wrapper: examples/criteo/train.py unchanged, plus a
        # timestamp after every step (bench-steps-<worker>.json)
        cmd = ["{python}", os.path.join(REPO, "bench", "bench_training.py"), "--_ours-worker",
               "--batch-size", str(args.micro_batch * args.virtual // workers)]
        extra = {}
    return {"name": name, "num_slots": 256, "ps": {"replicas": 1, "max_replicas": 4},
            "worker": {"replicas": workers, "max_replicas": 4, "command": cmd, "max_restarts": 0},
            "data": {"files": data["train"], "records_per_shard": per_shard},
            "master": {"state_dir": os.path.join(REPO, "runs", name), "progress_seconds": 30},
            **extra}


class Job:
    def __init__(self, doc: dict):
        self.state_dir = doc["master"]["state_dir"]
        shutil.rmtree(self.state_dir, ignore_errors=True)
        os.makedirs(self.state_dir)
        path = os.path.join(self.state_dir, "job.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        self.log = open(os.path.join(self.state_dir, "aimaster.out"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "aimaster.cli", "run", path], cwd=REPO,
                                     env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        addr = os.path.join(self.state_dir, "master.addr")
        deadline = time.monotonic() + 120
        while not os.path.exists(addr):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"aimaster did not start; see {self.log.name}")
            time.sleep(0.1)
        self.address = open(addr).read()

    def sync(self) -> dict:
        from deeprec_ext.grpc_util import insecure_channel
        from deeprec_ext.proto import master_pb2, master_pb2_grpc
        with insecure_channel(self.address) as ch:
            r = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(), timeout=10)
        return json.loads(r.sync_json) if r.sync_json else {}

    def scale(self, *args) -> dict:
        r = subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", self.address,
                            *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, PYTHONPATH=REPO))
        if r.returncode:
            raise RuntimeError(r.stderr)
        return json.loads(r.stdout)

    def wait(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
            raise RuntimeError(f"job timed out; see {self.log.name}")
        finally:
            self.log.close()
        from aimaster.state import load_state
        state = load_state(self.state_dir)
        if state["phase"] != "succeeded":
            raise RuntimeError(f"job {state['phase']}: {state['message']}")
        files = sorted(os.listdir(self.state_dir))
        metrics = [json.load(open(os.path.join(self.state_dir, f))) for f in files
                   if f.startswith("metrics-")]
        steps = [json.load(open(os.path.join(self.state_dir, f))) for f in files
                 if f.startswith("bench-steps-")]
        return {"events": state["events"], "metrics": metrics, "steps": steps}


def throughput(result: dict) -> dict:
    """End to end (samples / longest worker's train_seconds) and steady state (the window
    in which every worker trains, after 5 warm-up steps each; bench_training.steady_rate)."""
    from bench.bench_training import steady_rate
    ms = result["metrics"]
    samples = sum(m["samples"] for m in ms)
    seconds = max(m["train_seconds"] for m in ms)
    series = [s["series"] for s in result["steps"]] or [m["series"] for m in ms if m.get("series")]
    steady = steady_rate(series, 5)
    return {"samples": samples, "seconds": round(seconds, 2),
            "end_to_end_samples_per_s": round(samples / seconds, 1),
            "samples_per_s": round(float(steady["samples_per_s"]), 1) if steady["samples_per_s"] else None,
            "steady_window_s": round(float(steady.get("window_seconds", 0.0)), 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--virtual", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--repeat", type=int, default=2, help="runs per configuration (median)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "consistent.json"))
    args = p.parse_args(argv)
    data = ensure_data(args.micro_batch * args.virtual * args.steps)
    results = {"date": datetime.date.today().isoformat(), "args": vars(args),
               "load_before": os.getloadavg(), "runs": {}}
    import numpy as np
    for n in [int(x) for x in args.workers.split(",")]:
        for rep in range(args.repeat):  # interleaved: both modes see the same load drift
            for mode in ("async", "sync"):
                name = f"bench-consistent-{mode}-{n}"
                print(f"running {name} (repeat {rep}) ...", flush=True)
                r = throughput(Job(job_doc(name, data, args, mode, n)).wait(1800))
                results["runs"].setdefault(name, []).append(r)
                print(f"  {r}", flush=True)
        med = {}
        for mode in ("async", "sync"):
            runs = results["runs"][f"bench-consistent-{mode}-{n}"]
            med[mode] = {k: float(np.median([r[k] for r in runs if r[k]] or [0]))
                         for k in ("samples_per_s", "end_to_end_samples_per_s")}
        results["runs"][f"median-{n}"] = med
        results["runs"][f"ratio-sync/async-{n}"] = {
            k: round(med["sync"][k] / med["async"][k], 3) if med["async"][k] else None
            for k in ("samples_per_s", "end_to_end_samples_per_s")}
    # membership change: 2 -> 1 workers at steps/3, PS 1 -> 2 at 2*steps/3
    print("running the membership-change run ...", flush=True)
    job = Job(job_doc("bench-consistent-change", data, args, "sync", 2))

    def at(step):
        while job.sync().get("step", 0) < step:
            if job.proc.poll() is not None:
                raise RuntimeError("the job ended before the change")
            time.sleep(0.05)

    at(args.steps // 3)
    t0 = time.monotonic()
    job.scale("--workers", "1")
    scale_in_ms = (time.monotonic() - t0) * 1000
    at(2 * args.steps // 3)
    t0 = time.monotonic()
    ps_event = job.scale("--ps", "2")
    ps_ms = (time.monotonic() - t0) * 1000
    res = job.wait(1800)
    changes = [e for e in res["events"] if e["kind"] == "sync_membership"]
    holds = [e for e in res["events"] if e["kind"] == "sync_hold"]
    steps = [m for m in res["metrics"] if m.get("mean_step_seconds")]
    median_step_ms = 1000 * min(m["mean_step_seconds"] for m in steps)
    results["membership_change"] = {
        "boundaries": [{k: e[k] for k in ("step", "workers", "moved_virtual", "boundary_wait_ms")}
                       for e in changes],
        "scale_in_rpc_ms": round(scale_in_ms, 1),
        "ps_scale_rpc_ms": round(ps_ms, 1), "ps_scale_fence_ms": ps_event["fence_ms"],
        "ps_scale_moved_rows": ps_event["moved_rows"],
        "ps_scale_boundary_reached_ms": holds[0]["reached_ms"] if holds else None,
        "ps_scale_training_paused_ms": holds[0]["paused_ms"] if holds else None,
        "mean_step_ms_fastest_worker": round(median_step_ms, 1),
    }
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
