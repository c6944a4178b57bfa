"""``gazer``: look at a running job.

  gazer dump --master ADDR      one JSON snapshot (AIMaster status + per-PS statistics)
  gazer top  --master ADDR      live terminal view, refreshed every --interval seconds
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

from gazer.collect import snapshot


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gazer", description="Live statistics of an elastic PS job.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("dump", "print one JSON snapshot"), ("top", "live terminal view")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                       help="AIMaster address (env DEEPREC_MASTER_ADDR)")
        s.add_argument("--timeout", type=float, default=5.0)
        if name == "top":
            s.add_argument("--interval", type=float, default=1.0)
            s.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: never)")
    return p


def _render(snap: dict, prev: dict | None):
    from rich.table import Table
    t = Table(title=f"job {snap['job']}  phase {snap['phase']}  epoch {snap['epoch']}  "
                    f"shards {snap['shards']['done']} done / {snap['shards']['doing']} doing / "
                    f"{snap['shards']['todo']} todo")
    for col in ("member", "state", "rows", "table MB", "RSS MB", "lookups/s", "pushes/s", "samples/s"):
        t.add_column(col, justify="right" if col not in ("member", "state") else "left")
    dt = snap["time"] - prev["time"] if prev else 0.0
    old = {e["id"]: e for e in (prev["ps"] + prev["workers"])} if prev else {}

    def rate(e, key):
        if not dt or e["id"] not in old or key not in e or key not in old[e["id"]]:
            return ""
        return f"{(e[key] - old[e['id']][key]) / dt:,.0f}"

    for e in snap["ps"]:
        rows = sum(x["rows"] for x in e.get("tables", []))
        mb = sum(x["bytes"] for x in e.get("tables", [])) / 2**20
        t.add_row(e["id"], e["state"], f"{rows:,}", f"{mb:,.1f}",
                  f"{e.get('rss_bytes', 0) / 2**20:,.0f}", rate(e, "lookups"), rate(e, "pushes"), "")
    for e in snap["workers"]:
        t.add_row(e["id"], e["state"], "", "", "", "", "", rate(e, "samples"))
    return t


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if not args.master:
        print("gazer: error: --master is required (or set DEEPREC_MASTER_ADDR)", file=sys.stderr)
        return 2
    try:
        if args.command == "dump":
            print(json.dumps(snapshot(args.master, args.timeout), indent=2))
            return 0
        from rich.live import Live
        prev = None
        n = 0
        with Live(refresh_per_second=4) as live:
            while True:
                snap = snapshot(args.master, args.timeout)
                live.update(_render(snap, prev))
                prev = snap
                n += 1
                if args.iterations and n >= args.iterations:
                    return 0
                time.sleep(args.interval)
    except grpc.RpcError as exc:
        print(f"gazer: error: cannot reach AIMaster at {args.master}: {exc.code().name}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
