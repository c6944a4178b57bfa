"""The hash index saved with a full checkpoint (``checkpoint.writer._SavedIndex``) and
installed by a restore instead of placing every key (``EmbeddingTable.commit_load``):
the restored table equals the written one and serves like any table; writes during the
checkpoint's scan leave a usable index or none; a missing, corrupt or foreign index file
only costs the restore its speed."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import checkpoint.writer as cw
from checkpoint import CheckpointWriter, restore
from deeprec_ext.store import EmbeddingStore
from deeprec_ext.store.hash_index import HashIndex

I64 = np.iinfo(np.int64)
OPT = {"name": "adagrad", "learning_rate": 0.1}


def _keys(rng, n):
    return rng.integers(I64.min, I64.max, size=n, dtype=np.int64, endpoint=True)


def _store(rng, n=40_000, dim=4):
    s = EmbeddingStore()
    t = s.create_table("emb", dim, optimizer=OPT)
    keys = _keys(rng, n)
    t.apply_gradients(keys, rng.normal(size=(n, dim)).astype(np.float32))
    return s, t, keys


def _rows(t):
    k, r, _ = t.export_rows(with_counts=True)
    o = np.argsort(k)
    return k[o], r[o].view(np.uint32)


def _same(a, b):
    ka, ra = _rows(a)
    kb, rb = _rows(b)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(ra, rb)


def _manifest(root, ckpt_id=1, kind="full"):
    return json.loads((root / f"ckpt-{ckpt_id:08d}-{kind}" / "manifest.json").read_text())


def _index_entry(root, ckpt_id=1):
    (e,) = [e for e in _manifest(root, ckpt_id)["files"] if e["type"] == "rows"]
    return e.get("index")


@pytest.fixture
def placements(monkeypatch):
    """Counts the keys the restore places by hashing (HashIndex.place_rows)."""
    placed = []
    real = HashIndex.place_rows

    def spy(self, keys, *a, **kw):
        placed.append(len(keys))
        return real(self, keys, *a, **kw)

    monkeypatch.setattr(HashIndex, "place_rows", spy)
    return placed


def _restored(root):
    s = EmbeddingStore()
    info = restore(root, s)
    # the restore says whether the table's index came from the checkpoint
    assert info.tables["emb"].get("saved_index", False) == s.get("emb").index_from_checkpoint
    return s, s.get("emb")


def test_a_restore_installs_the_saved_index_and_the_table_serves(tmp_path, placements):
    """Deleted keys before the checkpoint leave tombstones the saved index keeps; the
    restore hashes no key, and the table then equals the written one, finds every key,
    and takes lookups of new keys, pushes and deletes as the original does."""
    rng = np.random.default_rng(1)
    s, t, keys = _store(rng)
    t.delete(keys[:3000])  # tombstones in the index
    w = CheckpointWriter(tmp_path, 1, "full")
    w.write_table("ps-0", t)
    w.commit()
    ix = _index_entry(tmp_path)
    assert ix and ix["rows"] == len(t) and ix["capacity"] == t._index.capacity
    s2, t2 = _restored(tmp_path)
    assert placements == [] and t2.index_from_checkpoint  # no key hashed and placed
    assert len(t2) == len(t) and t2._index.num_deleted == t._index.num_deleted > 0
    _same(t, t2)
    live = keys[3000:]
    assert (t2._index.find(live) >= 0).all() and (t2._index.find(keys[:3000]) < 0).all()
    new = _keys(rng, 5000)
    for table in (t, t2):  # new keys (through the tombstones), updates, deletes
        table.lookup(new)
        table.apply_gradients(np.concatenate([live[:2000], new[:100]]),
                              np.ones((2100, 4), np.float32))
        table.delete(live[2000:4000])
    _same(t, t2)


def test_keys_inserted_during_the_scan_are_tombstones_and_the_next_incremental_adds_them(
        tmp_path, placements):
    """Lookups of new keys between the scan's slices (a PS serving while it writes) keep
    the index's layout, and the index is saved. Rows freed before the checkpoint and
    reused then, behind the scan, are not written: their positions are saved as
    tombstones, so every written key's probe chain holds. The restored full finds each
    of its keys; the next incremental brings the rest."""
    import checkpoint
    rng = np.random.default_rng(2)
    s, t, keys = _store(rng, n=60_000)
    t.delete(keys[:20_000])  # free rows, reused by the lookups below
    w = CheckpointWriter(tmp_path, 1, "full")
    real = t.scan_by_slot
    calls = [0]
    new = _keys(rng, 4000)

    def serving_scan(*a, **k):
        calls[0] += 1
        if calls[0] in (2, 3):
            t.lookup(new[(calls[0] - 2) * 2000:(calls[0] - 1) * 2000])
        return real(*a, **k)

    t.scan_by_slot = serving_scan
    cut = w.write_table("ps-0", t)["cut_seq"]
    del t.scan_by_slot
    w.commit()
    ix = _index_entry(tmp_path)
    assert calls[0] > 3 and ix and ix["rows"] < len(t)  # some new keys not written
    full = checkpoint.load(tmp_path / "ckpt-00000001-full").tables["emb"].ids
    s1 = EmbeddingStore()
    restore(tmp_path, s1, upto=1, exact=True)
    t1 = s1.get("emb")
    assert placements == [] and len(t1) == full.size
    assert (t1._index.find(full) >= 0).all()  # no chain broken by a key not written
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1)
    w.write_table("ps-0", t, since_seq=cut)
    w.commit()
    s2, t2 = _restored(tmp_path)
    _same(t, t2)
    assert (t2._index.find(new) >= 0).all()


@pytest.mark.parametrize("change", ["delete", "growth"])
def test_a_layout_change_during_the_scan_saves_no_index_and_the_restore_places_keys(
        tmp_path, placements, change):
    """A key removed (its row may be scanned twice) or the index grown (every position
    moves) during the scan: the checkpoint names no index and leaves no index file; the
    restore places the keys and equals the table."""
    rng = np.random.default_rng(3)
    s, t, keys = _store(rng, n=60_000)
    w = CheckpointWriter(tmp_path, 1, "full")
    real = t.scan_by_slot
    calls = [0]

    def busy_scan(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            if change == "delete":
                t.delete(keys[:10])
            else:
                t.lookup(_keys(rng, t._index.capacity // 2))  # past load 1/2: it grows
        return real(*a, **k)

    t.scan_by_slot = busy_scan
    cut = w.write_table("ps-0", t)["cut_seq"]
    del t.scan_by_slot
    w.commit()
    assert calls[0] > 2
    assert _index_entry(tmp_path) is None
    assert not list(tmp_path.glob("ckpt-*/*.index"))
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1)
    w.write_table("ps-0", t, since_seq=cut)
    w.commit()
    s2, t2 = _restored(tmp_path)
    assert sum(placements) >= len(t) - 10_000 // 2 and placements
    _same(t, t2)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short", "seed"])
def test_a_bad_index_file_costs_only_speed(tmp_path, placements, caplog, damage):
    """An index file missing, with a flipped byte, truncated, or of another probe hash:
    the restore warns (not for another hash: nothing is wrong there), places the keys
    and restores every row exactly."""
    rng = np.random.default_rng(4)
    s, t, keys = _store(rng, n=20_000)
    w = CheckpointWriter(tmp_path, 1, "full")
    w.write_table("ps-0", t)
    w.commit()
    (path,) = tmp_path.glob("ckpt-*/*.index")
    if damage == "missing":
        path.unlink()
    elif damage == "corrupt":
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x40
        path.write_bytes(bytes(blob))
    elif damage == "short":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        import deeprec_ext.store.hash_index as hi
        import checkpoint.reader as rd
        pytest.MonkeyPatch().setattr(rd, "PROBE_SEED", hi.PROBE_SEED + 1)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        s2, t2 = _restored(tmp_path)
    if damage == "seed":
        import checkpoint.reader as rd
        import deeprec_ext.store.hash_index as hi
        rd.PROBE_SEED = hi.PROBE_SEED
    warned = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert (warned == []) == (damage == "seed"), warned
    assert sum(placements) == len(t)
    _same(t, t2)


def test_an_index_that_does_not_find_its_keys_is_not_trusted(tmp_path, placements, caplog):
    """A saved index whose positions do not match the keys' probes (written by another
    hash, say): the sample lookup catches it, the keys are placed, the table is exact."""
    rng = np.random.default_rng(5)
    s, t, keys = _store(rng, n=20_000)
    w = CheckpointWriter(tmp_path, 1, "full")
    w.write_table("ps-0", t)
    w.commit()
    import checkpoint.reader as rd
    real = rd._read_saved_index

    def shuffled(c, e, rows):
        cap, codes = real(c, e, rows)
        return cap, np.roll(codes, 7)  # every key 7 positions off its probe chain
    rd._read_saved_index = shuffled
    try:
        with caplog.at_level(logging.WARNING):
            s2, t2 = _restored(tmp_path)
    finally:
        rd._read_saved_index = real
    assert any("does not find its keys" in r.getMessage() for r in caplog.records)
    assert sum(placements) == len(t)
    _same(t, t2)
    assert (t2._index.find(keys) >= 0).all()


def test_each_ps_of_a_job_restores_its_part_with_its_index(tmp_path, placements):
    """As PS write: two tables owning half the slots each (one also holding rows of the
    other half, as after a migration round) write with their slot masks; the rows the
    mask leaves out are tombstones in the saved index. Each restores its half with the
    same mask from its own file and index, hashing no key; restored onto other slots,
    keys are placed. Rows equal throughout."""
    from deeprec_ext.hashing import slot_of
    rng = np.random.default_rng(6)
    s, t, keys = _store(rng, n=40_000)
    slots = slot_of(keys, 4096)
    mine = np.zeros(4096, bool)
    mine[:2048] = True
    parts = []
    for i, mask in enumerate((mine, ~mine)):
        si = EmbeddingStore()
        ti = si.create_table("emb", 4, optimizer=OPT)
        held = keys if i == 0 else keys[~mine[slots]]  # ps-0 also holds ps-1's rows
        ti.import_rows(*t.export_keys(held, with_counts=True))
        parts.append((ti, mask))
    w = CheckpointWriter(tmp_path, 1, "full", num_slots=4096)
    for i, (ti, mask) in enumerate(parts):
        w.write_table(f"ps-{i}", ti, slot_mask=mask)
    w.commit()
    files = [e for e in _manifest(tmp_path)["files"] if e["type"] == "rows"]
    assert all(e.get("index") for e in files)
    for i, (ti, mask) in enumerate(parts):
        s2 = EmbeddingStore()
        restore(tmp_path, s2, slot_mask=mask)
        t2 = s2.get("emb")
        want = keys[mask[slots]]
        assert len(t2) == want.size and (t2._index.find(want) >= 0).all()
        np.testing.assert_array_equal(t2.lookup(want, insert_missing=False),
                                      t.lookup(want, insert_missing=False))
        # ps-0's rows of ps-1's slots: tombstones in its restored index, not keys
        assert t2._index.num_deleted == (int((~mask[slots]).sum()) if i == 0 else 0)
    assert placements == []
    other = np.zeros(4096, bool)
    other[1024:3072] = True  # half of each PS's slots: both files, keys placed
    s3 = EmbeddingStore()
    restore(tmp_path, s3, slot_mask=other)
    assert placements and len(s3.get("emb")) == int(other[slots].sum())


def test_no_index_where_it_cannot_be_used(tmp_path, placements):
    """An incremental and a writer with the index off name none."""
    rng = np.random.default_rng(7)
    s, t, keys = _store(rng, n=20_000)
    w = CheckpointWriter(tmp_path / "a", 1, "full")
    cut = w.write_table("ps-0", t)["cut_seq"]
    w.commit()
    t.apply_gradients(keys[:100], np.ones((100, 4), np.float32))
    w = CheckpointWriter(tmp_path / "a", 2, "incr", parent=1)
    w.write_table("ps-0", t, since_seq=cut)
    w.commit()
    (e,) = [e for e in _manifest(tmp_path / "a", 2, "incr")["files"] if e["type"] == "rows"]
    assert "index" not in e
    cw.SAVE_INDEX = False
    try:
        w = CheckpointWriter(tmp_path / "b", 1, "full")
        w.write_table("ps-0", t)
        w.commit()
    finally:
        cw.SAVE_INDEX = True
    assert _index_entry(tmp_path / "b") is None
    s2, t2 = _restored(tmp_path / "b")
    assert sum(placements) == len(t)
    _same(t, t2)


def test_install_table_refuses_what_does_not_fit():
    idx = HashIndex(64)
    ok = np.zeros(64, np.int32)
    ok[[3, 9]] = [1, 2]
    assert not idx.install_table(63, ok[:63], 0, 2)  # not a power of two
    assert not idx.install_table(64, ok.astype(np.int64), 0, 2)  # not int32 codes
    assert not idx.install_table(64, ok, 0, 3)  # not the row count
    crowded = np.arange(1, 65, dtype=np.int32)
    assert not idx.install_table(64, crowded, 0, 64)  # load over 1/2
    gap = ok.copy()
    gap[9] = 3  # rows 1 and 3: row 2 missing
    assert not idx.install_table(64, gap, 0, 2)
    assert len(idx) == 0 and idx.capacity == 64
    assert idx.install_table(64, ok.copy(), 10, 2)  # rows 10, 11
    assert len(idx) == 2 and sorted(idx._tab[idx._tab > 0].tolist()) == [11, 12]
    with pytest.raises(RuntimeError, match="empty index"):
        idx.install_table(64, ok.copy(), 0, 2)


def test_inspect_checks_the_saved_index_and_a_bad_one_is_only_a_note(tmp_path):
    """``python -m checkpoint inspect`` reads the index files too: a good one is counted,
    a corrupt one is reported as a note naming its file, and the checkpoint stays valid
    and restorable (exit 0)."""
    import subprocess
    import sys
    from pathlib import Path
    root_dir = Path(__file__).resolve().parent.parent
    rng = np.random.default_rng(8)
    s, t, keys = _store(rng, n=5000)
    w = CheckpointWriter(tmp_path, 1, "full")
    w.write_table("ps-0", t)
    w.commit()

    def inspect(*extra):
        out = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", str(tmp_path),
                              *extra], capture_output=True, text=True, timeout=120,
                             cwd=root_dir)
        assert out.returncode == 0, out.stderr
        return out.stdout

    rep = json.loads(inspect("--json"))
    (c,) = rep["checkpoints"]
    assert c["valid"] and c["indexes"] == 1 and c["notes"] == []
    (path,) = tmp_path.glob("ckpt-*/*.index")
    blob = bytearray(path.read_bytes())
    blob[100] ^= 1
    path.write_bytes(bytes(blob))
    text = inspect()
    assert "notes" in text and "ps-0.emb.rows: saved index not usable (crc32c mismatch" in text
    assert "0 invalid" in text
    rep = json.loads(inspect("--json"))
    assert rep["ok"] and rep["checkpoints"][0]["valid"] and len(rep["checkpoints"][0]["notes"]) == 1


def test_a_growth_left_half_done_is_finished_and_the_index_saved(tmp_path, placements):
    """Keys inserted in large batches leave the index's growth half done (it moves on
    only as more keys arrive). A full checkpoint finishes it, in short lock holds, and
    saves the index; the restore installs it."""
    rng = np.random.default_rng(9)
    s = EmbeddingStore()
    t = s.create_table("emb", 4, optimizer=OPT)
    for _ in range(7):
        k = _keys(rng, 200_000)
        t.apply_gradients(k, np.zeros((k.size, 4), np.float32))
    assert t._index.growing  # what a bulk fill leaves
    w = CheckpointWriter(tmp_path, 1, "full")
    w.write_table("ps-0", t)
    w.commit()
    assert not t._index.growing and _index_entry(tmp_path)
    s2, t2 = _restored(tmp_path)
    assert placements == [] and t2.index_from_checkpoint
    _same(t, t2)
