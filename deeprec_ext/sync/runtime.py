"""Worker side of the sync mode: virtual workers and the step loop (no TensorFlow here).

A physical worker hosts the virtual workers the AIMaster's step barrier gives it. Each
virtual worker carries its own data position and random state; both travel through the
barrier when it moves to another host, so what it computes never depends on where it
runs. One global step on a host:

1. every hosted virtual worker reads its next micro-batch (its own shards, its own RNG);
2. one lookup per PS for the union of their ids plus every dense row, answered with the
   state after the previous step;
3. each virtual worker's gradients, in virtual-rank order;
4. one contribution per virtual worker to every PS, tagged (step, virtual rank);
5. back to the barrier with the virtual workers' new states.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Protocol

import numpy as np

from deeprec_ext.grpc_util import call_with_retry
from deeprec_ext.proto import master_pb2, master_pb2_grpc, sync_pb2, sync_pb2_grpc
from deeprec_ext.sync.client import SyncPSClient
from deeprec_ext.worker import ShardReader, WorkerContext

log = logging.getLogger(__name__)

_Status = sync_pb2.StepBarrierResponse
DENSE_PREFIX = "dense/"  # same table names as the asynchronous dense sync (deeprec_ext/tf/dense.py)


def dense_layout(shape) -> tuple[int, int]:
    """[rows, dim] a variable of ``shape`` is stored as (rows = first axis)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    return shape[0], int(np.prod(shape[1:]))


class StepModel(Protocol):
    """What the step loop needs from a model (``deeprec_ext.sync.keras.KerasStepModel``)."""

    def tables(self) -> dict[str, tuple[int, str, object, object]]:
        """{table: (dim, id feature, initializer spec, optimizer spec)}"""

    def dense(self) -> list[tuple[str, tuple, np.ndarray]]:
        """[(name, shape, initial value)] of the dense trainable variables."""

    def dense_optimizer(self) -> dict: ...

    def set_dense(self, values: list[np.ndarray]) -> None: ...

    def gradients(self, features: dict, label: np.ndarray, rows: dict[str, np.ndarray]):
        """-> (loss, [dense grads], {table: row grads [n, dim]}) for one micro-batch whose
        id features hold positions into the unique ids whose values are ``rows``."""


class VirtualWorker:
    """One logical worker: rank, next step, data cursor (shard k of its list, records of
    it consumed: a shard's records are the same whoever reads them) and a numpy Generator. ``state_json`` round-trips all of it."""

    def __init__(self, rank: int, step: int, shards: list, shard: int, offset: int,
                 rng: np.random.Generator):
        self.rank, self.step, self.shards = rank, step, shards
        self.shard, self.offset, self.rng = shard, offset, rng
        self._reader = ShardReader()
        self.sent_state = ""

    @classmethod
    def from_state(cls, state: sync_pb2.VirtualWorkerState, seed: int, shards: list) -> "VirtualWorker":
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, state.virtual_rank])))
        shard = offset = 0
        if state.state_json:
            d = json.loads(state.state_json)
            shard, offset = d["shard"], d["offset"]
            rng.bit_generator.state = d["rng"]
        vw = cls(state.virtual_rank, state.step, shards, shard, offset, rng)
        vw.sent_state = state.state_json
        return vw

    def state(self) -> sync_pb2.VirtualWorkerState:
        self.sent_state = json.dumps({"shard": self.shard, "offset": self.offset,
                                      "rng": self.rng.bit_generator.state}, sort_keys=True)
        return sync_pb2.VirtualWorkerState(virtual_rank=self.rank, step=self.step,
                                           state_json=self.sent_state)

    def read(self, n: int) -> list[bytes]:
        """The next ``n`` records of this virtual worker's data."""
        out: list[bytes] = []
        while len(out) < n:
            if self.shard >= len(self.shards):
                raise RuntimeError(f"virtual worker {self.rank} ran out of data at step {self.step}")
            records, _ = self._reader.read(self.shards[self.shard])
            take = min(n - len(out), len(records) - self.offset)
            out.extend(records[self.offset:self.offset + take])
            self.offset += take
            if self.offset >= len(records):
                self.shard, self.offset = self.shard + 1, 0
        return out

    def close(self) -> None:
        self._reader.close()


class SyncTrainer:
    """Runs the sync-mode step loop for this process until the barrier says FINISHED or
    LEAVE. ``prepare(lines, rng) -> (features, label)`` turns a micro-batch of records
    into numpy inputs; it may draw from the virtual worker's ``rng``."""

    def __init__(self, ctx: WorkerContext, model: StepModel, micro_batch: int,
                 prepare: Callable[[list[bytes], np.random.Generator], tuple[dict, np.ndarray]],
                 throttle_seconds: float = 0.0):
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch <= 0:
            raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
        self.ctx, self.model, self.micro_batch, self.prepare = ctx, model, micro_batch, prepare
        self.throttle_seconds = throttle_seconds
        self.ps = SyncPSClient(ctx.client)
        self.coordinator = sync_pb2_grpc.SyncCoordinatorStub(ctx.session.channel)
        self.tables = model.tables()
        names, shapes, initial = zip(*model.dense()) if model.dense() else ((), (), ())
        self.dense_names = [DENSE_PREFIX + n for n in names]
        self.dense_shapes = list(shapes)
        self.dense_layouts = [dense_layout(s) for s in shapes]
        self._dense_initial = list(initial)
        self._shards: dict[int, list] = {}
        self.hosted: dict[int, VirtualWorker] = {}
        self.stats = {"steps": 0, "micro_batches": 0, "step_seconds": [], "losses": [],
                      "step_ends": [], "first_step_start": None,
                      "series": []}  # (wall time, samples trained here) per step
        self.finished = False
        self.primary = False

    # -- setup ---------------------------------------------------------------------------
    def create_tables(self) -> None:
        client = self.ctx.client
        for name, (dim, _, init, opt) in self.tables.items():
            client.create_table(name, dim, initializer=init, optimizer=opt)
        for name, (rows, dim), value in zip(self.dense_names, self.dense_layouts, self._dense_initial):
            # first creator wins: every worker seeds identically, so all agree anyway
            client.create_table(name, dim, initializer="zeros", optimizer=self.model.dense_optimizer(),
                                init_ids=np.arange(rows, dtype=np.int64),
                                init_values=np.asarray(value, np.float32).reshape(rows, dim))

    def _shards_of(self, rank: int) -> list:
        if rank not in self._shards:
            resp = call_with_retry(lambda: self.coordinator.VirtualShards(
                sync_pb2.VirtualShardsRequest(virtual_rank=rank), timeout=30), "virtual shards")
            self._shards[rank] = list(resp.shards)
        return self._shards[rank]

    # -- the loop ------------------------------------------------------------------------
    def _barrier(self, step: int, generation: int) -> sync_pb2.StepBarrierResponse:
        req = sync_pb2.StepBarrierRequest(
            worker_id=self.ctx.worker_id, step=step, micro_batch=self.micro_batch,
            leaving=self.ctx.stop_requested.is_set(), generation=generation,
            states=[vw.state() for _, vw in sorted(self.hosted.items())])
        while True:
            resp = call_with_retry(lambda: self.coordinator.StepBarrier(req, timeout=30),
                                   "step barrier", self.ctx.retry)
            if resp.status != _Status.WAIT:
                return resp
            req.leaving = self.ctx.stop_requested.is_set()

    def _adopt(self, resp: sync_pb2.StepBarrierResponse) -> None:
        """Take the virtual workers the barrier placed here (keep the objects, and their
        open files, of those that stay and whose state is what we sent)."""
        hosted = {}
        for s in resp.states:
            vw = self.hosted.get(s.virtual_rank)
            if vw is None or vw.step != s.step or vw.sent_state != s.state_json:
                if vw is not None:
                    vw.close()
                vw = VirtualWorker.from_state(s, resp.seed, self._shards_of(s.virtual_rank))
            hosted[s.virtual_rank] = vw
        for rank, vw in self.hosted.items():
            if rank not in hosted:
                vw.close()
        self.hosted = hosted

    def run(self) -> dict:
        self.create_tables()
        step, generation = -1, 0
        while True:
            resp = self._barrier(step, generation)
            if resp.status in (_Status.FINISHED, _Status.LEAVE):
                self.finished = resp.status == _Status.FINISHED
                self.primary = resp.primary
                break
            generation = resp.generation
            if hasattr(self.model, "set_virtual_workers"):
                self.model.set_virtual_workers(resp.virtual_workers)
            routing = self.ctx.client.routing
            if routing is None or routing.epoch < resp.routing_epoch:
                self.ctx.client.refresh_routing(resp.routing_epoch)
            self._adopt(resp)
            # virtual workers whose old host died mid-step catch up first (same inputs,
            # same state before that step: the PS drops what it already counted)
            for t in sorted({vw.step for vw in self.hosted.values() if vw.step <= resp.step}):
                self.run_step(t, resp.virtual_workers,
                              [vw for _, vw in sorted(self.hosted.items()) if vw.step == t])
            step = resp.step + 1
        for vw in self.hosted.values():
            vw.close()
        self.ps.close()
        ends, first = self.stats["step_ends"], self.stats["first_step_start"]
        return {"finished": self.finished, "primary": self.primary, "steps": self.stats["steps"],
                "micro_batches": self.stats["micro_batches"],
                "samples": self.stats["micro_batches"] * self.micro_batch,
                "train_seconds": (ends[-1] - first) if ends else 0.0}

    def run_step(self, step: int, virtual_workers: int, vws: list[VirtualWorker]) -> None:
        start = time.monotonic()
        if self.stats["first_step_start"] is None:
            self.stats["first_step_start"] = start
        batches = []
        union_parts: dict[str, list] = {name: [] for name in self.tables}
        for vw in vws:
            features, label = self.prepare(vw.read(self.micro_batch), vw.rng)
            uniq = {}
            for name, (_, feature, _, _) in self.tables.items():
                if feature not in uniq:
                    ids = np.asarray(features[feature], np.int64)
                    u, inv = np.unique(ids, return_inverse=True)
                    uniq[feature] = u
                    features[feature] = inv.reshape(ids.shape).astype(np.int64)
                union_parts[name].append(uniq[feature])
            batches.append((vw, features, label, uniq))
        request = {name: np.unique(np.concatenate(parts)) for name, parts in union_parts.items()}
        for name, (rows, _) in zip(self.dense_names, self.dense_layouts):
            request[name] = np.arange(rows, dtype=np.int64)
        values = self.ps.step_lookup(step, request)
        self.model.set_dense([values[n].reshape(s) for n, s in zip(self.dense_names, self.dense_shapes)])
        contributions = {}
        for vw, features, label, uniq in batches:
            rows, ids_of = {}, {}
            for name, (_, feature, _, _) in self.tables.items():
                ids = uniq[feature]
                rows[name] = values[name][np.searchsorted(request[name], ids)]
                ids_of[name] = ids
            loss, dense_grads, row_grads = self.model.gradients(features, label, rows)
            c = {name: (ids_of[name], np.asarray(row_grads[name], np.float32)) for name in self.tables}
            for name, (n_rows, dim), g in zip(self.dense_names, self.dense_layouts, dense_grads):
                c[name] = (request[name], np.asarray(g, np.float32).reshape(n_rows, dim))
            contributions[vw.rank] = c
            self.stats["losses"].append(float(loss))
            del self.stats["losses"][:-1000]
        self.ps.contribute(step, virtual_workers, contributions)
        for vw in vws:
            vw.step = step + 1
        self.stats["steps"] += 1
        self.stats["micro_batches"] += len(vws)
        self.ctx.record_steps(1, self.micro_batch * len(vws))
        if self.throttle_seconds:
            time.sleep(self.throttle_seconds)
        end = time.monotonic()
        self.stats["step_seconds"].append(end - start)
        self.stats["step_ends"].append(end)
        self.stats["series"].append((time.time(), self.stats["micro_batches"] * self.micro_batch))
        for key in ("step_seconds", "step_ends", "series"):
            del self.stats[key][:-10000]

    # -- end -------------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """A full checkpoint of the final model (tables and dense weights), taken by the
        host of virtual rank 0 once training finished."""
        stub = master_pb2_grpc.MasterStub(self.ctx.session.channel)
        resp = stub.Checkpoint(master_pb2.CheckpointRequest(full=True), timeout=600)
        return json.loads(resp.event_json)


__all__ = ["SyncTrainer", "VirtualWorker", "StepModel"]
