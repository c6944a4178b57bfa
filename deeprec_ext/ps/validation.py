"""Checks of request fields shared by the PS's RPCs (ParameterServer and sync service).

Each raises :class:`InvalidRequestError` naming the field and the problem; the RPC answers
INVALID_ARGUMENT with that message before anything changes. Payload decoding (ids, float
rows) lives in :mod:`deeprec_ext.codec`.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re

import grpc
import numpy as np

from deeprec_ext import table_spec
from deeprec_ext.errors import InvalidRequestError, UnknownTableError

# A row of a table holds dim floats plus the optimizer's slots (up to 2 more per float),
# and a new table's arena starts at 1024 rows: 1 << 20 floats (4 MiB a row) keeps that
# first allocation (mapped lazily) within 12 GiB of address space. Dense variables are
# stored with their first axis as rows, so dim is the product of the other axes.
MAX_DIM = 1 << 20
# Table names become checkpoint file names (``<writer>.<name>.rows``, non-alphanumeric
# characters %-escaped per UTF-8 byte); most file systems allow 255 bytes a name.
MAX_QUOTED_NAME = 200
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# A routing slot count the PS accepts (the AIMaster's num_slots is at most this).
MAX_SLOTS = 1 << 24


def table_name(name: str, field: str = "table name") -> str:
    if not name:
        raise InvalidRequestError(f"{field} must not be empty")
    quoted = len(name) if len(name) > MAX_QUOTED_NAME else \
        sum(1 if c in _SAFE else 3 * len(c.encode("utf-8", "surrogatepass")) for c in name)
    if quoted > MAX_QUOTED_NAME:
        raise InvalidRequestError(
            f"{field} {name[:40]!r}... is too long: at most {MAX_QUOTED_NAME} characters once "
            "quoted for checkpoint file names (characters other than A-Z a-z 0-9 _ - count "
            "3 per UTF-8 byte)")
    return name


def dim(value: int, table: str) -> int:
    if not 0 < value <= MAX_DIM:
        raise InvalidRequestError(f"table '{table}': dim must be within [1, {MAX_DIM}], got {value}")
    return value


def table_config(cfg) -> tuple[object, object]:
    """A TableConfig message checked: (initializer spec, optimizer spec) parsed from its JSON.
    The specs themselves are checked by the store (unknown names, bad hyperparameters)."""
    table_name(cfg.name)
    dim(cfg.dim, cfg.name)
    if cfg.dtype not in ("", "float32", "float16"):
        raise InvalidRequestError(f"table '{cfg.name}': dtype must be 'float32' or 'float16', "
                                  f"got {cfg.dtype[:40]!r}")
    return table_spec.from_wire(cfg)


def slot_mask(raw: bytes, num_slots: int, expected: int | None = None,
              field: str = "slots") -> np.ndarray:
    """A uint8 [num_slots] mask as bool. ``expected``: the slot count the PS routes by
    (a mask over another slot count would name other keys)."""
    mask = np.frombuffer(raw, dtype=np.uint8)
    if not 0 < num_slots <= MAX_SLOTS or mask.size != num_slots:
        raise InvalidRequestError(f"{field} has {mask.size} entries, num_slots is {num_slots} "
                                  f"(must be equal, within [1, {MAX_SLOTS}])")
    if expected is not None and num_slots != expected:
        raise InvalidRequestError(f"num_slots {num_slots} differs from this PS's routing "
                                  f"({expected} slots)")
    return mask.astype(bool)


def checkpoint_root(root: str) -> str:
    """Checkpoint roots are absolute: a relative one would be resolved against the PS's
    working directory, which is not the caller's. A URL (s3://bucket/prefix) is taken
    as it is: the checkpoint code names a missing bucket or a refused key itself."""
    if root and "\x00" not in root and re.match(r"^[a-z][a-z0-9+.-]*://[^/]+", root) \
            and not root.startswith("file://"):
        return root
    if not root or "\x00" in root or not os.path.isabs(root):
        raise InvalidRequestError(f"checkpoint root must be an absolute path, got {root!r}")
    return root


def sequence_map(text: str, field: str) -> dict[str, int]:
    """A JSON object {table: sequence number >= 0} (empty text: {})."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"{field}: malformed JSON: {exc}") from None
    if not isinstance(value, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63
            for v in value.values()):
        raise InvalidRequestError(f"{field} must be a JSON object of table name -> sequence "
                                  f"number (0 <= n < 2^63), got {text[:100]!r}")
    return value


def address(value: str, field: str) -> str:
    """A PS address: host:port (the form the AIMaster hands out)."""
    host, _, port = value.rpartition(":")
    if (not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536
            or len(value) > 1024 or any(c.isspace() or not c.isprintable() for c in value)):
        raise InvalidRequestError(f"{field} must be host:port, got {value[:100]!r}")
    return value


def within_deadline(context, longest: float) -> float:
    """A timeout for a call made on behalf of ``context``: at most ``longest``, and ending
    shortly before the caller's own deadline."""
    left = context.time_remaining()
    return longest if left is None else max(min(longest, left - 0.5), 0.01)


def downstream_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """The status to answer when a call this PS made on the caller's behalf failed: an
    unreachable or slow peer as such, anything else ABORTED (the peer refused; the caller's
    request was not at fault)."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return code
    return grpc.StatusCode.ABORTED


def seconds(value: float, field: str, lo: float, hi: float) -> float:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequestError(f"{field} must be finite and within [{lo:g}, {hi:g}], got {value}")
    return value


def answers_refusals(service):
    """Class decorator for a servicer of ``service`` (a ServiceDescriptor): in each of its
    RPC methods, an :class:`InvalidRequestError` raised by the checks above (or deeper)
    answers INVALID_ARGUMENT (an unknown table: NOT_FOUND) with its message, and a failed
    allocation RESOURCE_EXHAUSTED, instead of escaping as UNKNOWN. The servicer's
    ``_count("rejected")``, if it has one, counts the refusal."""
    def decorate(cls):
        for method in service.methods:
            fn = cls.__dict__.get(method.name)
            if fn is not None:
                setattr(cls, method.name, _answering(fn, method.name))
        return cls
    return decorate


def _answering(fn, name: str):
    @functools.wraps(fn)
    def handler(self, request, context):
        try:
            return fn(self, request, context)
        except InvalidRequestError as exc:
            _count_rejected(self)
            code = grpc.StatusCode.NOT_FOUND if isinstance(exc, UnknownTableError) \
                else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, str(exc))
        except MemoryError:
            _count_rejected(self)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{name}: this PS ran out of memory serving the request")
    return handler


def _count_rejected(servicer) -> None:
    owner = getattr(servicer, "ps", servicer)  # the sync service counts on its PS
    count = getattr(owner, "_count", None)
    if count is not None:
        count("rejected")


class _Undecodable:
    """What the guarded deserializer returns for bytes that are no message of the type."""

    def __init__(self, error: str):
        self.error = error


def _fast_deserializers() -> dict:
    from deeprec_ext import rowwire
    # a migration's row stream and replication's (full copies, deltas): fields read as
    # views of the received bytes (no copy)
    return {"/deeprec_ext.ps.ParameterServer/ImportRows": rowwire.parse,
            "/deeprec_ext.ps.ParameterServer/Replicate": rowwire.parse}


FAST_DESERIALIZERS = _fast_deserializers()


class DecodeGuard(grpc.ServerInterceptor):
    """Answers a request whose bytes are not a message of the method's request type with
    INVALID_ARGUMENT naming the method, from the handler's thread.

    gRPC's own answer (INTERNAL "Exception deserializing request!") has a worse flaw for
    client-streaming methods (ImportRows, Replicate): after one such stream the server's
    ``stop(grace).wait()`` may never return, so the PS hung at exit (grpcio 1.85). The
    deserializer never raises here: it returns a marker that the method's wrapper refuses.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        inner = FAST_DESERIALIZERS.get(method, handler.request_deserializer)

        def deserialize(raw):
            try:
                return inner(raw)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
                return _Undecodable(f"{type(exc).__name__}: {exc}")

        def refuse(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: the request is not a message of the method's "
                              f"request type ({request.error})")
            return request

        def checked(requests, context):
            for request in requests:
                yield refuse(request, context)

        kw = dict(request_deserializer=deserialize,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            fn = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: fn(refuse(req, ctx), ctx), **kw)
        if handler.unary_stream:
            fn = handler.unary_stream

            def unary_stream(req, ctx):
                yield from fn(refuse(req, ctx), ctx)
            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        if handler.stream_unary:
            fn = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(
                lambda reqs, ctx: fn(checked(reqs, ctx), ctx), **kw)
        fn = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            lambda reqs, ctx: fn(checked(reqs, ctx), ctx), **kw)
