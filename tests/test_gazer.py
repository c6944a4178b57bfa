"""Gazer without TensorFlow workers: collectors, the RPC interceptor on a real PS server,
config, the AIMaster plugin in a PS-only job, CLI bad input and `gazer top` surviving a
dropped stream in a real terminal (tmux)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import grpc
import numpy as np
import pytest

from aimaster.config import ConfigError, parse_job
from deeprec_ext.grpc_util import create_server, insecure_channel
from deeprec_ext.proto import gazer_pb2, gazer_pb2_grpc, ps_pb2, ps_pb2_grpc
from deeprec_ext.ps.server import ParameterServerServicer
from deeprec_ext.stats import (LATENCY_BOUNDS_MS, MemberCollector, StatsInterceptor,
                               op_sample_every_from_master, quantile_ms)
from tests.conftest import ROOT, wait_for

ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")


def gazer(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gazer.cli", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- collectors -------------------------------------------------------------------------
def test_quantile_of_bucketed_histogram():
    counts = np.zeros(len(LATENCY_BOUNDS_MS) + 1, np.int64)
    assert quantile_ms(counts, 0.99) == 0.0
    counts[3] = 99   # (0.5, 1] ms
    counts[8] = 1    # (25, 50] ms
    assert 0.5 < quantile_ms(counts, 0.5) <= 1.0
    assert quantile_ms(counts, 0.99) <= 1.0
    assert 25.0 < quantile_ms(counts, 0.999) <= 50.0
    counts[-1] = 1000  # slower than the last bound: reported as that bound
    assert quantile_ms(counts, 0.99) == LATENCY_BOUNDS_MS[-1]


def test_member_collector_step_times_and_cpu():
    c = MemberCollector("worker")
    for _ in range(6):
        c.steps_done(1)
        time.sleep(0.01)
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # burn CPU so the window shows some
        pass
    s = c.collect("w")
    assert s.steps == 6 and s.role == "worker" and s.id == "w"
    assert 9.0 <= s.step_ms < 200.0, s.step_ms      # five timed steps of ~10 ms
    assert sum(s.step_counts) == 5
    assert s.rss_bytes > 10 * 2**20 and s.cpu_percent > 0
    assert c.collect("w").step_ms == 0.0            # no step since the last collect


def test_interceptor_times_counts_bytes_and_errors_on_a_real_ps():
    servicer = ParameterServerServicer("ps-t")
    server, port = create_server("127.0.0.1:0", interceptors=[StatsInterceptor(servicer.rpc_stats)])
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    server.start()
    try:
        with insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = ps_pb2_grpc.ParameterServerStub(ch)
            stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(name="t", dim=4)))
            ids = np.arange(1000, dtype=np.int64)
            for _ in range(5):
                stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table="t", ids=ids.tobytes())],
                                                 insert_missing=True))
            with pytest.raises(grpc.RpcError) as err:  # bad input: counted as an error
                stub.Lookup(ps_pb2.LookupRequest(tables=[ps_pb2.TableIds(table="nope", ids=b"")]))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            stats = gazer_pb2.MemberStats.FromString(stub.Stats(ps_pb2.StatsRequest()).gazer_stats)
    finally:
        server.stop(0)
        servicer.close()
    rpcs = {r.method: r for r in stats.rpcs}
    lookup = rpcs["Lookup"]
    assert lookup.count == 6 and lookup.errors == 1 and sum(lookup.counts) == 6
    assert lookup.bytes_in >= 5 * 8000            # five requests of 1000 int64 ids
    assert lookup.bytes_out >= 5 * 1000 * 4 * 4   # five answers of 1000 x 4 float32
    assert rpcs["CreateTable"].count == 1 and rpcs["CreateTable"].errors == 0
    (t,) = stats.tables
    assert t.name == "t" and t.rows == 1000 and t.capacity >= 1000 and t.bytes > 0
    assert stats.role == "ps" and stats.id == "ps-t"


# -- configuration ------------------------------------------------------------------------
def test_gazer_config_section():
    cfg = parse_job({"gazer": {"op_sample_every_steps": 10, "top_ops": 5, "prometheus_port": 9400}})
    assert (cfg.gazer.enabled, cfg.gazer.op_sample_every_steps, cfg.gazer.top_ops,
            cfg.gazer.prometheus_port) == (True, 10, 5, 9400)
    assert parse_job({}).gazer.op_sample_every_steps == 100
    for bad, word in (({"op_sample_every_steps": -1}, "op_sample_every_steps"),
                      ({"enabled": "no"}, "enabled"), ({"top_ops": 0}, "top_ops"),
                      ({"prometheus_port": 70000}, "prometheus_port"),
                      ({"enabled": False, "prometheus_port": 9400}, "prometheus_port"),
                      ({"sample": 3}, "unknown")):
        with pytest.raises(ConfigError, match=word):
            parse_job({"gazer": bad})


def test_prometheus_flag_is_validated(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("gazer: {enabled: false}\n")
    out = subprocess.run([sys.executable, "-m", "aimaster.cli", "run", str(job), "--prometheus-port",
                          "9400", "--state-dir", str(tmp_path / "s")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--prometheus-port needs Gazer" in out.stderr
    out = subprocess.run([sys.executable, "-m", "aimaster.cli", "run", "--prometheus-port", "0",
                          "--state-dir", str(tmp_path / "s")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a TCP port" in out.stderr
    assert "Traceback" not in out.stderr


# -- CLI bad input --------------------------------------------------------------------------
def test_cli_unreachable_master_is_a_clear_error():
    dead = f"127.0.0.1:{free_port()}"
    for args in (("dump", "--json"), ("top", "--once")):
        out = gazer(*args, "--master", dead, "--timeout", "3")
        assert out.returncode == 1, out
        assert f"cannot reach the AIMaster at {dead}" in out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
    out = gazer("top", "--master", dead, "--interval", "0")
    assert out.returncode == 2 and "--interval" in out.stderr
    env = {k: v for k, v in ENV.items() if k != "DEEPREC_MASTER_ADDR"}
    out = subprocess.run([sys.executable, "-m", "gazer.cli", "dump"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--master is required" in out.stderr


# -- PS-only jobs ---------------------------------------------------------------------------
def test_ps_only_job_snapshot_stream_and_bad_watch(start_job):
    job = start_job({"name": "gz-ps", "ps": {"replicas": 2}, "master": {"heartbeat_seconds": 0.5},
                     "gazer": {"op_sample_every_steps": 7}})
    ch = insecure_channel(job.address)
    stub = gazer_pb2_grpc.GazerStub(ch)
    try:
        # workers learn the sampling period from the master
        assert stub.GetConfig(gazer_pb2.ConfigRequest(), timeout=10).op_sample_every == 7
        assert op_sample_every_from_master(ch)[0] == 7

        def ps_reported():
            snap = stub.GetSnapshot(gazer_pb2.SnapshotRequest(), timeout=10)
            ps = [m for m in snap.members if m.role == "ps" and m.stats_age_seconds >= 0]
            return snap if len(ps) == 2 and all(m.stats.replication.peer for m in ps) else None
        snap = wait_for(ps_reported, 60, "both PS to report statistics")
        assert snap.job == "gz-ps" and snap.phase == "running" and snap.op_sample_every == 7
        for m in snap.members:
            assert m.stats.rss_bytes > 0 and m.stats.cpu_seconds > 0
            assert {r.method for r in m.stats.rpcs} >= {"SetRouting"}
        # a stream: one snapshot per interval, fresh times
        stream = stub.Watch(gazer_pb2.WatchRequest(interval_seconds=0.3), timeout=20)
        times = [next(stream).time for _ in range(3)]
        stream.cancel()
        assert times == sorted(times) and times[-1] > times[0]
        # bad input: refused with a message, the service keeps serving
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(gazer_pb2.WatchRequest(interval_seconds=0.01), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "interval_seconds" in err.value.details()
        assert stub.GetSnapshot(gazer_pb2.SnapshotRequest(), timeout=10).job == "gz-ps"
        # `gazer dump --json` is plain JSON with the same members
        out = gazer("dump", "--master", job.address, "--json")
        assert out.returncode == 0, out.stderr
        d = json.loads(out.stdout)
        assert [m["id"] for m in d["members"]] == ["ps-0", "ps-1"]
        assert isinstance(d["members"][0]["stats"]["rss_bytes"], int)
    finally:
        ch.close()


def test_disabled_gazer_job(start_job):
    job = start_job({"name": "gz-off", "ps": {"replicas": 1}, "gazer": {"enabled": False}})
    out = gazer("dump", "--master", job.address, "--json")
    assert out.returncode == 1 and "runs without Gazer" in out.stderr, out
    with insecure_channel(job.address) as ch:  # workers then sample nothing
        env = os.environ.pop("DEEPREC_GAZER_OP_SAMPLE_EVERY", None)
        try:
            assert op_sample_every_from_master(ch)[0] == 0
        finally:
            if env is not None:
                os.environ["DEEPREC_GAZER_OP_SAMPLE_EVERY"] = env
    # the rest of the AIMaster is unaffected
    wait_for(lambda: job.status()["phase"] == "running", 60, "the job to run")


class Tmux:
    """A private tmux server (own socket) running one command in a fixed-size window."""

    def __init__(self, command: str, width: int = 200, height: int = 50):
        self.socket = f"gazer-test-{uuid.uuid4().hex[:8]}"
        # the window's size, not the test runner's: pytest-xdist workers export COLUMNS=80
        # and LINES=24, which every terminal program (rich included) prefers to the tty's
        env = {k: v for k, v in ENV.items() if k not in ("COLUMNS", "LINES")}
        subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", "new-session", "-d",
                        "-s", "t", "-x", str(width), "-y", str(height), command],
                       check=True, env=dict(env, TERM="xterm-256color"), timeout=30)

    def screen(self) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, "capture-pane", "-p", "-t", "t"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout

    def wait_screen(self, predicate, timeout: float, what: str) -> str:
        last = [""]

        def check():
            last[0] = self.screen()
            return last[0] if predicate(last[0]) else None
        try:
            return wait_for(check, timeout, what, interval=0.5)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; screen:\n{last[0]}") from None

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "-L", self.socket, "send-keys", "-t", "t", *keys], timeout=30)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def require_tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup-venv installs it with apt-get when "
                    "it can): the real-terminal test of `gazer top` needs it")


def gazer_top_command(address: str, marker: str) -> str:
    # the pane stays open after gazer exits, showing its exit code and any traceback
    return (f"cd {ROOT} && {sys.executable} -m gazer.cli top --master {address}; "
            f"echo {marker}=$?; sleep 60")


def test_gazer_top_survives_unreachable_master_and_dropped_stream(start_job):
    require_tmux()
    # unreachable from the start: a message and retries, not a traceback
    dead = f"127.0.0.1:{free_port()}"
    t = Tmux(gazer_top_command(dead, "GAZER_EXIT"))
    try:
        screen = t.wait_screen(lambda s: "cannot reach the AIMaster" in s and "retrying" in s, 30,
                               "the unreachable-master notice")
        assert dead in screen and "Traceback" not in screen
    finally:
        t.close()
    job = start_job({"name": "gz-drop", "ps": {"replicas": 1}, "master": {"heartbeat_seconds": 0.5}})
    t = Tmux(gazer_top_command(job.address, "GAZER_EXIT"))
    try:
        t.wait_screen(lambda s: "gz-drop" in s and "ps-0" in s, 60, "the live view of the job")
        job.stop()  # the AIMaster goes away under the open stream
        screen = t.wait_screen(lambda s: "retrying" in s, 60, "the dropped-stream notice")
        assert "Traceback" not in screen and "GAZER_EXIT" not in screen  # still running
        t.keys("C-c")
        screen = t.wait_screen(lambda s: "GAZER_EXIT=" in s, 30, "gazer to quit on Ctrl-C")
        assert "GAZER_EXIT=0" in screen and "Traceback" not in screen
    finally:
        t.close()
