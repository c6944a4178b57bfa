"""Training throughput of the example DeepFM: ours vs single-process Keras vs TF's
ParameterServerStrategy, all measured in ONE run and printed as ratios.

    .venv/bin/python bench/bench_training.py [--rows 400000] [--batch-size 1024] \
        [--out bench/results/training.json] [--profile]

Configurations (same DeepFM: dim 8, hidden (128, 64), Adam lr 1e-3, same data, same batch):

  single    one process, ``keras.layers.Embedding`` over ids reduced modulo ``--vocab``
            (default 2**18 = 262,144: the smallest power of two >= the 207,437 distinct
            categorical values of the synthetic data), ``model.fit`` on
            ``examples.criteo.reader.criteo_dataset``
  single@V  the same with ``--extra-vocab`` (default 2**20), informational only
  tf-pss    ``tf.distribute.experimental.ParameterServerStrategy``: 1 worker + 1 PS
            ``tf.distribute.Server`` subprocesses on free 127.0.0.1 ports, a coordinator
            process (the "chief"), local Keras Embedding (vocab ``--vocab``) whose
            variables live on the PS, custom loop of ``ClusterCoordinator.schedule`` over a
            per-worker dataset
  tf-pss-x10  the same with 10 steps inside each scheduled ``tf.function`` (fewer
            coordinator round trips; TF's own advice for small steps), informational only
  ours-1x1  ``aimaster run <job> --ps 1 --workers 1`` running examples/criteo/train.py
  ours-2x2  ``aimaster run <job> --ps 2 --workers 2``

Every configuration runs in its own process group (killed on ``--timeout``), so no TF
state leaks between them. Throughput is *steady-state*: samples trained after the first
``--warmup-steps`` steps divided by the time they took (graph tracing, process start-up,
table creation are excluded). For several workers the window is the interval in which
all of them train (from the last worker's warm-up end to the first worker's last step)
and the samples of all workers in that window are summed. The end-to-end figure (total
samples / time of the training call, i.e. the worker-reported ``train_seconds`` for ours)
is printed next to it.

``--profile`` adds one more ours 1+1 run with per-call wall-clock accounting of the PS
client in the worker and, if ``py-spy`` is installed in the venv, sampling profiles of the
worker and PS processes (``runs/bench-ours-1x1-profile/py-spy-*.txt``, summarized).

For ours the worker command is this file with ``--_ours-worker``: it runs
``examples.criteo.train.main`` unchanged, only subclassing ``ElasticCallback`` to record a
timestamp after every step (and, with ``--profile``, timing the PS client calls).

Data: ``examples.criteo.generate.generate`` into ``runs/bench-data/`` (cached).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TARGET_VS_PSS = 2.0
TARGET_VS_SINGLE = 0.7
DIM = 8
HIDDEN = (128, 64)


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------

def ensure_data(rows: int, files: int, seed: int) -> dict:
    """Generate (once) the synthetic training files; returns {"dir", "train": [paths]}."""
    out = os.path.join(REPO, "runs", "bench-data", f"criteo-rows{rows}-files{files}-seed{seed}")
    meta_path = os.path.join(out, "meta.json")
    want = {"rows": rows, "files": files, "seed": seed}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("params") == want and all(os.path.exists(p) for p in meta["train"]):
            return {"dir": out, "train": meta["train"], "generated": False}
    from examples.criteo.generate import generate
    t0 = time.time()
    print(f"generating {rows:,} synthetic Criteo rows into {os.path.relpath(out, REPO)} ...",
          flush=True)
    res = generate(out, rows, files=files, test_rows=0, seed=seed)
    with open(meta_path + ".tmp", "w") as f:
        json.dump({"params": want, "train": res["train"],
                   "seconds": round(time.time() - t0, 2)}, f, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    return {"dir": out, "train": res["train"], "generated": True}


# ----------------------------------------------------------------------------------------
# steady-state throughput from per-step (time, cumulative samples) series
# ----------------------------------------------------------------------------------------

def steady_rate(series_list: list, warmup_steps: int) -> dict:
    """``series_list``: one [(t, cumulative_samples)] per worker (one point per step).

    Window = [max over workers of the end of step ``warmup_steps``, min over workers of the
    end of their last step]; samples of every worker inside it (linear interpolation
    between step ends) / window length.
    """
    import numpy as np
    series = [np.asarray(s, dtype=np.float64) for s in series_list if len(s)]
    if not series or any(len(s) <= warmup_steps + 1 for s in series):
        return {"samples_per_s": None, "reason": "too few steps after warm-up"}
    t0 = max(s[warmup_steps - 1, 0] if warmup_steps else s[0, 0] for s in series)
    t1 = min(s[-1, 0] for s in series)
    if t1 <= t0:
        return {"samples_per_s": None, "reason": "workers' training intervals do not overlap"}
    samples = sum(float(np.interp(t1, s[:, 0], s[:, 1]) - np.interp(t0, s[:, 0], s[:, 1]))
                  for s in series)
    return {"samples_per_s": samples / (t1 - t0), "window_seconds": t1 - t0,
            "window_samples": samples}


# ----------------------------------------------------------------------------------------
# children (each configuration runs in its own process)
# ----------------------------------------------------------------------------------------

def _tf_quiet():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def child_single(args) -> dict:
    """Single-process Keras: local Embedding, model.fit on criteo_dataset."""
    _tf_quiet()
    import keras
    from examples.criteo.model import build_deepfm
    from examples.criteo.reader import criteo_dataset

    files = args.files_list
    model = build_deepfm(dim=DIM, hidden=HIDDEN, vocab_size=args.vocab)
    model.compile(optimizer=keras.optimizers.Adam(args.lr), loss="binary_crossentropy")
    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.time())

    ds = criteo_dataset(files, args.batch_size, vocab_size=args.vocab)
    start = time.time()
    hist = model.fit(ds, epochs=1, verbose=0, callbacks=[Stamp()], shuffle=False)
    fit_seconds = time.time() - start
    rows, b = args.rows, args.batch_size
    cum, series = 0, []
    for i, t in enumerate(stamps):
        cum += min(b, rows - i * b)
        series.append((t, cum))
    return {"series": [series], "samples": cum, "fit_seconds": fit_seconds,
            "steps": len(stamps), "final_loss": float(hist.history["loss"][-1]),
            "jit_compile": bool(model.jit_compile)}


_SERVER_CODE = r"""
import ctypes, json, os, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the coordinator
except OSError:
    pass
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
cluster, job = json.loads(sys.argv[1]), sys.argv[2]
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=0,
                              protocol="grpc", start=True)
print("ready", flush=True)
server.join()
"""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def child_pss(args) -> dict:
    """tf.distribute ParameterServerStrategy, 1 worker + 1 PS, coordinator = this process."""
    _tf_quiet()
    chief, worker, ps = _free_ports(3)
    cluster = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"],
               "ps": [f"127.0.0.1:{ps}"]}
    procs = []
    try:
        for job in ("worker", "ps"):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _SERVER_CODE, json.dumps(cluster), job],
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL))
        deadline = time.time() + 120
        for p in procs:  # wait for "ready" from each server
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"tf.distribute.Server exited with {p.returncode}")
                r, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.time()))
                if not r:
                    raise TimeoutError("tf.distribute.Server did not start in 120 s")
                if p.stdout.readline().strip() == b"ready":
                    break

        import keras
        import tensorflow as tf
        from examples.criteo.model import build_deepfm
        from examples.criteo.reader import criteo_dataset

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        files, b, vocab = args.files_list, args.batch_size, args.vocab

        def dataset_fn():
            return criteo_dataset(files, b, vocab_size=vocab, drop_remainder=True).repeat()

        with strategy.scope():
            model = build_deepfm(dim=DIM, hidden=HIDDEN, vocab_size=vocab)
            optimizer = keras.optimizers.Adam(args.lr)
        devices = sorted({v.value.device for v in model.trainable_variables})
        loss_fn = keras.losses.BinaryCrossentropy()
        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        iterator = iter(per_worker)

        inner = max(1, args.pss_inner_steps)

        def replica_fn(batch):
            features, label = batch
            with tf.GradientTape() as tape:
                prob = model(features, training=True)
                loss = loss_fn(tf.reshape(label, [-1, 1]), prob)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def train_step(it):  # one scheduled function = one step (the baseline) ...
            return strategy.run(replica_fn, args=(next(it),))

        @tf.function
        def train_steps(it):  # ... or `inner` steps per scheduled function (informational)
            loss = tf.constant(0.0)
            for _ in tf.range(inner):
                loss = strategy.run(replica_fn, args=(next(it),))
            return loss

        fn = train_step if inner == 1 else train_steps
        calls = max(2, (args.rows // b) // inner)
        warm = min(max(1, args.warmup_steps // inner), calls - 1)
        start = time.time()
        for _ in range(warm):
            coordinator.schedule(fn, args=(iterator,))
        coordinator.join()
        t0 = time.time()
        last = None
        for _ in range(calls - warm):
            last = coordinator.schedule(fn, args=(iterator,))
        coordinator.join()
        t1 = time.time()
        loss = float(last.fetch()) if last is not None else None
        per = inner * b
        return {"series": [[(t0, warm * per), (t1, calls * per)]], "samples": calls * per,
                "fit_seconds": t1 - start, "steps": calls * inner, "final_loss": loss,
                "variable_devices": devices, "pre_warmed": True, "inner_steps": inner}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


# ----------------------------------------------------------------------------------------
# ours: the worker wrapper (runs inside the aimaster-launched worker process)
# ----------------------------------------------------------------------------------------

def ours_worker(argv: list[str]) -> int:
    """Run examples.criteo.train.main(argv) with a per-step timestamp recorder."""
    _tf_quiet()
    import deeprec_ext.tf as dtf
    from deeprec_ext.worker import get_context
    import examples.criteo.train as train

    profile = bool(os.environ.get("BENCH_PROFILE"))
    prof = _install_profiler() if profile else None
    series: list[tuple[float, int]] = []
    base = dtf.ElasticCallback

    class TimedElasticCallback(base):
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            series.append((time.time(), get_context().session.samples))
            if prof is not None:
                prof["step_ends"].append(time.perf_counter())

        def _sync(self):
            if prof is None:
                return super()._sync()
            t = time.perf_counter()
            try:
                return super()._sync()
            finally:
                prof["dense_sync_total"] += time.perf_counter() - t

        def on_train_end(self, logs=None):
            super().on_train_end(logs)
            ctx = get_context()
            out = {"worker": ctx.worker_id, "series": series}
            if prof is not None:
                out["profile"] = _summarize_profile(prof)
            path = os.path.join(os.environ.get("DEEPREC_STATE_DIR", "."),
                                f"bench-steps-{ctx.worker_id}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(path + ".tmp", path)

    dtf.ElasticCallback = TimedElasticCallback
    return train.main(argv)


def _install_profiler() -> dict:
    """Wall-clock accounting of the PS client calls of this worker (opt-in, --profile)."""
    import threading
    from deeprec_ext.client.client import PSClient
    from deeprec_ext.worker import WorkerContext

    prof = {"calls": {}, "step_ends": [], "dense_sync_total": 0.0, "lock": threading.Lock()}

    def add(key, dt):
        with prof["lock"]:
            n, s = prof["calls"].get(key, (0, 0.0))
            prof["calls"][key] = (n + 1, s + dt)

    def kind(names):
        names = list(names)
        return "dense" if names and all(n.startswith("dense/") for n in names) else "+".join(names)

    orig_lookup, orig_push, orig_fan = PSClient.lookup_many, PSClient.push_many, PSClient._fan_out
    orig_shard = WorkerContext.try_next_shard

    def lookup_many(self, requests, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_lookup(self, requests, *args, **kwargs)
        finally:
            add(f"lookup {kind(requests)}", time.perf_counter() - t)

    def push_many(self, updates, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_push(self, updates, *args, **kwargs)
        finally:
            add(f"push {kind(updates)}", time.perf_counter() - t)

    def _fan_out(self, tables, build, method, store, what, *args, **kwargs):
        t = time.perf_counter()
        try:
            return orig_fan(self, tables, build, method, store, what, *args, **kwargs)
        finally:
            add(f"  rpc part of {what} {kind(n for n, _ in tables)}", time.perf_counter() - t)

    def try_next_shard(self):
        t = time.perf_counter()
        try:
            return orig_shard(self)
        finally:
            add("get shard (master RPC)", time.perf_counter() - t)

    PSClient.lookup_many, PSClient.push_many, PSClient._fan_out = lookup_many, push_many, _fan_out
    WorkerContext.try_next_shard = try_next_shard
    return prof


def _summarize_profile(prof: dict) -> dict:
    ends = prof["step_ends"]
    skip = min(20, max(len(ends) - 2, 0))
    steps = len(ends)
    wall = ends[-1] - ends[0] if steps > 1 else 0.0
    return {"steps": steps, "wall_seconds_all_steps": wall,
            "ms_per_step": 1e3 * wall / max(steps - 1, 1),
            "ms_per_step_after_warmup": 1e3 * (ends[-1] - ends[skip]) / max(steps - 1 - skip, 1)
            if steps > skip + 1 else None,
            "dense_sync_ms_per_step": 1e3 * prof["dense_sync_total"] / max(steps, 1),
            "calls": {k: {"count": n, "total_s": s, "ms_per_call": 1e3 * s / max(n, 1),
                          "ms_per_step": 1e3 * s / max(steps, 1)}
                      for k, (n, s) in sorted(prof["calls"].items())}}


# ----------------------------------------------------------------------------------------
# ours: job file + aimaster run
# ----------------------------------------------------------------------------------------

def write_job(path: str, name: str, data_dir: str, args, profile: bool,
              overlap: bool = False) -> None:
    import yaml
    job = {
        "name": name,
        "num_slots": 4096,
        "ps": {"replicas": 1},
        "worker": {
            "replicas": 1,
            "command": ["{python}", os.path.abspath(__file__), "--_ours-worker",
                        "--batch-size", str(args.batch_size), "--dim", str(DIM),
                        "--lr", str(args.lr)] + (["--overlap"] if overlap else []),
            "max_restarts": 0,
            "env": {"BENCH_PROFILE": "1"} if profile else {},
        },
        "data": {"files": [os.path.join(data_dir, "train-*.txt")],
                 "records_per_shard": args.records_per_shard, "epochs": 1},
        "master": {"progress_seconds": 5},
    }
    with open(path, "w") as f:
        f.write("# generated by bench/bench_training.py (like examples/criteo/job.yaml, "
                "bench data, no --test)\n")
        yaml.safe_dump(job, f, sort_keys=False)


def _aimaster_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "aimaster")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "aimaster.cli"]


def run_ours(args, data: dict, ps: int, workers: int, profile: bool = False,
             tag: str | None = None, overlap: bool = False) -> dict:
    tag = tag or f"{ps}x{workers}" + ("-overlap" if overlap else "")
    state_dir = os.path.join(REPO, "runs", f"bench-ours-{tag}")
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    job_path = os.path.join(state_dir, "job.yaml")
    write_job(job_path, f"bench-ours-{tag}", data["dir"], args, profile, overlap)
    cmd = _aimaster_cmd() + ["run", job_path, "--ps", str(ps), "--workers", str(workers),
                             "--state-dir", os.path.relpath(state_dir, REPO),
                             "--log-level", "WARNING"]
    log_path = os.path.join(state_dir, "aimaster.out")
    pyspy = None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            if profile and args.py_spy:
                pyspy = _start_py_spy(state_dir, ps, workers, args.timeout)
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            raise RuntimeError(f"ours {tag}: timed out after {args.timeout}s; see {log_path}")
        finally:
            if proc.poll() is None:
                _stop_group(proc)
            for p in pyspy or []:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    if code != 0:
        raise RuntimeError(f"ours {tag}: aimaster exited with {code}; see {log_path} and "
                           f"{state_dir}/logs/")
    metrics = []
    for path in sorted(glob.glob(os.path.join(state_dir, "metrics-worker-*.json"))):
        with open(path) as f:
            metrics.append(json.load(f))
    steps = []
    for path in sorted(glob.glob(os.path.join(state_dir, "bench-steps-worker-*.json"))):
        with open(path) as f:
            steps.append(json.load(f))
    if len(metrics) != workers or len(steps) != workers:
        raise RuntimeError(f"ours {tag}: expected {workers} worker metrics files, found "
                           f"{len(metrics)} metrics / {len(steps)} step logs in {state_dir}")
    samples = sum(m["samples"] for m in metrics)
    out = {"series": [s["series"] for s in steps], "samples": samples,
           "fit_seconds": max(m["train_seconds"] for m in metrics),
           "steps": sum(m["steps"] for m in metrics),
           "worker_metrics": metrics, "state_dir": os.path.relpath(state_dir, REPO)}
    if profile:
        out["profile"] = {s["worker"]: s.get("profile") for s in steps}
        if pyspy:
            out["py_spy"] = {os.path.relpath(p, REPO): summarize_py_spy(p)
                             for p in sorted(glob.glob(os.path.join(state_dir, "py-spy-*.txt")))}
    return out


def _start_py_spy(state_dir: str, ps: int, workers: int, timeout: float) -> list:
    """Attach py-spy (raw collapsed stacks) to every PS and worker once they registered."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        print("  (py-spy not installed: skipping sampling profiles)", flush=True)
        return []
    deadline = time.time() + min(timeout, 120)
    from aimaster.state import load_state
    members = []
    while time.time() < deadline:
        try:
            members = (load_state(state_dir) or {}).get("members", [])
        except (OSError, ValueError, RuntimeError):
            members = []
        if sum(1 for m in members if m["role"] == "ps") >= ps and \
                sum(1 for m in members if m["role"] == "worker") >= workers:
            break
        time.sleep(0.2)
    procs = []
    for m in members:
        out = os.path.join(state_dir, f"py-spy-{m['id']}.txt")
        procs.append(subprocess.Popen(
            [exe, "record", "--pid", str(m["pid"]), "--format", "raw", "--rate", "200",
             "--nonblocking", "--threads", "--output", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def summarize_py_spy(path: str, top: int = 12) -> dict:
    """Share of non-idle samples per function (inclusive), from ``py-spy --format raw``."""
    import collections
    import re
    incl, total = collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")[1:]  # first frame: thread
            last = frames[-1] if frames else ""
            # threads parked in grpc's completion-queue poll / thread-pool queue are idle
            if re.search(r"^(_serve|_status|_worker|channel_spin|_run_channel_spin_thread|"
                         r"Condition.wait|_wait_once) ", last):
                continue
            n = int(n)
            total += n
            for name in {re.sub(r" \(.*$", "", fr) for fr in frames}:
                incl[name] += n
    keep = [(k, c) for k, c in incl.most_common() if not k.startswith(("Thread.", "_bootstrap",
                                                                        "<module>"))]
    return {"busy_samples": total,
            "top_inclusive": [(k, round(100.0 * c / max(total, 1), 1)) for k, c in keep[:top]]}


def _stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------

def run_child(args, kind: str, vocab: int, data: dict, log_dir: str, inner: int = 1) -> dict:
    result_path = os.path.join(log_dir, f"{kind}-{vocab}-x{inner}.json")
    log_path = os.path.join(log_dir, f"{kind}-{vocab}-x{inner}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, "--_result", result_path,
           "--_files", json.dumps(data["train"]), "--rows", str(args.rows),
           "--batch-size", str(args.batch_size), "--vocab", str(vocab), "--lr", str(args.lr),
           "--warmup-steps", str(args.warmup_steps), "--pss-inner-steps", str(inner)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{kind}: timed out after {args.timeout}s; see {log_path}")
        finally:
            _stop_group(proc)  # also reaps tf.distribute.Server grandchildren
    if not os.path.exists(result_path):
        raise RuntimeError(f"{kind}: no result (exit code {proc.returncode}); see {log_path}")
    with open(result_path) as f:
        return json.load(f)


def _summarize(name: str, raw: dict, warmup: int) -> dict:
    if raw.get("pre_warmed"):  # tf-pss: the child already timed only post-warm-up steps
        s = raw["series"][0]
        steady = {"samples_per_s": (s[1][1] - s[0][1]) / (s[1][0] - s[0][0]),
                  "window_seconds": s[1][0] - s[0][0], "window_samples": s[1][1] - s[0][1]}
    else:
        steady = steady_rate(raw["series"], warmup)
    out = {"config": name, "samples_per_s": steady["samples_per_s"],
           "end_to_end_samples_per_s": raw["samples"] / raw["fit_seconds"],
           "samples": raw["samples"], "steps": raw["steps"], "fit_seconds": raw["fit_seconds"],
           "steady": steady}
    for k in ("final_loss", "worker_metrics", "variable_devices", "jit_compile", "state_dir",
              "profile", "py_spy"):
        if k in raw:
            out[k] = raw[k]
    return out


def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_ours-worker"]:
        return ours_worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000, help="training rows (default 400k)")
    ap.add_argument("--files", type=int, default=2, help="training files to split rows into")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=2 ** 18,
                    help="Keras Embedding vocabulary of the baselines (ids mod vocab)")
    ap.add_argument("--extra-vocab", type=int, default=2 ** 20,
                    help="also run single-process with this vocabulary (informational; 0: skip)")
    ap.add_argument("--extra-pss-inner-steps", type=int, default=10,
                    help="also run TF-PSS with this many steps per scheduled tf.function "
                         "(informational; 0: skip)")
    ap.add_argument("--pss-inner-steps", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--records-per-shard", type=int, default=20_000)
    ap.add_argument("--configs", default="single,pss,ours-1x1,ours-1x1-overlap,ours-2x2",
                    help="comma-separated subset of single,pss,ours-1x1,ours-1x1-overlap,ours-2x2")
    ap.add_argument("--repeat", type=int, default=2,
                    help="rounds over all configurations (default 2); each configuration's "
                         "best round is reported, every round is kept in the JSON")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per configuration")
    ap.add_argument("--profile", action="store_true",
                    help="also run ours 1+1 once with per-call timing (and py-spy if installed)")
    ap.add_argument("--no-py-spy", dest="py_spy", action="store_false")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "training.json"))
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_files", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._child:
        args.files_list = json.loads(args._files)
        res = {"single": child_single, "pss": child_pss}[args._child](args)
        with open(args._result + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(args._result + ".tmp", args._result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip TF teardown (the PS coordinator can block on dead servers)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = set(configs) - {"single", "pss", "ours-1x1", "ours-1x1-overlap", "ours-2x2"}
    if bad:
        ap.error(f"unknown config(s) {sorted(bad)}")
    started = time.time()
    data = ensure_data(args.rows, args.files, args.seed)
    log_dir = os.path.join(REPO, "runs", "bench-training-logs")
    os.makedirs(log_dir, exist_ok=True)
    load_before = os.getloadavg()

    plan = []
    for c in configs:
        if c == "single":
            plan.append(("single", lambda: run_child(args, "single", args.vocab, data, log_dir)))
            if args.extra_vocab:
                plan.append((f"single@{args.extra_vocab}",
                             lambda: run_child(args, "single", args.extra_vocab, data, log_dir)))
        elif c == "pss":
            plan.append(("tf-pss", lambda: run_child(args, "pss", args.vocab, data, log_dir)))
            if args.extra_pss_inner_steps > 1:
                plan.append((f"tf-pss-x{args.extra_pss_inner_steps}",
                             lambda: run_child(args, "pss", args.vocab, data, log_dir,
                                               args.extra_pss_inner_steps)))
        elif c == "ours-1x1":
            plan.append(("ours-1x1", lambda: run_ours(args, data, 1, 1)))
        elif c == "ours-1x1-overlap":
            plan.append(("ours-1x1-overlap", lambda: run_ours(args, data, 1, 1, overlap=True)))
        elif c == "ours-2x2":
            plan.append(("ours-2x2", lambda: run_ours(args, data, 2, 2)))

    runs: dict[str, list] = {}
    for r in range(args.repeat):
        for name, fn in plan:
            print(f"[{time.time() - started:6.1f}s] {name} (round {r + 1}/{args.repeat}) ...",
                  flush=True)
            try:
                res = _summarize(name, fn(), args.warmup_steps)
            except Exception as exc:  # keep going: report what could be measured
                print(f"  FAILED: {exc}", flush=True)
                res = {"config": name, "samples_per_s": None, "error": str(exc)}
            runs.setdefault(name, []).append(res)
            if res.get("samples_per_s"):
                print(f"  {res['samples_per_s']:,.0f} samples/s steady, "
                      f"{res['end_to_end_samples_per_s']:,.0f} end-to-end", flush=True)
            elif "error" not in res:
                print(f"  no steady-state figure: {res['steady'].get('reason')}", flush=True)

    profile = None
    if args.profile:
        print(f"[{time.time() - started:6.1f}s] ours-1x1 profiled run ...", flush=True)
        try:
            profile = _summarize("ours-1x1 (profiled)", run_ours(args, data, 1, 1, True,
                                                                 tag="1x1-profile"),
                                 args.warmup_steps)
        except Exception as exc:
            print(f"  FAILED: {exc}", flush=True)
            profile = {"error": str(exc)}

    def best(name):
        ok = [r for r in runs.get(name, []) if r.get("samples_per_s")]
        return max(ok, key=lambda r: r["samples_per_s"]) if ok else None

    single, pss = best("single"), best("tf-pss")
    labels = {
        "single": f"single-process Keras, Embedding vocab {args.vocab:,}",
        f"single@{args.extra_vocab}": f"single-process Keras, Embedding vocab {args.extra_vocab:,} (info)",
        "tf-pss": f"TF ParameterServerStrategy 1 worker + 1 PS, vocab {args.vocab:,}",
        f"tf-pss-x{args.extra_pss_inner_steps}":
            f"TF PSS, {args.extra_pss_inner_steps} steps per schedule() (info)",
        "ours-1x1": "ours 1 worker + 1 PS",
        "ours-1x1-overlap": "ours 1 worker + 1 PS, --overlap",
        "ours-2x2": "ours 2 workers + 2 PS",
    }
    rows_out = []
    for name, _ in plan:
        b = best(name)
        sps = b["samples_per_s"] if b else None
        rows_out.append({
            "config": name, "label": labels.get(name, name), "samples_per_s": sps,
            "end_to_end_samples_per_s": b["end_to_end_samples_per_s"] if b else None,
            "vs_single": sps / single["samples_per_s"] if sps and single else None,
            "vs_tf_pss": sps / pss["samples_per_s"] if sps and pss else None,
            "all_rounds_samples_per_s": [r.get("samples_per_s") for r in runs[name]],
        })

    print()
    print(f"DeepFM dim {DIM}, hidden {HIDDEN}, Adam lr {args.lr}, batch {args.batch_size}, "
          f"{args.rows:,} rows; steady-state after {args.warmup_steps} warm-up steps; "
          f"{os.cpu_count()} CPUs")
    w = max(len(r["label"]) for r in rows_out)
    print(f"{'config':{w}}  {'samples/s':>10}  {'end-to-end':>10}  {'vs single':>9}  "
          f"{'vs TF-PSS':>9}  samples/s of every round")
    for r in rows_out:
        print(f"{r['label']:{w}}  {_fmt(r['samples_per_s']):>10}  "
              f"{_fmt(r['end_to_end_samples_per_s']):>10}  {_fmt(r['vs_single'], '.2f'):>8}x  "
              f"{_fmt(r['vs_tf_pss'], '.2f'):>8}x  "
              + " / ".join(_fmt(x) for x in r["all_rounds_samples_per_s"]))

    ours = next((r for r in rows_out if r["config"] == "ours-1x1"), None)
    targets = []
    for what, key, goal in ((f"ours 1+1 >= {TARGET_VS_PSS}x ParameterServerStrategy",
                             "vs_tf_pss", TARGET_VS_PSS),
                            (f"ours 1+1 >= {TARGET_VS_SINGLE}x single-process", "vs_single",
                             TARGET_VS_SINGLE)):
        got = ours[key] if ours else None
        verdict = "n/a" if got is None else ("PASS" if got >= goal else "MISS")
        base = "single" if key == "vs_single" else "tf-pss"
        per_round = [a["samples_per_s"] / b["samples_per_s"]
                     if a.get("samples_per_s") and b.get("samples_per_s") else None
                     for a, b in zip(runs.get("ours-1x1", []), runs.get(base, []))]
        targets.append({"target": what, "ratio": got, "goal": goal, "result": verdict,
                        "ratio_within_each_round": per_round})
    print()
    for t in targets:
        rounds = ", ".join(_fmt(x, ".2f") for x in t["ratio_within_each_round"])
        print(f"target: {t['target']:48s} {_fmt(t['ratio'], '.2f')}x  {t['result']}"
              f"   (within each round: {rounds})")
    if profile and profile.get("profile"):
        print()
        print("profile of ours 1+1 (per-call wall time in the worker; calls inside a step "
              "may overlap):")
        for worker, p in profile["profile"].items():
            if not p:
                continue
            print(f"  {worker}: {p['steps']} steps, {p['ms_per_step_after_warmup']:.1f} ms/step "
                  f"after warm-up, dense sync {p['dense_sync_ms_per_step']:.1f} ms/step")
            for k, c in p["calls"].items():
                print(f"    {k:48s} {c['count']:6d} calls  {c['ms_per_call']:7.2f} ms/call  "
                      f"{c['ms_per_step']:7.2f} ms/step")

    if profile and profile.get("py_spy"):
        print("py-spy, share of busy samples per function (inclusive):")
        for path, summ in profile["py_spy"].items():
            print(f"  {path} ({summ['busy_samples']} busy samples)")
            for name, pct in summ["top_inclusive"]:
                print(f"    {pct:5.1f}%  {name}")

    elapsed = time.time() - started
    result = {
        "benchmark": "bench/bench_training.py",
        "command": " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO)
                             else sys.executable, "bench/bench_training.py"] + argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "versions": _versions(),
        "params": {"rows": args.rows, "files": args.files, "seed": args.seed,
                   "batch_size": args.batch_size, "lr": args.lr, "dim": DIM,
                   "hidden": list(HIDDEN), "vocab": args.vocab,
                   "extra_vocab": args.extra_vocab, "warmup_steps": args.warmup_steps,
                   "records_per_shard": args.records_per_shard, "repeat": args.repeat,
                   "extra_pss_inner_steps": args.extra_pss_inner_steps},
        "data_dir": os.path.relpath(data["dir"], REPO),
        "table": rows_out, "targets": targets,
        "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "series"} for r in v]
                 for k, v in runs.items()},
        "profile": profile, "elapsed_seconds": elapsed,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nsaved {os.path.relpath(os.path.abspath(args.out), REPO)} "
          f"(total {elapsed:.0f} s)")
    return 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("tensorflow-cpu", "tensorflow", "keras", "numpy", "grpcio"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
