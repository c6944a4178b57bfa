"""The model as an output (issue 14): export cost, warm start vs cold start, and what the
final checkpoint adds to a job, all in ONE run.

    .venv/bin/python bench/bench_model_output.py [--rows 1000000,4000000] \
        [--out bench/results/model-output.json] [--skip-job]

(a) Export, per table size (one table ``emb``, dim 16, Adagrad, ids spread over int64):
    a full checkpoint is written in this process (``CheckpointWriter`` of an in-memory
    table), then ``aimaster export CKPT --out DIR --json`` runs as a subprocess (the way a
    user runs it; TensorFlow import included in the wall time, and reported apart from the
    export's own ``seconds``). Reported: rows/s and MB/s of the SavedModel written, and
    the same bytes copied by ``shutil.copyfile`` (the exported ``variables.data`` file, page
    cache warm) as this machine's raw copy speed; float16 as well.
(b) Time to first step, warm vs cold, per size: a PS-only job (2 PS) started by
    ``aimaster run --workers 0`` with and without ``init_from`` of that checkpoint; the
    time from launch to the first completed lookup + push of 4096 existing ids by a
    client (connect, create_table included). Cold starts an empty table.
(c) The final checkpoint's cost: the example DeepFM job (2 PS + 2 workers, 100k
    records) with ``checkpoint.on_success`` true and false, alternated twice; the job's
    wall time and the final ``checkpoint`` event's duration.

The machine is a shared 2-core VM: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
for _p in (REPO, BENCH):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import yaml  # noqa: E402

import bench_migration as bm  # noqa: E402

DIM, OPTIMIZER, INITIALIZER = bm.DIM, bm.OPTIMIZER, bm.INITIALIZER


def log(msg: str) -> None:
    print(msg, flush=True)


def write_checkpoint(root: str, rows: int) -> str:
    from checkpoint import CheckpointWriter
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    t = store.create_table("emb", DIM, INITIALIZER, OPTIMIZER, initial_capacity=rows)
    ids = bm.make_ids(rows, 1)
    rng = np.random.default_rng(2)
    for s in range(0, rows, 1 << 20):
        k = ids[s:s + (1 << 20)]
        t.import_rows(k, rng.normal(0, 0.05, (k.size, t.row_width)).astype(np.float32))
    w = CheckpointWriter(root, 1, "full", num_slots=4096)
    w.write_table("ps-0", t)
    w.add_extra({"job": "bench", "global_step": 1})
    w.commit()
    return os.path.join(root, "ckpt-00000001-full")


def export(ckpt: str, out: str, dtype: str) -> dict:
    start = time.perf_counter()
    r = subprocess.run([*bm.aimaster_exe(), "export", ckpt, "--out", out, "--dtype", dtype,
                        "--json"], cwd=REPO, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    s = json.loads(r.stdout.strip().splitlines()[-1])
    s["wall_seconds"] = round(wall, 3)
    return s


def raw_copy(model_dir: str) -> dict:
    var_dir = os.path.join(model_dir, "variables")
    data = max((os.path.join(var_dir, f) for f in os.listdir(var_dir)), key=os.path.getsize)
    dst = data + ".copy"
    best = None
    for _ in range(3):
        start = time.perf_counter()
        shutil.copyfile(data, dst)
        el = time.perf_counter() - start
        best = el if best is None else min(best, el)
        os.remove(dst)
    size = os.path.getsize(data)
    return {"bytes": size, "seconds": round(best, 3), "mb_per_s": round(size / best / 1e6, 1)}


def first_step(rows_ids: np.ndarray, init_from: str | None, state_dir: str) -> dict:
    from deeprec_ext import PSClient
    overrides = {"ps": {"replicas": 2, "max_replicas": 2}}
    if init_from:
        overrides["init_from"] = init_from
    t0 = time.perf_counter()
    job = bm.PsJob(state_dir, "bench-warm" if init_from else "bench-cold", 600,
                   job_overrides=overrides)
    try:
        c = PSClient.connect(job.address, timeout=600)
        c.create_table("emb", DIM, initializer=INITIALIZER, optimizer=OPTIMIZER)
        ids = rows_ids[:4096]
        c.lookup("emb", ids)
        c.push("emb", ids, np.zeros((ids.size, DIM), np.float32))
        took = time.perf_counter() - t0
        ev = [e for e in job.state().get("events", []) if e["kind"] == "warm_start"]
        c.close()
    finally:
        job.stop()
    return {"seconds_to_first_step": round(took, 3),
            "restore_ms": ev[0]["duration_ms"] if ev else None,
            "rows_restored": ev[0]["rows"] if ev else 0}


def deepfm_job(data: dict, on_success: bool, state_dir: str) -> dict:
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    job = {"name": "bench-final", "ps": {"replicas": 2},
           "worker": {"replicas": 2, "command": ["{python}", "-m", "examples.criteo.train"]},
           "data": {"files": data["train"], "records_per_shard": 10_000},
           "checkpoint": {"on_success": on_success},
           "master": {"state_dir": state_dir, "progress_seconds": 5}}
    path = os.path.join(state_dir, "job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    start = time.perf_counter()
    r = subprocess.run([*bm.aimaster_exe(), "run", path], cwd=REPO, capture_output=True,
                       text=True, timeout=1800,
                       env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-2000:])
    from aimaster.state import load_state
    state = load_state(state_dir)
    ck = [e for e in state["events"] if e["kind"] == "checkpoint"]
    return {"wall_seconds": round(wall, 2), "final_checkpoint_ms": ck[-1]["duration_ms"] if ck
            else None, "final_checkpoint_bytes": ck[-1]["bytes"] if ck else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1000000,4000000")
    p.add_argument("--out", default=os.path.join(BENCH, "results", "model-output.json"))
    p.add_argument("--skip-job", action="store_true", help="skip (c), the DeepFM jobs")
    args = p.parse_args(argv)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
              "cpus": os.cpu_count(), "sizes": {}}
    work = tempfile.mkdtemp(prefix="bench-model-output-")
    try:
        for rows in [int(x) for x in args.rows.split(",")]:
            label = f"{rows / 1e6:g}M"
            log(f"== {label} rows: writing a full checkpoint")
            ckpt = write_checkpoint(os.path.join(work, f"ckpt-{label}"), rows)
            size = {}
            for dtype in ("float32", "float16"):
                out = os.path.join(work, f"export-{label}-{dtype}")
                s = export(ckpt, out, dtype)
                size[dtype] = {"export_seconds": s["seconds"], "wall_seconds": s["wall_seconds"],
                               "bytes": s["bytes"],
                               "rows_per_s": round(rows / s["seconds"]),
                               "mb_per_s": round(s["bytes"] / s["seconds"] / 1e6, 1)}
                if dtype == "float32":
                    size["raw_copy"] = raw_copy(out)
                    size["float32"]["vs_raw_copy"] = round(
                        size["float32"]["mb_per_s"] / size["raw_copy"]["mb_per_s"], 3)
                shutil.rmtree(out, ignore_errors=True)
                log(f"   export {dtype}: {json.dumps(size[dtype])}")
            log(f"   raw copy: {json.dumps(size['raw_copy'])}")
            ids = bm.make_ids(rows, 1)
            cold = first_step(ids, None, os.path.join(work, f"cold-{label}"))
            warm = first_step(ids, ckpt, os.path.join(work, f"warm-{label}"))
            size["cold_start"], size["warm_start"] = cold, warm
            size["warm_vs_cold"] = round(warm["seconds_to_first_step"]
                                         / cold["seconds_to_first_step"], 2)
            log(f"   time to first step: cold {cold}, warm {warm}")
            result["sizes"][label] = size
            shutil.rmtree(os.path.dirname(ckpt), ignore_errors=True)
        if not args.skip_job:
            from examples.criteo.generate import generate
            data = generate(os.path.join(work, "data"), rows=100_000, files=2, seed=1)
            runs = []
            for on in (True, False, True, False):
                r = deepfm_job(data, on, os.path.join(work, "job"))
                r["on_success"] = on
                runs.append(r)
                log(f"   DeepFM job, final checkpoint {on}: {json.dumps(r)}")
            with_ck = [r["wall_seconds"] for r in runs if r["on_success"]]
            without = [r["wall_seconds"] for r in runs if not r["on_success"]]
            result["final_checkpoint"] = {
                "runs": runs, "median_extra_seconds": round(float(np.median(with_ck)
                                                                  - np.median(without)), 2),
                "checkpoint_ms": [r["final_checkpoint_ms"] for r in runs if r["on_success"]]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    log(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
