"""One error family for the runtime; callers decide what to do from the type."""
from __future__ import annotations


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
