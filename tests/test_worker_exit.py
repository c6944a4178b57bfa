"""A worker that dies of an exception leaves at once (TensorFlow's teardown threads would
hold it, heartbeating and holding its shards, for tens of seconds), and the job's failure
message says how every worker ended, not only those that exited non-zero."""
from __future__ import annotations

import json
import time

from tests.conftest import ROOT, wait_for

WORKER = '''
import json, os, sys, threading, time
from deeprec_ext.worker import get_context
ctx = get_context()
shard = ctx.try_next_shard()
# a non-daemon thread, as tf.data's and gRPC's: interpreter exit waits for it
threading.Thread(target=time.sleep, args=(120,), name="like-tf-data").start()
if ctx.worker_id == "worker-0":
    with open(sys.argv[1], "w") as f:
        json.dump({"crashed_at": time.time()}, f)
    raise RuntimeError("boom: the training step failed")
os._exit(0)  # worker-1 ends early without finishing its data
'''


def test_crashed_worker_exits_at_once_and_failure_names_every_worker(start_job, tmp_path):
    data = tmp_path / "records.txt"
    data.write_text("\n".join(str(i) for i in range(4000)) + "\n")
    script = tmp_path / "crashing_worker.py"
    script.write_text(WORKER)
    crash_file = tmp_path / "crash.json"
    job = start_job({
        "name": "crash",
        "ps": {"replicas": 1},
        "worker": {"replicas": 2, "max_restarts": 0,
                   "command": ["{python}", str(script), str(crash_file)],
                   "env": {"PYTHONPATH": str(ROOT)}},
        "data": {"files": [str(data)], "records_per_shard": 500},
        "master": {"heartbeat_seconds": 0.5, "lease_seconds": 10},
        "checkpoint": {"on_success": False},
    })
    assert job.wait(90) == 1, job.output()[-3000:]
    crashed_at = json.loads(crash_file.read_text())["crashed_at"]
    state = job.state()
    ends = {e["id"]: e for e in state["events"] if e["kind"] == "worker_end"}
    # seen within a heartbeat or two, not after the 10 s lease or the 120 s thread
    assert ends["worker-0"]["time"] - crashed_at < 5.0, ends
    assert ends["worker-0"]["reason"] == "exit code 1"
    assert state["phase"] == "failed"
    message = state["message"]
    assert "shards unprocessed" in message
    assert "worker-0 exited 1" in message and "worker-1 exited 0" in message, message
    assert "logs" in message
    log = (job.state_dir / "logs" / "worker-0.log").read_text()
    assert "RuntimeError: boom" in log  # the traceback is printed before the exit
    assert time.time() - crashed_at < 60
