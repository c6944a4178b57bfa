"""A push's optimizer step on the PS under the PS's malloc setting vs glibc's own policy.

A PS fixes glibc's mmap threshold at 1 MB (``deeprec_ext.ps.__main__.bound_malloc_retention``)
so that freed request buffers do not stay resident. Every block of 1 MB or more is then a
new mapping, page-faulted and zeroed on first touch. The optimizer step of a push gathers
its rows and copies them plane-major: ~2 MB each at 15k rows of dim 8 with Adam. The
table keeps those two buffers between pushes (``EmbeddingTable._optimizer_scratch``).
This benchmark times ``apply_gradients`` of the same rows in two child processes, one
with the PS's setting and one with glibc's dynamic threshold (which keeps reusing freed
blocks), alternated, and prints the ratio: about 1.0 when the bound costs the push
nothing (before the buffers were kept: 1.5-1.8x at 15k rows).

    .venv/bin/python bench/bench_push_apply.py [--rows 4000,15000,40000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(rows: int, dim: int, optimizer: str, reps: int, bounded: bool) -> float:
    """Median ms of one push's ``apply_gradients`` of ``rows`` present keys."""
    if bounded:
        from deeprec_ext.ps.__main__ import bound_malloc_retention
        if not bound_malloc_retention(1.0):
            raise SystemExit("error: glibc mallopt unavailable here")
    import numpy as np

    from deeprec_ext.store.table import EmbeddingTable
    rng = np.random.default_rng(0)
    table = EmbeddingTable("t", dim, optimizer=optimizer)
    table.lookup(np.unique(rng.integers(0, 2**40, 400_000)).astype(np.int64))
    keys = np.unique(rng.integers(0, 2**40, rows)).astype(np.int64)
    table.lookup(keys)
    grads = rng.standard_normal((keys.size, dim)).astype(np.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        table.apply_gradients(keys, grads)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[reps // 10:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="4000,15000,40000")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)  # rows, bounded (0/1)
    args = p.parse_args()
    if args._child:
        print(json.dumps(child(int(args._child[0]), args.dim, args.optimizer, args.reps,
                               args._child[1] == "1")))
        return 0
    try:
        sizes = [int(r) for r in args.rows.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        print(f"error: --rows must be comma-separated positive integers, got {args.rows!r}",
              file=sys.stderr)
        return 2
    for flag in ("dim", "reps", "rounds"):
        if getattr(args, flag) <= 0:
            print(f"error: --{flag} must be > 0, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if args.optimizer not in ("sgd", "adagrad", "adam", "ftrl"):
        print(f"error: --optimizer must be sgd, adagrad, adam or ftrl, got {args.optimizer!r}",
              file=sys.stderr)
        return 2
    results = []
    print(f"{args.optimizer}, dim {args.dim}: median ms of one push's apply_gradients, "
          f"{args.rounds} alternated rounds of child processes")
    print(f"{'rows':>8} {'PS malloc bound':>16} {'glibc default':>14} {'ratio':>6}")
    for n in sizes:
        ms = {"1": [], "0": []}
        for _ in range(args.rounds):
            for bounded in ("1", "0"):
                out = subprocess.run(
                    [sys.executable, __file__, "--_child", str(n), bounded, "--dim",
                     str(args.dim), "--optimizer", args.optimizer, "--reps", str(args.reps)],
                    cwd=ROOT, capture_output=True, text=True, check=True,
                    env=dict(os.environ, PYTHONPATH=ROOT))
                ms[bounded].append(json.loads(out.stdout.strip().splitlines()[-1]))
        b, d = statistics.median(ms["1"]), statistics.median(ms["0"])
        print(f"{n:>8,} {b:>16.3f} {d:>14.3f} {b / d:>5.2f}x")
        results.append({"rows": n, "bounded_ms": ms["1"], "default_ms": ms["0"],
                        "ratio": b / d})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "push_apply", "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                          time.gmtime()),
                       "optimizer": args.optimizer, "dim": args.dim, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
