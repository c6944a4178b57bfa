"""Job state persistence: the former full-rewrite JSON store vs the SQLite journal.

    .venv/bin/python bench/bench_state_store.py [--shards 5000] [--rounds 3] [--dir DIR]

One job state as the AIMaster saves it (``--shards`` shards, routing with 4096 slots,
8 members, the last 200 events) and the change of one data-shard request per save: a
``GetShard`` (the head of ``todo`` moves to ``doing``) or a ``ReportShard`` (``doing`` ->
``done``), alternately, with the members' step counters and ``global_step`` moving as
they do between two requests. Each store saves the same sequence of states, in
interleaved rounds (old, new, old, new, ...) on the same disk; per store it reports

- saves/s: the median over rounds of saves per second of ``save()`` alone (the state
  dicts are built beforehand);
- bytes written per save: what the process passed to write()/pwrite() during the saves
  (``wchar`` of ``/proc/self/io``), divided by the saves: the JSON documents for the old
  store; WAL frames and the periodic checkpoints into the database for the new one.

Both fsync every save (the old one also fsyncs the directory for its rename). Also
printed, for scale: the time ``ShardQueue.to_state()`` takes to build the shard part of
the state, which the AIMaster does before each save.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from aimaster.shards import Shard, ShardQueue  # noqa: E402
from aimaster.state import StateStore  # noqa: E402


class OldJsonStateStore:
    """The store this replaced: the whole state as one JSON document, rewritten atomically
    (write a temp file, fsync, rename, fsync the directory) on every save."""

    def __init__(self, state_dir: str, filename: str = "job_state.json"):
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, filename)
        self._lock = threading.Lock()

    def load(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def save(self, state: dict) -> None:
        data = json.dumps(state, sort_keys=True).encode()
        with self._lock:
            tmp = f"{self.path}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(dfd)  # make the rename itself durable
            finally:
                os.close(dfd)


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def make_states(shards: int, saves: int) -> list[dict]:
    """The initial state and ``saves`` one-request changes of it, as the AIMaster builds
    them (shard part from ShardQueue.to_state())."""
    q = ShardQueue([Shard(i, f"/data/day-{i // 500:03d}.csv", (i % 500) * 4096,
                          (i % 500 + 1) * 4096, 0) for i in range(shards)])
    members = [{"role": "ps", "id": f"ps-{i}", "pid": 100 + i, "address": f"10.0.0.{i}:7000",
                "state": "running", "steps": 0, "samples": 0} for i in range(2)]
    members += [{"role": "worker", "id": f"worker-{i}", "pid": 200 + i, "address": "",
                 "state": "running", "steps": 0, "samples": 0} for i in range(6)]
    events = [{"kind": "register", "time": 1.7e9 + i, "id": f"worker-{i % 6}", "role": "worker",
               "pid": 200 + i % 6, "address": ""} for i in range(200)]
    routing = {"epoch": 3, "num_slots": 4096, "ps_ids": ["ps-0", "ps-1"],
               "ps_addresses": ["10.0.0.0:7000", "10.0.0.1:7000"],
               "slot_owner": [s % 2 for s in range(4096)]}
    static = None

    def state() -> dict:
        nonlocal static
        shard_state = q.to_state()
        # the shard list never changes: share one copy (the real master builds it anew,
        # which costs CPU, not bytes; timed separately)
        static = static or shard_state["shards"]
        shard_state["shards"] = static
        return {"job_name": "bench", "phase": "running", "message": "", "epoch": 3,
                "master_address": "127.0.0.1:5000", "routing": routing,
                "members": [dict(m) for m in members], "shards": shard_state,
                "events": events[-200:],
                "global_step": sum(m["steps"] for m in members if m["role"] == "worker"),
                "model": {"tables": [{"name": "ids", "dim": 16}], "dense": [256, 128]},
                "final_checkpoint": "", "export_dir": ""}

    out = [state()]
    held: list[tuple[str, int]] = []
    for i in range(saves):
        w = f"worker-{i % 6}"
        if i % 2 == 0:
            _, shard = q.assign(w)
            held.append((w, shard.shard_id))
        else:
            w, sid = held.pop(0)
            q.complete(w, [sid])
        for m in members:
            if m["role"] == "worker":
                m["steps"] += 5
                m["samples"] = m["steps"] * 512
        out.append(state())
    return out


def run(store, states: list[dict]) -> tuple[float, float]:
    """(saves/s, bytes written per save) for saving states[1:] after states[0]."""
    store.save(states[0])
    w0, t0 = wchar(), time.perf_counter()
    for s in states[1:]:
        store.save(s)
    dt, dw = time.perf_counter() - t0, wchar() - w0
    return (len(states) - 1) / dt, dw / (len(states) - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-saves", type=int, default=200)
    ap.add_argument("--new-saves", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="bench-state-", dir=args.dir)
    try:
        states = make_states(args.shards, max(args.old_saves, args.new_saves))
        json_bytes = len(json.dumps(states[0], sort_keys=True))
        q = ShardQueue([Shard(i, "/d", i, i + 1) for i in range(args.shards)])
        t0 = time.perf_counter()
        for _ in range(20):
            q.to_state()
        to_state_ms = (time.perf_counter() - t0) / 20 * 1e3

        results = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in ("old", "new"):
                d = os.path.join(base, f"{name}-{r}")
                if name == "old":
                    store = OldJsonStateStore(d)
                    results[name].append(run(store, states[:args.old_saves + 1]))
                else:
                    store = StateStore(d)
                    results[name].append(run(store, states[:args.new_saves + 1]))
                    store.close()
                shutil.rmtree(d)
                print(f"  round {r} {name}: {results[name][-1][0]:8.1f} saves/s "
                      f"{results[name][-1][1]:12.0f} B/save", flush=True)
        old_rate = statistics.median(x[0] for x in results["old"])
        new_rate = statistics.median(x[0] for x in results["new"])
        old_bytes = statistics.median(x[1] for x in results["old"])
        new_bytes = statistics.median(x[1] for x in results["new"])
        print(f"\n{args.shards} shards, state JSON {json_bytes / 1e3:.0f} kB; one data-shard "
              f"request per save ({args.old_saves} old / {args.new_saves} new saves x "
              f"{args.rounds} rounds, medians)")
        print(f"{'':24}{'old (JSON rewrite)':>20}{'new (SQLite journal)':>22}{'ratio':>10}")
        print(f"{'saves/s':24}{old_rate:20.1f}{new_rate:22.1f}{new_rate / old_rate:9.1f}x")
        print(f"{'bytes written / save':24}{old_bytes:20.0f}{new_bytes:22.0f}"
              f"{old_bytes / new_bytes:9.1f}x less")
        print(f"\n(for scale: ShardQueue.to_state() of {args.shards} shards, built by the "
              f"AIMaster before each save: {to_state_ms:.1f} ms)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
