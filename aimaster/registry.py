"""Membership with leases. A member that stops heartbeating for ``lease_seconds``, or whose
process the scaler saw exit, is dead."""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable


class MemberState(str, Enum):
    """registered -> RUNNING -> (LEFT | DEAD | SUCCEEDED)."""
    RUNNING = "running"
    LEFT = "left"          # deregistered itself
    DEAD = "dead"          # lease expired or process died
    SUCCEEDED = "succeeded"  # worker process exited 0


@dataclass(frozen=True)
class Member:
    role: str
    id: str
    pid: int
    address: str
    state: MemberState
    last_heartbeat: float
    rank: int = -1
    steps: int = 0
    samples: int = 0
    base_steps: int = 0    # counts of earlier processes under this id (restarts)
    base_samples: int = 0
    # one per process: a new process under a reused id (and, in a container, the same
    # pid 1) is a new incarnation; keys of per-process state (checkpoint cuts) use it
    incarnation: str = ""


class Registry:
    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}

    def register(self, role: str, member_id: str, pid: int, address: str,
                 incarnation: str = "") -> Member:
        """Register (or re-register) a member. ``incarnation`` is the process's own random
        id; without one (an old client), a fresh one is drawn unless the same pid
        re-registers."""
        with self._lock:
            if not member_id:
                n = sum(1 for m in self._members.values() if m.role == role)
                while f"{role}-{n}" in self._members:
                    n += 1
                member_id = f"{role}-{n}"
            old = self._members.get(member_id)
            if old is not None and old.role != role:
                raise ValueError(f"member id {member_id!r} is already used by a {old.role}")
            rank = int(member_id.rsplit("-", 1)[1]) if member_id.rsplit("-", 1)[-1].isdigit() else -1
            steps = old.steps if old else 0
            samples = old.samples if old else 0
            same = old is not None and (old.incarnation == incarnation if incarnation
                                        else old.pid == pid)
            if same:  # the same process registering again
                base_steps, base_samples = old.base_steps, old.base_samples
                incarnation = old.incarnation
            else:
                base_steps, base_samples = steps, samples
                incarnation = incarnation or uuid.uuid4().hex
            m = Member(role, member_id, pid, address, MemberState.RUNNING, self.clock(), rank,
                       steps, samples, base_steps, base_samples, incarnation)
            self._members[member_id] = m
            return m

    def heartbeat(self, member_id: str, steps: int = 0, samples: int = 0) -> Member | None:
        with self._lock:
            m = self._members.get(member_id)
            if m is None or m.state != MemberState.RUNNING:
                return None
            m = replace(m, last_heartbeat=self.clock(), steps=max(m.steps, m.base_steps + steps),
                        samples=max(m.samples, m.base_samples + samples))
            self._members[member_id] = m
            return m

    def mark(self, member_id: str, state: MemberState) -> Member | None:
        """Move a RUNNING member to a final state; returns it if it changed."""
        with self._lock:
            m = self._members.get(member_id)
            if m is None or m.state != MemberState.RUNNING:
                return None
            m = replace(m, state=state)
            self._members[member_id] = m
            return m

    def expire(self) -> list[Member]:
        """Mark members whose lease ran out as DEAD; returns them."""
        now = self.clock()
        dead = []
        with self._lock:
            for mid, m in list(self._members.items()):
                if m.state == MemberState.RUNNING and now - m.last_heartbeat > self.lease_seconds:
                    m = replace(m, state=MemberState.DEAD)
                    self._members[mid] = m
                    dead.append(m)
        return dead

    def get(self, member_id: str) -> Member | None:
        with self._lock:
            return self._members.get(member_id)

    def members(self, role: str | None = None) -> list[Member]:
        with self._lock:
            return sorted((m for m in self._members.values() if role is None or m.role == role),
                          key=lambda m: (m.role, m.rank, m.id))
