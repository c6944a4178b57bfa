"""Shared fixtures: real AIMaster jobs as subprocesses on loopback, always cleaned up."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from aimaster.state import load_state

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Job:
    """An ``aimaster run`` subprocess with its state dir."""

    def __init__(self, tmp_path: Path, job: dict, args: list[str] = ()):
        self.state_dir = tmp_path / "state"
        job = dict(job)
        job.setdefault("master", {})["state_dir"] = str(self.state_dir)
        job["master"].setdefault("progress_seconds", 1)
        self.job_file = tmp_path / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(job))
        self.log = open(tmp_path / "aimaster.log", "wb")
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aimaster.cli", "run", str(self.job_file), *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.address = wait_for(self._address, 60, "AIMaster address")

    def _address(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"aimaster exited with {self.proc.returncode}: {self.output()}")
        p = self.state_dir / "master.addr"
        return p.read_text() if p.exists() else None

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def state(self) -> dict:
        state = load_state(str(self.state_dir))
        if state is None:
            raise FileNotFoundError(f"no job state in {self.state_dir}")
        return state

    def status(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "aimaster.cli", "status", "--master",
                              self.address, "--json"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def member_pids(self) -> list[int]:
        """PIDs of the job's member processes: those the AIMaster started (a test may
        register members of its own, with any pid it likes)."""
        import psutil
        try:
            ours = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            ours = set()
        return [m["pid"] for m in self.state()["members"] if m["pid"] in ours]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout}s:\n{self.output()[-4000:]}")

    def stop(self):
        pids = []
        try:
            pids = self.member_pids()
        except Exception:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        # no member may outlive its AIMaster
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
                raise AssertionError(f"orphan process {p} outlived the AIMaster")


@pytest.fixture
def start_job(tmp_path):
    jobs = []

    def start(job: dict, args=(), subdir: str = ""):
        d = tmp_path / subdir if subdir else tmp_path
        d.mkdir(exist_ok=True)
        j = Job(d, job, list(args))
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.stop()


@pytest.fixture(scope="session")
def criteo_data(tmp_path_factory):
    """Synthetic Criteo-format data shared by the training tests."""
    from examples.criteo.generate import generate
    out = tmp_path_factory.mktemp("criteo")
    return generate(str(out), rows=200_000, files=2, test_rows=40_000, seed=3)


class CounterPusher:
    """A client pushing +1 per id occurrence to a counter table (SGD, lr 1, gradient -1)
    from a background thread, keeping the exact expected counts and when each push was
    acknowledged: what a recovery test compares the table against."""

    def __init__(self, client, table: str, n: int, batch: int = 1000, seed: int = 0):
        import threading

        import numpy as np
        self.client, self.table, self.batch = client, table, batch
        self.expected = np.zeros(n, dtype=np.int64)
        self.acked: list = []  # (monotonic time acknowledged, ids)
        self.errors: list = []
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import numpy as np
        try:
            while not self._stop.is_set():
                ids = self._rng.integers(0, self.expected.size, self.batch)
                self.client.push(self.table, ids, -np.ones((ids.size, 1), np.float32))
                np.add.at(self.expected, ids, 1)
                self.acked.append((time.monotonic(), ids))
        except Exception as exc:  # noqa: BLE001 - surfaced by stop()
            self.errors.append(exc)

    def start(self) -> "CounterPusher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self.errors, self.errors


# Files whose tests run whole jobs (AIMaster, PS and TensorFlow workers as processes) and
# check timings, throughput or detection windows. With `pytest -n 2` (scripts/test) they
# form one xdist group, so they run one after another on one worker, never two jobs at
# once; the other worker takes the unit and single-service tests beside them.
JOB_MODULES = {
    "test_soak.py", "test_elasticity.py", "test_training_e2e.py", "test_model_output.py",
    "test_gazer_live.py", "test_stragglers.py", "test_fault_tolerance.py",
    "test_consistent.py", "test_autoscale_e2e.py", "test_autoscale_eviction_e2e.py",
    "test_eval.py", "test_checkpoint_remote.py", "test_criteo_example.py",
    "test_data_watch.py", "test_eviction.py", "test_admission.py", "test_idempotency.py",
    "test_shutdown.py", "test_launcher.py", "test_placement.py", "test_data_remote.py",
    "test_replication_races.py", "test_warm_start.py", "test_tf_initializers.py",
    "test_shard_columns.py", "test_recovery_detection.py",
}


def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "numprocesses", None):
        return
    for item in items:
        if item.path.name in JOB_MODULES:
            item.add_marker(pytest.mark.xdist_group("jobs"))
