"""The next batch's rows are looked up while a step trains, and patched with the step's
push (``deeprec_ext.lookahead``): a worker must read exactly what a waited push followed
by a lookup reads, and anything the lookahead cannot follow falls back to a lookup."""
from __future__ import annotations

import numpy as np
import pytest

from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.lookahead import match
from deeprec_ext.worker import WorkerContext
from tests.test_fresh_overlap import _fit


def test_lookahead_switch_takes_only_yes_or_no(monkeypatch):
    from deeprec_ext.lookahead import enabled_by_env
    for on in ("1", "true", "ON", " yes "):
        monkeypatch.setenv("DEEPREC_LOOKAHEAD", on)
        assert enabled_by_env()
    for off in ("0", "false", "Off", "no"):
        monkeypatch.setenv("DEEPREC_LOOKAHEAD", off)
        assert not enabled_by_env()
    monkeypatch.setenv("DEEPREC_LOOKAHEAD", "maybe")
    with pytest.raises(ValueError, match="DEEPREC_LOOKAHEAD must be .* got 'maybe'"):
        enabled_by_env()


def test_match_pairs_equal_ids():
    prev = np.array([9, 4, 7, 1, -3], np.int64)
    nxt = np.array([7, 2, -3, 9, 100], np.int64)
    dst, src = match(prev, nxt)
    np.testing.assert_array_equal(nxt[dst], prev[src])
    assert sorted(nxt[dst].tolist()) == [-3, 7, 9]
    assert match(prev, np.empty(0, np.int64))[0].size == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_keras_lookahead_trains_exactly_like_a_waited_lookup(start_job, overlap):
    """2 PS, heavy id reuse between steps: with the lookahead (and with the push left in
    flight, overlap=True) one worker ends with the rows and dense weights of plain waited
    training, every step after the first reads rows fetched ahead, and rows are patched."""
    job = start_job({"name": f"lookahead-{overlap}"}, ["--ps", "2", "--workers", "0"])
    ref_rows, ref_dense, _ = _fit(job, f"la_ref_{overlap}", False)
    rows, dense, stats = _fit(job, f"la_{overlap}", overlap, look_ahead=True,
                              slow=0.05 if overlap else 0.0)
    assert np.abs(ref_rows).max() > 0.01  # the model trained
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5)
    for a, b in zip(dense, ref_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)
    la = stats["lookahead"]
    assert la["used"] >= 10 and la["dropped"] == 0, la  # 12 steps: from the 2nd on
    assert la["patched_rows"] > 0
    assert stats["ahead_hits"] == la["used"]


def test_keras_lookahead_several_steps_per_execution(start_job):
    """Three steps per call: pushes leave between steps inside the call; rows fetched
    ahead are still patched with exactly the push in between, or dropped."""
    job = start_job({"name": "lookahead-spe"}, ["--ps", "1", "--workers", "0"])
    ref_rows, ref_dense, _ = _fit(job, "las_ref", False)
    rows, dense, stats = _fit(job, "las", False, spe=3, look_ahead=True)
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5)
    for a, b in zip(dense, ref_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert stats["lookahead"]["used"] > 0


def test_keras_lookahead_never_guesses_transformed_ids(start_job):
    """The model looks up ``ids % 250``, not a feature of the batch: nothing is fetched
    ahead (no table ever matches a noted feature) and training is unchanged."""
    import keras
    job = start_job({"name": "lookahead-transformed"}, ["--ps", "1", "--workers", "0"])
    mod = lambda x: keras.ops.mod(x, 250)  # noqa: E731
    ref_rows, _, _ = _fit(job, "lat_ref", False, transform=mod)
    rows, _, stats = _fit(job, "lat", False, look_ahead=True, transform=mod)
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5)
    assert stats["lookahead"]["ahead"] == 0
    assert stats["inflight_kept"] <= 1  # no step's push answer is kept beyond its step


def test_lookahead_counts_every_update_and_drops_after_a_refused_push(start_job):
    """Without TensorFlow: batches noted ahead, 2 PS, sgd with gradient -1 per id per
    step, so a row is the number of pushes that included it. Every step must read the
    exact counts; a push refused mid-way (non-finite gradients) changes nothing, raises,
    and the rows fetched ahead of it are dropped, not patched with its answer."""
    job = start_job({"name": "lookahead-direct"}, ["--ps", "2", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    try:
        for name in ("t", "other"):
            ctx.client.create_table(name, dim=2, initializer="zeros",
                                    optimizer={"name": "sgd", "learning_rate": 1.0})
        rng = np.random.default_rng(0)
        batches = [np.unique(rng.integers(0, 500, 300)).astype(np.int64)
                   for _ in range(8)]
        for b in batches:
            rng.shuffle(b)  # first-seen order, as tf.unique gives it
            ctx.lookahead.note([b])
        counts: dict[int, float] = {}
        for step, ids in enumerate(batches):
            got = ctx.lookup("t", ids)
            want = np.array([counts.get(int(i), 0.0) for i in ids], np.float32)
            np.testing.assert_array_equal(got[:, 0], want)
            np.testing.assert_array_equal(got[:, 1], 2 * want)
            grads = np.tile(np.array([[-1.0, -2.0]], np.float32), (ids.size, 1))
            if step == 4:
                grads[3, 0] = np.nan
                with pytest.raises((InvalidRequestError, ValueError), match="finite|NaN|nan"):
                    ctx.push_async("t", ids, grads)
            else:
                ctx.push_async("t", ids, grads)
                for i in ids:
                    counts[int(i)] = counts.get(int(i), 0.0) + 1.0
            # a second call of the step touching none of t's rows (as a dense sync every
            # N steps is): the rows fetched ahead of t stay usable
            ctx.push_async("other", np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
            ctx.step_done()
        stats = ctx.lookahead.stats
        beat = ctx.gazer.collect("worker-0")  # what the heartbeat carries to Gazer
        assert (beat.lookahead.ahead, beat.lookahead.used, beat.lookahead.dropped,
                beat.lookahead.patched_rows) == (stats["ahead"], stats["used"],
                                                 stats["dropped"], stats["patched_rows"])
        assert stats["used"] >= 5, stats
        assert stats["dropped"] >= 1, stats  # the batch after the refused push
        assert stats["patched_rows"] > 0
        ids = np.array(sorted(counts), np.int64)
        final = ctx.client.lookup("t", ids, insert_missing=False)
        np.testing.assert_array_equal(final[:, 0], [counts[int(i)] for i in ids])
    finally:
        ctx.close()


def test_look_ahead_keeps_elements_and_notes_integer_features_in_order():
    """The dataset's elements come out unchanged (dict + label, a bare tensor, strings
    only); each batch's integer features are noted as ``tf.unique`` orders them."""
    import types

    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from deeprec_ext.lookahead import Lookahead

    la = Lookahead(client=None)
    ctx = types.SimpleNamespace(lookahead=la)
    ids = np.array([[5, 3, 5], [7, 3, 1], [2, 2, 2], [9, 8, 9]], np.int64)
    dense = np.arange(12, dtype=np.float32).reshape(4, 3)
    ds = tf.data.Dataset.from_tensor_slices(({"cat": ids, "dense": dense},
                                             np.ones(4, np.float32))).batch(2)
    got = list(dtf.look_ahead(ds, ctx))
    want = list(ds)
    assert len(got) == 2
    for (gf, gl), (wf, wl) in zip(got, want):
        np.testing.assert_array_equal(gf["cat"], wf["cat"])
        np.testing.assert_array_equal(gf["dense"], wf["dense"])
        np.testing.assert_array_equal(gl, wl)
    noted = [u for _, u in la._noted]
    assert [list(u[0]) for u in noted] == [[5, 3, 7, 1], [2, 9, 8]]  # one int feature each
    bare = list(dtf.look_ahead(tf.data.Dataset.from_tensor_slices(ids).batch(4), ctx))
    np.testing.assert_array_equal(bare[0], ids)
    text = list(dtf.look_ahead(tf.data.Dataset.from_tensor_slices(["a", "b"]).batch(2), ctx))
    assert [t.decode() for t in text[0].numpy()] == ["a", "b"]
    assert len(la._noted) == 3  # the string batch noted nothing


def test_gazer_shows_and_exports_the_lookahead():
    """The worker's counts, as a snapshot carries them: the live view's AHEAD column and
    the Prometheus counters; a worker without counts shows and exports nothing."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry
    from rich.console import Console

    from deeprec_ext.proto import gazer_pb2
    from gazer.prometheus import SnapshotCollector
    from gazer.view import render

    snap = gazer_pb2.Snapshot(job="j")
    w = snap.members.add(id="worker-0", role="worker", state="running", stats_age_seconds=1)
    w.stats.lookahead.ahead, w.stats.lookahead.used = 50, 98
    w.stats.lookahead.dropped, w.stats.lookahead.patched_rows = 2, 4000
    snap.members.add(id="worker-1", role="worker", state="running", stats_age_seconds=1)

    class Plugin:  # the exporter's only call into the AIMaster's Gazer plugin
        def snapshot(self):
            return snap

    console = Console(width=200, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "AHEAD" in text and "98% of 100" in text
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(Plugin()))
    prom = generate_latest(registry).decode()
    assert ('gazer_worker_lookahead_lookups_total{member="worker-0",outcome="used",'
            'role="worker"} 98.0') in prom
    assert 'gazer_worker_lookahead_patched_rows_total{member="worker-0",role="worker"} 4000.0' \
        in prom
    assert 'member="worker-1",outcome' not in prom


def test_a_lookup_ahead_does_not_wait_for_a_push_of_other_tables():
    """The step end's dense sync (other tables) still in flight: the next batch's lookup
    of the embedding table leaves at once; a push of that table in flight holds it back
    until answered (it must read after it)."""
    import threading

    from deeprec_ext.lookahead import Lookahead

    class Client:
        def __init__(self):
            self.calls = []

        def lookup_many(self, requests, insert_missing, unique):
            self.calls.append(sorted(requests))
            return {t: np.zeros((ids.size, 2), np.float32) for t, ids in requests.items()}

    client = Client()
    la = Lookahead(client)
    la.enabled = True
    first, second, third = (np.array(v, np.int64) for v in ([1, 2], [2, 3], [3, 4]))
    la.note([first])
    la.note([second])
    dense, _ = la.before_push({"dense": (np.array([0], np.int64), np.ones((1, 2), np.float32))})
    done = threading.Event()
    threading.Thread(target=lambda: (la.advance("emb", first, ()), done.set()),
                     daemon=True).start()
    assert done.wait(10), "the lookup ahead waited for the dense sync's answer"
    assert la._pending["emb"][0].future.result(10)[0]["emb"].shape == (2, 2)
    assert la.stats["ahead"] == 1 and client.calls == [["emb"]]
    # a push of the table itself in flight: the next lookup ahead waits for its answer
    push, wanted = la.before_push({"emb": (first, np.ones((2, 2), np.float32))})
    assert wanted == {"emb"}
    la.note([third])
    done.clear()
    threading.Thread(target=lambda: (la.advance("emb", second, ()), done.set()),
                     daemon=True).start()
    assert not done.wait(0.3)
    la.answered(push, {"emb": np.zeros((2, 2), np.float32)})
    la.answered(dense, {})
    assert done.wait(10)
    la.close()
