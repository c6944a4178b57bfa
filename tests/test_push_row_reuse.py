"""A push takes the rows of its keys from the lookup of the same keys (no second index
probe) only while no row of the index changed; any change falls back to a probe, and
every path must leave what a table without the reuse leaves."""
from __future__ import annotations

import numpy as np
import pytest

from deeprec_ext.store.table import EmbeddingTable

OPT = {"name": "adagrad", "learning_rate": 0.1}


def _table(name="t"):
    return EmbeddingTable(name, 4, initializer={"name": "normal", "stddev": 0.1, "seed": 1},
                          optimizer=OPT)


def _reference(steps):
    """The same steps on a table whose pushes always probe (no lookup kept)."""
    ref = _table()
    for keys, grads, between in steps:
        ref.lookup(keys)
        ref._recent.clear()
        if between is not None:
            between(ref)
            ref._recent.clear()
        ref.apply_gradients(keys, grads)
    return ref


def _check_same(a, b, keys):
    np.testing.assert_array_equal(a.lookup(keys, insert_missing=False),
                                  b.lookup(keys, insert_missing=False))


def test_push_reuses_the_rows_of_its_lookup():
    rng = np.random.default_rng(0)
    t = _table()
    steps = []
    for _ in range(5):
        keys = np.unique(rng.integers(0, 400, 150)).astype(np.int64)
        rng.shuffle(keys)
        steps.append((keys, rng.normal(size=(keys.size, 4)).astype(np.float32), None))
    for keys, grads, _ in steps:
        t.lookup(keys)
        t.apply_gradients(keys, grads)
    assert t.recalls == 5
    _check_same(t, _reference(steps), np.arange(400, dtype=np.int64))


def test_apply_and_lookup_reuses_and_returns_the_updated_rows():
    t, ref = _table(), _table()
    keys = np.array([5, 3, 9, 1], np.int64)
    grads = np.ones((4, 4), np.float32)
    t.lookup(keys)
    ref.lookup(keys)
    ref._recent.clear()
    np.testing.assert_array_equal(t.apply_and_lookup(keys, grads),
                                  ref.apply_and_lookup(keys, grads))
    assert t.recalls == 1 and ref.recalls == 0


def test_a_deleted_key_between_lookup_and_push_is_probed_again():
    """The key's row is freed and may be handed to another key: reusing it would update
    the wrong row. The push must probe, recreate the key and update the new row."""
    keys = np.array([10, 11, 12, 13], np.int64)
    grads = np.full((4, 4), 0.5, np.float32)

    def between(table):
        table.delete(np.array([11], np.int64))
        table.lookup(np.array([99, 98], np.int64))  # may take the freed row

    t = _table()
    t.lookup(keys)
    between(t)
    t.apply_gradients(keys, grads)
    assert t.recalls == 0
    ref = _reference([(keys, grads, between)])
    _check_same(t, ref, np.array([10, 11, 12, 13, 98, 99], np.int64))


def test_keys_changed_by_the_caller_after_the_lookup_are_not_matched():
    t = _table()
    keys = np.array([1, 2, 3], np.int64)
    t.lookup(keys)
    keys[1] = 7  # the caller reuses its buffer: the table kept its own copy
    t.apply_gradients(keys, np.ones((3, 4), np.float32))
    assert t.recalls == 0
    ref = _table()
    ref.lookup(np.array([1, 2, 3], np.int64))
    ref.apply_gradients(np.array([1, 7, 3], np.int64), np.ones((3, 4), np.float32))
    _check_same(t, ref, np.array([1, 2, 3, 7], np.int64))


def test_another_order_or_subset_probes():
    t = _table()
    keys = np.array([4, 8, 15, 16], np.int64)
    t.lookup(keys)
    t.apply_gradients(keys[::-1].copy(), np.ones((4, 4), np.float32))
    t.apply_gradients(keys[:2].copy(), np.ones((2, 4), np.float32))
    assert t.recalls == 0


def test_a_small_push_reuses_the_rows_of_the_last_push():
    """A dense variable's table: never looked up while training, every push the same
    keys. From the second push on its rows come from the last push, until a row of the
    index changes; the values stay those of a table that always probes."""
    keys = np.arange(6, dtype=np.int64)
    t, ref = _table(), _table()
    rng = np.random.default_rng(3)
    for i in range(4):
        grads = rng.normal(size=(6, 4)).astype(np.float32)
        ref._recent.clear()
        np.testing.assert_array_equal(t.apply_and_lookup(keys, grads),
                                      ref.apply_and_lookup(keys, grads))
        assert t.recalls == i and ref.recalls == 0
    for table in (t, ref):  # a freed row that another key may take: probed again
        table.delete(np.array([2], np.int64))
        table.lookup(np.array([50], np.int64))
    ref._recent.clear()  # t keeps its memo of the last push: the index version refuses it
    grads = np.ones((6, 4), np.float32)
    np.testing.assert_array_equal(t.apply_and_lookup(keys, grads),
                                  ref.apply_and_lookup(keys, grads))
    assert t.recalls == 3
    _check_same(t, ref, np.array([0, 1, 2, 3, 4, 5, 50], np.int64))
    big = np.arange(10_000, dtype=np.int64)  # an embedding push: not kept
    t.apply_and_lookup(big, np.zeros((big.size, 4), np.float32))
    t.apply_and_lookup(big, np.zeros((big.size, 4), np.float32))
    assert t.recalls == 3


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd", "ftrl"])
def test_the_optimizer_buffers_are_kept_between_pushes_and_change_nothing(optimizer):
    """The gather and plane-major buffers of a push are reused (a PS's 1 MB mmap threshold
    made each a new mapping) and grown for a larger push; every row ends as a table
    applying the same pushes through fresh buffers (one push per fresh table) has it."""
    rng = np.random.default_rng(3)
    init = {"name": "normal", "stddev": 0.1, "seed": 1}
    t = EmbeddingTable("t", 8, optimizer=optimizer, initializer=init)
    keys = np.unique(rng.integers(0, 2**40, 40_000)).astype(np.int64)
    t.lookup(keys)
    ref = EmbeddingTable("r", 8, optimizer=optimizer, initializer=init)
    ref.lookup(keys)
    pushes = [keys[:5000], keys[3000:20000], keys[::3], keys[:100]]
    seen = []
    for i, k in enumerate(pushes):
        g = rng.standard_normal((k.size, 8)).astype(np.float32)
        t.apply_gradients(k, g)
        seen.append(t._scratch)
        ref._scratch = None  # fresh buffers for every push
        ref.apply_gradients(k, g)
    assert seen[0] is not seen[1]  # grown for the larger push
    assert seen[1] is seen[2] is seen[3]  # then kept
    np.testing.assert_array_equal(t.export_keys(keys)[1], ref.export_keys(keys)[1])
