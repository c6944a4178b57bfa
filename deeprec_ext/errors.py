"""One error family for the runtime; callers decide what to do from the type.

Across the wire a refusal carries its kind (:class:`ErrorKind`) in the status's trailing
metadata, so callers decide by kind, never by the text of the message:

    server:  errors.abort(context, grpc.StatusCode.ABORTED, ErrorKind.BUSY, "a scale runs")
    client:  if errors.kind_of(rpc_error) is ErrorKind.BUSY: retry later

The status code stays the coarse, standard answer a stock gRPC client understands.
"""
from __future__ import annotations

from enum import Enum

import grpc


class DeepRecError(Exception):
    """Base of every error raised by deeprec_ext."""


class InvalidRequestError(DeepRecError, ValueError):
    """The request itself is wrong (dtype, shape, unknown table, bad config). Not retried."""


class UnknownTableError(InvalidRequestError, KeyError):
    """No table of that name exists on the PS."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else "unknown table"


class StaleRoutingError(DeepRecError):
    """The PS does not own a requested slot at the client's epoch; refresh and retry."""

    def __init__(self, message: str, epoch: int):
        super().__init__(message)
        self.epoch = epoch


class UnavailableError(DeepRecError):
    """A PS or the AIMaster could not be reached within the retry budget."""


class RoutingNotReadyError(DeepRecError):
    """The AIMaster has no complete routing table yet (PS still starting)."""


ERROR_KIND_KEY = "x-deeprec-error"


class ErrorKind(str, Enum):
    """What a refusal means to the caller."""
    BUSY = "busy"                    # another operation holds the job: try again later
    NOT_RUNNING = "not_running"      # the job is starting or over
    REFUSED = "refused"              # the request is wrong here (bounds, missing config)
    PREEMPTED = "preempted"          # a recovery took precedence; nothing was committed
    STALE_EPOCH = "stale_epoch"      # a routing push older than what the PS already has
    RESYNCING = "resyncing"          # the replica is being rebuilt: not promotable yet
    NO_REPLICA = "no_replica"        # the peer holds no copy of the requested origin
    NEEDS_FULL = "needs_full"        # an incremental checkpoint cannot be cut: take a full one


def abort(context, code: grpc.StatusCode, kind: ErrorKind, message: str,
          metadata: tuple = ()) -> None:
    """End an RPC with ``code`` and ``message``, the kind in the trailing metadata."""
    context.set_trailing_metadata(((ERROR_KIND_KEY, kind.value), *metadata))
    context.abort(code, message)


def kind_of(exc: BaseException) -> ErrorKind | None:
    """The kind an RpcError carries, or None (not one of ours, or a transport error)."""
    trailing = getattr(exc, "trailing_metadata", None)
    if not callable(trailing):
        return None
    try:
        for key, value in trailing() or ():
            if key == ERROR_KIND_KEY:
                return ErrorKind(value)
    except ValueError:  # a kind this version does not know
        return None
    return None
