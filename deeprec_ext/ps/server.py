"""The ParameterServer gRPC service over an EmbeddingStore. numpy + grpc only: no TensorFlow.

Every request is validated in full (ids, payload sizes, table names, dims, finiteness,
slot ownership) before any table is touched, so a rejected request changes nothing.
Errors cross the wire as status codes with a message naming the problem.
"""
from __future__ import annotations

import json
import logging
import os
import threading

import grpc
import numpy as np
import psutil

from deeprec_ext import codec
from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.grpc_util import ROUTING_EPOCH_KEY
from deeprec_ext.hashing import DEFAULT_NUM_SLOTS, slot_of
from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
from deeprec_ext.store import EmbeddingStore

log = logging.getLogger(__name__)


class Routing:
    """This PS's view of slot ownership. ``owned is None`` means "owns every slot"
    (a standalone PS without an AIMaster)."""

    def __init__(self):
        self.epoch = 0
        self.num_slots = DEFAULT_NUM_SLOTS
        self.owned: np.ndarray | None = None
        self.lock = threading.Lock()

    def set(self, epoch: int, num_slots: int, owned: np.ndarray) -> None:
        with self.lock:
            self.epoch, self.num_slots, self.owned = epoch, num_slots, owned

    def check(self, ids: np.ndarray, context) -> None:
        owned, num_slots, epoch = self.owned, self.num_slots, self.epoch
        if owned is None or ids.size == 0:
            return
        ok = owned[slot_of(ids, num_slots)]
        if not ok.all():
            bad = int(ids[np.argmin(ok)])
            context.set_trailing_metadata(((ROUTING_EPOCH_KEY, str(epoch)),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale routing: key {bad} is not owned by this PS at epoch {epoch}")


def _config_json(spec) -> dict | str:
    return spec


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, ps_id: str = "ps", store: EmbeddingStore | None = None):
        self.ps_id = ps_id
        self.store = store if store is not None else EmbeddingStore()
        self.routing = Routing()
        self.counters = {"lookups": 0, "pushes": 0, "rejected": 0}
        self._counter_lock = threading.Lock()
        self._configs: dict[str, ps_pb2.TableConfig] = {}

    # -- helpers ---------------------------------------------------------------------
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
            if not cfg.name:
                raise InvalidRequestError("table name must not be empty")
            if cfg.dim <= 0:
                raise InvalidRequestError(f"table '{cfg.name}': dim must be positive, got {cfg.dim}")
            try:
                init = json.loads(cfg.initializer_json) if cfg.initializer_json else "zeros"
                opt = json.loads(cfg.optimizer_json) if cfg.optimizer_json else "sgd"
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"table '{cfg.name}': malformed JSON config: {exc}") from exc
            init_ids = codec.ids_from_bytes(request.init_ids, "init_ids")
            init_values = codec.floats_from_bytes(request.init_values, init_ids.size, cfg.dim,
                                                  "init_values")
            if init_ids.size and not np.isfinite(init_values).all():
                raise InvalidRequestError(f"table '{cfg.name}': init_values contain NaN or Inf")
            existed = cfg.name in self.store.tables()
            table = self.store.create_table(cfg.name, cfg.dim, init, opt)
            if init_ids.size:
                table.insert(init_ids, init_values, only_if_absent=True)
        except (ValueError, TypeError) as exc:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._configs.setdefault(cfg.name, cfg)
        return ps_pb2.CreateTableResponse(created=not existed)

    def ListTables(self, request, context):
        names = set(self.store.tables())
        return ps_pb2.ListTablesResponse(tables=[c for n, c in self._configs.items() if n in names])

    def Lookup(self, request, context):
        self._count("lookups")
        work = []
        for t in request.tables:
            table = self._table(t.table, context)
            try:
                ids = codec.ids_from_bytes(t.ids, f"table '{t.table}' ids")
            except InvalidRequestError as exc:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.routing.check(ids, context)
            work.append((table, ids))
        out = [codec.floats_to_bytes(table.lookup(ids, insert_missing=request.insert_missing))
               for table, ids in work]
        return ps_pb2.LookupResponse(values=out)

    def Push(self, request, context):
        self._count("pushes")
        work = []
        for t in request.tables:
            table = self._table(t.table, context)
            try:
                ids = codec.ids_from_bytes(t.ids, f"table '{t.table}' ids")
                vals = codec.floats_from_bytes(t.values, ids.size, table.dim,
                                               f"table '{t.table}' values")
                if not np.isfinite(vals).all():
                    raise InvalidRequestError(
                        f"table '{t.table}': gradients contain NaN or Inf; update rejected")
            except InvalidRequestError as exc:
                self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.routing.check(ids, context)
            work.append((table, ids, vals))
        out = []
        for table, ids, vals in work:
            table.apply_gradients(ids, vals)
            if request.return_values:
                out.append(codec.floats_to_bytes(table.lookup(ids, insert_missing=False)))
        return ps_pb2.PushResponse(values=out, sequence=self.store.sequence.value)

    def SetRouting(self, request, context):
        owned = np.frombuffer(request.owned_slots, dtype=np.uint8)
        if request.num_slots <= 0 or owned.size != request.num_slots:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"owned_slots has {owned.size} entries, num_slots is {request.num_slots}")
        self.routing.set(request.epoch, request.num_slots, owned.astype(bool))
        log.info("%s: routing epoch %d, owns %d/%d slots", self.ps_id, request.epoch,
                 int(owned.sum()), request.num_slots)
        return ps_pb2.SetRoutingResponse()

    def Stats(self, request, context):
        tables = []
        for name, table in sorted(self.store.tables().items()):
            cfg = self._configs.get(name)
            opt = json.loads(cfg.optimizer_json) if cfg and cfg.optimizer_json else "sgd"
            tables.append(ps_pb2.TableStats(
                name=name, dim=table.dim, rows=table.size, bytes=table.nbytes,
                optimizer=opt if isinstance(opt, str) else opt.get("name", "")))
        with self._counter_lock:
            c = dict(self.counters)
        return ps_pb2.StatsResponse(
            ps_id=self.ps_id, epoch=self.routing.epoch, sequence=self.store.sequence.value,
            tables=tables, rss_bytes=psutil.Process(os.getpid()).memory_info().rss, **c)
