"""Migration yields to training: a background round's source waits between chunks while
lookups or pushes are in flight, never longer than its bound, and not at all when idle."""
from __future__ import annotations

import threading
import time

from deeprec_ext.ps.server import ParameterServerServicer


def test_yield_waits_only_while_training_calls_are_in_flight():
    svc = ParameterServerServicer("ps-y")
    t0 = time.monotonic()
    for _ in range(50):
        svc._yield_to_training()
    assert time.monotonic() - t0 < 0.5 * svc.MIGRATE_YIELD_SECONDS * 50  # idle: no wait

    svc._data_call(1)
    t0 = time.monotonic()
    svc._yield_to_training()
    waited = time.monotonic() - t0
    assert svc.MIGRATE_YIELD_SECONDS * 0.9 <= waited < 1.0  # busy: bounded wait

    # the call ends during the wait: the copy goes on at once
    threading.Timer(0.005, svc._data_call, (-1,)).start()
    svc.MIGRATE_YIELD_SECONDS = 2.0
    t0 = time.monotonic()
    svc._yield_to_training()
    assert time.monotonic() - t0 < 1.0
    assert svc._data_calls == 0


def test_in_flight_count_is_exact_under_concurrent_calls():
    svc = ParameterServerServicer("ps-c")

    def hammer():
        for _ in range(20_000):
            svc._data_call(1)
            svc._data_call(-1)
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert svc._data_calls == 0


def test_bad_migration_share_is_refused_at_start():
    import os
    import subprocess
    import sys
    from tests.conftest import ROOT
    for bad in ("0", "1.5", "-0.2"):
        r = subprocess.run([sys.executable, "-m", "deeprec_ext.ps", "--migration-share", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 2 and "--migration-share" in r.stderr and bad in r.stderr, r.stderr
