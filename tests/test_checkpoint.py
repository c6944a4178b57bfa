"""Tests of the on-disk checkpoint format (checkpoint/): round trips, re-sharding onto a
different number of PS, corruption fallback, retention, the inspect CLI, incremental size."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoint import (CheckpointError, CheckpointWriter, NoValidCheckpoint, apply_retention,
                        list_chains, load_manifest, next_id, restore, verify)
from checkpoint.format import MANIFEST_NAME, header_size
from deeprec_ext.hashing import slot_of
from deeprec_ext.store import EmbeddingStore

ROOT = Path(__file__).resolve().parent.parent
NUM_SLOTS = 4096
I64 = np.iinfo(np.int64)


# --------------------------------------------------------------------------- helpers
def rand_keys(rng, n):
    return rng.integers(I64.min, I64.max, size=n, dtype=np.int64, endpoint=True)


def make_store(rng, n=6000):
    s = EmbeddingStore()
    a = s.create_table("emb", 8, initializer={"name": "normal", "stddev": 0.05},
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
    b = s.create_table("user/emb:0", 4, initializer="zeros",
                       optimizer={"name": "adam", "learning_rate": 0.01})
    d = s.create_table("dense/w", 3, optimizer="sgd")
    ka, kb = rand_keys(rng, n), rand_keys(rng, n // 2)
    a.apply_gradients(ka, rng.normal(0, 0.1, (n, 8)).astype(np.float32))
    b.apply_gradients(kb, rng.normal(0, 0.1, (kb.size, 4)).astype(np.float32))
    d.insert(np.arange(5), rng.normal(size=(5, 3)).astype(np.float32))
    return s


def mutate(s, rng, frac=0.1, new=300, delete=50):
    """Update a fraction of rows, insert new keys, delete some, delete+re-insert one."""
    for t in s.tables().values():
        keys, _, _ = t.export_rows()
        if keys.size == 0:
            continue
        upd = keys[rng.choice(keys.size, max(1, int(frac * keys.size)), replace=False)]
        upd = np.concatenate([upd, rand_keys(rng, new)])
        t.apply_gradients(upd, rng.normal(0, 0.1, (upd.size, t.dim)).astype(np.float32))
        keys, _, _ = t.export_rows()
        gone = keys[rng.choice(keys.size, min(delete, keys.size - 1), replace=False)]
        t.delete(gone)
        t.delete(keys[-1:])
        t.insert(keys[-1:], np.full((1, t.dim), 7.0, np.float32))  # deleted, then back


def snap(store, mask=None):
    """{table: (sorted keys, rows as uint32 bits)}, optionally only keys in ``mask``."""
    out = {}
    for name, t in store.tables().items():
        k, r, _ = t.export_rows()
        if mask is not None:
            sel = mask[slot_of(k, NUM_SLOTS)]
            k, r = k[sel], r[sel]
        o = np.argsort(k)
        out[name] = (k[o], r[o].view(np.uint32))
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=f"keys of {name}")
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=f"rows of {name}")


def write(root, ckpt_id, store, kind="full", parent=None, cuts=None, writer="ps-0",
          extra=None, slot_mask=None):
    """Write every table of ``store``; returns {table: cut_seq} for the next incremental."""
    w = CheckpointWriter(root, ckpt_id, kind, parent=parent, num_slots=NUM_SLOTS)
    out = {}
    for name, t in store.tables().items():
        st = w.write_table(writer, t, since_seq=None if kind == "full" else cuts[name],
                           slot_mask=slot_mask)
        out[name] = st["cut_seq"]
    w.add_extra(extra or {"ckpt": ckpt_id})
    w.commit()
    return out


def restored(root, **kw):
    s = EmbeddingStore()
    info = restore(root, s, **kw)
    return s, info


def data_file(root, ckpt_dir, table="emb"):
    m = load_manifest(Path(root) / ckpt_dir)
    e = next(e for e in m["files"] if e.get("table") == table)
    return Path(root) / ckpt_dir / e["path"], e


# --------------------------------------------------------------------------- round trip
def test_full_and_incrementals_round_trip_bit_exact(tmp_path):
    rng = np.random.default_rng(1)
    s = make_store(rng)
    cuts = write(tmp_path, 1, s)
    deleted_all = []
    for ckpt in (2, 3):
        before = {n: set(t.export_rows()[0].tolist()) for n, t in s.tables().items()}
        mutate(s, rng)
        after = {n: set(t.export_rows()[0].tolist()) for n, t in s.tables().items()}
        deleted_all += [(n, k) for n in before for k in before[n] - after[n]]
        cuts = write(tmp_path, ckpt, s, "incr", parent=ckpt - 1, cuts=cuts)
    assert deleted_all
    s2, info = restored(tmp_path)
    assert info.checkpoint_id == 3 and info.chain == [1, 2, 3]
    assert info.extra == {"ckpt": 3}
    assert_same(snap(s), snap(s2))
    for name, t in s.tables().items():
        assert s2[name].config == t.config
    for name, k in deleted_all:
        assert k not in set(s2[name].export_rows()[0].tolist())
    # values the restored table serves are the original ones, including optimizer state
    k = s["emb"].export_rows()[0][:100]
    np.testing.assert_array_equal(s2["emb"].lookup(k, insert_missing=False),
                                  s["emb"].lookup(k, insert_missing=False))
    # incrementals hold only the changes
    m2 = load_manifest(tmp_path / "ckpt-00000002-incr")
    assert m2["tables"]["emb"]["rows"] < 0.25 * 6000
    assert m2["tables"]["emb"]["tombstones"] > 0
    assert info.sequence == s2.sequence.value


def test_incremental_chain_with_dropped_table_dense_arrays_and_callback(tmp_path):
    rng = np.random.default_rng(2)
    s = make_store(rng, 500)
    w = CheckpointWriter(tmp_path, 1, "full")
    cuts = {n: w.write_table("ps-0", t)["cut_seq"] for n, t in s.tables().items()}
    w.write_dense({"bn/mean": np.arange(6, dtype=np.float64).reshape(2, 3),
                   "step": np.array(41, dtype=np.int64)})
    w.commit()
    with CheckpointWriter(tmp_path, 2, "incr", parent=1) as w:  # commits on exit
        w.write_table("ps-0", s["emb"], since_seq=cuts["emb"])  # others unchanged
        w.drop_table("user/emb:0")
        w.write_dense({"step": np.array(42, dtype=np.int64)})
    seen = []
    info = restore(tmp_path, lambda op, table, keys, rows, cfg: seen.append((op, table)))
    assert ("drop", "user/emb:0") in seen
    assert {t for op, t in seen if op == "rows"} == {"emb", "dense/w"}
    s2, info = restored(tmp_path)
    assert sorted(s2.tables()) == ["dense/w", "emb"]
    assert_same({k: v for k, v in snap(s).items() if k != "user/emb:0"}, snap(s2))
    assert info.dense["step"] == 42 and info.dense["step"].dtype == np.int64
    np.testing.assert_array_equal(info.dense["bn/mean"], np.arange(6.0).reshape(2, 3))

    # dropped and re-created with another config between two checkpoints
    s.drop_table("emb")
    e2 = s.create_table("emb", 2)
    e2.insert(np.array([5, 6]), np.ones((2, 2), np.float32))
    with CheckpointWriter(tmp_path, 3, "incr", parent=2) as w:
        w.drop_table("emb")
        w.write_table("ps-0", e2, since_seq=cuts["emb"])
    s2, info = restored(tmp_path)
    assert info.chain == [1, 2, 3] and s2["emb"].dim == 2
    assert_same({k: v for k, v in snap(s).items() if k != "user/emb:0"}, snap(s2))


def test_checkpoints_taken_during_training_catch_every_write(tmp_path):
    """Writes (updates, inserts, deletes) racing with the export: the next incremental
    after training stops brings the restore to the exact final state."""
    import threading
    rng = np.random.default_rng(10)
    s = make_store(rng, 20000)
    stop, running = threading.Event(), threading.Event()
    steps = [0]

    def train():
        r = np.random.default_rng(11)
        t = s["emb"]
        while not stop.is_set():
            steps[0] += 1
            running.set()
            k = np.concatenate([t.export_rows()[0][:64] if r.random() < 0.5 else
                                rand_keys(r, 64), r.integers(0, 500, 64)])
            t.apply_gradients(k, r.normal(0, 0.1, (k.size, 8)).astype(np.float32))
            t.delete(r.integers(0, 500, 8))

    th = threading.Thread(target=train)
    th.start()
    try:
        assert running.wait(10)
        cuts = write(tmp_path, 1, s)
        cuts = write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    finally:
        stop.set()
        th.join()
    assert steps[0] > 1
    write(tmp_path, 3, s, "incr", parent=2, cuts=cuts)
    s2, info = restored(tmp_path)
    assert info.chain == [1, 2, 3]
    assert_same(snap(s), snap(s2))


def test_restore_onto_different_number_of_ps(tmp_path, monkeypatch):
    """Written by 2 PS (each its own slots), restored onto 3 PS: every row exactly once."""
    monkeypatch.setattr("checkpoint.writer.ROWS_PER_CHUNK", 2048)  # several chunks per file
    rng = np.random.default_rng(3)
    src = make_store(rng, 20000)
    slots = np.arange(NUM_SLOTS)
    owner2 = slots * 2 // NUM_SLOTS
    ps = []
    for i in range(2):  # split the source into two PS by the 2-PS routing
        p = EmbeddingStore()
        mask = owner2 == i
        for name, t in src.tables().items():
            k, r, _ = t.export_rows()
            sel = mask[slot_of(k, NUM_SLOTS)]
            p.create_table(name, t.dim, t.config["initializer"],
                           t.config["optimizer"]).import_rows(k[sel], r[sel])
        ps.append((p, mask))
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    for i, (p, mask) in enumerate(ps):
        for t in p.tables().values():
            w.write_table(f"ps-{i}", t, slot_mask=mask)
    total = w.commit()["totals"]["bytes"]

    owner3 = slots * 3 // NUM_SLOTS
    want = snap(src)
    seen = {name: [] for name in want}
    for i in range(3):
        mask = owner3 == i
        s3, info = restored(tmp_path, slot_mask=mask)
        assert info.bytes_read < 0.5 * total  # only the chunks of its slots are read
        got = snap(s3)
        assert_same(snap(src, mask), got)
        for name, (k, _) in got.items():
            assert mask[slot_of(k, NUM_SLOTS)].all()
            seen[name].append(k)
    for name, (k, _) in want.items():
        allk = np.sort(np.concatenate(seen[name]))
        np.testing.assert_array_equal(allk, k)  # union == original, no duplicates


# --------------------------------------------------------------------------- corruption
@pytest.fixture
def two_chains(tmp_path):
    """Chain A: full 1, incr 2. Chain B: full 3, incr 4. Returns root and the snapshot
    each checkpoint represents."""
    rng = np.random.default_rng(4)
    s = make_store(rng, 3000)
    snaps = {}
    cuts = write(tmp_path, 1, s)
    snaps[1] = snap(s)
    mutate(s, rng)
    cuts = write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    snaps[2] = snap(s)
    mutate(s, rng)
    cuts = write(tmp_path, 3, s)
    snaps[3] = snap(s)
    mutate(s, rng)
    write(tmp_path, 4, s, "incr", parent=3, cuts=cuts)
    snaps[4] = snap(s)
    return tmp_path, snaps


def _flip_payload_byte(path, entry, table):
    ch = entry["chunks"][len(entry["chunks"]) // 2]
    off = ch[0] + header_size(table.encode()) + ch[6] // 2
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


def corrupt(root, ckpt_dir, how):
    d = Path(root) / ckpt_dir
    if how == "truncate":
        path, e = data_file(root, ckpt_dir)
        with open(path, "r+b") as f:
            f.truncate(e["size"] - 1000)
        return path.name
    if how == "bitflip":
        path, e = data_file(root, ckpt_dir)
        _flip_payload_byte(path, e, "emb")
        return path.name
    if how == "missing_manifest":
        (d / MANIFEST_NAME).unlink()
        return MANIFEST_NAME
    if how == "corrupt_manifest_json":
        blob = (d / MANIFEST_NAME).read_bytes()
        (d / MANIFEST_NAME).write_bytes(blob[:len(blob) // 2])
        return MANIFEST_NAME
    if how == "manifest_value_changed":  # valid JSON, wrong content
        m = json.loads((d / MANIFEST_NAME).read_text())
        m["tables"]["emb"]["optimizer"]["learning_rate"] = 0.5
        (d / MANIFEST_NAME).write_text(json.dumps(m))
        return MANIFEST_NAME
    raise AssertionError(how)


KINDS = ["truncate", "bitflip", "missing_manifest", "corrupt_manifest_json",
         "manifest_value_changed"]


@pytest.mark.parametrize("how", KINDS)
def test_corrupt_incremental_falls_back_within_chain(two_chains, how, caplog):
    root, snaps = two_chains
    what = corrupt(root, "ckpt-00000004-incr", how)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        s2, info = restored(root)
    assert info.checkpoint_id == 3 and info.chain == [3]
    assert_same(snaps[3], snap(s2))  # the older values, never the corrupt ones
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ckpt-00000004-incr" in m and what in m for m in msgs), msgs


@pytest.mark.parametrize("how", KINDS)
def test_corrupt_full_falls_back_to_previous_chain(two_chains, how, caplog):
    root, snaps = two_chains
    what = corrupt(root, "ckpt-00000003-full", how)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        s2, info = restored(root)
        chains = list_chains(root)
    assert info.chain == [1, 2]
    assert_same(snaps[2], snap(s2))
    assert [c.ids for c in chains] == [[1, 2]]
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ckpt-00000003-full" in m and what in m for m in msgs), msgs
    assert any("ckpt-00000004-incr" in m for m in msgs), msgs  # orphaned by its parent


def _flip_last_chunk(root, ckpt_dir, table="emb"):
    path, e = data_file(root, ckpt_dir, table)
    _flip_payload_byte(path, {"chunks": e["chunks"][-1:]}, table)


def test_restore_into_new_tables_checks_as_it_applies_and_takes_back_a_bad_one(two_chains,
                                                                               monkeypatch):
    """Into new or empty tables a restore reads each chunk once, checking it as it is
    applied. A bad LAST chunk (every other row applied by then) drops what was applied,
    empties a table that existed empty, leaves a table outside the chain alone, and the
    older chain comes out exactly: every row of it, none of the bad checkpoint's."""
    root, snaps = two_chains
    _flip_last_chunk(root, "ckpt-00000003-full")
    s = EmbeddingStore()
    s.create_table("emb", 8, initializer={"name": "normal", "stddev": 0.05},
                   optimizer={"name": "adagrad", "learning_rate": 0.05})  # empty
    other = s.create_table("other", 2)
    other.insert(np.arange(10), np.ones((10, 2), np.float32))
    import checkpoint.reader as reader
    undone, undo = [], reader._undo
    monkeypatch.setattr(reader, "_undo", lambda store, fresh: (undone.append(dict(fresh)),
                                                               undo(store, fresh)))
    info = restore(root, s)
    assert info.chain == [1, 2] and any("ckpt-00000003-full" in p for p in info.skipped)
    assert undone == [{"emb": True, "user/emb:0": False, "dense/w": False}]  # applied, then
    got = snap(s)
    assert got.pop("other")[0].tolist() == list(range(10))
    assert_same(snaps[2], got)
    assert sum(len(t) for n, t in s.tables().items() if n != "other") == \
        sum(k.size for k, _ in snaps[2].values())


def test_restore_into_a_table_with_rows_checks_everything_first(two_chains, monkeypatch):
    """A target table with rows cannot be taken back: every chunk is checked before
    anything is applied, so the bad checkpoint leaves no trace and the rows the table had
    survive next to the older chain's."""
    root, snaps = two_chains
    _flip_last_chunk(root, "ckpt-00000003-full")
    s = EmbeddingStore()
    t = s.create_table("emb", 8, initializer={"name": "normal", "stddev": 0.05},
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
    mine = np.array([11, 12], np.int64)
    t.insert(mine, np.full((2, 8), 3.0, np.float32))
    import checkpoint.reader as reader
    applied = []
    monkeypatch.setattr(reader, "_undo", lambda *a: applied.append(a))
    info = restore(root, s)
    assert info.chain == [1, 2] and not applied  # nothing to take back
    keys, _, _ = s.get("emb").export_rows()
    want = snaps[2]["emb"][0]
    assert sorted(keys.tolist()) == sorted(set(want.tolist()) | {11, 12})
    np.testing.assert_array_equal(s.get("emb").lookup(mine, insert_missing=False), 3.0)


def test_list_chains_and_restore_variants(two_chains, caplog):
    root, snaps = two_chains
    assert [c.ids for c in list_chains(root)] == [[3, 4], [1, 2]]
    rep = verify(root)
    assert rep["ok"] and rep["newest"] == 4 and len(rep["checkpoints"]) == 4
    s2, info = restored(root, upto=2)
    assert info.chain == [1, 2]
    assert_same(snaps[2], snap(s2))
    s2, info = restored(root, upto=3, exact=True, verify="full")
    assert_same(snaps[3], snap(s2))
    corrupt(root, "ckpt-00000004-incr", "bitflip")
    with pytest.raises(NoValidCheckpoint):
        restore(root, EmbeddingStore(), upto=4, exact=True)
    # a bit flip found only by a full read (not by manifest-level checks)
    assert [c.ids for c in list_chains(root, verify="manifest")] == [[3, 4], [1, 2]]
    assert [c.ids for c in list_chains(root)] == [[3], [1, 2]]


def test_restore_skips_unneeded_corrupt_chunks_but_never_loads_them(two_chains):
    root, snaps = two_chains
    path, e = data_file(root, "ckpt-00000003-full")
    ch = e["chunks"][-1]  # rows of the highest slots
    _flip_payload_byte(path, {"chunks": [ch]}, "emb")
    low = np.arange(NUM_SLOTS) < ch[3]  # slots below the corrupt chunk's range
    s2, info = restored(root, slot_mask=low)
    assert info.checkpoint_id == 4  # its chunks are all fine
    assert_same(snap(s2), {k: v for k, v in
                           {n: (kk[low[slot_of(kk, NUM_SLOTS)]], rr[low[slot_of(kk, NUM_SLOTS)]])
                            for n, (kk, rr) in snaps[4].items()}.items()})
    s3, info = restored(root)  # needs the corrupt chunk -> older chain
    assert info.chain == [1, 2]
    assert_same(snaps[2], snap(s3))


def test_nothing_restorable(tmp_path):
    with pytest.raises(NoValidCheckpoint):
        restore(tmp_path, EmbeddingStore())
    rng = np.random.default_rng(5)
    write(tmp_path, 1, make_store(rng, 100))
    corrupt(tmp_path, "ckpt-00000001-full", "bitflip")
    with pytest.raises(NoValidCheckpoint, match="crc32"):
        restore(tmp_path, EmbeddingStore())


# --------------------------------------------------------------------------- writer checks
def test_writer_rejects_misuse(tmp_path):
    rng = np.random.default_rng(6)
    s = make_store(rng, 100)
    cuts = write(tmp_path, 1, s)
    with pytest.raises(FileExistsError):
        CheckpointWriter(tmp_path, 1, "full")
    with pytest.raises(FileExistsError):
        CheckpointWriter(tmp_path, 1, "incr", parent=0)
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1)
    with pytest.raises(ValueError, match="since_seq"):
        w.write_table("ps-0", s["emb"])
    with pytest.raises(ValueError, match="since_seq"):
        w.write_table("ps-0", s["emb"], since_seq=s.sequence.value + 5)
    other = EmbeddingStore().create_table("emb", 4)
    with pytest.raises(ValueError, match="config"):
        w.write_table("ps-0", other, since_seq=0)
    w.write_table("ps-0", s["emb"], since_seq=cuts["emb"])
    with pytest.raises(ValueError, match="already wrote"):
        w.write_table("ps-0", s["emb"], since_seq=cuts["emb"])
    w.commit()
    with pytest.raises(RuntimeError):
        w.commit()
    with pytest.raises(ValueError):
        CheckpointWriter(tmp_path, 3, "incr")
    with pytest.raises(CheckpointError):
        CheckpointWriter(tmp_path, 9, "incr", parent=7)
    with pytest.raises(ValueError):
        CheckpointWriter(tmp_path, 3, "incr", parent=2, num_slots=1024)
    assert next_id(tmp_path) == 3
    # an aborted writer leaves nothing behind
    with pytest.raises(ZeroDivisionError):
        with CheckpointWriter(tmp_path, 3, "full") as w:
            w.write_table("ps-0", s["emb"])
            1 / 0
    assert not (tmp_path / "ckpt-00000003-full").exists()


# --------------------------------------------------------------------------- retention
def test_retention_keeps_newest_chains(tmp_path):
    rng = np.random.default_rng(7)
    s = make_store(rng, 200)
    for full in (1, 3, 5, 7):
        cuts = write(tmp_path, full, s)
        mutate(s, rng)
        write(tmp_path, full + 1, s, "incr", parent=full, cuts=cuts)
    (tmp_path / "ckpt-00000009-full").mkdir()  # being written: no manifest yet
    corrupt(tmp_path, "ckpt-00000007-full", "bitflip")  # newest chain is bad
    # a bit flip in the chain's older checkpoint: found by reading every byte
    deleted = apply_retention(tmp_path, keep_chains=2, verify="full")
    assert deleted == ["ckpt-00000001-full", "ckpt-00000002-incr"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ckpt-00000003-full", "ckpt-00000004-incr", "ckpt-00000005-full",
                    "ckpt-00000006-incr", "ckpt-00000007-full", "ckpt-00000008-incr",
                    "ckpt-00000009-full"]
    assert [c.ids for c in list_chains(tmp_path)] == [[5, 6], [3, 4]]
    assert apply_retention(tmp_path, keep_chains=1) == ["ckpt-00000003-full",
                                                        "ckpt-00000004-incr"]
    _, info = restored(tmp_path)
    assert info.chain == [5, 6]
    with pytest.raises(ValueError):
        apply_retention(tmp_path, keep_chains=0)


def test_retention_without_valid_chain_deletes_nothing(tmp_path):
    rng = np.random.default_rng(8)
    write(tmp_path, 1, make_store(rng, 100))
    corrupt(tmp_path, "ckpt-00000001-full", "truncate")
    assert apply_retention(tmp_path, keep_chains=1) == []
    assert (tmp_path / "ckpt-00000001-full").exists()


# --------------------------------------------------------------------------- CLI
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "checkpoint", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def cli(capsys, *args):
    """``python -m checkpoint`` in-process (subprocesses only where the entry point matters)."""
    from checkpoint.__main__ import main
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_inspect(two_chains, tmp_path_factory, capsys):
    root, _ = two_chains
    r = run_cli("inspect", root)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in ("00000001", "00000002", "00000003", "00000004"):
        assert i in r.stdout
    assert "00000003 -> 00000004" in r.stdout and "00000001 -> 00000002" in r.stdout
    assert "INVALID" not in r.stdout

    rc, out, _ = cli(capsys, "inspect", root, "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["ok"] and rep["chains"] == [[3, 4], [1, 2]] and rep["newest"] == 4
    c4 = next(c for c in rep["checkpoints"] if c["id"] == 4)
    assert c4["kind"] == "incr" and c4["parent"] == 3 and c4["bytes"] > 0 and c4["rows"] > 0
    assert sorted(c4["tables"]) == ["dense/w", "emb", "user/emb:0"]

    path, e = data_file(root, "ckpt-00000002-incr")
    _flip_payload_byte(path, e, "emb")
    r = run_cli("inspect", root)
    assert r.returncode == 1
    assert "INVALID" in r.stdout and path.name in r.stdout and "crc32" in r.stdout
    rc, out, _ = cli(capsys, "inspect", root, "--json")
    rep = json.loads(out)
    assert rc == 1 and not rep["ok"] and rep["chains"] == [[3, 4], [1]]

    rc, _, err = cli(capsys, "inspect", root / "nope")
    assert rc == 2 and "does not exist" in err
    rc, _, err = cli(capsys, "inspect")
    assert rc == 2 and "usage" in err.lower()
    rc, out, _ = cli(capsys, "inspect", tmp_path_factory.mktemp("empty"))
    assert rc == 0 and "no checkpoints" in out
    r = run_cli("inspect", root / "nope")
    assert r.returncode == 2 and "does not exist" in r.stderr


# --------------------------------------------------------------------------- cost
def test_incremental_is_proportional_to_changed_rows(tmp_path):
    rng = np.random.default_rng(9)
    s = EmbeddingStore()
    t = s.create_table("emb", 16, initializer={"name": "normal", "stddev": 0.05},
                       optimizer={"name": "adagrad", "learning_rate": 0.05})
    keys = rand_keys(rng, 200_000)
    t.apply_gradients(keys, rng.normal(0, 0.1, (keys.size, 16)).astype(np.float32))
    cuts = write(tmp_path, 1, s)
    touched = keys[rng.choice(keys.size, keys.size // 20, replace=False)]
    t.apply_gradients(touched, rng.normal(0, 0.1, (touched.size, 16)).astype(np.float32))
    write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    full = load_manifest(tmp_path / "ckpt-00000001-full")["totals"]
    incr = load_manifest(tmp_path / "ckpt-00000002-incr")["totals"]
    assert incr["rows"] == touched.size
    assert incr["bytes"] < 0.15 * full["bytes"], (incr, full)
    # time: best of 3 (the machine may be shared), loose bound
    t_full, t_incr = [], []
    for i in range(3):
        w = CheckpointWriter(tmp_path, 10 + i, "full")
        t_full.append(w.write_table("ps-0", t)["seconds"])
        w.abort()
        w = CheckpointWriter(tmp_path, 20 + i, "incr", parent=1)
        t_incr.append(w.write_table("ps-0", t, since_seq=cuts["emb"])["seconds"])
        w.abort()
    assert min(t_incr) < 0.5 * min(t_full), (t_incr, t_full)


def test_checkpoint_layering():
    """checkpoint/ imports only numpy, zstandard, google_crc32c (format 4's checksum),
    stdlib, deeprec_ext.hashing/.store, and deeprec_ext.data (its file-system layer, for
    roots on object stores; fsspec is loaded only when a URL is used)."""
    import ast
    allowed = {"numpy", "zstandard", "google_crc32c", "checkpoint", "deeprec_ext"}
    for f in (ROOT / "checkpoint").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                    else [])
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names:
                    continue
                assert top in allowed, f"{f.name} imports {mod}"
                if top == "deeprec_ext":
                    assert mod.split(".")[1] in ("hashing", "store", "data"), \
                        f"{f.name} imports {mod}"


# --------------------------------------------------------------------------- warm start, load
def test_restore_onto_another_num_slots_table_subset_and_optimizer_reset(tmp_path):
    """A warm start onto a job with a different num_slots: masks over the new slot space
    partition the rows exactly; a table subset and an optimizer reset are honoured."""
    rng = np.random.default_rng(11)
    src = make_store(rng, 5000)
    cuts = write(tmp_path, 1, src)
    mutate(src, rng)
    write(tmp_path, 2, src, "incr", parent=1, cuts=cuts)
    want = snap(src)
    new_slots = 1000
    owner = np.arange(new_slots) * 3 // new_slots
    seen = {name: [] for name in want}
    for i in range(3):
        mask = owner == i
        s3, _ = restored(tmp_path, slot_mask=mask)
        for name, (k, r) in snap(s3).items():
            assert mask[slot_of(k, new_slots)].all()
            sel = np.isin(want[name][0], k)
            np.testing.assert_array_equal(want[name][0][sel], k)
            np.testing.assert_array_equal(want[name][1][sel], r)
            seen[name].append(k)
    for name, parts in seen.items():
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), want[name][0])
    s, info = restored(tmp_path, tables=["emb"], reset_optimizer=True)
    assert sorted(s.tables()) == ["emb"]
    k, r, _ = s["emb"].export_rows()
    o = np.argsort(k)
    np.testing.assert_array_equal(r[o][:, :8].view(np.uint32), want["emb"][1][:, :8])
    assert (r[:, 8:] == s["emb"]._slot_init[None, :]).all()  # adagrad accumulators reset


def test_load_returns_named_arrays(tmp_path):
    import checkpoint
    rng = np.random.default_rng(12)
    src = make_store(rng, 3000)
    cuts = write(tmp_path, 1, src, extra={"global_step": 42,
                                          "model": {"dense_shapes": {"w": [5, 3]}}})
    mutate(src, rng)
    d = src["dense/w"]  # a dense variable keeps its rows 0..4
    d.delete(d.export_rows()[0][d.export_rows()[0] >= 5])
    d.delete(d.export_rows()[0][d.export_rows()[0] < 0])
    d.insert(np.arange(5), rng.normal(size=(5, 3)).astype(np.float32))
    write(tmp_path, 2, src, "incr", parent=1, cuts=cuts, extra={"global_step": 77})
    got = checkpoint.load(tmp_path)
    assert got.checkpoint_id == 2 and got.chain == [1, 2] and got.global_step == 77
    want = snap(src)
    t = got.tables["emb"]
    np.testing.assert_array_equal(t.ids, want["emb"][0])
    np.testing.assert_array_equal(np.hstack([t.values, t.slots]).view(np.uint32), want["emb"][1])
    assert t.config["optimizer"]["name"] == "adagrad" and t.dim == 8
    assert sorted(got.tables) == ["emb", "user/emb:0"]
    assert got.dense["w"].shape == (5, 3)  # no recorded shape at checkpoint 2: [rows, dim]
    # one checkpoint directory: exactly that checkpoint (and its shape record)
    first = checkpoint.load(tmp_path / "ckpt-00000001-full", tables=["emb"])
    assert first.checkpoint_id == 1 and sorted(first.tables) == ["emb"]
    assert first.global_step == 42 and first.dense["w"].shape == (5, 3)
    with pytest.raises(CheckpointError, match=r"no table\(s\) \['nope'\]"):
        checkpoint.load(tmp_path, tables=["nope"])
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        checkpoint.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        checkpoint.load(tmp_path / "empty")
    # a corrupt file of the named checkpoint is an error naming it, never wrong values
    path, e = data_file(tmp_path, "ckpt-00000002-incr")
    blob = bytearray(path.read_bytes())
    blob[e["chunks"][0][0] + 200] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises((CheckpointError, NoValidCheckpoint), match="ckpt-00000002-incr"):
        checkpoint.load(tmp_path / "ckpt-00000002-incr")


def test_update_counts_survive_a_chain_and_old_checkpoints_still_load(tmp_path):
    """Format 2 stores each row's update count; a format-1 checkpoint (no counts) loads
    with zero counts."""
    import checkpoint
    s = EmbeddingStore()
    t = s.create_table("emb", 4, optimizer="sgd")
    keys = np.arange(100, dtype=np.int64)
    t.lookup(keys)  # every key exists, not yet updated: count 0
    for k in range(1, 4):  # key i is pushed i % 4 times
        sel = keys[keys % 4 >= k]
        t.apply_gradients(sel, np.ones((sel.size, 4), np.float32))
    np.testing.assert_array_equal(t.counts(keys), np.minimum(keys % 4, 3))
    cuts = write(tmp_path, 1, s)
    t.apply_gradients(keys[:10], np.ones((10, 4), np.float32))   # +1 for keys 0..9
    write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    got = checkpoint.load(tmp_path).tables["emb"]
    want = np.minimum(keys % 4, 3) + (keys < 10)
    np.testing.assert_array_equal(got.counts, want)
    s2, _ = restored(tmp_path)
    np.testing.assert_array_equal(s2["emb"].counts(keys), want)
    # a format-1 checkpoint: same layout without the count column
    from checkpoint import format as fmt
    old = tmp_path / "old"
    monkey = (fmt.FORMAT_VERSION, )
    import checkpoint.writer as w
    orig_info, orig_export = w._table_info, EmbeddingStore
    try:
        w.FORMAT_VERSION = 1
        fmt.FORMAT_VERSION = 1
        w._table_info = lambda table: {k: v for k, v in orig_info(table).items() if k != "counts"}
        t.export_slots = (lambda f: lambda *a, with_counts=False, **k: f(*a, **k))(t.export_slots)
        wr = CheckpointWriter(old, 1, "full", num_slots=NUM_SLOTS)
        for name, tb in s.tables().items():
            wr.write_table("ps-0", tb)
        wr.commit()
    finally:
        w.FORMAT_VERSION, fmt.FORMAT_VERSION = monkey[0], monkey[0]
        w._table_info = orig_info
        del t.export_slots
    assert load_manifest(old / "ckpt-00000001-full")["version"] == 1
    got = checkpoint.load(old).tables["emb"]
    assert (got.counts == 0).all() and got.values.shape == (100, 4)


# --------------------------------------------------------------------------- streaming
_MEASURE = r'''
import gc, json, os, sys, tempfile, threading, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from checkpoint import CheckpointWriter, restore
from deeprec_ext.store import EmbeddingStore
rows = int(sys.argv[2])

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

s = EmbeddingStore()
t = s.create_table("emb", 16, initializer={"name": "normal", "stddev": 0.05},
                   optimizer={"name": "adagrad", "learning_rate": 0.05})
keys = np.arange(rows, dtype=np.int64) * 7919 + 13
for i in range(0, rows, 1 << 20):
    t.lookup(keys[i:i + (1 << 20)])
hot = keys[::997]
t.apply_gradients(hot, np.ones((hot.size, 16), np.float32))
gc.collect()
base = rss()
peak, lat, stop = [base], [], threading.Event()
rng = np.random.default_rng(0)

def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

def lookups():
    while not stop.is_set():
        q = keys[rng.integers(0, rows, 1000)]
        t0 = time.perf_counter()
        t.lookup(q, insert_missing=False)
        lat.append(time.perf_counter() - t0)
        time.sleep(0.001)

threads = [threading.Thread(target=sample), threading.Thread(target=lookups)]
for th in threads:
    th.start()
time.sleep(0.2)
lat.clear()
root = tempfile.mkdtemp()
w = CheckpointWriter(root, 1, "full", num_slots=4096)
t0 = time.perf_counter()
st = w.write_table("ps-0", t)
write_s = time.perf_counter() - t0
served = list(lat)
stop.set()
for th in threads:
    th.join()
w.commit()
s2 = EmbeddingStore()
restore(root, s2, verify="full")
probe = keys[::101]
same = bool((s2["emb"].lookup(probe, False) == t.lookup(probe, False)).all()) and \
    s2["emb"].size == rows and bool((s2["emb"].counts(hot) == 1).all())
print(json.dumps({"table": t.nbytes, "extra": peak[0] - base, "write_s": write_s,
                  "rows": st["rows"], "lat": served, "same": same}))
'''


def test_full_checkpoint_streams_in_bounded_memory_while_lookups_go_on(tmp_path):
    """A full checkpoint of a 2M-row Adagrad table (dim 16) holds no copy of the table: RSS
    grows by less than 15% of the table while it writes, lookups go on all along (none
    waits anywhere near the time the write takes), and it restores bit-exactly."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(ROOT), "2000000"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    lat = np.array(r["lat"]) * 1000
    print(f"table {r['table'] / 2**20:.0f} MB, peak extra {r['extra'] / 2**20:.1f} MB "
          f"({100 * r['extra'] / r['table']:.1f}%), write {r['write_s']:.2f} s, "
          f"{lat.size} lookups: p50 {np.median(lat):.2f} ms, max {lat.max():.1f} ms")
    assert r["rows"] == 2_000_000 and r["same"]
    # The writer's own peak is ~20 B per row (plan codes, keys, one chunk: 39 MB here by
    # tracemalloc); it was under 10% of the table until the hash index shrank from 17 to
    # 4 bytes per position (table 380 -> 312 MB). A copy of the table would be > 100%.
    assert r["extra"] < 0.15 * r["table"], r["extra"] / r["table"]
    assert lat.size >= 20  # lookups were served while it wrote
    assert lat.max() < max(0.25 * r["write_s"] * 1000, 50), (lat.max(), r["write_s"])


def test_rows_changed_or_deleted_during_a_streaming_checkpoint(tmp_path):
    """Writes during a checkpoint: rows written before the cut are in it; rows deleted, or
    re-created under other keys, after the plan are not written as stale rows; the next
    incremental brings the table to its state at its own cut."""
    rng = np.random.default_rng(5)
    s = EmbeddingStore()
    t = s.create_table("emb", 4, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 100_000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 4)).astype(np.float32))
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    real = t.scan_by_slot  # the full's scan (format 4; scan_live before)
    calls = [0]

    def busy_scan(*a, **k):  # meanwhile, the PS serves writes between the slices
        calls[0] += 1
        if calls[0] == 2:
            t.delete(keys[:5000])
            t.lookup(rand_keys(rng, 5000))  # reuses the freed rows
            t.apply_gradients(keys[5000:10000], np.ones((5000, 4), np.float32))
        return real(*a, **k)

    t.scan_by_slot = busy_scan
    cut = w.write_table("ps-0", t)["cut_seq"]
    del t.scan_by_slot
    assert calls[0] > 2
    w.commit()
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1, num_slots=NUM_SLOTS)
    w.write_table("ps-0", t, since_seq=cut)
    w.commit()
    s2, _ = restored(tmp_path)
    assert_same(snap(s2), snap(s))


# --------------------------------------------------------------------------- format 3
def _chunk_flags(path, entry, name="emb"):
    from checkpoint.format import decode_header
    blob = Path(path).read_bytes()
    return [decode_header(blob[ch[0]:], "t")["flags"] for ch in entry["chunks"]]


def test_chunks_are_stored_raw_where_zstd_does_not_pay(tmp_path):
    """compress="auto": trained float rows with random keys are stored as is (FLAG_RAW),
    constant rows with sequential keys are compressed; "always"/"never" force it. Every
    variant verifies (inspect) and restores bit-exactly."""
    from checkpoint.format import FLAG_COUNTS, FLAG_RAW
    rng = np.random.default_rng(11)
    s = EmbeddingStore()
    t = s.create_table("emb", 16, optimizer={"name": "adagrad", "learning_rate": 0.05})
    keys = rand_keys(rng, 20_000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 16)).astype(np.float32))
    z = s.create_table("zeros", 16, optimizer="sgd")
    z.lookup(np.arange(20_000, dtype=np.int64))
    for i, mode in enumerate(("auto", "always", "never")):
        root = tmp_path / mode
        w = CheckpointWriter(root, 1, "full", num_slots=NUM_SLOTS, compress=mode)
        for tb in s.tables().values():
            w.write_table("ps-0", tb)
        m = w.commit()
        assert m["version"] == 4 and all(e["sha256"] is None for e in m["files"])
        flags = {n: _chunk_flags(*data_file(root, "ckpt-00000001-full", n)) for n in s.tables()}
        # format 4: every rows chunk of a table with counts holds them as a column apart
        assert all(f & FLAG_COUNTS for fl in flags.values() for f in fl)
        if mode == "auto":
            assert all(f & FLAG_RAW for f in flags["emb"])
            assert not any(f & FLAG_RAW for f in flags["zeros"])
        else:
            want = (FLAG_RAW if mode == "never" else 0) | FLAG_COUNTS
            assert all(f == want for fl in flags.values() for f in fl)
        assert verify(root)["ok"]
        s2, _ = restored(root)
        assert_same(snap(s2), snap(s))
    # a bit flip in a stored chunk is caught by its crc32 (no zstd checksum to help)
    path, e = data_file(tmp_path / "never", "ckpt-00000001-full")
    _flip_payload_byte(path, e, "emb")
    assert not verify(tmp_path / "never")["ok"]
    with pytest.raises(NoValidCheckpoint):
        restore(tmp_path / "never", EmbeddingStore())


def test_zstd_probe_backs_off_once_a_table_agrees_and_notices_a_change():
    """The per-file zstd probe: every chunk until 4 in a row agree, then one in 8, one in
    16, ... up to one in 64 while the answer holds; a change of answer is picked up at the
    next probe and probing is dense again, then backs off again."""
    from checkpoint.writer import PROBE_EVERY, PROBE_MAX_EVERY, PROBE_STREAK, _Probe
    truth = [False] * 100 + [True] * 300
    calls = []

    def pays(i):
        calls.append(i)
        return truth[i]

    p = _Probe(pays)
    got = [p.pays(i) for i in range(len(truth))]
    assert calls[:PROBE_STREAK] == list(range(PROBE_STREAK))
    assert calls[PROBE_STREAK] == PROBE_STREAK - 1 + PROBE_EVERY  # then one in 8
    gaps = np.diff([i for i in calls if i < 100])
    assert gaps[PROBE_STREAK - 1:].tolist() == sorted(gaps[PROBE_STREAK - 1:].tolist())
    assert gaps.max() > PROBE_EVERY and gaps.max() <= PROBE_MAX_EVERY  # it backed off
    first_true = next(i for i in calls if truth[i])
    assert first_true < 100 + PROBE_MAX_EVERY  # the change is seen within one period
    k = calls.index(first_true)
    assert calls[k:k + PROBE_STREAK] == list(range(first_true, first_true + PROBE_STREAK))
    assert np.diff([i for i in calls if i >= first_true]).max() > PROBE_EVERY  # again
    assert len(calls) < 40
    assert all(got[i] for i in range(first_true, len(truth)))
    assert not any(got[:100])


@pytest.mark.parametrize("crc_on_io_bytes", [0, 1 << 40])
def test_stored_chunks_checksummed_on_the_pool_or_the_io_thread(tmp_path, monkeypatch,
                                                               crc_on_io_bytes):
    """A stored chunk's crc32c is computed on the pool (large files) or on the I/O thread
    (small ones): either way every chunk's checksum verifies, a flipped byte is caught,
    and the rows come back exactly (a full and an incremental)."""
    import checkpoint.writer as cw
    monkeypatch.setattr(cw, "CRC_ON_IO_BYTES", crc_on_io_bytes)
    rng = np.random.default_rng(48)
    s = EmbeddingStore()
    t = s.create_table("emb", 8, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 30000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 8)).astype(np.float32))
    w = CheckpointWriter(tmp_path, 1, "full", compress="never")
    cut = w.write_table("ps-0", t)["cut_seq"]
    w.commit()
    t.apply_gradients(keys[:9000], rng.normal(size=(9000, 8)).astype(np.float32))
    # two pool threads: an incremental is cut into one chunk per thread at least
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1, compress="never", threads=2)
    assert w.write_table("ps-0", t, since_seq=cut)["chunks"] > 1
    w.commit()
    assert verify(tmp_path)["ok"]
    s2, _ = restored(tmp_path)
    k0, r0, _ = t.export_rows()
    k1, r1, _ = s2["emb"].export_rows()
    o0, o1 = np.argsort(k0), np.argsort(k1)
    np.testing.assert_array_equal(k0[o0], k1[o1])
    np.testing.assert_array_equal(r0[o0], r1[o1])
    f = next((tmp_path / "ckpt-00000002-incr").glob("*.rows"))
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x40
    f.write_bytes(bytes(b))
    rep = verify(tmp_path)
    bad = [c for c in rep["checkpoints"] if not c["valid"]]
    assert not rep["ok"] and [c["id"] for c in bad] == [2]
    assert "crc" in " ".join(bad[0]["problems"]).lower()


def test_zstd_probe_starts_where_the_tables_last_file_ended(tmp_path):
    """The next file of a table starts from the answer and period its previous file ended
    with: its first chunk is probed and, if it agrees, the period goes on (no dense
    streak again); if it disagrees, probing is dense again. Chained incrementals of a
    table whose rows do not compress probe one chunk each, and still restore exactly."""
    from checkpoint.writer import PROBE_EVERY, PROBE_STREAK, _VERDICTS, _Probe
    calls = []

    def pays(i):
        calls.append(i)
        return False

    p = _Probe(pays, (False, 4 * PROBE_EVERY))
    assert not any(p.pays(i) for i in range(4 * PROBE_EVERY))
    assert calls == [0]  # then a period of 4 * PROBE_EVERY
    assert p.state() == (False, 8 * PROBE_EVERY)
    calls.clear()
    p = _Probe(lambda i: calls.append(i) or i >= 0, (False, 8 * PROBE_EVERY))
    assert [p.pays(i) for i in range(PROBE_STREAK + 1)] == [True] * (PROBE_STREAK + 1)
    assert calls == list(range(PROBE_STREAK))  # changed: dense again
    assert _Probe(pays).state() is None

    rng = np.random.default_rng(47)
    s = EmbeddingStore()
    t = s.create_table("probe_memo", 8, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 20000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 8)).astype(np.float32))
    probes = []
    real = CheckpointWriter._pays

    def counted(self, views):
        probes.append(1)
        return real(self, views)

    CheckpointWriter._pays = counted
    try:
        w = CheckpointWriter(tmp_path, 1, "full")
        cut = w.write_table("ps-0", t)["cut_seq"]
        w.commit()
        assert _VERDICTS[("probe_memo", w.level, w.version)][0] is False
        for i in range(2, 5):
            t.apply_gradients(keys[:12000], rng.normal(size=(12000, 8)).astype(np.float32))
            probes.clear()
            w = CheckpointWriter(tmp_path, i, "incr", parent=i - 1, threads=2)
            st = w.write_table("ps-0", t, since_seq=cut)
            w.commit()
            cut = st["cut_seq"]
            assert st["chunks"] > 1 and len(probes) == 1
    finally:
        CheckpointWriter._pays = real
    s2, _ = restored(tmp_path)
    k0, r0, _ = t.export_rows()
    k1, r1, _ = s2["probe_memo"].export_rows()
    o0, o1 = np.argsort(k0), np.argsort(k1)
    np.testing.assert_array_equal(k0[o0], k1[o1])
    np.testing.assert_array_equal(r0[o0], r1[o1])


@pytest.mark.parametrize("compress", ["never", "always"])
def test_preallocated_data_file_ends_at_its_end_header(tmp_path, monkeypatch, compress):
    """A full checkpoint's data file is preallocated at the table's expected size; it is
    cut to what was written, whether that is less (zstd) or more (rows added while it was
    written) than expected, and every row comes back."""
    import checkpoint.writer as cw
    monkeypatch.setattr(cw, "PREALLOCATE_MIN", 0)
    got = []

    def spy(fd, nbytes):
        got.append((nbytes, cw._preallocate.__wrapped__(fd, nbytes)))
        return got[-1][1]

    spy.__wrapped__ = cw._preallocate
    monkeypatch.setattr(cw, "_preallocate", spy)
    rng = np.random.default_rng(11)
    s = EmbeddingStore()
    t = s.create_table("emb", 8, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 40_000)
    # "always": equal rows, which zstd shrinks far below the expected size; "never":
    # trained rows, and rows added behind the scan make the file larger than expected
    grads = (np.ones((keys.size, 8), np.float32) if compress == "always"
             else rng.normal(size=(keys.size, 8)).astype(np.float32))
    t.apply_gradients(keys, grads)
    added = rand_keys(rng, 20_000 if compress == "never" else 0)
    real, calls = t.scan_by_slot, [0]

    def growing_scan(*a, **k):  # training adds rows behind the scan: more than expected
        calls[0] += 1
        if calls[0] == 2 and added.size:
            t.apply_gradients(added, rng.normal(size=(added.size, 8)).astype(np.float32))
        return real(*a, **k)

    t.scan_by_slot = growing_scan
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS, compress=compress)
    st = w.write_table("ps-0", t)
    del t.scan_by_slot
    w.commit()
    if cw._FALLOCATE is None or not got[0][1]:
        pytest.skip("this file system does not preallocate")
    path, entry = data_file(tmp_path, "ckpt-00000001-full")
    assert st["rows"] == keys.size + added.size  # the rows added behind the scan, too
    expected = got[0][0]
    assert (entry["size"] > expected) if compress == "never" else (entry["size"] < expected)
    assert path.stat().st_size == entry["size"]
    assert verify(tmp_path)["ok"]
    s2, _ = restored(tmp_path)
    assert len(s2["emb"]) == st["rows"]
    assert_same(snap(s2), snap(s))


def test_format_2_checkpoints_still_verify_and_restore(tmp_path):
    """A checkpoint in the previous layout (format 2: every chunk a zstd frame, sorted by
    slot, sha256 per file) is verified to the byte and restored by this reader, also
    with an incremental of the current format on top of it."""
    from checkpoint import format as fmt
    rng = np.random.default_rng(12)
    s = make_store(rng, 3000)
    orig = fmt.FORMAT_VERSION
    try:
        fmt.FORMAT_VERSION = 2
        cuts = write(tmp_path, 1, s)
    finally:
        fmt.FORMAT_VERSION = orig
    m = load_manifest(tmp_path / "ckpt-00000001-full")
    assert m["version"] == 2 and all(len(e["sha256"]) == 64 for e in m["files"])
    path, e = data_file(tmp_path, "ckpt-00000001-full")
    assert set(_chunk_flags(path, e)) == {0}
    assert verify(tmp_path)["ok"]
    assert cli_ok(tmp_path)
    s2, _ = restored(tmp_path)
    assert_same(snap(s2), snap(s))
    mutate(s, rng)
    write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    assert load_manifest(tmp_path / "ckpt-00000002-incr")["version"] == 4
    s3, info = restored(tmp_path)
    assert info.chain == [1, 2]
    assert_same(snap(s3), snap(s))
    # and a corrupt format-2 file is still caught, by its sha256 / crc32
    _flip_payload_byte(path, e, "emb")
    assert not verify(tmp_path)["ok"]


def cli_ok(root) -> bool:
    return run_cli("inspect", root).returncode == 0


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "pool"])
def test_retention_checks_only_the_new_checkpoint_yet_catches_it_corrupt(tmp_path, monkeypatch,
                                                                         inline):
    """apply_retention(verify="new"), after each commit: reads the chunks of the newest
    checkpoint only (an incremental's pass does not read the full under it), and a new
    checkpoint that is corrupt is not trusted: the older chain it would have replaced
    is kept. Small checkpoints are checked on the caller's thread, larger ones on a
    pool: both paths."""
    import checkpoint.reader as reader
    if not inline:
        monkeypatch.setattr(reader, "_CHECK_INLINE_BYTES", 0)
    rng = np.random.default_rng(13)
    s = make_store(rng, 3000)
    cuts = write(tmp_path, 1, s)
    mutate(s, rng)
    write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    read = []
    real = reader._check_chunk

    def spy(fd, entry, *a, **k):
        read.append(entry["path"])
        return real(fd, entry, *a, **k)

    monkeypatch.setattr(reader, "_check_chunk", spy)
    assert apply_retention(tmp_path, keep_chains=1) == []
    m2 = load_manifest(tmp_path / "ckpt-00000002-incr")
    assert read and set(read) <= {e["path"] for e in m2["files"]}
    assert len(read) == sum(len(e["chunks"]) for e in m2["files"])  # each chunk once
    # a new full whose payload rots right after the commit: not trusted, chain 1-2 kept
    write(tmp_path, 3, s)
    corrupt(tmp_path, "ckpt-00000003-full", "bitflip")
    read.clear()
    assert apply_retention(tmp_path, keep_chains=1) == []
    assert (tmp_path / "ckpt-00000001-full").exists()
    assert {p for p in read} >= {e["path"] for e in
                                 load_manifest(tmp_path / "ckpt-00000003-full")["files"]}
    # a good new full: before deleting the older chain, the kept one is read once more
    write(tmp_path, 4, s)
    assert apply_retention(tmp_path, keep_chains=1) == ["ckpt-00000001-full",
                                                        "ckpt-00000002-incr",
                                                        "ckpt-00000003-full"]
    _, info = restored(tmp_path)
    assert info.chain == [4]


def test_only_the_writer_that_creates_a_checkpoint_directory_syncs_the_root(tmp_path,
                                                                              monkeypatch):
    """The new directory's entry is made durable (fsync of the root) by the writer that
    created it, before it writes; another writer of the same checkpoint (the AIMaster,
    committing the PS's files) finds it done. The commit still syncs the directory
    before and after the manifest."""
    import checkpoint.writer as cw
    synced = []
    real = cw._fsync_dir
    monkeypatch.setattr(cw, "_fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    s = make_store(np.random.default_rng(19), 300)
    ps = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    assert synced == [tmp_path]
    ps.write_table("ps-0", s["emb"])
    files = ps.file_entries()
    synced.clear()
    master = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    assert synced == []
    master.add_file_entries(files)
    master.commit()
    assert synced == [tmp_path / "ckpt-00000001-full"] * 2
    _, info = restored(tmp_path)
    assert info.chain == [1]
    (tmp_path / "ckpt-00000002-full").write_bytes(b"")  # a file in the way: refused
    with pytest.raises(FileExistsError):
        CheckpointWriter(tmp_path, 2, "full", num_slots=NUM_SLOTS)


def test_cached_manifest_is_the_file_as_it_is_now(tmp_path):
    """load_manifest(cached=True), as retention and an incremental's writer read their
    manifests: a settled manifest parsed before is not parsed again, and one rewritten
    in place (same size) or replaced is read afresh, its corruption caught; one written
    in the last second is never kept (file times come from a coarse clock)."""
    import checkpoint.reader as reader
    rng = np.random.default_rng(17)
    s = make_store(rng, 500)
    write(tmp_path, 1, s)
    d = tmp_path / "ckpt-00000001-full"
    path = d / MANIFEST_NAME
    fresh = load_manifest(d, cached=True)
    assert load_manifest(d, cached=True) is not fresh  # just written: not kept
    old = path.stat().st_mtime - 3600
    os.utime(path, (old, old))  # settled
    m = load_manifest(d, cached=True)
    assert load_manifest(d, cached=True) is m and m == fresh
    blob = path.read_bytes()
    i = blob.index(b'"created_iso"')
    path.write_bytes(blob[:i + 20] + bytes([blob[i + 20] ^ 1]) + blob[i + 21:])
    with pytest.raises(CheckpointError, match="checksum"):
        load_manifest(d, cached=True)
    assert [c.problems for c in reader.scan(tmp_path, "manifest", _cached=True)][0]
    tmp = d / "replacement"
    tmp.write_bytes(blob)
    os.utime(tmp, (old, old))
    os.replace(tmp, path)  # same bytes and times as the kept one, another file
    m2 = load_manifest(d, cached=True)
    assert m2 is not m and m2 == m


def test_full_checkpoint_while_pushes_run_is_a_consistent_cut(tmp_path, monkeypatch):
    """Pushes go on while a full checkpoint streams the table (many short lock holds):
    every row restored is exactly the row after some number of its own pushes (value,
    accumulator and count of one moment, never a torn row), and holds every push with a
    sequence number <= the checkpoint's cut."""
    import threading

    import checkpoint.writer as cw
    monkeypatch.setattr(cw, "SCAN_SLICE_ROWS", 512)
    n, rounds, batch = 24_000, 25, 3000
    opt = {"name": "adagrad", "learning_rate": 0.1}
    keys = np.arange(n, dtype=np.int64) * 7919 + 5
    ones = np.ones((batch, 4), np.float32)
    ref = EmbeddingStore().create_table("emb", 4, {"name": "normal", "stddev": 0.1}, opt)
    ref.lookup(keys)
    states = [ref.export_keys(keys, with_counts=True)[1]]
    for _ in range(rounds):  # the state of every row after c pushes
        for i in range(0, n, batch):
            ref.apply_gradients(keys[i:i + batch], ones)
        states.append(ref.export_keys(keys, with_counts=True)[1])
    s = EmbeddingStore()
    t = s.create_table("emb", 4, {"name": "normal", "stddev": 0.1}, opt)
    t.lookup(keys)
    pushes = []  # (seq, first key index)
    started = threading.Event()

    def pusher():
        for r in range(rounds):
            for i in range(0, n, batch):
                pushes.append((t.apply_gradients(keys[i:i + batch], ones), i))
                if r == 1:
                    started.set()

    th = threading.Thread(target=pusher)
    th.start()
    started.wait(30)
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    at_start = len(pushes)
    st = w.write_table("ps-0", t)
    during = len(pushes) - at_start
    w.commit()
    th.join()
    cut = st["cut_seq"]
    s2, _ = restored(tmp_path)
    k2, r2 = s2["emb"].export_keys(keys, with_counts=True)
    assert k2.size == n
    c = r2[:, -1].astype(np.int64)
    idx = (k2 - 5) // 7919
    before = np.zeros(n, np.int64)  # pushes of each key with seq <= cut
    for seq, i in pushes:
        if seq <= cut:
            before[i:i + batch] += 1
    assert (c >= before[idx]).all() and (c <= rounds).all()
    want = np.stack([states[ci][ki] for ci, ki in zip(c, idx)])
    np.testing.assert_array_equal(r2.view(np.uint32), want.view(np.uint32))
    print(f"{during} pushes ran during the write; counts {c.min()}..{c.max()}")
    assert during > 0  # the pushes were not held up for the write


# --------------------------------------------------------------------------- format 4
def _spy_direct(monkeypatch):
    """Count the chunks read straight into a table's arrays (format 4's restore path)."""
    import checkpoint.reader as reader
    got = {"direct": 0, "raw": 0, "emb": 0}
    real = reader._read_into

    def spy(fd, e, ci, name, manifest, w, where_f, *dest):
        got["direct"] += 1
        got["emb"] += name == "emb"
        n = real(fd, e, ci, name, manifest, w, where_f, *dest)
        from checkpoint.format import FLAG_COUNTS, FLAG_RAW, decode_header
        head = decode_header(reader.os.pread(fd, 4096, e["chunks"][ci][0]), "t")
        got["raw"] += head["flags"] == FLAG_RAW | FLAG_COUNTS
        return n

    monkeypatch.setattr(reader, "_read_into", spy)
    return got


def test_format_4_reads_chunks_straight_into_the_table_and_round_trips(tmp_path, monkeypatch):
    """Format 4: rows chunks hold keys, rows and uint32 counts as the store does, with a
    crc32c; a restore into a new store reads each one straight into the reserved arena
    rows (no decode) and gets every key, row, optimizer slot and count back bit-exactly,
    also through a chain with deletions, re-inserts and dense arrays."""
    from checkpoint.format import FLAG_COUNTS, FLAG_RAW, crc32c
    import google_crc32c
    blob = np.random.default_rng(0).bytes(100_003)
    assert crc32c(blob) == google_crc32c.value(blob)
    assert crc32c(memoryview(blob)[7:], crc32c(memoryview(blob)[:7])) == crc32c(blob)
    import checkpoint.format as fmt
    assert fmt._CRC32C is not None  # the C library the wheel ships was found
    # the writer's writable byte views (sliced too), below and above the size up to which
    # the GIL is kept, and empty ones
    wv = memoryview(bytearray(blob))
    for lim in (1 << 20, 64 << 10, 1):
        monkeypatch.setattr(fmt, "_CRC_GIL_MAX", lim)
        assert crc32c(wv) == google_crc32c.value(blob)
        assert crc32c(wv[5:], crc32c(wv[:5])) == google_crc32c.value(blob)
        assert crc32c(wv[:0], 123) == 123
        arr = np.frombuffer(bytearray(blob[:100_000]), np.float32)
        assert crc32c(memoryview(arr).cast("B")) == google_crc32c.value(blob[:100_000])
    monkeypatch.setattr(fmt, "_CRC32C", None)  # without it: the module's (a copy)
    assert crc32c(blob) == google_crc32c.value(blob)
    assert crc32c(np.frombuffer(blob[:100_000], np.float32)) == google_crc32c.value(blob[:100_000])
    monkeypatch.undo()
    rng = np.random.default_rng(41)
    s = make_store(rng, 20_000)
    cuts = write(tmp_path, 1, s)
    m = load_manifest(tmp_path / "ckpt-00000001-full")
    assert m["version"] == 4
    path, e = data_file(tmp_path, "ckpt-00000001-full")
    flags = _chunk_flags(path, e)
    assert flags and all(f == FLAG_RAW | FLAG_COUNTS for f in flags)
    got = _spy_direct(monkeypatch)
    s2, info = restored(tmp_path)
    # trained rows: stored, read straight in; the other tables' (compressible) chunks
    # are decoded into their reserved rows
    assert got["emb"] == len(e["chunks"]) and got["raw"] >= got["emb"]
    assert got["direct"] == sum(len(f["chunks"]) for f in m["files"] if f["type"] == "rows")
    assert_same(snap(s2), snap(s))
    for name, t in s.tables().items():
        keys = t.export_rows()[0]
        np.testing.assert_array_equal(s2[name].counts(keys), t.counts(keys))
    assert info.tables["emb"]["rows"] == info.tables["emb"]["live_rows"] == 20_000
    k2, r2, _ = s2["emb"].export_rows()
    c2 = s2["emb"].counts(k2)
    # the restored table serves and trains like the original
    k = s["emb"].export_rows()[0][:64]
    g = rng.normal(size=(64, 8)).astype(np.float32)
    s["emb"].apply_gradients(k, g)
    s2["emb"].apply_gradients(k, g)
    np.testing.assert_array_equal(s2["emb"].lookup(k), s["emb"].lookup(k))
    # a chain: the full is read straight in, the incrementals (after deletions) go
    # through the store's upserts; the outcome is the store's state
    for ckpt in (2, 3):
        mutate(s, rng)
        cuts = write(tmp_path, ckpt, s, "incr", parent=ckpt - 1, cuts=cuts)
    s3, info = restored(tmp_path)
    assert info.chain == [1, 2, 3]
    assert_same(snap(s3), snap(s))
    keys = s["emb"].export_rows()[0]
    np.testing.assert_array_equal(s3["emb"].counts(keys), s["emb"].counts(keys))
    # and checkpoint.load of the full (a callback target: the decoding path) agrees with
    # the store restored from it
    import checkpoint
    t = checkpoint.load(tmp_path / "ckpt-00000001-full").tables["emb"]
    order = np.argsort(k2)
    np.testing.assert_array_equal(t.ids, k2[order])
    np.testing.assert_array_equal(t.values, r2[order][:, :8])
    np.testing.assert_array_equal(t.counts, c2[order])


def test_format_4_corrupt_or_truncated_chunk_is_an_error_naming_the_file(tmp_path):
    """A bit flip in a chunk read straight into the arena fails its crc32c: the restore
    drops what it applied and falls back to the previous chain, or (that checkpoint
    asked for exactly) raises CheckpointError naming the file; a truncated file names it
    too. The target store keeps working."""
    rng = np.random.default_rng(42)
    s = make_store(rng, 8000)
    write(tmp_path, 1, s)
    want1 = snap(s)
    mutate(s, rng)
    write(tmp_path, 2, s)  # a second full: its own chain
    path, e = data_file(tmp_path, "ckpt-00000002-full")
    _flip_payload_byte(path, e, "emb")
    assert verify(tmp_path)["ok"] is False
    # default: the corrupt newest checkpoint is skipped, the older chain restored whole
    s2 = EmbeddingStore()
    info = restore(tmp_path, s2)
    assert info.checkpoint_id == 1
    assert any(path.name in p and "crc32c" in p for p in info.skipped), info.skipped
    assert_same(snap(s2), want1)
    # exactly that checkpoint: an error naming the file, nothing left half-applied
    s3 = EmbeddingStore()
    with pytest.raises(CheckpointError, match=path.name):
        restore(tmp_path, s3, upto=2, exact=True)
    assert "emb" not in s3 or len(s3["emb"]) == 0
    s3.create_table("other", 4).lookup(np.arange(10))  # the store still serves
    assert len(s3["other"]) == 10
    # a truncated file: named, with what is wrong
    path1, e1 = data_file(tmp_path, "ckpt-00000001-full")
    with open(path1, "r+b") as f:
        f.truncate(e1["chunks"][len(e1["chunks"]) // 2][0] + 100)
    with pytest.raises(CheckpointError, match=rf"{path1.name}.*(truncated|size)"):
        restore(tmp_path, EmbeddingStore(), upto=1, exact=True)
    with pytest.raises(NoValidCheckpoint):
        restore(tmp_path, EmbeddingStore())


def test_format_4_corrupt_chunk_read_straight_in_is_caught_by_the_one_pass_restore(
        tmp_path, monkeypatch):
    """The corruption is caught on the direct path itself (no pre-check pass reads the
    chunk first) and named: the reserved rows are taken back with the table."""
    rng = np.random.default_rng(43)
    s = make_store(rng, 8000)
    write(tmp_path, 1, s)
    path, e = data_file(tmp_path, "ckpt-00000001-full")
    _flip_payload_byte(path, e, "emb")
    got = _spy_direct(monkeypatch)
    s2 = EmbeddingStore()
    with pytest.raises(CheckpointError, match=rf"{path.name}: chunk \d+ .*crc32c mismatch"):
        restore(tmp_path, s2, upto=1, exact=True)
    assert got["direct"] >= 1
    assert "emb" not in s2


def test_format_3_checkpoints_still_restore_into_the_arena(tmp_path, monkeypatch):
    """A format-3 checkpoint (zlib crc32, the count as a float column) written by the
    previous writer restores bit-exactly through the direct path (decoded, then copied
    into the reserved rows), verifies, and takes a format-4 incremental on top."""
    from checkpoint import format as fmt
    from checkpoint.format import FLAG_COUNTS
    rng = np.random.default_rng(44)
    s = make_store(rng, 6000)
    orig = fmt.FORMAT_VERSION
    try:
        fmt.FORMAT_VERSION = 3
        cuts = write(tmp_path, 1, s)
    finally:
        fmt.FORMAT_VERSION = orig
    assert load_manifest(tmp_path / "ckpt-00000001-full")["version"] == 3
    path, e = data_file(tmp_path, "ckpt-00000001-full")
    assert not any(f & FLAG_COUNTS for f in _chunk_flags(path, e))
    assert verify(tmp_path)["ok"]
    got = _spy_direct(monkeypatch)
    s2, _ = restored(tmp_path)
    assert got["direct"] >= 1 and got["raw"] == 0
    assert_same(snap(s2), snap(s))
    keys = s["emb"].export_rows()[0]
    np.testing.assert_array_equal(s2["emb"].counts(keys), s["emb"].counts(keys))
    mutate(s, rng)
    write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    assert load_manifest(tmp_path / "ckpt-00000002-incr")["version"] == 4
    assert verify(tmp_path)["ok"]
    s3, info = restored(tmp_path)
    assert info.chain == [1, 2]
    assert_same(snap(s3), snap(s))


def test_format_4_partial_slot_mask_restore(tmp_path, monkeypatch):
    """A restore of some routing slots from format 4: chunks wholly outside the mask are
    not read, chunks across its edge are read into the table too and filtered by key
    there (the rows they leave unfilled are freed, and reused by later inserts), and
    exactly the keys of the mask come back, with their counts."""
    rng = np.random.default_rng(45)
    s = make_store(rng, 12_000)
    write(tmp_path, 1, s)
    mask = np.zeros(NUM_SLOTS, bool)
    mask[100:1500] = True
    mask[3000:3001] = True
    got = _spy_direct(monkeypatch)
    s2, info = restored(tmp_path, slot_mask=mask)
    path, e = data_file(tmp_path, "ckpt-00000001-full")
    assert 1 <= got["emb"] < len(e["chunks"])  # only the chunks the mask touches
    assert_same(snap(s2), snap(s, mask))
    keys = snap(s, mask)["emb"][0]
    assert 0 < keys.size < 12_000
    assert len(s2["emb"]) == info.tables["emb"]["rows"] == keys.size
    np.testing.assert_array_equal(s2["emb"].counts(keys), s["emb"].counts(keys))
    t2 = s2["emb"]
    cap = t2._hwm
    assert t2._nfree > 0  # rows of the edge chunks' keys outside the mask
    new = rand_keys(rng, min(t2._nfree, 100))
    t2.lookup(new)
    assert t2._hwm == cap and len(t2) == keys.size + new.size  # freed rows reused
    # onto another num_slots (every chunk read and filtered): the same keys by their slot
    other = np.zeros(512, bool)
    other[::3] = True
    s3, _ = restored(tmp_path, slot_mask=other)
    k_all = s["emb"].export_rows()[0]
    want = np.sort(k_all[other[slot_of(k_all, 512)]])
    np.testing.assert_array_equal(np.sort(s3["emb"].export_rows()[0]), want)


def test_scan_by_slot_matches_scan_live_sorted_by_slot():
    """The full checkpoint's scan: the live rows of a slice (free rows skipped, only the
    slots of the mask), stably sorted by slot, with keys, rows and counts as the table
    holds them: what scan_live gives, sorted."""
    rng = np.random.default_rng(46)
    s = EmbeddingStore()
    t = s.create_table("emb", 4, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 5000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 4)).astype(np.float32))
    t.apply_gradients(keys[:700], rng.normal(size=(700, 4)).astype(np.float32))
    t.delete(keys[100:400])  # free rows inside the slices
    mask = rng.random(NUM_SLOTS) < 0.5
    for m in (None, mask):
        row = 0
        while row is not None:
            k, r, c, sl, nxt = t.scan_by_slot(row, 1024, NUM_SLOTS, m)
            k0, r0, _ = t.scan_live(row, 1024, with_counts=True)
            s0 = slot_of(k0, NUM_SLOTS)
            keep = np.ones(k0.size, bool) if m is None else m[s0]
            o = np.argsort(s0[keep], kind="stable")
            np.testing.assert_array_equal(k, k0[keep][o])
            np.testing.assert_array_equal(sl, s0[keep][o])
            np.testing.assert_array_equal(r, r0[keep][o][:, :-1])
            np.testing.assert_array_equal(c, r0[keep][o][:, -1].astype(np.uint32))
            assert r.dtype == np.float32 and c.dtype == np.uint32
            # gathered into a caller's buffer: the same rows, in it
            buf = np.full((1024, t.row_width), np.nan, np.float32)
            k2, r2, c2, _, nxt2 = t.scan_by_slot(row, 1024, NUM_SLOTS, m, out=buf)
            assert np.shares_memory(r2, buf) and nxt2 == nxt
            np.testing.assert_array_equal(k2, k)
            np.testing.assert_array_equal(r2, r)
            np.testing.assert_array_equal(c2, c)
            # from a sequential copy of the slice (stage): the same, in out, stage not read
            # back; a stage that does not fit falls back to the gather under the lock
            out = np.full((1024, t.row_width), np.nan, np.float32)
            for stage in (np.full((1024, t.row_width), np.nan, np.float32),
                          np.zeros((1023, t.row_width), np.float32)):
                k4, r4, c4, s4, nxt4 = t.scan_by_slot(row, 1024, NUM_SLOTS, m, out=out,
                                                      stage=stage)
                assert np.shares_memory(r4, out) and nxt4 == nxt
                np.testing.assert_array_equal(k4, k)
                np.testing.assert_array_equal(r4, r)
                np.testing.assert_array_equal(c4, c)
                np.testing.assert_array_equal(s4, sl)
                assert c4.dtype == np.uint32
            # a buffer that does not fit (too narrow, too short) is not written
            for bad in (np.zeros((1024, t.row_width - 1), np.float32),
                        np.zeros((max(k.size - 1, 0), t.row_width), np.float32)):
                _, r3, _, _, _ = t.scan_by_slot(row, 1024, NUM_SLOTS, m, out=bad)
                assert not np.shares_memory(r3, bad) and not bad.any()
                np.testing.assert_array_equal(r3, r)
            row = nxt


def test_full_checkpoint_reuses_its_slice_buffers(tmp_path, monkeypatch):
    """A full checkpoint gathers each slice into one of a few reused buffers (in a PS
    every new 2 MB buffer was a fresh mapping): far fewer buffers than slices, each
    reused only once the chunks holding its rows are written -- the restore is exact."""
    import checkpoint.writer as cw
    monkeypatch.setattr(cw, "SCAN_SLICE_ROWS", 512)
    # a bucket becomes a chunk after ~7 slices, as with the real sizes (16k-row slices,
    # 1 MB chunks of 16 buckets)
    monkeypatch.setattr(cw, "BUCKET_CHUNK_BYTES", 1 << 14)
    made = []

    class Counted(cw._SliceBuffers):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)

    monkeypatch.setattr(cw, "_SliceBuffers", Counted)
    rng = np.random.default_rng(47)
    s = EmbeddingStore()
    t = s.create_table("emb", 8, optimizer={"name": "adagrad", "learning_rate": 0.1})
    keys = rand_keys(rng, 60_000)
    t.apply_gradients(keys, rng.normal(size=(keys.size, 8)).astype(np.float32))
    t.delete(keys[:3000])  # free rows: slices with fewer live rows than the buffer
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=NUM_SLOTS)
    w.write_table("ps-0", t)
    w.commit()
    slices = -(-keys.size // 512)  # the arena's rows in use, 512 per lock hold
    assert len(made) == 1
    print(f"{made[0].allocated} buffers for {slices} slices")
    assert 0 < made[0].allocated <= 40 < slices
    s2, _ = restored(tmp_path)
    assert_same(snap(s2), snap(s))


def test_incremental_chunks_stay_under_a_fixed_mmap_threshold(tmp_path):
    """In a process with a fixed malloc mmap threshold (a PS), an incremental's chunks
    are sized so each chunk's rows stay under it (heap buffers reused, not a mapping per
    chunk); the chain restores exactly, counts included."""
    import checkpoint.writer as cw
    rng = np.random.default_rng(21)
    s = make_store(rng, 20_000)
    cuts = write(tmp_path, 1, s)
    mutate(s, rng, frac=0.5)
    assert cw._MMAP_THRESHOLD is None or "MALLOC_MMAP_THRESHOLD_" in os.environ
    before = cw._MMAP_THRESHOLD
    cw.set_malloc_mmap_threshold(128 * 1024)
    try:
        write(tmp_path, 2, s, "incr", parent=1, cuts=cuts)
    finally:
        cw.set_malloc_mmap_threshold(before)
    m = load_manifest(tmp_path / "ckpt-00000002-incr")
    e = next(e for e in m["files"] if e["table"] == "emb")
    width = m["tables"]["emb"]["row_width"]
    rows = [ch[2] for ch in e["chunks"] if ch[1] == 1]  # (offset, kind, n, ...): rows chunks
    assert len(rows) > 1 and sum(rows) == e["rows"]
    assert max(rows) * 4 * width < 128 * 1024, (rows, width)
    got, info = restored(tmp_path)
    assert info.chain == [1, 2]
    assert_same(snap(got), snap(s))
    for name, t in s.tables().items():
        k, _, _ = t.export_rows()
        np.testing.assert_array_equal(got[name].counts(k), t.counts(k))


def test_a_ps_malloc_bound_sizes_the_writers_chunks():
    """The PS's malloc bound (``bound_malloc_retention``) tells the checkpoint writer its
    threshold; a process that leaves glibc's policy alone keeps the larger chunks."""
    code = ("import checkpoint.writer as w; from deeprec_ext.ps.__main__ import "
            "bound_malloc_retention as b; print(w._MMAP_THRESHOLD, b(1.0), w._MMAP_THRESHOLD)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True", str(1 << 20)]


def test_manifest_with_int_keys_in_its_extra_reads_back_valid(tmp_path):
    """The AIMaster's extra holds the shard queue, whose in-flight shards are a dict keyed
    by int shard index. JSON makes those keys strings, which sort differently (99 < 100,
    "100" < "99"): a checksum over the Python body failed its own check once read back,
    and a good checkpoint was refused as corrupt (a soak hit it at shard 100)."""
    rng = np.random.default_rng(23)
    s = make_store(rng, 300)
    doing = {99: {"worker": "worker-0"}, 100: {"worker": "worker-1"},
             101: {"worker": "worker-2"}}
    write(tmp_path, 1, s, extra={"shards": {"doing": doing, "done": [2, 10, 1]}})
    m = load_manifest(tmp_path / "ckpt-00000001-full")
    assert m["extra"]["shards"]["doing"] == {str(k): v for k, v in doing.items()}
    s2, info = restored(tmp_path)
    assert info.chain == [1]
    assert_same(snap(s), snap(s2))


def test_manifest_written_with_the_int_key_checksum_still_reads(tmp_path):
    """Manifests written before the fix carry the checksum of the body with int keys:
    they still load (a good checkpoint is not refused), and a change to one still fails."""
    import json
    from checkpoint.format import manifest_checksum
    rng = np.random.default_rng(29)
    s = make_store(rng, 300)
    write(tmp_path, 1, s, extra={"shards": {"doing": {99: {"w": 0}, 100: {"w": 1}}}})
    d = tmp_path / "ckpt-00000001-full"
    body = json.loads((d / MANIFEST_NAME).read_text())
    legacy = dict(body, extra=dict(body["extra"], shards={"doing": {99: {"w": 0},
                                                                    100: {"w": 1}}}))
    body["checksum"] = manifest_checksum(legacy)  # as the old writer computed it
    assert body["checksum"] != manifest_checksum(body)
    (d / MANIFEST_NAME).write_text(json.dumps(body, indent=1, sort_keys=True))
    assert load_manifest(d)["extra"]["shards"]["doing"]["100"] == {"w": 1}
    s2, info = restored(tmp_path)
    assert_same(snap(s), snap(s2))
    body["extra"]["shards"]["doing"]["100"] = {"w": 2}
    (d / MANIFEST_NAME).write_text(json.dumps(body, indent=1, sort_keys=True))
    with pytest.raises(CheckpointError, match="checksum"):
        load_manifest(d)
