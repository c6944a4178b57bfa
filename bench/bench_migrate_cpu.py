"""CPU a live migration costs, per process: one source PS streams a third of its slots to
a destination PS over real gRPC (``MigrateSlots`` -> ``ImportRows``), then a catch-up
round after some training pushes, then the source's clean-up (``DropSlots``). Both PS are
standalone processes (``python -m deeprec_ext.ps``); the CPU of each is read from /proc
around every call, so the figure is what the migration takes from training on that PS.

Compares this checkout with another commit (``--base``, extracted with ``git archive``)
in one run: the variants alternate ``--repeat`` times; the figures are medians. The
rounds run unpaced (``--migration-share 1``): pacing spreads the CPU over time, it does
not change how much is spent.

    python bench/bench_migrate_cpu.py --rows 2000000 --base HEAD~3 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_SLOTS = 4096


def start_ps(code_root: str, tmp: str, name: str) -> tuple[subprocess.Popen, str]:
    port_file = os.path.join(tmp, f"{name}.port")
    env = dict(os.environ, PYTHONPATH=code_root)
    proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--port", "0",
                             "--port-file", port_file, "--migration-share", "1"],
                            env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, f"{name}.log"), "w"),
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(port_file) and open(port_file).read().strip():
            return proc, f"127.0.0.1:{int(open(port_file).read().strip())}"
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {open(os.path.join(tmp, name + '.log')).read()}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not start")


def cpu(pid: int, sys_only: bool = False) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[12]) + (0 if sys_only else int(fields[11]))) / os.sysconf("SC_CLK_TCK")


def child(rows: int, seed: int) -> dict:
    """Runs with PYTHONPATH set to the variant's code."""
    import grpc

    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2 as pb
    from deeprec_ext.proto import ps_pb2_grpc as pbg
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(-2**62, 2**62, int(rows * 1.01)))[:rows]
    rng.shuffle(ids)
    mask = np.zeros(NUM_SLOTS, np.uint8)
    mask[rng.choice(NUM_SLOTS, NUM_SLOTS // 3, replace=False)] = 1
    cfg = pb.TableConfig(name="emb", dim=16, initializer_json=json.dumps({"name": "normal", "seed": 1}),
                         optimizer_json=json.dumps({"name": "adagrad", "learning_rate": 0.05}))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            src, src_addr = start_ps(os.environ["PYTHONPATH"], tmp, "src")
            procs.append(src)
            dst, dst_addr = start_ps(os.environ["PYTHONPATH"], tmp, "dst")
            procs.append(dst)
            opts = [("grpc.max_send_message_length", 256 << 20),
                    ("grpc.max_receive_message_length", 256 << 20)]
            s = pbg.ParameterServerStub(grpc.insecure_channel(src_addr, opts))
            s.CreateTable(pb.CreateTableRequest(config=cfg), timeout=60)
            for i in range(0, ids.size, 200_000):
                s.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=ids[i:i + 200_000].tobytes())],
                                          insert_missing=True), timeout=120)
            moving = int(np.count_nonzero(mask[slot_of(ids, NUM_SLOTS)]))

            def timed(name, fn):
                c0s, c0d, t0 = cpu(src.pid), cpu(dst.pid), time.perf_counter()
                k0s, k0d = cpu(src.pid, True), cpu(dst.pid, True)
                r = fn()
                out[f"{name}_wall_ms"] = (time.perf_counter() - t0) * 1e3
                out[f"{name}_src_cpu_s"] = cpu(src.pid) - c0s
                out[f"{name}_dst_cpu_s"] = cpu(dst.pid) - c0d
                # of which in the kernel (page faults of fresh buffers and arena pages)
                out[f"{name}_src_sys_s"] = cpu(src.pid, True) - k0s
                out[f"{name}_dst_sys_s"] = cpu(dst.pid, True) - k0d
                return r

            req = pb.MigrateSlotsRequest(dst_address=dst_addr, slots=mask.tobytes(),
                                         num_slots=NUM_SLOTS, since_seq=-1)
            r = timed("snapshot", lambda: s.MigrateSlots(req, timeout=600))
            if r.rows != moving:
                raise AssertionError(f"snapshot moved {r.rows} rows, expected {moving}")
            out["moved_rows"] = moving
            # 20 training steps' pushes of 4096 ids, then a catch-up round
            for _ in range(20):
                sel = np.unique(ids[rng.integers(0, ids.size, 4096)])
                s.Push(pb.PushRequest(tables=[pb.TableUpdate(
                    table="emb", ids=sel.tobytes(),
                    values=np.full((sel.size, 16), 0.01, np.float32).tobytes())]), timeout=60)
            req = pb.MigrateSlotsRequest(dst_address=dst_addr, slots=mask.tobytes(),
                                         num_slots=NUM_SLOTS, since_seq=r.watermark)
            r2 = timed("catchup", lambda: s.MigrateSlots(req, timeout=600))
            out["catchup_rows"] = int(r2.rows)
            d = pbg.ParameterServerStub(grpc.insecure_channel(dst_addr, opts))
            st = d.Stats(pb.StatsRequest(), timeout=60)
            got = {t.name: t.rows for t in st.tables}
            if got.get("emb") != moving:
                raise AssertionError(f"destination holds {got} rows, expected {moving}")
            r3 = timed("drop", lambda: s.DropSlots(pb.DropSlotsRequest(
                slots=mask.tobytes(), num_slots=NUM_SLOTS), timeout=600))
            if r3.rows != moving:
                raise AssertionError(f"DropSlots freed {r3.rows}, expected {moving}")
        finally:
            for p in procs:
                p.kill()
                p.wait()
    out["total_cpu_s"] = sum(v for k, v in out.items() if k.endswith("_cpu_s"))
    out["total_sys_s"] = sum(v for k, v in out.items() if k.endswith("_sys_s"))
    out["cpu_us_per_moved_row"] = out["total_cpu_s"] / out["moved_rows"] * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows on the source PS")
    ap.add_argument("--base", default=None, help="commit to compare with")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.rows, args.seed)))
        return 0
    variants = {"this": ROOT}
    tmp = None
    if args.base:
        tmp = tempfile.TemporaryDirectory()
        arch = subprocess.run(["git", "-C", ROOT, "archive", args.base, "deeprec_ext"],
                              check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=arch, check=True)
        variants = {"base": tmp.name, "this": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for i in range(args.repeat):
        for name, code in variants.items():
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  "--rows", str(args.rows), "--seed", str(args.seed)],
                                 env=dict(os.environ, PYTHONPATH=code), capture_output=True,
                                 text=True, timeout=900)
            if res.returncode:
                print(res.stderr, file=sys.stderr)
                return 1
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"{name} #{i + 1}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in runs[name][-1].items()), flush=True)
    summary = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
               for name, rs in runs.items()}
    if "base" in summary:
        summary["base_over_this"] = {k: round(summary["base"][k] / summary["this"][k], 2)
                                     for k in summary["this"]
                                     if k.endswith(("_cpu_s", "_sys_s", "_ms", "_row")) and summary["this"][k]}
    summary.update(rows=args.rows, repeat=args.repeat, base_commit=args.base,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   loadavg=os.getloadavg())
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
