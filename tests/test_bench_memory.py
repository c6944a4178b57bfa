"""The memory benchmark's stream and AUC (bench/bench_memory.py): cheap checks, no PS."""
from __future__ import annotations

import numpy as np

from bench.bench_memory import Stream, auc


def test_auc_counts_ties_as_one_half_and_matches_pairs():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.4
    s = np.round(rng.normal(size=300), 1)  # many ties
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert abs(auc(y, s) - pairs) < 1e-12
    assert auc(y, np.zeros(300)) == 0.5


def test_tail_ids_slide_and_never_come_back():
    st = Stream(samples=100_000, fields=10, head=1000, seed=1)
    rng = np.random.default_rng(1)
    early = st.ids(rng, 0, 2000)[:, st.head_fields:]
    late = st.ids(rng, 90_000, 2000)[:, st.head_fields:]
    assert early.min() >= st.head and late.min() >= st.head
    assert late.min() > early.max()  # the window moved past every early tail id
    assert (st.ids(rng, 0, 2000)[:, :st.head_fields] < st.head).all()
    # each tail id is seen about 8 times over the run
    ids = st.ids(np.random.default_rng(2), 0, st.samples)[:, st.head_fields:]
    seen = np.unique(ids, return_counts=True)[1]
    assert 6 < seen.mean() < 10
