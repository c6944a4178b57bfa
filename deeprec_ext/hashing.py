"""Stable 64-bit hashing shared by the client, the PS and the checkpoint format.

Everything that decides where a key lives (its routing slot) or what it starts as (its
initial value) must hash identically in every process and every release, so this module
is the single definition. All functions take numpy arrays and run as one vectorized pass.
"""
from __future__ import annotations

import hashlib

import numpy as np

# splitmix64 constants (Steele et al.); the finalizer is a bijection on uint64.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

DEFAULT_NUM_SLOTS = 4096


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def hash64(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """Hash int64 keys to uint64. ``seed`` selects an independent hash family."""
    x = np.asarray(keys, dtype=np.int64).view(np.uint64)
    if seed:
        x = x ^ mix64(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        return mix64(x)


def slot_of(keys: np.ndarray, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Routing slot of each key: ``hash64(key) % num_slots`` as int64."""
    n = int(num_slots)
    if n > 0 and n & (n - 1) == 0:  # the same slots; a 64-bit modulo is 3x the hash
        return (hash64(keys) & np.uint64(n - 1)).astype(np.int64)
    return (hash64(keys) % np.uint64(num_slots)).astype(np.int64)


def string_key(value: str | bytes) -> int:
    """Stable signed 64-bit id for a string feature value (hashed client-side)."""
    if isinstance(value, str):
        value = value.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "little", signed=True)
