"""Adam's bias correction counts the table's steps as TF counts ``iterations``: the parts
of one push call that reach a PS as several requests (a resend after a routing change)
are one step. Real gRPC to an in-process PS."""
from __future__ import annotations

import numpy as np

from deeprec_ext.proto import ps_pb2 as pb
from tests.test_migration_wire import _serve


def test_parts_of_one_push_call_are_one_adam_step():
    svc, srv, ch, stub, _ = _serve("ps-a")
    try:
        cfg = pb.TableConfig(name="adam", dim=4, optimizer_json='{"name": "adam"}')
        stub.CreateTable(pb.CreateTableRequest(config=cfg), timeout=30)
        ids = np.arange(1, 101, dtype=np.int64)

        def push(part, step_id):
            stub.Push(pb.PushRequest(step_id=step_id, tables=[pb.TableUpdate(
                table="adam", ids=part.tobytes(),
                values=np.ones((part.size, 4), np.float32).tobytes())]), timeout=30)
        push(ids[:50], "w-1")
        push(ids[50:], "w-1")  # the rest of the same call
        assert svc.store["adam"].optimizer.step == 1
        push(ids[:50], "w-2")
        push(ids[:50], "")  # no step_id: each request is a step
        push(ids[50:], "")
        assert svc.store["adam"].optimizer.step == 4
        _, rows, _ = svc.store["adam"].export_rows()
        assert sorted(set(rows[:, 12].tolist())) == [3.0, 4.0]  # each row's last step
    finally:
        ch.close()
        svc.replicator.close()
        srv.stop(0).wait(10)
        svc.close()
