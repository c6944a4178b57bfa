"""End to end: a table whose rows plateau under eviction does not make the autoscaler add a
PS, while the same stream without eviction does. Real AIMaster, real PS processes; this
process looks ids up and pushes them as a trainer would, every id new."""
from __future__ import annotations

import threading
import time

import numpy as np

from deeprec_ext import PSClient
from tests.conftest import wait_for
from tests.test_autoscale_e2e import scale_events

MiB = 1024 * 1024
LIMIT_MB = 192
DIM = 32
BATCH, PERIOD = 4000, 0.1      # 40,000 new ids a second, ~8 MiB/s of PS memory
STEPS_TO_LIVE = 10             # about one second of ids live at a time
JOB = {
    "name": "autoscale-eviction", "num_slots": 256,
    "ps": {"replicas": 1, "max_replicas": 3},
    "autoscale": {"enabled": True, "ps_memory_limit_mb": LIMIT_MB, "interval_seconds": 0.5,
                  "lead_seconds": 4, "window_seconds": 6, "measure_seconds": 3,
                  "memory_headroom": 0.1, "scale_out_reserve": 1.0,
                  "performance_fit": False},
}


class NewIds:
    """Lookup (creates the rows) then push of BATCH new ids every PERIOD seconds."""

    def __init__(self, client: PSClient):
        self.client, self.next_id, self.errors = client, 0, []
        self.rows: list[tuple[float, int, int]] = []  # time, rows, evicted (all PS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        next_at = time.monotonic()
        try:
            while not self._stop.is_set():
                ids = np.arange(self.next_id, self.next_id + BATCH, dtype=np.int64)
                self.client.lookup("t", ids)
                self.client.push("t", ids, np.full((BATCH, DIM), 0.01, np.float32))
                self.next_id += BATCH
                next_at += PERIOD
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - surfaced by stop()
            self.errors.append(exc)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors


def table_counts(client: PSClient) -> tuple[int, int, int]:
    """(rows, evicted, max RSS) over the PS of the job."""
    rows = evicted = rss = 0
    for s in client.ps_stats():
        rss = max(rss, s.rss_bytes)
        for t in s.tables:
            rows, evicted = rows + t.rows, evicted + t.evicted
    return rows, evicted, rss


def run_stream(start_job, subdir: str, eviction, seconds: float | None):
    job = start_job(JOB, subdir=subdir)
    client = PSClient.connect(job.address)
    client.create_table("t", dim=DIM, initializer="zeros",
                        optimizer={"name": "sgd", "learning_rate": 1.0}, eviction=eviction)
    feeder = NewIds(client).start()
    t0 = time.monotonic()
    samples = []
    try:
        if seconds is None:  # until the policy scales out
            wait_for(lambda: any(e["ps"][1] > e["ps"][0] for e in scale_events(job.address)[1]),
                     45, "a PS scale-out by the policy", interval=0.5)
        else:
            while time.monotonic() - t0 < seconds:
                samples.append((time.monotonic() - t0, *table_counts(client)))
                time.sleep(0.5)
    finally:
        feeder.stop()
    elapsed = time.monotonic() - t0
    autoscale, scales = scale_events(job.address)
    out = {"elapsed": elapsed, "autoscale": autoscale, "scales": scales, "samples": samples,
           "ids": feeder.next_id, "final": table_counts(client)}
    client.close()
    job.stop()
    return out


def test_rows_that_plateau_under_eviction_do_not_scale_ps_out(start_job):
    grow = run_stream(start_job, "plain", None, None)
    fits = [e for e in grow["autoscale"] if e["rule"] == "resource-fit" and e["applied"]]
    assert fits and grow["scales"][0]["ps"][0] == 1 and grow["scales"][0]["ps"][1] >= 2, grow
    assert fits[0]["bounded_rate_bytes_per_s"] == 0  # nothing evicted: growth without end

    # the same stream with eviction, for longer than the plain one took to scale out
    spec = {"steps_to_live": STEPS_TO_LIVE, "interval_seconds": 0.3}
    ev = run_stream(start_job, "evict", spec, max(grow["elapsed"] + 6, 14))
    assert ev["scales"] == [] and not [e for e in ev["autoscale"]
                                       if e["rule"] == "resource-fit"], ev["autoscale"]
    rows, evicted, _ = ev["final"]
    # every id got a row (no admission): live + evicted accounts for each of them
    assert rows + evicted == ev["ids"] and evicted > 0.7 * ev["ids"], (rows, evicted, ev["ids"])
    # the rows plateaued: the live set stays within a few windows of ids
    late = [s for s in ev["samples"] if s[0] > ev["samples"][-1][0] / 2]
    assert max(s[1] for s in late) < 4 * STEPS_TO_LIVE * BATCH, late
    # and so did the memory: the last half's RSS stays below the plain run's at its scale-out
    assert max(s[3] for s in late) < 0.8 * LIMIT_MB * MiB
