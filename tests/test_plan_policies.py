"""The planner under admission and eviction: rows planned for the admitted ids and the live
window, checked against a replay of the same batches through the real store."""
from __future__ import annotations

import json

import numpy as np
import pytest

import graph_opt
from graph_opt.api import EstimateError
from graph_opt.memory import index_capacity, table_bytes
from graph_opt.plan import PlanInputs
from graph_opt.sketch import batch_occurrences, policy_timeline

IDS_PER_RECORD = 4
BATCH = 64


def sliding_model(admission=None, eviction=None):
    """One ElasticEmbedding over a record's ids, declaring the table's policies."""
    import keras

    import deeprec_ext.tf as dtf
    inp = keras.Input((IDS_PER_RECORD,), dtype="int64", name="ids")
    emb = dtf.ElasticEmbedding(4, table="emb", optimizer={"name": "sgd", "learning_rate": 0.1},
                               admission=admission, eviction=eviction)(inp)
    out = keras.layers.Dense(1)(keras.layers.Flatten()(emb))
    return keras.Model(inp, out)


def parse_ids(lines):
    """``"id id id id"`` lines -> int64 [n, IDS_PER_RECORD]."""
    import tensorflow as tf
    return tf.strings.to_number(tf.strings.split(lines).to_tensor(), tf.int64)


def sliding_stream(records: int, seed: int = 3) -> np.ndarray:
    """int64 [records, IDS_PER_RECORD]: a Zipf head of 200 ids (half the ids) plus a tail
    whose live set slides: ids drawn from the 400 newest of a stream that moves on by one
    id per record, each seen for a while and then never again."""
    rng = np.random.default_rng(seed)
    head = np.minimum(rng.zipf(1.3, (records, IDS_PER_RECORD // 2)), 200) - 1
    tail = 1000 + np.arange(records)[:, None] + rng.integers(0, 400, (records, IDS_PER_RECORD // 2))
    return np.concatenate([head, tail], axis=1).astype(np.int64)


def write_stream(path, ids: np.ndarray) -> str:
    with open(path, "w") as f:
        f.write("\n".join(" ".join(map(str, r)) for r in ids.tolist()) + "\n")
    return str(path)


def replay_store(ids: np.ndarray, admission, eviction, evict_every: int = 1) -> dict:
    """The same batches through a real store table: lookup (counts admission, creates
    rows), push (one step), and every ``evict_every`` steps an eviction run (a PS runs it
    every ``interval_seconds``)."""
    from deeprec_ext.store import EmbeddingStore
    store = EmbeddingStore()
    t = store.create_table("emb", 4, "zeros", {"name": "sgd", "learning_rate": 0.1},
                           admission=admission, eviction=eviction)
    peak = 0
    for i, b in enumerate(range(0, ids.shape[0], BATCH)):
        uk = np.unique(ids[b:b + BATCH])  # the client de-duplicates a batch
        t.lookup(uk)
        t.apply_gradients(uk, np.zeros((uk.size, 4), np.float32))
        if i % evict_every == evict_every - 1:
            t.evict()
        peak = max(peak, t.size)
    s = store.stats()["emb"]
    return {"peak": peak, "rows": s["rows"], "candidates": s.get("candidates", 0),
            "evicted": s.get("evicted", 0)}


def test_policy_timeline_by_hand():
    # batches 0..9; id 1 every batch, id 2 at 0,1 then 8, id 3 at 0 only, id 4 at 0 and 5
    pairs = [(1, b) for b in range(10)] + [(2, 0), (2, 1), (2, 8), (3, 0), (4, 0), (4, 5),
                                            (1, 3)]  # a duplicate in one batch counts once
    ids, batch = batch_occurrences(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
    assert ids.size == 16
    plain = policy_timeline(ids, batch, 10)
    assert plain["rows"].tolist() == [4] * 10 and plain["distinct"][-1] == 4
    # min_count 2: id 1 from batch 1, id 2 from batch 1, id 4 from batch 5; id 3 never
    adm = policy_timeline(ids, batch, 10, min_count=2)
    assert adm["rows"].tolist() == [0, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    assert adm["candidates"].tolist() == [4, 2, 2, 2, 2, 1, 1, 1, 1, 1]  # id 3 waits for ever
    # + steps_to_live 2: a row updated at batch b lives through b + 2 (the store's rule)
    ev = policy_timeline(ids, batch, 10, min_count=2, steps_to_live=2)
    # id 2: admitted at 1, evicted at 4, back at 8 counting from zero; id 4: admitted at 5,
    # evicted at 8
    assert ev["rows"].tolist() == [0, 2, 2, 2, 1, 2, 2, 2, 1, 1]
    assert ev["candidates"].tolist() == [4, 2, 2, 2, 2, 1, 1, 1, 2, 2]
    assert ev["evicted"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert ev["admitted"][-1] == 3
    # a bloom filter's counts are never reset: id 2 is admitted again at once at 8
    bl = policy_timeline(ids, batch, 10, min_count=2, steps_to_live=2, bloom=True)
    assert bl["rows"].tolist() == [0, 2, 2, 2, 1, 2, 2, 2, 2, 2]


def test_memory_model_under_churn():
    # tombstones fill the index too: a rehash keeps the capacity only while 8 x rows <= 3 x cap
    assert index_capacity(400_000) == 1 << 20 and index_capacity(400_000, churn=True) == 1 << 21
    plain, ev = table_bytes(100_000, 8, 1), table_bytes(100_000, 8, 1, evicting=True)
    assert ev["row_arrays"] - plain["row_arrays"] == 800_000  # row_step: 8 B a row


def test_estimate_plans_live_window_and_candidates(tmp_path):
    """Rows planned from a sample, against a real store fed the same batches."""
    records = 12_000
    ids = sliding_stream(records)
    data = write_stream(tmp_path / "stream.txt", ids)
    adm, ev = {"min_count": 2}, {"steps_to_live": 20, "interval_seconds": 1}
    common = dict(data=[data], parse="tests.test_plan_policies:parse_ids",
                  sample_records=records,
                  # 4 steps a second: the 1 s eviction interval keeps rows up to 4 steps longer
                  plan_inputs=PlanInputs(batch_size=BATCH, steps_per_second=4.0))
    plain = graph_opt.estimate("tests.test_plan_policies:sliding_model", **common)
    est = graph_opt.estimate("tests.test_plan_policies:sliding_model",
                             fn_kwargs={"admission": adm, "eviction": ev}, **common)
    t, p = est.tables[0], plain.tables[0]
    assert (t.admission, t.eviction) == (adm, {**ev, "interval_seconds": 1.0})  # the layer's
    truth = replay_store(ids, adm, ev, evict_every=5)
    exact = replay_store(ids, adm, ev)  # eviction after every step: the window alone
    distinct = np.unique(ids).size
    assert abs(p.rows / distinct - 1) < 0.03 and t.rows_all_ids == p.rows
    # the live window, not the stream: a small fraction of the distinct ids
    assert t.rows < 0.25 * distinct
    # the plan holds rows for the window + one interval: at or above the store's peak when
    # it evicts every 5 steps, not far above it
    assert truth["peak"] <= t.rows <= 1.1 * truth["peak"], (t.rows, truth)
    assert t.rows > 1.1 * exact["peak"]  # the interval does count
    # candidates: exact counters, never evicted, counting again after an eviction
    assert abs(t.candidate_rows / truth["candidates"] - 1) < 0.05, (t.candidate_rows, truth)
    assert "+ 4 steps of the 1 s eviction interval" in t.rows_reason
    assert "steps_to_live 20" in t.rows_reason and "min_count 2" in t.rows_reason
    # both in the memory plan: a companion table of candidates, churn-sized tables
    names = [x["name"] for x in est.ps_memory["per_table"]]
    assert "emb::admission" in names
    assert est.plan.ps.estimated_rss_bytes < plain.plan.ps.estimated_rss_bytes
    d = json.loads(json.dumps(est.to_dict()))
    assert d["tables"][0]["rows"] == t.rows and d["tables"][0]["candidate_rows"] == t.candidate_rows
    assert d["tables"][0]["eviction"]["steps_to_live"] == 20


def test_window_longer_than_sample_and_bloom(tmp_path):
    records = 4_000
    ids = sliding_stream(records, seed=5)
    data = write_stream(tmp_path / "stream.txt", ids)
    common = dict(data=[data], parse="tests.test_plan_policies:parse_ids",
                  plan_inputs=PlanInputs(batch_size=BATCH))
    # a window of 10,000 batches holds the whole data: every admitted id is live
    est = graph_opt.estimate("tests.test_plan_policies:sliding_model",
                             eviction={"emb": {"steps_to_live": 10_000}},
                             sample_records=2_000, **common)
    t = est.tables[0]
    assert "longer than half the sample" in t.rows_reason
    assert 0.9 < t.rows / np.unique(ids).size < 1.25  # Heaps from the half sample
    # bloom: the filter's fixed size, whatever the stream
    est = graph_opt.estimate("tests.test_plan_policies:sliding_model",
                             admission={"emb": {"min_count": 3, "bloom": {"capacity": 100_000,
                                                                          "fpp": 0.01}}},
                             sample_records=records, **common)
    t = est.tables[0]
    # 958,506 cells -> 234 per slot -> 240 (whole blocks of 16) x 4096 slots / 16
    assert (t.candidate_rows, t.candidate_dim) == (4096 * 240 // 16, 16)
    assert "bloom filter: 958,506 cells" in t.rows_reason


def test_cli_policies_text_json_and_bad_spec(tmp_path, capsys):
    from aimaster.cli import main
    data = write_stream(tmp_path / "stream.txt", sliding_stream(3_000))
    base = ["estimate", "tests.test_plan_policies:sliding_model", "--data", data,
            "--parse", "tests.test_plan_policies:parse_ids", "--batch-size", str(BATCH),
            "--steps-per-second", "2"]
    assert main(base + ["--admission", "emb={min_count: 2}",
                        "--eviction", "emb={steps_to_live: 10}"]) == 0
    out = capsys.readouterr().out
    assert "policies: admission {'min_count': 2}" in out and "rows planned" in out
    assert "rows planned under its policies: admission min_count 2" in out
    assert main(base + ["--eviction", "emb={steps_to_live: 10, interval_seconds: 1}",
                        "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tables"][0]["rows"] < d["tables"][0]["rows_all_ids"]
    for flag, spec, msg in (("--admission", "emb={min_count: 0}", "admission.min_count"),
                            ("--eviction", "emb={steps_to_live: -1}", "steps_to_live must be"),
                            ("--steps-per-second", "0", "--steps-per-second must be > 0"),
                            ("--admission", "nosuch={min_count: 2}", "no elastic table named")):
        assert main(base + [flag, spec]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_policies_survive_in_a_graph_file(tmp_path):
    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from graph_opt.inventory import planning_context
    g = tf.Graph()
    with g.as_default(), planning_context():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 4], name="ids")
        dtf.embedding_lookup("emb", ids, 4, admission={"min_count": 3},
                             eviction={"steps_to_live": 50})
        path = str(tmp_path / "model.meta")
        tf.compat.v1.train.export_meta_graph(filename=path)
    t = graph_opt.estimate(path, rows={"emb": 1000}).tables[0]
    assert t.admission == {"min_count": 3} and t.eviction["steps_to_live"] == 50
    with pytest.raises(EstimateError, match="table 'emb': admission.bloom.fpp"):
        graph_opt.estimate(path, rows={"emb": 1000},
                           admission={"emb": {"min_count": 2,
                                              "bloom": {"capacity": 10, "fpp": 2}}})
