"""Reading checkpoints: verification, chains, restore, retention."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from deeprec_ext.hashing import slot_of
from deeprec_ext.store.hash_index import PROBE_SEED

from checkpoint import remote

from checkpoint.format import (CHUNK_FIELDS, DIR_RE, FLAG_COUNTS, FLAG_RAW, READABLE_VERSIONS,
                               KIND_ARRAY, KIND_END,
                               KIND_ROWS, KIND_TOMBSTONES, MANIFEST_FORMAT,
                               MANIFEST_NAME, CheckpointError, NoValidCheckpoint, crc32c,
                               data_width, decode_header, header_size, manifest_checksum,
                               payload_crc)

log = logging.getLogger("checkpoint")

_CI = {f: i for i, f in enumerate(CHUNK_FIELDS)}
_LEVELS = ("manifest", "chunks", "full")
_READ_THREADS = min(4, os.cpu_count() or 1)
_IMPORT_ROWS = 1 << 16  # rows handed to the target store per call (small chunks are batched)
_TASK_BYTES = 8 << 20   # chunk bytes read and decoded per thread task


# ----------------------------------------------------------------------------- manifest
def _req(cond, what: str) -> None:
    if not cond:
        raise ValueError(what)


# manifests parsed and checked by this process, by path: (stat key, manifest). Retention
# runs after every checkpoint and parsed every kept manifest each time (a full's, with
# ~500 chunks in its index, ~0.6 ms; ~2 ms for 2 chains of a 4M-row table)
_MANIFESTS: dict = {}
_MANIFESTS_MAX = 512
_MANIFEST_SETTLED_NS = 1_000_000_000  # kept once its file is older than this


def _int_keyed(o):
    """``o`` with the keys of every dict whose keys are all decimal integers made ints
    again. Writers before 2026-11-27 took the manifest's checksum over the Python body,
    in which such keys (a shard queue's) were ints and sorted as numbers; the checksum of
    their manifests is the checksum of this form."""
    if isinstance(o, dict):
        ints = bool(o) and all(_INT_KEY.fullmatch(k) for k in o)
        return {(int(k) if ints else k): _int_keyed(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_int_keyed(v) for v in o]
    return o


_INT_KEY = re.compile(r"-?(0|[1-9][0-9]*)")


def load_manifest(ckpt_dir, cached: bool = False) -> dict:
    """Parse and check ``manifest.json`` of one checkpoint directory (JSON, checksum,
    schema, id/kind against the directory name). Raises CheckpointError naming the
    problem. Does not look at the data files.

    ``cached``: the manifest this process parsed and checked before, if the file is the
    same (device, inode, size, modification and change times: a manifest is only ever
    replaced, and a later write changes them); the object is shared, do not modify it."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST_NAME
    if cached:
        try:
            st = os.stat(path)
        except OSError:
            return load_manifest(ckpt_dir)  # the error, as named there
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = _MANIFESTS.get(str(path))
        if hit is not None and hit[0] == key:
            return hit[1]
        m = load_manifest(ckpt_dir)  # stat first: content newer than the key only misses
        # file times come from a coarse clock (a jiffy): a file written in the last
        # moments could be rewritten in place with the same times, so it is not kept yet
        if time.time_ns() - st.st_mtime_ns > _MANIFEST_SETTLED_NS:
            if len(_MANIFESTS) >= _MANIFESTS_MAX:
                _MANIFESTS.clear()
            _MANIFESTS[str(path)] = (key, m)
        return m
    where = f"{ckpt_dir.name}/{MANIFEST_NAME}"
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing (checkpoint never committed, or "
                              "deleted)") from None
    except OSError as e:
        raise CheckpointError(f"{where}: unreadable: {e}") from None
    try:
        m = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{where}: not a checkpoint manifest")
    if m.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{where}: unsupported format version {m.get('version')!r}")
    try:
        ok = m.get("checksum") == manifest_checksum(m)
        if not ok:  # written before 2026-11-27: the checksum of a body with int keys
            ok = m.get("checksum") == manifest_checksum(_int_keyed(m))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: manifest checksum mismatch (file modified or "
                              "corrupt)")
    mt = DIR_RE.match(ckpt_dir.name)
    if mt and (int(mt.group(1)) != m.get("id") or mt.group(2) != m.get("kind")):
        raise CheckpointError(f"{where}: id/kind {m.get('id')}/{m.get('kind')} do not match "
                              f"the directory name")
    try:
        _req(m["kind"] in ("full", "incr"), "kind")
        _req((m["parent"] is None) == (m["kind"] == "full"), "parent")
        _req(type(m["num_slots"]) is int and m["num_slots"] > 0, "num_slots")
        _req(m.get("chunk_fields") == CHUNK_FIELDS, "chunk_fields")
        for e in m["files"]:
            _req(isinstance(e["path"], str) and "/" not in e["path"] and e["path"][:1] != ".",
                 "file path")
            _req(e["type"] in ("rows", "dense"), "file type")
            _req(type(e["size"]) is int and (isinstance(e.get("sha256"), str) or (
                m["version"] >= 3 and e.get("sha256") is None)), "file size/sha256")
            _req(isinstance(e["chunks"], list), "chunk index")
            if e["type"] == "rows":
                _req(e["table"] in m["tables"], f"table of {e['path']}")
        for name, t in m["tables"].items():
            _req(type(t["dim"]) is int and t["dim"] > 0 and type(t["row_width"]) is int
                 and t["row_width"] % t["dim"] == 0, f"dim/row_width of table {name}")
        _req(isinstance(m["dropped_tables"], list) and isinstance(m["extra"], dict), "fields")
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__} {e})") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: malformed manifest (bad {e})") from None
    return m


# ----------------------------------------------------------------------------- model
@dataclass
class Checkpoint:
    """One checkpoint directory as found on disk."""
    id: int
    kind: str
    path: Path
    manifest: dict | None = None
    problems: list = field(default_factory=list)
    level: str | None = None          # how deeply it has been verified
    verified_chunks: set = field(default_factory=set)  # (file, chunk#) checked (restore)
    notes: list = field(default_factory=list)  # findings that do not make it invalid

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def valid(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def parent(self) -> int | None:
        return self.manifest["parent"] if self.manifest else None

    @property
    def created(self) -> float | None:
        return self.manifest.get("created") if self.manifest else None

    def summary(self) -> dict:
        m = self.manifest or {}
        tot = m.get("totals", {})
        return {"id": self.id, "kind": self.kind, "dir": self.name,
                "parent": m.get("parent"), "created": m.get("created_iso"),
                "tables": sorted(m.get("tables", {})), "rows": tot.get("rows"),
                "tombstones": tot.get("tombstones"), "bytes": tot.get("bytes"),
                "files": len(m.get("files", [])), "num_slots": m.get("num_slots"),
                "valid": self.valid, "problems": list(self.problems),
                "indexes": sum(1 for e in m.get("files", []) if e.get("index")),
                "notes": list(self.notes)}


@dataclass
class Chain:
    """A full checkpoint followed by its incrementals, oldest first."""
    checkpoints: list

    @property
    def head(self) -> Checkpoint:
        return self.checkpoints[-1]

    @property
    def root(self) -> Checkpoint:
        return self.checkpoints[0]

    @property
    def ids(self) -> list[int]:
        return [c.id for c in self.checkpoints]

    def __repr__(self) -> str:
        return f"Chain({' -> '.join(c.name for c in self.checkpoints)})"


@dataclass
class RestoreInfo:
    """What :func:`restore` applied.

    ``checkpoint_id``/``chain``/``dir``: the checkpoint restored (head) and its chain,
    oldest first. ``tables``: per table, rows imported and deletions applied over the
    chain (``live_rows`` for store targets; ``saved_index``: True where the index saved
    with the full checkpoint became the table's, no key placed). ``extra``: the head
    checkpoint's ``extra``.
    ``dense``: the newest ``write_dense`` arrays along the chain. ``watermarks``: the
    head's per-(writer, table) cut_seq (of the writing processes, informational).
    ``skipped``: problems of the checkpoints passed over. ``sequence``: the target
    store's counter afterwards (``since_seq`` for an incremental on top of this
    restore)."""
    checkpoint_id: int
    chain: list
    dir: str
    num_slots: int
    tables: dict
    extra: dict
    dense: dict
    watermarks: dict
    skipped: list
    bytes_read: int
    seconds: float
    sequence: int | None = None   # store.sequence.value after the restore (store sinks)


# ----------------------------------------------------------------------------- verification
def _decode_payload(comp: bytes, h: dict, where: str) -> bytes:
    """A chunk's payload bytes: ``comp`` itself for a stored chunk (its crc32 was checked
    by the caller), else the zstd frame decompressed (xxh64 content checksum checked)."""
    raw_len = h["raw_len"]
    if h["flags"] & FLAG_RAW:
        if len(comp) != raw_len:
            raise CheckpointError(f"{where}: stored payload of {len(comp)} bytes, expected "
                                  f"{raw_len}")
        return comp
    try:
        raw = zstandard.ZstdDecompressor().decompress(comp, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise CheckpointError(f"{where}: zstd decompression failed ({e})") from None
    if len(raw) != raw_len:
        raise CheckpointError(f"{where}: decompressed {len(raw)} bytes, expected {raw_len}")
    return raw


def _crc_name(h: dict) -> str:
    return "crc32c" if h["version"] >= 4 else "crc32"


def _split_rows(raw: bytes, n: int, w: int, where: str, apart: bool = False):
    """``(keys, rows float32 [n, w])`` of a rows payload; ``apart`` (format 4, flag
    COUNTS): the payload holds the update counts as a uint32 column after the rows,
    joined here as the float32 last column the callers of this path take."""
    if len(raw) != n * (8 + 4 * w):
        raise CheckpointError(f"{where}: payload length {len(raw)} != {n} x (8 + 4 x {w})")
    keys = np.frombuffer(raw, dtype="<i8", count=n)
    if not w:
        return keys, None
    if not apart:
        return keys, np.frombuffer(raw, dtype="<f4", offset=8 * n).reshape(n, w)
    rows = np.empty((n, w), dtype=np.float32)
    rows[:, :w - 1] = np.frombuffer(raw, dtype="<f4", offset=8 * n,
                                    count=n * (w - 1)).reshape(n, w - 1)
    rows[:, w - 1] = np.frombuffer(raw, dtype="<u4", offset=4 * n * (w + 1), count=n)
    return keys, rows


def _check_chunk_header(buf, off: int, ch: list, name: str, num_slots: int, w: int,
                        where: str) -> dict:
    h = decode_header(buf, where)
    want = {"kind": ch[_CI["kind"]], "n": ch[_CI["n"]], "slot_lo": ch[_CI["slot_lo"]],
            "slot_hi": ch[_CI["slot_hi"]], "raw_len": ch[_CI["raw_len"]],
            "comp_len": ch[_CI["comp_len"]], "crc32": ch[_CI["crc32"]], "name": name,
            "num_slots": num_slots}
    if h["kind"] == KIND_ROWS:
        want["row_width"] = w
    bad = [k for k, v in want.items() if h[k] != v]
    if bad:
        raise CheckpointError(f"{where}: chunk header disagrees with the manifest ({', '.join(bad)})")
    return h


def _deep_check(comp: bytes, h: dict, num_slots: int, where: str) -> None:
    raw = _decode_payload(comp, h, where)
    if h["kind"] in (KIND_ROWS, KIND_TOMBSTONES):
        w = h["row_width"] if h["kind"] == KIND_ROWS else 0
        keys, rows = _split_rows(raw, h["n"], w, where, bool(h["flags"] & FLAG_COUNTS))
        if keys.size:
            s = slot_of(keys, num_slots)
            # formats 1-2 sort a chunk's keys by slot; format 3 only bounds them (a full
            # export writes a bucket's pieces, each sorted, as one chunk)
            if s.min() < h["slot_lo"] or s.max() > h["slot_hi"] or (
                    h["version"] < 3 and (np.diff(s) < 0).any()):
                raise CheckpointError(f"{where}: keys outside the chunk's slot range "
                                      f"[{h['slot_lo']}, {h['slot_hi']}]")
        if rows is not None and not np.isfinite(rows).all():
            raise CheckpointError(f"{where}: non-finite values")


def verify_file(ckpt_dir: Path, entry: dict, manifest: dict, deep: bool = True,
                pool: ThreadPoolExecutor | None = None) -> None:
    """Check one data file completely: size, sha256 (formats 1-2; from format 3 on the
    chunk crc32s cover every byte), every chunk header and payload crc32, the END chunk; ``deep`` also decompresses (zstd content checksum, lengths,
    slot ranges, finiteness). Raises CheckpointError naming the file and problem."""
    path = ckpt_dir / entry["path"]
    where_f = f"{ckpt_dir.name}/{entry['path']}"
    num_slots = manifest["num_slots"]
    name = entry["table"] if entry["type"] == "rows" else None
    w = data_width(manifest["tables"].get(name, {})) if name else 0
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{where_f}: file missing") from None
    if size != entry["size"]:
        raise CheckpointError(f"{where_f}: size {size} != {entry['size']} in the manifest "
                              f"({'truncated' if size < entry['size'] else 'extra bytes'})")
    sha = hashlib.sha256() if entry.get("sha256") is not None else None
    futures = deque()
    with open(path, "rb") as f:
        pos = 0
        for i, ch in enumerate(entry["chunks"]):
            where = f"{where_f}: chunk {i} at offset {ch[0]}"
            if ch[0] != pos:
                raise CheckpointError(f"{where}: chunk index not contiguous")
            cname = name if name is not None else _array_name_of(entry, i)
            hlen = header_size(cname.encode("utf-8"))
            buf = f.read(hlen + ch[_CI["comp_len"]])
            if sha is not None:
                sha.update(buf)
            if len(buf) != hlen + ch[_CI["comp_len"]]:
                raise CheckpointError(f"{where}: truncated")
            h = _check_chunk_header(buf, pos, ch, cname, num_slots, w, where)
            comp = memoryview(buf)[hlen:]
            if payload_crc(comp, h["version"]) != h["crc32"]:
                raise CheckpointError(f"{where}: payload {_crc_name(h)} mismatch (corrupt data)")
            if deep:
                if pool is not None:
                    futures.append(pool.submit(_deep_check, comp, h, num_slots, where))
                    while len(futures) > 2 * _READ_THREADS:
                        futures.popleft().result()
                else:
                    _deep_check(comp, h, num_slots, where)
            pos += len(buf)
        rest = f.read()
        if sha is not None:
            sha.update(rest)
    while futures:
        futures.popleft().result()
    where = f"{where_f}: END chunk at offset {pos}"
    h = decode_header(rest, where)
    if h["kind"] != KIND_END or h["n"] != len(entry["chunks"]) or h["raw_len"] != pos \
            or h["header_len"] != len(rest):
        raise CheckpointError(f"{where}: bad END chunk")
    if sha is not None and sha.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{where_f}: sha256 mismatch")


def _array_name_of(entry: dict, i: int) -> str:
    """Name of the dense array chunk ``i`` of a dense file belongs to (arrays are stored
    one after the other, ``chunks`` pieces each)."""
    seen = 0
    for name, meta in entry["arrays"].items():
        seen += int(meta["chunks"])
        if i < seen:
            return name
    raise CheckpointError(f"{entry['path']}: chunk {i} does not belong to any array")


def _verify_checkpoint(c: Checkpoint, level: str, pool=None, cached: bool = False) -> None:
    """Check ``c`` at ``level`` ("manifest": manifest + file sizes; "full": every byte),
    recording problems in ``c.problems``. ``cached``: see :func:`load_manifest`."""
    if c.manifest is None and not c.problems:
        try:
            c.manifest = load_manifest(c.path, cached=cached)
        except CheckpointError as e:
            c.problems.append(str(e))
            return
    if not c.valid:
        return
    if level == "manifest" and c.level is None:
        for e in c.manifest["files"]:
            p = c.path / e["path"]
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                c.problems.append(f"{c.name}/{e['path']}: file missing")
                continue
            if size != e["size"]:
                c.problems.append(f"{c.name}/{e['path']}: size {size} != {e['size']} in the "
                                  f"manifest ({'truncated' if size < e['size'] else 'extra bytes'})")
        c.level = "manifest"
    elif level == "full" and c.level != "full":
        for e in c.manifest["files"]:
            try:
                verify_file(c.path, e, c.manifest, deep=True, pool=pool)
            except CheckpointError as err:
                c.problems.append(str(err))
            except OSError as err:
                c.problems.append(f"{c.name}/{e['path']}: {err}")
            if isinstance(e.get("index"), dict):  # optional: a bad one is a note
                try:
                    _check_saved_index(c, e, e.get("rows"))
                except (OSError, KeyError, TypeError, ValueError) as err:
                    c.notes.append(f"{c.name}/{e['path']}: saved index not usable ({err}); "
                                   "restores place the keys instead")
        c.level = "full"


def scan(root, verify: str = "full", _cached: bool = False) -> list[Checkpoint]:
    """Every checkpoint directory under ``root`` (ascending id), checked at ``verify``
    level ("manifest" or "full"); invalid ones have ``problems``. Does not log.
    (``_cached``: retention's, manifests shared with earlier calls: read-only.)"""
    if verify not in ("manifest", "full"):
        raise ValueError(f"verify must be 'manifest' or 'full', got {verify!r}")
    # a URL root: its committed checkpoints, mirrored into the local cache (remote.py)
    root = remote.mirror(str(root)) if remote.is_remote(str(root)) else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    out = []
    for p in sorted(root.iterdir()):
        m = DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append(Checkpoint(int(m.group(1)), m.group(2), p))
    out.sort(key=lambda c: (c.id, c.kind))
    ids = [c.id for c in out]
    for c in out:
        if ids.count(c.id) > 1:
            c.problems.append(f"{c.name}: another checkpoint directory has the same id {c.id}")
    with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="ckpt-verify") as pool:
        for c in out:
            _verify_checkpoint(c, verify, pool, cached=_cached)
    return out


def _chain_problem(c: Checkpoint, by_id: dict) -> str | None:
    """Why ``c`` (itself valid) cannot be restored: a broken link to its parent."""
    seen = set()
    while c.kind == "incr":
        seen.add(c.id)
        p = by_id.get(c.parent)
        if p is None:
            return f"{c.name}: parent checkpoint {c.parent} is missing"
        if not p.valid:
            return f"{c.name}: parent {p.name} is invalid"
        if p.id >= c.id or p.id in seen:
            return f"{c.name}: bad parent link to {p.name}"
        if p.manifest["checksum"] != c.manifest.get("parent_checksum"):
            return f"{c.name}: parent {p.name} was rewritten (checksum differs)"
        if p.manifest["num_slots"] != c.manifest["num_slots"]:
            return f"{c.name}: num_slots differs from parent {p.name}"
        c = p
    return None


def _path_to(c: Checkpoint, by_id: dict) -> list[Checkpoint]:
    path = [c]
    while path[-1].kind == "incr":
        path.append(by_id[path[-1].parent])
    return path[::-1]


def _restorable(cks: list[Checkpoint]) -> tuple[list[Checkpoint], dict]:
    """(restorable checkpoints ascending, {id: problem} for valid but unrestorable ones)."""
    by_id = {c.id: c for c in cks if c.valid}
    ok, broken = [], {}
    for c in cks:
        if not c.valid:
            continue
        why = _chain_problem(c, by_id)
        if why is None:
            ok.append(c)
        else:
            broken[c.id] = why
    return ok, broken


def _chains(cks: list[Checkpoint]) -> list[Chain]:
    ok, _ = _restorable(cks)
    by_id = {c.id: c for c in ok}
    has_child = {c.parent for c in ok if c.kind == "incr"}
    leaves = [c for c in ok if c.id not in has_child]
    return [Chain(_path_to(c, by_id)) for c in sorted(leaves, key=lambda c: -c.id)]


def _warn_invalid(cks: list[Checkpoint], what: str = "skipped") -> None:
    for c in cks:
        for p in c.problems:
            log.warning("checkpoint %s %s: %s", c.name, what, p)
    _, broken = _restorable(cks)
    for c in cks:
        if c.id in broken:
            log.warning("checkpoint %s %s: %s", c.name, what, broken[c.id])


def list_chains(root, verify: str = "full") -> list[Chain]:
    """Restorable chains under ``root``, newest head first. A chain is a full checkpoint
    and its incrementals in order (one chain per branch tip). Checkpoints whose manifest
    is missing/corrupt or whose files fail size/sha256/chunk checks (``verify="full"``,
    the default, reads every byte; ``"manifest"`` checks manifests and file sizes only)
    are skipped with a ``logging.warning`` naming the file and the problem."""
    cks = scan(root, verify)
    _warn_invalid(cks)
    return _chains(cks)


def verify(root) -> dict:
    """Check every byte of every checkpoint under ``root``. Returns a JSON-serializable
    report: ``ok``, ``checkpoints`` (id, kind, parent, tables, rows, bytes, created,
    valid, problems), ``chains`` (lists of ids, newest first) and ``newest`` (id of the
    checkpoint a restore would use)."""
    cks = scan(root, "full")
    _, broken = _restorable(cks)
    items = []
    for c in cks:
        s = c.summary()
        if c.id in broken and c.valid:
            s["valid"] = False
            s["problems"].append(broken[c.id])
        items.append(s)
    chains = _chains(cks)
    return {"root": str(root) if remote.is_remote(str(root)) else str(Path(root)), "ok": all(s["valid"] for s in items),
            "checkpoints": items, "chains": [ch.ids for ch in chains],
            "newest": max((ch.head.id for ch in chains), default=None)}


# ----------------------------------------------------------------------------- restore
class _StoreSink:
    def __init__(self, store, reset_optimizer: bool = False):
        self.store = store
        self.reset_optimizer = reset_optimizer

    def table(self, name, info, expected_rows):
        try:
            t = self.store.create_table(name, info["dim"], info["initializer"],
                                        info["optimizer"],
                                        initial_capacity=max(int(expected_rows), 1024),
                                        admission=info.get("admission"),
                                        eviction=info.get("eviction"),
                                        dtype=info.get("dtype", "float32"))
        except ValueError as e:
            raise CheckpointError(f"cannot create table '{name}' in the target store: {e}") \
                from None
        if t.row_width != info["row_width"]:
            raise CheckpointError(f"table '{name}': row width {t.row_width} != "
                                  f"{info['row_width']} in the checkpoint")
        if hasattr(t, "end_load"):  # a table with rows loads them in place, not in bulk
            t.end_load()

    def drop(self, name):
        if name in self.store:
            self.store.drop_table(name)

    def delete(self, name, keys):
        self.store.get(name).delete(keys, log_tombstone=False)

    def rows(self, name, keys, rows):
        """``rows``: one array, or a list of arrays (the chunks of one batch, not joined)."""
        table = self.store.get(name)
        if isinstance(rows, list) and (self.reset_optimizer
                                       or rows[0].shape[1] != table.row_width + 1
                                       or not hasattr(table, "load_rows")):
            rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
        if self.reset_optimizer:  # values only: the optimizer slots start from their initial state
            table.insert(keys, np.ascontiguousarray(rows[:, :table.dim]))
        elif isinstance(rows, list) or (rows.shape[1] == table.row_width + 1
                                        and hasattr(table, "load_rows")):
            table.load_rows(keys, rows)  # checksummed rows with counts: the bulk path
        else:
            table.import_rows(keys, rows)


class _CallbackSink:
    def __init__(self, fn):
        self.fn = fn

    def table(self, name, info, expected_rows):
        self.fn("table", name, None, None, info)

    def drop(self, name):
        self.fn("drop", name, None, None, None)

    def delete(self, name, keys):
        self.fn("delete", name, keys, None, None)

    def rows(self, name, keys, rows):
        if isinstance(rows, list):
            rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
        self.fn("rows", name, keys, rows, None)


def _read_chunk(fd: int, entry: dict, ci: int, name: str, manifest: dict, w: int,
                where_f: str) -> tuple[bytes, dict]:
    """Read chunk ``ci`` of a file with pread and check header and payload crc."""
    ch = entry["chunks"][ci]
    where = f"{where_f}: chunk {ci} at offset {ch[0]}"
    hlen = header_size(name.encode("utf-8"))
    want = hlen + ch[_CI["comp_len"]]
    buf = os.pread(fd, want, ch[0])
    if len(buf) != want:
        raise CheckpointError(f"{where}: truncated")
    h = _check_chunk_header(buf, ch[0], ch, name, manifest["num_slots"], w, where)
    comp = memoryview(buf)[hlen:]
    if payload_crc(comp, h["version"]) != h["crc32"]:
        raise CheckpointError(f"{where}: payload {_crc_name(h)} mismatch (corrupt data)")
    return comp, h


class _Plan:
    """Which chunks of which files a restore of ``chain`` for ``slot_mask`` reads."""

    def __init__(self, chain: list[Checkpoint], slot_mask: np.ndarray | None,
                 tables=None, retarget: bool = False):
        head = chain[-1].manifest
        self.num_slots = head["num_slots"]
        self.final_tables = set(head["tables"])
        if tables is not None:
            self.final_tables &= set(tables)
        if retarget:
            # the mask is over another num_slots: every chunk is read and filtered by key
            self.items = [(c, e, [(ci, ch[_CI["kind"]], ch[_CI["kind"]] != KIND_ARRAY)
                                  for ci, ch in enumerate(e["chunks"])])
                          for c in chain for e in c.manifest["files"]
                          if not (e["type"] == "rows" and e["table"] not in self.final_tables)]
            return
        if slot_mask is not None:
            pre = np.concatenate([[0], np.cumsum(slot_mask, dtype=np.int64)])
        self.items = []   # (ckpt, entry, [(chunk index, kind, partial)])
        for c in chain:
            for e in c.manifest["files"]:
                if e["type"] == "rows" and e["table"] not in self.final_tables:
                    continue
                sel = []
                for ci, ch in enumerate(e["chunks"]):
                    kind = ch[_CI["kind"]]
                    partial = False
                    if slot_mask is not None and kind in (KIND_ROWS, KIND_TOMBSTONES):
                        lo, hi = ch[_CI["slot_lo"]], ch[_CI["slot_hi"]]
                        if not (0 <= lo <= hi < self.num_slots):
                            err = CheckpointError(f"{c.name}/{e['path']}: chunk {ci}: bad "
                                                  f"slot range [{lo}, {hi}]")
                            err.ckpt = c
                            raise err
                        inside = int(pre[hi + 1] - pre[lo])
                        if inside == 0:
                            continue
                        partial = inside != hi - lo + 1
                    sel.append((ci, kind, partial))
                self.items.append((c, e, sel))


def _check_end(fd: int, e: dict, where_f: str) -> None:
    name = (e["table"] if e["type"] == "rows" else "").encode("utf-8")
    off = e["size"] - header_size(name)
    where = f"{where_f}: END chunk at offset {off}"
    buf = os.pread(fd, header_size(name), off) if off >= 0 else b""
    h = decode_header(buf, where)
    if h["kind"] != KIND_END or h["n"] != len(e["chunks"]) or h["raw_len"] != off:
        raise CheckpointError(f"{where}: bad END chunk")


def _opened_file_width(fd: int, e: dict, manifest: dict, where_f: str) -> int:
    """Check an opened data file's size against its manifest entry; the floats per row of
    its rows (0 for a file of dense arrays)."""
    size = os.fstat(fd).st_size
    if size != e["size"]:
        raise CheckpointError(f"{where_f}: size {size} != {e['size']} in the manifest")
    return data_width(manifest["tables"].get(e["table"], {})) if e["type"] == "rows" else 0


def _prevalidate(plan: _Plan) -> None:
    """Pass 1: read every planned chunk and check header + crc32 (no decompression).
    Raises CheckpointError (with ``.ckpt`` set) at the first problem."""
    for c, e, sel in plan.items:
        todo = [s for s in sel if (e["path"], s[0]) not in c.verified_chunks]
        if not todo:
            continue
        path = c.path / e["path"]
        where_f = f"{c.name}/{e['path']}"
        try:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"{where_f}: file missing") from None
            try:
                w = _opened_file_width(fd, e, c.manifest, where_f)
                for ci, kind, _ in todo:
                    name = e["table"] if e["type"] == "rows" else _array_name_of(e, ci)
                    _read_chunk(fd, e, ci, name, c.manifest, w, where_f)
                    c.verified_chunks.add((e["path"], ci))
                _check_end(fd, e, where_f)
            finally:
                os.close(fd)
        except CheckpointError as err:
            err.ckpt = c
            raise
        except OSError as err:
            new = CheckpointError(f"{where_f}: {err}")
            new.ckpt = c
            raise new from None


def restore(root, store_or_callback, slot_mask: np.ndarray | None = None,
            upto: int | None = None, verify: str = "chunks", exact: bool = False,
            tables=None, reset_optimizer: bool = False) -> RestoreInfo:
    """Apply the newest valid chain under ``root`` to an EmbeddingStore (tables are
    created from the manifest configs) or to a callback
    ``fn(op, table, keys, rows, info)`` with ``op`` in "table", "drop", "delete", "rows".

    Each checkpoint of the chain is applied in order: dropped tables, then deletions
    (tombstones), then rows. ``slot_mask`` (bool [num_slots]) restricts the restore to
    the keys whose routing slot is set -- how a checkpoint restores onto a different
    number of PS; chunks outside the mask are not read at all. ``upto``: use the newest
    restorable checkpoint with id <= upto (``exact=True``: exactly that checkpoint, or
    raise) -- several PS restoring the same job must restore the same checkpoint, so a
    coordinator picks it (e.g. ``list_chains``/``verify``) and passes ``upto=id,
    exact=True``.

    ``slot_mask`` may also be over another ``num_slots`` than the checkpoint's (a warm
    start onto a job with a different ``num_slots``): then every chunk is read and each
    key is kept when ``slot_mask[slot_of(key, len(slot_mask))]``. ``tables``: restore only
    these tables (None: all). ``reset_optimizer`` (store targets): import the values only,
    the optimizer slots start from their initial state.

    Nothing is applied before every chunk to be read has passed its checks: the manifest
    checksum and file sizes of every checkpoint, then the header and crc32 of every
    chunk the restore needs (``verify="full"``: every byte of every file of the chain,
    sha256 included). A checkpoint failing a check is skipped with a warning and the
    newest remaining restorable checkpoint is used. While applying, each chunk is read
    again and its crc32 and zstd content checksum re-checked; a failure then raises
    CheckpointError (the target is partially restored). Raises NoValidCheckpoint if
    nothing is restorable.

    Exception, for speed (a job start, a warm start): with ``verify="chunks"`` and a store
    whose tables of the chain are all absent or empty, each chunk is read once and
    checked (header, crc32, zstd checksum) as it is applied; at a failed check the tables
    are dropped (emptied, if they existed) and the next restorable checkpoint is tried,
    with the same outcome as above.
    """
    t0 = time.perf_counter()
    if verify not in _LEVELS:
        raise ValueError(f"verify must be one of {_LEVELS}, got {verify!r}")
    if exact and upto is None:
        raise ValueError("exact=True needs upto=<checkpoint id>")
    if hasattr(store_or_callback, "create_table"):
        sink = _StoreSink(store_or_callback, reset_optimizer)
    elif callable(store_or_callback):
        sink = _CallbackSink(store_or_callback)
    else:
        raise TypeError("store_or_callback must be an EmbeddingStore or a callable")
    cks = scan(root, "manifest")
    warned = set()

    def warn_new():
        _, broken = _restorable(cks)
        for c in cks:
            for p in c.problems + ([broken[c.id]] if c.id in broken else []):
                if (c.id, p) not in warned:
                    warned.add((c.id, p))
                    log.warning("checkpoint %s skipped: %s", c.name, p)

    warn_new()
    while True:
        ok, _ = _restorable(cks)
        cand = [c for c in ok if upto is None or c.id <= upto]
        if exact:
            cand = [c for c in cand if c.id == upto]
        if not cand:
            skipped = "; ".join(p for c in cks for p in c.problems) or "none"
            raise NoValidCheckpoint(
                f"no restorable checkpoint under {root}"
                + (f" with id {'==' if exact else '<='} {upto}" if upto is not None else "")
                + f" (found {len(cks)} checkpoint directories; problems: {skipped})")
        head = cand[-1]
        by_id = {c.id: c for c in ok}
        chain = _path_to(head, by_id)
        retarget = False
        if slot_mask is not None:
            slot_mask = np.asarray(slot_mask)
            n = head.manifest["num_slots"]
            if slot_mask.dtype != np.bool_ or slot_mask.ndim != 1 or slot_mask.size == 0:
                raise ValueError(f"slot_mask must be a non-empty bool vector, got "
                                 f"{slot_mask.dtype} {slot_mask.shape}")
            retarget = slot_mask.size != n
        try:
            if verify == "full":
                for c in chain:
                    _verify_checkpoint(c, "full")
                    if c.problems:
                        err = CheckpointError(c.problems[0])
                        err.ckpt = c
                        raise err
            plan = _Plan(chain, slot_mask, tables, retarget)
            # into new or empty tables the chunks are checked as they are applied (each
            # byte read once, not twice); a failed check drops what was applied
            fresh = _fresh_targets(sink, chain, plan) if verify == "chunks" else None
            if verify != "manifest" and fresh is None:
                _prevalidate(plan)
        except CheckpointError as err:
            c = getattr(err, "ckpt", head)
            if str(err) not in c.problems:
                c.problems.append(str(err))
            warn_new()
            continue
        if fresh is None:
            break
        try:
            applied = _apply(plan, chain, sink, slot_mask)
        except CheckpointError as err:
            _undo(sink.store, fresh)
            c = getattr(err, "ckpt", None)
            if c is None:  # not a bad chunk (e.g. a table the store cannot create)
                raise
            if str(err) not in c.problems:
                c.problems.append(str(err))
            warn_new()
            continue
        break

    newer = [c for c in cks if c.id > head.id and (upto is None or c.id <= upto)]
    if newer:
        log.warning("restoring %s (chain %s): newer checkpoint(s) %s are not restorable",
                    head.name, " -> ".join(str(c.id) for c in chain),
                    ", ".join(c.name for c in newer))
    else:
        log.info("restoring %s (chain %s)", head.name, " -> ".join(str(c.id) for c in chain))
    tables, dense, nbytes = _apply(plan, chain, sink, slot_mask) if fresh is None else applied
    seq = None
    if isinstance(sink, _StoreSink):
        seq = int(sink.store.sequence.value)
        for name, st in tables.items():
            st["live_rows"] = len(sink.store.get(name))
    skipped = [p for c in cks for p in c.problems]
    _, broken = _restorable(cks)
    skipped += [broken[i] for i in sorted(broken)]
    where = remote.to_url(str(root), head.path) if remote.is_remote(str(root)) else str(head.path)
    return RestoreInfo(checkpoint_id=head.id, chain=[c.id for c in chain], dir=where,
                       num_slots=head.manifest["num_slots"], tables=tables,
                       extra=head.manifest.get("extra", {}), dense=dense,
                       watermarks=head.manifest.get("watermarks", {}), skipped=skipped,
                       bytes_read=nbytes, seconds=time.perf_counter() - t0, sequence=seq)


def _fresh_targets(sink, chain, plan) -> dict | None:
    """For a store target whose tables of ``chain`` are all absent or empty: ``{name: True
    if it exists}`` (what :func:`_undo` needs to take an applied restore back), else None
    (a callback, or a table with rows: nothing may be applied before every check)."""
    if not isinstance(sink, _StoreSink):
        return None
    store = sink.store
    names = set(plan.final_tables)
    for c in chain:
        names |= set(c.manifest["tables"]) | set(c.manifest.get("dropped_tables", []))
    fresh = {}
    for name in names:
        if name in store:
            t = store.get(name)
            if len(t) or t.segment_rows:
                return None
            fresh[name] = True
        else:
            fresh[name] = False
    return fresh


def _undo(store, fresh: dict) -> None:
    """Take back a restore applied into the new or empty tables ``fresh``."""
    for name, existed in fresh.items():
        if name not in store:
            continue
        if existed:
            store.get(name).clear()
        else:
            store.drop_table(name)


def _load_chunks(path: Path, e: dict, group: list, manifest: dict, w: int, slot_mask,
                 where_f: str) -> list:
    """:func:`_load_chunk` for each ``(chunk index, name, partial)`` of ``group``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        # the file's size and END chunk (checked before by _prevalidate, except on a
        # one-pass restore into new tables; a few microseconds per 8 MB task)
        _opened_file_width(fd, e, manifest, where_f)
        _check_end(fd, e, where_f)
        return [_load_chunk(fd, e, ci, name, manifest, w, slot_mask, partial, where_f)
                for ci, name, partial in group]
    finally:
        os.close(fd)


def _load_chunk(fd: int, e: dict, ci: int, name: str, manifest: dict, w: int,
                slot_mask, partial: bool, where_f: str):
    comp, h = _read_chunk(fd, e, ci, name, manifest, w, where_f)
    where = f"{where_f}: chunk {ci}"
    raw = _decode_payload(comp, h, where)
    if h["kind"] == KIND_ARRAY:
        return h, raw, None, len(comp)
    keys, rows = _split_rows(raw, h["n"], w if h["kind"] == KIND_ROWS else 0, where,
                             bool(h["flags"] & FLAG_COUNTS))
    if partial:
        sel = slot_mask[slot_of(keys, slot_mask.size)]
        keys = keys[sel]
        rows = rows[sel] if rows is not None else None
    return h, keys, rows, len(comp)


def _read_into(fd: int, e: dict, ci: int, name: str, manifest: dict, w: int, where_f: str,
               keys_out: np.ndarray, rows_out: np.ndarray, counts_out: np.ndarray,
               slot_mask=None) -> tuple[int, int]:
    """Read rows chunk ``ci`` into a table's own arrays (the views of
    ``EmbeddingTable.reserve_load``): a stored format-4 chunk (flags RAW | COUNTS) goes
    with one ``preadv`` straight into them, no read buffer, no copy, and its crc32c is
    taken there (both release the GIL); any other chunk is read and decoded, then copied
    in. Checks the header against the manifest and the payload's checksum. ``slot_mask``
    (a chunk partly inside the restore's slots): the rows of keys outside it are dropped
    and the kept ones moved to the front. Returns ``(payload length on disk, rows
    kept)``."""
    ch = e["chunks"][ci]
    where = f"{where_f}: chunk {ci} at offset {ch[0]}"
    hlen = header_size(name.encode("utf-8"))
    comp_len = ch[_CI["comp_len"]]
    head = os.pread(fd, hlen, ch[0])
    if len(head) != hlen:
        raise CheckpointError(f"{where}: truncated")
    h = _check_chunk_header(head, ch[0], ch, name, manifest["num_slots"], w, where)
    if h["kind"] != KIND_ROWS or h["n"] != keys_out.size:
        raise CheckpointError(f"{where}: not the rows chunk the manifest announces")
    if h["flags"] == FLAG_RAW | FLAG_COUNTS and h["version"] >= 4:
        views = [memoryview(a).cast("B") for a in (keys_out, rows_out, counts_out)]
        if sum(v.nbytes for v in views) != comp_len:
            raise CheckpointError(f"{where}: payload length {comp_len} != {h['n']} x "
                                  f"(8 + 4 x {w})")
        if os.preadv(fd, views, ch[0] + hlen) != comp_len:
            raise CheckpointError(f"{where}: truncated")
        c = crc32c(keys_out)
        c = crc32c(rows_out, c)
        if crc32c(counts_out, c) != h["crc32"]:
            raise CheckpointError(f"{where}: payload crc32c mismatch (corrupt data)")
    else:
        comp, h = _read_chunk(fd, e, ci, name, manifest, w, where_f)
        raw = _decode_payload(comp, h, where)
        keys, rows = _split_rows(raw, h["n"], w, where, bool(h["flags"] & FLAG_COUNTS))
        keys_out[:] = keys
        rows_out[:] = rows[:, :w - 1]
        counts_out[:] = np.clip(rows[:, w - 1], 0, 2**32 - 1)
    if slot_mask is None:
        return comp_len, int(keys_out.size)
    keep = np.flatnonzero(slot_mask[slot_of(keys_out, slot_mask.size)])
    m = int(keep.size)
    if m != keys_out.size:
        keys_out[:m] = keys_out.take(keep)
        rows_out[:m] = rows_out.take(keep, axis=0)
        counts_out[:m] = counts_out.take(keep)
    return comp_len, m


def _read_chunks_into(path: Path, e: dict, group: list, manifest: dict, w: int,
                      where_f: str, slot_mask) -> list:
    """:func:`_read_into` for each ``(chunk index, name, (keys, rows, counts, partial))``
    of ``group``: ``[(bytes read, rows kept, rows reserved)]``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _opened_file_width(fd, e, manifest, where_f)
        _check_end(fd, e, where_f)
        out = []
        for ci, name, (keys, rows, counts, partial) in group:
            nb, kept = _read_into(fd, e, ci, name, manifest, w, where_f, keys, rows, counts,
                                  slot_mask if partial else None)
            out.append((nb, kept, int(keys.size)))
        return out
    finally:
        os.close(fd)


def _reserve_direct(sink, c: Checkpoint, plan: _Plan, name: str):
    """For the rows phase of table ``name`` in checkpoint ``c``: reserve the table's
    arena rows for every rows chunk the plan reads of it, so the reader threads read
    straight into them (format 4 layout; older chunks are copied in). Only for a store
    target (optimizer slots kept) of a table with counts into an empty table (or after
    earlier loads of this restore); else None. A chunk partly inside the slot mask is
    reserved whole; the rows it does not fill are freed when it is committed. Returns
    ``{(file, chunk): (first_row, keys, rows, counts, partial)}``."""
    if not isinstance(sink, _StoreSink) or sink.reset_optimizer:
        return None
    info = c.manifest["tables"][name]
    if not info.get("counts"):
        return None
    todo = []
    for cc, e, sel in plan.items:
        if cc is not c or e.get("table") != name:
            continue
        for ci, kind, partial in sel:
            if kind == KIND_ROWS:
                todo.append((e["path"], ci, int(e["chunks"][ci][_CI["n"]]), partial))
    total = sum(t[2] for t in todo)
    table = sink.store.get(name)
    if not total or not hasattr(table, "reserve_load") or \
            table.row_width + 1 != data_width(info):
        return None
    got = table.reserve_load(total)
    if got is None:
        return None
    r0, keys, rows, counts = got
    out, at = {}, 0
    for path, ci, n, partial in todo:
        out[(path, ci)] = (r0 + at, keys[at:at + n], rows[at:at + n], counts[at:at + n],
                           partial)
        at += n
    return out


def _saved_index_plan(c: Checkpoint, plan: _Plan, name: str, into) -> dict | None:
    """Whether table ``name`` is restored whole from one rows file of ``c`` that has a
    saved index (``checkpoint.writer._SavedIndex``), read straight into consecutive
    reserved rows in the file's order: then its rows are committed at once, with that
    index. Returns ``{"entry", "r0", "total", "done"}`` or None."""
    if not into:
        return None
    files = [(e, sel) for cc, e, sel in plan.items
             if cc is c and e.get("type") == "rows" and e.get("table") == name
             and any(kind == KIND_ROWS for _, kind, _ in sel)]
    if len(files) != 1 or not isinstance(files[0][0].get("index"), dict):
        return None
    e, sel = files[0]
    rows_chunks = [ci for ci, ch in enumerate(e["chunks"]) if ch[_CI["kind"]] == KIND_ROWS]
    picked = [(ci, partial) for ci, kind, partial in sel if kind == KIND_ROWS]
    if [ci for ci, _ in picked] != rows_chunks or any(p for _, p in picked):
        return None
    r0 = at = into[(e["path"], rows_chunks[0])][0] if rows_chunks else 0
    for ci in rows_chunks:
        if into[(e["path"], ci)][0] != at:
            return None
        at += int(e["chunks"][ci][_CI["n"]])
    return {"entry": e, "r0": r0, "total": at - r0, "done": 0}


def _check_saved_index(c: Checkpoint, e: dict, rows) -> np.ndarray | None:
    """The codes of the index saved beside rows file ``e`` (``HashIndex.install_table``),
    checked: size, crc32c, the row count. None if it was written with another probe
    hash (not usable, nothing wrong); raises ValueError, OSError or KeyError if bad."""
    ix = e["index"]
    cap, n, size = int(ix["capacity"]), int(ix["rows"]), int(ix["size"])
    name = str(ix["path"])
    if "/" in name or name.startswith(".") or n != rows or cap < 1 or size != 4 * cap:
        raise ValueError(f"entry {ix} does not match {rows} rows")
    codes = np.fromfile(c.path / name, dtype="<i4")
    if codes.nbytes != size:
        raise ValueError(f"{codes.nbytes} bytes, the manifest says {size}")
    if crc32c(codes) != int(ix["crc32c"]):
        raise ValueError("crc32c mismatch (corrupt data)")
    if ix.get("probe_seed") != PROBE_SEED:
        return None
    return codes.astype(np.int32, copy=False)


def _read_saved_index(c: Checkpoint, e: dict, rows: int):
    """The index saved beside rows file ``e`` (``(capacity, codes)``, see
    ``HashIndex.install_table``), checked (:func:`_check_saved_index`); None with a
    warning if it is missing or does not check: the restore then places the keys, as it
    would without it."""
    if e["index"].get("probe_seed") != PROBE_SEED:
        return None  # another hash layout: nothing wrong, just not usable
    try:
        codes = _check_saved_index(c, e, rows)
    except (OSError, KeyError, TypeError, ValueError) as err:
        log.warning("checkpoint %s: index of %s not used (%s); placing its keys instead",
                    c.name, e.get("path"), err)
        return None
    return (codes.size, codes) if codes is not None else None


def _apply(plan: _Plan, chain, sink, slot_mask):
    """Pass 2: read, decompress (worker threads, bounded look-ahead) and apply."""
    stats: dict[str, dict] = {}
    dense_parts: dict[str, list] = {}
    dense_meta: dict[str, dict] = {}
    nbytes = 0
    with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="ckpt-read") as pool:
        for c in chain:
            m = c.manifest
            items = [(e, sel) for cc, e, sel in plan.items if cc is c]
            for name in m.get("dropped_tables", []):
                sink.drop(name)
                stats.pop(name, None)
            for name, info in m["tables"].items():
                if name not in plan.final_tables:
                    continue
                if name not in stats:
                    expected = sum(ch[_CI["n"]] for cc, e, sel in plan.items
                                   if e.get("table") == name
                                   for ci, kind, _ in sel
                                   for ch in [e["chunks"][ci]] if kind == KIND_ROWS)
                    sink.table(name, info, expected)
                    stats.setdefault(name, {"rows": 0, "deleted": 0})
            for phase in (KIND_TOMBSTONES, KIND_ROWS, KIND_ARRAY):
                jobs = deque()
                batch: dict[str, list] = {}  # rows per table, imported _IMPORT_ROWS at a time
                # rows phase: per table, its arena rows reserved for a direct read
                direct = {}
                saved = {}  # per table: its rows committed at once, with its saved index
                if phase == KIND_ROWS:
                    for name in {e["table"] for e, _ in items if e["type"] == "rows"}:
                        direct[name] = _reserve_direct(sink, c, plan, name)
                        saved[name] = _saved_index_plan(c, plan, name, direct[name])

                def flush(table):
                    # the rows of the chunks go on as a list: a store copies each part
                    # into its arena, no joined copy of the batch first
                    parts = batch.pop(table, [])
                    if parts:
                        sink.rows(table, parts[0][0] if len(parts) == 1 else
                                  np.concatenate([p[0] for p in parts]), [p[1] for p in parts])

                def finish(job, c=c):
                    nonlocal nbytes
                    e, fut = job
                    try:
                        got = fut.result()
                    except CheckpointError as err:
                        err.ckpt = c
                        raise
                    except OSError as err:
                        new = CheckpointError(f"{c.name}/{e['path']}: {err}")
                        new.ckpt = c
                        raise new from None
                    si = saved.get(e["table"]) if fut.direct is not None else None
                    if si is not None:  # the whole table, made live at its last chunk
                        for nb, kept, n in got:
                            nbytes += nb
                            stats[e["table"]]["rows"] += kept
                            si["done"] += n
                        if si["done"] == si["total"]:
                            table = sink.store.get(e["table"])
                            table.commit_load(
                                si["r0"], si["total"],
                                saved_index=_read_saved_index(c, si["entry"], si["total"]))
                            stats[e["table"]]["saved_index"] = table.index_from_checkpoint
                        return
                    if fut.direct is not None:  # rows read into the table: live, in order
                        table = sink.store.get(e["table"])
                        r = run = fut.direct
                        for nb, kept, n in got:  # runs of whole chunks: one commit each
                            nbytes += nb
                            stats[e["table"]]["rows"] += kept
                            if kept != n:
                                if r > run:
                                    table.commit_load(run, r - run)
                                table.commit_load(r, kept, n)
                                run = r + n
                            r += n
                        if r > run:
                            table.commit_load(run, r - run)
                        return
                    for res in got:
                        finish_one(e, *res)

                def finish_one(e, h, keys, rows, n):
                    nonlocal nbytes
                    nbytes += n
                    if h["kind"] == KIND_TOMBSTONES:
                        if keys.size:
                            sink.delete(e["table"], keys)
                        stats[e["table"]]["deleted"] += int(keys.size)
                    elif h["kind"] == KIND_ROWS:
                        if keys.size:
                            parts = batch.setdefault(e["table"], [])
                            parts.append((keys, rows))
                            if sum(p[0].size for p in parts) >= _IMPORT_ROWS:
                                flush(e["table"])
                        stats[e["table"]]["rows"] += int(keys.size)
                    else:
                        dense_parts.setdefault(h["name"], []).append(keys)

                for e, sel in items:
                    if e["type"] == "dense" and phase == KIND_ARRAY:
                        for name, meta in e["arrays"].items():
                            dense_parts[name] = []
                            dense_meta[name] = meta
                    w = data_width(m["tables"][e["table"]]) if e["type"] == "rows" else 0
                    # a task reads a run of chunks (~_TASK_BYTES): fewer hand-offs between
                    # threads, which cost more than a 1 MB chunk's work on a busy host
                    group, size = [], 0
                    todo = [(ci, partial) for ci, kind, partial in sel if kind == phase]
                    into = direct.get(e["table"]) if e["type"] == "rows" else None
                    for j, (ci, partial) in enumerate(todo):
                        name = e["table"] if e["type"] == "rows" else _array_name_of(e, ci)
                        group.append((ci, name, into[(e["path"], ci)][1:] if into
                                      else partial))
                        size += e["chunks"][ci][_CI["comp_len"]]
                        if size < _TASK_BYTES and j + 1 < len(todo):
                            continue
                        if into:
                            # one task's chunks are consecutive reserved rows
                            fut = pool.submit(_read_chunks_into, c.path / e["path"], e,
                                              group, m, w, f"{c.name}/{e['path']}",
                                              slot_mask)
                            fut.direct = into[(e["path"], group[0][0])][0]
                        else:
                            fut = pool.submit(_load_chunks, c.path / e["path"], e, group, m,
                                              w, slot_mask, f"{c.name}/{e['path']}")
                            fut.direct = None
                        group, size = [], 0
                        jobs.append((e, fut))
                        while len(jobs) > 2 * _READ_THREADS:
                            finish(jobs.popleft())
                while jobs:
                    finish(jobs.popleft())
                for table in list(batch):
                    flush(table)
    dense = {}
    for name, meta in dense_meta.items():
        blob = b"".join(bytes(p) for p in dense_parts.get(name, []))
        dt = np.dtype(meta["dtype"])
        want = int(np.prod(meta["shape"], dtype=np.int64)) * dt.itemsize
        if len(blob) != want:
            raise CheckpointError(f"dense variable '{name}': {len(blob)} bytes, expected {want}")
        dense[name] = np.frombuffer(blob, dtype=dt).reshape(meta["shape"]).copy()
    return stats, dense, nbytes


# ----------------------------------------------------------------------------- retention
_scratch = threading.local()  # each verify thread's read buffer (see _check_chunk)


def _check_chunk(fd: int, entry: dict, ci: int, name: str, manifest: dict, w: int,
                 where_f: str) -> None:
    """:func:`_read_chunk`'s checks (header, payload crc), reading into a buffer this
    thread reuses: the bytes are dropped at once, and a fresh ``bytes`` per chunk was a
    new allocation, page-faulted for the copy and freed again (the 28 MB of a 5%
    incremental of 4M rows: ~5 -> 1.5 ms of CPU; ~13 -> 3 ms under a PS's 1 MB mmap
    threshold). The buffer goes with the thread (:func:`_check_new`'s pool)."""
    ch = entry["chunks"][ci]
    where = f"{where_f}: chunk {ci} at offset {ch[0]}"
    hlen = header_size(name.encode("utf-8"))
    want = hlen + ch[_CI["comp_len"]]
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < want:
        buf = _scratch.buf = bytearray(want)
    view = memoryview(buf)[:want]
    got = os.preadv(fd, [view], ch[0])
    if got != want:
        raise CheckpointError(f"{where}: truncated")
    h = _check_chunk_header(view, ch[0], ch, name, manifest["num_slots"], w, where)
    if payload_crc(view[hlen:], h["version"]) != h["crc32"]:
        raise CheckpointError(f"{where}: payload {_crc_name(h)} mismatch (corrupt data)")


# a checkpoint smaller than this (an incremental) is checked on the calling thread: the
# pool's threads cost more than they overlap (28 MB, 15 rounds: CPU median 3.1-3.3 ms
# inline against 4.0-5.0 with 2 threads)
_CHECK_INLINE_BYTES = 64 << 20


class _Inline:
    """A stand-in for the verify pool that runs each task at once on the caller."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def submit(fn, *args):
        fut = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # re-raised by result(), as from a pool
            fut.set_exception(e)
        return fut


def _check_new(c: Checkpoint) -> None:
    """Chunk-level check of the files of ``c`` (the checkpoint just committed): every
    chunk header (against the manifest's index) and payload crc32 and the END chunk, no
    decompression; problems go to ``c.problems``. Reads the bytes of ``c`` only."""
    if not c.valid or c.level == "chunks":
        return
    c.level = "chunks"
    small = sum(int(e["size"]) for e in c.manifest["files"]) < _CHECK_INLINE_BYTES
    with (_Inline() if small else
          ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="ckpt-verify")) as pool:
        for e in c.manifest["files"]:
            where_f = f"{c.name}/{e['path']}"
            try:
                fd = os.open(c.path / e["path"], os.O_RDONLY)
            except OSError as err:
                c.problems.append(f"{where_f}: {err}")
                continue
            try:
                w = _opened_file_width(fd, e, c.manifest, where_f)
                pos = 0
                futs = deque()
                try:
                    for ci, ch in enumerate(e["chunks"]):
                        if ch[0] != pos:
                            raise CheckpointError(f"{where_f}: chunk {ci}: chunk index not "
                                                  "contiguous")
                        name = e["table"] if e["type"] == "rows" else _array_name_of(e, ci)
                        pos += header_size(name.encode("utf-8")) + ch[_CI["comp_len"]]
                        futs.append(pool.submit(_check_chunk, fd, e, ci, name, c.manifest, w,
                                                where_f))
                        while len(futs) > 2 * _READ_THREADS:  # bounded memory
                            futs.popleft().result()
                    while futs:
                        futs.popleft().result()
                finally:
                    wait(futs)  # no read may outlive the descriptor
                _check_end(fd, e, where_f)
                c.verified_chunks.update((e["path"], ci) for ci in range(len(e["chunks"])))
            except CheckpointError as err:
                c.problems.append(str(err))
            except OSError as err:
                c.problems.append(f"{where_f}: {err}")
            finally:
                os.close(fd)


def apply_retention(root, keep_chains: int = 2, verify: str = "new") -> list[str]:
    """Delete checkpoints older than the newest ``keep_chains`` restorable chains (and
    older incomplete or corrupt ones). Never deletes the newest restorable chain, nor
    anything when no chain is restorable, nor anything newer than the oldest kept chain
    (e.g. a checkpoint still being written). Returns the deleted directory names.

    ``verify``: how the checkpoints are checked before chains are formed. ``"new"`` (the
    default, run after each commit): manifests and file sizes of all, and every chunk's
    header and crc32 of the newest checkpoint only -- what was just written, which
    earlier runs have not seen; older ones were checked when they were the newest. Its
    cost is proportional to the new checkpoint, so an incremental's retention pass does
    not read the full it builds on. ``"manifest"``: manifests and sizes only; ``"full"``:
    every byte of every checkpoint."""
    if isinstance(keep_chains, bool) or not isinstance(keep_chains, int) or keep_chains < 1:
        raise ValueError(f"keep_chains must be an integer >= 1, got {keep_chains!r}")
    if verify not in ("new", "manifest", "full"):
        raise ValueError(f"verify must be 'new', 'manifest' or 'full', got {verify!r}")
    url = str(root) if remote.is_remote(str(root)) else None
    root = remote.mirror(url) if url else Path(root)
    cks = scan(root, "full" if verify == "full" else "manifest", _cached=True)
    if verify == "new":
        newest = [c for c in cks if c.valid]
        if newest:
            _check_new(newest[-1])
    while True:
        chains = _chains(cks)
        if not chains:
            _warn_invalid(cks)
            log.warning("retention: no restorable checkpoint under %s; nothing deleted", root)
            return []
        kept = chains[:keep_chains]
        floor = min(ch.root.id for ch in kept)
        doomed = [p for p in sorted(root.iterdir())
                  if (m := DIR_RE.match(p.name)) and p.is_dir() and int(m.group(1)) < floor]
        if not doomed or verify != "new":
            break
        # about to delete: first check every chunk of the chains kept instead (once per
        # new chain, not per incremental), so bit rot in a kept checkpoint never costs the
        # older chain that would replace it
        unseen = [c for ch in kept for c in ch.checkpoints if c.level != "chunks"]
        if not unseen:
            break
        for c in unseen:
            _check_new(c)
            c.level = "chunks"
    _warn_invalid(cks)
    deleted = []
    for p in doomed:
        if url:  # manifest object first: it stops being a checkpoint before it goes
            remote.delete(url, p.name)
        trash = root / f".deleting-{p.name}-{os.getpid()}"
        os.replace(p, trash)  # atomic: readers never see a half-deleted checkpoint
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(p.name)
    if deleted:
        log.info("retention: deleted %s (keeping chains from %s on)", ", ".join(deleted),
                 kept[-1].root.name)
    return deleted
