"""Sparse (row-wise) optimizers applied on the PS, following TensorFlow's update formulas.

An optimizer works on rows gathered from a table's arena. A row is ``(1 + num_slots)``
vectors of ``dim`` float32: the value followed by the optimizer's slots
(``row_width = dim * (1 + num_slots)``). ``apply(values, slots, grads)`` receives

    values [n, dim]    slots [n, num_slots, dim]    grads [n, dim] (one row per key)

and updates values and slots **in place** (they may be views; ``EmbeddingTable`` passes
views of a plane-major copy so each ``slots[:, i, :]`` is contiguous) and returns them.
Arithmetic is float32 like TF's kernels; scalar hyperparameters are float32 constants.

=============  =====================================================  =====================
optimizer      update (TF formula)                                    slots
=============  =====================================================  =====================
sgd            w -= lr * g                                            -
adagrad        acc += g^2;  w -= lr * g / (sqrt(acc) + eps)           acc (init 0.1)
adam           t = the table's update count (TF's ``iterations``);   m, v, t
               m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
               a = lr sqrt(1-b2^t)/(1-b1^t);  w -= a * m / (sqrt(v) + eps)
ftrl           TF ApplyFtrl (accumulator n, linear z; see Ftrl)       n (init 0.1), z
assign_add     w += g   (the worker pushes deltas of its own optimizer) -
=============  =====================================================  =====================

Adam is lazy (sparse) Adam as TF's ``LazyAdam`` and TFRA's optimizers run it: only the
rows of a batch change, and the bias correction uses the **table's step** ``t``, the
number of updates the table applied (one per push), as TF's optimizers use their
``iterations``. Slot 2 keeps, per row, the step of its last update (replicated across the
``dim`` columns so every row stays a uniform ``(1 + num_slots) * dim`` vector): rows that
arrive from a checkpoint, a migration or a promoted replica carry their steps, and the
table's count catches up with the largest it meets. Before 2026-11-28 the correction
used each row's own update count: a rare row's steps were ~3x smaller than TF's, which
cost the example DeepFM 0.0025 of test AUC (0.7648 against 0.7673; single-process Keras
0.7678). The count is a float32, exact up to 2**24 (after that it stays there, which is
harmless: the bias correction is 1 long before).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from deeprec_ext.store.spec import split_spec

_F32 = np.float32


def _num(opt: str, field: str, value, *, positive=False, nonneg=False, lt1=False,
         nonpos=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"optimizer '{opt}': {field} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"optimizer '{opt}': {field} must be finite, got {value!r}")
    if positive and v <= 0:
        raise ValueError(f"optimizer '{opt}': {field} must be > 0, got {value!r}")
    if nonneg and v < 0:
        raise ValueError(f"optimizer '{opt}': {field} must be >= 0, got {value!r}")
    if lt1 and not 0 <= v < 1:
        raise ValueError(f"optimizer '{opt}': {field} must be in [0, 1), got {value!r}")
    if nonpos and v > 0:
        raise ValueError(f"optimizer '{opt}': {field} must be <= 0, got {value!r}")
    return v


class Optimizer:
    name = "base"
    num_slots = 0
    _defaults: dict = {}
    _rules: dict = {}

    def __init__(self, **hyper):
        unknown = sorted(set(hyper) - set(self._defaults))
        if unknown:
            raise ValueError(f"optimizer '{self.name}': unknown hyperparameter(s) {unknown} "
                             f"(allowed: {sorted(self._defaults)})")
        params = dict(self._defaults)
        for k, v in hyper.items():
            params[k] = _num(self.name, k, v, **self._rules.get(k, {}))
        for k, v in params.items():
            params[k] = float(v)
        self.params = params
        for k, v in params.items():
            setattr(self, "_" + k, _F32(v))

    @property
    def config(self) -> dict:
        return {"name": self.name, **self.params}

    def __eq__(self, other) -> bool:
        return isinstance(other, Optimizer) and other.config == self.config

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config.items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    def row_width(self, dim: int) -> int:
        return dim * (1 + self.num_slots)

    def begin_update(self, token: int) -> None:
        """An update of the table starts (its rows then come to ``apply`` in chunks);
        calls with the same ``token`` one after another (the parts of one push call,
        resent to this PS as several requests after a routing change) are one update."""

    def slot_initial_values(self) -> tuple[float, ...]:
        """Initial value of each slot vector (every column)."""
        return ()

    def init_slots(self, n: int, dim: int) -> np.ndarray:
        """Fresh slots, float32 [n, num_slots, dim]."""
        out = np.empty((n, self.num_slots, dim), dtype=np.float32)
        for i, v in enumerate(self.slot_initial_values()):
            out[:, i, :] = v
        return out

    def apply(self, values: np.ndarray, slots: np.ndarray, grads: np.ndarray):
        """Update ``values`` [n, dim] and ``slots`` [n, num_slots, dim] in place with
        ``grads`` [n, dim] (float32, one row per distinct key); returns them."""
        raise NotImplementedError


class SGD(Optimizer):
    name = "sgd"
    _defaults = {"learning_rate": 0.01}
    _rules = {"learning_rate": {"positive": True}}

    def apply(self, values, slots, grads):
        values -= self._learning_rate * grads
        return values, slots


class AssignAdd(Optimizer):
    name = "assign_add"

    def apply(self, values, slots, grads):
        values += grads
        return values, slots


class Adagrad(Optimizer):
    name = "adagrad"
    num_slots = 1
    _defaults = {"learning_rate": 0.001, "initial_accumulator_value": 0.1, "epsilon": 1e-7}
    _rules = {"learning_rate": {"positive": True},
              "initial_accumulator_value": {"nonneg": True},
              "epsilon": {"positive": True}}

    def slot_initial_values(self):
        return (self.params["initial_accumulator_value"],)

    def apply(self, values, slots, grads):
        acc = slots[:, 0, :]
        tmp = np.multiply(grads, grads)
        acc += tmp
        den = np.sqrt(acc)
        den += self._epsilon
        np.multiply(grads, self._learning_rate, out=tmp)
        tmp /= den
        values -= tmp
        return values, slots


class Adam(Optimizer):
    name = "adam"
    num_slots = 3  # m, v, per-row step count t
    _defaults = {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}
    _rules = {"learning_rate": {"positive": True}, "beta_1": {"lt1": True},
              "beta_2": {"lt1": True}, "epsilon": {"positive": True}}

    MAX_STEP = 2 ** 24  # float32 counts exactly up to here

    def __init__(self, **hyper):
        super().__init__(**hyper)
        self.step = 0  # updates the table applied (TF's ``iterations``)
        self._token = None

    def slot_initial_values(self):
        return (0.0, 0.0, 0.0)

    def begin_update(self, token: int) -> None:
        if token != self._token:
            self._token = token
            self.step = min(self.step + 1, self.MAX_STEP)

    def apply(self, values, slots, grads):
        m, v, t = slots[:, 0, :], slots[:, 1, :], slots[:, 2, :]
        if t.size:
            last = int(t[:, 0].max())
            if self.step <= last < self.MAX_STEP:
                # rows last updated at a later step than this table counted (restored,
                # moved or promoted from a PS that applied more updates): catch up
                self.step = last + 1
        step = max(self.step, 1)
        t[...] = _F32(step)
        # alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), from the table's step
        alpha = _F32(self.params["learning_rate"] * math.sqrt(1.0 - self.params["beta_2"] ** step)
                     / (1.0 - self.params["beta_1"] ** step))
        tmp = np.subtract(grads, m)  # m += (g - m) * (1 - b1)
        tmp *= _F32(1.0) - self._beta_1
        m += tmp
        np.multiply(grads, grads, out=tmp)  # v += (g^2 - v) * (1 - b2)
        tmp -= v
        tmp *= _F32(1.0) - self._beta_2
        v += tmp
        den = np.sqrt(v)  # w -= alpha * m / (sqrt(v) + eps)
        den += self._epsilon
        np.multiply(m, alpha, out=tmp)
        tmp /= den
        values -= tmp
        return values, slots


class Ftrl(Optimizer):
    """TF ``ApplyFtrl``::

        n_new = n + g^2
        z    += g - (n_new^-p - n^-p) / lr * w          (p = learning_rate_power)
        quad  = n_new^-p / lr + 2 l2
        w     = (sign(z) l1 - z) / quad  if |z| > l1  else 0
        n     = n_new
    """

    name = "ftrl"
    num_slots = 2  # accumulator n, linear z
    _defaults = {"learning_rate": 0.001, "learning_rate_power": -0.5,
                 "initial_accumulator_value": 0.1, "l1_regularization_strength": 0.0,
                 "l2_regularization_strength": 0.0}
    _rules = {"learning_rate": {"positive": True}, "learning_rate_power": {"nonpos": True},
              "initial_accumulator_value": {"nonneg": True},
              "l1_regularization_strength": {"nonneg": True},
              "l2_regularization_strength": {"nonneg": True}}

    def slot_initial_values(self):
        return (self.params["initial_accumulator_value"], 0.0)

    def _pow(self, x):
        p = self.params["learning_rate_power"]
        if p == -0.5:
            return np.sqrt(x)
        return np.power(x, _F32(-p))

    def apply(self, values, slots, grads):
        n, z = slots[:, 0, :], slots[:, 1, :]
        lr = self._learning_rate
        l1 = self._l1_regularization_strength
        n_new = np.multiply(grads, grads)
        n_new += n
        p_new = self._pow(n_new)
        sigma = np.subtract(p_new, self._pow(n))  # sigma = (n_new^-p - n^-p) / lr
        sigma /= lr
        sigma *= values
        z += grads
        z -= sigma
        quad = np.divide(p_new, lr, out=p_new)  # quad = n_new^-p / lr + 2 l2
        quad += _F32(2.0) * self._l2_regularization_strength
        w = np.sign(z, out=sigma)  # w = (sign(z) l1 - z) / quad, 0 where |z| <= l1
        w *= l1
        w -= z
        w /= quad
        w[np.abs(z) <= l1] = _F32(0.0)
        values[...] = w
        n[...] = n_new
        return values, slots


_REGISTRY = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam, "ftrl": Ftrl,
             "assign_add": AssignAdd}


def make_optimizer(spec) -> Optimizer:
    """Build from ``"adam"`` or ``{"name": "adam", "learning_rate": 1e-3, ...}``.

    Raises ValueError for unknown names, unknown hyperparameters and bad values
    (e.g. non-positive learning rate). An :class:`Optimizer` instance is returned as is.
    """
    if isinstance(spec, Optimizer):
        return spec
    name, hyper = split_spec(spec, "optimizer")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer '{name}' (expected one of {sorted(_REGISTRY)})")
    return cls(**hyper)
