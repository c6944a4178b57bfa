"""PS process entry point: ``python -m deeprec_ext.ps [--master ADDR] [--id ps-0] [--port 0]``.

Without an AIMaster the PS owns every slot (standalone mode, for tools and tests).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time

from deeprec_ext import auth
from deeprec_ext.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, create_server
from deeprec_ext.member import MASTER_ENV, MEMBER_ID_ENV, MasterSession
from deeprec_ext.proto import ps_pb2_grpc, sync_pb2_grpc
from deeprec_ext.ps.server import ParameterServerServicer, set_malloc_mmap_threshold
from deeprec_ext.ps.validation import DecodeGuard
from deeprec_ext.launcher import launcher_alive, watch_launcher
from deeprec_ext.stats import StatsInterceptor
from deeprec_ext.ps.sync_service import SyncServicer

log = logging.getLogger("deeprec_ext.ps")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deeprec_ext.ps", description=__doc__)
    p.add_argument("--master", default=os.environ.get(MASTER_ENV, ""),
                   help=f"AIMaster address (env {MASTER_ENV}); empty = standalone")
    p.add_argument("--id", default=os.environ.get(MEMBER_ID_ENV, ""), help="member id, e.g. ps-0")
    p.add_argument("--host", default=os.environ.get("DEEPREC_PS_HOST", "127.0.0.1"),
                   help="interface to bind and advertise")
    p.add_argument("--port", type=int, default=int(os.environ.get("DEEPREC_PS_PORT", "0")))
    p.add_argument("--threads", type=int, default=8, help="gRPC handler threads (data plane)")
    p.add_argument("--control-port", type=int,
                   default=int(os.environ.get("DEEPREC_PS_CONTROL_PORT", "0")),
                   help="port of the control endpoint (AIMaster and peer PS calls: "
                        "replication, migration, promotion); 0: any free port")
    p.add_argument("--control-threads", type=int, default=8,
                   help="gRPC handler threads of the control endpoint")
    p.add_argument("--max-message-mb", type=int,
                   default=DEFAULT_MAX_MESSAGE_BYTES // (1024 * 1024),
                   help="largest request accepted; bigger ones get RESOURCE_EXHAUSTED")
    p.add_argument("--memory-limit-mb", type=float,
                   default=float(os.environ.get("DEEPREC_PS_MEMORY_LIMIT_MB", "0")),
                   help="memory budget reported to the AIMaster for scaling (0: none)")
    p.add_argument("--migration-share", type=float,
                   default=float(os.environ.get("DEEPREC_PS_MIGRATION_SHARE", "0.3")),
                   help="most of the wall time a background migration round may keep "
                        "busy, in (0, 1]: the copy paces itself so training keeps the rest "
                        "(1: no pacing; the fenced last round is never paced)")
    p.add_argument("--seed-from-replica", choices=("on", "off"),
                   default=os.environ.get("DEEPREC_PS_SEED_FROM_REPLICA", "on"),
                   help="a migration's snapshot round to this PS's ring peer is taken by "
                        "the peer from the copy of this PS it holds, instead of streamed "
                        "(a scale-in's leaving PS and its peer)")
    p.add_argument("--malloc-mmap-threshold-mb", type=float,
                   # a string default goes through ``type``: a bad environment value is
                   # a usage error naming the flag, not a traceback
                   default=os.environ.get("DEEPREC_PS_MALLOC_MMAP_THRESHOLD_MB", "1"),
                   help="glibc malloc: blocks of at least this size get their own mapping, "
                        "returned to the OS when freed, and a heap keeps at most twice this "
                        "free at its top; 0: glibc's own policy (see bound_malloc_retention)")
    p.add_argument("--port-file", default="", help="write the bound port here (standalone use)")
    return p


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def bound_malloc_retention(threshold_mb: float) -> bool:
    """Stop glibc malloc from keeping freed request buffers resident.

    By default glibc raises its mmap threshold to the size of each large block freed (up
    to 32 MB) and lets each of its per-thread heaps keep up to 64 MB free: a PS that
    served a few large requests (fills, copies, migrations) held ~230 MB of freed memory
    in 4 KB pages next to 68 MB in use. A PS killed -9 is noticed only once the kernel has
    freed all of it, 4 KB page by 4 KB page: that was most of a recovery's detection
    (docs/BENCHMARKS.md, issue 16 item 1: 4 KB-page memory of a 4M-row job's PS ~280 MB,
    ~155 MB with a 4 MB bound, ~70 MB with 1 MB). With a fixed threshold, blocks of
    ``threshold_mb`` and more are mapped on their own (numpy asks for 2 MB pages from
    4 MB on) and unmapped when freed; smaller ones -- a 4096-id step's requests split
    over the PS -- are reused from the heaps as before. Lookups + pushes of 16k-64k keys
    (2-8 MB blocks, mapped afresh each time) took the same time within noise. Leaves the
    setting alone when the operator chose one (``MALLOC_*_`` variables, GLIBC_TUNABLES)
    and where there is no glibc. Returns whether it was applied."""
    if threshold_mb <= 0 or not sys.platform.startswith("linux"):
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) \
            or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    size = int(threshold_mb * 1024 * 1024)
    # 32 MB is glibc's most for the threshold; trimming at 2x is its own dynamic ratio
    size = max(128 * 1024, min(size, 32 * 1024 * 1024))
    ok = bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * size))
    if ok:  # checkpoint chunks sized under it
        set_malloc_mmap_threshold(size)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("DEEPREC_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if bound_malloc_retention(args.malloc_mmap_threshold_mb):
        log.debug("malloc: blocks of %g MB and more are unmapped when freed",
                  args.malloc_mmap_threshold_mb)
    if args.max_message_mb <= 0:
        print("error: --max-message-mb must be positive", file=sys.stderr)
        return 2
    if not 0.0 < args.migration_share <= 1.0:
        print(f"error: --migration-share (DEEPREC_PS_MIGRATION_SHARE) must be in (0, 1], "
              f"got {args.migration_share}", file=sys.stderr)
        return 2
    if args.seed_from_replica not in ("on", "off"):  # an environment default is not checked
        print(f"error: --seed-from-replica (DEEPREC_PS_SEED_FROM_REPLICA) must be on or off, "
              f"got {args.seed_from_replica!r}", file=sys.stderr)
        return 2
    servicer = ParameterServerServicer(
        args.id or "ps", memory_limit_bytes=int(max(args.memory_limit_mb, 0) * 1024 * 1024),
        migration_share=args.migration_share, seed_from_replica=args.seed_from_replica == "on")
    try:  # access control: the job token (DEEPREC_TOKEN_FILE) checked on every RPC
        interceptors = auth.server_interceptors()
    except auth.AuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Gazer first: it also times the calls auth refuses
    chain = [StatsInterceptor(servicer.rpc_stats), *interceptors, DecodeGuard()]
    server, port = create_server(f"{args.host}:{args.port}", max_workers=args.threads,
                                 max_message_bytes=args.max_message_mb * 1024 * 1024,
                                 interceptors=chain)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    # sync-mode step aggregation (idle, and off every async path, unless a job uses it)
    sync_pb2_grpc.add_SyncParameterServerServicer_to_server(SyncServicer(servicer), server)
    # The same service on a second endpoint with its own threads, for the AIMaster and
    # peer PS: a push in sync replication holds a data-plane thread until the peer has
    # its rows, so with every thread of every PS in a ring held that way no peer could
    # serve the Replicate they wait on. Control calls never queue behind training traffic.
    control, control_port = create_server(
        f"{args.host}:{args.control_port}", max_workers=args.control_threads,
        max_message_bytes=args.max_message_mb * 1024 * 1024, interceptors=chain)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, control)
    server.start()
    control.start()
    address = f"{args.host}:{port}"
    control_address = f"{args.host}:{control_port}"
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    stop = threading.Event()
    session = None
    if args.master:
        session = MasterSession(args.master, "ps", args.id, address, on_stop=stop.set,
                                stats_source=lambda: servicer.gazer.collect_bytes(servicer.ps_id),
                                control_address=control_address)
        session.start()
        servicer.ps_id = session.id
    log.info("PS %s serving on %s (control %s)", servicer.ps_id, address, control_address)
    # A handler must not take locks: one arriving while the main thread is inside
    # Event.set (its own, or a repeated signal) would deadlock on the Event's lock. It
    # only flips a flag; the main thread polls it.
    signalled = []
    signal.signal(signal.SIGTERM, lambda *_: signalled.append(1))
    signal.signal(signal.SIGINT, lambda *_: signalled.append(1))
    while not signalled and not stop.wait(0.1):
        pass
    stop.set()
    log.info("PS %s stopping", servicer.ps_id)
    # a hand-off needs a live AIMaster to promote the peer; when the local launcher died
    # (PR_SET_PDEATHSIG) the whole job is gone: just exit
    if launcher_alive():
        # the launcher may be dying right now: then stop the hand-off and exit
        watch_launcher(lambda: os._exit(143))
        handed_off = servicer.hand_off(timeout=10.0)
    else:
        handed_off = False
    servicer.close()  # replication and background eviction
    if session is not None:
        session.close("preempted" if handed_off else "stopped")
    # bounded: a call gRPC never completes must not keep the process alive after SIGTERM
    control_stopped = control.stop(grace=2)
    if not (server.stop(grace=2).wait(10) and control_stopped.wait(5)):
        log.warning("PS %s: the gRPC server did not finish stopping; exiting anyway", servicer.ps_id)
    _exit_bounded(servicer.ps_id)
    return 0


EXIT_JOIN_SECONDS = 5.0


def _exit_bounded(ps_id: str) -> None:
    """Python joins every non-daemon thread at exit, gRPC's handler threads among them: a
    handler still busy (a call the server stop cancelled but whose code runs on) would
    keep this process alive until the launcher's SIGKILL. Give them a few seconds, then
    leave without them."""
    deadline = time.monotonic() + EXIT_JOIN_SECONDS
    busy = [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon]
    for t in busy:
        t.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in busy if t.is_alive()]
    if left:
        log.warning("PS %s: threads %s still busy at exit; exiting without them", ps_id, left)
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
