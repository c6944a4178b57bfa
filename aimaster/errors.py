"""The AIMaster's error family. Callers decide by type, and over gRPC by the
:class:`~deeprec_ext.errors.ErrorKind` each type carries, never by message text.

    OperationRefused   the request cannot be carried out; nothing was changed
      +-- Busy         another operation holds the job: the same request may succeed later
      +-- NotRunning   the job is not running (starting, or over)
      +-- Preempted    a recovery took precedence; nothing was committed
"""
from __future__ import annotations

import grpc

from deeprec_ext import errors as wire
from deeprec_ext.errors import ErrorKind


class OperationRefused(ValueError):
    """A request for a change (scale, rebalance, checkpoint) that cannot be carried out
    now or at all; nothing was changed. The base class: the request itself is wrong here
    (out of bounds, missing config)."""
    kind = ErrorKind.REFUSED
    code = grpc.StatusCode.FAILED_PRECONDITION


class Busy(OperationRefused):
    kind = ErrorKind.BUSY
    code = grpc.StatusCode.ABORTED  # gRPC's "retry at a higher level"


class NotRunning(OperationRefused):
    kind = ErrorKind.NOT_RUNNING


class Preempted(OperationRefused):
    kind = ErrorKind.PREEMPTED
    code = grpc.StatusCode.ABORTED


# the name the scale API used first
ScaleRefused = OperationRefused

_BY_KIND = {cls.kind: cls for cls in (OperationRefused, Busy, NotRunning, Preempted)}


def abort(context, exc: OperationRefused) -> None:
    """End an RPC with the refusal's status code, message and kind."""
    wire.abort(context, exc.code, exc.kind, str(exc))


def from_rpc_error(exc: grpc.RpcError) -> OperationRefused | None:
    """The refusal an RpcError carries (client side), or None if it is not one."""
    cls = _BY_KIND.get(wire.kind_of(exc))
    return cls(exc.details()) if cls else None
