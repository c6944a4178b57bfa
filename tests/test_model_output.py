"""The model outlives the job: a real DeepFM job (AIMaster + 2 PS + 2 workers) ends with a
final checkpoint and a SavedModel; that SavedModel, loaded by a process in which this
project cannot be imported, predicts what the live job's model predicted (ids never seen
in training included); tomorrow's job warm-starts from the checkpoint on 3 PS with
another num_slots, starts from the very same model, and trains on."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import checkpoint
from tests.conftest import ROOT

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FRESH_PROCESS = textwrap.dedent("""
    import sys
    # the project must not be importable here: only TensorFlow serves the model
    for name in ("deeprec_ext", "aimaster", "checkpoint", "examples", "gazer", "graph_opt"):
        sys.modules[name] = None
    try:
        import deeprec_ext  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("deeprec_ext is importable")
    import numpy as np
    import tensorflow as tf
    model_dir, features, out = sys.argv[1:4]
    f = np.load(features)
    serve = tf.saved_model.load(model_dir).signatures["serving_default"]
    preds = []
    for i in range(0, len(f["cat"]), 4096):
        y = serve(dense=tf.constant(f["dense"][i:i + 4096]), cat=tf.constant(f["cat"][i:i + 4096]))
        preds.append(y["predictions"].numpy().ravel())
    np.save(out, np.concatenate(preds))
""")


def _job(data, test_file, preds, workers=2, ps=2, extra=None, worker_args=()):
    job = {
        "name": "model-output",
        "ps": {"replicas": ps},
        "worker": {"replicas": workers, "max_restarts": 0,
                   "command": ["{python}", "-m", "examples.criteo.train", "--test", test_file,
                               "--predictions-out", preds, *worker_args]},
        "data": {"files": data, "records_per_shard": 10_000},
        "master": {"heartbeat_seconds": 0.5},
    }
    job.update(extra or {})
    return job


@pytest.fixture(scope="module")
def day1(tmp_path_factory):
    """Day 1: train, final checkpoint, export; the test file mixes the example's test
    records with copies whose categorical values were never seen in training."""
    from examples.criteo.generate import generate
    from examples.criteo.reader import criteo_dataset
    from tests.conftest import Job
    d = tmp_path_factory.mktemp("model_output")
    # one distribution, two days: files 0-2 are day 1, file 3 arrives on day 2
    data = generate(str(d / "data"), rows=80_000, files=4, test_rows=4_000, seed=5)
    day2 = {"train": data["train"][3:]}
    data["train"] = data["train"][:3]
    lines = open(data["test"]).read().splitlines()
    rng = np.random.default_rng(0)
    unseen = []
    for line in lines[:1000]:
        cols = line.split("\t")
        for j in range(14, 40):
            if cols[j] and rng.random() < 0.5:
                cols[j] = f"{rng.integers(1 << 32):08x}"
        unseen.append("\t".join(cols))
    test_file = d / "test-mixed.txt"
    test_file.write_text("\n".join(lines + unseen) + "\n")
    feats = {"dense": [], "cat": []}
    for f, _ in criteo_dataset([str(test_file)], 4096):
        feats["dense"].append(f["dense"].numpy())
        feats["cat"].append(f["cat"].numpy())
    features = d / "features.npz"
    np.savez(features, dense=np.concatenate(feats["dense"]), cat=np.concatenate(feats["cat"]))
    preds = d / "live.npy"
    export_base = d / "export"
    (d / "run1").mkdir()
    job = Job(d / "run1", _job(data["train"], str(test_file), str(preds),
                               extra={"export": {"dir": str(export_base)}}))
    try:
        code = job.wait(400)
        assert code == 0, job.output()[-4000:]
        state, output = job.state(), job.output()
        auc = json.loads((d / "run1" / "state" / "metrics-worker-0.json").read_text())["auc"]
    finally:
        job.stop()
    return {"dir": d, "state": state, "auc": auc, "output": output, "test": str(test_file),
            "features": str(features), "live": np.load(preds), "export_base": export_base,
            "n_unseen": len(unseen), "day2": day2}


def test_final_checkpoint_is_taken_verified_and_reported(day1):
    state = day1["state"]
    assert state["phase"] == "succeeded"
    path = state["final_checkpoint"]
    assert path and os.path.isdir(path) and path.endswith("-full")
    last = [ln for ln in day1["output"].splitlines() if "final checkpoint" in ln]
    assert last and path in last[-1]
    out = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", path.rsplit("/", 1)[0]],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = checkpoint.load(path)
    assert sorted(got.tables) == ["embedding", "linear"]
    assert got.model["kind"] == "keras" and got.global_step == state["global_step"] > 0
    assert "deep_0/kernel" in got.dense and got.dense["deep_0/kernel"].shape == (26 * 8 + 13, 128)
    assert got.tables["embedding"].slots.shape[1] == 3 * 8  # Adam: m, v and its step count
    ev = next(e for e in state["events"] if e["kind"] == "checkpoint" and e["final"])
    assert ev["path"] == path


def test_export_in_a_fresh_process_matches_the_live_model(day1, tmp_path):
    versions = os.listdir(day1["export_base"])
    assert len(versions) == 1 and versions[0].isdigit()  # TF Serving's BASE/<version>
    model_dir = day1["export_base"] / versions[0]
    assert day1["state"]["export_dir"] == str(model_dir)
    out = tmp_path / "served.npy"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(model_dir), day1["features"],
                        str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    served, live = np.load(out), day1["live"]
    assert served.shape == live.shape
    n = day1["n_unseen"]
    # the unseen half really holds ids the tables never saw
    f = np.load(day1["features"])
    ids = checkpoint.load(day1["state"]["final_checkpoint"], tables=["embedding"]).tables["embedding"].ids
    assert (~np.isin(f["cat"][-n:], ids)).sum() > 5 * n
    err = np.abs(served - live)
    print(f"max |export - live| = {err.max():.2e} (seen {err[:-n].max():.2e}, "
          f"unseen {err[-n:].max():.2e})")
    assert err.max() <= 1e-5


def test_offline_export_options_and_bad_input(day1, tmp_path):
    ckpt = day1["state"]["final_checkpoint"]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "aimaster.cli", "export", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "emb16"
    r = run(ckpt, "--out", str(out), "--tables", "embedding", "--dtype", "float16", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["signatures"] == ["lookup_embedding"] and summary["dtype"] == "float16"
    import tensorflow as tf
    lookup = tf.saved_model.load(str(out)).signatures["lookup_embedding"]
    t = checkpoint.load(ckpt, tables=["embedding"]).tables["embedding"]
    got = lookup(ids=tf.constant(t.ids[:500]))["values"].numpy()
    np.testing.assert_allclose(got, t.values[:500].astype(np.float16).astype(np.float32))
    # keep only rows updated by >= 3 pushes: the others are served like unseen ids
    full = checkpoint.load(ckpt, tables=["embedding"]).tables["embedding"]
    assert full.counts.max() >= 3 and (full.counts < 3).any()
    out3 = tmp_path / "min3"
    r = run(ckpt, "--out", str(out3), "--min-count", "3", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    kept = full.counts >= 3
    assert summary["tables"]["embedding"] == int(kept.sum())
    assert summary["rows_below_min_count"]["embedding"] == int((~kept).sum())
    lookup3 = tf.saved_model.load(str(out3)).signatures["lookup_embedding"]
    got = lookup3(ids=tf.constant(full.ids))["values"].numpy()
    np.testing.assert_array_equal(got[kept], full.values[kept])
    from deeprec_ext.store.initializers import make_initializer
    init = make_initializer(full.config["initializer"], full.dim)
    np.testing.assert_array_equal(got[~kept], init(full.ids[~kept]))
    # bad input: a clear message naming the problem, exit 1, nothing written
    r = run(ckpt, "--out", str(tmp_path / "x"), "--min-count", "-1")
    assert r.returncode == 1 and "min_count" in r.stderr and not (tmp_path / "x").exists()
    r = run(ckpt, "--out", str(out))
    assert r.returncode == 1 and "exists" in r.stderr
    r = run(ckpt, "--out", str(tmp_path / "x"), "--tables", "nope")
    assert r.returncode == 1 and "nope" in r.stderr and not (tmp_path / "x").exists()
    r = run(str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert r.returncode == 1 and "missing" in r.stderr
    broken = tmp_path / "broken" / os.path.basename(ckpt)
    shutil.copytree(ckpt, broken)
    data = next(p for p in sorted(broken.iterdir()) if p.name.endswith(".rows")
                and "embedding" in p.name)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    r = run(str(broken), "--out", str(tmp_path / "x"))
    assert r.returncode == 1 and os.path.basename(ckpt) in r.stderr, r.stderr
    manifest = json.loads((broken / "manifest.json").read_text())
    shutil.copy(os.path.join(ckpt, data.name), data)
    manifest["version"] = 999
    (broken / "manifest.json").write_text(json.dumps(manifest))
    r = run(str(broken), "--out", str(tmp_path / "x"))
    assert r.returncode == 1 and "version" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x")]  # no temp left


def test_warm_start_on_3_ps_starts_from_the_same_model_then_trains(day1, tmp_path):
    """Day 2: another PS count and num_slots; the model before any training predicts
    exactly what day 1 ended with (bit for bit against the live day-1 model, within 1e-5
    of the day-1 export), then trains on the new data."""
    from tests.conftest import Job
    before = tmp_path / "before.npy"
    after = tmp_path / "after.npy"
    ckpt = day1["state"]["final_checkpoint"]
    (tmp_path / "run2").mkdir()
    job = Job(tmp_path / "run2", _job(day1["day2"]["train"], day1["test"], str(after), workers=1,
                                      ps=3, worker_args=["--predictions-before-out", str(before)],
                                      extra={"num_slots": 2048, "init_from": ckpt}))
    try:
        assert job.wait(400) == 0, job.output()[-4000:]
        state = job.state()
    finally:
        job.stop()
    start = np.load(before)
    np.testing.assert_array_equal(start.view(np.uint32), day1["live"].view(np.uint32))
    ev = next(e for e in state["events"] if e["kind"] == "warm_start")
    assert ev["num_slots"] == 2048 and ev["from_num_slots"] == 4096
    assert state["global_step"] > ev["global_step"] > 0  # the step carries on
    trained = np.load(after)
    assert np.abs(trained - start).max() > 1e-3  # day 2 changed the model
    metrics = json.loads((tmp_path / "run2" / "state" / "metrics-worker-0.json").read_text())
    print(f"test AUC after day 1 {day1['auc']:.4f}, after day 2 {metrics['auc']:.4f}")
    assert metrics["auc"] > day1["auc"]  # more data of the same distribution: better
