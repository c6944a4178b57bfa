"""The client's cached copy of the AIMaster's routing table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deeprec_ext.hashing import slot_of
from deeprec_ext.proto import master_pb2


@dataclass(frozen=True)
class RoutingTable:
    """slot -> PS index, plus the PS addresses, at one epoch."""
    epoch: int
    num_slots: int
    ps_ids: tuple[str, ...]
    ps_addresses: tuple[str, ...]
    slot_owner: np.ndarray  # int32 [num_slots]

    @classmethod
    def from_proto(cls, msg: master_pb2.RoutingResponse) -> "RoutingTable":
        owner = np.frombuffer(msg.slot_owner, dtype="<i4").copy()
        if owner.size != msg.num_slots:
            raise ValueError(f"routing: {owner.size} slot owners for {msg.num_slots} slots")
        if owner.size and (owner.min() < 0 or owner.max() >= len(msg.ps_addresses)):
            raise ValueError("routing: slot owner out of range of the PS list")
        return cls(msg.epoch, msg.num_slots, tuple(msg.ps_ids), tuple(msg.ps_addresses), owner)

    def to_proto(self) -> master_pb2.RoutingResponse:
        return master_pb2.RoutingResponse(
            epoch=self.epoch, num_slots=self.num_slots, ps_ids=list(self.ps_ids),
            ps_addresses=list(self.ps_addresses),
            slot_owner=self.slot_owner.astype("<i4").tobytes())

    def owners(self, keys: np.ndarray) -> np.ndarray:
        """PS index of each key (vectorized)."""
        return self.slot_owner[slot_of(keys, self.num_slots)]

    def partition(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """[(ps_index, positions into keys)] for every PS that owns at least one key."""
        if len(self.ps_addresses) == 1:
            return [(0, np.arange(keys.size))] if keys.size else []
        owner = self.owners(keys)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(len(self.ps_addresses) + 1))
        return [(p, order[bounds[p]:bounds[p + 1]])
                for p in range(len(self.ps_addresses)) if bounds[p + 1] > bounds[p]]

    @staticmethod
    def even(ps_ids: list[str], ps_addresses: list[str], num_slots: int, epoch: int) -> "RoutingTable":
        """Contiguous, equal slot ranges over the PS list."""
        n = len(ps_addresses)
        owner = (np.arange(num_slots, dtype=np.int64) * n // num_slots).astype(np.int32)
        return RoutingTable(epoch, num_slots, tuple(ps_ids), tuple(ps_addresses), owner)


def remap_owners(slot_owner: np.ndarray, old_ps: list[str], new_ps: list[str]) -> np.ndarray:
    """Owner indices into ``old_ps`` -> indices into ``new_ps`` (-1: the PS is leaving)."""
    if not new_ps:
        raise ValueError("the new PS set is empty")
    index_of = {ps: i for i, ps in enumerate(new_ps)}
    return np.array([index_of.get(ps, -1) for ps in old_ps], dtype=np.int64)[slot_owner]


def rebalance(slot_owner: np.ndarray, old_ps: list[str], new_ps: list[str]) -> np.ndarray:
    """New slot -> index-into-``new_ps`` owner array that moves as few slots as possible.

    Slots of PS that stay keep their owner unless that PS holds more than its even share;
    slots of leaving PS and the excess are handed to the PS below their share. Loops run
    over PS, never over slots.
    """
    num_slots = slot_owner.size
    n = len(new_ps)
    owner = remap_owners(slot_owner, old_ps, new_ps)
    counts = np.bincount(owner[owner >= 0], minlength=n)
    # even shares; the PS already holding the most get the +1 remainders (fewer moves)
    target = np.full(n, num_slots // n, dtype=np.int64)
    target[np.argsort(-counts, kind="stable")[: num_slots % n]] += 1
    for p in np.flatnonzero(counts > target):
        mine = np.flatnonzero(owner == p)
        owner[mine[target[p]:]] = -1
    free = np.flatnonzero(owner < 0)
    need = np.maximum(target - np.bincount(owner[owner >= 0], minlength=n), 0)
    owner[free] = np.repeat(np.arange(n), need)
    return owner.astype(np.int32)
