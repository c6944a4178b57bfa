"""Worker-side runtime shared by the Keras and TF1 integrations (no TensorFlow import).

``WorkerContext`` is one process's membership (lease heartbeats), PS client and data-shard
cursor. ``ShardTracker`` decides when a shard is really DONE: not when its records were
read into the input pipeline, but when the last batch holding them has been trained.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import grpc
import numpy as np

from deeprec_ext.batching import StepBatcher
from deeprec_ext.client import PSClient
from deeprec_ext.data.ranges import BadInput, read_shard
from deeprec_ext.evaluation import EVALUATOR
from deeprec_ext.evaluation import role as process_role
from deeprec_ext.grpc_util import RetryPolicy, call_with_retry
from deeprec_ext.launcher import launcher_alive, watch_launcher
from deeprec_ext.lookahead import Lookahead, match
from deeprec_ext.member import MEMBER_ID_ENV, MasterSession, master_address_from_env
from deeprec_ext.proto import master_pb2
from deeprec_ext.stats import MemberCollector

log = logging.getLogger(__name__)


class ShardTracker:
    """Maps trained batches back to shards.

    The input source hands out shards in order and records the size of every batch it
    emits; batches are trained in that order, so after each trained batch we know exactly
    how many records were trained. A shard is DONE once that count passes its end: not
    when its records were read into the pipeline, which would lose them on a crash. For a
    shard not fully trained the tracker knows where its untrained records begin (the
    position after its last trained record), which is what a leaving worker hands back.
    """

    def __init__(self, report_done: Callable[[list[int]], None],
                 give_back: Callable[[list[int], list[int]], None]):
        self._report_done = report_done
        self._give_back = give_back
        self._lock = threading.Lock()
        # (shard_id, cumulative end, records, hand-out start, next_pos per record)
        self._pending: deque[tuple] = deque()
        self._batches: deque[int] = deque()               # sizes of emitted, untrained batches
        self.handed_out = 0
        self.trained = 0

    def add(self, shard_id: int, records: int, start: int = 0, next_pos=None) -> None:
        """A shard's ``records`` entered the input; ``next_pos[i]`` is where the record
        after record ``i`` begins (``aimaster.shards``), ``start`` the hand-out's start."""
        with self._lock:
            self.handed_out += records
            self._pending.append((shard_id, self.handed_out, records, start, next_pos))

    def emitted(self, batch_records: int) -> None:
        """The input source emitted a batch of this many records."""
        with self._lock:
            self._batches.append(batch_records)

    def advance(self, batches: int = 1) -> int:
        """Record trained batches; reports the shards they completed. Returns records trained."""
        with self._lock:
            n = 0
            for _ in range(min(batches, len(self._batches))):
                n += self._batches.popleft()
            self.trained += n
            done = []
            while self._pending and self._pending[0][1] <= self.trained:
                done.append(self._pending.popleft()[0])
        if done:
            self._report_done(done)
        return n

    def truncate(self, shard_id: int, dropped: int) -> bool:
        """The last ``dropped`` records of a shard were cut off before they were emitted
        (a split: another worker trains them); its end moves back by that much."""
        with self._lock:
            for i, (sid, end, n, start, next_pos) in enumerate(self._pending):
                if sid != shard_id:
                    continue
                if not 0 < dropped <= n:
                    return False
                kept = n - dropped
                self._pending[i] = (sid, end - dropped, kept, start,
                                    next_pos[:kept] if next_pos is not None else None)
                for j in range(i + 1, len(self._pending)):
                    e = self._pending[j]
                    self._pending[j] = (e[0], e[1] - dropped) + e[2:]
                self.handed_out -= dropped
                return True
            return False

    def finish(self, exhausted: bool = False) -> None:
        """End of training: shards not fully trained go back to the master with the
        position where their first untrained record begins, so another worker continues
        exactly there."""
        with self._lock:
            done = [p[0] for p in self._pending if p[1] <= self.trained]
            rest = []
            for sid, end, n, start, next_pos in self._pending:
                if end <= self.trained:
                    continue
                k = min(max(self.trained - (end - n), 0), n)  # records of it trained
                rest.append((sid, int(next_pos[k - 1]) if k and next_pos is not None else start))
            self._pending.clear()
            self._batches.clear()
        if done:
            self._report_done(done)
        if rest:
            self._give_back([s for s, _ in rest], [c for _, c in rest])

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)


class WorkerContext:
    """Membership + PS client + shard cursor of one training process."""

    def __init__(self, master_address: str | None = None, member_id: str | None = None,
                 retry: RetryPolicy = RetryPolicy()):
        self.master_address = master_address_from_env(master_address)
        self.stop_requested = threading.Event()
        self.split_requested = threading.Event()  # a straggler: cut the current shard
        role = process_role()  # "evaluator": the job's evaluator (deeprec_ext.evaluation)
        self.gazer = MemberCollector(role)  # Gazer statistics, sent with each heartbeat
        self.session = MasterSession(self.master_address, role,
                                     member_id if member_id is not None else os.environ.get(MEMBER_ID_ENV, ""),
                                     on_epoch=self._on_epoch, on_stop=self.request_stop,
                                     stall_source=self._take_stall, retry=retry,
                                     stats_source=lambda: self.gazer.collect_bytes(self.worker_id),
                                     on_split=lambda: self.split_requested.set())
        self.session.register()
        self.client = PSClient.connect(self.master_address, timeout=retry.deadline)
        self.session.start()
        self.tracker = ShardTracker(self._report_done, self._give_back)
        self.retry = retry
        self.exhausted = False
        self._closed = False
        self._push_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ps-push")
        self._push_inflight: dict[str, Future] = {}
        self._unacked_steps = 0
        # Overlap mode: pushes go out one step in flight (ElasticCallback(overlap=True)).
        # With fresh_lookups (the default) a push asks the PS for the rows it leaves
        # behind, and a lookup made while it is in flight takes those rows for the ids it
        # shares with it: the next step's lookup overlaps the push yet reads what a
        # synchronous push would have left. Without, a step reads embeddings one step
        # stale (measured: about -0.02 AUC on the example).
        self.async_pushes = False
        self.fresh_lookups = True
        self._push_rows: dict[str, tuple[Future, np.ndarray]] = {}
        self._push_lock = threading.Lock()
        self.batcher = StepBatcher(self.client, self._send_push)
        # the next batch's rows are looked up while a step trains (deeprec_ext.lookahead)
        self.lookahead = Lookahead(self.client)
        if role != EVALUATOR:
            self.batcher.lookahead = self.lookahead
            self.gazer.extra = self.lookahead.fill
        self.batcher.ahead_ok = lambda: self.fresh_lookups or not self.async_pushes

    @property
    def worker_id(self) -> str:
        return self.session.id

    @property
    def rank(self) -> int:
        """The worker's rank; -1 for the evaluator (no rank-0 duty is its)."""
        return -1 if self.session.role == EVALUATOR else self.session.rank

    def lookup(self, table: str, ids, insert_missing: bool = True):
        """Rows of unique ``ids``; tables sharing ids travel in one RPC per PS (StepBatcher).
        The evaluator's lookups never insert, whatever the graph asked (a TF1 training
        graph it scores was built with ``training=True``)."""
        if self.session.role == EVALUATOR:
            insert_missing = False
        with self._push_lock:
            inflight = self._push_rows.get(table)
        if inflight is not None and inflight[0].done():
            inflight = None  # applied before this lookup left: the PS answers fresh rows
        values = self.batcher.lookup(table, ids, insert_missing)
        if inflight is None or table in self.batcher.served_ahead:
            return values  # rows fetched ahead are patched with the push's already
        # the push was in flight while this lookup ran: its ids take the rows it left
        fut, pushed = inflight
        after = fut.result()[table]
        if not pushed.size or not values.size:
            return values
        ids = np.asarray(ids).ravel()
        dst, src = match(pushed, ids)  # the ids the two share, as the lookahead patches
        if dst.size:
            values = np.array(values, copy=True)
            values.reshape(ids.size, -1)[dst] = after[src]
        return values

    def push_async(self, table: str, ids, grads) -> None:
        """Queue a table's gradients (unique ids); a step's pushes leave in one call per PS
        once every table it looked up has pushed (StepBatcher)."""
        if self.session.role == EVALUATOR:
            raise RuntimeError(f"the evaluator must not push (table {table!r}): it scores the "
                               "model read-only")
        self.batcher.push(table, ids, grads)

    def _send_push(self, batch: dict, return_tables=None, wait: bool = True):
        """In overlap mode (``async_pushes``), send without waiting, at most one push in
        flight per table (otherwise synchronously): a table's next push first waits for
        the previous one (and re-raises its error), so a step's lookups see every update
        older than one step (asynchronous PS training).

        ``wait=False`` (overlap mode, the step's one fused call of embedding gradients and
        dense deltas): returns a Future of the values of ``return_tables`` (plus, with
        fresh lookups, the pushed rows of the other tables, which the next step's lookups
        take while the call is in flight)."""
        if not self.async_pushes or (return_tables and wait):
            out = self.client.push_many(batch, unique=True, return_tables=return_tables)
            if wait:
                return out
            done: Future = Future()
            done.set_result(out)
            return done
        with self._push_lock:
            prev = {id(f): f for f in (self._push_inflight.get(t) for t in batch) if f is not None}
        for f in prev.values():
            f.result()
        fresh = self.fresh_lookups
        keep = set(return_tables or ())
        rows = [t for t in batch if t not in keep]  # the embedding tables of the call
        if return_tables:
            fut = self._push_pool.submit(self.client.push_many, batch, unique=True,
                                         return_tables=keep | set(rows if fresh else ()))
        else:
            fut = self._push_pool.submit(self.client.push_many, batch, unique=True,
                                         return_values=fresh)
        with self._push_lock:
            for t, (ids, _) in batch.items():
                self._push_inflight[t] = fut
                if fresh and t in rows:
                    self._push_rows[t] = (fut, np.asarray(ids).ravel())
        return None if wait else fut

    def step_done(self, steps: int = 1) -> None:
        """A training step ended. Its pushes may still be in flight, so its records count
        as trained at the next step end or ``settle`` (earlier steps' pushes are
        acknowledged by then: one push in flight per table)."""
        self.gazer.steps_done(steps)
        self.batcher.end_step()
        if self.batcher.carry:  # a push held since an earlier step end is due now
            self.batcher.flush(older=True)
            self.batcher.steps_done += 1
        with self._push_lock:
            acked, self._unacked_steps = self._unacked_steps, steps
        if acked:
            self.record_steps(acked, self.tracker.advance(acked))

    def settle(self) -> None:
        """Wait for in-flight pushes, then count every ended step as trained. Called at
        the end of training and by the input source before it waits for shards (which
        otherwise could wait on this worker's own last shard)."""
        self.batcher.end_step()
        self.batcher.flush()  # carry mode: the push held for a next lookup leaves now
        with self._push_lock:  # the steps ended so far, and the pushes they sent
            acked, self._unacked_steps = self._unacked_steps, 0
            pending = list(self._push_inflight.values())
        for fut in pending:
            fut.result()
        if acked:
            self.record_steps(acked, self.tracker.advance(acked))

    def flush_pushes(self) -> None:
        """Wait until every push sent so far has been applied (re-raises failures)."""
        self.batcher.end_step()
        self.batcher.flush()
        with self._push_lock:  # entries stay: the next push of a table still waits on them
            pending = list(self._push_inflight.values())
        for fut in pending:
            fut.result()

    def request_stop(self) -> None:
        """Leave the job at the next step boundary (AIMaster scale-in, or SIGTERM)."""
        if not self.stop_requested.is_set():
            log.info("worker %s asked to leave: finishing the current step", self.worker_id)
            self.stop_requested.set()

    def _take_stall(self) -> float:
        client = getattr(self, "client", None)
        return client.take_max_stall_ms() if client is not None else 0.0

    def _on_epoch(self, epoch: int) -> None:
        client = getattr(self, "client", None)
        if client is not None and client.routing is not None and client.routing.epoch < epoch:
            threading.Thread(target=client.refresh_routing, args=(epoch,), daemon=True).start()

    def record_steps(self, steps: int, samples: int) -> None:
        self.session.steps += steps
        self.session.samples += samples

    # -- data shards ------------------------------------------------------------------
    def try_next_shard(self) -> master_pb2.GetShardResponse:
        """Ask once: SHARD (assigned to us), WAIT (others still hold shards) or FINISHED."""
        req = master_pb2.GetShardRequest(worker_id=self.worker_id)
        resp = call_with_retry(lambda: self.session.stub.GetShard(req, timeout=10),
                               "get shard", self.retry)
        if resp.status == master_pb2.GetShardResponse.FINISHED:
            self.exhausted = True
        return resp

    def _report_done(self, shard_ids: list[int]) -> None:
        req = master_pb2.ReportShardRequest(worker_id=self.worker_id, done_shard_ids=shard_ids)
        try:
            call_with_retry(lambda: self.session.stub.ReportShard(req, timeout=10),
                            "report shards", self.retry)
        except grpc.RpcError as exc:
            # FAILED_PRECONDITION: the master gave the shard to someone else after our lease
            # lapsed; that worker will train it, so nothing is lost.
            log.warning("shards %s not accepted as done: %s", shard_ids, exc.details())

    def report_bad_input(self, shard_id: int, entries: list[dict], fatal: bool) -> None:
        """Tell the AIMaster about bad input in a DOING shard (``data.on_bad_record``)."""
        for e in entries:
            log.warning("bad input in shard %d: %s at %d: %s", shard_id, e["path"], e["offset"],
                        e["reason"])
        req = master_pb2.ReportShardRequest(
            worker_id=self.worker_id, bad_input_fatal=fatal,
            bad_records=[master_pb2.BadRecord(shard_id=shard_id, path=e["path"], offset=e["offset"],
                                              reason=e["reason"], count=e.get("count", 1))
                         for e in entries])
        try:
            call_with_retry(lambda: self.session.stub.ReportShard(req, timeout=10),
                            "report bad input", self.retry)
        except grpc.RpcError as exc:
            log.warning("could not report bad input of shard %d: %s", shard_id, exc.details())

    def _give_back(self, shard_ids: list[int], positions: list[int]) -> None:
        req = master_pb2.ReportShardRequest(worker_id=self.worker_id, returned_shard_ids=shard_ids,
                                            returned_positions=positions)
        try:
            self.session.stub.ReportShard(req, timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not return shards %s: %s", shard_ids, exc.details())

    def split_shard(self, shard_id: int, position: int) -> bool:
        """Offer the AIMaster a cut of a shard at ``position`` (the end of the last record
        this worker keeps); True when it was made: the records from there on are no
        longer this worker's to train."""
        req = master_pb2.ReportShardRequest(worker_id=self.worker_id,
                                            split_shard_ids=[shard_id],
                                            split_positions=[int(position)])
        try:
            resp = self.session.stub.ReportShard(req, timeout=10)
        except grpc.RpcError as exc:  # not cut: this worker trains the whole shard
            log.warning("could not split shard %d: %s", shard_id, exc.details())
            return False
        return shard_id in resp.split_shard_ids

    def put_model(self, spec: dict) -> None:
        """Send the model's structure to the AIMaster (rank 0 does, once): it goes into every
        checkpoint, so ``aimaster export`` rebuilds the model from a checkpoint alone."""
        req = master_pb2.PutModelRequest(worker_id=self.worker_id, model_json=json.dumps(spec))
        try:
            call_with_retry(lambda: self.session.stub.PutModel(req, timeout=30), "put model",
                            self.retry)
        except grpc.RpcError as exc:  # training goes on; the export will say what is missing
            log.warning("could not record the model's structure for export: %s", exc.details())

    def wait_all_done(self, timeout: float = 3600.0, poll_seconds: float = 0.5) -> bool:
        """Block until every shard of the job is DONE and every other worker has finished
        (sent its final dense delta and left), e.g. before a final evaluation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.session.stub.Status(master_pb2.StatusRequest(), timeout=10)
            others = [m for m in st.members if m.role == "worker" and m.id != self.worker_id
                      and m.state == "running"]
            if st.shards.todo == 0 and st.shards.doing == 0 and not others:
                return True
            time.sleep(poll_seconds)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.settle()
        self.lookahead.close()
        self._push_pool.shutdown()
        self.tracker.finish()
        self.client.close()
        self.session.close("finished")


class ShardReader:
    """Reads shards (``deeprec_ext.data.ranges``: one ``pread`` of the byte range for
    text and TFRecord, whatever the shard's place in the file). The last shard read is
    kept, so a virtual worker that reads a shard in steps reads it once."""

    def __init__(self):
        self._key, self._value = None, None

    def read(self, shard, bad: list | None = None, kinds: dict | None = None,
             null_values: dict | None = None) -> tuple[list[bytes], object]:
        """``(records, next_pos)`` of a ``master_pb2.Shard`` (or ``aimaster.shards.Shard``).
        Bad input raises ``BadInput``, or with ``bad`` (``on_bad_record: skip``) is left
        out and listed there (``deeprec_ext.data.ranges.read_shard``). With ``kinds``
        (``{column: kind}``) a Parquet shard's records are typed columns
        (``deeprec_ext.data.columns.ColumnRows``)."""
        fmt = getattr(shard, "format", "") or "text"
        key = (shard.path, shard.start, shard.end, fmt, kinds is not None)
        if key != self._key and kinds is not None:
            self._value = _read_columns(shard, fmt, bad, kinds, null_values)
            self._key = key
        elif key != self._key:
            self._value = read_shard(shard.path, shard.start, shard.end, fmt,
                                     getattr(shard, "size", 0) or None, bad=bad,
                                     fields=getattr(shard, "fields", 0),
                                     delimiter=(getattr(shard, "delimiter", "") or "\t").encode())
            self._key = key
        return self._value

    def close(self) -> None:
        self._key, self._value = None, None


def _read_columns(shard, fmt: str, bad: list | None, kinds: dict, null_values: dict | None):
    from deeprec_ext.data.columns import ColumnRows
    from deeprec_ext.data.ranges import _guarded, parquet_columns
    if fmt != "parquet":
        raise BadInput(shard.path, shard.start, f"shard_dataset(columns=...) reads Parquet "
                       f"files only, and this file is read as {fmt!r} (data.format)")
    start, end = int(shard.start), int(shard.end)

    def read():
        return parquet_columns(shard.path, start, end, kinds, null_values)
    try:
        flat = _guarded(read, shard.path, start, bad)
    except BadInput as exc:  # a column missing or retyped in this file
        if bad is None:
            raise
        bad.append(exc.as_dict())
        flat = None
    rows = ColumnRows(kinds, flat)
    return rows, np.arange(start + 1, start + 1 + len(rows), dtype=np.int64)


def _read_checked(ctx: "WorkerContext", reader: ShardReader, shard, kinds: dict | None = None,
                  null_values: dict | None = None):
    """Read a shard under ``data.on_bad_record``: ``skip`` reports what was left out and
    returns the rest; ``fail`` (and a shard without the setting) reports the first
    problem, which fails the job, and raises it."""
    skip = shard.on_bad_record == "skip"
    bad: list | None = [] if skip else None
    try:
        records, next_pos = reader.read(shard, bad, kinds, null_values)
    except BadInput as exc:
        ctx.report_bad_input(shard.shard_id, [exc.as_dict()], fatal=True)
        raise
    if bad:
        ctx.report_bad_input(shard.shard_id, bad, fatal=False)
    return records, next_pos


def shard_batches(ctx: "WorkerContext", batch_size: int, poll_seconds: float = 0.2,
                  kinds: dict | None = None, null_values: dict | None = None, first=None):
    """Batches (lists of lines) of the shards handed to this worker, in order. With
    ``kinds`` (``{column: kind}``) batches of typed columns of Parquet shards
    (``ColumnRows``); ``first``: a ``GetShardResponse`` already taken, used first.

    Flushes a short batch before waiting for more shards (a worker whose last records sat
    in an unfinished batch would otherwise wait for shards other workers hold while they
    wait for it) and stops taking shards once the worker is asked to leave.
    """
    from deeprec_ext.data.columns import ColumnRows
    reader = ShardReader()
    buf = [] if kinds is None else ColumnRows(kinds)
    cur = None  # (shard, next_pos, records): the shard whose records end ``buf``

    def emit(n):
        nonlocal buf
        out, buf = buf[:n], buf[n:]
        ctx.tracker.emitted(len(out))
        return out

    def maybe_split():
        """The AIMaster asked (a straggler, or the tail of the data): cut the current
        shard after the last record emitted, if at least a batch is left to hand on."""
        nonlocal buf, cur
        if not ctx.split_requested.is_set():
            return
        ctx.split_requested.clear()
        if cur is None:
            return
        s, next_pos, n = cur
        rest = min(len(buf), n)
        kept = n - rest
        if kept < 1 or rest < batch_size:
            return
        if ctx.split_shard(s.shard_id, int(next_pos[kept - 1])):
            buf = buf[:len(buf) - rest]
            ctx.tracker.truncate(s.shard_id, rest)
            cur = (s, next_pos[:kept], kept)
            ctx.tracker.advance(0)  # its kept records may all be trained already: DONE

    try:
        while not ctx.stop_requested.is_set():
            resp, first = (first, None) if first is not None else (ctx.try_next_shard(), None)
            if resp.status == master_pb2.GetShardResponse.SHARD:
                s = resp.shard
                records, next_pos = _read_checked(ctx, reader, s, kinds, null_values)
                reader.close()
                buf.extend(records)
                ctx.tracker.add(s.shard_id, len(records), s.start, next_pos)
                cur = (s, next_pos, len(records))
                if not records:  # a range inside one long record: DONE once those before are
                    ctx.tracker.advance(0)
                while len(buf) >= batch_size and not ctx.stop_requested.is_set():
                    yield emit(batch_size)
                    maybe_split()
                cur = None
                continue
            if buf:
                yield emit(len(buf))
            if resp.status == master_pb2.GetShardResponse.FINISHED:
                return
            ctx.settle()  # our own last shard may be what the others wait for
            time.sleep(poll_seconds)
    finally:
        reader.close()


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def _on_sigterm(*_):
    """Preemption notice: leave cleanly at the next step boundary. A second SIGTERM, or
    one arriving after the local launcher (the AIMaster) died, exits at once: the job is
    gone, or the sender has run out of patience."""
    if not launcher_alive():
        os._exit(143)
    if _context is None or _context.stop_requested.is_set():
        os._exit(143)
    _context.request_stop()
    # the launcher may be dying right now (the kernel's death signal comes while it exits)
    watch_launcher(lambda: os._exit(143))


def _exit_on_uncaught(exc_type, exc, tb) -> None:
    """A training script that dies of an exception exits now, with the traceback printed:
    TensorFlow's interpreter teardown (tf.data and gRPC threads) can otherwise hold a
    crashed worker for tens of seconds, heartbeating and holding its shards, before the
    AIMaster learns of the failure and hands its data to another worker."""
    _previous_excepthook(exc_type, exc, tb)
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


_previous_excepthook = sys.excepthook


def get_context() -> WorkerContext:
    """This process's WorkerContext, created on first use from the environment
    (DEEPREC_MASTER_ADDR, DEEPREC_MEMBER_ID) that the AIMaster's launcher sets."""
    global _context
    with _context_lock:
        if _context is None:
            _context = WorkerContext()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _on_sigterm)
                if sys.excepthook is sys.__excepthook__:  # not if the user installed one
                    sys.excepthook = _exit_on_uncaught
        return _context


def set_context(ctx: WorkerContext | None) -> None:
    """Install a context explicitly (tests, or a process that builds its own)."""
    global _context
    with _context_lock:
        _context = ctx
