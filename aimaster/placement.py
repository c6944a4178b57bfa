"""Placement: which PS owns which routing slot, balanced by bytes and by access rate.

Every table shares one slot map, so balancing slots balances all tables at once. A slot's
load has two dimensions: its share of the job's bytes (memory, with a little of the slot
count blended in for rows still to come) and of its lookups (CPU and network).

``balance`` keeps every slot where it is unless its PS is above the even share of some
dimension by more than ``tolerance`` or is leaving; the freed slots, heaviest first, go
to the PS whose most loaded dimension stays lowest. Few slots move, and the heavy ones
move first (they fix the most).
Loops run over slots being moved (at most ``num_slots``), never over keys.
"""
from __future__ import annotations

import numpy as np

from deeprec_ext.client.routing import remap_owners


def slot_loads(slot_bytes: np.ndarray, slot_lookups: np.ndarray,
               growth_prior: float = 0.1) -> np.ndarray:
    """float64 [num_slots, k]: each slot's share of memory and (when any were counted) of
    lookups. Memory blends in ``growth_prior`` of the slot count: rows not inserted yet
    arrive evenly over the slots, so a PS should not take all the empty ones."""
    n = slot_bytes.size
    count = np.full(n, 1.0 / n)
    total = float(np.sum(slot_bytes))
    memory = count if total <= 0 else \
        (1 - growth_prior) * np.asarray(slot_bytes, np.float64) / total + growth_prior * count
    cols = [memory]
    total = float(np.sum(slot_lookups))
    if total > 0:
        cols.append(np.asarray(slot_lookups, np.float64) / total)
    return np.stack(cols, axis=1)


def imbalance(owner: np.ndarray, values: np.ndarray, n: int) -> float:
    """max / mean of ``values`` summed per owner (1.0 = perfectly even)."""
    per = np.bincount(owner, weights=np.asarray(values, np.float64), minlength=n)
    mean = per.sum() / n
    return float(per.max() / mean) if mean > 0 else 1.0


def service_rates(service_ms: dict[str, float], ps_ids: list[str]) -> list[float]:
    """Each PS's service rate relative to the median of the *other* PS, from its measured
    data-plane service time (a PS taking twice the others' time: 0.5; unbounded above; a
    PS without a measurement, or with no measured peer: 1). Against a median that
    includes the PS itself, one slow PS of two could never measure below 0.5."""
    out = []
    for p in ps_ids:
        v = service_ms.get(p, 0.0)
        others = [x for q, x in service_ms.items() if q != p and q in ps_ids and x > 0]
        out.append(1.0 if v <= 0 or not others else float(np.median(others)) / v)
    return out


def capacity_weights(service_ms: dict[str, float], ps_ids: list[str],
                     min_weight: float = 0.1) -> list[float]:
    """Each PS's capacity weight for placement: its service rate relative to the median
    of the other PS (``service_rates``), at most 1 and at least ``min_weight``: a PS that
    serves at half the others' speed weighs 0.5."""
    return [float(min(1.0, max(min_weight, r))) for r in service_rates(service_ms, ps_ids)]


def balance(slot_owner: np.ndarray, old_ps: list[str], new_ps: list[str], loads: np.ndarray,
            tolerance: float = 0.05, capacity: list[float] | None = None) -> np.ndarray:
    """New slot -> index-into-``new_ps`` owners balancing ``loads`` ([num_slots, k] from
    ``slot_loads``, each column summing to 1; a 1-D array is one dimension).
    ``capacity`` (one weight per new PS, default all equal): each PS's share of every
    dimension is proportional to its weight (a slow PS takes less)."""
    n = len(new_ps)
    owner = remap_owners(slot_owner, old_ps, new_ps)
    loads = np.asarray(loads, np.float64)
    if loads.ndim == 1:
        loads = loads[:, None]
    blended = loads.sum(axis=1)
    w = np.ones(n) if capacity is None else np.asarray(capacity, np.float64)
    if w.shape != (n,) or not np.all(w > 0):
        raise ValueError(f"capacity: one positive weight per PS ({n}), got {capacity}")
    # [n, k] each PS's share of every dimension (the even share when weights are equal)
    target = np.maximum(loads.sum(axis=0)[None, :] * (w / w.sum())[:, None], 1e-300)
    per = np.zeros((n, loads.shape[1]))
    np.add.at(per, owner[owner >= 0], loads[owner >= 0])
    # 1. a PS above its share of a dimension gives up slots, heaviest in its worst
    #    dimension first, never going below the share: few moves, the big ones first
    for p in range(n):
        mine = list(np.flatnonzero(owner == p))
        rel = loads / target[p]
        if ((per[p] - target[p]) / target[p]).max() <= tolerance:
            continue  # close enough: moving rows costs more than it gains
        while mine:
            over = (per[p] - target[p]) / target[p]
            d = int(np.argmax(over))
            if over[d] <= 0:
                break
            # the heaviest slot in the worst dimension that does not overshoot it
            cand = np.asarray(mine)
            fits = cand[rel[cand, d] <= over[d]]
            if fits.size == 0:
                break
            s = int(fits[np.argmax(rel[fits, d])])
            owner[s] = -1
            per[p] -= loads[s]
            mine.remove(s)
    # 2. freed slots, heaviest first, each to the PS whose worst dimension stays lowest
    free = np.flatnonzero(owner < 0)
    scale = 1.0 / target
    for s in free[np.argsort(-blended[free], kind="stable")]:
        p = int(np.argmin(((per + loads[s]) * scale).max(axis=1)))
        owner[s] = p
        per[p] += loads[s]
    return owner.astype(np.int32)
