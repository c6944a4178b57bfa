"""PSClient: the public data-plane API (lookup / push / create_table) over the PS fleet.

A call de-duplicates its ids, splits them by owning PS using the cached routing table,
and sends one RPC per PS carrying every table of the call, all PS in parallel. A PS that
answers "stale routing" makes the client refresh its routing from the AIMaster and resend
only the keys that PS refused; an unreachable PS is retried with backoff (it may be
restarting or being replaced) until the retry deadline.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import uuid
import threading
import time
from typing import Mapping

import grpc
import numpy as np

from deeprec_ext import codec, table_spec
from deeprec_ext.client.routing import RoutingTable
from deeprec_ext.errors import (InvalidRequestError, RoutingNotReadyError, StaleRoutingError,
                                UnavailableError, UnknownTableError)
from deeprec_ext.grpc_util import RETRIABLE_CODES, ROUTING_EPOCH_KEY, RetryPolicy, insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc
from deeprec_ext.store.policies import check_policies
from deeprec_ext.store.spec import check_dtype

log = logging.getLogger(__name__)


def _as_ids(ids, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what}: ids must be an integer array (np.int64), got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidRequestError(f"{what}: uint64 ids above 2**63-1 do not fit int64")
    return arr.astype(np.int64, copy=False)


def _error_from_rpc(exc: grpc.RpcError, what: str) -> Exception:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownTableError(f"{what}: {details}")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ALREADY_EXISTS):
        return InvalidRequestError(f"{what}: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        epoch = -1
        for key, value in exc.trailing_metadata() or ():
            if key == ROUTING_EPOCH_KEY:
                epoch = int(value)
        if epoch >= 0:
            return StaleRoutingError(details, epoch)
    # CANCELLED that this client did not ask for: the PS stopped with the call in flight
    # (a preempted PS fences its slots first, so nothing is applied after it; a resend
    # carries the same request id and is skipped where the rows were handed)
    if code in RETRIABLE_CODES or code == grpc.StatusCode.CANCELLED:
        return UnavailableError(f"{what}: {code.name}: {details}")
    return exc


def _part_request_id(call_id: str, parts) -> str:
    """The request id of a push's first attempt at one PS: the call's id and a digest of
    the part's tables and ids ([(table, ids, positions)]), so a resend is recognized."""
    digest = hashlib.blake2b(digest_size=8)
    for n, i, _ in parts:
        digest.update(n.encode())
        digest.update(codec.ids_to_bytes(i))
    return f"{call_id}-{digest.hexdigest()}"


class PreparedPush:
    """A push checked and encoded by ``PSClient.prepare_push`` (see there)."""

    def __init__(self, pushes, grads_of, return_tables, call_id, routing):
        self.pushes, self.grads_of, self.return_tables = pushes, grads_of, return_tables
        self.call_id, self.routing = call_id, routing
        self.prebuilt: dict[int, tuple] = {}


class _RoutingPrefetch:
    """A long poll for a routing epoch newer than ``epoch``, sent the moment a part of a
    call is found unreachable (from gRPC's callback thread, while the call's other parts
    are still out): the recovery's new routing is then on its way to the client while it
    collects the other answers, instead of being asked for after them."""

    def __init__(self, client: "PSClient", epoch: int):
        self._client, self.epoch = client, epoch
        self._lock = threading.Lock()
        self.future = None

    def on_done(self, fut) -> None:
        exc = fut.exception()
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.start()

    def start(self) -> None:
        with self._lock:
            if self.future is None:
                wait = self._client.ROUTING_LONG_POLL_SECONDS
                try:
                    self.future = self._client._master.GetRouting.future(
                        master_pb2.GetRoutingRequest(after_epoch=self.epoch,
                                                     wait_ms=int(wait * 1000)),
                        timeout=wait + 5.0)
                except Exception:  # noqa: BLE001 - a closed client: the caller polls itself
                    self.future = None

    def result(self, timeout: float) -> "RoutingTable | None":
        """The newer routing, if the long poll brought one within ``timeout`` s."""
        with self._lock:
            fut = self.future
        if fut is None:
            return None
        try:
            resp = fut.result(timeout=max(timeout, 0.0))
            return RoutingTable.from_proto(resp) if resp.epoch > self.epoch else None
        except Exception:  # noqa: BLE001 - only a hint: the caller polls itself
            fut.cancel()
            return None


class PSClient:
    """Talks to every PS of a job. Thread-safe; one per process is plenty."""

    def __init__(self, master_address: str, retry: RetryPolicy = RetryPolicy(),
                 rpc_timeout: float = 60.0):
        if not isinstance(master_address, str) or ":" not in master_address:
            raise InvalidRequestError(
                f"AIMaster address must be 'host:port', got {master_address!r}")
        self.master_address = master_address
        self.retry = retry
        self.rpc_timeout = rpc_timeout
        self._master_channel = insecure_channel(master_address)
        self._master = master_pb2_grpc.MasterStub(self._master_channel)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, ps_pb2_grpc.ParameterServerStub] = {}
        self._dims: dict[str, int] = {}
        self.table_specs: dict[str, dict] = {}  # what this client created (for the model record)
        self.routing: RoutingTable | None = None
        self._client_id = uuid.uuid4().hex[:12]
        self._push_counter = itertools.count()
        self.stats = {"rpcs": 0, "stale_retries": 0, "unavailable_retries": 0}
        # the last call that had to re-route, as time.monotonic(): its first refused
        # answer, the new routing in hand (after an unreachable PS), the call done
        self.last_reroute: dict | None = None

    # -- connection ----------------------------------------------------------------
    @classmethod
    def connect(cls, master_address: str, timeout: float = 120.0, **kwargs) -> "PSClient":
        """Connect through the AIMaster; waits up to ``timeout`` s for the PS to be ready."""
        client = cls(master_address, retry=RetryPolicy(deadline=timeout), **kwargs)
        client.refresh_routing()
        return client

    def refresh_routing(self, min_epoch: int = -1) -> RoutingTable:
        """Fetch the routing table from the AIMaster (retrying until it is ready)."""
        deadline = time.monotonic() + self.retry.deadline
        delays = self.retry.sleeps()
        routing_seen = False
        while True:
            # waiting for an epoch being published is a fence in progress: the AIMaster
            # answers the moment it is (a long poll), it is the stall every request
            # touching the moved slots sees
            fenced = min_epoch >= 0 and routing_seen
            req = master_pb2.GetRoutingRequest(
                after_epoch=min_epoch - 1,
                wait_ms=int(self.ROUTING_LONG_POLL_SECONDS * 1000)) if fenced \
                else master_pb2.GetRoutingRequest()
            asked = time.monotonic()
            try:
                resp = self._master.GetRouting(req, timeout=10)
                routing = RoutingTable.from_proto(resp)
                routing_seen = True
                if routing.ps_addresses and routing.epoch >= min_epoch:
                    with self._lock:
                        self.routing = routing
                    return routing
                problem = f"routing epoch {routing.epoch} < {min_epoch}"
            except grpc.RpcError as exc:
                if exc.code() not in RETRIABLE_CODES:
                    raise _error_from_rpc(exc, "get routing") from exc
                problem = f"{exc.code().name}: {exc.details()}"
            delay = next(delays, None)
            if delay is None or time.monotonic() > deadline:
                raise RoutingNotReadyError(
                    f"AIMaster {self.master_address} gave no usable routing: {problem}")
            if not (min_epoch >= 0 and routing_seen):
                time.sleep(delay)  # no routing yet, or the AIMaster unreachable
            elif fenced and time.monotonic() - asked < self.ROUTING_LONG_POLL_SECONDS / 2:
                time.sleep(0.005)  # answered at once (no waiting place free): poll

    ROUTING_POLL_SECONDS = 0.02
    ROUTING_POLL_FIRST_SECONDS = 0.002
    ROUTING_LONG_POLL_SECONDS = 0.25

    def _await_new_epoch(self, delay: float) -> RoutingTable | None:
        """Wait up to ``delay`` s after a PS was unreachable, returning early once the
        AIMaster publishes a newer routing epoch: a dead PS's slots are promoted on its
        peer within a few ms of the death being noticed, and a blind backoff sleep (up to
        0.25 s) was most of the training stall. The AIMaster holds the call until the
        epoch changes (a long poll: the new routing arrives when it is published, where
        polls 2, 4, 8 ms apart found it 4-6 ms late, a seventh of a recovery's kill ->
        resumed). When it answers at once (its few waiting places taken), polls start
        2 ms apart and double up to ROUTING_POLL_SECONDS, as before. Returns the newer
        routing it fetched (the caller need not ask again), else None."""
        end = time.monotonic() + delay
        epoch = self.routing.epoch if self.routing is not None else -1
        pause = self.ROUTING_POLL_FIRST_SECONDS
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            wait = min(left, self.ROUTING_LONG_POLL_SECONDS)
            asked = time.monotonic()
            try:
                resp = self._master.GetRouting(
                    master_pb2.GetRoutingRequest(after_epoch=epoch, wait_ms=max(1, int(wait * 1000))),
                    timeout=wait + 5.0)
            except Exception:  # noqa: BLE001 - only a hint: the backoff is waited out anyway
                resp = None
            if resp is not None and resp.epoch > epoch:
                try:
                    return RoutingTable.from_proto(resp)
                except Exception:  # noqa: BLE001 - the caller fetches it again
                    return None
            if time.monotonic() - asked < wait / 2:  # answered at once: poll
                time.sleep(min(pause, max(0.0, end - time.monotonic())))
                pause = min(pause * 2, self.ROUTING_POLL_SECONDS)

    def _stub(self, address: str) -> ps_pb2_grpc.ParameterServerStub:
        stub = self._stubs.get(address)
        if stub is None:
            with self._lock:
                if address not in self._stubs:
                    ch = insecure_channel(address)
                    self._channels[address] = ch
                    self._stubs[address] = ps_pb2_grpc.ParameterServerStub(ch)
                stub = self._stubs[address]
        return stub

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            self._stubs.clear()
        self._master_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- tables --------------------------------------------------------------------
    def create_table(self, name: str, dim: int, initializer="zeros", optimizer="sgd",
                     init_ids=None, init_values=None, admission=None, eviction=None,
                     dtype="float32") -> bool:
        """Create ``name`` on every PS (idempotent for an identical config).

        ``init_ids``/``init_values`` seed rows where absent (first creator wins), which is
        how workers share one initial value of a dense variable. ``admission`` /
        ``eviction``: the table's policies (``deeprec_ext.store.policies``), checked here
        before any PS is asked. ``dtype``: how the PS stores values, "float32" (default)
        or "float16" (half the value bytes; optimizer slots and math stay float32, lookups
        still return float32). Returns True if created.
        """
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("table name must be a non-empty string")
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim <= 0:
            raise InvalidRequestError(f"table '{name}': dim must be a positive int, got {dim!r}")
        for what, spec in (("initializer", initializer), ("optimizer", optimizer)):
            if not isinstance(spec, (str, dict)):
                raise InvalidRequestError(f"table '{name}': {what} must be a name or a dict, got {spec!r}")
        check_policies(name, int(dim), admission, eviction)
        try:
            dtype = check_dtype(dtype, name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.table_specs[name] = {"dim": int(dim), "initializer": initializer,
                                  "optimizer": optimizer}
        if dtype != "float32":
            self.table_specs[name]["dtype"] = dtype
        for key, spec in (("admission", admission), ("eviction", eviction)):
            if spec:
                self.table_specs[name][key] = spec
        config = table_spec.to_wire(name, dim, initializer, optimizer, admission, eviction, dtype)
        ids = None
        if init_ids is not None:
            ids = _as_ids(init_ids, f"table '{name}' init_ids").ravel()
            init_values = self._as_values(init_values, ids.size, int(dim), f"table '{name}' init_values")
        created = False

        def send(routing: RoutingTable):
            nonlocal created
            parts = dict(routing.partition(ids)) if ids is not None else {}
            futs = []
            for p, address in enumerate(routing.ps_addresses):
                req = ps_pb2.CreateTableRequest(config=config)
                if p in parts:
                    req.init_ids = codec.ids_to_bytes(ids[parts[p]])
                    req.init_values = codec.floats_to_bytes(init_values[parts[p]])
                futs.append(self._stub(address).CreateTable.future(req, timeout=self.rpc_timeout))
            for f in futs:
                created = f.result().created or created

        self._with_routing(send, f"create table '{name}'")
        self._dims[name] = int(dim)
        return created

    def _with_routing(self, fn, what: str):
        """Run ``fn(routing)``, refreshing routing on stale / unavailable answers."""
        delays = self.retry.sleeps()
        while True:
            routing = self.routing or self.refresh_routing()
            try:
                return fn(routing)
            except grpc.RpcError as exc:
                err = _error_from_rpc(exc, what)
                if not isinstance(err, (StaleRoutingError, UnavailableError)):
                    raise err from exc
                delay = next(delays, None)
                if delay is None:
                    raise err from exc
                time.sleep(delay)
                self.refresh_routing()

    def dim(self, name: str) -> int:
        if name not in self._dims:
            self._load_dims()
            if name not in self._dims:
                raise UnknownTableError(f"unknown table '{name}'")
        return self._dims[name]

    def _load_dims(self) -> None:
        def fetch(routing: RoutingTable):
            resp = self._stub(routing.ps_addresses[0]).ListTables(
                ps_pb2.ListTablesRequest(), timeout=self.rpc_timeout)
            for cfg in resp.tables:
                self._dims[cfg.name] = cfg.dim
        self._with_routing(fetch, "list tables")

    # -- validation ----------------------------------------------------------------
    @staticmethod
    def _as_values(values, rows: int, dim: int, what: str) -> np.ndarray:
        if values is None:
            raise InvalidRequestError(f"{what}: missing")
        arr = np.asarray(values)
        if arr.dtype.kind != "f":
            raise InvalidRequestError(f"{what}: must be float32, got dtype {arr.dtype}")
        if arr.shape != (rows, dim):
            if arr.size == rows * dim and arr.ndim >= 1 and arr.shape[-1] == dim:
                arr = arr.reshape(rows, dim)
            else:
                raise InvalidRequestError(
                    f"{what}: shape {arr.shape} does not match [{rows}, {dim}] (ids x table dim)")
        arr = arr.astype(np.float32, copy=False)
        if not np.isfinite(arr).all():
            raise InvalidRequestError(f"{what}: contains NaN or Inf; nothing was sent")
        return arr

    # -- data plane ------------------------------------------------------------------
    def lookup(self, table: str, ids, insert_missing: bool = True,
               unique: bool = False) -> np.ndarray:
        """Values of ``ids`` (any shape, any order, repeats allowed): float32 ids.shape + [dim].

        ``unique=True`` promises the ids hold no repeats (the TF ops de-duplicate in the
        graph) and skips the client's own de-duplication.
        """
        return self.lookup_many({table: ids}, insert_missing, unique)[table]

    def lookup_many(self, requests: Mapping[str, np.ndarray], insert_missing: bool = True,
                    unique: bool = False) -> dict[str, np.ndarray]:
        """Look up several tables with one RPC per PS."""
        prepared = []
        for name, ids in requests.items():
            arr = _as_ids(ids, f"lookup '{name}'")
            dim = self.dim(name)
            if unique:
                uniq, inverse = arr.ravel(), None
            else:
                uniq, inverse = np.unique(arr.ravel(), return_inverse=True)
            prepared.append((name, arr.shape, dim, uniq, inverse))
        uniq_values = {name: np.empty((u.size, dim), np.float32) for name, _, dim, u, _ in prepared}

        def build(ps_tables):  # [(name, ids)] -> request
            return ps_pb2.LookupRequest(
                epoch=self.routing.epoch if self.routing else 0, insert_missing=insert_missing,
                tables=[ps_pb2.TableIds(table=n, ids=codec.ids_to_bytes(i)) for n, i in ps_tables])

        def store(name, positions, payload):
            dim = self._dims[name]
            uniq_values[name][positions] = codec.floats_from_bytes(payload, positions.size, dim, name)

        self._fan_out([(n, u) for n, _, _, u, _ in prepared], build,
                      lambda stub: stub.Lookup, store, "lookup")
        return {name: (uniq_values[name] if inverse is None else uniq_values[name][inverse])
                .reshape(shape + (dim,)) for name, shape, dim, _, inverse in prepared}

    def push(self, table: str, ids, grads, return_values: bool = False, unique: bool = False):
        """Send gradients; repeated ids are summed before the PS applies its optimizer.
        ``unique=True`` promises no repeated ids and skips the client-side summing."""
        out = self.push_many({table: (ids, grads)}, return_values, unique)
        return out[table] if return_values else None

    def push_many(self, updates: Mapping[str, tuple], return_values: bool = False,
                  unique: bool = False, return_tables=None):
        """Push to several tables with one RPC per PS. With ``return_values`` the PS answers
        each row's value after the update (dense variables use this to sync in one trip);
        ``return_tables`` (implies ``return_values``) limits that to the tables named, and
        the result holds only those."""
        if return_tables is not None:
            return_tables = set(return_tables)
            return_values = bool(return_tables)
        prepared = []
        shapes = {}
        for name, (ids, grads) in updates.items():
            arr = _as_ids(ids, f"push '{name}'")
            shapes[name] = arr.shape
            arr = arr.ravel()
            dim = self.dim(name)
            g = self._as_values(grads, arr.size, dim, f"push '{name}' gradients")
            if unique:
                prepared.append((name, dim, arr, g, arr.size, None))
                continue
            uniq, inverse = np.unique(arr, return_inverse=True)
            if uniq.size != arr.size:  # sum repeated ids: one sorted segment-sum, no Python loop
                order = np.argsort(inverse, kind="stable")
                starts = np.searchsorted(inverse[order], np.arange(uniq.size))
                g = np.add.reduceat(g[order], starts, axis=0)
            else:
                g = g[np.argsort(inverse)] if arr.size else g
            prepared.append((name, dim, uniq, g, arr.size, inverse))
        grads_of = {name: g for name, _, _, g, _, _ in prepared}
        results = {name: np.empty((u.size, dim), np.float32) for name, dim, u, _, _, _ in prepared
                   if return_tables is None or name in return_tables}

        call_id = f"{self._client_id}-{next(self._push_counter)}"

        def build(ps_tables, request_id=None):
            if request_id is None:  # a first attempt: this part's own id
                request_id = _part_request_id(call_id, ps_tables)
            return ps_pb2.PushRequest(
                request_id=request_id, step_id=call_id,
                epoch=self.routing.epoch if self.routing else 0, return_values=return_values,
                return_tables=sorted(return_tables or ()),
                tables=[ps_pb2.TableUpdate(table=n, ids=codec.ids_to_bytes(i),
                                           values=codec.floats_to_bytes(grads_of[n][pos]))
                        for n, i, pos in ps_tables])

        def store(name, positions, payload):
            if name in results:
                results[name][positions] = codec.floats_from_bytes(
                    payload, positions.size, self._dims[name], name)

        self._fan_out([(n, u) for n, _, u, _, _, _ in prepared], build,
                      lambda stub: stub.Push, store if return_values else None, "push",
                      with_positions=True, idempotent=False)
        if not return_values:
            return None
        return {name: (results[name] if inverse is None else results[name][inverse])
                .reshape(shapes[name] + (dim,)) for name, dim, _, _, _, inverse in prepared
                if name in results}

    def prepare_push(self, updates: Mapping[str, tuple], return_tables=()) -> "PreparedPush":
        """Check and encode a push (``{table: (unique ids, grads)}``) for
        ``lookup_with_push`` ahead of the call: its per-PS requests for the current
        routing are built here, in the caller's thread (the worker's step end), so the
        lookup op that carries it only sends. A bad push is refused here."""
        return_tables = set(return_tables or ())
        pushes = []
        for name, (ids, grads) in updates.items():
            arr = _as_ids(ids, f"push '{name}'").ravel()
            dim = self.dim(name)
            pushes.append((name, arr, self._as_values(grads, arr.size, dim,
                                                      f"push '{name}' gradients")))
        prep = PreparedPush(pushes, {n: g for n, _, g in pushes}, return_tables,
                            f"{self._client_id}-{next(self._push_counter)}",
                            self.routing or self.refresh_routing())
        by_ps: dict[int, list] = {}
        for name, arr, _ in pushes:
            for p, sel in prep.routing.partition(arr):
                by_ps.setdefault(p, []).append((name, arr[sel], sel))
        prep.prebuilt = {p: self._push_request(prep, parts, None) for p, parts in by_ps.items()}
        return prep

    def _push_request(self, prep: "PreparedPush", parts, rid):
        """(PushRequest of ``parts`` [(table, ids, positions)], its request id)."""
        if rid is None:  # a first attempt: the id of this PS's part, as push_many
            rid = _part_request_id(prep.call_id, parts)
        return ps_pb2.PushRequest(
            request_id=rid, epoch=self.routing.epoch if self.routing else 0,
            return_values=bool(prep.return_tables), return_tables=sorted(prep.return_tables),
            tables=[ps_pb2.TableUpdate(table=n, ids=codec.ids_to_bytes(i),
                                       values=codec.floats_to_bytes(prep.grads_of[n][pos]))
                    for n, i, pos in parts]), rid

    def lookup_with_push(self, requests: Mapping[str, np.ndarray], updates,
                         insert_missing: bool = True, return_tables=()):
        """One step's calls in one RPC per PS: push ``updates`` (``{table: (unique ids,
        grads)}``, the previous step's, or a ``prepare_push`` of them), then look up
        ``requests`` (``{table: unique ids}``). Each PS applies its part of the push
        before it reads any row, so the values answered are those a waited push leaves.
        A PS that owns pushed rows but none looked up gets the push alone (in the same
        kind of call). Returns ``(values, pushed)``: ``values`` as
        ``lookup_many(unique=True)``, ``pushed`` the values of ``return_tables`` after
        the push (``{}`` when none asked).

        Retries follow ``push_many``: each push part keeps the request id of its first
        attempt (a PS that applied it skips the resend), and a push part whose call timed
        out is not resent (it may have been applied)."""
        prep = updates if isinstance(updates, PreparedPush) \
            else self.prepare_push(updates, return_tables)
        return_tables = prep.return_tables
        looks = []
        for name, ids in requests.items():
            arr = _as_ids(ids, f"lookup '{name}'").ravel()
            looks.append((name, arr, self.dim(name)))
        values = {n: np.empty((a.size, d), np.float32) for n, a, d in looks}
        pushed = {n: np.empty((a.size, self._dims[n]), np.float32) for n, a, _ in prep.pushes
                  if n in return_tables}
        # parts: (kind, table, ids, positions, request id of the push part's first attempt)
        pending = [("L", n, a, np.arange(a.size), None) for n, a, _ in looks if a.size]
        pending += [("P", n, a, np.arange(a.size), None) for n, a, _ in prep.pushes if a.size]
        epoch = lambda: self.routing.epoch if self.routing else 0  # noqa: E731

        def push_request(p, routing, parts, rid):
            if rid is None and routing is prep.routing and p in prep.prebuilt:
                return prep.prebuilt[p]  # built at the step end, for this very routing
            return self._push_request(prep, parts, rid)

        delays = self.retry.sleeps()
        first_failure = None
        while pending:
            routing = self.routing or self.refresh_routing()
            by_ps: dict[int, tuple[list, dict]] = {}
            for kind, name, ids, pos, rid in pending:
                for p, sel in routing.partition(ids):
                    lk, pu = by_ps.setdefault(p, ([], {}))
                    part = (name, ids[sel], pos[sel])
                    if kind == "L":
                        lk.append(part)
                    else:
                        pu.setdefault(rid, []).append(part)
            calls = []
            prefetch = _RoutingPrefetch(self, routing.epoch)
            for p, (lk, pu) in by_ps.items():
                stub = self._stub(routing.ps_addresses[p])
                groups = list(pu.items()) or [(None, None)]
                for k, (rid, parts) in enumerate(groups):
                    preq, sent_rid = push_request(p, routing, parts, rid) \
                        if parts is not None else (None, None)
                    # the push given to the constructor: ``req.push.CopyFrom`` measured
                    # 3.3 ms a DeepFM step (a deep copy of the payload), this 0.03 ms
                    req = ps_pb2.LookupRequest(
                        epoch=epoch(), insert_missing=insert_missing, push=preq,
                        tables=[ps_pb2.TableIds(table=n, ids=codec.ids_to_bytes(i))
                                for n, i, _ in (lk if k == 0 else ())])
                    calls.append((lk if k == 0 else [], parts or [], sent_rid, stub, req))
                    self.stats["rpcs"] += 1
            # the others in flight while this thread makes the last (with 1 PS the only)
            # call blocking: a future costs a spin thread and a hand-off (see _fan_out)
            answers = [lambda s=s, r=r: s.Lookup(r, timeout=self.rpc_timeout)
                       for *_, s, r in calls[-1:]]
            futures = [s.Lookup.future(r, timeout=self.rpc_timeout) for *_, s, r in calls[:-1]]
            for fut in futures:
                fut.add_done_callback(prefetch.on_done)
            answers = [f.result for f in futures] + answers
            retry, failure = [], None
            for (lk, parts, sent_rid, _, _), answer in zip(calls, answers):
                try:
                    resp = answer()
                except grpc.RpcError as exc:
                    failure = self._refused(exc, "lookup with push on PS", bool(parts),
                                            prefetch, failure)
                    retry.extend(("L", n, i, pos, None) for n, i, pos in lk)
                    retry.extend(("P", n, i, pos, sent_rid) for n, i, pos in parts)
                    continue
                if parts and not resp.HasField("push"):
                    # a PS that predates carried pushes ignores the field: never lose it
                    # silently (the lookup was answered, the push not applied)
                    raise InvalidRequestError(
                        "lookup with push: the PS did not apply the carried push (it "
                        "predates LookupRequest.push); upgrade the PS or train without "
                        "overlap='carry'")
                for (name, _, pos), payload in zip(lk, resp.values):
                    values[name][pos] = codec.floats_from_bytes(payload, pos.size,
                                                                self._dims[name], name)
                if return_tables:
                    for (name, _, pos), payload in zip(parts, resp.push.values):
                        if name in pushed:
                            pushed[name][pos] = codec.floats_from_bytes(
                                payload, pos.size, self._dims[name], name)
            pending = retry
            if pending:
                first_failure = first_failure or time.monotonic()
                self._reroute(failure, delays, prefetch)
        if first_failure is not None:
            stall_ms = (time.monotonic() - first_failure) * 1000
            self.stats["max_stall_ms"] = max(self.stats.get("max_stall_ms", 0.0), stall_ms)
        return values, pushed

    def _refused(self, exc: grpc.RpcError, what: str, resend_unsafe: bool,
                 prefetch: "_RoutingPrefetch", failure):
        """A part of a call was refused: raise what a resend cannot fix, and a push part
        that timed out (``resend_unsafe``: it may have been applied, never twice); else
        count it, start the routing long poll if the PS is unreachable, and return the
        failure the call reports (stale routing wins: it names the epoch to wait for)."""
        err = _error_from_rpc(exc, what)
        if not isinstance(err, (StaleRoutingError, UnavailableError)):
            raise err from exc
        if resend_unsafe and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise err from exc
        key = "stale_retries" if isinstance(err, StaleRoutingError) else "unavailable_retries"
        self.stats[key] += 1
        if isinstance(err, UnavailableError):
            prefetch.start()  # before the other answers are collected
        return err if failure is None or isinstance(err, StaleRoutingError) else failure

    def _reroute(self, failure, delays, prefetch: "_RoutingPrefetch | None" = None,
                 trace: dict | None = None) -> None:
        """After parts of a call were refused (stale routing, an unreachable PS): take the
        next retry delay (``failure`` is raised once they are spent) and adopt a newer
        routing, from the long poll ``prefetch`` sent at the refusal, else by waiting for
        a new epoch (unreachable) or asking for it (stale)."""
        delay = next(delays, None)
        if delay is None:  # retry deadline spent (stale or unavailable alike)
            raise failure
        fresh = None
        if isinstance(failure, UnavailableError):
            asked = time.monotonic()
            if prefetch is not None:
                fresh = prefetch.result(min(delay, self.ROUTING_LONG_POLL_SECONDS + 0.1))
            if fresh is None:
                fresh = self._await_new_epoch(delay - (time.monotonic() - asked))
            if trace is not None:
                trace["new_routing"] = time.monotonic()
        elif prefetch is not None and prefetch.future is not None:
            prefetch.future.cancel()
        min_epoch = getattr(failure, "epoch", -1)
        if fresh is not None and fresh.ps_addresses and fresh.epoch >= min_epoch:
            # the poll's answer is the routing: asking again cost a round trip to the
            # AIMaster in every recovery's first resent request
            with self._lock:
                if self.routing is None or fresh.epoch >= self.routing.epoch:
                    self.routing = fresh
            return
        try:
            self.refresh_routing(min_epoch)
        except RoutingNotReadyError:
            raise failure from None

    def _fan_out(self, tables, build, method, store, what: str, with_positions: bool = False,
                 idempotent: bool = True):
        """Send each table's unique ids to their owners, one RPC per PS, in parallel.

        ``tables`` is [(name, unique ids)]. Parts refused with stale routing or an
        unavailable PS are re-partitioned with fresh routing and resent; parts that
        succeeded are never resent. A push that timed out is not resent either: it may
        have been applied, and sending it again could apply it twice. The time a call
        spends waiting on re-routing is its stall, reported in ``stats``.
        """
        # (table, ids, positions, request id): a part resent after a failure keeps the id
        # of its first attempt, even when a new layout splits it over several PS, and
        # parts of different attempts never share a request: a PS that applied (or was
        # handed, by replication, promotion or migration) that id skips the resend
        pending = [(name, ids, np.arange(ids.size), None) for name, ids in tables if ids.size]
        delays = self.retry.sleeps()
        first_failure = None
        while pending:
            routing = self.routing or self.refresh_routing()
            by_ps: dict[tuple, list] = {}
            for name, ids, pos, rid in pending:
                for p, sel in routing.partition(ids):
                    by_ps.setdefault((p, rid), []).append((name, ids[sel], pos[sel]))
            calls = []
            last = len(by_ps) - 1
            prefetch = _RoutingPrefetch(self, routing.epoch)
            for k, ((p, rid), parts) in enumerate(by_ps.items()):
                payload = [(n, i, pos) if with_positions else (n, i) for n, i, pos in parts]
                req = build(payload) if rid is None else build(payload, rid)
                rpc = method(self._stub(routing.ps_addresses[p]))
                if k < last:  # the others run while this thread makes the last call
                    fut = rpc.future(req, timeout=self.rpc_timeout)
                    fut.add_done_callback(prefetch.on_done)
                    calls.append((parts, getattr(req, "request_id", None), fut.result))
                else:
                    # the last (with 1 PS the only) call blocks in this thread, and is
                    # collected first (the futures are in flight by then): a future costs
                    # a channel spin thread started per call and a hand-off back, measured
                    # at twice the client CPU of a blocking call
                    calls.insert(0, (parts, getattr(req, "request_id", None),
                                     lambda rpc=rpc, req=req: rpc(req, timeout=self.rpc_timeout)))
                self.stats["rpcs"] += 1
            retry, failure = [], None
            for parts, sent_rid, answer in calls:
                try:
                    resp = answer()
                except grpc.RpcError as exc:
                    failure = self._refused(exc, f"{what} on PS", not idempotent, prefetch,
                                            failure)
                    retry.extend((n, i, pos, sent_rid) for n, i, pos in parts)
                    continue
                if store is not None:
                    for (name, _, pos), payload in zip(parts, resp.values):
                        store(name, pos, payload)
            pending = retry
            if pending:
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                    trace = self.last_reroute = {"what": what, "failed": now}
                log.debug("%s: %s; refreshing routing and resending %d table part(s)",
                          what, failure, len(pending))
                self._reroute(failure, delays, prefetch, trace)
        if first_failure is not None:
            trace["done"] = time.monotonic()
            stall_ms = (trace["done"] - first_failure) * 1000
            self.stats["max_stall_ms"] = max(self.stats.get("max_stall_ms", 0.0), stall_ms)

    def take_max_stall_ms(self) -> float:
        """Longest re-routing stall since the last call (and reset it)."""
        return self.stats.pop("max_stall_ms", 0.0)

    # -- introspection -----------------------------------------------------------------
    def ps_stats(self) -> list[ps_pb2.StatsResponse]:
        routing = self.routing or self.refresh_routing()
        return [self._stub(a).Stats(ps_pb2.StatsRequest(), timeout=10) for a in routing.ps_addresses]
