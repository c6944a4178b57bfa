"""Workers the local launcher starts get TensorFlow thread counts for their share of the
host's cores (PS and workers share it), unless the job or the environment sets them."""
from __future__ import annotations

import json
import os
import time

from aimaster.config import parse_job
from aimaster.scaler import ScalePlan
from aimaster.scaler.local import TF_THREAD_VARS, LocalProcessScaler, tf_thread_env

# written aside and renamed: the test reads a file as soon as it exists
DUMP = ("import json, os, sys; p = os.path.join(sys.argv[1], os.environ['DEEPREC_MEMBER_ID']); "
        "f = open(p + '.tmp', 'w'); json.dump({k: os.environ.get(k) for k in "
        "('TF_NUM_INTEROP_THREADS', 'TF_NUM_INTRAOP_THREADS')}, f); f.close(); "
        "os.replace(p + '.tmp', p + '.json')")


def test_a_workers_share_of_the_cores():
    assert tf_thread_env({}, 2, cores=2) == {k: "1" for k in TF_THREAD_VARS}
    assert tf_thread_env({}, 3, cores=16) == {k: "5" for k in TF_THREAD_VARS}
    assert tf_thread_env({}, 8, cores=2) == {k: "1" for k in TF_THREAD_VARS}  # at least 1
    assert tf_thread_env({}, 1, cores=16) == {}  # alone on the host: TF's own default
    assert tf_thread_env({"TF_NUM_INTRAOP_THREADS": "4"}, 2, cores=16) == {}  # the user's


def _run(tmp_path, worker_env: dict) -> dict:
    out = tmp_path / "env"
    out.mkdir()
    cfg = parse_job({"name": "thr", "ps": {"replicas": 1},
                     "worker": {"replicas": 2, "env": worker_env,
                                "command": ["{python}", "-c", DUMP, str(out)]}})
    s = LocalProcessScaler("127.0.0.1:1", cfg, str(tmp_path / "logs"))
    try:
        s.apply(ScalePlan(workers=2))  # no PS started: two processes on this host
        deadline = time.monotonic() + 30
        while len(list(out.glob("*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        s.shutdown(timeout=5)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_local_workers_get_their_share(tmp_path, monkeypatch):
    for k in TF_THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    got = _run(tmp_path, {})
    assert got == {f"worker-{i}": {k: share for k in TF_THREAD_VARS} for i in range(2)}


def test_the_jobs_own_thread_setting_wins(tmp_path, monkeypatch):
    for k in TF_THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    got = _run(tmp_path, {"TF_NUM_INTRAOP_THREADS": "3"})
    assert all(v == {"TF_NUM_INTEROP_THREADS": None, "TF_NUM_INTRAOP_THREADS": "3"}
               for v in got.values()) and len(got) == 2
