"""AUC cost of float16 embedding storage (issue 17, item 4): the Criteo DeepFM example
(examples/criteo, Keras, adam on the PS) trained twice on the same synthetic data with the
same seeds, once with float32 and once with float16 value storage, 2 PS + 1 worker (one
worker: the same batch order in both runs). Test AUC of each, and the difference.

    python bench/bench_fp16_auc.py [--rows 300000] [--out bench/results/fp16-auc.json]

The two jobs run at the same time (AUC, not speed, is measured).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def start(work: Path, dtype: str, data: dict, batch: int) -> subprocess.Popen:
    d = work / dtype
    d.mkdir()
    job = {"name": f"fp16-auc-{dtype}", "ps": {"replicas": 2},
           "worker": {"replicas": 1,
                      "command": ["{python}", "-m", "examples.criteo.train", "--batch-size",
                                  str(batch), "--test", data["test"],
                                  "--storage-dtype", dtype]},
           "data": {"files": data["train"], "records_per_shard": 10000, "epochs": 1},
           "master": {"state_dir": str(d / "state"), "progress_seconds": 10}}
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, "-m", "aimaster.cli", "run", str(d / "job.yaml")],
                            cwd=ROOT, env=env, stdout=open(d / "aimaster.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--test-rows", type=int, default=30_000)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from examples.criteo.generate import generate
    work = Path(tempfile.mkdtemp(prefix="fp16-auc-"))
    data = generate(str(work / "data"), rows=args.rows, files=2, test_rows=args.test_rows,
                    seed=args.seed)
    t0 = time.monotonic()
    procs = {dt: start(work, dt, data, args.batch_size) for dt in ("float32", "float16")}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": args.rows,
           "test_rows": args.test_rows, "batch_size": args.batch_size, "seed": args.seed,
           "ps": 2, "workers": 1, "model": "examples/criteo DeepFM, dim 8, adam lr 0.001"}
    for dt, proc in procs.items():
        code = proc.wait(max(1.0, args.timeout - (time.monotonic() - t0)))
        if code != 0:
            print(f"{dt} job failed ({code}), see {work / dt / 'aimaster.log'}", file=sys.stderr)
            return 1
        m = json.loads((work / dt / "state" / "metrics-worker-0.json").read_text())
        out[dt] = {"auc": m["auc"], "samples": m["samples"], "final_loss": m["final_loss"]}
    out["auc_difference"] = out["float16"]["auc"] - out["float32"]["auc"]
    out["within_0.002"] = abs(out["auc_difference"]) <= 0.002
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
