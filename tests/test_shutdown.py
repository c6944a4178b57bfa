"""SIGTERM to the AIMaster in the middle of a scale event: it exits within seconds,
stops every member (no orphan), and the client that asked for the scale gets an answer
that says what happened instead of hanging."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from deeprec_ext import PSClient
from tests.conftest import ROOT, wait_for


def test_sigterm_during_a_scale_event_exits_in_seconds(start_job):
    job = start_job({"name": "term", "ps": {"replicas": 1, "max_replicas": 3},
                     "master": {"heartbeat_seconds": 0.5}}, ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    client.create_table("big", dim=16, optimizer="adagrad")
    for i in range(15):  # 1.5M rows: the migration takes seconds
        client.lookup("big", np.arange(i * 100_000, (i + 1) * 100_000, dtype=np.int64))
    client.close()
    scale = subprocess.Popen([sys.executable, "-m", "aimaster.cli", "scale", "--master",
                              job.address, "--ps", "3"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        # underway once a new PS registered (rows still to move)
        wait_for(lambda: len(job.status()["members"]) >= 2, 60, "the scale to start")
        pids = job.member_pids()
        t0 = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        code = job.proc.wait(30)
        took = time.monotonic() - t0
        assert took < 20, f"the AIMaster took {took:.1f}s to exit after SIGTERM"
        assert code == 0, job.output()[-3000:]  # stopped by signal: STOPPED, exit 0
        out, err = scale.communicate(timeout=60)
        assert scale.returncode != 0 or "scale" in out  # an answer, not a hang
        if scale.returncode != 0:
            assert "aimaster" in err and any(w in err for w in (
                "stopping", "shutting down", "UNAVAILABLE", "CANCELLED", "not running")), err
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "members outlived the AIMaster"
    finally:
        if scale.poll() is None:
            scale.kill()
            scale.wait()


def _alive(pid: int) -> bool:
    from tests.conftest import pid_alive
    return pid_alive(pid)
