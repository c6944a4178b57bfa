"""One step's PS calls, waited pushes against the push carried in the next lookup.

    .venv/bin/python bench/bench_carry_calls.py [--steps 300] [--rounds 3]

A real PS (``aimaster run --ps 1 --workers 0``), this process as the worker's client, no
TensorFlow: DeepFM batches from the bench_training data (26 ids a row, batch 1024, both
tables looked up with the step's unique ids), Adam on the PS, DeepFM's 8 dense variables
as ``assign_add`` tables whose merged values every push returns. Per step:

- ``waited`` (``ElasticCallback()``): ``lookup_many`` of both tables, then one
  ``push_many`` of the embedding gradients and the dense deltas: 2 RPCs;
- ``carry`` (``overlap="carry"``): ``lookup_with_push``, carrying the previous step's
  push: 1 RPC.

Both modes alternate, ``--rounds`` times each, on the same batches. Printed per mode:
wall ms a step, the client's CPU ms a step (this process) and the PS job's CPU ms a step
(the PS and the AIMaster).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

DENSE = [(221, 128), (128,), (128, 64), (64,), (64, 1), (1,), (13, 1), (1,)]  # DeepFM's


def _job_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the job's live processes: the AIMaster ``pid`` and
    every process under it (the PS)."""
    import psutil
    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400_000, help="which bench_training data set")
    ap.add_argument("--steps", type=int, default=300, help="timed steps a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternated")
    ap.add_argument("--out", default="", help="JSON results")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_training import ensure_data
    from examples.criteo.reader import criteo_dataset

    data = ensure_data(args.rows, 2, 1)
    warm = 20
    batches = [np.unique(f["cat"].numpy().ravel()) for _, (f, _) in
               zip(range(args.steps + warm), criteo_dataset(data["train"], 1024))]
    print(f"{args.steps} timed steps, {np.mean([b.size for b in batches]):,.0f} unique ids a "
          f"step; {args.rounds} rounds of each mode, alternated", flush=True)

    state = tempfile.mkdtemp(prefix="bench-carry-")
    job = os.path.join(state, "job.yaml")
    with open(job, "w") as f:
        f.write("name: bench-carry\nps: {replicas: 1}\n")
    exe = os.path.join(os.path.dirname(sys.executable), "aimaster")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "aimaster.cli"]) + \
        ["run", job, "--ps", "1", "--workers", "0", "--state-dir", state, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    results = {"waited": [], "carry": []}
    try:
        line = proc.stdout.readline().decode()
        if "listening on " not in line:
            raise RuntimeError(f"aimaster did not start: {line!r}")
        address = line.split("listening on ")[1].split()[0]
        from deeprec_ext import PSClient
        client = PSClient.connect(address, timeout=60)
        opt = {"name": "adam", "learning_rate": 1e-3}
        client.create_table("embedding", 8, initializer="zeros", optimizer=opt)
        client.create_table("linear", 1, initializer="zeros", optimizer=opt)
        dense_ids, dense_names = {}, []
        for i, shape in enumerate(DENSE):
            rows, dim = (shape[0], shape[1]) if len(shape) > 1 else (1, shape[0])
            name = f"dense/{i}"
            client.create_table(name, dim, initializer="zeros", optimizer={"name": "assign_add"})
            dense_ids[name] = (np.arange(rows, dtype=np.int64), dim)
            dense_names.append(name)

        def update(u):  # one step's push: embedding gradients and dense deltas
            out = {"embedding": (u, np.full((u.size, 8), 1e-3, np.float32)),
                   "linear": (u, np.full((u.size, 1), 1e-3, np.float32))}
            for name, (ids, dim) in dense_ids.items():
                out[name] = (ids, np.full((ids.size, dim), 1e-6, np.float32))
            return out

        updates = [update(u) for u in batches]  # built before timing: both modes alike

        def waited(k):
            client.lookup_many({"embedding": batches[k], "linear": batches[k]}, unique=True)
            client.push_many(updates[k], unique=True, return_tables=dense_names)

        def carry(k):
            prev = updates[k - 1] if k else {}
            client.lookup_with_push({"embedding": batches[k], "linear": batches[k]}, prev,
                                    return_tables=dense_names)

        for k in range(warm):
            waited(k)
        for r in range(args.rounds):
            for mode, step in (("waited", waited), ("carry", carry)):
                if mode == "carry":
                    step(warm)  # its first step carries nothing: not timed
                rpcs = client.stats["rpcs"]
                ps0, me0, t0 = _job_cpu(proc.pid), time.process_time(), time.perf_counter()
                for k in range(warm + 1, warm + args.steps):
                    step(k)
                if mode == "carry":  # the last push is flushed, as at the end of training
                    client.push_many(updates[warm + args.steps - 1], unique=True,
                                     return_tables=dense_names)
                n = args.steps - 1
                res = {"wall_ms": 1e3 * (time.perf_counter() - t0) / n,
                       "client_cpu_ms": 1e3 * (time.process_time() - me0) / n,
                       "ps_cpu_ms": 1e3 * (_job_cpu(proc.pid) - ps0) / n,
                       "rpcs_per_step": (client.stats["rpcs"] - rpcs) / n}
                results[mode].append(res)
                print(f"round {r + 1} {mode:6s}: wall {res['wall_ms']:.2f} ms/step, client CPU "
                      f"{res['client_cpu_ms']:.2f}, PS CPU {res['ps_cpu_ms']:.2f}, "
                      f"{res['rpcs_per_step']:.2f} RPCs/step", flush=True)
        client.close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(state, ignore_errors=True)
    for key in ("wall_ms", "client_cpu_ms", "ps_cpu_ms"):
        ratios = [c[key] / w[key] for w, c in zip(results["waited"], results["carry"])]
        print(f"carry / waited, {key}: " + " / ".join(f"{x:.3f}" for x in ratios))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": args.steps, "results": results,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
