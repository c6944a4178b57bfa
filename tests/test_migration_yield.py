"""Migration yields to training: a background round's source waits between chunks while
lookups or pushes are in flight, never longer than its bound, and not at all when idle."""
from __future__ import annotations

import threading
import time

import pytest

from deeprec_ext.ps.server import ParameterServerServicer


@pytest.fixture(autouse=True)
def _close_servicers(monkeypatch):
    """Close every servicer a test makes: its replicator thread would outlive the test."""
    made, init = [], ParameterServerServicer.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ParameterServerServicer, "__init__", tracked)
    yield
    for svc in made:
        svc.close()


def test_yield_waits_only_while_training_calls_are_in_flight():
    svc = ParameterServerServicer("ps-y")
    t0 = time.monotonic()
    for _ in range(50):
        svc._yield_to_training()
    assert time.monotonic() - t0 < 0.5 * svc.MIGRATE_YIELD_SECONDS * 50  # idle: no wait

    svc._data_call(1)
    t0 = time.monotonic()
    svc._yield_to_training()
    waited = time.monotonic() - t0
    assert svc.MIGRATE_YIELD_SECONDS * 0.9 <= waited < 1.0  # busy: bounded wait

    # the call ends during the wait: the copy goes on at once
    threading.Timer(0.005, svc._data_call, (-1,)).start()
    svc.MIGRATE_YIELD_SECONDS = 2.0
    t0 = time.monotonic()
    svc._yield_to_training()
    assert time.monotonic() - t0 < 1.0
    assert svc._data_calls == 0


def test_in_flight_count_is_exact_under_concurrent_calls():
    svc = ParameterServerServicer("ps-c")

    def hammer():
        for _ in range(20_000):
            svc._data_call(1)
            svc._data_call(-1)
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert svc._data_calls == 0


def test_bad_migration_share_is_refused_at_start():
    import os
    import subprocess
    import sys
    from tests.conftest import ROOT
    for bad in ("0", "1.5", "-0.2"):
        r = subprocess.run([sys.executable, "-m", "deeprec_ext.ps", "--migration-share", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 2 and "--migration-share" in r.stderr and bad in r.stderr, r.stderr


def test_drop_slots_yields_between_chunks_while_training_calls_are_in_flight():
    """DropSlots (a migration's clean-up) waits between its delete chunks while lookups
    or pushes are in flight, bounded per chunk, and still drops every row."""
    import numpy as np

    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2
    svc = ParameterServerServicer("ps-d")
    t = svc.store.create_table("emb", 4, optimizer="sgd")
    keys = np.arange(100_000, dtype=np.int64)
    t.lookup(keys)
    mask = np.zeros(64, np.uint8)
    mask[::2] = 1
    moving = int(mask[slot_of(keys, 64)].sum())
    svc.MIGRATE_CHUNK_ROWS = 4096
    chunks = -(-moving // 4096)
    svc.MIGRATE_YIELD_SECONDS = 0.01
    svc._data_call(1)  # a training call in flight the whole time
    t0 = time.monotonic()
    r = svc.DropSlots(ps_pb2.DropSlotsRequest(slots=mask.tobytes(), num_slots=64), None)
    waited = time.monotonic() - t0
    svc._data_call(-1)
    assert r.rows == moving and len(t) == keys.size - moving
    assert waited >= 0.9 * 0.01 * (chunks - 1), (waited, chunks)
    t0 = time.monotonic()  # idle: no wait
    svc.DropSlots(ps_pb2.DropSlotsRequest(slots=(1 - mask).tobytes(), num_slots=64), None)
    assert len(t) == 0 and time.monotonic() - t0 < 0.5 * 0.01 * (chunks - 1)


def test_a_catch_up_round_is_paced_past_its_first_rows_only():
    """The snapshot is paced to the migration share; a catch-up round only after its first
    ``CATCHUP_UNPACED_ROWS`` (small rounds converge at full speed, a large first catch-up
    no longer takes the CPU in one burst). Real gRPC between two in-process PS; every row
    arrives either way."""
    import numpy as np

    from deeprec_ext.grpc_util import create_server, insecure_channel
    from deeprec_ext.hashing import slot_of
    from deeprec_ext.proto import ps_pb2 as pb
    from deeprec_ext.proto import ps_pb2_grpc as pbg

    paced = []

    class CountingPacer(ParameterServerServicer._Pacer):
        def pace(self):
            if self.share < 1.0:  # a duty cycle in force (1.0: never sleeps)
                paced.append(self.share)
            super().pace()

    servers, stubs, addresses, svcs = [], [], [], []
    try:
        for name in ("src", "dst"):
            svc = ParameterServerServicer(name, migration_share=0.9)
            server, port = create_server("127.0.0.1:0", max_workers=8)
            pbg.add_ParameterServerServicer_to_server(svc, server)
            server.start()
            servers.append(server)
            svcs.append(svc)
            addresses.append(f"127.0.0.1:{port}")
            stubs.append(pbg.ParameterServerStub(insecure_channel(addresses[-1])))
        src, dst = stubs
        svcs[0]._Pacer = CountingPacer
        svcs[0].CATCHUP_UNPACED_ROWS = 8192
        cfg = pb.TableConfig(name="emb", dim=4, initializer_json='{"name": "zeros"}',
                             optimizer_json='{"name": "sgd", "learning_rate": 1.0}')
        src.CreateTable(pb.CreateTableRequest(config=cfg), timeout=30)
        ids = np.unique(np.random.default_rng(3).integers(-2**62, 2**62, 120_000))
        src.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=ids.tobytes())],
                                    insert_missing=True), timeout=60)
        mask = np.zeros(4096, np.uint8)
        mask[::3] = 1
        moving = ids[mask[slot_of(ids, 4096)].astype(bool)]

        def migrate(since):
            paced.clear()
            return src.MigrateSlots(pb.MigrateSlotsRequest(
                dst_address=addresses[1], slots=mask.tobytes(), num_slots=4096,
                since_seq=since), timeout=60)

        def push(keys):
            src.Push(pb.PushRequest(tables=[pb.TableUpdate(
                table="emb", ids=keys.tobytes(),
                values=np.ones((keys.size, 4), np.float32).tobytes())]), timeout=30)

        # which imported rows the destination was told to import yielding (background)
        marks = []
        real_import = svcs[1]._import_pieces

        def recording_import(table, ids, rows, counts, yield_=False):
            marks.append((int(ids.size), yield_))
            real_import(table, ids, rows, counts, yield_)
        svcs[1]._import_pieces = recording_import

        def yielded():
            out = [n for n, y in marks if y], [n for n, y in marks if not y]
            marks.clear()
            return sum(out[0]), sum(out[1])

        r = migrate(-1)
        assert r.rows == moving.size and len(paced) >= 2  # the snapshot: paced
        assert yielded() == (moving.size, 0)  # ...and imported yielding
        push(moving[:1000])
        r = migrate(r.watermark)
        assert r.rows == 1000 and paced == []  # a small catch-up: at full speed
        assert yielded() == (0, 1000)
        push(moving)
        r = migrate(r.watermark)
        assert r.rows == moving.size and len(paced) >= 1  # a large one: paced past its start
        got_yield, got_fast = yielded()  # its first rows fast, the paced rest yielding
        assert got_yield + got_fast == moving.size and 0 < got_fast <= 8192 + svcs[0].MIGRATE_CHUNK_ROWS
        assert got_yield >= moving.size - 8192 - svcs[0].MIGRATE_CHUNK_ROWS
        # the last round (fenced, send_request_ids): never yielding, however large
        push(moving)
        r = src.MigrateSlots(pb.MigrateSlotsRequest(
            dst_address=addresses[1], slots=mask.tobytes(), num_slots=4096,
            since_seq=r.watermark, send_request_ids=True), timeout=60)
        assert r.rows == moving.size and yielded() == (0, moving.size)
        got = dst.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=moving.tobytes())]),
                         timeout=30)
        want = src.Lookup(pb.LookupRequest(tables=[pb.TableIds(table="emb", ids=moving.tobytes())]),
                          timeout=30)
        assert got.values[0] == want.values[0]
        st = {t.name: t.rows for t in dst.Stats(pb.StatsRequest(), timeout=30).tables}
        assert st["emb"] == moving.size
    finally:
        for server in servers:
            server.stop(None)


def test_a_snapshot_import_yields_between_pieces_while_training_calls_are_in_flight():
    """A destination (a scale-in's serves all of training) waits between the pieces of a
    snapshot's import while lookups or pushes are in flight here, bounded per piece; a
    catch-up round's import (no announced rows; the last one runs fenced) never waits.
    Every row lands either way."""
    import numpy as np

    from deeprec_ext import rowwire
    from deeprec_ext.proto import ps_pb2

    def import_rows(svc, keys, announce: bool, background: bool = False) -> tuple[float, int]:
        cfg = ps_pb2.TableConfig(name="emb", dim=4, optimizer_json='{"name": "sgd"}',
                                 initializer_json='{"name": "zeros"}').SerializeToString()
        rows = np.ones((keys.size, 4), np.float32)
        counts = np.ones(keys.size, np.uint32)
        batches = [rowwire.parse(rowwire.encode(cfg, total_rows=keys.size if announce else 0)),
                   rowwire.parse(rowwire.encode(cfg, keys, rows, counts, background=background))]
        t0 = time.monotonic()
        r = svc.ImportRows(iter(batches), None)
        return time.monotonic() - t0, r.rows

    keys = np.arange(40_000, dtype=np.int64)
    pieces = -(-keys.size // ParameterServerServicer.IMPORT_PIECE_ROWS)
    svc = ParameterServerServicer("ps-i", migration_share=0.5)
    # a wait per piece well above an import's own time on a loaded 2-core host (a 4k-row
    # piece: ~1 ms idle, 10+ ms at load 9), so no-wait and wait cannot be confused
    svc.MIGRATE_YIELD_SECONDS = wait = 0.05
    svc._data_call(1)  # a training call in flight the whole time
    waited, n = import_rows(svc, keys, announce=True)
    assert n == keys.size and len(svc.store.tables()["emb"]) == keys.size
    assert waited >= 0.9 * wait * pieces, (waited, pieces)
    waited, n = import_rows(svc, keys + keys.size, announce=False)  # a catch-up round's start
    assert n == keys.size and len(svc.store.tables()["emb"]) == 2 * keys.size
    assert waited < 0.5 * wait * pieces, (waited, pieces)
    # a paced catch-up round's rows (the source marks them background) yield too, and
    # still land, present keys overwritten
    waited, n = import_rows(svc, keys + keys.size, announce=False, background=True)
    assert n == keys.size and len(svc.store.tables()["emb"]) == 2 * keys.size
    assert waited >= 0.9 * wait * pieces, (waited, pieces)
    svc._data_call(-1)
    waited, n = import_rows(svc, keys + 2 * keys.size, announce=True)  # idle: no wait
    assert n == keys.size and waited < 0.5 * wait * pieces
    unpaced = ParameterServerServicer("ps-u")  # --migration-share 1: no pacing, no yield
    unpaced._data_call(1)
    waited, n = import_rows(unpaced, keys, announce=True)
    assert n == keys.size and waited < 0.5 * wait * pieces
