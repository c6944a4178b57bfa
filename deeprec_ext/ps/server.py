"""The ParameterServer gRPC service over an EmbeddingStore. numpy + grpc only: no TensorFlow.

Every request is validated in full (ids, payload sizes, table names, dims, finiteness,
slot ownership) before any table is touched, so a rejected request changes nothing.
Errors cross the wire as status codes with a message naming the problem.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

import grpc
import numpy as np
import psutil

from deeprec_ext import codec, errors, rowwire, table_spec
from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.grpc_util import ROUTING_EPOCH_KEY
from deeprec_ext.hashing import DEFAULT_NUM_SLOTS, slot_of
from deeprec_ext.proto import gazer_pb2, ps_pb2, ps_pb2_grpc
from deeprec_ext.ps import validation
from deeprec_ext.ps.gate import ReadWriteGate
from deeprec_ext.ps.replication import (BASE_KEY, KIND_KEY, PROMOTE_WAIT_SECONDS, AppliedRequests,
                                        ApplyGate, ReplicaRefused, ReplicaSet, ReplicaUnavailable,
                                        Replicator, table_config)
from deeprec_ext.stats import MemberCollector, RpcStats
from deeprec_ext.store import EmbeddingStore, LogTrimmed
from deeprec_ext.store.policies import is_candidate_table

log = logging.getLogger(__name__)

IMPORT_ROWS = "/deeprec_ext.ps.ParameterServer/ImportRows"
SEED_FROM_REPLICA = "/deeprec_ext.ps.ParameterServer/SeedFromReplica"


class Routing:
    """This PS's view of slot ownership. ``owned is None`` means "owns every slot"
    (a standalone PS without an AIMaster)."""

    def __init__(self):
        self.epoch = 0
        self.num_slots = DEFAULT_NUM_SLOTS
        self.owned: np.ndarray | None = None
        self.gate = ReadWriteGate()
        # keys looked up per slot (placement balances by access rate); only the totals
        # matter, so a rare lost update between threads is harmless and takes no lock
        self.lookups_per_slot = np.zeros(DEFAULT_NUM_SLOTS, dtype=np.int64)
        self.counting_since = time.monotonic()
        # the ``owned`` array known to hold every slot (a lone PS): a push to it needs no
        # per-key slot hash (compared by identity, so a racing set() never wrongly skips)
        self._owns_all: np.ndarray | None = None

    def _adopt(self, epoch: int, num_slots: int, owned: np.ndarray | None) -> None:
        if num_slots != self.lookups_per_slot.size:
            self.lookups_per_slot = np.zeros(num_slots, dtype=np.int64)
        self._owns_all = owned if owned is not None and bool(np.all(owned)) else None
        self.epoch, self.num_slots, self.owned = epoch, num_slots, owned

    def set(self, epoch: int, num_slots: int, owned: np.ndarray) -> None:
        self.gate.acquire_exclusive()
        try:
            self._adopt(epoch, num_slots, owned)
        finally:
            self.gate.release_exclusive()

    def advance(self, epoch: int, num_slots: int, owned: np.ndarray) -> bool:
        """``set``, only if ``epoch`` is newer than the current one (epochs never go back)."""
        self.gate.acquire_exclusive()
        try:
            if epoch <= self.epoch:
                return False
            self._adopt(epoch, num_slots, owned)
            return True
        finally:
            self.gate.release_exclusive()

    def check(self, ids: np.ndarray, context, count: bool = False) -> None:
        owned, num_slots, epoch = self.owned, self.num_slots, self.epoch
        if owned is None or ids.size == 0 or (not count and owned is self._owns_all):
            return
        slots = slot_of(ids, num_slots)
        if count:
            counts = self.lookups_per_slot
            if counts.size == num_slots:
                counts += np.bincount(slots, minlength=num_slots)
        ok = owned[slots]
        if not ok.all():
            bad = int(ids[np.argmin(ok)])
            context.set_trailing_metadata(((ROUTING_EPOCH_KEY, str(epoch)),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale routing: key {bad} is not owned by this PS at epoch {epoch}")


def set_malloc_mmap_threshold(nbytes: int | None) -> None:
    """The process's fixed malloc mmap threshold (``ps.__main__`` sets one): the checkpoint
    writer sizes an incremental's chunks under it. Here because the PS server is the one
    part of ``deeprec_ext`` that drives the checkpoint package."""
    from checkpoint.writer import set_malloc_mmap_threshold as tell_writer
    tell_writer(nbytes)


@validation.answers_refusals(ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"])
class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, ps_id: str = "ps", store: EmbeddingStore | None = None,
                 memory_limit_bytes: int = 0, migration_share: float = 1.0,
                 seed_from_replica: bool = True):
        self.ps_id = ps_id
        # a snapshot round to this PS's ring peer is taken from the peer's copy of it
        # (``SeedFromReplica``) instead of being streamed
        self.seed_from_replica = bool(seed_from_replica)
        if not 0.0 < migration_share <= 1.0:
            raise ValueError(f"migration_share must be in (0, 1], got {migration_share!r}")
        self.migration_share = float(migration_share)
        self.memory_limit_bytes = int(memory_limit_bytes)
        self.store = store if store is not None else EmbeddingStore()
        self.routing = Routing()
        self.counters = {"lookups": 0, "pushes": 0, "rejected": 0}
        self._counter_lock = threading.Lock()
        self._data_calls = 0  # lookups and pushes in flight (migration yields to them)
        # notified when the last call in flight ends: a yielding migration wakes then
        self._data_calls_lock = threading.Condition()
        self._paced_rounds = 0  # snapshot rounds of migrations running now (one pace budget)
        self._configs: dict[str, ps_pb2.TableConfig] = {}
        # warm start: tables restored from another job's checkpoint, which take the config
        # of this job's first CreateTable (name -> checkpoint it came from)
        self._warm: dict[str, str] = {}
        self._create_lock = threading.Lock()
        self.applied = AppliedRequests()
        # pushes apply rows and record their request id under the shared side; a shipment
        # to the peer reads rows and ids under the exclusive side (they always match)
        self.apply_gate = ApplyGate()
        self.replicator = Replicator(self.store, self._configs, self.applied, self.apply_gate)
        self.replicator.pace_factory = self._full_copy_pace
        self.replicas = ReplicaSet()
        # incremental checkpoints read the logs from the cut of this PS's previous part:
        # keep them from the start until this PS wrote one (bounded by the hard caps)
        self.store.set_consumer("checkpoint", 0)
        self._ckpt_cuts: list[int] = []
        self._migrations: dict[str, float] = {}  # destination -> last catch-up round
        self._merger: threading.Thread | None = None  # background merge of promoted rows
        self._merge_again = False
        self._sync_lock = threading.Lock()
        # Gazer: RPC histograms (filled by deeprec_ext.stats.StatsInterceptor on the
        # server), tables and replication lag, sent with every heartbeat and in Stats
        self.rpc_stats = RpcStats()
        self.gazer = MemberCollector("ps", self.rpc_stats, extra=self._gazer_extra)
        # eviction policies run in the background (started with the first such table)
        self._evictor: threading.Thread | None = None
        self._evict_stop = threading.Event()
        self._evicted_at: dict[str, float] = {}

    # -- helpers ---------------------------------------------------------------------
    # Migration yields to training: between the chunks of a background round (snapshot,
    # catch-up; not the last round, which runs with slots fenced) the source waits while
    # lookups or pushes are in flight on this PS, up to this long per chunk, so a bulk
    # copy takes the CPU and the table lock between training requests, not ahead of them.
    MIGRATE_YIELD_SECONDS = 0.02

    def _yield_to_training(self) -> None:
        # woken by the call that ends last, not by polling: a 1 ms poll took the GIL
        # from the serving threads up to 1,000 times a second per waiting migration thread
        with self._data_calls_lock:
            self._data_calls_lock.wait_for(lambda: self._data_calls <= 0,
                                           self.MIGRATE_YIELD_SECONDS)

    def _full_copy_pace(self):
        """Pacing of a background full copy to the ring peer: the migration's share of
        the wall time, and a wait while training calls are in flight, between chunks."""
        pacer = self._Pacer(self.migration_share)

        def pace():
            pacer.pace()
            self._yield_to_training()
        return pace

    class _Pacer:
        """Duty cycle of a background migration round: after each chunk (exported, and
        taken by the destination: the stream's flow control makes a slow importer show up
        here as time spent) it sleeps so that the round is busy at most ``share`` of the
        wall time. Yielding only while training calls are in flight is not enough on a
        small machine: between two steps the copy takes every core and the next step
        waits for the CPU, not for a lock. The share is the PS's, not each stream's: with
        ``streams()`` paced rounds running at once (a scale-in sends to every remaining PS)
        each one sleeps that many times longer."""

        def __init__(self, share: float, streams=lambda: 1):
            self.share = share
            self.streams = streams
            self.mark = time.monotonic()

        def pace(self) -> None:
            if self.share < 1.0:
                busy = time.monotonic() - self.mark
                wait = busy * (max(self.streams(), 1) - self.share) / self.share
                time.sleep(min(wait, 1.0))
            self.mark = time.monotonic()

    @contextlib.contextmanager
    def _paced_round(self, paced: bool):
        """Counts the paced rounds running at once (``_Pacer`` shares the PS's budget)."""
        if not paced:
            yield
            return
        with self._data_calls_lock:
            self._paced_rounds += 1
        try:
            yield
        finally:
            with self._data_calls_lock:
                self._paced_rounds -= 1

    def _data_call(self, delta: int) -> None:
        with self._data_calls_lock:
            self._data_calls += delta
            if self._data_calls <= 0 < -delta:
                self._data_calls_lock.notify_all()

    def _count(self, key: str) -> None:
        with self._counter_lock:
            self.counters[key] += 1

    def _reject(self, context, code, message: str):
        self._count("rejected")
        context.abort(code, message)

    def _table(self, name: str, context):
        try:
            return self.store.get(name)
        except KeyError:
            self._reject(context, grpc.StatusCode.NOT_FOUND, f"unknown table '{name}'")

    # -- RPCs ------------------------------------------------------------------------
    def CreateTable(self, request, context):
        cfg = request.config
        try:
            init, opt = validation.table_config(cfg)
            if is_candidate_table(cfg.name):
                raise InvalidRequestError(f"table '{cfg.name}': names ending in "
                                          f"'::admission' are reserved for admission counters")
            policies = table_spec.policies(cfg)
            init_ids = codec.ids_from_bytes(request.init_ids, "init_ids")
            init_values = codec.floats_from_bytes(request.init_values, init_ids.size, cfg.dim,
                                                  "init_values")
            if init_ids.size and not np.isfinite(init_values).all():
                raise InvalidRequestError(f"table '{cfg.name}': init_values contain NaN or Inf")
            with self._create_lock:
                existed = cfg.name in self.store.tables()
                source = self._warm.pop(cfg.name, None)
                if source is not None:
                    self._adopt_warm_table(cfg, init, opt, source)
                    self.store.set_policies(cfg.name, **policies)
                table = self.store.create_table(cfg.name, cfg.dim, init, opt, **policies)
            if init_ids.size:
                table.insert(init_ids, init_values, only_if_absent=True)
        except (ValueError, TypeError) as exc:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if source is not None:
            self._configs[cfg.name] = cfg
        self._configs.setdefault(cfg.name, cfg)
        self._start_evictor()
        return ps_pb2.CreateTableResponse(created=not existed)

    def _adopt_warm_table(self, cfg, init, opt, source: str) -> None:
        """The job's first CreateTable of a table restored from ``source``: same dim or a
        clear error; the job's initializer and optimizer replace the checkpoint's (the
        slots are kept when the optimizer kind is the same)."""
        table = self.store.get(cfg.name)
        if table.dim != cfg.dim:
            self._warm[cfg.name] = source  # still warm: the error repeats for every worker
            raise InvalidRequestError(
                f"table '{cfg.name}': the job asks for dim {cfg.dim}, but the warm-start "
                f"checkpoint {source} has dim {table.dim}; use the same dim, or another "
                f"table name to start that table fresh")
        if self.store.reconfigure(cfg.name, cfg.dim, init, opt):
            log.warning("%s: table '%s': optimizer changed from the warm-start checkpoint's; "
                        "its slots start fresh", self.ps_id, cfg.name)

    def ListTables(self, request, context):
        names = set(self.store.user_tables())
        return ps_pb2.ListTablesResponse(tables=[c for n, c in self._configs.items() if n in names])

    def Lookup(self, request, context):
        self._count("lookups")
        carried = request.HasField("push")
        if carried:
            self._count("pushes")
        self._data_call(1)
        self.routing.gate.acquire_shared()
        try:
            return self._lookup(request, context, carried)
        finally:
            self.routing.gate.release_shared()
            self._data_call(-1)

    def _lookup(self, request, context, carried: bool = False):
        work = []
        for t in request.tables:
            table = self._table(t.table, context)
            try:
                ids = codec.ids_from_bytes(t.ids, f"table '{t.table}' ids")
            except InvalidRequestError as exc:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.routing.check(ids, context, count=True)
            work.append((table, ids))
        # the previous step's push carried here: every lookup part was checked above, the
        # push's parts are checked before it applies, and it applies before any read, so
        # the rows answered are those a waited push would have left
        pushed = self._push(request.push, context) if carried else None
        out = [codec.floats_to_bytes(table.lookup(ids, insert_missing=request.insert_missing))
               for table, ids in work]
        return ps_pb2.LookupResponse(values=out, push=pushed)

    def Push(self, request, context):
        self._count("pushes")
        self._data_call(1)
        self.routing.gate.acquire_shared()
        try:
            return self._push(request, context)
        finally:
            self.routing.gate.release_shared()
            self._data_call(-1)

    def decode_updates(self, tables, context, what: str = "update",
                       unique: bool = False) -> list:
        """[(table, ids, values)] of TableUpdate messages, every one checked (finite values,
        owned keys; with ``unique``, no repeated id) before any is applied: a bad one is
        answered INVALID_ARGUMENT naming it, and nothing changes."""
        work = []
        for t in tables:
            table = self._table(t.table, context)
            try:
                ids = codec.ids_from_bytes(t.ids, f"table '{t.table}' ids")
                vals = codec.floats_from_bytes(t.values, ids.size, table.dim,
                                               f"table '{t.table}' values")
                if not np.isfinite(vals).all():
                    raise InvalidRequestError(
                        f"table '{t.table}': gradients contain NaN or Inf; {what} rejected")
                if unique and ids.size > 1 and np.unique(ids).size != ids.size:
                    raise InvalidRequestError(f"table '{t.table}': ids of one {what} must be unique")
            except InvalidRequestError as exc:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.routing.check(ids, context)
            work.append((table, ids, vals))
        return work

    def _push(self, request, context):
        work = self.decode_updates(request.tables, context)
        rid = request.request_id
        only = set(request.return_tables)
        returns = [request.return_values and (not only or t.table in only) for t in request.tables]
        sync = self.replicator.sync and self.replicator.peer
        if rid and self.applied.seen(rid):  # a resend of a push already applied here
            if sync:
                # acknowledged only once the peer holds it: the first attempt's shipment
                # may have failed (it was answered UNAVAILABLE), so ship rows and id again
                with self._sync_lock:
                    self._ship_sync(work, rid, context)
            return ps_pb2.PushResponse(
                values=[codec.floats_to_bytes(t.lookup(i, insert_missing=False)) if r else b""
                        for (t, i, _), r in zip(work, returns)]
                if request.return_values else [], sequence=self.store.sequence.value)
        if sync:
            # synchronous replication: answer only once the peer holds these rows; one
            # push at a time so the peer sees the rows in the order they were written
            with self._sync_lock:
                with self.apply_gate.shared():
                    out = self._apply(work, returns, request.step_id)
                    self.applied.add(rid)
                self._ship_sync(work, rid, context)
        else:
            with self.apply_gate.shared():  # rows and request id reach the peer together
                out = self._apply(work, returns, request.step_id)
                self.applied.add(rid)
        return ps_pb2.PushResponse(values=out, sequence=self.store.sequence.value)

    def _ship_sync(self, work, rid: str, context) -> None:
        """Send a push's rows (every table) and its request id to the peer in one stream,
        which the peer applies whole or not at all."""
        try:
            self.replicator.ship_push([(table.name, ids) for table, ids, _ in work], rid)
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"applied, but replica {self.replicator.peer} unreachable: "
                          f"{exc.code().name}")

    @staticmethod
    def _apply(work, returns: list[bool], step_id: str = "") -> list[bytes]:
        update = step_id or None  # parts of one push call: one optimizer step
        out = []
        for (table, ids, vals), ret in zip(work, returns):
            if ret:  # one index probe for the update and the answer
                out.append(codec.floats_to_bytes(table.apply_and_lookup(ids, vals, update)))
            else:
                table.apply_gradients(ids, vals, update)
                out.append(b"")
        return out if any(returns) else []

    @staticmethod
    def _check_routing(request) -> np.ndarray:
        """A SetRoutingRequest's owned slots, every field checked (raises the validation
        error the caller answers with)."""
        owned = validation.slot_mask(request.owned_slots, request.num_slots, field="owned_slots")
        if request.ps_id:  # with a ps_id the replication settings apply: checked first
            # (a NaN interval made the replication thread spin, an infinite one killed it)
            validation.seconds(request.replication_interval_ms, "replication_interval_ms",
                               0.0, 3_600_000.0)
            if request.replica_peer:
                validation.address(request.replica_peer, "replica_peer")
        return owned

    def SetRouting(self, request, context):
        owned = self._check_routing(request)
        if not self._apply_routing(request, owned):
            # a push that lost a race with a newer one (or a restarted master that does not
            # know the PS's epoch): applying it would move routing backwards
            errors.abort(context, grpc.StatusCode.FAILED_PRECONDITION, errors.ErrorKind.STALE_EPOCH,
                         f"routing epoch {request.epoch} is not newer than this PS's epoch "
                         f"{self.routing.epoch}", ((ROUTING_EPOCH_KEY, str(self.routing.epoch)),))
        return ps_pb2.SetRoutingResponse()

    def _apply_routing(self, request, owned: np.ndarray) -> bool:
        """Ownership and the replication ring of a checked SetRoutingRequest; False (and
        nothing changed) when its epoch is not newer than this PS's."""
        if not self.routing.advance(request.epoch, request.num_slots, owned.astype(bool)):
            return False
        self.store.set_routing_slots(request.num_slots)
        self.replicas.num_slots = request.num_slots  # copies arriving note rows' slots
        if request.ps_id:
            self.ps_id = request.ps_id
            self.replicator.configure(request.ps_id, request.replica_peer,
                                      request.replication_interval_ms or 200.0,
                                      request.sync_replication)
        log.info("%s: routing epoch %d, owns %d/%d slots", self.ps_id, request.epoch,
                 int(owned.sum()), request.num_slots)
        if request.ps_id and request.sync_replication and self.replicator.taking_over():
            # a prepared copy becomes the peer's: with synchronous replication, the pushes
            # acknowledged since its last delta reach it before this answer (the routing
            # change is not published while a failure here could lose them)
            self.replicator.switch_now(self.SWITCH_SHIP_SECONDS)
        return True

    SWITCH_SHIP_SECONDS = 5.0  # within the AIMaster's 10 s for a routing push
    PREPARE_WAIT_MAX_SECONDS = 3600.0

    def PrepareReplica(self, request, context):
        """Make-before-break (``PrepareReplicaRequest``): keep a copy of this PS on the peer
        a routing change is about to give it, and wait (bounded by the request and the
        caller's deadline) for that copy to be complete."""
        wait = validation.seconds(request.wait_seconds, "wait_seconds", 0.0,
                                  self.PREPARE_WAIT_MAX_SECONDS)
        if not request.peer:
            self.replicator.cancel_prepared()
            return ps_pb2.PrepareReplicaResponse(complete=False, sequence=-1)
        validation.address(request.peer, "peer")
        scope = self._slot_mask(request.slots, request.num_slots, context, routed=True) \
            if request.slots else None
        try:
            complete, seq = self.replicator.prepare(
                request.peer, min(wait, validation.within_deadline(context, wait)),
                origin=request.ps_id, scope=scope, caller_waits=context.is_active)
        except ValueError as exc:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, f"prepare replica: {exc}")
        except ReplicaUnavailable as exc:
            self._reject(context, grpc.StatusCode.UNAVAILABLE, f"prepare replica: {exc}")
        return ps_pb2.PrepareReplicaResponse(complete=complete, sequence=seq)

    # -- live migration -------------------------------------------------------------------
    MIGRATE_CHUNK_ROWS = 1 << 14  # rows per streamed batch / per table-lock hold
    CATCHUP_UNPACED_ROWS = 2 * MIGRATE_CHUNK_ROWS  # a catch-up round's rows sent before pacing

    def _slot_mask(self, raw: bytes, num_slots: int, context, routed: bool = False) -> np.ndarray:
        """A request's slot mask; ``routed``: it must be over this PS's routing slots (once
        it has routing), else it would name other keys than the caller means."""
        expected = self.routing.num_slots if routed and self.routing.owned is not None else None
        return validation.slot_mask(raw, num_slots, expected)

    def MigrateSlots(self, request, context):
        """Send rows of the given slots written after ``since_seq`` to ``dst_address``.

        The watermark is read before scanning: a row written during the scan has a larger
        sequence number and is sent again by the next round, so no write is missed.
        """
        mask = self._slot_mask(request.slots, request.num_slots, context, routed=True)
        validation.address(request.dst_address, "dst_address")
        if request.dst_replica_after:
            validation.address(request.dst_replica_after, "dst_replica_after")
        if request.fence_epoch:  # before the watermark: every write it lets in is then sent
            self._fence(request, mask, context)
        if request.since_seq < 0 and not request.send_request_ids and self.seed_from_replica:
            seeded = self._seed_at_destination(request, mask, context)
            if seeded is not None:
                return seeded
        watermark = self.store.sequence.value
        since = None if request.since_seq < 0 else request.since_seq
        totals = {"rows": 0, "bytes": 0, "deleted": 0, "request_ids": 0}
        background = not request.send_request_ids  # the last round runs fenced: no yielding
        # The snapshot is paced; a catch-up round only past its first CATCHUP_UNPACED_ROWS.
        # Small rounds run at full speed, or more rows would change meanwhile and the
        # deltas stop shrinking (the fenced last round grows with them). The first
        # catch-up carries the rows written during the snapshot, a fifth of it at 4M rows:
        # unpaced, training ran at 0.3-0.5x its steady rate while it lasted, and the
        # event's longest steps fell in it
        paced = background and self.migration_share < 1.0
        pacer = self._Pacer(self.migration_share if paced else 1.0, lambda: self._paced_rounds)

        share = float(np.count_nonzero(mask)) / max(mask.size, 1)
        ids_cursor = f"migrate:{request.dst_address}"

        def batches():
            # RowBatch wire bytes written straight from the exported arrays (rowwire): rows
            # in the store's layout, counts apart, each buffer copied once into the message
            for name, table in sorted(self.store.tables().items()):
                cfg = table_config(self._configs, name, table).SerializeToString()
                deleted = table.tombstones_since(since) if since is not None else np.empty(0, np.int64)
                if deleted.size:
                    deleted = deleted[mask[slot_of(deleted, mask.size)]]
                totals["deleted"] += int(deleted.size)
                # a snapshot announces its rows so the destination sizes its table once;
                # keys hash evenly over slots, so the slots' share of the table (+2%) is
                # close, and counting them exactly would cost a pass over every key
                expected = int(len(table) * share * 1.02) + 64 if since is None else 0
                # the destination's peer after the publish: before the fence only (the
                # destination fixes the slots it holds back from its current peer then)
                yield rowwire.encode(cfg, deleted_ids=deleted, total_rows=expected,
                                     replica_after=request.dst_replica_after if background else "")
                row = 0
                while row is not None:
                    keys, (rows, counts), _, row = table.export_slots(
                        mask, since, row, self.MIGRATE_CHUNK_ROWS, with_counts="apart")
                    if keys.size:
                        totals["rows"] += int(keys.size)
                        totals["bytes"] += rows.nbytes + counts.nbytes + keys.nbytes
                        # rows this round paces (the source) are imported yielding to
                        # training too (the destination): a scale-in's destinations serve
                        # all of it, and its catch-up phase, imported unyielded, ran at
                        # 0.27-0.69x steady and held the event's longest steps
                        yield rowwire.encode(cfg, keys, rows, counts, background=paced and (
                            since is None or totals["rows"] > self.CATCHUP_UNPACED_ROWS))
                    if background and row is not None:
                        if since is None or totals["rows"] > self.CATCHUP_UNPACED_ROWS:
                            pacer.pace()
                        else:  # the duty cycle counts from where pacing starts
                            pacer.mark = time.monotonic()
                        self._yield_to_training()
            ids = self._applied_ids_for(ids_cursor, snapshot=since is None,
                                        last=bool(request.send_request_ids))
            totals["request_ids"] = len(ids)
            if ids:
                yield rowwire.encode(applied_request_ids=ids)

        from deeprec_ext.grpc_util import insecure_channel
        with insecure_channel(request.dst_address) as ch, self._paced_round(paced):
            try:
                # within the caller's deadline: an unreachable destination must not hold
                # this handler (one of the PS's few threads) after the caller gave up
                ch.stream_unary(IMPORT_ROWS, request_serializer=None,  # bytes already
                                response_deserializer=ps_pb2.ImportRowsResponse.FromString)(
                    batches(), timeout=validation.within_deadline(context, 600.0))
            except grpc.RpcError as exc:
                # the ids taken for this round may not have arrived: the next round to
                # this destination sends every remembered id again
                self.applied.close_cursor(ids_cursor)
                context.abort(validation.downstream_code(exc.code()),
                              f"sending rows to {request.dst_address}: {exc.code().name}: "
                              f"{exc.details()}")
        self._migration_consumer(request.dst_address, watermark)
        return ps_pb2.MigrateSlotsResponse(watermark=watermark, **totals)

    def _applied_ids_for(self, cursor: str, snapshot: bool, last: bool) -> list[str]:
        """Ids of applied pushes a migration round sends its destination, so that a push
        resent there after the publish is not applied twice. Every round sends those
        applied since the previous one (the first round, or one after a lost log, every
        remembered id); the fenced last round, after which no push is applied here, then
        sends only the few since the last catch-up. Sent all in the last round, a full
        window (200k ids) held the fence 1-2 s: encoded, parsed and recorded while every
        request for the moving slots waited."""
        a = self.applied
        if snapshot or not a.has_cursor(cursor):
            ids = a.open_cursor(cursor, snapshot=True)
        else:
            ids, lost = a.take_unshipped(cursor)
            if lost:  # more pushes than the window since the last round
                ids = a.open_cursor(cursor, snapshot=True)
        if last:
            a.close_cursor(cursor)
        return ids

    def _seed_at_destination(self, request, mask: np.ndarray, context):
        """A snapshot round to this PS's ring peer, taken by the peer from the copy of this
        PS it holds (``SeedFromReplica``): at a scale-in the leaving PS's peer is one of
        its destinations, and streaming it rows it already holds cost both PS the export,
        the wire and the parse of every one of them. The logs are kept from what the copy
        holds for sure (the replication's shipped sequence) before the peer reads it, so
        the catch-up rounds from the copy's sequence find every tombstone since. Returns
        the round's answer, or None when the peer cannot (no complete copy, one that
        lacks held-back or out-of-scope slots, synchronous replication): the caller then
        streams the rows, nothing having changed on the peer."""
        rep = self.replicator
        shipped = rep.shipped_sequence()
        if shipped < 0 or rep.sync or rep.peer != request.dst_address or not rep.origin \
                or rep.scope is not None:
            return None
        if rep.holds_back(mask):
            return None
        self._migration_consumer(request.dst_address, shipped)  # the logs from there on
        from deeprec_ext.grpc_util import insecure_channel
        t0 = time.monotonic()
        # counted among this PS's paced rounds while the peer copies: the rounds it streams
        # to other destinations meanwhile keep the pace they had when this one streamed
        # too (on a shared host the seed's CPU is taken from the same training)
        with insecure_channel(request.dst_address) as ch, \
                self._paced_round(self.migration_share < 1.0):
            try:
                resp = ch.unary_unary(
                    SEED_FROM_REPLICA, request_serializer=ps_pb2.SeedFromReplicaRequest.SerializeToString,
                    response_deserializer=ps_pb2.SeedFromReplicaResponse.FromString)(
                    ps_pb2.SeedFromReplicaRequest(
                        origin=rep.origin, slots=request.slots, num_slots=request.num_slots,
                        min_sequence=shipped, replica_after=request.dst_replica_after),
                    timeout=validation.within_deadline(context, 600.0))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # nothing changed there
                    log.info("%s: %s cannot take the snapshot from its copy (%s); streaming it",
                             self.ps_id, request.dst_address, exc.details())
                    return None
                context.abort(validation.downstream_code(exc.code()),
                              f"seeding {request.dst_address} from its copy of this PS: "
                              f"{exc.code().name}: {exc.details()}")
        if resp.sequence < shipped:  # the peer's copy older than what was shipped to it
            context.abort(grpc.StatusCode.INTERNAL,
                          f"{request.dst_address} seeded from a copy current to "
                          f"{resp.sequence}, older than the {shipped} shipped to it")
        self._migration_consumer(request.dst_address, resp.sequence)
        log.info("%s: %s took %d rows of the snapshot from its copy of this PS (current to "
                 "%d) in %.0f ms", self.ps_id, request.dst_address, resp.rows, resp.sequence,
                 (time.monotonic() - t0) * 1000)
        return ps_pb2.MigrateSlotsResponse(watermark=resp.sequence, rows=resp.rows,
                                           seeded=resp.rows)

    def _fence(self, request, moving: np.ndarray, context) -> None:
        """The fence of a last round (``MigrateSlotsRequest.fence_epoch``): this PS keeps
        only ``fence_owned`` from that epoch on. Taking the exclusive side of the gate, it
        waits for the requests that passed the old ownership check. The same fence again
        (the last round to another destination) is a no-op; an older epoch or another
        layout at that epoch is refused, nothing sent."""
        if not request.send_request_ids:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "fence_epoch is for the last round only (send_request_ids)")
        owned = validation.slot_mask(request.fence_owned, request.num_slots, field="fence_owned")
        if (owned & moving).any():
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "fence_owned keeps slots this round moves away")
        if self.routing.advance(request.fence_epoch, request.num_slots, owned):
            log.info("%s: fenced at epoch %d, keeps %d/%d slots", self.ps_id,
                     request.fence_epoch, int(owned.sum()), request.num_slots)
            return
        r = self.routing
        if r.epoch != request.fence_epoch or r.owned is None or r.num_slots != request.num_slots \
                or not np.array_equal(r.owned, owned):
            errors.abort(context, grpc.StatusCode.FAILED_PRECONDITION, errors.ErrorKind.STALE_EPOCH,
                         f"fence epoch {request.fence_epoch} is not newer than this PS's epoch "
                         f"{r.epoch} (nor the same fence)", ((ROUTING_EPOCH_KEY, str(r.epoch)),))

    MIGRATION_CONSUMER_SECONDS = 600.0

    def _migration_consumer(self, dst: str | None, watermark: int = 0) -> None:
        """The next catch-up round to ``dst`` reads the logs from ``watermark``: keep them
        (None: the migrations are over). Forgotten after 10 minutes without a round."""
        now = time.monotonic()
        with self._counter_lock:
            if dst is None:
                gone, self._migrations = list(self._migrations), {}
            else:
                gone = [d for d, t in self._migrations.items()
                        if now - t > self.MIGRATION_CONSUMER_SECONDS]
                for d in gone:
                    del self._migrations[d]
                self._migrations[dst] = now
        for d in gone:
            self.store.set_consumer(f"migrate:{d}", None)
            self.applied.close_cursor(f"migrate:{d}")
        if dst is not None:
            self.store.set_consumer(f"migrate:{dst}", watermark)

    # an announced row count is a sizing hint: a larger one (a bad or hostile sender) is
    # capped, so it cannot make this PS reserve more than this many rows up front
    MAX_ANNOUNCED_ROWS = 1 << 24

    def ImportRows(self, request_iterator, context):
        t0 = time.monotonic()
        n = 0
        snapshot = False  # a snapshot's stream (it announces its rows): its pieces yield
        background = False  # some batch came from a paced round (RowBatch.background)
        for batch in request_iterator:
            # pushes the source applied (migration), and this PS's peer learns them too
            self._record_source_ids(batch.applied_request_ids)
            cfg = batch.config
            if not cfg.name:
                continue
            try:
                init, opt = validation.table_config(cfg)
                if batch.replica_after:
                    # this PS replicates to another peer once the migration is published:
                    # the current peer's copy is then replaced, so the imports skip it
                    validation.address(batch.replica_after, "replica_after")
                    self.replicator.hold_unowned(batch.replica_after, self.routing.owned)
                table = self.store.create_table(cfg.name, cfg.dim, init, opt,
                                                **table_spec.policies(cfg))
                self._configs.setdefault(cfg.name, cfg)
                self._start_evictor()
                deleted = codec.ids_from_bytes(batch.deleted_ids, "deleted_ids")
                if deleted.size:
                    table.delete(deleted)
                if batch.total_rows > 0:  # a snapshot's rows: size the table for them once
                    table.reserve_import(min(int(batch.total_rows), self.MAX_ANNOUNCED_ROWS))
                    snapshot = True
                ids = codec.ids_from_bytes(batch.ids)
                if ids.size and len(batch.counts):  # the store's layout, counts apart
                    rows = codec.floats_from_bytes(batch.rows, ids.size, table.row_width, "rows")
                    counts = codec.counts_from_bytes(batch.counts, ids.size)
                    background = background or batch.background
                    self._import_pieces(table, ids, rows, counts,
                                        (snapshot or batch.background)
                                        and self.migration_share < 1.0)
                    n += int(ids.size)
                elif ids.size:  # rows with their counts last (senders before the counts field)
                    rows = codec.rows_from_bytes(batch.rows, ids.size, table.row_width, "rows")
                    table.import_rows(ids, rows)
                    n += int(ids.size)
            except (ValueError, TypeError) as exc:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"import into '{cfg.name}': {exc}")
        if n:  # a long training step is matched with a migration round from the logs
            log.info("%s: imported %d rows in %.0f ms (%s%s)", self.ps_id, n,
                     (time.monotonic() - t0) * 1000, "snapshot" if snapshot else "catch-up",
                     ", yielding" if background and not snapshot else "")
        return ps_pb2.ImportRowsResponse(rows=n)

    def _record_source_ids(self, ids: list[str]) -> None:
        """A migration source's ids of applied pushes. A first round's (up to a full
        window) are kept as a window of their own beside this PS's (``adopt``): recorded
        into it, they took ~170 ms and pushed out this PS's own latest ids, whose resends
        would then be applied twice. A later round's few are recorded as usual."""
        if len(ids) > self.applied.capacity // 8:
            self.applied.adopt(dict.fromkeys(ids), ship=True)
        elif ids:
            self.applied.add_many(ids, ship=True)

    def _table_for_replica(self, name: str, rtable):
        """This PS's table ``name`` for rows of a replica's table: created with that
        table's config when absent (a promotion, a seed); another config raises."""
        cfg = rtable.config
        table = self.store.create_table(name, rtable.dim, cfg["initializer"], cfg["optimizer"],
                                        admission=cfg.get("admission"),
                                        eviction=cfg.get("eviction"),
                                        dtype=cfg.get("dtype", "float32"))
        self._configs.setdefault(name, table_spec.of_table(rtable))
        return table

    def SeedFromReplica(self, request, context):
        """A migration's snapshot round from the copy this PS holds of the source (the
        source asks: see ``_seed_at_destination``). Rows of the moving slots go from that
        copy into this PS's tables in slices, each read under the copy's lock (deltas keep
        arriving between them: a row read later may be newer than the copy's sequence at
        the start, which the answer reports, and the catch-up rounds ship every write
        after it again), paced and yielding to training like a streamed snapshot.
        FAILED_PRECONDITION, with nothing changed, when there is no complete copy current
        to ``min_sequence``; ABORTED when the copy is promoted or replaced mid-way (the
        migration then fails and drops what was seeded)."""
        mask = self._slot_mask(request.slots, request.num_slots, context, routed=True)
        if not request.origin:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "origin is required")
        if request.replica_after:
            validation.address(request.replica_after, "replica_after")
        copy = self.replicas.current(request.origin)
        if copy is None:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"this PS holds no complete copy of {request.origin!r}")
        with copy.lock:
            sequence = copy.sequence
        if sequence < request.min_sequence:
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"the copy of {request.origin!r} is current to {sequence}, older "
                         f"than {request.min_sequence}")
        t0 = time.monotonic()
        n = 0
        share = float(np.count_nonzero(mask)) / max(mask.size, 1)
        paced = self.migration_share < 1.0
        pacer = self._Pacer(self.migration_share if paced else 1.0, lambda: self._paced_rounds)
        if request.replica_after:  # as ImportRows: imports skip a peer that changes
            self.replicator.hold_unowned(request.replica_after, self.routing.owned)
        with self._paced_round(paced):
            for name, rtable in sorted(copy.store.tables().items()):
                try:
                    table = self._table_for_replica(name, rtable)
                except (ValueError, TypeError) as exc:
                    self._reject(context, grpc.StatusCode.FAILED_PRECONDITION if not n else
                                 grpc.StatusCode.ABORTED, f"seed table '{name}': {exc}")
                table.reserve_import(int(len(rtable) * share * 1.02) + 64)
                row = 0
                while row is not None:
                    with copy.lock:
                        if self.replicas.current(request.origin) is not copy:
                            self._reject(context, grpc.StatusCode.ABORTED,
                                         f"the copy of {request.origin!r} was promoted or "
                                         f"replaced after {n} rows")
                        keys, (rows, counts), _, row = rtable.export_slots(
                            mask, None, row, self.MIGRATE_CHUNK_ROWS, with_counts="apart")
                    if keys.size:
                        self._import_pieces(table, keys, rows, counts, yield_=paced)
                        n += int(keys.size)
                    if row is not None:
                        pacer.pace()
        self._start_evictor()
        log.info("%s: seeded %d rows of %s's moving slots from its copy (current to %d) in "
                 "%.0f ms", self.ps_id, n, request.origin, sequence, (time.monotonic() - t0) * 1000)
        return ps_pb2.SeedFromReplicaResponse(rows=n, sequence=sequence)

    # Rows per table-lock hold of an import. A sender's chunk (MIGRATE_CHUNK_ROWS) imported
    # in one hold into a table that serves training (a scale-in's destinations hold rows,
    # their index grows and has deleted positions: the slower path) kept this PS's lookups
    # waiting 6-7 ms at the median, up to 26-38 ms, in-process; in pieces, with the
    # interpreter handed to the serving threads between them, about 1 ms.
    IMPORT_PIECE_ROWS = 1 << 12

    def _import_pieces(self, table, ids, rows, counts, yield_: bool = False) -> None:
        """``yield_`` (a snapshot's stream, or a batch the source marked ``background``:
        a catch-up round past its first rows; pacing on): between pieces wait, bounded,
        while training calls are in flight here, as the source does between its chunks.
        A scale-in's destinations serve all of training while they import; the stream's
        flow control passes the wait back to the source. The first rows of a catch-up
        round and the fenced last round are never slowed (small rounds converge)."""
        piece = self.IMPORT_PIECE_ROWS
        if ids.size > piece:  # checked whole: a bad row refuses the batch, none of it lands
            ids, rows, counts = table.check_block(ids, rows, counts)
        for i in range(0, ids.size, piece):
            if yield_:
                self._yield_to_training()
            elif i:
                time.sleep(0)  # let a waiting lookup or push take the lock and run
            table.import_block(ids[i:i + piece], rows[i:i + piece], counts[i:i + piece])

    def DropSlots(self, request, context):
        """Free the rows of slots this PS no longer owns (after a migration published)."""
        mask = self._slot_mask(request.slots, request.num_slots, context, routed=True)
        owned = self.routing.owned
        if owned is not None and (owned & mask).any():
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                         "refusing to drop slots this PS still owns")
        n = 0
        t0 = time.monotonic()
        for table in self.store.tables().values():
            keys = table.keys_in_slots(mask)
            # in slices, releasing the table lock between them: one big delete stalled
            # every request to this PS for hundreds of ms. The rows moved, they were not
            # deleted from the model: no tombstone for checkpoints or migrations, but a
            # "moved" one for this PS's replica, which must lose them too (or a later
            # promotion would bring the old rows back)
            for i in range(0, keys.size, self.MIGRATE_CHUNK_ROWS):
                if i:
                    # clean-up is background work, like a migration round: training calls
                    # in flight go first (a 667k-row drop took 0.5-0.8 s on a loaded PS,
                    # right after the publish, and the event's longest steps fell in it)
                    self._yield_to_training()
                n += table.delete(keys[i:i + self.MIGRATE_CHUNK_ROWS], log_tombstone=False,
                                  moved=True)
        self._migration_consumer(None)  # the migration is over
        log.info("%s: dropped %d rows of moved slots in %.0f ms", self.ps_id, n,
                 (time.monotonic() - t0) * 1000)
        return ps_pb2.DropSlotsResponse(rows=n)

    def hand_off(self, timeout: float = 10.0) -> bool:
        """Leaving on a preemption notice: stop taking writes (fence every slot; clients
        are told "stale routing" and wait for the next epoch), then ship the last delta
        so the ring peer holds every update. Returns True if rows were handed off."""
        owned = self.routing.owned
        if owned is None or not owned.any() or not self.replicator.peer:
            return False
        self.routing.set(self.routing.epoch + 1, self.routing.num_slots, np.zeros_like(owned))
        try:
            self.replicator.ship(timeout=timeout)
        except grpc.RpcError as exc:
            log.error("%s: final delta to %s failed: %s", self.ps_id, self.replicator.peer,
                      exc.code().name)
            return False
        log.info("%s: fenced and handed off to %s", self.ps_id, self.replicator.peer)
        return True

    # -- peer replication -------------------------------------------------------------------
    def Replicate(self, request_iterator, context):
        meta = dict(context.invocation_metadata())
        try:
            base = int(meta.get(BASE_KEY, "-1"))
        except ValueError:
            base = -1
        try:
            return ps_pb2.ReplicateResponse(
                rows=self.replicas.apply(request_iterator, meta.get(KIND_KEY, ""), base))
        except ReplicaRefused as exc:  # a delta without its base here: the origin sends a full copy
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, f"replicate: {exc}")
        except (ValueError, TypeError) as exc:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"replicate: {exc}")

    # promoted rows are served from the replica's tables ("segments") at once, then merged
    # into the live tables in the background, MERGE_CHUNK_ROWS per table-lock hold, after
    # MERGE_DELAY_SECONDS (the recovery's own work -- the new ring's full copy, the
    # replacement's migration -- goes first). None: keep the segments (no merge).
    MERGE_DELAY_SECONDS: float | None = 5.0
    MERGE_CHUNK_ROWS = 1 << 14
    MERGE_PAUSE_SECONDS = 0.002
    # the full copy to this PS's peer that a promotion makes necessary starts this much
    # later: the clients' first steps on the new routing go first (the peer keeps its
    # earlier copy of this PS's own rows meanwhile)
    PROMOTE_SHIP_DELAY_SECONDS = 1.0

    def Promote(self, request, context):
        """Take over a dead PS's slots from the replica this PS holds of it. No row is
        copied: each replica table becomes a segment of this PS's table of that name
        (``EmbeddingTable.adopt_segment``), which serves the promoted slots right away,
        and is merged into the table later in the background (``merge_segments``). A table
        that cannot take a segment (another config, or it still holds one from an earlier
        promotion) gets the rows copied, in slices.

        A copy still streaming in (a full resync after the ring re-formed, or a delta being
        applied) is waited for, up to PROMOTE_WAIT_SECONDS within the caller's deadline.
        Without a complete copy the answer is FAILED_PRECONDITION with the kind RESYNCING
        (still being rebuilt after the wait: ask again) or NO_REPLICA (none, or its
        rebuild broke off with the origin): the caller restores those slots from a
        checkpoint instead. Nothing partial is ever promoted."""
        mask = self._slot_mask(request.slots, request.num_slots, context)
        # the routing it carries is checked before anything is promoted: a bad one is
        # refused whole, the copy still promotable
        owned = self._check_routing(request.routing) if request.HasField("routing") else None
        if owned is not None and (owned.size != mask.size or bool((mask & ~owned).any())):
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"routing: its owned_slots ({owned.size}) must include every promoted "
                         f"slot ({mask.size} slots, {int(mask.sum())} promoted)")
        wait = PROMOTE_WAIT_SECONDS
        remaining = context.time_remaining()
        if remaining is not None:
            wait = max(0.0, min(wait, remaining - 5.0))
        t_start = time.monotonic()
        try:
            copy = self.replicas.take(request.origin, wait=wait)
        except ReplicaUnavailable as exc:
            self._count("rejected")
            kind = errors.ErrorKind.RESYNCING if exc.kind == "resyncing" else errors.ErrorKind.NO_REPLICA
            errors.abort(context, grpc.StatusCode.FAILED_PRECONDITION, kind, str(exc))
        t_taken = time.monotonic()
        age = (t_taken - copy.updated) * 1000
        self.replicator.defer(self.PROMOTE_SHIP_DELAY_SECONDS)  # before any row is stamped
        n = copied = 0
        try:
            for name, rtable in sorted(copy.store.tables().items()):
                table = self._table_for_replica(name, rtable)
                adopted = table.adopt_segment(rtable, mask, int(mask.size))
                if adopted >= 0:
                    n += adopted
                    continue
                keys = rtable.keys_in_slots(mask)
                # in slices: one import of a million rows held the table lock for seconds
                for i in range(0, keys.size, self.MIGRATE_CHUNK_ROWS):
                    found, rows = rtable.export_keys(keys[i:i + self.MIGRATE_CHUNK_ROWS],
                                                     with_counts=True)
                    table.import_rows(found, rows)
                    n += int(found.size)
                    copied += int(found.size)
        except Exception:
            self.replicas.put_back(request.origin, copy)  # a retry finds it again
            raise
        t_adopted = time.monotonic()
        with self.apply_gate.shared():  # the pushes in these rows, for this PS's peer too
            self.applied.adopt(copy.applied, ship=True)
        t_ids = time.monotonic()
        # the promoted slots are served from here on: applying the routing now saves the
        # recovery a SetRouting round trip before its clients learn the new routing
        routed = owned is not None and self._apply_routing(request.routing, owned)
        t_end = time.monotonic()
        log.info("%s: promoted %d rows of %s (%d copied; replica %.0f ms old); ms: take %.1f, "
                 "adopt %.1f, request ids %.1f, routing %.1f%s (monotonic %.6f)", self.ps_id, n,
                 request.origin, copied, age, (t_taken - t_start) * 1000,
                 (t_adopted - t_taken) * 1000, (t_ids - t_adopted) * 1000,
                 (t_end - t_ids) * 1000, "" if routed or owned is None else " (not newer)", t_end)
        self._start_merge()
        self._start_evictor()
        return ps_pb2.PromoteResponse(rows=n, origin_sequence=copy.sequence, replica_age_ms=age,
                                      routing_applied=routed)

    def _start_merge(self) -> None:
        if self.MERGE_DELAY_SECONDS is None:
            return
        with self._counter_lock:
            if self._merger is not None and self._merger.is_alive():
                self._merge_again = True
                return
            self._merge_again = False
            self._merger = threading.Thread(target=self.merge_segments, name="segment-merge",
                                            args=(self.MERGE_DELAY_SECONDS,), daemon=True)
            self._merger.start()

    def merge_segments(self, delay: float = 0.0) -> int:
        """Merge every table's segment (promoted rows) into the table, in steps of
        MERGE_CHUNK_ROWS arena rows with the table lock released (and a short pause)
        between them; lookups, pushes, exports keep running. Returns the steps taken."""
        if delay:
            time.sleep(delay)
        steps = 0
        while True:
            for table in self.store.tables().values():
                while table.merge_segment(self.MERGE_CHUNK_ROWS):
                    steps += 1
                    time.sleep(self.MERGE_PAUSE_SECONDS)
            with self._counter_lock:
                if not self._merge_again:
                    self._merger = None if threading.current_thread() is self._merger \
                        else self._merger
                    return steps
                self._merge_again = False

    def WriteCheckpoint(self, request, context):
        """Write this PS's rows (the slots it owns) into a checkpoint; the AIMaster commits."""
        from checkpoint import CheckpointCancelled, CheckpointWriter  # the PS writes the format
        if request.kind not in ("full", "incr"):
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"kind must be 'full' or 'incr', got {request.kind!r}")
        validation.checkpoint_root(request.root)
        # the writer id is part of every file name the checkpoint gets
        writer_id = validation.table_name(request.writer_id, "writer_id") if request.writer_id \
            else self.ps_id
        since = validation.sequence_map(request.since_json, "since_json")
        try:
            writer = CheckpointWriter(request.root, request.ckpt_id, request.kind,
                                      parent=request.parent if request.kind == "incr" else None,
                                      num_slots=self.routing.num_slots)
        except Exception as exc:  # noqa: BLE001 - bad root/parent/kind: answer, keep serving
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"checkpoint: {exc}")
        # The slots owned now are what this part holds. No gate is held while writing: the
        # rows stream out in chunks under short table-lock holds, and a routing change
        # (which takes the gate's exclusive side) must not wait for, and hold up every
        # lookup behind, a checkpoint of a large table.
        owned = self.routing.owned
        self.evict_now()  # evicted rows go into this checkpoint as deletions, not as rows
        rows = nbytes = 0
        cut = {}
        try:
            for name, table in sorted(self.store.tables().items()):
                stats = writer.write_table(
                    writer_id, table,
                    since_seq=(since.get(name, 0) if request.kind == "incr" else None),
                    slot_mask=owned, cancelled=lambda: not context.is_active())
                rows += stats["rows"]
                nbytes += stats["bytes"]
                cut[name] = stats["cut_seq"]
        except (ValueError, OSError, LogTrimmed, CheckpointCancelled) as exc:
            try:
                writer.abort()
            except OSError as cleanup:  # the answer is about the write, not the clean-up
                log.warning("%s: checkpoint %d: clean-up failed: %s", self.ps_id,
                            request.ckpt_id, cleanup)
            if isinstance(exc, LogTrimmed):  # deletions since `since` are forgotten
                self._count("rejected")
                errors.abort(context, grpc.StatusCode.FAILED_PRECONDITION, errors.ErrorKind.NEEDS_FULL,
                             f"checkpoint: an incremental is impossible, take a full one: {exc}")
            if isinstance(exc, CheckpointCancelled):
                self._reject(context, grpc.StatusCode.CANCELLED, f"checkpoint: {exc}")
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"checkpoint: {exc}")
        # the next incremental of this PS starts from this cut (or, if this checkpoint is
        # not committed, from the previous one): the logs are kept from the older of both
        self._ckpt_cuts = (self._ckpt_cuts + [min(cut.values(), default=self.store.sequence.value)])[-2:]
        self.store.set_consumer("checkpoint", min(self._ckpt_cuts))
        return ps_pb2.WriteCheckpointResponse(files_json=json.dumps(writer.file_entries()),
                                              cut_json=json.dumps(cut), rows=rows, bytes=nbytes)

    def RestoreCheckpoint(self, request, context):
        """Load the rows of some slots from a checkpoint into this PS's tables."""
        from checkpoint import restore
        mask = self._slot_mask(request.slots, request.num_slots, context)
        validation.checkpoint_root(request.root)
        try:
            info = restore(request.root, self.store, slot_mask=mask, upto=request.ckpt_id,
                           exact=True, reset_optimizer=request.reset_optimizer)
        except Exception as exc:  # noqa: BLE001 - missing/corrupt checkpoint: answer, keep serving
            self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, f"restore: {exc}")
        if request.warm_start:
            with self._create_lock:
                self._warm.update({name: info.dir for name in info.tables
                                   if name not in self._configs})
        for name, table in self.store.tables().items():
            self._configs.setdefault(name, table_spec.of_table(table))
        self._start_evictor()
        rows = sum(int(t.get("rows", 0)) for t in info.tables.values())
        saved = sorted(n for n, t in info.tables.items() if t.get("saved_index"))
        log.info("%s: restored %d rows of %d slots from checkpoint %d in %.2fs (saved "
                 "index installed: %s)", self.ps_id, rows, int(mask.sum()),
                 info.checkpoint_id, info.seconds, ", ".join(saved) or "none")
        return ps_pb2.RestoreCheckpointResponse(rows=rows, bytes_read=info.bytes_read,
                                                seconds=info.seconds)

    # -- eviction ---------------------------------------------------------------------
    EVICT_POLL_SECONDS = 0.5

    def evict_now(self, due_only: bool = False) -> dict[str, int]:
        """Run the eviction policies of the tables (``due_only``: those whose interval has
        passed) over the slots this PS owns: ``{table: rows evicted}``. The rows go
        through the delete path, so the replica, migrations and the next incremental
        checkpoint see them deleted."""
        now = time.monotonic()
        owned = self.routing.owned
        out = {}
        for name, table in self.store.user_tables().items():
            ev = table.eviction
            if not ev:
                continue
            if due_only and now - self._evicted_at.get(name, 0.0) < ev["interval_seconds"]:
                continue
            self._evicted_at[name] = now
            try:
                out[name] = table.evict(owned)
            except Exception:  # noqa: BLE001 - an eviction failing must not stop the PS
                log.exception("%s: eviction of table '%s' failed", self.ps_id, name)
        if any(out.values()):
            log.info("%s: evicted %s", self.ps_id, {k: v for k, v in out.items() if v})
        return out

    def _start_evictor(self) -> None:
        if self._evictor is not None or not any(
                t.eviction for t in self.store.user_tables().values()):
            return
        with self._counter_lock:
            if self._evictor is not None:
                return
            now = time.monotonic()
            for name in self.store.user_tables():
                self._evicted_at.setdefault(name, now)  # first run one interval from now
            self._evictor = threading.Thread(target=self._evict_loop, name="evictor",
                                             daemon=True)
            self._evictor.start()

    def _evict_loop(self) -> None:
        while not self._evict_stop.wait(self.EVICT_POLL_SECONDS):
            now = time.monotonic()
            for name in self.store.user_tables():
                self._evicted_at.setdefault(name, now)
            self.evict_now(due_only=True)

    def close(self) -> None:
        """Stop what this PS runs in the background (the process is leaving): shipping to
        its replica peer and the eviction. A servicer left running after its server
        stopped would go on shipping deltas to a peer that may be gone."""
        self.replicator.close()
        self._evict_stop.set()

    def _gazer_extra(self, out) -> None:
        for name, t in sorted(self.store.user_tables().items()):
            pol = t.policy_stats()
            out.tables.add(name=name, rows=t.size, bytes=t.nbytes, capacity=t.capacity,
                           **{k: int(pol.get(k, 0))
                              for k in ("admitted", "rejected", "candidates", "evicted")})
        out.replication.CopyFrom(gazer_pb2.ReplicationStats(**self.replicator.lag()))
        for origin, c in sorted(self.replicas.origins().items()):
            out.replication.held.add(origin=origin, sequence=c["sequence"], rows=c["rows"],
                                     age_ms=c["age_ms"])

    def SlotStats(self, request, context):
        num_slots = self.routing.num_slots
        nbytes = np.zeros(num_slots, dtype=np.int64)
        for table in self.store.tables().values():
            # bytes a row costs on this PS: value + optimizer slots + per-row bookkeeping
            row_bytes = table.nbytes / max(table.capacity, 1)
            nbytes += (table.rows_per_slot(num_slots) * row_bytes).astype(np.int64)
        lookups = self.routing.lookups_per_slot
        if lookups.size != num_slots:
            lookups = np.zeros(num_slots, dtype=np.int64)
        return ps_pb2.SlotStatsResponse(
            num_slots=num_slots, slot_bytes=nbytes.astype("<i8").tobytes(),
            slot_lookups=lookups.astype("<i8").tobytes(),
            seconds=time.monotonic() - self.routing.counting_since)

    def Stats(self, request, context):
        if request.replication_only:
            return ps_pb2.StatsResponse(ps_id=self.ps_id, epoch=self.routing.epoch,
                                        sequence=self.store.sequence.value,
                                        shipped_sequence=self.replicator.shipped_sequence())
        tables = []
        for name, st in self.store.stats().items():
            cfg = self._configs.get(name)
            opt = json.loads(cfg.optimizer_json) if cfg and cfg.optimizer_json else "sgd"
            tables.append(ps_pb2.TableStats(
                name=name, dim=st["dim"], rows=st["rows"], bytes=st["bytes"],
                optimizer=opt if isinstance(opt, str) else opt.get("name", ""),
                **{k: int(st.get(k, 0)) for k in ("admitted", "rejected", "candidates",
                                                  "evicted", "dropped")}))
        with self._counter_lock:
            c = dict(self.counters)
        proc = psutil.Process(os.getpid())
        cpu = proc.cpu_times()
        return ps_pb2.StatsResponse(
            ps_id=self.ps_id, epoch=self.routing.epoch, sequence=self.store.sequence.value,
            tables=tables, rss_bytes=proc.memory_info().rss,
            cpu_seconds=cpu.user + cpu.system, memory_limit_bytes=self.memory_limit_bytes,
            gazer_stats=self.gazer.collect_bytes(self.ps_id),
            shipped_sequence=self.replicator.shipped_sequence(), **c)
