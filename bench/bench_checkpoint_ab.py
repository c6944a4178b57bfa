"""Restore and write of one table, this tree against an older commit, with
``tf.train.Checkpoint`` alongside, alternated round by round in one run.

    .venv/bin/python bench/bench_checkpoint_ab.py [--rows 4000000] [--reps 5] [--before cc8cd73]
        [--before-format 3] [--ps-malloc]

The restore's speed lives in the store (hash index, arena) as much as in the reader, so
the older commit's whole tree (``git archive``) restores in a subprocess of its own,
driven over stdin, as this tree's does. Each reads the same table written by this
tree, in the format the older commit can read (``--before-format``, 3 by default: an
older tree cannot read format 4) and in the current format respectively. The older
writer is loaded from git as in ``bench_checkpoint.py --baseline`` and writes the
older format (the format module's version set to ``--before-format`` around it). Each round: TF read, both restores (order swapped
every round), TF write (no fsync), both writers with ``sync=False`` (order swapped).
Best of the rounds and the per-round ratios; the machine is shared, so only ratios of
one run mean anything (``uptime`` printed each round).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

CHILD = r"""
import gc, os, sys, time
repo, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo)
from checkpoint import restore
from deeprec_ext.store import EmbeddingStore
import deeprec_ext.store.table as T
assert T.__file__.startswith(repo), T.__file__
for line in sys.stdin:
    s = EmbeddingStore()
    t0 = time.perf_counter()
    restore(root, s, upto=1, exact=True)
    ms = (time.perf_counter() - t0) * 1000
    n = len(s["emb"])
    del s
    gc.collect()
    print(f"{ms:.1f} {n}", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before", default="cc8cd73", help="the older commit")
    ap.add_argument("--before-format", type=int, default=3,
                    help="checkpoint format the older commit reads and writes")
    ap.add_argument("--ps-malloc", action="store_true",
                    help="our side (this process's writers, both restore children) with a "
                         "PS's malloc setting: deeprec_ext.ps --malloc-mmap-threshold-mb's "
                         "default (TF's child keeps glibc's policy)")
    args = ap.parse_args()
    child_env = {}
    if args.ps_malloc:
        from deeprec_ext.ps.__main__ import bound_malloc_retention, get_args_parser
        mb = float(get_args_parser().parse_args([]).malloc_mmap_threshold_mb)
        if not bound_malloc_retention(mb):
            sys.exit("error: --ps-malloc: the malloc setting could not be applied")
    import bench_checkpoint as B
    if args.ps_malloc:  # the same two mallopt settings, read by glibc at the children's start
        child_env = B.ps_malloc_env(mb)
    import checkpoint.format as fmt
    from checkpoint import CheckpointWriter

    class Older:  # the format module of the older commit's version, around its calls
        def __enter__(self):
            self.v, fmt.FORMAT_VERSION = fmt.FORMAT_VERSION, args.before_format

        def __exit__(self, *exc):
            fmt.FORMAT_VERSION = self.v
    work = tempfile.mkdtemp(prefix="bench-ckpt-ab-")
    procs, tf = {}, None
    try:
        old_tree = os.path.join(work, "before")
        os.makedirs(old_tree)
        arch = subprocess.run(["git", "archive", args.before], cwd=REPO, check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old_tree], input=arch, check=True)
        child = os.path.join(work, "child.py")
        with open(child, "w") as f:
            f.write(CHILD)
        store, table, _ = B.make_table(args.rows)
        k, r, _ = table.export_rows()
        np.save(os.path.join(work, "values.npy"), r[:, :B.DIM])
        np.save(os.path.join(work, "accum.npy"), r[:, B.DIM:2 * B.DIM])
        del k, r
        gc.collect()
        tf = B.TF(work)
        roots = {"before": os.path.join(work, "ckpt-before"), "after": os.path.join(work, "ckpt")}
        for name, root in roots.items():
            with Older() if name == "before" else contextlib.nullcontext():
                w = CheckpointWriter(root, 1, "full")
                w.write_table("ps-0", table)
                w.commit()
        for name, repo in (("before", old_tree), ("after", REPO)):
            procs[name] = subprocess.Popen(
                [sys.executable, child, repo, roots[name]], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
                env=dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL="2", **child_env))
        old_writer = B.old_writer_class(args.before)
        res = {k: [] for k in ("tf_read", "before", "after", "tf_write", "w_before", "w_after")}
        print(f"rows {args.rows:,}, before = {args.before}"
              f"{', PS malloc setting' if args.ps_malloc else ''}; load {B.uptime()}",
              flush=True)
        for i in range(args.reps):
            res["tf_read"].append(tf.ask("read")["ms"])
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                p = procs[name]
                p.stdin.write("go\n")
                p.stdin.flush()
                ms, n = p.stdout.readline().split()
                assert int(n) == args.rows, (name, n)
                res[name].append(float(ms))
            res["tf_write"].append(tf.ask("write 0")["ms"])
            writers = [("w_before", old_writer), ("w_after", CheckpointWriter)]
            for name, cls in writers if i % 2 == 0 else writers[::-1]:
                scratch = os.path.join(work, "nosync")
                gc.collect()
                with Older() if name == "w_before" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    w = cls(scratch, 1, "full", sync=False)
                    w.write_table("ps-0", table)
                    w.commit()
                    res[name].append(round((time.perf_counter() - t0) * 1000, 1))
                shutil.rmtree(scratch)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in res.items())
                  + f" ms; load {B.uptime()}", flush=True)
        b = {k: min(v) for k, v in res.items()}
        print(f"best ms: {b}")
        print(f"restore, TF / ours: before {b['tf_read'] / b['before']:.2f}, after "
              f"{b['tf_read'] / b['after']:.2f}; after / before speed "
              f"{b['before'] / b['after']:.2f}x, per round "
              f"{[round(x / y, 2) for x, y in zip(res['before'], res['after'])]}")
        print(f"write without fsync, TF / ours: before {b['tf_write'] / b['w_before']:.2f}, "
              f"after {b['tf_write'] / b['w_after']:.2f}; after / before speed "
              f"{b['w_before'] / b['w_after']:.2f}x, per round "
              f"{[round(x / y, 2) for x, y in zip(res['w_before'], res['w_after'])]}")
    finally:
        for p in procs.values():
            p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if tf:
            tf.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
