"""Deterministic, per-key initializers for embedding rows.

The initial value of column ``c`` of key ``k`` is a pure function ``f(seed, k, c)``:

    base  = hash64(k, seed ^ DOMAIN)               # DOMAIN keeps it apart from routing
    bits  = mix64(base + c * GOLDEN)               # splitmix64 stream of the key
    u     = uniform number from the top bits of ``bits``
    value = transform(u)                           # affine (uniform) / inverse normal CDF

so a key starts with bit-identical values in every process, batch composition and order,
and the value of a column does not depend on ``dim``.

Portability: the transforms use only IEEE-754 correctly rounded operations (+ - * / sqrt,
frexp, int<->float conversions of exactly representable values) -- no libm/SIMD
``log``/``cos``/``pow``, whose last bit differs between CPUs and numpy builds -- so the
values are reproducible across machines too.

* uniform: 24 random bits -> ``u`` in [0, 1) exactly in float32; ``minval + (maxval -
  minval) * u`` in float32.
* normal: inverse normal CDF of ``p = 0.5 + q``, ``q`` an exact float32 built from 25
  random bits (``|q| < 0.5``, symmetric). Acklam's rational approximation (relative error
  < 1.2e-9): the central 95% in float32, the tails in float64 with a series ``log``. The
  sample range is about +-5.45 stddev. Inverse CDF rather than Box-Muller: one uniform per
  value, no trigonometry, and it gives ``truncated_normal`` for free:
* truncated_normal: the same transform restricted to ``p in (Phi(-2), Phi(2))`` -- exactly
  TF's distribution (normal re-drawn outside 2 stddev) without any resampling.

Defaults follow the Keras initializers (``RandomNormal``/``TruncatedNormal`` stddev 0.05,
``RandomUniform`` [-0.05, 0.05]); ``seed`` defaults to 0 (a fixed seed: determinism across
processes needs one).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from deeprec_ext.hashing import hash64, mix64
from deeprec_ext.store.spec import split_spec

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_INIT_DOMAIN = 0x1A17_5EED_C0DE_F00D  # keeps initializer hashes apart from routing hashes
_CHUNK = 32768  # (key, column) elements per vectorized block: temporaries stay in cache

# Acklam's inverse normal CDF coefficients.
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155833025e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)
_P_LOW = 0.02425
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_PHI_M2 = 0.022750131948179195  # Phi(-2)
_F32_MAX = float(np.finfo(np.float32).max)


def _log(x: np.ndarray) -> np.ndarray:
    """Natural log for positive finite float64 from exact frexp + atanh series
    (|s| <= 0.172, 10 terms: ~1e-16 relative), bit-reproducible everywhere."""
    m, e = np.frexp(x)
    small = m < _SQRT_HALF
    m = np.where(small, m * 2.0, m)
    e = e - small
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = np.full_like(s, 1.0 / 19.0)
    for k in range(17, 0, -2):
        acc = acc * s2 + 1.0 / k
    return e * _LN2 + 2.0 * s * acc


_A32 = tuple(np.float32(a) for a in _A)
_B32 = tuple(np.float32(b) for b in _B)
_Q_TAIL32 = np.float32(0.5 - _P_LOW)
_Y_SCALE = 2.0 ** -25


def _ndtri_q(y: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Inverse standard normal CDF at ``p = 0.5 + q`` with ``q = scale * y * 2**-25``.

    ``y`` holds odd int32 in ``(-2**24, 2**24)`` (so ``q`` is exact, symmetric and never
    0.5). The central region (95% of values) runs Acklam's rational function in float32
    -- a few float32 ulps of error, well below the sampling resolution -- with in-place
    Horner steps; the tails (|q| > 0.5 - 0.02425) are evaluated in float64 on the
    compacted subset. Returns float32 of ``y``'s shape.
    """
    q = y.astype(np.float32)
    q *= np.float32(_Y_SCALE)
    if scale != 1.0:
        q *= np.float32(scale)
    r = q * q
    num = r * _A32[0]
    for a in _A32[1:]:
        num += a
        num *= r if a is not _A32[-1] else q
    den = r * _B32[0]
    for b in _B32[1:]:
        den += b
        den *= r
    den += np.float32(1.0)
    num /= den
    flat_q = q.reshape(-1)
    tail = np.flatnonzero(np.abs(flat_q) > _Q_TAIL32)
    if tail.size:
        q64 = y.reshape(-1).take(tail).astype(np.float64) * (_Y_SCALE * scale)
        pm = 0.5 - np.abs(q64)  # min(p, 1 - p), exact
        t = np.sqrt(-2.0 * _log(pm))
        tn = _C[0] * t + _C[1]
        for c in _C[2:]:
            tn = tn * t + c
        td = _D[0] * t + _D[1]
        for d in _D[2:]:
            td = td * t + d
        x = tn / (td * t + 1.0)  # lower-tail value (negative)
        num.reshape(-1)[tail] = np.where(q64 > 0, -x, x)
    return num


def _check_number(name: str, field: str, value, *, nonneg: bool = False,
                  positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"initializer '{name}': {field} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or abs(v) > _F32_MAX:
        raise ValueError(f"initializer '{name}': {field} must be finite and within float32 "
                         f"range, got {value!r}")
    if nonneg and v < 0:
        raise ValueError(f"initializer '{name}': {field} must be >= 0, got {value!r}")
    if positive and v <= 0:
        raise ValueError(f"initializer '{name}': {field} must be > 0, got {value!r}")
    return v


def _check_seed(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"initializer '{name}': seed must be an integer, got {value!r}")
    return int(value)


class Initializer:
    """``init(keys) -> float32 [n, dim]``; deterministic per (seed, key, column)."""

    name = "base"

    def __init__(self, dim: int, **params):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0:
            raise ValueError(f"initializer '{self.name}': dim must be a positive integer, "
                             f"got {dim!r}")
        self.dim = int(dim)
        self.params = params

    @property
    def config(self) -> dict:
        """Normalized spec (all defaults filled in); equal configs => equal values."""
        return {"name": self.name, **self.params}

    def __eq__(self, other) -> bool:
        return (isinstance(other, Initializer) and other.dim == self.dim
                and other.config == self.config)

    def __hash__(self) -> int:
        return hash((self.dim, tuple(sorted(self.config.items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}(dim={self.dim}{', ' if args else ''}{args})"

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        out = np.empty((keys.size, self.dim), dtype=np.float32)
        if keys.size:
            self._fill(keys, out)
        return out

    def _fill(self, keys: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError


class Constant(Initializer):
    name = "constant"

    def __init__(self, dim: int, value=0.0):
        super().__init__(dim, value=_check_number("constant", "value", value))

    def _fill(self, keys, out):
        out.fill(self.params["value"])


class Zeros(Constant):
    name = "zeros"

    def __init__(self, dim: int):
        Initializer.__init__(self, dim)

    def _fill(self, keys, out):
        out.fill(0.0)


class Ones(Zeros):
    name = "ones"

    def _fill(self, keys, out):
        out.fill(1.0)


class _Random(Initializer):
    """Shared bit generation: per key one hash, per column one splitmix64 step."""

    def __init__(self, dim, **params):
        super().__init__(dim, **params)
        seed = params["seed"] & 0xFFFF_FFFF_FFFF_FFFF
        self._hash_seed = seed ^ _INIT_DOMAIN
        with np.errstate(over="ignore"):
            self._col_offsets = np.arange(self.dim, dtype=np.uint64) * _GOLDEN

    def _fill(self, keys, out):
        base = hash64(keys, self._hash_seed)
        rows = max(1, _CHUNK // self.dim)
        with np.errstate(over="ignore"):
            for s in range(0, keys.size, rows):
                b = base[s:s + rows]
                bits = mix64(b[:, None] + self._col_offsets[None, :])
                out[s:s + rows] = self._transform(bits)

    def _transform(self, bits: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _odd_y(bits: np.ndarray) -> np.ndarray:
    """25 random bits -> odd int32 y in (-2**24, 2**24), symmetric around 0."""
    x = (bits >> np.uint64(39)).astype(np.int32)
    x |= 1
    x -= 1 << 24
    return x


class RandomUniform(_Random):
    name = "uniform"

    def __init__(self, dim, minval=-0.05, maxval=0.05, seed=0):
        lo = _check_number("uniform", "minval", minval)
        hi = _check_number("uniform", "maxval", maxval)
        if lo > hi:
            raise ValueError(f"initializer 'uniform': minval ({minval!r}) must be <= "
                             f"maxval ({maxval!r})")
        super().__init__(dim, minval=lo, maxval=hi, seed=_check_seed("uniform", seed))
        self._lo32 = np.float32(lo)
        self._hi32 = np.float32(hi)

    def _transform(self, bits):
        u = (bits >> np.uint64(40)).astype(np.float32)  # 24 bits, exact
        u *= np.float32(2.0 ** -24)  # [0, 1)
        u *= self._hi32 - self._lo32
        u += self._lo32
        return np.clip(u, self._lo32, self._hi32, out=u)


class RandomNormal(_Random):
    name = "normal"

    def __init__(self, dim, mean=0.0, stddev=0.05, seed=0):
        super().__init__(dim, mean=_check_number(self.name, "mean", mean),
                         stddev=_check_number(self.name, "stddev", stddev, nonneg=True),
                         seed=_check_seed(self.name, seed))
        self._std32 = np.float32(self.params["stddev"])
        self._mean32 = np.float32(self.params["mean"])

    def _transform(self, bits):
        z = _ndtri_q(_odd_y(bits))
        z *= self._std32
        z += self._mean32
        return z


class TruncatedNormal(RandomNormal):
    """Normal restricted to [mean - 2 stddev, mean + 2 stddev] by inverse-CDF sampling of
    the restricted range (same distribution as TF's re-drawing, no resampling)."""

    name = "truncated_normal"

    def _transform(self, bits):
        z = _ndtri_q(_odd_y(bits), scale=1.0 - 2.0 * _PHI_M2)
        np.clip(z, np.float32(-2.0), np.float32(2.0), out=z)
        z *= self._std32
        z += self._mean32
        return z


_REGISTRY = {
    "zeros": Zeros, "zero": Zeros,
    "ones": Ones, "one": Ones,
    "constant": Constant,
    "normal": RandomNormal, "random_normal": RandomNormal,
    "uniform": RandomUniform, "random_uniform": RandomUniform,
    "truncated_normal": TruncatedNormal,
}


def make_initializer(spec, dim: int) -> Initializer:
    """Build an initializer from ``"normal"`` or ``{"name": "normal", "stddev": .01, ...}``.

    Raises ValueError naming the problem for unknown names, unknown or bad parameters.
    An existing :class:`Initializer` is returned as is if its dim matches.
    """
    if isinstance(spec, Initializer):
        if spec.dim != dim:
            raise ValueError(f"initializer has dim={spec.dim}, expected dim={dim}")
        return spec
    name, params = split_spec(spec, "initializer")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown initializer '{name}' "
                         f"(expected one of {sorted(set(_REGISTRY))})")
    try:
        return cls(dim, **params)
    except TypeError:
        import inspect
        allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "dim")]
        bad = sorted(set(params) - set(allowed))
        raise ValueError(f"initializer '{cls.name}': unknown parameter(s) {bad} "
                         f"(allowed: {allowed})") from None
