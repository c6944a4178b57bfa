"""Scaler interface: the part of the AIMaster that acts on processes or pods.

Observe / decide / act are kept apart: the scaler reports node exits (observe) and
starts/stops nodes (act); what to do about them is decided by the master.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from enum import Enum


class NodeState(str, Enum):
    """PENDING -> RUNNING -> (SUCCEEDED | FAILED); STOPPED when we asked it to go."""
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ScalePlan:
    """Desired replica counts. ``None`` leaves a role unchanged."""
    ps: int | None = None
    workers: int | None = None


@dataclass(frozen=True)
class NodeInfo:
    role: str
    id: str
    pid: int
    state: NodeState
    exit_code: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class ScaleResult:
    started: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()


class ScalerError(RuntimeError):
    """A node could not be started or stopped."""


class Scaler(abc.ABC):
    retires_chosen = False  # ``retire`` can let one chosen node go (a straggler's replacement)

    def retire_refusal(self, node_id: str) -> str | None:
        """Why ``retire(node_id)`` cannot be done here (None: it can): asked before a
        replacement starts anything."""
        return None if self.retires_chosen else "this backend cannot retire one chosen node"

    def retire(self, node_id: str) -> None:
        """Let ``node_id`` go (it owns nothing any more and was told to stop), keeping the
        others: a replaced straggler. Only where ``retires_chosen``."""
        raise ScalerError(f"this backend cannot retire one chosen node ({node_id})")

    @abc.abstractmethod
    def apply(self, plan: ScalePlan) -> ScaleResult:
        """Start or stop nodes until each role has the planned count."""

    @abc.abstractmethod
    def leavers(self, role: str, count: int) -> list[str]:
        """The node ids that ``apply`` removes when ``role`` ("ps" or "worker") is scaled
        down to ``count``, in the order the backend removes them; ``[]`` if ``count`` is not
        below the current count.

        The backend, not the caller, decides who leaves: the local scaler stops the live
        nodes past ``count`` by index, and on Kubernetes the training operator deletes
        every pod whose replica index is past the new ``replicas`` (which may include a
        node that is not live). A caller that scales in drains exactly these nodes (a PS's
        slots migrated away, a worker's shards handed back) before it calls ``apply``."""

    def start_replacement(self, role: str, slow_id: str, count: int) -> ScaleResult:
        """Raise ``role`` to ``count`` nodes to replace the slow ``slow_id`` (a straggler):
        the new node should not share the slow one's machine. Here: a plain scale-out
        (the local scaler has one machine); on Kubernetes the new pod is kept off the slow
        pod's node."""
        return self.apply(ScalePlan(ps=count) if role == "ps" else ScalePlan(workers=count))

    @abc.abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """Every node this scaler manages, live or exited."""

    @abc.abstractmethod
    def poll_exits(self) -> list[NodeInfo]:
        """Nodes that exited since the last call (each reported once)."""

    @abc.abstractmethod
    def restart(self, node_id: str) -> NodeInfo:
        """Start a fresh process for an exited node, under the same id."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every node: polite signal first, then force after ``timeout``."""


_REGISTRY: dict[str, callable] = {}


def register_scaler(name: str, creator) -> None:
    _REGISTRY[name] = creator


def create_scaler(name: str, **kwargs) -> Scaler:
    """Build a scaler by name; creators import heavy dependencies lazily."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown scaler {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)
