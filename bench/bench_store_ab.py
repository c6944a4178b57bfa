"""In-process A/B of ``EmbeddingTable`` against the one of another git revision: insert,
lookup of present keys, push, and (with ``--dtype float16``, new side only) the float16
table. Old and new run interleaved in one process, best of ``--repeat``, CPU time
(``time.process_time``: other processes' load disturbs it less than wall time).

    python bench/bench_store_ab.py --base adb6293 [--keys 1000000] [--repeat 6]

Prints new/old throughput ratios (> 1: the new store is faster).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_table_module(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:deeprec_ext/store/table.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "table_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("table_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_ops(make, keys, batch, dim, opt):
    t = make(opt)
    g = np.full((batch, dim), 0.01, np.float32)
    out = {}
    c = time.process_time()
    for s in range(0, keys.size, batch):
        t.insert(keys[s:s + batch], np.ones((min(batch, keys.size - s), dim), np.float32))
    out["insert"] = time.process_time() - c
    rng = np.random.default_rng(1)
    probes = [keys[rng.integers(0, keys.size, batch)] for _ in range(10)]
    c = time.process_time()
    for p in probes:
        t.lookup(p)
    out["lookup"] = time.process_time() - c
    c = time.process_time()
    for p in probes:
        t.apply_gradients(p, g)
    out["push"] = time.process_time() - c
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True, help="git revision of the old store")
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--optimizers", default="sgd,adam")
    args = p.parse_args()
    from deeprec_ext.store.table import EmbeddingTable as New
    Old = load_table_module(args.base).EmbeddingTable
    keys = np.random.default_rng(0).integers(-2**62, 2**62, args.keys, dtype=np.int64)
    sides = {"old": lambda o: Old("t", args.dim, "zeros", o),
             "new": lambda o: New("t", args.dim, "zeros", o),
             "new-float16": lambda o: New("t", args.dim, "zeros", o, dtype="float16")}
    result = {}
    for opt in args.optimizers.split(","):
        best = {s: {} for s in sides}
        for _ in range(args.repeat):
            for side, make in sides.items():  # interleaved
                for op, sec in run_ops(make, keys, args.batch, args.dim, opt).items():
                    best[side][op] = min(best[side].get(op, 1e9), sec)
        result[opt] = {"cpu_seconds": best,
                       "new/old": {op: best["old"][op] / best["new"][op] for op in best["old"]},
                       "float16/old": {op: best["old"][op] / best["new-float16"][op]
                                       for op in best["old"]}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
