"""JobView: the narrow, read-only face of a running job that plugins, the gRPC servicer's
helpers and tools get instead of the JobMaster itself.

It reads (phase, routing, members, shard counts, targets) and asks for changes only through
the master's public operations (``scale``, ``rebalance``, ``checkpoint``, ``record_event``,
``complete_shards``), which run through the operation runner and persist the job state. No
caller reaches a private field: what a feature needs is added here, on purpose.
"""
from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from aimaster.config import JobConfig
    from aimaster.registry import Member
    from aimaster.shards import Shard
    from deeprec_ext.client.routing import RoutingTable


class JobPhase(str, Enum):
    """STARTING (waiting for every PS) -> RUNNING -> SUCCEEDED | FAILED | STOPPED."""
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


FINAL_PHASES = (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


class JobView:
    def __init__(self, master):
        self._m = master

    # -- what the job is -------------------------------------------------------------------
    @property
    def config(self) -> "JobConfig":
        return self._m.config

    @property
    def clock(self) -> Callable[[], float]:
        return self._m.clock

    @property
    def started_at(self) -> float:
        return self._m.started_at

    @property
    def address(self) -> str:
        return self._m.address

    @property
    def phase(self):
        return self._m.phase

    @property
    def epoch(self) -> int:
        return self._m.epoch

    @property
    def routing(self) -> "RoutingTable | None":
        return self._m.routing  # immutable: a new table replaces it on every change

    def global_step(self) -> int:
        return self._m.global_step()

    # -- members -------------------------------------------------------------------------
    # Member and Shard are frozen dataclasses: handing them out shares nothing mutable
    def members(self, role: str | None = None) -> list["Member"]:
        return self._m.registry.members(role)

    def member(self, member_id: str) -> "Member | None":
        return self._m.registry.get(member_id)

    def live_ps(self) -> list["Member"]:
        return self._m.live_ps()

    def live_workers(self) -> list["Member"]:
        """Running workers that are not leaving."""
        return self._m.live_workers()

    def leaving(self) -> frozenset[str]:
        """Workers asked to leave (a scale-in) that have not left yet."""
        return self._m.leaving()

    @property
    def ps_target(self) -> int:
        return self._m.ps_target

    @property
    def worker_target(self) -> int:
        return self._m.worker_target

    # -- data ----------------------------------------------------------------------------
    @property
    def has_data(self) -> bool:
        return self._m.shards is not None

    def shard_counts(self) -> dict:
        s = self._m.shards
        return s.counts() if s is not None else {"todo": 0, "doing": 0, "done": 0}

    def all_shards(self) -> list["Shard"]:
        s = self._m.shards
        return s.all_shards() if s is not None else []

    # -- asking for changes ---------------------------------------------------------------
    def record_event(self, kind: str, **fields) -> None:
        self._m.record_event(kind, **fields)

    def complete_shards(self, shard_ids: list[int]) -> None:
        """Mark shards DONE (consistent mode decides by step) and persist it."""
        self._m.complete_shards(shard_ids)

    def scale(self, ps: int | None = None, workers: int | None = None,
              timeout: float = 600.0) -> dict:
        return self._m.scale(ps, workers, timeout)

    def rebalance(self, tolerance: float = 0.05, timeout: float = 600.0) -> dict:
        return self._m.rebalance(tolerance, timeout)

    def checkpoint(self, full: bool = False) -> dict:
        return self._m.checkpoint(full=full)

    def ps_stats(self, address: str, timeout: float = 2.0):
        """A PS's StatsResponse, through the job's PS fleet (its channel and retries)."""
        return self._m.fleet.stats(address, timeout)

    def ps_tables(self, address: str, timeout: float = 2.0):
        """A PS's table configs (``ListTables``: their admission / eviction specs)."""
        from deeprec_ext.proto import ps_pb2
        return list(self._m.fleet.stub(address).ListTables(ps_pb2.ListTablesRequest(),
                                                           timeout=timeout).tables)

    # -- stragglers ---------------------------------------------------------------------
    def straggler_rebalance(self, capacity: dict[str, float], detail: dict,
                            timeout: float = 600.0) -> dict:
        return self._m.straggler_rebalance(capacity, detail, timeout=timeout)

    def replace_ps(self, ps_id: str, detail: dict, timeout: float = 600.0) -> dict:
        return self._m.replace_ps(ps_id, detail, timeout)

    def replace_worker(self, worker_id: str, detail: dict, timeout: float = 600.0) -> dict:
        return self._m.replace_worker(worker_id, detail, timeout)

    def prestart_ps(self, slow: str) -> list[str]:
        return self._m.prestart_ps(slow)

    def retire_spare_ps(self, spare_ids: list[str], detail: dict) -> dict:
        return self._m.retire_spare_ps(spare_ids, detail)

    def slot_stats(self):
        """(bytes, lookups) per slot of the current routing, or None."""
        routing = self._m.routing
        return None if routing is None else self._m.fleet.slot_stats(routing)

    def ps_probe_ms(self, address: str, timeout: float = 2.0) -> float:
        """Milliseconds a PS takes to answer a trivial request (ListTables): its queueing
        and scheduling delay as a client sees it, which its own timers do not show."""
        import time

        from deeprec_ext.proto import ps_pb2
        t = time.perf_counter()
        self._m.fleet.stub(address).ListTables(ps_pb2.ListTablesRequest(), timeout=timeout)
        return (time.perf_counter() - t) * 1000.0

    def waiting_workers(self, within: float = 2.0) -> list[str]:
        return self._m.waiting_workers(within)

    def shards_doing(self) -> dict[int, str]:
        s = self._m.shards
        return s.doing() if s is not None else {}

    def request_split(self, worker_id: str, for_worker: str) -> bool:
        return self._m.request_split(worker_id, for_worker)

    def set_stragglers(self, marks: dict[str, dict]) -> None:
        """The members currently marked slow (id -> what was measured), for Gazer."""
        self._m.straggler_marks = dict(marks)

    def straggler_event(self, kind: str, **fields) -> None:
        """A job event that is also counted by kind (Gazer, Prometheus)."""
        self._m.count_straggler_event(kind)
        self._m.record_event(kind, **fields)

    def stragglers(self) -> dict[str, dict]:
        return dict(self._m.straggler_marks)

    def straggler_counts(self) -> dict[str, int]:
        return dict(self._m.straggler_counts)

    def migration_progress(self) -> dict:
        from aimaster.migration import progress
        return progress()

    def eval_state(self) -> dict | None:
        """Evaluation while training: {"latest", "rounds", "age_seconds"}; None without
        an eval section (aimaster/evaluation.py)."""
        evals = self._m.evals
        return evals.state() if evals is not None else None
