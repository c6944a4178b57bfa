"""Seeded, structure-aware fuzzing of every public RPC against real processes.

An ``aimaster run`` job with 2 PS processes (in sync mode, so that the SyncCoordinator is
served too, with a small data set and a job token), plus a spare PS process outside the
job, get for every method of every service found in the generated descriptors
(``deeprec_ext/proto/*_pb2.py``: a new RPC is fuzzed without touching this file) requests
of the method's own type, each field filled with extreme values (0, -1, integer limits,
NaN/inf, empty, very long and odd strings, byte payloads of wrong lengths such as 7 bytes
of "int64 ids", huge declared sizes, repeated fields with many entries; nested messages
recursively), often made consistent where fields relate (ids and values of the named
table's dim, masks and num_slots, a live worker's id) so the code behind the first check
is reached; plus raw bytes as the request (random, truncated, mutated, invalid UTF-8, bad
length prefixes, deep nesting). Streams are opened, fed a little, and sometimes cancelled.
Every call has a deadline. Each method alone, then each service's methods interleaved.

Asserted:
  1. no process dies, and each keeps answering normal requests (after every method);
  2. no call hangs: every answer comes before the client's deadline, and a fuzzed PS
     still stops on SIGTERM;
  3. no handler ends in an unhandled exception: never UNKNOWN (gRPC's answer when one
     escapes a handler) and every refusal has a message; no background thread died, no
     AIMaster plugin hook failed, nothing is left spinning;
  4. a sentinel table no request names keeps its rows byte for byte (after every method);
  5. without the job token, or with a wrong one, every method refuses every call.

What the fuzz found is fixed and kept as one deterministic case each: in the PS and
Gazer ``test_fixed_finding``, in the AIMaster's MasterServicer ``test_master_finding``.

``FUZZ_SEED`` picks the seed (printed in every failure: rerun with it to reproduce) and
``FUZZ_ROUNDS`` multiplies the requests per method (the default is a short CI run).
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf.message_factory import GetMessageClass

from deeprec_ext import auth
from deeprec_ext.proto import gazer_pb2, master_pb2, ps_pb2, sync_pb2
from tests.conftest import ROOT, Job, pid_alive, wait_for

SEED = int(os.environ.get("FUZZ_SEED", "20240611"))
ROUNDS = max(1, int(os.environ.get("FUZZ_ROUNDS", "1")))
STRUCTURED_PER_ENDPOINT = 24   # structured requests per method and endpoint, per round
RAW_PER_ENDPOINT = 8           # raw byte payloads per method and endpoint, per round
DEADLINE = 3.0                 # seconds, every call
TOKEN = "fuzz-job-token-5b1e0c77d2a94f8e"
SENTINEL = "fuzz_sentinel"
NUM_SLOTS = 256
MAX_DIM = 1 << 20  # the PS's limit (deeprec_ext/ps/validation.py)
FUZZ_TABLES = {"fz_sgd": (4, {"name": "sgd", "learning_rate": 0.5}),
               "fz_adam": (3, {"name": "adam", "learning_rate": 0.01}),
               "fz_add": (1, {"name": "assign_add"}),
               "dense/fz_kernel": (8, {"name": "assign_add"})}
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# Methods not fuzzed, with the reason: their effect is to start, stop or kill processes.
SKIP = {
    "deeprec_ext.master.Master/Scale":
        "its effect is to start and stop member processes (a scale-in ends PS and workers); "
        "its refusals are covered by tests/test_elasticity.py",
}
# Methods fuzzed on the spare PS only (a PS process outside the job), with the reason.
SPARE_ONLY = {
    "deeprec_ext.ps.ParameterServer/SetRouting":
        "the AIMaster's command giving a PS its slots and ring peer: a valid one re-assigns "
        "the PS for good (routing epochs only move forward), which is its job, not a bug",
}
# gRPC's own answers to a payload that is not a message of the method's type (no servicer
# code runs); anything else from the framework means a handler bug
FRAMEWORK_REFUSALS = {"Exception deserializing request!"}


def seed_note() -> str:
    return f"[FUZZ_SEED={SEED} FUZZ_ROUNDS={ROUNDS}]"


# -- the services, from the generated descriptors ---------------------------------------------
def _proto_modules():
    for path in sorted(glob.glob(str(ROOT / "deeprec_ext" / "proto" / "*_pb2.py"))):
        yield importlib.import_module(f"deeprec_ext.proto.{Path(path).stem}")


def all_methods() -> list[tuple[str, _descriptor.MethodDescriptor]]:
    """[("package.Service/Method", descriptor)] of every service of the project."""
    out = []
    for mod in _proto_modules():
        for service in mod.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                out.append((f"{service.full_name}/{method.name}", method))
    return out


METHODS = all_methods()
SERVICES = sorted({name.split("/")[0] for name, _ in METHODS})


def request_class(method: _descriptor.MethodDescriptor):
    return GetMessageClass(method.input_type)


def kind(method: _descriptor.MethodDescriptor) -> str:
    return {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, False): "stream_unary", (True, True): "stream_stream"}[
        (method.client_streaming, method.server_streaming)]


# -- value generation ---------------------------------------------------------------------------
FD = _descriptor.FieldDescriptor
INT_EXTREMES = {
    FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1),
    FD.TYPE_SFIXED32: (-2**31, 2**31 - 1), FD.TYPE_INT64: (-2**63, 2**63 - 1),
    FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}
FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-3, float("nan"), float("inf"), float("-inf"),
          1.7976931348623157e308, -1.7976931348623157e308, 5e-324, 3.5e38, 1e9, 86400.0 * 365)
ODD_STRINGS = ("", " ", "x", "-", "\n", "\t\r", "\x00", "a\x00b", "\x7f", "é", "\u200b",
               "\ufeff", "\U0001f600" * 3, "\u202e" + "txt.exe", "𝔘𝔫𝔦", "%s%n%x", "{}", "[]",
               "null", "../../../../etc/passwd", "..", ".", "/", "\\", "ps-", "worker-",
               "worker-99999999999999999999", "ps-2147483648", "x-\u00b2", "x-\u0663",
               "w" * 300, "λ" * 5000, "A" * 70000)
ADDRESSES = ("", "127.0.0.1:1", "10.255.255.1:9", "127.0.0.1:0", "localhost:99999", "256.0.0.1:80", ":::",
             "unix:/nonexistent/fuzz.sock", "dns:///fuzz.invalid:1", "[::1]:1", "x" * 1000,
             "127.0.0.1:-5", "ipv4:300.1.1.1:1", "\x00:1")
ROLE_VALUES = ("ps", "worker", "client", "", "PS", "chief", "ps\x00", "w" * 500)
KIND_VALUES = ("full", "incr", "", "FULL", "partial", "incr\x00")
ID_FIELDS = {"ids", "init_ids", "deleted_ids"}
FLOAT_FIELDS = {"values", "init_values", "rows"}
MASK_FIELDS = {"slots", "owned_slots"}
JSON_FIELDS = {"initializer_json", "optimizer_json", "since_json", "model_json", "state_json"}
TABLE_FIELDS = {"table", "return_tables"}
ADDRESS_FIELDS = {"dst_address", "replica_peer", "address"}


class Fuzzer:
    """Seeded request generator. ``context`` holds what a structure-aware fuzzer should
    know of the job: table names and dims, the slot count, ids seen in answers, paths."""

    def __init__(self, rng: random.Random, tables: dict[str, int], work_dir: Path,
                 forbidden: set[str]):
        self.rng = rng
        self.tables = dict(tables)
        self.work_dir = work_dir
        self.forbidden = forbidden
        self.learned: list[str] = []  # ids the servers handed out (Register answers)

    # primitives
    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def integer(self, ftype: int, name: str) -> int:
        lo, hi = INT_EXTREMES[ftype]
        r = self.rng
        special = [0, -1, 1, 2, 7, lo, hi, lo + 1, hi - 1, 2**31, -2**31, 2**32, 2**53, 255, 256]
        if name == "num_slots":
            special += [NUM_SLOTS] * 6 + [NUM_SLOTS + 1, NUM_SLOTS - 1, 4096, 1 << 24]
        if name == "dim":
            special += [1, 3, 4, 8, 64, (1 << 20) + 1, 1 << 24, 2**31 - 1]
        if name in ("step", "generation", "virtual_rank", "virtual_workers", "micro_batch",
                    "since_seq", "ckpt_id", "parent", "epoch", "pid"):
            special += [0, 1, 2, 3, 5, 64, 10**6]
        v = r.choice(special) if self.chance(0.8) else r.randint(lo, hi)
        if name == "dim" and 64 < v <= MAX_DIM:
            # a dim the PS accepts stays small: a lookup of 200k new ids into a table the
            # fuzz created must not take gigabytes of the machine (the limit itself is fuzzed)
            v = v % 64 + 1
        return min(max(v, lo), hi)

    def floating(self, name: str) -> float:
        return self.rng.choice(FLOATS) if self.chance(0.85) else self.rng.uniform(-1e6, 1e6)

    def string(self, name: str) -> str:
        r = self.rng
        if name in TABLE_FIELDS or (name == "name" and self.chance(0.7)):
            pool = list(self.tables) * 3 + ["nope", "", "fz_sgd\x00", "FZ_SGD"]
            s = r.choice(pool) if self.chance(0.8) else r.choice(ODD_STRINGS)
        elif name in ADDRESS_FIELDS:
            s = r.choice(ADDRESSES)
        elif name == "role":
            s = r.choice(ROLE_VALUES)
        elif name == "kind":
            s = r.choice(KIND_VALUES)
        elif name in JSON_FIELDS:
            s = self.json_text(name)
        elif name == "root":
            s = self.root_path()
        elif self.learned and self.chance(0.3):
            s = r.choice(self.learned)
        else:
            s = r.choice(ODD_STRINGS) if self.chance(0.7) else "".join(
                chr(r.choice([r.randint(0x20, 0x7e), r.randint(0xa0, 0xd7ff),
                              r.randint(0xe000, 0x10ffff)])) for _ in range(r.randint(1, 40)))
        return "fz-not-forbidden" if s in self.forbidden else s

    def root_path(self) -> str:
        r = self.rng
        return r.choice([
            str(self.work_dir / "ckpt_root"), str(self.work_dir / "ckpt_root"),
            str(self.work_dir / "missing" / "deeper"), str(self.work_dir / "a_file"),
            "", "fuzz-relative-root", "./fuzz-relative-root/x", "\x00",
            str(self.work_dir / ("n" * 300)), "/proc/fuzz-root", str(self.work_dir / "é\u202e")])

    def json_text(self, name: str) -> str:
        r = self.rng
        choices = ["", "{", "null", "[]", "1e999", "NaN", "\"zeros\"", "\"sgd\"", "{}",
                   '{"name": "sgd", "learning_rate": NaN}', '{"name": "normal", "seed": -1}',
                   '{"name": "normal", "stddev": 1e308}', '{"name": "adam", "beta_1": 1.5}',
                   '{"name": "ftrl"}', '{"name": "adagrad", "initial_accumulator_value": -1}',
                   '{"name": "constant", "value": 3.5e38}', '{"name": {}}', '"' + "x" * 10000 + '"',
                   "[" * 5000 + "]" * 5000, '{"a": ' * 2000 + "1" + "}" * 2000,
                   json.dumps({t: r.choice([-1, 0, 2**63, "x", None]) for t in self.tables}),
                   json.dumps({"kind": r.choice(["keras", "tables", "x", None]),
                               "tables": r.choice([{}, [], {"t": 1}, None])}),
                   json.dumps({"cursor": r.choice([-1, 2**70, "x"]), "rng": [1] * 100})]
        return r.choice(choices)

    def id_bytes(self) -> bytes:
        r = self.rng
        shape = r.random()
        if shape < 0.15:
            return bytes(r.getrandbits(8) for _ in range(r.choice([1, 3, 7, 9, 15, 17])))
        if shape < 0.2:
            return b""
        n = r.choice([1, 2, 3, 8, 64, 1000, 20000]) if shape < 0.95 else 200_000
        special = np.array([0, -1, 1, -2**63, 2**63 - 1, 2**62, -2**62, 42], dtype=np.int64)
        ids = np.random.default_rng(r.getrandbits(32)).integers(-2**63, 2**63 - 1, n,
                                                                dtype=np.int64, endpoint=True)
        if self.chance(0.5):
            ids[: min(n, special.size)] = special[: min(n, special.size)]
        if self.chance(0.2) and n > 1:
            ids[-1] = ids[0]  # a repeated id
        return ids.astype("<i8").tobytes()

    def float_bytes(self, n: int | None = None, dim: int | None = None) -> bytes:
        r = self.rng
        if n is None or dim is None or self.chance(0.3):
            length = r.choice([0, 1, 3, 4, 7, 8, 12, 4096, 4 * 1000 * 3 + 1])
            return bytes(r.getrandbits(8) for _ in range(min(length, 64))) * max(1, length // 64)
        vals = np.random.default_rng(r.getrandbits(32)).standard_normal((n, dim)).astype("<f4")
        if self.chance(0.3) and vals.size:
            vals.flat[r.randrange(vals.size)] = r.choice([np.nan, np.inf, -np.inf, 3.4e38, -0.0])
        return vals.tobytes()

    def mask_bytes(self) -> bytes:
        r = self.rng
        n = r.choice([0, 1, 2, NUM_SLOTS, NUM_SLOTS, NUM_SLOTS, NUM_SLOTS - 1, NUM_SLOTS + 1, 4096])
        fill = r.choice(["zeros", "ones", "random", "bytes"])
        if fill == "zeros":
            m = np.zeros(n, np.uint8)
        elif fill == "ones":
            m = np.ones(n, np.uint8)
        elif fill == "random":
            m = np.random.default_rng(r.getrandbits(32)).integers(0, 2, n).astype(np.uint8)
        else:
            m = np.random.default_rng(r.getrandbits(32)).integers(0, 256, n).astype(np.uint8)
        return m.tobytes()

    def bytes_field(self, name: str, msg) -> bytes:
        if name in ID_FIELDS:
            return self.id_bytes()
        if name in FLOAT_FIELDS:
            return self.float_bytes()
        if name in MASK_FIELDS:
            return self.mask_bytes()
        if name == "gazer_stats":
            return self.message(gazer_pb2.MemberStats).SerializeToString() if self.chance(0.7) \
                else bytes(self.rng.getrandbits(8) for _ in range(self.rng.choice([1, 5, 33])))
        r = self.rng
        return bytes(r.getrandbits(8) for _ in range(r.choice([0, 1, 7, 8, 9, 100, 5000])))

    def scalar(self, field, msg):
        t = field.type
        if t in INT_EXTREMES:
            return self.integer(t, field.name)
        if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
            v = self.floating(field.name)
            if t == FD.TYPE_FLOAT and abs(v) > 3.4e38 and v == v and abs(v) != float("inf"):
                v = float("inf") if v > 0 else float("-inf")
            return v
        if t == FD.TYPE_BOOL:
            return self.chance(0.5)
        if t == FD.TYPE_STRING:
            return self.string(field.name)
        if t == FD.TYPE_BYTES:
            return self.bytes_field(field.name, msg)
        if t == FD.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return self.rng.choice(known + [-1, 99, 2**31 - 1])
        raise AssertionError(f"unhandled field type {t} of {field.full_name}")

    def message(self, cls, depth: int = 0):
        msg = cls()
        r = self.rng
        for field in msg.DESCRIPTOR.fields:
            if self.chance(0.25 if depth else 0.15):
                continue  # left at its default
            repeated = field.is_repeated
            if field.type == FD.TYPE_MESSAGE:
                if depth >= 4:
                    continue
                sub = GetMessageClass(field.message_type)
                if repeated:
                    n = r.choice([0, 1, 2, 3, 5, 40 if depth == 0 else 3])
                    for _ in range(n):
                        getattr(msg, field.name).add().CopyFrom(self.message(sub, depth + 1))
                else:
                    getattr(msg, field.name).CopyFrom(self.message(sub, depth + 1))
                continue
            if repeated:
                n = r.choice([0, 1, 2, 3, 10, 1000])
                values = [self.scalar(field, msg) for _ in range(min(n, 50))]
                values = (values * (n // max(len(values), 1) + 1))[:n]
                getattr(msg, field.name).extend(values)
            else:
                setattr(msg, field.name, self.scalar(field, msg))
        self.make_consistent(msg)
        return msg

    def make_consistent(self, msg) -> None:
        """Often make related fields agree, so requests get past the first check and reach
        the code behind it: ids with values of the named table's dim, masks with num_slots."""
        fields = msg.DESCRIPTOR.fields_by_name
        r = self.rng
        for ids_name, vals_name in (("ids", "values"), ("init_ids", "init_values"), ("ids", "rows")):
            if ids_name in fields and vals_name in fields and self.chance(0.6):
                raw = getattr(msg, ids_name)
                if len(raw) % 8:
                    continue
                n = len(raw) // 8
                if n > 5000:
                    continue
                dim = self.tables.get(getattr(msg, "table", ""), None)
                if "config" in fields and msg.HasField("config"):
                    if msg.config.name in self.tables and self.chance(0.7):
                        msg.config.dim = self.tables[msg.config.name]  # rows for that table
                    if 0 < msg.config.dim <= 64:
                        dim = msg.config.dim
                if vals_name == "rows" and dim is not None and self.chance(0.5):
                    dim = dim * r.choice([1, 2, 3])  # value plus optimizer slots
                if dim is None:
                    dim = r.choice([1, 3, 4, 8])
                setattr(msg, vals_name, self.float_bytes(n, dim))
        for mask_name in MASK_FIELDS:
            if mask_name in fields and "num_slots" in fields and self.chance(0.6):
                msg.num_slots = len(getattr(msg, mask_name))

    def forbid_names(self, msg) -> None:
        """No request names the sentinel table (nor a real member): rewrite any that does."""
        for field, value in msg.ListFields():
            if field.type == FD.TYPE_MESSAGE:
                items = value if field.is_repeated else [value]
                for sub in items:
                    self.forbid_names(sub)
            elif field.type == FD.TYPE_STRING:
                if field.is_repeated:
                    for i, s in enumerate(value):
                        if s in self.forbidden:
                            value[i] = "fz-not-forbidden"
                elif value in self.forbidden:
                    setattr(msg, field.name, "fz-not-forbidden")

    def request(self, cls):
        msg = self.message(cls)
        self.forbid_names(msg)
        return msg

    # raw payloads: not (or not quite) a serialized message of the method's type
    def raw(self, cls) -> bytes:
        r = self.rng
        good = self.request(cls).SerializeToString()
        pick = r.randrange(9)
        if pick == 0:
            return bytes(r.getrandbits(8) for _ in range(r.choice([1, 2, 5, 16, 64, 1000])))
        if pick == 1 and good:
            return good[: r.randrange(len(good))]  # truncated
        if pick == 2 and good:
            b = bytearray(good)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] = r.getrandbits(8)
            return bytes(b)
        if pick == 3:  # a string field holding invalid UTF-8
            strings = [f for f in cls.DESCRIPTOR.fields if f.type == FD.TYPE_STRING]
            f = r.choice(strings) if strings else None
            number = f.number if f else 1
            bad = r.choice([b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"ok\x80ok"])
            return _tag(number, 2) + _varint(len(bad)) + bad
        if pick == 4:  # a length prefix far beyond the payload
            number = r.choice([f.number for f in cls.DESCRIPTOR.fields] or [1])
            return _tag(number, 2) + _varint(r.choice([2**31 - 1, 2**32 + 5, 2**63])) + b"abc"
        if pick == 5:  # deep nesting of unknown groups
            return _tag(r.randint(100, 200), 3) * r.choice([50, 200, 2000])
        if pick == 6:  # unknown fields only: a valid, empty-looking message
            return _tag(r.randint(1000, 2**29 - 1), 0) + _varint(2**64 - 1) + \
                _tag(r.randint(1000, 2**29 - 1), 2) + _varint(3) + b"xyz"
        if pick == 7:  # a field with the wrong wire type
            number = r.choice([f.number for f in cls.DESCRIPTOR.fields] or [1])
            return _tag(number, r.choice([1, 5])) + b"\x00" * 8
        return b""


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        out.append(byte | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


# -- calls --------------------------------------------------------------------------------------
class Outcome:
    def __init__(self, code, details: str = "", elapsed: float = 0.0, cancelled: bool = False,
                 response: bytes | None = None):
        self.code, self.details, self.elapsed = code, details, elapsed
        self.cancelled, self.response = cancelled, response


def call(channel: grpc.Channel, path: str, method, payloads: list[bytes], metadata,
         rng: random.Random | None = None, deadline: float = DEADLINE) -> Outcome:
    """One call with raw payloads (bytes in, bytes out). Streams are opened, fed
    ``payloads`` and read up to their first answer; with ``rng`` they are sometimes
    cancelled early (without: a normal call, read to its first answer)."""
    k = kind(method)
    start = time.monotonic()

    def cancelled() -> Outcome:
        return Outcome(grpc.StatusCode.CANCELLED, "cancelled by the fuzzer",
                       time.monotonic() - start, cancelled=True)

    try:
        if k == "unary_unary":
            resp = channel.unary_unary(path)(payloads[0], timeout=deadline, metadata=metadata)
            return Outcome(grpc.StatusCode.OK, "", time.monotonic() - start, response=resp)
        if k in ("unary_stream", "stream_stream"):
            stream = channel.unary_stream(path)(payloads[0], timeout=deadline, metadata=metadata) \
                if k == "unary_stream" else \
                channel.stream_stream(path)(iter(payloads), timeout=deadline, metadata=metadata)
            if rng is not None and rng.random() < 0.3:
                time.sleep(rng.choice([0.0, 0.02]))
                stream.cancel()  # before (or while) the first answer comes
                return cancelled()
            first = next(stream, None)
            stream.cancel()
            return Outcome(grpc.StatusCode.OK, "", time.monotonic() - start, response=first)
        cancel_midway = rng is not None and rng.random() < 0.3
        held = threading.Event()

        def requests():
            yield from payloads
            if cancel_midway:
                held.wait(deadline)  # the stream stays open until cancelled

        fut = channel.stream_unary(path).future(requests(), timeout=deadline, metadata=metadata)
        if cancel_midway:
            time.sleep(0.05)
            fut.cancel()
            held.set()
        try:
            resp = fut.result()
        except grpc.FutureCancelledError:
            return cancelled()
        return Outcome(grpc.StatusCode.OK, "", time.monotonic() - start, response=resp)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.CANCELLED and "Locally cancelled" in (exc.details() or ""):
            return cancelled()
        return Outcome(code, exc.details() or "", time.monotonic() - start)


def problem(out: Outcome, deadline: float = DEADLINE) -> str | None:
    """What is wrong with an answer to a (possibly bad) request, or None."""
    if out.cancelled:
        return None
    if out.code == grpc.StatusCode.DEADLINE_EXCEEDED and out.elapsed >= deadline * 0.95:
        return f"no answer within the {deadline}s deadline (the call hung)"
    if out.code == grpc.StatusCode.UNKNOWN:
        return f"UNKNOWN (an exception escaped the handler): {out.details!r}"
    if out.code == grpc.StatusCode.CANCELLED:
        return f"CANCELLED by the server: {out.details!r}"
    if out.code != grpc.StatusCode.OK and not out.details.strip():
        return f"{out.code.name} without a message"
    if out.code == grpc.StatusCode.INTERNAL and out.details not in FRAMEWORK_REFUSALS \
            and ("serializ" in out.details or "Exception" in out.details):
        return f"INTERNAL from the framework: {out.details!r}"
    return None


def describe(msg, limit: int = 700) -> str:
    """A short, reproducible description of a request (nested messages inline)."""
    if isinstance(msg, (bytes, bytearray)):
        return f"raw bytes ({len(msg)}): {bytes(msg[:60])!r}"[:limit]

    def value(v) -> str:
        if hasattr(v, "ListFields"):
            return describe(v, limit)
        if isinstance(v, (bytes, str)) and len(v) > 40:
            return f"<{type(v).__name__} len {len(v)}: {v[:20]!r}...>"
        if isinstance(v, (list, tuple)) or type(v).__name__.startswith("Repeated"):
            items = list(v)
            shown = ", ".join(value(x) for x in items[:3])
            return f"[{shown}{', ...' if len(items) > 3 else ''}] ({len(items)})"
        return repr(v)

    fields = ", ".join(f"{f.name}={value(v)}" for f, v in msg.ListFields())
    return f"{type(msg).__name__}({fields})"[:limit]


# -- what the fuzz found in the AIMaster's own MasterServicer, fixed there: each kept as a
# deterministic regression case (test_master_finding). The fuzz sends such requests too.
def _rank_out_of_int32(member_id: str) -> bool:
    suffix = member_id.rsplit("-", 1)[-1]
    if "-" not in member_id or not suffix.isdigit():
        return False
    try:
        return not -2**31 <= int(suffix) < 2**31
    except ValueError:
        return False


def _json_too_deep(text: str) -> bool:
    """Nested too deep for the recursive JSON decoder."""
    try:
        json.loads(text)
    except RecursionError:
        return True
    except ValueError:
        return False
    return False


def _tables_not_an_object(text: str) -> bool:
    """A model spec whose "tables" is not a mapping."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(spec, dict) and spec.get("kind") in ("keras", "tables") \
        and "tables" in spec and not isinstance(spec["tables"], dict)


def _absurd_counters(req) -> bool:
    return max(req.steps, req.samples) > 2**53


@dataclass(frozen=True)
class MasterFailure:
    method: str                 # the failing RPC of the AIMaster's MasterServicer
    matches: Callable           # request -> bool: the fuzz hit this failure
    steps: tuple                # ((method, request), ...): the reproduction, last call fails
    why: str
    # it breaks the AIMaster for every later request: the fuzz does not send it, and its
    # reproduction runs last
    poisons: bool = False


KNOWN_MASTER_FAILURES = {
    "register-rank-beyond-int32": MasterFailure(
        "deeprec_ext.master.Master/Register", lambda req: _rank_out_of_int32(req.id),
        (("deeprec_ext.master.Master/Register",
          master_pb2.RegisterRequest(role="client", id="worker-99999999999999999999")),),
        "Register: Registry.register takes the rank from the id's numeric suffix unbounded and "
        "RegisterResponse.rank is int32: 'Value out of range' escapes the handler (UNKNOWN)"),
    "put-model-json-nested-too-deep": MasterFailure(
        "deeprec_ext.master.Master/PutModel", lambda req: _json_too_deep(req.model_json),
        (("deeprec_ext.master.Master/PutModel",
          master_pb2.PutModelRequest(worker_id="w", model_json="[" * 100_000 + "]" * 100_000)),),
        "PutModel: JobMaster.put_model's json.loads raises RecursionError (not a ValueError) "
        "on deep nesting; it escapes the handler (UNKNOWN)"),
    "put-model-tables-not-an-object": MasterFailure(
        "deeprec_ext.master.Master/PutModel", lambda req: _tables_not_an_object(req.model_json),
        (("deeprec_ext.master.Master/PutModel",
          master_pb2.PutModelRequest(worker_id="w", model_json='{"kind": "keras", "tables": null}')),),
        "PutModel: JobMaster.put_model's sorted(spec.get('tables', {})) raises TypeError for "
        "'tables' that is not an object (null, a number); it escapes the handler (UNKNOWN)"),
    "heartbeat-counters-overflow-status": MasterFailure(
        "deeprec_ext.master.Master/Heartbeat", _absurd_counters,
        (("deeprec_ext.master.Master/Register", master_pb2.RegisterRequest(role="worker", id="worker-70")),
         ("deeprec_ext.master.Master/Register", master_pb2.RegisterRequest(role="worker", id="worker-71")),
         ("deeprec_ext.master.Master/Heartbeat", master_pb2.HeartbeatRequest(id="worker-70", steps=2**63 - 1)),
         ("deeprec_ext.master.Master/Heartbeat", master_pb2.HeartbeatRequest(id="worker-71", steps=2**63 - 1)),
         ("deeprec_ext.master.Master/Status", master_pb2.StatusRequest())),
        "Heartbeat accepts any steps/samples (Registry.heartbeat keeps the max); once the "
        "workers' steps sum past int64, StatusResponse.global_step is out of range and every "
        "Status call answers UNKNOWN for the rest of the job ('aimaster status' is broken)",
        poisons=True),
}


# -- the job ------------------------------------------------------------------------------------
class FuzzJob:
    def __init__(self, job: Job, work_dir: Path):
        self.job = job
        self.work_dir = work_dir
        self.md = (("authorization", f"Bearer {TOKEN}"),)
        self.master_address = job.address
        self.channels: dict[str, grpc.Channel] = {}
        self.client = None
        self.sentinel_ids = np.arange(-500, 1500, 7, dtype=np.int64) * 7919
        self.sentinel_before: bytes = b""
        self.sentinel_rows: dict[str, int] = {}
        self.ps: dict[str, tuple[str, int]] = {}  # job PS id -> (address, pid)
        self.spare = None                           # (address, Popen): a PS outside the job
        self.served: dict[str, list[str]] = {}    # service -> endpoint names
        self.learned: list[str] = []               # member ids the AIMaster handed out
        self.fuzz_seconds = 0.0
        self.codes: dict[str, dict[str, int]] = {}  # method -> status code name -> calls

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            from deeprec_ext.grpc_util import channel_options
            self.channels[address] = grpc.insecure_channel(address, options=channel_options())
        return self.channels[address]

    def endpoints(self) -> dict[str, str]:
        return {"aimaster": self.master_address, **{i: a for i, (a, _) in self.ps.items()},
                "spare-ps": self.spare[0]}

    def pids(self) -> dict[str, int]:
        return {"aimaster": self.job.proc.pid, **{i: p for i, (_, p) in self.ps.items()},
                "spare-ps": self.spare[1].pid}

    def unary(self, address: str, path: str, request, response_cls, timeout: float = 10.0):
        raw = self.channel(address).unary_unary(path)(request.SerializeToString(), timeout=timeout,
                                                     metadata=self.md)
        return response_cls.FromString(raw)

    def status(self) -> master_pb2.StatusResponse:
        return self.unary(self.master_address, "/deeprec_ext.master.Master/Status",
                          master_pb2.StatusRequest(), master_pb2.StatusResponse)

    def sentinel_values(self) -> bytes:
        return self.client.lookup(SENTINEL, self.sentinel_ids, insert_missing=False).tobytes()

    def table_rows(self, name: str) -> dict[str, int]:
        return {s.ps_id: sum(t.rows for t in s.tables if t.name == name)
                for s in self.client.ps_stats()}

    def assert_whole(self, after: str) -> None:
        """Every process alive, answering normal requests; the sentinel unchanged."""
        where = f"{seed_note()} after {after}"
        dead = {n: p for n, p in self.pids().items() if not pid_alive(p)}
        assert not dead, f"{where}: processes died: {dead}\n{self.job.output()[-3000:]}"
        m = self.master_address
        checks = [
            (m, "/deeprec_ext.master.Master/Status", master_pb2.StatusRequest(), master_pb2.StatusResponse),
            (m, "/deeprec_ext.master.Master/GetRouting", master_pb2.GetRoutingRequest(), master_pb2.RoutingResponse),
            (m, "/deeprec_ext.gazer.Gazer/GetSnapshot", gazer_pb2.SnapshotRequest(), gazer_pb2.Snapshot),
            (m, "/deeprec_ext.gazer.Gazer/GetConfig", gazer_pb2.ConfigRequest(), gazer_pb2.ConfigResponse),
        ]
        for address in [a for a, _ in self.ps.values()] + [self.spare[0]]:
            checks += [(address, "/deeprec_ext.ps.ParameterServer/Stats", ps_pb2.StatsRequest(), ps_pb2.StatsResponse),
                       (address, "/deeprec_ext.ps.ParameterServer/ListTables", ps_pb2.ListTablesRequest(), ps_pb2.ListTablesResponse),
                       (address, "/deeprec_ext.sync.SyncParameterServer/SyncState", sync_pb2.SyncStateRequest(), sync_pb2.SyncStateResponse)]
        for address, path, request, response_cls in checks:
            try:
                self.unary(address, path, request, response_cls)
            except grpc.RpcError as exc:
                raise AssertionError(f"{where}: a normal {path} to {address} failed: "
                                     f"{exc.code().name}: {exc.details()}") from None
        watch = dict(METHODS)["deeprec_ext.gazer.Gazer/Watch"]
        out = call(self.channel(m), "/deeprec_ext.gazer.Gazer/Watch", watch,
                   [gazer_pb2.WatchRequest().SerializeToString()], self.md)
        assert out.code == grpc.StatusCode.OK and out.response, \
            f"{where}: a normal Gazer/Watch got {out.code.name}: {out.details}"
        assert self.sentinel_values() == self.sentinel_before, \
            f"{where}: the rows of table '{SENTINEL}', named by no request, changed"

    def close(self):
        if self.client is not None:
            self.client.close()
        for ch in self.channels.values():
            ch.close()
        if self.spare is not None:
            proc = self.spare[1]
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start_spare_ps(directory: Path) -> tuple[str, subprocess.Popen]:
    directory.mkdir()
    port_file = directory / "port"
    with open(directory / "ps.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deeprec_ext.ps", "--id", "ps-spare",
                                 "--port-file", str(port_file)], cwd=directory,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=log, stderr=subprocess.STDOUT)
    port = wait_for(lambda: port_file.exists() and port_file.read_text(), 30, "spare PS port")
    return f"127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def fuzz_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    data = tmp / "data.txt"
    data.write_text("".join(f"{i % 2} {i} {i * 3} {i * 7} {i * 11}\n" for i in range(400)))
    (tmp / "a_file").write_text("not a directory\n")
    saved = os.environ.get(auth.TOKEN_FILE_ENV)
    os.environ[auth.TOKEN_FILE_ENV] = str(token_file)  # this process's PSClient and spare PS
    job = Job(tmp, {"name": "fuzz", "num_slots": NUM_SLOTS,
                    "ps": {"replicas": 2, "max_replicas": 4},
                    "data": {"files": [str(data)], "records_per_shard": 40},
                    "consistency": {"mode": "sync", "virtual_workers": 2, "seed": 3},
                    # members the fuzz registers and abandons expire quickly
                    "master": {"lease_seconds": 4, "heartbeat_seconds": 1}},
              ["--token-file", str(token_file)])
    fj = FuzzJob(job, tmp)
    try:
        fj.spare = _start_spare_ps(tmp / "spare")

        def running():
            try:
                st = fj.status()
            except grpc.RpcError:
                return None
            live = [m for m in st.members if m.role == "ps" and m.state == "running"]
            return st if st.phase == "running" and len(live) == 2 else None
        st = wait_for(running, 90, "2 PS running")
        fj.ps = {m.id: (m.address, m.pid) for m in st.members if m.role == "ps"}
        # the job's own processes: the fuzz registers members with any pid (0, -1, 1,
        # 2^63 - 1, ...), which Job.stop must neither wait for nor kill
        job.member_pids = lambda: [pid for _, pid in fj.ps.values()]
        from deeprec_ext import PSClient
        fj.client = PSClient.connect(job.address, timeout=15)
        fj.client.create_table(SENTINEL, dim=5, initializer={"name": "normal", "seed": 9},
                               optimizer={"name": "adagrad", "learning_rate": 0.3})
        fj.client.push(SENTINEL, fj.sentinel_ids, np.random.default_rng(1).standard_normal(
            (fj.sentinel_ids.size, 5)).astype(np.float32))
        for name, (dim, opt) in FUZZ_TABLES.items():
            fj.client.create_table(name, dim=dim, optimizer=opt)
            fj.client.lookup(name, np.arange(64, dtype=np.int64))
        for name, (dim, opt) in FUZZ_TABLES.items():  # the pool's names: small dims there too
            fj.unary(fj.spare[0], "/deeprec_ext.ps.ParameterServer/CreateTable",
                     ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
                         name=name, dim=dim, optimizer_json=json.dumps(opt))), ps_pb2.CreateTableResponse)
        fj.sentinel_before = fj.sentinel_values()
        fj.sentinel_rows = fj.table_rows(SENTINEL)
        assert all(fj.sentinel_rows.values()), fj.sentinel_rows  # rows on both PS
        fj.relative_before = _relative_writes()
        yield fj
    finally:
        fj.close()
        job.stop()
        if saved is None:
            os.environ.pop(auth.TOKEN_FILE_ENV, None)
        else:
            os.environ[auth.TOKEN_FILE_ENV] = saved


def _relative_writes() -> list[str]:
    """Checkpoint directories in the job PS's working directory (the repository): where a
    relative checkpoint root would land."""
    return sorted(glob.glob(str(ROOT / "ckpt-*")) + glob.glob(str(ROOT / "fuzz-relative-root*")))


def _served_on(fj: FuzzJob, service: str) -> list[str]:
    """Endpoints serving ``service``: an undecodable payload is refused by a served method
    (no servicer code runs) and answered UNIMPLEMENTED elsewhere."""
    if service in fj.served:
        return fj.served[service]
    method = next(m for n, m in METHODS if n.startswith(service + "/"))
    out = []
    for name, address in fj.endpoints().items():
        o = call(fj.channel(address), f"/{service}/{method.name}", method, [b"\xff\xff\xff"], fj.md)
        if o.code != grpc.StatusCode.UNIMPLEMENTED:
            out.append(name)
    fj.served[service] = out
    return out


def _fuzzer(fj: FuzzJob, rng: random.Random) -> Fuzzer:
    f = Fuzzer(rng, {n: d for n, (d, _) in FUZZ_TABLES.items()}, fj.work_dir,
               forbidden={SENTINEL, *fj.ps, "ps-spare"})
    f.learned = fj.learned  # shared: later methods use the members earlier ones registered
    return f


MEMBER_FIELDS = ("worker_id", "id")  # fields naming a member of the job


def _replica_metadata(rng: random.Random) -> list[tuple[str, str]]:
    """Replicate streams say what they carry in metadata (deeprec_ext.ps.replication)."""
    from deeprec_ext.ps import replication
    kind_key = getattr(replication, "KIND_KEY", "x-replica-kind")
    base_key = getattr(replication, "BASE_KEY", "x-replica-base")
    md = []
    if rng.random() < 0.8:
        md.append((kind_key, rng.choice(["full-new", "full-refresh", "delta", "rows", "drop",
                                          "", "full", "bogus", "DELTA"])))
    if rng.random() < 0.6:
        md.append((base_key, rng.choice(["0", "-1", "1", "5", str(2**63 - 1), str(2**64),
                                          "x", "", "1e3", "-9223372036854775809"])))
    return md


# request metadata a method reads, besides the job token
METADATA_HINTS = {"deeprec_ext.ps.ParameterServer/Replicate": _replica_metadata}


def _live_worker(fj: FuzzJob) -> str:
    """A worker registered just now (normal request): a request naming it gets past the
    "not a live member" check to the code behind it."""
    resp = fj.unary(fj.master_address, "/deeprec_ext.master.Master/Register",
                    master_pb2.RegisterRequest(role="worker", pid=os.getpid()),
                    master_pb2.RegisterResponse)
    return resp.id


def _one(fj: FuzzJob, fuzzer: Fuzzer, rng: random.Random, name: str, endpoint: str,
         structured: bool, failures: list, tag: str) -> None:
    method = dict(METHODS)[name]
    cls = request_class(method)
    n_msgs = rng.choice([0, 1, 1, 2, 3]) if method.client_streaming else 1
    member_field = next((f for f in MEMBER_FIELDS if f in cls.DESCRIPTOR.fields_by_name), None)
    worker = _live_worker(fj) if (structured and endpoint == "aimaster" and member_field
                                  and name != "deeprec_ext.master.Master/Register"
                                  and rng.random() < 0.35) else None
    for _ in range(20):  # requests that would break the AIMaster for good: drawn again
        if structured:
            msgs = [fuzzer.request(cls) for _ in range(n_msgs)]
            if worker:
                for m in msgs:
                    setattr(m, member_field, worker)
            payloads = [m.SerializeToString() for m in msgs]
        else:
            msgs = payloads = [fuzzer.raw(cls) for _ in range(n_msgs)]
        break
    md = fj.md + tuple(METADATA_HINTS[name](rng)) if name in METADATA_HINTS else fj.md
    out = call(fj.channel(fj.endpoints()[endpoint]), f"/{name}", method, payloads, md, rng)
    if worker:  # it leaves again: one live worker at a time keeps barriers short
        fj.unary(fj.master_address, "/deeprec_ext.master.Master/Deregister",
                 master_pb2.DeregisterRequest(id=worker, reason="fuzz"), master_pb2.DeregisterResponse)
    counts = fj.codes.setdefault(name, {})
    counts[out.code.name] = counts.get(out.code.name, 0) + 1
    bad = problem(out)
    if bad:
        failures.append(f"{endpoint} {name} {tag}: {bad}\n    request: "
                        + " | ".join(describe(m) for m in msgs))
    if out.code == grpc.StatusCode.OK and name == "deeprec_ext.master.Master/Register" \
            and out.response is not None:
        member_id = master_pb2.RegisterResponse.FromString(out.response).id
        if member_id not in fuzzer.forbidden and member_id not in fj.learned:
            fj.learned.append(member_id)


def _check_no_relative_writes(fj: FuzzJob, name: str) -> None:
    new = sorted(set(_relative_writes()) - set(fj.relative_before))
    for path in new:  # out of the checkout again (the failure stays reported)
        shutil.rmtree(path, ignore_errors=True)
    assert not new, f"{seed_note()} {name} wrote into the PS working directory: {new}"


# -- tests --------------------------------------------------------------------------------------
def test_every_service_is_served(fuzz_job):
    where = {s: _served_on(fuzz_job, s) for s in SERVICES}
    assert all(where.values()), f"services no endpoint of the job serves: {where}"
    assert len(METHODS) >= 30, [n for n, _ in METHODS]


# -- what the fuzz found in the PS and Gazer, fixed: one deterministic case each -------------
PS_ = "/deeprec_ext.ps.ParameterServer/"
SYNC_ = "/deeprec_ext.sync.SyncParameterServer/"
INVALID = (grpc.StatusCode.INVALID_ARGUMENT,)


def _send(fj: FuzzJob, endpoint: str, path: str, msgs: list, md=()) -> Outcome:
    method = dict(METHODS)[path.strip("/")]
    payloads = [m if isinstance(m, bytes) else m.SerializeToString() for m in msgs]
    return call(fj.channel(fj.endpoints()[endpoint]), path, method, payloads, fj.md + tuple(md))


def _deep_config(**kw) -> ps_pb2.TableConfig:
    return ps_pb2.TableConfig(name="fz_deep", dim=4, optimizer_json="[" * 100_000 + "]" * 100_000, **kw)


def _watch_cancelled_streams_free_their_slot(fj: FuzzJob):
    path = "/deeprec_ext.gazer.Gazer/Watch"
    slow = gazer_pb2.WatchRequest(interval_seconds=3600)
    outs = [("cancelled Watch", _send(fj, "aimaster", path, [slow]), (grpc.StatusCode.OK,))
            for _ in range(6)]  # read the first snapshot, then cancel
    time.sleep(0.5)
    return outs + [("normal Watch after them", _send(fj, "aimaster", path, [gazer_pb2.WatchRequest()]),
                    (grpc.StatusCode.OK,))]


def _step_lookup_answers_within_the_deadline(fj: FuzzJob):
    contrib = sync_pb2.ContributeRequest(step=0, virtual_workers=2**31 - 1,
                                         contributions=[sync_pb2.Contribution(virtual_rank=0)])
    return [
        ("a partial step of 2^31-1 virtual workers", _send(fj, "spare-ps", SYNC_ + "Contribute", [contrib]),
         (grpc.StatusCode.OK,)),
        # the waiting lookup lists a few missing ranks (it listed all 2^31: memory) and
        # gives up before the caller's deadline (it waited wait_seconds, even forever)
        ("a lookup waiting for it", _send(fj, "spare-ps", SYNC_ + "StepLookup",
                                          [sync_pb2.StepLookupRequest(step=1, wait_seconds=3000)]),
         (grpc.StatusCode.UNAVAILABLE,)),
        ("an infinite wait", _send(fj, "spare-ps", SYNC_ + "StepLookup",
                                   [sync_pb2.StepLookupRequest(step=1, wait_seconds=float("inf"))]), INVALID),
    ]


FIXED_FINDINGS = {
    "json-nested-too-deep": lambda fj: [
        ("CreateTable", _send(fj, "ps-0", PS_ + "CreateTable", [ps_pb2.CreateTableRequest(config=_deep_config())]), INVALID),
        ("ImportRows", _send(fj, "ps-0", PS_ + "ImportRows", [ps_pb2.RowBatch(config=_deep_config())]), INVALID),
        ("Replicate", _send(fj, "spare-ps", PS_ + "Replicate", [ps_pb2.RowBatch(origin="fz-origin", reset=True),
                                                              ps_pb2.RowBatch(origin="fz-origin", config=_deep_config())]),
         INVALID)],
    "dim-beyond-memory": lambda fj: [
        ("CreateTable", _send(fj, "ps-0", PS_ + "CreateTable", [ps_pb2.CreateTableRequest(
            config=ps_pb2.TableConfig(name="fz_huge", dim=2**31 - 1, optimizer_json='"adam"'))]), INVALID)],
    "table-name-too-long-for-checkpoint-files": lambda fj: [
        ("CreateTable", _send(fj, "ps-0", PS_ + "CreateTable", [ps_pb2.CreateTableRequest(
            config=ps_pb2.TableConfig(name="λ" * 100, dim=2))]), INVALID),
        ("WriteCheckpoint writer_id", _send(fj, "ps-0", PS_ + "WriteCheckpoint", [ps_pb2.WriteCheckpointRequest(
            root=str(fj.work_dir / "ckpt_fixed"), ckpt_id=1, kind="full", writer_id="w" * 300)]), INVALID)],
    "drop-slots-over-another-slot-count": lambda fj: [
        ("DropSlots", _send(fj, "ps-0", PS_ + "DropSlots", [ps_pb2.DropSlotsRequest(slots=b"\0\0", num_slots=2)]),
         INVALID)],
    "migrate-to-an-invalid-address": lambda fj: [
        ("MigrateSlots", _send(fj, "ps-0", PS_ + "MigrateSlots", [ps_pb2.MigrateSlotsRequest(
            dst_address="\x00:1", slots=bytes(NUM_SLOTS), num_slots=NUM_SLOTS)]), INVALID)],
    "checkpoint-root-relative-to-the-ps": lambda fj: [
        ("WriteCheckpoint", _send(fj, "ps-0", PS_ + "WriteCheckpoint", [ps_pb2.WriteCheckpointRequest(
            root="fuzz-relative-root", ckpt_id=1, kind="full")]), INVALID),
        ("RestoreCheckpoint", _send(fj, "ps-0", PS_ + "RestoreCheckpoint", [ps_pb2.RestoreCheckpointRequest(
            root="", ckpt_id=1, slots=bytes(NUM_SLOTS), num_slots=NUM_SLOTS)]), INVALID)],
    "since-json-not-an-object": lambda fj: [
        ("WriteCheckpoint", _send(fj, "ps-0", PS_ + "WriteCheckpoint", [ps_pb2.WriteCheckpointRequest(
            root=str(fj.work_dir / "ckpt_fixed"), ckpt_id=2, kind="incr", parent=1, since_json="[1]")]),
         INVALID)],
    "replication-interval-not-finite": lambda fj: [
        (f"SetRouting interval {v}", _send(fj, "spare-ps", PS_ + "SetRouting", [ps_pb2.SetRoutingRequest(
            epoch=10**12, num_slots=4, owned_slots=b"\1" * 4, ps_id="x", replication_interval_ms=v)]), INVALID)
        for v in (float("inf"), float("nan"), 1e300)],
    "undecodable-stream-message": lambda fj: [
        (endpoint, _send(fj, endpoint, PS_ + "ImportRows", [b"\xff\xff"]), INVALID)
        for endpoint in ("ps-0", "spare-ps")],
    "watch-cancelled-streams-free-their-slot": _watch_cancelled_streams_free_their_slot,
    "step-lookup-answers-within-the-deadline": _step_lookup_answers_within_the_deadline,
}


@pytest.mark.parametrize("finding", sorted(FIXED_FINDINGS))
def test_fixed_finding(fuzz_job, finding):
    """Each finding of the fuzz in the PS and Gazer, as a fixed request: a clear status."""
    wrong = []
    for what, out, expected in FIXED_FINDINGS[finding](fuzz_job):
        bad = problem(out)
        if bad or out.code not in expected:
            wrong.append(f"{what}: {out.code.name} {out.details!r} (expected "
                         f"{[c.name for c in expected]}){': ' + bad if bad else ''}")
    assert not wrong, f"{finding}:\n" + "\n".join(wrong)
    _check_no_relative_writes(fuzz_job, finding)


BAD_TOKENS = [(), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),),
              (("authorization", f"bearer {TOKEN}"),), (("authorization", f"Bearer {TOKEN}x"),),
              (("authorization", "Bearer "),), (("authorization", f"Bearer  {TOKEN}"),),
              (("x-authorization", f"Bearer {TOKEN}"),)]


@pytest.mark.parametrize("name", [n for n, _ in METHODS])
def test_every_method_refuses_calls_without_the_job_token(fuzz_job, name):
    fj = fuzz_job
    method = dict(METHODS)[name]
    cls = request_class(method)
    rng = random.Random(f"{SEED}:token:{name}")
    fuzzer = _fuzzer(fj, rng)
    # a skipped method gets only requests it would refuse anyway, should the check fail
    payloads = [b"", b"\xff\xff\xff", cls().SerializeToString()]
    if name not in SKIP:
        payloads.append(fuzzer.request(cls).SerializeToString())
    wrong = []
    for endpoint in _served_on(fj, name.split("/")[0]):
        for md in BAD_TOKENS:
            for p in payloads:
                out = call(fj.channel(fj.endpoints()[endpoint]), f"/{name}", method, [p], md)
                if out.code not in REFUSED:
                    wrong.append(f"{endpoint} metadata={md!r} payload={p[:30]!r}: "
                                 f"{out.code.name} {out.details!r}")
    assert not wrong, f"{seed_note()} {name} answered a call without the job token:\n" + \
        "\n".join(wrong[:20])


@pytest.mark.parametrize("name", [n for n, _ in METHODS])
def test_fuzz(fuzz_job, name):
    if name in SKIP:
        pytest.skip(SKIP[name])
    fj = fuzz_job
    rng = random.Random(f"{SEED}:{name}")
    fuzzer = _fuzzer(fj, rng)
    failures: list[str] = []
    endpoints = _served_on(fj, name.split("/")[0])
    if name in SPARE_ONLY:
        endpoints = [e for e in endpoints if e == "spare-ps"]
    start = time.monotonic()
    for endpoint in endpoints:
        n_structured = STRUCTURED_PER_ENDPOINT * ROUNDS
        for i in range(n_structured + RAW_PER_ENDPOINT * ROUNDS):
            _one(fj, fuzzer, rng, name, endpoint, i < n_structured, failures, f"request #{i}")
    fj.fuzz_seconds += time.monotonic() - start
    fj.assert_whole(f"fuzzing {name}")
    _check_no_relative_writes(fj, name)
    assert not failures, f"{seed_note()} {len(failures)} bad answers:\n" + "\n".join(failures[:25])


@pytest.mark.parametrize("service", SERVICES)
def test_fuzz_interleaved(fuzz_job, service):
    """The methods of one service in random order on one endpoint: the state one leaves
    behind (a pending sync step, a registered member, a replica) meets the others."""
    fj = fuzz_job
    rng = random.Random(f"{SEED}:interleaved:{service}")
    fuzzer = _fuzzer(fj, rng)
    names = [n for n, _ in METHODS if n.startswith(service + "/") and n not in SKIP]
    endpoints = _served_on(fj, service)
    failures: list[str] = []
    start = time.monotonic()
    for i in range(40 * ROUNDS):
        name = rng.choice(names)
        endpoint = "spare-ps" if name in SPARE_ONLY else endpoints[i * len(endpoints) // (40 * ROUNDS)]
        _one(fj, fuzzer, rng, name, endpoint, rng.random() < 0.8, failures, f"interleaved call #{i}")
    fj.fuzz_seconds += time.monotonic() - start
    fj.assert_whole(f"the interleaved calls to {service}")
    _check_no_relative_writes(fj, f"the interleaved calls to {service}")
    assert not failures, f"{seed_note()} {len(failures)} bad answers:\n" + "\n".join(failures[:25])


def test_after_fuzzing_the_job_is_whole(fuzz_job):
    fj = fuzz_job
    fj.assert_whole("all fuzzing")
    note = seed_note()
    # the sentinel: byte for byte, and no row more or less on any PS
    assert fj.table_rows(SENTINEL) == fj.sentinel_rows, note
    # the data plane works end to end, and replication keeps up with it
    fj.client.create_table("after_fuzz", dim=3, optimizer={"name": "sgd", "learning_rate": 1.0})
    ids = np.arange(1000, dtype=np.int64)
    before = fj.client.lookup("after_fuzz", ids)
    fj.client.push("after_fuzz", ids, np.ones((1000, 3), np.float32))
    np.testing.assert_allclose(fj.client.lookup("after_fuzz", ids), before - 1.0)

    def replicated():
        lags = []
        for s in fj.client.ps_stats():
            stats = gazer_pb2.MemberStats.FromString(s.gazer_stats)
            lags.append(stats.replication.behind_sequence)
        return all(lag == 0 for lag in lags) or None
    wait_for(replicated, 15, "every PS's replica to catch up")
    # the job can still take a checkpoint (table names, writer ids, roots)
    ckpt = fj.unary(fj.master_address, "/deeprec_ext.master.Master/Checkpoint",
                    master_pb2.CheckpointRequest(full=True), master_pb2.CheckpointResponse, 60)
    assert json.loads(ckpt.event_json)["rows"] > 0, note
    # no background thread died, no plugin hook failed, nothing left spinning
    logs = {"aimaster": fj.job.log.name, "spare-ps": str(fj.work_dir / "spare" / "ps.log"),
            **{p: str(fj.job.state_dir / "logs" / f"{p}.log") for p in fj.ps}}
    for who, path in logs.items():
        text = Path(path).read_text(errors="replace")
        for needle in ("Exception in thread", "plugin gazer:", "plugin consistent:"):
            assert needle not in text, f"{note} {who}'s log has {needle!r}:\n" + \
                text[text.index(needle) - 200:text.index(needle) + 1500]
    import psutil
    procs = {n: psutil.Process(p) for n, p in fj.pids().items()}
    cpu0 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    time.sleep(2.0)
    busy = {n: round(sum(p.cpu_times()[:2]) - cpu0[n], 2) for n, p in procs.items()}
    assert all(v < 1.0 for v in busy.values()), f"{note} processes busy while idle: {busy}"
    # a fuzzed PS still stops on SIGTERM (the job's PS are stopped by the fixture)
    spare = fj.spare[1]
    spare.terminate()
    try:
        spare.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{note} the spare PS did not exit within 15s of SIGTERM") from None
    print(f"\nfuzzing took {fj.fuzz_seconds:.1f}s")
    for name, counts in sorted(fj.codes.items()):
        print(f"  {name}: " + ", ".join(f"{c} {n}" for c, n in sorted(counts.items())))


@pytest.mark.parametrize("key", [
    k for k, v in sorted(KNOWN_MASTER_FAILURES.items(), key=lambda kv: (kv[1].poisons, kv[0]))])
def test_master_finding(fuzz_job, key):
    """The AIMaster's failures the fuzz found, each reproduced: a clear status now."""
    failure = KNOWN_MASTER_FAILURES[key]
    for method, request in failure.steps:  # each answered or refused with a clear status
        out = call(fuzz_job.channel(fuzz_job.master_address), f"/{method}", dict(METHODS)[method],
                   [request.SerializeToString()], fuzz_job.md)
        assert problem(out) is None, f"{method} {describe(request)}: {problem(out)} -- {failure.why}"
    fuzz_job.status()  # and the AIMaster still answers
