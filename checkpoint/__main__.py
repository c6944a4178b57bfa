"""``python -m checkpoint inspect DIR [--json]``: list chains and verify every checksum.

Exit codes: 0 every checkpoint valid (also when there are none), 1 some checkpoint is
invalid or not restorable (each problem is printed with its file), 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from checkpoint.reader import verify


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _id(i) -> str:
    return "-" if i is None else f"{i:08d}"


def _print_report(rep: dict, out) -> None:
    cks = rep["checkpoints"]
    print(f"checkpoint directory: {rep['root']}", file=out)
    if not cks:
        print("no checkpoints", file=out)
        return
    hdr = ("ID", "KIND", "PARENT", "TABLES", "ROWS", "TOMBSTONES", "BYTES", "CREATED", "STATUS")
    rows = [hdr]
    for c in cks:
        rows.append((_id(c["id"]), c["kind"], _id(c["parent"]),
                     str(len(c["tables"])) if c["tables"] or c["valid"] else "-",
                     "-" if c["rows"] is None else str(c["rows"]),
                     "-" if c["tombstones"] is None else str(c["tombstones"]),
                     _size(c["bytes"]), c["created"] or "-",
                     "ok" if c["valid"] else "INVALID"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    for r in rows:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), file=out)
    print("chains (newest first; a restore uses the first):", file=out)
    if rep["chains"]:
        for ch in rep["chains"]:
            print("  " + " -> ".join(_id(i) for i in ch), file=out)
    else:
        print("  none restorable", file=out)
    bad = [c for c in cks if not c["valid"]]
    if bad:
        print("problems:", file=out)
        for c in bad:
            for p in c["problems"]:
                print(f"  {p}", file=out)
    notes = [n for c in cks for n in c.get("notes", [])]
    if notes:
        print("notes (the checkpoints are complete without these):", file=out)
        for n in notes:
            print(f"  {n}", file=out)
    print(f"result: {len(cks)} checkpoint(s), {len(bad)} invalid; newest restorable: "
          f"{_id(rep['newest']) if rep['newest'] is not None else 'none'}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoint",
                                 description="Inspect deeprec-ext checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="list chains and verify every checksum "
                         "(exit 0 all valid, 1 some invalid, 2 usage error)")
    ins.add_argument("dir", help="checkpoint root directory (holds ckpt-*/ directories), or its URL (s3://...)")
    ins.add_argument("--json", action="store_true", help="print a JSON report")
    args = ap.parse_args(argv)
    from checkpoint import remote
    from checkpoint.format import CheckpointError
    if remote.is_remote(args.dir):  # s3://bucket/prefix: mirrored, then checked locally
        root = args.dir
    else:
        root = Path(args.dir)
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            print(f"python -m checkpoint inspect: error: {root} {what}", file=sys.stderr)
            return 2
    try:
        rep = verify(root)
    except (OSError, CheckpointError) as e:
        print(f"python -m checkpoint inspect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        print()
    else:
        _print_report(rep, sys.stdout)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
