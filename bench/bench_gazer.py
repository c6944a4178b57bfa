"""Cost of Gazer: training throughput with Gazer at its default sampling vs off, measured
in ONE run with interleaved rounds (on, off, off, on, ...), printed as a ratio.

    .venv/bin/python bench/bench_gazer.py [--rounds 16] [--steps 200] [--batch-size 512] \
        [--out bench/results/gazer.json]

Setup: ``aimaster run --ps 2 --workers 0`` (Gazer enabled, default config) and this
process as the one worker: a Keras model (8 ids -> ElasticEmbedding dim 16 -> MLP 128-64)
trained by ``model.fit`` with ``ElasticCallback`` on in-memory random ids.

- "on": what a worker runs by default: per-op sampling every ``op_sample_every_steps``
  (read from the AIMaster, default 100) and statistics on every heartbeat;
- "off": the sampler disabled and no statistics on heartbeats (what a worker of a job
  with ``gazer: {enabled: false}`` runs).

Throughput per round is steady state: samples of the steps after the first 10 divided by
their time. The PS side of Gazer (the RPC interceptor) cannot be toggled inside a running
PS; its cost is measured separately with an in-process PS served with and without the
interceptor, Lookup RPCs of 4,096 ids in interleaved rounds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def start_job(state_dir: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "aimaster.cli", "run", "--ps", "2", "--workers", "0",
                             "--state-dir", state_dir], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=REPO))
    addr = os.path.join(state_dir, "master.addr")
    deadline = time.monotonic() + 120
    while not os.path.exists(addr):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the AIMaster did not start")
        time.sleep(0.1)
    return proc, open(addr).read()


def bench_training(args) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from deeprec_ext.tf.op_sampler import sampler_for

    ctx = dtf.get_context()
    sampler = sampler_for(ctx)
    default_every = sampler.every
    stats_source = ctx.session.stats_source
    ids_in = keras.Input((8,), dtype="int64")
    emb = dtf.ElasticEmbedding(16, table="bench_emb")(ids_in)
    x = keras.layers.Dense(128, activation="relu")(keras.layers.Flatten()(emb))
    x = keras.layers.Dense(64, activation="relu")(x)
    model = keras.Model(ids_in, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile("adam", "binary_crossentropy")
    rng = np.random.default_rng(0)
    n = args.batch_size * 64
    ids = rng.integers(0, 200_000, (n, 8))
    labels = (ids[:, :1] % 2).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(args.batch_size).repeat()

    class Clock(keras.callbacks.Callback):
        """Step end times, and each step's own duration with whether it was traced (runs
        after ElasticCallback: the trace's start and stop are inside the interval)."""
        def on_train_begin(self, logs=None):
            self.t = []

        def on_train_batch_begin(self, batch, logs=None):
            self.begin, self.traced = time.perf_counter(), sampler._session is not None

        def on_train_batch_end(self, batch, logs=None):
            self.t.append(time.perf_counter())
            (sampled_ms if self.traced else plain_ms).append((self.t[-1] - self.begin) * 1000)

    sampled_ms, plain_ms = [], []
    clock = Clock()
    elastic = dtf.ElasticCallback()

    def run(on: bool) -> float:
        sampler.every = default_every if on else 0
        ctx.gazer.op_sample_every = sampler.every
        ctx.session.stats_source = stats_source if on else None
        before = sampler.samples
        model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=[elastic, clock])
        skip = 10
        samples_per_s = (len(clock.t) - 1 - skip) * args.batch_size / (clock.t[-1] - clock.t[skip])
        return samples_per_s, sampler.samples - before

    run(True)  # warm-up: tracing, table creation, first profiler session
    sampled_ms.clear()
    plain_ms.clear()
    order = [i % 4 in (0, 3) for i in range(args.rounds)]  # on, off, off, on, on, off, ...
    rounds = []
    for on in order:
        tput, sampled = run(on)
        rounds.append({"gazer": "on" if on else "off", "samples_per_s": round(tput, 1),
                       "sampled_steps": sampled})
        print(f"  round {len(rounds):2d} gazer {'on ' if on else 'off'}: {tput:10,.0f} samples/s"
              f"  ({sampled} sampled steps)", flush=True)
    on_v = [r["samples_per_s"] for r in rounds if r["gazer"] == "on"]
    off_v = [r["samples_per_s"] for r in rounds if r["gazer"] == "off"]
    # the load-independent estimate: what a traced step costs extra, spread over N steps
    extra = statistics.median(sampled_ms) - statistics.median(plain_ms)
    est = extra / (default_every * statistics.median(plain_ms)) if default_every else 0.0
    return {"op_sample_every": default_every, "rounds": rounds,
            "traced_step_ms_median": statistics.median(sampled_ms),
            "plain_step_ms_median": statistics.median(plain_ms), "traced_steps": len(sampled_ms),
            "estimated_overhead": est,
            "median_on": statistics.median(on_v), "median_off": statistics.median(off_v),
            "mean_on": statistics.mean(on_v), "mean_off": statistics.mean(off_v),
            "ratio_median": statistics.median(on_v) / statistics.median(off_v),
            "ratio_mean": statistics.mean(on_v) / statistics.mean(off_v)}


def bench_interceptor(rounds: int = 10, calls: int = 300) -> dict:
    import numpy as np

    from deeprec_ext.grpc_util import create_server, insecure_channel
    from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
    from deeprec_ext.ps.server import ParameterServerServicer
    from deeprec_ext.stats import StatsInterceptor

    servers, stubs = [], {}
    for name, with_stats in (("on", True), ("off", False)):
        servicer = ParameterServerServicer(f"ps-{name}")
        server, port = create_server(
            "127.0.0.1:0", interceptors=[StatsInterceptor(servicer.rpc_stats)] if with_stats else [])
        ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
        server.start()
        servers.append(server)
        stub = ps_pb2_grpc.ParameterServerStub(insecure_channel(f"127.0.0.1:{port}"))
        stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(name="t", dim=16)))
        stubs[name] = stub
    ids = np.random.default_rng(1).integers(0, 1 << 40, 4096).astype(np.int64).tobytes()
    req = ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table="t", ids=ids)], insert_missing=True)
    per = {"on": [], "off": []}
    for name in ("on", "off"):
        for _ in range(50):
            stubs[name].Lookup(req)
    for i in range(rounds):
        for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
            t = time.perf_counter()
            for _ in range(calls):
                stubs[name].Lookup(req)
            per[name].append((time.perf_counter() - t) / calls * 1e6)
    for s in servers:
        s.stop(0)
    on, off = statistics.median(per["on"]), statistics.median(per["off"])
    return {"lookup_us_on": round(on, 1), "lookup_us_off": round(off, 1), "ratio": on / off,
            "ids_per_lookup": 4096, "calls_per_round": calls, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=200, help="training steps per round")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "gazer.json"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-gazer-") as state:
        proc, address = start_job(state)
        os.environ["DEEPREC_MASTER_ADDR"] = address
        try:
            print(f"AIMaster {address}; {args.rounds} interleaved rounds of {args.steps} steps, "
                  f"batch {args.batch_size}", flush=True)
            training = bench_training(args)
            import deeprec_ext.tf as dtf
            dtf.get_context().close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    interceptor = bench_interceptor()
    result = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
              "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
              "args": vars(args), "training": training, "ps_interceptor": interceptor}
    overhead = (1 - training["ratio_median"]) * 100
    print(f"\ntraining throughput, Gazer on / off (median of rounds): {training['ratio_median']:.3f} "
          f"(overhead {overhead:+.1f}%; mean ratio {training['ratio_mean']:.3f}); "
          f"sampling every {training['op_sample_every']} steps")
    print(f"traced step {training['traced_step_ms_median']:.1f} ms vs plain step "
          f"{training['plain_step_ms_median']:.1f} ms (medians, {training['traced_steps']} traced): "
          f"estimated overhead {training['estimated_overhead'] * 100:.2f}% at one step in "
          f"{training['op_sample_every']}")
    print(f"PS Lookup of 4,096 ids, with / without the stats interceptor: "
          f"{interceptor['lookup_us_on']:.0f} / {interceptor['lookup_us_off']:.0f} us "
          f"(ratio {interceptor['ratio']:.3f})")
    print(f"load average before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
