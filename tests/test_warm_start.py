"""Warm start (``init_from``) onto another PS count and num_slots, with real PS processes:
rows and optimizer slots arrive bit for bit, the job's hyperparameters win, a dim that
differs is refused by name, and a bad ``init_from`` fails the job before it trains."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import checkpoint
from deeprec_ext import PSClient
from deeprec_ext.errors import InvalidRequestError
from tests.conftest import ROOT

N = 20_000
INIT = {"name": "normal", "stddev": 0.05, "seed": 3}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "aimaster.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def day1(tmp_path_factory):
    """A 2-PS job (num_slots 4096) that trained table 'emb' and took a full checkpoint."""
    from tests.conftest import Job
    d = tmp_path_factory.mktemp("day1")
    job = Job(d, {"name": "day1", "ps": {"replicas": 2}}, ["--workers", "0"])
    try:
        c = PSClient.connect(job.address, timeout=60)
        c.create_table("emb", 8, initializer=INIT,
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
        rng = np.random.default_rng(0)
        ids = np.arange(N, dtype=np.int64) * 7919 - 50_000
        for _ in range(3):
            c.push("emb", ids, rng.normal(0, 0.1, (N, 8)).astype(np.float32))
        c.close()
        out = _cli("checkpoint", "--master", job.address, "--full")
        assert out.returncode == 0, out.stderr
        path = json.loads(out.stdout)["path"]
    finally:
        job.stop()
    return {"path": path, "ids": ids}


def test_warm_start_onto_3_ps_and_other_num_slots(day1, start_job):
    want = checkpoint.load(day1["path"]).tables["emb"]
    job = start_job({"name": "day2", "num_slots": 1000, "ps": {"replicas": 3},
                     "init_from": day1["path"]}, ["--workers", "0"])
    c = PSClient.connect(job.address, timeout=60)
    with pytest.raises(InvalidRequestError, match=r"table 'emb'.*dim 4.*warm-start checkpoint.*"
                                                  r"dim 8"):
        c.create_table("emb", 4, initializer=INIT, optimizer="adagrad")
    # the job's learning rate replaces the checkpoint's; values and accumulators are kept
    c.create_table("emb", 8, initializer=INIT, optimizer={"name": "adagrad", "learning_rate": 0.5})
    got = c.lookup("emb", want.ids, insert_missing=False)
    np.testing.assert_array_equal(got.view(np.uint32), want.values.view(np.uint32))
    st = job.status()
    ev = next(e for e in st["events"] if e["kind"] == "warm_start")
    # status shows the global step carried from day 1 and where every slot lives
    assert st["global_step"] == ev["global_step"] == 0  # day 1 had no workers
    placement = st["placement"]
    assert placement["num_slots"] == 1000 and sorted(placement["ps"]) == ["ps-0", "ps-1", "ps-2"]
    assert sum(p["slots"] for p in placement["ps"].values()) == 1000
    assert st["final_checkpoint"] is None and st["model_recorded"] is False
    assert ev["rows"] == len(want) and ev["tables"] == ["emb"]
    assert ev["from_num_slots"] == 4096 and ev["num_slots"] == 1000
    g = np.full((1, 8), 0.2, np.float32)
    c.push("emb", want.ids[:1], g)
    acc = want.slots[0] + g[0] ** 2
    expect = want.values[0] - 0.5 * g[0] / (np.sqrt(acc) + 1e-7)
    np.testing.assert_allclose(c.lookup("emb", want.ids[:1], insert_missing=False)[0], expect,
                               rtol=1e-5)
    c.close()


def test_warm_start_onto_the_same_layout_installs_each_ps_saved_index(day1, start_job):
    """Day 2 on day 1's layout (2 PS, 4096 slots): each PS restores its part with the
    hash index the full checkpoint saved for it (no key placed, says its log), and every
    row arrives bit for bit."""
    want = checkpoint.load(day1["path"]).tables["emb"]
    job = start_job({"name": "day2-same", "ps": {"replicas": 2}, "init_from": day1["path"]},
                    ["--workers", "0"])
    c = PSClient.connect(job.address, timeout=60)
    c.create_table("emb", 8, initializer=INIT, optimizer={"name": "adagrad", "learning_rate": 0.05})
    got = c.lookup("emb", want.ids, insert_missing=False)
    np.testing.assert_array_equal(got.view(np.uint32), want.values.view(np.uint32))
    c.close()
    logs = "".join(p.read_text(errors="replace") for p in (job.state_dir / "logs").glob("ps-*"))
    assert logs.count("saved index installed: emb") == 2, logs[-3000:]


def test_warm_start_reset_optimizer(day1, start_job):
    want = checkpoint.load(day1["path"]).tables["emb"]
    job = start_job({"name": "day2r", "ps": {"replicas": 1}, "init_from": day1["path"],
                     "reset_optimizer": True}, ["--workers", "0"])
    c = PSClient.connect(job.address, timeout=60)
    c.create_table("emb", 8, initializer=INIT, optimizer={"name": "adagrad", "learning_rate": 0.5})
    g = np.full((1, 8), 0.2, np.float32)
    c.push("emb", want.ids[:1], g)
    acc = 0.1 + g[0] ** 2  # a fresh accumulator (adagrad's initial 0.1), not the checkpoint's
    expect = want.values[0] - 0.5 * g[0] / (np.sqrt(acc) + 1e-7)
    np.testing.assert_allclose(c.lookup("emb", want.ids[:1], insert_missing=False)[0], expect,
                               rtol=1e-5)
    c.close()


def test_bad_init_from_fails_the_job_with_its_name(tmp_path, start_job):
    job = start_job({"name": "bad", "ps": {"replicas": 1},
                     "init_from": str(tmp_path / "nowhere")}, ["--workers", "0"])
    assert job.wait(60) != 0
    assert job.state()["phase"] == "failed"
    assert "init_from" in job.state()["message"] and "nowhere" in job.state()["message"]


def test_warm_start_into_float16_storage(day1, start_job):
    """The job's storage dtype wins: a float32 checkpoint warm-started into a float16 table
    holds its values rounded to float16 and its adagrad accumulators unchanged (float32),
    and later pushes round to float16."""
    want = checkpoint.load(day1["path"]).tables["emb"]
    job = start_job({"name": "day2h", "ps": {"replicas": 2}, "init_from": day1["path"]},
                    ["--workers", "0"])
    c = PSClient.connect(job.address, timeout=60)
    c.create_table("emb", 8, initializer=INIT, optimizer={"name": "adagrad", "learning_rate": 0.5},
                   dtype="float16")
    f16 = want.values.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(c.lookup("emb", want.ids, insert_missing=False), f16)
    g = np.full((1, 8), 0.2, np.float32)
    c.push("emb", want.ids[:1], g)
    acc = want.slots[0] + g[0] ** 2  # the checkpoint's accumulator, kept as float32
    expect = (f16[0] - np.float32(0.5) * g[0] / (np.sqrt(acc) + np.float32(1e-7)))
    got = c.lookup("emb", want.ids[:1], insert_missing=False)[0]
    np.testing.assert_array_equal(got, got.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(got, expect, rtol=2e-3)  # within a float16 rounding
    c.close()
