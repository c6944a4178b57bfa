"""Estimated PS memory (``aimaster estimate``) vs the PS RSS measured at the end of a real
training run, for several DeepFM configurations, side by side from ONE run.

    .venv/bin/python bench/bench_estimate.py [--configs a,b,c] [--out bench/results/estimate.json]

Per configuration:

1. synthetic Criteo data (``examples.criteo.generate``, cached in ``runs/bench-estimate-data``);
2. the estimate, through the public API: ``graph_opt.estimate("bench.bench_estimate:build_model",
   dim=..., optimizer=...)`` with the job file's data read by
   ``examples.criteo.reader:parse_lines`` (first ``--sample-records`` records, distinct ids
   by HyperLogLog, Heaps' law to the full data) -- no PS is started;
3. a real job: ``aimaster run`` with the PS and worker counts of the configuration; the
   worker is this file with ``--_worker`` (DeepFM with ``ElasticEmbedding`` +
   ``ElasticCallback`` over the AIMaster's data shards). When every shard is trained, the
   worker waits 2 s (replication ships its last delta) and reads each PS's ``Stats`` RPC
   (``rss_bytes``, rows, ``cpu_seconds``) before anything stops;
4. estimate / measured per PS.

Config ``d`` gives the embedding table admission (min_count 2) and eviction
(steps_to_live 40): its rows are planned for the admitted ids within the window plus the
candidates' counters (``e`` is its twin without policies).

Target: every estimate within 20 % of the measured RSS.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TARGET = 0.20
# name: (dim, PS optimizer, training records, PS, workers)
CONFIGS = {
    "a": (8, "adam", 200_000, 1, 1),
    "b": (16, "adagrad", 400_000, 2, 1),
    "c": (32, "ftrl", 400_000, 1, 1),
    "d": (16, "adagrad", 400_000, 1, 1),   # with POLICIES["d"]
    "e": (16, "adagrad", 400_000, 1, 1),   # d's twin without policies
}
# admission + eviction of the embedding table, per config (issue 17: rows planned for the
# admitted ids live within the window, plus the candidates' counters)
POLICIES = {
    "d": {"admission": {"min_count": 2}, "eviction": {"steps_to_live": 40, "interval_seconds": 2}},
}


def build_model(dim: int = 8, optimizer: str = "adam", lr: float = 0.001, admission=None,
                eviction=None):
    """The example DeepFM with both tables on the PS under ``optimizer`` (the estimate
    target and the worker's model); ``admission`` / ``eviction`` of the embedding table."""
    import keras

    import deeprec_ext.tf as dtf
    from examples.criteo.model import build_deepfm
    opt = {"name": optimizer, "learning_rate": lr if optimizer == "adam" else 0.05}
    init = {"embedding": {"name": "normal", "stddev": 0.01, "seed": 7}, "linear": "zeros"}

    def factory(name, d):
        pol = {"admission": admission, "eviction": eviction} if name == "embedding" else {}
        return dtf.ElasticEmbedding(d, table=name, initializer=init[name], optimizer=opt,
                                    name=name, **pol)

    model = build_deepfm(embedding_factory=factory, dim=dim)
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="binary_crossentropy")
    return model


def worker_main(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import psutil

    import deeprec_ext.tf as dtf
    from examples.criteo.reader import parse_lines
    ctx = dtf.get_context()
    model = build_model(args.dim, args.optimizer, **json.loads(args.policies))
    model.fit(dtf.shard_dataset(args.batch_size, parse_fn=parse_lines), epochs=1,
              callbacks=[dtf.ElasticCallback()], verbose=0)
    out = {"worker": ctx.worker_id, "samples": ctx.session.samples,
           "worker_rss_bytes": psutil.Process().memory_info().rss}
    if ctx.rank == 0:
        ctx.wait_all_done()
        time.sleep(2.0)  # async replication ships every 200 ms: let the last delta land
        out["ps"] = [{"ps_id": s.ps_id, "rss_bytes": s.rss_bytes, "cpu_seconds": s.cpu_seconds,
                      "tables": {t.name: {"rows": t.rows, "bytes": t.bytes,
                                          "candidates": t.candidates, "evicted": t.evicted}
                                 for t in s.tables}}
                     for s in ctx.client.ps_stats()]
    path = os.path.join(os.environ["DEEPREC_STATE_DIR"], f"bench-{ctx.worker_id}.json")
    with open(path, "w") as f:
        json.dump(out, f)
    ctx.close()
    sys.stdout.flush()
    os._exit(0)


def ensure_data(rows: int) -> list[str]:
    from examples.criteo.generate import generate
    out = os.path.join(REPO, "runs", "bench-estimate-data", f"rows{rows}")
    done = os.path.join(out, "done.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)["train"]
    res = generate(out, rows, files=2, test_rows=0, seed=11)
    with open(done, "w") as f:
        json.dump(res, f)
    return res["train"]


def run_config(name: str, timeout: float, sample_records: int) -> dict:
    import yaml

    import graph_opt
    from aimaster.config import load_job
    from graph_opt.plan import PlanInputs
    dim, opt, records, n_ps, n_workers = CONFIGS[name]
    files = ensure_data(records)
    state = os.path.join(REPO, "runs", f"bench-estimate-{name}")
    os.makedirs(state, exist_ok=True)
    for f in os.listdir(state):
        if f.startswith("bench-") and f.endswith(".json"):
            os.remove(os.path.join(state, f))
    job = {"name": f"bench-estimate-{name}", "num_slots": 4096,
           "ps": {"replicas": n_ps}, "worker": {"replicas": n_workers, "command": [
               "{python}", os.path.join(REPO, "bench", "bench_estimate.py"), "--_worker",
               "--dim", str(dim), "--optimizer", opt,
               "--policies", json.dumps(POLICIES.get(name, {}))]},
           "data": {"files": files, "records_per_shard": 20000, "epochs": 1},
           "master": {"state_dir": state, "progress_seconds": 5}}
    job_file = os.path.join(state, "job.yaml")
    with open(job_file, "w") as f:
        yaml.safe_dump(job, f)

    t0 = time.monotonic()
    est = graph_opt.estimate("bench.bench_estimate:build_model",
                             fn_kwargs={"dim": dim, "optimizer": opt, **POLICIES.get(name, {})},
                             job=load_job(job_file),
                             parse="examples.criteo.reader:parse_lines",
                             sample_records=sample_records,
                             plan_inputs=PlanInputs(ps=n_ps, workers=n_workers))
    est_seconds = time.monotonic() - t0

    log = open(os.path.join(state, "aimaster.log"), "wb")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "aimaster.cli", "run", job_file], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        raise RuntimeError(f"config {name}: job did not finish in {timeout}s (see {log.name})")
    finally:
        log.close()
    path = os.path.join(state, "bench-worker-0.json")
    if code != 0 or not os.path.exists(path):
        raise RuntimeError(f"config {name}: job exited {code}; see {log.name}")
    with open(path) as f:
        measured = json.load(f)
    rss = [p["rss_bytes"] for p in measured["ps"]]
    rows = {t: sum(p["tables"].get(t, {}).get("rows", 0) for p in measured["ps"])
            for t in ("embedding", "linear")}
    e = est.plan.ps.estimated_rss_bytes
    return {"config": name, "dim": dim, "optimizer": opt, "records": records, "ps": n_ps,
            "workers": n_workers, "estimate_bytes": e, "measured_rss_bytes": rss,
            "ratio": [round(e / r, 3) for r in rss],
            "estimated_rows": {t.name: t.rows for t in est.tables}, "measured_rows": rows,
            "policies": POLICIES.get(name, {}),
            "estimated_candidates": {t.name: t.candidate_rows for t in est.tables},
            "measured_candidates": {t: sum(p["tables"].get(t, {}).get("candidates", 0)
                                           for p in measured["ps"]) for t in ("embedding",)},
            "evicted": sum(p["tables"].get("embedding", {}).get("evicted", 0)
                           for p in measured["ps"]),
            "rows_reason": {t.name: t.rows_reason for t in est.tables if t.rows_reason},
            "rows_all_ids": {t.name: t.rows_all_ids for t in est.tables if t.rows_all_ids},
            "ps_cpu_seconds": [p["cpu_seconds"] for p in measured["ps"]],
            "samples": measured["samples"], "worker_rss_bytes": measured["worker_rss_bytes"],
            "estimate_seconds": round(est_seconds, 1),
            "job_seconds": round(time.monotonic() - t0, 1), "ps_memory": est.ps_memory}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--sample-records", type=int, default=1_000_000)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "estimate.json"))
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--policies", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        return worker_main(args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    load = os.getloadavg()
    results = [run_config(n, args.timeout, args.sample_records) for n in names]
    mib = 2 ** 20
    print(f"\n{'cfg':4} {'dim':>4} {'opt':8} {'records':>8} {'PS':>3} {'rows est/meas':>17} "
          f"{'estimate MiB':>13} {'measured MiB (per PS)':>22} {'est/meas':>9}")
    ok = True
    for r in results:
        er, mr = r["estimated_rows"]["embedding"], r["measured_rows"]["embedding"]
        meas = ", ".join(f"{x / mib:.1f}" for x in r["measured_rss_bytes"])
        ratios = ", ".join(f"{x:.2f}" for x in r["ratio"])
        print(f"{r['config']:4} {r['dim']:>4} {r['optimizer']:8} {r['records']:>8,} {r['ps']:>3} "
              f"{er:>8,}/{mr:<8,} {r['estimate_bytes'] / mib:>13.1f} {meas:>22} {ratios:>9}")
        if r["policies"]:
            print(f"     {r['policies']}: embedding of {r['rows_all_ids'].get('embedding', 0):,} "
                  f"distinct ids; candidates est/meas {r['estimated_candidates']['embedding']:,}/"
                  f"{r['measured_candidates']['embedding']:,}; evicted {r['evicted']:,}")
        ok &= all(abs(x - 1) <= TARGET for x in r["ratio"])
    print(f"target: every estimate within {TARGET:.0%} of the measured RSS: "
          f"{'PASS' if ok else 'MISS'}  (load average before {load[0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "load_before": load,
                   "load_after": os.getloadavg(), "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
