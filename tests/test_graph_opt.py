"""graph_opt estimate: inventory of real Keras / TF1 / SavedModel / MetaGraph models, the
distinct-id sketch, the PS memory model and plan arithmetic, and the CLI's exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT

import graph_opt
from graph_opt.api import EstimateError
from graph_opt.memory import SLOTS_PER_ROW, index_capacity, ps_bytes, table_bytes
from graph_opt.plan import PlanInputs
from graph_opt.sketch import HyperLogLog, heaps_extrapolate

DEEPFM_DENSE_PARAMS = 221 * 128 + 128 + 128 * 64 + 64 + 13 + 1 + 64 + 1
DEEPFM_FLOPS = 73_968  # 2 x (221 x 128 + 128 x 64 + 64 + 13) MACs + adds, relu, fm


def deepfm_tf1(dim: int = 8):
    """TF1 builder for the CLI: placeholders + the example DeepFM with elastic lookups."""
    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from examples.criteo.model import build_deepfm_tf1
    v1 = tf.compat.v1
    features = {"dense": v1.placeholder(tf.float32, [None, 13], name="dense"),
                "cat": v1.placeholder(tf.int64, [None, 26], name="cat")}

    def lookup(name, ids, d):
        return dtf.embedding_lookup(name, ids, d, optimizer={"name": "ftrl"})

    logits = build_deepfm_tf1(features, lookup, dim=dim)
    v1.train.AdamOptimizer(1e-3).minimize(tf.reduce_mean(logits))
    return logits


def broken_model():
    """A Keras model whose code fails (eagerly, as TF2 runs it), though a graph-mode
    retry of the same builder would return a model."""
    import tensorflow as tf
    from tensorflow import keras
    if tf.executing_eagerly():
        raise ValueError("feature 'cat' has 27 columns, 26 expected")
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1)(inp))


def not_a_model():
    return 42


def _tables(est):
    return {t.name: t for t in est.tables}


def test_keras_deepfm_inventory():
    est = graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs={"lr": 1e-3, "dim": 8},
                             rows={"embedding": 1_000_000, "linear": 1_000_000})
    t = _tables(est)
    assert set(t) == {"embedding", "linear"} and est.kind == "keras"
    assert (t["embedding"].dim, t["embedding"].optimizer, t["embedding"].num_slots) == (8, "adam", 3)
    assert t["embedding"].row_floats == 32 and t["linear"].row_floats == 4
    assert t["embedding"].feature == "cat" and t["embedding"].ids_per_sample == 26
    assert t["embedding"].key_dtype == "int64" and t["embedding"].rows_source == "hint"
    assert est.dense_params == DEEPFM_DENSE_PARAMS and not est.candidates
    assert est.flops_per_sample == DEEPFM_FLOPS
    d = json.loads(json.dumps(est.to_dict()))
    assert d["plan"]["ps"]["replicas"] >= 1 and isinstance(d["plan"]["ps"]["memory_bytes"], int)


def test_tf1_deepfm_inventory_and_metagraph(tmp_path):
    import tensorflow as tf
    est = graph_opt.estimate("tests.test_graph_opt:deepfm_tf1", fn_kwargs={"dim": 4},
                             rows={"embedding": 10_000, "linear": 10_000})
    t = _tables(est)
    assert est.kind == "tf1" and set(t) == {"embedding", "linear"}
    assert (t["embedding"].dim, t["embedding"].optimizer, t["embedding"].num_slots) == (4, "ftrl", 2)
    assert t["linear"].feature == "cat" and t["linear"].input_dtype == "int64"
    assert t["linear"].ids_per_sample == 26
    # Adam slots, beta powers and global state are not model weights
    assert est.dense_params == (26 * 4 + 13) * 128 + 128 + 128 * 64 + 64 + 13 + 1 + 64 + 1
    # 2 x (117 x 128 + 128 x 64 + 64 + 13) MACs = 46,490, plus element-wise ops
    assert 46_490 <= est.flops_per_sample < 48_000

    # the same graph as a MetaGraph file: the tables survive in the spec constants
    from graph_opt.inventory import planning_context
    g = tf.Graph()
    with g.as_default(), planning_context():
        deepfm_tf1(4)
        path = str(tmp_path / "model.meta")
        tf.compat.v1.train.export_meta_graph(filename=path)
    est2 = graph_opt.estimate(path, rows={"embedding": 10_000, "linear": 10_000})
    assert est2.kind == "metagraph"
    assert {(x.name, x.dim, x.optimizer) for x in est2.tables} == \
        {(x.name, x.dim, x.optimizer) for x in est.tables}
    assert est2.dense_params == est.dense_params


def test_plain_embedding_flagged():
    est = graph_opt.estimate("examples.criteo.model:build_deepfm",
                             fn_kwargs={"vocab_size": 200_000, "dim": 8})
    assert not est.tables
    kinds = {c.name: c for c in est.candidates}
    assert kinds["embedding"].kind == "keras.layers.Embedding"
    assert kinds["embedding"].shape == [200_000, 8]
    assert kinds["embedding"].bytes == 200_000 * 8 * 4
    assert "ElasticEmbedding" in kinds["embedding"].reason


def test_saved_model_directory(tmp_path):
    import tensorflow as tf

    from examples.criteo.train import build_keras
    from graph_opt.inventory import planning_context
    with planning_context():  # saving traces call(), which declares the tables
        tf.saved_model.save(build_keras(1e-3, 16), str(tmp_path / "sm"))
    est = graph_opt.estimate(str(tmp_path / "sm"), rows={"embedding": 5000, "linear": 5000})
    assert est.kind == "savedmodel"
    t = _tables(est)
    assert (t["embedding"].dim, t["embedding"].optimizer) == (16, "adam")
    assert (t["linear"].dim, t["linear"].num_slots) == (1, 3)
    assert est.dense_params == (26 * 16 + 13) * 128 + 128 + 128 * 64 + 64 + 13 + 1 + 64 + 1


def test_hyperloglog_accuracy():
    rng = np.random.default_rng(5)
    for distinct in (1_000, 50_000, 400_000):
        universe = rng.integers(-2 ** 62, 2 ** 62, distinct)
        ids = universe[rng.integers(0, distinct, 3 * distinct)]  # repeats
        ids[:distinct] = universe  # every id at least once
        sk = HyperLogLog()
        for chunk in np.array_split(ids, 7):
            sk.add(chunk)
        assert abs(sk.count() / distinct - 1) < 0.03, (distinct, sk.count())
    a, b = HyperLogLog(), HyperLogLog()
    a.add(np.arange(0, 60_000))
    b.add(np.arange(30_000, 90_000))
    a.merge(b)
    assert abs(a.count() / 90_000 - 1) < 0.03
    est, beta = heaps_extrapolate([(100, 50.0), (200, 80.0)], 400)
    assert beta == pytest.approx(np.log2(1.6)) and est == pytest.approx(128.0)


def test_rows_from_sampled_data(tmp_path):
    import tensorflow as tf

    from examples.criteo.generate import generate
    from examples.criteo.reader import parse_lines
    files = generate(str(tmp_path / "data"), 12_000, files=2, seed=4)["train"]
    lines = [ln for f in files for ln in open(f, "rb").read().splitlines()]
    exact = np.unique(parse_lines(tf.constant(lines))[0]["cat"].numpy()).size
    est = graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs={"lr": 1e-3, "dim": 8},
                             data=[str(tmp_path / "data" / "train-*.txt")],
                             parse="examples.criteo.reader:parse_lines", sample_records=50_000)
    t = _tables(est)
    assert t["embedding"].rows_source == "sample"
    assert abs(t["embedding"].rows / exact - 1) < 0.03, (t["embedding"].rows, exact)
    assert est.sampling["total_records"] == 12_000
    # half the data: extrapolated by Heaps' law, an upper bound that stays close
    half = graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs={"lr": 1e-3, "dim": 8},
                              data=[str(tmp_path / "data" / "train-*.txt")],
                              parse="examples.criteo.reader:parse_lines", sample_records=6_000)
    h = _tables(half)["embedding"]
    assert h.rows_source.startswith("sample+heaps") and 0.95 < h.rows / exact < 1.25


def test_memory_model_and_plan_arithmetic():
    from deeprec_ext.store.optimizers import _REGISTRY
    assert SLOTS_PER_ROW == {n: c.num_slots for n, c in _REGISTRY.items()}
    assert index_capacity(0) == 2048 and index_capacity(1024) == 2048
    assert index_capacity(1025) == 4096 and index_capacity(300_000) == 1 << 20
    b = table_bytes(100_000, 8, 3)
    assert b["arena"] == 100_000 * 32 * 4 and b["row_arrays"] == 2_000_000  # 20 B a row
    assert b["index"] == 4 * 262_144
    one = ps_bytes([{"name": "t", "rows": 1_000_000, "dim": 8, "num_slots": 3}], 1, base_bytes=0)
    two = ps_bytes([{"name": "t", "rows": 1_000_000, "dim": 8, "num_slots": 3}], 2, base_bytes=0)
    assert one["copies"] == 1 and two["copies"] == 2  # ring replica with 2+ PS
    assert two["arena"] == 2 * 500_000 * 128 and one["arena"] == 1_000_000 * 128

    rows = 50_000_000
    est = graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs={"lr": 1e-3, "dim": 8},
                             rows={"embedding": rows, "linear": rows},
                             plan_inputs=PlanInputs(ps_memory_limit_bytes=4 * 2 ** 30, workers=3))
    plan = est.plan
    assert plan.worker.replicas == 3
    # memory-bound: the smallest n whose estimated RSS x 1.25 fits 4 GiB
    tables = [{"name": t.name, "rows": t.rows, "dim": t.dim, "num_slots": t.num_slots}
              for t in est.tables]
    n = plan.ps.replicas
    assert ps_bytes(tables, n)["total"] * 1.25 <= 4 * 2 ** 30 * 1.001
    assert ps_bytes(tables, n - 1)["total"] * 1.25 > 4 * 2 ** 30
    assert plan.ps.memory_bytes >= plan.ps.estimated_rss_bytes * 1.25
    assert plan.ps.memory_bytes <= 4 * 2 ** 30 and plan.ps.cpu >= 0.5
    assert any("PS count = max(memory" in line for line in est.arithmetic)


def _cli(argv, capsys):
    from aimaster.cli import main
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_and_text(capsys):
    code, out, err = _cli(["estimate", "examples.criteo.train:build_keras", "--arg", "lr=0.001",
                           "--arg", "dim=8", "--rows", "embedding=2.5m", "--rows",
                           "linear=2500000", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert set(d["plan"]) >= {"ps", "worker"}
    for role in ("ps", "worker"):
        assert isinstance(d["plan"][role]["replicas"], int)
        assert isinstance(d["plan"][role]["memory_bytes"], int)
        assert isinstance(d["plan"][role]["cpu"], float)
    assert {t["name"]: t["rows"] for t in d["tables"]} == {"embedding": 2_500_000,
                                                          "linear": 2_500_000}
    code, out, _ = _cli(["estimate", "examples.criteo.train:build_keras", "--arg", "lr=0.001",
                         "--arg", "dim=8",
                         "--rows", "embedding=1000", "--rows", "linear=1000"], capsys)
    assert code == 0 and "arithmetic:" in out and "RSS of one PS" in out


@pytest.mark.parametrize("argv, message", [
    (["no_such_module_xyz:build"], "cannot import module 'no_such_module_xyz'"),
    (["examples.criteo.model:no_such_fn"], "has no attribute 'no_such_fn'"),
    (["examples.criteo.model:NUM_CAT"], "is not callable"),
    (["tests.test_graph_opt:not_a_model"], "not a model"),
    # the model's own error, not a guess about graph mode
    (["tests.test_graph_opt:broken_model"], "ValueError: feature 'cat' has 27 columns, 26 expected"),
    (["examples.criteo.train:build_keras", "--arg", "lr=0.1", "--rows", "embedding"],
     "expected NAME=VALUE"),
    (["examples.criteo.train:build_keras", "--arg", "lr=0.1", "--rows", "embedding=lots"],
     "is not a row count"),
    (["examples.criteo.train:build_keras", "--arg", "lr=0.1", "--arg", "dim=8", "--rows", "nosuch=5"],
     "no elastic table named 'nosuch'"),
    (["examples.criteo.train:build_keras"], "pass arguments with --arg"),
])
def test_cli_bad_input(argv, message, capsys):
    code, out, err = _cli(["estimate", *argv], capsys)
    assert code == 2 and message in err and "Traceback" not in err and not out


def test_cli_bad_saved_model_and_graph_file(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _cli(["estimate", str(empty)], capsys)
    assert code == 2 and "not a SavedModel directory" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "saved_model.pb").write_bytes(b"\x00garbage\xff" * 10)
    code, _, err = _cli(["estimate", str(bad)], capsys)
    assert code == 2 and "cannot read SavedModel" in err
    junk = tmp_path / "junk.pb"
    junk.write_bytes(b"not a graph")
    code, _, err = _cli(["estimate", str(junk)], capsys)
    assert code == 2 and "not a readable MetaGraphDef or GraphDef" in err


def test_cli_subprocess_no_traceback_and_no_ps():
    """The real entry point: a clear message and exit 2, and no child process (no PS)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("DEEPREC_MASTER_ADDR", None)
    out = subprocess.run([sys.executable, "-m", "aimaster.cli", "estimate", "no_such_mod:f"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot import module" in out.stderr
    assert "Traceback" not in out.stderr
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs={"lr": 1e-3, "dim": 8},
                       rows={"embedding": 10, "linear": 10})
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_recording_client_refuses_data_plane():
    from graph_opt.inventory import RecordingClient
    with pytest.raises(EstimateError, match="PSClient.lookup"):
        RecordingClient().lookup("t", np.arange(3))
