"""Synthetic Criteo display-ads data with a planted, learnable signal.

Writes files in the exact Criteo display-advertising challenge format: one
record per line, 40 tab-separated columns, no header::

    label  I1 .. I13  C1 .. C26

* ``label`` is ``0``/``1``.
* ``I1..I13`` are integer counts (skewed, mostly non-negative, may be empty =
  missing; ``I2`` occasionally holds ``-1`` like the real data).
* ``C1..C26`` are 8-hex-digit lowercase strings (may be empty = missing).

Categorical values are Zipf distributed over a per-column vocabulary.  Every
(column, value index) pair renders to a distinct hex string.  The label is
``Bernoulli(sigmoid(bias + scale * z))`` where ``z`` combines

* first-order hidden weights of the values of a subset of columns,
* a few low-rank pairwise interaction terms between columns (what an FM /
  DeepFM can pick up and a purely linear model cannot),
* a linear term in ``log1p`` of a few integer features.

The hidden parameters, the ``scale`` and the ``bias`` depend only on the seed
and the vocabulary sizes (``scale`` and ``bias`` are calibrated on a fixed
calibration sample so that the positive rate is ~25 %).  Train and test rows
are drawn from the same distribution with independent random streams.

Everything is vectorized with numpy, including the text rendering (lines are
assembled in a byte matrix and compacted with a boolean mask), so one million
rows take a few seconds.

Command line::

    python -m examples.criteo.generate --out DIR --rows N --files K \
        --test-rows M --seed S
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

NUM_DENSE = 13
NUM_CAT = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT

# Default per-column vocabulary sizes: real Criteo (Kaggle) cardinalities,
# clipped to [10, 20000].  Total 207,411 distinct values.
DEFAULT_VOCAB_SIZES = (
    1460, 583, 20000, 20000, 305, 24, 12517, 633, 10, 20000, 5683, 20000, 3194,
    27, 14992, 20000, 10, 5652, 2173, 10, 20000, 18, 15, 20000, 105, 20000,
)

# Fraction of missing values per categorical column (real data has a few
# heavily-missing columns; the overall rate here is a few percent).
CAT_MISSING_RATE = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.04, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.25, 0.25, 0.03, 0.25, 0.0, 0.03, 0.25, 0.25,
)

# Integer features: missing rate (as in the real data), log-normal location
# and spread of the counts.
INT_MISSING_RATE = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04,
                    0.45, 0.04, 0.77, 0.22)
INT_LOG_MU = (0.5, 2.0, 1.8, 1.5, 7.5, 3.0, 1.2, 2.0, 3.0, -0.5, 0.5, -1.0,
              1.5)
INT_LOG_SIGMA = (1.2, 1.8, 1.4, 1.0, 2.0, 1.8, 1.6, 1.0, 1.5, 1.0, 1.0, 1.5,
                 1.2)
INT_NEG_COLUMN = 1          # I2 (0-based 1) sometimes holds -1
INT_NEG_RATE = 0.03

# Planted signal.  Column indices are 0-based into C1..C26 / I1..I13.
SIGNAL_COLUMNS = (0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 12, 13, 14, 16, 18, 21, 23,
                  24)
INTERACTIONS = ((0, 5), (4, 7), (13, 24), (10, 16))   # (Ca, Cb) pairs
INTERACTION_RANK = 4
SIGNAL_INT_COLUMNS = (0, 4, 6, 10)   # I1, I5, I7, I11
# Relative weights of the (unit-variance normalized) components.
W_LINEAR, W_INTERACTION, W_INT = 1.0, 1.0, 0.45
TARGET_LOGIT_STD = 2.2
TARGET_POSITIVE_RATE = 0.25
CALIBRATION_ROWS = 100_000

_CHUNK_ROWS = 100_000
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_MAX_VOCAB = 1 << 26


# --------------------------------------------------------------------------
# hidden parameters
# --------------------------------------------------------------------------

def _mix32(x: np.ndarray) -> np.ndarray:
    """Bijective 32-bit integer mixer (lowbias32)."""
    x = x.astype(np.uint32, copy=True)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


class _Spec:
    """Hidden parameters of the synthetic distribution (seed-determined)."""

    def __init__(self, seed: int, vocab_sizes, zipf_a: float):
        vocab_sizes = tuple(int(v) for v in vocab_sizes)
        if len(vocab_sizes) != NUM_CAT:
            raise ValueError(f"need {NUM_CAT} vocab sizes, got {len(vocab_sizes)}")
        if min(vocab_sizes) < 1 or max(vocab_sizes) > _MAX_VOCAB:
            raise ValueError(f"vocab sizes must be in [1, {_MAX_VOCAB}]")
        self.seed = int(seed)
        self.vocab_sizes = vocab_sizes
        self.zipf_a = float(zipf_a)
        rng = np.random.default_rng([self.seed, 0])

        # Zipf CDFs (rank r has probability ~ 1 / r**a).  A random
        # permutation maps ranks to value indices so that popularity is not
        # tied to the index.
        self.cdfs, self.rank_to_index = [], []
        for v in vocab_sizes:
            p = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** self.zipf_a
            c = np.cumsum(p)
            c /= c[-1]
            self.cdfs.append(c)
            self.rank_to_index.append(rng.permutation(v).astype(np.int64))

        # Hex string (as uint32) of every (column, index); index v (== vocab)
        # is the "missing" slot.  key = col << 26 | index is unique and
        # _mix32 is a bijection, so strings are unique across columns too.
        salt = np.uint32(rng.integers(0, 2**32, dtype=np.uint64))
        self.hex_codes = []
        for j, v in enumerate(vocab_sizes):
            key = (np.uint32(j) << np.uint32(26)) | np.arange(v, dtype=np.uint32)
            self.hex_codes.append(_mix32(key ^ salt))

        # First-order weights (extra trailing 0 for "missing").
        self.weights = {}
        for j in SIGNAL_COLUMNS:
            w = rng.normal(0.0, 1.0, size=vocab_sizes[j] + 1)
            w[-1] = 0.0
            self.weights[j] = w
        # Low-rank interaction vectors.
        self.vectors = {}
        for a, b in INTERACTIONS:
            for j in (a, b):
                if j not in self.vectors:
                    vec = rng.normal(0.0, 1.0, size=(vocab_sizes[j] + 1,
                                                     INTERACTION_RANK))
                    vec[-1] = 0.0
                    self.vectors[j] = vec
        self.int_betas = rng.choice([-1.0, 1.0], size=len(SIGNAL_INT_COLUMNS)) \
            * rng.uniform(0.5, 1.0, size=len(SIGNAL_INT_COLUMNS))

        # Calibrate component normalization, overall scale and bias on a
        # fixed calibration sample.
        self._norm = (1.0, 1.0, 1.0)
        cal = self.sample(np.random.default_rng([self.seed, 1]),
                          CALIBRATION_ROWS, raw=True)
        lin, inter, ints = cal
        self._norm = (1.0 / max(lin.std(), 1e-9),
                      1.0 / max(inter.std(), 1e-9),
                      1.0 / max(ints.std(), 1e-9))
        self._mean = (lin.mean(), inter.mean(), ints.mean())
        z = self._combine(lin, inter, ints)
        self.scale = TARGET_LOGIT_STD / max(z.std(), 1e-9)
        z = z * self.scale
        lo, hi = -20.0, 20.0
        for _ in range(60):     # bisection for the target positive rate
            mid = 0.5 * (lo + hi)
            if _sigmoid(mid + z).mean() < TARGET_POSITIVE_RATE:
                lo = mid
            else:
                hi = mid
        self.bias = 0.5 * (lo + hi)

    def _combine(self, lin, inter, ints):
        return (W_LINEAR * (lin - self._mean[0]) * self._norm[0]
                + W_INTERACTION * (inter - self._mean[1]) * self._norm[1]
                + W_INT * (ints - self._mean[2]) * self._norm[2])

    def sample(self, rng: np.random.Generator, n: int, raw: bool = False):
        """Draw ``n`` rows.

        Returns ``(label int8[n], ints int64[n,13], int_missing bool[n,13],
        cat_index int64[n,26] (== vocab for missing), logit float64[n])``, or
        the raw signal components when ``raw``.
        """
        # categorical
        cat = np.empty((n, NUM_CAT), dtype=np.int64)
        for j, v in enumerate(self.vocab_sizes):
            u = rng.random(n)
            rank = np.searchsorted(self.cdfs[j], u, side="right")
            np.minimum(rank, v - 1, out=rank)
            idx = self.rank_to_index[j][rank]
            if CAT_MISSING_RATE[j] > 0:
                idx[rng.random(n) < CAT_MISSING_RATE[j]] = v
            cat[:, j] = idx
        # integer
        g = rng.normal(size=(n, NUM_DENSE))
        g = g * np.asarray(INT_LOG_SIGMA) + np.asarray(INT_LOG_MU)
        ints = np.floor(np.clip(np.expm1(np.minimum(g, 20.0)), 0.0, None))
        ints = ints.astype(np.int64)
        neg = rng.random(n) < INT_NEG_RATE
        ints[neg, INT_NEG_COLUMN] = -1
        int_missing = rng.random((n, NUM_DENSE)) < np.asarray(INT_MISSING_RATE)

        # signal
        lin = np.zeros(n)
        for j in SIGNAL_COLUMNS:
            lin += self.weights[j][cat[:, j]]
        inter = np.zeros(n)
        for a, b in INTERACTIONS:
            inter += np.einsum("nk,nk->n", self.vectors[a][cat[:, a]],
                               self.vectors[b][cat[:, b]])
        logx = np.log1p(np.where(int_missing, 0, np.maximum(ints, 0)))
        int_term = logx[:, list(SIGNAL_INT_COLUMNS)] @ self.int_betas
        if raw:
            return lin, inter, int_term
        logit = self.bias + self.scale * self._combine(lin, inter, int_term)
        label = (rng.random(n) < _sigmoid(logit)).astype(np.int8)
        return label, ints, int_missing, cat, logit


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# --------------------------------------------------------------------------
# vectorized rendering
# --------------------------------------------------------------------------

def _render(spec: _Spec, label, ints, int_missing, cat) -> bytes:
    """Render rows to Criteo-format text (bytes) without a per-row loop.

    Every field gets a fixed-width, right-aligned slot in a field-major byte
    matrix; a boolean mask marks the bytes that belong to the output and the
    final compaction ``buf.T[mask.T]`` yields the lines in row order.
    """
    n = label.shape[0]
    absv = np.abs(ints)
    small = int(absv.max(initial=0)) < 2**32
    absv = absv.astype(np.uint32 if small else np.uint64)
    col_max = absv.max(axis=0, initial=0)
    widths = [len(str(int(m))) + 1 for m in col_max]       # + sign
    total = 1 + sum(widths) + 8 * NUM_CAT + NUM_COLUMNS    # tabs + newline
    buf = np.empty((total, n), dtype=np.uint8)
    mask = np.empty((total, n), dtype=bool)

    o = 0
    buf[o] = 48 + label
    mask[o] = True
    o += 1
    ten = absv.dtype.type(10)
    for j in range(NUM_DENSE):
        buf[o] = 9
        mask[o] = True
        o += 1
        w = widths[j]
        v = absv[:, j]
        # length of the rendered field: digits (+ sign), 0 when missing
        length = np.ones(n, dtype=np.int64)
        p = 10
        while p <= col_max[j]:
            length += v >= p
            p *= 10
        neg = ints[:, j] < 0
        length += neg
        length[int_missing[:, j]] = 0
        for k in range(w):
            buf[o + w - 1 - k] = v % ten
            buf[o + w - 1 - k] += 48
            v = v // ten
            mask[o + w - 1 - k] = length > k
        if neg.any():
            rows = np.nonzero(neg)[0]
            buf[o + w - length[rows], rows] = ord("-")
        o += w
    codes_missing = np.zeros(1, np.uint32)
    for j in range(NUM_CAT):
        buf[o] = 9
        mask[o] = True
        o += 1
        v = spec.vocab_sizes[j]
        h = np.concatenate([spec.hex_codes[j], codes_missing])[cat[:, j]]
        for k in range(8):
            buf[o + 7 - k] = _HEX[(h >> np.uint32(4 * k)) & np.uint32(15)]
        mask[o:o + 8] = (cat[:, j] != v)[None, :]
        o += 8
    buf[o] = 10
    mask[o] = True
    assert o + 1 == total
    return buf.T[mask.T].tobytes()


def _write(spec: _Spec, rng: np.random.Generator, path: str, rows: int):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        done = 0
        while done < rows:
            n = min(_CHUNK_ROWS, rows - done)
            label, ints, int_missing, cat, _ = spec.sample(rng, n)
            f.write(_render(spec, label, ints, int_missing, cat))
            done += n
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------

def generate(out_dir, rows, files=1, test_rows=0, seed=0, vocab_sizes=None,
             zipf_a=1.1) -> dict:
    """Write ``rows`` training rows split evenly over ``files`` files
    (``train-00000.txt`` ...) and ``test_rows`` rows to ``test.txt``.

    Output is a deterministic function of all arguments.  Returns
    ``{"train": [paths], "test": path or None}``.
    """
    rows, files, test_rows = int(rows), int(files), int(test_rows)
    if rows < 0 or test_rows < 0 or files < 1:
        raise ValueError("rows/test_rows must be >= 0 and files >= 1")
    os.makedirs(out_dir, exist_ok=True)
    spec = _Spec(seed, vocab_sizes or DEFAULT_VOCAB_SIZES, zipf_a)

    train_rng = np.random.default_rng([int(seed), 2])
    base, extra = divmod(rows, files)
    train = []
    for i in range(files):
        path = os.path.join(out_dir, f"train-{i:05d}.txt")
        _write(spec, train_rng, path, base + (1 if i < extra else 0))
        train.append(path)
    test = None
    if test_rows:
        test = os.path.join(out_dir, "test.txt")
        _write(spec, np.random.default_rng([int(seed), 3]), test, test_rows)
    return {"train": train, "test": test}


def oracle_sample(n, seed=0, vocab_sizes=None, zipf_a=1.1, stream=3):
    """Draw ``n`` rows in memory (no files) with their true logits.

    ``stream=3`` reproduces ``test.txt``'s rows.  Useful to measure the best
    achievable AUC.  Returns ``(label, logit)``.
    """
    spec = _Spec(seed, vocab_sizes or DEFAULT_VOCAB_SIZES, zipf_a)
    rng = np.random.default_rng([int(seed), stream])
    labels, logits = [], []
    done = 0
    while done < n:
        m = min(_CHUNK_ROWS, n - done)
        label, _, _, _, logit = spec.sample(rng, m)
        labels.append(label)
        logits.append(logit)
        done += m
    return np.concatenate(labels), np.concatenate(logits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--rows", type=int, required=True, help="training rows")
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--test-rows", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf-a", type=float, default=1.1)
    args = ap.parse_args(argv)
    t0 = time.time()
    out = generate(args.out, args.rows, files=args.files,
                   test_rows=args.test_rows, seed=args.seed,
                   zipf_a=args.zipf_a)
    out["seconds"] = round(time.time() - t0, 2)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
