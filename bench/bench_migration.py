"""Live PS scale-out / scale-in under a training load (issue 3): stall, migration speed and
training throughput while slots move, for several table sizes, all measured in ONE run.

    .venv/bin/python bench/bench_migration.py [--rows 100000,1000000,4000000] \
        [--out bench/results/migration.json]

For each table size:

1. ``aimaster run JOB.yaml --workers 0`` as a subprocess in its own process group: a
   PS-only job with ``ps.replicas: 2``, ``ps.max_replicas: 3``, state dir
   ``runs/bench-migration-<rows>/`` (wiped first).
2. ``PSClient.create_table("emb", dim=16, optimizer adagrad)`` and fill it with ``rows``
   distinct ids spread over the whole int64 range (``PSClient.lookup`` of batches of
   ``--fill-batch`` ids with ``insert_missing=True``).
3. A "training" load in a background thread of this process, with its own ``PSClient``:
   every step looks up, then pushes, ``--batch`` (4096) ids drawn uniformly from the
   existing ids, the stand-in for one worker's step. Each step's start, end and the
   client's stall (``take_max_stall_ms``) and stale-routing retries are recorded.
4. Steady state for ``--steady`` s, then ``aimaster scale --ps 3`` (blocking; the printed
   JSON event is parsed), ``--steady`` s of steady state with 3 PS, ``aimaster scale --ps
   2``, and ``--steady`` s more (informational).
5. The job is always stopped (SIGTERM to the AIMaster's process group, SIGKILL after a
   grace period, then any PS still alive is killed by pid), even on errors.

Per size and direction it reports: the event's ``duration_ms``, ``fence_ms`` and
``max_stall_ms``; the load thread's longest step overlapping the event and its longest
re-routing stall; moved rows and MB; migrated MB/s (``moved_bytes / duration``); and the
throughput during the event, ``steps completed in [event start, event end] / duration``
(a step straddling an edge counts for its fraction inside) divided by the steady steps/s
measured just before the event.

The event's window is placed on this process's clock with its wall-clock ``time`` (same
machine). Its phases come from the job state's events: new PS registered (scale-out),
``routing`` published (the fence window is the ``fence_ms`` before it), clean-up
(``DropSlots``, stopping leaving PS). (The event no longer waits for worker stall reports:
they amend the recorded event when they arrive.) Throughput and the
longest step are also given per phase. The fence window is split further with the PS logs' ``routing epoch`` lines
(SetRouting to the old PS, last-delta round, SetRouting to the new layout, publish), and
the CPU seconds of every job process during the scale call are read from ``/proc``.

``--no-breakdown`` skips the in-process cost breakdown that follows the runs: for each
size, one source PS's share of the table is built in this process and the steps of one
migration pair are timed without gRPC or contention (``export_slots`` snapshot scan,
protobuf encode/decode of the row batches, ``import_rows`` on the destination, an empty
catch-up scan, ``DropSlots``'s ``keys_in_slots`` + ``delete``), to show where the time
goes.

``--profile`` attaches ``py-spy record`` (non-blocking, 200 Hz) to every PS during each
scale call, including the PS that joins, and stores busy CPU seconds and the top functions
per PS in the results (``py-spy-*.txt`` in the state dir). It perturbs the timings: run it
separately (e.g. ``--rows 4000000 --profile --out bench/results/migration-profile.json``)
and use it for shares, not for the figures. Its state dirs are
``runs/bench-migration-profile-<rows>/``.

The machine is a shared 2-core VM: compare ratios within one run, not absolute numbers
between runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from deeprec_ext import PSClient  # noqa: E402

TABLE = "emb"
DIM = 16
OPTIMIZER = {"name": "adagrad", "learning_rate": 0.05}
INITIALIZER = {"name": "normal", "seed": 1}
HEARTBEAT_SECONDS = 1.0          # job default
STALL_TARGET_MS = 200.0
THROUGHPUT_TARGET = 0.70
LONGEST_STEP_LIMIT = 2.0         # longest step during the event <= 2x the steady p99
STALL_GROWTH_LIMIT = 2.0         # "not growing": largest size <= 2x the smallest size


def log(msg: str) -> None:
    print(msg, flush=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------------------
# the job
# ----------------------------------------------------------------------------------------
class PsJob:
    """``aimaster run JOB.yaml --workers 0`` in its own process group."""

    def __init__(self, state_dir: str, name: str, start_timeout: float,
                 job_overrides: dict | None = None):
        shutil.rmtree(state_dir, ignore_errors=True)  # a stale master.addr would mislead us
        os.makedirs(state_dir)
        self.state_dir = state_dir
        self.job_file = os.path.join(state_dir, "job.yaml")
        job = {"name": name, "ps": {"replicas": 2, "max_replicas": 3},
               "master": {"state_dir": state_dir, "heartbeat_seconds": HEARTBEAT_SECONDS}}
        job.update(job_overrides or {})
        with open(self.job_file, "w") as f:
            yaml.safe_dump(job, f)
        self.log_path = os.path.join(state_dir, "aimaster.log")
        self._log = open(self.log_path, "wb")
        self.pids: set[int] = set()
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aimaster.cli", "run", self.job_file, "--workers", "0"],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        addr_file = os.path.join(state_dir, "master.addr")
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"aimaster exited with {self.proc.returncode}: {self.tail()}")
                if os.path.exists(addr_file):
                    with open(addr_file) as f:
                        self.address = f.read().strip()
                    if self.address:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no master.addr after {start_timeout}s: {self.tail()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()  # the caller never gets this object: do not leak the job
            raise

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def state(self) -> dict:
        from aimaster.state import load_state
        state = load_state(self.state_dir)
        if state is None:
            raise FileNotFoundError(f"no job state in {self.state_dir}")
        return state

    def remember_pids(self) -> None:
        try:
            self.pids |= {m["pid"] for m in self.state()["members"]
                          if m.get("pid") and m["pid"] != os.getpid()}
        except (OSError, ValueError, KeyError):
            pass

    def stop(self) -> None:
        self.remember_pids()
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()
        # PS get SIGTERM from the AIMaster (and PDEATHSIG); make sure none outlives it
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids):
            time.sleep(0.1)
        for p in self.pids:
            if pid_alive(p):
                log(f"  killing leftover PS pid {p}")
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def aimaster_exe() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "aimaster")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "aimaster.cli"]


def run_scale(job: PsJob, ps: int, timeout: float) -> tuple[dict, float, float]:
    """``aimaster scale --ps N``; returns (event, call start, call end) on our monotonic clock."""
    t0 = time.monotonic()
    r = subprocess.run([*aimaster_exe(), "scale", "--master", job.address, "--ps", str(ps),
                        "--timeout", str(timeout)], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout + 60, env=dict(os.environ, PYTHONPATH=REPO),
                       stdin=subprocess.DEVNULL)
    t1 = time.monotonic()
    if r.returncode != 0:
        raise RuntimeError(f"aimaster scale --ps {ps} exited {r.returncode}: {r.stderr.strip()}")
    event = json.loads(r.stdout.strip().splitlines()[-1])
    return event, t0, t1


class Profiler:
    """``--profile``: py-spy (raw collapsed stacks, non-blocking) on every PS during one scale
    call, including a PS that registers during it. Perturbs the timings: use it for shares."""

    def __init__(self, job: "PsJob", tag: str, rate_hz: int = 200):
        self.exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
        self.job, self.tag, self.rate = job, tag, rate_hz
        self.procs: dict[str, tuple[subprocess.Popen, str]] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _attach(self) -> None:
        try:
            members = self.job.state()["members"]
        except (OSError, ValueError, KeyError):
            return
        for m in members:
            if m["role"] == "ps" and m["state"] == "running" and m["id"] not in self.procs \
                    and m.get("pid") and pid_alive(m["pid"]):
                out = os.path.join(self.job.state_dir, f"py-spy-{self.tag}-{m['id']}.txt")
                self.procs[m["id"]] = (subprocess.Popen(
                    [self.exe, "record", "--pid", str(m["pid"]), "--format", "raw", "--rate",
                     str(self.rate), "--nonblocking", "--threads", "--idle", "--output", out],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)

    def _watch(self) -> None:
        while not self.stop_event.is_set():
            self._attach()
            self.stop_event.wait(0.05)

    def __enter__(self):
        if os.path.exists(self.exe):
            self._attach()
            self.thread.start()
            time.sleep(0.5)  # py-spy needs a moment to attach
        else:
            log("  (py-spy not installed: no profile)")
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(5)
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc, _ in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def summary(self) -> dict:
        return {ps: summarize_py_spy(out, self.rate) for ps, (_, out) in sorted(self.procs.items())
                if os.path.exists(out)}


FOCUS = ("ParameterServerServicer.Lookup", "ParameterServerServicer.Push",
         "ParameterServerServicer.MigrateSlots", "EmbeddingTable.export_slots",
         "_consume_request_iterator.<locals>.consume_request_iterator", "serialize",
         "ParameterServerServicer.ImportRows", "EmbeddingTable.import_rows", "HashIndex._rehash",
         "EmbeddingTable._grow_arena", "ParameterServerServicer.DropSlots",
         "EmbeddingTable.keys_in_slots", "EmbeddingTable.delete", "ParameterServerServicer.SetRouting")


def summarize_py_spy(path: str, rate_hz: int, top: int = 14) -> dict:
    """Busy CPU seconds and inclusive share per function, from ``py-spy --format raw``
    (threads parked in gRPC polls / pool queues are idle and skipped)."""
    import collections
    import re
    incl, total = collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")[1:]
            last = frames[-1] if frames else ""
            if re.search(r"^(_serve|_status|_worker|channel_spin|_run_channel_spin_thread|"
                         r"Condition.wait|_wait_once|wait|select|poll|_poll|Event.wait) ", last):
                continue
            n = int(n)
            total += n
            for name in {re.sub(r" \(.*$", "", fr) for fr in frames}:
                incl[name] += n
    focus = {k: round(100.0 * incl[k] / max(total, 1), 1) for k in FOCUS if incl[k]}
    keep = [(k, c) for k, c in incl.most_common()
            if not k.startswith(("Thread.", "_bootstrap", "<module>", "_worker", "_WorkItem",
                                 "_call_behavior", "_unary_response_in_pool"))]
    return {"busy_s": round(total / rate_hz, 2), "focus_pct": focus,
            "top_inclusive_pct": [(k, round(100.0 * c / max(total, 1), 1)) for k, c in keep[:top]]}


# ----------------------------------------------------------------------------------------
# the training load
# ----------------------------------------------------------------------------------------
class Load(threading.Thread):
    """lookup + push of ``batch`` random existing ids per step, as fast as it can."""

    def __init__(self, address: str, ids: np.ndarray, batch: int, seed: int):
        super().__init__(daemon=True, name="load")
        self.address, self.ids, self.batch, self.seed = address, ids, batch, seed
        self.stop_event = threading.Event()
        self.started = threading.Event()
        # (start, lookup end, end, stall_ms, stale retries, unavailable retries)
        self.steps: list[tuple] = []
        self.reroutes: list[tuple[float, dict]] = []  # (step start, client.last_reroute)
        self.error: str | None = None

    def run(self) -> None:
        client = None
        try:
            client = PSClient.connect(self.address, timeout=60)
            rng = np.random.default_rng(self.seed)
            grads = (rng.standard_normal((self.batch, DIM)) * 0.01).astype(np.float32)
            stale = unavail = 0
            self.started.set()
            while not self.stop_event.is_set():
                sel = self.ids[rng.integers(0, self.ids.size, self.batch)]
                t0 = time.monotonic()
                client.lookup(TABLE, sel, insert_missing=True)
                t1 = time.monotonic()
                client.push(TABLE, sel, grads)
                t2 = time.monotonic()
                s, u = client.stats["stale_retries"], client.stats["unavailable_retries"]
                self.steps.append((t0, t1, t2, client.take_max_stall_ms(), s - stale, u - unavail))
                if (s != stale or u != unavail) and client.last_reroute is not None:
                    self.reroutes.append((t0, dict(client.last_reroute)))
                stale, unavail = s, u
        except Exception:  # noqa: BLE001 - reported in the results
            self.error = traceback.format_exc()
            log(f"  load thread failed:\n{self.error}")
        finally:
            self.started.set()
            if client is not None:
                client.close()

    def snapshot(self) -> np.ndarray:
        return np.array(self.steps[:len(self.steps)], dtype=np.float64).reshape(-1, 6)


def rate(steps: np.ndarray, a: float, b: float) -> float:
    """Steps per second in [a, b]. A step that straddles a window edge counts for the
    fraction of its duration inside the window, so short windows are not quantized."""
    if b <= a:
        return float("nan")
    s, e = steps[:, 0], steps[:, 2]
    inside = np.clip(np.minimum(e, b) - np.maximum(s, a), 0, None)
    return float((inside / np.maximum(e - s, 1e-9)).sum()) / (b - a)


def cpu_seconds(pids) -> dict:
    """utime + stime of each live pid, in seconds (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def overlapping(steps: np.ndarray, a: float, b: float) -> np.ndarray:
    return steps[(steps[:, 0] < b) & (steps[:, 2] > a)]


def window_stats(steps: np.ndarray, a: float, b: float, steady: float) -> dict:
    ov = overlapping(steps, a, b)
    dur = (ov[:, 2] - ov[:, 0]) * 1000 if len(ov) else np.zeros(0)
    r = rate(steps, a, b)
    return {"ms": round((b - a) * 1000, 1), "steps_per_s": round(r, 2),
            "vs_steady": round(r / steady, 3) if steady else None,
            "longest_step_ms": round(float(dur.max()), 1) if dur.size else None,
            "p50_step_ms": round(float(np.median(dur)), 1) if dur.size else None,
            "client_stall_ms": round(float(ov[:, 3].max()), 1) if len(ov) else 0.0,
            "stale_retries": int(ov[:, 4].sum()) if len(ov) else 0}


def steady_stats(steps: np.ndarray, a: float, b: float) -> dict:
    done = steps[(steps[:, 2] >= a) & (steps[:, 2] <= b)]
    dur = (done[:, 2] - done[:, 0]) * 1000
    return {"steps_per_s": round(rate(steps, a, b), 2), "window_s": round(b - a, 2),
            "p50_step_ms": round(float(np.median(dur)), 1) if dur.size else None,
            "p99_step_ms": round(float(np.percentile(dur, 99)), 1) if dur.size else None,
            "max_step_ms": round(float(dur.max()), 1) if dur.size else None,
            "lookup_ms": round(float(np.median(done[:, 1] - done[:, 0]) * 1000), 1) if dur.size else None,
            "push_ms": round(float(np.median(done[:, 2] - done[:, 1]) * 1000), 1) if dur.size else None}


def routing_log_times(state_dir: str, epoch: int) -> list[float]:
    """Wall-clock times (ms resolution) at which PS logged ``routing epoch <epoch>``, sorted."""
    import glob
    import re
    pat = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* routing epoch (\d+),")
    times = []
    for path in glob.glob(os.path.join(state_dir, "logs", "ps-*.log")):
        with open(path, errors="replace") as f:
            for line in f:
                m = pat.match(line)
                if m and int(m.group(3)) == epoch:
                    t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                    times.append(t + int(m.group(2)) / 1000)
    return sorted(times)


def fence_breakdown(state_dir: str, event: dict, publish_wall: float | None) -> dict | None:
    """Split the fence window with the PS logs: SetRouting to every old PS (the fence),
    the last-delta round, SetRouting to every new-layout PS (hand-over), then publish."""
    n_old, n_new = event["ps"]
    times = routing_log_times(state_dir, event.get("epoch", -1))
    if len(times) < n_old + n_new or publish_wall is None:
        return None
    old, new = times[:n_old], times[n_old:n_old + n_new]
    ms = lambda a, b: round((b - a) * 1000, 1)  # noqa: E731
    # fence_ms ends after publish() saved the job state (fsync) while the routing event is
    # stamped before that save, so this first part also holds the save's duration
    return {"to_first_setrouting_plus_state_save_ms": ms(publish_wall - event["fence_ms"] / 1000,
                                                         old[0]),
            "fence_setrouting_ms": ms(old[0], old[-1]),
            "last_delta_round_ms": ms(old[-1], new[0]),
            "handover_setrouting_ms": ms(new[0], new[-1]),
            "publish_ms": ms(new[-1], publish_wall),
            "note": "PS log timestamps have 1 ms resolution"}


def analyze_event(event: dict, state: dict, steps: np.ndarray, steady: float,
                  wall_minus_mono: float, call: tuple[float, float], ps_before: list[str],
                  state_dir: str, steady_p99_ms: float | None = None) -> dict:
    start = event["time"] - wall_minus_mono
    end = start + event["duration_ms"] / 1000
    events = state.get("events", [])
    publish_wall = next((e["time"] for e in events
                         if e["kind"] == "routing" and e.get("epoch") == event.get("epoch")), None)
    publish = None if publish_wall is None else publish_wall - wall_minus_mono
    registered = [e["time"] - wall_minus_mono for e in events
                  if e["kind"] == "register" and e.get("role") == "ps"
                  and e.get("id") not in ps_before and e["time"] >= event["time"]]
    phases = {}
    copy_start = start
    if registered:
        copy_start = max(registered)
        phases["start_new_ps"] = (start, copy_start)
    if publish is not None:
        fence_start = publish - event.get("fence_ms", 0.0) / 1000
        phases["snapshot_catchup"] = (copy_start, fence_start)
        # the migration's own laps (AIMaster side): the catch-up rounds end at the fence
        laps = event.get("phases_ms") or {}
        if "catchup" in laps:
            catchup_start = max(copy_start, fence_start - laps["catchup"] / 1000)
            phases["snapshot"] = (copy_start, catchup_start)
            phases["catchup"] = (catchup_start, fence_start)
            # each catch-up round (the AIMaster's round_ms: snapshot, catch-ups, last),
            # back to back up to the fence; which round a long step fell in
            rms = (event.get("round_ms") or [])[1:-1]
            t = fence_start - sum(rms) / 1000
            for k, r in enumerate(rms, 1):
                phases[f"catchup_{k}"] = (max(t, catchup_start), t + r / 1000)
                t += r / 1000
        phases["fence"] = (fence_start, publish)
        phases["cleanup"] = (publish, end)
    whole = window_stats(steps, start, end, steady)
    ev_ms = event["duration_ms"]
    # every step over the longest-step limit, with the phases it overlaps (ms from the
    # event's start; "catchup" is the sum of the catchup_<k> rounds)
    long_steps = []
    if steady_p99_ms:
        for s in overlapping(steps, start, end):
            ms = (s[2] - s[0]) * 1000
            if ms > LONGEST_STEP_LIMIT * steady_p99_ms:
                long_steps.append({
                    "start_ms": round((s[0] - start) * 1000, 1), "ms": round(ms, 1),
                    "x_p99": round(ms / steady_p99_ms, 2), "client_stall_ms": round(s[3], 1),
                    "phases": [k for k, (a, b) in phases.items()
                               if k not in ("snapshot_catchup", "catchup") and s[0] < b and s[2] > a]})
    moved_bytes = event.get("moved_bytes", 0)
    return {
        "ps": event["ps"], "epoch": event.get("epoch"),
        "duration_ms": ev_ms, "fence_ms": event.get("fence_ms"),
        "max_stall_ms": event.get("max_stall_ms"), "rounds": event.get("rounds"),
        "moved_slots": event.get("moved_slots"), "moved_rows": event.get("moved_rows"),
        "catchup_rows": event.get("catchup_rows"), "moved_bytes": moved_bytes,
        "moved_mb": round(moved_bytes / 1e6, 2),
        "mb_per_s": round(moved_bytes / 1e6 / (ev_ms / 1000), 2) if ev_ms else None,
        "cli_call_ms": round((call[1] - call[0]) * 1000, 1),
        "steady_before_steps_per_s": round(steady, 2),
        "event_window": whole,
        "phases": {k: window_stats(steps, a, b, steady) for k, (a, b) in phases.items()},
        "long_steps": long_steps,
        "fence_breakdown": fence_breakdown(state_dir, event, publish_wall),
        "event": event,
        # per step overlapping the event (+-1 s): start offset from event start, duration,
        # client stall, stale retries (ms, ms, ms, n)
        "timeline": [[round((s[0] - start) * 1000, 1), round((s[2] - s[0]) * 1000, 1),
                      round(s[3], 1), int(s[4])] for s in overlapping(steps, start - 1, end + 1)],
    }


# ----------------------------------------------------------------------------------------
# one table size
# ----------------------------------------------------------------------------------------
def make_ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n,
                                 dtype=np.int64, endpoint=True))
    while ids.size < n:  # collisions are ~n^2/2^65: practically never
        more = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n - ids.size,
                            dtype=np.int64, endpoint=True)
        ids = np.unique(np.concatenate([ids, more]))
    return rng.permutation(ids)


def run_size(n: int, args) -> dict:
    label = f"{n // 1000}k" if n < 1_000_000 else f"{n / 1e6:g}M"
    state_dir = os.path.join(REPO, "runs", f"bench-migration-{'profile-' if args.profile else ''}{label}")
    res: dict = {"rows": n, "label": label, "state_dir": os.path.relpath(state_dir, REPO)}
    job = client = load = None
    size_deadline = time.monotonic() + args.size_timeout
    log(f"\n== {label} rows: starting job in {res['state_dir']}")
    try:
        job = PsJob(state_dir, f"bench-migration-{label}", args.start_timeout)
        client = PSClient.connect(job.address, timeout=args.start_timeout)
        job.remember_pids()
        client.create_table(TABLE, dim=DIM, initializer=INITIALIZER, optimizer=OPTIMIZER)
        ids = make_ids(n, args.seed)
        t0 = time.monotonic()
        for i in range(0, n, args.fill_batch):
            client.lookup(TABLE, ids[i:i + args.fill_batch], insert_missing=True)
            if time.monotonic() - t0 > args.fill_timeout:
                res["fill_incomplete"] = i + args.fill_batch
                raise TimeoutError(f"filling {n} rows took more than {args.fill_timeout}s "
                                   f"({i + args.fill_batch} rows done)")
        fill_s = time.monotonic() - t0
        res["fill_s"] = round(fill_s, 2)
        res["fill_rows_per_s"] = round(n / fill_s)
        ps_stats = client.ps_stats()
        res["ps_after_fill"] = [{"ps": s.ps_id, "rows": sum(t.rows for t in s.tables),
                                 "table_mb": round(sum(t.bytes for t in s.tables) / 1e6, 1),
                                 "rss_mb": round(s.rss_bytes / 1e6, 1)} for s in ps_stats]
        log(f"  filled {n:,} rows in {fill_s:.1f}s ({n / fill_s:,.0f} rows/s); "
            f"per PS: {res['ps_after_fill']}")

        load = Load(job.address, ids, args.batch, args.seed + 1)
        load.start()
        load.started.wait(60)
        if load.error:
            raise RuntimeError("load thread failed to start")
        time.sleep(args.warmup)
        wall_minus_mono = time.time() - time.monotonic()
        res["events"] = {}
        res["steady"] = {}
        for direction, target in (("out", 3), ("in", 2)):
            ps_pids = [m["pid"] for m in job.state()["members"]
                       if m["role"] == "ps" and m.get("pid")]
            a = time.monotonic()
            steady_cpu0 = cpu_seconds(ps_pids)
            time.sleep(args.steady)
            b = time.monotonic()
            steady_cpu1 = cpu_seconds(ps_pids)
            steady = steady_stats(load.snapshot(), a, b)
            # the PS's CPU per training step in steady state: what serving alone costs
            steady["ps_cpu_s"] = round(sum(steady_cpu1[p] - steady_cpu0.get(p, 0.0)
                                           for p in steady_cpu1), 3)
            steady["ps_cpu_ms_per_step"] = round(
                1000 * steady["ps_cpu_s"] / max(steady["steps_per_s"] * (b - a), 1e-9), 3)
            res["steady"][f"before_{direction}"] = steady
            log(f"  steady with {5 - target} PS: {steady['steps_per_s']:.1f} steps/s "
                f"(p50 step {steady['p50_step_ms']} ms, p99 {steady['p99_step_ms']} ms)")
            if load.error:
                raise RuntimeError("load thread failed")
            remaining = size_deadline - time.monotonic()
            if remaining < 30:
                raise TimeoutError(f"--size-timeout {args.size_timeout}s spent before scale-{direction}")
            st = job.state()
            ps_before = list(st["routing"]["ps_ids"])
            names = {job.proc.pid: "aimaster", os.getpid(): "bench (load thread)"}
            names.update({m["pid"]: m["id"] for m in st["members"] if m.get("pid")})
            cpu0 = cpu_seconds(names)
            if args.profile:
                with Profiler(job, f"scale-{direction}") as prof:
                    event, c0, c1 = run_scale(job, target, min(args.scale_timeout, remaining))
            else:
                event, c0, c1 = run_scale(job, target, min(args.scale_timeout, remaining))
            st = job.state()
            names.update({m["pid"]: m["id"] for m in st["members"] if m.get("pid")})
            cpu1 = cpu_seconds(names)
            job.remember_pids()
            time.sleep(0.2)  # let the steps that straddle the event end land
            ev = analyze_event(event, job.state(), load.snapshot(), steady["steps_per_s"],
                               wall_minus_mono, (c0, c1), ps_before, job.state_dir,
                               steady["p99_step_ms"])
            ev["cpu_s_during_call"] = {names[p]: round(cpu1[p] - cpu0.get(p, 0.0), 2)
                                       for p in cpu1}
            ev["cpu_s_during_call"]["wall_s"] = round(c1 - c0, 2)
            # the migration's CPU: the PS's CPU during the call minus what serving the
            # steps of that time costs at the steady rate (the new PS's start included)
            ps_cpu = sum(v for k, v in ev["cpu_s_during_call"].items() if k.startswith("ps-"))
            steps = rate(load.snapshot(), c0, c1) * (c1 - c0)
            serving = steps * steady["ps_cpu_ms_per_step"] / 1000
            moved = ev["moved_rows"] + ev["catchup_rows"]
            ev["migration_cpu"] = {
                "ps_cpu_s": round(ps_cpu, 2), "steps_during_call": round(steps, 1),
                "serving_cpu_s": round(serving, 2), "migration_cpu_s": round(ps_cpu - serving, 2),
                "us_per_moved_row_all": round(1e6 * ps_cpu / max(moved, 1), 2),
                "us_per_moved_row": round(1e6 * (ps_cpu - serving) / max(moved, 1), 2)}
            if args.profile:
                ev["py_spy"] = prof.summary()
                for ps, summ in ev["py_spy"].items():
                    log(f"      py-spy {ps}: busy {summ['busy_s']} s; {summ['focus_pct']}")
            res["events"][direction] = ev
            log(f"  scale-{direction} {event['ps']}: {ev['duration_ms']:.0f} ms, fence "
                f"{ev['fence_ms']} ms, max_stall {ev['max_stall_ms']} ms, moved "
                f"{ev['moved_rows']:,} rows (+{ev['catchup_rows']:,} catch-up) "
                f"{ev['moved_mb']} MB in {ev['rounds']} rounds; throughput "
                f"{ev['event_window']['vs_steady']:.2f}x steady, longest step "
                f"{ev['event_window']['longest_step_ms']} ms, client stall "
                f"{ev['event_window']['client_stall_ms']} ms")
            log(f"      CPU s during the scale call: {ev['cpu_s_during_call']}")
            log(f"      migration CPU (PS CPU minus steady serving): {ev['migration_cpu']}")
            log(f"      fence window from PS logs: {ev['fence_breakdown']}")
            for k, ph in ev["phases"].items():
                log(f"      {k:18} {ph['ms']:8.0f} ms  {ph['vs_steady'] or 0:5.2f}x steady  "
                    f"longest step {ph['longest_step_ms']} ms")
            log(f"      rounds: rows {event.get('round_rows')}, ms {event.get('round_ms')}")
            for ls in ev["long_steps"]:
                log(f"      step over {LONGEST_STEP_LIMIT:g}x p99: {ls['ms']} ms ({ls['x_p99']}x) at "
                    f"{ls['start_ms']} ms, in {', '.join(ls['phases']) or '?'}")
            time.sleep(args.settle)
        a = time.monotonic()
        time.sleep(args.steady)
        res["steady"]["after"] = steady_stats(load.snapshot(), a, time.monotonic())
        if load.error:
            raise RuntimeError("load thread failed")
    except Exception as exc:  # noqa: BLE001 - report what ran, keep going
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"  ERROR: {res['error']}")
        traceback.print_exc()
        if job is not None:
            res["aimaster_log_tail"] = job.tail(2000)
    finally:
        if load is not None:
            load.stop_event.set()
            load.join(90)
            steps = load.snapshot()
            res["load"] = {"steps": int(len(steps)), "error": load.error,
                           "stale_retries": int(steps[:, 4].sum()) if len(steps) else 0,
                           "unavailable_retries": int(steps[:, 5].sum()) if len(steps) else 0}
        if client is not None:
            client.close()
        if job is not None:
            job.stop()
            log(f"  job stopped (aimaster exit code {job.proc.returncode})")
    return res


# ----------------------------------------------------------------------------------------
# in-process cost breakdown of one migration pair (no gRPC, no contention)
# ----------------------------------------------------------------------------------------
def breakdown(n: int, seed: int, chunk_rows: int = 1 << 16) -> dict:
    from deeprec_ext import codec, rowwire
    from deeprec_ext.client.routing import RoutingTable, rebalance
    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2 as pb
    from deeprec_ext.store import EmbeddingStore

    old = RoutingTable.even(["ps-0", "ps-1"], ["a", "b"], 4096, 1)
    new_owner = rebalance(old.slot_owner, ["ps-0", "ps-1"], ["ps-0", "ps-1", "ps-2"])
    # source ps-0, destination ps-2: the slots ps-0 hands over on scale-out
    mask = (old.slot_owner == 0) & (new_owner == 2)
    ids = make_ids(n, seed)
    ids = ids[old.slot_owner[slot_of(ids, 4096)] == 0]
    src = EmbeddingStore().create_table(TABLE, DIM, INITIALIZER, OPTIMIZER)
    for i in range(0, ids.size, 200_000):
        src.lookup(ids[i:i + 200_000], insert_missing=True)
    out = {"source_rows": int(ids.size), "moving_slots": int(mask.sum())}
    cfg = pb.TableConfig(name=TABLE, dim=DIM, initializer_json=json.dumps(INITIALIZER),
                         optimizer_json=json.dumps(OPTIMIZER))

    # snapshot: scan + gather, the way MigrateSlots does it
    t = time.perf_counter()
    chunks, row, longest = [], 0, 0.0
    while row is not None:
        c0 = time.perf_counter()
        keys, rows, _, row = src.export_slots(mask, None, row, chunk_rows, with_counts="apart")
        longest = max(longest, time.perf_counter() - c0)
        if keys.size:
            chunks.append((keys, rows))
    out["export_snapshot_ms"] = round((time.perf_counter() - t) * 1000, 1)
    out["export_longest_chunk_ms"] = round(longest * 1000, 2)
    out["export_chunks"] = (src._hwm + chunk_rows - 1) // chunk_rows if hasattr(src, "_hwm") else None
    moved = sum(k.size for k, _ in chunks)
    out["moved_rows"] = int(moved)
    out["moved_mb"] = round(sum(r.nbytes + c.nbytes + k.nbytes for k, (r, c) in chunks) / 1e6, 2)

    # wire encoding as MigrateSlots / ImportRows do it: rowwire bytes from the exported
    # arrays (source), fields read as views of the received bytes (destination)
    cfg_bytes = cfg.SerializeToString()
    t = time.perf_counter()
    wire = [rowwire.encode(cfg_bytes, k, r, c) for k, (r, c) in chunks]
    out["encode_ms"] = round((time.perf_counter() - t) * 1000, 1)
    t = time.perf_counter()
    parsed = [rowwire.parse(w) for w in wire]
    decoded = []
    for b in parsed:
        k = codec.ids_from_bytes(b.ids)
        decoded.append((k, codec.floats_from_bytes(b.rows, k.size, src.row_width, "rows"),
                        codec.counts_from_bytes(b.counts, k.size)))
    out["decode_ms"] = round((time.perf_counter() - t) * 1000, 1)

    # destination: a fresh table sized once for the announced rows, then import_block
    dst = EmbeddingStore().create_table(TABLE, DIM, INITIALIZER, OPTIMIZER)
    t = time.perf_counter()
    dst.reserve_import(int(moved * 1.02) + 64)
    longest = 0.0
    for k, r, c in decoded:
        c0 = time.perf_counter()
        dst.import_block(k, r, c)
        longest = max(longest, time.perf_counter() - c0)
    out["import_ms"] = round((time.perf_counter() - t) * 1000, 1)
    out["import_longest_chunk_ms"] = round(longest * 1000, 2)
    del decoded, parsed, wire, dst, chunks

    # a catch-up round that finds nothing: the cost of scanning the whole arena
    since = src.sequence.value
    t = time.perf_counter()
    row = 0
    while row is not None:
        _, _, _, row = src.export_slots(mask, since, row, chunk_rows)
    out["catchup_scan_empty_ms"] = round((time.perf_counter() - t) * 1000, 1)
    # a catch-up round with a realistic delta: 10 training steps' worth of pushes
    rng = np.random.default_rng(seed + 7)
    for _ in range(10):
        sel = ids[rng.integers(0, ids.size, 4096)]
        src.apply_gradients(np.unique(sel), np.full((np.unique(sel).size, DIM), 0.01, np.float32))
    t = time.perf_counter()
    row, delta = 0, 0
    while row is not None:
        k, _, _, row = src.export_slots(mask, since, row, chunk_rows)
        delta += k.size
    out["catchup_scan_10steps_ms"] = round((time.perf_counter() - t) * 1000, 1)
    out["catchup_10steps_rows"] = int(delta)

    # DropSlots on the source: keys_in_slots + delete
    t = time.perf_counter()
    keys = src.keys_in_slots(mask)
    t1 = time.perf_counter()
    src.delete(keys, log_tombstone=False)
    out["drop_keys_in_slots_ms"] = round((t1 - t) * 1000, 1)
    out["drop_delete_ms"] = round((time.perf_counter() - t1) * 1000, 1)
    return out


# ----------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------
def verdicts(results: list[dict]) -> dict:
    ok = [r for r in results if r.get("events", {}).get("in")]
    out: dict = {}
    if not ok:
        return {"note": "no size completed both events"}
    small, large = ok[0], ok[-1]
    stall_large = max(large["events"][d]["max_stall_ms"] for d in ("out", "in"))
    stall_small = max(small["events"][d]["max_stall_ms"] for d in ("out", "in"))
    seen_large = max(large["events"][d]["event_window"]["client_stall_ms"] for d in ("out", "in"))
    out["stall_at_largest"] = {
        "rows": large["rows"], "max_stall_ms": stall_large, "client_stall_ms": seen_large,
        "longest_step_ms": max(large["events"][d]["event_window"]["longest_step_ms"] or 0
                               for d in ("out", "in")),
        "target_ms": STALL_TARGET_MS,
        "result": "PASS" if stall_large <= STALL_TARGET_MS else "MISS"}
    growth = stall_large / stall_small if stall_small else float("inf")
    out["stall_growth"] = {
        "small_rows": small["rows"], "large_rows": large["rows"],
        "small_ms": stall_small, "large_ms": stall_large, "ratio": round(growth, 2),
        "limit": STALL_GROWTH_LIMIT,
        "result": "PASS" if growth <= STALL_GROWTH_LIMIT else "MISS"}
    tp = {f"{r['label']} {d}": r["events"][d]["event_window"]["vs_steady"]
          for r in ok for d in ("out", "in")}
    steps = {f"{r['label']} {d}": {
        "longest_ms": r["events"][d]["event_window"]["longest_step_ms"] or 0.0,
        "steady_p99_ms": r["steady"][f"before_{d}"]["p99_step_ms"]} for r in ok for d in ("out", "in")}
    worst = max(v["longest_ms"] / v["steady_p99_ms"] for v in steps.values())
    out["longest_step"] = {"per_event": steps, "max_ratio": round(worst, 2),
                           "limit": LONGEST_STEP_LIMIT,
                           "result": "PASS" if worst <= LONGEST_STEP_LIMIT else "MISS"}
    out["throughput"] = {"per_event": tp, "min": min(tp.values()), "target": THROUGHPUT_TARGET,
                         "result": "PASS" if min(tp.values()) >= THROUGHPUT_TARGET else "MISS"}
    if len(ok) < len(results):
        out["incomplete_sizes"] = [r["label"] for r in results if r not in ok]
    return out


def print_table(results: list[dict]) -> None:
    hdr = ("rows", "dir", "dur ms", "fence ms", "max_stall", "longest step", "client stall",
           "moved rows", "catch-up", "MB", "MB/s", "tput", "rounds")
    print("\n" + " | ".join(hdr))
    for r in results:
        for d, ev in r.get("events", {}).items():
            print(" | ".join(str(x) for x in (
                r["label"], f"{ev['ps'][0]}->{ev['ps'][1]}", f"{ev['duration_ms']:.0f}",
                f"{ev['fence_ms']:.0f}", f"{ev['max_stall_ms']:.0f}",
                f"{ev['event_window']['longest_step_ms']:.0f}",
                f"{ev['event_window']['client_stall_ms']:.0f}",
                f"{ev['moved_rows']:,}", f"{ev['catchup_rows']:,}", ev["moved_mb"], ev["mb_per_s"],
                f"{ev['event_window']['vs_steady']:.2f}", ev["rounds"])))
        if r.get("error"):
            print(f"{r['label']}: ERROR {r['error']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="100000,1000000,4000000",
                   help="comma-separated table sizes (rows), smallest first")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "migration.json"))
    p.add_argument("--batch", type=int, default=4096, help="ids per training step")
    p.add_argument("--fill-batch", type=int, default=200_000)
    p.add_argument("--warmup", type=float, default=2.0, help="s of load before measuring")
    p.add_argument("--steady", type=float, default=5.0, help="s of steady state per window")
    p.add_argument("--settle", type=float, default=1.0, help="s after an event before measuring")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--fill-timeout", type=float, default=240.0)
    p.add_argument("--scale-timeout", type=float, default=600.0)
    p.add_argument("--size-timeout", type=float, default=1200.0, help="bound for one size")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every size this many times; verdicts per run and over all runs")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="attach py-spy to every PS during each scale call (perturbs timings)")
    args = p.parse_args(argv)
    sizes = sorted(int(float(x)) for x in args.rows.split(",") if x.strip())

    started = datetime.datetime.now()
    runs = []
    for i in range(args.repeat):
        if args.repeat > 1:
            log(f"\n#### run {i + 1} of {args.repeat}")
        runs.append([run_size(n, args) for n in sizes])
    results = runs[0]
    if not args.no_breakdown:
        log("\n== in-process breakdown of one migration pair (ps-0 -> ps-2 on scale-out)")
        for r in results:
            try:
                r["breakdown"] = breakdown(r["rows"], args.seed)
                log(f"  {r['label']}: {r['breakdown']}")
            except Exception as exc:  # noqa: BLE001
                r["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"  {r['label']}: breakdown failed: {exc}")
    per_run = []
    for i, rs in enumerate(runs):
        print_table(rs)
        per_run.append(verdicts(rs))
        print(f"\nrun {i + 1}:" if len(runs) > 1 else "")
        for k, item in per_run[-1].items():
            if isinstance(item, dict) and "result" in item:
                print(f"{item['result']:4}  {k}: {json.dumps({x: y for x, y in item.items() if x != 'result'})}")
            else:
                print(f"      {k}: {item}")
    v = per_run[0] if len(runs) == 1 else {"per_run": per_run, "all_runs": {
        k: "PASS" if all(r.get(k, {}).get("result") == "PASS" for r in per_run) else "MISS"
        for k in per_run[0] if isinstance(per_run[0][k], dict) and "result" in per_run[0][k]}}
    if len(runs) > 1:
        print(f"\nover all {len(runs)} runs: {v['all_runs']}")
    import grpc
    out = {"date": started.isoformat(timespec="seconds"),
           "duration_s": round((datetime.datetime.now() - started).total_seconds(), 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version(), "numpy": np.__version__,
                       "grpcio": grpc.__version__, "loadavg": os.getloadavg()},
           "config": {k: v for k, v in vars(args).items()}, "table": {
               "dim": DIM, "optimizer": OPTIMIZER, "initializer": INITIALIZER,
               "row_bytes": 4 * DIM * 2 + 8},
           "results": results if len(runs) == 1 else runs, "verdicts": v}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log(f"\nwrote {os.path.relpath(os.path.abspath(args.out), REPO)}")
    return 0 if all("error" not in r for rs in runs for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
