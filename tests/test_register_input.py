"""A PS's control endpoint is where every AIMaster and peer call to it goes: a Register
with a malformed one is refused with a message naming it, and the job keeps serving."""
from __future__ import annotations

import grpc
import pytest

from deeprec_ext.grpc_util import insecure_channel
from deeprec_ext.proto import master_pb2, master_pb2_grpc
from tests.conftest import wait_for


CASES = [
    ("ps", "no-port", "control_address must be host:port"),
    ("ps", "127.0.0.1:99999", "control_address must be host:port"),
    ("ps", "127.0.0.1:12 34", "control_address must be host:port"),
    ("worker", "127.0.0.1:1234", "only a PS registers a control_address"),
]


def test_bad_control_address_is_refused_and_the_job_serves_on(start_job):
    job = start_job({"name": "register-input"}, ["--ps", "1", "--workers", "0"])
    # the job's PS registers after the job answers: compare against the settled membership
    before = wait_for(lambda: [m["id"] for m in job.status()["members"]], 60, "ps-0 to register")
    with insecure_channel(job.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for role, control, message in CASES:
            with pytest.raises(grpc.RpcError) as info:
                stub.Register(master_pb2.RegisterRequest(
                    role=role, id=f"{role}-7", pid=1, address="127.0.0.1:4000",
                    control_address=control), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (control, info.value)
            assert message in info.value.details(), (control, info.value.details())
    assert [m["id"] for m in job.status()["members"]] == before
