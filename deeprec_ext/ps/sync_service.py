"""Step aggregation for the accuracy-consistent (sync) mode. numpy + grpc only.

A job in sync mode has V virtual workers. In every global step each of them sends this PS
one contribution (its gradients for the rows this PS owns, possibly none), tagged
(step, virtual rank). The PS holds them until all V of the step are here, sums them in
virtual-rank order and applies the optimizer once per row: the result depends only on
the V micro-batches, never on which physical worker computed which, nor on how many PS
share the rows (the sum and the optimizer are per row). Lookups for step s wait until
step s-1 is applied, so they see exactly the state after it.

Nothing here runs in asynchronous mode: it is a separate service on the same server,
sharing the PS's store, routing and gate.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np

from deeprec_ext import codec
from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.proto import sync_pb2, sync_pb2_grpc
from deeprec_ext.ps import validation

log = logging.getLogger(__name__)


def sum_in_rank_order(parts: list[tuple[np.ndarray, np.ndarray]], dim: int):
    """``parts`` is [(unique ids, grads [n, dim])] in virtual-rank order. Returns the
    sorted union of the ids and, per id, the sum of its gradients added in that order,
    starting from +0.0: a fixed order of float additions, so the same bits every time."""
    parts = [(i, g) for i, g in parts if i.size]
    if not parts:
        return np.empty(0, np.int64), np.empty((0, dim), np.float32)
    union = np.unique(np.concatenate([i for i, _ in parts]))
    acc = np.zeros((union.size, dim), np.float32)
    for ids, grads in parts:  # one vectorized add per virtual worker (ids unique within one)
        acc[np.searchsorted(union, ids)] += grads
    return union, acc


@validation.answers_refusals(sync_pb2.DESCRIPTOR.services_by_name["SyncParameterServer"])
class SyncServicer(sync_pb2_grpc.SyncParameterServerServicer):
    def __init__(self, ps):
        self.ps = ps  # the ParameterServerServicer whose store, routing and gate we share
        self._cond = threading.Condition()
        self._pending: dict[int, dict[int, list]] = {}  # step -> {virtual rank: work}
        self._num_virtual: dict[int, int] = {}
        self.applied_step = -1
        self.applied_rows = 0
        self._before: tuple[int, dict] = (-1, {})  # (step, {table: (sorted ids, values before)})

    def _validate(self, tables, context) -> list:
        return self.ps.decode_updates(tables, context, what="step contribution", unique=True)

    def Contribute(self, request, context):
        v, step = request.virtual_workers, request.step
        if v <= 0 or step < 0:
            self.ps._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                            f"virtual_workers must be > 0 and step >= 0, got {v} and {step}")
        ranks = [c.virtual_rank for c in request.contributions]
        if any(r < 0 or r >= v for r in ranks) or len(set(ranks)) != len(ranks):
            self.ps._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                            f"virtual ranks {ranks} must be distinct and within [0, {v})")
        gate = self.ps.routing.gate
        gate.acquire_shared()  # a fence (SetRouting) waits for the step to be held or applied
        try:
            parsed = [(c.virtual_rank, self._validate(c.tables, context))
                      for c in request.contributions]
            duplicates = 0
            with self._cond:
                if step <= self.applied_step:  # a resend of an applied step: already counted
                    return sync_pb2.ContributeResponse(applied_step=self.applied_step,
                                                       duplicates=len(parsed))
                known = self._num_virtual.setdefault(step, v)
                if known != v:
                    self.ps._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                                    f"step {step}: virtual_workers {v} != {known} of earlier contributions")
                bucket = self._pending.setdefault(step, {})
                for rank, work in parsed:
                    if rank in bucket:
                        duplicates += 1
                    else:
                        bucket[rank] = work
                if len(bucket) == v:
                    self._apply(step, bucket)
                return sync_pb2.ContributeResponse(applied_step=self.applied_step,
                                                   duplicates=duplicates)
        finally:
            gate.release_shared()

    def _apply(self, step: int, bucket: dict) -> None:
        """Sum a complete step in virtual-rank order and apply it (caller holds _cond)."""
        by_table: dict[str, list] = {}
        tables = {}
        for rank in sorted(bucket):
            for table, ids, vals in bucket[rank]:
                tables[table.name] = table
                by_table.setdefault(table.name, []).append((ids, vals))
        rows = 0
        before = {}
        for name in sorted(by_table):
            table = tables[name]
            ids, grads = sum_in_rank_order(by_table[name], table.dim)
            if ids.size:
                # the rows as they were before this step: a virtual worker re-run on a new
                # host after its old one died mid-step must read exactly what it read then
                before[name] = (ids, table.lookup(ids, insert_missing=False))
                table.apply_gradients(ids, grads)
                rows += int(ids.size)
        self._before = (step, before)
        del self._pending[step]
        self._num_virtual.pop(step, None)
        self.applied_step = max(self.applied_step, step)
        self.applied_rows += rows
        self._cond.notify_all()

    def _missing(self, step: int) -> str:
        pend = sorted(s for s in self._pending if s < step)
        if not pend:
            return ""
        s = pend[0]
        # the first few missing ranks, found without listing all V (V comes with the request)
        have, v = self._pending[s], self._num_virtual.get(s, 0)
        missing = []
        rank = 0
        while rank < v and len(missing) < 10:
            if rank not in have:
                missing.append(rank)
            rank += 1
        more = v - len(have) - len(missing)
        return (f"step {s} still waits for virtual ranks {missing}"
                + (f" and {more} more" if more > 0 else ""))

    def StepLookup(self, request, context):
        step = request.step
        wait = validation.seconds(request.wait_seconds, "wait_seconds", 0.0, 3600.0) or 10.0
        # answered before the caller's deadline: a waiting handler holds one of the PS's
        # few threads, and nobody would read a late answer
        deadline = time.monotonic() + validation.within_deadline(context, wait)
        with self._cond:
            # every earlier step must be applied: the caller already delivered its own
            # contributions to them, so an earlier step pending here is incomplete
            while (problem := self._missing(step)):
                left = deadline - time.monotonic()
                if left <= 0:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"lookup for step {step}: {problem}")
                self._cond.wait(min(left, 1.0))
            applied = self.applied_step
            before_step, before = self._before
            if applied >= step and before_step != step:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"lookup for step {step}: this PS applied step {applied} already "
                              "and keeps the rows before the last step only")
            if applied < step:
                before = {}
        # Step ``step`` cannot be applied while we read: it needs the caller's own
        # contributions to it, which come after this answer. (The gate is taken outside
        # _cond: Contribute takes them in the other order.)
        self.ps.routing.gate.acquire_shared()
        try:
            work = []
            for t in request.tables:
                table = self.ps._table(t.table, context)
                try:
                    ids = codec.ids_from_bytes(t.ids, f"table '{t.table}' ids")
                except InvalidRequestError as exc:
                    self.ps._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                self.ps.routing.check(ids, context)
                work.append((table, ids))
            # insert_missing=False: rows are created by the step that updates them, so a
            # lookup writes nothing and every layout holds the same row set
            out = []
            for table, ids in work:
                values = table.lookup(ids, insert_missing=False)
                if table.name in before:  # a re-run of the step applied last: undo it
                    b_ids, b_values = before[table.name]
                    pos = np.minimum(np.searchsorted(b_ids, ids), b_ids.size - 1)
                    hit = b_ids[pos] == ids
                    values[hit] = b_values[pos[hit]]
                out.append(codec.floats_to_bytes(values))
        finally:
            self.ps.routing.gate.release_shared()
        return sync_pb2.StepLookupResponse(values=out, applied_step=applied)

    def SyncState(self, request, context):
        with self._cond:
            return sync_pb2.SyncStateResponse(applied_step=self.applied_step,
                                              pending_steps=sorted(self._pending),
                                              applied_rows=self.applied_rows)
