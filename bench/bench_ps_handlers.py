"""CPU a PS spends in its handlers for one step of ``bench_training.py``'s ours 1+1, in process.

One step of the DeepFM job: a ``Lookup`` of the batch's unique ids in ``embedding`` (dim 8)
and ``linear`` (dim 1), then one ``Push`` of their gradients (Adam on the PS) plus the 8
dense variables' deltas (``assign_add`` tables, whose merged values the push returns).
Requests are serialized beforehand and parsed here as gRPC hands them over; the servicer
owns every routing slot, as a lone PS does. No gRPC transport: its own cost per call is
measured by ``bench_training.py`` (PS CPU per step) and is not in these figures.

Ids: the categorical columns of ``bench_training.py``'s training files (generated there,
``runs/bench-data/``), hashed per column, unique per batch of 1024 (6.8k ids a step).

``--ab`` alternates the current handlers with two of their earlier behaviours patched
back (a returned table updated and then looked up again; a push's keys hashed to their
routing slots although this PS owns all of them), so a change is measured in one run.

    .venv/bin/python bench/bench_ps_handlers.py --rounds 3 --ab
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.bench_training import ensure_data  # noqa: E402
from deeprec_ext import codec  # noqa: E402
from deeprec_ext.proto import ps_pb2  # noqa: E402
from deeprec_ext.ps.server import ParameterServerServicer  # noqa: E402

DENSE = [(221, 128), (128,), (128, 64), (64,), (64, 1), (1,), (13, 1), (1,)]  # DeepFM's


def steps_of(files: list[str], steps: int, batch: int) -> tuple[list[tuple[bytes, bytes]], float]:
    """Serialized (Lookup, Push) requests of each step, and the mean unique ids a step."""
    lines = []
    for path in files:
        with open(path, "rb") as f:
            lines += f.read().split(b"\n")
        if len(lines) > steps * batch:
            break
    lines = [x for x in lines[:steps * batch] if x]
    ids = np.array([[zlib.crc32(b"%d:" % j + c) for j, c in enumerate(x.split(b"\t")[14:40])]
                    for x in lines], np.int64)
    rng = np.random.default_rng(0)
    names = [f"dense/{i}" for i in range(len(DENSE))]
    out, sizes = [], []
    for k in range(0, len(ids) - batch + 1, batch):
        b = np.unique(ids[k:k + batch])
        sizes.append(b.size)
        lookup = ps_pb2.LookupRequest(insert_missing=True, tables=[
            ps_pb2.TableIds(table=t, ids=codec.ids_to_bytes(b)) for t in ("embedding", "linear")])
        ups = [ps_pb2.TableUpdate(table=t, ids=codec.ids_to_bytes(b), values=codec.floats_to_bytes(
            rng.standard_normal((b.size, d), dtype=np.float32) * 1e-3))
            for t, d in (("embedding", 8), ("linear", 1))]
        for name, shape in zip(names, DENSE):
            rows, dim = (shape[0], shape[1]) if len(shape) > 1 else (1, shape[0])
            ups.append(ps_pb2.TableUpdate(table=name, ids=codec.ids_to_bytes(np.arange(rows)),
                                          values=codec.floats_to_bytes(
                                              np.full((rows, dim), 1e-5, np.float32))))
        push = ps_pb2.PushRequest(tables=ups, return_values=True, return_tables=sorted(names),
                                  request_id=f"bench-{k}")
        out.append((lookup.SerializeToString(), push.SerializeToString()))
    return out, float(np.mean(sizes))


def _earlier(svc: ParameterServerServicer) -> None:
    """Patch back the two behaviours ``--ab`` compares against."""
    def apply(work, returns):
        out = []
        for (table, ids, vals), ret in zip(work, returns):
            table.apply_gradients(ids, vals)
            out.append(codec.floats_to_bytes(table.lookup(ids, insert_missing=False))
                       if ret else b"")
        return out if any(returns) else []
    svc._apply = apply
    svc.routing._owns_all = None
    svc.routing._adopt = lambda *a: None  # the routing is set once, before this


def run(steps, earlier: bool, warm: int) -> float:
    svc = ParameterServerServicer("bench-ps")
    svc.routing.set(1, 4096, np.ones(4096, bool))
    if earlier:
        _earlier(svc)
    store = svc.store
    store.create_table("embedding", 8, {"name": "normal", "stddev": 0.01, "seed": 7},
                       {"name": "adam", "learning_rate": 1e-3})
    store.create_table("linear", 1, "zeros", {"name": "adam", "learning_rate": 1e-3})
    for i, shape in enumerate(DENSE):
        rows, dim = (shape[0], shape[1]) if len(shape) > 1 else (1, shape[0])
        store.create_table(f"dense/{i}", dim, "zeros", {"name": "assign_add"}).lookup(
            np.arange(rows, dtype=np.int64))
    spent = 0.0
    for k, (lookup, push) in enumerate(steps):
        start = time.process_time()
        svc.Lookup(ps_pb2.LookupRequest.FromString(lookup), None)
        svc.Push(ps_pb2.PushRequest.FromString(push), None)
        if k >= warm:
            spent += time.process_time() - start
    return spent / (len(steps) - warm) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=390)
    ap.add_argument("--warmup-steps", type=int, default=100,
                    help="steps not counted (the tables grow most in the first ones)")
    ap.add_argument("--ab", action="store_true", help="alternate with the earlier handlers")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup_steps:
        ap.error("--steps must be larger than --warmup-steps")
    data = ensure_data(400_000, 2, 1, 50_000)
    steps, ids = steps_of(data["train"], args.steps, 1024)
    print(f"{len(steps)} steps, {ids:,.0f} unique ids a "
          f"step; CPU ms per step (Lookup + Push handlers) after {args.warmup_steps} steps:")
    sides = [("current", False)] + ([("earlier", True)] if args.ab else [])
    got: dict[str, list[float]] = {name: [] for name, _ in sides}
    for _ in range(args.rounds):
        for name, earlier in sides:
            got[name].append(run(steps, earlier, args.warmup_steps))
    for name, values in got.items():
        print(f"  {name:8s} " + " / ".join(f"{v:.2f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
