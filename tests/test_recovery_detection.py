"""What bounds a dead PS's detection: a PS killed -9 is noticed (the launcher's waitid, the
clients' connections) only once the kernel has freed its memory, so a PS must not keep
freed request buffers resident (``deeprec_ext.ps.__main__.bound_malloc_retention``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _anon_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc, /proc")
def test_ps_returns_freed_request_buffers_to_the_os(tmp_path):
    """Two real PS processes serve the same large lookups (fresh rows: 200k ids per
    request, ~38 MB of buffers per request); the one with glibc's default policy keeps the
    freed buffers resident, the bounded one (the default) gives them back. Both keep
    serving, and agree on every value."""
    from deeprec_ext import codec
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
    procs, chans = [], []
    try:
        stubs = []
        for name, extra in (("default", []), ("glibc", ["--malloc-mmap-threshold-mb", "0"])):
            port_file = tmp_path / f"{name}.port"
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deeprec_ext.ps", "--port-file", str(port_file), *extra],
                cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            port = wait_for(lambda: port_file.exists() and port_file.read_text(), 30, "PS port")
            ch = insecure_channel(f"127.0.0.1:{port}")
            chans.append(ch)
            stubs.append(ps_pb2_grpc.ParameterServerStub(ch))
        cfg = ps_pb2.TableConfig(name="t", dim=16, initializer_json='{"name": "zeros"}',
                                 optimizer_json='{"name": "adagrad", "learning_rate": 0.1}')
        for stub in stubs:
            stub.CreateTable(ps_pb2.CreateTableRequest(config=cfg), timeout=30)
        rng = np.random.default_rng(0)
        ids = np.unique(rng.integers(-2**62, 2**62, 1_000_000, dtype=np.int64))
        last = []
        for stub in stubs:
            for i in range(0, ids.size, 200_000):
                resp = stub.Lookup(ps_pb2.LookupRequest(insert_missing=True, tables=[
                    ps_pb2.TableIds(table="t", ids=codec.ids_to_bytes(ids[i:i + 200_000]))]),
                    timeout=120)
            last.append(np.frombuffer(resp.values[0], np.float32))
        np.testing.assert_array_equal(last[0], last[1])
        bounded, default = (_anon_kb(p.pid) for p in procs)
        # the rows themselves (~1M x 32 floats, ~140 MB with the index) are in both; the
        # freed buffers only in glibc's default: tens of MB more
        assert default - bounded > 30 * 1024, (bounded, default)
        for p in procs:
            assert p.poll() is None, "a PS exited"
    finally:
        for ch in chans:
            ch.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(20)


def test_an_operators_malloc_setting_is_left_alone(monkeypatch):
    from deeprec_ext.ps.__main__ import bound_malloc_retention
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert bound_malloc_retention(4.0) is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert bound_malloc_retention(4.0) is False
    assert bound_malloc_retention(0) is False
