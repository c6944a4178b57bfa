"""In-process: what a migration's import into a PS that serves training does to its
lookups (issue 16, item 3). A scale-in's destination holds rows of its own and the
deleted positions of an earlier clean-up (a third of its slots dropped), so the imported
rows take ``import_block``'s slower path (find, claims, an index that grows). A thread
looks up 2048 of its live keys every 4 ms (a training step's share) while another
imports a third as many new rows, in ``MigrateSlots``' 16k-row chunks, each either in
one table-lock hold (``--pieces 16384``) or in pieces with the interpreter handed over in
between (the PS's ``IMPORT_PIECE_ROWS``). Variants run in fresh processes, alternating,
``--repeat`` times; medians.

    python bench/bench_import_pieces.py --rows 2000000 --pieces 16384,4096 --repeat 5

``--yield``: each variant also with the import waiting between pieces while a lookup is
in flight (``ParameterServerServicer._import_pieces`` of a snapshot's stream).

``--growth 16,64``: variants of ``EmbeddingTable.IMPORT_GROWTH_PER_ROW`` (positions of a
growth under way moved per imported row) instead; ``--base DIR``: a variant ``base`` run
from the tree exported there (e.g. ``git archive``), alternating with this tree's.

    python bench/bench_import_pieces.py --rows 2000000 --pieces 4096 --growth 16,64 \
        --base /tmp/base --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 1 << 14  # MigrateSlots' rows per streamed batch


def measure(rows: int, piece: int, seed: int, growth: int = 0, yield_: bool = False) -> dict:
    import threading

    import numpy as np

    from deeprec_ext.ps.server import ParameterServerServicer
    from deeprec_ext.store import EmbeddingStore, EmbeddingTable
    if growth:
        EmbeddingTable.IMPORT_GROWTH_PER_ROW = growth
    # the PS's own import loop and in-flight count (its lookups bracket themselves so)
    svc = ParameterServerServicer("bench", migration_share=0.5)
    svc.IMPORT_PIECE_ROWS = piece
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.unique(rng.integers(-2**62, 2**62, int(rows * 1.52))))
    own, incoming = ids[:rows], ids[rows:rows + rows // 3]
    t = EmbeddingStore().create_table("t", 16, "zeros", {"name": "adagrad", "learning_rate": 0.1})
    for i in range(0, own.size, 200_000):
        t.lookup(own[i:i + 200_000], insert_missing=True)
    mask = np.zeros(4096, bool)
    mask[rng.choice(4096, 4096 // 3, replace=False)] = True
    gone = t.keys_in_slots(mask)
    for i in range(0, gone.size, CHUNK):
        t.delete(gone[i:i + CHUNK], log_tombstone=False, moved=True)
    live = np.setdiff1d(own, gone)
    data = rng.random((incoming.size, t.row_width), dtype=np.float32)
    counts = np.ones(incoming.size, np.uint32)
    lat, stop = [], threading.Event()

    def serve():
        r = np.random.default_rng(seed + 1)
        while not stop.is_set():
            q = live[r.integers(0, live.size, 2048)]
            t0 = time.perf_counter()
            svc._data_call(1)
            t.lookup(q, insert_missing=False)
            svc._data_call(-1)
            lat.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.004)

    th = threading.Thread(target=serve)
    th.start()
    time.sleep(0.3)
    n0 = len(lat)
    t0 = time.perf_counter()
    t.reserve_import(int(incoming.size * 1.02) + 64)
    for i in range(0, incoming.size, CHUNK):
        k, d, c = incoming[i:i + CHUNK], data[i:i + CHUNK], counts[i:i + CHUNK]
        if yield_:  # waits between pieces while a lookup is in flight
            svc._import_pieces(t, k, d, c, True)
            continue
        for j in range(0, k.size, piece):
            if j:
                time.sleep(0)
            t.import_block(k[j:j + piece], d[j:j + piece], c[j:j + piece])
    import_ms = (time.perf_counter() - t0) * 1e3
    stop.set()
    th.join()
    got = np.asarray(lat[n0:])
    assert len(t) == live.size + incoming.size
    assert (t.lookup(incoming[::97], insert_missing=False) == data[::97, :16]).all()
    return {"piece": piece, "growth": growth, "yield": yield_, "import_ms": import_ms,
            "lookups": int(got.size),
            "lookup_p50_ms": float(np.median(got)), "lookup_p99_ms": float(np.percentile(got, 99)),
            "lookup_max_ms": float(got.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--pieces", default="16384,4096")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--growth", default="", help="IMPORT_GROWTH_PER_ROW variants, e.g. 16,64")
    ap.add_argument("--yield", dest="yield_", action="store_true",
                    help="also a variant whose import waits between pieces while lookups are "
                         "in flight (the PS's snapshot imports)")
    ap.add_argument("--base", default="", help="a tree exported elsewhere, run as variant 'base'")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-growth", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-yield", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.rows, a.child, a.seed, a.child_growth, bool(a.child_yield))))
        return 0
    import numpy as np
    pieces = [int(p) for p in a.pieces.split(",")]
    growths = [int(g) for g in a.growth.split(",")] if a.growth else [0]
    variants = [(f"base piece {pieces[0]}", a.base, pieces[0], 0, 0)] if a.base else []
    variants += [(f"piece {p}" + (f" growth {g}" if g else "") + (" yield" if y else ""),
                  ROOT, p, g, y) for p in pieces for g in growths for y in ((0, 1) if a.yield_ else (0,))]
    runs = {v[0]: [] for v in variants}
    for r in range(a.repeat):
        for name, root, p, g, y in variants:  # alternating, each in a fresh process
            # this script, importing the store of the tree on PYTHONPATH
            out = subprocess.run([sys.executable, __file__, "--rows", str(a.rows), "--child", str(p),
                                  "--child-growth", str(g), "--child-yield", str(y),
                                  "--seed", str(a.seed)],
                                 capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=root), check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {r + 1} {name}: {runs[name][-1]}", flush=True)
    keys = ["import_ms", "lookups", "lookup_p50_ms", "lookup_p99_ms", "lookup_max_ms"]
    med = {p: {k: round(float(np.median([x[k] for x in v])), 2) for k in keys} for p, v in runs.items()}
    print("\nmedians:")
    for p, m in med.items():
        print(f"  {p}: {m}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg": os.getloadavg(),
                       "rows": a.rows, "runs": runs, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
