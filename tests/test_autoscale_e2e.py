"""End to end: the autoscale policy scales PS out before a growing table exhausts a PS's
memory budget, and no row is lost on the way. A real AIMaster with real PS processes; this
test process pushes new keys at a steady rate and samples every PS's Stats throughout."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from deeprec_ext import PSClient
from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, wait_for

LIMIT_MB = 256
NEW_KEYS_PER_S = 6_000   # the largest table; about 2 MiB/s of PS RSS in all
JOB = {
    "name": "autoscale-e2e", "num_slots": 256,
    "ps": {"replicas": 1, "max_replicas": 3},
    "autoscale": {"enabled": True, "ps_memory_limit_mb": LIMIT_MB, "interval_seconds": 0.5,
                  "lead_seconds": 6, "window_seconds": 10, "measure_seconds": 5,
                  "memory_headroom": 0.1, "performance_fit": False},
}
TABLES = ("t0", "t1", "t2", "t3")
DIM = 16
MiB = 1024 * 1024


class KeyGrower:
    """Pushes +1 (SGD, lr 1, gradient -1) to ``new_per_s`` new keys per second in every
    table, plus a quarter as many repeats of older keys, keeping the exact expected counts."""

    def __init__(self, client: PSClient, new_per_s: int, max_keys: int, batch: int = 2000):
        self.client, self.batch = client, batch
        self.period = batch / new_per_s
        self.expected = np.zeros((len(TABLES), max_keys), dtype=np.int64)
        self.next_key = 0
        self.errors: list = []
        self._rng = np.random.default_rng(5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        next_at = time.monotonic()
        try:
            while not self._stop.is_set() and self.next_key + self.batch <= self.expected.shape[1]:
                new = np.arange(self.next_key, self.next_key + self.batch, dtype=np.int64)
                old = self._rng.integers(0, max(self.next_key, 1), self.batch // 4) \
                    if self.next_key else np.empty(0, np.int64)
                # table j gets the first (j + 1) / 4 of the new keys: the tables grow at
                # different rates, so their arenas do not all double at the same moment
                parts = {t: np.concatenate([new[: self.batch * (j + 1) // len(TABLES)], old])
                         for j, t in enumerate(TABLES)}
                self.client.push_many({t: (p, -np.ones((p.size, DIM), np.float32))
                                       for t, p in parts.items()})
                for j, t in enumerate(TABLES):
                    np.add.at(self.expected[j], parts[t], 1)
                self.next_key += self.batch
                next_at += self.period
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - surfaced by stop()
            self.errors.append(exc)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(60)
        assert not self.errors, self.errors


def status(address: str) -> master_pb2.StatusResponse:
    with insecure_channel(address) as ch:
        return master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(), timeout=10)


def vm_hwm(pid: int) -> int:
    """Peak RSS of a process so far (bytes): catches transients between samples."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


class Sampler:
    """Every PS's Stats (and peak RSS from /proc) every 0.2 s, from a background thread."""

    def __init__(self, address: str):
        self.address = address
        self.samples: list[tuple[float, str, int, int]] = []   # time, ps id, rss, limit
        self.table_bytes: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                for m in status(self.address).members:
                    if m.role != "ps" or m.state != "running":
                        continue
                    with insecure_channel(m.address) as ch:
                        s = ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=5)
                    self.samples.append((time.monotonic(), m.id, s.rss_bytes, s.memory_limit_bytes))
                    self.table_bytes[m.id] = sum(t.bytes for t in s.tables)
                    try:
                        self.peaks[m.id] = max(self.peaks.get(m.id, 0), vm_hwm(m.pid))
                    except FileNotFoundError:
                        pass
            except Exception:  # noqa: BLE001 - a PS mid-start; the next round samples it
                pass
            self._stop.wait(0.2)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(30)


def scale_events(address: str) -> tuple[list[dict], list[dict]]:
    events = [json.loads(e) for e in status(address).events_json]
    return ([e for e in events if e["kind"] == "autoscale"],
            [e for e in events if e["kind"] == "scale"])


def test_growing_table_scales_ps_out_before_the_memory_limit(start_job):
    job = start_job(JOB)
    client = PSClient.connect(job.address)
    for t in TABLES:
        client.create_table(t, dim=DIM, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
    sampler = Sampler(job.address).start()
    grower = KeyGrower(client, new_per_s=NEW_KEYS_PER_S, max_keys=1_200_000).start()
    try:
        # grow until the policy scaled out, then keep growing for a while on the new layout
        wait_for(lambda: any(e["ps"][1] > e["ps"][0] for e in scale_events(job.address)[1]),
                 70, "a PS scale-out by the policy", interval=0.5)
        time.sleep(8)
    finally:
        grower.stop()
        sampler.stop()

    autoscale, scales = scale_events(job.address)
    fits = [e for e in autoscale if e["rule"] == "resource-fit" and e["applied"]]
    assert fits, autoscale
    assert "limit" in fits[0]["reason"] and fits[0]["ps"] >= 2
    assert scales[0]["ps"][0] == 1 and scales[0]["ps"][1] >= 2

    # every PS reported the budget from the job file, and none went above it: neither in
    # any Stats sample taken throughout, nor in its peak RSS (VmHWM) between samples
    assert sampler.samples
    assert {limit for _, _, _, limit in sampler.samples} == {LIMIT_MB * MiB}
    worst = max(sampler.samples, key=lambda s: s[2])
    assert worst[2] <= LIMIT_MB * MiB, f"{worst[1]} RSS {worst[2] / MiB:.0f} MiB > {LIMIT_MB} MiB"
    assert max(sampler.peaks.values()) <= LIMIT_MB * MiB, sampler.peaks
    # the first PS really did approach its limit: the scale-out was needed, not premature
    first = max(rss for _, ps, rss, _ in sampler.samples if ps == "ps-0")
    assert first > 0.5 * LIMIT_MB * MiB, f"ps-0 peaked at {first / MiB:.0f} MiB"

    # no row was lost: every key of every table has exactly its pushed count
    n = grower.next_key
    ids = np.arange(n, dtype=np.int64)
    values = client.lookup_many({t: ids for t in TABLES}, insert_missing=False)
    for j, t in enumerate(TABLES):
        np.testing.assert_array_equal(values[t][:, 0], grower.expected[j, :n].astype(np.float32))
        assert (values[t] == values[t][:, :1]).all()
    rows = {t: 0 for t in TABLES}
    for s in client.ps_stats():
        for ts in s.tables:
            rows[ts.name] += ts.rows
    assert rows == {t: int((grower.expected[j, :n] > 0).sum()) for j, t in enumerate(TABLES)}

    # cost accounting is shown by `aimaster status`, as JSON and as text
    d = job.status()["autoscale"]
    assert d["cost"]["ps"]["allocated_core_seconds"] > 0
    assert 0 < d["cost"]["ps"]["used_core_seconds"]
    assert d["cost"]["ps"]["allocated_gb_seconds"] > d["cost"]["ps"]["used_gb_seconds"] > 0
    assert any(x["rule"] == "resource-fit" for x in d["decisions"])
    text = subprocess.run([sys.executable, "-m", "aimaster.cli", "status", "--master", job.address],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert text.returncode == 0 and "core-s alloc" in text.stdout and "resource-fit" in text.stdout
    client.close()


@pytest.mark.parametrize("bad, message", [
    ({"recovery": "retry"}, "autoscale.recovery"),
    ({"memory_headroom": 2}, "autoscale.memory_headroom"),
    ({"cooldown": 5}, "unknown key"),
])
def test_bad_autoscale_section_is_refused_with_its_name(tmp_path, bad, message):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "bad", "autoscale": {"enabled": True, **bad},
                               "master": {"state_dir": str(tmp_path / "state")}}))
    out = subprocess.run([sys.executable, "-m", "aimaster.cli", "run", str(job)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert message in out.stderr + out.stdout
    assert not (tmp_path / "state" / "master.addr").exists()
