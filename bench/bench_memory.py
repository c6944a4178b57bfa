"""Tables that stay bounded (issue 17, items 7 and 4): PS memory and rows against samples
seen, with and without admission + eviction, on a stream whose live ids slide; and bytes
per row of a 4M-row table per optimizer.

    .venv/bin/python bench/bench_memory.py                 # 30M id occurrences + per-row
    .venv/bin/python bench/bench_memory.py --quick         # 3M occurrences
    .venv/bin/python bench/bench_memory.py --per-row-only  # only the bytes-per-row part

**Stream.** Each sample names ``--fields`` ids (10): half from a Zipf head of
``--head`` ids (exponent 1.1), half from a sliding tail: tail id ``k`` is live while the
stream is between samples ``k / r`` and ``(k + W) / r`` (``r`` new tail ids per sample,
window ``W`` ids), drawn uniformly among the live ones, and never seen again. ``r`` and
``W`` follow from the run length: each tail id is seen about 8 times, and its life is
1/20 of the run. Each id has a hidden weight (uniform in [-1, 1], a hash of the id); a
sample's label is Bernoulli(sigmoid(sum of its ids' hidden weights)).

**Model.** Logistic regression over one PS embedding table (dim 8, zeros, adagrad):
logit = bias + sum over the sample's ids of the sum of the id's 8 values. Every batch is
a ``PSClient.lookup(insert_missing=True)`` of its distinct ids and a ``push`` of the numpy
gradient; the bias lives in this process. Training AUC is progressive (each batch scored
before its update). Test AUC is measured every record point on held-out samples drawn
from the stream's current window (``insert_missing=False`` lookups, which count nothing),
the same samples for both configurations.

**Configurations**, one PS-only job each (``aimaster run --workers 0``, one PS), one after
the other in this run, on the same stream (same seed):

* ``unbounded`` -- no policy;
* ``bounded`` -- ``admission={"min_count": 2}`` and ``eviction={"steps_to_live": S,
  "interval_seconds": 0.25}``, where ``S`` is ``--ttl-factor`` (6) tail-id lives in pushes
  (450 at 30M occurrences; with 2 or 4 lives the AUC target was missed; a step is a
  push applied to the table on the PS).

Every ``--record-every`` samples: PS RSS (``ps_stats().rss_bytes``), the table's rows and
admission/eviction counters, test AUC. Targets: with eviction the RSS and row curves
flatten (growth over the last third of the run under 10% of the growth over the first
third) and the test AUC (mean over the last third's record points) stays within 0.005 of
the unbounded run's.

**Per row** (after the stream unless ``--no-per-row``; alone with ``--per-row-only``):
for sgd, adagrad and adam, a fresh subprocess builds an ``EmbeddingTable`` (dim 16)
in-process, fills it with ``--per-row-rows`` (4M) random ids
(``lookup(insert_missing=True)`` in batches of 64K) and reads its RSS from
``/proc/self/statm`` before and after: bytes per row = RSS growth / rows, against the
floor ``8 + 4 * dim * (1 + slots)`` (key + value + optimizer slots). It then trains the
table (one ``apply_gradients`` to every row, same batches) and reads RSS again: the
"trained" figure, what a user's table holds. ``--dtype float16``: the same with float16
value storage, against the floor ``8 + 2 * dim + 4 * dim * slots``.
Target: within 1.5x of the floor, filled and trained. The table's own arrays are broken down too.

Results go to ``--out`` (bench/results/memory.json) and the plot to ``--png``
(docs/memory-bounded.png; needs matplotlib: ``pip install -e '.[bench]'``, or
``--no-plot``). The machine is a shared 2-core VM: compare within one run.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

TABLE = "emb"
DIM = 8
OPTIMIZER = {"name": "adagrad", "learning_rate": 0.05}
FLATTEN_LIMIT = 0.10     # last third's growth < 10% of the first third's
AUC_LIMIT = 0.005        # |AUC bounded - AUC unbounded| <= 0.005
PER_ROW_LIMIT = 1.5      # bytes per row <= 1.5x the floor
PER_ROW_DIM = 16
PER_ROW_OPTIMIZERS = ("sgd", "adagrad", "adam")
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 3}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------
# the stream
# ----------------------------------------------------------------------------------------
class Stream:
    """Samples of ``fields`` ids: a Zipf head and a sliding tail (see the module doc)."""

    def __init__(self, samples: int, fields: int, head: int, seed: int,
                 seen_per_tail_id: float = 8.0, life_fraction: float = 0.05):
        self.samples, self.fields, self.head = samples, fields, head
        self.head_fields = fields // 2
        self.tail_fields = fields - self.head_fields
        p = np.arange(1, head + 1, dtype=np.float64) ** -1.1
        self.head_cdf = np.cumsum(p / p.sum())
        # each tail id lives `life` samples and is seen ~seen_per_tail_id times
        self.life = max(1.0, life_fraction * samples)
        self.rate = self.tail_fields / seen_per_tail_id      # new tail ids per sample
        self.window = max(1, int(round(self.rate * self.life)))
        self.tail_ids = int(self.rate * samples) + self.window
        self.seed = seed

    def ids(self, rng: np.random.Generator, start: int, n: int) -> np.ndarray:
        """int64 [n, fields]: the ids of samples [start, start + n)."""
        out = np.empty((n, self.fields), dtype=np.int64)
        u = rng.random((n, self.head_fields))
        out[:, :self.head_fields] = np.minimum(np.searchsorted(self.head_cdf, u),
                                               self.head - 1)
        pos = start + np.arange(n, dtype=np.float64)[:, None]
        lo = pos * self.rate                                    # oldest live tail id
        k = np.floor(lo + rng.random((n, self.tail_fields)) * self.window).astype(np.int64)
        out[:, self.head_fields:] = self.head + k
        return out

    @staticmethod
    def hidden(ids: np.ndarray) -> np.ndarray:
        from deeprec_ext.hashing import hash64
        h = hash64(ids.ravel(), 0x51D).reshape(ids.shape)
        return ((h >> np.uint64(11)).astype(np.float64) / float(1 << 53)) * 2.0 - 1.0

    def labels(self, rng: np.random.Generator, ids: np.ndarray) -> np.ndarray:
        logit = self.hidden(ids).sum(axis=1)
        return (rng.random(ids.shape[0]) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float64)


def auc(y: np.ndarray, s: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half)."""
    y = np.asarray(y) > 0.5
    npos = int(y.sum())
    nneg = y.size - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(y.size, dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    return float((ranks[y].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


# ----------------------------------------------------------------------------------------
# one configuration
# ----------------------------------------------------------------------------------------
def table_stats(client) -> dict:
    client.refresh_routing()
    out = {"rss_bytes": 0, "rows": 0, "bytes": 0, "admitted": 0, "rejected": 0,
           "candidates": 0, "evicted": 0, "dropped": 0}
    for s in client.ps_stats():
        out["rss_bytes"] += int(s.rss_bytes)
        for t in s.tables:
            if t.name == TABLE:
                for key in ("rows", "bytes", "admitted", "rejected", "candidates",
                            "evicted", "dropped"):
                    out[key] += int(getattr(t, key))
    return out


def score(client, ids: np.ndarray, bias: float, train: bool):
    """(logits [n], distinct ids, inverse) of samples ``ids`` [n, fields]."""
    u, inv = np.unique(ids, return_inverse=True)
    vals = client.lookup(TABLE, u, insert_missing=train, unique=True)
    per_id = vals.sum(axis=1, dtype=np.float64)
    return bias + per_id[inv.reshape(ids.shape)].sum(axis=1), u, inv.reshape(-1)


def run_config(name: str, stream: Stream, args, admission, eviction) -> dict:
    from bench.bench_migration import PsJob

    from deeprec_ext import PSClient
    state_dir = os.path.join(REPO, "runs", f"bench-memory{args.tag}-{name}")
    log(f"[{name}] admission={admission} eviction={eviction}")
    job = PsJob(state_dir, f"bench-memory-{name}", start_timeout=120,
                job_overrides={"ps": {"replicas": 1, "max_replicas": 1}})
    points = []
    try:
        client = PSClient.connect(job.address, timeout=60)
        client.create_table(TABLE, DIM, initializer="zeros", optimizer=OPTIMIZER,
                            admission=admission, eviction=eviction)
        rng = np.random.default_rng(stream.seed)
        bias, bias_lr = 0.0, 0.5
        third = stream.samples / 3.0
        thirds_y = [[], [], []]
        thirds_s = [[], [], []]

        def record(seen: int, t_train: float):
            st = table_stats(client)
            # held-out samples from the current window: the same for every configuration
            trng = np.random.default_rng([stream.seed, 7, seen])
            at = max(0, seen - args.batch)
            tids = stream.ids(trng, at, args.test_samples)
            ty = stream.labels(trng, tids)
            ts, _, _ = score(client, tids, bias, train=False)
            st.update(samples=seen, test_auc=auc(ty, ts), train_seconds=round(t_train, 1))
            points.append(st)
            log(f"[{name}] {seen:>10,} samples  rss {st['rss_bytes'] / 2**20:8.1f} MB  "
                f"rows {st['rows']:>10,}  evicted {st['evicted']:>10,}  "
                f"test auc {st['test_auc']:.4f}  ({t_train:.0f}s)")

        record(0, 0.0)
        seen, t_train, next_rec = 0, 0.0, args.record_every
        while seen < stream.samples:
            n = min(args.batch, stream.samples - seen)
            t0 = time.monotonic()
            ids = stream.ids(rng, seen, n)
            y = stream.labels(rng, ids)
            logit, u, inv = score(client, ids, bias, train=True)
            p = 1.0 / (1.0 + np.exp(-logit))
            g = p - y
            gid = np.bincount(inv, weights=np.repeat(g, stream.fields), minlength=u.size)
            client.push(TABLE, u, np.repeat(gid.astype(np.float32)[:, None], DIM, axis=1),
                        unique=True)
            bias -= bias_lr * float(g.mean())
            t_train += time.monotonic() - t0
            k = min(2, int(seen // third))
            thirds_y[k].append(y)
            thirds_s[k].append(logit)
            seen += n
            if seen >= next_rec or seen >= stream.samples:
                record(seen, t_train)
                next_rec += args.record_every
        train = {f"third_{i + 1}": auc(np.concatenate(thirds_y[i]), np.concatenate(thirds_s[i]))
                 for i in range(3) if thirds_y[i]}
        train["all"] = auc(np.concatenate([a for t in thirds_y for a in t]),
                           np.concatenate([a for t in thirds_s for a in t]))
        client.close()
    finally:
        job.stop()
    return {"admission": admission, "eviction": eviction, "points": points,
            "train_auc": train, "train_seconds": round(t_train, 1)}


def at_samples(points: list, key: str, s: float) -> float:
    xs = np.array([p["samples"] for p in points], dtype=np.float64)
    ys = np.array([p[key] for p in points], dtype=np.float64)
    return float(np.interp(s, xs, ys))


def growth(points: list, key: str, total: int) -> tuple[float, float, float]:
    """(growth over the first third, over the last third, ratio)."""
    first = at_samples(points, key, total / 3) - at_samples(points, key, 0)
    last = at_samples(points, key, total) - at_samples(points, key, 2 * total / 3)
    return first, last, (last / first if first > 0 else float("inf"))


def last_third_auc(points: list, total: int) -> float:
    v = [p["test_auc"] for p in points if p["samples"] >= 2 * total / 3 and p["samples"] > 0]
    return float(np.mean(v))


def plot(results: dict, png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, style in (("unbounded", "-"), ("bounded", "-")):
        pts = results[name]["points"]
        x = np.array([p["samples"] for p in pts]) / 1e6
        label = name if name == "unbounded" else "admission + eviction"
        axes[0].plot(x, [p["rss_bytes"] / 2**20 for p in pts], style, label=label)
        axes[1].plot(x, [p["rows"] / 1e3 for p in pts], style, label=label)
        axes[2].plot(x[1:], [p["test_auc"] for p in pts[1:]], style, label=label)
    for ax, yl in zip(axes, ("PS RSS (MB)", "table rows (thousands)", "test AUC (recent window)")):
        ax.set_xlabel("samples seen (millions)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def stream_bench(args) -> dict:
    samples = args.occurrences // args.fields
    stream = Stream(samples, args.fields, args.head, args.seed)
    if args.record_every <= 0:
        args.record_every = max(args.batch, samples // 45 // args.batch * args.batch)
    life_steps = stream.life / args.batch
    stl = max(20, int(round(args.ttl_factor * life_steps)))
    log(f"stream: {args.occurrences:,} id occurrences = {samples:,} samples x {args.fields} "
        f"ids; head {args.head:,} (Zipf 1.1), tail {stream.tail_ids:,} ids, window "
        f"{stream.window:,} ids, each live {stream.life:,.0f} samples "
        f"({life_steps:.0f} pushes of {args.batch}); steps_to_live {stl}")
    results = {"unbounded": run_config("unbounded", stream, args, None, None),
               "bounded": run_config("bounded", stream, args,
                                     {"min_count": args.min_count} if args.min_count else None,
                                     {"steps_to_live": stl, "interval_seconds": 0.25})}
    summary = {}
    for name, r in results.items():
        pts = r["points"]
        rss = growth(pts, "rss_bytes", samples)
        rows = growth(pts, "rows", samples)
        summary[name] = {
            "rss_first_third_mb": rss[0] / 2**20, "rss_last_third_mb": rss[1] / 2**20,
            "rss_ratio": rss[2], "rows_first_third": rows[0], "rows_last_third": rows[1],
            "rows_ratio": rows[2], "final_rss_mb": pts[-1]["rss_bytes"] / 2**20,
            "final_rows": pts[-1]["rows"], "test_auc_last_third": last_third_auc(pts, samples),
            "test_auc_final": pts[-1]["test_auc"], "train_auc": r["train_auc"],
            "train_seconds": r["train_seconds"]}
    u, b = summary["unbounded"], summary["bounded"]
    log("")
    log(f"{'':32}{'unbounded':>14}{'adm+evict':>14}")
    rowsfmt = [("final PS RSS (MB)", "final_rss_mb", "{:.1f}"),
               ("final rows", "final_rows", "{:,}"),
               ("RSS growth 1st third (MB)", "rss_first_third_mb", "{:.1f}"),
               ("RSS growth last third (MB)", "rss_last_third_mb", "{:.1f}"),
               ("RSS last/first third", "rss_ratio", "{:.3f}"),
               ("rows growth 1st third", "rows_first_third", "{:,.0f}"),
               ("rows growth last third", "rows_last_third", "{:,.0f}"),
               ("rows last/first third", "rows_ratio", "{:.3f}"),
               ("test AUC (last third mean)", "test_auc_last_third", "{:.4f}"),
               ("test AUC (final)", "test_auc_final", "{:.4f}"),
               ("train seconds", "train_seconds", "{:.0f}")]
    for label, key, fmt in rowsfmt:
        log(f"{label:32}{fmt.format(u[key]):>14}{fmt.format(b[key]):>14}")
    for k in ("third_1", "third_2", "third_3", "all"):
        log(f"{'train AUC ' + k:32}{u['train_auc'][k]:>14.4f}{b['train_auc'][k]:>14.4f}")
    flat = b["rss_ratio"] < FLATTEN_LIMIT and b["rows_ratio"] < FLATTEN_LIMIT
    dauc = b["test_auc_last_third"] - u["test_auc_last_third"]
    log(f"{'PASS' if flat else 'MISS'}: with eviction the curves flatten: last third's growth "
        f"/ first third's = RSS {b['rss_ratio']:.3f}, rows {b['rows_ratio']:.3f} "
        f"(target < {FLATTEN_LIMIT})")
    log(f"{'PASS' if abs(dauc) <= AUC_LIMIT else 'MISS'}: test AUC bounded - unbounded = "
        f"{dauc:+.4f} (last-third mean {b['test_auc_last_third']:.4f} vs "
        f"{u['test_auc_last_third']:.4f}; target within {AUC_LIMIT})")
    if args.png:
        plot(results, args.png, f"{args.occurrences / 1e6:g}M id occurrences, "
             f"sliding tail (window {stream.window:,} ids), adagrad dim {DIM}: "
             f"min_count {args.min_count}, steps_to_live {stl}")
        log(f"plot: {args.png}")
    return {"stream": {"occurrences": args.occurrences, "samples": samples,
                       "fields": args.fields, "head": args.head, "tail_ids": stream.tail_ids,
                       "window": stream.window, "life_samples": stream.life,
                       "batch": args.batch, "test_samples": args.test_samples,
                       "steps_to_live": stl, "min_count": args.min_count,
                       "optimizer": OPTIMIZER, "dim": DIM},
            "configs": results, "summary": summary,
            "targets": {"flatten_pass": bool(flat), "auc_delta": dauc,
                        "auc_pass": bool(abs(dauc) <= AUC_LIMIT)}}


# ----------------------------------------------------------------------------------------
# bytes per row
# ----------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def per_row_floor(optimizer: str, dtype: str = "float32") -> int:
    """key + value + optimizer slots; float16 storage halves the value part only."""
    value = (2 if dtype == "float16" else 4) * PER_ROW_DIM
    return 8 + value + 4 * PER_ROW_DIM * SLOTS[optimizer]


def per_row_child(optimizer: str, rows: int, dtype: str = "float32") -> dict:
    from deeprec_ext.store.table import EmbeddingTable
    t = EmbeddingTable("t", PER_ROW_DIM, "zeros", optimizer, dtype=dtype)
    rng = np.random.default_rng(5)
    batch = 1 << 16
    t.lookup(rng.integers(-2**63, 2**63 - 1, 16, dtype=np.int64))  # warm the code paths
    gc.collect()
    before = rss_bytes()
    t0 = time.monotonic()
    sizes = []
    while t.size < rows:
        n = min(batch, rows - t.size)
        sizes.append(n)
        t.lookup(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64), insert_missing=True)
    seconds = time.monotonic() - t0
    gc.collect()
    after = rss_bytes()
    # Then train it: one push to every row (the same ids again, same generator), which
    # is what a user's table sees; scratch state written by pushes shows up here.
    rng = np.random.default_rng(5)
    rng.integers(-2**63, 2**63 - 1, 16, dtype=np.int64)
    grads = np.full((batch, PER_ROW_DIM), 0.01, dtype=np.float32)
    t0 = time.monotonic()
    for n in sizes:
        t.apply_gradients(rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64), grads[:n])
    push_seconds = time.monotonic() - t0
    del grads
    gc.collect()
    trained = rss_bytes()
    idx = t._index
    arrays = {"arena": t._arena.nbytes, "row_seq": t._row_seq.nbytes,
              "row_key": t._row_key.nbytes, "row_count": t._row_count.nbytes,
              "free": t._free.nbytes, "index": idx.nbytes}
    return {"optimizer": optimizer, "dtype": dtype, "rows": int(t.size), "rss_before": before,
            "rss_after": after, "rss_trained": trained, "fill_seconds": round(seconds, 1),
            "push_seconds": round(push_seconds, 1),
            "arena_capacity": int(t._arena.shape[0]), "index_capacity": int(idx.capacity)
            if hasattr(idx, "capacity") else None, "table_nbytes": int(t.nbytes),
            "arrays_bytes": {k: int(v) for k, v in arrays.items()}}


def per_row_bench(args) -> dict:
    out = {}
    log(f"bytes per row: {args.per_row_rows:,} rows, dim {PER_ROW_DIM}, {args.dtype} values, "
        f"one subprocess per optimizer")
    log(f"{'optimizer':10}{'floor B':>9}{'RSS B/row':>11}{'x floor':>9}{'trained':>11}"
        f"{'x floor':>9}{'arrays B/row':>14}{'fill s':>8}")
    for opt in PER_ROW_OPTIMIZERS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--per-row-child", opt,
                            "--per-row-rows", str(args.per_row_rows), "--dtype", args.dtype],
                           cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                           text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"per-row child {opt} exited {r.returncode}: {r.stderr[-2000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        floor = per_row_floor(opt, args.dtype)
        per_row = (res["rss_after"] - res["rss_before"]) / res["rows"]
        trained = (res["rss_trained"] - res["rss_before"]) / res["rows"]
        res.update(floor_bytes=floor, bytes_per_row=per_row, ratio=per_row / floor,
                   bytes_per_row_trained=trained, ratio_trained=trained / floor,
                   arrays_per_row={k: v / res["rows"] for k, v in res["arrays_bytes"].items()},
                   passed=max(per_row, trained) / floor <= PER_ROW_LIMIT)
        out[opt] = res
        log(f"{opt:10}{floor:>9}{per_row:>11.1f}{per_row / floor:>9.2f}"
            f"{trained:>11.1f}{trained / floor:>9.2f}"
            f"{res['table_nbytes'] / res['rows']:>14.1f}{res['fill_seconds']:>8.1f}")
    for opt, res in out.items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in res["arrays_per_row"].items())
        log(f"  {opt}: allocated arrays per row: {parts} (arena capacity "
            f"{res['arena_capacity']:,}, index capacity {res['index_capacity']:,})")
    for opt, res in out.items():
        log(f"{'PASS' if res['passed'] else 'MISS'}: {opt} {res['bytes_per_row']:.1f} B/row = "
            f"{res['ratio']:.2f}x the floor {res['floor_bytes']} B, trained "
            f"{res['bytes_per_row_trained']:.1f} B/row = {res['ratio_trained']:.2f}x "
            f"(target <= {PER_ROW_LIMIT}x)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--occurrences", type=int, default=30_000_000, help="id occurrences")
    ap.add_argument("--quick", action="store_true", help="3M occurrences, 1M rows per-row")
    ap.add_argument("--fields", type=int, default=10, help="ids per sample")
    ap.add_argument("--head", type=int, default=200_000, help="Zipf head ids")
    ap.add_argument("--batch", type=int, default=2000, help="samples per push")
    ap.add_argument("--test-samples", type=int, default=20_000)
    ap.add_argument("--record-every", type=int, default=0,
                    help="samples between records (default: about 45 records)")
    ap.add_argument("--min-count", type=int, default=2,
                    help="admission min_count (0: no admission, eviction only)")
    ap.add_argument("--ttl-factor", type=float, default=6.0,
                    help="eviction steps_to_live in tail-id lives (pushes)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--tag", default="", help="suffix of the jobs' state dirs (runs/)")
    ap.add_argument("--per-row-rows", type=int, default=4_000_000)
    ap.add_argument("--per-row-only", action="store_true")
    ap.add_argument("--no-per-row", action="store_true")
    ap.add_argument("--per-row-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                    help="value storage of the per-row tables (the floor follows it)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "memory.json"))
    ap.add_argument("--png", default=os.path.join(REPO, "docs", "memory-bounded.png"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if args.per_row_child:
        print(json.dumps(per_row_child(args.per_row_child, args.per_row_rows, args.dtype)))
        return 0
    if args.quick:
        if args.occurrences == ap.get_default("occurrences"):
            args.occurrences = 3_000_000
        if args.per_row_rows == ap.get_default("per_row_rows"):
            args.per_row_rows = 1_000_000
    if args.no_plot:
        args.png = None
    elif not args.per_row_only:
        try:
            have_plot = importlib.util.find_spec("matplotlib") is not None
        except (ImportError, ValueError):
            have_plot = False
        if not have_plot:
            log("matplotlib is not installed, so the plot cannot be drawn: install it with "
                "`pip install -e '.[bench]'` (or 'matplotlib>=3.8,<4'), or pass --no-plot")
            return 2
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "loadavg": os.getloadavg()}}
    if not args.per_row_only:
        result["stream"] = stream_bench(args)
    if not args.no_per_row:
        log("")
        result["per_row"] = per_row_bench(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    log(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
