"""LocalProcessScaler: every role as a child process of the AIMaster (the default).

Children get PR_SET_PDEATHSIG (through the ``_child`` exec wrapper) so that even a
``kill -9`` of the AIMaster leaves no orphan PS or worker behind, and their own session so
a stop reaches the whole process group. The kernel ties PDEATHSIG to the *thread* that
forked, so the master forks only from its main thread.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from aimaster.config import JobConfig
from aimaster.scaler.api import NodeInfo, NodeState, ScalePlan, ScaleResult, Scaler, ScalerError
from deeprec_ext import auth
from deeprec_ext.member import MASTER_ENV, MEMBER_ID_ENV

log = logging.getLogger(__name__)

TF_THREAD_VARS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")


def tf_thread_env(env: dict, processes: int, cores: int | None = None) -> dict:
    """TensorFlow thread counts for a worker sharing this host with ``processes`` job
    processes (PS and workers): its share of the cores, at least 1. TF sizes its pools to
    every core by default, and on a shared host its idle pool threads spin on cores the
    PS needs (measured, 1 PS + 1 worker on 2 cores: about 3 ms of worker CPU per step
    less at 1 thread each, the same throughput). Nothing when the job's env or the
    environment sets either variable, or when the worker has the host to itself."""
    if any(k in env for k in TF_THREAD_VARS):
        return {}
    cores = cores or len(os.sched_getaffinity(0))
    if processes <= 1 or cores <= 0:
        return {}
    share = str(max(1, cores // processes))
    return {k: share for k in TF_THREAD_VARS}


@dataclass
class _Node:
    role: str
    id: str
    proc: subprocess.Popen
    restarts: int = 0
    stopping: bool = False
    reported: bool = False
    log_file: object = field(default=None, repr=False)

    def info(self) -> NodeInfo:
        code = self.proc.poll()
        if code is None:
            state = NodeState.RUNNING
        elif self.stopping:
            state = NodeState.STOPPED
        else:
            state = NodeState.SUCCEEDED if code == 0 else NodeState.FAILED
        return NodeInfo(self.role, self.id, self.proc.pid, state, code, self.restarts)


class LocalProcessScaler(Scaler):
    retires_chosen = True  # retire(node) stops exactly that node (a straggler's replacement)

    def __init__(self, master_address: str, config: JobConfig, log_dir: str,
                 python: str = sys.executable):
        self.master_address = master_address
        self.config = config
        self.log_dir = log_dir
        self.python = python
        os.makedirs(log_dir, exist_ok=True)
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        # called (from a waiter thread) as soon as a child exits: the AIMaster wakes its
        # loop instead of noticing the exit at its next tick (up to 0.2 s later, the
        # largest part of the detection time of a dead PS)
        self.on_exit: Callable[[], None] | None = None
        # node id -> time.monotonic() when the kernel reported its last exit: the start
        # of a recovery's timeline (CLOCK_MONOTONIC is one clock for every process here)
        self.exit_reported: dict[str, float] = {}
        self._eval_env = ""
        self._host_processes = 0  # PS + workers the last plan runs on this host

    def _command(self, role: str, node_id: str) -> list[str]:
        if role == "ps":
            return [self.python, "-m", "deeprec_ext.ps", "--master", self.master_address,
                    "--id", node_id, "--host", self.config.host]
        cmd = [c.replace("{python}", self.python) for c in self.config.worker.command]
        return cmd

    def _env(self, role: str, node_id: str) -> dict:
        env = dict(os.environ)
        cfg = self.config.ps if role == "ps" else self.config.worker
        if role == "ps" and self.config.autoscale.ps_memory_limit_mb:  # ps.env may override it
            env["DEEPREC_PS_MEMORY_LIMIT_MB"] = str(self.config.autoscale.ps_memory_limit_mb)
        env.update(dict(cfg.env))
        env[MASTER_ENV] = self.master_address
        env[MEMBER_ID_ENV] = node_id
        env["DEEPREC_STATE_DIR"] = os.path.abspath(self.config.state_dir)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["DEEPREC_PARENT_PID"] = str(os.getpid())
        if self.config.eval is not None:  # workers add their loss curve to TensorBoard
            env["DEEPREC_TENSORBOARD_DIR"] = os.path.join(env["DEEPREC_STATE_DIR"], "tensorboard")
        if role == "evaluator":  # the worker command, told to evaluate (deeprec_ext.evaluation)
            env["DEEPREC_ROLE"] = "evaluator"
            env["DEEPREC_EVAL"] = self._eval_env
        if role != "ps":  # every role here shares this host's cores
            env.update(tf_thread_env(env, self._host_processes + (role == "evaluator")))
        env.update(auth.child_env())  # the token FILE (never the token) and TLS dir
        return env

    def _spawn(self, role: str, node_id: str, restarts: int = 0) -> _Node:
        path = os.path.join(self.log_dir, f"{node_id}.log")
        log_file = open(path, "ab")
        try:
            cmd = [self.python, "-m", "aimaster.scaler._child", str(os.getpid()), "--",
                   *self._command(role, node_id)]
            proc = subprocess.Popen(cmd, env=self._env(role, node_id),
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            log_file.close()
            raise ScalerError(f"cannot start {node_id}: {exc}") from exc
        log.info("started %s (pid %d), log %s", node_id, proc.pid, path)
        threading.Thread(target=self._wait_exit, args=(proc.pid, node_id), name=f"exit-{node_id}",
                         daemon=True).start()
        return _Node(role, node_id, proc, restarts, log_file=log_file)

    def _wait_exit(self, pid: int, node_id: str = "") -> None:
        """Block until child ``pid`` exits, without reaping it (WNOWAIT: ``poll`` still
        collects its exit code), then tell ``on_exit``."""
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            self.exit_reported[node_id] = time.monotonic()
            # the time the kernel reported the exit: a recovery's detection is this
            # (the dead process's teardown) plus the AIMaster's own reaction
            log.info("%s (pid %d) exit reported", node_id, pid)
        except (ChildProcessError, OSError):
            pass  # already reaped (or not waitable here): poll_exits sees it
        cb = self.on_exit
        if cb is not None:
            cb()

    def _live(self, role: str) -> list[_Node]:
        """Running nodes of ``role`` that were not asked to stop, by index (lock held)."""
        return sorted((n for n in self._nodes.values()
                       if n.role == role and n.proc.poll() is None and not n.stopping),
                      key=lambda n: int(n.id.rsplit("-", 1)[1]))

    def start_evaluator(self, eval_env: str) -> NodeInfo:
        """Start ``evaluator-0``: the worker command with ``DEEPREC_ROLE=evaluator`` and
        ``DEEPREC_EVAL`` (the job's eval section as JSON)."""
        with self._lock:
            self._eval_env = eval_env
            node = self._spawn("evaluator", "evaluator-0")
            self._nodes[node.id] = node
            return node.info()

    def leavers(self, role: str, count: int) -> list[str]:
        """The live nodes past ``count`` by index: the ones ``apply`` sends SIGTERM."""
        with self._lock:
            return [n.id for n in self._live(role)[max(count, 0):]]

    def apply(self, plan: ScalePlan) -> ScaleResult:
        started, stopped = [], []
        with self._lock:
            self._host_processes = sum(len(self._live(r)) if want is None else want
                                       for r, want in (("ps", plan.ps), ("worker", plan.workers)))
            for role, want in (("ps", plan.ps), ("worker", plan.workers)):
                if want is None:
                    continue
                live = self._live(role)
                index = 0
                while len(live) < want:
                    node_id = f"{role}-{index}"
                    index += 1
                    old = self._nodes.get(node_id)
                    if old is not None and old.proc.poll() is None:
                        continue
                    node = self._spawn(role, node_id)
                    self._nodes[node_id] = node
                    live.append(node)
                    started.append(node_id)
                for node in live[want:]:
                    self._signal(node, signal.SIGTERM)
                    node.stopping = True
                    stopped.append(node.id)
        return ScaleResult(tuple(started), tuple(stopped))

    @staticmethod
    def _signal(node: _Node, sig: int) -> None:
        try:
            os.killpg(node.proc.pid, sig)
        except ProcessLookupError:
            pass

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return [n.info() for n in self._nodes.values()]

    def poll_exits(self) -> list[NodeInfo]:
        out = []
        with self._lock:
            for node in self._nodes.values():
                if not node.reported and node.proc.poll() is not None:
                    node.reported = True
                    node.log_file.close()
                    out.append(node.info())
        return out

    def restart(self, node_id: str) -> NodeInfo:
        with self._lock:
            old = self._nodes[node_id]
            if old.proc.poll() is None:
                raise ScalerError(f"{node_id} is still running (pid {old.proc.pid})")
            node = self._spawn(old.role, node_id, old.restarts + 1)
            self._nodes[node_id] = node
            return node.info()

    def retire(self, node_id: str) -> None:
        """SIGTERM to exactly that node; the others keep their indices."""
        self.kill(node_id, signal.SIGTERM)

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Deliver a signal to one node (a hung or departed member; tests kill -9 too)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None:
                node.stopping = True
                self._signal(node, sig)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            if node.proc.poll() is None:
                node.stopping = True
                self._signal(node, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                node.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing", node.id, timeout)
                self._signal(node, signal.SIGKILL)
                node.proc.wait()
            if node.log_file and not node.log_file.closed:
                node.log_file.close()
