"""Checkpoint write and restore against ``tf.train.Checkpoint``, side by side in one run.

    .venv/bin/python bench/bench_checkpoint.py [--rows 4000000] [--reps 3] [--quick]
        [--compress auto] [--baseline 381a4c1] [--ps-malloc [MB]]
        [--out bench/results/checkpoint.json]

``--ps-malloc``: our side runs with the malloc setting a PS process applies
(``deeprec_ext.ps --malloc-mmap-threshold-mb``, 1 MB by default: every block of that size
or more is mapped and unmapped on its own), as a checkpoint is written inside a PS.

One table, dim 16, Adagrad (value + accumulator), one gradient step on every row, so the
accumulators are trained values, not the constant initial one. Then, in this order:

1. ``--reps`` rounds, each alternating ``tf.train.Checkpoint`` (in a subprocess driven
   over stdin; TensorFlow is not imported here) on the SAME values and accumulators
   (exported from the table, handed over as .npy files) with this format:
   - TF ``write`` (no fsync: TF does not sync, checked with strace), then ours with
     ``sync=False`` (``write_table`` + ``commit``, no fsync);
   - TF ``write`` + fsync of every file and the directory (a durable TF checkpoint),
     then ours as the AIMaster runs it: ``write_table`` + ``commit`` (fsync) +
     ``apply_retention(verify="new")``, the retention timed apart;
   - TF ``read`` into fresh variables (made before the clock starts; the time to make
     them is reported apart), then our restore of the whole table into an empty store.
   Best of the rounds for each.
2. ``--reps`` restores from nothing, each side in a new process, alternated (what a
   job's start does): TF makes its variables (allocated, zero-filled) and reads its
   checkpoint; ours makes a store and restores the last full. Imports are untimed. In
   the long-lived child above TF reads into memory its allocator already holds, while
   our restore maps a new arena each round: this pair has neither side warm.
3. ``--reps`` incrementals chained on the last full, each after another 5% of the rows
   were touched (``--touched``), as the AIMaster takes them, each including its
   retention pass: time and bytes against the full's (also incl. its retention pass).
4. One more full checkpoint while a thread pushes gradients and looks up rows in a loop:
   the pushes' and lookups' latency during the write (they are not blocked), and the
   peak extra RSS of the process during the checkpoint (sampled every 2 ms).
5. ``--baseline COMMIT``: the writer of that commit (loaded from git) on the same table,
   for the before/after figure.

MB/s are of the logical data both sides hold, values + accumulators (``rows * 2 * dim *
4`` bytes; 512 MB at 4M rows), so a ratio is a ratio of times. The machine is shared and
noisy: compare ratios from the same run; ``uptime`` is printed before and after.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DIM = 16


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------ TF side
def tf_child(data_dir: str) -> None:
    """Runs in the subprocess, driven over stdin one command per line, so its runs
    alternate with ours: ``write 0|1`` (1: fsync every file it wrote, and the directory),
    ``read`` (a checkpoint is written first, untimed), ``quit``. Answers JSON lines."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    values = np.load(os.path.join(data_dir, "values.npy"))
    accum = np.load(os.path.join(data_dir, "accum.npy"))
    v = tf.Variable(values, name="emb")
    a = tf.Variable(accum, name="emb_adagrad_accum")
    ckpt = tf.train.Checkpoint(emb=v, accum=a)
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-tf-", dir=data_dir)
    print(json.dumps({"tensorflow": tf.__version__, "rows": int(v.shape[0])}), flush=True)
    n = 0
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            n += 1
            d = os.path.join(tmp, f"run{n}") if cmd[0] != "keep" else cmd[1]
            t = time.perf_counter()
            path = ckpt.write(os.path.join(d, "ckpt"))
            if cmd[0] == "write" and cmd[1] == "1":
                for f in os.listdir(d):
                    fd = os.open(os.path.join(d, f), os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                fd = os.open(d, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            ms = (time.perf_counter() - t) * 1000
            out = {"ms": round(ms, 1), "bytes": dir_bytes(d)}
            if cmd[0] == "read":
                # the variables a restore reads into must exist first: a TF restore from
                # nothing (a PS or a job starting) makes them, memory allocated and filled;
                # our restore's time includes making its table. Timed apart ("create_ms").
                t = time.perf_counter()
                v2 = tf.Variable(tf.zeros_like(v), name="emb")
                a2 = tf.Variable(tf.zeros_like(a), name="emb_adagrad_accum")
                t1 = time.perf_counter()
                tf.train.Checkpoint(emb=v2, accum=a2).read(path).assert_consumed()
                out = {"ms": round((time.perf_counter() - t1) * 1000, 1),
                       "create_ms": round((t1 - t) * 1000, 1),
                       "exact": bool(np.array_equal(v2.numpy(), values)
                                     and np.array_equal(a2.numpy(), accum))}
                del v2, a2
            if cmd[0] == "keep":  # a checkpoint left in place for the fresh-process reads
                out["path"] = path
            else:
                shutil.rmtree(d, ignore_errors=True)
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fresh_child(kind: str, where: str, ckpt_id: int) -> None:
    """One restore from nothing in a new process, as a job's start does: ``tf`` makes the
    variables (allocated, zero-filled) and reads ``where`` (a TF checkpoint prefix) into
    them; ``ours`` makes a store and restores checkpoint ``ckpt_id`` under ``where``.
    Imports happen before the clock starts. Prints one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if kind == "tf":
        import tensorflow as tf
        shapes = tf.train.load_checkpoint(where).get_variable_to_shape_map()
        t = time.perf_counter()
        v = tf.Variable(tf.zeros(shapes["emb/.ATTRIBUTES/VARIABLE_VALUE"]))
        a = tf.Variable(tf.zeros(shapes["accum/.ATTRIBUTES/VARIABLE_VALUE"]))
        t1 = time.perf_counter()
        tf.train.Checkpoint(emb=v, accum=a).read(where).assert_consumed()
        t2 = time.perf_counter()
        out = {"ms": round((t2 - t) * 1000, 1), "create_ms": round((t1 - t) * 1000, 1),
               "read_ms": round((t2 - t1) * 1000, 1), "rows": int(v.shape[0])}
    else:
        from checkpoint import restore
        from deeprec_ext.store import EmbeddingStore
        t = time.perf_counter()
        s = EmbeddingStore()
        restore(where, s, upto=ckpt_id, exact=True)
        out = {"ms": round((time.perf_counter() - t) * 1000, 1), "rows": len(s["emb"])}
    print(json.dumps(out), flush=True)


def ps_malloc_env(mb: float) -> dict:
    """The environment that gives a child process the malloc setting
    ``bound_malloc_retention(mb)`` applies in a PS (glibc reads it at the child's start),
    the threshold clamped as the PS clamps it."""
    size = max(128 * 1024, min(int(mb * 2**20), 32 * 2**20))
    return {"MALLOC_MMAP_THRESHOLD_": str(size), "MALLOC_TRIM_THRESHOLD_": str(2 * size)}


def run_fresh(kind: str, where: str, ckpt_id: int = 0, ps_malloc_mb: float | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    if ps_malloc_mb is not None and kind == "ours":  # --ps-malloc: as a PS allocates
        env.update(ps_malloc_env(ps_malloc_mb))
    got = subprocess.run([sys.executable, os.path.abspath(__file__), "--fresh-child", kind,
                          where, str(ckpt_id)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    if got.returncode:
        raise RuntimeError(f"fresh {kind} restore failed: {got.stderr[-2000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


class TF:
    """The TF subprocess (TensorFlow is not imported here)."""

    def __init__(self, data_dir: str):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--tf-child", data_dir], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
        self.info = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the TF subprocess exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ------------------------------------------------------------------------------ our side
def make_table(rows: int, seed: int = 0):
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    t = store.create_table("emb", DIM, initializer={"name": "normal", "stddev": 0.05},
                           optimizer={"name": "adagrad", "learning_rate": 0.05})
    rng = np.random.default_rng(seed)
    keys = rng.integers(-2**63, 2**63 - 1, size=rows, dtype=np.int64)
    for i in range(0, rows, 500_000):
        k = keys[i:i + 500_000]
        t.apply_gradients(k, rng.normal(0, 0.1, (k.size, DIM)).astype(np.float32))
    return store, t, keys


def old_writer_class(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:checkpoint/writer.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_writer.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("checkpoint.old_writer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CheckpointWriter


def _timed_checkpoint(root, ckpt_id, kind, table, writer_cls=None, since=None, **kw) -> dict:
    """Write, commit and run retention as the AIMaster does; the time of each part."""
    from checkpoint import CheckpointWriter, apply_retention
    writer_cls = writer_cls or CheckpointWriter
    t0 = time.perf_counter()
    w = writer_cls(root, ckpt_id, kind, **kw)
    st = w.write_table("ps-0", table, since_seq=since)
    t1 = time.perf_counter()
    m = w.commit()
    t2 = time.perf_counter()
    apply_retention(root, keep_chains=2, verify="new")
    t3 = time.perf_counter()
    return {"ms": (t3 - t0) * 1000, "write_ms": (t1 - t0) * 1000, "commit_ms": (t2 - t1) * 1000,
            "write_commit_ms": (t2 - t0) * 1000,
            "retention_ms": (t3 - t2) * 1000, "bytes": m["totals"]["bytes"],
            "raw_bytes": m["totals"]["raw_bytes"], "rows": st["rows"],
            "cut_seq": st["cut_seq"], "chunks": st["chunks"]}


def full_checkpoint(root, ckpt_id, table, writer_cls=None, **kw) -> dict:
    return _timed_checkpoint(root, ckpt_id, "full", table, writer_cls, **kw)


def incr_checkpoint(root, ckpt_id, parent, since, table) -> dict:
    return _timed_checkpoint(root, ckpt_id, "incr", table, since=since, parent=parent)


def best(runs: list[dict], key: str = "ms") -> dict:
    b = {k: v for k, v in min(runs, key=lambda r: r[key]).items() if k != "exact"}
    b["runs_ms"] = [round(r[key], 1) for r in runs]
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in b.items()}


def under_load(root, ckpt_id, table, keys) -> dict:
    """A full checkpoint while a thread pushes gradients to (and looks up) random rows:
    their latencies during the write, and the peak extra RSS of the checkpoint."""
    rng = np.random.default_rng(5)
    stop = threading.Event()
    lat = {"push": [], "lookup": []}
    gc.collect()
    base = rss()
    peak = [base]

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    def train():
        g = rng.normal(0, 0.1, (1024, DIM)).astype(np.float32)
        while not stop.is_set():
            k = keys[rng.integers(0, keys.size, 1024)]
            t = time.perf_counter()
            table.lookup(k, insert_missing=False)
            lat["lookup"].append(time.perf_counter() - t)
            t = time.perf_counter()
            table.apply_gradients(k, g)
            lat["push"].append(time.perf_counter() - t)
            time.sleep(0.001)

    th = [threading.Thread(target=sample, daemon=True), threading.Thread(target=train,
                                                                         daemon=True)]
    for x in th:
        x.start()
    time.sleep(0.3)
    for v in lat.values():
        v.clear()
    r = full_checkpoint(root, ckpt_id, table)
    n = {k: len(v) for k, v in lat.items()}
    stop.set()
    for x in th:
        x.join()
    out = {"ms": round(r["ms"], 1), "peak_extra_rss_mb": round((peak[0] - base) / 2**20, 1),
           "table_mb": round(table.nbytes / 2**20, 1)}
    for k, v in lat.items():
        ms = np.array(v[:n[k]]) * 1000 if n[k] else np.zeros(1)
        out[k] = {"n": n[k], "p50_ms": round(float(np.percentile(ms, 50)), 2),
                  "p99_ms": round(float(np.percentile(ms, 99)), 2),
                  "max_ms": round(float(ms.max()), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--quick", action="store_true", help="500k rows, 2 reps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--touched", type=float, default=0.05)
    ap.add_argument("--compress", default=None, help="auto | always | never (default: the "
                    "writer's default)")
    ap.add_argument("--baseline", default="381a4c1",
                    help="commit whose writer to time as 'before' ('' to skip)")
    ap.add_argument("--baseline-format", type=int, default=2,
                    help="checkpoint format the --baseline writer writes")
    ap.add_argument("--no-tf", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ps-malloc", type=float, nargs="?", const=-1.0, default=None,
                    metavar="MB", help="apply a PS's malloc setting in this process first "
                    "(deeprec_ext.ps --malloc-mmap-threshold-mb; without MB: the PS's "
                    "default), so our side allocates as it does in a PS (TF's child keeps "
                    "glibc's own policy)")
    ap.add_argument("--tf-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fresh-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tf_child:
        tf_child(args.tf_child)
        return
    if args.fresh_child:
        fresh_child(args.fresh_child[0], args.fresh_child[1], int(args.fresh_child[2]))
        return
    ps_malloc = None
    if args.ps_malloc is not None:
        from deeprec_ext.ps.__main__ import bound_malloc_retention, get_args_parser
        mb = args.ps_malloc if args.ps_malloc >= 0 else \
            float(get_args_parser().parse_args([]).malloc_mmap_threshold_mb)
        if not bound_malloc_retention(mb):
            sys.exit(f"error: --ps-malloc {mb:g}: the malloc setting could not be applied "
                     "(no glibc, or MALLOC_*_/GLIBC_TUNABLES already set)")
        ps_malloc = mb
        print(f"malloc as in a PS: blocks of {mb:g} MB and more mapped on their own",
              flush=True)
    if args.quick:
        args.rows, args.reps = 500_000, 2
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    res = {"rows": args.rows, "dim": DIM, "reps": args.reps, "load_before": uptime(),
           "ps_malloc_mmap_threshold_mb": ps_malloc,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    logical = args.rows * 2 * DIM * 4
    res["logical_mb"] = round(logical / 1e6, 1)
    tf = None
    try:
        t = time.perf_counter()
        store, table, keys = make_table(args.rows)
        print(f"table: {args.rows:,} rows filled in {time.perf_counter() - t:.1f} s; "
              f"load {uptime()}", flush=True)
        if not args.no_tf:
            k, rows, _ = table.export_rows()
            np.save(os.path.join(work, "values.npy"), rows[:, :DIM])
            np.save(os.path.join(work, "accum.npy"), rows[:, DIM:2 * DIM])
            del k, rows
            gc.collect()
            # the 512 MB just saved for TF's child on disk now, not written back by the
            # kernel during the timed rounds (ours ran ~100 ms slower with it pending)
            for f in ("values.npy", "accum.npy"):
                fd = os.open(os.path.join(work, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            tf = TF(work)
            res["tensorflow"] = tf.info["tensorflow"]
        from checkpoint import CheckpointWriter, restore
        from deeprec_ext.store import EmbeddingStore
        kw = {} if args.compress is None else {"compress": args.compress}
        root = os.path.join(work, "ckpt")
        scratch = os.path.join(work, "nosync")
        runs = {k: [] for k in ("tf_write", "tf_write_fsync", "tf_read", "full", "full_nosync",
                                "restore")}
        # alternate: each of ours right after the TF run it is compared with
        for i in range(args.reps):
            if tf:
                runs["tf_write"].append(tf.ask("write 0"))
            t0 = time.perf_counter()
            w = CheckpointWriter(scratch, 1 + i, "full", sync=False, **kw)
            w.write_table("ps-0", table)
            w.commit()
            runs["full_nosync"].append({"ms": (time.perf_counter() - t0) * 1000})
            shutil.rmtree(scratch, ignore_errors=True)
            if tf:
                runs["tf_write_fsync"].append(tf.ask("write 1"))
            runs["full"].append(full_checkpoint(root, 1 + i, table, **kw))
            if tf:
                runs["tf_read"].append(tf.ask("read"))
            gc.collect()
            t = time.perf_counter()
            s2 = EmbeddingStore()
            info = restore(root, s2, upto=1 + i, exact=True)
            runs["restore"].append({"ms": (time.perf_counter() - t) * 1000,
                                    "rows": len(s2["emb"]), "bytes_read": info.bytes_read})
            del s2
            print(f"rep {i + 1}: " + ", ".join(f"{k} {v[-1]['ms']:.0f} ms" for k, v in
                                             runs.items() if v) + f"; load {uptime()}",
                  flush=True)
        if tf:
            kept = tf.ask("keep " + os.path.join(work, "tf-kept"))["path"]
            tf.close()
            tf = None
            # restores from nothing, each in a new process (as a job's start): TF makes its
            # variables and reads; ours makes a store and restores. Alternated.
            fresh = {"tf": [], "ours": []}
            for i in range(args.reps):
                for kind in (("tf", "ours") if i % 2 == 0 else ("ours", "tf")):
                    fresh[kind].append(run_fresh(kind, kept if kind == "tf" else root,
                                                 args.reps, ps_malloc))
                print(f"fresh-process restore {i + 1}: TF {fresh['tf'][-1]['ms']:.0f} ms "
                      f"(made {fresh['tf'][-1]['create_ms']:.0f}, read "
                      f"{fresh['tf'][-1]['read_ms']:.0f}), ours {fresh['ours'][-1]['ms']:.0f} "
                      f"ms; load {uptime()}", flush=True)
            res["fresh_restore"] = {k: best(v) for k, v in fresh.items()}
            res["tf"] = {k: best(runs[k]) for k in ("tf_write", "tf_write_fsync", "tf_read")}
            for r in runs["tf_read"]:
                r["create_read_ms"] = round(r["create_ms"] + r["ms"], 1)
            res["tf"]["tf_create_read"] = best(
                [{"ms": r["create_read_ms"], "create_ms": r["create_ms"]} for r in runs["tf_read"]])
            res["tf"]["bytes"] = runs["tf_write"][0]["bytes"]
            res["tf"]["read_exact"] = all(r["exact"] for r in runs["tf_read"])
        res["full"] = best(runs["full"], "write_commit_ms")
        res["full_nosync"] = best(runs["full_nosync"])
        res["restore"] = best(runs["restore"])
        # incrementals as the AIMaster takes them: a chain on the last full, each after
        # another 5% of the rows were touched
        rng = np.random.default_rng(1)
        parent, since, incrs = args.reps, runs["full"][-1]["cut_seq"], []
        for i in range(args.reps):
            touched = keys[rng.choice(keys.size, int(args.touched * keys.size), replace=False)]
            table.apply_gradients(touched, rng.normal(0, 0.1, (touched.size, DIM))
                                  .astype(np.float32))
            incrs.append(incr_checkpoint(root, 100 + i, parent, since, table))
            parent, since = 100 + i, incrs[-1]["cut_seq"]
        res["incr"] = best(incrs)
        res["incr"]["touched_rows"] = int(touched.size)
        res["full_incl_retention_best_ms"] = round(min(r["ms"] for r in runs["full"]), 1)
        print(f"incr: {res['incr']}", flush=True)
        res["under_training"] = under_load(root, 200, table, keys)
        print(f"full while training: {res['under_training']}", flush=True)
        if args.baseline:
            # the older writer writes the format of its day (2 for 381a4c1; the format
            # module's version is what its headers and manifest take)
            import checkpoint.format as fmt
            current, fmt.FORMAT_VERSION = fmt.FORMAT_VERSION, args.baseline_format
            try:
                cls = old_writer_class(args.baseline)
                olds = [full_checkpoint(root, 300 + i, table, writer_cls=cls)
                        for i in range(args.reps)]
            finally:
                fmt.FORMAT_VERSION = current
            res["baseline"] = best(olds, "write_commit_ms")
            res["baseline"]["commit"] = args.baseline
            print(f"baseline writer ({args.baseline}): {res['baseline']}", flush=True)
    finally:
        if tf:
            tf.close()
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = uptime()
    report(res, logical)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def report(res: dict, logical: int) -> None:
    def mbs(ms):
        return logical / 1e6 / (ms / 1000)

    full, rest, incr = res["full"], res["restore"], res["incr"]
    print()
    print(f"{res['rows']:,} rows x dim {DIM}, Adagrad: {res['logical_mb']} MB of values + "
          f"accumulators; best of {res['reps']}, runs alternated; load {res['load_before']} "
          f"-> {res['load_after']}")
    if res.get("ps_malloc_mmap_threshold_mb") is not None:
        print(f"  our side with a PS's malloc setting (mmap threshold "
              f"{res['ps_malloc_mmap_threshold_mb']:g} MB)")
    lines = [("this format: full write + commit, no fsync", res["full_nosync"]["ms"], None),
             ("this format: full write + commit (fsync)", full["write_commit_ms"],
              full["bytes"]),
             ("  + retention pass (checks the new checkpoint)", full["retention_ms"], None),
             ("this format: restore, whole table", rest["ms"], None)]
    tf = res.get("tf", {})
    if tf:
        lines += [("tf.train.Checkpoint write (no fsync)", tf["tf_write"]["ms"], tf["bytes"]),
                  ("tf.train.Checkpoint write + fsync", tf["tf_write_fsync"]["ms"], tf["bytes"]),
                  ("tf.train.Checkpoint read (into made variables)", tf["tf_read"]["ms"], None),
                  ("tf.train.Checkpoint variables made + read", tf["tf_create_read"]["ms"], None)]
    if "baseline" in res:
        lines.append((f"writer of {res['baseline']['commit']} (before), write + commit",
                      res["baseline"]["write_commit_ms"], res["baseline"]["bytes"]))
    for what, ms, nbytes in lines:
        mb = "" if nbytes is None else f"{nbytes / 1e6:8.1f} MB on disk"
        print(f"  {what:52} {ms:9.1f} ms {mbs(ms):8.0f} MB/s  {mb}")
    if tf:
        print(f"  write ratio, ours / TF MB/s (target >= 0.8): "
              f"{tf['tf_write']['ms'] / res['full_nosync']['ms']:.2f} both without fsync, "
              f"{tf['tf_write_fsync']['ms'] / full['write_commit_ms']:.2f} both with fsync, "
              f"{tf['tf_write']['ms'] / full['write_commit_ms']:.2f} ours with fsync vs TF without")
        print(f"  restore ratio (target >= 0.8): {tf['tf_create_read']['ms'] / rest['ms']:.2f} "
              f"against TF from nothing, as ours (variables made: "
              f"{tf['tf_create_read']['create_ms']:.0f} ms, then read), "
              f"{tf['tf_read']['ms'] / rest['ms']:.2f} against TF's read alone")
        fr = res.get("fresh_restore")
        if fr:
            print(f"  restore from nothing, each in a new process (a job's start): TF "
                  f"{fr['tf']['ms']:.0f} ms (variables made {fr['tf']['create_ms']:.0f}, "
                  f"read {fr['tf']['read_ms']:.0f}), ours {fr['ours']['ms']:.0f} ms: ratio "
                  f"{fr['tf']['ms'] / fr['ours']['ms']:.2f} (best of {res['reps']}; TF "
                  f"{fr['tf']['runs_ms']}, ours {fr['ours']['runs_ms']})")
    fi = res["full_incl_retention_best_ms"]
    print(f"  incremental ({incr['touched_rows']:,} rows touched): {incr['ms']:.1f} ms "
          f"incl. retention ({incr['retention_ms']:.1f} ms), {incr['bytes'] / 1e6:.1f} MB = "
          f"{incr['ms'] / fi:.1%} of the full's time incl. retention ({fi:.0f} ms), "
          f"{incr['bytes'] / full['bytes']:.1%} of its bytes (target <= 10%)")
    u = res["under_training"]
    print(f"  full while training: {u['ms']:.0f} ms; peak extra RSS {u['peak_extra_rss_mb']} MB "
          f"({u['peak_extra_rss_mb'] / u['table_mb']:.1%} of the {u['table_mb']} MB table); "
          f"push p50/p99/max {u['push']['p50_ms']}/{u['push']['p99_ms']}/"
          f"{u['push']['max_ms']} ms over {u['push']['n']} pushes; lookup "
          f"{u['lookup']['p50_ms']}/{u['lookup']['p99_ms']}/{u['lookup']['max_ms']} ms")


if __name__ == "__main__":
    main()
