"""The dense sync reads and assigns a model's variables in one TF call each."""
from __future__ import annotations

import keras
import numpy as np

from deeprec_ext.tf.keras_api import _VarBlock


def _vars(dtypes):
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (3,), (), (2, 1)]
    return [keras.Variable(np.asarray(rng.random(s), d), dtype=d) for s, d in zip(shapes, dtypes)]


def test_fused_read_and_assign_match_the_variables():
    vs = _vars(["float32"] * 4)
    block = _VarBlock(vs)
    assert block.fused
    got = block.read()
    assert [g.shape for g in got] == [(4, 3), (3,), (), (2, 1)]
    assert all(np.array_equal(g, v.numpy()) for g, v in zip(got, vs))
    new = [np.full(v.shape, i + 0.5, np.float32) for i, v in enumerate(vs)]
    block.assign(new)
    assert all(np.array_equal(n, v.numpy()) for n, v in zip(new, vs))
    before = [g.copy() for g in block.read()]
    block.assign([n * 2 for n in new])  # a read is a copy: later assigns do not change it
    assert all(np.array_equal(b, n) for b, n in zip(before, new))


def test_mixed_dtypes_are_handled_one_by_one():
    vs = _vars(["float32", "float16", "float32", "float32"])
    block = _VarBlock(vs)
    assert not block.fused
    new = [np.full(v.shape, 1.5, v.dtype) for v in vs]
    block.assign(new)
    assert all(np.array_equal(g, n) for g, n in zip(block.read(), new))
