"""Training throughput with evaluation while training on vs off (docs/guide-eval.md).

Runs the example DeepFM job (``examples.criteo.train``, unchanged) with ``aimaster run``,
alternately without and with an ``eval`` section, and compares the workers' samples/s
(``samples / train_seconds`` of ``metrics-worker-*.json``: the training loop's wall time).

    .venv/bin/python bench/bench_eval.py [--mode keras|tf1] [--rows 300000] [--eval-rows 20000] \
        [--every-seconds 5] [--repeat 3] [--ps 1 --workers 1] [--out bench/results/eval.json]

Every run writes its job under ``runs/bench-eval-<mode>-<on|off>-<i>/``. On one machine the
evaluator shares the CPU with the PS and the workers (on Kubernetes it is a pod of its own);
it runs at a lower CPU priority (nice 10), as it should yield to training.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_data(rows: int, eval_rows: int, seed: int = 5) -> dict:
    out = os.path.join(REPO, "runs", "bench-data", f"eval-rows{rows}-eval{eval_rows}-seed{seed}")
    meta = os.path.join(out, "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            return json.load(f)
    from examples.criteo.generate import generate
    res = generate(out, rows, files=2, test_rows=eval_rows, seed=seed)
    data = {"train": res["train"], "eval": res["test"]}
    with open(meta, "w") as f:
        json.dump(data, f)
    return data


def run_job(tag: str, data: dict, args, with_eval: bool) -> dict:
    state_dir = os.path.join(REPO, "runs", f"bench-eval-{args.mode}-{tag}")
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    job = {"name": f"bench-eval-{tag}", "ps": {"replicas": args.ps},
           "worker": {"replicas": args.workers, "max_restarts": 0,
                      "command": ["{python}", "-m", "examples.criteo.train", "--mode", args.mode,
                                  "--batch-size", str(args.batch_size)]},
           "data": {"files": data["train"], "bytes_per_shard": 4 << 20},
           "checkpoint": {"on_success": False},
           "master": {"state_dir": state_dir, "progress_seconds": 60}}
    if with_eval:
        job["eval"] = {"files": [data["eval"]], "every_seconds": args.every_seconds}
    import yaml
    path = os.path.join(state_dir, "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    with open(os.path.join(state_dir, "aimaster.out"), "wb") as log:
        code = subprocess.run([sys.executable, "-m", "aimaster.cli", "run", path,
                               "--log-level", "WARNING"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if code != 0:
        raise RuntimeError(f"{tag}: aimaster exited with {code}; see {state_dir}")
    metrics = [json.load(open(p)) for p in
               sorted(glob.glob(os.path.join(state_dir, "metrics-worker-*.json")))]
    samples = sum(m["samples"] for m in metrics)
    seconds = max(m["train_seconds"] for m in metrics)
    out = {"tag": tag, "eval": with_eval, "samples": samples, "train_seconds": seconds,
           "samples_per_second": samples / seconds}
    if with_eval:
        points = [json.loads(line) for line in open(os.path.join(state_dir, "eval.jsonl"))]
        out.update(eval_rounds=len(points), eval_rounds_during=sum(not p["final"] for p in points),
                   final_auc=points[-1]["auc"] if points else None,
                   eval_round_seconds=statistics.mean(p["seconds"] for p in points) if points else None,
                   # load-independent: CPU the evaluator spent in rounds during training,
                   # per second of training (cores)
                   eval_cpu_cores=sum(p["cpu_seconds"] or 0 for p in points if not p["final"])
                   / seconds)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("keras", "tf1"), default="keras",
                   help="the example's training loop: model.fit or MonitoredTrainingSession")
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--eval-rows", type=int, default=20_000)
    p.add_argument("--every-seconds", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    data = ensure_data(args.rows, args.eval_rows)
    runs = []
    for i in range(args.repeat):  # alternate, so drift on a shared machine hits both
        for with_eval in ((False, True) if i % 2 == 0 else (True, False)):
            r = run_job(f"{'on' if with_eval else 'off'}-{i}", data, args, with_eval)
            print(json.dumps(r), flush=True)
            runs.append(r)
    off = [r["samples_per_second"] for r in runs if not r["eval"]]
    on = [r["samples_per_second"] for r in runs if r["eval"]]
    pairs = [b["samples_per_second"] / a["samples_per_second"]  # on / off, run next to each other
             for a, b in zip(runs[::2], runs[1::2])]
    pairs = [p if not runs[2 * i]["eval"] else 1 / p for i, p in enumerate(pairs)]
    summary = {"off_median": statistics.median(off), "on_median": statistics.median(on),
               "ratio_on_off": statistics.median(on) / statistics.median(off),
               "pair_ratios_on_off": pairs,
               "eval_cpu_cores_median": statistics.median(r["eval_cpu_cores"] for r in runs if r["eval"]),
               "mode": args.mode, "rows": args.rows, "eval_rows": args.eval_rows,
               "every_seconds": args.every_seconds, "ps": args.ps, "workers": args.workers,
               "batch_size": args.batch_size, "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
