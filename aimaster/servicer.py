"""The AIMaster's gRPC service: checks each request, calls the master's public methods,
and turns refusals into status codes with their kind (``aimaster.errors``)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from aimaster import errors
from aimaster.registry import MemberState
from aimaster.shards import ShardState
from deeprec_ext.data import fs as data_fs
from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.proto import master_pb2, master_pb2_grpc
from deeprec_ext.ps import validation

if TYPE_CHECKING:  # pragma: no cover
    from aimaster.master import JobMaster

MAX_MODEL_JSON = 16 << 20
MAX_INDEX = 2**31 - 1   # a member's rank (its id's index) is an int32 on the wire
MAX_STEPS = 2**53       # counters beyond any real job (sums of them stay within int64)
MAX_ROUTING_WAIT_MS = 250  # a GetRouting long poll holds one of the AIMaster's handler threads


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, master: "JobMaster"):
        self.m = master

    def Register(self, request, context):
        if request.role not in ("ps", "worker", "client", "evaluator"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"role must be 'ps', 'worker', 'client' or 'evaluator', got {request.role!r}")
        if request.role == "ps" and not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a PS must register with its address")
        if request.control_address:
            if request.role != "ps":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "only a PS registers a control_address")
            try:  # every AIMaster and peer call to this PS would go there
                validation.address(request.control_address, "control_address")
            except InvalidRequestError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        suffix = request.id.rsplit("-", 1)[-1]
        if "-" in request.id and suffix.isdigit() and int(suffix) >= MAX_INDEX:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"member id {request.id[:80]!r}: its index must be below {MAX_INDEX}")
        try:
            member = self.m.register(request.role, request.id, request.pid, request.address,
                                     request.incarnation, request.control_address)
        except ValueError as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        cfg = self.m.config
        return master_pb2.RegisterResponse(id=member.id, lease_seconds=cfg.lease_seconds,
                                           heartbeat_seconds=cfg.heartbeat_seconds,
                                           epoch=self.m.epoch, rank=member.rank, job_name=cfg.name)

    def Heartbeat(self, request, context):
        if not (0 <= request.steps <= MAX_STEPS and 0 <= request.samples <= MAX_STEPS):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"steps ({request.steps}) and samples ({request.samples}) must be in "
                          f"[0, {MAX_STEPS}]")
        known, stop = self.m.heartbeat(request.id, request.steps, request.samples,
                                       request.max_stall_ms, request)
        return master_pb2.HeartbeatResponse(epoch=self.m.epoch, known=known, stop=stop,
                                            split_shard=known and not stop
                                            and self.m.take_split_ask(request.id))

    def Deregister(self, request, context):
        self.m.deregister(request.id, request.reason)
        return master_pb2.DeregisterResponse()

    def GetRouting(self, request, context):
        if request.wait_ms > 0:  # a long poll: answer once the epoch is above after_epoch
            routing = self.m.wait_routing(request.after_epoch,
                                          min(request.wait_ms, MAX_ROUTING_WAIT_MS) / 1000)
        else:
            routing = self.m.routing
        if routing is None:
            ready = len(self.m.live_ps())
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"routing not ready: {ready}/{self.m.config.ps.replicas} PS registered")
        return routing.to_proto()

    def _live_worker(self, worker_id: str, context) -> None:
        member = self.m.registry.get(worker_id)
        if member is None or member.role != "worker" or member.state != MemberState.RUNNING:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{worker_id!r} is not a live registered worker")

    def GetShard(self, request, context):
        if self.m.shards is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this job has no data section: no shards to hand out")
        self._live_worker(request.worker_id, context)
        state, shard = self.m.assign_shard(request.worker_id)
        if state == ShardState.DOING:
            data = self.m.config.data
            return master_pb2.GetShardResponse(
                status=master_pb2.GetShardResponse.SHARD,
                shard=master_pb2.Shard(shard_id=shard.shard_id, path=data_fs.absolute(shard.path),
                                       start=shard.start, end=shard.end, data_epoch=shard.data_epoch,
                                       size=shard.size, format=shard.format,
                                       on_bad_record=data.on_bad_record, fields=data.fields,
                                       delimiter=data.delimiter))
        if state == ShardState.DONE:
            # one of the job's files (shard_id -1, not an assignment): a worker that got no
            # shard still reads the columns' types from it (shard_dataset(columns=...))
            first = self.m.shards.any_shard()
            return master_pb2.GetShardResponse(
                status=master_pb2.GetShardResponse.FINISHED,
                shard=master_pb2.Shard(shard_id=-1, path=data_fs.absolute(first.path),
                                       size=first.size, format=first.format)
                if first is not None else None)
        return master_pb2.GetShardResponse(status=master_pb2.GetShardResponse.WAIT)

    def ReportShard(self, request, context):
        if self.m.shards is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job has no data section")
        if request.returned_progress:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "returned_progress (records of a line-range shard) comes from a worker "
                          "of an older version: shards are byte ranges now and a returned shard "
                          "carries returned_positions; upgrade the worker's deeprec_ext")
        if request.returned_positions and len(request.returned_positions) != len(request.returned_shard_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "returned_positions must have one entry per returned shard")
        if request.bad_records:
            self.m.report_bad_input(request.worker_id, [
                {"shard_id": b.shard_id, "path": b.path, "offset": b.offset, "reason": b.reason,
                 "count": b.count or 1} for b in request.bad_records], request.bad_input_fatal)
        if len(request.split_positions) != len(request.split_shard_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "split_positions must have one entry per split shard")
        split = self.m.split_shards(request.worker_id, list(request.split_shard_ids),
                                    list(request.split_positions)) \
            if request.split_shard_ids else []
        missing = self.m.report_shards(request.worker_id, list(request.done_shard_ids),
                                       list(request.returned_shard_ids),
                                       list(request.returned_positions))
        if missing:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shards {missing} are not DOING for {request.worker_id!r} "
                          "(reassigned after a lease loss?)")
        return master_pb2.ReportShardResponse(split_shard_ids=split)

    def Status(self, request, context):
        return self.m.status()

    def Scale(self, request, context):
        ps = request.ps if request.HasField("ps") else None
        workers = request.workers if request.HasField("workers") else None
        timeout = request.timeout_seconds or 600.0
        if request.rebalance and (ps is not None or workers is not None):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "rebalance moves slots between the current PS; give no counts with it")
        if not request.rebalance and ps is None and workers is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a PS count, a worker count or both")
        try:
            event = self.m.rebalance(timeout=timeout) if request.rebalance \
                else self.m.scale(ps, workers, timeout)
        except errors.OperationRefused as exc:
            errors.abort(context, exc)
        return master_pb2.ScaleResponse(event_json=json.dumps(event, sort_keys=True))

    def Checkpoint(self, request, context):
        try:
            event = self.m.checkpoint(full=request.full)
        except errors.OperationRefused as exc:
            errors.abort(context, exc)
        except (OSError, ValueError, grpc.RpcError) as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {exc}")
        return master_pb2.CheckpointResponse(event_json=json.dumps(event, sort_keys=True))

    def PutModel(self, request, context):
        if len(request.model_json) > MAX_MODEL_JSON:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model_json is {len(request.model_json)} bytes; at most 16 MiB")
        try:
            self.m.put_model(request.worker_id, request.model_json)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return master_pb2.PutModelResponse()

    def Barrier(self, request, context):
        self._live_worker(request.worker_id, context)
        timeout = max(1.0, (context.time_remaining() or 600.0) - 0.5)
        try:
            gen, ids, leave = self.m.barrier(request.worker_id, request.generation, timeout)
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return master_pb2.BarrierResponse(generation=gen, worker_ids=ids, leave=leave)
