"""The PS's deterministic initializers (:mod:`deeprec_ext.store.initializers`) as stock
TensorFlow ops, so an exported SavedModel gives an id it never saw the very vector the
live job gives it, with nothing but TensorFlow installed (no custom op, no py_function;
this project is imported at trace time only).

    initial_values(config, dim, keys) -> float32 [n, dim]

Kinds: zeros/zero, ones/one, constant, uniform/random_uniform, normal/random_normal,
truncated_normal -- every name :func:`make_initializer` accepts.

The computation is the numpy one, op for op:

* splitmix64 in ``tf.uint64``: TF 2.21's CPU kernels for uint64 AddV2, Mul, BitwiseXor,
  RightShift, Bitcast and Cast exist and wrap like numpy, so no int64 emulation is needed.
* the same float32 steps, in the same order, for the uniform transform and the central
  region of the inverse normal CDF; the same float64 steps for its tails, computed on the
  compacted tail elements only (~5%; computing them everywhere made it 3x slower), with
  ``frexp`` rebuilt from the float64 bits (TF has no frexp op).

Exactness (tests/test_tf_initializers.py): bit-identical to the PS for every kind, in
eager mode, in a ``tf.function`` and in a SavedModel loaded by stock TF alone: every step
is a correctly rounded IEEE operation in both, and Grappler does not reassociate them.

Not covered:

* XLA (``jit_compile=True``, auto-clustering) contracts ``a * b + c`` into FMAs, even
  through float64 round trips, so values differ: measured up to ~4e-9 for uniform
  [-0.05, 0.05] and up to ~4e-4 * stddev for normal, near |z| = 1.97 where Acklam's
  float32 central formula is ill-conditioned (the PS's own float32 values are that far
  from the exact formula there; matching them needs the same float32 rounding steps).
  Do not XLA-compile a function that calls this.
* TF's CPU kernels flush subnormal float32 to zero, numpy does not: values whose
  magnitude would be below 2**-126 (~1.2e-38) differ, which takes a stddev or a
  ``maxval - minval`` below ~2e-31.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from deeprec_ext.hashing import mix64 as _np_mix64
from deeprec_ext.store import initializers as _np_init

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _u64(value: int) -> tf.Tensor:
    return tf.constant(np.uint64(value & _MASK64), tf.uint64)


def _mix64(x: tf.Tensor) -> tf.Tensor:
    """splitmix64 finalizer on uint64 (wrapping), as ``deeprec_ext.hashing.mix64``."""
    z = x + _u64(_GOLDEN)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(30))) * _u64(_M1)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(27))) * _u64(_M2)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(31)))


def _column_bits(keys: tf.Tensor, seed: int, dim: int) -> tf.Tensor:
    """uint64 [n, dim]: one splitmix64 step per (key, column), as ``_Random._fill``."""
    hash_seed = (seed & _MASK64) ^ _np_init._INIT_DOMAIN
    x = tf.bitcast(keys, tf.uint64)
    if hash_seed:  # hash64 skips the xor for seed 0
        salt = int(_np_mix64(np.array([hash_seed], dtype=np.uint64))[0])
        x = tf.bitwise.bitwise_xor(x, _u64(salt))
    base = _mix64(x)
    with np.errstate(over="ignore"):
        offsets = np.arange(dim, dtype=np.uint64) * np.uint64(_GOLDEN)
    return _mix64(base[:, None] + tf.constant(offsets, tf.uint64)[None, :])


def _odd_y(bits: tf.Tensor) -> tf.Tensor:
    """25 random bits -> odd int32 in (-2**24, 2**24), as ``initializers._odd_y``."""
    x = tf.cast(tf.bitwise.right_shift(bits, _u64(39)), tf.int32)
    return tf.bitwise.bitwise_or(x, 1) - (1 << 24)


def _log(x: tf.Tensor) -> tf.Tensor:
    """float64 natural log of positive normal numbers, as ``initializers._log``."""
    bits = tf.bitcast(x, tf.int64)
    e = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, tf.constant(52, tf.int64)),
                               tf.constant(0x7FF, tf.int64)) - 1022
    m = tf.bitcast(tf.bitwise.bitwise_or(                       # frexp: x = m * 2**e
        tf.bitwise.bitwise_and(bits, tf.constant(~(0x7FF << 52), tf.int64)),
        tf.constant(1022 << 52, tf.int64)), tf.float64)
    small = m < _np_init._SQRT_HALF
    m = tf.where(small, m * 2.0, m)
    e = e - tf.cast(small, tf.int64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = tf.fill(tf.shape(s), tf.constant(1.0 / 19.0, tf.float64))
    for k in range(17, 0, -2):
        acc = acc * s2 + 1.0 / k
    return tf.cast(e, tf.float64) * _np_init._LN2 + 2.0 * s * acc


def _tail(y: tf.Tensor, scale: float) -> tf.Tensor:
    """float32 Acklam tail value of int32 ``y`` (float64 math), as in ``_ndtri_q``."""
    q64 = tf.cast(y, tf.float64) * (_np_init._Y_SCALE * scale)
    pm = 0.5 - tf.abs(q64)  # min(p, 1 - p), exact
    t = tf.sqrt(-2.0 * _log(pm))
    c, d = _np_init._C, _np_init._D
    tn = c[0] * t + c[1]
    for ci in c[2:]:
        tn = tn * t + ci
    td = d[0] * t + d[1]
    for di in d[2:]:
        td = td * t + di
    x = tn / (td * t + 1.0)  # lower-tail value (negative)
    return tf.cast(tf.where(q64 > 0, -x, x), tf.float32)


def _ndtri_q(y: tf.Tensor, scale: float = 1.0) -> tf.Tensor:
    """Inverse normal CDF at ``0.5 + scale * y * 2**-25``, as ``initializers._ndtri_q``."""
    a32, b32 = _np_init._A32, _np_init._B32
    q = tf.cast(y, tf.float32) * np.float32(_np_init._Y_SCALE)  # exact (power of two)
    if scale != 1.0:
        q = q * np.float32(scale)
    r = q * q
    num = r * a32[0]
    for a in a32[1:-1]:
        num = (num + a) * r
    num = (num + a32[-1]) * q
    den = r * b32[0]
    for b in b32[1:]:
        den = (den + b) * r
    central = num / (den + np.float32(1.0))
    # the tails (~5% of values) in float64 on the compacted subset, scattered back
    shape = tf.shape(y)
    flat = tf.reshape(central, [-1])
    idx = tf.where(tf.abs(tf.reshape(q, [-1])) > _np_init._Q_TAIL32)
    tail = _tail(tf.gather_nd(tf.reshape(y, [-1]), idx), scale)
    return tf.reshape(tf.tensor_scatter_nd_update(flat, idx, tail), shape)


def initial_values(config, dim: int, keys: tf.Tensor) -> tf.Tensor:
    """float32 [n, dim]: the initial rows of int64 ``keys`` [n] (any shape is flattened)
    for the initializer ``config`` -- ``make_initializer(spec, dim).config``, or any spec
    :func:`make_initializer` takes -- bit-identical to the PS's. Stock ops only; traceable
    in a ``tf.function`` with an unknown batch size and in a Keras layer's ``call``."""
    init = _np_init.make_initializer(config, dim)  # validates and fills in defaults
    name, p = init.name, init.params
    keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
    if name in ("zeros", "ones", "constant"):
        value = {"zeros": 0.0, "ones": 1.0}.get(name, p.get("value", 0.0))
        return tf.fill(tf.stack([tf.shape(keys)[0], dim]), tf.constant(np.float32(value)))
    bits = _column_bits(keys, p["seed"], dim)
    if name == "uniform":
        lo, hi = np.float32(p["minval"]), np.float32(p["maxval"])
        u = tf.cast(tf.bitwise.right_shift(bits, _u64(40)), tf.float32)  # 24 bits, exact
        u = u * np.float32(2.0 ** -24)  # [0, 1), exact
        with np.errstate(over="ignore"):
            width = hi - lo  # float32 subtraction, as the PS
        return tf.clip_by_value(u * width + lo, lo, hi)
    std, mean = np.float32(p["stddev"]), np.float32(p["mean"])
    if name == "normal":
        return _ndtri_q(_odd_y(bits)) * std + mean
    if name == "truncated_normal":
        z = _ndtri_q(_odd_y(bits), scale=1.0 - 2.0 * _np_init._PHI_M2)
        return tf.clip_by_value(z, np.float32(-2.0), np.float32(2.0)) * std + mean
    raise ValueError(f"initializer '{name}' has no TensorFlow form")
