"""Durable job state, written as a journal of what changed.

The state is one JSON-like document (a dict). ``StateStore.save`` keeps it in a SQLite
database ``<state_dir>/job_state.db`` in WAL mode with ``synchronous=FULL``: a save
commits one transaction (one fsync of the write-ahead log) and what ``save`` returned for
survives ``kill -9`` and power loss; a restarted AIMaster's ``load()`` returns the last
saved state.

Only what changed is written. The document is a tree of rows, table ``node``, keyed by
``(parent, pos)``:

- a value whose JSON is short (``split_bytes``, 1 KiB by default) is one row holding
  that JSON (a *leaf*);
- a larger dict or list is a *container* row with an id, and each of its elements is a
  row under it (recursively). Dict elements are keyed by their key; list elements carry
  an integer ``pos`` that only orders them (gaps of 2^32), so an element inserted or
  removed anywhere, at the front of a queue included, is one row written and no other
  row renumbered.

The store keeps, in memory, a mirror of what it last wrote. ``save`` compares the new
document with it and writes the difference: changed leaves are updated in place; a list
is compared by its common prefix and suffix, then the middle is either updated position
by position or aligned by element (``difflib``) when that writes fewer rows (an event
window that drops its oldest entry and gains a new one: two rows). For the AIMaster's
state a data-shard request writes a few rows (the head of ``todo``, ``doing``, a
``done`` id, the members' counters, ``global_step``): a handful of pages, whatever the
number of shards. A save that changes nothing writes nothing.

Values are compared with ``==`` after JSON normalization (dict keys become strings,
tuples lists), as ``load()`` would return them; a change ``==`` cannot see inside a
list or dict element (``1`` to ``1.0``) is not rewritten.

The WAL is checkpointed into the database by SQLite every 1000 pages, and truncated
every ``checkpoint_every`` saves. ``load()`` closes the database afterwards, which
folds the WAL into the database file: until the next ``save`` it is one self-contained
file that can be renamed (``set_aside``) or copied. Readers in other processes use
``load_state(state_dir)`` (a consistent snapshot even while the AIMaster writes), or
``python -m aimaster.state <state_dir>`` to print the state as JSON.

A state dir written by an older version (``job_state.json``) is imported by the first
``load()``; the JSON file is then renamed ``job_state.json.imported``.
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import urllib.parse
import uuid
from difflib import SequenceMatcher

DB_NAME = "job_state.db"
LEGACY_NAME = "job_state.json"
FORMAT = 1

LEAF, DICT, LIST = 0, 1, 2
META = -1           # parent of the store's own rows (format, generation, seq, next id)
_M_FORMAT, _M_GENERATION, _M_SEQ, _M_NEXT_ID = 0, 1, 2, 3
GAP = 1 << 32       # spacing of list positions
POS_LIMIT = 1 << 62
PAGE_SIZE = 1024    # small pages: a save writes whole pages to the WAL

_dumps = json.JSONEncoder(separators=(",", ":")).encode

_SCHEMA = """
CREATE TABLE node (
    parent INTEGER NOT NULL,  -- id of the containing dict/list; 0 for the root, -1: meta
    pos    INTEGER NOT NULL,  -- order among the parent's elements
    key    TEXT,              -- dict element: its key
    kind   INTEGER NOT NULL,  -- 0 leaf (value is JSON), 1 dict, 2 list
    id     INTEGER,           -- dict/list: the parent id of its elements
    value  TEXT,
    PRIMARY KEY (parent, pos)
) WITHOUT ROWID
"""


class StateStoreError(RuntimeError):
    """The state database cannot be read or written; the message names the file."""


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jkey(k) -> str:
    """A dict key as JSON writes it."""
    if type(k) is str:
        return k
    if isinstance(k, str):
        return str.__str__(k)  # a str enum: its value, as JSON writes it
    if k is True:
        return "true"
    if k is False:
        return "false"
    if k is None:
        return "null"
    if isinstance(k, (int, float)):
        return _dumps(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")


def _normalized(d: dict) -> dict:
    for k in d:
        if type(k) is not str:
            return {_jkey(k): v for k, v in d.items()}
    return d


_SCALARS = (str, int, float, bool, type(None))


def _align_key(x):
    t = type(x)
    if t in _SCALARS:
        return (t, x)
    return _dumps(x)


def _common_prefix(a: list, b: list, limit: int) -> int:
    """Length of the longest common prefix (at most ``limit``): slices of doubling size
    compared in C, then a short loop."""
    p, step = 0, 16
    while p < limit:
        q = min(limit, p + step)
        if a[p:q] != b[p:q]:
            while q - p > 16:  # the first difference is in [p, q): halve
                h = (p + q) // 2
                if a[p:h] == b[p:h]:
                    p = h
                else:
                    q = h
            break
        p, step = q, step * 2
    while p < limit and a[p] == b[p]:
        p += 1
    return p


def _common_suffix(a: list, b: list, limit: int) -> int:
    """Length of the longest common suffix (at most ``limit``), as ``_common_prefix``."""
    la, lb = len(a), len(b)
    s, step = 0, 16
    while s < limit:
        t = min(limit, s + step)
        if a[la - t:la - s] != b[lb - t:lb - s]:
            while t - s > 16:
                h = (s + t) // 2
                if a[la - h:la - s] == b[lb - h:lb - s]:
                    s = h
                else:
                    t = h
            break
        s, step = t, step * 2
    while s < limit and a[la - 1 - s] == b[lb - 1 - s]:
        s += 1
    return s


class _Node:
    __slots__ = ("kind", "pos", "key", "id", "text", "value", "children", "next")

    def __init__(self, kind, pos, key, id=None, text=None, value=None, children=None, next=0):
        self.kind, self.pos, self.key, self.id = kind, pos, key, id
        self.text, self.value, self.children, self.next = text, value, children, next


def _row(node: _Node, parent: int, pos: int | None = None) -> tuple:
    return (parent, node.pos if pos is None else pos, node.key, node.kind, node.id,
            node.text if node.kind == LEAF else None)


class _Writer:
    """Writes the difference between the mirror and a new document, in the open
    transaction of ``cur``; updates the mirror as it goes (the caller drops the mirror
    if the transaction does not commit)."""

    def __init__(self, cur: sqlite3.Cursor, next_id: int, split_bytes: int):
        self.cur = cur
        self.next_id = next_id
        self.split = split_bytes
        self.rows = 0  # rows written or deleted

    # -- writes --------------------------------------------------------------------------
    def _insert(self, row: tuple) -> None:
        self.cur.execute("INSERT INTO node VALUES (?,?,?,?,?,?)", row)
        self.rows += 1

    def _delete(self, parent: int, pos: int) -> None:
        self.cur.execute("DELETE FROM node WHERE parent=? AND pos=?", (parent, pos))
        self.rows += 1

    def _drop(self, node: _Node) -> None:
        """Delete a container's descendants (not its own row)."""
        if node.kind == LEAF:
            return
        for c in (node.children.values() if node.kind == DICT else node.children):
            self._drop(c)
        self.cur.execute("DELETE FROM node WHERE parent=?", (node.id,))
        self.rows += 1

    def build(self, parent: int, pos: int, key, value, text: str | None = None) -> _Node:
        """Write ``value`` fresh as the element (parent, pos)."""
        if text is None:
            text = _dumps(value)
        if isinstance(value, (dict, list, tuple)) and value and len(text) >= self.split:
            cid = self.next_id
            self.next_id += 1
            if isinstance(value, dict):
                node = _Node(DICT, pos, key, cid, children={}, value={})
                self._insert(_row(node, parent))
                for i, (k, v) in enumerate(_normalized(value).items()):
                    c = self.build(cid, i, k, v)
                    node.children[k] = c
                    node.value[k] = c.value
                node.next = len(node.children)
            else:
                node = _Node(LIST, pos, key, cid, children=[], value=[])
                self._insert(_row(node, parent))
                for i, v in enumerate(value):
                    c = self.build(cid, i * GAP, None, v)
                    node.children.append(c)
                    node.value.append(c.value)
            return node
        node = _Node(LEAF, pos, key, text=text, value=json.loads(text))
        self._insert(_row(node, parent))
        return node

    def remove(self, parent: int, node: _Node) -> None:
        self._drop(node)
        self._delete(parent, node.pos)

    # -- differences ---------------------------------------------------------------------
    def update(self, parent: int, node: _Node, value) -> _Node:
        """Make element ``node`` of ``parent`` hold ``value``; returns its (new) node."""
        if node.kind == LEAF:
            if value == node.value and type(value) is type(node.value):
                return node
            text = _dumps(value)
            if text == node.text:
                return node
            if isinstance(value, (dict, list, tuple)) and value and len(text) >= self.split:
                self._delete(parent, node.pos)
                return self.build(parent, node.pos, node.key, value, text)
            self.cur.execute("UPDATE node SET value=? WHERE parent=? AND pos=?",
                             (text, parent, node.pos))
            self.rows += 1
            node.text, node.value = text, json.loads(text)
            return node
        if node.kind == DICT and isinstance(value, dict):
            self._diff_dict(node, value)
            return node
        if node.kind == LIST and isinstance(value, (list, tuple)):
            self._diff_list(node, value if type(value) is list else list(value))
            return node
        self.remove(parent, node)  # the type changed
        return self.build(parent, node.pos, node.key, value)

    def _diff_dict(self, node: _Node, value: dict) -> None:
        new = _normalized(value)
        children, vals = node.children, node.value
        for k, v in new.items():
            c = children.get(k)
            if c is None:
                c = self.build(node.id, node.next, k, v)
                node.next += 1
                children[k] = c
                vals[k] = c.value
                continue
            if c.kind == LEAF and v == c.value and type(v) is type(c.value):
                continue
            nc = self.update(node.id, c, v)
            if nc is not c:
                children[k] = nc
            vals[k] = nc.value
        if len(children) != len(new):
            for k in [k for k in children if k not in new]:
                self.remove(node.id, children.pop(k))
                del vals[k]

    def _diff_list(self, node: _Node, new: list) -> None:
        old = node.value
        if new == old:
            return
        n, k = len(old), len(new)
        p = _common_prefix(new, old, min(n, k))
        s = _common_suffix(new, old, min(n, k) - p)
        a_nodes = node.children[p:n - s]
        a, b = old[p:n - s], new[p:k - s]
        la, lb = len(a), len(b)
        common = min(la, lb)
        plan = [("replace", 0, common, 0, common)]
        if la > common:
            plan.append(("delete", common, la, common, common))
        elif lb > common:
            plan.append(("insert", la, la, common, lb))
        if la and lb:
            cost = sum(1 for x, y in zip(a, b) if x != y) + abs(la - lb)
            if cost > 2:
                ops = SequenceMatcher(None, [_align_key(x) for x in a],
                                      [_align_key(y) for y in b]).get_opcodes()
                if sum(max(i2 - i1, j2 - j1) for t, i1, i2, j1, j2 in ops if t != "equal") < cost:
                    plan = ops
        # ``out``: the middle's new elements, kept nodes or values still to insert
        out: list = []
        inserts = False
        for tag, i1, i2, j1, j2 in plan:
            if tag == "equal":
                out.extend(a_nodes[i1:i2])
                continue
            pairs = min(i2 - i1, j2 - j1) if tag == "replace" else 0
            for d in range(pairs):
                out.append(self.update(node.id, a_nodes[i1 + d], b[j1 + d]))
            for i in range(i1 + pairs, i2):
                self.remove(node.id, a_nodes[i])
            for j in range(j1 + pairs, j2):
                out.append(_Pending(b[j]))
                inserts = True
        if inserts:
            lo = node.children[p - 1].pos if p else None
            hi = node.children[n - s].pos if s else None
            if not self._place(node.id, out, lo, hi):
                node.children[p:n - s] = out
                self._renumber(node)
                node.value[:] = [c.value for c in node.children]
                return
        node.children[p:n - s] = out
        node.value[p:n - s] = [c.value for c in out]

    def _place(self, parent: int, out: list, lo: int | None, hi: int | None) -> bool:
        """Give the pending elements of ``out`` positions between their neighbours and
        write them; False (nothing written) when some run has no room."""
        runs, i = [], 0
        while i < len(out):
            if not isinstance(out[i], _Pending):
                i += 1
                continue
            j = i
            while j < len(out) and isinstance(out[j], _Pending):
                j += 1
            left = out[i - 1].pos if i else lo
            right = out[j].pos if j < len(out) else hi
            r = j - i
            if left is None and right is None:
                first, step = 0, GAP
            elif left is None:
                first, step = right - r * GAP, GAP
            elif right is None:
                first, step = left + GAP, GAP
            else:
                step = (right - left) // (r + 1)
                first = left + step
            if step < 1 or first < -POS_LIMIT or first + (r - 1) * step > POS_LIMIT:
                return False
            runs.append((i, j, first, step))
            i = j
        for i, j, first, step in runs:
            for d in range(j - i):
                out[i + d] = self.build(parent, first + d * step, None, out[i + d].value)
        return True

    def _renumber(self, node: _Node) -> None:
        """Rewrite a list's rows with fresh positions (when a gap is used up)."""
        self.cur.execute("DELETE FROM node WHERE parent=?", (node.id,))
        self.rows += 1
        for i, c in enumerate(node.children):
            if isinstance(c, _Pending):
                node.children[i] = self.build(node.id, i * GAP, None, c.value)
            else:
                c.pos = i * GAP
                self._insert(_row(c, node.id))


class _Pending:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _read(conn: sqlite3.Connection, path: str):
    """(root node or None, meta dict) from a database, in one read transaction."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "node" not in tables:
        if tables:
            raise StateStoreError(f"{path}: not a job state database (tables {sorted(tables)})")
        return None, {}  # being created
    rows = conn.execute("SELECT parent, pos, key, kind, id, value FROM node "
                        "ORDER BY parent, pos").fetchall()
    meta, by_parent = {}, {}
    for r in rows:
        if r[0] == META:
            meta[r[1]] = json.loads(r[5])
        else:
            by_parent.setdefault(r[0], []).append(r)
    if meta.get(_M_FORMAT) != FORMAT:
        raise StateStoreError(f"{path}: state format {meta.get(_M_FORMAT)!r}, this AIMaster "
                              f"reads format {FORMAT} (written by another version?)")

    def build(r) -> _Node:
        _, pos, key, kind, cid, value = r
        if kind == LEAF:
            return _Node(LEAF, pos, key, text=value, value=json.loads(value))
        if kind == DICT:
            node = _Node(DICT, pos, key, cid, children={}, value={})
            for cr in by_parent.get(cid, ()):
                c = build(cr)
                node.children[c.key] = c
                node.value[c.key] = c.value
            node.next = max((c.pos for c in node.children.values()), default=-1) + 1
            return node
        if kind == LIST:
            node = _Node(LIST, pos, key, cid, children=[], value=[])
            for cr in by_parent.get(cid, ()):
                c = build(cr)
                node.children.append(c)
                node.value.append(c.value)
            return node
        raise StateStoreError(f"{path}: corrupt state (row kind {kind!r})")

    roots = by_parent.get(0, [])
    return (build(roots[0]) if roots else None), meta


def _uri(path: str, mode: str) -> str:
    return f"file:{urllib.parse.quote(os.path.abspath(path))}?mode={mode}"


def _read_checked(conn: sqlite3.Connection, path: str, begin: bool = True):
    """``_read`` (in a read transaction of its own if ``begin``); any failure is a
    StateStoreError naming ``path``."""
    try:
        if not begin:
            return _read(conn, path)
        conn.execute("BEGIN")
        try:
            return _read(conn, path)
        finally:
            conn.execute("ROLLBACK")
    except StateStoreError:
        raise
    except (sqlite3.Error, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _describe(path, exc) from None


def _describe(path: str, exc) -> StateStoreError:
    return StateStoreError(
        f"{path}: cannot read or write the job state database ({exc}). If the file is "
        "damaged, move it aside to start the job over (its checkpoints stay).")


def _connect(path: str, create: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(_uri(path, "rwc" if create else "rw"), uri=True, timeout=30,
                           isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only effective on a new database
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"journal mode {mode!r}, not WAL")
        conn.execute("PRAGMA synchronous=FULL")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "node" not in tables:
            if tables:
                raise StateStoreError(f"{path}: not a job state database (tables {sorted(tables)})")
            conn.execute("BEGIN IMMEDIATE")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "node" not in tables:
                conn.execute(_SCHEMA)
                conn.executemany("INSERT INTO node VALUES (?,?,?,?,?,?)", [
                    (META, _M_FORMAT, "format", LEAF, None, _dumps(FORMAT)),
                    (META, _M_GENERATION, "generation", LEAF, None, _dumps(uuid.uuid4().hex)),
                    (META, _M_SEQ, "seq", LEAF, None, "0"),
                    (META, _M_NEXT_ID, "next_id", LEAF, None, "1")])
            conn.execute("COMMIT")
    except BaseException:
        conn.close()
        raise
    return conn


class StateStore:
    """The AIMaster's durable state (see the module doc). Thread-safe."""

    def __init__(self, state_dir: str, filename: str = DB_NAME, *, split_bytes: int = 1024,
                 checkpoint_every: int = 1000):
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, filename)
        self._legacy = os.path.join(state_dir, LEGACY_NAME) if filename == DB_NAME else None
        self._split = split_bytes
        self._checkpoint_every = checkpoint_every
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._root: _Node | None = None   # mirror of the database...
        self._tag: tuple | None = None    # ...as of (generation, seq)
        self._saves = 0
        self.rows_written = 0             # rows written by the last save (0: no change)

    # -- connection ----------------------------------------------------------------------
    def _open(self, create: bool) -> sqlite3.Connection:
        if self._conn is None:
            new = not os.path.exists(self.path)
            try:
                self._conn = _connect(self.path, create)
            except sqlite3.Error as exc:
                raise _describe(self.path, exc) from None
            if new:
                _fsync_dir(self.path)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()  # the last connection folds the WAL into the database
            except sqlite3.Error:
                pass

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- API -----------------------------------------------------------------------------
    def load(self) -> dict | None:
        """The last saved state, or None if nothing was saved."""
        with self._lock:
            if not os.path.exists(self.path):
                self._root = self._tag = None
                if self._legacy and os.path.exists(self._legacy):
                    return self._import_legacy()
                return None
            conn = self._open(create=False)
            try:
                root, meta = _read_checked(conn, self.path)
            finally:
                self._close()
            self._root, self._tag = root, (meta.get(_M_GENERATION), meta.get(_M_SEQ))
            return None if root is None else json.loads(_dumps(root.value))

    def save(self, state: dict) -> None:
        """Durably record ``state``; writes only what differs from the last save."""
        if not isinstance(state, dict):
            raise TypeError(f"the state must be a dict, not {type(state).__name__}")
        with self._lock:
            self._save(state)

    def set_aside(self, suffix: str) -> str | None:
        """Rename the database (and any WAL) to ``path + suffix``; the next save starts an
        empty one. Returns the new path, or None if there was nothing to set aside."""
        with self._lock:
            if not os.path.exists(self.path):
                return None
            try:
                conn = self._open(create=False)
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except (sqlite3.Error, StateStoreError):
                pass  # moved with its WAL below (a damaged file is moved aside as it is)
            self._close()
            target = self.path + suffix
            os.replace(self.path, target)
            for ext in ("-wal", "-shm"):
                if os.path.exists(self.path + ext):
                    os.replace(self.path + ext, target + ext)
            _fsync_dir(self.path)
            self._root = self._tag = None
            return target

    def checkpoint(self) -> None:
        """Fold the WAL into the database and truncate it (also done every
        ``checkpoint_every`` saves)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                except sqlite3.Error as exc:
                    raise _describe(self.path, exc) from None

    # -- internals -----------------------------------------------------------------------
    def _import_legacy(self) -> dict | None:
        try:
            with open(self._legacy, encoding="utf-8") as f:
                state = json.load(f)
        except ValueError as exc:
            raise StateStoreError(f"{self._legacy}: unreadable job state ({exc})") from None
        if not isinstance(state, dict):
            raise StateStoreError(f"{self._legacy}: unreadable job state (not an object)")
        self._save(state)
        os.replace(self._legacy, self._legacy + ".imported")
        _fsync_dir(self._legacy)
        self._close()
        return state

    def _save(self, state: dict) -> None:
        conn = self._open(create=True)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _describe(self.path, exc) from None
        try:
            gen, seq, next_id = self._meta(conn)
            if self._tag != (gen, seq):  # first save, or written by another process
                self._root = _read_checked(conn, self.path, begin=False)[0]
            w = _Writer(conn.cursor(), next_id, self._split)
            if self._root is None:
                self._root = w.build(0, 0, None, state)
            else:
                self._root = w.update(0, self._root, state)
            if w.rows:
                seq += 1
                conn.execute("UPDATE node SET value=? WHERE parent=? AND pos=?",
                             (str(seq), META, _M_SEQ))
                if w.next_id != next_id:
                    conn.execute("UPDATE node SET value=? WHERE parent=? AND pos=?",
                                 (str(w.next_id), META, _M_NEXT_ID))
                conn.execute("COMMIT")
            else:
                conn.execute("ROLLBACK")
        except BaseException as exc:
            # the mirror may hold what was not committed: re-read it at the next save
            self._root = self._tag = None
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    self._close()
            if isinstance(exc, sqlite3.Error):
                raise _describe(self.path, exc) from None
            raise  # e.g. TypeError: a value JSON cannot encode
        self._tag = (gen, seq)
        self.rows_written = w.rows
        if w.rows:
            self._saves += 1
            if self._checkpoint_every and self._saves % self._checkpoint_every == 0:
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                except sqlite3.Error:
                    pass  # retried at the next one; SQLite also checkpoints on its own

    def _meta(self, conn: sqlite3.Connection) -> tuple[str, int, int]:
        meta = dict(conn.execute("SELECT pos, value FROM node WHERE parent=?", (META,)))
        try:
            if json.loads(meta[_M_FORMAT]) != FORMAT:
                raise StateStoreError(f"{self.path}: state format {meta[_M_FORMAT]}, this "
                                      f"AIMaster writes format {FORMAT} (another version?)")
            return (json.loads(meta[_M_GENERATION]), int(meta[_M_SEQ]),
                    int(meta[_M_NEXT_ID]))
        except (KeyError, ValueError) as exc:
            raise _describe(self.path, f"corrupt metadata: {exc!r}") from None


def db_path(path: str) -> str:
    return os.path.join(path, DB_NAME) if os.path.isdir(path) else path


def load_state(path: str) -> dict | None:
    """Read-only: the state saved in a state dir (or in a database file such as a
    set-aside ``job_state.db.interrupted``); None if there is none. Safe while the
    AIMaster is writing (a consistent snapshot). Reads a state dir of an older version
    (``job_state.json``) too."""
    db = db_path(path)
    if not os.path.exists(db):
        legacy = os.path.join(path, LEGACY_NAME) if os.path.isdir(path) else None
        if legacy and os.path.exists(legacy):
            with open(legacy, encoding="utf-8") as f:
                return json.load(f)
        return None
    try:
        conn = sqlite3.connect(_uri(db, "rw"), uri=True, timeout=30,
                               isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _describe(db, exc) from None
    try:
        root, _ = _read_checked(conn, db)
    finally:
        conn.close()
    return None if root is None else root.value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m aimaster.state STATE_DIR | DB_FILE\n"
              "Print a job's saved state as JSON (works while the AIMaster runs).",
              file=sys.stderr)
        return 2
    try:
        state = load_state(argv[0])
    except StateStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if state is None:
        print(f"error: no job state in {argv[0]}", file=sys.stderr)
        return 1
    json.dump(state, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
