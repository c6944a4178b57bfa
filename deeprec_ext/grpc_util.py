"""gRPC plumbing shared by every service: channel/server options and retry policy."""
from __future__ import annotations

import json
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# Large tables move in big messages; the default 4 MiB cap would reject ordinary batches.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
ROUTING_EPOCH_KEY = "x-routing-epoch"


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Loopback and in-cluster links: do not let idle channels be torn down mid-job.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.enable_retries", 1),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list:
    return [
        *channel_options(max_message_bytes),
        # clients ping every 30 s (keepalive_time_ms); gRPC's server defaults call pings
        # during a silent call abuse and end it with GOAWAY "too_many_pings" after about
        # 4 minutes: a long scale, checkpoint or restore must not be cut off
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC sets SO_REUSEPORT by default: a second server on a taken port then binds
        # without an error and takes part of its connections (a PS started twice on one
        # port), and servers picking free ports at once can end up sharing one
        # (grpc/grpc#10755). A taken port must be an error instead.
        ("grpc.so_reuseport", 0),
    ]


def create_server(address: str, max_workers: int = 8,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  interceptors: list | tuple = ()) -> tuple[grpc.Server, int]:
    """Create a server bound to ``address`` ("host:0" picks a free port); returns (server, port).

    ``interceptors`` (grpc.ServerInterceptor) run in order around every call: statistics
    (Gazer) and access control hook in here, never in the servicers.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=server_options(max_message_bytes),
                         interceptors=list(interceptors))
    from deeprec_ext import auth  # access control: TLS when this process has certificates
    creds = auth.server_credentials()
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError when the port is taken
        raise OSError(f"could not bind {address}: {exc}") from exc
    return server, port


def insecure_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                     service_config: dict | None = None) -> grpc.Channel:
    """Every client channel of the project. Despite the name, it carries this process's
    access control (``deeprec_ext.auth``: the job token, TLS) when it has any.
    ``service_config``: gRPC's own per-channel policy (retries), see :func:`retry_config`."""
    from deeprec_ext import auth
    options = channel_options(max_message_bytes)
    if service_config is not None:
        options.append(("grpc.service_config", json.dumps(service_config)))
    return auth.client_channel(address, options)


def retry_config(service: str, max_attempts: int = 4, initial_backoff: float = 0.05,
                 max_backoff: float = 0.5, codes: tuple[str, ...] = ("UNAVAILABLE",)) -> dict:
    """A service config retrying every method of ``service`` (e.g. "deeprec.ParameterServer")
    on ``codes`` with exponential backoff: the retry policy is the channel's, declared once,
    not a loop around each call. UNAVAILABLE means the request did not reach a handler, so
    retrying it is safe for every method."""
    return {"methodConfig": [{
        "name": [{"service": service}],
        "retryPolicy": {
            "maxAttempts": max_attempts,
            "initialBackoff": f"{initial_backoff}s",
            "maxBackoff": f"{max_backoff}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": list(codes),
        },
    }]}


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff delays (seconds) tried in order, then the last one repeats until ``deadline``."""
    # short and capped: a PS being replaced comes back (as its promoted peer) in well
    # under a second, and every retry interval adds to the training stall
    delays: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.25)
    deadline: float = 120.0

    def sleeps(self):
        start = time.monotonic()
        i = 0
        while True:
            delay = self.delays[min(i, len(self.delays) - 1)]
            if time.monotonic() - start + delay > self.deadline:
                return
            yield delay
            i += 1


RETRIABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def call_with_retry(fn: Callable[[], T], what: str, policy: RetryPolicy = RetryPolicy(),
                    on_retry: Callable[[], None] | None = None) -> T:
    """Call ``fn``; retry on UNAVAILABLE / DEADLINE_EXCEEDED with the policy's backoff."""
    last: grpc.RpcError | None = None
    attempts = policy.sleeps()
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() not in RETRIABLE_CODES:
                raise
            last = exc
        delay = next(attempts, None)
        if delay is None:
            raise last
        log.info("%s: %s, retrying in %.2fs", what, last.code().name, delay)
        time.sleep(delay)
        if on_retry is not None:
            on_retry()
