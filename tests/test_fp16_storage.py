"""float16 value storage (issue 17, item 4): values stored as float16, optimizer slots and
math in float32, float32 on the wire; through checkpoints, replication, migration and
promotion."""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from checkpoint import CheckpointWriter, restore
from checkpoint.reader import load_manifest
from deeprec_ext import InvalidRequestError, PSClient
from deeprec_ext.store import EmbeddingStore, EmbeddingTable

INIT = {"name": "random_normal", "stddev": 0.3, "seed": 7}
OPTS = [{"name": "sgd", "learning_rate": 0.1}, {"name": "adagrad", "learning_rate": 0.1},
        {"name": "adam", "learning_rate": 0.01}]


def _f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _sorted_rows(table):
    keys, rows, _ = table.export_rows()
    o = np.argsort(keys)
    return keys[o], rows[o]


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o["name"])
def test_values_round_to_float16_and_optimizer_math_stays_float32(opt):
    """A float16 table holds what a float32 table holding the same (float16) values holds
    after the same float32 optimizer step, with the value rounded to float16 and the slots
    exactly the float32 ones."""
    t16 = EmbeddingTable("h", 6, INIT, opt, dtype="float16")
    t32 = EmbeddingTable("f", 6, INIT, opt)
    ids = np.arange(5000, dtype=np.int64)
    v16 = t16.lookup(ids)
    assert v16.dtype == np.float32
    np.testing.assert_array_equal(v16, _f16(t32.lookup(ids)))
    t32.import_rows(*t16.export_rows()[:2])  # the same starting rows in both
    rng = np.random.default_rng(1)
    for _ in range(3):
        batch = rng.integers(0, ids.size, 4000)  # duplicates: summed in float32 first
        g = rng.normal(size=(batch.size, 6)).astype(np.float32)
        t16.apply_gradients(batch, g)
        t32.apply_gradients(batch, g)
        _, a = _sorted_rows(t16)
        _, b = _sorted_rows(t32)
        np.testing.assert_array_equal(a[:, :6], _f16(b[:, :6]))
        np.testing.assert_array_equal(a[:, 6:], b[:, 6:])  # slots: float32, exact
        t32.import_rows(*t16.export_rows()[:2])  # next step starts from the rounded value
    assert t16.row_width == t32.row_width  # float32 rows outside the arena
    slots = t16.num_slots
    assert t16.arena_row_bytes == 2 * 6 + 4 * 6 * slots
    assert t32.arena_row_bytes == 4 * 6 * (1 + slots)
    assert t16.nbytes < t32.nbytes


def test_float16_paths_that_move_rows_in_bulk():
    """insert, import, the sequential load of a restore, a scan, a reconfigure and a
    storage conversion all keep float16-exact values and float32 slots."""
    t = EmbeddingTable("h", 3, "zeros", "adagrad", dtype="float16")
    ids = np.arange(100, dtype=np.int64)
    vals = np.random.default_rng(2).normal(size=(100, 3)).astype(np.float32)
    t.insert(ids, vals)
    np.testing.assert_array_equal(t.lookup(ids), _f16(vals))
    rows = np.zeros((100, t.row_width + 1), np.float32)
    rows[:, :3] = vals + 1
    rows[:, 3:6] = vals  # slots: kept as float32
    rows[:, 6] = 5
    t2 = EmbeddingTable("h", 3, "zeros", "adagrad", dtype="float16")
    t2.load_rows(ids, rows)  # fresh table: the one-slice path
    keys, got, _ = t2.export_rows(with_counts=True)
    np.testing.assert_array_equal(got[:, :3], _f16(vals + 1))
    np.testing.assert_array_equal(got[:, 3:6], vals)
    np.testing.assert_array_equal(got[:, 6], 5)
    skeys, srows, _ = t2.scan_live(0, 1000, with_counts=True)
    np.testing.assert_array_equal(srows, got)
    t2.reconfigure("zeros", {"name": "adam", "learning_rate": 0.01})  # slots reset, values kept
    np.testing.assert_array_equal(t2.lookup(ids), _f16(vals + 1))
    assert t2.set_dtype("float32") and t2.dtype == "float32"
    np.testing.assert_array_equal(t2.lookup(ids), _f16(vals + 1))
    t2.insert(ids, vals)
    np.testing.assert_array_equal(t2.lookup(ids), vals)  # float32 again: exact
    assert t2.set_dtype("float16")
    np.testing.assert_array_equal(t2.lookup(ids), _f16(vals))
    # growth past the initial capacity keeps the rows
    big = np.arange(10_000, dtype=np.int64)
    t2.insert(big, np.full((big.size, 3), 1 / 3, np.float32))
    np.testing.assert_array_equal(t2.lookup(big), _f16(np.full((big.size, 3), 1 / 3)))


def test_float16_segment_adopts_only_into_a_float16_table():
    src = EmbeddingTable("t", 2, "zeros", "sgd", dtype="float16")
    src.insert(np.arange(50, dtype=np.int64), np.ones((50, 2), np.float32) / 3)
    mask = np.ones(4, bool)
    assert EmbeddingTable("t", 2, "zeros", "sgd").adopt_segment(src, mask, 4) < 0
    dst = EmbeddingTable("t", 2, "zeros", "sgd", dtype="float16")
    assert dst.adopt_segment(src, mask, 4) == 50
    np.testing.assert_array_equal(dst.lookup(np.arange(50, dtype=np.int64)),
                                  _f16(np.ones((50, 2)) / 3))


def test_checkpoint_records_dtype_and_restores_float16(tmp_path):
    """Full + incremental chain of a float16 table restores as float16, values exact; a
    float32 table's checkpoint records no dtype (what older checkpoints hold) and restores
    as float32."""
    store = EmbeddingStore()
    h = store.create_table("h", 4, INIT, "adam", dtype="float16")
    f = store.create_table("f", 4, INIT, "adam")
    ids = np.arange(3000, dtype=np.int64)
    h.lookup(ids), f.lookup(ids)
    w = CheckpointWriter(tmp_path, 1, "full")
    cut = {n: w.write_table("ps-0", t)["cut_seq"] for n, t in (("h", h), ("f", f))}
    w.commit()
    g = np.random.default_rng(3).normal(size=(1000, 4)).astype(np.float32)
    h.apply_gradients(ids[:1000], g)
    f.apply_gradients(ids[:1000], g)
    h.delete(ids[2900:])
    w = CheckpointWriter(tmp_path, 2, "incr", parent=1)
    for n, t in (("h", h), ("f", f)):
        w.write_table("ps-0", t, since_seq=cut[n])
    w.commit()
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2
    for d in dirs:  # both checkpoints
        meta = load_manifest(d)
        assert meta["tables"]["h"]["dtype"] == "float16"
        assert "dtype" not in meta["tables"]["f"]
    back = EmbeddingStore()
    restore(str(tmp_path), back)
    assert back.get("h").dtype == "float16" and back.get("h").config["dtype"] == "float16"
    assert back.get("f").dtype == "float32" and "dtype" not in back.get("f").config
    for name in ("h", "f"):
        k0, r0 = _sorted_rows(store.get(name))
        k1, r1 = _sorted_rows(back.get(name))
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(r0, r1)
    assert back.get("h").size == 2900


@pytest.mark.parametrize("bad", ["float64", "bfloat16", "int8", 16, np.float64])
def test_bad_dtype_is_refused_naming_the_table(bad):
    with pytest.raises(ValueError, match="table 'x'.*dtype"):
        EmbeddingStore().create_table("x", 4, dtype=bad)
    with pytest.raises(ValueError, match="table 'x'.*dtype"):
        EmbeddingTable("x", 4, dtype=bad)


def test_existing_table_of_another_dtype_is_refused():
    store = EmbeddingStore()
    store.create_table("x", 4, dtype="float16")
    assert store.create_table("x", 4, dtype=np.float16).dtype == "float16"
    with pytest.raises(ValueError, match="table 'x' already exists with dtype=float16"):
        store.create_table("x", 4)


# -- real processes ----------------------------------------------------------------------
def _cli(job, *args):
    from tests.test_fault_tolerance import _cli as cli
    code, out, err = cli(job, "aimaster.cli", *args, "--master", job.address)
    assert code == 0, err + job.output()[-3000:]
    return json.loads(out)


def test_float16_table_through_scale_out_kill9_and_checkpoint(start_job, tmp_path):
    """PS-only job: a float16 adam table is pushed, the PS fleet scales out, a PS is killed
    with -9 (sync replication) and the table is checkpointed and restored. At every stage
    lookups equal a local float16 table given the same pushes -- float16-exact values,
    nothing lost -- and the restored table is float16. Bad dtypes are refused by the PS
    with INVALID_ARGUMENT naming the table, and it keeps serving."""
    from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
    from tests.test_elasticity import kill9_ps_until_replaced, scale
    ck = tmp_path / "ckpt"
    job = start_job({"name": "fp16", "ps": {"replicas": 2, "max_replicas": 3},
                     "replication": {"mode": "sync"}, "checkpoint": {"dir": str(ck)}},
                    ["--workers", "0"])
    client = PSClient.connect(job.address, timeout=60)
    opt = {"name": "adam", "learning_rate": 0.01}
    client.create_table("h", 8, initializer=INIT, optimizer=opt, dtype="float16")
    mirror = EmbeddingTable("h", 8, INIT, opt, dtype="float16")
    n = 20_000
    ids = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(5)

    def push_rounds(k):
        for _ in range(k):
            batch = rng.choice(n, 4000, replace=False).astype(np.int64)  # distinct ids
            g = rng.normal(size=(batch.size, 8)).astype(np.float32)
            client.push("h", batch, g)
            mirror.apply_gradients(batch, g)

    def check():
        client.refresh_routing()
        got = client.lookup("h", ids, insert_missing=False)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, mirror.lookup(ids, insert_missing=False))

    np.testing.assert_array_equal(client.lookup("h", ids), mirror.lookup(ids))
    push_rounds(5)
    check()
    assert scale(job, "--ps", "3")["ps"] == [2, 3]
    push_rounds(5)
    check()
    kill9_ps_until_replaced(job, "ps-1", scale_events=2)
    check()
    push_rounds(3)
    check()
    assert _cli(job, "checkpoint", "--full")["type"] == "full"
    push_rounds(2)
    incr = _cli(job, "checkpoint")
    assert incr["type"] == "incr"
    # what an export reads: float32 values, float16-exact, the dtype in the table's config
    import checkpoint
    loaded = checkpoint.load(incr["path"]).tables["h"]
    assert loaded.values.dtype == np.float32 and loaded.config["dtype"] == "float16"
    assert loaded.ids.size == n  # the whole chain
    np.testing.assert_array_equal(loaded.values,
                                  mirror.lookup(loaded.ids, insert_missing=False))
    back = EmbeddingStore()
    restore(str(ck), back)
    t = back.get("h")
    assert t.dtype == "float16"
    keys, rows = _sorted_rows(t)
    mk, mrows = _sorted_rows(mirror)
    np.testing.assert_array_equal(keys, mk)
    np.testing.assert_array_equal(rows, mrows)  # values and adam slots, exact
    # bad input: refused with the table named, and the PS keeps serving
    with pytest.raises(InvalidRequestError, match="table 'bad'.*dtype"):
        client.create_table("bad", 4, dtype="float64")
    address = client.routing.ps_addresses[0]
    with grpc.insecure_channel(address) as ch:
        stub = ps_pb2_grpc.ParameterServerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateTable(ps_pb2.CreateTableRequest(config=ps_pb2.TableConfig(
                name="bad", dim=4, dtype="int8")), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table 'bad'" in e.value.details() and "dtype" in e.value.details()
    check()
    client.close()


def test_keras_and_tf1_take_storage_dtype():
    """``storage_dtype`` (not Keras's compute ``dtype``): a bad one is refused when the
    model is built, naming the table; the layer's config round-trips it, and an export's
    serving layer accepts that config."""
    pytest.importorskip("tensorflow")
    from deeprec_ext.tf.keras_api import ElasticEmbedding
    with pytest.raises(InvalidRequestError, match="table 'user'.*dtype"):
        ElasticEmbedding(8, table="user", storage_dtype="float64")
    layer = ElasticEmbedding(8, table="user", storage_dtype="float16")
    assert layer.compute_dtype == "float32"  # the Keras dtype is untouched
    cfg = layer.get_config()
    assert cfg["storage_dtype"] == "float16"
    assert ElasticEmbedding.from_config(cfg).storage_dtype == "float16"
    assert "storage_dtype" not in ElasticEmbedding(8, table="u2").get_config()
    import inspect

    from deeprec_ext.tf.tf1_api import embedding_lookup
    assert inspect.signature(embedding_lookup).parameters["storage_dtype"].default == "float32"


def test_planner_counts_two_bytes_per_float16_value():
    """``aimaster estimate``: a float16 table's arena is 2 B per value + 4 B per slot float,
    taken from the layer (Keras) or the recorded table spec (TF1 graphs)."""
    pytest.importorskip("tensorflow")
    import graph_opt
    from graph_opt.memory import table_bytes
    assert table_bytes(1000, 8, 3, value_bytes=2)["arena"] == 1000 * (16 + 96)
    assert table_bytes(1000, 8, 3)["arena"] == 1000 * 128
    kw = {"lr": 1e-3, "dim": 8}
    rows = {"embedding": 1_000_000, "linear": 1_000_000}
    f32 = graph_opt.estimate("examples.criteo.train:build_keras", fn_kwargs=kw, rows=rows)
    f16 = graph_opt.estimate("examples.criteo.train:build_keras",
                             fn_kwargs={**kw, "storage_dtype": "float16"}, rows=rows)
    assert {t.storage_dtype for t in f16.tables} == {"float16"}
    assert {t.storage_dtype for t in f32.tables} == {"float32"}
    # the plan's own memory model: embedding dim 8, linear dim 1, 2 B saved per value on
    # each copy (own rows + the ring replica) of each PS's share
    n_ps = f16.plan.ps.replicas
    assert f32.plan.ps.replicas == n_ps
    copies = f16.ps_memory["copies"]
    share = -(-1_000_000 // n_ps)
    assert f32.ps_memory["arena"] - f16.ps_memory["arena"] == copies * 2 * share * (8 + 1)
    assert any("2 x 8 + 4 x 8 x 3 adam slots" in line for line in f16.arithmetic)
