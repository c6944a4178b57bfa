"""Evaluation while training: the job file's eval section, the evaluator role, its
read-only lookups, and the metrics file / TensorBoard events it leaves."""
from __future__ import annotations

import glob
import json
import os
import random

import numpy as np
import pytest

from aimaster.config import ConfigError, parse_job
from deeprec_ext.tensorboard import ScalarWriter, crc32c
from deeprec_ext.evaluation import binary_metrics, record_batches


def _job(**eval_section):
    return {"worker": {"replicas": 1, "command": ["true"]}, "eval": eval_section}


def _eval_rounds(state_dir):
    """eval.jsonl's points and its rounds during training; one final round at the last step."""
    points = [json.loads(line) for line in (state_dir / "eval.jsonl").read_text().splitlines()]
    final = [p for p in points if p["final"]]
    assert len(final) == 1 and points[-1]["final"], points
    total_steps = json.loads((state_dir / "metrics-worker-0.json").read_text())["steps"]
    assert final[0]["step"] == total_steps
    during = [p for p in points if not p["final"]]
    # a round may land after the last step but before the worker has left
    assert all(0 < p["step"] <= total_steps for p in during), points
    return points, during, total_steps


@pytest.mark.parametrize("section, key", [
    ({"every_steps": 5}, "eval.files"),
    ({"files": ["a"], "every_steps": 5, "every_seconds": 3}, "eval.every_steps, every_seconds: give one"),
    ({"files": ["a"]}, "eval.every_steps or every_seconds"),
    ({"files": ["a"], "every_steps": 0}, "eval.every_steps"),
    ({"files": ["a"], "every_seconds": -1}, "eval.every_seconds"),
    ({"files": ["a"], "every_steps": 5, "batch": 3}, "eval: unknown key"),
])
def test_bad_eval_section_is_refused_naming_the_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_job(_job(**section))


def test_eval_files_must_exist_at_job_start(tmp_path):
    cfg = parse_job(_job(files=[str(tmp_path / "nothing-*.txt")], every_steps=3))
    assert cfg.eval.every_steps == 3 and cfg.eval.every_seconds is None
    with pytest.raises(ConfigError, match=r"eval\.files"):
        cfg.eval.resolved_files()
    assert parse_job({}).eval is None


def test_binary_metrics_match_a_reference():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    s = np.clip(y * 0.3 + rng.random(2000) * 0.7, 0, 1)
    m = binary_metrics(y, s)
    pos, neg = s[y == 1], s[y == 0]
    ref = ((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())
    assert m["auc"] == pytest.approx(ref, abs=1e-9)
    p = np.clip(s, 1e-7, 1 - 1e-7)
    assert m["logloss"] == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    logits = np.log(p / (1 - p))
    assert binary_metrics(y, logits, from_logits=True)["logloss"] == pytest.approx(m["logloss"])


def test_record_batches_reads_every_line(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(f"a{i}\n" for i in range(5)))
    b.write_text("".join(f"b{i}\n" for i in range(4)))
    got = list(record_batches([str(a), str(b)], 4))
    assert [len(x) for x in got] == [4, 4, 1]
    assert [r.decode() for x in got for r in x] == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(4)]


def test_event_file_reads_back_with_tensorflow(tmp_path):
    import tensorflow as tf
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    w = ScalarWriter(str(tmp_path))
    w.add(7, {"eval/auc": 0.75, "eval/logloss": None})
    w.close()
    [path] = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    events = list(tf.compat.v1.train.summary_iterator(path))
    assert events[0].file_version == "brain.Event:2"
    assert [(e.step, v.tag, round(v.simple_value, 4)) for e in events[1:]
            for v in e.summary.value] == [(7, "eval/auc", 0.75)]


def _unseen_eval_file(train_path: str, out: str, rows: int = 3000) -> str:
    """Eval lines whose 26 categorical values appear in no training line."""
    rnd = random.Random(5)
    with open(train_path) as f, open(out, "w") as g:
        for i, line in zip(range(rows), f):
            cols = line.rstrip("\n").split("\t")
            cols[14:] = [f"zz{rnd.getrandbits(40):010x}" for _ in range(26)]
            g.write("\t".join(cols) + "\n")
    return out


def _events(logdir):
    import tensorflow as tf
    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for e in tf.compat.v1.train.summary_iterator(path):
            out.extend((e.step, v.tag, v.simple_value) for v in e.summary.value)
    return out


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    from examples.criteo.generate import generate
    d = tmp_path_factory.mktemp("criteo_eval")
    data = generate(str(d), rows=60_000, files=1, test_rows=10, seed=11)
    data["eval"] = _unseen_eval_file(data["train"][0], str(d / "eval.txt"))
    return data


def test_keras_job_evaluates_while_training_read_only(start_job, eval_data):
    job = start_job({
        "name": "evaljob",
        "ps": {"replicas": 1},
        "worker": {"replicas": 1, "max_restarts": 0,
                   "command": ["{python}", "-m", "examples.criteo.train", "--batch-size", "256"]},
        "data": {"files": eval_data["train"], "bytes_per_shard": 4 << 20},
        "master": {"heartbeat_seconds": 0.5},
        "eval": {"files": [eval_data["eval"]], "every_steps": 40, "batch_size": 1024},
    })
    assert job.wait(300) == 0, job.output()[-3000:]
    state_dir = job.state_dir
    points, during, total_steps = _eval_rounds(state_dir)
    assert during, points
    assert all(p["examples"] == 3000 and 0.0 <= p["auc"] <= 1.0 and p["logloss"] > 0
               for p in points)
    # TensorBoard: eval curves at the steps scored, training curves beside them
    ev = _events(state_dir / "tensorboard" / "eval")
    assert [s for s, tag, _ in ev if tag == "eval/auc"] == [p["step"] for p in points]
    tags = {tag for _, tag, _ in _events(state_dir / "tensorboard" / "train")}
    assert {"train/samples", "train/samples_per_second"} <= tags
    loss = [(s, v) for s, tag, v in _events(state_dir / "tensorboard" / "worker-0")
            if tag == "train/loss"]
    assert len(loss) >= 5 and all(v > 0 for _, v in loss) and loss[-1][1] < loss[0][1], loss
    # read-only: no id of the eval file (all unseen in training) became a row
    import checkpoint
    import tensorflow as tf
    from examples.criteo.reader import parse_lines
    lines = open(eval_data["eval"]).read().splitlines()
    eval_ids = np.unique(parse_lines(tf.constant(lines))[0]["cat"].numpy())
    ck = checkpoint.load(job.state()["final_checkpoint"], slots=False)
    for name in ("embedding", "linear"):
        assert ck.tables[name].ids.size > 0
        assert not np.isin(eval_ids, ck.tables[name].ids).any(), name
    # the evaluator ran the unchanged worker command and left its own metrics file
    assert (state_dir / "metrics-evaluator-0.json").exists()
    assert any(e.get("kind") == "eval_final" for e in job.state().get("events", []))


def test_kubernetes_manifest_has_an_evaluator_replica():
    from tfjob_crd import naming, validate
    from tfjob_crd.render import render
    doc = {"name": "evk", "worker": {"replicas": 2, "command": ["python", "t.py"]},
           "eval": {"files": ["/mnt/data/eval-*.txt"], "every_seconds": 60},
           "kubernetes": {"image": "img"}}
    docs = render(parse_job(doc), doc)
    tfjob = [d for d in docs if d["kind"] == "TFJob"][0]
    ev = tfjob["spec"]["tfReplicaSpecs"]["Evaluator"]
    env = {e["name"]: e.get("value") for e in ev["template"]["spec"]["containers"][0]["env"]}
    assert ev["replicas"] == 1 and env["DEEPREC_ROLE"] == "evaluator"
    assert json.loads(env["DEEPREC_EVAL"])["files"] == ["/mnt/data/eval-*.txt"]
    assert naming.member_id("Evaluator", 0) == "evaluator-0"
    problems, _ = validate.validate_documents(docs, require_crd=False)
    assert problems == []
    no_eval = {k: v for k, v in doc.items() if k != "eval"}
    tfjob = [d for d in render(parse_job(no_eval), no_eval) if d["kind"] == "TFJob"][0]
    assert "Evaluator" not in tfjob["spec"]["tfReplicaSpecs"]


class _FakeView:
    """The parts of a JobView a Gazer snapshot reads, with an eval state."""
    phase = type("P", (), {"value": "running"})()
    epoch, started_at = 1, 0.0

    def __init__(self, ev):
        self._ev = ev

    def clock(self):
        return 10.0

    def shard_counts(self):
        return {"todo": 1, "doing": 0, "done": 2}

    def members(self, role=None):
        return []

    def migration_progress(self):
        return {"phase": ""}

    def stragglers(self):
        return {}

    def straggler_counts(self):
        return {}

    def eval_state(self):
        return self._ev


def test_gazer_snapshot_prometheus_and_top_show_the_latest_round(tmp_path):
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from rich.console import Console

    from aimaster.config import JobConfig
    from aimaster.evaluation import EvalRecorder
    from aimaster.monitor import GazerPlugin
    from gazer.prometheus import SnapshotCollector
    from gazer.view import render as render_top

    rec = EvalRecorder(str(tmp_path))
    rec.record("evaluator-0", {"step": 40, "auc": 0.71, "logloss": 0.52, "examples": 3000})
    rec.record("evaluator-0", {"step": 80, "auc": 0.73, "logloss": 0.5, "examples": 3000,
                               "final": True})
    rec.close()
    plugin = GazerPlugin(JobConfig())
    plugin.master = _FakeView(rec.state())
    snap = plugin.snapshot()
    assert (snap.eval.step, round(snap.eval.auc, 2), snap.eval.final, snap.eval.rounds) == \
        (80, 0.73, True, 2)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(plugin))
    text = generate_latest(registry).decode()
    assert 'gazer_eval_auc{job="job"} 0.73' in text and 'gazer_eval_step{job="job"} 80.0' in text
    console = Console(width=160, record=True)
    console.print(render_top(snap))
    assert "eval auc 0.7300  logloss 0.5000  at step 80 (final)" in console.export_text()
    plugin.master = _FakeView(None)  # no eval section: nothing about it
    assert not plugin.snapshot().HasField("eval")
    assert "gazer_eval_auc" not in generate_latest(registry).decode()


def test_tf1_job_evaluates_while_training_read_only(start_job, eval_data):
    """The unchanged TF1 script (MonitoredTrainingSession + ElasticSessionHook) as the
    evaluator: it finds the graph's logits and labels itself, scores every round, and
    adds not one row to the PS."""
    job = start_job({
        "name": "evaltf1",
        "ps": {"replicas": 1},
        "worker": {"replicas": 1, "max_restarts": 0,
                   "command": ["{python}", "-m", "examples.criteo.train", "--mode", "tf1",
                               "--batch-size", "256"]},
        "data": {"files": eval_data["train"], "bytes_per_shard": 4 << 20},
        "master": {"heartbeat_seconds": 0.5},
        "eval": {"files": [eval_data["eval"]], "every_steps": 40, "batch_size": 1024},
    })
    assert job.wait(300) == 0, job.output()[-3000:]
    state_dir = job.state_dir
    log = (state_dir / "logs" / "evaluator-0.log").read_text()
    assert "sigmoid cross-entropy" in log, log[-3000:]  # how it found what to score
    points, during, total_steps = _eval_rounds(state_dir)
    assert any(p["step"] < total_steps for p in during), points
    assert all(p["examples"] == 3000 and 0.0 <= p["auc"] <= 1.0 and 0 < p["logloss"] < 5
               for p in points), points
    # the evaluator trained nothing: its script ran no training step
    assert json.loads((state_dir / "metrics-evaluator-0.json").read_text())["steps"] == 0
    ev = _events(state_dir / "tensorboard" / "eval")
    assert [s for s, tag, _ in ev if tag == "eval/auc"] == [p["step"] for p in points]
    # rows on the PS = the ids training saw, exactly: the eval file's ids (all unseen in
    # training) were looked up every round by a graph built with training=True
    import checkpoint
    import tensorflow as tf
    from examples.criteo.reader import parse_lines
    train_ids = np.unique(np.concatenate([
        parse_lines(tf.constant(open(f).read().splitlines()))[0]["cat"].numpy().ravel()
        for f in eval_data["train"]]))
    lines = open(eval_data["eval"]).read().splitlines()
    eval_ids = np.unique(parse_lines(tf.constant(lines))[0]["cat"].numpy())
    ck = checkpoint.load(job.state()["final_checkpoint"], slots=False)
    for name in ("embedding", "linear"):
        rows = np.sort(ck.tables[name].ids)
        assert rows.size == train_ids.size and np.array_equal(rows, train_ids), name
        assert not np.isin(eval_ids, rows).any(), name


def _tf1_graph(kind: str):
    """A small TF1 training graph over a dataset shaped like shard_dataset's."""
    import tensorflow as tf
    from deeprec_ext.tf.tf1_eval import eval_tensors
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        ds = tf.data.Dataset.from_tensor_slices(
            (np.zeros([8, 4], np.float32), np.zeros([8], np.float32))).batch(4)
        x, y = v1.data.make_one_shot_iterator(ds).get_next()
        z = tf.reshape(tf.matmul(tf.math.log1p(x), v1.get_variable("w", [4, 1])), [-1],
                       name="logits")
        ce = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=z))
        if kind == "ce":
            loss = ce
        elif kind == "v1_sigmoid_ce":
            loss = v1.losses.sigmoid_cross_entropy(y, z)
        elif kind == "v1_log_loss":
            loss = v1.losses.log_loss(y, tf.sigmoid(z))
        elif kind == "hand_log_loss":
            p = tf.clip_by_value(tf.sigmoid(z), 1e-7, 1 - 1e-7)
            loss = -tf.reduce_mean(y * tf.math.log(p) + (1 - y) * tf.math.log(1 - p))
        elif kind == "ce_and_logged_metric":  # a second CE that is not minimized
            z2 = tf.reshape(tf.matmul(x, v1.get_variable("w2", [4, 1])), [-1])
            tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=z2))
            loss = ce
        elif kind in ("two_heads", "two_heads_named"):
            z2 = tf.reshape(tf.matmul(x, v1.get_variable("w2", [4, 1])), [-1], name="cvr")
            loss = ce + tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=z2))
            if kind == "two_heads_named":
                eval_tensors(labels=y, logits=z2)
        elif kind == "mse":
            loss = tf.reduce_mean(tf.square(z - y))
        v1.train.AdamOptimizer(1e-3).minimize(loss)
    return g, ds.element_spec


@pytest.mark.parametrize("kind, how, scores, from_logits", [
    ("ce", "sigmoid cross-entropy", "logits:0", True),
    ("v1_sigmoid_ce", "sigmoid cross-entropy", "logits:0", True),
    ("v1_log_loss", "log loss", "Sigmoid:0", False),
    ("hand_log_loss", "log loss", "Sigmoid:0", False),
    ("ce_and_logged_metric", "sigmoid cross-entropy", "logits:0", True),
    ("two_heads_named", "dtf.eval_tensors", "cvr:0", True),
])
def test_tf1_graph_shapes_the_evaluator_recognizes(kind, how, scores, from_logits):
    from deeprec_ext.tf.tf1_eval import find_eval_tensors, input_feeds
    g, spec = _tf1_graph(kind)
    found = find_eval_tensors(g)
    assert found["how"].startswith(how) and found["scores"].name == scores
    assert found["labels"].name == "IteratorGetNext:1" and found["from_logits"] is from_logits
    assert [t.name for t in input_feeds(g, spec, [found["scores"]])] == \
        ["IteratorGetNext:0", "IteratorGetNext:1"]


@pytest.mark.parametrize("kind, problem", [
    ("two_heads", "found 2 binary losses"),
    ("mse", "found no binary loss"),
])
def test_tf1_graph_the_evaluator_cannot_read_is_refused_naming_the_line(kind, problem):
    from deeprec_ext.tf.tf1_eval import EvalTensorsError, find_eval_tensors
    g, _ = _tf1_graph(kind)
    with pytest.raises(EvalTensorsError, match=problem) as err:
        find_eval_tensors(g)
    assert "dtf.eval_tensors(labels=" in str(err.value)


TWO_HEAD_TF1 = r'''
import tensorflow as tf
import deeprec_ext.tf as dtf

v1 = tf.compat.v1
v1.disable_eager_execution()


def parse(lines):
    label, user, item = tf.io.decode_csv(lines, record_defaults=[[0.0], [""], [""]])
    return tf.strings.to_hash_bucket_fast(tf.stack([user, item], axis=1), 2**62), label


ids, label = v1.data.make_one_shot_iterator(dtf.shard_dataset(256, parse_fn=parse)).get_next()
x = tf.reshape(dtf.embedding_lookup("emb", ids, 4), [-1, 8])
ctr = tf.squeeze(tf.matmul(x, v1.get_variable("w_ctr", [8, 1])), 1, name="ctr")
cvr = tf.squeeze(tf.matmul(x, v1.get_variable("w_cvr", [8, 1])), 1, name="cvr")
loss = (tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=ctr)) +
        tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=cvr)))
train_op = v1.train.AdamOptimizer(1e-2).minimize(loss)
with v1.train.MonitoredTrainingSession(hooks=[dtf.ElasticSessionHook()], save_checkpoint_secs=None,
                                       save_summaries_steps=None) as sess:
    while not sess.should_stop():
        sess.run(train_op)
dtf.get_context().close()
'''


def test_tf1_evaluator_refuses_an_ambiguous_graph_and_training_goes_on(start_job, tmp_path):
    """Two heads, two losses: the evaluator names them and the one line that settles it,
    scores nothing, and the job still trains every record to success."""
    (tmp_path / "two_heads.py").write_text(TWO_HEAD_TF1)
    rnd = random.Random(3)
    (tmp_path / "train.csv").write_text("".join(
        f"{rnd.randrange(2)},u{rnd.randrange(300)},i{rnd.randrange(200)}\n" for _ in range(6000)))
    (tmp_path / "eval.csv").write_text("1,u1,i1\n0,u2,i2\n")
    job = start_job({
        "name": "evalamb",
        "ps": {"replicas": 1},
        "worker": {"replicas": 1, "max_restarts": 0,
                   "command": ["{python}", str(tmp_path / "two_heads.py")]},
        "data": {"files": [str(tmp_path / "train.csv")], "bytes_per_shard": 1 << 20},
        "master": {"heartbeat_seconds": 0.5},
        "eval": {"files": [str(tmp_path / "eval.csv")], "every_steps": 5},
    }, subdir="job")
    assert job.wait(300) == 0, job.output()[-3000:]
    log = (job.state_dir / "logs" / "evaluator-0.log").read_text()
    assert "found 2 binary losses" in log and "(scores ctr:0)" in log and "(scores cvr:0)" in log
    assert "dtf.eval_tensors(labels=" in log
    eval_file = job.state_dir / "eval.jsonl"
    assert not eval_file.exists() or not eval_file.read_text().strip()
    # training went on to the end: every training id has its row, and nothing else
    import checkpoint
    import tensorflow as tf
    cols = [line.split(",")[1:] for line in (tmp_path / "train.csv").read_text().splitlines()]
    want = np.unique(tf.strings.to_hash_bucket_fast(tf.constant(cols), 2**62).numpy())
    rows = checkpoint.load(job.state()["final_checkpoint"], slots=False).tables["emb"].ids
    assert np.array_equal(np.sort(rows), want)


def test_tf1_log_loss_that_hides_its_labels_takes_the_datasets():
    """A log loss written with tf.where: the labels come from what shard_dataset gave,
    the second element of (features, labels); the evaluator's parse graph feeds it."""
    import tensorflow as tf
    from deeprec_ext.tf import data as dtf_data
    from deeprec_ext.tf.tf1_eval import EvalTensorsError, TF1Evaluator, find_eval_tensors
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        def parse(lines):
            cols = tf.io.decode_csv(lines, record_defaults=[[0.0], [0.0]])
            return tf.stack([cols[1]], axis=1), cols[0]
        ds = tf.data.Dataset.from_tensor_slices(tf.constant(["1,0.5"])).batch(1).map(parse)
        x, y = v1.data.make_one_shot_iterator(ds).get_next()
        p = tf.sigmoid(tf.reshape(tf.matmul(x, v1.get_variable("w", [1, 1])), [-1]))
        loss = tf.reduce_mean(tf.where(y > 0.5, -tf.math.log(p), -tf.math.log(1 - p)))
        v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(EvalTensorsError, match="not the labels"):
            find_eval_tensors(g)
        saved = dict(dtf_data.EVAL_INPUT)
        try:
            dtf_data.EVAL_INPUT.update(parse_fn=parse, element_spec=ds.element_spec)
            ev = TF1Evaluator([])
        finally:
            dtf_data.EVAL_INPUT.clear()
            dtf_data.EVAL_INPUT.update(saved)
        assert (ev.labels.name, ev.scores.name, ev.from_logits) == \
            ("IteratorGetNext:1", "Sigmoid:0", False)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            values = sess.run(ev.parsed, {ev.records: np.array([b"1,2.0", b"0,-1.0"], object)})
            got_y, got_p = sess.run([ev.labels, ev.scores], dict(zip(ev.feeds, values)))
            w = sess.run(v1.trainable_variables()[0])[0, 0]
        assert got_y.tolist() == [1.0, 0.0]
        np.testing.assert_allclose(got_p, 1 / (1 + np.exp(-np.array([2.0, -1.0]) * w)), rtol=1e-5)


def test_evaluator_context_reads_only_and_refuses_pushes(start_job, monkeypatch):
    """Whatever a graph asks (a TF1 training graph looks up with training=True), a
    process in the evaluator role inserts no row, and a push fails naming the table."""
    from deeprec_ext.worker import WorkerContext
    job = start_job({"name": "evalctx"}, ["--ps", "2", "--workers", "0"])
    monkeypatch.setenv("DEEPREC_ROLE", "evaluator")
    ctx = WorkerContext(master_address=job.address, member_id="evaluator-0")
    try:
        assert ctx.rank == -1
        ctx.client.create_table("t", dim=2, initializer="ones",
                                optimizer={"name": "sgd", "learning_rate": 1.0})

        def rows():
            return sum(t.rows for s in ctx.client.ps_stats() for t in s.tables if t.name == "t")
        ids = np.arange(1000, dtype=np.int64)
        got = ctx.lookup("t", ids, insert_missing=True)
        assert got.shape == (1000, 2) and (got == 1.0).all()  # initial values, read only
        assert rows() == 0
        with pytest.raises(RuntimeError, match="evaluator must not push \\(table 't'\\)"):
            ctx.push_async("t", ids, np.ones((1000, 2), np.float32))
        assert rows() == 0
        ctx.client.lookup("t", ids[:10], insert_missing=True)  # the PS still serves writes
        assert rows() == 10
    finally:
        ctx.close()
