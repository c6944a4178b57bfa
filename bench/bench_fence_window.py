"""The fence window of a live migration (issue 16, item 3): from the fence to the end
of the publish, while a thread pushes to the PS. Two real PS processes; ``migrate()``
moves 8 of 64 slots from one to the other and back, ``--moves`` times per run, with the
fleet's own publish (no AIMaster, no job-state save). ``--base DIR`` runs a tree exported
there (e.g. ``git archive``) alternately with this one, each in fresh processes.

    python bench/bench_fence_window.py --rows 200000 --moves 10 --repeat 3 --base /tmp/base

``--request-ids N``: each PS first applies N one-key pushes with request ids (a long job's
window of remembered ids is 200,000), and the load's pushes carry ids as well.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_ps(tmp: str, name: str, root: str):
    port_file = os.path.join(tmp, f"{name}.port")
    proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--port", "0",
                             "--port-file", port_file], cwd=root,
                            env=dict(os.environ, PYTHONPATH=root),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(open(port_file).read())}"


def measure(rows: int, moves: int, root: str, request_ids: int = 0) -> dict:
    import numpy as np

    from aimaster.fleet import PsFleet
    from aimaster.migration import migrate
    from deeprec_ext import codec
    from deeprec_ext.client.routing import RoutingTable
    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2

    n = 64
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for name in ("ps-0", "ps-1"):
                procs.append(_start_ps(tmp, name, root))
            addrs = [p[1] for p in procs]
            fleet = PsFleet()
            owner = np.array([0, 1] * (n // 2), np.int32)
            cur = RoutingTable(fleet.next_epoch(), n, ("ps-0", "ps-1"), tuple(addrs), owner)
            fleet.publish(cur, lambda _: True)
            for a in addrs:
                fleet.stub(a).CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
                    name="t", dim=16, initializer_json='{"name": "zeros"}',
                    optimizer_json='{"name": "adagrad", "learning_rate": 0.1}')), timeout=30)
            keys = np.arange(1, rows + 1, dtype=np.int64)
            slots = slot_of(keys, n)
            fixed = ~np.isin(slots, np.arange(0, 16, 2))  # slots that never move
            stop = threading.Event()
            pushes = [0]

            def push(ps, ids, rid=""):
                fleet.stub(addrs[ps]).Push(ps_pb2.PushRequest(
                    epoch=0, request_id=rid, tables=[ps_pb2.TableUpdate(
                        table="t", ids=codec.ids_to_bytes(ids),
                        values=codec.floats_to_bytes(np.ones((ids.size, 16), np.float32)))]),
                    timeout=30)
            for ps in (0, 1):
                mine = keys[owner[slots] == ps]
                for i in range(0, mine.size, 50_000):
                    push(ps, mine[i:i + 50_000])
            t_ids = time.monotonic()
            for ps in (0, 1):  # a long job's window of applied push ids (1-key pushes)
                stub, futs = fleet.stub(addrs[ps]), []
                one = codec.floats_to_bytes(np.ones((1, 16), np.float32))
                mine = keys[fixed & (owner[slots] == ps)]
                for i in range(request_ids):
                    futs.append(stub.Push.future(ps_pb2.PushRequest(
                        request_id=f"fill-{ps}-{i:07d}-{'0' * 24}", tables=[ps_pb2.TableUpdate(
                            table="t", ids=codec.ids_to_bytes(mine[i % mine.size:][:1]),
                            values=one)]), timeout=60))
                    if len(futs) >= 256:
                        for f in futs:
                            f.result()
                        futs = []
                for f in futs:
                    f.result()
            fill_ids_s = time.monotonic() - t_ids

            def load():  # a training-like stream to both PS, on slots that never move
                r = np.random.default_rng(1)
                per = [keys[fixed & (owner[slots] == ps)] for ps in (0, 1)]
                while not stop.is_set():
                    for ps in (0, 1):
                        push(ps, per[ps][r.integers(0, per[ps].size, 2048)],
                             f"load-{ps}-{pushes[0]}" if request_ids else "")
                        pushes[0] += 1
                    time.sleep(0.005)
            th = threading.Thread(target=load, daemon=True)
            th.start()
            out = []
            for m in range(moves):
                new_owner = cur.slot_owner.copy()
                new_owner[0:16:2] = 1 - new_owner[0:16:2]  # 8 slots across, then back
                res = migrate(fleet, cur, new_owner, list(cur.ps_ids), list(cur.ps_addresses),
                              lambda r: fleet.publish(r, lambda _: True))
                cur = res.routing
                out.append({"fence_ms": res.fence_ms, "phases_ms": res.phases_ms,
                            "last_rows": res.round_rows[-1]})
            stop.set()
            th.join(10)
            fleet.close()
            return {"moves": out, "pushes": pushes[0], "request_ids": request_ids,
                    "fill_ids_s": round(fill_ids_s, 1)}
        finally:
            for p, _ in procs:
                p.kill()
                p.wait(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--moves", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--request-ids", type=int, default=0,
                    help="push ids each PS has applied before the moves (the window of a "
                         "long job: 200000 fills it); the load's pushes then carry ids too")
    ap.add_argument("--base", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rows <= 0 or a.moves <= 0 or a.repeat <= 0 or a.request_ids < 0:
        ap.error("--rows, --moves and --repeat must be positive, --request-ids not negative")
    if a.child:
        print(json.dumps(measure(a.rows, a.moves, a.child, a.request_ids)))
        return 0
    import numpy as np
    trees = ([("base", a.base)] if a.base else []) + [("this", ROOT)]
    runs = {name: [] for name, _ in trees}
    for r in range(a.repeat):
        for name, root in trees:  # alternating, fresh processes
            res = subprocess.run([sys.executable, __file__, "--rows", str(a.rows), "--moves",
                                  str(a.moves), "--request-ids", str(a.request_ids),
                                  "--child", root], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=root), check=True, timeout=900)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            runs[name].append(got)
            f = [m["fence_ms"] for m in got["moves"]]
            print(f"run {r + 1} {name}: fence window ms median {np.median(f):.1f} "
                  f"p90 {np.percentile(f, 90):.1f} max {max(f):.1f}"
                  + (f" ({a.request_ids} ids applied first, in {got['fill_ids_s']} s)"
                     if a.request_ids else ""), flush=True)
    summary = {}
    for name, rs in runs.items():
        f = [m["fence_ms"] for x in rs for m in x["moves"]]
        summary[name] = {"moves": len(f), "median_ms": round(float(np.median(f)), 2),
                         "p90_ms": round(float(np.percentile(f, 90)), 2),
                         "max_ms": round(float(max(f)), 2)}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg": os.getloadavg(),
                       "rows": a.rows, "runs": runs, "summary": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
