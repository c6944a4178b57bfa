"""Soak: a real job (AIMaster, PS and workers as processes) under a seeded random schedule
of events, checked after every event for lost or doubled updates, shards trained twice,
epochs going back and processes left behind.

    python bench/soak.py --minutes 10 --seed 1 [--replication sync|async] [--ps 3]
                         [--workers 2] [--events-per-minute 6] [--skip KIND,...]

The workload is a counting model: every worker (bench/soak_worker.py) reads data shards
whose records are integer ids and pushes +1 per record to the ``records`` table, logging
every push it sends and every acknowledgement in a ledger; a pusher thread in this
process pushes +1 per id to a ``c`` table and keeps the exact expected counts. A job that
has trained all its data is checked, released and ends; if time is left, a new job (a new
"round", with its own state dir) starts.

Events, drawn from the seed in shuffled blocks of one of each kind (so every kind occurs
once per block, in a random order, with random parameters):

  ps_scale_out, ps_scale_in   ``aimaster scale --ps N`` (N within min/max)
  worker_join, worker_leave   ``aimaster scale --workers M``
  kill_ps                     ``kill -9`` of a PS; waits for its recovery and replacement
  kill_worker                 ``kill -9`` of a worker; waits for its restart
  kill_master                 ``kill -9`` of the AIMaster (its PS and workers die with it),
                              then the same ``aimaster run JOB.yaml`` on the same state dir
  checkpoint_full, checkpoint_incr   ``aimaster checkpoint [--full]``; the checkpoint is
                              restored here and compared with the pushes around it
  pause_ps                    SIGSTOP a PS for 2-5 s, then SIGCONT

After every event (and at the end of every job):

- updates: per record, the table holds at least every acknowledged push and at most every
  push sent (``records``: the workers' ledgers; ``c``: this process's pusher, paused
  during the check, so exactly). Sync replication: nothing may be lost. Async: a loss is
  allowed only for pushes acknowledged inside the window the recovery event reports, and
  is counted.
- shards: a record of a DONE shard is in the table; no record is acknowledged twice by
  workers that did not die. A record trained twice is reported with its documented cause
  (a worker killed mid-shard: its shards are handed out whole again; an AIMaster restart:
  the data position and rows of the checkpoint it resumed from, see
  docs/guide-fault-tolerance.md). At the end of a job every record's count is exactly
  what was pushed, and the final checkpoint equals the tables.
- the routing epoch only grows (also across an AIMaster restart that resumes).
- processes: a process of the job (environment DEEPREC_STATE_DIR) that is not a running
  member is gone within a grace period; after ``kill -9`` of the AIMaster every member
  dies; at the end of a job none is left.

Output: one line per event (time, event, result, check), then a JSON summary as the last
line. Exit 1 on a violation (the message names it and how to reproduce it), 2 on a usage
or setup error. The schedule is a function of the seed; the timing is not.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from aimaster.state import load_state  # noqa: E402
from deeprec_ext import PSClient  # noqa: E402
from deeprec_ext.errors import UnknownTableError  # noqa: E402

KINDS = ("ps_scale_out", "ps_scale_in", "worker_join", "worker_leave", "kill_ps",
         "kill_worker", "kill_master", "checkpoint_full", "checkpoint_incr", "pause_ps")
COUNTER_TABLE, RECORDS_TABLE = "c", "records"


# ------------------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Planned:
    index: int
    kind: str
    u: float  # victim / target choice
    v: float  # duration choice

    def __str__(self) -> str:
        return f"#{self.index} {self.kind}"


def make_schedule(seed: int, count: int, kinds=KINDS) -> list[Planned]:
    """``count`` events: shuffled blocks holding each kind once, with their random draws.
    A function of the seed only."""
    rng = random.Random(seed)
    out: list[Planned] = []
    while len(out) < count:
        block = list(kinds)
        rng.shuffle(block)
        for kind in block:
            out.append(Planned(len(out), kind, rng.random(), rng.random()))
    return out[:count]


class Violation(Exception):
    """An invariant broke; the message says which and where."""


class SetupError(Exception):
    """The soak could not run (not a finding about the system)."""


# ------------------------------------------------------------------------------ processes
def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def job_processes(state_dirs) -> dict[int, str]:
    """Live processes (pid -> member id) whose environment says they belong to one of
    ``state_dirs`` (DEEPREC_STATE_DIR, set by the AIMaster's launcher for PS and workers)."""
    wanted = {f"DEEPREC_STATE_DIR={os.path.abspath(d)}".encode() for d in state_dirs}
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if wanted.intersection(env) and pid_alive(int(name)):
            member = next((e.split(b"=", 1)[1].decode() for e in env
                           if e.startswith(b"DEEPREC_MEMBER_ID=")), "?")
            out[int(name)] = member
    return out


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """The predicate's first truthy value; a Violation (a hang) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Violation(f"hang: waited {timeout:.0f} s for {what}")
        time.sleep(interval)


def run_cli(address: str, *args: str, timeout: float = 420.0, busy_retry_s: float = 120.0):
    """``aimaster ARGS --master ADDRESS``: (exit code, parsed JSON or None, stderr). A busy
    refusal (another operation holds the job) is retried for ``busy_retry_s``."""
    deadline = time.monotonic() + busy_retry_s
    while True:
        r = subprocess.run([sys.executable, "-m", "aimaster.cli", args[0], "--master", address,
                            *args[1:]], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if r.returncode != 0 and "busy: try again" in r.stderr and time.monotonic() < deadline:
            time.sleep(1.0)
            continue
        out = None
        if r.returncode == 0:
            try:
                out = json.loads(r.stdout.strip().splitlines()[0])
            except (ValueError, IndexError):
                out = None
        return r.returncode, out, r.stderr.strip()


# ------------------------------------------------------------------------------ ledgers
class Ledger:
    """The workers' push ledgers of one round (bench/soak_worker.py writes them)."""

    LINE = re.compile(r"^(I|A|E) (\d+) ([\d.]+)(?: (.*))?$")

    def __init__(self, directory: Path, n: int):
        self.dir, self.n = directory, n
        self.procs: dict[str, dict] = {}  # file name -> {master, member, pid, offset, sent, acked}

    def refresh(self) -> None:
        for path in sorted(self.dir.glob("*.ledger")):
            p = self.procs.get(path.name)
            if p is None:  # <AIMaster pid>-<member id>-<pid>.ledger
                master, rest = path.stem.split("-", 1)
                member, pid = rest.rsplit("-", 1)
                p = self.procs[path.name] = {"master": int(master), "member": member,
                                             "pid": int(pid), "offset": 0, "sent": {},
                                             "acked": {}, "ended": False}
            with open(path, "rb") as f:
                f.seek(p["offset"])
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only: a writer may be mid-line
            p["offset"] += end
            for line in data[:end].decode().splitlines():
                m = self.LINE.match(line)
                if m is None:
                    raise Violation(f"ledger {path}: unreadable line {line!r}")
                kind, seq, t = m.group(1), int(m.group(2)), float(m.group(3))
                if kind == "I":
                    runs = [tuple(map(int, r.split("-"))) for r in (m.group(4) or "").split(",") if r]
                    p["sent"][seq] = (t, runs)
                elif kind == "A":
                    p["acked"][seq] = t
                else:
                    p["ended"] = True

    def processes(self, master_pid: int) -> list[dict]:
        return [p for p in self.procs.values() if p["master"] == master_pid]

    def _count(self, pushes) -> np.ndarray:
        diff = np.zeros(self.n + 1, np.int64)
        starts, ends = [], []
        for runs in pushes:
            for a, b in runs:
                starts.append(a)
                ends.append(b)
        if starts:
            np.add.at(diff, np.asarray(starts), 1)
            np.add.at(diff, np.asarray(ends), -1)
        return np.cumsum(diff)[:-1]

    def counts(self, master_pid: int, died: set[int], window=None) -> dict[str, np.ndarray]:
        """Per record, over the processes of AIMaster ``master_pid``: ``acked`` pushes,
        ``sent`` (acked or not), ``acked_alive`` (by processes not in ``died``),
        ``acked_died``; with ``window`` (t0, t1) also ``in_window``: pushes acknowledged
        then."""
        acked, sent, alive, in_window = [], [], [], []
        for p in self.processes(master_pid):
            for seq, (_, runs) in p["sent"].items():
                sent.append(runs)
                t = p["acked"].get(seq)
                if t is None:
                    continue
                acked.append(runs)
                if p["pid"] not in died:
                    alive.append(runs)
                if window is not None and window[0] <= t <= window[1]:
                    in_window.append(runs)
        out = {"acked": self._count(acked), "sent": self._count(sent),
               "acked_alive": self._count(alive)}
        out["acked_died"] = out["acked"] - out["acked_alive"]
        if window is not None:
            out["in_window"] = self._count(in_window)
        return out


# ------------------------------------------------------------------------------ pusher
class Pusher:
    """Pushes +1 per id occurrence to the counter table from a thread, keeping the exact
    expected counts (``acked``), what was sent (``sent``) and when each push was
    acknowledged. ``paused()`` holds it between pushes (a check sees no push in flight)."""

    def __init__(self, client: PSClient, n: int, seed: int, batch: int = 500, pause: float = 0.05):
        self.client, self.n, self.batch, self.pause = client, n, batch, pause
        self.acked = np.zeros(n, np.int64)
        self.sent = np.zeros(n, np.int64)
        self.acks: list[tuple[float, np.ndarray]] = []  # (unix time acknowledged, ids)
        self.pushes = 0
        self.errors: list[str] = []
        self.max_gap = 0.0
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-pusher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.time()
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    break
                ids = self._rng.integers(0, self.n, self.batch)
                np.add.at(self.sent, ids, 1)
                try:
                    self.client.push(COUNTER_TABLE, ids, -np.ones((ids.size, 1), np.float32))
                except Exception as exc:  # noqa: BLE001 - reported by the next check
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    return
                now = time.time()
                np.add.at(self.acked, ids, 1)
                self.acks.append((now, ids))
                self.pushes += 1
                self.max_gap = max(self.max_gap, now - last)
                last = now
                if len(self.acks) > 4000:  # loss windows are seconds: keep the last minutes
                    del self.acks[:1000]
            time.sleep(self.pause)

    @contextmanager
    def paused(self):
        with self._lock:
            yield

    def in_window(self, t0: float, t1: float) -> np.ndarray:
        out = np.zeros(self.n, np.int64)
        for t, ids in self.acks:
            if t0 <= t <= t1:
                np.add.at(out, ids, 1)
        return out

    def take_max_gap(self) -> float:
        gap, self.max_gap = self.max_gap, 0.0
        return gap

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(180)
        if self._thread.is_alive():
            raise Violation("hang: the counter pusher's push did not return in 180 s")


# ------------------------------------------------------------------------------ a job
class Round:
    """One job: its files, AIMaster processes (one per generation: a restart after
    ``kill -9`` is a new generation on the same state dir) and the expected counts."""

    def __init__(self, soak: "Soak", index: int):
        self.soak, self.index = soak, index
        a = soak.args
        self.dir = soak.workdir / f"round-{index}"
        self.state_dir = self.dir / "state"
        self.ledger_dir = self.dir / "ledger"
        self.pace_file = self.dir / "pace"
        self.release_file = self.dir / "release"
        for d in (self.state_dir, self.ledger_dir, self.dir / "data"):
            d.mkdir(parents=True, exist_ok=True)
        self.pace_file.write_text(str(a.pace))
        # data: file f holds ids [f * per_file, (f + 1) * per_file), one per line
        self.per_file = math.ceil(a.records / a.files)
        self.n = self.per_file * a.files
        self.files = []
        for f in range(a.files):
            p = self.dir / "data" / f"part-{f}.txt"
            ids = np.arange(f * self.per_file, (f + 1) * self.per_file)
            p.write_text("\n".join(map(str, ids)) + "\n")
            self.files.append(str(p))
        self.base = {p: f * self.per_file for f, p in enumerate(self.files)}
        # shards are byte ranges holding the lines that begin in them: per file, the
        # byte offset where each line (record id base + i) begins
        self.line_starts = {}
        for p in self.files:
            with open(p, "rb") as fh:
                nl = np.flatnonzero(np.frombuffer(fh.read(), np.uint8) == ord("\n"))
            self.line_starts[p] = np.concatenate([[0], nl[:-1] + 1]).astype(np.int64)
        self.ps_min, self.ps_max = max(2, a.ps - 1), a.ps + 1
        self.w_min, self.w_max = max(1, a.workers - 1), a.workers + 1
        self.spec = {
            "name": f"soak-{index}",
            "num_slots": 1024,
            "ps": {"replicas": a.ps, "min_replicas": self.ps_min, "max_replicas": self.ps_max},
            "worker": {"replicas": a.workers, "min_replicas": self.w_min,
                       "max_replicas": self.w_max, "max_restarts": 1000,
                       "command": ["{python}", str(ROOT / "bench" / "soak_worker.py")],
                       "env": {"PYTHONPATH": str(ROOT), "SOAK_LEDGER_DIR": str(self.ledger_dir),
                               "SOAK_PACE_FILE": str(self.pace_file),
                               "SOAK_RELEASE": str(self.release_file),
                               "SOAK_BATCH": str(a.batch)}},
            "data": {"files": self.files, "records_per_shard": a.records_per_shard},
            "master": {"state_dir": str(self.state_dir), "heartbeat_seconds": 0.5,
                       "grace_seconds": 15, "progress_seconds": 10},
            "replication": {"mode": a.replication, "interval_ms": a.interval_ms},
        }
        self.job_file = self.dir / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(self.spec))
        self.ledger = Ledger(self.ledger_dir, self.n)
        # expectations: table = base (what the job resumed from) + pushes since - losses
        self.base_records = np.zeros(self.n, np.int64)
        self.base_counter = np.zeros(soak.args.counter_ids, np.int64)
        self.lost_records = np.zeros(self.n, np.int64)
        # records that lost an update (async) at any time in this job: a DONE shard may
        # keep them at 0, also in the checkpoints taken afterwards
        self.lost_mask = np.zeros(self.n, bool)
        self.lost_counter = np.zeros(soak.args.counter_ids, np.int64)
        self.died: set[int] = set()      # worker pids killed (by the soak or found dead)
        self.procs: list[subprocess.Popen] = []
        self.master_pid = 0
        self.address = ""
        self._stub = None                # (address, channel, MasterStub)
        self.client: PSClient | None = None
        self.pusher: Pusher | None = None
        self.epoch_max = 0
        self.event_epoch = 0
        self.seen_events: set[tuple] = set()
        self.ps_target, self.worker_target = a.ps, a.workers
        self.chain_n = 0                 # checkpoints in the current chain of this AIMaster
        self.suspects: dict[int, tuple[float, str]] = {}
        self.worker_kills = 0            # kill_worker events of this AIMaster generation
        self.worker_deaths = 0           # worker_end events (dead) of this generation
        self.acked_before = 0            # updates acknowledged in earlier generations
        self.rolled_back = 0             # of those, not in the checkpoint resumed from
        self.lost_total = 0              # lost (async replication), every generation
        self.finished = False

    # -- AIMaster ---------------------------------------------------------------------
    def start_master(self) -> None:
        addr = self.state_dir / "master.addr"
        addr.unlink(missing_ok=True)  # a kill -9 leaves it behind
        log = open(self.dir / f"aimaster-{len(self.procs)}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "aimaster.cli", "run", str(self.job_file)],
                                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        self.master_pid = proc.pid

        def address():
            if proc.poll() is not None:
                raise Violation(f"the AIMaster exited with {proc.returncode} at start "
                                f"(see {self.dir}/aimaster-{len(self.procs) - 1}.log)")
            return addr.read_text() if addr.exists() else None
        self.address = wait_until(address, 90, "the AIMaster's address")
        wait_until(lambda: self.status()["phase"] == "running", 120, "the job to be running")

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def status(self) -> dict:
        """``aimaster status --json`` of the current AIMaster, over one cached channel."""
        import grpc
        from aimaster.cli import status_dict
        from deeprec_ext.grpc_util import insecure_channel
        from deeprec_ext.proto import master_pb2, master_pb2_grpc
        if self._stub is None or self._stub[0] != self.address:
            if self._stub is not None:
                self._stub[1].close()
            ch = insecure_channel(self.address)
            self._stub = (self.address, ch, master_pb2_grpc.MasterStub(ch))
        for _ in range(20):
            if self.proc.poll() is not None:
                raise Violation(f"the AIMaster (pid {self.proc.pid}) exited with "
                                f"{self.proc.returncode}: {self.tail()}")
            try:
                return status_dict(self._stub[2].Status(master_pb2.StatusRequest(), timeout=15))
            except grpc.RpcError as exc:
                last = exc
                time.sleep(0.5)
        raise Violation(f"hang: the AIMaster does not answer Status: {last.code().name}")

    def tail(self, lines: int = 15) -> str:
        p = self.dir / f"aimaster-{len(self.procs) - 1}.log"
        text = p.read_text(errors="replace").splitlines() if p.exists() else []
        return "\n    " + "\n    ".join(text[-lines:])

    def connect(self, counter_seed: int) -> None:
        self.client = PSClient.connect(self.address, timeout=120)
        self.client.create_table(COUNTER_TABLE, dim=1, initializer="zeros",
                                 optimizer={"name": "sgd", "learning_rate": 1.0})
        self.pusher = Pusher(self.client, self.soak.args.counter_ids, counter_seed,
                             batch=self.soak.args.counter_batch, pause=self.soak.args.counter_pause)

    def start(self) -> None:
        self.start_master()
        self.connect(self.soak.args.seed * 1000 + self.index)
        st = self.status()
        self.epoch_max = st["epoch"]
        self.note_events(st)

    def close_client(self) -> None:
        if self.pusher is not None:
            self.pusher.stop()
        if self.client is not None:
            self.client.close()
        if self._stub is not None:
            self._stub[1].close()
            self._stub = None

    # -- reading -----------------------------------------------------------------------
    def lookup(self, table: str, n: int) -> np.ndarray:
        try:
            got = self.client.lookup(table, np.arange(n, dtype=np.int64), insert_missing=False)
        except UnknownTableError:
            return np.zeros(n, np.int64)
        return np.rint(got[:, 0]).astype(np.int64)

    def shard_ids(self, state: dict, which: str) -> list[tuple[int, int, int]]:
        """(shard id, first record id, end record id) of the shards in ``which``."""
        sh = state["shards"]
        ids = sh["done"] if which == "done" else [int(s) for s in sh["doing"]]
        by_id = {s["shard_id"]: s for s in sh["shards"]}
        out = []
        for sid in ids:
            s = by_id[int(sid)]
            b, starts = self.base[s["path"]], self.line_starts[s["path"]]
            first, end = np.searchsorted(starts, [s["start"], s["end"]])
            out.append((int(sid), b + int(first), b + int(end)))
        return out

    def done_mask(self, state: dict) -> np.ndarray:
        mask = np.zeros(self.n, bool)
        for _, a, b in self.shard_ids(state, "done"):
            mask[a:b] = True
        return mask

    def note_events(self, st: dict) -> list[dict]:
        """New events since the last call; checks that routing epochs only grow."""
        new = []
        for e in st["events"]:
            key = (e["kind"], e.get("time"), e.get("id"), e.get("dead"), e.get("epoch"))
            if key in self.seen_events:
                continue
            self.seen_events.add(key)
            new.append(e)
            if e["kind"] in ("routing", "recovery", "scale", "rebalance") and "epoch" in e:
                if e["epoch"] < self.event_epoch:
                    raise Violation(f"routing epoch went back: {e['kind']} event with epoch "
                                    f"{e['epoch']} after epoch {self.event_epoch}: {e}")
                self.event_epoch = e["epoch"]
            if e["kind"] in ("worker_gave_up", "replacement_failed", "checkpoint_failed"):
                raise Violation(f"unexpected {e['kind']} event: {e}")
            if e["kind"] == "worker_end" and e.get("state") == "dead":
                self.worker_deaths += 1
                if self.worker_deaths > self.worker_kills:
                    log = self.state_dir / "logs" / f"{e['id']}.log"
                    text = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
                    raise Violation(f"{e['id']} died without being killed ({e.get('reason')}); "
                                    f"end of {log}:\n    " + "\n    ".join(text))
        return new

    # -- the check ---------------------------------------------------------------------
    def check(self, loss_window: tuple[float, float] | None = None) -> str:
        """Every invariant, now. With ``loss_window`` (async replication after a PS
        death) a shortfall is allowed for pushes acknowledged in that window, and counted."""
        a = self.soak.args
        pusher = self.pusher
        if pusher.errors:
            raise Violation(f"a counter push failed: {pusher.errors[0]}")
        with pusher.paused():
            self.ledger.refresh()
            before = self.ledger.counts(self.master_pid, self.died, loss_window)
            st = self.status()
            state = load_state(str(self.state_dir))
            records = self.lookup(RECORDS_TABLE, self.n)
            counter = self.lookup(COUNTER_TABLE, a.counter_ids)
            self.ledger.refresh()
            after = self.ledger.counts(self.master_pid, self.died)
            c_lo = self.base_counter + pusher.acked - self.lost_counter
            c_hi = self.base_counter + pusher.sent - self.lost_counter
            c_window = pusher.in_window(*loss_window) if loss_window else None
        if st["phase"] != "running":
            raise Violation(f"the job is {st['phase']}, not running")
        self.note_events(st)
        if st["epoch"] < self.epoch_max:
            raise Violation(f"routing epoch went back from {self.epoch_max} to {st['epoch']}")
        self.epoch_max = st["epoch"]
        lost_now = 0
        # updates: at least every acknowledged push, at most every push sent
        r_lo = self.base_records + before["acked"] - self.lost_records
        r_hi = self.base_records + after["sent"] - self.lost_records
        for name, got, lo, hi, window, lost in (
                ("records", records, r_lo, r_hi, before.get("in_window"), self.lost_records),
                ("c", counter, c_lo, c_hi, c_window, self.lost_counter)):
            short = np.maximum(lo - got, 0)
            if short.any():
                ids = np.flatnonzero(short)
                if window is None or a.replication == "sync" or (short > window).any():
                    bad = ids if window is None else np.flatnonzero(short > window)
                    raise Violation(
                        f"updates lost in table '{name}': {int(short.sum())} acknowledged "
                        f"update(s) of {ids.size} id(s) missing (e.g. id {bad[0]}: table "
                        f"{got[bad[0]]}, acknowledged {lo[bad[0]]})"
                        + ("" if window is None else f"; {int((short > window).sum())} of "
                           "them outside the window the recovery event reports"))
                lost += short
                lost_now += int(short.sum())
                if name == "records":
                    self.lost_mask |= short > 0
            over = got - hi
            if (over > 0).any():
                i = int(np.flatnonzero(over > 0)[0])
                raise Violation(f"table '{name}' holds more than was ever pushed: "
                                f"{int((over > 0).sum())} id(s), e.g. id {i}: table {got[i]}, "
                                f"pushes sent {hi[i]} (an update applied twice)")
        # shards: no record trained twice by workers that lived; DONE shards all there
        twice = after["acked_alive"] >= 2
        if twice.any():
            i = int(np.flatnonzero(twice)[0])
            raise Violation(f"{int(twice.sum())} record(s) acknowledged twice by workers that "
                            f"did not die, e.g. record {i} ({int(after['acked_alive'][i])} times): "
                            f"a shard was trained twice{self.who_pushed(i)}")
        done = self.done_mask(state)
        missing = done & (records == 0) & ~self.lost_mask
        if missing.any():
            i = int(np.flatnonzero(missing)[0])
            raise Violation(f"{int(missing.sum())} record(s) of DONE shards were never "
                            f"trained, e.g. record {i}{self.who_pushed(i)}")
        self.orphans(st)
        sh = st["shards"]
        line = (f"shards {sh['done']}/{sh['todo'] + sh['doing'] + sh['done']} done, records "
                f"{int(records.sum())} = base {int(self.base_records.sum())} + acked "
                f"{int(before['acked'].sum())}"
                + (f" - lost {int(self.lost_records.sum())}" if self.lost_records.any() else "")
                + f" (+{int(records.sum() - r_lo.sum())} in flight), "
                f"c {int(counter.sum())}/{int(c_lo.sum())}, "
                f"x2 {int((done & (records >= 2)).sum())}, epoch {st['epoch']}")
        if lost_now:
            line += f", LOST {lost_now} (async, inside the reported window)"
            self.lost_total += lost_now
        return line

    def who_pushed(self, record: int) -> str:
        who = []
        for p in self.ledger.procs.values():
            for seq, (t, runs) in p["sent"].items():
                if any(a <= record < b for a, b in runs):
                    who.append(f"{p['member']} pid {p['pid']} (AIMaster {p['master']}) at "
                               f"{time.strftime('%H:%M:%S', time.localtime(t))}"
                               f"{'' if seq in p['acked'] else ' unacknowledged'}"
                               f"{' died' if p['pid'] in self.died else ''}")
        return f"; pushed by: {', '.join(who) or 'nobody'}"

    def orphans(self, st: dict | None, grace: float = 30.0) -> None:
        """Processes of this job that are not running members must be gone in ``grace``."""
        running = {m["pid"] for m in st["members"] if m["state"] == "running"} if st else set()
        now = time.monotonic()
        live = job_processes([self.state_dir])
        for pid in list(self.suspects):
            if pid not in live:
                del self.suspects[pid]
        for pid, member in live.items():
            if pid in running:
                self.suspects.pop(pid, None)
                continue
            first, _ = self.suspects.setdefault(pid, (now, member))
            if now - first > grace:
                raise Violation(f"orphan: {member} (pid {pid}) is alive {now - first:.0f} s "
                                "after it stopped being a running member of the job")

    # -- waiting -----------------------------------------------------------------------
    def settled(self) -> dict | None:
        st = self.status()
        self.note_events(st)
        if st["phase"] != "running":
            raise Violation(f"the job is {st['phase']}: {self.tail()}")
        ps = {m["id"]: m for m in st["members"] if m["role"] == "ps" and m["state"] == "running"}
        placed = (st["placement"] or {}).get("ps", {})
        workers = [m for m in st["members"] if m["role"] == "worker" and m["state"] == "running"]
        if len(placed) == self.ps_target and set(placed) <= set(ps) and \
                len(workers) == self.worker_target:
            return st
        return None

    def settle(self, timeout: float = 180.0) -> dict:
        return wait_until(self.settled, timeout,
                          f"the job to settle at {self.ps_target} PS and {self.worker_target} workers")

    def all_done(self) -> bool:
        sh = self.status()["shards"]
        return sh["todo"] == 0 and sh["doing"] == 0

    # -- events ------------------------------------------------------------------------
    def pick(self, st: dict, role: str, u: float) -> dict:
        members = sorted((m for m in st["members"] if m["role"] == role and m["state"] == "running"),
                         key=lambda m: int(m["id"].rsplit("-", 1)[1]))
        return members[min(int(u * len(members)), len(members) - 1)]

    def ev_scale(self, ev: Planned, role: str, direction: str) -> tuple[str, str]:
        """At a bound the other direction instead (unless that kind is left out)."""
        st = self.settle()
        lo, hi = (self.ps_min, self.ps_max) if role == "ps" else (self.w_min, self.w_max)
        n = self.ps_target if role == "ps" else self.worker_target

        def kind_of(d):
            return f"ps_scale_{d}" if role == "ps" else "worker_join" if d == "out" else "worker_leave"
        note = ""
        if (direction == "out" and n >= hi) or (direction == "in" and n <= lo):
            other = "in" if direction == "out" else "out"
            if kind_of(other) in self.soak.args.skip:
                return "skipped", (f"{kind_of(direction)}: at {'max' if direction == 'out' else 'min'} "
                                   f"{n}, and {kind_of(other)} is left out (--skip)")
            note = f" (at {'max' if direction == 'out' else 'min'} {n}: {kind_of(other)} instead)"
            direction = other
        choices = list(range(n + 1, hi + 1)) if direction == "out" else list(range(lo, n))
        target = choices[min(int(ev.u * len(choices)), len(choices) - 1)]
        kind = kind_of(direction)
        before = {m["id"]: m["pid"] for m in st["members"] if m["state"] == "running"}
        # a worker joins or leaves in seconds, a PS scale moves rows: bounded either way
        code, event, err = run_cli(self.address, "scale", "--ps" if role == "ps" else "--workers",
                                   str(target), "--timeout", "300" if role == "ps" else "120")
        if code != 0 or event is None:
            raise Violation(f"aimaster scale --{role} {target} failed (exit {code}): {err}")
        key = "ps" if role == "ps" else "workers"
        if event[key] != [n, target]:
            raise Violation(f"scale event says {key} {event[key]}, expected [{n}, {target}]: {event}")
        if role == "ps":
            self.ps_target = target
        else:
            self.worker_target = target
        after = {m["id"]: m["pid"] for m in self.settle()["members"] if m["state"] == "running"}
        restarted = [i for i in before if i in after and after[i] != before[i]]
        if restarted:
            raise Violation(f"scale restarted surviving members {restarted}")
        if role == "ps":
            res = (f"ps {n}->{target} epoch {event.get('epoch')} moved {event.get('moved_rows')} "
                   f"rows, fence {event.get('fence_ms')} ms, {event['duration_ms'] / 1000:.1f} s")
        else:
            res = f"workers {n}->{target} in {event['duration_ms'] / 1000:.1f} s"
        return kind, res + note

    def ev_kill_ps(self, ev: Planned) -> tuple[str, str, tuple | None]:
        st = self.settle()
        victim = self.pick(st, "ps", ev.u)
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)

        def recovered():
            st = self.status()
            self.note_events(st)
            recs = [e for e in st["events"] if e["kind"] == "recovery"
                    and e["dead"] == victim["id"] and e["time"] >= killed_at]
            return recs[0] if recs else None
        rec = wait_until(recovered, 90, f"the recovery of {victim['id']}")
        st = self.settle()
        replacement = next((m for m in st["members"] if m["id"] == victim["id"]
                            and m["state"] == "running"), None)
        took = time.time() - killed_at
        if a_sync(self) and rec["updates_at_risk_ms"] != 0.0:
            raise Violation(f"sync replication, but the recovery reports "
                            f"{rec['updates_at_risk_ms']} ms of updates at risk: {rec}")
        window = None
        if not a_sync(self):
            # pushes the dead PS acknowledged after its last shipment: from (detection -
            # replica age) until the kill (plus a margin for the ledgers' clocks)
            detected = rec["time"] - rec["resumed_ms"] / 1000
            window = (detected - rec["updates_at_risk_ms"] / 1000 - 0.05, killed_at + 0.2)
        res = (f"{victim['id']} (pid {victim['pid']}) killed: promoted on {rec['promoted_on']} "
               f"({rec['promoted_rows']} rows) in {rec['resumed_ms']} ms, at risk "
               f"{rec['updates_at_risk_ms']} ms; replaced"
               + (f" by pid {replacement['pid']}" if replacement else "") + f", {took:.1f} s in all")
        return "kill_ps", res, window

    def ev_kill_worker(self, ev: Planned) -> tuple[str, str]:
        st = self.settle()
        victim = self.pick(st, "worker", ev.u)
        state = load_state(str(self.state_dir))
        holding = sorted(int(s) for s, w in state["shards"]["doing"].items() if w == victim["id"])
        killed_at = time.time()
        self.worker_kills += 1
        os.kill(victim["pid"], signal.SIGKILL)
        self.died.add(victim["pid"])

        def restarted():
            st = self.status()
            self.note_events(st)
            m = next((m for m in st["members"] if m["id"] == victim["id"]), None)
            return m if m and m["state"] == "running" and m["pid"] != victim["pid"] else None
        new = wait_until(restarted, 90, f"{victim['id']} to be restarted")
        self.settle()
        return "kill_worker", (f"{victim['id']} (pid {victim['pid']}) killed holding shards "
                               f"{holding}: restarted as pid {new['pid']} in "
                               f"{time.time() - killed_at:.1f} s")

    def ev_checkpoint(self, ev: Planned, full: bool) -> tuple[str, str]:
        from checkpoint import restore
        from deeprec_ext.store import EmbeddingStore
        self.settle()
        pusher = self.pusher
        with pusher.paused():
            self.ledger.refresh()
            lo = self.base_records + self.ledger.counts(self.master_pid, self.died)["acked"] \
                - self.lost_records
            c_lo = self.base_counter + pusher.acked - self.lost_counter
        args = ["checkpoint"] + (["--full"] if full else []) + ["--timeout", "300"]
        code, event, err = run_cli(self.address, *args)
        if code != 0 or event is None:
            raise Violation(f"aimaster {' '.join(args)} failed (exit {code}): {err}")
        with pusher.paused():
            self.ledger.refresh()
            hi = self.base_records + self.ledger.counts(self.master_pid, self.died)["sent"] \
                - self.lost_records
            c_hi = self.base_counter + pusher.sent - self.lost_counter
        expect = "full" if full or self.chain_n == 0 or self.chain_n % 5 == 0 else "incr"
        if event["type"] != expect:
            raise Violation(f"checkpoint {event['id']} is {event['type']}, expected {expect} "
                            f"({self.chain_n} checkpoint(s) in the chain): {event}")
        self.chain_n = 1 if event["type"] == "full" else self.chain_n + 1
        store = EmbeddingStore()
        info = restore(event["dir"], store, upto=event["id"], exact=True)
        got = self.read_store(store, RECORDS_TABLE, self.n)
        got_c = self.read_store(store, COUNTER_TABLE, self.soak.args.counter_ids)
        for name, g, l, h in (("records", got, lo, hi), ("c", got_c, c_lo, c_hi)):
            if (g < l).any() or (g > h).any():
                i = int(np.flatnonzero((g < l) | (g > h))[0])
                raise Violation(f"checkpoint {event['id']} ({event['type']}) table '{name}': "
                                f"{int((g < l).sum())} id(s) below the pushes acknowledged before "
                                f"it, {int((g > h).sum())} above those sent by its end (e.g. id "
                                f"{i}: {g[i]} not in [{l[i]}, {h[i]}])")
        shards = info.extra.get("shards")
        if shards:
            done = self.done_mask(info.extra) & ~self.lost_mask
            if (done & (got == 0)).any():
                i = int(np.flatnonzero(done & (got == 0))[0])
                raise Violation(f"checkpoint {event['id']}: its shard queue has record {i}'s "
                                f"shard DONE but its rows do not hold the record")
        kind = "checkpoint_full" if full else "checkpoint_incr"
        return kind, (f"checkpoint {event['id']} {event['type']}: {event['rows']} rows, "
                      f"{event['bytes']} B in {event['duration_ms']} ms; restored: every "
                      "acknowledged push in it, nothing more than was sent")

    @staticmethod
    def read_store(store, table: str, n: int) -> np.ndarray:
        try:
            t = store.get(table)
        except Exception:  # noqa: BLE001 - the table is not in the checkpoint
            return np.zeros(n, np.int64)
        return np.rint(t.lookup(np.arange(n, dtype=np.int64), insert_missing=False)[:, 0]).astype(np.int64)

    def ev_pause_ps(self, ev: Planned) -> tuple[str, str]:
        st = self.settle()
        victim = self.pick(st, "ps", ev.u)
        seconds = 2.0 + 3.0 * ev.v
        t0 = time.time()
        self.pusher.take_max_gap()
        pushes = self.pusher.pushes
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        wait_until(lambda: self.pusher.pushes > pushes + 5 or self.pusher.errors, 60,
                   f"counter pushes to go on after {victim['id']} resumed")
        st = self.settle()
        recs = [e for e in st["events"] if e["kind"] in ("recovery", "ps_end") and e["time"] >= t0]
        if recs:
            raise Violation(f"{victim['id']} paused {seconds:.1f} s (lease "
                            f"{10.0} s) was treated as dead: {recs}")
        return "pause_ps", (f"{victim['id']} (pid {victim['pid']}) stopped {seconds:.1f} s: "
                            f"longest push gap {self.pusher.take_max_gap():.1f} s, no recovery")

    def ev_kill_master(self, ev: Planned) -> tuple[str, str]:
        from checkpoint import restore
        from deeprec_ext.store import EmbeddingStore
        self.settle()
        old_pid, epoch_before = self.master_pid, self.epoch_max
        self.close_client()
        self.ledger.refresh()
        counts = self.ledger.counts(old_pid, self.died)
        gen_acked = int(counts["acked"].sum()) + int(self.pusher.acked.sum())
        expected_end = int((self.base_records + counts["acked"] - self.lost_records).sum()
                           + (self.base_counter + self.pusher.acked - self.lost_counter).sum())
        members = job_processes([self.state_dir])
        t0 = time.time()
        os.kill(old_pid, signal.SIGKILL)
        self.proc.wait(30)

        def gone():
            return not any(pid_alive(p) for p in members)
        try:
            wait_until(gone, 40, "the job's processes to die with their AIMaster")
        except Violation:
            left = {p: m for p, m in members.items() if pid_alive(p)}
            raise Violation(f"orphans: {left} (pid: member) outlived their AIMaster "
                            f"(pid {old_pid}, kill -9) by 40 s")
        died_in = time.time() - t0
        for p in self.ledger.processes(old_pid):
            self.died.add(p["pid"])
        t1 = time.time()
        self.start_master()
        st = self.status()
        resumed = next((e for e in st["events"] if e["kind"] == "resumed"), None)
        if resumed is None:  # a new job from scratch: its epochs start again
            self.event_epoch = 0
        self.note_events(st)
        self.ps_target, self.worker_target = self.soak.args.ps, self.soak.args.workers
        self.chain_n = 0
        self.worker_kills = self.worker_deaths = 0
        self.acked_before += gen_acked
        self.lost_records[:] = 0
        self.lost_counter[:] = 0
        if resumed is None:
            # no checkpoint: the job starts over (its old state set aside), from nothing
            if not (self.state_dir / "job_state.db.interrupted").exists():
                raise Violation("the restarted AIMaster neither resumed nor set the old state "
                                "aside (job_state.db.interrupted)")
            self.base_records = np.zeros(self.n, np.int64)
            self.base_counter = np.zeros(self.soak.args.counter_ids, np.int64)
            self.epoch_max = st["epoch"]
            how = "no checkpoint: started over (the first run's updates are discarded)"
        else:
            store = EmbeddingStore()
            info = restore(str(self.state_dir / "checkpoints"), store, upto=resumed["checkpoint"],
                           exact=True)
            self.base_records = self.read_store(store, RECORDS_TABLE, self.n)
            self.base_counter = self.read_store(store, COUNTER_TABLE, self.soak.args.counter_ids)
            queued = info.extra.get("shards") or {}
            if resumed["shards"] and resumed["shards"]["done"] != len(queued.get("done", [])):
                raise Violation(f"resumed with {resumed['shards']['done']} shards DONE; checkpoint "
                                f"{resumed['checkpoint']} recorded {len(queued.get('done', []))}")
            if st["epoch"] <= epoch_before:
                raise Violation(f"routing epoch went back across the AIMaster restart: "
                                f"{epoch_before} -> {st['epoch']}")
            self.epoch_max = st["epoch"]
            how = (f"resumed from checkpoint {resumed['checkpoint']} ({resumed['rows']} rows, "
                   f"shards {resumed['shards']})")
        rolled = expected_end - int(self.base_records.sum() + self.base_counter.sum())
        self.rolled_back += rolled
        how += f"; {rolled} acknowledged update(s) rolled back"
        self.connect(self.soak.args.seed * 1000 + self.index + 100 * len(self.procs))
        return "kill_master", (f"AIMaster pid {old_pid} killed, {len(members)} member(s) died "
                               f"with it in {died_in:.1f} s; restarted as pid {self.master_pid} in "
                               f"{time.time() - t1:.1f} s, {how}; epoch {epoch_before}->{st['epoch']}")

    # -- the end of a job ------------------------------------------------------------
    def finish(self) -> dict:
        """All shards DONE: final exact check, release the workers, the job must succeed,
        its final checkpoint equal the tables, and no process be left."""
        from checkpoint import restore
        from deeprec_ext.store import EmbeddingStore
        self.pace_file.write_text("0")
        line = self.check()
        self.pusher.stop()
        self.ledger.refresh()
        counts = self.ledger.counts(self.master_pid, self.died)
        records = self.lookup(RECORDS_TABLE, self.n)
        counter = self.lookup(COUNTER_TABLE, self.soak.args.counter_ids)
        expect_c = self.base_counter + self.pusher.acked - self.lost_counter
        if not np.array_equal(counter, expect_c):
            raise Violation(f"table 'c' at the end differs from the acknowledged pushes in "
                            f"{int((counter != expect_c).sum())} id(s)")
        lo = self.base_records + counts["acked"] - self.lost_records
        hi = self.base_records + counts["sent"] - self.lost_records
        if (records < lo).any() or (records > hi).any():
            raise Violation("records table at the end outside [acked, sent]")
        zero = (records == 0) & ~self.lost_mask
        if zero.any():
            raise Violation(f"{int(zero.sum())} record(s) never trained though every shard is "
                            f"DONE, e.g. {int(np.flatnonzero(zero)[0])}")
        # records trained more than once, by their (documented) cause: resumed from a
        # checkpoint that held them while their shard was not DONE in it; doubled before
        # that checkpoint; or pushed by a worker that was killed before its shard was DONE
        twice = records >= 2
        died = counts["acked_died"] + counts["sent"] - counts["acked"]
        by_restart = twice & (self.base_records >= 1) & (counts["sent"] >= 1)
        in_base = twice & ~by_restart & (self.base_records >= 2)
        by_kill = twice & ~by_restart & ~in_base
        if (by_kill & (died == 0)).any():
            i = int(np.flatnonzero(by_kill & (died == 0))[0])
            raise Violation(f"record {i} trained {records[i]} times, and no worker that pushed "
                            f"it died{self.who_pushed(i)}")
        acked_now = int(counts["acked"].sum() + self.pusher.acked.sum())
        in_flight = int(records.sum() - lo.sum())
        in_tables = int(records.sum() + counter.sum())
        pushed = self.acked_before + acked_now
        lost = int(self.lost_total)
        if pushed - lost - self.rolled_back + in_flight != in_tables:
            raise Violation(f"accounting: pushed {pushed} - lost {lost} - rolled back "
                            f"{self.rolled_back} + applied in flight {in_flight} != {in_tables} "
                            "in the tables")
        state = load_state(str(self.state_dir))
        shard_rows = self.shard_ids(state, "done")
        once = sum(1 for _, a, b in shard_rows if (records[a:b] == 1).all())
        self.close_client()
        self.release_file.write_text("")
        t0 = time.time()
        try:
            code = self.proc.wait(240)
        except subprocess.TimeoutExpired:
            raise Violation(f"hang: the job did not end in 240 s after its workers were "
                            f"released: {self.tail()}")
        final = load_state(str(self.state_dir))
        if code != 0 or final["phase"] != "succeeded":
            raise Violation(f"the job ended {final['phase']} (exit {code}): {final['message']}")
        if final.get("final_checkpoint"):
            store = EmbeddingStore()
            ck = Path(final["final_checkpoint"])
            restore(str(ck.parent), store, upto=int(ck.name.split("-")[1]), exact=True)
            if not np.array_equal(self.read_store(store, RECORDS_TABLE, self.n), records) or \
                    not np.array_equal(self.read_store(store, COUNTER_TABLE,
                                                       self.soak.args.counter_ids), counter):
                raise Violation(f"the final checkpoint {ck} differs from the tables at the end")
        left = wait_until_empty(self.state_dir, 15)
        if left:
            raise Violation(f"orphans after the job ended: {left} (pid: member)")
        for p in self.procs:
            # poll() on our own child, not the pid: a killed AIMaster's pid can be reused by
            # an unrelated process before the job ends (pids wrap on a busy machine)
            if p.poll() is None:
                raise Violation(f"AIMaster pid {p.pid} still alive after the job ended")
        self.finished = True
        return {"round": self.index, "records": self.n, "shards": len(shard_rows),
                "shards_exactly_once": once,
                "records_trained_twice_worker_kill": int(by_kill.sum()),
                "records_trained_twice_master_restart": int((by_restart | in_base).sum()),
                "records_never_trained_async_loss": int(((records == 0) & self.lost_mask).sum()),
                "updates_pushed": pushed, "updates_lost": lost,
                "updates_rolled_back_by_restart": self.rolled_back,
                "updates_applied_in_flight": in_flight, "updates_in_tables": in_tables,
                "generations": len(self.procs), "end_seconds": round(time.time() - t0, 1),
                "check": line}

    def abort(self) -> None:
        """Stop whatever runs (after a violation): the AIMaster gets SIGTERM, then every
        process of the job SIGKILL."""
        try:
            if self.pusher is not None:
                self.pusher._stop.set()
        except Exception:  # noqa: BLE001
            pass
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGTERM)
                    p.wait(30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.kill(p.pid, signal.SIGKILL)
        for pid in job_processes([self.state_dir]):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def a_sync(r: Round) -> bool:
    return r.soak.args.replication == "sync"


def wait_until_empty(state_dir: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = job_processes([state_dir])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ------------------------------------------------------------------------------ driver
class Soak:
    def __init__(self, args):
        self.args = args
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"soak-{args.seed}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.survived: Counter = Counter()
        self.rounds: list[dict] = []
        self.round: Round | None = None
        self.round_count = 0
        self.skipped = 0
        skip = set(args.skip)
        self.kinds = tuple(k for k in KINDS if k not in skip)
        per_min = args.events_per_minute
        self.schedule = make_schedule(args.seed, max(1, math.ceil(args.minutes * per_min)), self.kinds)

    def say(self, text: str) -> None:
        print(f"{time.monotonic() - self.t0:7.1f}s  {text}", flush=True)

    def new_round(self) -> Round:
        r = Round(self, self.round_count)
        self.round_count += 1
        self.round = r
        r.start()
        sh = r.status()["shards"]
        self.say(f"round {r.index}: job {r.spec['name']} running, {r.n} records in "
                 f"{sh['todo'] + sh['doing'] + sh['done']} shards, {self.args.ps} PS, "
                 f"{self.args.workers} workers, replication {self.args.replication} "
                 f"(state dir {r.state_dir})")
        return r

    def end_round(self) -> None:
        r = self.round
        summary = r.finish()
        self.rounds.append(summary)
        self.say(f"round {r.index}: ended succeeded, {summary['shards_exactly_once']}/"
                 f"{summary['shards']} shards exactly once, trained twice (documented): "
                 f"{summary['records_trained_twice_worker_kill']} records after worker kills, "
                 f"{summary['records_trained_twice_master_restart']} after AIMaster restarts, "
                 f"lost {summary['updates_lost']}, no process left | {summary['check']}")

    def run_event(self, ev: Planned) -> None:
        r = self.round
        window = None
        t = time.monotonic()
        if ev.kind in ("ps_scale_out", "ps_scale_in"):
            kind, res = r.ev_scale(ev, "ps", ev.kind.rsplit("_", 1)[1])
        elif ev.kind in ("worker_join", "worker_leave"):
            kind, res = r.ev_scale(ev, "worker", "out" if ev.kind == "worker_join" else "in")
        elif ev.kind == "kill_ps":
            kind, res, window = r.ev_kill_ps(ev)
        elif ev.kind == "kill_worker":
            kind, res = r.ev_kill_worker(ev)
        elif ev.kind == "kill_master":
            kind, res = r.ev_kill_master(ev)
        elif ev.kind in ("checkpoint_full", "checkpoint_incr"):
            kind, res = r.ev_checkpoint(ev, ev.kind == "checkpoint_full")
        elif ev.kind == "pause_ps":
            kind, res = r.ev_pause_ps(ev)
        else:
            raise SetupError(f"unknown event kind {ev.kind}")
        self.current = f"#{ev.index} {kind}"
        if kind == "skipped":
            self.skipped += 1
            self.say(f"#{ev.index:<3} {'(skipped)':<15} {res}")
            return
        line = r.check(window)
        self.survived[kind] += 1
        self.say(f"#{ev.index:<3} {kind:<15} {res} ({time.monotonic() - t:.1f} s) | check ok: {line}")

    def run(self) -> int:
        a = self.args
        interval = 60.0 / a.events_per_minute
        budget = a.minutes * 60.0
        self.current = "start"
        self.say(f"soak seed {a.seed}: {len(self.schedule)} events planned over {a.minutes} min "
                 f"({', '.join(e.kind for e in self.schedule[:12])}{', ...' if len(self.schedule) > 12 else ''})")
        self.new_round()
        next_at = time.monotonic() + a.warmup
        i = 0
        while i < len(self.schedule) and time.monotonic() - self.t0 < budget:
            if self.round.all_done():
                self.current = f"end of round {self.round.index}"
                self.end_round()
                if budget - (time.monotonic() - self.t0) < a.min_round_seconds:
                    break
                self.new_round()
                next_at = max(next_at, time.monotonic() + a.warmup)
                continue
            if time.monotonic() < next_at:
                time.sleep(min(0.5, next_at - time.monotonic()))
                continue
            ev = self.schedule[i]
            self.current = str(ev)
            self.run_event(ev)
            i += 1
            next_at += interval
        # drain: workers at full speed until every shard is DONE, then the final checks
        if not self.round.finished:
            self.current = f"drain of round {self.round.index}"
            self.round.pace_file.write_text("0")
            self.say(f"drain: events over ({i} run), workers at full speed")
            wait_until(self.round.all_done, a.drain_timeout, "every shard to be DONE (drain)",
                       interval=1.0)
            self.current = f"end of round {self.round.index}"
            self.end_round()
        return i

    def summary(self, events_run: int, violation: str | None) -> dict:
        rounds = self.rounds
        return {
            "seed": self.args.seed, "minutes": self.args.minutes,
            "replication": self.args.replication, "ps": self.args.ps,
            "workers": self.args.workers, "events_per_minute": self.args.events_per_minute,
            "skipped_kinds": sorted(self.args.skip),
            "events_run": events_run, "events_skipped": self.skipped,
            "events_survived": dict(sorted(self.survived.items())),
            "rounds": len(rounds),
            "records": sum(r["records"] for r in rounds),
            "shards": sum(r["shards"] for r in rounds),
            "shards_exactly_once": sum(r["shards_exactly_once"] for r in rounds),
            "records_trained_twice_worker_kill": sum(r["records_trained_twice_worker_kill"] for r in rounds),
            "records_trained_twice_master_restart": sum(r["records_trained_twice_master_restart"] for r in rounds),
            "records_never_trained_async_loss": sum(r["records_never_trained_async_loss"] for r in rounds),
            "updates_pushed": sum(r["updates_pushed"] for r in rounds),
            "updates_lost": sum(r["updates_lost"] for r in rounds)
            + (self.round.lost_total if self.round and not self.round.finished else 0),
            "updates_rolled_back_by_restart": sum(r["updates_rolled_back_by_restart"] for r in rounds),
            "updates_applied_in_flight": sum(r["updates_applied_in_flight"] for r in rounds),
            "updates_in_tables": sum(r["updates_in_tables"] for r in rounds),
            "orphan_processes": 0 if violation is None or "orphan" not in violation else 1,
            "violation": violation,
            "duration_s": round(time.monotonic() - self.t0, 1),
            "workdir": str(self.workdir),
            "ok": violation is None,
        }


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python bench/soak.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="time for events (then a drain)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replication", choices=("sync", "async"), default="sync")
    p.add_argument("--ps", type=int, default=3, help="PS at start (scaled within [max(2, ps-1), ps+1])")
    p.add_argument("--workers", type=int, default=2,
                   help="workers at start (scaled within [max(1, workers-1), workers+1])")
    p.add_argument("--events-per-minute", type=float, default=6.0)
    p.add_argument("--skip", type=lambda s: [k for k in s.split(",") if k], default=[],
                   help=f"comma-separated event kinds to leave out ({', '.join(KINDS)})")
    p.add_argument("--records", type=int, default=0,
                   help="records per job (round); default: what the workers train in "
                        "--round-minutes at --pace")
    p.add_argument("--round-minutes", type=float, default=4.0)
    p.add_argument("--files", type=int, default=3)
    p.add_argument("--records-per-shard", type=int, default=500)
    p.add_argument("--batch", type=int, default=100, help="records per worker push")
    p.add_argument("--pace", type=float, default=0.1, help="worker sleep after each push (s)")
    p.add_argument("--counter-ids", type=int, default=20_000)
    p.add_argument("--counter-batch", type=int, default=500)
    p.add_argument("--counter-pause", type=float, default=0.05)
    p.add_argument("--interval-ms", type=float, default=200.0, help="replication interval")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds before a job's first event")
    p.add_argument("--min-round-seconds", type=float, default=45.0,
                   help="start another job only with this much time left")
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument("--workdir", help="default: a new temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the work dir after a clean run")
    args = p.parse_args(argv)
    bad = set(args.skip) - set(KINDS)
    if bad:
        p.error(f"--skip: unknown kind(s) {sorted(bad)}")
    if not args.records:
        per_worker = args.batch / (args.pace + 0.05)  # a push takes ~50 ms on 2 busy cores
        args.records = int(min(args.minutes, args.round_minutes) * 60 * per_worker * args.workers * 0.7)
    if args.ps < 2:
        p.error("--ps must be at least 2 (a PS kill needs a live ring peer)")
    if args.workers < 1 or args.events_per_minute <= 0 or args.minutes <= 0:
        p.error("--workers, --events-per-minute and --minutes must be positive")
    return args


def reproduce_command(args) -> str:
    parts = [f"python bench/soak.py --seed {args.seed} --minutes {args.minutes}",
             f"--replication {args.replication} --ps {args.ps} --workers {args.workers}",
             f"--events-per-minute {args.events_per_minute}"]
    if args.skip:
        parts.append(f"--skip {','.join(args.skip)}")
    parts.append(f"--records {args.records}")
    return " ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    soak = Soak(args)
    violation, events_run, code = None, 0, 0
    try:
        events_run = soak.run()
    except Violation as exc:
        violation = f"{soak.current}: {exc}"
        code = 1
    except SetupError as exc:
        violation = f"setup: {exc}"
        code = 2
    except KeyboardInterrupt:
        violation = "interrupted"
        code = 2
    finally:
        if soak.round is not None and not soak.round.finished:
            soak.round.abort()
    events_run = events_run or sum(soak.survived.values())
    summary = soak.summary(events_run, violation)
    if violation:
        print(f"SOAK VIOLATION (seed {args.seed}) at {violation}", flush=True)
        print(f"  reproduce: {reproduce_command(args)}", flush=True)
        print(f"  state and logs kept in {soak.workdir} (AIMaster logs: round-*/aimaster-*.log, "
              "member logs: round-*/state/logs/)", flush=True)
    elif not args.keep and not args.workdir:
        shutil.rmtree(soak.workdir, ignore_errors=True)
    (soak.workdir.mkdir(parents=True, exist_ok=True), None)
    (soak.workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
