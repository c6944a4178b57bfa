"""Overlap mode keeps lookups fresh: a step's push is in flight while the next step looks
its rows up, and the rows the push changed are taken from the push's answer, so the
worker reads what a synchronous push would have left (one worker: exactly)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from deeprec_ext.worker import WorkerContext


def _slow_pushes(ctx, seconds: float):
    real = ctx.client.push_many

    def slow(*args, **kwargs):
        time.sleep(seconds)  # the push is still in flight when the next lookup leaves
        return real(*args, **kwargs)
    ctx.client.push_many = slow


@pytest.mark.parametrize("fresh", [True, False])
def test_lookup_during_an_inflight_push_reads_its_rows(start_job, fresh):
    job = start_job({"name": f"overlap-{fresh}"}, ["--ps", "2", "--workers", "0"])
    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    try:
        ctx.client.create_table("t", dim=2, initializer="zeros",
                                optimizer={"name": "sgd", "learning_rate": 1.0})
        ctx.async_pushes, ctx.fresh_lookups = True, fresh
        _slow_pushes(ctx, 0.5)
        rng = np.random.default_rng(0)
        expected = {}
        for step in range(4):
            ids = np.unique(rng.integers(0, 3000, 800)).astype(np.int64)
            got = ctx.lookup("t", ids)
            want = np.array([expected.get(int(i), 0.0) for i in ids], np.float32)
            if fresh:  # every earlier push is in what the step reads
                np.testing.assert_array_equal(got[:, 0], want)
                np.testing.assert_array_equal(got[:, 1], 2 * want)
            elif step > 0:  # the previous step's push was still in flight: stale rows
                assert (got[:, 0] != want).any()
            ctx.push_async("t", ids, np.tile(np.array([[-1.0, -2.0]], np.float32), (ids.size, 1)))
            ctx.step_done()
            for i in ids:
                expected[int(i)] = expected.get(int(i), 0.0) + 1.0
        ctx.flush_pushes()
        ids = np.array(sorted(expected), np.int64)
        final = ctx.client.lookup("t", ids, insert_missing=False)
        np.testing.assert_array_equal(final[:, 0], [expected[int(i)] for i in ids])
    finally:
        ctx.close()


def test_overlap_takes_only_its_three_values():
    import deeprec_ext.tf as dtf
    for good in (False, True, "stale", "carry"):
        dtf.ElasticCallback(overlap=good)
    for bad in ("fresh", 1, 0.0, None):
        with pytest.raises(ValueError, match="overlap must be False, True, 'stale' or 'carry'"):
            dtf.ElasticCallback(overlap=bad)


def _fit(job, table: str, overlap, steps: int = 12, slow: float = 0.0, spe: int = 1,
         look_ahead: bool = False, transform=None):
    """Train a small Keras model in this process against the job's real PS with
    ``ElasticCallback(overlap=overlap)``: the final embedding rows, dense weights and
    the batcher's push count (and the lookahead's counts). ``look_ahead``: the dataset
    goes through ``dtf.look_ahead``; ``transform``: applied to the ids in the model."""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import deeprec_ext.tf as dtf
    from deeprec_ext.worker import set_context

    ctx = WorkerContext(master_address=job.address, member_id="worker-0")
    set_context(ctx)
    if slow:
        _slow_pushes(ctx, slow)  # each step's call is surely in flight at the next lookup
    try:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(1)
        # heavy id reuse between consecutive steps: a stale lookup changes the result
        ids = rng.integers(0, 300, (steps * 64, 4)).astype(np.int64)
        labels = (ids.sum(1, keepdims=True) % 3 == 0).astype(np.float32)
        inp = keras.Input((4,), dtype="int64")
        emb = dtf.ElasticEmbedding(4, table=table, initializer="zeros",
                                   optimizer={"name": "sgd", "learning_rate": 20.0})(
            transform(inp) if transform is not None else inp)
        out = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")(
            keras.layers.Flatten()(emb))
        model = keras.Model(inp, out)
        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy", steps_per_execution=spe)
        rpcs = []

        class Count(keras.callbacks.Callback):  # the client's RPCs between first and last step
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 0:
                    rpcs.append(ctx.client.stats["rpcs"])

            def on_train_batch_end(self, batch, logs=None):
                if batch == steps - 1 or (batch == steps - spe and spe > 1):
                    rpcs.append(ctx.client.stats["rpcs"])
        ds = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(64)
        model.fit(dtf.look_ahead(ds).prefetch(2) if look_ahead else ds, epochs=1,
                  verbose=0, shuffle=False,
                  callbacks=[dtf.ElasticCallback(overlap=overlap), Count()])
        uniq = np.unique(ids)
        rows = ctx.client.lookup(table, uniq, insert_missing=False)
        dense = [np.asarray(v.numpy()) for v in model.layers[-1].weights]
        return rows, dense, dict(ctx.batcher.stats, rpcs_in_training=rpcs[1] - rpcs[0],
                                 lookahead=dict(ctx.lookahead.stats),
                                 inflight_kept=len(ctx.lookahead._inflight))
    finally:
        set_context(None)
        ctx.close()


def test_keras_overlap_two_calls_per_step_reads_like_sync(start_job):
    """``overlap=True`` with the dense sync every step: the step's embedding gradients
    leave from the backward pass and the dense deltas at the step's end, both calls left
    in flight while the next step starts. One worker must end with exactly what
    synchronous training leaves (lookups take the rows the push changed from its answer;
    no dense update lost), with two push calls per step where sync makes one;
    ``overlap="stale"`` reads one step old rows and ends elsewhere (the test can tell)."""
    job = start_job({"name": "keras-overlap"}, ["--ps", "1", "--workers", "0"])
    sync_rows, sync_dense, sync_stats = _fit(job, "e_sync", False)
    rows, dense, stats = _fit(job, "e_fresh", True, slow=0.05)
    stale_rows, _, _ = _fit(job, "e_stale", "stale", slow=0.05)
    assert np.abs(sync_rows).max() > 0.01  # the model trained
    np.testing.assert_allclose(rows, sync_rows, atol=1e-5)
    for a, b in zip(dense, sync_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert stats["push_calls"] == 2 * sync_stats["push_calls"]  # embeddings, then dense
    assert np.abs(stale_rows - sync_rows).max() > 100 * max(np.abs(rows - sync_rows).max(), 1e-6)


def test_keras_carry_one_rpc_per_step_reads_like_sync(start_job):
    """``overlap="carry"``: the step end sends nothing, the step's push and dense deltas
    ride in the next step's lookup call, which the PS applies before it reads. One worker
    ends with what waited pushes leave (rows and dense weights), with one RPC per step
    (1 PS), and the push held after the last step is not lost (train end flushes it)."""
    job = start_job({"name": "keras-carry"}, ["--ps", "1", "--workers", "0"])
    sync_rows, sync_dense, _ = _fit(job, "c_sync", False)
    rows, dense, stats = _fit(job, "c_carry", "carry")
    assert np.abs(sync_rows).max() > 0.01
    np.testing.assert_allclose(rows, sync_rows, atol=1e-5)
    for a, b in zip(dense, sync_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # 12 steps: 11 pushes carried by the next step's lookup, the last one flushed
    assert stats["carried"] == 11
    assert stats["rpcs_in_training"] == 12  # one call per step, nothing at the step ends


@pytest.mark.parametrize("overlap", [False, "carry"])
def test_keras_several_steps_per_execution_lose_no_push(start_job, overlap):
    """``steps_per_execution=3``: Keras runs 3 steps in one call and the callback sees
    their end once. The pushes held for the step end (the default with the dense sync
    every step, and carry mode) must still leave one step at a time: each step's push is
    applied before the next step looks its rows up, and none replaces another's."""
    job = start_job({"name": f"keras-spe-{overlap}"}, ["--ps", "1", "--workers", "0"])
    ref_rows, ref_dense, _ = _fit(job, f"s_ref_{overlap}", False)
    rows, dense, stats = _fit(job, f"s_spe_{overlap}", overlap, spe=3)
    assert np.abs(ref_rows).max() > 0.01
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5)
    for a, b in zip(dense, ref_dense):
        np.testing.assert_allclose(a, b, atol=1e-5)
