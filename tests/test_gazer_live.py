"""Gazer against live jobs with TensorFlow workers (Keras and TF1): `gazer top` in a real
terminal (tmux), the Prometheus endpoint scraped over HTTP, and per-op entries from
TensorFlow in `gazer dump --json`. About a minute on a quiet machine."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tests.conftest import ROOT, Job, wait_for
from tests.test_gazer import Tmux, free_port, gazer, gazer_top_command, require_tmux

WORKER_SRC = '''
"""A small Keras (or TF1) worker for the Gazer tests: 4 ids -> ElasticEmbedding -> MLP."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import deeprec_ext.tf as dtf  # noqa: E402


def parse(lines):
    nums = tf.strings.to_number(tf.strings.split(lines, " ").to_tensor("0"), tf.int64)
    return nums[:, 1:5], tf.cast(nums[:, :1], tf.float32)


def keras_main():
    ids = keras.Input((4,), dtype="int64")
    emb = dtf.ElasticEmbedding(8, table="emb")(ids)
    x = keras.layers.Dense(32, activation="relu", name="hidden")(keras.layers.Flatten()(emb))
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile("adam", "binary_crossentropy")
    model.fit(dtf.shard_dataset(64, parse_fn=parse), epochs=1, verbose=0,
              callbacks=[dtf.ElasticCallback()])


def tf1_main():
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    ids, label = v1.data.make_one_shot_iterator(dtf.shard_dataset(64, parse_fn=parse)).get_next()
    emb = dtf.embedding_lookup("emb", ids, 8)
    w1 = v1.get_variable("w1", [32, 32])
    w2 = v1.get_variable("w2", [32, 1])
    h = tf.nn.relu(tf.matmul(tf.reshape(emb, [-1, 32]), w1, name="hidden"))
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label,
                                                                  logits=tf.matmul(h, w2)))
    train_op = v1.train.AdamOptimizer(1e-3).minimize(loss)
    with v1.train.MonitoredTrainingSession(hooks=[dtf.ElasticSessionHook()]) as sess:
        while not sess.should_stop():
            sess.run(train_op)


if __name__ == "__main__":
    (tf1_main if sys.argv[1:] == ["tf1"] else keras_main)()
    dtf.get_context().close()
'''


def make_job(tmp, mode: str, extra: dict | None = None) -> dict:
    (tmp / "worker.py").write_text(WORKER_SRC)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5000, (20_000, 4))
    (tmp / "data.txt").write_text("".join(f"{r[0] % 2} {r[0]} {r[1]} {r[2]} {r[3]}\n" for r in ids))
    job = {"name": f"gz-{mode}", "ps": {"replicas": 2},
           "worker": {"replicas": 2, "command": [sys.executable, str(tmp / "worker.py"), mode]},
           # long enough to outlive the tests; the fixture stops it
           "data": {"files": [str(tmp / "data.txt")], "records_per_shard": 2000, "epochs": 100},
           "master": {"heartbeat_seconds": 0.5},
           "gazer": {"op_sample_every_steps": 10}}
    job.update(extra or {})
    return job


def stop_job(job: Job) -> None:
    """Workers leave first (scale to 0, at a step boundary, while the PS still serve);
    stopping everything at once leaves workers retrying lookups on PS that are gone."""
    subprocess.run([sys.executable, "-m", "aimaster.cli", "scale", "--master", job.address,
                    "--workers", "0", "--timeout", "60"], cwd=ROOT, capture_output=True,
                   timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    job.stop()


# Runs before the Keras tests: their module-scoped job would otherwise still be training
# on the same two cores while this job starts.
def test_tf1_job_dump_has_per_op_entries_from_run_metadata(tmp_path):
    job = Job(tmp_path, make_job(tmp_path, "tf1"))
    try:
        d = wait_for_ops(job.address)
        for w in (m for m in d["members"] if m["role"] == "worker"):
            ops = w["stats"]["ops"]
            types = {op["type"] for op in ops}
            names = {op["name"] for op in ops}
            assert "ResourceApplyAdam" in types and any("MatMul" in t for t in types), types
            assert "ps_lookup_emb" in names or any("ps_lookup" in n for n in names), names
    finally:
        stop_job(job)


@pytest.fixture(scope="module")
def keras_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gazer-keras")
    port = free_port()
    job = Job(tmp, make_job(tmp, "keras"), ["--prometheus-port", str(port)])
    job.prometheus_port = port
    try:
        yield job
    finally:
        stop_job(job)


def snapshot_json(address: str) -> dict:
    out = gazer("dump", "--master", address, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for_ops(address: str, timeout: float = 180) -> dict:
    """A snapshot where both workers reported sampled ops and both PS their tables."""
    def ready():
        d = snapshot_json(address)
        workers = [m for m in d["members"] if m["role"] == "worker" and m["state"] == "running"]
        ps = [m for m in d["members"] if m["role"] == "ps" and m["stats"]["tables"]]
        ok = len(workers) == 2 and all(m["stats"]["ops"] for m in workers) and len(ps) == 2
        return d if ok and d["top_ops"] else None
    return wait_for(ready, timeout, "both workers to report sampled TensorFlow ops", interval=1)


def test_dump_json_has_per_op_entries_from_keras(keras_job):
    d = wait_for_ops(keras_job.address)
    assert d["op_sample_every"] == 10
    for w in (m for m in d["members"] if m["role"] == "worker"):
        s = w["stats"]
        assert s["op_sample_every"] == 10 and s["ops_step"] >= 3 and s["step_ms"] > 0
        types = {op["type"] for op in s["ops"]}
        names = " ".join(op["name"] for op in s["ops"])
        # the profiler saw real ops of the model: the PS lookup/push host calls and the
        # dense layer's matmul (oneDNN may rename its type)
        assert any("PyFunc" in t for t in types), types
        assert "MatMul" in " ".join(types) and "hidden" in names, s["ops"]
        assert all(op["micros"] > 0 and op["count"] >= 1 for op in s["ops"])
        assert w["steps_per_second"] > 0 and w["samples_per_second"] > 0
    for op in d["top_ops"]:
        assert op["workers"] >= 1 and op["micros"] > 0 and 0 <= op["share"] <= 1.5


def test_prometheus_endpoint_metric_families_and_labels(keras_job):
    wait_for_ops(keras_job.address)
    url = f"http://127.0.0.1:{keras_job.prometheus_port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    assert {"gazer_job_samples_per_second", "gazer_member_up", "gazer_cpu_percent",
            "gazer_rss_bytes", "gazer_worker_steps_per_second", "gazer_worker_step_seconds",
            "gazer_op_seconds", "gazer_rpc_latency_seconds", "gazer_rpc_received_bytes_total",
            "gazer_rpc_sent_bytes_total", "gazer_ps_table_rows", "gazer_ps_arena_fill_ratio",
            "gazer_ps_replication_behind_updates", "gazer_rpc_p99_seconds",
            "gazer_ps_table_admitted_total", "gazer_ps_table_rejected_total",
            "gazer_ps_table_evicted_total",
            "gazer_ps_table_candidates"} <= families, families
    # the admission counters of a table without a policy: present, 0
    assert re.search(r'^gazer_ps_table_rejected_total\{member="ps-1",role="ps",table="emb"\} 0',
                     text, re.M)
    for member, role in (("ps-0", "ps"), ("ps-1", "ps"), ("worker-0", "worker"), ("worker-1", "worker")):
        assert re.search(rf'^gazer_rss_bytes\{{member="{member}",role="{role}"\}} \d', text, re.M), member
        assert re.search(rf'^gazer_cpu_percent\{{member="{member}",role="{role}"\}}', text, re.M)
    assert re.search(r'^gazer_rpc_latency_seconds_bucket\{le="\+Inf",member="ps-0",method="Lookup",'
                     r'role="ps"\} [1-9]', text, re.M), "Lookup latency histogram of ps-0"
    assert re.search(r'^gazer_ps_table_rows\{member="ps-1",role="ps",table="emb"\} [1-9]', text, re.M)
    assert re.search(r'^gazer_op_seconds\{member="worker-0",op="[^"]+",op_type="[^"]+",'
                     r'role="worker"\} ', text, re.M)
    assert re.search(r'^gazer_worker_steps_total\{member="worker-1",role="worker"\} [1-9]', text, re.M)
    assert re.search(r'^gazer_job_samples_per_second\{job="gz-keras"\} ', text, re.M)
    # a second scrape: fresh numbers from the same endpoint
    time.sleep(1.5)  # a few heartbeats later
    again = urllib.request.urlopen(url, timeout=30).read().decode()
    assert "gazer_member_up" in again and again != text


def test_gazer_top_in_tmux_shows_every_member_and_top_ops(keras_job):
    require_tmux()
    wait_for_ops(keras_job.address)
    t = Tmux(gazer_top_command(keras_job.address, "GAZER_EXIT"), width=200, height=50)
    try:
        members = ("ps-0", "ps-1", "worker-0", "worker-1")
        screen = t.wait_screen(
            lambda s: all(m in s for m in members) and "top ops" in s and "PyFunc" in s
            and "samples/s" in s, 60, "every member and the top ops on screen")
        assert "job gz-keras" in screen and "running" in screen
        assert re.search(r"worker-0\s+worker\s+running", screen), screen
        assert re.search(r"ps-0\s+ps\s+running\s+\d+\s+\d+\s+[\d,]+ req/s", screen), screen
        first = screen
        # refreshed every second: the uptime moves
        t.wait_screen(lambda s: re.search(r"up \S+", s).group(0) != re.search(r"up \S+", first).group(0),
                      15, "a refresh")
        t.keys("C-c")
        screen = t.wait_screen(lambda s: "GAZER_EXIT=" in s, 30, "gazer to quit on Ctrl-C")
        assert "GAZER_EXIT=0" in screen and "Traceback" not in screen
    finally:
        t.close()
