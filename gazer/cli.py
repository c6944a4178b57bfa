"""``gazer``: live statistics of a running job, from its AIMaster.

  gazer top  --master ADDR [--interval 1]   live terminal view (Ctrl-C quits)
  gazer top  --master ADDR --once           one screen, for scripts
  gazer dump --master ADDR --json           one snapshot as JSON

The master address also comes from DEEPREC_MASTER_ADDR. ``gazer top`` keeps running when
the AIMaster is unreachable or its stream drops: it says so and reconnects.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import gazer_pb2, gazer_pb2_grpc

RETRY_DELAYS = (1.0, 2.0, 5.0)  # then 5 s between attempts


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gazer", description="Live statistics of an elastic PS job.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("dump", "print one snapshot (--json: as JSON)"),
                        ("top", "live terminal view, refreshed every --interval seconds")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                       help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
        s.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
        s.add_argument("--token-file", default=None, help="job token file (env DEEPREC_TOKEN_FILE)")
        if name == "dump":
            s.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            s.add_argument("--interval", type=float, default=1.0, help="refresh period (>= 0.2 s)")
            s.add_argument("--once", action="store_true", help="print one screen and exit")
            s.add_argument("--iterations", type=int, default=0,
                           help="exit after N refreshes (0: run until Ctrl-C)")
    return p


def _fail(message: str, code: int = 1) -> int:
    print(f"gazer: error: {message}", file=sys.stderr)
    return code


def _why(exc: grpc.RpcError, master: str) -> str:
    code = exc.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        from deeprec_ext.auth import unauthenticated_hint
        return unauthenticated_hint(master)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"the AIMaster at {master} runs without Gazer (the job file sets "
                "gazer: {enabled: false})")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"cannot reach the AIMaster at {master} ({code.name})"
    return f"AIMaster at {master}: {code.name}: {exc.details()}"


def get_snapshot(master: str, timeout: float) -> gazer_pb2.Snapshot:
    with insecure_channel(master) as ch:
        return gazer_pb2_grpc.GazerStub(ch).GetSnapshot(gazer_pb2.SnapshotRequest(), timeout=timeout)


def _console():
    from rich.console import Console
    # piped output (scripts, logs) gets a wide page instead of rich's 80 columns
    return Console() if sys.stdout.isatty() else Console(width=200)


def cmd_dump(args) -> int:
    from gazer.view import render, to_dict
    try:
        snap = get_snapshot(args.master, args.timeout)
    except grpc.RpcError as exc:
        return _fail(_why(exc, args.master))
    if args.json:
        print(json.dumps(to_dict(snap), indent=2))
    else:
        _console().print(render(snap))
    return 0


def cmd_top(args) -> int:
    from rich.live import Live
    from rich.text import Text

    from gazer.view import render
    if not 0.2 <= args.interval <= 3600:
        return _fail(f"--interval must lie within [0.2, 3600] seconds, got {args.interval}", 2)
    console = _console()
    if args.once:
        try:
            snap = get_snapshot(args.master, args.timeout)
        except grpc.RpcError as exc:
            return _fail(_why(exc, args.master))
        console.print(render(snap))
        return 0
    last = None
    shown = 0
    failures = 0
    with Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            channel = insecure_channel(args.master)
            try:
                stream = gazer_pb2_grpc.GazerStub(channel).Watch(
                    gazer_pb2.WatchRequest(interval_seconds=args.interval))
                for snap in stream:
                    last, failures = snap, 0
                    live.update(render(snap), refresh=True)
                    shown += 1
                    if args.iterations and shown >= args.iterations:
                        return 0
                notice = "the AIMaster closed the stream (job finished or restarting)"
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                    live.stop()
                    return _fail(_why(exc, args.master))
                notice = _why(exc, args.master)
            finally:
                channel.close()
            delay = RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)]
            failures += 1
            notice += f"; retrying in {delay:.0f} s (Ctrl-C quits)"
            live.update(render(last, notice) if last is not None else Text(notice, style="bold red"),
                        refresh=True)
            time.sleep(delay)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if not args.master:
        return _fail("--master is required (or set DEEPREC_MASTER_ADDR)", 2)
    from deeprec_ext import auth
    try:
        auth.configure(token_file=args.token_file)
    except auth.AuthError as exc:
        return _fail(str(exc), 2)
    try:
        return {"dump": cmd_dump, "top": cmd_top}[args.command](args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
