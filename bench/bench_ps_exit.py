"""What a PS killed -9 spends its exit on: the part of a recovery's detection that is the
kernel tearing the dead process down (issue 16 item 1).

    .venv/bin/python bench/bench_ps_exit.py [--rows 4000000] [--kills 3] \
        [--out bench/results/ps-exit.json]

Per kill (a fresh job each time, as in ``bench_recovery.py``): ``aimaster run`` with 3 PS
and async replication, the table filled with ``--rows`` ids, ~1 s for the replica to
catch up, ``--warmup`` s of lookup + push load (kept running through the kill, as in the
recovery benchmark). Then, for ``ps-1``:

* its memory from ``/proc/<pid>/smaps``: anonymous and ``AnonHugePages`` kB in total and
  per mapping (largest first), so what is *not* in 2 MB pages shows up by mapping;
* ``kill -9``, timed (monotonic) to: a TCP connection this process opened to the PS's
  data port reporting closed (the kernel closes the dead process's files only after it
  freed its address space), and a ``pidfd`` of the PS becoming readable (the exit is
  reported: what the AIMaster's ``waitid`` sees); and the AIMaster's recovery event
  (kill -> noticed, as in ``bench_recovery.py``).

``--no-load`` kills an idle PS (no CPU contention from the load).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import signal
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
for _p in (REPO, BENCH):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

import bench_migration as bm  # noqa: E402
import bench_recovery as br  # noqa: E402

VICTIM = "ps-1"


def smaps(pid: int) -> dict:
    """Anonymous / AnonHugePages kB in total and for the largest mappings."""
    maps, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = {"range": head[0], "size_kb": (hi - lo) // 1024,
                       "name": head[5] if len(head) > 5 else "", "anon_kb": 0, "thp_kb": 0,
                       "rss_kb": 0, "thp_eligible": None}
                maps.append(cur)
            elif head[0] == "Anonymous:":
                cur["anon_kb"] = int(head[1])
            elif head[0] == "AnonHugePages:":
                cur["thp_kb"] = int(head[1])
            elif head[0] == "Rss:":
                cur["rss_kb"] = int(head[1])
            elif head[0] == "THPeligible:":
                cur["thp_eligible"] = int(head[1])
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    anon = sum(m["anon_kb"] for m in maps)
    thp = sum(m["thp_kb"] for m in maps)
    big = sorted((m for m in maps if m["anon_kb"] >= 1024), key=lambda m: -m["anon_kb"])
    return {"rss_kb": sum(m["rss_kb"] for m in maps), "anon_kb": anon, "thp_kb": thp,
            "anon_4k_kb": anon - thp, "mappings": len(maps), "threads": threads,
            "anon_4k_in_small_mappings_kb": sum(m["anon_kb"] - m["thp_kb"] for m in maps
                                                if m["anon_kb"] < 1024),
            "largest": big[:25]}


def kill_and_time(pid: int, address: str) -> dict:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
    poller.register(pidfd, select.POLLIN)
    out = {}
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        while len(out) < 2 and time.monotonic() - t0 < 30:
            for fd, _ in poller.poll(100):
                now = round((time.monotonic() - t0) * 1000, 2)
                if fd == pidfd and "exit_reported_ms" not in out:
                    out["exit_reported_ms"] = now
                    poller.unregister(pidfd)
                elif fd == sock.fileno() and "socket_closed_ms" not in out:
                    try:
                        data = sock.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if data:  # the server's HTTP/2 preface: not closed yet
                        continue
                    out["socket_closed_ms"] = now
                    poller.unregister(sock.fileno())
    finally:
        sock.close()
        os.close(pidfd)
    out["kill_monotonic"] = t0
    return out


def one_kill(args, i: int) -> dict:
    from deeprec_ext import PSClient
    label = br.label_of(args.rows)
    state_dir = os.path.join(REPO, "runs", f"bench-ps-exit-{label}")
    res: dict = {"kill": i}
    job = client = load = None
    try:
        job = br.RecoveryJob(state_dir, f"bench-ps-exit-{label}", 120.0, 200.0,
                             ps_env=dict(kv.split("=", 1) for kv in args.ps_env))
        client = PSClient.connect(job.address, timeout=120)
        job.remember_pids()
        client.create_table(br.TABLE, dim=br.DIM, initializer=br.INITIALIZER,
                            optimizer=br.OPTIMIZER)
        ids = bm.make_ids(args.rows, args.seed)
        for s in range(0, args.rows, 200_000):
            client.lookup(br.TABLE, ids[s:s + 200_000], insert_missing=True)
        time.sleep(args.replication_wait)
        if not args.no_load:
            load = bm.Load(job.address, ids, 4096, args.seed + 1)
            load.start()
            load.started.wait(60)
            time.sleep(args.warmup)
        status = job.status()
        m = next(m for m in status["members"]
                 if m["role"] == "ps" and m["id"] == VICTIM and m["state"] == "running")
        job.remember_pids()
        res["smaps"] = smaps(m["pid"])
        if load is not None:  # the load's steps before the kill (hot-path cost of a change)
            st = load.snapshot()
            st = st[st[:, 0] >= time.monotonic() - args.warmup + 0.5]
            d = (st[:, 2] - st[:, 0]) * 1000
            res["steps_before_kill"] = {"n": int(d.size), "p50_ms": round(float(np.median(d)), 2),
                                        "p90_ms": round(float(np.percentile(d, 90)), 2)}
        if args.malloc_stats:
            import subprocess
            subprocess.run(["gdb", "-p", str(m["pid"]), "-batch", "-ex",
                            "call (void) malloc_stats()"], capture_output=True, timeout=60)
        res["ps_rows"] = {s.ps_id: sum(t.rows for t in s.tables) for s in client.ps_stats()}
        wall_minus_mono = time.time() - time.monotonic()
        res["loadavg"] = os.getloadavg()
        t = kill_and_time(m["pid"], m["address"])
        kill = t.pop("kill_monotonic")
        res.update(t)
        rec = br.wait_for(lambda: job.events("recovery"), 60, "the recovery event")[0]
        res["noticed_ms"] = round((rec["time"] - wall_minus_mono - rec["resumed_ms"] / 1000
                                   - kill) * 1000, 1)
        res["resumed_ms"] = rec["resumed_ms"]
        sm = res["smaps"]
        br.log(f"  kill {i}: rss {sm['rss_kb'] / 1024:.0f} MB, anon {sm['anon_kb'] / 1024:.0f} MB "
               f"of which 2 MB pages {sm['thp_kb'] / 1024:.0f} MB, {sm['threads']} threads, "
               f"{sm['mappings']} mappings; socket closed {res.get('socket_closed_ms')} ms, "
               f"exit reported {res.get('exit_reported_ms')} ms, noticed {res['noticed_ms']} ms "
               f"(load average {res['loadavg'][0]:.1f})")
    finally:
        if load is not None:
            load.stop_event.set()
            load.join(10)
        if client is not None:
            client.close()
        if job is not None:
            job.stop()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--replication-wait", type=float, default=1.5)
    p.add_argument("--no-load", action="store_true")
    p.add_argument("--ps-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the PS processes (ps.env), for experiments")
    p.add_argument("--malloc-stats", action="store_true",
                   help="before the kill, have gdb call malloc_stats() in the PS (output "
                        "in its log): in-use vs retained malloc memory")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    started = datetime.datetime.now()
    runs = [one_kill(args, i) for i in range(args.kills)]
    summary = {k: [r.get(k) for r in runs] for k in
               ("socket_closed_ms", "exit_reported_ms", "noticed_ms", "resumed_ms")}
    summary["step_p50_ms"] = [r.get("steps_before_kill", {}).get("p50_ms") for r in runs]
    summary["anon_mb"] = [round(r["smaps"]["anon_kb"] / 1024) for r in runs]
    summary["thp_mb"] = [round(r["smaps"]["thp_kb"] / 1024) for r in runs]
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": started.isoformat(timespec="seconds"), "config": vars(args),
                       "summary": summary, "runs": runs}, f, indent=1)
        br.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
