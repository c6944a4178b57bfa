"""Collect one snapshot of a job: AIMaster status plus every PS's Stats."""
from __future__ import annotations

import time

import grpc

from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc


def snapshot(master_address: str, timeout: float = 5.0) -> dict:
    with insecure_channel(master_address) as ch:
        st = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(), timeout=timeout)
    out = {"time": time.time(), "job": st.job_name, "phase": st.phase, "epoch": st.epoch,
           "shards": {"todo": st.shards.todo, "doing": st.shards.doing, "done": st.shards.done},
           "workers": [], "ps": []}
    for m in st.members:
        if m.role == "worker":
            out["workers"].append({"id": m.id, "state": m.state, "steps": m.steps,
                                   "samples": m.samples})
        elif m.role == "ps":
            entry = {"id": m.id, "state": m.state, "address": m.address}
            if m.state == "running":
                try:
                    with insecure_channel(m.address) as ch:
                        s = ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(),
                                                                      timeout=timeout)
                    entry.update(rss_bytes=s.rss_bytes, sequence=s.sequence, lookups=s.lookups,
                                 pushes=s.pushes, rejected=s.rejected,
                                 tables=[{"name": t.name, "dim": t.dim, "rows": t.rows,
                                          "bytes": t.bytes, "optimizer": t.optimizer}
                                         for t in s.tables])
                except grpc.RpcError as exc:
                    entry["error"] = f"{exc.code().name}: {exc.details()}"
            out["ps"].append(entry)
    return out
