"""Members tell a dying AIMaster from a live one (the kernel's death signal can arrive
while it is a zombie), and long calls are not cut off by keepalive pings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from deeprec_ext import launcher
from deeprec_ext.grpc_util import create_server


def test_a_zombie_launcher_is_dead(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv(launcher.PARENT_ENV, str(child.pid))
        monkeypatch.setattr(os, "getppid", lambda: child.pid)  # as its member would see it
        assert launcher.launcher_alive()
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # not reaped: a zombie, kill(pid, 0) succeeds
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        os.kill(child.pid, 0)
        assert not launcher.launcher_alive()
    finally:
        child.kill()
        child.wait()


def test_a_reparented_member_sees_its_launcher_gone(monkeypatch):
    monkeypatch.setenv(launcher.PARENT_ENV, str(os.getpid()))  # not our parent
    assert not launcher.launcher_alive()
    monkeypatch.delenv(launcher.PARENT_ENV)
    assert launcher.launcher_alive()  # not started by the local launcher (a pod)


def test_watch_launcher_fires_once_the_launcher_dies(monkeypatch):
    alive = [True]
    monkeypatch.setenv(launcher.PARENT_ENV, "1")
    monkeypatch.setattr(launcher, "launcher_alive", lambda: alive[0])
    gone = []
    t = launcher.watch_launcher(lambda: gone.append(1), seconds=5, interval=0.02)
    time.sleep(0.1)
    assert not gone
    alive[0] = False
    t.join(2)
    assert gone == [1]


def _slow_server(server):
    def slow(request, context):
        time.sleep(6)
        return b"done"
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(slow)})
    server.add_generic_rpc_handlers((handler,))
    server.start()


def _long_call(port: int) -> bytes:
    # a client that pings often during a silent call (ours ping every 30 s; a call of
    # minutes meets the same rule)
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.keepalive_time_ms", 200), ("grpc.http2.max_pings_without_data", 0)]) as ch:
        return ch.unary_unary("/test.Slow/Call")(b"x", timeout=30)


def test_a_long_call_is_not_cut_off_by_keepalive_pings():
    server, port = create_server("127.0.0.1:0")
    _slow_server(server)
    try:
        assert _long_call(port) == b"done"
    finally:
        server.stop(0).wait()
    # control: gRPC's default server settings end the same call ("too many pings")
    plain = grpc.server(futures.ThreadPoolExecutor(2))
    port = plain.add_insecure_port("127.0.0.1:0")
    _slow_server(plain)
    try:
        with pytest.raises(grpc.RpcError) as info:
            _long_call(port)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        plain.stop(0).wait()


def test_a_server_on_a_taken_port_is_an_error_naming_the_address():
    """A second server on a port another one listens on fails to start (gRPC's default
    SO_REUSEPORT would let it bind and take part of the first one's connections)."""
    first, port = create_server("127.0.0.1:0")
    first.start()
    try:
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{port}"):
            create_server(f"127.0.0.1:{port}")
    finally:
        first.stop(0)
